/* A server whose listening socket goes away behind the layer's back: it accepts one
 * connection, answers one byte, then closes the listener with a bare `syscall` instruction
 * (neither the layer nor its agent hears of it, as when a listener dies between the agent's
 * answer and a client's SYN), and stays alive.
 *
 *   vanishing_listener IP PORT */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

static long bare_close(long fd)
{
    long r;
    __asm__ volatile("syscall" : "=a"(r) : "a"(3L), "D"(fd) : "rcx", "r11", "memory");
    return r;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s IP PORT\n", argv[0]);
        return 2;
    }
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((unsigned short)atoi(argv[2]))};
    if (inet_pton(AF_INET, argv[1], &a.sin_addr) != 1 || bind(l, (void *)&a, sizeof a) || listen(l, 16)) {
        perror("listen");
        return 1;
    }
    printf("listening\n");
    fflush(stdout);
    int c = accept(l, 0, 0);
    char b;
    if (c < 0 || read(c, &b, 1) != 1 || write(c, "y", 1) != 1) {
        perror("first connection");
        return 1;
    }
    close(c);
    bare_close(l);
    printf("listener gone\n");
    fflush(stdout);
    sleep(60);
    return 0;
}
