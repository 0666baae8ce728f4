/* indexer._events_native: the engine bridge's per-event step in C (optional accelerator).
 *
 * `decode_batch` reads one engine batch (`indexer/engine_events.py`: the `[ts, events, dp_rank]`
 * envelope, tagged-map and tagged-array events, int and bytes block hashes) and builds the decoded
 * events in one call: hashes folded to u64, token ids packed and hashed into tokens hashes (through
 * `indexer._native`'s `msgpack_u32s` and `block_hashes`, so XXH3 lives in one place), `medium` mapped
 * to a tier. `hold_chain` and `drop_blocks` are `indexer.held_blocks.HeldBlocks.store`'s dict update
 * with its checks and `remove`'s pops.
 *
 * Guardrail: only the plain shapes are taken here. Anything else (a map envelope, a LoRA name, a
 * cache salt, multimodal infos, an unknown medium spelling, any value of a wrong type, any error
 * the decoder names) returns None and the caller runs the Python decoder, which gives the same
 * answer for what is taken here (tests/test_events_native.py) and names every error.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Set by `configure`: the decoded event types, the tiers by medium, and indexer._native's helpers. */
static PyObject *stored_type, *removed_type, *cleared_event, *tiers, *device_tier;
static PyObject *pack_tokens_fn, *block_hashes_fn;

typedef struct {
    const uint8_t *p, *end;
} Reader;

/* ------------------------------------------------------------------ msgpack reading */

static int read_be(Reader *r, size_t n, uint64_t *out) {
    if ((size_t)(r->end - r->p) < n)
        return -1;
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++)
        v = (v << 8) | r->p[i];
    r->p += n;
    *out = v;
    return 0;
}

/* A container header: its length, or -1 if the next value is not of the family whose fix form is
 * `fix` (0x90 arrays, 0x80 maps) and whose 16-bit form is `wide` (0xdc, 0xde; 32-bit: one more). */
static int64_t read_header(Reader *r, uint8_t fix, uint8_t wide) {
    if (r->p >= r->end)
        return -1;
    uint8_t tag = *r->p++;
    uint64_t n;
    if ((tag & 0xF0) == fix)
        return tag & 0x0F;
    if ((tag == wide && read_be(r, 2, &n) == 0) || (tag == wide + 1 && read_be(r, 4, &n) == 0))
        return (int64_t)n;
    return -1;
}

static int64_t read_array(Reader *r) { return read_header(r, 0x90, 0xdc); }

static int64_t read_map(Reader *r) { return read_header(r, 0x80, 0xde); }

/* Non-ASCII text is left to msgspec, which checks that it is UTF-8. */
static int ascii(const uint8_t *data, size_t len) {
    for (size_t i = 0; i < len; i++)
        if (data[i] & 0x80)
            return 0;
    return 1;
}

/* A str: its bytes, or -1 if the next value is not an ASCII str. */
static int read_str(Reader *r, const uint8_t **data, size_t *len) {
    if (r->p >= r->end)
        return -1;
    uint8_t tag = *r->p++;
    uint64_t n;
    if ((tag & 0xE0) == 0xA0)
        n = tag & 0x1F;
    else if (tag == 0xd9 && read_be(r, 1, &n) == 0) {
    } else if (tag == 0xda && read_be(r, 2, &n) == 0) {
    } else if (tag == 0xdb && read_be(r, 4, &n) == 0) {
    } else
        return -1;
    if ((uint64_t)(r->end - r->p) < n || !ascii(r->p, (size_t)n))
        return -1;
    *data = r->p;
    *len = (size_t)n;
    r->p += n;
    return 0;
}

static int is_nil(Reader *r) {
    if (r->p < r->end && *r->p == 0xc0) {
        r->p++;
        return 1;
    }
    return 0;
}

