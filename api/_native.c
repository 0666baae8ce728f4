/* api._native: the HTTP front's per-request parsing in C (optional accelerator, api/native.py).
 *
 * Each function has a pure-Python path that gives the same answers (tests/test_native_api.py): a
 * JSON body's array of token ids to packed u32 (the decision API's `tokens`, api/codec.py; a
 * completion's `prompt`, api/proxy/service.py) and one whole plain POST request
 * (api/http_protocol.py), the bytes of one response (api/http_protocol.py) and a histogram series
 * (api/metrics.py).
 *
 * Guardrail: a function that meets input it was not written for returns None, so the caller's
 * ordinary parser runs and gives the exact error or meaning.
 */
/* Raised whenever a function's signature or meaning changes: api/native.py runs the Python paths
 * rather than call a stale in-place build (one made before a `git pull`) with the new signatures. */
#define NATIVE_INTERFACE 2

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

/* ------------------------------------------------------------------ JSON token arrays (codec.py, the proxy)
 *
 * split_json_tokens(body, member=b"tokens", /) -> (packed, start, end) | None: for a JSON object body
 * whose top-level member of that name ("tokens" for the decision API, "prompt" for the proxy's
 * completions) is an array of integers in [0, 2^32), the ids as packed little-endian u32 and the
 * byte span of that array in the body. None for anything else (no such member, or a value this
 * parser does not take as it is: another JSON value, a float, an exponent, a leading zero, a value
 * out of range, an escaped key, a repeated key of that name, bad syntax): the caller then decodes the
 * body the ordinary way, which gives the exact error or meaning. Only that array is parsed;
 * the other members are skipped (strings, nesting) for the caller's decoder to check. */
