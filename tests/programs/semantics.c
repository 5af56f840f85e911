/*
 * Socket semantics on one TCP connection, checked call by call: both ends of a scenario run
 * as two programs (server and client) that agree on what is sent when.
 *
 *     semantics server SCENARIO IP:PORT [HOLD_MS]
 *     semantics client SCENARIO IP:PORT [HOLD_MS]
 *     semantics list
 *
 * The server binds IP:PORT, accepts one connection and runs its half of SCENARIO; the client
 * connects and runs its half. Both keep the connection open HOLD_MS milliseconds right after
 * it is established (so that `vmictl status` can see it), then run the scenario. Each prints
 * one JSON line and exits 0 on success:
 *
 *     {"role": "client", "scenario": "peek", "ok": true, "local": "10.78.0.2:40000",
 *      "peer": "10.78.0.1:17500", "detail": "..."}
 *
 * or, with "ok": false, the step that failed and why (exit status 1). A step that hangs is
 * reported the same way after TIMEOUT_S seconds (exit status 2).
 *
 * Everything the programs expect is what native Linux TCP does; run without any preload
 * every scenario passes (the test suite runs it that way as a control).
 */

#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/select.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define TIMEOUT_S 12          /* whole program */
#define WAIT_MS 5000          /* one wait for readiness */

static const char *g_role = "?";
static const char *g_scen = "?";
static const char *volatile g_step = "start";
static char g_local[64] = "";
static char g_peer[64] = "";
static char g_detail[512] = "";
static int g_hold_ms = 0;

#define STEP(s) (g_step = (s))

/* ------------------------------------------------------------------------------------------ */
/* Reporting */

static const char *errname(int e)
{
    const char *n = strerrorname_np(e);
    return n ? n : "unknown errno";
}

static size_t json_escape(char *out, size_t cap, const char *s)
{
    size_t o = 0;
    for (; *s && o + 7 < cap; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            out[o++] = '\\';
            out[o++] = (char)c;
        } else if (c < 0x20) {
            o += (size_t)snprintf(out + o, cap - o, "\\u%04x", c);
        } else {
            out[o++] = (char)c;
        }
    }
    out[o] = 0;
    return o;
}

static void emit(int ok, const char *error)
{
    char line[4096], e_step[256], e_err[2048], e_det[1024];
    json_escape(e_step, sizeof e_step, g_step);
    json_escape(e_err, sizeof e_err, error ? error : "");
    json_escape(e_det, sizeof e_det, g_detail);
    int n;
    if (ok)
        n = snprintf(line, sizeof line,
                     "{\"role\": \"%s\", \"scenario\": \"%s\", \"ok\": true, \"local\": \"%s\", "
                     "\"peer\": \"%s\", \"detail\": \"%s\"}\n",
                     g_role, g_scen, g_local, g_peer, e_det);
    else
        n = snprintf(line, sizeof line,
                     "{\"role\": \"%s\", \"scenario\": \"%s\", \"ok\": false, \"local\": \"%s\", "
                     "\"peer\": \"%s\", \"step\": \"%s\", \"error\": \"%s\", \"detail\": \"%s\"}\n",
                     g_role, g_scen, g_local, g_peer, e_step, e_err, e_det);
    if (n > (int)sizeof line - 1)
        n = (int)sizeof line - 1;
    ssize_t w = write(1, line, (size_t)n);
    (void)w;
}

static void fail(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
static void fail(const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    emit(0, msg);
    _exit(1);
}

#define CHECK(cond, ...)          \
    do {                          \
        if (!(cond))              \
            fail(__VA_ARGS__);    \
    } while (0)

static void on_alarm(int sig)
{
    (void)sig;
    char msg[128];
    snprintf(msg, sizeof msg, "timed out: still in this step after %d s", TIMEOUT_S);
    emit(0, msg);
    _exit(2);
}

static void note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void note(const char *fmt, ...)
{
    size_t o = strlen(g_detail);
    if (o + 2 >= sizeof g_detail)
        return;
    if (o)
        g_detail[o++] = ';', g_detail[o++] = ' ', g_detail[o] = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_detail + o, sizeof g_detail - o, fmt, ap);
    va_end(ap);
}

/* ------------------------------------------------------------------------------------------ */
/* Small tools */

static long now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000L + t.tv_nsec / 1000000L;
}

static void sleep_ms(int ms)
{
    struct timespec t = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&t, &t) != 0 && errno == EINTR)
        ;
}

static uint8_t pat(size_t i)
{
    return (uint8_t)(i * 131u + (i >> 10) * 7u + 1u);
}

static void fill(uint8_t *b, size_t n, size_t start)
{
    for (size_t i = 0; i < n; i++)
        b[i] = pat(start + i);
}

/* Index of the first byte that differs from the pattern, or -1. */
static long mismatch(const uint8_t *b, size_t n, size_t start)
{
    for (size_t i = 0; i < n; i++)
        if (b[i] != pat(start + i))
            return (long)i;
    return -1;
}

static int wait_fd(int fd, short events, int ms)
{
    struct pollfd p = {fd, events, 0};
    int r;
    do
        r = poll(&p, 1, ms);
    while (r < 0 && errno == EINTR);
    return r > 0 ? p.revents : 0;
}

static void write_all(int fd, const void *buf, size_t n)
{
    const char *p = buf;
    size_t done = 0;
    while (done < n) {
        ssize_t r = write(fd, p + done, n - done);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && errno == EAGAIN) {
            CHECK(wait_fd(fd, POLLOUT, WAIT_MS) & POLLOUT,
                  "write: socket not writable within %d ms (%zu of %zu bytes written)", WAIT_MS,
                  done, n);
            continue;
        }
        CHECK(r > 0, "write returned %zd (%s) after %zu of %zu bytes", r,
              r < 0 ? errname(errno) : "-", done, n);
        done += (size_t)r;
    }
}

static void read_exact(int fd, void *buf, size_t n)
{
    char *p = buf;
    size_t done = 0;
    while (done < n) {
        ssize_t r = read(fd, p + done, n - done);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && errno == EAGAIN) {
            CHECK(wait_fd(fd, POLLIN, WAIT_MS),
                  "read: nothing readable within %d ms (%zu of %zu bytes read)", WAIT_MS, done, n);
            continue;
        }
        CHECK(r != 0, "read: end of stream after %zu of %zu bytes", done, n);
        CHECK(r > 0, "read returned -1 (%s) after %zu of %zu bytes", errname(errno), done, n);
        done += (size_t)r;
    }
}

static void expect_bytes(int fd, const char *want)
{
    char got[256];
    size_t n = strlen(want);
    read_exact(fd, got, n);
    CHECK(memcmp(got, want, n) == 0, "read '%.*s', expected '%s'", (int)n, got, want);
}

/* Waits for the peer's end of stream; the socket may be blocking or not. */
static void expect_eof(int fd)
{
    STEP("wait for the peer's end of stream");
    char b[64];
    for (;;) {
        CHECK(wait_fd(fd, POLLIN, 10000), "no end of stream within 10 s");
        ssize_t r = read(fd, b, sizeof b);
        if (r < 0 && (errno == EINTR || errno == EAGAIN))
            continue;
        CHECK(r == 0, "expected end of stream, read returned %zd (%s)", r,
              r < 0 ? errname(errno) : "unexpected data");
        return;
    }
}

/* Reads until end of stream into a growing buffer. */
static uint8_t *read_to_eof(int fd, size_t *len)
{
    size_t cap = 1 << 16, n = 0;
    uint8_t *b = malloc(cap);
    for (;;) {
        if (n == cap)
            b = realloc(b, cap *= 2);
        ssize_t r = read(fd, b + n, cap - n);
        if (r < 0 && errno == EINTR)
            continue;
        CHECK(r >= 0, "read returned -1 (%s) after %zu bytes", errname(errno), n);
        if (r == 0)
            break;
        n += (size_t)r;
    }
    *len = n;
    return b;
}

static void set_nonblock(int fd, int on)
{
    int fl = fcntl(fd, F_GETFL);
    CHECK(fl >= 0, "fcntl(F_GETFL): %s", errname(errno));
    CHECK(fcntl(fd, F_SETFL, on ? fl | O_NONBLOCK : fl & ~O_NONBLOCK) == 0,
          "fcntl(F_SETFL): %s", errname(errno));
}

