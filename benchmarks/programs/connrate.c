/*
 * Connection set-up rate: how many TCP connections per second a client can open and close,
 * one after the other, against an accept-and-close server.
 *
 *   connrate server IP PORT
 *       PORT   : accept every connection and close it at once;
 *       PORT+1 : accept and hold every connection until the peer closes it (the "keeper").
 *   connrate client IP PORT COUNT SECONDS
 *       opens a keeper connection to PORT+1 (held for the whole run, so that an observer can see
 *       at least one long-lived connection), then loops: connect to PORT, read until EOF (the
 *       server's close), close; stops after COUNT connections or SECONDS, whichever comes first.
 *       Prints one JSON object on stdout:
 *       {"connections": N, "seconds": S, "conns_per_sec": R, "errors": E}
 *
 * The client waits for the server's close before closing its own end, so TIME_WAIT sits on
 * the server side and the client's ephemeral ports do not run out.
 * Plain POSIX; runs unchanged natively and under LD_PRELOAD.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
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

static int listen_at(const char *ip, int port)
{
    struct sockaddr_in sa;
    if (make_addr("connrate", ip, port, &sa) < 0)
        return -1;
    return listen_on(&sa);
}

static int server(const char *ip, int port)
{
    int lclose = listen_at(ip, port);
    int lhold = listen_at(ip, port + 1);
    if (lclose < 0 || lhold < 0)
        return 1;
    int ep = epoll_create1(0);
    if (ep < 0) {
        perror("epoll_create1");
        return 1;
    }
    struct epoll_event ev = {.events = EPOLLIN};
    ev.data.fd = lclose;
    epoll_ctl(ep, EPOLL_CTL_ADD, lclose, &ev);
    ev.data.fd = lhold;
    epoll_ctl(ep, EPOLL_CTL_ADD, lhold, &ev);
    fprintf(stderr, "connrate server: listening on %s:%d (close) and :%d (hold)\n", ip, port,
            port + 1);
    unsigned long accepted = 0;
    struct epoll_event evs[64];
    for (;;) {
        int n = epoll_wait(ep, evs, 64, -1);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            perror("epoll_wait");
            return 1;
        }
        for (int i = 0; i < n; i++) {
            int fd = evs[i].data.fd;
            if (fd == lclose) {
                int c = accept(lclose, NULL, NULL);
                if (c >= 0) {
                    accepted++;
                    close(c);
                }
            } else if (fd == lhold) {
                int c = accept(lhold, NULL, NULL);
                if (c >= 0) {
                    struct epoll_event cev = {.events = EPOLLIN};
                    cev.data.fd = c;
                    epoll_ctl(ep, EPOLL_CTL_ADD, c, &cev);
                }
            } else {
                char buf[4096];
                ssize_t r = read(fd, buf, sizeof(buf));
                if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
                    epoll_ctl(ep, EPOLL_CTL_DEL, fd, NULL);
                    close(fd);
                }
            }
        }
    }
    (void)accepted;
    return 0;
}

static int connect_to(const struct sockaddr_in *sa)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return -1;
    if (connect(fd, (const struct sockaddr *)sa, sizeof(*sa)) < 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

static int client(const char *ip, int port, long count, double seconds)
{
    struct sockaddr_in sa, sk;
    if (make_addr("connrate", ip, port, &sa) < 0 || make_addr("connrate", ip, port + 1, &sk) < 0)
        return 1;
    int keeper = connect_to(&sk);
    if (keeper < 0) {
        perror("connrate client: keeper connect");
        return 1;
    }
    long done = 0, errors = 0;
    char buf[256];
    double t0 = now(), t = t0;
    while (done < count && t - t0 < seconds) {
        int fd = connect_to(&sa);
        if (fd < 0) {
            errors++;
            if (errors <= 5)
                fprintf(stderr, "connrate client: connect: %s\n", strerror(errno));
            if (errors > 100) {
                fprintf(stderr, "connrate client: too many errors, giving up\n");
                break;
            }
            usleep(1000);
            t = now();
            continue;
        }
        /* Wait for the server's close. */
        for (;;) {
            ssize_t r = read(fd, buf, sizeof(buf));
            if (r > 0)
                continue;
            if (r < 0 && errno == EINTR)
                continue;
            break;
        }
        close(fd);
        done++;
        t = now();
    }
    double el = t - t0;
    close(keeper);
    printf("{\"connections\": %ld, \"seconds\": %.6f, \"conns_per_sec\": %.3f, \"errors\": %ld}\n",
           done, el, el > 0 ? (double)done / el : 0.0, errors);
    fflush(stdout);
    return done > 0 ? 0 : 1;
}

int main(int argc, char **argv)
{
    signal(SIGPIPE, SIG_IGN);
    if (argc == 4 && strcmp(argv[1], "server") == 0)
        return server(argv[2], atoi(argv[3]));
    if (argc == 6 && strcmp(argv[1], "client") == 0)
        return client(argv[2], atoi(argv[3]), atol(argv[4]), atof(argv[5]));
    fprintf(stderr, "usage: connrate server IP PORT | connrate client IP PORT COUNT SECONDS\n");
    return 2;
}
