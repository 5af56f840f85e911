/*
 * Many connections held open, idle and then active at a low rate (harness/scale.py).
 *
 *   scale_conns server IP PORT
 *       raises RLIMIT_NOFILE to its hard limit, accepts every connection and holds it (epoll),
 *       reads and counts whatever arrives, closes a connection when its peer does. A line
 *       `stats` on its standard input prints
 *         {"event": "stats", "held": H, "accepted": A, "closed": C, "failed": X, "bytes": B,
 *          "closed_bytes": CB, "fingerprint": F}
 *       (X: connections that ended with an error instead of their peer's close;
 *       B: bytes received on every connection; C, CB, F: the connections closed by their
 *       peer, their bytes, and the sum mod 2^64 of mix(id, bytes) over them, id being the
 *       8 bytes each connection starts with).
 *   scale_conns client IP PORT N [CID]
 *       raises RLIMIT_NOFILE to its hard limit, opens one warm-up connection (its 8-byte id),
 *       prints {"event": "warm", "pid": P} and then obeys lines on its standard input:
 *         open          opens N connections, each carrying its 8-byte id (CID << 32 | i; the
 *                       warm-up's i is 0xffffffff), keeps them, and prints
 *                       {"event": "open", "opened": K, "errors": E, "seconds": S}
 *         active SECS   for SECS seconds every connection sends 64 bytes once a second, the
 *                       connections spread evenly over the second (slots of 10 ms); prints
 *                       {"event": "active", "sends": .., "errors": .., "max_late_ms": ..}
 *       and at the end of its standard input prints what it sent,
 *         {"event": "sent", "conns": K + 1, "bytes": B, "fingerprint": F}
 *       (the same sum as the server's, over its connections and the warm-up), closes
 *       everything and exits (0 if all N opened). Every byte a send took counts, so a
 *       server that has seen every connection close must show the same bytes and fingerprint
 *       as its clients together: nothing lost, nothing added, on no connection.
 *
 * Plain POSIX; runs unchanged natively and under LD_PRELOAD.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "conns.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void sleep_until(double t)
{
    for (;;) {
        double d = t - now();
        if (d <= 0)
            return;
        struct timespec ts = {.tv_sec = (time_t)d, .tv_nsec = (long)((d - (double)(time_t)d) * 1e9)};
        if (nanosleep(&ts, NULL) == 0)
            return;
    }
}

/* One connection's bytes, tied to its id: summed over connections, equal on both sides only
 * if every connection's count is (but for a 2^-64 chance). */