static void addr_text(const struct sockaddr_in *a, char *out, size_t cap)
{
    char ip[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &a->sin_addr, ip, sizeof ip);
    snprintf(out, cap, "%s:%u", ip, ntohs(a->sin_port));
}

static void record_names(int fd)
{
    struct sockaddr_in a;
    socklen_t l = sizeof a;
    CHECK(getsockname(fd, (struct sockaddr *)&a, &l) == 0, "getsockname: %s", errname(errno));
    addr_text(&a, g_local, sizeof g_local);
    l = sizeof a;
    CHECK(getpeername(fd, (struct sockaddr *)&a, &l) == 0, "getpeername: %s", errname(errno));
    addr_text(&a, g_peer, sizeof g_peer);
}

static void expect_eagain(ssize_t r, const char *call)
{
    CHECK(r == -1 && errno == EAGAIN, "%s on an empty non-blocking socket returned %zd (%s), "
          "expected -1 EAGAIN", call, r, r < 0 ? errname(errno) : "data");
}

/* Echoes everything until end of stream. */
static void serve_echo(int fd)
{
    STEP("echo until end of stream");
    static char b[1 << 16];
    size_t total = 0;
    for (;;) {
        ssize_t r = read(fd, b, sizeof b);
        if (r < 0 && errno == EINTR)
            continue;
        CHECK(r >= 0, "read returned -1 (%s) after %zu bytes", errname(errno), total);
        if (r == 0)
            break;
        write_all(fd, b, (size_t)r);
        total += (size_t)r;
    }
    note("echoed %zu bytes", total);
    close(fd);
}

/* ------------------------------------------------------------------------------------------ */
/* Scenarios. Each side owns fd and closes it. */

/* MSG_PEEK shows the bytes without taking them; the read then returns the same bytes. */
static void s_peek(int fd)
{
    STEP("write 11 bytes");
    write_all(fd, "hello, peek", 11);
    expect_eof(fd);
    close(fd);
}

static void c_peek(int fd)
{
    char a[64], b[64];
    STEP("wait until readable");
    CHECK(wait_fd(fd, POLLIN, WAIT_MS) & POLLIN, "no data within %d ms", WAIT_MS);
    sleep_ms(50);
    STEP("recv(5, MSG_PEEK)");
    ssize_t n = recv(fd, a, 5, MSG_PEEK);
    CHECK(n == 5 && memcmp(a, "hello", 5) == 0, "returned %zd (%s) '%.*s', expected 5 'hello'",
          n, n < 0 ? errname(errno) : "-", (int)(n > 0 ? n : 0), a);
    STEP("recv(64, MSG_PEEK)");
    n = recv(fd, a, sizeof a, MSG_PEEK);
    CHECK(n == 11 && memcmp(a, "hello, peek", 11) == 0,
          "returned %zd (%s) '%.*s', expected 11 'hello, peek' (peeking again sees the same "
          "bytes)", n, n < 0 ? errname(errno) : "-", (int)(n > 0 ? n : 0), a);
    STEP("read(64) after peeking");
    n = read(fd, b, sizeof b);
    CHECK(n == 11 && memcmp(b, "hello, peek", 11) == 0,
          "returned %zd (%s) '%.*s', expected the 11 peeked bytes", n,
          n < 0 ? errname(errno) : "-", (int)(n > 0 ? n : 0), b);
    STEP("recv(MSG_PEEK|MSG_DONTWAIT) on the now empty socket");
    expect_eagain(recv(fd, a, sizeof a, MSG_PEEK | MSG_DONTWAIT), "recv(MSG_PEEK|MSG_DONTWAIT)");
    close(fd);
}

/* Two writes queued at the receiver: a peek sees all queued bytes, like native TCP. A
 * program that peeks until a whole message header is there relies on it. */
static void s_peek_two_writes(int fd)
{
    STEP("write 'abc', then 'defgh'");
    write_all(fd, "abc", 3);
    sleep_ms(50);
    write_all(fd, "defgh", 5);
    expect_eof(fd);
    close(fd);
}

static void c_peek_two_writes(int fd)
{
    char a[64];
    STEP("wait until both writes arrived");
    CHECK(wait_fd(fd, POLLIN, WAIT_MS) & POLLIN, "no data within %d ms", WAIT_MS);
    sleep_ms(300);
    STEP("recv(8, MSG_PEEK) until it shows 8 bytes");
    ssize_t n = -1, best = -1;
    int tries;
    for (tries = 1; tries <= 50; tries++) {
        CHECK(wait_fd(fd, POLLIN, WAIT_MS) & POLLIN, "socket no longer readable");
        n = recv(fd, a, 8, MSG_PEEK);
        CHECK(n > 0, "recv(MSG_PEEK) returned %zd (%s)", n, n < 0 ? errname(errno) : "EOF");
        if (n > best)
            best = n;
        if (n == 8)
            break;
        sleep_ms(10);
    }
    CHECK(n == 8 && memcmp(a, "abcdefgh", 8) == 0,
          "8 bytes ('abc' and 'defgh', two writes) are queued, but 50 calls of "
          "recv(8, MSG_PEEK) over 0.5 s never showed more than %zd bytes ('%.*s'); native TCP "
          "shows all 8 (a program peeking for a whole header would spin forever)",
          best, (int)(best > 0 ? best : 0), a);
    note("peek showed 8 bytes after %d call(s)", tries);
    STEP("read the 8 bytes");
    char b[8];
    read_exact(fd, b, 8);
    CHECK(memcmp(b, "abcdefgh", 8) == 0, "read '%.8s', expected 'abcdefgh'", b);
    close(fd);
}

/* MSG_WAITALL: one call returns all 100000 bytes the peer writes in 1000-byte pieces. */
#define WAITALL_N 100000
static void s_waitall(int fd)
{
    STEP("write 100 pieces of 1000 bytes, 2 ms apart");
    uint8_t b[1000];
    for (int i = 0; i < WAITALL_N / 1000; i++) {
        fill(b, sizeof b, (size_t)i * 1000);
        write_all(fd, b, sizeof b);
        sleep_ms(2);
    }
    expect_eof(fd);
    close(fd);
}

static void c_waitall(int fd)
{
    uint8_t *b = malloc(WAITALL_N);
    STEP("recv(100000, MSG_WAITALL)");
    long t0 = now_ms();
    ssize_t n = recv(fd, b, WAITALL_N, MSG_WAITALL);
    CHECK(n == WAITALL_N, "one recv(MSG_WAITALL) returned %zd (%s) after %ld ms, expected all "
          "%d bytes", n, n < 0 ? errname(errno) : "-", now_ms() - t0, WAITALL_N);
    long bad = mismatch(b, WAITALL_N, 0);
    CHECK(bad < 0, "byte %ld differs", bad);
    note("one call, %ld ms", now_ms() - t0);
    free(b);
    close(fd);
}

/* MSG_DONTWAIT on an empty blocking socket: EAGAIN, and the socket stays blocking. */
static void s_dontwait(int fd)
{
    STEP("write 'late' after 300 ms");
    sleep_ms(300);
    write_all(fd, "late", 4);
    expect_eof(fd);
    close(fd);
}

static void c_dontwait(int fd)
{
    char b[16];
    STEP("recv(MSG_DONTWAIT) on the empty socket");
    expect_eagain(recv(fd, b, sizeof b, MSG_DONTWAIT), "recv(MSG_DONTWAIT)");
    STEP("the socket is still blocking");
    CHECK(!(fcntl(fd, F_GETFL) & O_NONBLOCK), "O_NONBLOCK is set after recv(MSG_DONTWAIT)");
    STEP("a blocking recv waits for 'late'");
    long t0 = now_ms();
    ssize_t n = recv(fd, b, sizeof b, 0);
    CHECK(n == 4 && memcmp(b, "late", 4) == 0, "returned %zd (%s), expected 4 'late'", n,
          n < 0 ? errname(errno) : "-");
    note("blocking recv waited %ld ms", now_ms() - t0);
    close(fd);
}

/* Non-blocking connect: EINPROGRESS, POLLOUT, SO_ERROR 0, then data both ways. */
static void s_nb_connect(int fd)
{
    STEP("read 'ping'");
    expect_bytes(fd, "ping");
    STEP("write 'pong'");
    write_all(fd, "pong", 4);
    expect_eof(fd);
    close(fd);
}

static void c_nb_connect(int fd)
{
    STEP("write 'ping' on the non-blocking socket");
    write_all(fd, "ping", 4);
    STEP("read 'pong' on the non-blocking socket");
    expect_bytes(fd, "pong");
    close(fd);
}

