/* indexer._native: the per-block inner loops of kv-router in C (optional accelerator).
 *
 * Everything here has a pure-Python twin that gives the same answers bit for bit (`indexer/native.py`
 * chooses; the tests compare both): XXH3-64 from xxHash's official header, Dynamo's block and
 * sequence hashes over packed little-endian u32 tokens, token lists to packed u32, the radix tree's
 * node type with its store, match and removal loops, the u64 check of decoded stored blocks, and the
 * msgpack encodings of the event paths. The router's and the HTTP front's loops are router/_native.c
 * and api/_native.c (each layer its own extension).
 *
 * Guardrail: a function that meets input it was not written for returns None (or raises the same
 * exception class as the Python path), so the caller can fall back to Python for the exact error.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include "_msgpack_write.h"

/* ------------------------------------------------------------------ XXH3-64 (the official xxhash.h)
 *
 * xxHash's single header (BSD-2-Clause, vendor/xxhash/LICENSE), as shipped in the `xxhash` package's
 * sdist, every function inlined into this module (no symbol exported, no library linked). */

#define XXH_INLINE_ALL
#include "vendor/xxhash/xxhash.h"

static inline uint64_t xxh3_64(const uint8_t *in, size_t len, uint64_t seed) {
    return (uint64_t)XXH3_64bits_withSeed(in, len, (XXH64_hash_t)seed);
}

static inline void write64(uint8_t *p, uint64_t v) {
#if PY_BIG_ENDIAN
    v = __builtin_bswap64(v);
#endif
    memcpy(p, &v, 8);
}

/* The sequence-hash step: XXH3-64(le64(previous) || le64(local), seed). */
static inline uint64_t chain_step(uint64_t previous, uint64_t local, uint64_t seed) {
    uint8_t pair[16];
    write64(pair, previous);
    write64(pair + 8, local);
    return xxh3_64(pair, 16, seed);
}

/* ------------------------------------------------------------------ helpers */

/* 2^64, the first int past u64 (set at import). */
static PyObject *u64_end;

/* A u64 from a Python int; -1 with an exception set (OverflowError, TypeError) otherwise.
 *
 * On CPython 3.11 the digits of a small exact int are read directly: the one read of an object's
 * internals left in this file, because no public call does it at that cost (through
 * PyLong_AsLongLongAndOverflow and a comparison with 2^64 the index's store and removal run 11% more
 * instructions, through PyLong_AsUnsignedLongLong's byte array 15%: callgrind, one 100k-block
 * workload). From 3.12 on, ints are laid out otherwise and the public calls below run. Values below
 * 2^63 go through PyLong_AsLongLongAndOverflow (a loop over the digits); those above as their low 64
 * bits (PyLong_AsUnsignedLongLongMask, the same loop) once compared with 2^64. */
static int as_u64(PyObject *value, uint64_t *out) {
#if PY_VERSION_HEX < 0x030C0000 && PyLong_SHIFT == 30
    if (PyLong_CheckExact(value)) {
        const digit *d = ((PyLongObject *)value)->ob_digit;
        switch (Py_SIZE(value)) {
        case 0:
            *out = 0;
            return 0;
        case 1:
            *out = d[0];
            return 0;
        case 2:
            *out = (uint64_t)d[0] | ((uint64_t)d[1] << 30);
            return 0;
        case 3:
            if (d[2] < 16) {
                *out = (uint64_t)d[0] | ((uint64_t)d[1] << 30) | ((uint64_t)d[2] << 60);
                return 0;
            }
            break;
        default:
            break;
        }
    }
#endif
    if (!PyLong_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "expected an int");
        return -1;
    }
    int overflow;
    long long small = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow == 0 && small >= 0) {
        *out = (uint64_t)small;
        return 0;
    }
    if (overflow > 0) {
        int below = PyObject_RichCompareBool(value, u64_end, Py_LT);
        if (below < 0)
            return -1;
        if (below) {
            *out = (uint64_t)PyLong_AsUnsignedLongLongMask(value);
            return 0;
        }
        PyErr_SetString(PyExc_OverflowError, "int too big to convert");
        return -1;
    }
    if (small == -1 && PyErr_Occurred())
        return -1;
    PyErr_SetString(PyExc_OverflowError, "can't convert negative int to unsigned");
    return -1;
}

/* The two hash fields of a stored block (msgspec structs keep fields in slots): read through the
 * slots' member descriptors of the block's type (`PyMember_GetOne`), resolved once per type, else by
 * attribute. New references. */
static PyObject *str_block_hash, *str_tokens_hash;
static PyTypeObject *block_type;
static PyObject *block_hash_descr, *tokens_hash_descr; /* keep the members below alive */
static PyMemberDef *block_hash_member, *tokens_hash_member;

/* The slot member `name` of `type` (a new reference to its descriptor), or NULL: no error set. */
static PyObject *slot_member(PyTypeObject *type, PyObject *name) {
    PyObject *descr = PyObject_GetAttr((PyObject *)type, name);
    if (descr == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (!Py_IS_TYPE(descr, &PyMemberDescr_Type) || ((PyMemberDescrObject *)descr)->d_member->type != T_OBJECT_EX) {
        Py_DECREF(descr);
        return NULL;
    }
    return descr;
}

static int block_hashes_of(PyObject *block, PyObject **block_hash, PyObject **tokens_hash) {
    PyTypeObject *type = Py_TYPE(block);
    if (type != block_type) {
        PyObject *b = slot_member(type, str_block_hash), *t = slot_member(type, str_tokens_hash);
        if (b != NULL && t != NULL) {
            Py_XSETREF(block_type, (PyTypeObject *)Py_NewRef(type));
            Py_XSETREF(block_hash_descr, b);
            Py_XSETREF(tokens_hash_descr, t);
            block_hash_member = ((PyMemberDescrObject *)b)->d_member;
            tokens_hash_member = ((PyMemberDescrObject *)t)->d_member;
        } else {
            Py_XDECREF(b);
            Py_XDECREF(t);
        }
    }
    if (type == block_type) {
        *block_hash = PyMember_GetOne((const char *)block, block_hash_member);
        if (*block_hash == NULL)
            return -1;
        *tokens_hash = PyMember_GetOne((const char *)block, tokens_hash_member);
        if (*tokens_hash == NULL) {
            Py_CLEAR(*block_hash);
            return -1;
        }
        return 0;
    }
    *block_hash = PyObject_GetAttr(block, str_block_hash);
    if (*block_hash == NULL)
        return -1;
    *tokens_hash = PyObject_GetAttr(block, str_tokens_hash);
    if (*tokens_hash == NULL) {
        Py_CLEAR(*block_hash);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ hashing entry points */

static PyObject *py_xxh3_64(PyObject *self, PyObject *args) {
    Py_buffer data;
    unsigned long long seed = 0;
    if (!PyArg_ParseTuple(args, "y*|K", &data, &seed))
        return NULL;
    uint64_t h = xxh3_64((const uint8_t *)data.buf, (size_t)data.len, seed);
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLongLong(h);
}

/* block_hashes(packed, seed, stride, window) -> list[int]: XXH3 of every full window, one per stride. */
static PyObject *py_block_hashes(PyObject *self, PyObject *args) {
    Py_buffer data;
    unsigned long long seed;
    Py_ssize_t stride, window;
    if (!PyArg_ParseTuple(args, "y*Knn", &data, &seed, &stride, &window))
        return NULL;
    if (stride <= 0 || window < stride) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "stride must be positive and the window at least one stride");
        return NULL;
    }
    Py_ssize_t count = data.len >= window ? (data.len - window) / stride + 1 : 0;
    PyObject *list = PyList_New(count);
    if (list == NULL) {
        PyBuffer_Release(&data);
        return NULL;
    }
    const uint8_t *base = (const uint8_t *)data.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyLong_FromUnsignedLongLong(xxh3_64(base + i * stride, (size_t)window, seed));
        if (item == NULL) {
            Py_DECREF(list);
            PyBuffer_Release(&data);
            return NULL;
        }
        PyList_SET_ITEM(list, i, item);
    }
    PyBuffer_Release(&data);
    return list;
}

/* pack_u32(tokens) -> bytes | None: a sequence of ints in [0, 2^32) as packed little-endian u32;
 * None if an item is not such an int (the caller's Python path names it). */
static PyObject *py_pack_u32(PyObject *self, PyObject *seq) {
    PyObject *fast = PySequence_Fast(seq, "tokens must be a sequence");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out == NULL) {
        Py_DECREF(fast);
        return NULL;
    }
    uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t value;
        if (as_u64(items[i], &value) < 0 || value > 0xFFFFFFFFULL) {
            PyErr_Clear();
            Py_DECREF(out);
            Py_DECREF(fast);
            Py_RETURN_NONE;
        }
        dst[0] = (uint8_t)value;
        dst[1] = (uint8_t)(value >> 8);
        dst[2] = (uint8_t)(value >> 16);
        dst[3] = (uint8_t)(value >> 24);
        dst += 4;
    }
    Py_DECREF(fast);
    return out;
}

/* sequence_hashes(local_hashes, seed) -> tuple[int, ...]; raises OverflowError / TypeError on a
 * value that is not a u64 (the caller reports it as Python does). */
