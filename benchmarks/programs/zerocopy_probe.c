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
 *   zerocopy_probe client IP PORT ring|ring-pipe|ring-send|ring-bare SIZE COUNT
 *
 * The ring modes send as the layer's send path would: each buffer is copied into an 8 MiB
 * shared ring (MAP_SHARED, as the layer's connection memory), behind a 24-byte frame header,
 * then "ring" sends header and ring bytes with one sendmsg (a second copy, by the kernel);
 * the others splice the ring's pages in chunks that end at 64 KiB boundaries, with the header
 * written into the pipe first ("ring-pipe"), sent by copy with MSG_MORE ("ring-send"), or
 * left out ("ring-bare", not a real protocol: the bound of what splicing the ring can give).
 * The buffers then start at ring offsets that are multiples of SIZE (page-aligned).
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
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
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

#define RING (8L << 20)
#define CHUNK (64L << 10)

/* One buffer the ring way (see the head of the file); returns 0, or -1 after perror. */
static int ring_send(int fd, const char *mode, char *ring, long *cur, const char *src, long size,
                     int pipefd[2])
{
    char head[24] = {(char)0xa7, 1};
    long off = *cur % RING, first = size < RING - off ? size : RING - off;
    memcpy(ring + off, src, first);
    if (first < size)
        memcpy(ring, src + first, size - first);
    if (strcmp(mode, "ring") == 0) {
        struct iovec v[3] = {{head, sizeof head}, {ring + off, first}, {ring, size - first}};
        long want = sizeof head + size, done = 0;
        while (done < want) {
            struct msghdr m = {.msg_iov = v, .msg_iovlen = first < size ? 3 : 2};
            ssize_t n = sendmsg(fd, &m, 0);
            if (n < 0) {
                perror("zerocopy_probe: sendmsg");
                return -1;
            }
            done += n;
            /* (A short write: go on from where it stopped.) */
            for (int i = 0; i < 3 && n > 0; i++) {
                long k = (long)v[i].iov_len < n ? (long)v[i].iov_len : n;
                v[i].iov_base = (char *)v[i].iov_base + k;
                v[i].iov_len -= k;
                n -= k;
            }
        }
        *cur += size;
        return 0;
    }
    long in_pipe = 0;
    if (strcmp(mode, "ring-pipe") == 0) {
        if (write(pipefd[1], head, sizeof head) != sizeof head) {
            perror("zerocopy_probe: write");
            return -1;
        }
        in_pipe = sizeof head;
    } else if (strcmp(mode, "ring-send") == 0) {
        if (send(fd, head, sizeof head, MSG_MORE) != sizeof head) {
            perror("zerocopy_probe: send");
            return -1;
        }
    }
    for (long at = 0; at < size;) {
        long pos = (*cur + at) % RING, want = size - at, lim = CHUNK - pos % CHUNK;
        if (want > lim)
            want = lim;
        if (pos + want > RING)
            want = RING - pos;
        struct iovec v = {ring + pos, want};
        ssize_t m = vmsplice(pipefd[1], &v, 1, 0);
        if (m < 0) {
            perror("zerocopy_probe: vmsplice");
            return -1;
        }
        at += m;
        in_pipe += m;
        while (in_pipe > 0) {
            ssize_t k = splice(pipefd[0], NULL, fd, NULL, in_pipe, at < size ? SPLICE_F_MORE : 0);
            if (k < 0) {
                perror("zerocopy_probe: splice");
                return -1;
            }
            in_pipe -= k;
        }
    }
    *cur += size;
    return 0;
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
    int sp = strcmp(mode, "splice") == 0, rg = strncmp(mode, "ring", 4) == 0;
    int pipefd[2] = {-1, -1};
    if ((sp || rg) && (pipe(pipefd) < 0 || fcntl(pipefd[1], F_SETPIPE_SZ, 1 << 20) < 0)) {
        perror("zerocopy_probe: pipe");
        return 1;
    }
    char *buf = aligned_alloc(4096, (size + 4095) / 4096 * 4096);
    memset(buf, 'z', size);
    long done = 0, copied = 0, sent_calls = 0;
    double t0 = now(), c0 = cpu();
    long bytes = 0;
    char *ring = rg ? mmap(NULL, RING, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0) : NULL;
    if (ring == MAP_FAILED) {
        perror("zerocopy_probe: mmap");
        return 1;
    }
    long cur = 0;
    for (long i = 0; i < count; i++) {
        if (rg) {
            if (ring_send(fd, mode, ring, &cur, buf, size, pipefd) < 0)
                return 1;
            bytes += size;
            continue;
        }
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
    fprintf(stderr, "usage: zerocopy_probe server IP PORT | client IP PORT "
                    "plain|zerocopy|splice|ring|ring-pipe|ring-send|ring-bare SIZE COUNT\n");
    return 2;
}