/* An int of any msgpack form (msgspec's `int`: within i64 or u64): its value and sign. */
static int read_int(Reader *r, uint64_t *out, int *negative) {
    if (r->p >= r->end)
        return -1;
    uint8_t tag = *r->p;
    *negative = 0;
    if (tag < 0x80) {
        r->p++;
        *out = tag;
        return 0;
    }
    if (tag >= 0xe0) {
        r->p++;
        *out = (uint64_t)(int64_t)(int8_t)tag;
        *negative = 1;
        return 0;
    }
    if (tag >= 0xcc && tag <= 0xcf) {
        r->p++;
        return read_be(r, (size_t)1 << (tag - 0xcc), out);
    }
    if (tag >= 0xd0 && tag <= 0xd3) {
        size_t n = (size_t)1 << (tag - 0xd0);
        r->p++;
        uint64_t v;
        if (read_be(r, n, &v) < 0)
            return -1;
        if (n < 8 && (v >> (8 * n - 1)) & 1)
            v |= ~(uint64_t)0 << (8 * n); /* sign-extend */
        *negative = (int64_t)v < 0;
        *out = v;
        return 0;
    }
    return -1;
}

/* An engine block hash folded to u64: ints modulo 2^64, bytes by their last 8 bytes big-endian. */
static int read_hash(Reader *r, uint64_t *out) {
    if (r->p >= r->end)
        return -1;
    uint8_t tag = *r->p;
    if (tag >= 0xc4 && tag <= 0xc6) {
        r->p++;
        uint64_t n;
        if (read_be(r, (size_t)1 << (tag - 0xc4), &n) < 0 || (uint64_t)(r->end - r->p) < n)
            return -1;
        const uint8_t *data = r->p;
        r->p += n;
        size_t start = n > 8 ? (size_t)n - 8 : 0;
        uint64_t v = 0;
        for (size_t i = start; i < n; i++)
            v = (v << 8) | data[i];
        *out = v;
        return 0;
    }
    int negative;
    return read_int(r, out, &negative);
}

static int skip(Reader *r, int depth);
static int read_str(Reader *r, const uint8_t **data, size_t *len);

static int skip_n(Reader *r, uint64_t n, int depth) {
    for (uint64_t i = 0; i < n; i++) {
        /* Token ids and hashes: unsigned ints, stepped over here without a call each. */
        if (r->p < r->end) {
            uint8_t tag = *r->p;
            if (tag < 0x80) {
                r->p++;
                continue;
            }
            if (tag >= 0xcc && tag <= 0xcf) {
                size_t width = (size_t)1 << (tag - 0xcc);
                if ((size_t)(r->end - r->p) <= width)
                    return -1;
                r->p += 1 + width;
                continue;
            }
        }
        if (skip(r, depth) < 0)
            return -1;
    }
    return 0;
}

/* Past a map's entries: keys are ints or ASCII strs (what msgspec's `Any` surely takes). */
static int skip_entries(Reader *r, uint64_t n, int depth) {
    for (uint64_t i = 0; i < n; i++) {
        if (r->p >= r->end)
            return -1;
        uint8_t key = *r->p;
        int text = (key & 0xE0) == 0xA0 || (key >= 0xd9 && key <= 0xdb);
        int number = key < 0x80 || key >= 0xe0 || (key >= 0xcc && key <= 0xd3);
        if (!(text || number) || skip(r, depth) < 0 || skip(r, depth) < 0)
            return -1;
    }
    return 0;
}

/* Past any one value of msgspec's `Any`, nested at most 32 deep; -1 for what only msgspec should
 * judge (ext types such as timestamps, non-ASCII text, maps keyed by containers). */
static int skip(Reader *r, int depth) {
    if (r->p >= r->end || depth > 32)
        return -1;
    uint8_t tag = *r->p++;
    uint64_t n;
    if (tag < 0x80 || tag >= 0xe0 || tag == 0xc0 || tag == 0xc2 || tag == 0xc3)
        return 0;
    if ((tag & 0xF0) == 0x80)
        return skip_entries(r, tag & 0x0F, depth + 1);
    if ((tag & 0xF0) == 0x90)
        return skip_n(r, tag & 0x0F, depth + 1);
    if ((tag & 0xE0) == 0xA0 || (tag >= 0xd9 && tag <= 0xdb)) {
        r->p--;
        const uint8_t *data;
        size_t len;
        return read_str(r, &data, &len);
    }
    if (tag >= 0xc4 && tag <= 0xc6) { /* bin */
        if (read_be(r, (size_t)1 << (tag - 0xc4), &n) < 0)
            return -1;
    } else if (tag == 0xca)
        n = 4;
    else if (tag == 0xcb)
        n = 8;
    else if (tag >= 0xcc && tag <= 0xcf)
        n = (uint64_t)1 << (tag - 0xcc);
    else if (tag >= 0xd0 && tag <= 0xd3)
        n = (uint64_t)1 << (tag - 0xd0);
    else if (tag == 0xdc || tag == 0xdd) {
        if (read_be(r, tag == 0xdc ? 2 : 4, &n) < 0)
            return -1;
        return skip_n(r, n, depth + 1);
    } else if (tag == 0xde || tag == 0xdf) {
        if (read_be(r, tag == 0xde ? 2 : 4, &n) < 0)
            return -1;
        return skip_entries(r, n, depth + 1);
    } else
        return -1; /* ext (0xc7-0xc9, 0xd4-0xd8) and 0xc1 */
    if ((uint64_t)(r->end - r->p) < n)
        return -1;
    r->p += n;
    return 0;
}

