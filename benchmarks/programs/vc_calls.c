/*
 * Cost of the calls a program makes on one TCP connection, without scheduling in the way:
 * both ends live in this process and one thread drives them, so every read finds its bytes
 * already there and nobody sleeps or wakes. What remains is the price of the calls
 * themselves: the kernel's, plus (under the layer) the layer's framing, acknowledgements and
 * bookkeeping, or its shared-memory ring.
 *
 *   vc_calls [N [SIZE]]
 *       N : round trips per message size (default 200000)
 *       SIZE : only this message size (one of 64, 1024, 16384; the others print 0): for an
 *              instruction count per round trip, run under callgrind with two N and subtract
 *
 * Listens on 127.0.0.1 (port chosen by the kernel), connects to itself and accepts. For each
 * message size S in 64, 1024 and 16384 bytes it times N round trips; one round trip is four
 * calls: write(S) on the connecting end, read on the accepting end until S bytes arrived,
 * write(S) back, read until S bytes arrived. It first runs N/20 (at least 1000) untimed round
 * trips. The bytes are checked (each round trip carries a different pattern). Then it times
 * the registration changes an event loop makes around each request (redis's `ae` takes a
 * connection out of its epoll instance and puts it back, UCX and wrk ask for writability and
 * then no more): N rounds of four `epoll_ctl` calls on the connecting end, MOD to input and
 * output, MOD back to input, DEL, ADD for input, after N/20 untimed ones. Prints one JSON
 * object on stdout:
 *   {"round_trips": N, "rt_64_ns": ..., "rt_1024_ns": ..., "rt_16384_ns": ..., "ctl_ns": ...,
 *    "app_bytes": A, "wire_bytes": W, "path": "plain"|"framed"|"shared-memory",
 *    "preloaded": true|false}
 * with nanoseconds per round trip, and per `epoll_ctl` call for "ctl_ns" (0 with SIZE). "wire_bytes" is what the kernel sent on the connecting
 * end's socket (TCP_INFO tcpi_bytes_sent), "app_bytes" what the program wrote there: equal
 * for plain TCP, more when the layer frames the bytes, far fewer when they went through
 * shared memory. A caller checks "path" to know the layered run really was virtual.
 * Exits with 1 if a call fails or a byte is wrong.
 * Plain POSIX plus Linux TCP_INFO (linux/tcp.h for tcpi_bytes_sent); runs unchanged natively and under LD_PRELOAD.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <linux/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "bench_util.h"

#define MAX_MSG 16384

static char out_buf[MAX_MSG];
static char in_buf[MAX_MSG];
static unsigned long long app_bytes;

static void die(const char *what, long i)
{
    fprintf(stderr, "vc_calls: %s failed at round trip %ld: %s\n", what, i, strerror(errno));
    exit(1);
}

static void send_all(int fd, size_t n, long i, int count)
{
    size_t done = 0;
    while (done < n) {
        ssize_t w = write(fd, out_buf + done, n - done);
        if (w <= 0)
            die("write", i);
        done += (size_t)w;
    }
    if (count)
        app_bytes += n;
}

static void recv_all(int fd, size_t n, long i, char tag)
{
    size_t done = 0;
    while (done < n) {
        ssize_t r = read(fd, in_buf + done, n - done);
        if (r <= 0) {
            if (r == 0)
                errno = EPIPE;
            die("read", i);
        }
        done += (size_t)r;
    }
    if (in_buf[0] != tag || in_buf[n - 1] != tag) {
        errno = EILSEQ;
        die("check", i);
    }
}

/* n round trips of s bytes between a (connecting end) and b (accepting end) */
static void round_trips(int a, int b, size_t s, long n)
{
    for (long i = 0; i < n; i++) {
        char tag = (char)('a' + i % 26);
        out_buf[0] = out_buf[s - 1] = tag;
        send_all(a, s, i, 1);
        recv_all(b, s, i, tag);
        send_all(b, s, i, 0);
        recv_all(a, s, i, tag);
    }
}

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 200000;
    long only = argc > 2 ? atol(argv[2]) : 0;
    if (n < 1 || (only != 0 && only != 64 && only != 1024 && only != 16384)) {
        fprintf(stderr, "usage: vc_calls [N [64|1024|16384]]\n");
        return 2;
    }
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in addr = {.sin_family = AF_INET};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (l < 0 || bind(l, (struct sockaddr *)&addr, sizeof(addr)) != 0 || listen(l, 1) != 0 ||
        getsockname(l, (struct sockaddr *)&addr, &len) != 0)
        die("listen", -1);
    int a = socket(AF_INET, SOCK_STREAM, 0);
    if (a < 0 || connect(a, (struct sockaddr *)&addr, sizeof(addr)) != 0)
        die("connect", -1);
    int b = accept(l, NULL, NULL);
    if (b < 0)
        die("accept", -1);
    memset(out_buf, 'x', sizeof(out_buf));

    static const size_t sizes[] = {64, 1024, 16384};
    double ns[3] = {0, 0, 0};
    long warm = n / 20 > 1000 ? n / 20 : 1000;
    for (int k = 0; k < 3; k++) {
        if (only != 0 && (long)sizes[k] != only)
            continue;
        round_trips(a, b, sizes[k], warm);
        double t0 = now_ns();
        round_trips(a, b, sizes[k], n);
        ns[k] = (now_ns() - t0) / (double)n;
    }

    /* The registration changes around a request, on the connecting end. */
    double ctl = 0;
    if (only == 0) {
        int ep = epoll_create1(0);
        struct epoll_event ev = {.events = EPOLLIN, .data.fd = a};
        if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, a, &ev) != 0)
            die("epoll_ctl ADD", -1);
        for (int timed = 0; timed < 2; timed++) {
            long m = timed ? n : warm;
            double t0 = now_ns();
            for (long i = 0; i < m; i++) {
                ev.events = EPOLLIN | EPOLLOUT;
                if (epoll_ctl(ep, EPOLL_CTL_MOD, a, &ev) != 0)
                    die("epoll_ctl MOD", i);
                ev.events = EPOLLIN;
                if (epoll_ctl(ep, EPOLL_CTL_MOD, a, &ev) != 0)
                    die("epoll_ctl MOD", i);
                if (epoll_ctl(ep, EPOLL_CTL_DEL, a, NULL) != 0)
                    die("epoll_ctl DEL", i);
                if (epoll_ctl(ep, EPOLL_CTL_ADD, a, &ev) != 0)
                    die("epoll_ctl ADD", i);
            }
            ctl = (now_ns() - t0) / (4.0 * (double)m);
        }
        close(ep);
    }

    struct tcp_info ti;
    socklen_t tl = sizeof(ti);
    memset(&ti, 0, sizeof(ti));
    unsigned long long wire = 0;
    if (getsockopt(a, IPPROTO_TCP, TCP_INFO, &ti, &tl) == 0)
        wire = ti.tcpi_bytes_sent;
    const char *path = wire == app_bytes ? "plain" : wire > app_bytes ? "framed" : "shared-memory";
    printf("{\"round_trips\": %ld, \"rt_64_ns\": %.1f, \"rt_1024_ns\": %.1f, \"rt_16384_ns\": %.1f, "
           "\"ctl_ns\": %.1f, \"app_bytes\": %llu, \"wire_bytes\": %llu, \"path\": \"%s\", "
           "\"preloaded\": %s}\n",
           n, ns[0], ns[1], ns[2], ctl, app_bytes, wire, path, preloaded() ? "true" : "false");
    close(a);
    close(b);
    close(l);
    return 0;
}
