/* indexer._events_native: the engine bridge's per-event step in C (optional accelerator).
 *
 * `decode_batch` reads one engine batch (`indexer/engine_events.py`: the `[ts, events, dp_rank]`
 * envelope, tagged-map and tagged-array events, int and bytes block hashes) and builds the decoded
 * events in one call: hashes folded to u64, token ids packed and hashed into tokens hashes (through
 * `indexer._native`'s `msgpack_u32s` and `block_hashes`, so XXH3 lives in one place), `medium` mapped
 * to a tier. `hold_chain` and `drop_blocks` are `indexer.held_blocks.HeldBlocks.store`'s dict update
 * with its checks and `remove`'s pops. `bridge_batch` is the bridge's whole step, from a batch's
 * bytes to the publisher's encoded events (handed back: the publisher keeps its own numbering).
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
#include "_msgpack_write.h"

/* Set by `configure`: the decoded event types, the tiers by medium, and indexer._native's helpers. */
static PyObject *stored_type, *removed_type, *cleared_event, *tiers, *device_tier;
static PyObject *pack_tokens_fn, *block_hashes_fn, *namespace_seed_fn;

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
    const uint8_t *extra_keys; /* vLLM's per-block keys (a request's cache salt on its first block) */
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
    if (stored_field && NAMED(key, len, "extra_keys")) {
        if (f->extra_keys != NULL)
            return -1; /* a repeated key: msgspec decides */
        f->extra_keys = start;
        return skip(r, 0);
    }
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
        if (strcmp(slot, "lora_id") == 0) {
            if (skip(r, 0) < 0)
                return -1;
        } else if (strcmp(slot, "extra_keys") == 0) {
            f->extra_keys = r->p;
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

/* Whether `parent` (if any) or any hash appears twice (the decoder's repeated_hash); -1: no memory. */
static int repeats(const uint64_t *values, Py_ssize_t n, int has_parent, uint64_t parent) {
    for (Py_ssize_t i = 0; has_parent && i < n; i++)
        if (values[i] == parent)
            return 1;
    uint64_t small[64];
    uint64_t *sorted = n <= 64 ? small : PyMem_Malloc(sizeof(uint64_t) * (size_t)n);
    if (sorted == NULL)
        return -1;
    memcpy(sorted, values, sizeof(uint64_t) * (size_t)n);
    qsort(sorted, (size_t)n, sizeof(uint64_t), cmp_u64);
    int found = 0;
    for (Py_ssize_t i = 1; i < n && !found; i++)
        found = sorted[i] == sorted[i - 1];
    if (sorted != small)
        PyMem_Free(sorted);
    return found;
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

/* One event as read, before any Python object of its own: what `decode_batch` turns into a decoded
 * event and `bridge_batch` applies. The lists and the parent are new references. */
typedef struct {
    enum Kind kind;
    PyObject *tier; /* borrowed */
    PyObject *hashes, *locals, *parent; /* block hashes, tokens hashes (stored), parent (NULL: none) */
    uint64_t *values;                   /* the block hashes as u64, in order */
    uint64_t parent_value;
} Decoded;

static void decoded_clear(Decoded *d) {
    Py_CLEAR(d->hashes);
    Py_CLEAR(d->locals);
    Py_CLEAR(d->parent);
    PyMem_Free(d->values);
    d->values = NULL;
}

/* The cache salts a batch reads and changes, as `engine_events._engine_event` does with its `salts`
 * dict, for `decode_batch`: the caller's dict (NULL: salts are not followed past their store) and this
 * batch's changes, applied to it only when the whole batch is taken (a declined batch must leave it as
 * it was, for Python to decide from). `bridge_batch` passes no context: it declines any salted store. */
typedef struct {
    PyObject *salts; /* borrowed: block hash -> salt, or NULL */
    PyObject *added; /* a new dict of this batch's stores (hash -> salt), or NULL */
    int cleared;     /* `salts` cleared by this batch (before `added`) */
} Salts;

/* Whether the salts, as this batch has changed them so far, hold anything (Python's `if salts`). */
static int salts_any(Salts *s) {
    if (s->salts == NULL)
        return 0;
    if (s->added != NULL && PyDict_GET_SIZE(s->added) > 0)
        return 1;
    return !s->cleared && PyDict_GET_SIZE(s->salts) > 0;
}

/* The salt of `key` as this batch has changed the salts (borrowed), NULL when none (or an error). */
static PyObject *salts_get(Salts *s, PyObject *key) {
    if (s->added != NULL) {
        PyObject *found = PyDict_GetItemWithError(s->added, key);
        if (found != NULL || PyErr_Occurred())
            return found;
    }
    if (s->cleared)
        return NULL;
    return PyDict_GetItemWithError(s->salts, key);
}

static int salts_add(Salts *s, PyObject *key, PyObject *salt) {
    if (s->added == NULL && (s->added = PyDict_New()) == NULL)
        return -1;
    return PyDict_SetItem(s->added, key, salt);
}

static void salts_clear(Salts *s) {
    s->cleared = 1;
    Py_CLEAR(s->added);
}

/* This batch's changes into the caller's dict (the batch was taken). */
static int salts_commit(Salts *s) {
    if (s->salts == NULL)
        return 0;
    if (s->cleared)
        PyDict_Clear(s->salts);
    return s->added != NULL ? PyDict_Update(s->salts, s->added) : 0;
}

/* The cache salt vLLM (0.32) names in a store's `extra_keys`: one entry per block, a request's salt in
 * its first block's keys (`[["tenant-X"], nil, ...]`). 0: none (nil, or nils), 1: `*salt` set (a new
 * reference), -1: not plain, or not allowed (`allow` 0): Python decides (any other key, a non-ASCII or
 * empty salt), or an exception set. */
static int extra_keys_salt(const uint8_t *at, const uint8_t *end, int allow, PyObject **salt) {
    Reader r = {at, end};
    *salt = NULL;
    if (is_nil(&r))
        return 0;
    int64_t n = read_array(&r);
    if (n < 0 || n > r.end - r.p)
        return -1;
    for (int64_t i = 0; i < n; i++) {
        if (is_nil(&r))
            continue;
        const uint8_t *text;
        size_t len;
        if (i > 0 || !allow || read_array(&r) != 1 || read_str(&r, &text, &len) < 0 || len == 0 ||
            !ascii(text, len))
            goto declined;
        *salt = PyUnicode_FromStringAndSize((const char *)text, (Py_ssize_t)len);
        if (*salt == NULL)
            return -1;
    }
    return *salt != NULL;
declined:
    Py_CLEAR(*salt);
    return -1;
}

/* 1: `d` filled, 0: an ignored event, -1: not taken (an exception set, or none: Python decides). */
static int decode_event(Fields *f, const uint8_t *end, long block_size, PyObject *seed, Salts *salts, Decoded *d) {
    PyObject *salt = NULL, *salted_seed = NULL; /* new references, released at `done` */
    d->kind = f->kind;
    if (f->kind == CLEARED)
        return 1;
    uint64_t group;
    int negative;
    int has_group = optional_int(f->group_idx, end, &group, &negative);
    if (has_group < 0)
        return -1;
    d->tier = tier_of(f->medium, end);
    if (d->tier == NULL)
        return -1;
    d->hashes = hash_list(f->block_hashes, end, &d->values);
    if (d->hashes == NULL)
        return -1;
    int verdict = -1;
    Py_ssize_t n = PyList_GET_SIZE(d->hashes);
    if (f->kind == REMOVED) {
        verdict = 1;
        goto done;
    }
    uint64_t engine_block_size;
    int has_size = optional_int(f->block_size, end, &engine_block_size, &negative);
    if (has_size < 0)
        goto done;
    if (f->parent != NULL) {
        Reader r = {f->parent, end};
        if (!is_nil(&r)) {
            if (read_hash(&r, &d->parent_value) < 0 ||
                (d->parent = PyLong_FromUnsignedLongLong(d->parent_value)) == NULL)
                goto done;
        }
    }
    /* Every field's type is checked before a group is ignored, as msgspec checks them first. */
    int ignored = ignored_group(f->spec_kind, end);
    if (ignored != 0) {
        /* A hybrid model's side group (its `group_idx` named): Python learns the group, whose
         * removals it then ignores (`decode_engine_batch`'s side_groups). */
        verdict = ignored > 0 && has_group == 0 ? 0 : -1;
        goto done;
    }
    /* A token-less store in a lower tier (vLLM's OffloadingConnector): an `EngineOffloaded`, from Python. */
    if (d->tier != device_tier && (f->token_ids == NULL || (f->token_ids_end - f->token_ids == 1 && *f->token_ids == 0x90)))
        goto done;
    if (has_size && (negative || engine_block_size != (uint64_t)block_size))
        goto done; /* block_size_mismatch: named by Python */
    int repeated = repeats(d->values, n, d->parent != NULL, d->parent_value);
    if (repeated != 0) {
        if (repeated < 0)
            PyErr_NoMemory();
        goto done;
    }
    /* The salt: the store's own (vLLM's extra_keys, read on a request's first block only, which has
     * no parent: under one a lone string is a multimodal identifier), else its parent's (a salted
     * request's later blocks); hashed in that namespace instead of the caller's. */
    if (f->extra_keys != NULL && d->parent == NULL && extra_keys_salt(f->extra_keys, end, salts != NULL, &salt) < 0)
        goto done;
    if (salt == NULL && d->parent != NULL && salts != NULL && salts_any(salts)) {
        salt = Py_XNewRef(salts_get(salts, d->parent));
        if (salt == NULL && PyErr_Occurred())
            goto done;
    }
    if (salt != NULL && (salted_seed = PyObject_CallOneArg(namespace_seed_fn, salt)) == NULL)
        goto done;
    d->locals = tokens_hashes(f->token_ids, f->token_ids_end, n, block_size, salted_seed ? salted_seed : seed);
    if (d->locals == NULL)
        goto done;
    verdict = 1;
    for (Py_ssize_t i = 0; salt != NULL && salts->salts != NULL && i < n; i++)
        if (salts_add(salts, PyList_GET_ITEM(d->hashes, i), salt) < 0) {
            verdict = -1;
            break;
        }
done:
    Py_XDECREF(salt);
    Py_XDECREF(salted_seed);
    if (verdict != 1)
        decoded_clear(d);
    return verdict;
}

/* A whole batch read into `Decoded` entries (the ignored ones left out). */
typedef struct {
    PyObject *ts, *rank; /* rank: Py_None when the batch does not name one */
    Decoded *events;
    Py_ssize_t count, ignored;
} Batch;

static void batch_clear(Batch *b) {
    for (Py_ssize_t i = 0; i < b->count; i++)
        decoded_clear(&b->events[i]);
    PyMem_Free(b->events);
    b->events = NULL;
    b->count = 0;
    Py_CLEAR(b->ts);
    Py_CLEAR(b->rank);
}

/* 1: `b` filled (clear it after), 0: not a plain batch (Python decides), -1: an exception set. */
static int read_batch(Reader *r, long block_size, PyObject *seed, Salts *salts, Batch *b) {
    memset(b, 0, sizeof(*b));
    int64_t parts = read_array(r);
    if (parts != 2 && parts != 3)
        return 0;
    /* ts: a float (msgspec's `float` takes ints too, which Python decodes) */
    uint64_t bits;
    if (r->p < r->end && *r->p == 0xcb) {
        r->p++;
        if (read_be(r, 8, &bits) < 0)
            return 0;
        double value;
        memcpy(&value, &bits, 8);
        b->ts = PyFloat_FromDouble(value);
    } else if (r->p < r->end && *r->p == 0xca) {
        r->p++;
        if (read_be(r, 4, &bits) < 0)
            return 0;
        uint32_t narrow = (uint32_t)bits;
        float value;
        memcpy(&value, &narrow, 4);
        b->ts = PyFloat_FromDouble((double)value);
    } else
        return 0;
    if (b->ts == NULL)
        return -1;
    int64_t count = read_array(r);
    if (count < 0 || count > r->end - r->p)
        goto unsupported;
    b->events = PyMem_Calloc((size_t)(count ? count : 1), sizeof(Decoded));
    if (b->events == NULL) {
        PyErr_NoMemory();
        goto failed;
    }
    for (int64_t i = 0; i < count; i++) {
        Fields f = {0};
        if (r->p >= r->end)
            goto unsupported;
        uint8_t head = *r->p;
        int shape = ((head & 0xF0) == 0x80 || head == 0xde || head == 0xdf) ? read_map_event(r, &f)
                    : ((head & 0xF0) == 0x90 || head == 0xdc || head == 0xdd) ? read_array_event(r, &f)
                                                                               : -1;
        if (shape < 0)
            goto unsupported;
        Decoded *d = &b->events[b->count];
        int taken = decode_event(&f, r->end, block_size, seed, salts, d);
        if (taken < 0)
            goto unsupported;
        /* A removal leaves the salts to the caller: the engine may hold another copy of the block. */
        if (taken > 0 && salts != NULL && d->kind == CLEARED && salts_any(salts))
            salts_clear(salts);
        if (taken == 0)
            b->ignored++;
        else
            b->count++;
    }
    if (parts == 3) {
        uint64_t value;
        int negative;
        if (is_nil(r))
            b->rank = Py_NewRef(Py_None);
        else if (read_int(r, &value, &negative) == 0 && !negative && value <= UINT32_MAX)
            b->rank = PyLong_FromUnsignedLongLong(value);
        else
            goto unsupported; /* a rank outside u32 included: Python names it a bad envelope */
    } else
        b->rank = Py_NewRef(Py_None);
    if (b->rank == NULL)
        goto failed;
    if (r->p != r->end)
        goto unsupported; /* trailing bytes: msgspec names them */
    return 1;
unsupported:
    if (PyErr_Occurred())
        goto failed;
    batch_clear(b);
    return 0;
failed:
    batch_clear(b);
    return -1;
}

/* The arguments both entry points start with: (payload, block_size, seed). */
static int batch_arguments(PyObject *const *args, long *block_size, Py_buffer *data) {
    if (!PyLong_Check(args[1]) || !PyLong_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "block_size and seed must be ints");
        return -1;
    }
    if (stored_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "configure() was not called");
        return -1;
    }
    *block_size = PyLong_AsLong(args[1]);
    if (*block_size <= 0 || *block_size > (1L << 24)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return -1;
    }
    return PyObject_GetBuffer(args[0], data, PyBUF_SIMPLE);
}

