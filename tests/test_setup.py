"""Connection set-up: the source ports layers bind to, and connections announced one way
between agents (with what ends that: a listener gone, an agent restarted)."""

import json
import shutil
import subprocess
import time

import pytest

from helpers import (H1, H1_IP, H2, H2_IP, H3, H3_IP, PORTS, PROGRAMS, PYTHON, Watcher,
                     as_nobody, assert_virtual, extra_agent, metric, public_copies, python_prog,
                     scrape_metrics, strace_counts, vmictl_status)

# Connects n times, one connection after the other, and prints for each its local port,
# whether the banner and the echo came back right, and how long the banner took (ms, the
# connect included); the last connection is held a second, for vmictl to see.
PORTS_CLIENT = r"""
import socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
out = []
for i in range(n):
    t0 = time.monotonic()
    s = socket.create_connection((host, port))
    f = s.makefile("rb")
    ok = bool(f.readline())
    ms = (time.monotonic() - t0) * 1000
    s.sendall(b"x\n")
    ok = ok and f.readline() == b"x\n"
    out.append("%d:%d:%.1f" % (s.getsockname()[1], ok, ms))
    if i == n - 1:
        time.sleep(1)
    f.close()
    s.close()
print(" ".join(out), flush=True)
"""

BLOCK = range(59000, 61000)


def test_layered_connections_take_their_source_port_from_the_nodes_block(procs):
    """The agent reserves a block of source ports (its `setup-ports`, 59000-60999 by
    default) and the layer binds each connection the program did not bind to one of them
    before `connect`: the connection is announced with its port, so the accepting side's
    agent finds it at once instead of waiting for the port to follow through both agents.
    The kernel gives those ports to no socket that did not ask for one: a program without
    the layer on the same node never gets one."""
    port = PORTS["setup_block"]
    addr = f"{H1_IP}:{port}"
    reserved = procs.run(H2, ["cat", "/proc/sys/net/ipv4/ip_local_reserved_ports"], layer=False,
                         name="reserved").stdout()
    assert "59000-60999" in reserved, reserved
    procs.server(H1, python_prog("banner.py", "server", "--bind", addr), port, layer=True,
                 name="banner-server")
    n = 30
    with Watcher(H1, H2) as w:
        layered = procs.run(H2, [PYTHON, "-c", PORTS_CLIENT, H1_IP, port, n], layer=True,
                            name="block-client", timeout=60).stdout().split()
    plain = procs.run(H2, [PYTHON, "-c", PORTS_CLIENT, H1_IP, port, n], layer=False,
                      name="plain-client", timeout=60).stdout().split()
    assert len(layered) == n and all(x.split(":")[1] == "1" for x in layered), layered
    assert len(plain) == n and all(x.split(":")[1] == "1" for x in plain), plain
    ports = [int(x.split(":")[0]) for x in layered]
    assert all(p in BLOCK for p in ports), ports
    assert len(set(ports)) == n, f"a port used twice: {ports}"
    assert not any(int(x.split(":")[0]) in BLOCK for x in plain), plain
    assert_virtual(w, H1, addr, H2, min_conns=1)


def connect_n(procs, n, port, *, name):
    """PORTS_CLIENT under the layer on H2 toward H1: the local ports, after checking that every
    connection carried its banner and echo right."""
    out = procs.run(H2, [PYTHON, "-c", PORTS_CLIENT, H1_IP, port, n], layer=True, name=name,
                    timeout=60).stdout().split()
    assert len(out) == n and all(x.split(":")[1] == "1" for x in out), f"{name}: {out}"
    return out


def wait_for(what, check, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.1)


def one_way(host):
    return vmictl_status(host)["setup"]


