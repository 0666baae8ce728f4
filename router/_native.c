/* router._native: the router's per-request loops in C (optional accelerator, router/native.py).
 *
 * Each function has a pure-Python twin that gives the same answers bit for bit (tests/test_native_router.py):
 * a rank's booked blocks as a trie of prompts (router/booked_blocks.py), the dynamo policy's costs and
 * the choice of the lowest (router/policies/dynamo.py), the latency policy's costs and the prompt tokens
 * each rank holds (router/policies/latency.py).
 *
 * Guardrail: a function that meets input it was not written for returns None (or raises the same
 * exception class as the Python path), so the caller can fall back to Python for the exact error.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

/* ------------------------------------------------------------------ booked blocks (booked_blocks.py)
 *
 * `BookedBlocks`: one rank's booked prompt blocks, the C twin of router/booked_blocks.py. Requests
 * on a rank share blocks only as a common prefix of their sequence hashes (each hash names its whole
 * prefix), so the booked blocks are a trie of prompts, kept here with compressed edges: a `Run` is a
 * slice of one booked prompt's hashes with the number of active requests whose prompt covers all of
 * it, and its children are keyed by their first hash. Booking, release and the prefix reads walk one
 * run per divergence and compare slices, instead of one dict operation per block. Hashes are
 * compared as the dict of the Python twin compares its keys (`==`), and a run keeps its prompt's
 * tuple alive. */
typedef struct Run {
    PyObject_HEAD
    PyObject *hashes;   /* a tuple: the run is hashes[start:end] */
    Py_ssize_t start, end;
    Py_ssize_t count;   /* active requests whose prompt covers the whole run */
    PyObject *children; /* NULL or a dict: first hash -> Run */
} Run;

static void Run_dealloc(Run *self) {
    Py_XDECREF(self->hashes);
    Py_XDECREF(self->children);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject RunType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "router._native._Run",
    .tp_basicsize = sizeof(Run),
    .tp_dealloc = (destructor)Run_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
};

static Run *run_new(PyObject *hashes, Py_ssize_t start, Py_ssize_t end, Py_ssize_t count) {
    Run *run = PyObject_New(Run, &RunType);
    if (run == NULL)
        return NULL;
    run->hashes = Py_NewRef(hashes);
    run->start = start;
    run->end = end;
    run->count = count;
    run->children = NULL;
    return run;
}

typedef struct {
    PyObject_HEAD
    PyObject *roots; /* dict: first hash -> Run */
    Py_ssize_t blocks; /* distinct booked blocks */
} BookedObject;

/* Where a prompt's walk down the trie ends. */
typedef struct {
    Run **path;          /* the runs covered in full, root first */
    Py_ssize_t depth;    /* how many */
    Run *partial;        /* the run the prompt leaves (or ends) inside, NULL if none */
    PyObject *partial_in; /* the dict holding `partial` */
    Py_ssize_t inside;   /* how many of partial's hashes the prompt shares */
    Py_ssize_t held;     /* leading hashes of the prompt booked */
    PyObject *last_children; /* the dict the next run of the prompt would go in (may be NULL) */
    Run *last;           /* the last run covered in full (NULL: none, the roots) */
} Walk;

/* 0 with *walk filled, -1 with an exception. `path` has room for `n` runs (each covers a hash). */
static int walk_prompt(BookedObject *self, PyObject **items, Py_ssize_t n, Walk *walk, Run **path) {
    walk->path = path;
    walk->depth = 0;
    walk->partial = NULL;
    walk->partial_in = NULL;
    walk->inside = 0;
    walk->last = NULL;
    PyObject *children = self->roots;
    Py_ssize_t i = 0;
    while (i < n && children != NULL) {
        Run *run = (Run *)PyDict_GetItemWithError(children, items[i]);
        if (run == NULL) {
            if (PyErr_Occurred())
                return -1;
            break;
        }
        PyObject **mine = &PySequence_Fast_ITEMS(run->hashes)[run->start];
        Py_ssize_t length = run->end - run->start, shared = 1;
        while (shared < length && i + shared < n) {
            PyObject *a = mine[shared], *b = items[i + shared];
            if (a != b) {
                int equal = PyObject_RichCompareBool(a, b, Py_EQ);
                if (equal < 0)
                    return -1;
                if (!equal)
                    break;
            }
            shared++;
        }
        i += shared;
        if (shared < length) {
            walk->partial = run;
            walk->partial_in = children;
            walk->inside = shared;
            break;
        }
        path[walk->depth++] = run;
        walk->last = run;
        children = run->children;
    }
    walk->held = i;
    walk->last_children = children;
    return 0;
}

