/*
 * Memory per idle connection.
 *
 *   idle_conns server IP PORT
 *       accepts every connection and holds it (epoll); reads and discards whatever arrives and
 *       closes a connection when its peer does.
 *   idle_conns client IP PORT N HOLD_SECONDS [TOUCH]
 *       raises RLIMIT_NOFILE to its hard limit, opens one warm-up connection (so one-time
 *       set-up of any library, e.g. an interposition layer, is not charged to the N), reads
 *       its own VmRSS and RssAnon from /proc/self/status, opens N more connections and keeps
 *       them, reads VmRSS/RssAnon again and prints one JSON object on stdout:
 *       {"n": N, "opened": K, "rss_before_kb": .., "rss_after_kb": .., "bytes_per_conn": ..,
 *        "anon_bytes_per_conn": .., "connect_seconds": .., "errors": ..}
 *       (bytes_per_conn = (after - before) / K). With TOUCH=1 (the default) every connection
 *       carries one byte to the server after connect, so that per-connection state a library
 *       allocates only on first use is counted too; TOUCH=0 leaves them fully silent.
 *       Then it holds the connections for HOLD_SECONDS, or until its standard input closes,
 *       and exits.
 *
 * Plain POSIX; runs unchanged natively and under LD_PRELOAD.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

/* Value in kB of a "Key:   123 kB" line of /proc/self/status, or -1. */
static long status_kb(const char *key)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (!f)
        return -1;
    char line[256];
    long v = -1;
    size_t kl = strlen(key);
    while (fgets(line, sizeof(line), f)) {
        if (strncmp(line, key, kl) == 0 && line[kl] == ':') {
            v = strtol(line + kl + 1, NULL, 10);
            break;
        }
    }
    fclose(f);
    return v;
}

static int server(const char *ip, int port)
{
    raise_nofile();
    struct sockaddr_in sa;
    if (make_addr("idle_conns", ip, port, &sa) < 0)
        return 1;
    int lfd = listen_on(&sa);
    if (lfd < 0)
        return 1;
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN};
    ev.data.fd = lfd;
    epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev);
    fprintf(stderr, "idle_conns server: listening on %s:%d\n", ip, port);
    long held = 0;
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
            if (fd == lfd) {
                int c = accept(lfd, NULL, NULL);
                if (c < 0) {
                    if (errno == EMFILE || errno == ENFILE)
                        fprintf(stderr, "idle_conns server: accept: %s\n", strerror(errno));
                    continue;
                }
                struct epoll_event cev = {.events = EPOLLIN};
                cev.data.fd = c;
                if (epoll_ctl(ep, EPOLL_CTL_ADD, c, &cev) < 0) {
                    close(c);
                    continue;
                }
                held++;
            } else {
                char buf[4096];
                ssize_t r = read(fd, buf, sizeof(buf));
                if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
                    epoll_ctl(ep, EPOLL_CTL_DEL, fd, NULL);
                    close(fd);
                    held--;
                }
            }
        }
    }
    return 0;
}

static int client(const char *ip, int port, long n, double hold, int touch)
{
    raise_nofile();
    struct sockaddr_in sa;
    if (make_addr("idle_conns", ip, port, &sa) < 0)
        return 1;
    int *fds = calloc((size_t)n + 1, sizeof(int));
    if (!fds)
        return 1;
    /* Touch the array so its pages are resident before the first measurement. */
    memset(fds, 0xff, ((size_t)n + 1) * sizeof(int));

    int warm = socket(AF_INET, SOCK_STREAM, 0);
    if (warm < 0 || connect(warm, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        perror("idle_conns client: warm-up connect");
        return 1;
    }
    if (touch && write(warm, "w", 1) != 1)
        perror("idle_conns client: warm-up write");
    usleep(100000);

    long rss0 = status_kb("VmRSS"), anon0 = status_kb("RssAnon");
    long opened = 0, errors = 0;
    double t0 = now();
    for (long i = 0; i < n; i++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0) {
            errors++;
            if (errors <= 5)
                fprintf(stderr, "idle_conns client: socket: %s\n", strerror(errno));
            if (errno == EMFILE || errno == ENFILE)
                break;
            continue;
        }
        if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
            errors++;
            if (errors <= 5)
                fprintf(stderr, "idle_conns client: connect: %s\n", strerror(errno));
            close(fd);
            if (errors > 100)
                break;
            continue;
        }
        if (touch && write(fd, "x", 1) != 1) {
            errors++;
            if (errors <= 5)
                fprintf(stderr, "idle_conns client: write: %s\n", strerror(errno));
        }
        fds[opened++] = fd;
    }
    double el = now() - t0;
    usleep(200000); /* let any deferred per-connection work settle */
    long rss1 = status_kb("VmRSS"), anon1 = status_kb("RssAnon");
    double per = opened > 0 ? (double)(rss1 - rss0) * 1024.0 / (double)opened : 0.0;
    double aper = opened > 0 ? (double)(anon1 - anon0) * 1024.0 / (double)opened : 0.0;
    printf("{\"n\": %ld, \"opened\": %ld, \"rss_before_kb\": %ld, \"rss_after_kb\": %ld, "
           "\"anon_before_kb\": %ld, \"anon_after_kb\": %ld, \"bytes_per_conn\": %.1f, "
           "\"anon_bytes_per_conn\": %.1f, \"connect_seconds\": %.3f, \"errors\": %ld, "
           "\"touch\": %d}\n",
           n, opened, rss0, rss1, anon0, anon1, per, aper, el, errors, touch);
    fflush(stdout);

    /* Hold until stdin closes or the hold time runs out. */
    double end = now() + hold;
    for (;;) {
        double left = end - now();
        if (left <= 0)
            break;
        struct pollfd p = {.fd = 0, .events = POLLIN};
        int r = poll(&p, 1, (int)(left * 1000) + 1);
        if (r < 0 && errno == EINTR)
            continue;
        if (r > 0) {
            char c;
            if (read(0, &c, 1) <= 0)
                break;
            continue;
        }
        if (r == 0)
            break;
        break;
    }
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
    if ((argc == 6 || argc == 7) && strcmp(argv[1], "client") == 0)
        return client(argv[2], atoi(argv[3]), atol(argv[4]), atof(argv[5]),
                      argc == 7 ? atoi(argv[6]) : 1);
    fprintf(stderr, "usage: idle_conns server IP PORT | "
                    "idle_conns client IP PORT N HOLD_SECONDS [TOUCH]\n");
    return 2;
}
