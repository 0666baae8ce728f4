/* indexer._native: the per-block inner loops of kv-router in C (optional accelerator).
 *
 * Everything here has a pure-Python twin that gives the same answers bit for bit (`indexer/native.py`
 * chooses; the tests compare both): XXH3-64 written from its public specification, Dynamo's block and
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

/* ------------------------------------------------------------------ XXH3-64 (public specification) */

#define PRIME32_1 0x9E3779B1U
#define PRIME32_2 0x85EBCA77U
#define PRIME32_3 0xC2B2AE3DU
#define PRIME64_1 0x9E3779B185EBCA87ULL
#define PRIME64_2 0xC2B2AE3D27D4EB4FULL
#define PRIME64_3 0x165667B19E3779F9ULL
#define PRIME64_4 0x85EBCA77C2B2AE63ULL
#define PRIME64_5 0x27D4EB2F165667C5ULL
#define PRIME_MX1 0x165667919E3779F9ULL
#define PRIME_MX2 0x9FB21C651E98DF25ULL

#define SECRET_SIZE 192
#define STRIPE_LEN 64
#define SECRET_CONSUME_RATE 8
#define ACC_NB 8

static const uint8_t kSecret[SECRET_SIZE] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

static inline uint32_t read32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
#if PY_BIG_ENDIAN
    v = __builtin_bswap32(v);
#endif
    return v;
}

static inline uint64_t read64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if PY_BIG_ENDIAN
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline void write64(uint8_t *p, uint64_t v) {
#if PY_BIG_ENDIAN
    v = __builtin_bswap64(v);
#endif
    memcpy(p, &v, 8);
}

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t mul128_fold64(uint64_t a, uint64_t b) {
    __uint128_t product = (__uint128_t)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
}

static inline uint64_t xxh64_avalanche(uint64_t h) {
    h ^= h >> 33;
    h *= PRIME64_2;
    h ^= h >> 29;
    h *= PRIME64_3;
    h ^= h >> 32;
    return h;
}

static inline uint64_t xxh3_avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= PRIME_MX1;
    h ^= h >> 32;
    return h;
}

static inline uint64_t rrmxmx(uint64_t h, uint64_t len) {
    h ^= rotl64(h, 49) ^ rotl64(h, 24);
    h *= PRIME_MX2;
    h ^= (h >> 35) + len;
    h *= PRIME_MX2;
    h ^= h >> 28;
    return h;
}

static inline uint64_t len_1to3(const uint8_t *in, size_t len, uint64_t seed) {
    uint32_t combined = ((uint32_t)in[0] << 16) | ((uint32_t)in[len >> 1] << 24) | (uint32_t)in[len - 1] |
                        ((uint32_t)len << 8);
    uint64_t bitflip = (uint64_t)(read32(kSecret) ^ read32(kSecret + 4)) + seed;
    return xxh64_avalanche((uint64_t)combined ^ bitflip);
}

static inline uint64_t len_4to8(const uint8_t *in, size_t len, uint64_t seed) {
    seed ^= (uint64_t)__builtin_bswap32((uint32_t)seed) << 32;
    uint32_t lo = read32(in), hi = read32(in + len - 4);
    uint64_t bitflip = (read64(kSecret + 8) ^ read64(kSecret + 16)) - seed;
    uint64_t keyed = ((uint64_t)hi + ((uint64_t)lo << 32)) ^ bitflip;
    return rrmxmx(keyed, len);
}

static inline uint64_t len_9to16(const uint8_t *in, size_t len, uint64_t seed) {
    uint64_t bitflip1 = (read64(kSecret + 24) ^ read64(kSecret + 32)) + seed;
    uint64_t bitflip2 = (read64(kSecret + 40) ^ read64(kSecret + 48)) - seed;
    uint64_t lo = read64(in) ^ bitflip1;
    uint64_t hi = read64(in + len - 8) ^ bitflip2;
    uint64_t acc = len + __builtin_bswap64(lo) + hi + mul128_fold64(lo, hi);
    return xxh3_avalanche(acc);
}

static inline uint64_t mix16(const uint8_t *in, const uint8_t *secret, uint64_t seed) {
    return mul128_fold64(read64(in) ^ (read64(secret) + seed), read64(in + 8) ^ (read64(secret + 8) - seed));
}