static PyObject *py_sequence_hashes(PyObject *self, PyObject *args) {
    PyObject *seq;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "OK", &seq, &seed))
        return NULL;
    PyObject *fast = PySequence_Fast(seq, "block hashes must be a sequence");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    PyObject *out = PyTuple_New(n);
    if (out == NULL) {
        Py_DECREF(fast);
        return NULL;
    }
    uint64_t previous = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t local;
        if (as_u64(items[i], &local) < 0) {
            Py_DECREF(out);
            Py_DECREF(fast);
            return NULL;
        }
        previous = i ? chain_step(previous, local, seed) : local;
        PyObject *item = PyLong_FromUnsignedLongLong(previous);
        if (item == NULL) {
            Py_DECREF(out);
            Py_DECREF(fast);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, item);
    }
    Py_DECREF(fast);
    return out;
}

/* ------------------------------------------------------------------ the radix tree's node */

typedef struct {
    PyObject_HEAD
    uint64_t block_hash;
    uint64_t local_hash;
    PyObject *parent;   /* Node or None */
    uint64_t mask;      /* the owners bitmask over slots while it fits in 64 bits (wide is NULL) */
    PyObject *wide;     /* the owners as an int when a slot of 64 or more owns the node, else NULL */
    PyObject *children; /* None, the only child (a Node), or a dict local_hash -> Node */
} NodeObject;

static PyTypeObject NodeType;

#define Node_Check(op) Py_IS_TYPE(op, &NodeType)

/* Not tracked by the cyclic GC, as the Python node is not: the tree dismantles its links itself. */
static void Node_dealloc(NodeObject *self) {
    Py_XDECREF(self->parent);
    Py_XDECREF(self->wide);
    Py_XDECREF(self->children);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static NodeObject *node_new(uint64_t block_hash, uint64_t local_hash, PyObject *parent, uint64_t mask) {
    NodeObject *node = PyObject_New(NodeObject, &NodeType);
    if (node == NULL)
        return NULL;
    node->block_hash = block_hash;
    node->local_hash = local_hash;
    Py_INCREF(parent);
    node->parent = parent;
    node->mask = mask;
    node->wide = NULL;
    Py_INCREF(Py_None);
    node->children = Py_None;
    return node;
}

/* The owners as an int (a new reference). */
static PyObject *node_owners(NodeObject *node) {
    return node->wide != NULL ? Py_NewRef(node->wide) : PyLong_FromUnsignedLongLong(node->mask);
}

/* Set the owners from an int: kept as a machine word whenever it fits in one. */
static int node_set_owners(NodeObject *node, PyObject *owners) {
    if (!PyLong_Check(owners)) {
        PyErr_SetString(PyExc_TypeError, "owners must be an int");
        return -1;
    }
    uint64_t mask;
    if (as_u64(owners, &mask) == 0) {
        node->mask = mask;
        Py_CLEAR(node->wide);
        return 0;
    }
    PyErr_Clear();
    node->mask = 0;
    Py_XSETREF(node->wide, Py_NewRef(owners));
    return 0;
}

/* Whether `bit` (an int, `bit_value` when below 64) is among the owners: 1, 0, or -1 on error. */
static int node_owned_by(NodeObject *node, PyObject *bit, uint64_t bit_value) {
    if (node->wide == NULL)
        return (node->mask & bit_value) != 0;
    PyObject *shared = PyNumber_And(node->wide, bit);
    if (shared == NULL)
        return -1;
    int owned = PyObject_IsTrue(shared);
    Py_DECREF(shared);
    return owned;
}

/* owners | bit, or owners ^ bit to drop a bit the node has. */
static int node_combine_owners(NodeObject *node, PyObject *bit, uint64_t bit_value, int add) {
    if (node->wide == NULL && bit_value) {
        node->mask = add ? node->mask | bit_value : node->mask & ~bit_value;
        return 0;
    }
    PyObject *owners = node_owners(node);
    if (owners == NULL)
        return -1;
    PyObject *combined = add ? PyNumber_Or(owners, bit) : PyNumber_Xor(owners, bit);
    Py_DECREF(owners);
    if (combined == NULL)
        return -1;
    int status = node_set_owners(node, combined);
    Py_DECREF(combined);
    return status;
}

static PyObject *Node_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"block_hash", "local_hash", "parent", "owners", "children", NULL};
    PyObject *block, *local, *parent, *owners, *children = Py_None;
    uint64_t block_hash, local_hash;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO|O", kwlist, &block, &local, &parent, &owners, &children))
        return NULL;
    if (as_u64(block, &block_hash) < 0 || as_u64(local, &local_hash) < 0)
        return NULL;
    NodeObject *node = node_new(block_hash, local_hash, parent, 0);
    if (node == NULL)
        return NULL;
    if (node_set_owners(node, owners) < 0) {
        Py_DECREF(node);
        return NULL;
    }
    Py_INCREF(children);
    Py_SETREF(node->children, children);
    return (PyObject *)node;
}

static PyObject *Node_get_block_hash(NodeObject *self, void *closure) {
    return PyLong_FromUnsignedLongLong(self->block_hash);
}

static PyObject *Node_get_local_hash(NodeObject *self, void *closure) {
    return PyLong_FromUnsignedLongLong(self->local_hash);
}

static int Node_set_object(NodeObject *self, PyObject *value, PyObject **slot, const char *name) {
    if (value == NULL) {
        PyErr_Format(PyExc_AttributeError, "cannot delete %s", name);
        return -1;
    }
    Py_INCREF(value);
    Py_SETREF(*slot, value);
    return 0;
}

static PyObject *Node_get_parent(NodeObject *self, void *closure) { return Py_NewRef(self->parent); }
static PyObject *Node_get_owners(NodeObject *self, void *closure) { return node_owners(self); }
static PyObject *Node_get_children(NodeObject *self, void *closure) { return Py_NewRef(self->children); }
static int Node_set_parent(NodeObject *self, PyObject *v, void *c) { return Node_set_object(self, v, &self->parent, "parent"); }
static int Node_set_owners(NodeObject *self, PyObject *v, void *c) {
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete owners");
        return -1;
    }
    return node_set_owners(self, v);
}
static int Node_set_children(NodeObject *self, PyObject *v, void *c) {
    return Node_set_object(self, v, &self->children, "children");
}

static PyObject *Node_repr(NodeObject *self) {
    PyObject *mask = node_owners(self);
    if (mask == NULL)
        return NULL;
    PyObject *owners = PyNumber_ToBase(mask, 16);
    Py_DECREF(mask);
    if (owners == NULL)
        return NULL;
    PyObject *text = PyUnicode_FromFormat("_Node(block_hash=%llu, local_hash=%llu, owners=%U)",
                                          (unsigned long long)self->block_hash,
                                          (unsigned long long)self->local_hash, owners);
    Py_DECREF(owners);
    return text;
}

static PyGetSetDef Node_getset[] = {
    {"block_hash", (getter)Node_get_block_hash, NULL, "the first writer's engine block hash", NULL},
    {"local_hash", (getter)Node_get_local_hash, NULL, "Dynamo's tokens_hash of the block", NULL},
    {"parent", (getter)Node_get_parent, (setter)Node_set_parent, NULL, NULL},
    {"owners", (getter)Node_get_owners, (setter)Node_set_owners, NULL, NULL},
    {"children", (getter)Node_get_children, (setter)Node_set_children, NULL, NULL},
    {NULL},
};

static PyTypeObject NodeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "indexer._native.Node",
    .tp_basicsize = sizeof(NodeObject),
    .tp_dealloc = (destructor)Node_dealloc,
    .tp_repr = (reprfunc)Node_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One block of the radix tree under its parent (the C twin of radix_tree._Node).",
    .tp_getset = Node_getset,
    .tp_new = Node_new,
};

/* ------------------------------------------------------------------ a rank's block map (RadixTree lookup)
 *
 * BlockMap: block_hash (u64) -> node, the C twin of the dict a rank keeps in the Python tree. Open
 * addressing with linear probing over 16-byte entries (the key as a machine word, the node), at most
 * three quarters full, deletions by backward shift (no tombstones): no int object per key and no
 * int object's hashing, about a third of a dict entry plus its key's int; the home of a key is keyed
 * by a secret (`map_home`). Iteration follows the table, not insertion order: the tree's only walk
 * of it (`_clear`) gives the same tree in any order. */

typedef struct {
    uint64_t key;
    PyObject *value; /* NULL: an empty entry */
} MapEntry;

typedef struct {
    PyObject_HEAD
    MapEntry *entries;
    Py_ssize_t capacity; /* 0 or a power of two */
    Py_ssize_t used;
    uint64_t secret; /* the process's map key when this map was made */
} BlockMapObject;

static PyTypeObject BlockMapType;
#define BlockMap_Check(op) Py_IS_TYPE(op, &BlockMapType)

/* Keys are mixed with a per-process random key (`set_map_key`, from os.urandom at import by
 * indexer/native.py). A sender picks its block hashes: under a fixed hash it can pick keys that share
 * one home at every table size, and each insert and lookup of that rank then walks one probe run of
 * everything it holds (tests/test_native_hostile.py). Each map keeps the key it was made with, so a
 * new key never moves the entries of a live map. */
static uint64_t map_key_for_new;
static int map_key_set;