static int nb_connect(const struct sockaddr_in *dst)
{
    STEP("socket + O_NONBLOCK");
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    CHECK(fd >= 0, "socket: %s", errname(errno));
    set_nonblock(fd, 1);
    STEP("non-blocking connect");
    int r = connect(fd, (const struct sockaddr *)dst, sizeof *dst);
    CHECK(r == -1 && errno == EINPROGRESS, "connect returned %d (%s), expected -1 EINPROGRESS",
          r, r < 0 ? errname(errno) : "connected at once");
    STEP("poll(POLLOUT) for the connection");
    int ev = wait_fd(fd, POLLOUT, WAIT_MS);
    CHECK(ev & POLLOUT, "poll gave revents 0x%x, expected POLLOUT", ev);
    STEP("getsockopt(SO_ERROR)");
    int err = -1;
    socklen_t l = sizeof err;
    CHECK(getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &l) == 0, "getsockopt: %s", errname(errno));
    CHECK(err == 0, "SO_ERROR is %d (%s), expected 0", err, errname(err));
    return fd;
}

/* O_NONBLOCK via fcntl: every read call gives EAGAIN on an empty socket. */
static void s_late_data(int fd)
{
    STEP("read 'g'");
    expect_bytes(fd, "g");
    STEP("write 'data' after 100 ms");
    sleep_ms(100);
    write_all(fd, "data", 4);
    STEP("write 'more' after 200 ms");
    sleep_ms(200);
    write_all(fd, "more", 4);
    expect_eof(fd);
    close(fd);
}

static void empty_reads_eagain(int fd)
{
    char b[16];
    struct iovec iov = {b, sizeof b};
    struct msghdr m = {0};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    STEP("read/recv/readv/recvmsg on the empty non-blocking socket");
    expect_eagain(read(fd, b, sizeof b), "read");
    expect_eagain(recv(fd, b, sizeof b, 0), "recv");
    expect_eagain(readv(fd, &iov, 1), "readv");
    expect_eagain(recvmsg(fd, &m, 0), "recvmsg");
}

static void nonblock_rest(int fd, const char *how)
{
    char b[16];
    STEP("write 'g'");
    write_all(fd, "g", 1);
    STEP("poll, then read 'data'");
    CHECK(wait_fd(fd, POLLIN, WAIT_MS) & POLLIN, "no data within %d ms", WAIT_MS);
    ssize_t n = read(fd, b, sizeof b);
    CHECK(n == 4 && memcmp(b, "data", 4) == 0, "read returned %zd (%s), expected 4 'data'", n,
          n < 0 ? errname(errno) : "-");
    STEP("read again: EAGAIN");
    expect_eagain(read(fd, b, sizeof b), "read");
    STEP("back to blocking; a read waits for 'more'");
    if (strcmp(how, "fionbio") == 0) {
        int off = 0;
        CHECK(ioctl(fd, FIONBIO, &off) == 0, "ioctl(FIONBIO, 0): %s", errname(errno));
    } else {
        set_nonblock(fd, 0);
    }
    n = read(fd, b, sizeof b);
    CHECK(n == 4 && memcmp(b, "more", 4) == 0, "blocking read returned %zd (%s), expected 4 "
          "'more'", n, n < 0 ? errname(errno) : "-");
    close(fd);
}

static void c_nonblock_fcntl(int fd)
{
    STEP("fcntl(F_SETFL, O_NONBLOCK)");
    set_nonblock(fd, 1);
    CHECK(fcntl(fd, F_GETFL) & O_NONBLOCK, "O_NONBLOCK not set");
    empty_reads_eagain(fd);
    nonblock_rest(fd, "fcntl");
}

static void c_nonblock_fionbio(int fd)
{
    STEP("ioctl(FIONBIO, 1)");
    int on = 1;
    CHECK(ioctl(fd, FIONBIO, &on) == 0, "ioctl(FIONBIO): %s", errname(errno));
    CHECK(fcntl(fd, F_GETFL) & O_NONBLOCK, "O_NONBLOCK not set by FIONBIO");
    empty_reads_eagain(fd);
    nonblock_rest(fd, "fionbio");
}

/* FIONREAD counts the payload bytes waiting, nothing else. */
static void s_fionread(int fd)
{
    uint8_t b[1000];
    fill(b, sizeof b, 0);
    STEP("read 'g'");
    expect_bytes(fd, "g");
    STEP("write 400 + 600 bytes");
    write_all(fd, b, 400);
    sleep_ms(20);
    write_all(fd, b + 400, 600);
    expect_eof(fd);
    close(fd);
}

static int fionread(int fd)
{
    int n = -1;
    CHECK(ioctl(fd, FIONREAD, &n) == 0, "ioctl(FIONREAD): %s", errname(errno));
    return n;
}

static void c_fionread(int fd)
{
    uint8_t b[1000];
    int n;
    STEP("FIONREAD on the empty socket");
    CHECK((n = fionread(fd)) == 0, "FIONREAD says %d, expected 0", n);
    STEP("write 'g'; the peer answers with 400 + 600 bytes");
    write_all(fd, "g", 1);
    sleep_ms(400);
    STEP("FIONREAD with 1000 bytes waiting");
    CHECK((n = fionread(fd)) == 1000, "FIONREAD says %d, expected 1000", n);
    STEP("read 300, FIONREAD again");
    read_exact(fd, b, 300);
    CHECK((n = fionread(fd)) == 700, "FIONREAD says %d after reading 300 of 1000, expected 700",
          n);
    STEP("read 700, FIONREAD again");
    read_exact(fd, b + 300, 700);
    CHECK((n = fionread(fd)) == 0, "FIONREAD says %d after reading everything, expected 0", n);
    long bad = mismatch(b, sizeof b, 0);
    CHECK(bad < 0, "byte %ld differs", bad);
    close(fd);
}

/* poll / select readiness, including end of stream. */
static void s_reply(int fd)
{
    STEP("read 'g'");
    expect_bytes(fd, "g");
    STEP("write 'reply' after 100 ms");
    sleep_ms(100);
    write_all(fd, "reply", 5);
    expect_eof(fd);
    close(fd);
}

static int sel(int fd, int rd, int wr, int ms)
{
    fd_set r, w;
    FD_ZERO(&r);
    FD_ZERO(&w);
    if (rd)
        FD_SET(fd, &r);
    if (wr)
        FD_SET(fd, &w);
    struct timeval tv = {ms / 1000, (ms % 1000) * 1000};
    int n = select(fd + 1, &r, &w, NULL, &tv);
    CHECK(n >= 0, "select: %s", errname(errno));
    return (FD_ISSET(fd, &r) ? 1 : 0) | (FD_ISSET(fd, &w) ? 2 : 0);
}

static int readable(int fd, int use_select, int ms)
{
    return use_select ? (sel(fd, 1, 0, ms) & 1) : (wait_fd(fd, POLLIN, ms) & POLLIN) != 0;
}

static void c_readiness(int fd, int use_select)
{
    char b[8];
    STEP("not readable while nothing was sent (100 ms)");
    CHECK(!readable(fd, use_select, 100), "readable before the peer sent anything");
    STEP("writable at once");
    if (use_select)
        CHECK(sel(fd, 0, 1, 0) & 2, "select does not report the socket writable");
    else
        CHECK(wait_fd(fd, POLLOUT, 0) & POLLOUT, "poll does not report POLLOUT");
    STEP("write 'g'; readable when the reply arrives");
    write_all(fd, "g", 1);
    long t0 = now_ms();
    CHECK(readable(fd, use_select, WAIT_MS), "not readable within %d ms of the reply", WAIT_MS);
    note("readable after %ld ms", now_ms() - t0);
    STEP("read 'reply'");
    ssize_t n = read(fd, b, sizeof b);
    CHECK(n == 5 && memcmp(b, "reply", 5) == 0, "read returned %zd (%s), expected 5 'reply'", n,
          n < 0 ? errname(errno) : "-");
    STEP("not readable once drained (100 ms)");
    CHECK(!readable(fd, use_select, 100), "still readable after reading everything");
    STEP("shutdown(SHUT_WR); readable at the peer's end of stream");
    CHECK(shutdown(fd, SHUT_WR) == 0, "shutdown: %s", errname(errno));
    CHECK(readable(fd, use_select, WAIT_MS), "end of stream not reported readable in %d ms",
          WAIT_MS);
    n = read(fd, b, sizeof b);
    CHECK(n == 0, "read at end of stream returned %zd (%s), expected 0", n,
          n < 0 ? errname(errno) : "data");
    close(fd);
}

