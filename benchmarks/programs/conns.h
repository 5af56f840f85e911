/* What the connection benchmarks (connrate.c, idle_conns.c, scale_conns.c) share: an IPv4
 * address from text, the descriptor limit raised to its hard limit, a listening socket. */
#ifndef VMI_BENCH_CONNS_H
#define VMI_BENCH_CONNS_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>

/* sa = ip:port; -1 (and a message naming program `who`) if ip is not an IPv4 address. */
static inline int make_addr(const char *who, const char *ip, int port, struct sockaddr_in *sa)
{
    memset(sa, 0, sizeof(*sa));
    sa->sin_family = AF_INET;
    sa->sin_port = htons((unsigned short)port);
    if (inet_pton(AF_INET, ip, &sa->sin_addr) != 1) {
        fprintf(stderr, "%s: bad address %s\n", who, ip);
        return -1;
    }
    return 0;
}

/* The soft descriptor limit up to the hard one (many connections need many descriptors). */
static inline void raise_nofile(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
            perror("setrlimit");
    }
}

/* A socket listening on sa (SO_REUSEADDR, backlog 4096), or -1 after a message. */
static inline int listen_on(const struct sockaddr_in *sa)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    if (fd < 0) {
        perror("socket");
        return -1;
    }
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, (const struct sockaddr *)sa, sizeof(*sa)) < 0 || listen(fd, 4096) < 0) {
        perror("bind/listen");
        return -1;
    }
    return fd;
}

#endif