/* Both entry points' first step: the batch of (payload, block_size, seed) into `b`. As read_batch:
 * -1 with an exception set, 0 when the payload is not a plain batch (Python decides), 1 when read. */
static int read_batch_arguments(PyObject *const *args, Salts *salts, Batch *b) {
    long block_size;
    Py_buffer data;
    if (batch_arguments(args, &block_size, &data) < 0)
        return -1;
    Reader r = {(const uint8_t *)data.buf, (const uint8_t *)data.buf + data.len};
    int read = read_batch(&r, block_size, args[2], salts, b);
    PyBuffer_Release(&data);
    return read;
}

/* The decoded event of `d` (a new reference). */
static PyObject *event_object(Decoded *d, PyObject *block_size_obj) {
    if (d->kind == CLEARED)
        return Py_NewRef(cleared_event);
    if (d->kind == REMOVED) {
        PyObject *items[] = {d->hashes, d->tier};
        return named_tuple(removed_type, items, 2);
    }
    PyObject *items[] = {d->parent != NULL ? d->parent : Py_None, d->hashes, d->locals, d->tier, block_size_obj};
    return named_tuple(stored_type, items, 5);
}

/* decode_batch(payload, block_size, seed, salts=None) -> (ts, dp_rank, events, ignored) | None; `salts`
 * (block hash -> cache salt) is read and, when the batch is taken, changed as Python changes it. */