static void c_poll(int fd) { c_readiness(fd, 0); }
static void c_select(int fd) { c_readiness(fd, 1); }

/* epoll, level-triggered: still reported while bytes remain. */
static void s_hundred(int fd)
{
    uint8_t b[100];
    fill(b, sizeof b, 0);
    STEP("read 'g'");
    expect_bytes(fd, "g");
    STEP("write 100 bytes");
    write_all(fd, b, sizeof b);
    expect_eof(fd);
    close(fd);
}

static int ep_wait(int ep, int ms, struct epoll_event *ev)
{
    int n;
    do
        n = epoll_wait(ep, ev, 4, ms);
    while (n < 0 && errno == EINTR);
    CHECK(n >= 0, "epoll_wait: %s", errname(errno));
    return n;
}

static void c_epoll_lt(int fd)
{
    uint8_t b[100];
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = fd}, out[4];
    int ep = epoll_create1(EPOLL_CLOEXEC);
    CHECK(ep >= 0 && epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) == 0, "epoll: %s", errname(errno));
    STEP("nothing reported before the peer writes (100 ms)");
    CHECK(ep_wait(ep, 100, out) == 0, "epoll reported an event before any data");
    STEP("write 'g'; EPOLLIN for the 100 bytes");
    write_all(fd, "g", 1);
    int n = ep_wait(ep, WAIT_MS, out);
    CHECK(n == 1 && (out[0].events & EPOLLIN) && out[0].data.fd == fd,
          "epoll_wait returned %d (events 0x%x)", n, n > 0 ? out[0].events : 0);
    sleep_ms(50);
    STEP("read 10 bytes; level-triggered: reported again");
    ssize_t r = read(fd, b, 10);
    CHECK(r == 10, "read(10) returned %zd (%s)", r, r < 0 ? errname(errno) : "-");
    n = ep_wait(ep, 0, out);
    CHECK(n == 1 && (out[0].events & EPOLLIN), "90 bytes remain but epoll_wait returned %d", n);
    STEP("read the other 90; nothing reported (100 ms)");
    read_exact(fd, b + 10, 90);
    n = ep_wait(ep, 100, out);
    CHECK(n == 0, "drained socket still reported (events 0x%x)", n > 0 ? out[0].events : 0);
    long bad = mismatch(b, sizeof b, 0);
    CHECK(bad < 0, "byte %ld differs", bad);
    close(ep);
    close(fd);
}

/* epoll, edge-triggered: one edge per burst; the reader drains until EAGAIN. */
#define ET_BURST 5000
#define ET_BURSTS 3
static void s_bursts(int fd)
{
    uint8_t b[ET_BURST];
    STEP("read 'g'");
    expect_bytes(fd, "g");
    STEP("write 3 bursts of 5000 bytes, 150 ms apart");
    for (int i = 0; i < ET_BURSTS; i++) {
        fill(b, sizeof b, (size_t)i * ET_BURST);
        write_all(fd, b, sizeof b);
        sleep_ms(150);
    }
    expect_eof(fd);
    close(fd);
}

static void c_epoll_et(int fd)
{
    static uint8_t all[ET_BURST * ET_BURSTS + 4096];
    size_t total = 0;
    int edges = 0;
    struct epoll_event ev = {.events = EPOLLIN | EPOLLET, .data.fd = fd}, out[4];
    set_nonblock(fd, 1);
    int ep = epoll_create1(EPOLL_CLOEXEC);
    CHECK(ep >= 0 && epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) == 0, "epoll: %s", errname(errno));
    STEP("write 'g'");
    write_all(fd, "g", 1);
    while (total < ET_BURST * ET_BURSTS) {
        STEP("wait for an edge");
        int n = ep_wait(ep, WAIT_MS, out);
        CHECK(n == 1 && (out[0].events & EPOLLIN), "no EPOLLIN edge within %d ms with %zu of "
              "%d bytes read (%d edges so far)", WAIT_MS, total, ET_BURST * ET_BURSTS, edges);
        edges++;
        STEP("drain until EAGAIN");
        for (;;) {
            ssize_t r = read(fd, all + total, 1024);
            if (r < 0 && errno == EAGAIN)
                break;
            CHECK(r > 0, "read returned %zd (%s) while draining", r, r < 0 ? errname(errno)
                  : "EOF");
            total += (size_t)r;
            CHECK(total <= ET_BURST * ET_BURSTS, "read more bytes than were sent");
        }
    }
    STEP("no edge once drained (200 ms)");
    int n = ep_wait(ep, 200, out);
    CHECK(n == 0, "an edge was reported after everything was read (events 0x%x)",
          n > 0 ? out[0].events : 0);
    long bad = mismatch(all, total, 0);
    CHECK(bad < 0, "byte %ld differs", bad);
    note("%d edges", edges);
    close(ep);
    close(fd);
}

/* EPOLLONESHOT: disarmed after one event until EPOLL_CTL_MOD re-arms it. */
static void s_oneshot(int fd)
{
    STEP("read 'g'");
    expect_bytes(fd, "g");
    STEP("write 'a', then 'b' after 200 ms");
    write_all(fd, "a", 1);
    sleep_ms(200);
    write_all(fd, "b", 1);
    expect_eof(fd);
    close(fd);
}

static void c_epoll_oneshot(int fd)
{
    char c;
    struct epoll_event ev = {.events = EPOLLIN | EPOLLONESHOT, .data.fd = fd}, out[4];
    int ep = epoll_create1(EPOLL_CLOEXEC);
    CHECK(ep >= 0 && epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) == 0, "epoll: %s", errname(errno));
    STEP("write 'g'; one event for 'a'");
    write_all(fd, "g", 1);
    int n = ep_wait(ep, WAIT_MS, out);
    CHECK(n == 1 && (out[0].events & EPOLLIN), "epoll_wait returned %d", n);
    read_exact(fd, &c, 1);
    CHECK(c == 'a', "read '%c', expected 'a'", c);
    STEP("disarmed: no event for 'b' (600 ms)");
    n = ep_wait(ep, 600, out);
    CHECK(n == 0, "event reported while EPOLLONESHOT is disarmed");
    CHECK(wait_fd(fd, POLLIN, 0) & POLLIN, "'b' did not arrive within 600 ms (poll)");
    STEP("EPOLL_CTL_MOD re-arms: event for 'b'");
    CHECK(epoll_ctl(ep, EPOLL_CTL_MOD, fd, &ev) == 0, "EPOLL_CTL_MOD: %s", errname(errno));
    n = ep_wait(ep, WAIT_MS, out);
    CHECK(n == 1 && (out[0].events & EPOLLIN), "re-armed epoll_wait returned %d", n);
    read_exact(fd, &c, 1);
    CHECK(c == 'b', "read '%c', expected 'b'", c);
    close(ep);
    close(fd);
}

/* An epoll descriptor inside another one. */
static void s_nested(int fd)
{
    STEP("read 'g'");
    expect_bytes(fd, "g");
    STEP("write 'nested' after 200 ms");
    sleep_ms(200);
    write_all(fd, "nested", 6);
    expect_eof(fd);
    close(fd);
}

static void c_epoll_nested(int fd)
{
    char b[8];
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = fd}, out[4];
    int inner = epoll_create1(EPOLL_CLOEXEC), outer = epoll_create1(EPOLL_CLOEXEC);
    CHECK(inner >= 0 && outer >= 0, "epoll_create1: %s", errname(errno));
    CHECK(epoll_ctl(inner, EPOLL_CTL_ADD, fd, &ev) == 0, "add socket: %s", errname(errno));
    struct epoll_event oev = {.events = EPOLLIN, .data.u64 = 0xfeed};
    CHECK(epoll_ctl(outer, EPOLL_CTL_ADD, inner, &oev) == 0, "add inner: %s", errname(errno));
    STEP("write 'g'; outer reports nothing yet (50 ms)");
    write_all(fd, "g", 1);
    CHECK(ep_wait(outer, 50, out) == 0, "outer epoll reported an event before any data");
    STEP("outer reports the inner epoll");
    int n = ep_wait(outer, WAIT_MS, out);
    CHECK(n == 1 && out[0].data.u64 == 0xfeed, "outer epoll_wait returned %d", n);
    STEP("inner reports the socket");
    n = ep_wait(inner, 0, out);
    CHECK(n == 1 && out[0].data.fd == fd && (out[0].events & EPOLLIN),
          "inner epoll_wait returned %d", n);
    read_exact(fd, b, 6);
    CHECK(memcmp(b, "nested", 6) == 0, "read '%.6s', expected 'nested'", b);
    STEP("both quiet once drained (100 ms)");
    CHECK(ep_wait(outer, 100, out) == 0, "outer epoll still reports an event");
    close(outer);
    close(inner);
    close(fd);
}