def test_later_connections_are_announced_one_way_and_a_listener_gone_ends_it(procs):
    """After a first connection to a listener on another node (asked about, agent to agent,
    as always), the connecting node's agent subscribes to it: later connections there are
    announced one way and answered at once, and the listener's agent holds their accepts
    until the announcement comes. When the listener goes away (here its process is killed),
    its agent tells the subscribed one before anything else can listen there: a plain
    server started on the same port next gets plain connections from the same layered
    client, byte for byte right (with the subscription still in force the client's layer
    would send it frames)."""
    port = PORTS["setup_one_way"]
    addr = f"{H1_IP}:{port}"
    server = procs.server(H1, python_prog("banner.py", "server", "--bind", addr), port,
                          layer=True, name="layered-server")
    with Watcher(H1, H2) as w:
        connect_n(procs, 6, port, name="first-clients")
    assert_virtual(w, H1, addr, H2, min_conns=1)
    assert addr in one_way(H2)["one_way_to"], one_way(H2)
    # A program without the layer on the subscribed node: its ports are outside the block,
    # so its accepts do not wait for an announcement (they would, 500 ms, inside it).
    plain = procs.run(H2, [PYTHON, "-c", PORTS_CLIENT, H1_IP, port, 5], layer=False,
                      name="plain-client", timeout=60).stdout().split()
    assert all(x.split(":")[1] == "1" and float(x.split(":")[2]) < 250 for x in plain), plain
    assert {"listener": addr, "node": H2_IP} in one_way(H1)["one_way_from"], one_way(H1)
    assert one_way(H2)["ports"] == "59000-60999"
    server.stop()
    wait_for("the subscription ended on both nodes",
             lambda: addr not in one_way(H2)["one_way_to"] and not one_way(H1)["one_way_from"])
    procs.server(H1, python_prog("banner.py", "server", "--bind", addr), port, layer=False,
                 name="plain-server")
    connect_n(procs, 6, port, name="clients-of-the-plain-server")


TICKETS = range(60000, 61000)


def assert_ticketed(out, n, trace):
    """`PORTS_CLIENT`'s `n` lines all right, nearly all from distinct ticket ports, and an
    strace of its polls (`trace`) showing the layer waited for its agent only a few times."""
    assert len(out) == n and all(x.split(":")[1] == "1" for x in out), out
    ports = [int(x.split(":")[0]) for x in out]
    ticketed = [p for p in ports if p in TICKETS]
    assert len(ticketed) >= n - 5, f"only {len(ticketed)} of {n} from ticket ports: {ports}"
    assert len(set(ticketed)) == len(ticketed), f"a ticket port used twice: {ports}"
    # (The layer's socket to its agent is descriptor 700; its control thread polls others.)
    polls = trace.read_text().count("poll([{fd=700, events=POLLIN}], 1,")
    assert 0 < polls < n // 4, f"the layer waited for its agent {polls} times in {n} connections"


def test_later_connections_use_tickets_and_ask_nobody(procs, tmp_path):
    """Once a listener on another node is subscribed to, the connecting process gets
    tickets for it: source ports of the upper half of the block, each with a GID and a
    secret its agent announced to the listener's agent ahead. A `connect` with a ticket binds
    its port and is virtual without a word to the agent before it (the agent hears after
    the SYN left, one way): 80 short connections, every banner and echo right (a connection
    virtual at one end only would show frames as data), most from ticket ports, and the
    layer waited for its agent (`poll`) only a few times, where it used to wait once per
    connection. The agent counts the tickets out."""
    port = PORTS["setup_tickets"]
    addr = f"{H1_IP}:{port}"
    procs.server(H1, python_prog("banner.py", "server", "--bind", addr), port, layer=True,
                 name="ticket-server")
    n = 80
    trace = tmp_path / "tickets.strace"
    with Watcher(H1, H2) as w:
        out = procs.run(H2, ["strace", "-f", "-e", "trace=poll", "-o", trace, PYTHON, "-c",
                             PORTS_CLIENT, H1_IP, port, n], layer=True, name="ticket-client",
                        timeout=60).stdout().split()
    assert_ticketed(out, n, trace)
    assert_virtual(w, H1, addr, H2, min_conns=1)
    assert one_way(H2)["tickets_out"] > 0, one_way(H2)


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shm", "tcp"])
def test_connections_to_a_listener_on_the_same_node_use_tickets(procs, tmp_path, shm):
    """The same with the listener on the client's own node: the agent expects the tickets'
    connections itself, at once, so that a `connect` there asks nobody either (it used to
    wait for its agent every time). Over shared memory (the rings offered before the SYN,
    as for a connection the agent answered) and over TCP: every banner and echo right, the
    connections virtual, most from ticket ports, few waits for the agent."""
    port = PORTS["setup_tickets_here" if shm == "1" else "setup_tickets_here_tcp"]
    addr = f"{H1_IP}:{port}"
    env = {"VMI_SHM": shm}
    procs.server(H1, python_prog("banner.py", "server", "--bind", addr), port, layer=True,
                 name="ticket-server-here", env=env)
    n = 80
    trace = tmp_path / "tickets-here.strace"
    with Watcher(H1) as w:
        out = procs.run(H1, ["strace", "-f", "-e", "trace=poll", "-o", trace, PYTHON, "-c",
                             PORTS_CLIENT, H1_IP, port, n], layer=True, name="ticket-client-here",
                        env=env, timeout=60).stdout().split()
    assert_ticketed(out, n, trace)
    mine = [c for c in w.connections(H1) if c.get("peer", "").endswith(f":{port}")]
    assert mine, w.summary(H1)
    want = "shm" if shm == "1" else "tcp"
    assert all(c.get("substrate") == want for c in mine), mine
    assert one_way(H1)["tickets_out"] > 0, one_way(H1)