static PyObject *py_decode_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "decode_batch(payload, block_size, seed, salts=None)");
        return NULL;
    }
    Salts salts = {NULL, NULL, 0};
    if (nargs == 4 && args[3] != Py_None) {
        if (!PyDict_CheckExact(args[3])) {
            PyErr_SetString(PyExc_TypeError, "salts must be a dict or None");
            return NULL;
        }
        salts.salts = args[3];
    }
    Batch b;
    int read = read_batch_arguments(args, &salts, &b);
    if (read > 0 && salts_commit(&salts) < 0) {
        batch_clear(&b);
        read = -1;
    }
    Py_CLEAR(salts.added);
    if (read <= 0)
        return read < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *events = PyList_New(b.count), *result = NULL;
    if (events == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < b.count; i++) {
        PyObject *event = event_object(&b.events[i], args[1]);
        if (event == NULL)
            goto done;
        PyList_SET_ITEM(events, i, event);
    }
    result = Py_BuildValue("(OOOn)", b.ts, b.rank, events, b.ignored);
done:
    Py_XDECREF(events);
    batch_clear(&b);
    return result;
}

/* configure(stored_type, removed_type, cleared_event, tiers_by_medium, device_tier, pack_tokens, block_hashes,
 *           namespace_seed) */
static PyObject *py_configure(PyObject *self, PyObject *args) {
    PyObject *s, *rm, *c, *t, *d, *pack, *hashes, *seeds;
    if (!PyArg_ParseTuple(args, "OOOO!OOOO", &s, &rm, &c, &PyDict_Type, &t, &d, &pack, &hashes, &seeds))
        return NULL;
    Py_XSETREF(namespace_seed_fn, Py_NewRef(seeds));
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

/* hold_chain(held, parent, block_hashes, tokens_hashes, device) -> 0 | 1 | 2 | 3 | 4
 *
 * `HeldBlocks.store`'s checks and update: 1 a device store under a parent not held, 2 a chain that
 * holds its parent, 3 a chain that repeats a hash, 4 a chain with a block already held (nothing
 * recorded then); 0 recorded, each block under the one before it. ValueError when the two lists differ in length. */
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
        PyObject *item = PySequence_Fast_GET_ITEM(hashes, i);
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

static int record_chain(PyObject *held, PyObject *parent, PyObject *hashes, PyObject *locals);

/* `hold_chain` on its checked arguments: the code it returns, or -1 with an exception set. */
static int hold(PyObject *held, PyObject *parent, PyObject *hashes, PyObject *locals, int device) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    if (parent != Py_None && device) {
        int found = PyDict_Contains(held, parent);
        if (found <= 0)
            return found < 0 ? -1 : 1;
    }
    int conflict = chain_conflict_u64(parent, hashes, n);
    if (conflict < 0) {
        conflict = 0;
        if (parent != Py_None) {
            int inside = PySequence_Contains(hashes, parent);
            if (inside < 0)
                return -1;
            conflict = inside ? 2 : 0;
        }
        if (conflict == 0) {
            PyObject *unique = PySet_New(hashes);
            if (unique == NULL)
                return -1;
            conflict = PySet_GET_SIZE(unique) != n ? 3 : 0;
            Py_DECREF(unique);
        }
    }
    if (conflict == 2)
        return 2;
    if (PySequence_Fast_GET_SIZE(locals) != n) {
        PyErr_Format(PyExc_ValueError, "%zd block hashes but %zd tokens hashes", n, PySequence_Fast_GET_SIZE(locals));
        return -1;
    }
    if (conflict == 3)
        return 3;
    return record_chain(held, parent, hashes, locals);
}