static inline size_t map_home(const BlockMapObject *map, uint64_t key) {
    /* XXH3 of the 8 bytes, seeded with the map's key: a bijection of the key for a given seed, so
     * distinct keys stay distinct before the mask. */
    uint8_t bytes[8];
    memcpy(bytes, &key, 8);
    return (size_t)XXH3_64bits_withSeed(bytes, 8, map->secret) & (size_t)(map->capacity - 1);
}

/* The entry holding `key`, or NULL. */
static MapEntry *map_find(const BlockMapObject *map, uint64_t key) {
    if (map->capacity == 0)
        return NULL;
    size_t mask = (size_t)map->capacity - 1;
    for (size_t i = map_home(map, key);; i = (i + 1) & mask) {
        MapEntry *entry = &map->entries[i];
        if (entry->value == NULL)
            return NULL;
        if (entry->key == key)
            return entry;
    }
}

static int map_resize(BlockMapObject *map, Py_ssize_t capacity) {
    MapEntry *entries = PyMem_Calloc((size_t)capacity, sizeof(MapEntry));
    if (entries == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    MapEntry *old = map->entries;
    Py_ssize_t old_capacity = map->capacity;
    map->entries = entries;
    map->capacity = capacity;
    size_t mask = (size_t)capacity - 1;
    for (Py_ssize_t j = 0; j < old_capacity; j++) {
        if (old[j].value == NULL)
            continue;
        size_t i = map_home(map, old[j].key);
        while (entries[i].value != NULL)
            i = (i + 1) & mask;
        entries[i] = old[j];
    }
    PyMem_Free(old);
    return 0;
}

/* The value for `key` if present (borrowed), else `value` inserted (a new reference taken) and
 * returned; NULL on failure. */
static PyObject *map_setdefault(BlockMapObject *map, uint64_t key, PyObject *value) {
    if ((map->used + 1) * 4 > map->capacity * 3 && map_resize(map, map->capacity ? map->capacity * 2 : 8) < 0)
        return NULL;
    size_t mask = (size_t)map->capacity - 1;
    size_t i = map_home(map, key);
    for (;; i = (i + 1) & mask) {
        MapEntry *entry = &map->entries[i];
        if (entry->value == NULL)
            break;
        if (entry->key == key)
            return entry->value;
    }
    map->entries[i].key = key;
    map->entries[i].value = Py_NewRef(value);
    map->used++;
    return value;
}

static int map_set(BlockMapObject *map, uint64_t key, PyObject *value) {
    PyObject *present = map_setdefault(map, key, value);
    if (present == NULL)
        return -1;
    if (present != value) {
        MapEntry *entry = map_find(map, key);
        Py_SETREF(entry->value, Py_NewRef(value));
    }
    return 0;
}

/* Remove `entry` and return its value (the map's reference, now the caller's). */
static PyObject *map_take(BlockMapObject *map, MapEntry *entry) {
    PyObject *value = entry->value;
    size_t mask = (size_t)map->capacity - 1;
    size_t hole = (size_t)(entry - map->entries);
    /* Backward shift: move up every later entry of the run whose home is not between hole and it. */
    for (size_t i = (hole + 1) & mask; map->entries[i].value != NULL; i = (i + 1) & mask) {
        size_t home = map_home(map, map->entries[i].key);
        if (((i - home) & mask) >= ((i - hole) & mask)) {
            map->entries[hole] = map->entries[i];
            hole = i;
        }
    }
    map->entries[hole].value = NULL;
    map->used--;
    return value;
}

/* A key as a u64: 1, or 0 when it is no u64 (no block has it: a lookup misses, as in a dict). */
static int map_key(PyObject *key, uint64_t *out) {
    if (PyLong_Check(key) && as_u64(key, out) == 0)
        return 1;
    PyErr_Clear();
    return 0;
}

static void BlockMap_dealloc(BlockMapObject *self) {
    for (Py_ssize_t i = 0; i < self->capacity; i++)
        Py_XDECREF(self->entries[i].value);
    PyMem_Free(self->entries);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *BlockMap_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "BlockMap() takes no arguments");
        return NULL;
    }
    if (!map_key_set) {
        PyErr_SetString(PyExc_RuntimeError, "set_map_key was not called");
        return NULL;
    }
    BlockMapObject *map = (BlockMapObject *)type->tp_alloc(type, 0);
    if (map != NULL) {
        map->entries = NULL;
        map->capacity = map->used = 0;
        map->secret = map_key_for_new;
    }
    return (PyObject *)map;
}

static Py_ssize_t BlockMap_len(BlockMapObject *self) { return self->used; }

static PyObject *BlockMap_subscript(BlockMapObject *self, PyObject *key) {
    uint64_t k;
    int valid = map_key(key, &k);
    MapEntry *entry = valid ? map_find(self, k) : NULL;
    if (entry == NULL) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return Py_NewRef(entry->value);
}

static int BlockMap_ass_subscript(BlockMapObject *self, PyObject *key, PyObject *value) {
    uint64_t k;
    int valid = map_key(key, &k);
    if (value != NULL) {
        if (!valid) {
            PyErr_SetString(PyExc_OverflowError, "block map keys are u64 ints");
            return -1;
        }
        return map_set(self, k, value);
    }
    MapEntry *entry = valid ? map_find(self, k) : NULL;
    if (entry == NULL) {
        PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    Py_DECREF(map_take(self, entry));
    return 0;
}

/* The (key[, default]) calls: checks the arity against `usage` and finds the key's entry (NULL when absent,
 * or when the key is no u64 int and so cannot be held). Returns -1 with TypeError on a wrong arity. */
static int map_lookup_args(BlockMapObject *self, PyObject *const *args, Py_ssize_t nargs, const char *usage,
                           MapEntry **entry) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    uint64_t k;
    *entry = map_key(args[0], &k) ? map_find(self, k) : NULL;
    return 0;
}

static PyObject *BlockMap_get(BlockMapObject *self, PyObject *const *args, Py_ssize_t nargs) {
    MapEntry *entry;
    if (map_lookup_args(self, args, nargs, "get(key, default=None)", &entry) < 0)
        return NULL;
    return Py_NewRef(entry != NULL ? entry->value : nargs == 2 ? args[1] : Py_None);
}

static PyObject *BlockMap_pop(BlockMapObject *self, PyObject *const *args, Py_ssize_t nargs) {
    MapEntry *entry;
    if (map_lookup_args(self, args, nargs, "pop(key[, default])", &entry) < 0)
        return NULL;
    if (entry != NULL)
        return map_take(self, entry);
    if (nargs == 2)
        return Py_NewRef(args[1]);
    PyErr_SetObject(PyExc_KeyError, args[0]);
    return NULL;
}

static PyObject *BlockMap_setdefault(BlockMapObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "setdefault(key, value)");
        return NULL;
    }
    uint64_t k;
    if (!map_key(args[0], &k)) {
        PyErr_SetString(PyExc_OverflowError, "block map keys are u64 ints");
        return NULL;
    }
    PyObject *value = map_setdefault(self, k, args[1]);
    return value == NULL ? NULL : Py_NewRef(value);
}

static PyObject *BlockMap_values(BlockMapObject *self, PyObject *unused) {
    PyObject *values = PyList_New(self->used);
    if (values == NULL)
        return NULL;
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < self->capacity; i++)
        if (self->entries[i].value != NULL)
            PyList_SET_ITEM(values, n++, Py_NewRef(self->entries[i].value));
    return values;
}

static PyObject *BlockMap_sizeof(BlockMapObject *self, PyObject *unused) {
    return PyLong_FromSsize_t((Py_ssize_t)sizeof(BlockMapObject) + self->capacity * (Py_ssize_t)sizeof(MapEntry));
}

static PyMethodDef BlockMap_methods[] = {
    {"get", (PyCFunction)(void (*)(void))BlockMap_get, METH_FASTCALL, "get(key, default=None)"},
    {"pop", (PyCFunction)(void (*)(void))BlockMap_pop, METH_FASTCALL, "pop(key[, default])"},
    {"setdefault", (PyCFunction)(void (*)(void))BlockMap_setdefault, METH_FASTCALL, "setdefault(key, value)"},
    {"values", (PyCFunction)BlockMap_values, METH_NOARGS, "values() -> list: the nodes, in table order."},
    {"__sizeof__", (PyCFunction)BlockMap_sizeof, METH_NOARGS, NULL},
    {NULL},
};

static PyMappingMethods BlockMap_mapping = {
    .mp_length = (lenfunc)BlockMap_len,
    .mp_subscript = (binaryfunc)BlockMap_subscript,
    .mp_ass_subscript = (objobjargproc)BlockMap_ass_subscript,
};

/* Not tracked by the cyclic GC: it holds nodes, which hold no map. */
static PyTypeObject BlockMapType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "indexer._native.BlockMap",
    .tp_basicsize = sizeof(BlockMapObject),
    .tp_dealloc = (destructor)BlockMap_dealloc,
    .tp_as_mapping = &BlockMap_mapping,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A rank's block_hash (u64) -> node map (the C twin of the Python tree's dict).",
    .tp_methods = BlockMap_methods,
    .tp_new = BlockMap_new,
};