static uint64_t mix(uint64_t id, uint64_t bytes)
{
    uint64_t z = id * 0x9E3779B97F4A7C15ull + bytes + 0x632BE59BD9B4E019ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* What the server knows of the connection on each descriptor. */
struct held {
    uint64_t id, bytes;
    unsigned char idlen;
};

static int server(const char *ip, int port)
{
    raise_nofile();
    struct rlimit rl;
    long maxfd = getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY
                     ? (long)rl.rlim_cur : 1 << 20;
    struct held *hs = calloc((size_t)maxfd, sizeof(*hs));
    if (!hs)
        return 1;
    memset(hs, 0, (size_t)maxfd * sizeof(*hs)); /* resident before any measurement */
    struct sockaddr_in sa;
    if (make_addr("scale_conns", ip, port, &sa) < 0)
        return 1;
    int lfd = listen_on(&sa);
    if (lfd < 0)
        return 1;
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN};
    ev.data.fd = lfd;
    epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev);
    struct epoll_event iev = {.events = EPOLLIN};
    iev.data.fd = 0;
    int cmds = epoll_ctl(ep, EPOLL_CTL_ADD, 0, &iev) == 0; /* not if stdin is /dev/null */
    fprintf(stderr, "scale_conns server: listening on %s:%d\n", ip, port);
    long held = 0, accept_errors = 0, accepted = 0, closed = 0, failed = 0;
    uint64_t bytes = 0, closed_bytes = 0, fingerprint = 0;
    struct epoll_event evs[256];
    for (;;) {
        int n = epoll_wait(ep, evs, 256, -1);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            perror("epoll_wait");
            return 1;
        }
        for (int i = 0; i < n; i++) {
            int fd = evs[i].data.fd;
            if (fd == 0 && cmds) {
                char cmd[64];
                ssize_t r = read(0, cmd, sizeof(cmd) - 1);
                if (r <= 0) {
                    epoll_ctl(ep, EPOLL_CTL_DEL, 0, NULL);
                    cmds = 0;
                    continue;
                }
                /* Any line asks for the figures (the harness sends `stats`). */
                printf("{\"event\": \"stats\", \"held\": %ld, \"accepted\": %ld, "
                       "\"closed\": %ld, \"failed\": %ld, \"bytes\": %llu, "
                       "\"closed_bytes\": %llu, \"fingerprint\": %llu}\n", held, accepted,
                       closed, failed,
                       (unsigned long long)bytes, (unsigned long long)closed_bytes,
                       (unsigned long long)fingerprint);
                fflush(stdout);
            } else if (fd == lfd) {
                int c = accept(lfd, NULL, NULL);
                if (c < 0) {
                    if (++accept_errors <= 5)
                        fprintf(stderr, "scale_conns server: accept: %s (held %ld)\n",
                                strerror(errno), held);
                    if (errno == EMFILE || errno == ENFILE)
                        usleep(10000);
                    continue;
                }
                struct epoll_event cev = {.events = EPOLLIN};
                cev.data.fd = c;
                if (c >= maxfd || epoll_ctl(ep, EPOLL_CTL_ADD, c, &cev) < 0) {
                    close(c);
                    continue;
                }
                memset(&hs[c], 0, sizeof(hs[c]));
                held++;
                accepted++;
            } else {
                char buf[4096];
                ssize_t r = read(fd, buf, sizeof(buf));
                if (r > 0) {
                    struct held *h = &hs[fd];
                    for (ssize_t k = 0; k < r && h->idlen < 8; k++)
                        h->id |= (uint64_t)(unsigned char)buf[k] << (8 * h->idlen++);
                    h->bytes += (uint64_t)r;
                    bytes += (uint64_t)r;
                } else if (r == 0 || (errno != EAGAIN && errno != EINTR)) {
                    if (r < 0) {
                        if (++failed <= 5)
                            fprintf(stderr, "scale_conns server: read: %s (connection %llx)\n",
                                    strerror(errno), (unsigned long long)hs[fd].id);
                    } else {
                        closed++;
                        closed_bytes += hs[fd].bytes;
                        fingerprint += mix(hs[fd].id, hs[fd].bytes);
                    }
                    epoll_ctl(ep, EPOLL_CTL_DEL, fd, NULL);
                    close(fd);
                    held--;
                }
            }
        }
    }
    return 0;
}

static int *fds;
static uint64_t *sent, cid, warm_sent;
static long opened, n_conns;

/* Writes connection id (little-endian, 8 bytes) on fd; the bytes a write took. */
static uint64_t send_id(int fd, uint64_t id)
{
    unsigned char b[8];
    for (int k = 0; k < 8; k++)
        b[k] = (unsigned char)(id >> (8 * k));
    ssize_t w = write(fd, b, sizeof(b));
    if (w != (ssize_t)sizeof(b))
        fprintf(stderr, "scale_conns client: write: %zd %s\n", w, w < 0 ? strerror(errno) : "short");
    return w > 0 ? (uint64_t)w : 0;
}

static void open_all(const struct sockaddr_in *sa)
{
    long errors = 0;
    double t0 = now();
    for (long i = 0; i < n_conns; i++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0) {
            if (++errors <= 5)
                fprintf(stderr, "scale_conns client: socket: %s\n", strerror(errno));
            if (errno == EMFILE || errno == ENFILE)
                break;
            continue;
        }
        if (connect(fd, (const struct sockaddr *)sa, sizeof(*sa)) < 0) {
            if (++errors <= 5)
                fprintf(stderr, "scale_conns client: connect: %s (after %ld)\n",
                        strerror(errno), opened);
            close(fd);
            if (errors > 100)
                break;
            continue;
        }
        sent[opened] = send_id(fd, cid << 32 | (uint64_t)opened);
        if (sent[opened] != 8)
            errors++;
        fds[opened++] = fd;
    }
    printf("{\"event\": \"open\", \"opened\": %ld, \"errors\": %ld, \"seconds\": %.3f}\n",
           opened, errors, now() - t0);
    fflush(stdout);
}