/* Room for the runs of an n-hash prompt's path: on the stack when it fits, else allocated (NULL with
 * MemoryError), freed by the caller when it is not `on_stack`. */
#define PATH_ON_STACK 64
static Run **path_for(Py_ssize_t n, Run **on_stack) {
    if (n <= PATH_ON_STACK)
        return on_stack;
    Run **path = PyMem_Malloc(sizeof(Run *) * (size_t)n);
    if (path == NULL)
        PyErr_NoMemory();
    return path;
}

/* A call's prompt: its hashes (a tuple when the caller keeps them, else any fast sequence: a list is
 * not copied) and room for its path; opened and closed by every method. */
typedef struct {
    PyObject *tuple; /* or the list itself, when opened without `as_tuple` */
    PyObject **items;
    Py_ssize_t n;
    Run **path;
    Run *on_stack[PATH_ON_STACK];
} Prompt;

/* 0, or -1 with an exception set (and nothing left to close). */
static int prompt_open(Prompt *prompt, PyObject *hashes, int as_tuple) {
    if (PyTuple_CheckExact(hashes))
        prompt->tuple = Py_NewRef(hashes);
    else
        prompt->tuple = as_tuple ? PySequence_Tuple(hashes) : PySequence_Fast(hashes, "hashes must be a sequence");
    if (prompt->tuple == NULL)
        return -1;
    prompt->n = PySequence_Fast_GET_SIZE(prompt->tuple);
    prompt->items = PySequence_Fast_ITEMS(prompt->tuple);
    prompt->path = path_for(prompt->n, prompt->on_stack);
    if (prompt->path == NULL) {
        Py_DECREF(prompt->tuple);
        return -1;
    }
    return 0;
}

static void prompt_close(Prompt *prompt) {
    if (prompt->path != prompt->on_stack)
        PyMem_Free(prompt->path);
    Py_DECREF(prompt->tuple);
}

/* Split `run` after its first `keep` hashes: the head takes its place in `holder`, the rest becomes
 * the head's only child. Returns the head (borrowed from `holder`). */
static Run *split_run(PyObject *holder, Run *run, Py_ssize_t keep) {
    PyObject *first = PyTuple_GET_ITEM(run->hashes, run->start);
    Run *head = run_new(run->hashes, run->start, run->start + keep, run->count);
    if (head == NULL)
        return NULL;
    head->children = PyDict_New();
    if (head->children == NULL) {
        Py_DECREF(head);
        return NULL;
    }
    Py_INCREF(run);
    Py_INCREF(first);
    run->start += keep;
    int status = PyDict_SetItem(head->children, PyTuple_GET_ITEM(run->hashes, run->start), (PyObject *)run);
    if (status == 0)
        status = PyDict_SetItem(holder, first, (PyObject *)head); /* replaces `run` there */
    Py_DECREF(first);
    Py_DECREF(run);
    Py_DECREF(head);
    return status < 0 ? NULL : head;
}

/* book(hashes) -> held: book a prompt; returns how many of its leading blocks were booked before. */
static PyObject *Booked_book(BookedObject *self, PyObject *hashes) {
    Prompt prompt;
    if (prompt_open(&prompt, hashes, 1) < 0)
        return NULL;
    PyObject *tuple = prompt.tuple, **items = prompt.items;
    Py_ssize_t n = prompt.n;
    Run **path = prompt.path;
    PyObject *result = NULL;
    Walk walk;
    if (walk_prompt(self, items, n, &walk, path) < 0)
        goto done;
    PyObject *holder = walk.last_children;
    if (walk.partial != NULL) {
        Run *head = split_run(walk.partial_in, walk.partial, walk.inside);
        if (head == NULL)
            goto done;
        head->count++;
        holder = head->children;
    }
    if (walk.held < n) {
        if (holder == NULL) { /* the last run covered in full had no children yet */
            holder = walk.last->children = PyDict_New();
            if (holder == NULL)
                goto done;
        }
        Run *leaf = run_new(tuple, walk.held, n, 1);
        if (leaf == NULL)
            goto done;
        int status = PyDict_SetItem(holder, items[walk.held], (PyObject *)leaf);
        Py_DECREF(leaf);
        if (status < 0)
            goto done;
    }
    for (Py_ssize_t d = 0; d < walk.depth; d++)
        path[d]->count++;
    self->blocks += n - walk.held;
    result = PyLong_FromSsize_t(walk.held);
done:
    prompt_close(&prompt);
    return result;
}

