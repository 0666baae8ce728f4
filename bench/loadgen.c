/* A cheap closed-loop load generator for bench/replicas_bench.py (a few µs of CPU per decision, where
 * the Python generator takes ~150 µs and wrk with a Lua script ~110 µs).
 *
 * Each of CONNECTIONS keep-alive connections to 127.0.0.1 (connection i to the i-th of the
 * comma-separated PORTS, round robin) loops: POST /v1/new with a JSON body
 * {"request_id":"TAG-<connection>-<n>","tokens":<line n of BODIES>}, then POST /v1/mark_free of that
 * id, on the same connection (so whichever --processes child took it frees its own booking). One
 * thread, epoll; requests are written whole with writev from the prepared lines.
 *
 *     cc -O2 -o loadgen bench/loadgen.c && ./loadgen PORTS CONNECTIONS SECONDS BODIES TAG
 *
 * After SECONDS no new decision is asked; the ones in flight are answered and freed, not counted.
 * Prints one JSON line: decisions answered within SECONDS, frees, failed replies, the decisions'
 * latency percentiles (ms) and this process's CPU seconds. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define READ_BUFFER (1 << 16)

typedef struct {
    int fd;
    int index;
    long n;           /* decisions asked on this connection */
    int freeing;      /* awaiting the reply to a mark_free (else to a new) */
    int counted;      /* the decision in flight was asked before the deadline */
    double asked_at;
    size_t have;
    char buffer[READ_BUFFER];
} Connection;

static char **bodies;
static size_t *body_lengths;
static size_t body_count;
static const char *tag;
static double *latencies;
static size_t latency_count, latency_capacity;
static long decisions, frees, failures;
static char failure[256];

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void die(const char *what) {
    perror(what);
    exit(2);
}

static void read_bodies(const char *path) {
    FILE *file = fopen(path, "r");
    if (!file) die(path);
    char *line = NULL;
    size_t capacity = 0, allocated = 0;
    ssize_t length;
    while ((length = getline(&line, &capacity, file)) > 0) {
        while (length && (line[length - 1] == '\n' || line[length - 1] == '\r')) length--;
        if (!length) continue;
        if (body_count == allocated) {
            allocated = allocated ? 2 * allocated : 256;
            bodies = realloc(bodies, allocated * sizeof *bodies);
            body_lengths = realloc(body_lengths, allocated * sizeof *body_lengths);
        }
        bodies[body_count] = memcpy(malloc(length), line, length);
        body_lengths[body_count++] = length;
    }
    free(line);
    fclose(file);
    if (!body_count) {
        fprintf(stderr, "%s: no bodies\n", path);
        exit(2);
    }
}

static void write_all(int fd, struct iovec *parts, int count) {
    while (count) {
        ssize_t written = writev(fd, parts, count);
        if (written < 0) {
            if (errno == EINTR) continue;
            die("writev");
        }
        while (count && (size_t)written >= parts->iov_len) {
            written -= parts->iov_len;
            parts++;
            count--;
        }
        if (count) {
            parts->iov_base = (char *)parts->iov_base + written;
            parts->iov_len -= written;
        }
    }
}

static void ask_decision(Connection *c, double deadline) {
    char id[160], head[256];
    long n = c->n++;
    int id_length = snprintf(id, sizeof id, "{\"request_id\":\"%s-%d-%ld\",\"tokens\":", tag, c->index, n);
    size_t body = body_lengths[n % body_count];
    int head_length = snprintf(head, sizeof head,
                               "POST /v1/new HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                               "Content-Length: %zu\r\n\r\n",
                               (size_t)id_length + body + 1);
    struct iovec parts[4] = {{head, head_length}, {id, id_length}, {bodies[n % body_count], body}, {"}", 1}};
    c->freeing = 0;
    c->asked_at = now_s();
    c->counted = c->asked_at < deadline;
    write_all(c->fd, parts, 4);
}

static void ask_free(Connection *c) {
    char body[192], head[256];
    int body_length = snprintf(body, sizeof body, "{\"request_id\":\"%s-%d-%ld\"}", tag, c->index, c->n - 1);
    int head_length = snprintf(head, sizeof head,
                               "POST /v1/mark_free HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                               "Content-Length: %d\r\n\r\n",
                               body_length);
    struct iovec parts[2] = {{head, head_length}, {body, body_length}};
    c->freeing = 1;
    write_all(c->fd, parts, 2);
}

/* The length of the whole response at the start of the buffer, or 0 while it is incomplete. */
static size_t response_length(Connection *c) {
    char *end = memmem(c->buffer, c->have, "\r\n\r\n", 4);
    if (!end) return 0;
    size_t head = end + 4 - c->buffer;
    size_t content = 0;
    for (char *line = memchr(c->buffer, '\n', head); line && line < end; line = memchr(line + 1, '\n', end - line)) {
        if (!strncasecmp(line + 1, "content-length:", 15)) content = strtoul(line + 16, NULL, 10);
    }
    return c->have >= head + content ? head + content : 0;
}

