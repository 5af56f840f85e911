/* Programs that restrict themselves, for tests/test_sandbox.py.
 *
 *   sandboxed seccomp-client IP:PORT BYTES [tsync]
 *       Connects to an echo server, then installs a seccomp filter that allows only the
 *       system calls this program makes itself from then on (read, write, close, exit_group,
 *       exit), default action: kill the process. With "tsync" the filter goes in through
 *       seccomp(2) with SECCOMP_FILTER_FLAG_TSYNC (every thread of the process), else through
 *       prctl(PR_SET_SECCOMP) (the calling thread, as OpenSSH does). Then it streams BYTES in
 *       chunks of 64 KiB (a pseudo-random stream), reading each chunk back and comparing it.
 *   sandboxed seccomp-reader IP:PORT BYTES [tsync]
 *       Same filter; then only reads BYTES sent by the peer (stream of --seed 7), checking them:
 *       acknowledgements must get back to a sender although this side never writes.
 *   sandboxed stream-server IP:PORT BYTES
 *       Serves connections one after the other: waits for one byte, then sends BYTES of the
 *       stream the reader checks, and closes. Not sandboxed.
 *   sandboxed chroot-server IP:PORT DIR UID
 *       Listens as root, accepts one connection, then chroot(DIR), chdir("/"), setgroups,
 *       setgid/setuid(UID): an unprivileged process in an empty root. Then echoes until the
 *       peer closes.
 *   sandboxed landlock-client IP:PORT BYTES
 *       Connects to an echo server, then restricts itself with Landlock (ABI 6 or later): no
 *       file system access, no TCP bind or connect, no abstract Unix sockets outside its
 *       domain (the layer's agent and rendezvous sockets are abstract). Then echoes BYTES.
 *   sandboxed echo-client IP:PORT BYTES
 *       Connects to an echo server and echoes BYTES through it (no sandbox).
 *   sandboxed exec-filtered PROGRAM [ARGS...]
 *       Installs a filter that kills the process on sendmsg and recvmsg (calls the layer uses
 *       to talk to its agent, and PROGRAM does not), then execs PROGRAM: the layer in the new
 *       image starts under a filter it cannot read.
 *   sandboxed pthread-exit IP:PORT BYTES MODE
 *       Connects to an echo server, echoes BYTES through it, then the main thread ends with
 *       pthread_exit. MODE "alone": no other thread of the program is left (the process must
 *       end at once, status 0). MODE "worker": a second thread echoes BYTES more after that,
 *       then returns (the process must end when it does).
 *
 * Each mode prints one JSON line at the end: {"mode": ..., "bytes": N, "ok": true|false, ...}
 * and exits 0 when everything matched.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <grp.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#define CHUNK (64 * 1024)

static unsigned char out_buf[CHUNK], in_buf[CHUNK];

static void die(const char *what) {
    fprintf(stderr, "sandboxed: %s: %s\n", what, strerror(errno));
    exit(2);
}

static void parse(const char *text, struct sockaddr_in *sa) {
    char host[64];
    const char *colon = strrchr(text, ':');
    if (!colon || (size_t)(colon - text) >= sizeof host) {
        fprintf(stderr, "sandboxed: bad address %s\n", text);
        exit(2);
    }
    memcpy(host, text, colon - text);
    host[colon - text] = 0;
    memset(sa, 0, sizeof *sa);
    sa->sin_family = AF_INET;
    sa->sin_port = htons(atoi(colon + 1));
    if (inet_pton(AF_INET, host, &sa->sin_addr) != 1) {
        fprintf(stderr, "sandboxed: bad address %s\n", text);
        exit(2);
    }
}

static int dial(const char *addr) {
    struct sockaddr_in sa;
    parse(addr, &sa);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) die("socket");
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) die("connect");
    return fd;
}

/* xorshift64*: the stream both ends can regenerate. */
static uint64_t next(uint64_t *s) {
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 0x2545F4914F6CDD1DULL;
}

static void fill(unsigned char *b, size_t n, uint64_t *s) {
    for (size_t i = 0; i < n; i += 8) {
        uint64_t v = next(s);
        memcpy(b + i, &v, n - i < 8 ? n - i : 8);
    }
}

static int write_all(int fd, const unsigned char *b, size_t n) {
    while (n > 0) {
        ssize_t r = write(fd, b, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        b += r;
        n -= r;
    }
    return 0;
}

static int read_all(int fd, unsigned char *b, size_t n) {
    while (n > 0) {
        ssize_t r = read(fd, b, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        b += r;
        n -= r;
    }
    return 0;
}

static long long echo_through(int fd, long long bytes, uint64_t seed);

#define ALLOW(nr) BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (nr), 0, 1), BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW)

/* Only what this program does itself once connected. */
static void sandbox(int tsync) {
    static struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        ALLOW(__NR_read),
        ALLOW(__NR_write),
        ALLOW(__NR_close),
        ALLOW(__NR_exit_group),
        ALLOW(__NR_exit),
        ALLOW(__NR_rt_sigreturn),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
    };
    struct sock_fprog prog = {.len = sizeof f / sizeof f[0], .filter = f};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) die("no_new_privs");
    if (tsync) {
        if (syscall(__NR_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, &prog) != 0)
            die("seccomp(TSYNC)");
    } else if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) {
        die("prctl(PR_SET_SECCOMP)");
    }
}