/* The child of `node` for a local hash, borrowed; NULL with no error when absent. */
static PyObject *child_of(NodeObject *node, uint64_t local_hash, PyObject *local_obj) {
    PyObject *kids = node->children;
    if (kids == Py_None)
        return NULL;
    if (Node_Check(kids))
        return ((NodeObject *)kids)->local_hash == local_hash ? kids : NULL;
    return PyDict_GetItemWithError(kids, local_obj);
}

/* Owners masks of trees with at most 64 slots fit in a u64 (the callers check the slot count). */
static inline int owners_u64(PyObject *owners, uint64_t *out) { return as_u64(owners, out); }

/* The rank's node for `parent_hash` when the rank holds it and no block of the chain names it
 * (borrowed); NULL without an error otherwise, NULL with one on failure. */
static NodeObject *held_parent(PyObject *parent_hash, PyObject *blocks, PyObject *bit, uint64_t bit_value,
                               BlockMapObject *lookup) {
    uint64_t parent;
    if (!map_key(parent_hash, &parent))
        return NULL;
    MapEntry *entry = map_find(lookup, parent);
    if (entry == NULL)
        return NULL;
    PyObject *found = entry->value;
    if (!Node_Check(found)) {
        PyErr_SetString(PyExc_TypeError, "lookup values must be nodes");
        return NULL;
    }
    int owned = node_owned_by((NodeObject *)found, bit, bit_value);
    if (owned <= 0)
        return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(blocks); i++) {
        PyObject *block_obj, *local_obj;
        if (block_hashes_of(PyList_GET_ITEM(blocks, i), &block_obj, &local_obj) < 0)
            return NULL;
        uint64_t block_hash;
        int same = as_u64(block_obj, &block_hash) < 0 ? -1 : block_hash == parent;
        Py_DECREF(block_obj);
        Py_DECREF(local_obj);
        if (same != 0)
            return NULL;
    }
    return (NodeObject *)found;
}

/* store_chain(root, parent_hash, blocks, bit, lookup, aliases, disown, state)
 *     -> (created, newly_owned, branched) | None
 *
 * `RadixTree._store`, step for step: from the root (`parent_hash` None) or the rank's node for
 * `parent_hash`, walk or extend the chain, mark `bit` (a slot below 64) on every block, record
 * aliases, map each block hash to its node in `lookup`, and call `disown(state, node)` for a node
 * the worker's hash moved away from. None, with nothing changed, when the rank does not hold the
 * parent or a block names it: the Python code then names the error. */
static PyObject *py_store_chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "store_chain takes 8 arguments");
        return NULL;
    }
    PyObject *root = args[0], *parent_hash = args[1], *blocks = args[2], *bit = args[3], *lookup = args[4],
             *aliases = args[5], *disown = args[6], *state = args[7];
    if (!Node_Check(root) || !PyList_Check(blocks) || !PyLong_Check(bit) || !BlockMap_Check(lookup) ||
        !PyDict_Check(aliases)) {
        PyErr_SetString(PyExc_TypeError, "store_chain(Node, parent, list, int, BlockMap, dict, disown, state)");
        return NULL;
    }
    uint64_t bit_value;
    if (owners_u64(bit, &bit_value) < 0)
        return NULL;
    NodeObject *start = (NodeObject *)root;
    if (parent_hash != Py_None) {
        start = held_parent(parent_hash, blocks, bit, bit_value, (BlockMapObject *)lookup);
        if (start == NULL) {
            if (PyErr_Occurred())
                return NULL;
            Py_RETURN_NONE;
        }
    }
    Py_ssize_t created = 0, newly_owned = 0, branched = 0;
    NodeObject *node = (NodeObject *)Py_NewRef(start);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(blocks); i++) {
        PyObject *block_obj, *local_obj;
        if (block_hashes_of(PyList_GET_ITEM(blocks, i), &block_obj, &local_obj) < 0)
            goto error;
        uint64_t block_hash, local_hash;
        NodeObject *child = NULL;
        if (as_u64(block_obj, &block_hash) < 0 || as_u64(local_obj, &local_hash) < 0)
            goto error_block;
        PyObject *kids = node->children;
        PyObject *found = child_of(node, local_hash, local_obj);
        if (found == NULL && PyErr_Occurred())
            goto error_block;
        if (found == NULL) {
            child = node_new(block_hash, local_hash, (PyObject *)node, bit_value);
            if (child == NULL)
                goto error_block;
            if (kids == Py_None) {
                Py_SETREF(node->children, Py_NewRef((PyObject *)child));
            } else if (Node_Check(kids)) {
                PyObject *branch = PyDict_New();
                PyObject *only_key = PyLong_FromUnsignedLongLong(((NodeObject *)kids)->local_hash);
                if (branch == NULL || only_key == NULL || PyDict_SetItem(branch, only_key, kids) < 0 ||
                    PyDict_SetItem(branch, local_obj, (PyObject *)child) < 0) {
                    Py_XDECREF(branch);
                    Py_XDECREF(only_key);
                    goto error_block;
                }
                Py_DECREF(only_key);
                Py_SETREF(node->children, branch);
                branched++;
            } else if (PyDict_SetItem(kids, local_obj, (PyObject *)child) < 0) {
                goto error_block;
            }
            created++;
        } else {
            if (!Node_Check(found)) {
                PyErr_SetString(PyExc_TypeError, "tree children must be nodes");
                goto error_block;
            }
            child = (NodeObject *)Py_NewRef(found);
            int owned = node_owned_by(child, bit, bit_value);
            if (owned < 0)
                goto error_block;
            if (!owned) {
                if (node_combine_owners(child, bit, bit_value, 1) < 0)
                    goto error_block;
                newly_owned++;
            }
            if (child->block_hash != block_hash && PyDict_SetItem(aliases, (PyObject *)child, block_obj) < 0)
                goto error_block;
        }
        PyObject *previous = map_setdefault((BlockMapObject *)lookup, block_hash, (PyObject *)child);
        if (previous == NULL)
            goto error_block;
        if (previous != (PyObject *)child) {
            Py_INCREF(previous);
            int owned = Node_Check(previous) ? node_owned_by((NodeObject *)previous, bit, bit_value) : 0;
            if (owned < 0) {
                Py_DECREF(previous);
                goto error_block;
            }
            if (owned) {
                /* The worker reuses a hash for another position: it no longer holds the old one. */
                PyObject *result = PyObject_CallFunctionObjArgs(disown, state, previous, NULL);
                if (result == NULL) {
                    Py_DECREF(previous);
                    goto error_block;
                }
                Py_DECREF(result);
            }
            Py_DECREF(previous);
            if (map_set((BlockMapObject *)lookup, block_hash, (PyObject *)child) < 0)
                goto error_block;
        }
        Py_DECREF(block_obj);
        Py_DECREF(local_obj);
        Py_SETREF(node, child);
        continue;
    error_block:
        Py_XDECREF(child);
        Py_DECREF(block_obj);
        Py_DECREF(local_obj);
        goto error;
    }
    Py_DECREF(node);
    return Py_BuildValue("nnn", created, newly_owned, branched);
error:
    Py_DECREF(node);
    return NULL;
}

/* Set scores[keys[slot]] = depth for every set bit of mask, lowest slot first. */
static int score_bits(uint64_t mask, PyObject *keys, PyObject *scores, PyObject *depth_obj) {
    while (mask) {
        int slot = __builtin_ctzll(mask);
        if (slot >= PyList_GET_SIZE(keys)) {
            PyErr_SetString(PyExc_IndexError, "owner bit of an unknown slot");
            return -1;
        }
        if (PyDict_SetItem(scores, PyList_GET_ITEM(keys, slot), depth_obj) < 0)
            return -1;
        mask &= mask - 1;
    }
    return 0;
}

static int score_depth(uint64_t mask, Py_ssize_t depth, PyObject *keys, PyObject *scores) {
    if (!mask)
        return 0;
    PyObject *depth_obj = PyLong_FromSsize_t(depth);
    if (depth_obj == NULL)
        return -1;
    int status = score_bits(mask, keys, scores, depth_obj);
    Py_DECREF(depth_obj);
    return status;
}

/* match_prefix(root, local_hashes, keys, scores, path) -> None
 *
 * `RadixTree.find_matches`'s walk, step for step, for trees of at most 64 slots: per slot the
 * number of leading blocks of `local_hashes` it holds goes into `scores` (keyed by `keys[slot]`,
 * in the Python walk's order); with a list as `path`, the matched nodes are appended to it. */