/* Each block of the chain held under the one before it (the first under `parent`); -1: an error; 4: a
 * block already held (another copy: vLLM does not share physical blocks), the chain left unrecorded
 * for Python to count the copy. One dict operation per block, the test included. */
static int record_chain(PyObject *held, PyObject *parent, PyObject *hashes, PyObject *locals) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    PyObject *previous = parent;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *block = PySequence_Fast_GET_ITEM(hashes, i);
        PyObject *entry = PyTuple_Pack(2, previous, PySequence_Fast_GET_ITEM(locals, i));
        if (entry == NULL)
            return -1;
        /* Two ints (or None and an int) can hold no cycle: untracked now, as the collector would
         * untrack them at its first pass, so what a worker holds never weighs on collections. */
        if (PyLong_CheckExact(PyTuple_GET_ITEM(entry, 1)) && (previous == Py_None || PyLong_CheckExact(previous)))
            PyObject_GC_UnTrack(entry);
        PyObject *kept = PyDict_SetDefault(held, block, entry); /* borrowed */
        Py_DECREF(entry);
        if (kept == NULL)
            return -1;
        if (kept != entry) { /* held already: the blocks before it were new, and are taken back */
            for (Py_ssize_t j = 0; j < i; j++)
                if (PyDict_DelItem(held, PySequence_Fast_GET_ITEM(hashes, j)) < 0)
                    return -1;
            return 4;
        }
        previous = block;
    }
    return 0;
}