static inline int json_space(uint8_t c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

static const uint8_t *skip_space(const uint8_t *p, const uint8_t *end) {
    while (p < end && json_space(*p))
        p++;
    return p;
}

/* Past a string starting at its opening quote; NULL when unterminated. */
static const uint8_t *skip_string(const uint8_t *p, const uint8_t *end) {
    for (p++; p < end; p++) {
        if (*p == '\\')
            p++;
        else if (*p == '"')
            return p + 1;
    }
    return NULL;
}

/* Past one value (not checked: the caller's decoder checks it); NULL at the end of the input. */
static const uint8_t *skip_value(const uint8_t *p, const uint8_t *end) {
    Py_ssize_t depth = 0;
    while (p < end) {
        uint8_t c = *p;
        if (c == '"') {
            p = skip_string(p, end);
            if (p == NULL)
                return NULL;
            if (depth == 0)
                return p;
            continue;
        }
        if (c == '{' || c == '[') {
            depth++;
        } else if (c == '}' || c == ']') {
            if (depth == 0)
                return p; /* the end of the enclosing object: a scalar ended here */
            if (--depth == 0)
                return p + 1;
        } else if (c == ',' && depth == 0) {
            return p;
        }
        p++;
    }
    return NULL;
}

/* The run of ASCII digits starting at `p`, read 8 bytes at once (`p` has at least 8 readable bytes):
 * its length when it is 1 to 7 digits long, with its value in `*value`; 0 otherwise (no digit, or 8
 * or more: the caller reads those a byte at a time). One load and no branch per digit: a token's
 * digit count varies from one to the next, which a loop per byte pays for in mispredicted branches. */
static inline Py_ssize_t short_digit_run(const uint8_t *p, uint64_t *value) {
    uint64_t chunk;
    memcpy(&chunk, p, 8);
    /* A byte is a digit when its high nibble is 3 both as it is and with 6 added (low nibble <= 9).
     * A carry out of a byte (>= 0xFA, not a digit) only disturbs the bytes after the first
     * non-digit, which are not read. */
    const uint64_t high = 0xF0F0F0F0F0F0F0F0ULL, threes = 0x3030303030303030ULL;
    uint64_t not_digit = ((chunk & high) ^ threes) | (((chunk + 0x0606060606060606ULL) & high) ^ threes);
    if (not_digit == 0)
        return 0;
    Py_ssize_t n = __builtin_ctzll(not_digit) / 8; /* little-endian: the first byte is the lowest */
    if (n == 0)
        return 0;
    /* The n digits moved to the top bytes, zeros below them: "000ddddd" as 8 digits, summed in pairs,
     * fours and eights (the first character is the lowest byte). */
    uint64_t digits = (chunk & 0x0F0F0F0F0F0F0F0FULL) << (8 * (8 - n));
    digits = (digits * 10 + (digits >> 8)) & 0x00FF00FF00FF00FFULL;
    digits = (digits * 100 + (digits >> 16)) & 0x0000FFFF0000FFFFULL;
    digits = (digits * 10000 + (digits >> 32)) & 0xFFFFFFFFULL;
    *value = digits;
    return n;
}

/* Parse a token array at `p` into `dst`; returns past the array, or NULL if it is not one.
 * The caller guarantees that a non-digit byte ends the input (the body's closing brace), so digit
 * runs need no bounds check. */
static const uint8_t *parse_token_array(const uint8_t *p, const uint8_t *end, uint8_t *dst, Py_ssize_t *count) {
    uint8_t *const first = dst;
    if (p == end || *p != '[')
        return NULL;
    p = skip_space(p + 1, end);
    if (p < end && *p == ']') {
        *count = 0;
        return p + 1;
    }
    for (;;) {
        if ((uint8_t)(*p - '0') > 9) {
            p = skip_space(p, end);
            if (p == end || (uint8_t)(*p - '0') > 9)
                return NULL;
        }
        const uint8_t *digits = p;
        uint64_t value;
        Py_ssize_t run = end - p >= 8 ? short_digit_run(p, &value) : 0;
        if (run) {
            p += run;
        } else {
            value = (uint64_t)(*p++ - '0');
            while ((uint8_t)(*p - '0') <= 9) {
                value = value * 10 + (uint64_t)(*p++ - '0');
                if (p - digits > 10)
                    return NULL;
            }
        }
        if (value > 0xFFFFFFFFULL || (*digits == '0' && p - digits > 1))
            return NULL; /* out of range, or a leading zero (not JSON) */
        uint8_t c = *p;
        if (c == '.' || c == 'e' || c == 'E')
            return NULL;
        dst[0] = (uint8_t)value;
        dst[1] = (uint8_t)(value >> 8);
        dst[2] = (uint8_t)(value >> 16);
        dst[3] = (uint8_t)(value >> 24);
        dst += 4;
        if (c == ',') {
            p++;
            continue;
        }
        p = skip_space(p, end);
        if (p == end)
            return NULL;
        if (*p == ',') {
            p++;
            continue;
        }
        if (*p == ']') {
            *count = (dst - first) / 4;
            return p + 1;
        }
        return NULL;
    }
}

/* Scratch space for parsed tokens, kept between calls (the GIL is held): a fresh buffer as large as
 * the worst case would be a new mapping, and its page faults, for every long prompt. */
static uint8_t *token_scratch;
static size_t token_scratch_size;

static PyObject *py_split_json_tokens(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    const char *member = "tokens";
    Py_ssize_t member_len = 6;
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "split_json_tokens(body, member=b'tokens', /)");
        return NULL;
    }
    if (nargs == 2) {
        if (!PyBytes_Check(args[1])) {
            PyErr_SetString(PyExc_TypeError, "split_json_tokens: member must be bytes");
            return NULL;
        }
        member = PyBytes_AS_STRING(args[1]);
        member_len = PyBytes_GET_SIZE(args[1]);
    }
    Py_buffer data;
    if (PyObject_GetBuffer(args[0], &data, PyBUF_SIMPLE) < 0)
        return NULL;
    const uint8_t *begin = (const uint8_t *)data.buf, *end = begin + data.len;
    const uint8_t *p = skip_space(begin, end), *array_start = NULL, *array_end = NULL;
    PyObject *packed;
    Py_ssize_t count = 0;
    if (p == end || *p != '{')
        goto unsupported;
    p = skip_space(p + 1, end);
    if (p < end && *p == '}')
        goto unsupported;
    for (;;) {
        if (p == end || *p != '"')
            goto unsupported;
        const uint8_t *key = p + 1;
        p = skip_string(p, end);
        if (p == NULL || memchr(key, '\\', (size_t)(p - 1 - key)) != NULL)
            goto unsupported;
        int is_tokens = p - 1 - key == member_len && memcmp(key, member, (size_t)member_len) == 0;
        p = skip_space(p, end);
        if (p == end || *p != ':')
            goto unsupported;
        p = skip_space(p + 1, end);
        if (is_tokens) {
            if (array_start != NULL)
                goto unsupported; /* a repeated key: the ordinary decoder decides */
            const uint8_t *last = end - 1;
            while (last > p && json_space(*last))
                last--;
            if (*last != '}')
                goto unsupported; /* also what lets the digit loop run without bounds checks */
            /* A token is at least one digit plus a separator: this bounds the output. */
            size_t needed = (size_t)(end - p) / 2 * 4 + 4;
            if (needed > token_scratch_size) {
                uint8_t *grown = PyMem_Realloc(token_scratch, needed);
                if (grown == NULL) {
                    PyBuffer_Release(&data);
                    return PyErr_NoMemory();
                }
                token_scratch = grown;
                token_scratch_size = needed;
            }
            array_start = p;
            p = parse_token_array(p, end, token_scratch, &count);
            if (p == NULL)
                goto unsupported;
            array_end = p;
        } else {
            p = skip_value(p, end);
            if (p == NULL)
                goto unsupported;
        }
        p = skip_space(p, end);
        if (p == end)
            goto unsupported;
        if (*p == ',') {
            p = skip_space(p + 1, end);
            continue;
        }
        if (*p == '}')
            break;
        goto unsupported;
    }
    if (array_start == NULL || skip_space(p + 1, end) != end)
        goto unsupported;
    PyBuffer_Release(&data);
    packed = PyBytes_FromStringAndSize((const char *)token_scratch, count * 4);
    if (packed == NULL)
        return NULL;
    return Py_BuildValue("Nnn", packed, (Py_ssize_t)(array_start - begin), (Py_ssize_t)(array_end - begin));