static PyObject *py_match_prefix(PyObject *self, PyObject *args) {
    PyObject *root, *hashes, *keys, *scores, *path;
    if (!PyArg_ParseTuple(args, "O!OO!O!O", &NodeType, &root, &hashes, &PyList_Type, &keys, &PyDict_Type, &scores,
                          &path))
        return NULL;
    int record = path != Py_None;
    if (record && !PyList_Check(path)) {
        PyErr_SetString(PyExc_TypeError, "path must be a list or None");
        return NULL;
    }
    PyObject *fast = PySequence_Fast(hashes, "local hashes must be a sequence");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    NodeObject *node = (NodeObject *)root;
    uint64_t active = 0;
    Py_ssize_t depth = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t local;
        if (as_u64(items[i], &local) < 0) {
            /* A value no block can have (not a u64): nothing further matches, as in Python. */
            PyErr_Clear();
            break;
        }
        PyObject *found = child_of(node, local, items[i]);
        if (found == NULL) {
            if (PyErr_Occurred())
                goto error;
            break;
        }
        if (!Node_Check(found)) {
            PyErr_SetString(PyExc_TypeError, "tree children must be nodes");
            goto error;
        }
        if (((NodeObject *)found)->wide != NULL) {
            PyErr_SetString(PyExc_OverflowError, "an owners mask past 64 slots");
            goto error;
        }
        uint64_t owners = ((NodeObject *)found)->mask;
        if (i == 0) {
            if (!owners)
                break;
            active = owners;
        } else if (owners != active) {
            uint64_t remaining = active & owners;
            if (remaining != active) {
                if (score_depth(active ^ remaining, depth, keys, scores) < 0)
                    goto error;
                active = remaining;
                if (!remaining)
                    break;
            }
        }
        node = (NodeObject *)found;
        depth++;
        if (record && PyList_Append(path, found) < 0)
            goto error;
    }
    if (score_depth(active, depth, keys, scores) < 0)
        goto error;
    Py_DECREF(fast);
    Py_RETURN_NONE;
error:
    Py_DECREF(fast);
    return NULL;
}

/* has_wide_hash(blocks) -> bool: whether a block's block_hash or tokens_hash is outside [0, 2^64),
 * the test `KvStoredData.__post_init__` runs on every decoded event before normalising i64 hashes. */
static int is_u64(PyObject *value) {
    uint64_t ignored;
    if (as_u64(value, &ignored) == 0)
        return 1;
    PyErr_Clear();
    return 0;
}

static PyObject *py_has_wide_hash(PyObject *self, PyObject *blocks) {
    if (!PyList_Check(blocks)) {
        PyErr_SetString(PyExc_TypeError, "blocks must be a list");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(blocks); i++) {
        PyObject *block_hash, *tokens_hash;
        if (block_hashes_of(PyList_GET_ITEM(blocks, i), &block_hash, &tokens_hash) < 0)
            return NULL;
        int narrow = is_u64(block_hash) && is_u64(tokens_hash);
        Py_DECREF(block_hash);
        Py_DECREF(tokens_hash);
        if (!narrow)
            Py_RETURN_TRUE;
    }
    Py_RETURN_FALSE;
}

/* ------------------------------------------------------------------ removals (RadixTree._remove)
 *
 * remove_blocks(root, lookup, aliases, hashes, bit) -> (missing, disowned, pruned, unbranched)
 *
 * `RadixTree._remove` with `_disown` and `_prune` inlined, step for step: pop each hash from the
 * rank's `lookup`; a node the rank holds loses `bit` (and its alias), then it and its ancestors are
 * detached while they are ownerless leaves. Returns the hashes not held, how many nodes were
 * disowned, how many detached, and how many branch dicts went back to a single child. */
static int owners_without(NodeObject *node, PyObject *bit, uint64_t bit_value, int *held) {
    *held = node_owned_by(node, bit, bit_value);
    if (*held < 0)
        return -1;
    return *held ? node_combine_owners(node, bit, bit_value, 0) : 0;
}

/* Detach `child` from `parent`'s children; *unbranched is set when a branch dict went back to one. */
static int detach_child(NodeObject *parent, NodeObject *child, int *unbranched) {
    PyObject *kids = parent->children;
    *unbranched = 0;
    if (kids == (PyObject *)child) {
        Py_SETREF(parent->children, Py_NewRef(Py_None));
        return 0;
    }
    if (!PyDict_Check(kids))
        return 0;
    PyObject *key = PyLong_FromUnsignedLongLong(child->local_hash);
    if (key == NULL)
        return -1;
    int status = PyDict_DelItem(kids, key);
    Py_DECREF(key);
    if (status < 0)
        return -1;
    if (PyDict_GET_SIZE(kids) == 1) {
        Py_ssize_t position = 0;
        PyObject *only_key, *only;
        PyDict_Next(kids, &position, &only_key, &only);
        Py_SETREF(parent->children, Py_NewRef(only));
        *unbranched = 1;
    }
    return 0;
}

static PyObject *py_remove_blocks(PyObject *self, PyObject *args) {
    PyObject *root, *lookup, *aliases, *hashes, *bit;
    if (!PyArg_ParseTuple(args, "O!O!O!OO!", &NodeType, &root, &BlockMapType, &lookup, &PyDict_Type, &aliases, &hashes,
                          &PyLong_Type, &bit))
        return NULL;
    uint64_t bit_value;
    if (owners_u64(bit, &bit_value) < 0)
        return NULL;
    PyObject *fast = PySequence_Fast(hashes, "hashes must be a sequence");
    if (fast == NULL)
        return NULL;
    PyObject *missing = PyList_New(0);
    if (missing == NULL) {
        Py_DECREF(fast);
        return NULL;
    }
    Py_ssize_t disowned = 0, pruned = 0, unbranched = 0;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t key;
        int valid = map_key(items[i], &key);
        MapEntry *entry = valid ? map_find((BlockMapObject *)lookup, key) : NULL;
        if (entry == NULL) {
            if (PyList_Append(missing, items[i]) < 0)
                goto error;
            continue;
        }
        NodeObject *node = (NodeObject *)map_take((BlockMapObject *)lookup, entry);
        int held = 0;
        if (!Node_Check(node) || owners_without(node, bit, bit_value, &held) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "lookup values must be nodes");
            Py_DECREF(node);
            goto error;
        }
        if (!held) {
            Py_DECREF(node);
            if (PyList_Append(missing, items[i]) < 0)
                goto error;
            continue;
        }
        disowned++;
        if (PyDict_GET_SIZE(aliases)) {
            int aliased = PyDict_Contains(aliases, (PyObject *)node);
            if (aliased < 0 || (aliased && PyDict_DelItem(aliases, (PyObject *)node) < 0)) {
                Py_DECREF(node);
                goto error;
            }
        }
        /* Detach while an ownerless leaf below the root; `node` holds a reference throughout. */
        while ((PyObject *)node != root && node->children == Py_None) {
            /* A wide mask is never zero: it is kept as a word whenever it fits. */
            int ownerless = node->wide == NULL && node->mask == 0;
            if (!ownerless || !Node_Check(node->parent))
                break;
            NodeObject *parent = (NodeObject *)Py_NewRef(node->parent);
            int collapsed;
            if (detach_child(parent, node, &collapsed) < 0) {
                Py_DECREF(parent);
                Py_DECREF(node);
                goto error;
            }
            unbranched += collapsed;
            Py_SETREF(node->parent, Py_NewRef(Py_None));
            pruned++;
            Py_SETREF(node, parent);
        }
        Py_DECREF(node);
    }
    Py_DECREF(fast);
    return Py_BuildValue("Nnnn", missing, disowned, pruned, unbranched);
error:
    Py_DECREF(fast);
    Py_DECREF(missing);
    return NULL;
}

/* ------------------------------------------------------------------ event encoding (indexer/events.py)
 *
 * msgpack_rows(first, second, before, between, after) -> bytes | None
 *
 * A msgpack array with one row per pair (first[i], second[i]): `before`, the first int, `between`,
 * the second int, `after`, each int in msgspec's smallest unsigned form. With the pieces of an
 * encoded `StoredBlock` it is the `blocks` array of a stored event, byte for byte as msgspec writes
 * it, without one Python object per block. None when a value is not a u64 (msgspec then encodes). */
static PyObject *py_msgpack_rows(PyObject *self, PyObject *args) {
    PyObject *first, *second;
    Py_buffer before, between, after;
    if (!PyArg_ParseTuple(args, "O!O!y*y*y*", &PyList_Type, &first, &PyList_Type, &second, &before, &between, &after))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = PyList_GET_SIZE(first);
    if (PyList_GET_SIZE(second) != n) {
        PyErr_SetString(PyExc_ValueError, "the two columns differ in length");
        goto done;
    }
    Py_ssize_t row = before.len + between.len + after.len + 18;
    if (n > (PY_SSIZE_T_MAX - 5) / row) {
        PyErr_NoMemory();
        goto done;
    }
    uint8_t *start = scratch_new(5 + n * row), *out = start;
    if (start == NULL)
        goto done;
    out = put_array_header(out, n);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t a, b;
        if (as_u64(PyList_GET_ITEM(first, i), &a) < 0 || as_u64(PyList_GET_ITEM(second, i), &b) < 0) {
            PyErr_Clear();
            PyMem_Free(start);
            result = Py_NewRef(Py_None);
            goto done;
        }
        memcpy(out, before.buf, before.len);
        out = put_uint(out + before.len, a);
        memcpy(out, between.buf, between.len);
        out = put_uint(out + between.len, b);
        memcpy(out, after.buf, after.len);
        out += after.len;
    }
    result = scratch_bytes(start, out);
done:
    PyBuffer_Release(&before);
    PyBuffer_Release(&between);
    PyBuffer_Release(&after);
    return result;
}

/* msgpack_u32s(data) -> bytes | None
 *
 * A msgpack array of ints in [0, 2^32) (an engine's token_ids) as packed little-endian u32, without
 * an int object per token. None for anything else, trailing bytes included: msgspec then decodes
 * the array and names what is wrong. */
