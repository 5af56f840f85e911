"""With `VMI_SPLICE=1`, large frames go to the kernel from the replay ring by reference
(`vmsplice` into a pipe, `splice` into the socket): the program's bytes are copied once, into
the ring, as a native send copies them once, into the kernel. By default (`auto`) only the
frames of large send calls that begin with every byte acknowledged go so (a message that
waits for its answer). What that must not break: the
stream itself; a peer that ends its sending side while spliced bytes sit unread in its socket
(ring space reused before its layer acknowledged them would be read as later bytes); a
sender that asked for no SIGPIPE, whose peer dies (`splice` has no MSG_NOSIGNAL)."""

import json
import time

from helpers import H1, H1_IP, H2, PORTS, PYTHON, Watcher, assert_virtual, strace_counts

# "send HOST PORT BYTES CHUNK": accepts one connection, sends BYTES random bytes in writes of
# CHUNK (every chunk different, so ring space reused too early shows), then ends its side and
# waits for the peer's end; prints the count and the SHA-256 of what it sent.
# "recv HOST PORT [HALF_AT SLEEP]": reads to the end and prints the count and the SHA-256;
# with HALF_AT, ends its own sending side after HALF_AT bytes and sleeps SLEEP seconds
# before reading on.
BULK = r"""
import hashlib, json, os, socket, sys, time
mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "send":
    n, chunk = int(sys.argv[4]), int(sys.argv[5])
    ls = socket.create_server((host, port))
    c, _ = ls.accept()
    h = hashlib.sha256()
    sent = 0
    while sent < n:
        b = os.urandom(min(chunk, n - sent))
        c.sendall(b)
        h.update(b)
        sent += len(b)
    c.shutdown(socket.SHUT_WR)
    while c.recv(65536):
        pass
    print(json.dumps({"bytes": sent, "sha": h.hexdigest()}), flush=True)
else:
    half = int(sys.argv[4]) if len(sys.argv) > 4 else -1
    pause = float(sys.argv[5]) if len(sys.argv) > 5 else 0
    s = socket.create_connection((host, port))
    h = hashlib.sha256()
    got = 0
    buf = bytearray(1 << 20)
    while True:
        want = len(buf) if half < 0 or got >= half else min(len(buf), half - got)
        k = s.recv_into(buf, want)
        if not k:
            break
        h.update(memoryview(buf)[:k])
        got += k
        if got == half:
            s.shutdown(socket.SHUT_WR)
            time.sleep(pause)
    print(json.dumps({"bytes": got, "sha": h.hexdigest()}), flush=True)
"""


# "serve HOST PORT ROUNDS SIZE": accepts one connection and sends back each message of SIZE
# bytes it receives, ROUNDS times, each in one send call. "ask HOST PORT ROUNDS SIZE": sends
# ROUNDS messages of SIZE random bytes, each in one call, reading each answer before the
# next; prints whether every answer was its message.
PINGPONG = r"""
import json, os, socket, sys
mode, host, port, rounds, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
def recv_all(s, n):
    buf, got = bytearray(n), 0
    while got < n:
        k = s.recv_into(memoryview(buf)[got:], n - got)
        if not k:
            break
        got += k
    return bytes(buf[:got])
if mode == "serve":
    ls = socket.create_server((host, port))
    c, _ = ls.accept()
    for _ in range(rounds):
        c.sendall(recv_all(c, size))
    c.close()
else:
    s = socket.create_connection((host, port))
    same = True
    for _ in range(rounds):
        m = os.urandom(size)
        s.sendall(m)
        same &= recv_all(s, size) == m
    print(json.dumps({"same": same, "rounds": rounds}), flush=True)
"""

# Every large frame spliced (by default only those of large calls that begin idle).
SPLICE = {"VMI_SPLICE": "1"}


def stream(procs, tmp_path, port, nbytes, chunk, *, env=None, half=None, splice=True):
    addr = f"{H1_IP}:{port}"
    env = {**(SPLICE if splice else {}), **(env or {})}
    trace = tmp_path / "sender.strace"
    srv = procs.start(H1, ["strace", "-c", "-f", "-o", trace, PYTHON, "-c", BULK, "send", H1_IP,
                           port, nbytes, chunk], layer=True, name="bulk-send", env=env)
    time.sleep(0.5)
    extra = [] if half is None else [half, 1.0]
    with Watcher(H1, H2) as w:
        cli = procs.run(H2, [PYTHON, "-c", BULK, "recv", H1_IP, port, *extra], layer=True,
                        name="bulk-recv", timeout=120)
        srv.wait(timeout=60)
    sent, got = srv.last_json(), cli.last_json()
    assert got == sent, f"sent {sent}, received {got}"
    assert sent["bytes"] == nbytes
    assert_virtual(w, H1, addr, H2, min_conns=1)
    return srv, strace_counts(trace)


def test_large_frames_are_spliced_from_the_ring_and_the_stream_is_whole(procs, tmp_path):
    """64 MiB in writes of 256 KiB: the sender's layer hands the kernel the ring's pages
    (vmsplice, splice) instead of the program's buffer, and every byte arrives in order."""
    _, c = stream(procs, tmp_path, PORTS["splice_stream"], 64 << 20, 256 << 10)
    assert c.get("vmsplice", 0) >= 64 and c.get("splice", 0) >= 64, c