/* The runs of a booked prompt, in `walk`; KeyError when it is not booked in full. */
static int walk_booked(BookedObject *self, PyObject *tuple, Walk *walk, Run **path) {
    Py_ssize_t n = PyTuple_GET_SIZE(tuple);
    if (walk_prompt(self, PySequence_Fast_ITEMS(tuple), n, walk, path) < 0)
        return -1;
    if (walk->held < n || walk->partial != NULL) {
        PyErr_SetObject(PyExc_KeyError, PyTuple_GET_ITEM(tuple, walk->held < n ? walk->held : n - 1));
        return -1;
    }
    return 0;
}

/* The leading blocks of a booked prompt that other active requests hold too. */
static Py_ssize_t shared_of(const Walk *walk) {
    Py_ssize_t shared = 0;
    for (Py_ssize_t d = 0; d < walk->depth && walk->path[d]->count > 1; d++)
        shared += walk->path[d]->end - walk->path[d]->start;
    return shared;
}

/* shared(hashes) / release(hashes) -> shared: how many leading blocks of a booked prompt other
 * active requests hold; release also frees it. */
static PyObject *shared_or_release(BookedObject *self, PyObject *hashes, int release) {
    Prompt prompt;
    if (prompt_open(&prompt, hashes, 1) < 0)
        return NULL;
    PyObject *tuple = prompt.tuple;
    Py_ssize_t n = prompt.n;
    Run **path = prompt.path;
    PyObject *result = NULL;
    Walk walk;
    if (n == 0) {
        result = PyLong_FromLong(0);
        goto done;
    }
    if (walk_booked(self, tuple, &walk, path) < 0)
        goto done;
    Py_ssize_t shared = shared_of(&walk);
    if (release) {
        /* Counts never increase down a path: the runs left with none are its tail. */
        Py_ssize_t first_empty = walk.depth;
        for (Py_ssize_t d = 0; d < walk.depth; d++)
            if (--path[d]->count == 0 && first_empty == walk.depth)
                first_empty = d;
        if (first_empty < walk.depth) {
            Run *gone = path[first_empty];
            PyObject *holder = first_empty == 0 ? self->roots : path[first_empty - 1]->children;
            if (PyDict_DelItem(holder, PyTuple_GET_ITEM(gone->hashes, gone->start)) < 0)
                goto done;
        }
        self->blocks -= n - shared;
    }
    result = PyLong_FromSsize_t(shared);
done:
    prompt_close(&prompt);
    return result;
}

static PyObject *Booked_shared(BookedObject *self, PyObject *hashes) { return shared_or_release(self, hashes, 0); }

static PyObject *Booked_release(BookedObject *self, PyObject *hashes) { return shared_or_release(self, hashes, 1); }

/* held(hashes) -> int: how many leading hashes of a prompt are booked. */
static PyObject *Booked_held(BookedObject *self, PyObject *hashes) {
    Prompt prompt;
    if (prompt_open(&prompt, hashes, 0) < 0)
        return NULL;
    Walk walk;
    PyObject *result = NULL;
    if (walk_prompt(self, prompt.items, prompt.n, &walk, prompt.path) == 0)
        result = PyLong_FromSsize_t(walk.held);
    prompt_close(&prompt);
    return result;
}

static int add_refcounts(PyObject *children, PyObject *out) {
    if (children == NULL)
        return 0;
    PyObject *key, *value;
    Py_ssize_t position = 0;
    while (PyDict_Next(children, &position, &key, &value)) {
        Run *run = (Run *)value;
        PyObject *count = PyLong_FromSsize_t(run->count);
        if (count == NULL)
            return -1;
        for (Py_ssize_t i = run->start; i < run->end; i++) {
            if (PyDict_SetItem(out, PyTuple_GET_ITEM(run->hashes, i), count) < 0) {
                Py_DECREF(count);
                return -1;
            }
        }
        Py_DECREF(count);
        if (add_refcounts(run->children, out) < 0)
            return -1;
    }
    return 0;
}