static PyObject *py_hold_chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyDict_Check(args[0]) || !PyList_Check(args[2]) || !PyList_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "hold_chain(held: dict, parent, block_hashes: list, tokens_hashes: list, device)");
        return NULL;
    }
    int device = PyObject_IsTrue(args[4]);
    if (device < 0)
        return NULL;
    /* The checks and the dict calls may run a key's `__eq__` or `__hash__`, which may change the lists:
     * they are read from a copy taken now, which also keeps each block alive while it is the next one's
     * parent. */
    PyObject *hashes = PyList_AsTuple(args[2]), *locals = PyList_AsTuple(args[3]);
    int code = hashes == NULL || locals == NULL ? -1 : hold(args[0], args[1], hashes, locals, device);
    Py_XDECREF(hashes);
    Py_XDECREF(locals);
    return code < 0 ? NULL : PyLong_FromLong(code);
}

/* `drop_blocks` on a list or tuple: hashes not held are ignored. A key's `__eq__` (or a value's
 * finaliser) may change the list: as the twin's `map(held.pop, hashes, repeat(None, n))`, the first
 * `n` hashes at most, its length read again at each step, each held while it is popped. */
static int drop(PyObject *held, PyObject *hashes) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    for (Py_ssize_t i = 0; i < n && i < PySequence_Fast_GET_SIZE(hashes); i++) {
        PyObject *item = Py_NewRef(PySequence_Fast_GET_ITEM(hashes, i));
        int failed = PyDict_DelItem(held, item) < 0;
        Py_DECREF(item);
        if (failed) {
            if (!PyErr_ExceptionMatches(PyExc_KeyError))
                return -1;
            PyErr_Clear();
        }
    }
    return 0;
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
    int failed = drop(args[0], hashes);
    Py_DECREF(hashes);
    if (failed < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ one batch, decode to payload bytes */

static inline uint8_t *put_bytes(uint8_t *out, PyObject *bytes) {
    memcpy(out, PyBytes_AS_STRING(bytes), (size_t)PyBytes_GET_SIZE(bytes));
    return out + PyBytes_GET_SIZE(bytes);
}

/* The u64 of an int: -1 with OverflowError set if it is not one. */
static int u64_of(PyObject *value, uint64_t *out) {
    *out = PyLong_AsUnsignedLongLong(value);
    return *out == (uint64_t)-1 && PyErr_Occurred() ? -1 : 0;
}

/* A tokens hash as u64: `block_hashes` makes them with XXH3-64, so the masked read (digit by digit,
 * where the checked one goes through a byte array) is exact. */
static inline uint64_t tokens_u64(PyObject *value) { return PyLong_AsUnsignedLongLongMask(value); }

/* The stored event's bytes: `StoredEventEncoder.encode`'s template (four literals, then which of
 * event id, parent, blocks fills each slot) filled with the rows `row` (three literals) frames. */
static PyObject *encode_stored(PyObject *template, PyObject *row, uint64_t event_id, Decoded *d) {
    Py_ssize_t n = PyList_GET_SIZE(d->hashes), literals = 0, row_size = 18;
    for (int i = 0; i < 4; i++)
        literals += PyBytes_GET_SIZE(PyTuple_GET_ITEM(template, i));
    for (int i = 0; i < 3; i++)
        row_size += PyBytes_GET_SIZE(PyTuple_GET_ITEM(row, i));
    if (n > (PY_SSIZE_T_MAX - literals - 23) / row_size)
        return PyErr_NoMemory();
    uint8_t *start = scratch_new(literals + 23 + n * row_size), *out = start;
    if (start == NULL)
        return NULL;
    for (int slot = 0; slot < 4; slot++) {
        out = put_bytes(out, PyTuple_GET_ITEM(template, slot));
        if (slot == 3)
            break;
        long which = PyLong_AsLong(PyTuple_GET_ITEM(template, 4 + slot));
        if (which == 0)
            out = put_uint(out, event_id);
        else if (which == 1 && d->parent == NULL)
            *out++ = 0xc0;
        else if (which == 1)
            out = put_uint(out, d->parent_value);
        else {
            out = put_array_header(out, n);
            for (Py_ssize_t i = 0; i < n; i++) {
                out = put_uint(put_bytes(out, PyTuple_GET_ITEM(row, 0)), d->values[i]);
                out = put_uint(put_bytes(out, PyTuple_GET_ITEM(row, 1)), tokens_u64(PyList_GET_ITEM(d->locals, i)));
                out = put_bytes(out, PyTuple_GET_ITEM(row, 2));
            }
        }
    }
    return scratch_bytes(start, out);
}

/* The removed event's bytes: `RemovedEventEncoder.encode`'s three literals around the event id and
 * the hashes. */
static PyObject *encode_removed(PyObject *template, uint64_t event_id, Decoded *d) {
    Py_ssize_t n = PyList_GET_SIZE(d->hashes), literals = 0;
    for (int i = 0; i < 3; i++)
        literals += PyBytes_GET_SIZE(PySequence_Fast_GET_ITEM(template, i));
    if (n > (PY_SSIZE_T_MAX - literals - 14) / 9)
        return PyErr_NoMemory();
    uint8_t *start = scratch_new(literals + 14 + n * 9), *out = start;
    if (start == NULL)
        return NULL;
    out = put_uint(put_bytes(out, PySequence_Fast_GET_ITEM(template, 0)), event_id);
    out = put_array_header(put_bytes(out, PySequence_Fast_GET_ITEM(template, 1)), n);
    for (Py_ssize_t i = 0; i < n; i++)
        out = put_uint(out, d->values[i]);
    out = put_bytes(out, PySequence_Fast_GET_ITEM(template, 2));
    return scratch_bytes(start, out);
}

/* Whether a stored template's three slots (items 4-6) each name what `encode_stored` writes there:
 * 0 the event id, 1 the parent, 2 the blocks. */
static int stored_slots(PyObject *template) {
    for (Py_ssize_t i = 4; i < 7; i++) {
        PyObject *slot = PyTuple_GET_ITEM(template, i);
        if (!PyLong_CheckExact(slot))
            return 0;
        int overflow;
        long which = PyLong_AsLongAndOverflow(slot, &overflow);
        if (overflow || which < 0 || which > 2)
            return 0;
    }
    return 1;
}

/* Whether the first `count` items of a tuple or list are bytes. */
static int bytes_items(PyObject *sequence, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++)
        if (!PyBytes_Check(PySequence_Fast_GET_ITEM(sequence, i)))
            return 0;
    return 1;
}

