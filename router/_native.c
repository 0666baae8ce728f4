/* router._native: the router's per-request loops in C (optional accelerator, router/native.py).
 *
 * Each function has a pure-Python twin that gives the same answers bit for bit (tests/test_native_router.py):
 * the refcount loops of booking and release and the prefix bisections (router/sequences.py), the dynamo
 * policy's costs and the choice of the lowest (router/policies/dynamo.py).
 *
 * Guardrail: a function that meets input it was not written for returns None (or raises the same
 * exception class as the Python path), so the caller can fall back to Python for the exact error.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* ------------------------------------------------------------------ booked blocks (sequences.py)
 *
 * A rank's booked blocks are a dict sequence hash -> refcount. Booking a prompt increments the
 * refcounts of the first `held` hashes (those the rank already holds) and sets the rest to 1;
 * releasing decrements the first `shared` and deletes the rest (held by this request alone). */
static PyObject *one, *minus_one;

/* The refcount of a booked `hash` (borrowed); NULL with KeyError, as `refs[hash]` raises, when it is
 * not booked. */
static PyObject *booked_count(PyObject *refs, PyObject *hash) {
    PyObject *count = PyDict_GetItemWithError(refs, hash);
    if (count == NULL && !PyErr_Occurred())
        PyErr_SetObject(PyExc_KeyError, hash);
    return count;
}

/* The one loop of book_blocks (step +1) and release_blocks (step -1): `args` is (refs, hashes, split);
 * the first `split` refcounts move by `step`, the rest are set to 1 (booking) or deleted (release). */
static PyObject *rebook(PyObject *args, PyObject *step) {
    PyObject *refs, *hashes;
    Py_ssize_t split;
    if (!PyArg_ParseTuple(args, "O!On", &PyDict_Type, &refs, &hashes, &split))
        return NULL;
    PyObject *fast = PySequence_Fast(hashes, "hashes must be a sequence");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    int status = 0;
    for (Py_ssize_t i = 0; i < n && status == 0; i++) {
        if (i < split) {
            PyObject *current = booked_count(refs, items[i]);
            PyObject *count = current == NULL ? NULL : PyNumber_Add(current, step);
            status = count == NULL ? -1 : PyDict_SetItem(refs, items[i], count);
            Py_XDECREF(count);
        } else if (step == one) {
            status = PyDict_SetItem(refs, items[i], one);
        } else {
            status = PyDict_DelItem(refs, items[i]);
        }
    }
    Py_DECREF(fast);
    if (status < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_book_blocks(PyObject *self, PyObject *args) { return rebook(args, one); }

static PyObject *py_release_blocks(PyObject *self, PyObject *args) { return rebook(args, minus_one); }

/* Whether `hash` counts towards the prefix: 1 yes, 0 no, -1 error. */
typedef int (*PrefixTest)(PyObject *refs, PyObject *hash);

static int is_held(PyObject *refs, PyObject *hash) { return PyDict_Contains(refs, hash); }

static int is_shared(PyObject *refs, PyObject *hash) {
    PyObject *count = booked_count(refs, hash);
    return count == NULL ? -1 : PyObject_RichCompareBool(count, one, Py_GT);
}

/* How many leading hashes of `args` = (refs, hashes) pass `test`, by bisection: the callers' hashes
 * pass as a prefix (router/sequences.py). */
static PyObject *bisect_prefix(PyObject *args, PrefixTest test) {
    PyObject *refs, *hashes;
    if (!PyArg_ParseTuple(args, "O!O", &PyDict_Type, &refs, &hashes))
        return NULL;
    PyObject *fast = PySequence_Fast(hashes, "hashes must be a sequence");
    if (fast == NULL)
        return NULL;
    PyObject **items = PySequence_Fast_ITEMS(fast);
    Py_ssize_t low = 0, high = PySequence_Fast_GET_SIZE(fast);
    while (low < high) {
        Py_ssize_t middle = (low + high) / 2;
        int passes = test(refs, items[middle]);
        if (passes < 0) {
            Py_DECREF(fast);
            return NULL;
        }
        if (passes)
            low = middle + 1;
        else
            high = middle;
    }
    Py_DECREF(fast);
    return PyLong_FromSsize_t(low);
}

/* How many leading `hashes` are keys of `refs`. */
static PyObject *py_held_prefix(PyObject *self, PyObject *args) { return bisect_prefix(args, is_held); }

/* How many leading `hashes` (a booked prompt) have a refcount above 1; KeyError for a hash that is
 * not booked. */
static PyObject *py_shared_prefix(PyObject *self, PyObject *args) { return bisect_prefix(args, is_shared); }

/* ------------------------------------------------------------------ the dynamo policy's costs (policies/dynamo.py)
 *
 * `python_costs` in C: the same float operations in the same order, so every cost is bit-identical.
 * Integers are read as int64 and must stay within +-2^50 (every sum of a few of them then converts to
 * a double exactly, as Python's int arithmetic followed by true division or float() does); config
 * weights and taint multipliers must be exact floats. Anything else returns None: the Python code
 * runs instead. */
static PyObject *str_key, *str_prefill_tokens, *str_decode_blocks, *str_requests;
static PyObject *str_cached_tokens, *str_device_blocks, *str_host_blocks, *str_disk_blocks;

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
    {"book_blocks", py_book_blocks, METH_VARARGS,
     "book_blocks(refs, hashes, held) -> None: +1 on the first held hashes' refcounts, the rest set to 1."},
    {"release_blocks", py_release_blocks, METH_VARARGS,
     "release_blocks(refs, hashes, shared) -> None: -1 on the first shared hashes' refcounts, the rest deleted."},
    {"held_prefix", py_held_prefix, METH_VARARGS,
     "held_prefix(refs, hashes) -> int: how many leading hashes are keys of refs (a prefix), by bisection."},
    {"shared_prefix", py_shared_prefix, METH_VARARGS,
     "shared_prefix(refs, hashes) -> int: how many leading hashes have a refcount above 1, by bisection."},
    {"dynamo_costs", py_dynamo_costs, METH_VARARGS,
     "dynamo_costs(ranks, overlaps, depths, isl, block_size, booked, track_prefill, credit, decay, host_weight, "
     "disk_weight, scale, request_weight, multipliers) -> list[float] | None: the dynamo policy's costs."},
    {"lowest_cost", py_lowest_cost, METH_O,
     "lowest_cost(costs) -> (index, ties) | None: the first lowest cost's index and how many share it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "router._native", "kv-router's optional C accelerator of the router (see router/native.py).",
    -1, native_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    one = PyLong_FromLong(1);
    minus_one = PyLong_FromLong(-1);
    if (one == NULL || minus_one == NULL)
        return NULL;
    PyObject **names[] = {&str_key, &str_prefill_tokens, &str_decode_blocks, &str_requests,
                          &str_cached_tokens, &str_device_blocks, &str_host_blocks, &str_disk_blocks};
    const char *spellings[] = {"key", "prefill_tokens", "decode_blocks", "requests",
                               "cached_tokens", "device_blocks", "host_blocks", "disk_blocks"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        *names[i] = PyUnicode_InternFromString(spellings[i]);
        if (*names[i] == NULL)
            return NULL;
    }
    return PyModule_Create(&native_module);
}
