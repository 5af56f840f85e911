/*
 * Many connections held open, idle and then active at a low rate (harness/scale.py).
 *
 *   scale_conns server IP PORT
 *       raises RLIMIT_NOFILE to its hard limit, accepts every connection and holds it (epoll),
 *       reads and discards whatever arrives, closes a connection when its peer does.
 *   scale_conns client IP PORT N
 *       raises RLIMIT_NOFILE to its hard limit, opens one warm-up connection (one byte), prints
 *       {"event": "warm", "pid": P} and then obeys lines on its standard input:
 *         open          opens N connections, each carrying one byte, keeps them, and prints
 *                       {"event": "open", "opened": K, "errors": E, "seconds": S}
 *         active SECS   for SECS seconds every connection sends 64 bytes once a second, the
 *                       connections spread evenly over the second (slots of 10 ms); prints
 *                       {"event": "active", "sends": .., "errors": .., "max_late_ms": ..}
 *       and at the end of its standard input closes everything and exits (0 if all N opened).
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

static int server(const char *ip, int port)
{
    raise_nofile();
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
    fprintf(stderr, "scale_conns server: listening on %s:%d\n", ip, port);
    long held = 0, accept_errors = 0;
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
                    if (++accept_errors <= 5)
                        fprintf(stderr, "scale_conns server: accept: %s (held %ld)\n",
                                strerror(errno), held);
                    if (errno == EMFILE || errno == ENFILE)
                        usleep(10000);
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

static int *fds;
static long opened, n_conns;

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
        if (write(fd, "x", 1) != 1) {
            if (++errors <= 5)
                fprintf(stderr, "scale_conns client: write: %s\n", strerror(errno));
        }
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

static int client(const char *ip, int port, long n)
{
    raise_nofile();
    struct sockaddr_in sa;
    if (make_addr("scale_conns", ip, port, &sa) < 0)
        return 1;
    n_conns = n;
    fds = calloc((size_t)n + 1, sizeof(int));
    if (!fds)
        return 1;
    memset(fds, 0xff, ((size_t)n + 1) * sizeof(int)); /* resident before any measurement */
    int warm = socket(AF_INET, SOCK_STREAM, 0);
    if (warm < 0 || connect(warm, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        perror("scale_conns client: warm-up connect");
        return 1;
    }
    if (write(warm, "w", 1) != 1)
        perror("scale_conns client: warm-up write");
    printf("{\"event\": \"warm\", \"pid\": %d}\n", (int)getpid());
    fflush(stdout);
    char line[128];
    while (fgets(line, sizeof(line), stdin)) {
        if (strncmp(line, "open", 4) == 0)
            open_all(&sa);
        else if (strncmp(line, "active", 6) == 0)
            active(atof(line + 6));
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
    if (argc == 5 && strcmp(argv[1], "client") == 0)
        return client(argv[2], atoi(argv[3]), atol(argv[4]));
    fprintf(stderr, "usage: scale_conns server IP PORT | scale_conns client IP PORT N\n");
    return 2;
}