def test_an_agent_restarted_between_connections_is_asked_again(procs, agent_control):
    """The agent a subscription was made with restarts (and knows nothing of it): the
    server's layer registers its listener with the new agent as soon as it finds it, and the
    subscribed agent sees the channel the subscription was made on closed and asks again
    instead of announcing one way into the void, so the connections that follow are right,
    virtual, and announced one way again."""
    port = PORTS["setup_restart"]
    addr = f"{H1_IP}:{port}"
    procs.server(H1, python_prog("banner.py", "server", "--bind", addr), port, layer=True,
                 name="layered-server")
    connect_n(procs, 4, port, name="before-restart")
    assert addr in one_way(H2)["one_way_to"], one_way(H2)
    agent_control.restart(H1)
    # The server's layer sees its event channel close and open again, and introduces itself
    # and its listener to the new agent at once (not at its next accept).
    listed = lambda: addr in [x["addr"] for x in vmictl_status(H1)["listeners"]]  # noqa: E731
    wait_for("the listener registered with the new agent", listed, timeout=10)
    with Watcher(H1, H2) as w:
        connect_n(procs, 4, port, name="after-restart")
    assert_virtual(w, H1, addr, H2, min_conns=1)
    wait_for("subscribed again", lambda: {"listener": addr, "node": H2_IP} in one_way(H1)["one_way_from"])


# Makes n connections one after the other to an echo server, each carrying 4 KiB there and
# back; with "fork" after them, opens four at once (held a second) and closes them, forks, and parent and
# child each make n more at the same time, each checking its echoes. Prints the number of
# wrong echoes.
REUSE_CLIENT = r"""
import os, socket, sys, time
host, port, n, fork = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "fork"
def run(tag):
    bad = 0
    for i in range(n):
        s = socket.create_connection((host, port))
        data = (b"%s-%d-" % (tag, i)) * 400
        data = data[:4096]
        s.sendall(data)
        got = b""
        while len(got) < len(data):
            b = s.recv(65536)
            if not b:
                break
            got += b
        bad += got != data
        s.close()
    return bad
bad = run(b"first")
if fork:
    # Four connections open at once, then closed: four memories kept when the fork comes.
    held = [socket.create_connection((host, port)) for _ in range(4)]
    for s in held:
        s.sendall(b"x")
        bad += s.recv(1) != b"x"
    time.sleep(1)
    for s in held:
        s.close()
    time.sleep(0.5)
    pid = os.fork()
    bad += run(b"child" if pid == 0 else b"parent")
    if pid == 0:
        os._exit(min(bad, 100))
    _, st = os.waitpid(pid, 0)
    bad += os.waitstatus_to_exitcode(st)
print(bad, flush=True)
"""