unsupported:
    PyBuffer_Release(&data);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ one whole hot HTTP request (http_protocol.py)
 *
 * `parse_post(data)`: the request in `data` when it is exactly one complete `POST` of the plainest
 * form, else None and httptools parses it as usual. Plainest form: `POST <target> HTTP/1.1`, the
 * target of URL-safe characters only, header names of token characters, values of visible ASCII and
 * inner spaces (not empty, no leading or trailing whitespace: nothing for a parser to trim or reject), one
 * Content-Length of digits with exactly that many body bytes after the head, and none of the headers
 * that change how a request is framed or answered (Connection, Transfer-Encoding, Upgrade, Expect,
 * Keep-Alive, Proxy-Connection) nor a repeated one of those it reads, and within the bounds the Python path
 * refuses past (MAX_TARGET_BYTES, MAX_HEADER_BYTES counted as on the wire, MAX_HEADERS): one past them is
 * declined, for httptools' path to refuse it. Returns (path, query,
 * content_type, accept, x_request_id, authorization, body), absent headers as None; or, when such a
 * head is complete but not all of its body is in `data` yet, the Content-Length. */
static inline int url_char(uint8_t c) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'))
        return 1;
    switch (c) {
    case '-': case '.': case '_': case '~': case '!': case '$': case '&': case '\'': case '(': case ')':
    case '*': case '+': case ',': case ';': case '=': case ':': case '@': case '/': case '%': case '?':
        return 1;
    default:
        return 0;
    }
}

static inline int token_char(uint8_t c) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'))
        return 1;
    switch (c) {
    case '!': case '#': case '$': case '%': case '&': case '\'': case '*': case '+': case '-': case '.':
    case '^': case '_': case '`': case '|': case '~':
        return 1;
    default:
        return 0;
    }
}

static int name_is(const uint8_t *name, size_t length, const char *lower) {
    size_t n = strlen(lower);
    if (length != n)
        return 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t c = name[i];
        if (c >= 'A' && c <= 'Z')
            c = (uint8_t)(c + 32);
        if (c != (uint8_t)lower[i])
            return 0;
    }
    return 1;
}

enum { H_CONTENT_TYPE, H_ACCEPT, H_REQUEST_ID, H_AUTHORIZATION, H_READ };
enum { MAX_TARGET_BYTES = 65536, MAX_HEADER_BYTES = 65536, MAX_HEADERS = 100 }; /* api/http_protocol.py's */