/* refcounts() -> dict: sequence hash -> how many active requests hold it (for checks). */
static PyObject *Booked_refcounts(BookedObject *self, PyObject *unused) {
    PyObject *out = PyDict_New();
    if (out != NULL && add_refcounts(self->roots, out) < 0)
        Py_CLEAR(out);
    return out;
}

static Py_ssize_t Booked_len(BookedObject *self) { return self->blocks; }

static PyObject *Booked_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "BookedBlocks() takes no arguments");
        return NULL;
    }
    BookedObject *self = (BookedObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->roots = PyDict_New();
    if (self->roots == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    self->blocks = 0;
    return (PyObject *)self;
}

static void Booked_dealloc(BookedObject *self) {
    Py_XDECREF(self->roots);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Booked_methods[] = {
    {"book", (PyCFunction)Booked_book, METH_O, "book(hashes) -> int: book a prompt; how many leading blocks were booked before."},
    {"release", (PyCFunction)Booked_release, METH_O,
     "release(hashes) -> int: free a booked prompt; how many leading blocks other requests still hold."},
    {"shared", (PyCFunction)Booked_shared, METH_O,
     "shared(hashes) -> int: how many leading blocks of a booked prompt other requests hold too."},
    {"held", (PyCFunction)Booked_held, METH_O, "held(hashes) -> int: how many leading hashes of a prompt are booked."},
    {"refcounts", (PyCFunction)Booked_refcounts, METH_NOARGS,
     "refcounts() -> dict[int, int]: each booked hash and how many active requests hold it."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods Booked_as_sequence = {.sq_length = (lenfunc)Booked_len};

static PyTypeObject BookedType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "router._native.BookedBlocks",
    .tp_doc = "One rank's booked prompt blocks: a trie of prompts with compressed edges (router/booked_blocks.py).",
    .tp_basicsize = sizeof(BookedObject),
    .tp_dealloc = (destructor)Booked_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Booked_new,
    .tp_methods = Booked_methods,
    .tp_as_sequence = &Booked_as_sequence,
};

/* ------------------------------------------------------------------ the dynamo policy's costs (policies/dynamo.py)
 *
 * `python_costs` in C: the same float operations in the same order, so every cost is bit-identical.
 * Integers are read as int64 and must stay within +-2^50 (every sum of a few of them then converts to
 * a double exactly, as Python's int arithmetic followed by true division or float() does); config
 * weights and taint multipliers must be exact floats. Anything else returns None: the Python code
 * runs instead. */
static PyObject *str_key, *str_prefill_tokens, *str_decode_blocks, *str_requests;
static PyObject *str_cached_tokens, *str_device_blocks, *str_host_blocks, *str_disk_blocks;
static PyObject *str_context_tokens, *str_decoding_inverse_output, *str_decoding_untold;

#define COST_INT_LIMIT (1LL << 50)

/* 1: read, 0: not a small exact int (fall back), -1: error. */
static int small_int(PyObject *value, long long *out) {
    if (!PyLong_CheckExact(value))
        return 0;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow || v > COST_INT_LIMIT || v < -COST_INT_LIMIT)
        return 0;
    *out = v;
    return 1;
}

/* An int attribute of `object`: 1 read, 0 fall back, -1 error. */
static int int_attr(PyObject *object, PyObject *name, long long *out) {
    PyObject *value = PyObject_GetAttr(object, name);
    if (value == NULL)
        return -1;
    int status = small_int(value, out);
    Py_DECREF(value);
    return status;
}

typedef struct {
    long long prefill, decode, requests, cached, device, host, disk, depth;
    int has_overlap, has_depth;
} RankInputs;

/* One rank's inputs: 1 read, 0 fall back, -1 error. */
static int rank_inputs(PyObject *rank, PyObject *overlaps, PyObject *depths, RankInputs *in) {
    int status;
    if ((status = int_attr(rank, str_prefill_tokens, &in->prefill)) != 1 ||
        (status = int_attr(rank, str_decode_blocks, &in->decode)) != 1 ||
        (status = int_attr(rank, str_requests, &in->requests)) != 1)
        return status;
    in->cached = in->device = in->host = in->disk = in->depth = 0;
    in->has_overlap = in->has_depth = 0;
    if (PyDict_GET_SIZE(overlaps)) {
        PyObject *key = PyObject_GetAttr(rank, str_key);
        if (key == NULL)
            return -1;
        PyObject *overlap = PyDict_GetItemWithError(overlaps, key);
        Py_DECREF(key);
        if (overlap == NULL) {
            if (PyErr_Occurred())
                return -1;
        } else {
            in->has_overlap = 1;
            if ((status = int_attr(overlap, str_cached_tokens, &in->cached)) != 1 ||
                (status = int_attr(overlap, str_device_blocks, &in->device)) != 1 ||
                (status = int_attr(overlap, str_host_blocks, &in->host)) != 1 ||
                (status = int_attr(overlap, str_disk_blocks, &in->disk)) != 1)
                return status;
        }
    }
    if (PyDict_GET_SIZE(depths)) {
        PyObject *depth = PyDict_GetItemWithError(depths, rank);
        if (depth == NULL) {
            if (PyErr_Occurred())
                return -1;
        } else {
            in->has_depth = 1;
            if ((status = small_int(depth, &in->depth)) != 1)
                return status;
        }
    }
    return 1;
}

static inline double py_max0(double value) { return 0.0 > value ? 0.0 : value; } /* Python's max(value, 0.0) */

static int exact_float(PyObject *value, double *out) {
    if (!PyFloat_CheckExact(value))
        return 0;
    *out = PyFloat_AS_DOUBLE(value);
    return 1;
}

static PyObject *py_dynamo_costs(PyObject *self, PyObject *args) {
    PyObject *ranks, *overlaps, *depths, *multipliers, *weights[6];
    long long isl, block_size, booked;
    int track_prefill;
    if (!PyArg_ParseTuple(args, "OO!O!LLLpOOOOOOO", &ranks, &PyDict_Type, &overlaps, &PyDict_Type, &depths, &isl,
                          &block_size, &booked, &track_prefill, &weights[0], &weights[1], &weights[2], &weights[3],
                          &weights[4], &weights[5], &multipliers))
        return NULL;
    double credit, decay_rate, host_weight, disk_weight, scale, request_weight;
    if (!exact_float(weights[0], &credit) || !exact_float(weights[1], &decay_rate) ||
        !exact_float(weights[2], &host_weight) || !exact_float(weights[3], &disk_weight) ||
        !exact_float(weights[4], &scale) || !exact_float(weights[5], &request_weight) || block_size <= 0 ||
        isl > COST_INT_LIMIT || isl < -COST_INT_LIMIT || booked > COST_INT_LIMIT || booked < -COST_INT_LIMIT)
        Py_RETURN_NONE;
    PyObject *fast = PySequence_Fast(ranks, "ranks must be a sequence");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    PyObject *factors = NULL;
    if (multipliers != Py_None) {
        factors = PySequence_Fast(multipliers, "taint multipliers must be a sequence");
        if (factors == NULL) {
            Py_DECREF(fast);
            return NULL;
        }
        if (PySequence_Fast_GET_SIZE(factors) < n)
            goto fall_back; /* Python raises its IndexError */
    }
    RankInputs stack_inputs[64];
    RankInputs *in = n <= 64 ? stack_inputs : PyMem_Malloc(sizeof(RankInputs) * (size_t)(n ? n : 1));
    if (in == NULL) {
        Py_DECREF(fast);
        Py_XDECREF(factors);
        return PyErr_NoMemory();
    }
    PyObject *costs = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        int status = rank_inputs(items[i], overlaps, depths, &in[i]);
        if (status < 0)
            goto done;
        if (status == 0)
            goto fall_back_freeing;
        if (factors != NULL && !PyFloat_CheckExact(PySequence_Fast_GET_ITEM(factors, i)))
            goto fall_back_freeing;
    }
    int decays = track_prefill && decay_rate > 0.0;
    long long floor_tokens = 0;
    if (decays) {
        if (n == 0)
            goto fall_back_freeing; /* Python's min() of nothing raises */
        floor_tokens = in[0].prefill;
        for (Py_ssize_t i = 1; i < n; i++)
            if (in[i].prefill < floor_tokens)
                floor_tokens = in[i].prefill;
    }
    /* -(-isl // block_size): Python's floor division, then negated */
    long long negated = -isl, quotient = negated / block_size;
    if ((negated % block_size != 0) && ((negated < 0) != (block_size < 0)))
        quotient -= 1;
    double request_blocks = (double)(-quotient);
    double bs = (double)block_size;
    int every_rank_in_full = !track_prefill || factors != NULL;
    costs = PyList_New(n);
    if (costs == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        const RankInputs *r = &in[i];
        double value;
        if (!every_rank_in_full && !r->has_overlap && !r->has_depth) {
            value = scale * ((double)(r->prefill + isl) / bs) + (double)(r->decode + booked) +
                    request_weight * (double)r->requests;
        } else {
            double raw_prefill = 0.0;
            if (track_prefill) {
                long long uncached = isl - r->cached > 0 ? isl - r->cached : 0;
                raw_prefill = (double)(r->prefill + uncached + r->cached) / bs;
            }
            double device_credit = credit;
            if (decays) {
                double backlog = (double)(r->prefill - floor_tokens) / bs / request_blocks;
                device_credit = credit * (1.0 / (1.0 + decay_rate * backlog));
            }
            double overlap_credit =
                device_credit * (double)r->device + host_weight * (double)r->host + disk_weight * (double)r->disk;
            value = scale * py_max0(raw_prefill - overlap_credit) + (double)(r->decode + booked - r->depth) +
                    request_weight * (double)r->requests;
            if (factors != NULL)
                value = value * PyFloat_AS_DOUBLE(PySequence_Fast_GET_ITEM(factors, i));
        }
        PyObject *cost = PyFloat_FromDouble(value);
        if (cost == NULL) {
            Py_CLEAR(costs);
            goto done;
        }
        PyList_SET_ITEM(costs, i, cost);
    }
done:
    if (in != stack_inputs)
        PyMem_Free(in);
    Py_DECREF(fast);
    Py_XDECREF(factors);
    return costs;
fall_back_freeing:
    if (in != stack_inputs)
        PyMem_Free(in);
fall_back:
    Py_DECREF(fast);
    Py_XDECREF(factors);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ the latency policy's costs */

/* `key`'s value in `dict` (borrowed) into *value, NULL when absent: 0, or -1 with an exception. */
static int dict_lookup(PyObject *dict, PyObject *key, PyObject **value) {
    *value = PyDict_GetItemWithError(dict, key);
    return *value == NULL && PyErr_Occurred() ? -1 : 0;
}

/* router.overlap.round_half_away of `credit * tokens` into *out: 1, or 0 past the bounded ints. */
static int credit_tokens(double credit, long long tokens, long long *out) {
    double value = credit * (double)tokens;
    double whole = floor(value);
    if (!(whole <= (double)COST_INT_LIMIT && whole >= -(double)COST_INT_LIMIT))
        return 0;
    *out = (long long)whole + (value - whole >= 0.5);
    return 1;
}

/* Python's -(-a // b) for b > 0: the ceiling of a / b, for negative a too. */
static long long ceil_div(long long a, long long b) {
    long long q = a / b;
    return (a % b != 0 && a > 0) ? q + 1 : q;
}

/* One rank's latency cost and the prompt tokens it holds (router/policies/latency.py,
 * `python_costs_and_held`, is the spec: the same float operations in the same order): 1 done,
 * 0 fall back, -1 error. */
static int latency_rank(PyObject *rank, PyObject *overlaps, PyObject *depths, PyObject *fills, PyObject *pass_tokens,
                        const double *w, long long isl, long long block_size, int track_prefill,
                        long long default_output, double *cost, long long *held) {
    int status;
    long long requests, context, queued = 0, cached = 0, depth = 0, budget = 0;
    if ((status = int_attr(rank, str_requests, &requests)) != 1 ||
        (status = int_attr(rank, str_context_tokens, &context)) != 1)
        return status;
    if (track_prefill && (status = int_attr(rank, str_prefill_tokens, &queued)) != 1)
        return status;
    PyObject *key = PyObject_GetAttr(rank, str_key);
    if (key == NULL)
        return -1;
    double fill = 1.0;
    PyObject *found;
    if (dict_lookup(overlaps, key, &found) < 0)
        goto error;
    if (found != NULL && (status = int_attr(found, str_cached_tokens, &cached)) != 1)
        goto status;
    if (dict_lookup(pass_tokens, key, &found) < 0)
        goto error;
    if (found != NULL && (status = small_int(found, &budget)) != 1)
        goto status;
    if (fills != Py_None) {
        if (dict_lookup(fills, key, &found) < 0)
            goto error;
        fill = 0.0;
        if (found != NULL && (status = exact_float(found, &fill)) != 1)
            goto status;
    }
    Py_DECREF(key);
    if (dict_lookup(depths, rank, &found) < 0)
        return -1;
    if (found != NULL && (status = small_int(found, &depth)) != 1)
        return status;
    if (depth > COST_INT_LIMIT / block_size || depth < -COST_INT_LIMIT / block_size)
        return 0;
    long long inflight = depth * block_size;
    double credit = w[0];
    if (credit != 1.0 && (!credit_tokens(credit, cached, &cached) || !credit_tokens(credit, inflight, &inflight)))
        return 0;
    *held = cached > inflight ? cached : inflight;
    if (inflight > cached && queued >= budget)
        cached = inflight;
    long long miss = isl - cached > 0 ? isl - cached : 0;
    double prefill_scale = w[1], extra_miss_weight = w[2], stall_weight = w[3], itl_stall_weight = w[4];
    double decode_weight = w[5], others_weight = w[6], pass_base = w[7];
    double stalled = stall_weight * (double)requests;
    if (itl_stall_weight != 0.0) {
        double inverse_output;
        long long untold;
        PyObject *value = PyObject_GetAttr(rank, str_decoding_inverse_output);
        if (value == NULL)
            return -1;
        status = exact_float(value, &inverse_output);
        Py_DECREF(value);
        if (status != 1)
            return status;
        if ((status = int_attr(rank, str_decoding_untold, &untold)) != 1)
            return status;
        double shorter = (double)default_output * inverse_output + (double)untold;
        stalled += itl_stall_weight * shorter;
    }
    long long waited = 0, added = 0;
    if (pass_base != 0.0 && budget > 0) {
        /* The passes until its prefill is done, and those it adds to the rank's queue (a full hit still
         * computes a token). */
        long long own = miss > 1 ? miss : 1; /* queued and miss are bounded ints: no overflow */
        waited = ceil_div(queued + own, budget);
        added = waited - ceil_div(queued, budget);
    } else if (pass_base != 0.0) {
        /* No budget said: what is queued there is one pass, which it joins or starts. */
        waited = 1;
        added = queued > 0 ? 0 : 1;
    }
    *cost = prefill_scale * ((double)queued + (1.0 + extra_miss_weight * fill + stalled) * (double)miss +
                             pass_base * ((double)waited + (double)added * stalled)) +
            decode_weight * ((double)context + others_weight * (double)isl * (double)requests);
    return 1;
status:
    Py_DECREF(key);
    return status;
error:
    Py_DECREF(key);
    return -1;
}

static PyObject *py_latency_costs(PyObject *self, PyObject *args) {
    PyObject *ranks, *overlaps, *depths, *fills, *pass_tokens, *ints[3], *weights[8];
    int track_prefill;
    if (!PyArg_ParseTuple(args, "OOOOOOOpOOOOOOOOO", &ranks, &overlaps, &depths, &fills, &pass_tokens, &ints[0],
                          &ints[1], &track_prefill, &ints[2], &weights[0], &weights[1], &weights[2], &weights[3],
                          &weights[4], &weights[5], &weights[6], &weights[7]))
        return NULL;
    /* Exact dicts only (a subclass may answer lookups otherwise), bounded ints, finite floats. */
    if (!PyDict_CheckExact(overlaps) || !PyDict_CheckExact(depths) || !PyDict_CheckExact(pass_tokens) ||
        (fills != Py_None && !PyDict_CheckExact(fills)))
        Py_RETURN_NONE;
    long long values[3];
    for (int i = 0; i < 3; i++) {
        int status = small_int(ints[i], &values[i]);
        if (status < 0)
            return NULL;
        if (status == 0)
            Py_RETURN_NONE;
    }
    long long isl = values[0], block_size = values[1], default_output = values[2];
    double w[8];
    for (int i = 0; i < 8; i++)
        if (!exact_float(weights[i], &w[i]) || !isfinite(w[i]))
            Py_RETURN_NONE;
    if (block_size <= 0)
        Py_RETURN_NONE;
    PyObject *fast = PySequence_Fast(ranks, "ranks must be a sequence");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    PyObject *costs = PyList_New(n), *held = PyList_New(n), *result = NULL;
    if (costs == NULL || held == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        double cost;
        long long holds;
        int status = latency_rank(items[i], overlaps, depths, fills, pass_tokens, w, isl, block_size, track_prefill,
                                  default_output, &cost, &holds);
        if (status < 0)
            goto done;
        if (status == 0 || holds > COST_INT_LIMIT || holds < -COST_INT_LIMIT) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        PyObject *value = PyFloat_FromDouble(cost);
        if (value == NULL)
            goto done;
        PyList_SET_ITEM(costs, i, value);
        value = PyLong_FromLongLong(holds);
        if (value == NULL)
            goto done;
        PyList_SET_ITEM(held, i, value);
    }
    result = PyTuple_Pack(2, costs, held);
done:
    Py_DECREF(fast);
    Py_XDECREF(costs);
    Py_XDECREF(held);
    return result;
}

/* (index of the first lowest cost, how many share it) as `min` and `==` on floats give them, or None
 * when a cost is not a float or none equals the minimum (NaN): the Python code answers then. */
static PyObject *py_lowest_cost(PyObject *self, PyObject *costs) {
    if (!PyList_CheckExact(costs) || PyList_GET_SIZE(costs) == 0)
        Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(costs);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyFloat_CheckExact(PyList_GET_ITEM(costs, i)))
            Py_RETURN_NONE;
    double lowest = PyFloat_AS_DOUBLE(PyList_GET_ITEM(costs, 0));
    for (Py_ssize_t i = 1; i < n; i++) {
        double cost = PyFloat_AS_DOUBLE(PyList_GET_ITEM(costs, i));
        if (cost < lowest)
            lowest = cost;
    }
    Py_ssize_t first = -1, ties = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyFloat_AS_DOUBLE(PyList_GET_ITEM(costs, i)) == lowest) {
            if (first < 0)
                first = i;
            ties++;
        }
    }
    if (ties == 0)
        Py_RETURN_NONE;
    return Py_BuildValue("nn", first, ties);
}