static int exec_filtered(char **argv) {
    static struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_sendmsg, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_recvmsg, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {.len = sizeof f / sizeof f[0], .filter = f};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) die("no_new_privs");
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) die("prctl(PR_SET_SECCOMP)");
    execvp(argv[0], argv);
    die("exec");
    return 2;
}

/* Landlock, spelled out (Debian 12's headers predate network rules and scopes). */
struct ll_ruleset_attr {
    uint64_t handled_access_fs;
    uint64_t handled_access_net;
    uint64_t scoped;
};

static int landlock_client(const char *addr, long long bytes) {
    int fd = dial(addr);
    long abi = syscall(444 /* landlock_create_ruleset */, NULL, 0, 1 /* VERSION */);
    if (abi < 6) {
        fprintf(stderr, "sandboxed: Landlock ABI %ld, need 6\n", abi);
        return 3;
    }
    struct ll_ruleset_attr attr = {
        .handled_access_fs = (1ULL << 16) - 1,
        .handled_access_net = 3,      /* BIND_TCP | CONNECT_TCP */
        .scoped = 1,                  /* ABSTRACT_UNIX_SOCKET */
    };
    int rs = syscall(444, &attr, sizeof attr, 0);
    if (rs < 0) die("landlock_create_ruleset");
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) die("no_new_privs");
    if (syscall(446 /* landlock_restrict_self */, rs, 0) != 0) die("landlock_restrict_self");
    close(rs);
    long long n = echo_through(fd, bytes, 11);
    close(fd);
    printf("{\"mode\": \"landlock-client\", \"bytes\": %lld, \"ok\": %s}\n", n < 0 ? 0 : n,
           n == bytes ? "true" : "false");
    fflush(stdout);
    return n == bytes ? 0 : 1;
}

static int seccomp_client(const char *addr, long long bytes, int tsync) {
    int fd = dial(addr);
    sandbox(tsync);
    uint64_t s_out = 0x1234567ULL, s_in = 0x1234567ULL;
    long long done = 0;
    int ok = 1;
    while (done < bytes) {
        size_t n = bytes - done < CHUNK ? (size_t)(bytes - done) : CHUNK;
        n = (n + 7) & ~(size_t)7;
        if (n > CHUNK) n = CHUNK;
        fill(out_buf, n, &s_out);
        if (write_all(fd, out_buf, n) != 0 || read_all(fd, in_buf, n) != 0) {
            ok = 0;
            break;
        }
        fill(out_buf, n, &s_in);
        if (memcmp(out_buf, in_buf, n) != 0) {
            ok = 0;
            break;
        }
        done += n;
    }
    close(fd);
    printf("{\"mode\": \"seccomp-client\", \"tsync\": %s, \"bytes\": %lld, \"ok\": %s}\n",
           tsync ? "true" : "false", done, ok ? "true" : "false");
    fflush(stdout);
    return ok ? 0 : 1;
}

static int seccomp_reader(const char *addr, long long bytes, int tsync) {
    int fd = dial(addr);
    /* The server (a stream sender) starts when it sees the first byte. */
    unsigned char go = 'g';
    if (write_all(fd, &go, 1) != 0) die("write");
    sandbox(tsync);
    uint64_t s = 7;
    long long done = 0;
    int ok = 1;
    while (done < bytes) {
        size_t n = bytes - done < CHUNK ? (size_t)(bytes - done) : CHUNK;
        if (read_all(fd, in_buf, n) != 0) {
            ok = 0;
            break;
        }
        fill(out_buf, n, &s);
        if (memcmp(out_buf, in_buf, n) != 0) {
            ok = 0;
            break;
        }
        done += n;
    }
    close(fd);
    printf("{\"mode\": \"seccomp-reader\", \"tsync\": %s, \"bytes\": %lld, \"ok\": %s}\n",
           tsync ? "true" : "false", done, ok ? "true" : "false");
    fflush(stdout);
    return ok ? 0 : 1;
}

static int listener(const char *addr) {
    struct sockaddr_in sa;
    parse(addr, &sa);
    int ls = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    if (ls < 0) die("socket");
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(ls, (struct sockaddr *)&sa, sizeof sa) != 0) die("bind");
    if (listen(ls, 4) != 0) die("listen");
    return ls;
}

static _Noreturn void stream_server(const char *addr, long long bytes) {
    int ls = listener(addr);
    for (;;) {
        int fd = accept(ls, NULL, NULL);
        if (fd < 0) die("accept");
        unsigned char go;
        if (read_all(fd, &go, 1) == 0) {
            uint64_t s = 7;
            long long done = 0;
            while (done < bytes) {
                size_t n = bytes - done < CHUNK ? (size_t)(bytes - done) : CHUNK;
                fill(out_buf, n, &s);
                if (write_all(fd, out_buf, n) != 0) break;
                done += n;
            }
            fprintf(stderr, "stream-server: sent %lld bytes\n", done);
        }
        close(fd);
    }
}