def test_short_connections_reuse_their_memory_and_a_fork_child_never_shares_it(procs, tmp_path):
    """A connection's memory (its state and replay ring, shared with fork children) is kept
    when the connection ends and no process holds it, and the next connection takes it: a
    program making many short connections maps and unmaps nothing per connection (an unmap
    flushes every thread's TLB). Counted with strace: 200 connections more add far fewer
    than 200 `munmap`s. A fork child lets go of the memory its parent kept (the memory is
    shared with the parent, which hands it to its next connection): parent and child then
    make connections at the same time and every echo comes back right."""
    port = PORTS["setup_reuse"]
    addr = f"{H1_IP}:{port}"
    procs.server(H1, python_prog("echo_server.py", "--bind", addr), port, layer=True, name="echo")
    counts = {}
    for n in (20, 220):
        trace = tmp_path / f"reuse{n}.strace"
        out = procs.run(H2, ["strace", "-c", "-f", "-o", trace, PYTHON, "-c", REUSE_CLIENT, H1_IP,
                             port, n, "once"], layer=True, name=f"reuse-{n}", timeout=120).stdout()
        assert out.split() == ["0"], out
        counts[n] = strace_counts(trace)
    added = {k: counts[220].get(k, 0) - counts[20].get(k, 0) for k in ("mmap", "munmap", "connect")}
    assert added["connect"] >= 200, added
    assert added["munmap"] < 50 and added["mmap"] < 50, f"per 200 connections more: {added}"
    port = PORTS["setup_reuse_fork"]
    addr = f"{H1_IP}:{port}"
    procs.server(H1, python_prog("echo_server.py", "--bind", addr), port, layer=True,
                 name="echo-fork")
    with Watcher(H1, H2) as w:
        out = procs.run(H2, [PYTHON, "-c", REUSE_CLIENT, H1_IP, port, 100, "fork"], layer=True,
                        name="reuse-fork", timeout=120).stdout()
    assert out.split() == ["0"], out
    assert_virtual(w, H1, addr, H2, min_conns=1)


def test_accepts_take_announced_connections_from_the_table_shared_with_the_agent(procs, tmp_path):
    """A layered server takes each connection announced to its listener from the table it
    shares with its agent (a sealed memfd handed over with the listener), without asking the
    agent and waiting for its answer: 60 short connections from another host, every echo
    right, and the agent counts them as taken from the table
    (`vmi_accepts_total{how="table"}`); a connection whose SYN overtook its announcement is
    asked about, as before. The connections are virtual at both ends, with one GID."""
    maddr = "127.0.0.1:19788"
    port = PORTS["setup_table"]
    addr = f"{H3_IP}:{port}"
    with extra_agent(H3, tmp_path, "agent-table", args=["--metrics", maddr]):
        procs.server(H3, python_prog("echo_server.py", "--bind", addr), port, layer=True,
                     name="echo-table")
        out = procs.run(H1, [PYTHON, "-c", REUSE_CLIENT, H3_IP, port, 60, "once"], layer=True,
                        name="table-client", timeout=120).stdout()
        assert out.split() == ["0"], out
        # (A table's accepts reach the agent a little later, with others: waited for.)
        def counts():
            text = scrape_metrics(H3, maddr)
            return (metric(text, "vmi_accepts_total", how="table"),
                    metric(text, "vmi_accepts_total", how="asked"))
        deadline = time.monotonic() + 5
        while sum(counts()) < 60 and time.monotonic() < deadline:
            time.sleep(0.1)
        taken, asked = counts()
        assert taken + asked >= 60 and taken >= 40, (taken, asked)
        with Watcher(H1, H3) as w:
            procs.run(H1, [PYTHON, "-c", HOLD_CLIENT, H3_IP, port], layer=True,
                      name="table-hold", timeout=30)
        assert_virtual(w, H3, addr, H1, min_conns=1)
        # (That one too came from the table, or was asked about: counted either way.)
        text = scrape_metrics(H3, maddr)
        assert metric(text, "vmi_accepts_total", how="table") + \
            metric(text, "vmi_accepts_total", how="asked") >= taken + asked + 1, text


# One connection, an echo, held three seconds (for vmictl to see), closed.
HOLD_CLIENT = r"""
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
s.sendall(b"hold")
assert s.recv(4) == b"hold"
time.sleep(3)
s.close()
"""


# Listens, waits for argv[3] seconds before it accepts one connection, echoes four bytes,
# holds the connection two seconds.
SLOW_ACCEPT = r"""
import socket, sys, time
l = socket.socket()
l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind((sys.argv[1], int(sys.argv[2])))
l.listen(4)
print("listening", flush=True)
time.sleep(float(sys.argv[3]))
c, _ = l.accept()
c.sendall(c.recv(4))
time.sleep(2)
"""