/* ------------------------------------------------------------------ module */

static PyMethodDef native_methods[] = {
    {"dynamo_costs", py_dynamo_costs, METH_VARARGS,
     "dynamo_costs(ranks, overlaps, depths, isl, block_size, booked, track_prefill, credit, decay, host_weight, "
     "disk_weight, scale, request_weight, multipliers) -> list[float] | None: the dynamo policy's costs."},
    {"latency_costs", py_latency_costs, METH_VARARGS,
     "latency_costs(ranks, overlaps, depths, fills, pass_tokens, isl, block_size, track_prefill, default_output, "
     "credit, prefill_scale, extra_miss_weight, stall_weight, itl_stall_weight, decode_weight, others_weight, "
     "pass_base) -> "
     "(costs, held) | None: the latency policy's costs before taint multipliers, and the tokens each rank holds."},
    {"lowest_cost", py_lowest_cost, METH_O,
     "lowest_cost(costs) -> (index, ties) | None: the first lowest cost's index and how many share it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "router._native", "kv-router's optional C accelerator of the router (see router/native.py).",
    -1, native_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&RunType) < 0 || PyType_Ready(&BookedType) < 0)
        return NULL;
    PyObject **names[] = {&str_key, &str_prefill_tokens, &str_decode_blocks, &str_requests,
                          &str_cached_tokens, &str_device_blocks, &str_host_blocks, &str_disk_blocks,
                          &str_context_tokens, &str_decoding_inverse_output, &str_decoding_untold};
    const char *spellings[] = {"key", "prefill_tokens", "decode_blocks", "requests",
                               "cached_tokens", "device_blocks", "host_blocks", "disk_blocks",
                               "context_tokens", "decoding_inverse_output", "decoding_untold"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        *names[i] = PyUnicode_InternFromString(spellings[i]);
        if (*names[i] == NULL)
            return NULL;
    }
    PyObject *module = PyModule_Create(&native_module);
    if (module != NULL && PyModule_AddObjectRef(module, "BookedBlocks", (PyObject *)&BookedType) < 0)
        Py_CLEAR(module);
    return module;
}
