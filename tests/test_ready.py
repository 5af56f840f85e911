"""Readable means readable: every readable report of `epoll_wait`, `poll` and `select` on a
virtual connection is followed by data or the end for `recv`, never EAGAIN, as on a native
socket (tests/programs/honest_ready.py). UCX's TCP transport under MPICH dereferences a
null pointer when a `recv` after a readable report says EAGAIN in the middle of a message.

Under the layer, the layer's own bytes arrive on the program's socket too: acknowledgements
sent alone to a program that only sends, the first frame of a rebuilt link, bells that wake
a writer waiting for room in a shared-memory ring. The client here only sends (64 MiB) while
the server only reads, so each of those would be a false report; the layer takes them off
the socket inside the wait and reports the descriptor readable only when it is.
"""

import time

import pytest

from helpers import (BASELINE, ETH0, H1, H1_IP, H2, PLACES, block_port, client_conns, python_prog,
                     vmictl, wait_status)

WAITS = ["epoll", "epoll-et", "epoll-oneshot", "poll", "select"]
CASES = [(where, w) for where in ("hosts", "shm") for w in WAITS]


def run(procs, where, wait, port, extra=(), server_args=(), watch=None):
    host, env, _, _ = PLACES[where]
    addr = f"{H1_IP}:{port}"
    srv = procs.server(H1, python_prog("honest_ready.py", "server", "--addr", addr, *server_args),
                       port, layer=True, name="ready-server", env=env)
    cli = procs.start(host, python_prog("honest_ready.py", "client", "--addr", addr, "--wait",
                                        wait, *extra),
                      layer=True, name=f"ready-client-{wait}", env=env)
    if watch:
        watch(host, addr)
    cli.wait(timeout=90)
    srv.wait(timeout=30)
    c = cli.last_json()
    assert c["answer_ok"] and c["sent"] > 0, (c, srv.json_lines())
    return c


@pytest.mark.parametrize("where,wait", CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_every_readable_report_is_true(procs, where, wait):
    """A program that only sends, waiting for room and readability with each primitive: no
    readable report without data. Over shared memory the reader is slow, so the ring fills
    and the writer is woken for room (a bell each time)."""
    port = block_port("ready", CASES.index((where, wait)))
    slow = ("--slow",) if where == "shm" else ()
    mib = ("--mib", "32") if where == "shm" else ()
    c = run(procs, where, wait, port, extra=mib, server_args=slow)
    assert c["spurious"] == 0, (f"{c['spurious']} of {c['readable_reports']} readable reports "
                                f"were followed by EAGAIN", c)


@pytest.mark.skipif(BASELINE, reason="links are rebuilt by the layer")
@pytest.mark.parametrize("where", ["hosts", "shm"])
def test_readable_reports_stay_true_across_a_relink(procs, faults, where):
    """The sender pauses after 8 MiB; meanwhile the link is rebuilt (across hosts: the
    client's eth0 goes down and the connection fails over to eth1; on one host: the operator
    moves it off shared memory and back). The rebuilt link's first frames are the layer's,
    and the sender, waiting with epoll again, gets no false readable report."""
    port = block_port("ready", len(CASES) + ["hosts", "shm"].index(where))

    def rebuilt(host, addr, before, substrate):
        return wait_status(host, lambda st: next(
            (x for x in client_conns(st, addr) if x.get("failovers", 0) > before
             and x.get("substrate") == substrate), None), 10,
            f"the connection rebuilt on {substrate}")

    def relink(host, addr):
        c = wait_status(host, lambda st: (client_conns(st, addr) or [None])[0], 20,
                        "the client's connection listed")
        if where == "hosts":
            faults.net_down(host, ETH0)
            rebuilt(host, addr, c.get("failovers", 0), "tcp")
            faults.net_up(host, ETH0)
            return
        for target in ("tcp", "shm"):
            r = vmictl(host, "move", c["gid"], target)
            assert r.returncode == 0, f"vmictl move {target}: {r.stderr}{r.stdout}"
            c = rebuilt(host, addr, c.get("failovers", 0), target)

    c = run(procs, where, "epoll", port,
            extra=("--mib", "32", "--pause-after", "8", "--pause", "3"), watch=relink)
    assert c["spurious"] == 0, (f"{c['spurious']} of {c['readable_reports']} readable reports "
                                f"were followed by EAGAIN", c)


def test_a_queue_that_ends_inside_a_frame_reads_as_native(procs):
    """A reader that asks for exactly each message (as MPI libraries do) while its socket's
    queue often ends inside the next frame's header: the client's segments are cut small
    (TCP_MAXSEG 88) and the reader keeps up, so it meets the cut (tests/programs/
    torn_frames.py). Every readable report is followed by data; before 2026-11-29 about
    110 of 26,000 reports per run were followed by EAGAIN (the queue held only the start of
    a frame), which killed an MPICH rank now and then."""
    port = block_port("ready", len(CASES) + 2)
    addr = f"{H1_IP}:{port}"
    n = "20000"
    srv = procs.server(H1, python_prog("torn_frames.py", "server", "--addr", addr, "--messages", n,
                                       "--rcvbuf", "65536"),
                       port, layer=True, name="torn-server")
    cli = procs.start(H2, python_prog("torn_frames.py", "client", "--addr", addr, "--messages", n,
                                      "--mss", "88"),
                      layer=True, name="torn-client")
    cli.wait(timeout=60)
    srv.wait(timeout=30)
    s, c = srv.last_json(), cli.last_json()
    assert s["received"] == c["sent"] and s["sha256"] == c["sha256"] and s["in_order"], (s, c)
    assert s["spurious"] == 0, (f"{s['spurious']} of {s['readable_reports']} readable reports "
                                f"were followed by EAGAIN", s)