static inline uint64_t len_17to128(const uint8_t *in, size_t len, uint64_t seed) {
    uint64_t acc = len * PRIME64_1;
    if (len > 32) {
        if (len > 64) {
            if (len > 96) {
                acc += mix16(in + 48, kSecret + 96, seed);
                acc += mix16(in + len - 64, kSecret + 112, seed);
            }
            acc += mix16(in + 32, kSecret + 64, seed);
            acc += mix16(in + len - 48, kSecret + 80, seed);
        }
        acc += mix16(in + 16, kSecret + 32, seed);
        acc += mix16(in + len - 32, kSecret + 48, seed);
    }
    acc += mix16(in, kSecret, seed);
    acc += mix16(in + len - 16, kSecret + 16, seed);
    return xxh3_avalanche(acc);
}

static uint64_t len_129to240(const uint8_t *in, size_t len, uint64_t seed) {
    uint64_t acc = len * PRIME64_1;
    size_t rounds = len / 16, i;
    for (i = 0; i < 8; i++)
        acc += mix16(in + 16 * i, kSecret + 16 * i, seed);
    acc = xxh3_avalanche(acc);
    for (i = 8; i < rounds; i++)
        acc += mix16(in + 16 * i, kSecret + 16 * (i - 8) + 3, seed);
    acc += mix16(in + len - 16, kSecret + 136 - 17, seed);
    return xxh3_avalanche(acc);
}

static inline void accumulate_512(uint64_t *acc, const uint8_t *in, const uint8_t *secret) {
    for (int i = 0; i < ACC_NB; i++) {
        uint64_t value = read64(in + 8 * i);
        uint64_t key = value ^ read64(secret + 8 * i);
        acc[i ^ 1] += value;
        acc[i] += (uint64_t)(uint32_t)key * (key >> 32);
    }
}

static inline void scramble(uint64_t *acc, const uint8_t *secret) {
    for (int i = 0; i < ACC_NB; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= read64(secret + 8 * i);
        a *= PRIME32_1;
        acc[i] = a;
    }
}

static uint64_t len_long(const uint8_t *in, size_t len, uint64_t seed) {
    uint8_t secret[SECRET_SIZE];
    for (int i = 0; i < SECRET_SIZE / 16; i++) {
        write64(secret + 16 * i, read64(kSecret + 16 * i) + seed);
        write64(secret + 16 * i + 8, read64(kSecret + 16 * i + 8) - seed);
    }
    uint64_t acc[ACC_NB] = {PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1};
    const size_t stripes_per_block = (SECRET_SIZE - STRIPE_LEN) / SECRET_CONSUME_RATE;
    const size_t block_len = STRIPE_LEN * stripes_per_block;
    const size_t blocks = (len - 1) / block_len;
    size_t n, s;
    for (n = 0; n < blocks; n++) {
        for (s = 0; s < stripes_per_block; s++)
            accumulate_512(acc, in + n * block_len + s * STRIPE_LEN, secret + s * SECRET_CONSUME_RATE);
        scramble(acc, secret + SECRET_SIZE - STRIPE_LEN);
    }
    const size_t stripes = ((len - 1) - block_len * blocks) / STRIPE_LEN;
    for (s = 0; s < stripes; s++)
        accumulate_512(acc, in + blocks * block_len + s * STRIPE_LEN, secret + s * SECRET_CONSUME_RATE);
    accumulate_512(acc, in + len - STRIPE_LEN, secret + SECRET_SIZE - STRIPE_LEN - 7);
    uint64_t result = len * PRIME64_1;
    for (int i = 0; i < 4; i++)
        result += mul128_fold64(acc[2 * i] ^ read64(secret + 11 + 16 * i), acc[2 * i + 1] ^ read64(secret + 11 + 16 * i + 8));
    return xxh3_avalanche(result);
}

static uint64_t xxh3_64(const uint8_t *in, size_t len, uint64_t seed) {
    if (len <= 16) {
        if (len > 8)
            return len_9to16(in, len, seed);
        if (len >= 4)
            return len_4to8(in, len, seed);
        if (len)
            return len_1to3(in, len, seed);
        return xxh64_avalanche(seed ^ (read64(kSecret + 56) ^ read64(kSecret + 64)));
    }
    if (len <= 128)
        return len_17to128(in, len, seed);
    if (len <= 240)
        return len_129to240(in, len, seed);
    return len_long(in, len, seed);
}