static PyObject *py_parse_post(PyObject *self, PyObject *data) {
    if (!PyBytes_CheckExact(data))
        Py_RETURN_NONE;
    const uint8_t *p = (const uint8_t *)PyBytes_AS_STRING(data);
    const uint8_t *end = p + PyBytes_GET_SIZE(data);
    if (end - p < 6 || memcmp(p, "POST /", 6) != 0)
        Py_RETURN_NONE;
    p += 5;
    const uint8_t *target = p, *question = NULL;
    while (p < end && *p != ' ') {
        if (!url_char(*p))
            Py_RETURN_NONE;
        if (*p == '?' && question == NULL)
            question = p;
        p++;
    }
    const uint8_t *target_end = p;
    if (target_end - target > MAX_TARGET_BYTES)
        Py_RETURN_NONE;
    if (end - p < 11 || memcmp(p, " HTTP/1.1\r\n", 11) != 0)
        Py_RETURN_NONE;
    p += 11;
    const uint8_t *values[H_READ] = {NULL, NULL, NULL, NULL};
    size_t lengths[H_READ] = {0, 0, 0, 0};
    long long content_length = -1;
    size_t header_bytes = 0;
    int fields = 0;
    for (;;) {
        if (end - p < 2)
            Py_RETURN_NONE;
        if (p[0] == '\r' && p[1] == '\n') {
            p += 2;
            break;
        }
        if (++fields > MAX_HEADERS)
            Py_RETURN_NONE;
        const uint8_t *name = p;
        while (p < end && token_char(*p))
            p++;
        size_t name_length = (size_t)(p - name);
        if (name_length == 0 || p >= end || *p != ':')
            Py_RETURN_NONE;
        p++;
        if (p < end && *p == ' ')
            p++;
        const uint8_t *value = p;
        while (p < end && *p >= 0x20 && *p <= 0x7e)
            p++;
        size_t value_length = (size_t)(p - value);
        if (end - p < 2 || p[0] != '\r' || p[1] != '\n')
            Py_RETURN_NONE;
        p += 2;
        if (value_length == 0 || value[0] == ' ' || value[value_length - 1] == ' ')
            Py_RETURN_NONE;
        header_bytes += name_length + value_length + 4; /* its line: name, ": ", value, CRLF */
        if (header_bytes > MAX_HEADER_BYTES)
            Py_RETURN_NONE;
        int slot = -1;
        if (name_is(name, name_length, "content-length")) {
            if (content_length >= 0 || value_length == 0 || value_length > 15)
                Py_RETURN_NONE;
            content_length = 0;
            for (size_t i = 0; i < value_length; i++) {
                if (value[i] < '0' || value[i] > '9')
                    Py_RETURN_NONE;
                content_length = content_length * 10 + (value[i] - '0');
            }
            continue;
        }
        if (name_is(name, name_length, "content-type"))
            slot = H_CONTENT_TYPE;
        else if (name_is(name, name_length, "accept"))
            slot = H_ACCEPT;
        else if (name_is(name, name_length, "x-request-id"))
            slot = H_REQUEST_ID;
        else if (name_is(name, name_length, "authorization"))
            slot = H_AUTHORIZATION;
        else if (name_is(name, name_length, "connection") || name_is(name, name_length, "transfer-encoding") ||
                 name_is(name, name_length, "upgrade") || name_is(name, name_length, "expect") ||
                 name_is(name, name_length, "keep-alive") || name_is(name, name_length, "proxy-connection"))
            Py_RETURN_NONE;
        if (slot >= 0) {
            if (values[slot] != NULL)
                Py_RETURN_NONE;
            values[slot] = value;
            lengths[slot] = value_length;
        }
    }
    if (content_length < 0 || content_length < end - p)
        Py_RETURN_NONE;
    if (content_length > end - p) /* the rest of the body is still to come: the caller may wait for it */
        return PyLong_FromLongLong(content_length);
    const uint8_t *path_end = question != NULL ? question : target_end;
    PyObject *items[7] = {NULL};
    items[0] = PyBytes_FromStringAndSize((const char *)target, path_end - target);
    items[1] = question != NULL ? PyBytes_FromStringAndSize((const char *)question + 1, target_end - question - 1)
                                : PyBytes_FromStringAndSize("", 0);
    for (int i = 0; i < H_READ; i++) {
        if (values[i] == NULL)
            items[2 + i] = Py_NewRef(Py_None);
        else if (i == H_REQUEST_ID)
            items[2 + i] = PyUnicode_DecodeLatin1((const char *)values[i], (Py_ssize_t)lengths[i], NULL);
        else
            items[2 + i] = PyBytes_FromStringAndSize((const char *)values[i], (Py_ssize_t)lengths[i]);
    }
    items[6] = PyBytes_FromStringAndSize((const char *)p, end - p);
    PyObject *result = PyTuple_New(7);
    for (int i = 0; i < 7; i++) {
        if (items[i] == NULL || result == NULL) {
            for (int j = 0; j < 7; j++)
                Py_XDECREF(items[j]);
            Py_XDECREF(result);
            return NULL;
        }
    }
    for (int i = 0; i < 7; i++)
        PyTuple_SET_ITEM(result, i, items[i]);
    return result;
}