static PyObject *py_msgpack_u32s(PyObject *self, PyObject *arg) {
    Py_buffer data;
    if (PyObject_GetBuffer(arg, &data, PyBUF_SIMPLE) < 0)
        return NULL;
    const uint8_t *p = (const uint8_t *)data.buf, *end = p + data.len;
    PyObject *result = NULL;
    size_t count;
    if (p >= end)
        goto unsupported;
    if ((*p & 0xF0) == 0x90) {
        count = *p & 0x0F;
        p += 1;
    } else if (*p == 0xdc && end - p >= 3) {
        count = ((size_t)p[1] << 8) | p[2];
        p += 3;
    } else if (*p == 0xdd && end - p >= 5) {
        count = ((size_t)p[1] << 24) | ((size_t)p[2] << 16) | ((size_t)p[3] << 8) | p[4];
        p += 5;
    } else {
        goto unsupported;
    }
    if (count > (size_t)(end - p)) /* every element takes at least one byte */
        goto unsupported;
    result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(count * 4));
    if (result == NULL)
        goto done;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result);
    for (size_t i = 0; i < count; i++) {
        uint64_t v;
        if (p >= end)
            goto unsupported;
        uint8_t tag = *p;
        if (tag < 0x80) {
            v = tag;
            p += 1;
        } else if (tag == 0xcc && end - p >= 2) {
            v = p[1];
            p += 2;
        } else if (tag == 0xcd && end - p >= 3) {
            v = ((uint64_t)p[1] << 8) | p[2];
            p += 3;
        } else if (tag == 0xce && end - p >= 5) {
            v = ((uint64_t)p[1] << 24) | ((uint64_t)p[2] << 16) | ((uint64_t)p[3] << 8) | p[4];
            p += 5;
        } else {
            goto unsupported; /* signed or wider forms, or not an int: msgspec decides */
        }
        out[0] = (uint8_t)v;
        out[1] = (uint8_t)(v >> 8);
        out[2] = (uint8_t)(v >> 16);
        out[3] = (uint8_t)(v >> 24);
        out += 4;
    }
    if (p != end)
        goto unsupported;
    goto done;
unsupported:
    Py_XDECREF(result);
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&data);
    return result;
}

/* ------------------------------------------------------------------ RouterEvent JSON (decode_router_events)
 *
 * router_events_json(payload) -> list[RouterEvent] | None
 *
 * msgspec's decoding of a RouterEvent payload (one event or a list of them), for the form publishers
 * write: stored, removed and bare "cleared" events of the device tier, every hash a u64, no escaped
 * key, no unknown or repeated key. The objects are the wire structs themselves (`bind_event_types`
 * names them), each a copy of a template with its fields set (`wire_new`). Anything else (an i64 hash, a float, another
 * tier, `{"cleared": null}`, invalid JSON) returns None and msgspec decodes it, for the exact value or
 * error. */

#define FIELDS_MAX 3
typedef struct {
    PyObject *template; /* an instance, copied by its type's `__copy__` for each new struct */
    PyObject *copy;     /* the type's `__copy__` */
    PyObject *descrs[FIELDS_MAX];
    PyMemberDef *members[FIELDS_MAX]; /* each field's slot, written with PyMember_SetOne */
    Py_ssize_t nfields;
    int construct; /* no `__post_init__`: made by calling the type */
} WireStruct;

enum { WIRE_ROUTER, WIRE_EVENT, WIRE_DATA, WIRE_STORED, WIRE_REMOVED, WIRE_BLOCK, WIRE_COUNT };
static WireStruct wire[WIRE_COUNT];
static const char *const wire_fields[WIRE_COUNT][FIELDS_MAX] = {
    {"worker_id", "event", "storage_tier"}, {"event_id", "data", "dp_rank"},
    {"stored", "removed", "cleared"},       {"blocks", "parent_hash", "start_position"},
    {"block_hashes", NULL, NULL},           {"block_hash", "tokens_hash", "mm_extra_info"},
};
static PyObject *wire_device, *wire_unset, *wire_cleared;
static int wire_bound;

static void wire_struct_clear(WireStruct *ws) {
    Py_CLEAR(ws->template);
    Py_CLEAR(ws->copy);
    for (int f = 0; f < FIELDS_MAX; f++) {
        Py_CLEAR(ws->descrs[f]);
        ws->members[f] = NULL;
    }
    ws->nfields = 0;
    ws->construct = 0;
}

/* `ws` for kind `t` from `template`: 1, or 0 when its type's `__struct_fields__` are not the fields
 * the decoder sets, in that order, each a plain slot, or it has no `__copy__`. */
static int wire_struct_bind(WireStruct *ws, int t, PyObject *template) {
    PyObject *type = (PyObject *)Py_TYPE(template);
    Py_ssize_t nfields = 0;
    while (nfields < FIELDS_MAX && wire_fields[t][nfields] != NULL)
        nfields++;
    PyObject *fields = PyObject_GetAttrString(type, "__struct_fields__");
    if (fields == NULL) {
        PyErr_Clear();
        return 0;
    }
    int same = PyTuple_Check(fields) && PyTuple_GET_SIZE(fields) == nfields;
    for (Py_ssize_t f = 0; same && f < nfields; f++) {
        PyObject *field = PyTuple_GET_ITEM(fields, f);
        same = PyUnicode_Check(field) && PyUnicode_CompareWithASCIIString(field, wire_fields[t][f]) == 0;
        if (same && (ws->descrs[f] = slot_member((PyTypeObject *)type, field)) == NULL)
            same = 0;
        if (same)
            ws->members[f] = ((PyMemberDescrObject *)ws->descrs[f])->d_member;
    }
    Py_DECREF(fields);
    if (same && (ws->copy = PyObject_GetAttrString(type, "__copy__")) == NULL) {
        PyErr_Clear();
        same = 0;
    }
    if (!same) {
        wire_struct_clear(ws);
        return 0;
    }
    int post_init = PyObject_HasAttrString(type, "__post_init__");
    ws->template = Py_NewRef(template);
    ws->nfields = nfields;
    ws->construct = !post_init;
    return 1;
}

/* bind_event_types(router, event, data, stored, removed, block, device, unset, cleared) -> bool
 *
 * The first six are an instance of each wire type (their values do not matter: every field is set).
 * False (and the decoder stays bound as it was) when one does not fit `wire_struct_bind`. */
static PyObject *py_bind_event_types(PyObject *self, PyObject *args) {
    PyObject *templates[WIRE_COUNT], *device, *unset, *cleared;
    if (!PyArg_ParseTuple(args, "OOOOOOOOU", &templates[0], &templates[1], &templates[2], &templates[3],
                          &templates[4], &templates[5], &device, &unset, &cleared))
        return NULL;
    WireStruct bound[WIRE_COUNT];
    memset(bound, 0, sizeof(bound));
    for (int t = 0; t < WIRE_COUNT; t++) {
        if (!wire_struct_bind(&bound[t], t, templates[t])) {
            for (int u = 0; u < t; u++)
                wire_struct_clear(&bound[u]);
            Py_RETURN_FALSE;
        }
    }
    for (int t = 0; t < WIRE_COUNT; t++) {
        wire_struct_clear(&wire[t]);
        wire[t] = bound[t];
    }
    Py_XSETREF(wire_device, Py_NewRef(device));
    Py_XSETREF(wire_unset, Py_NewRef(unset));
    Py_XSETREF(wire_cleared, Py_NewRef(cleared));
    wire_bound = 1;
    Py_RETURN_TRUE;
}

/* A struct of kind `t` holding `values` (references stolen, all of them, even on failure). A type
 * without `__post_init__` is called (msgspec's constructor, its cheapest public way in); one with it
 * is a copy of the template (msgspec's `__copy__`, which runs no `__post_init__`: on this form each of
 * those checks passes and changes nothing, and a Python call per struct would be a fifth of a decode)
 * with every field set through its slot (PyMember_SetOne). */
static PyObject *wire_new(int t, PyObject **values) {
    const WireStruct *ws = &wire[t];
    PyObject *obj = NULL;
    for (Py_ssize_t f = 0; f < ws->nfields; f++)
        if (values[f] == NULL)
            goto done;
    if (ws->construct) {
        obj = PyObject_Vectorcall((PyObject *)Py_TYPE(ws->template), values, (size_t)ws->nfields, NULL);
        goto done;
    }
    obj = PyObject_Vectorcall(ws->copy, (PyObject *const *)&ws->template, 1, NULL);
    for (Py_ssize_t f = 0; obj != NULL && f < ws->nfields; f++)
        if (PyMember_SetOne((char *)obj, ws->members[f], values[f]) < 0)
            Py_CLEAR(obj);
done:
    for (Py_ssize_t f = 0; f < ws->nfields; f++)
        Py_XDECREF(values[f]);
    return obj;
}

/* Parse status: JSON_OK, JSON_OTHER (not the fast form: msgspec decides) or JSON_ERROR (exception set). */
enum { JSON_OK = 0, JSON_OTHER = 1, JSON_ERROR = -1 };

typedef struct {
    const char *p;
    const char *end;
} JsonCursor;

