/* msgpack writers shared by indexer/_native.c and indexer/_events_native.c: the shortest forms, as
 * msgspec writes them, so that bytes built in C equal msgspec's byte for byte. The caller sizes the
 * buffer: an unsigned int takes at most 9 bytes, an array header at most 5. */
#ifndef KV_ROUTER_MSGPACK_WRITE_H
#define KV_ROUTER_MSGPACK_WRITE_H

#include <Python.h>
#include <stdint.h>

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