/* ------------------------------------------------------------------ one event */

enum Kind { NONE, STORED, REMOVED, CLEARED };

/* Where each field of an event starts (NULL: absent), found in either form. */
typedef struct {
    enum Kind kind;
    const uint8_t *block_hashes, *parent, *token_ids, *block_size, *medium, *group_idx, *spec_kind;
    const uint8_t *token_ids_end;
} Fields;

#define NAMED(data, len, literal) ((len) == sizeof(literal) - 1 && memcmp((data), (literal), (len)) == 0)

static enum Kind kind_of(const uint8_t *name, size_t len) {
    if (NAMED(name, len, "BlockStored"))
        return STORED;
    if (NAMED(name, len, "BlockRemoved"))
        return REMOVED;
    if (NAMED(name, len, "AllBlocksCleared"))
        return CLEARED;
    return NONE;
}

/* The fields the decoder reads, where `Fields` keeps them; `stored` ones belong to BlockStored only. */
static const struct {
    const char *name;
    size_t offset;
    int stored;
} FIELD_SLOTS[] = {
    {"block_hashes", offsetof(Fields, block_hashes), 0},
    {"medium", offsetof(Fields, medium), 0},
    {"group_idx", offsetof(Fields, group_idx), 0},
    {"parent_block_hash", offsetof(Fields, parent), 1},
    {"token_ids", offsetof(Fields, token_ids), 1},
    {"block_size", offsetof(Fields, block_size), 1},
    {"kv_cache_spec_kind", offsetof(Fields, spec_kind), 1},
};
/* BlockStored fields that must be nil for the fast path: they salt the hashes (Python computes those). */
static const char *const NIL_ONLY[] = {"lora_name", "cache_salt", "block_mm_infos"};

/* Record where a field of `kind` starts and step past it; -1: not a plain shape. Keys of other
 * kinds' fields, or unknown keys, are skipped as msgspec skips them. */
static int take_field(Reader *r, Fields *f, const uint8_t *key, size_t len, int stored_field) {
    const uint8_t *start = r->p;
    const uint8_t **slot = NULL;
    for (size_t i = 0; i < sizeof(FIELD_SLOTS) / sizeof(*FIELD_SLOTS) && slot == NULL; i++)
        if ((stored_field || !FIELD_SLOTS[i].stored) && len == strlen(FIELD_SLOTS[i].name) &&
            memcmp(key, FIELD_SLOTS[i].name, len) == 0)
            slot = (const uint8_t **)((char *)f + FIELD_SLOTS[i].offset);
    for (size_t i = 0; i < sizeof(NIL_ONLY) / sizeof(*NIL_ONLY) && slot == NULL && stored_field; i++)
        if (len == strlen(NIL_ONLY[i]) && memcmp(key, NIL_ONLY[i], len) == 0)
            return is_nil(r) ? 0 : -1;
    if (NAMED(key, len, "type"))
        return -1; /* a second tag: msgspec decides */
    if (slot == NULL)
        return skip(r, 0);
    if (*slot != NULL)
        return -1; /* a repeated key: msgspec decides */
    *slot = start;
    if (skip(r, 0) < 0)
        return -1;
    if (slot == &f->token_ids)
        f->token_ids_end = r->p;
    return 0;
}

