#define _GNU_SOURCE
#include "CBenchLoops.h"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static int listen_any(int *port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) || listen(fd, 4) || getsockname(fd, (struct sockaddr *)&a, &len)) return -1;
    *port = ntohs(a.sin_port);
    return fd;
}

static int connect_to(int port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int one = 1;
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a)) return -1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

static int read_full(int fd, char *buf, size_t n) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r <= 0) return -1;
        got += r;
    }
    return 0;
}

static void *sink(void *arg) {
    int listener = (int)(long)arg, fd = accept(listener, NULL, NULL);
    char *buf = malloc(65536);
    long total = 0;
    ssize_t r;
    while ((r = read(fd, buf, 65536)) > 0) total += r;
    free(buf);
    close(fd);
    return (void *)total;
}

static void *echo(void *arg) {
    int listener = (int)(long)arg, fd = accept(listener, NULL, NULL), one = 1;
    char buf[32];
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    while (read_full(fd, buf, 32) == 0 && write(fd, buf, 32) == 32) {}
    close(fd);
    close(listener);
    return NULL;
}

double tk_bench_c_tcp_throughput(size_t total, size_t chunk) {
    int port, listener = listen_any(&port);
    pthread_t peer;
    if (listener < 0 || pthread_create(&peer, NULL, sink, (void *)(long)listener)) return -1;
    int fd = connect_to(port);
    char *buf = calloc(1, chunk);
    double start = now();
    for (size_t sent = 0; sent < total;) {
        ssize_t w = write(fd, buf, chunk);
        if (w <= 0) return -1;
        sent += w;
    }
    close(fd);
    pthread_join(peer, NULL);
    double elapsed = now() - start;
    free(buf);
    close(listener);
    return elapsed;
}

int tk_bench_c_echo_server(void) {
    int port, listener = listen_any(&port);
    pthread_t peer;
    if (listener < 0 || pthread_create(&peer, NULL, echo, (void *)(long)listener)) return -1;
    pthread_detach(peer);
    return port;
}

double tk_bench_c_tcp_round_trips(int rounds) {
    int fd = connect_to(tk_bench_c_echo_server());
    char buf[32] = {0};
    double start = now();
    for (int i = 0; i < rounds; i++) {
        if (write(fd, buf, 32) != 32 || read_full(fd, buf, 32)) return -1;
    }
    double elapsed = now() - start;
    close(fd);
    return elapsed;
}

static pthread_t sink_thread;
static int sink_listener = -1;

int tk_bench_c_sink_start(void) {
    int port;
    sink_listener = listen_any(&port);
    if (sink_listener < 0 || pthread_create(&sink_thread, NULL, sink, (void *)(long)sink_listener)) return -1;
    return port;
}

long tk_bench_c_sink_join(void) {
    void *total = NULL;
    if (sink_listener < 0 || pthread_join(sink_thread, &total)) return -1;
    close(sink_listener);
    sink_listener = -1;
    return (long)total;
}

int tk_bench_c_connect(int port) {
    return connect_to(port);
}

int tk_bench_c_tcp_pair(int fds[2]) {
    int port, listener = listen_any(&port), one = 1;
    if (listener < 0) return -1;
    fds[0] = connect_to(port);
    fds[1] = accept4(listener, NULL, NULL, SOCK_CLOEXEC);
    close(listener);
    if (fds[0] < 0 || fds[1] < 0) return -1;
    setsockopt(fds[1], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return 0;
}