/* shutdown(SHUT_WR): the peer reads the end of stream, then still answers. */
#define BULK_N (12u << 20)
static void s_half_close(int fd, size_t reply_bytes)
{
    STEP("read the request until end of stream");
    size_t n;
    uint8_t *req = read_to_eof(fd, &n);
    CHECK(n == 7 && memcmp(req, "request", 7) == 0, "read %zu bytes '%.*s' before end of stream, "
          "expected 'request'", n, (int)(n < 64 ? n : 64), req);
    free(req);
    STEP("answer after the end of stream");
    if (reply_bytes == 0) {
        write_all(fd, "response:request", 16);
    } else {
        static uint8_t b[1 << 16];
        for (size_t off = 0; off < reply_bytes; off += sizeof b) {
            fill(b, sizeof b, off);
            write_all(fd, b, sizeof b);
        }
        note("wrote %zu bytes after the end of stream", reply_bytes);
    }
    close(fd);
}

static void c_half_close(int fd, size_t reply_bytes)
{
    STEP("write 'request', shutdown(SHUT_WR)");
    write_all(fd, "request", 7);
    CHECK(shutdown(fd, SHUT_WR) == 0, "shutdown: %s", errname(errno));
    STEP("read the answer until end of stream");
    size_t n;
    uint8_t *got = read_to_eof(fd, &n);
    if (reply_bytes == 0) {
        CHECK(n == 16 && memcmp(got, "response:request", 16) == 0,
              "read %zu bytes '%.*s', expected 'response:request'", n, (int)(n < 64 ? n : 64),
              got);
    } else {
        CHECK(n == reply_bytes, "read %zu bytes, expected %zu", n, reply_bytes);
        long bad = mismatch(got, n, 0);
        CHECK(bad < 0, "byte %ld differs", bad);
    }
    free(got);
    STEP("write after shutdown(SHUT_WR): EPIPE");
    ssize_t r = write(fd, "x", 1);
    CHECK(r == -1 && errno == EPIPE, "write returned %zd (%s), expected -1 EPIPE", r,
          r < 0 ? errname(errno) : "written");
    close(fd);
}

static void s_shutdown_wr(int fd) { s_half_close(fd, 0); }
static void c_shutdown_wr(int fd) { c_half_close(fd, 0); }
static void s_shutdown_wr_bulk(int fd) { s_half_close(fd, BULK_N); }
static void c_shutdown_wr_bulk(int fd) { c_half_close(fd, BULK_N); }

/* The writer closes while the reader has not read yet: every byte, then end of stream. */
#define UNREAD_N (3u << 20)
static void s_close_before_peer_reads(int fd)
{
    STEP("write 3 MiB and close at once");
    uint8_t *b = malloc(UNREAD_N);
    fill(b, UNREAD_N, 0);
    write_all(fd, b, UNREAD_N);
    close(fd);
    free(b);
    STEP("stay alive after the close");
    sleep_ms(1500);
}

static void c_close_before_peer_reads(int fd)
{
    STEP("wait 400 ms, then read everything");
    sleep_ms(400);
    size_t n;
    uint8_t *got = read_to_eof(fd, &n);
    CHECK(n == UNREAD_N, "read %zu bytes before end of stream, expected %u", n, UNREAD_N);
    long bad = mismatch(got, n, 0);
    CHECK(bad < 0, "byte %ld differs", bad);
    free(got);
    close(fd);
}

/* The writer half-closes with bytes still on their way and ends at once with _exit (no
 * destructors run): the reader, slow, still gets every byte and then the end of stream.
 * Under the layer the writer's socket holds acknowledgements it never read; closed as they
 * are, it would reset the link and lose the tail that was still queued. */
#define EXIT_FIRST (1u << 20)
#define EXIT_REST (32u << 20)
static void s_exit_after_shutdown_wr(int fd)
{
    uint8_t *b = malloc(EXIT_FIRST + EXIT_REST);
    fill(b, EXIT_FIRST + EXIT_REST, 0);
    STEP("write 1 MiB, let the reader take it");
    write_all(fd, b, EXIT_FIRST);
    sleep_ms(300);
    STEP("write 32 MiB more, shutdown(SHUT_WR), _exit(0)");
    write_all(fd, b + EXIT_FIRST, EXIT_REST);
    CHECK(shutdown(fd, SHUT_WR) == 0, "shutdown: %s", errname(errno));
    STEP("done");
    emit(1, NULL);
    fflush(NULL);
    _exit(0);
}

static void c_exit_after_shutdown_wr(int fd)
{
    STEP("read the first 1 MiB at once");
    uint8_t *got = malloc(EXIT_FIRST);
    read_exact(fd, got, EXIT_FIRST);
    long bad = mismatch(got, EXIT_FIRST, 0);
    CHECK(bad < 0, "byte %ld differs", bad);
    free(got);
    STEP("wait 1 s (the writer exits meanwhile), then read to the end of stream");
    sleep_ms(1000);
    size_t n;
    got = read_to_eof(fd, &n);
    CHECK(n == EXIT_REST, "read %zu more bytes before end of stream, expected %u", n, EXIT_REST);
    bad = mismatch(got, n, EXIT_FIRST);
    CHECK(bad < 0, "byte %ld differs", bad);
    free(got);
    close(fd);
}

/* Closing with unread received bytes: native TCP resets the connection. */
static void s_close_with_unread(int fd)
{
    STEP("wait for the peer's 1000 bytes, close without reading them");
    CHECK(wait_fd(fd, POLLIN, WAIT_MS) & POLLIN, "no data within %d ms", WAIT_MS);
    sleep_ms(100);
    close(fd);
    STEP("stay alive after the close");
    sleep_ms(1500);
}

static void c_close_with_unread(int fd)
{
    uint8_t b[1000];
    fill(b, sizeof b, 0);
    STEP("write 1000 bytes the peer never reads");
    write_all(fd, b, sizeof b);
    sleep_ms(600);
    STEP("read after the peer closed with those bytes unread");
    ssize_t r = read(fd, b, sizeof b);
    CHECK(r == -1 && errno == ECONNRESET, "read returned %zd (%s); native TCP gives -1 "
          "ECONNRESET (a socket closed with unread data sends a reset)", r,
          r < 0 ? errname(errno) : (r == 0 ? "end of stream" : "data"));
    close(fd);
}

/* dup family: write through the copy, read through the original; close the original and
 * keep using the copy. The server echoes. */
static void dup_exchange(int fd, int copy, const char *how)
{
    char b[16];
    STEP("write via the copy, read via the original");
    write_all(copy, "via-copy", 8);
    read_exact(fd, b, 8);
    CHECK(memcmp(b, "via-copy", 8) == 0, "%s: read '%.8s', expected 'via-copy'", how, b);
    STEP("write via the original, read via the copy");
    write_all(fd, "via-orig", 8);
    read_exact(copy, b, 8);
    CHECK(memcmp(b, "via-orig", 8) == 0, "%s: read '%.8s', expected 'via-orig'", how, b);
    STEP("close the original, keep using the copy");
    CHECK(close(fd) == 0, "close: %s", errname(errno));
    write_all(copy, "after-close", 11);
    read_exact(copy, b, 11);
    CHECK(memcmp(b, "after-close", 11) == 0, "%s: read '%.11s', expected 'after-close'", how,
          b);
    STEP("256 KiB round trip through the copy");
    static uint8_t big[256 << 10], back[256 << 10];
    fill(big, sizeof big, 7);
    write_all(copy, big, sizeof big);
    read_exact(copy, back, sizeof back);
    CHECK(memcmp(big, back, sizeof big) == 0, "%s: the echo differs", how);
    close(copy);
}