static int read_map_event(Reader *r, Fields *f) {
    int64_t n = read_map(r);
    if (n < 0)
        return -1;
    /* The tag first: the fields a key names depend on the kind (vLLM, SGLang and TRT-LLM write it first). */
    const uint8_t *key, *value;
    size_t len, value_len;
    if (n == 0 || read_str(r, &key, &len) < 0 || !NAMED(key, len, "type") || read_str(r, &value, &value_len) < 0)
        return -1;
    f->kind = kind_of(value, value_len);
    if (f->kind == NONE)
        return -1;
    for (int64_t i = 1; i < n; i++) {
        if (read_str(r, &key, &len) < 0)
            return -1;
        if (f->kind == CLEARED) {
            if (skip(r, 0) < 0)
                return -1;
        } else if (take_field(r, f, key, len, f->kind == STORED) < 0)
            return -1;
    }
    return f->block_hashes == NULL && f->kind != CLEARED ? -1 : 0;
}

/* Positional fields after the tag, as `_StoredArray` / `_RemovedArray` declare them; NULL: skipped. */
static const char *const STORED_SLOTS[] = {"block_hashes", "parent_block_hash", "token_ids", "block_size",
                                           "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
                                           "kv_cache_spec_kind"};
static const char *const REMOVED_SLOTS[] = {"block_hashes", "medium", "group_idx"};

static int read_array_event(Reader *r, Fields *f) {
    int64_t n = read_array(r);
    const uint8_t *name;
    size_t len;
    if (n < 1 || read_str(r, &name, &len) < 0)
        return -1;
    f->kind = kind_of(name, len);
    if (f->kind == NONE)
        return -1;
    const char *const *slots = f->kind == STORED ? STORED_SLOTS : REMOVED_SLOTS;
    int64_t declared = f->kind == STORED ? 10 : f->kind == REMOVED ? 3 : 0;
    for (int64_t i = 1; i < n; i++) {
        if (i > declared) { /* extra trailing items are ignored */
            if (skip(r, 0) < 0)
                return -1;
            continue;
        }
        const char *slot = slots[i - 1];
        if (strcmp(slot, "lora_id") == 0 || strcmp(slot, "extra_keys") == 0) {
            if (skip(r, 0) < 0)
                return -1;
        } else if (take_field(r, f, (const uint8_t *)slot, strlen(slot), f->kind == STORED) < 0)
            return -1;
    }
    return f->block_hashes == NULL && f->kind != CLEARED ? -1 : 0;
}

/* A list of folded u64 block hashes from the field at `at` (a new list, NULL: not a plain list). */
static PyObject *hash_list(const uint8_t *at, const uint8_t *end, uint64_t **values) {
    Reader r = {at, end};
    int64_t n = read_array(&r);
    if (n < 0 || n > end - at)
        return NULL;
    uint64_t *buffer = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n ? n : 1));
    if (buffer == NULL)
        return NULL;
    PyObject *list = PyList_New((Py_ssize_t)n);
    if (list == NULL)
        goto fail;
    for (int64_t i = 0; i < n; i++) {
        PyObject *value;
        if (read_hash(&r, &buffer[i]) < 0 || (value = PyLong_FromUnsignedLongLong(buffer[i])) == NULL)
            goto fail;
        PyList_SET_ITEM(list, (Py_ssize_t)i, value);
    }
    *values = buffer;
    return list;
