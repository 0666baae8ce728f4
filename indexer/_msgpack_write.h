/* msgpack writers shared by indexer/_native.c and indexer/_events_native.c: the shortest forms, as
 * msgspec writes them, so that bytes built in C equal msgspec's byte for byte. The caller sizes the
 * buffer: an unsigned int takes at most 9 bytes, an array header at most 5. */
#ifndef KV_ROUTER_MSGPACK_WRITE_H
#define KV_ROUTER_MSGPACK_WRITE_H

#include <Python.h>
#include <stdint.h>

/* A writer's buffer of at most `size` bytes (NULL with MemoryError set), and the bytes of what was
 * written into it, which frees it: the public API cannot shrink a bytes object, so the exact length
 * is copied out (a memcpy of the event, small beside writing it). */
static inline uint8_t *scratch_new(Py_ssize_t size) {
    uint8_t *buffer = PyMem_Malloc((size_t)(size > 0 ? size : 1));
    if (buffer == NULL)
        PyErr_NoMemory();
    return buffer;
}

static inline PyObject *scratch_bytes(uint8_t *start, const uint8_t *end) {
    PyObject *bytes = PyBytes_FromStringAndSize((const char *)start, end - start);
    PyMem_Free(start);
    return bytes;
}

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

static inline uint8_t *put_array_header(uint8_t *out, Py_ssize_t n) {
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
    return out;
}

#endif