/* Every connection sends 64 bytes once a second for secs seconds; connection i in slot
 * i % 100 of each second (10 ms slots). */
static void active(double secs)
{
    static char msg[64];
    memset(msg, 'a', sizeof(msg));
    long sends = 0, errors = 0;
    double max_late = 0, t0 = now();
    long slots = (long)(secs * 100.0);
    for (long s = 0; s < slots; s++) {
        double due = t0 + (double)s * 0.01;
        sleep_until(due);
        double late = now() - due;
        if (late > max_late)
            max_late = late;
        for (long i = s % 100; i < opened; i += 100) {
            ssize_t w = send(fds[i], msg, sizeof(msg), MSG_NOSIGNAL | MSG_DONTWAIT);
            if (w > 0)
                sent[i] += (uint64_t)w;
            if (w == (ssize_t)sizeof(msg))
                sends++;
            else if (++errors <= 5)
                fprintf(stderr, "scale_conns client: send: %zd %s\n", w,
                        w < 0 ? strerror(errno) : "short");
        }
    }
    printf("{\"event\": \"active\", \"sends\": %ld, \"errors\": %ld, \"max_late_ms\": %.1f, "
           "\"seconds\": %.3f}\n", sends, errors, max_late * 1000.0, now() - t0);
    fflush(stdout);
}

static int client(const char *ip, int port, long n, uint64_t id)
{
    cid = id;
    raise_nofile();
    struct sockaddr_in sa;
    if (make_addr("scale_conns", ip, port, &sa) < 0)
        return 1;
    n_conns = n;
    fds = calloc((size_t)n + 1, sizeof(int));
    if (!fds)
        return 1;
    sent = calloc((size_t)n + 1, sizeof(*sent));
    if (!sent)
        return 1;
    memset(fds, 0xff, ((size_t)n + 1) * sizeof(int)); /* resident before any measurement */
    memset(sent, 0, ((size_t)n + 1) * sizeof(*sent));
    int warm = socket(AF_INET, SOCK_STREAM, 0);
    if (warm < 0 || connect(warm, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        perror("scale_conns client: warm-up connect");
        return 1;
    }
    warm_sent = send_id(warm, cid << 32 | 0xffffffffull);
    printf("{\"event\": \"warm\", \"pid\": %d}\n", (int)getpid());
    fflush(stdout);
    char line[128];
    while (fgets(line, sizeof(line), stdin)) {
        if (strncmp(line, "open", 4) == 0)
            open_all(&sa);
        else if (strncmp(line, "active", 6) == 0)
            active(atof(line + 6));
    }
    uint64_t total = warm_sent, fingerprint = mix(cid << 32 | 0xffffffffull, warm_sent);
    for (long i = 0; i < opened; i++) {
        total += sent[i];
        fingerprint += mix(cid << 32 | (uint64_t)i, sent[i]);
    }
    printf("{\"event\": \"sent\", \"conns\": %ld, \"bytes\": %llu, \"fingerprint\": %llu}\n",
           opened + 1, (unsigned long long)total, (unsigned long long)fingerprint);
    fflush(stdout);
    for (long i = 0; i < opened; i++)
        close(fds[i]);
    close(warm);
    return opened == n ? 0 : 1;
}

int main(int argc, char **argv)
{
    signal(SIGPIPE, SIG_IGN);
    if (argc == 4 && strcmp(argv[1], "server") == 0)
        return server(argv[2], atoi(argv[3]));
    if ((argc == 5 || argc == 6) && strcmp(argv[1], "client") == 0)
        return client(argv[2], atoi(argv[3]), atol(argv[4]),
                      argc == 6 ? strtoull(argv[5], NULL, 10) : 0);
    fprintf(stderr, "usage: scale_conns server IP PORT | scale_conns client IP PORT N [CID]\n");
    return 2;
}