fail:
    Py_XDECREF(list);
    PyMem_Free(buffer);
    return NULL;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* Whether `parent` (if any) or any hash appears twice (the decoder's repeated_hash). */
static int repeats(uint64_t *values, Py_ssize_t n, int has_parent, uint64_t parent) {
    for (Py_ssize_t i = 0; has_parent && i < n; i++)
        if (values[i] == parent)
            return 1;
    qsort(values, (size_t)n, sizeof(uint64_t), cmp_u64);
    for (Py_ssize_t i = 1; i < n; i++)
        if (values[i] == values[i - 1])
            return 1;
    return 0;
}

/* The tier of a `medium` field (NULL: absent); NULL: a spelling the Python mapping must decide. */
static PyObject *tier_of(const uint8_t *at, const uint8_t *end) {
    if (at == NULL)
        return device_tier;
    Reader r = {at, end};
    if (is_nil(&r))
        return device_tier;
    const uint8_t *name;
    size_t len;
    if (read_str(&r, &name, &len) < 0)
        return NULL;
    PyObject *key = PyBytes_FromStringAndSize((const char *)name, (Py_ssize_t)len);
    if (key == NULL)
        return NULL;
    PyObject *tier = PyDict_GetItemWithError(tiers, key);
    Py_DECREF(key);
    return tier; /* borrowed */
}

/* An optional int field: 1 present (value in *out), 0 nil or absent, -1 not an int. */
static int optional_int(const uint8_t *at, const uint8_t *end, uint64_t *out, int *negative) {
    if (at == NULL)
        return 0;
    Reader r = {at, end};
    if (is_nil(&r))
        return 0;
    return read_int(&r, out, negative) < 0 ? -1 : 1;
}

static const char *const MAIN_ATTENTION[] = {"full_attention", "mla_attention", "sink_full_attention"};

/* 1: a group that is not full attention (ignored, as Dynamo ignores it), 0: kept, -1: not a str. */
static int ignored_group(const uint8_t *at, const uint8_t *end) {
    if (at == NULL)
        return 0;
    Reader r = {at, end};
    if (is_nil(&r))
        return 0;
    const uint8_t *name;
    size_t len;
    if (read_str(&r, &name, &len) < 0)
        return -1;
    for (size_t i = 0; i < sizeof(MAIN_ATTENTION) / sizeof(*MAIN_ATTENTION); i++)
        if (len == strlen(MAIN_ATTENTION[i]) && memcmp(name, MAIN_ATTENTION[i], len) == 0)
            return 0;
    return 1;
}

/* Our tokens hashes of `count` blocks from the token ids at [at, at_end): a new list, or NULL with
 * no exception (not plain u32 ids, or too few of them). */
static PyObject *tokens_hashes(const uint8_t *at, const uint8_t *at_end, Py_ssize_t count, long block_size,
                               PyObject *seed) {
    PyObject *view = NULL, *packed = NULL, *stride = NULL, *result = NULL;
    if (at == NULL) {
        if (count != 0)
            return NULL;
        return PyList_New(0);
    }
    view = PyMemoryView_FromMemory((char *)at, at_end - at, PyBUF_READ);
    if (view == NULL)
        goto done;
    packed = PyObject_CallOneArg(pack_tokens_fn, view);
    if (packed == NULL || packed == Py_None || PyBytes_GET_SIZE(packed) / 4 < count * block_size)
        goto done;
    Py_SETREF(view, PyMemoryView_FromMemory(PyBytes_AS_STRING(packed), count * block_size * 4, PyBUF_READ));
    stride = PyLong_FromLong(block_size * 4);
    if (view == NULL || stride == NULL)
        goto done;
    PyObject *args[] = {view, seed, stride, stride};
    result = PyObject_Vectorcall(block_hashes_fn, args, 4, NULL);
done:
    Py_XDECREF(view);
    Py_XDECREF(packed);
    Py_XDECREF(stride);
    return result;
}

/* An instance of a tuple subclass (the decoded events are NamedTuples) from its items, without a
 * call of its Python `__new__`; steals nothing. */
static PyObject *named_tuple(PyObject *type, PyObject *const *items, Py_ssize_t n) {
    PyObject *result = ((PyTypeObject *)type)->tp_alloc((PyTypeObject *)type, n);
    if (result == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        PyTuple_SET_ITEM(result, i, Py_NewRef(items[i]));
    return result;
}

/* The decoded event (new reference), Py_None for an ignored one (new reference), or NULL: not taken. */
static PyObject *event_of(Fields *f, const uint8_t *end, long block_size, PyObject *block_size_obj, PyObject *seed) {
    if (f->kind == CLEARED)
        return Py_NewRef(cleared_event);
    uint64_t group;
    int negative;
    if (optional_int(f->group_idx, end, &group, &negative) < 0)
        return NULL;
    PyObject *tier = tier_of(f->medium, end);
    if (tier == NULL)
        return NULL;
    uint64_t *values = NULL;
    PyObject *hashes = hash_list(f->block_hashes, end, &values), *result = NULL;
    PyObject *parent = NULL, *locals = NULL;
    if (hashes == NULL)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(hashes);
    if (f->kind == REMOVED) {
        PyObject *args[] = {hashes, tier};
        result = named_tuple(removed_type, args, 2);
        goto done;
    }
    uint64_t engine_block_size;
    int has_size = optional_int(f->block_size, end, &engine_block_size, &negative);
    if (has_size < 0)
        goto done;
    uint64_t parent_value = 0;
    int has_parent = 0;
    if (f->parent != NULL) {
        Reader r = {f->parent, end};
        if (!is_nil(&r)) {
            if (read_hash(&r, &parent_value) < 0 || (parent = PyLong_FromUnsignedLongLong(parent_value)) == NULL)
                goto done;
            has_parent = 1;
        }
    }
    /* Every field's type is checked before a group is ignored, as msgspec checks them first. */
    int ignored = ignored_group(f->spec_kind, end);
    if (ignored != 0) {
        result = ignored > 0 ? Py_NewRef(Py_None) : NULL;
        goto done;
    }
    if (has_size && (negative || engine_block_size != (uint64_t)block_size))
        goto done; /* block_size_mismatch: named by Python */
    if (repeats(values, n, has_parent, parent_value))
        goto done;
    locals = tokens_hashes(f->token_ids, f->token_ids_end, n, block_size, seed);
    if (locals == NULL)
        goto done;
    PyObject *args[] = {has_parent ? parent : Py_None, hashes, locals, tier, block_size_obj};
    result = named_tuple(stored_type, args, 5);
done:
    PyMem_Free(values);
    Py_DECREF(hashes);
    Py_XDECREF(parent);
    Py_XDECREF(locals);
    return result;
}

/* decode_batch(payload, block_size, seed) -> (ts, dp_rank, events, ignored) | None */
static PyObject *py_decode_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyLong_Check(args[1]) || !PyLong_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "decode_batch(payload, block_size, seed)");
        return NULL;
    }
    if (stored_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "configure() was not called");
        return NULL;
    }
    long block_size = PyLong_AsLong(args[1]);
    if (block_size <= 0 || block_size > (1L << 24)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return NULL;
    }
    Py_buffer data;
    if (PyObject_GetBuffer(args[0], &data, PyBUF_SIMPLE) < 0)
        return NULL;
    Reader r = {(const uint8_t *)data.buf, (const uint8_t *)data.buf + data.len};
    PyObject *events = NULL, *ts = NULL, *rank = NULL, *result = NULL;
    Py_ssize_t ignored = 0;
    int64_t parts = read_array(&r);
    if (parts != 2 && parts != 3)
        goto unsupported;
    /* ts: a float (msgspec's `float` takes ints too, which Python decodes) */
    uint64_t bits;
    if (r.p < r.end && *r.p == 0xcb) {
        r.p++;
        if (read_be(&r, 8, &bits) < 0)
            goto unsupported;
        double value;
        memcpy(&value, &bits, 8);
        ts = PyFloat_FromDouble(value);
    } else if (r.p < r.end && *r.p == 0xca) {
        r.p++;
        if (read_be(&r, 4, &bits) < 0)
            goto unsupported;
        uint32_t narrow = (uint32_t)bits;
        float value;
        memcpy(&value, &narrow, 4);
        ts = PyFloat_FromDouble((double)value);
    } else
        goto unsupported;
    if (ts == NULL)
        goto done;
    int64_t count = read_array(&r);
    if (count < 0 || count > r.end - r.p)
        goto unsupported;
    events = PyList_New(0);
    if (events == NULL)
        goto done;
    for (int64_t i = 0; i < count; i++) {
        Fields f = {0};
        if (r.p >= r.end)
            goto unsupported;
        uint8_t head = *r.p;
        int shape = ((head & 0xF0) == 0x80 || head == 0xde || head == 0xdf) ? read_map_event(&r, &f)
                    : ((head & 0xF0) == 0x90 || head == 0xdc || head == 0xdd) ? read_array_event(&r, &f)
                                                                               : -1;
        if (shape < 0)
            goto unsupported;
        PyObject *event = event_of(&f, r.end, block_size, args[1], args[2]);
        if (event == NULL) {
            if (PyErr_Occurred())
                goto done;
            goto unsupported;
        }
        if (event == Py_None) {
            ignored++;
            Py_DECREF(event);
            continue;
        }
        int failed = PyList_Append(events, event);
        Py_DECREF(event);
        if (failed < 0)
            goto done;
    }
    if (parts == 3) {
        uint64_t value;
        int negative;
        if (is_nil(&r))
            rank = Py_NewRef(Py_None);
        else if (read_int(&r, &value, &negative) == 0)
            rank = negative ? PyLong_FromLongLong((long long)value) : PyLong_FromUnsignedLongLong(value);
        else
            goto unsupported;
    } else
        rank = Py_NewRef(Py_None);
    if (rank == NULL)
        goto done;
    if (r.p != r.end)
        goto unsupported; /* trailing bytes: msgspec names them */
    result = Py_BuildValue("(OOOn)", ts, rank, events, ignored);
    goto done;
