/*
 * Can the kernel send without copying on this path? One connection, COUNT buffers of SIZE
 * bytes sent from one fixed, page-aligned buffer (as a replay ring would be sent from): with
 * plain send, with send(MSG_ZEROCOPY) and its completions read from the error queue, or with
 * vmsplice of the buffer's pages into a pipe and splice from the pipe into the socket (the
 * pages go by reference; nothing says when the kernel lets go of them, so a ring could reuse
 * them only once the peer acknowledged the bytes). The receiver reads and discards.
 *
 *   zerocopy_probe server IP PORT
 *   zerocopy_probe client IP PORT plain|zerocopy|splice SIZE COUNT
 *
 * The client prints one JSON object:
 *   {"mode": ..., "size": S, "bytes": B, "seconds": T, "cpu_s_per_gib": C,
 *    "completions": N, "copied": K}
 * where cpu_s_per_gib is the client's user+system CPU time per GiB sent, completions the
 * zero-copy notifications received, and copied how many of them said the kernel copied the
 * bytes after all (SO_EE_CODE_ZEROCOPY_COPIED: it does for a receiver on this host, as over
 * loopback or veth, where the pages would otherwise be handed to another socket).
 * Plain Linux; no layer involved (it measures what the kernel offers the layer).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/errqueue.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#ifndef SO_ZEROCOPY
#define SO_ZEROCOPY 60
#endif
#ifndef MSG_ZEROCOPY
#define MSG_ZEROCOPY 0x4000000
#endif

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static double cpu(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6;
}

static void addr(const char *ip, int port, struct sockaddr_in *sa)
{
    memset(sa, 0, sizeof *sa);
    sa->sin_family = AF_INET;
    sa->sin_port = htons(port);
    if (inet_pton(AF_INET, ip, &sa->sin_addr) != 1) {
        fprintf(stderr, "zerocopy_probe: bad address %s\n", ip);
        exit(2);
    }
}

static int server(const char *ip, int port)
{
    struct sockaddr_in sa;
    addr(ip, port, &sa);
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(l, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(l, 16) < 0) {
        perror("zerocopy_probe: listen");
        return 1;
    }
    static char buf[1 << 20];
    for (;;) {
        int c = accept(l, NULL, NULL);
        if (c < 0)
            continue;
        while (read(c, buf, sizeof buf) > 0) {
        }
        close(c);
    }
}

/* Reads the zero-copy completions waiting on the error queue; counts them and the copied. */
static void reap(int fd, long *done, long *copied, int wait)
{
    for (;;) {
        if (wait) {
            struct pollfd p = {fd, 0, 0};
            poll(&p, 1, 100);
        }
        char control[128];
        struct msghdr m = {0};
        m.msg_control = control;
        m.msg_controllen = sizeof control;
        if (recvmsg(fd, &m, MSG_ERRQUEUE | MSG_DONTWAIT) < 0)
            return;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
            struct sock_extended_err *e = (struct sock_extended_err *)CMSG_DATA(c);
            if (e->ee_origin != SO_EE_ORIGIN_ZEROCOPY)
                continue;
            long n = (long)e->ee_data - (long)e->ee_info + 1;
            *done += n;
            if (e->ee_code & SO_EE_CODE_ZEROCOPY_COPIED)
                *copied += n;
        }
        wait = 0;
    }
}

static int client(const char *ip, int port, const char *mode, long size, long count)
{
    struct sockaddr_in sa;
    addr(ip, port, &sa);
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    int zc = strcmp(mode, "zerocopy") == 0;
    if (zc && setsockopt(fd, SOL_SOCKET, SO_ZEROCOPY, &one, sizeof one) < 0) {
        perror("zerocopy_probe: SO_ZEROCOPY");
        return 1;
    }
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
        perror("zerocopy_probe: connect");
        return 1;
    }
    int sp = strcmp(mode, "splice") == 0;
    int pipefd[2] = {-1, -1};
    if (sp && (pipe(pipefd) < 0 || fcntl(pipefd[1], F_SETPIPE_SZ, 1 << 20) < 0)) {
        perror("zerocopy_probe: pipe");
        return 1;
    }
    char *buf = aligned_alloc(4096, (size + 4095) / 4096 * 4096);
    memset(buf, 'z', size);
    long done = 0, copied = 0, sent_calls = 0;
    double t0 = now(), c0 = cpu();
    long bytes = 0;
    for (long i = 0; i < count; i++) {
        long off = 0;
        while (sp && off < size) {
            struct iovec v = {buf + off, size - off};
            ssize_t in = vmsplice(pipefd[1], &v, 1, 0);
            if (in < 0) {
                perror("zerocopy_probe: vmsplice");
                return 1;
            }
            for (ssize_t left = in; left > 0;) {
                ssize_t n = splice(pipefd[0], NULL, fd, NULL, left, SPLICE_F_MOVE);
                if (n < 0) {
                    perror("zerocopy_probe: splice");
                    return 1;
                }
                left -= n;
                sent_calls++;
            }
            off += in;
        }
        while (off < size) {
            ssize_t n = send(fd, buf + off, size - off, zc ? MSG_ZEROCOPY : 0);
            if (n < 0) {
                if (errno == ENOBUFS && zc) {
                    reap(fd, &done, &copied, 1);
                    continue;
                }
                perror("zerocopy_probe: send");
                return 1;
            }
            off += n;
            sent_calls++;
        }
        bytes += size;
        if (zc)
            reap(fd, &done, &copied, 0);
    }
    shutdown(fd, SHUT_WR);
    char b;
    while (read(fd, &b, 1) > 0) {
    }
    if (zc)
        while (done < sent_calls) {
            long before = done;
            reap(fd, &done, &copied, 1);
            if (done == before)
                break;
        }
    double t = now() - t0, c = cpu() - c0;
    printf("{\"mode\": \"%s\", \"size\": %ld, \"bytes\": %ld, \"seconds\": %.4f, \"cpu_s_per_gib\": %.4f, "
           "\"completions\": %ld, \"copied\": %ld}\n",
           mode, size, bytes, t, c / ((double)bytes / (1 << 30)), done, copied);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 4 && strcmp(argv[1], "server") == 0)
        return server(argv[2], atoi(argv[3]));
    if (argc == 7 && strcmp(argv[1], "client") == 0)
        return client(argv[2], atoi(argv[3]), argv[4], atol(argv[5]), atol(argv[6]));
    fprintf(stderr, "usage: zerocopy_probe server IP PORT | client IP PORT plain|zerocopy SIZE COUNT\n");
    return 2;
}