static int chroot_server(const char *addr, const char *dir, int uid) {
    int ls = listener(addr);
    int fd = accept(ls, NULL, NULL);
    if (fd < 0) die("accept");
    close(ls);
    if (chroot(dir) != 0) die("chroot");
    if (chdir("/") != 0) die("chdir");
    gid_t g = uid;
    if (setgroups(1, &g) != 0) die("setgroups");
    if (setgid(uid) != 0) die("setgid");
    if (setuid(uid) != 0) die("setuid");
    long long total = 0;
    for (;;) {
        ssize_t r = read(fd, in_buf, CHUNK);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        if (write_all(fd, in_buf, r) != 0) break;
        total += r;
    }
    close(fd);
    printf("{\"mode\": \"chroot-server\", \"bytes\": %lld, \"uid\": %d, \"ok\": true}\n", total,
           (int)getuid());
    fflush(stdout);
    return 0;
}

struct job {
    int fd;
    long long bytes;
    uint64_t seed;
};

static long long echo_through(int fd, long long bytes, uint64_t seed) {
    uint64_t s_out = seed, s_in = seed;
    long long done = 0;
    static __thread unsigned char o[CHUNK], i[CHUNK];
    while (done < bytes) {
        size_t n = bytes - done < CHUNK ? (size_t)(bytes - done) : CHUNK;
        fill(o, n, &s_out);
        if (write_all(fd, o, n) != 0 || read_all(fd, i, n) != 0) return -1;
        fill(o, n, &s_in);
        if (memcmp(o, i, n) != 0) return -1;
        done += n;
    }
    return done;
}

static void *worker(void *arg) {
    struct job *j = arg;
    /* Let the main thread end first. */
    usleep(300 * 1000);
    long long n = echo_through(j->fd, j->bytes, j->seed);
    printf("{\"mode\": \"pthread-exit\", \"worker\": true, \"bytes\": %lld, \"ok\": %s}\n",
           n < 0 ? 0 : n, n == j->bytes ? "true" : "false");
    fflush(stdout);
    close(j->fd);
    return NULL;
}

static int echo_client(const char *addr, long long bytes) {
    int fd = dial(addr);
    long long n = echo_through(fd, bytes, 5);
    close(fd);
    printf("{\"mode\": \"echo-client\", \"bytes\": %lld, \"ok\": %s}\n", n < 0 ? 0 : n,
           n == bytes ? "true" : "false");
    fflush(stdout);
    return n == bytes ? 0 : 1;
}

static int pthread_exit_mode(const char *addr, long long bytes, const char *mode) {
    int fd = dial(addr);
    long long n = echo_through(fd, bytes, 99);
    if (n != bytes) {
        printf("{\"mode\": \"pthread-exit\", \"bytes\": %lld, \"ok\": false}\n", n);
        return 1;
    }
    if (strcmp(mode, "worker") == 0) {
        static struct job j;
        j.fd = fd;
        j.bytes = bytes;
        j.seed = 1234;
        pthread_t t;
        if (pthread_create(&t, NULL, worker, &j) != 0) die("pthread_create");
        pthread_detach(t);
    } else {
        printf("{\"mode\": \"pthread-exit\", \"worker\": false, \"bytes\": %lld, \"ok\": true}\n", n);
        fflush(stdout);
    }
    pthread_exit(NULL);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOFBF, 4096);
    if (argc >= 4 && strcmp(argv[1], "seccomp-client") == 0)
        return seccomp_client(argv[2], atoll(argv[3]), argc > 4 && strcmp(argv[4], "tsync") == 0);
    if (argc >= 4 && strcmp(argv[1], "seccomp-reader") == 0)
        return seccomp_reader(argv[2], atoll(argv[3]), argc > 4 && strcmp(argv[4], "tsync") == 0);
    if (argc == 4 && strcmp(argv[1], "stream-server") == 0)
        stream_server(argv[2], atoll(argv[3]));
    if (argc == 5 && strcmp(argv[1], "chroot-server") == 0)
        return chroot_server(argv[2], argv[3], atoi(argv[4]));
    if (argc == 4 && strcmp(argv[1], "landlock-client") == 0)
        return landlock_client(argv[2], atoll(argv[3]));
    if (argc == 4 && strcmp(argv[1], "echo-client") == 0)
        return echo_client(argv[2], atoll(argv[3]));
    if (argc >= 3 && strcmp(argv[1], "exec-filtered") == 0)
        return exec_filtered(argv + 2);
    if (argc == 5 && strcmp(argv[1], "pthread-exit") == 0)
        return pthread_exit_mode(argv[2], atoll(argv[3]), argv[4]);
    fprintf(stderr, "usage: see the comment at the top of sandboxed.c\n");
    return 2;
}