/* The sequence-hash step: XXH3-64(le64(previous) || le64(local), seed). */
static inline uint64_t chain_step(uint64_t previous, uint64_t local, uint64_t seed) {
    uint8_t pair[16];
    write64(pair, previous);
    write64(pair + 8, local);
    return len_9to16(pair, 16, seed);
}

/* ------------------------------------------------------------------ helpers */

/* A u64 from a Python int; -1 with an exception set (OverflowError, TypeError) otherwise. Reads
 * the digits of a small exact int directly: CPython 3.11's generic conversion goes through a byte
 * array and was a tenth of the tree's store loop. */
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
    unsigned long long v = PyLong_AsUnsignedLongLong(value);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (uint64_t)v;
    return 0;
}

/* The two hash fields of a stored block (msgspec structs keep fields in slots): read at the slot
 * offsets of the block's type, resolved once, else by attribute. New references. */
static PyObject *str_block_hash, *str_tokens_hash;
static PyTypeObject *block_type;
static Py_ssize_t block_hash_offset, tokens_hash_offset;

static Py_ssize_t slot_offset(PyTypeObject *type, PyObject *name) {
    PyObject *descr = _PyType_Lookup(type, name);
    if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type))
        return -1;
    PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
    return member->type == T_OBJECT_EX ? member->offset : -1;
}