/* `TokensHashCheck.observe` of the store `d`: appends (known_hash, block_hash, tokens_hash, parent,
 * known_tokens) to `found` when the store contradicts an earlier one. 0, or -1 with an exception. */
static int observe(PyObject *by_content, PyObject *by_hash, Py_ssize_t max_recorded, Decoded *d, PyObject *found) {
    if (PyList_GET_SIZE(d->hashes) == 0)
        return 0;
    PyObject *block = PyList_GET_ITEM(d->hashes, 0), *tokens = PyList_GET_ITEM(d->locals, 0);
    PyObject *parent = d->parent != NULL ? d->parent : Py_None;
    if (PyDict_GET_SIZE(by_hash) >= max_recorded) {
        PyDict_Clear(by_content);
        PyDict_Clear(by_hash);
    }
    PyObject *key = PyTuple_Pack(2, parent, tokens);
    if (key == NULL)
        return -1;
    /* None or an int and an int: no cycle. Untracked, the record's keys (up to `max_recorded`) never
     * count towards a full collection, which would stop the bridge for tens of ms once they added up
     * (the Python path's keys are untracked only by a collection that looks at them). */
    PyObject_GC_UnTrack(key);
    PyObject *known_hash = PyDict_SetDefault(by_content, key, block); /* borrowed */
    Py_DECREF(key);
    if (known_hash == NULL)
        return -1;
    Py_INCREF(known_hash);
    PyObject *known_tokens = PyDict_SetDefault(by_hash, block, tokens);
    int verdict = known_tokens == NULL ? -1 : 0;
    if (verdict == 0) {
        int same_hash = PyObject_RichCompareBool(known_hash, block, Py_EQ);
        int same_tokens = same_hash < 0 ? -1 : PyObject_RichCompareBool(known_tokens, tokens, Py_EQ);
        if (same_hash < 0 || same_tokens < 0)
            verdict = -1;
        else if (!same_hash || !same_tokens) {
            PyObject *evidence = PyTuple_Pack(5, known_hash, block, tokens, parent, known_tokens);
            verdict = evidence == NULL || PyList_Append(found, evidence) < 0 ? -1 : 0;
            Py_XDECREF(evidence);
        }
    }
    Py_DECREF(known_hash);
    return verdict;
}