unsupported:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(ts);
    Py_XDECREF(rank);
    Py_XDECREF(events);
    PyBuffer_Release(&data);
    return result;
}

/* configure(stored_type, removed_type, cleared_event, tiers_by_medium, device_tier, pack_tokens, block_hashes) */
static PyObject *py_configure(PyObject *self, PyObject *args) {
    PyObject *s, *rm, *c, *t, *d, *pack, *hashes;
    if (!PyArg_ParseTuple(args, "OOOO!OOO", &s, &rm, &c, &PyDict_Type, &t, &d, &pack, &hashes))
        return NULL;
    Py_XSETREF(stored_type, Py_NewRef(s));
    Py_XSETREF(removed_type, Py_NewRef(rm));
    Py_XSETREF(cleared_event, Py_NewRef(c));
    Py_XSETREF(tiers, Py_NewRef(t));
    Py_XSETREF(device_tier, Py_NewRef(d));
    Py_XSETREF(pack_tokens_fn, Py_NewRef(pack));
    Py_XSETREF(block_hashes_fn, Py_NewRef(hashes));
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ held blocks */

/* hold_chain(held, parent, block_hashes, tokens_hashes, device) -> 0 | 1 | 2 | 3
 *
 * `HeldBlocks.store`'s checks and update: 1 a device store under a parent not held, 2 a chain that
 * holds its parent, 3 a chain that repeats a hash (nothing recorded then); 0 recorded, each block
 * under the one before it. ValueError when the two lists differ in length. */
static int compare_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* hold_chain's two chain tests on the hashes as u64 values (what every hash on the bridge's path is):
 * 2 if the chain holds its parent, 3 if it repeats a hash, 0 if neither; -1 (no error set) when a
 * value is not a u64 int, for the generic tests. A sorted copy instead of a set of the ints. */