static void c_dup(int fd)
{
    STEP("dup");
    int c = dup(fd);
    CHECK(c >= 0, "dup: %s", errname(errno));
    dup_exchange(fd, c, "dup");
}

static void c_dup2(int fd)
{
    STEP("dup2 onto an open descriptor (/dev/null)");
    int nul = open("/dev/null", O_RDONLY);
    CHECK(nul >= 0, "open: %s", errname(errno));
    int c = dup2(fd, nul);
    CHECK(c == nul, "dup2 returned %d (%s)", c, c < 0 ? errname(errno) : "-");
    dup_exchange(fd, c, "dup2");
}

static void c_dup3(int fd)
{
    STEP("dup3 onto 200 with O_CLOEXEC");
    int c = dup3(fd, 200, O_CLOEXEC);
    CHECK(c == 200, "dup3 returned %d (%s)", c, c < 0 ? errname(errno) : "-");
    CHECK(fcntl(c, F_GETFD) & FD_CLOEXEC, "FD_CLOEXEC not set on the dup3 copy");
    dup_exchange(fd, c, "dup3");
}

static void c_fcntl_dupfd(int fd)
{
    char b[8];
    STEP("fcntl(F_DUPFD_CLOEXEC, 310)");
    int c2 = fcntl(fd, F_DUPFD_CLOEXEC, 310);
    CHECK(c2 >= 310, "F_DUPFD_CLOEXEC returned %d (%s)", c2, c2 < 0 ? errname(errno) : "-");
    CHECK(fcntl(c2, F_GETFD) & FD_CLOEXEC, "FD_CLOEXEC not set on the F_DUPFD_CLOEXEC copy");
    write_all(c2, "cloexec", 7);
    read_exact(fd, b, 7);
    CHECK(memcmp(b, "cloexec", 7) == 0, "read '%.7s', expected 'cloexec'", b);
    close(c2);
    STEP("fcntl(F_DUPFD, 300)");
    int c = fcntl(fd, F_DUPFD, 300);
    CHECK(c >= 300, "F_DUPFD returned %d (%s)", c, c < 0 ? errname(errno) : "-");
    dup_exchange(fd, c, "F_DUPFD");
}

/* readv / writev and sendmsg / recvmsg with several buffers. */
#define BIG_V (3 * 120000)

static size_t scatter_read(int fd, int use_msg, const size_t *sizes, int k, uint8_t *out,
                           size_t total, int *calls)
{
    struct iovec iov[8];
    uint8_t *bufs[8];
    for (int i = 0; i < k; i++) {
        bufs[i] = malloc(sizes[i]);
        iov[i].iov_base = bufs[i];
        iov[i].iov_len = sizes[i];
    }
    size_t got = 0;
    *calls = 0;
    while (got < total) {
        for (int i = 0; i < k; i++)
            memset(bufs[i], 0xEE, sizes[i]);
        ssize_t r;
        if (use_msg) {
            struct sockaddr_storage name;
            char ctl[64];
            struct msghdr m = {0};
            m.msg_name = &name;
            m.msg_namelen = sizeof name;
            m.msg_iov = iov;
            m.msg_iovlen = (size_t)k;
            m.msg_control = ctl;
            m.msg_controllen = sizeof ctl;
            r = recvmsg(fd, &m, 0);
            if (r > 0) {
                CHECK(m.msg_flags == 0, "recvmsg set msg_flags 0x%x", m.msg_flags);
                CHECK(m.msg_controllen == 0, "recvmsg returned %zu bytes of control data",
                      (size_t)m.msg_controllen);
            }
        } else {
            r = readv(fd, iov, k);
        }
        if (r < 0 && errno == EINTR)
            continue;
        CHECK(r > 0, "%s returned %zd (%s) after %zu of %zu bytes", use_msg ? "recvmsg" : "readv",
              r, r < 0 ? errname(errno) : "EOF", got, total);
        CHECK(got + (size_t)r <= total, "read more bytes than were sent");
        (*calls)++;
        /* The bytes fill the buffers in order. */
        size_t left = (size_t)r;
        for (int i = 0; i < k && left; i++) {
            size_t take = left < sizes[i] ? left : sizes[i];
            memcpy(out + got, bufs[i], take);
            got += take;
            left -= take;
        }
    }
    for (int i = 0; i < k; i++)
        free(bufs[i]);
    return got;
}

static void gather_write(int fd, int use_msg, uint8_t *data, const size_t *sizes, int k)
{
    struct iovec iov[8];
    size_t total = 0, off = 0;
    for (int i = 0; i < k; i++) {
        iov[i].iov_base = data + off;
        iov[i].iov_len = sizes[i];
        off += sizes[i];
    }
    total = off;
    ssize_t r;
    if (use_msg) {
        struct msghdr m = {0};
        m.msg_iov = iov;
        m.msg_iovlen = (size_t)k;
        r = sendmsg(fd, &m, MSG_NOSIGNAL);
    } else {
        r = writev(fd, iov, k);
    }
    CHECK(r == (ssize_t)total, "%s of %zu bytes in %d buffers returned %zd (%s)",
          use_msg ? "sendmsg" : "writev", total, k, r, r < 0 ? errname(errno) : "short");
}

static const char SMALL_V[] = "abc" "defgh";

static void small_message(uint8_t *m)
{
    memcpy(m, SMALL_V, 8);
    fill(m + 8, 1000, 0);
}

static void s_vectors(int fd, int use_msg)
{
    uint8_t small[1008], want[1008];
    uint8_t *big = malloc(BIG_V);
    int calls;
    small_message(want);
    STEP("scatter-read 1008 bytes into buffers of 2, 7, 2000");
    size_t s1[] = {2, 7, 2000};
    scatter_read(fd, use_msg, s1, 3, small, sizeof small, &calls);
    CHECK(memcmp(small, want, sizeof small) == 0, "the 1008 bytes differ");
    STEP("gather-write them back in buffers of 100, 8, 900");
    size_t s2[] = {100, 8, 900};
    gather_write(fd, use_msg, small, s2, 3);
    STEP("scatter-read 360000 bytes into buffers of 1000, 65536, 3");
    size_t s3[] = {1000, 65536, 3};
    scatter_read(fd, use_msg, s3, 3, big, BIG_V, &calls);
    long bad = mismatch(big, BIG_V, 99);
    CHECK(bad < 0, "byte %ld of 360000 differs", bad);
    STEP("gather-write them back in 3 buffers of 120000");
    size_t s4[] = {120000, 120000, 120000};
    gather_write(fd, use_msg, big, s4, 3);
    free(big);
    expect_eof(fd);
    close(fd);
}

static void c_vectors(int fd, int use_msg)
{
    uint8_t small[1008], back[1008];
    uint8_t *big = malloc(BIG_V), *bback = malloc(BIG_V);
    int calls;
    small_message(small);
    fill(big, BIG_V, 99);
    STEP("gather-write 3 + 0 + 5 + 1000 bytes");
    struct iovec iov[4] = {{small, 3}, {small + 3, 0}, {small + 3, 5}, {small + 8, 1000}};
    ssize_t r;
    if (use_msg) {
        struct msghdr m = {0};
        m.msg_iov = iov;
        m.msg_iovlen = 4;
        r = sendmsg(fd, &m, 0);
    } else {
        r = writev(fd, iov, 4);
    }
    CHECK(r == 1008, "%s returned %zd (%s), expected 1008", use_msg ? "sendmsg" : "writev", r,
          r < 0 ? errname(errno) : "short");
    STEP("scatter-read the echo into buffers of 10, 10, 5000");
    size_t s1[] = {10, 10, 5000};
    scatter_read(fd, use_msg, s1, 3, back, sizeof back, &calls);
    CHECK(memcmp(small, back, sizeof back) == 0, "the echoed 1008 bytes differ");
    STEP("gather-write 360000 bytes in buffers of 100000, 200000, 60000");
    size_t s2[] = {100000, 200000, 60000};
    gather_write(fd, use_msg, big, s2, 3);
    STEP("scatter-read the echo into buffers of 4096, 4096, 70000");
    size_t s3[] = {4096, 4096, 70000};
    scatter_read(fd, use_msg, s3, 3, bback, BIG_V, &calls);
    long bad = mismatch(bback, BIG_V, 99);
    CHECK(bad < 0, "byte %ld of the echoed 360000 differs", bad);
    note("%d read calls for the 360000-byte echo", calls);
    free(big);
    free(bback);
    close(fd);
}