/* bridge_batch(payload, block_size, seed, default_rank, next_event_id, held, stored_templates,
 *              removed_templates, row, by_content, by_hash, max_recorded)
 *   -> (dp_rank, applied, events, ignored, contradictions, numbered) | None
 *
 * One engine batch from its bytes to the publisher's encoded events, what `decode_batch`, the
 * stream's hash check and `KvEventPublisher.emit_engine_events` do in Python: decoded, each store's
 * first block checked against the engine's hashes (`by_content`, `by_hash`: `TokensHashCheck`),
 * held (`held`: `HeldBlocks`' dicts by (rank, tier)), numbered from the id `next_event_id(rank)`
 * gives (the publisher's public method; None: the rank has no log yet) and encoded into the
 * encoders' templates by (rank, tier). `numbered` is each event's (id, bytes): the publisher keeps
 * them (its ring, its last id, its open message), so its state stays its own. None, with nothing
 * changed, for what the Python code must do: a batch `decode_batch` would not take, a clear, a rank
 * or a template not made yet. A store refused by what the rank holds stops the batch: `applied` <
 * `events` says from which decoded event on Python carries on (that store refused again, nothing of
 * it recorded). */
static PyObject *py_bridge_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 12 || !PyCallable_Check(args[4]) || !PyDict_Check(args[5]) || !PyDict_Check(args[6]) ||
        !PyDict_Check(args[7]) || !PyTuple_Check(args[8]) || PyTuple_GET_SIZE(args[8]) != 3 ||
        !bytes_items(args[8], 3) || !PyDict_Check(args[9]) || !PyDict_Check(args[10])) {
        PyErr_SetString(PyExc_TypeError, "bridge_batch(payload, block_size, seed, default_rank, next_event_id, "
                                         "held: dict, stored_templates: dict, removed_templates: dict, row: tuple, "
                                         "by_content: dict, by_hash: dict, max_recorded)");
        return NULL;
    }
    Py_ssize_t max_recorded = PyLong_AsSsize_t(args[11]);
    if (max_recorded == -1 && PyErr_Occurred())
        return NULL;
    Batch b;
    int read = read_batch_arguments(args, NULL, &b);
    if (read <= 0)
        return read < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *rank = b.rank == Py_None ? args[3] : b.rank; /* borrowed from either */
    PyObject **templates = NULL, **keys = NULL, *found = NULL, *result = NULL, *numbered = NULL;
    PyObject *next_obj = NULL;
    Py_ssize_t applied = 0;
    if (b.count == 0) {
        result = Py_BuildValue("(OnnnNN)", rank, (Py_ssize_t)0, (Py_ssize_t)0, b.ignored, PyList_New(0), PyList_New(0));
        goto done;
    }
    templates = PyMem_Calloc((size_t)b.count, sizeof(PyObject *));
    keys = PyMem_Calloc((size_t)b.count, sizeof(PyObject *));
    if (templates == NULL || keys == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* Everything the Python code must do first is found before anything changes. */
    for (Py_ssize_t i = 0; i < b.count; i++) {
        Decoded *d = &b.events[i];
        if (d->kind == CLEARED)
            goto not_taken;
        if ((keys[i] = PyTuple_Pack(2, rank, d->tier)) == NULL)
            goto done;
        PyObject *template = PyDict_GetItemWithError(d->kind == STORED ? args[6] : args[7], keys[i]);
        if (template == NULL) {
            if (PyErr_Occurred())
                goto done;
            goto not_taken;
        }
        /* A stored template: a tuple of four literals and three slots; a removed one: three literals. */
        int shaped = d->kind == STORED ? PyTuple_Check(template) && PyTuple_GET_SIZE(template) == 7 &&
                                             bytes_items(template, 4) && stored_slots(template)
                                       : (PyTuple_Check(template) || PyList_Check(template)) &&
                                             PySequence_Fast_GET_SIZE(template) == 3 && bytes_items(template, 3);
        if (!shaped) {
            PyErr_SetString(PyExc_TypeError, "an encoder template is not its literals and slots");
            goto done;
        }
        templates[i] = Py_NewRef(template);
        /* What a rank and tier hold is a dict (`HeldBlocks`'): read with the dict macros below. */
        PyObject *held = PyDict_GetItemWithError(args[5], keys[i]); /* borrowed */
        if (held == NULL ? PyErr_Occurred() != NULL : !PyDict_Check(held)) {
            if (held != NULL)
                PyErr_SetString(PyExc_TypeError, "held: what a rank and tier hold is not a dict");
            goto done;
        }
    }
    if ((next_obj = PyObject_CallOneArg(args[4], rank)) == NULL)
        goto done;
    if (next_obj == Py_None)
        goto not_taken;
    uint64_t next;
    if (u64_of(next_obj, &next) < 0 || (numbered = PyList_New(0)) == NULL || (found = PyList_New(0)) == NULL)
        goto done;
    uint64_t last = next - 1;
    for (Py_ssize_t i = 0; i < b.count; i++)
        if (b.events[i].kind == STORED && observe(args[9], args[10], max_recorded, &b.events[i], found) < 0)
            goto done;
    for (; applied < b.count; applied++) {
        Decoded *d = &b.events[applied];
        PyObject *held = PyDict_GetItemWithError(args[5], keys[applied]), *encoded; /* borrowed */
        if (held == NULL && PyErr_Occurred())
            goto done;
        if (d->kind == STORED) {
            if (held == NULL) {
                held = PyDict_New();
                if (held == NULL || PyDict_SetItem(args[5], keys[applied], held) < 0) {
                    Py_XDECREF(held);
                    goto done;
                }
                Py_DECREF(held); /* the dict of `held` keeps it */
            }
            /* The decoder refused chains that repeat a hash or hold their parent: a parent not held
             * is the one refusal left. */
            if (d->parent != NULL && d->tier == device_tier) {
                int found = PyDict_Contains(held, d->parent);
                if (found < 0)
                    goto done;
                if (!found)
                    break; /* refused: Python names it */
            }
            int recorded = record_chain(held, d->parent != NULL ? d->parent : Py_None, d->hashes, d->locals);
            if (recorded < 0)
                goto done;
            if (recorded)
                break; /* a copy of a held block: Python counts it (`HeldBlocks.store`) */
            encoded = encode_stored(templates[applied], args[8], last + 1, d);
        } else {
            if (held != NULL && PyDict_GET_SIZE(held) > 0 &&
                drop(held, d->hashes) < 0)
                goto done;
            encoded = encode_removed(templates[applied], last + 1, d);
        }
        if (encoded == NULL)
            goto done;
        last++;
        PyObject *entry = Py_BuildValue("(KN)", (unsigned long long)last, encoded);
        if (entry != NULL)
            PyObject_GC_UnTrack(entry); /* an int and bytes: no cycle, no weight on collections */
        int failed = entry == NULL || PyList_Append(numbered, entry) < 0;
        Py_XDECREF(entry);
        if (failed)
            goto done;
    }
    result = Py_BuildValue("(OnnnOO)", rank, applied, b.count, b.ignored, found, numbered);
    goto done;
not_taken:
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; templates != NULL && i < b.count; i++) {
        Py_XDECREF(templates[i]);
        Py_XDECREF(keys[i]);
    }
    PyMem_Free(templates);
    PyMem_Free(keys);
    Py_XDECREF(found);
    Py_XDECREF(numbered);
    Py_XDECREF(next_obj);
    batch_clear(&b);
    return result;
}

