"""Filters on a live connection's stream (the device chain): `VMI_CHAIN` at set-up, `vmictl
chain GID ...` on a connection that is moving bytes, and a chain that stays on through a
failover. The filter used is `double`, which sends every byte twice: it changes lengths, so
a frame boundary that the two layers did not agree on, a frame coded twice or a replay coded
with the wrong chain shows up as a broken checksum or a closed connection.

Every case checks the stream byte for byte at both ends (stream.py's digests, nb_stream.py's
per-message checks), what `vmictl status --json` says of each direction's chain, and, where
the chain was on the whole time, that the wire really carried twice the bytes (the client
host's interface counters).
"""

import json
import time

import pytest

from helpers import (BASELINE, ETH0, ETH1, H1, H2, H2_IP, PORTS, Watcher, assert_same_stream,
                     assert_virtual, chain_of, in_netns, python_prog, vmictl, vmictl_ok,
                     wait_conn)

pytestmark = pytest.mark.skipif(BASELINE, reason="filters are the layer's: on plain TCP there "
                                "is nothing to test")

MiB = 1 << 20
CLIENT, SERVER = H1, H2
HEADER_BYTES = 24   # stream.py's header, sent by the client on the connection


def tx_bytes(host, ifname=ETH0):
    """Bytes the host's interface sent so far."""
    r = in_netns(host, ["ip", "-j", "-s", "link", "show", "dev", ifname])
    assert r.returncode == 0, r.stderr
    return int(json.loads(r.stdout)[0]["stats64"]["tx"]["bytes"])


def test_chain_at_set_up_codes_every_byte(procs):
    """Both programs start with VMI_CHAIN=double: each side offers the chain for what it
    sends, the other takes it, and from then on every frame is coded. The wire carries about
    twice the stream; both ends list the chain in both directions."""
    port = PORTS["chain_setup"]
    addr = f"{H2_IP}:{port}"
    up, down = 12 * MiB, 8 * MiB
    env = {"VMI_CHAIN": "double", "VMI_LOG": "info"}
    srv = procs.server(SERVER, python_prog("stream.py", "server", "--bind", addr, "--count", "1",
                                           "--hold", "2"), port, layer=True, env=env,
                       name="stream-server")
    before = tx_bytes(CLIENT)
    with Watcher(SERVER, CLIENT) as w:
        cli = procs.run(CLIENT, python_prog("stream.py", "client", "--connect", addr, "--bytes", up,
                                            "--server-bytes", down, "--seed", port, "--hold", "2"),
                        layer=True, env=env, name="stream-client", timeout=60)
        srv.wait(timeout=15)
    sent = tx_bytes(CLIENT) - before
    c, s = cli.last_json(), srv.last_json()
    assert c["sent_bytes"] == up and c["recv_bytes"] == down, c
    assert_same_stream(c, s)
    assert_virtual(w, SERVER, addr, CLIENT, c2s_bytes=up + HEADER_BYTES, s2c_bytes=down,
                   exact=True, client_pid=cli.pid)
    ends = [e for e in w.connections(CLIENT) if e.get("peer") == addr]
    assert ends and chain_of(ends[-1]) == ("double", "double"), \
        f"the client end should list chain double both ways: {ends[-1] if ends else None}"
    ends = [e for e in w.connections(SERVER) if e.get("local") == addr]
    assert ends and chain_of(ends[-1]) == ("double", "double"), ends[-1] if ends else None
    # The first frames go plain until the answer arrives; the rest twice over.
    assert sent >= 1.8 * up, \
        f"{CLIENT}'s {ETH0} sent {sent} bytes for a {up}-byte stream under chain double: the " \
        f"bytes were not coded"


def test_chain_attached_and_detached_live(procs):
    """A connection moving bytes both ways gets `vmictl chain GID double` on one end, then
    on the other, then `double,double`, then none, several times over; the stream stays
    exact, and status shows each change once the peer took it."""
    port = PORTS["chain_live"]
    addr = f"{H2_IP}:{port}"
    rate, seconds = 4 * MiB, 12
    n = rate * seconds
    srv = procs.server(SERVER, python_prog("stream.py", "server", "--bind", addr, "--count", "1",
                                           "--hold", "1", "--rate", rate), port, layer=True,
                       env={"VMI_LOG": "info"}, name="stream-server")
    with Watcher(SERVER, CLIENT) as w:
        cli = procs.start(CLIENT, python_prog("stream.py", "client", "--connect", addr, "--bytes",
                                              n, "--server-bytes", n, "--seed", port, "--rate",
                                              rate, "--hold", "1"),
                          layer=True, env={"VMI_LOG": "info"}, name="stream-client")
        c = wait_conn(CLIENT, addr, lambda c: c.get("bytes_sent", 0) > 0
                      and c.get("bytes_received", 0) > 0, 10, "the stream moving both ways")
        gid = c["gid"]
        steps = [(CLIENT, "double"), (SERVER, "double"), (CLIENT, "double,double"),
                 (SERVER, "none"), (CLIENT, "none"), (SERVER, "double,double"),
                 (CLIENT, "double"), (SERVER, "double")]
        for host, spec in steps:
            vmictl_ok(host, "chain", gid, spec)
            want = "" if spec == "none" else spec
            side = "client" if host == CLIENT else "server"
            other, oside = (SERVER, "server") if host == CLIENT else (CLIENT, "client")
            wait_conn(host, addr, lambda c: c.get("gid") == gid and chain_of(c)[0] == want, 5,
                      f"the {side} end sending through chain {want!r}", side=side)
            if want:
                wait_conn(other, addr, lambda c: c.get("gid") == gid and chain_of(c)[1] == want,
                          5, f"the {oside} end receiving through chain {want!r}", side=oside)
            time.sleep(0.3)
        cli.wait(timeout=seconds + 30)
        srv.wait(timeout=10)
    c, s = cli.last_json(), srv.last_json()
    assert c["sent_bytes"] == n and c["recv_bytes"] == n, c
    assert_same_stream(c, s)
    assert_virtual(w, SERVER, addr, CLIENT, c2s_bytes=n + HEADER_BYTES, s2c_bytes=n, exact=True,
                   client_pid=cli.pid)