static void s_readv_writev(int fd) { s_vectors(fd, 0); }
static void c_readv_writev(int fd) { c_vectors(fd, 0); }
static void s_sendmsg_recvmsg(int fd) { s_vectors(fd, 1); }
static void c_sendmsg_recvmsg(int fd) { c_vectors(fd, 1); }

/* sendfile with an explicit offset (file position untouched) and without (file position
 * moves), and past the end of the file. */
#define SF_FILE 300000
#define SF_TOTAL (100000 + 50000 + 1000)

static void s_sendfile(int fd)
{
    uint8_t *got = malloc(SF_TOTAL), *file = malloc(SF_FILE);
    fill(file, SF_FILE, 5);
    STEP("read 151000 bytes");
    read_exact(fd, got, SF_TOTAL);
    CHECK(memcmp(got, file + 1000, 100000) == 0, "bytes 0..100000 are not file[1000..101000]");
    CHECK(memcmp(got + 100000, file + 5000, 50000) == 0,
          "bytes 100000..150000 are not file[5000..55000]");
    CHECK(memcmp(got + 150000, file + 299000, 1000) == 0,
          "bytes 150000..151000 are not file[299000..300000]");
    STEP("write 'OK'");
    write_all(fd, "OK", 2);
    free(got);
    free(file);
    expect_eof(fd);
    close(fd);
}

static size_t sendfile_all(int out, int in, off_t *off, size_t count)
{
    size_t done = 0;
    while (done < count) {
        ssize_t r = sendfile(out, in, off, count - done);
        if (r < 0 && errno == EINTR)
            continue;
        CHECK(r >= 0, "sendfile returned -1 (%s) after %zu of %zu bytes", errname(errno), done,
              count);
        if (r == 0)
            break;
        done += (size_t)r;
    }
    return done;
}

static void c_sendfile(int fd)
{
    char path[] = "/tmp/vmi-sendfile-XXXXXX";
    STEP("write a 300000-byte temporary file");
    int f = mkstemp(path);
    CHECK(f >= 0, "mkstemp: %s", errname(errno));
    unlink(path);
    uint8_t *file = malloc(SF_FILE);
    fill(file, SF_FILE, 5);
    CHECK(write(f, file, SF_FILE) == SF_FILE, "writing the file: %s", errname(errno));
    CHECK(lseek(f, 0, SEEK_SET) == 0, "lseek: %s", errname(errno));
    STEP("sendfile 100000 bytes from offset 1000 (explicit offset)");
    off_t off = 1000;
    size_t n = sendfile_all(fd, f, &off, 100000);
    CHECK(n == 100000, "sent %zu bytes, expected 100000", n);
    CHECK(off == 101000, "offset is %lld after sending, expected 101000", (long long)off);
    off_t pos = lseek(f, 0, SEEK_CUR);
    CHECK(pos == 0, "file position moved to %lld by sendfile with an explicit offset",
          (long long)pos);
    STEP("sendfile 50000 bytes from the file position 5000 (NULL offset)");
    CHECK(lseek(f, 5000, SEEK_SET) == 5000, "lseek: %s", errname(errno));
    n = sendfile_all(fd, f, NULL, 50000);
    CHECK(n == 50000, "sent %zu bytes, expected 50000", n);
    pos = lseek(f, 0, SEEK_CUR);
    CHECK(pos == 55000, "file position is %lld, expected 55000", (long long)pos);
    STEP("sendfile 5000 bytes from offset 299000 (1000 left in the file)");
    off = 299000;
    ssize_t r = sendfile(fd, f, &off, 5000);
    CHECK(r == 1000, "sendfile returned %zd (%s), expected 1000", r,
          r < 0 ? errname(errno) : "-");
    CHECK(off == SF_FILE, "offset is %lld, expected %d", (long long)off, SF_FILE);
    r = sendfile(fd, f, &off, 5000);
    CHECK(r == 0, "sendfile at the end of the file returned %zd, expected 0", r);
    STEP("read 'OK'");
    expect_bytes(fd, "OK");
    free(file);
    close(f);
    close(fd);
}

/* getsockname / getpeername agree with what the peer sees. */
static void exchange_names(int fd, int first)
{
    char mine[160], theirs[256];
    int n = snprintf(mine, sizeof mine, "%s %s", g_local, g_peer);
    uint8_t len = (uint8_t)n;
    if (first) {
        STEP("send my names");
        write_all(fd, &len, 1);
        write_all(fd, mine, len);
    }
    STEP("read the peer's names");
    read_exact(fd, &len, 1);
    read_exact(fd, theirs, len);
    theirs[len] = 0;
    if (!first) {
        STEP("send my names");
        len = (uint8_t)n;
        write_all(fd, &len, 1);
        write_all(fd, mine, len);
    }
    char want[160];
    snprintf(want, sizeof want, "%s %s", g_peer, g_local);
    CHECK(strcmp(theirs, want) == 0, "the peer says it is '%s' (local peer), but here "
          "getpeername/getsockname give '%s'", theirs, want);
}

static void s_names(int fd)
{
    exchange_names(fd, 0);
    expect_eof(fd);
    close(fd);
}

static void c_names(int fd)
{
    exchange_names(fd, 1);
    close(fd);
}

/* Writing to a connection the peer closed: EPIPE with SIGPIPE ignored, SIGPIPE otherwise. */
static void s_close_then_live(int fd)
{
    STEP("read 'bye', close, stay alive");
    expect_bytes(fd, "bye");
    close(fd);
    sleep_ms(2500);
}

static void wait_peer_close(int fd)
{
    char b[8];
    STEP("write 'bye'; read the peer's end of stream");
    write_all(fd, "bye", 3);
    ssize_t r = read(fd, b, sizeof b);
    CHECK(r == 0, "read returned %zd (%s), expected end of stream", r,
          r < 0 ? errname(errno) : "data");
}

/* Writes 100 bytes every 20 ms for up to 2 s; returns the number of writes that succeeded
 * before the first failure (errno is then set), or -1 if none failed. */
static int write_until_error(int fd)
{
    char b[100];
    memset(b, 'w', sizeof b);
    for (int i = 0; i < 100; i++) {
        ssize_t r = write(fd, b, sizeof b);
        if (r < 0)
            return i;
        sleep_ms(20);
    }
    return -1;
}

static void c_epipe(int fd)
{
    wait_peer_close(fd);
    STEP("write until an error (SIGPIPE ignored)");
    int ok = write_until_error(fd);
    CHECK(ok >= 0, "100 writes over 2 s after the peer closed all succeeded; native TCP fails "
          "the second one with EPIPE (the peer's kernel resets the connection)");
    CHECK(errno == EPIPE, "write failed with %s after %d successful writes, expected EPIPE",
          errname(errno), ok);
    note("EPIPE after %d successful write(s)", ok);
    close(fd);
}

/* The server closes at once, having sent and read nothing (a port check, a refused client):
 * the client reads the end of stream, and its writes then fail as native TCP's do. */
static void s_close_at_once(int fd)
{
    STEP("close at once, stay alive");
    close(fd);
    sleep_ms(2500);
}

static void c_close_at_once(int fd)
{
    char b[8];
    STEP("read the peer's end of stream");
    ssize_t r = read(fd, b, sizeof b);
    CHECK(r == 0, "read returned %zd (%s), expected end of stream", r,
          r < 0 ? errname(errno) : "data");
    STEP("write until an error (SIGPIPE ignored)");
    int ok = write_until_error(fd);
    CHECK(ok >= 0, "100 writes over 2 s after the peer closed all succeeded; native TCP fails "
          "the second one with EPIPE");
    CHECK(errno == EPIPE, "write failed with %s after %d successful writes, expected EPIPE",
          errname(errno), ok);
    close(fd);
}

/* The server sends a message and closes with SO_LINGER 0 (an abortive close: a RST): the
 * client reads the message, then ECONNRESET once, then the end of stream. */
static void s_linger_zero(int fd)
{
    STEP("send 11 bytes, close with SO_LINGER 0");
    write_all(fd, "hello-reset", 11);
    struct linger l = {1, 0};
    CHECK(setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l) == 0, "setsockopt: %s",
          errname(errno));
    close(fd);
    STEP("stay alive after the close");
    sleep_ms(1500);
}