/* ------------------------------------------------------------------ module */

static PyMethodDef methods[] = {
    {"configure", py_configure, METH_VARARGS,
     "configure(stored_type, removed_type, cleared_event, tiers_by_medium, device_tier, pack_tokens, block_hashes, "
     "namespace_seed)."},
    {"decode_batch", (PyCFunction)(void (*)(void))py_decode_batch, METH_FASTCALL,
     "decode_batch(payload, block_size, seed, salts=None) -> (ts, dp_rank, events, ignored) | None: a plain engine "
     "batch."},
    {"hold_chain", (PyCFunction)(void (*)(void))py_hold_chain, METH_FASTCALL,
     "hold_chain(held, parent, block_hashes, tokens_hashes, device) -> 0 | 1 | 2 | 3 | 4: HeldBlocks.store."},
    {"drop_blocks", (PyCFunction)(void (*)(void))py_drop_blocks, METH_FASTCALL,
     "drop_blocks(held, block_hashes) -> None: HeldBlocks.remove (hashes not held are ignored)."},
    {"bridge_batch", (PyCFunction)(void (*)(void))py_bridge_batch, METH_FASTCALL,
     "bridge_batch(payload, block_size, seed, default_rank, next_event_id, held, stored_templates, removed_templates, "
     "row, by_content, by_hash, max_recorded) -> (dp_rank, applied, events, ignored, contradictions, numbered) | None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "indexer._events_native",
    "The engine bridge's decode and hold steps in C (see indexer/engine_events.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__events_native(void) { return PyModule_Create(&module); }