static inline void json_ws(JsonCursor *c) {
    /* Publishers write compact JSON: one test passes the common case. */
    while (c->p < c->end && (unsigned char)*c->p <= ' ' &&
           (*c->p == ' ' || *c->p == '\n' || *c->p == '\r' || *c->p == '\t'))
        c->p++;
}

static inline int json_eat(JsonCursor *c, char ch) {
    json_ws(c);
    if (c->p < c->end && *c->p == ch) {
        c->p++;
        return 1;
    }
    return 0;
}

/* A string's bytes up to the next quote, borrowed from the payload. Only compared with literals
 * (keys, "device", "cleared"), none of which holds a backslash or a control character: an escaped
 * string never equals one, so it ends the fast form without a scan for escapes. */
static int json_plain_string(JsonCursor *c, const char **text, Py_ssize_t *len) {
    if (!json_eat(c, '"'))
        return 0;
    const char *close = memchr(c->p, '"', (size_t)(c->end - c->p));
    if (close == NULL)
        return 0;
    *text = c->p;
    *len = close - c->p;
    c->p = close + 1;
    return 1;
}

/* The next key and its colon. */
static int json_key(JsonCursor *c, const char **key, Py_ssize_t *len) {
    return json_plain_string(c, key, len) && json_eat(c, ':');
}

#define KEY_IS(key, len, literal) ((len) == (Py_ssize_t)sizeof(literal) - 1 && memcmp((key), (literal), (len)) == 0)

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
/* Eight ASCII digits at p, tested and converted eight at a time (SWAR, little-endian loads). */
static inline int eight_digits(const char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return ((v & 0xF0F0F0F0F0F0F0F0ULL) | (((v + 0x0606060606060606ULL) & 0xF0F0F0F0F0F0F0F0ULL) >> 4)) ==
           0x3333333333333333ULL;
}

static inline uint64_t eight_digits_value(const char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    v -= 0x3030303030303030ULL;
    v = v * 10 + (v >> 8);
    return (((v & 0x000000FF000000FFULL) * (100 + (1000000ULL << 32))) +
            (((v >> 16) & 0x000000FF000000FFULL) * (1 + (10000ULL << 32)))) >>
           32;
}
#endif

/* A non-negative JSON integer up to `max` (no sign, fraction or exponent: those end the fast form). */
static int json_uint(JsonCursor *c, uint64_t max, uint64_t *out) {
    json_ws(c);
    const char *p = c->p, *end = c->end;
    if (p == end || *p < '0' || *p > '9')
        return 0;
    uint64_t value = 0;
    int digits = 0;
    if (*p == '0') {
        p++;
    } else {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        /* Sixteen digits at most this way: below 10^16, no overflow is possible. */
        while (digits < 16 && end - p >= 8 && eight_digits(p)) {
            value = value * 100000000ULL + eight_digits_value(p);
            p += 8;
            digits += 8;
        }
#endif
        while (p < end && *p >= '0' && *p <= '9') {
            uint64_t digit = (uint64_t)(*p - '0');
            if (digits >= 19 && (digits >= 20 || value > (UINT64_MAX - digit) / 10))
                return 0;
            value = value * 10 + digit;
            p++;
            digits++;
        }
    }
    if (p < end && (*p == '.' || *p == 'e' || *p == 'E' || (*p >= '0' && *p <= '9')))
        return 0;
    if (value > max)
        return 0;
    c->p = p;
    *out = value;
    return 1;
}

static int json_null(JsonCursor *c) {
    json_ws(c);
    if (c->end - c->p >= 4 && memcmp(c->p, "null", 4) == 0) {
        c->p += 4;
        return 1;
    }
    return 0;
}

static inline int json_peek(JsonCursor *c, char ch) {
    json_ws(c);
    return c->p < c->end && *c->p == ch;
}

/* After a member: 1 if another follows (a comma), 0 at the closing brace, -1 otherwise. */
static int json_next_member(JsonCursor *c) {
    if (json_eat(c, ','))
        return 1;
    return json_eat(c, '}') ? 0 : -1;
}

/* The members of an object, one `member` call per key; `member` returns a JSON_* status. */
#define JSON_MEMBERS(c, key, len, ...)                                                                           \
    do {                                                                                                         \
        if (!json_eat(c, '{'))                                                                                   \
            return JSON_OTHER;                                                                                   \
        if (!json_eat(c, '}')) {                                                                                 \
            for (;;) {                                                                                           \
                if (!json_key(c, &key, &len))                                                                    \
                    goto other;                                                                                  \
                __VA_ARGS__;                                                                                     \
                int more = json_next_member(c);                                                                  \
                if (more < 0)                                                                                    \
                    goto other;                                                                                  \
                if (!more)                                                                                       \
                    break;                                                                                       \
            }                                                                                                    \
        }                                                                                                        \
    } while (0)

static int json_block(JsonCursor *c, PyObject **out) {
    const char *key;
    Py_ssize_t len;
    uint64_t block_hash = 0, tokens_hash = 0;
    int seen = 0;
    JSON_MEMBERS(c, key, len, {
        if (KEY_IS(key, len, "block_hash") && !(seen & 1) && json_uint(c, UINT64_MAX, &block_hash))
            seen |= 1;
        else if (KEY_IS(key, len, "tokens_hash") && !(seen & 2) && json_uint(c, UINT64_MAX, &tokens_hash))
            seen |= 2;
        else if (KEY_IS(key, len, "mm_extra_info") && !(seen & 4) && json_null(c))
            seen |= 4;
        else
            goto other;
    });
    if ((seen & 3) != 3)
        return JSON_OTHER;
    PyObject *values[3] = {PyLong_FromUnsignedLongLong(block_hash), PyLong_FromUnsignedLongLong(tokens_hash),
                           Py_NewRef(Py_None)};
    *out = wire_new(WIRE_BLOCK, values);
    return *out == NULL ? JSON_ERROR : JSON_OK;
other:
    return JSON_OTHER;
}

/* A JSON array into a new list, one `item` call per element. */
static int json_list(JsonCursor *c, int (*item)(JsonCursor *, PyObject **), PyObject **out) {
    if (!json_eat(c, '['))
        return JSON_OTHER;
    PyObject *list = PyList_New(0);
    if (list == NULL)
        return JSON_ERROR;
    if (!json_eat(c, ']')) {
        for (;;) {
            PyObject *value;
            int status = item(c, &value);
            if (status != JSON_OK) {
                Py_DECREF(list);
                return status;
            }
            int appended = PyList_Append(list, value);
            Py_DECREF(value);
            if (appended < 0) {
                Py_DECREF(list);
                return JSON_ERROR;
            }
            if (json_eat(c, ','))
                continue;
            if (json_eat(c, ']'))
                break;
            Py_DECREF(list);
            return JSON_OTHER;
        }
    }
    *out = list;
    return JSON_OK;
}

static int json_hash(JsonCursor *c, PyObject **out) {
    uint64_t value;
    if (!json_uint(c, UINT64_MAX, &value))
        return JSON_OTHER;
    *out = PyLong_FromUnsignedLongLong(value);
    return *out == NULL ? JSON_ERROR : JSON_OK;
}

/* null or an integer up to `max`, as None or an int. */
static int json_optional_uint(JsonCursor *c, uint64_t max, PyObject **out) {
    if (json_null(c)) {
        *out = Py_NewRef(Py_None);
        return JSON_OK;
    }
    uint64_t value;
    if (!json_uint(c, max, &value))
        return JSON_OTHER;
    *out = PyLong_FromUnsignedLongLong(value);
    return *out == NULL ? JSON_ERROR : JSON_OK;
}

/* A member's value into `*slot` once: a repeated key or a value not of the fast form ends it. */
#define JSON_FIELD(c, slot, parse)                                                                               \
    do {                                                                                                         \
        if (slot != NULL)                                                                                        \
            goto other;                                                                                          \
        int status_ = (parse);                                                                                   \
        if (status_ == JSON_ERROR)                                                                               \
            goto error;                                                                                          \
        if (status_ != JSON_OK)                                                                                  \
            goto other;                                                                                          \
    } while (0)