/* ------------------------------------------------------------------ one response (http_protocol.py)
 *
 * response(head, body, request_id, lines) -> bytes: `head` (the status line and headers up to the
 * content-length value), the body's length, an x-request-id line when `request_id` is given and
 * holds no control character (`_BAD_HEADER_VALUE`, as the Python path checks it), the
 * already formatted header `lines`, the blank line and the body: the bytes `_respond` writes, in one
 * allocation. None when `request_id` is not latin-1 (the Python path then raises as it would). */
static int header_value_ok(const uint8_t *value, Py_ssize_t length) {
    for (Py_ssize_t i = 0; i < length; i++) {
        uint8_t c = value[i];
        if ((c <= 0x08) || (c >= 0x0A && c <= 0x1F) || c == 0x7F)
            return 0;
    }
    return 1;
}

static PyObject *py_response(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyBytes_CheckExact(args[0]) || !PyBytes_CheckExact(args[1]) || !PyBytes_CheckExact(args[3]) ||
        (args[2] != Py_None && !PyUnicode_Check(args[2]))) {
        PyErr_SetString(PyExc_TypeError, "response(head: bytes, body: bytes, request_id: str | None, lines: bytes)");
        return NULL;
    }
    Py_ssize_t head_length = PyBytes_GET_SIZE(args[0]), body_length = PyBytes_GET_SIZE(args[1]);
    Py_ssize_t lines_length = PyBytes_GET_SIZE(args[3]);
    const uint8_t *id = NULL;
    Py_ssize_t id_length = 0;
    if (args[2] != Py_None) {
        if (PyUnicode_READY(args[2]) < 0)
            return NULL;
        if (PyUnicode_KIND(args[2]) != PyUnicode_1BYTE_KIND)
            Py_RETURN_NONE;
        id = PyUnicode_1BYTE_DATA(args[2]);
        id_length = PyUnicode_GET_LENGTH(args[2]);
        if (!header_value_ok(id, id_length))
            id = NULL;
    }
    char digits[24];
    int digits_length = snprintf(digits, sizeof digits, "%zd\r\n", body_length);
    static const char id_name[] = "x-request-id: ";
    Py_ssize_t total = head_length + digits_length + lines_length + 2 + body_length;
    if (id != NULL)
        total += (Py_ssize_t)(sizeof id_name - 1) + id_length + 2;
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL)
        return NULL;
    char *w = PyBytes_AS_STRING(out);
    memcpy(w, PyBytes_AS_STRING(args[0]), head_length);
    w += head_length;
    memcpy(w, digits, digits_length);
    w += digits_length;
    if (id != NULL) {
        memcpy(w, id_name, sizeof id_name - 1);
        w += sizeof id_name - 1;
        memcpy(w, id, id_length);
        w += id_length;
        *w++ = '\r';
        *w++ = '\n';
    }
    memcpy(w, PyBytes_AS_STRING(args[3]), lines_length);
    w += lines_length;
    *w++ = '\r';
    *w++ = '\n';
    memcpy(w, PyBytes_AS_STRING(args[1]), body_length);
    return out;
}