static int chain_conflict_u64(PyObject *parent, PyObject *hashes, Py_ssize_t n) {
    uint64_t small[64];
    uint64_t *values = n <= 64 ? small : PyMem_Malloc((size_t)n * sizeof(uint64_t));
    if (values == NULL)
        return -1;
    int verdict = 0;
    uint64_t parent_value = 0;
    if (parent != Py_None) {
        parent_value = PyLong_CheckExact(parent) ? PyLong_AsUnsignedLongLong(parent) : (uint64_t)-1;
        if (parent_value == (uint64_t)-1 && (!PyLong_CheckExact(parent) || PyErr_Occurred()))
            verdict = -1;
    }
    for (Py_ssize_t i = 0; i < n && verdict == 0; i++) {
        PyObject *item = PyList_GET_ITEM(hashes, i);
        uint64_t value = PyLong_CheckExact(item) ? PyLong_AsUnsignedLongLong(item) : (uint64_t)-1;
        if (value == (uint64_t)-1 && (!PyLong_CheckExact(item) || PyErr_Occurred()))
            verdict = -1;
        else if (parent != Py_None && value == parent_value)
            verdict = 2;
        values[i] = value;
    }
    if (verdict == 0 && n <= 64) {
        for (Py_ssize_t i = 1; i < n; i++) { /* insertion sort: the short chains engines send */
            uint64_t value = values[i];
            Py_ssize_t j = i;
            for (; j > 0 && values[j - 1] > value; j--)
                values[j] = values[j - 1];
            values[j] = value;
        }
    } else if (verdict == 0)
        qsort(values, (size_t)n, sizeof(uint64_t), compare_u64);
    if (verdict == 0) {
        for (Py_ssize_t i = 1; i < n; i++)
            if (values[i] == values[i - 1]) {
                verdict = 3;
                break;
            }
    }
    if (values != small)
        PyMem_Free(values);
    if (verdict < 0)
        PyErr_Clear();
    return verdict;
}

