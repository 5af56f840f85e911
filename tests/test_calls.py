"""System calls the layer adds to a program's own: none for the patterns MPI progress engines
use (issue: native speed for every program).

tests/programs/progress.py exchanges request/response messages as Open MPI's TCP transport
does: each message a `writev` of a header and a body, read back by busy polling with a zero
time-out and `readv` into a header and a body buffer until it is whole, non-blocking and
stopping at EAGAIN. The client runs under `strace -c -f` once natively and once under the
layer (both ends layered, the connection virtual), and its receive and send calls per
message must be the same within a small margin (an acknowledgement the layer sends alone now
and then). Buffer by buffer, a two-buffer `readv` of a small message cost the layer two
receive calls where the kernel takes one.
"""


import re

import pytest

from helpers import (BASELINE, H1, H1_IP, H2, PORTS, PYTHON, Watcher, assert_virtual,
                     python_prog, strace_counts)

MESSAGES = 2000
RECEIVE = ("read", "readv", "recvfrom", "recvmsg")
SEND = ("write", "writev", "sendto", "sendmsg")


def run(procs, tmp_path, layer, size=64, messages=MESSAGES):
    tag = "layer" if layer else "native"
    port = PORTS[f"progress_{tag}"]
    addr = f"{H1_IP}:{port}"
    procs.server(H1, python_prog("progress.py", "server", "--bind", addr), port, layer=layer,
                 name=f"progress-server-{tag}")
    trace = tmp_path / f"{tag}.strace"
    with Watcher(H1, H2) as w:
        cli = procs.run(H2, ["strace", "-c", "-f", "-o", trace,
                             *python_prog("progress.py", "client", "--connect", addr,
                                          "--messages", messages, "--size", size,
                                          "--hold", 1)],
                        layer=layer, name=f"progress-client-{tag}", timeout=120)
    r = cli.last_json()
    assert r["bad"] == 0 and r["messages"] == messages, r
    if layer:
        assert_virtual(w, H1, addr, H2, min_conns=1)
    c = strace_counts(trace)
    return sum(c.get(n, 0) for n in RECEIVE), sum(c.get(n, 0) for n in SEND), c


@pytest.mark.skipif(BASELINE, reason="compares the layer with the kernel alone")
def test_mpi_style_progress_adds_no_system_calls(procs, tmp_path):
    n_recv, n_send, native = run(procs, tmp_path, False)
    l_recv, l_send, layered = run(procs, tmp_path, True)
    detail = f"native {native}\nlayer {layered}"
    # The Python start-up reads files and writes nothing: its calls are the same both times.
    assert n_recv >= MESSAGES and n_send >= MESSAGES, detail
    slack = MESSAGES // 20
    assert l_recv <= n_recv + slack, f"receive calls: {l_recv} under the layer, {n_recv} natively\n{detail}"
    assert l_send <= n_send + slack, f"send calls: {l_send} under the layer, {n_send} natively\n{detail}"


@pytest.mark.skipif(BASELINE, reason="compares the layer with the kernel alone")
def test_large_requests_and_answers_add_no_send_calls(procs, tmp_path):
    """Messages of 512 KiB each way (an MPI rank's large messages; a quarter of the default
    2 MiB window): each one `writev` of its header and body, natively one call. Under the
    layer also one: the two buffers go as one frame, and the acknowledgements ride on the
    answers, none alone (the layer sends one alone only when five eighths of the peer's
    window wait for it). Before, such a message cost three: its header and its body a frame
    each, and an acknowledgement alone at each quarter window read."""
    size, messages = 512 << 10, 60
    n_recv, n_send, native = run(procs, tmp_path, False, size, messages)
    l_recv, l_send, layered = run(procs, tmp_path, True, size, messages)
    detail = f"native {native}\nlayer {layered}"
    assert n_send >= messages, detail
    # (The layer's own messages to its agent at set-up: a few sends, whatever the traffic.)
    assert l_send <= n_send + 10, f"send calls: {l_send} under the layer, {n_send} natively\n{detail}"


# Sends BYTES in writes of 128 KiB, then waits for the peer's end.
BULK_SEND = r"""
import socket, sys
ls = socket.create_server((sys.argv[1], int(sys.argv[2])))
c, _ = ls.accept()
b = bytes(128 << 10)
for _ in range(int(sys.argv[3]) // len(b)):
    c.sendall(b)
c.shutdown(socket.SHUT_WR)
while c.recv(65536):
    pass
"""

# Reads to the end (then holds the connection 0.6 s); every 4 MiB notes whether its socket is in the kernel's interactive
# ("pingpong") mode, where TCP_QUICKACK reads 0.
BULK_RECV = r"""
import json, socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
buf = bytearray(1 << 20)
got, mark, quick = 0, 4 << 20, []
while True:
    k = s.recv_into(buf)
    if not k:
        break
    got += k
    if got >= mark:
        mark += 4 << 20
        quick.append(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK))
time.sleep(0.6)  # (held open for vmictl to see)
print(json.dumps({"bytes": got, "quick": quick}), flush=True)
"""