static void c_linger_zero(int fd)
{
    char b[32];
    sleep_ms(300);
    STEP("read what the peer sent before its reset");
    read_exact(fd, b, 11);
    CHECK(memcmp(b, "hello-reset", 11) == 0, "read '%.11s', expected 'hello-reset'", b);
    STEP("read the reset");
    ssize_t r = read(fd, b, sizeof b);
    CHECK(r == -1 && errno == ECONNRESET, "read returned %zd (%s); native TCP gives -1 "
          "ECONNRESET after a peer's close with SO_LINGER 0", r,
          r < 0 ? errname(errno) : (r == 0 ? "end of stream" : "data"));
    STEP("read after the reset");
    r = read(fd, b, sizeof b);
    CHECK(r == 0, "read returned %zd (%s), expected the end of stream after the reset", r,
          r < 0 ? errname(errno) : "data");
    close(fd);
}

/* The server never reads; the client, with SO_SNDTIMEO 0.2 s, writes until a write fails:
 * EAGAIN once the peer's buffers (and the layer's window) are full, well before the server
 * closes. */
static void s_sndtimeo(int fd)
{
    STEP("read nothing for 4 s, then close");
    sleep_ms(4000);
    close(fd);
}

static void c_sndtimeo(int fd)
{
    static char b[65536];
    memset(b, 's', sizeof b);
    struct timeval tv = {0, 200000};
    STEP("set SO_SNDTIMEO 0.2 s");
    CHECK(setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) == 0, "setsockopt: %s",
          errname(errno));
    STEP("write 64 KiB at a time until a write fails");
    long long t0 = now_ms();
    ssize_t r;
    while ((r = write(fd, b, sizeof b)) > 0 && now_ms() - t0 < 3000)
        ;
    CHECK(r < 0, "writes went on for 3 s into a peer that reads nothing");
    CHECK(errno == EAGAIN, "write failed with %s, expected EAGAIN (the send time-out)",
          errname(errno));
    note("EAGAIN after %lld ms", now_ms() - t0);
    close(fd);
}

static void c_sigpipe(int fd)
{
    wait_peer_close(fd);
    STEP("in a child with SIGPIPE at its default: write until killed");
    pid_t pid = fork();
    CHECK(pid >= 0, "fork: %s", errname(errno));
    if (pid == 0) {
        signal(SIGPIPE, SIG_DFL);
        signal(SIGALRM, SIG_DFL);
        int ok = write_until_error(fd);
        _exit(ok < 0 ? 100 : 101);
    }
    int st;
    CHECK(waitpid(pid, &st, 0) == pid, "waitpid: %s", errname(errno));
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGPIPE,
          "the child %s; expected it to die of SIGPIPE", WIFSIGNALED(st)
          ? strsignal(WTERMSIG(st)) : WEXITSTATUS(st) == 100
          ? "wrote for 2 s after the peer closed without any error"
          : "got a write error without being killed by SIGPIPE");
    close(fd);
}

/* ------------------------------------------------------------------------------------------ */

struct scenario {
    const char *name;
    void (*server)(int);
    void (*client)(int);
    int nb_connect;
};

static const struct scenario SCENARIOS[] = {
    {"peek", s_peek, c_peek, 0},
    {"peek_two_writes", s_peek_two_writes, c_peek_two_writes, 0},
    {"waitall", s_waitall, c_waitall, 0},
    {"dontwait", s_dontwait, c_dontwait, 0},
    {"nb_connect", s_nb_connect, c_nb_connect, 1},
    {"nonblock_fcntl", s_late_data, c_nonblock_fcntl, 0},
    {"nonblock_fionbio", s_late_data, c_nonblock_fionbio, 0},
    {"fionread", s_fionread, c_fionread, 0},
    {"poll", s_reply, c_poll, 0},
    {"select", s_reply, c_select, 0},
    {"epoll_lt", s_hundred, c_epoll_lt, 0},
    {"epoll_et", s_bursts, c_epoll_et, 0},
    {"epoll_oneshot", s_oneshot, c_epoll_oneshot, 0},
    {"epoll_nested", s_nested, c_epoll_nested, 0},
    {"shutdown_wr", s_shutdown_wr, c_shutdown_wr, 0},
    {"shutdown_wr_bulk", s_shutdown_wr_bulk, c_shutdown_wr_bulk, 0},
    {"close_before_peer_reads", s_close_before_peer_reads, c_close_before_peer_reads, 0},
    {"close_with_unread", s_close_with_unread, c_close_with_unread, 0},
    {"exit_after_shutdown_wr", s_exit_after_shutdown_wr, c_exit_after_shutdown_wr, 0},
    {"dup", serve_echo, c_dup, 0},
    {"dup2", serve_echo, c_dup2, 0},
    {"dup3", serve_echo, c_dup3, 0},
    {"fcntl_dupfd", serve_echo, c_fcntl_dupfd, 0},
    {"readv_writev", s_readv_writev, c_readv_writev, 0},
    {"sendmsg_recvmsg", s_sendmsg_recvmsg, c_sendmsg_recvmsg, 0},
    {"sendfile", s_sendfile, c_sendfile, 0},
    {"names", s_names, c_names, 0},
    {"epipe", s_close_then_live, c_epipe, 0},
    {"sigpipe", s_close_then_live, c_sigpipe, 0},
    {"close_at_once", s_close_at_once, c_close_at_once, 0},
    {"linger_zero", s_linger_zero, c_linger_zero, 0},
    {"sndtimeo", s_sndtimeo, c_sndtimeo, 0},
};

static void parse_addr(const char *text, struct sockaddr_in *a)
{
    char ip[64];
    const char *colon = strrchr(text, ':');
    CHECK(colon && (size_t)(colon - text) < sizeof ip, "bad address '%s' (want IP:PORT)", text);
    memcpy(ip, text, (size_t)(colon - text));
    ip[colon - text] = 0;
    memset(a, 0, sizeof *a);
    a->sin_family = AF_INET;
    a->sin_port = htons((uint16_t)atoi(colon + 1));
    CHECK(inet_pton(AF_INET, ip, &a->sin_addr) == 1, "bad IPv4 address '%s'", ip);
}

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "list") == 0) {
        for (size_t i = 0; i < sizeof SCENARIOS / sizeof *SCENARIOS; i++)
            printf("%s\n", SCENARIOS[i].name);
        return 0;
    }
    if (argc < 4 || (strcmp(argv[1], "server") && strcmp(argv[1], "client"))) {
        fprintf(stderr, "usage: %s server|client SCENARIO IP:PORT [HOLD_MS] | list\n", argv[0]);
        return 64;
    }
    g_role = argv[1];
    g_scen = argv[2];
    g_hold_ms = argc > 4 ? atoi(argv[4]) : 0;
    signal(SIGPIPE, SIG_IGN);
    signal(SIGALRM, on_alarm);
    alarm(TIMEOUT_S);

    const struct scenario *sc = NULL;
    for (size_t i = 0; i < sizeof SCENARIOS / sizeof *SCENARIOS; i++)
        if (strcmp(SCENARIOS[i].name, g_scen) == 0)
            sc = &SCENARIOS[i];
    CHECK(sc, "unknown scenario '%s'", g_scen);
    struct sockaddr_in addr;
    parse_addr(argv[3], &addr);

    int fd;
    if (strcmp(g_role, "server") == 0) {
        STEP("bind + listen");
        int ls = socket(AF_INET, SOCK_STREAM, 0);
        int one = 1;
        CHECK(ls >= 0, "socket: %s", errname(errno));
        setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        CHECK(bind(ls, (struct sockaddr *)&addr, sizeof addr) == 0, "bind %s: %s", argv[3],
              errname(errno));
        CHECK(listen(ls, 16) == 0, "listen: %s", errname(errno));
        STEP("accept");
        do
            fd = accept(ls, NULL, NULL);
        while (fd < 0 && errno == EINTR);
        CHECK(fd >= 0, "accept: %s", errname(errno));
        close(ls);
    } else if (sc->nb_connect) {
        fd = nb_connect(&addr);
    } else {
        STEP("connect");
        fd = socket(AF_INET, SOCK_STREAM, 0);
        CHECK(fd >= 0, "socket: %s", errname(errno));
        CHECK(connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0, "connect %s: %s", argv[3],
              errname(errno));
    }
    record_names(fd);
    STEP("hold");
    sleep_ms(g_hold_ms);
    if (strcmp(g_role, "server") == 0)
        sc->server(fd);
    else
        sc->client(fd);
    STEP("done");
    emit(1, NULL);
    return 0;
}