static void record_failure(Connection *c, size_t length) {
    failures++;
    size_t shown = length < sizeof failure - 1 ? length : sizeof failure - 1;
    for (size_t i = 0; i < shown; i++) {
        char ch = c->buffer[i];
        failure[i] = (ch == '"' || ch == '\\' || ch < 32) ? '\'' : ch;
    }
    failure[shown] = 0;
}

/* One whole response is in the buffer: account for it and ask the next request; 0 once done. */
static int on_response(Connection *c, size_t length, double deadline) {
    int ok = c->have >= 12 && !memcmp(c->buffer + 9, "200", 3);
    if (!c->freeing) {
        if (!ok || !memmem(c->buffer, length, "\"worker_id\"", 11)) {
            record_failure(c, length);
        } else if (c->counted) {
            double answered = now_s();
            if (answered < deadline) {
                decisions++;
                if (latency_count == latency_capacity) {
                    latency_capacity = latency_capacity ? 2 * latency_capacity : 1 << 16;
                    latencies = realloc(latencies, latency_capacity * sizeof *latencies);
                }
                latencies[latency_count++] = (answered - c->asked_at) * 1e3;
            }
        }
        memmove(c->buffer, c->buffer + length, c->have - length);
        c->have -= length;
        if (!ok) {
            if (now_s() >= deadline) return 0;
            ask_decision(c, deadline);
            return 1;
        }
        ask_free(c);
        return 1;
    }
    if (ok) frees++;
    else record_failure(c, length);
    memmove(c->buffer, c->buffer + length, c->have - length);
    c->have -= length;
    if (now_s() >= deadline) return 0;
    ask_decision(c, deadline);
    return 1;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double percentile(double q) {
    if (!latency_count) return 0.0;
    size_t index = (size_t)(q / 100 * (latency_count - 1) + 0.5);
    return latencies[index];
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s PORTS CONNECTIONS SECONDS BODIES TAG\n", argv[0]);
        return 2;
    }
    int ports[64], port_count = 0, count = atoi(argv[2]);
    for (char *port = strtok(argv[1], ","); port && port_count < 64; port = strtok(NULL, ",")) {
        ports[port_count++] = atoi(port);
    }
    if (!port_count || count < 1) {
        fprintf(stderr, "no ports or connections\n");
        return 2;
    }
    double seconds = atof(argv[3]);
    read_bodies(argv[4]);
    tag = argv[5];
    int poller = epoll_create1(0);
    if (poller < 0) die("epoll_create1");
    Connection *connections = calloc(count, sizeof *connections);
    for (int i = 0; i < count; i++) {
        Connection *c = &connections[i];
        struct sockaddr_in address = {.sin_family = AF_INET, .sin_port = htons(ports[i % port_count])};
        address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        c->index = i;
        c->fd = socket(AF_INET, SOCK_STREAM, 0);
        if (c->fd < 0) die("socket");
        int one = 1;
        setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (connect(c->fd, (struct sockaddr *)&address, sizeof address)) die("connect");
        struct epoll_event event = {.events = EPOLLIN, .data.ptr = c};
        if (epoll_ctl(poller, EPOLL_CTL_ADD, c->fd, &event)) die("epoll_ctl");
    }
    double started = now_s(), deadline = started + seconds;
    for (int i = 0; i < count; i++) ask_decision(&connections[i], deadline);
    int active = count;
    double give_up = deadline + 10.0;
    struct epoll_event events[256];
    while (active > 0 && now_s() < give_up) {
        int ready = epoll_wait(poller, events, 256, 100);
        if (ready < 0) {
            if (errno == EINTR) continue;
            die("epoll_wait");
        }
        for (int e = 0; e < ready; e++) {
            Connection *c = events[e].data.ptr;
            ssize_t got = read(c->fd, c->buffer + c->have, READ_BUFFER - c->have);
            if (got <= 0) {
                if (got < 0 && errno == EINTR) continue;
                fprintf(stderr, "connection %d: %s\n", c->index, got ? strerror(errno) : "closed by the server");
                return 1;
            }
            c->have += got;
            size_t length;
            while ((length = response_length(c)) > 0) {
                if (!on_response(c, length, deadline)) {
                    epoll_ctl(poller, EPOLL_CTL_DEL, c->fd, NULL);
                    active--;
                    break;
                }
            }
            if (c->have == READ_BUFFER) {
                fprintf(stderr, "connection %d: a response over %d bytes\n", c->index, READ_BUFFER);
                return 1;
            }
        }
    }
    struct rusage usage;
    getrusage(RUSAGE_SELF, &usage);
    double cpu = usage.ru_utime.tv_sec + usage.ru_utime.tv_usec / 1e6 + usage.ru_stime.tv_sec +
                 usage.ru_stime.tv_usec / 1e6;
    qsort(latencies, latency_count, sizeof *latencies, by_value);
    printf("{\"decisions\": %ld, \"frees\": %ld, \"failures\": %ld, \"unfinished\": %d, \"duration_s\": %f, "
           "\"p50_ms\": %.4f, \"p90_ms\": %.4f, \"p99_ms\": %.4f, \"cpu_s\": %f, \"a_failure\": \"%s\"}\n",
           decisions, frees, failures, active, seconds, percentile(50), percentile(90), percentile(99), cpu, failure);
    for (int i = 0; i < count; i++) close(connections[i].fd);
    return 0;
}