def test_a_bulk_receivers_acknowledgements_leave_its_socket_out_of_interactive_mode(procs):
    """A receiver that only reads sends the layer's acknowledgements alone, and data going back
    makes the kernel take the connection for an interactive one: it then holds back its own
    ACKs of the sender's segments, hoping to carry them on a reply that never comes, and the
    sender waits on them (iperf3 with four streams: about half its rate). After each such
    acknowledgement the layer puts the socket back in quick-ACK mode; measured here as the
    kernel reports it, with TCP_QUICKACK read by the receiving program every 4 MiB."""
    port = PORTS["quick_acks"]
    addr = f"{H1_IP}:{port}"
    nbytes = 96 << 20
    procs.server(H1, [PYTHON, "-c", BULK_SEND, H1_IP, port, nbytes], port, layer=True,
                 name="bulk-send")
    with Watcher(H1, H2) as w:
        cli = procs.run(H2, [PYTHON, "-c", BULK_RECV, H1_IP, port], layer=True,
                        name="bulk-recv", timeout=120)
    r = cli.last_json()
    assert r["bytes"] == nbytes, r
    # (Without the layer's quick-ACK it is in interactive mode at every check; with it, the
    # kernel may still enter it now and then between two acknowledgements: 20 of 24 seen on
    # a loaded machine.)
    assert len(r["quick"]) >= 20 and sum(r["quick"]) >= 3 * len(r["quick"]) // 4, r
    assert_virtual(w, H1, addr, H2, min_conns=1)


LARGE = 300 << 10
FRAME_HEADER = 24


def client_sends(procs, tmp_path, port, size, messages, name, env=None):
    """Runs progress.py's client (`messages` of `size` bytes, each one `writev` of an 8-byte
    header and the body) under the layer against its server, checks the answers and that the
    connection was virtual, and returns the byte counts of the client's sending calls (from
    an `strace` of them) with a description for a failed assertion."""
    addr = f"{H1_IP}:{port}"
    procs.server(H1, python_prog("progress.py", "server", "--bind", addr), port, layer=True,
                 name=f"{name}-server")
    trace = tmp_path / "sends.strace"
    with Watcher(H1, H2) as w:
        cli = procs.run(H2, ["strace", "-f", "-e", "trace=sendto,sendmsg,writev,write",
                             "-e", "abbrev=all", "-o", trace,
                             *python_prog("progress.py", "client", "--connect", addr,
                                          "--messages", messages, "--size", size, "--hold", 1)],
                        layer=True, name=f"{name}-client", timeout=180, env=env)
    r = cli.last_json()
    assert r["bad"] == 0 and r["messages"] == messages, r
    assert_virtual(w, H1, addr, H2, min_conns=1)
    sent = []
    for line in trace.read_text().splitlines():
        m = re.search(r"\b(sendto|sendmsg|writev|write)\(.*\)\s*=\s*(\d+)\s*$", line)
        if m:
            sent.append(int(m.group(2)))
    return sent, f"{len(sent)} sends; sizes: {sorted(set(sent))[:20]}"


@pytest.mark.skipif(BASELINE, reason="counts the layer's frames")
def test_a_writev_of_a_header_and_a_large_body_goes_as_one_frame_in_one_call(procs, tmp_path):
    """Open MPI writes each message as one `writev` of its header and its body. The layer
    sends the buffers of such a call as one frame, gathered by the kernel from the program's
    own buffers (and copied once, into the replay ring): one system call, as natively. Before,
    a call of more than 256 KiB went buffer by buffer, a frame and a system call each (the
    8-byte header a frame of its own), and smaller ones were first copied into one buffer.
    Counted from an `strace` of the client's sends: every message one call that carries its
    frame whole, and no frame of a header alone."""
    messages = 40
    sent, detail = client_sends(procs, tmp_path, PORTS["gather_writev"], LARGE, messages, "gather")
    assert sum(1 for n in sent if n == 8 + LARGE + FRAME_HEADER) == messages, detail
    # (A header alone would be a frame of 8 payload bytes.)
    assert 8 + FRAME_HEADER not in sent, detail


MAX_PAYLOAD = 1 << 20


@pytest.mark.skipif(BASELINE, reason="counts the layer's frames")
def test_a_write_of_more_than_one_frame_goes_in_one_call(procs, tmp_path):
    """A frame carries at most 1 MiB, so a 1 MiB message and its 8-byte header (one `writev`,
    as Open MPI writes them) need two frames. Both go with one system call: before, the second,
    eight bytes, went with a call of its own after the first (and as a TCP segment of its own,
    a wake-up of the reader's progress loop per message). Counted from an `strace` of the
    client's sends: every message one call that carries both frames whole. (Copied frames:
    by default such a message, sent when every byte is acknowledged, goes from the replay
    ring by reference, its header and pages in calls of their own, the last of them marked
    for more so that the 8-byte frame joins its packet; see tests/test_splice.py.)"""
    messages = 12
    sent, detail = client_sends(procs, tmp_path, PORTS["two_frames"], MAX_PAYLOAD, messages,
                                "two-frames", env={"VMI_SPLICE": "0"})
    assert sum(1 for n in sent if n == 8 + MAX_PAYLOAD + 2 * FRAME_HEADER) == messages, detail
    # (The second frame alone: 8 payload bytes.)
    assert 8 + FRAME_HEADER not in sent, detail