static int block_hashes_of(PyObject *block, PyObject **block_hash, PyObject **tokens_hash) {
    PyTypeObject *type = Py_TYPE(block);
    if (type != block_type) {
        Py_ssize_t block_offset = slot_offset(type, str_block_hash), tokens_offset = slot_offset(type, str_tokens_hash);
        if (block_offset >= 0 && tokens_offset >= 0) {
            Py_XSETREF(block_type, (PyTypeObject *)Py_NewRef(type));
            block_hash_offset = block_offset;
            tokens_hash_offset = tokens_offset;
        }
    }
    if (type == block_type) {
        PyObject *b = *(PyObject **)((char *)block + block_hash_offset);
        PyObject *t = *(PyObject **)((char *)block + tokens_hash_offset);
        if (b != NULL && t != NULL) {
            *block_hash = Py_NewRef(b);
            *tokens_hash = Py_NewRef(t);
            return 0;
        }
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
    PyObject *owners;   /* int bitmask over slots */
    PyObject *children; /* None, the only child (a Node), or a dict local_hash -> Node */
} NodeObject;

static PyTypeObject NodeType;

#define Node_Check(op) Py_IS_TYPE(op, &NodeType)

/* Not tracked by the cyclic GC, as the Python node is not: the tree dismantles its links itself. */
static void Node_dealloc(NodeObject *self) {
    Py_XDECREF(self->parent);
    Py_XDECREF(self->owners);
    Py_XDECREF(self->children);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static NodeObject *node_new(uint64_t block_hash, uint64_t local_hash, PyObject *parent, PyObject *owners) {
    NodeObject *node = PyObject_New(NodeObject, &NodeType);
    if (node == NULL)
        return NULL;
    node->block_hash = block_hash;
    node->local_hash = local_hash;
    Py_INCREF(parent);
    node->parent = parent;
    Py_INCREF(owners);
    node->owners = owners;
    Py_INCREF(Py_None);
    node->children = Py_None;
    return node;
}

static PyObject *Node_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"block_hash", "local_hash", "parent", "owners", "children", NULL};
    PyObject *block, *local, *parent, *owners, *children = Py_None;
    uint64_t block_hash, local_hash;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO|O", kwlist, &block, &local, &parent, &owners, &children))
        return NULL;
    if (as_u64(block, &block_hash) < 0 || as_u64(local, &local_hash) < 0)
        return NULL;
    NodeObject *node = node_new(block_hash, local_hash, parent, owners);
    if (node != NULL) {
        Py_INCREF(children);
        Py_SETREF(node->children, children);
    }
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
static PyObject *Node_get_owners(NodeObject *self, void *closure) { return Py_NewRef(self->owners); }
static PyObject *Node_get_children(NodeObject *self, void *closure) { return Py_NewRef(self->children); }
static int Node_set_parent(NodeObject *self, PyObject *v, void *c) { return Node_set_object(self, v, &self->parent, "parent"); }
static int Node_set_owners(NodeObject *self, PyObject *v, void *c) {
    if (v != NULL && !PyLong_Check(v)) {
        PyErr_SetString(PyExc_TypeError, "owners must be an int");
        return -1;
    }
    return Node_set_object(self, v, &self->owners, "owners");
}
static int Node_set_children(NodeObject *self, PyObject *v, void *c) {
    return Node_set_object(self, v, &self->children, "children");
}

static PyObject *Node_repr(NodeObject *self) {
    PyObject *owners = PyNumber_ToBase(self->owners, 16);
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

/* store_chain(node, blocks, bit, lookup, aliases, disown, state) -> (created, newly_owned, branched)
 *
 * The hot loop of `RadixTree._store`, step for step: walk or extend the chain below `node`, mark
 * `bit` (a slot below 64) on every block, record aliases, map each block hash to its node in
 * `lookup`, and call `disown(state, node)` for a node the worker's hash moved away from. */
static PyObject *py_store_chain(PyObject *self, PyObject *args) {
    PyObject *start, *blocks, *bit, *lookup, *aliases, *disown, *state;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!OO", &NodeType, &start, &PyList_Type, &blocks, &PyLong_Type, &bit,
                          &PyDict_Type, &lookup, &PyDict_Type, &aliases, &disown, &state))
        return NULL;
    uint64_t bit_value;
    if (owners_u64(bit, &bit_value) < 0)
        return NULL;
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
            child = node_new(block_hash, local_hash, (PyObject *)node, bit);
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
            uint64_t owners;
            if (owners_u64(child->owners, &owners) < 0) {
                /* Wider masks (a slot of 64 or more owns this node): test and set in Python ints. */
                PyErr_Clear();
                PyObject *shared = PyNumber_And(child->owners, bit);
                if (shared == NULL)
                    goto error_block;
                int owned = PyObject_IsTrue(shared);
                Py_DECREF(shared);
                owners = owned ? bit_value : 0;
            }
            if (!(owners & bit_value)) {
                PyObject *widened = PyNumber_Or(child->owners, bit);
                if (widened == NULL)
                    goto error_block;
                Py_SETREF(child->owners, widened);
                newly_owned++;
            }
            if (child->block_hash != block_hash && PyDict_SetItem(aliases, (PyObject *)child, block_obj) < 0)
                goto error_block;
        }
        PyObject *previous = PyDict_SetDefault(lookup, block_obj, (PyObject *)child);
        if (previous == NULL)
            goto error_block;
        if (previous != (PyObject *)child) {
            Py_INCREF(previous);
            int owned = 0;
            if (Node_Check(previous)) {
                PyObject *shared = PyNumber_And(((NodeObject *)previous)->owners, bit);
                owned = shared == NULL ? -1 : PyObject_IsTrue(shared);
                Py_XDECREF(shared);
            }
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
            if (PyDict_SetItem(lookup, block_obj, (PyObject *)child) < 0)
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
        uint64_t owners;
        if (owners_u64(((NodeObject *)found)->owners, &owners) < 0)
            goto error;
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
    uint64_t owners;
    if (owners_u64(node->owners, &owners) == 0) {
        *held = (owners & bit_value) != 0;
        if (*held) {
            PyObject *narrowed = PyLong_FromUnsignedLongLong(owners & ~bit_value);
            if (narrowed == NULL)
                return -1;
            Py_SETREF(node->owners, narrowed);
        }
        return 0;
    }
    PyErr_Clear(); /* a mask wider than 64 bits: Python int arithmetic */
    PyObject *shared = PyNumber_And(node->owners, bit);
    if (shared == NULL)
        return -1;
    *held = PyObject_IsTrue(shared);
    Py_DECREF(shared);
    if (*held < 0)
        return -1;
    if (*held) {
        PyObject *narrowed = PyNumber_Xor(node->owners, bit);
        if (narrowed == NULL)
            return -1;
        Py_SETREF(node->owners, narrowed);
    }
    return 0;
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
    if (!PyArg_ParseTuple(args, "O!O!O!OO!", &NodeType, &root, &PyDict_Type, &lookup, &PyDict_Type, &aliases, &hashes,
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
        PyObject *found = PyDict_GetItemWithError(lookup, items[i]);
        if (found == NULL) {
            if (PyErr_Occurred() || PyList_Append(missing, items[i]) < 0)
                goto error;
            continue;
        }
        NodeObject *node = (NodeObject *)Py_NewRef(found);
        if (PyDict_DelItem(lookup, items[i]) < 0) {
            Py_DECREF(node);
            goto error;
        }
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
            uint64_t owners;
            int ownerless;
            if (owners_u64(node->owners, &owners) == 0) {
                ownerless = owners == 0;
            } else {
                PyErr_Clear();
                ownerless = PyObject_Not(node->owners);
                if (ownerless < 0) {
                    Py_DECREF(node);
                    goto error;
                }
            }
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
static inline uint8_t *put_uint(uint8_t *out, uint64_t v) {
    if (v < 128) {
        *out++ = (uint8_t)v;
    } else if (v <= 0xFF) {
        *out++ = 0xcc;
        *out++ = (uint8_t)v;
    } else if (v <= 0xFFFF) {
        *out++ = 0xcd;
        *out++ = (uint8_t)(v >> 8);
        *out++ = (uint8_t)v;
    } else if (v <= 0xFFFFFFFFull) {
        *out++ = 0xce;
        for (int shift = 24; shift >= 0; shift -= 8)
            *out++ = (uint8_t)(v >> shift);
    } else {
        *out++ = 0xcf;
        for (int shift = 56; shift >= 0; shift -= 8)
            *out++ = (uint8_t)(v >> shift);
    }
    return out;
}

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
    result = PyBytes_FromStringAndSize(NULL, 5 + n * row);
    if (result == NULL)
        goto done;
    uint8_t *start = (uint8_t *)PyBytes_AS_STRING(result), *out = start;
    if (n < 16) {
        *out++ = (uint8_t)(0x90 | n);
    } else if (n <= 0xFFFF) {
        *out++ = 0xdc;
        *out++ = (uint8_t)(n >> 8);
        *out++ = (uint8_t)n;
    } else {
        *out++ = 0xdd;
        for (int shift = 24; shift >= 0; shift -= 8)
            *out++ = (uint8_t)((uint64_t)n >> shift);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t a, b;
        if (as_u64(PyList_GET_ITEM(first, i), &a) < 0 || as_u64(PyList_GET_ITEM(second, i), &b) < 0) {
            PyErr_Clear();
            Py_CLEAR(result);
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
    _PyBytes_Resize(&result, out - start);
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

/* ------------------------------------------------------------------ module */

static PyMethodDef native_methods[] = {
    {"xxh3_64", py_xxh3_64, METH_VARARGS, "xxh3_64(data, seed=0) -> int: XXH3-64 of a bytes-like object."},
    {"block_hashes", py_block_hashes, METH_VARARGS,
     "block_hashes(packed, seed, stride, window) -> list[int]: XXH3-64 of every full window."},
    {"pack_u32", py_pack_u32, METH_O, "pack_u32(tokens) -> bytes | None: ints in [0, 2^32) as packed little-endian u32."},
    {"sequence_hashes", py_sequence_hashes, METH_VARARGS,
     "sequence_hashes(local_hashes, seed) -> tuple[int, ...]: Dynamo's rolling sequence hashes."},
    {"has_wide_hash", py_has_wide_hash, METH_O,
     "has_wide_hash(blocks) -> bool: whether any block hash is outside [0, 2^64)."},
    {"store_chain", py_store_chain, METH_VARARGS,
     "store_chain(node, blocks, bit, lookup, aliases, disown, state) -> (created, newly_owned, branched)."},
    {"remove_blocks", py_remove_blocks, METH_VARARGS,
     "remove_blocks(root, lookup, aliases, hashes, bit) -> (missing, disowned, pruned, unbranched)."},
    {"msgpack_u32s", py_msgpack_u32s, METH_O,
     "msgpack_u32s(data) -> bytes | None: a msgpack array of u32 ints as packed little-endian u32."},
    {"msgpack_rows", py_msgpack_rows, METH_VARARGS,
     "msgpack_rows(first, second, before, between, after) -> bytes | None: an array of rows of two u64."},
    {"match_prefix", py_match_prefix, METH_VARARGS,
     "match_prefix(root, local_hashes, keys, scores, path) -> None: the find_matches walk."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "indexer._native", "kv-router's optional C accelerator (see indexer/native.py).", -1,
    native_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&NodeType) < 0)
        return NULL;
    str_block_hash = PyUnicode_InternFromString("block_hash");
    str_tokens_hash = PyUnicode_InternFromString("tokens_hash");
    if (str_block_hash == NULL || str_tokens_hash == NULL)
        return NULL;
    PyObject *module = PyModule_Create(&native_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "Node", (PyObject *)&NodeType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