def test_without_vmi_splice_large_frames_are_copied(procs, tmp_path):
    """Splicing every frame is slower on this kind of path for a stream (ARCHITECTURE.md):
    by default a stream of 256 KiB writes makes no `vmsplice` call, and with
    `VMI_SPLICE=0` neither does one of 1 MiB writes."""
    _, c = stream(procs, tmp_path, PORTS["splice_off"], 128 << 20, 256 << 10, splice=False)
    assert c.get("vmsplice", 0) == 0 and c.get("splice", 0) == 0, c
    _, c = stream(procs, tmp_path, PORTS["splice_off_big"], 64 << 20, 1 << 20, splice=False,
                  env={"VMI_SPLICE": "0"})
    assert c.get("vmsplice", 0) == 0 and c.get("splice", 0) == 0, c


def test_by_default_a_stream_of_large_writes_is_copied(procs, tmp_path):
    """By default (`auto`) a sender of 1 MiB writes that runs ahead of its receiver (each
    call begins with bytes unacknowledged) keeps the copy, cheaper for a stream here: only
    its first call, which begins with nothing unacknowledged, may go by reference (17
    `vmsplice` calls, in chunks that end at 64 KiB boundaries of memory; two calls would be
    34), not its 64."""
    _, c = stream(procs, tmp_path, PORTS["splice_auto_stream"], 64 << 20, 1 << 20, splice=False)
    assert c.get("vmsplice", 0) <= 24, c


def test_by_default_large_messages_that_wait_for_their_answer_go_by_reference(procs, tmp_path):
    """MPI's ping-pong of large messages, in small: 1 MiB messages, each sent in one call
    once the answer to the one before came back (every byte acknowledged), and echoed in one
    call by the server. By default both sides splice these calls' frames (the kernel's copy
    was on the critical path: NetPIPE at 1 MiB 1.2-1.4x faster), and every answer is its
    message."""
    port = PORTS["splice_auto_pingpong"]
    addr = f"{H1_IP}:{port}"
    trace = tmp_path / "server.strace"
    rounds, size = 24, 1 << 20
    srv = procs.start(H1, ["strace", "-c", "-f", "-o", trace, PYTHON, "-c", PINGPONG, "serve", H1_IP,
                           port, rounds, size], layer=True, name="pingpong-serve")
    time.sleep(0.5)
    with Watcher(H1, H2) as w:
        cli = procs.run(H2, [PYTHON, "-c", PINGPONG, "ask", H1_IP, port, rounds, size], layer=True,
                        name="pingpong-ask", timeout=120)
        srv.wait(timeout=60)
    r = cli.last_json()
    assert r["same"] and r["rounds"] == rounds, r
    assert_virtual(w, H1, addr, H2, min_conns=1)
    c = strace_counts(trace)
    # 16 chunks of 64 KiB per message; some answers may begin before the last
    # acknowledgement arrived.
    assert c.get("vmsplice", 0) >= rounds * 16 // 2, c


def test_a_peer_that_ends_its_side_gets_every_spliced_byte_right(procs, tmp_path):
    """The receiver ends its sending side after 2 MiB and sleeps a second, with spliced
    bytes unread in its socket (by reference to the sender's ring pages) and the sender's
    ring small (1 MiB: `VMI_WINDOW=256K`), so that ring space reused before the receiver's
    layer acknowledged it would be read as later bytes. Its end of stream must not count as
    an acknowledgement: its layer still acknowledges what the program reads."""
    _, c = stream(procs, tmp_path, PORTS["splice_half"], 48 << 20, 256 << 10,
                  env={"VMI_WINDOW": "256K"}, half=2 << 20)
    assert c.get("vmsplice", 0) > 0, c


DIES = r"""
import errno, json, signal, socket, sys, time
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
b = bytes(1 << 20)
sent, err = 0, None
t0 = time.monotonic()
while time.monotonic() - t0 < 30:
    try:
        sent += s.send(b, socket.MSG_NOSIGNAL)
    except OSError as e:
        err = errno.errorcode.get(e.errno, str(e.errno))
        break
print(json.dumps({"sent": sent, "error": err}), flush=True)
"""

SINK = r"""
import socket, sys, time
ls = socket.create_server((sys.argv[1], int(sys.argv[2])))
c, _ = ls.accept()
got = 0
while got < (8 << 20):
    got += len(c.recv(1 << 20))
print("reading no more", flush=True)
time.sleep(600)
"""


def test_a_sender_that_asked_for_no_sigpipe_gets_none_when_its_peer_dies(procs):
    """A program with SIGPIPE at its default action sends with MSG_NOSIGNAL to a peer that
    stops reading and is killed: it must see an error from `send`, as natively, and not die
    of a SIGPIPE raised by the layer's own `splice` into the dead socket."""
    port = PORTS["splice_sigpipe"]
    srv = procs.start(H1, [PYTHON, "-c", SINK, H1_IP, port], layer=True, name="sink")
    time.sleep(0.5)
    cli = procs.start(H2, [PYTHON, "-c", DIES, H1_IP, port], layer=True, name="dies", env=SPLICE)
    deadline = time.monotonic() + 30
    while "reading no more" not in srv.stdout() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "reading no more" in srv.stdout(), "the receiver never read 8 MiB"
    time.sleep(0.5)
    srv.popen.kill()
    cli.wait(timeout=60, check=False)
    assert cli.returncode == 0, f"the sender ended with {cli.returncode} (-13: SIGPIPE)"
    r = json.loads(cli.stdout().strip().splitlines()[-1])
    assert r["error"] in ("EPIPE", "ECONNRESET"), r
    assert r["sent"] >= 8 << 20, r
