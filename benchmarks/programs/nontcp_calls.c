/*
 * Cost of I/O calls on descriptors that are not TCP sockets: what every call pays when the
 * layer is preloaded but has nothing to do with the descriptor (it only looks the fd up).
 *
 *   nontcp_calls [N]
 *       N : iterations of each case (default 1000000)
 *
 * In one process, times N iterations of each case, one after the other:
 *   pipe    : write(64 B) on a pipe's write end, read(64 B) from its read end;
 *   unix    : send(64 B) on one end of an AF_UNIX SOCK_STREAM socketpair, recv(64 B) on the other;
 *   udp     : sendto(64 B) from one UDP socket bound to 127.0.0.1 to another, recvfrom(64 B) on
 *             the second;
 *   devzero : read(64 B) from /dev/zero.
 * Each case first runs N/100 (at least 1000) untimed iterations to warm caches and the lazy
 * symbol binding. Prints one JSON object on stdout:
 *   {"iterations": N, "pipe_ns": ..., "unix_ns": ..., "udp_ns": ..., "devzero_ns": ...,
 *    "preloaded": true|false}
 * with nanoseconds per iteration (one iteration = both calls of a pair, or one read for
 * devzero). "preloaded" says whether libvmi_preload is mapped into the process (from
 * /proc/self/maps), so a caller can check that the layered run really had the layer.
 * Exits with 1 if a call fails or moves fewer than 64 bytes.
 * Plain POSIX; runs unchanged natively and under LD_PRELOAD.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "bench_util.h"

#define MSG 64

static void die(const char *what, long i)
{
    fprintf(stderr, "nontcp_calls: %s failed at iteration %ld: %s\n", what, i, strerror(errno));
    exit(1);
}

static char out_buf[MSG];
static char in_buf[MSG];

/* write+read on a pipe */
static void loop_pipe(int w, int r, long n)
{
    for (long i = 0; i < n; i++) {
        if (write(w, out_buf, MSG) != MSG)
            die("pipe write", i);
        if (read(r, in_buf, MSG) != MSG)
            die("pipe read", i);
    }
}

/* send+recv on a socketpair */
static void loop_unix(int a, int b, long n)
{
    for (long i = 0; i < n; i++) {
        if (send(a, out_buf, MSG, 0) != MSG)
            die("unix send", i);
        if (recv(b, in_buf, MSG, MSG_WAITALL) != MSG)
            die("unix recv", i);
    }
}

/* sendto+recvfrom between two bound UDP sockets */
static void loop_udp(int a, int b, const struct sockaddr_in *to, long n)
{
    struct sockaddr_in from;
    for (long i = 0; i < n; i++) {
        if (sendto(a, out_buf, MSG, 0, (const struct sockaddr *)to, sizeof(*to)) != MSG)
            die("udp sendto", i);
        socklen_t fl = sizeof(from);
        if (recvfrom(b, in_buf, MSG, 0, (struct sockaddr *)&from, &fl) != MSG)
            die("udp recvfrom", i);
    }
}

/* read from /dev/zero */
static void loop_devzero(int z, long n)
{
    for (long i = 0; i < n; i++) {
        if (read(z, in_buf, MSG) != MSG)
            die("/dev/zero read", i);
    }
}

static int udp_bound(struct sockaddr_in *sa)
{
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    if (fd < 0) {
        perror("nontcp_calls: socket(AF_INET, SOCK_DGRAM)");
        exit(1);
    }
    memset(sa, 0, sizeof(*sa));
    sa->sin_family = AF_INET;
    sa->sin_port = 0;
    sa->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(fd, (struct sockaddr *)sa, sizeof(*sa)) < 0) {
        perror("nontcp_calls: bind 127.0.0.1");
        exit(1);
    }
    socklen_t len = sizeof(*sa);
    if (getsockname(fd, (struct sockaddr *)sa, &len) < 0) {
        perror("nontcp_calls: getsockname");
        exit(1);
    }
    return fd;
}

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 1000000L;
    if (n < 1) {
        fprintf(stderr, "usage: nontcp_calls [ITERATIONS]\n");
        return 2;
    }
    long warm = n / 100 > 1000 ? n / 100 : 1000;
    memset(out_buf, 'x', sizeof(out_buf));

    int p[2];
    if (pipe(p) < 0) {
        perror("nontcp_calls: pipe");
        return 1;
    }
    int sp[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sp) < 0) {
        perror("nontcp_calls: socketpair");
        return 1;
    }
    struct sockaddr_in ua, ub;
    int u1 = udp_bound(&ua);
    int u2 = udp_bound(&ub);
    int z = open("/dev/zero", O_RDONLY);
    if (z < 0) {
        perror("nontcp_calls: open /dev/zero");
        return 1;
    }

    double t0, ns_pipe, ns_unix, ns_udp, ns_zero;

    loop_pipe(p[1], p[0], warm);
    t0 = now_ns();
    loop_pipe(p[1], p[0], n);
    ns_pipe = (now_ns() - t0) / (double)n;

    loop_unix(sp[0], sp[1], warm);
    t0 = now_ns();
    loop_unix(sp[0], sp[1], n);
    ns_unix = (now_ns() - t0) / (double)n;

    loop_udp(u1, u2, &ub, warm);
    t0 = now_ns();
    loop_udp(u1, u2, &ub, n);
    ns_udp = (now_ns() - t0) / (double)n;

    loop_devzero(z, warm);
    t0 = now_ns();
    loop_devzero(z, n);
    ns_zero = (now_ns() - t0) / (double)n;

    printf("{\"iterations\": %ld, \"pipe_ns\": %.2f, \"unix_ns\": %.2f, \"udp_ns\": %.2f, "
           "\"devzero_ns\": %.2f, \"preloaded\": %s}\n",
           n, ns_pipe, ns_unix, ns_udp, ns_zero, preloaded() ? "true" : "false");
    fflush(stdout);
    close(p[0]);
    close(p[1]);
    close(sp[0]);
    close(sp[1]);
    close(u1);
    close(u2);
    close(z);
    return 0;
}