def test_chain_on_non_blocking_event_loops(procs):
    """nb_stream.py (asyncio: partial writes left to the layer, reads until EAGAIN, epoll)
    with VMI_CHAIN=double at both ends: coded frames cut short by a full socket go on from
    the ring, readiness waits for whole coded frames, and every message arrives intact."""
    port = PORTS["chain_nb"]
    addr = f"{H2_IP}:{port}"
    env = {"VMI_CHAIN": "double"}
    srv = procs.server(SERVER, python_prog("nb_stream.py", "server", "--addr", addr, "--seconds",
                                           "4"), port, layer=True, env=env, name="nb-server")
    cli = procs.run(CLIENT, python_prog("nb_stream.py", "client", "--addr", addr, "--seconds", "4"),
                    layer=True, env=env, name="nb-client", timeout=60)
    srv.wait(timeout=20)
    c, s = cli.last_json(), srv.last_json()
    for r in (c, s):
        assert r["errors"] == 0 and r["sent"] > 100 and r["received"] > 100, r
    assert c["sent"] == s["received"] and s["sent"] == c["received"], (c, s)


def test_chain_survives_failover(procs, faults):
    """A stream under VMI_CHAIN=double,aead loses its network in the middle: the frames sent
    again on the rebuilt link are coded (and sealed) with the chain and key of their own
    offsets, each side takes a new key after the relink, and both programs see an exact
    stream."""
    port = PORTS["chain_failover"]
    addr = f"{H2_IP}:{port}"
    rate, seconds = 2 * MiB, 6
    n = rate * seconds
    want = ("double,aead:aes-256-gcm",) * 2
    env = {"VMI_CHAIN": "double,aead", "VMI_LOG": "info"}
    srv = procs.server(SERVER, python_prog("stream.py", "server", "--bind", addr, "--count", "1",
                                           "--hold", "1", "--rate", rate), port, layer=True,
                       env=env, name="stream-server")
    with Watcher(SERVER, CLIENT) as w:
        cli = procs.start(CLIENT, python_prog("stream.py", "client", "--connect", addr, "--bytes",
                                              n, "--server-bytes", n, "--seed", port, "--rate",
                                              rate, "--hold", "1"),
                          layer=True, env=env, name="stream-client")
        c = wait_conn(CLIENT, addr, lambda c: c.get("bytes_sent", 0) > 0
                      and chain_of(c) == want, 10, "the stream moving, coded both ways")
        time.sleep(1.0)
        faults.link_down(CLIENT, ETH0)
        wait_conn(CLIENT, addr, lambda e: e.get("gid") == c["gid"] and e.get("network") == ETH1
                  and (e.get("failovers") or 0) >= 1, 20, "the connection moved to eth1")
        cli.wait(timeout=seconds + 30)
        srv.wait(timeout=10)
    c2, s = cli.last_json(), srv.last_json()
    assert c2["sent_bytes"] == n and c2["recv_bytes"] == n, c2
    assert_same_stream(c2, s)
    ends = [e for e in w.connections(CLIENT) if e.get("gid") == c["gid"]]
    assert ends and chain_of(ends[-1]) == want, ends[-1] if ends else None
    for p in (cli, srv):
        assert "takes a new key" in p.stderr(), f"{p.name}: no new key after the relink"


def test_chain_refused_for_unknown_filter(procs):
    """`vmictl chain GID brotli` (a filter this build does not have) is refused by the agent
    with a message naming the filters there are; the connection goes on untouched."""
    port = PORTS["chain_unknown"]
    addr = f"{H2_IP}:{port}"
    srv = procs.server(SERVER, python_prog("stream.py", "server", "--bind", addr, "--count", "1",
                                           "--hold", "1", "--rate", MiB), port, layer=True,
                       name="stream-server")
    cli = procs.start(CLIENT, python_prog("stream.py", "client", "--connect", addr, "--bytes",
                                          3 * MiB, "--server-bytes", 3 * MiB, "--seed", port,
                                          "--rate", MiB, "--hold", "1"),
                      layer=True, name="stream-client")
    c = wait_conn(CLIENT, addr, lambda c: c.get("bytes_sent", 0) > 0, 10, "the stream moving")
    r = vmictl(CLIENT, "chain", c["gid"], "brotli")
    assert r.returncode == 1 and "no such chain: brotli" in r.stderr and "double" in r.stderr, \
        (r.returncode, r.stdout, r.stderr)
    cli.wait(timeout=30)
    srv.wait(timeout=10)
    assert_same_stream(cli.last_json(), srv.last_json())