/* {"stored": {...}} or {"removed": {...}}: the KvCacheEventData. */
static int json_data(JsonCursor *c, PyObject **out) {
    const char *key;
    Py_ssize_t len;
    PyObject *blocks = NULL, *parent = NULL, *position = NULL, *hashes = NULL, *inner = NULL;
    int stored = 0;
    if (!json_eat(c, '{') || !json_key(c, &key, &len))
        return JSON_OTHER;
    if (KEY_IS(key, len, "stored")) {
        stored = 1;
        JSON_MEMBERS(c, key, len, {
            if (KEY_IS(key, len, "blocks"))
                JSON_FIELD(c, blocks, json_list(c, json_block, &blocks));
            else if (KEY_IS(key, len, "parent_hash"))
                JSON_FIELD(c, parent, json_optional_uint(c, UINT64_MAX, &parent));
            else if (KEY_IS(key, len, "start_position"))
                JSON_FIELD(c, position, json_optional_uint(c, UINT32_MAX, &position));
            else
                goto other;
        });
        if (blocks == NULL)
            goto other;
        PyObject *values[3] = {blocks, parent ? parent : Py_NewRef(Py_None), position ? position : Py_NewRef(Py_None)};
        blocks = parent = position = NULL;
        inner = wire_new(WIRE_STORED, values);
    } else if (KEY_IS(key, len, "removed")) {
        JSON_MEMBERS(c, key, len, {
            if (KEY_IS(key, len, "block_hashes"))
                JSON_FIELD(c, hashes, json_list(c, json_hash, &hashes));
            else
                goto other;
        });
        if (hashes == NULL)
            goto other;
        PyObject *values[1] = {hashes};
        hashes = NULL;
        inner = wire_new(WIRE_REMOVED, values);
    } else {
        return JSON_OTHER;
    }
    if (inner == NULL)
        return JSON_ERROR;
    if (!json_eat(c, '}')) { /* a second kind of data, or anything else: msgspec decides */
        Py_DECREF(inner);
        return JSON_OTHER;
    }
    /* The kind not present is UNSET, as msgspec leaves it (None would be a second key, refused). */
    PyObject *values[3] = {stored ? inner : Py_NewRef(wire_unset), stored ? Py_NewRef(wire_unset) : inner,
                           Py_NewRef(wire_unset)};
    *out = wire_new(WIRE_DATA, values);
    return *out == NULL ? JSON_ERROR : JSON_OK;
other:
    Py_XDECREF(blocks);
    Py_XDECREF(parent);
    Py_XDECREF(position);
    Py_XDECREF(hashes);
    return JSON_OTHER;
error:
    Py_XDECREF(blocks);
    Py_XDECREF(parent);
    Py_XDECREF(position);
    Py_XDECREF(hashes);
    return JSON_ERROR;
}

/* The event's data: the bare string "cleared" or one of the two objects. */
static int json_event_data(JsonCursor *c, PyObject **out) {
    if (json_peek(c, '"')) {
        const char *text;
        Py_ssize_t len;
        if (!json_plain_string(c, &text, &len) || !KEY_IS(text, len, "cleared"))
            return JSON_OTHER;
        *out = Py_NewRef(wire_cleared);
        return JSON_OK;
    }
    return json_data(c, out);
}

static int json_event(JsonCursor *c, PyObject **out) {
    const char *key;
    Py_ssize_t len;
    PyObject *event_id = NULL, *data = NULL, *dp_rank = NULL;
    JSON_MEMBERS(c, key, len, {
        if (KEY_IS(key, len, "event_id"))
            JSON_FIELD(c, event_id, json_hash(c, &event_id));
        else if (KEY_IS(key, len, "data"))
            JSON_FIELD(c, data, json_event_data(c, &data));
        else if (KEY_IS(key, len, "dp_rank"))
            JSON_FIELD(c, dp_rank, json_optional_uint(c, UINT32_MAX, &dp_rank));
        else
            goto other;
    });
    if (event_id == NULL || data == NULL || dp_rank == Py_None)
        goto other;
    PyObject *values[3] = {event_id, data, dp_rank ? dp_rank : PyLong_FromLong(0)};
    *out = wire_new(WIRE_EVENT, values);
    return *out == NULL ? JSON_ERROR : JSON_OK;
other:
    Py_XDECREF(event_id);
    Py_XDECREF(data);
    Py_XDECREF(dp_rank);
    return JSON_OTHER;
error:
    Py_XDECREF(event_id);
    Py_XDECREF(data);
    Py_XDECREF(dp_rank);
    return JSON_ERROR;
}

static int json_router_event(JsonCursor *c, PyObject **out) {
    const char *key;
    Py_ssize_t len;
    PyObject *worker_id = NULL, *event = NULL;
    int tier_seen = 0;
    JSON_MEMBERS(c, key, len, {
        if (KEY_IS(key, len, "worker_id")) {
            JSON_FIELD(c, worker_id, json_hash(c, &worker_id));
        } else if (KEY_IS(key, len, "event")) {
            JSON_FIELD(c, event, json_event(c, &event));
        } else if (KEY_IS(key, len, "storage_tier") && !tier_seen) {
            const char *tier;
            Py_ssize_t tier_len;
            if (!json_plain_string(c, &tier, &tier_len) || !KEY_IS(tier, tier_len, "device"))
                goto other;
            tier_seen = 1;
        } else {
            goto other;
        }
    });
    if (worker_id == NULL || event == NULL)
        goto other;
    PyObject *values[3] = {worker_id, event, Py_NewRef(wire_device)};
    *out = wire_new(WIRE_ROUTER, values);
    return *out == NULL ? JSON_ERROR : JSON_OK;
other:
    Py_XDECREF(worker_id);
    Py_XDECREF(event);
    return JSON_OTHER;
error:
    Py_XDECREF(worker_id);
    Py_XDECREF(event);
    return JSON_ERROR;
}

static PyObject *py_router_events_json(PyObject *self, PyObject *payload) {
    if (!wire_bound) {
        PyErr_SetString(PyExc_RuntimeError, "bind_event_types was not called");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    JsonCursor c = {(const char *)view.buf, (const char *)view.buf + view.len};
    PyObject *events = NULL;
    int status;
    if (json_peek(&c, '[')) {
        status = json_list(&c, json_router_event, &events);
    } else {
        PyObject *event = NULL;
        status = json_router_event(&c, &event);
        if (status == JSON_OK) {
            events = PyList_New(1);
            if (events == NULL) {
                Py_DECREF(event);
                status = JSON_ERROR;
            } else {
                PyList_SET_ITEM(events, 0, event);
            }
        }
    }
    if (status == JSON_OK) {
        json_ws(&c);
        if (c.p != c.end) { /* trailing bytes: msgspec names the error */
            Py_CLEAR(events);
            status = JSON_OTHER;
        }
    }
    PyBuffer_Release(&view);
    if (status == JSON_ERROR)
        return NULL;
    if (status == JSON_OTHER)
        Py_RETURN_NONE;
    return events;
}

/* ------------------------------------------------------------------ module */

/* set_map_key(key) -> None: the key of every BlockMap made from now on (a u64). */
static PyObject *py_set_map_key(PyObject *self, PyObject *key) {
    uint64_t value;
    if (as_u64(key, &value) < 0)
        return NULL;
    map_key_for_new = value;
    map_key_set = 1;
    Py_RETURN_NONE;
}

static PyMethodDef native_methods[] = {
    {"xxh3_64", py_xxh3_64, METH_VARARGS, "xxh3_64(data, seed=0) -> int: XXH3-64 of a bytes-like object."},
    {"block_hashes", py_block_hashes, METH_VARARGS,
     "block_hashes(packed, seed, stride, window) -> list[int]: XXH3-64 of every full window."},
    {"pack_u32", py_pack_u32, METH_O, "pack_u32(tokens) -> bytes | None: ints in [0, 2^32) as packed little-endian u32."},
    {"sequence_hashes", py_sequence_hashes, METH_VARARGS,
     "sequence_hashes(local_hashes, seed) -> tuple[int, ...]: Dynamo's rolling sequence hashes."},
    {"has_wide_hash", py_has_wide_hash, METH_O,
     "has_wide_hash(blocks) -> bool: whether any block hash is outside [0, 2^64)."},
    {"store_chain", (PyCFunction)(void (*)(void))py_store_chain, METH_FASTCALL,
     "store_chain(root, parent_hash, blocks, bit, lookup, aliases, disown, state) -> (created, newly_owned, "
     "branched) | None."},
    {"remove_blocks", py_remove_blocks, METH_VARARGS,
     "remove_blocks(root, lookup, aliases, hashes, bit) -> (missing, disowned, pruned, unbranched)."},
    {"msgpack_u32s", py_msgpack_u32s, METH_O,
     "msgpack_u32s(data) -> bytes | None: a msgpack array of u32 ints as packed little-endian u32."},
    {"msgpack_rows", py_msgpack_rows, METH_VARARGS,
     "msgpack_rows(first, second, before, between, after) -> bytes | None: an array of rows of two u64."},
    {"match_prefix", py_match_prefix, METH_VARARGS,
     "match_prefix(root, local_hashes, keys, scores, path) -> None: the find_matches walk."},
    {"set_map_key", py_set_map_key, METH_O, "set_map_key(key) -> None: the hash key of the BlockMaps made from now on."},
    {"bind_event_types", py_bind_event_types, METH_VARARGS,
     "bind_event_types(router, event, data, stored, removed, block, device, unset, cleared) -> bool."},
    {"router_events_json", py_router_events_json, METH_O,
     "router_events_json(payload) -> list[RouterEvent] | None: msgspec's decode of the common JSON form."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "indexer._native", "kv-router's optional C accelerator (see indexer/native.py).", -1,
    native_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&NodeType) < 0 || PyType_Ready(&BlockMapType) < 0)
        return NULL;
    u64_end = PyLong_FromString("18446744073709551616", NULL, 10);
    if (u64_end == NULL)
        return NULL;
    str_block_hash = PyUnicode_InternFromString("block_hash");
    str_tokens_hash = PyUnicode_InternFromString("tokens_hash");
    if (str_block_hash == NULL || str_tokens_hash == NULL)
        return NULL;
    PyObject *module = PyModule_Create(&native_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "Node", (PyObject *)&NodeType) < 0 ||
        PyModule_AddObjectRef(module, "BlockMap", (PyObject *)&BlockMapType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