/* ------------------------------------------------------------------ histogram series (metrics.py)
 *
 * Histogram(bounds): one series of a histogram, the twin of api/metrics.py's `_Histogram`: per-bucket
 * counts (not cumulative; the last is +Inf) and the sum. observe(value) adds one value to the first
 * bucket whose bound is not below it, exactly as `bisect_left` over the float bounds finds it (a NaN
 * lands in the first bucket, as there), and adds it to the sum as a float; an int value is taken as
 * the float Python's `float + int` makes of it. `counts` is read as a new list, `bounds` as the tuple
 * of floats given, `created` is the caller's to set. */
typedef struct {
    PyObject_HEAD
    PyObject *bounds; /* tuple of float */
    double *limits;
    unsigned long long *counts;
    Py_ssize_t buckets; /* len(bounds) + 1 */
    double total;
    double created;
} Histogram;

static void histogram_dealloc(Histogram *self) {
    Py_XDECREF(self->bounds);
    PyMem_Free(self->limits);
    PyMem_Free(self->counts);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int histogram_init(Histogram *self, PyObject *args, PyObject *kwargs) {
    PyObject *given;
    if (!PyArg_ParseTuple(args, "O:Histogram", &given))
        return -1;
    PyObject *seq = PySequence_Fast(given, "Histogram(bounds): bounds must be a sequence of numbers");
    if (seq == NULL)
        return -1;
    /* `tuple(float(bound) for bound in bounds)`, as the twin: a bound's `__float__` may change a list
     * of bounds, so its length is read again at each step and the item held while converted. */
    PyObject *floats = PyList_New(0);
    if (floats == NULL) {
        Py_DECREF(seq);
        return -1;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *item = Py_NewRef(PySequence_Fast_GET_ITEM(seq, i));
        PyObject *value = PyNumber_Float(item);
        Py_DECREF(item);
        if (value == NULL || PyList_Append(floats, value) < 0) {
            Py_XDECREF(value);
            Py_DECREF(floats);
            Py_DECREF(seq);
            return -1;
        }
        Py_DECREF(value);
    }
    Py_DECREF(seq);
    PyObject *bounds = PyList_AsTuple(floats);
    Py_DECREF(floats);
    if (bounds == NULL)
        return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(bounds);
    double *limits = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(double));
    unsigned long long *counts = PyMem_Calloc((size_t)n + 1, sizeof(unsigned long long));
    if (limits == NULL || counts == NULL) {
        Py_DECREF(bounds);
        PyMem_Free(limits);
        PyMem_Free(counts);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        limits[i] = PyFloat_AS_DOUBLE(PyTuple_GET_ITEM(bounds, i));
    Py_XSETREF(self->bounds, bounds);
    PyMem_Free(self->limits);
    PyMem_Free(self->counts);
    self->limits = limits;
    self->counts = counts;
    self->buckets = n + 1;
    self->total = 0.0;
    return 0;
}

/* `bisect_left` over the bounds, as Python compares (`exact`: the bound objects with `arg`) or as
 * doubles (`value`); -1 with the comparison's error set. */
static Py_ssize_t histogram_bucket(Histogram *self, PyObject *arg, double value, int exact) {
    Py_ssize_t low = 0, high = self->buckets - 1;
    while (low < high) {
        Py_ssize_t mid = (low + high) / 2;
        int below = exact ? PyObject_RichCompareBool(PyTuple_GET_ITEM(self->bounds, mid), arg, Py_LT)
                          : self->limits[mid] < value;
        if (below < 0)
            return -1;
        if (below)
            low = mid + 1;
        else
            high = mid;
    }
    return low;
}

/* Any other value (a bool, a float's or an int's subclass, a Decimal, a string), as the twin takes it:
 * `bisect_left` with Python's comparisons (a subclass's reflected one first, a TypeError for what does
 * not compare), counted, then `total += value` (its error raised after the count, as there) kept as
 * the float of the sum. */
static PyObject *histogram_observe_any(Histogram *self, PyObject *arg) {
    Py_ssize_t bucket = histogram_bucket(self, arg, 0.0, 1);
    if (bucket < 0)
        return NULL;
    self->counts[bucket]++;
    PyObject *total = PyFloat_FromDouble(self->total);
    if (total == NULL)
        return NULL;
    PyObject *sum = PyNumber_Add(total, arg);
    Py_DECREF(total);
    if (sum == NULL)
        return NULL;
    double value = PyFloat_AsDouble(sum);
    Py_DECREF(sum);
    if (value == -1.0 && PyErr_Occurred())
        return NULL;
    self->total = value;
    Py_RETURN_NONE;
}

static PyObject *histogram_observe(Histogram *self, PyObject *arg) {
    if (self->counts == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Histogram not initialised");
        return NULL;
    }
    double value;
    int exact = 0, too_large = 0; /* compare as Python does: an int beyond 2^53 is not its float */
    if (PyFloat_CheckExact(arg)) {
        value = PyFloat_AS_DOUBLE(arg);
    } else if (PyLong_CheckExact(arg)) {
        value = PyLong_AsDouble(arg);
        if (value == -1.0 && PyErr_Occurred()) {
            /* Beyond any float: counted, then refused by the sum, as the twin counts it before `total +=` raises. */
            if (!PyErr_ExceptionMatches(PyExc_OverflowError))
                return NULL;
            PyErr_Clear();
            too_large = 1;
        }
        exact = too_large || fabs(value) >= 9007199254740992.0;
    } else {
        return histogram_observe_any(self, arg);
    }
    Py_ssize_t bucket = histogram_bucket(self, arg, value, exact);
    if (bucket < 0)
        return NULL;
    self->counts[bucket]++;
    if (too_large) {
        PyLong_AsDouble(arg); /* the twin's error: "int too large to convert to float" */
        return NULL;
    }
    self->total += value;
    Py_RETURN_NONE;
}

static PyObject *histogram_counts(Histogram *self, void *closure) {
    PyObject *list = PyList_New(self->counts == NULL ? 0 : self->buckets);
    if (list == NULL || self->counts == NULL)
        return list;
    for (Py_ssize_t i = 0; i < self->buckets; i++) {
        PyObject *count = PyLong_FromUnsignedLongLong(self->counts[i]);
        if (count == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, count);
    }
    return list;
}

static PyObject *histogram_bounds(Histogram *self, void *closure) {
    if (self->bounds == NULL)
        return PyTuple_New(0);
    return Py_NewRef(self->bounds);
}

static PyMethodDef histogram_methods[] = {
    {"observe", (PyCFunction)histogram_observe, METH_O, "observe(value): count one value and add it to the sum."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef histogram_getset[] = {
    {"counts", (getter)histogram_counts, NULL, "per-bucket counts (not cumulative; the last is +Inf)", NULL},
    {"bounds", (getter)histogram_bounds, NULL, "the buckets' upper bounds, as floats", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef histogram_members[] = {
    {"total", T_DOUBLE, offsetof(Histogram, total), READONLY, "the sum of the values observed"},
    {"created", T_DOUBLE, offsetof(Histogram, created), 0, "when the series appeared (set by the caller)"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject HistogramType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "api._native.Histogram",
    .tp_basicsize = sizeof(Histogram),
    .tp_dealloc = (destructor)histogram_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Histogram(bounds): one histogram series (the twin of api/metrics.py's _Histogram).",
    .tp_methods = histogram_methods,
    .tp_members = histogram_members,
    .tp_getset = histogram_getset,
    .tp_init = (initproc)histogram_init,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------------ module */

static PyMethodDef native_methods[] = {
    {"split_json_tokens", (PyCFunction)(void (*)(void))py_split_json_tokens, METH_FASTCALL,
     "split_json_tokens(body, member=b'tokens', /) -> (packed, start, end) | None: a JSON body's array of\n"
     "token ids under that top-level member as packed u32."},
    {"parse_post", py_parse_post, METH_O,
     "parse_post(data) -> (path, query, content_type, accept, x_request_id, authorization, body) | int | None: "
     "one whole plain POST request, or its Content-Length while its body is incomplete."},
    {"response", (PyCFunction)(void (*)(void))py_response, METH_FASTCALL,
     "response(head, body, request_id, lines) -> bytes | None: one whole HTTP/1.1 response."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "api._native", "kv-router's optional C accelerator of the HTTP front (see api/native.py).",
    -1, native_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&HistogramType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&native_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "Histogram", (PyObject *)&HistogramType) < 0 ||
        PyModule_AddIntConstant(module, "INTERFACE", NATIVE_INTERFACE) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