static PyObject *py_hold_chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyDict_Check(args[0]) || !PyList_Check(args[2]) || !PyList_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "hold_chain(held: dict, parent, block_hashes: list, tokens_hashes: list, device)");
        return NULL;
    }
    PyObject *held = args[0], *parent = args[1], *hashes = args[2], *locals = args[3];
    int device = PyObject_IsTrue(args[4]);
    if (device < 0)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(hashes);
    if (parent != Py_None && device) {
        int found = PyDict_Contains(held, parent);
        if (found <= 0)
            return found < 0 ? NULL : PyLong_FromLong(1);
    }
    int conflict = chain_conflict_u64(parent, hashes, n);
    if (conflict < 0) {
        conflict = 0;
        if (parent != Py_None) {
            int inside = PySequence_Contains(hashes, parent);
            if (inside < 0)
                return NULL;
            conflict = inside ? 2 : 0;
        }
        if (conflict == 0) {
            PyObject *unique = PySet_New(hashes);
            if (unique == NULL)
                return NULL;
            conflict = PySet_GET_SIZE(unique) != n ? 3 : 0;
            Py_DECREF(unique);
        }
    }
    if (conflict == 2)
        return PyLong_FromLong(2);
    if (PyList_GET_SIZE(locals) != n) {
        PyErr_Format(PyExc_ValueError, "%zd block hashes but %zd tokens hashes", n, PyList_GET_SIZE(locals));
        return NULL;
    }
    if (conflict == 3)
        return PyLong_FromLong(3);
    PyObject *previous = parent;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *block = PyList_GET_ITEM(hashes, i);
        PyObject *entry = PyTuple_Pack(2, previous, PyList_GET_ITEM(locals, i));
        if (entry == NULL)
            return NULL;
        /* Two ints (or None and an int) can hold no cycle: untracked now, as the collector would
         * untrack them at its first pass, so what a worker holds never weighs on collections. */
        if (PyLong_CheckExact(PyTuple_GET_ITEM(entry, 1)) && (previous == Py_None || PyLong_CheckExact(previous)))
            PyObject_GC_UnTrack(entry);
        int failed = PyDict_SetItem(held, block, entry);
        Py_DECREF(entry);
        if (failed < 0)
            return NULL;
        previous = block;
    }
    return PyLong_FromLong(0);
}

/* drop_blocks(held, block_hashes) -> None: `HeldBlocks.remove`'s pops; hashes not held are ignored. */
static PyObject *py_drop_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyDict_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "drop_blocks(held: dict, block_hashes)");
        return NULL;
    }
    PyObject *hashes = PySequence_Fast(args[1], "block_hashes must be a sequence");
    if (hashes == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    PyObject **items = PySequence_Fast_ITEMS(hashes);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyDict_DelItem(args[0], items[i]) < 0) {
            if (!PyErr_ExceptionMatches(PyExc_KeyError)) {
                Py_DECREF(hashes);
                return NULL;
            }
            PyErr_Clear();
        }
    }
    Py_DECREF(hashes);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ module */

static PyMethodDef methods[] = {
    {"configure", py_configure, METH_VARARGS,
     "configure(stored_type, removed_type, cleared_event, tiers_by_medium, device_tier, pack_tokens, block_hashes)."},
    {"decode_batch", (PyCFunction)(void (*)(void))py_decode_batch, METH_FASTCALL,
     "decode_batch(payload, block_size, seed) -> (ts, dp_rank, events, ignored) | None: a plain engine batch."},
    {"hold_chain", (PyCFunction)(void (*)(void))py_hold_chain, METH_FASTCALL,
     "hold_chain(held, parent, block_hashes, tokens_hashes, device) -> 0 | 1 | 2 | 3: HeldBlocks.store."},
    {"drop_blocks", (PyCFunction)(void (*)(void))py_drop_blocks, METH_FASTCALL,
     "drop_blocks(held, block_hashes) -> None: HeldBlocks.remove (hashes not held are ignored)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "indexer._events_native",
    "The engine bridge's decode and hold steps in C (see indexer/engine_events.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__events_native(void) { return PyModule_Create(&module); }