# Connects, prints its source port, sends four bytes and reads the echo.
PORT_CLIENT = r"""
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
print(s.getsockname()[1], flush=True)
s.sendall(b"ping")
assert s.recv(4) == b"ping"
print("echoed", flush=True)
"""


def test_only_a_holder_of_the_accepted_socket_learns_the_connection(procs):
    """An announced connection's identity and secret wait in the agent for the listener's
    accept; the agent gives them out only to a process that hands over the accepted socket
    itself (proof that it holds that connection). Asked without it, by another user or by
    root, the agent answers "plain" (and counts a refusal), and the connection stays for
    its listener, whose accept still finds it: virtual at both ends."""
    port = PORTS["setup_owner"]
    addr = f"{H1_IP}:{port}"
    srv = procs.start(H1, [PYTHON, "-c", SLOW_ACCEPT, H1_IP, port, 4], layer=True,
                      name="slow-accept")
    with Watcher(H1, H2) as w:
        deadline = time.monotonic() + 10
        while "listening" not in srv.stdout():
            assert time.monotonic() < deadline and srv.alive(), srv.stderr()
            time.sleep(0.05)
        cli = procs.start(H2, [PYTHON, "-c", PORT_CLIENT, H1_IP, port], layer=True,
                          name="port-client")
        while not cli.stdout().strip():
            assert time.monotonic() < deadline and cli.alive(), cli.stderr()
            time.sleep(0.05)
        src = f"{H2_IP}:{int(cli.stdout().split()[0])}"
        ask = ["local-accept", "--local", addr, "--peer", src]
        with public_copies(PROGRAMS / "stranger.py", PROGRAMS / "hostile.py") as d:
            r = as_nobody(H1, ["/usr/bin/python3", d / "stranger.py", *ask])
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["answer"] == 7, r.stdout
        r = procs.run(H1, python_prog("stranger.py", *ask), layer=False, name="root-ask",
                      timeout=20)
        assert json.loads(r.stdout())["answer"] == 7, r.stdout()
        cli.wait(timeout=30)
        assert "echoed" in cli.stdout(), cli.stdout()
        srv.wait(timeout=30)
    assert_virtual(w, H1, addr, H2, min_conns=1)
    assert vmictl_status(H1)["mesh"]["refused"]["local"] >= 2


def test_a_refused_connect_of_a_virtual_connection_fails_as_natively(procs, tmp_path):
    """A listener that goes away behind the layer's back (closed with a bare system call, as
    when it dies between its agent's answer, or a ticket's announcement, and a client's SYN):
    the client's next connection is set up as virtual and its non-blocking connect is
    refused. The program must see what native TCP says, call by call (ECONNREFUSED from
    SO_ERROR, EPIPE from every send, the end of stream from recv), not a lost link being
    rebuilt (sends said EAGAIN while the socket polled writable, and a program waiting for
    writability spun)."""
    gcc = shutil.which("gcc")
    assert gcc, "gcc not found (apt-get install gcc)"
    server = tmp_path / "vanishing_listener"
    subprocess.run([gcc, "-O2", "-Wall", "-o", str(server), str(PROGRAMS / "vanishing_listener.c")],
                   check=True, timeout=120)
    said = {}
    for layer, key in ((True, "setup_refused"), (False, "setup_refused_native")):
        port = PORTS[key]
        procs.server(H1, [server, H1_IP, port], port, layer=layer, name=f"vanishing-{key}")
        client = procs.run(H2, [PYTHON, str(PROGRAMS / "refused_client.py"), H1_IP, port],
                           layer=layer, name=f"refused-{key}", timeout=60,
                           env={"VMI_LOG": "info"} if layer else None)
        said[layer] = client.stdout().split()
        if layer:
            assert "virtual connection" in client.stderr(), client.stderr()
    want = ["so_error=ECONNREFUSED", "send=EPIPE", "send=EPIPE", "send=EPIPE", "recv=b''"]
    assert said[False] == want, f"natively: {said[False]}"
    assert said[True] == want, f"under the layer: {said[True]}"
