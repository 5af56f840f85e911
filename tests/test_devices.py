"""Devices loaded into running programs (`vmictl device load|unload|list`): a device goes on
both directions of a live connection, of every connection of a process, or of every
connection of the node, from the node itself or from another node through the agents; the
two layers switch at a frame boundary they agree on, so the program sees nothing.

The devices are the filters of the device chain: `lz4` and `zstd:LEVEL` (compression of each
frame) and `double` (every byte twice, a test device that changes lengths). Every case checks the
streams byte for byte at both ends (stream.py's digests and counts) and what `vmictl status`
and `vmictl device list` say of each direction's chain. The lz4 case sends words (data that
compresses) and checks on the interface counters that the wire carried much less than the
stream.
"""

import functools
import json
import re
import time

import pytest

import subprocess

from helpers import (BASELINE, ETH0, H1, H1_IP, H2, H2_IP, PORTS, PRELOAD_LIB,
                     assert_same_stream, both_ways, chain_of, extra_agent, in_netns, python_prog,
                     vmictl, vmictl_ok, wait_conn, wait_status)

pytestmark = pytest.mark.skipif(BASELINE, reason="devices are the layer's: on plain TCP there "
                                "is nothing to test")

MiB = 1 << 20
CLIENT, SERVER = H1, H2


def tx_bytes(host, ifname=ETH0):
    r = in_netns(host, ["ip", "-j", "-s", "link", "show", "dev", ifname])
    assert r.returncode == 0, r.stderr
    return int(json.loads(r.stdout)[0]["stats64"]["tx"]["bytes"])


def test_device_loaded_and_unloaded_in_a_loop_locally_and_from_another_node(procs):
    """A checksummed stream moving both ways: lz4 and double are loaded and unloaded many
    times, by connection, alternately from the client's node and, through the agents, from
    the server's node asked on the client's. Every switch reaches both directions (the peer
    layer offers back the chain it was asked for), and the streams stay exact."""
    port = PORTS["device_loop"]
    addr = f"{H2_IP}:{port}"
    rate, seconds = 4 * MiB, 14
    n = rate * seconds
    srv = procs.server(SERVER, python_prog("stream.py", "server", "--bind", addr, "--count", "1",
                                           "--hold", "1", "--rate", rate), port, layer=True,
                       env={"VMI_LOG": "info"}, name="stream-server")
    cli = procs.start(CLIENT, python_prog("stream.py", "client", "--connect", addr, "--bytes", n,
                                          "--server-bytes", n, "--seed", port, "--rate", rate,
                                          "--hold", "1"),
                      layer=True, env={"VMI_LOG": "info"}, name="stream-client")
    c = wait_conn(CLIENT, addr, lambda c: c.get("bytes_sent", 0) > 0
                  and c.get("bytes_received", 0) > 0, 10, "the stream moving both ways")
    gid = c["gid"]
    # (where vmictl runs, the node option, the command, the chain both ways after it)
    steps = [
        (CLIENT, [], "load", "lz4", "lz4"),
        (CLIENT, ["--node", H2_IP], "load", "double", "lz4,double"),
        (CLIENT, [], "unload", "lz4", "double"),
        (CLIENT, ["--node", H2_IP], "unload", "double", ""),
        (CLIENT, [], "load", "zstd", "zstd:3"),
        (CLIENT, ["--node", H2_IP], "unload", "zstd", ""),
    ] * 2
    took = []
    for host, node, op, dev, want in steps:
        t0 = time.time() * 1000
        r = vmictl_ok(host, *node, "device", op, dev, "--gid", gid)
        assert "1 connection" in r.stdout, r.stdout
        took.append(both_ways(gid, want, t0))
    cli.wait(timeout=seconds + 30)
    srv.wait(timeout=10)
    c, s = cli.last_json(), srv.last_json()
    assert c["sent_bytes"] == n and c["recv_bytes"] == n, c
    assert_same_stream(c, s)
    print(f"both directions switched {min(took) * 1000:.0f}..{max(took) * 1000:.0f} ms after "
          f"vmictl was run (median {sorted(took)[len(took) // 2] * 1000:.0f} ms)")


def test_device_loaded_at_the_end_that_only_receives(procs):
    """A one-way stream (the client sends, the server only receives, as an iperf3 server
    does): lz4 loaded at the server's end, where no data frame goes out to carry the offer,
    takes effect both ways while the stream runs. The offer rides on an acknowledgement the
    server's layer sends alone (before, it waited for a data frame that never came, and the
    device did nothing until the stream ended); unloading works the same way."""
    port = PORTS["device_receiver"]
    addr = f"{H2_IP}:{port}"
    rate, seconds = 8 * MiB, 10
    n = rate * seconds
    srv = procs.server(SERVER, python_prog("stream.py", "server", "--bind", addr, "--count", "1",
                                           "--hold", "1"), port, layer=True,
                       env={"VMI_LOG": "info"}, name="stream-server")
    cli = procs.start(CLIENT, python_prog("stream.py", "client", "--connect", addr, "--bytes", n,
                                          "--server-bytes", 0, "--seed", port, "--rate", rate,
                                          "--hold", "1"),
                      layer=True, env={"VMI_LOG": "info"}, name="stream-client")
    c = wait_conn(CLIENT, addr, lambda c: c.get("bytes_sent", 0) > 0, 10, "the stream moving")
    gid = c["gid"]
    t0 = time.time() * 1000
    vmictl_ok(SERVER, "device", "load", "lz4", "--gid", gid)
    took = both_ways(gid, "lz4", t0, timeout=6)
    t1 = time.time() * 1000
    vmictl_ok(SERVER, "device", "unload", "lz4", "--gid", gid)
    took_off = both_ways(gid, "", t1, timeout=6)
    cli.wait(timeout=seconds + 30)
    srv.wait(timeout=10)
    c, s = cli.last_json(), srv.last_json()
    assert c["sent_bytes"] == n and c["recv_bytes"] == 0, c
    assert_same_stream(c, s)
    print(f"both directions switched {took * 1000:.0f} ms (on) and {took_off * 1000:.0f} ms (off) "
          "after vmictl was run at the receiving end")


def test_device_by_process_and_all_and_listed(procs):
    """Two connections of one server process: `device load lz4 --pid` puts lz4 on both,
    both ways; `device list` shows it; `device unload lz4 --all` takes it off every
    connection of the node. Words (data that compresses) cross the wire in a fraction of
    their bytes while lz4 is on."""
    port = PORTS["device_pid"]
    addr = f"{H2_IP}:{port}"
    rate, seconds = 4 * MiB, 8
    n = rate * seconds
    srv = procs.server(SERVER, python_prog("stream.py", "server", "--bind", addr, "--count", "2",
                                           "--hold", "1", "--rate", rate, "--text"), port,
                       layer=True, env={"VMI_LOG": "info"}, name="stream-server")
    clis = [procs.start(CLIENT, python_prog("stream.py", "client", "--connect", addr, "--bytes",
                                            n, "--server-bytes", n, "--seed", port + k, "--rate",
                                            rate, "--hold", "1", "--text"),
                        layer=True, env={"VMI_LOG": "info"}, name=f"stream-client-{k}")
            for k in range(2)]
    gids = set()
    for cli in clis:
        c = wait_conn(CLIENT, addr, lambda c: c.get("pid") == cli.pid and c.get("bytes_sent", 0)
                      > 0, 10, f"client {cli.pid} moving bytes")
        gids.add(c["gid"])
    assert len(gids) == 2
    r = vmictl_ok(SERVER, "device", "load", "lz4", "--pid", srv.pid)
    assert "2 connection" in r.stdout, r.stdout
    for g in gids:
        both_ways(g, "lz4", 0)
    listed = json.loads(vmictl_ok(SERVER, "device", "list", "--json").stdout)
    assert "lz4" in listed["devices"] and "double" in listed["devices"], listed
    mine = {c["gid"]: (c["send"], c["recv"]) for c in listed["connections"] if c["gid"] in gids}
    assert mine == {g: ("lz4", "lz4") for g in gids}, listed
    text = vmictl_ok(SERVER, "device", "list").stdout
    assert all(g in text for g in gids) and "lz4" in text, text
    # While lz4 is on: the client's interface carries far less than the streams it sends.
    sent0 = sum(wait_conn(CLIENT, addr, lambda c, g=g: c.get("gid") == g, 5, "the connection")
                ["bytes_sent"] for g in gids)
    wire0 = tx_bytes(CLIENT)
    time.sleep(2)
    sent1 = sum(wait_conn(CLIENT, addr, lambda c, g=g: c.get("gid") == g, 5, "the connection")
                ["bytes_sent"] for g in gids)
    wire = tx_bytes(CLIENT) - wire0
    assert sent1 - sent0 > 4 * MiB, (sent0, sent1)
    assert wire < 0.6 * (sent1 - sent0), \
        f"{CLIENT} sent {wire} bytes on the wire for {sent1 - sent0} bytes of words under lz4"
    r = vmictl_ok(SERVER, "device", "unload", "lz4", "--all")
    for g in gids:
        both_ways(g, "", 0)
    for cli in clis:
        cli.wait(timeout=seconds + 30)
    srv.wait(timeout=10)
    results = {r["peer"]: r for r in srv.json_lines()}
    for cli in clis:
        c = cli.last_json()
        assert c["sent_bytes"] == n and c["recv_bytes"] == n, c
        assert_same_stream(c, results[c["local"]])


def test_device_switches_on_a_stream_at_full_speed(procs):
    """iperf3 at full speed keeps the sender's window full: a device loaded then must still
    reach the wire (its offer waits for the next data frame that goes, not for one that the
    full window held back). Eight loads and unloads, each seen at the sender and at the
    receiver; iperf3 reports no error."""
    port = PORTS["device_busy"]
    procs.server(SERVER, ["iperf3", "-s", "-1", "-B", H2_IP, "-p", port], port, layer=True,
                 name="iperf3-server")
    cli = procs.start(CLIENT, ["iperf3", "-c", H2_IP, "-p", port, "-t", "12", "--json"],
                      layer=True, name="iperf3-client")
    addr = f"{H2_IP}:{port}"
    c = wait_conn(CLIENT, addr, lambda c: c.get("bytes_sent", 0) > 64 << 20, 10,
                  "iperf3's data connection at full speed")
    gid = c["gid"]
    took = []
    for k in range(8):
        op, want = ("load", "lz4") if k % 2 == 0 else ("unload", "")
        t0 = time.time() * 1000
        vmictl_ok(CLIENT, "device", op, "lz4", "--gid", gid)
        # (iperf3's data flows one way: the receiver never sends, so only the sender's
        # direction switches.)
        snd = wait_conn(CLIENT, addr, lambda c: c.get("gid") == gid
                        and chain_of(c)[0] == want, 5, f"the sender on chain {want!r}")
        wait_conn(SERVER, addr, lambda c: c.get("gid") == gid and chain_of(c)[1] == want, 5,
                  f"the receiver on chain {want!r}", side="server")
        took.append(snd["chain"]["send_since_ms"] - t0)
    cli.wait(timeout=40)
    res = json.loads(cli.stdout())
    assert "error" not in res, res["error"]
    print(f"switches at full speed: {min(took):.0f}..{max(took):.0f} ms after vmictl was run")


def test_node_default_chains_from_the_agent(procs, tmp_path):
    """Agents started with `--chain lz4 --chain H2_IP/32=zstd:1` (on a socket and port of
    their own): a program that sets nothing gets the node's default for its peer (the client
    end, whose peer matches the /32 rule, sends through zstd:1; the server end through lz4),
    and one with VMI_CHAIN=none gets no chain. Streams stay exact."""
    sock, port0 = "vmi-chainpol", 7950
    rules = ["--chain", "lz4", "--chain", f"{H2_IP}/32=zstd:1"]
    env = {"VMI_AGENT_SOCKET": sock, "VMI_LOG": "info"}
    with extra_agent(H1, tmp_path, "agent-pol-h1", args=["--socket", sock, "--port", port0, *rules]), \
            extra_agent(H2, tmp_path, "agent-pol-h2", args=["--socket", sock, "--port", port0, *rules]):
        port = PORTS["device_policy"]
        addr = f"{H2_IP}:{port}"
        srv = procs.server(SERVER, python_prog("stream.py", "server", "--bind", addr, "--count",
                                               "2", "--hold", "1", "--text"), port, layer=True,
                           env=env, name="stream-server")
        seen = {}
        for k, extra in enumerate(({}, {"VMI_CHAIN": "none"})):
            cli = procs.start(CLIENT, python_prog("stream.py", "client", "--connect", addr,
                                                  "--bytes", 4 * MiB, "--server-bytes", 4 * MiB,
                                                  "--seed", port + k, "--hold", "1.5", "--text"),
                              layer=True, env={**env, **extra}, name=f"stream-client-{k}")
            time.sleep(1.0)
            st = json.loads(vmictl_ok(CLIENT, "--socket", sock, "status", "--json").stdout)
            mine = [c for c in st["connections"] if c["pid"] == cli.pid]
            assert mine, st["connections"]
            seen[k] = chain_of(mine[0])
            cli.wait(timeout=30)
            c = cli.last_json()
            assert c["sent_bytes"] == 4 * MiB and c["recv_bytes"] == 4 * MiB, c
        srv.wait(timeout=10)
    assert seen[0] == ("zstd:1", "lz4"), seen
    assert seen[1] == ("", "lz4"), seen
    results = {r["peer"]: r for r in srv.json_lines()}
    assert len(results) == 2 and all("error" not in r for r in results.values()), results


def local_stream(procs, port, n, rate, env):
    """A checksummed stream both ways between two programs on H1 (server and client)."""
    addr = f"{H1_IP}:{port}"
    srv = procs.server(H1, python_prog("stream.py", "server", "--bind", addr, "--count", "1",
                                       "--hold", "1", "--rate", rate), port, layer=True,
                       env=env, name="stream-server")
    cli = procs.start(H1, python_prog("stream.py", "client", "--connect", addr, "--bytes", n,
                                      "--server-bytes", n, "--seed", port, "--rate", rate,
                                      "--hold", "1"), layer=True, env=env, name="stream-client")
    return srv, cli


def local_ends(addr, substrate, chain, past=0):
    """A status check: both ends of the connection to addr on `substrate`, with `chain` on
    both directions, each having received more than `past` bytes."""
    def check(st):
        e = [c for c in st.get("connections", []) if addr in (c.get("peer"), c.get("local"))]
        ok = len(e) == 2 and all(c.get("substrate") == substrate and chain_of(c) == (chain, chain)
                                 and c.get("bytes_received", 0) > past for c in e)
        return ok and e
    return check


@pytest.mark.parametrize("device,spec", [("lz4", "lz4"), ("aead", "aead:aes-256-gcm")], ids=["lz4", "aead"])
def test_devices_stand_aside_on_shared_memory_and_stay_across_moves(procs, device, spec):
    """Two programs on one node stream both ways over shared memory. A device loaded there
    leaves the connection on shared memory: its bytes never leave the node, so the chain
    waits (the log says so). Moved to TCP, both ends code with it both ways; moved back onto
    shared memory, both keep it (its keys too) while it stands aside, and code with it again
    on the next TCP link; unloaded on TCP, the connection goes back onto shared memory with
    no device. The streams stay exact throughout."""
    port = PORTS["device_shm"]
    addr = f"{H1_IP}:{port}"
    rate, seconds = 4 * MiB, 10
    n = rate * seconds
    srv, cli = local_stream(procs, port, n, rate, {"VMI_LOG": "info", "VMI_SHM": "1"})

    def step(what, substrate, chain, past):
        e = wait_status(H1, local_ends(addr, substrate, chain, past), 10, what)
        return e[0]["bytes_received"]
    past = step("both ends streaming over shared memory", "shm", "", 0)
    gid = wait_status(H1, local_ends(addr, "shm", ""), 10, "the connection")[0]["gid"]
    vmictl_ok(H1, "device", "load", device, "--gid", gid)
    time.sleep(1)
    past = step(f"still on shared memory with {device} waiting", "shm", "", past)
    # The status says what waits: the chain offered, for the next TCP link.
    ends = wait_status(H1, local_ends(addr, "shm", ""), 10, "the ends")
    assert spec in [e["chain"].get("send_offered") for e in ends], [e["chain"] for e in ends]
    out = vmictl_ok(H1, "status").stdout
    assert f"out {spec} offered, for the next TCP link" in out, out
    vmictl_ok(H1, "move", gid, "tcp")
    past = step(f"both ends on TCP with {device} both ways", "tcp", spec, past)
    ends = wait_status(H1, local_ends(addr, "tcp", spec), 10, "the ends")
    assert all(e["chain"].get("send_offered") is None for e in ends), [e["chain"] for e in ends]
    vmictl_ok(H1, "move", gid, "shm")
    past = step(f"back on shared memory, {device} kept", "shm", spec, past)
    vmictl_ok(H1, "move", gid, "tcp")
    past = step(f"on TCP again, coding with {device}", "tcp", spec, past)
    vmictl_ok(H1, "device", "unload", device, "--gid", gid)
    past = step("on TCP with no device", "tcp", "", past)
    vmictl_ok(H1, "move", gid, "shm")
    step("back on shared memory with no device", "shm", "", past)
    cli.wait(timeout=seconds + 30)
    srv.wait(timeout=10)
    c, s = cli.last_json(), srv.last_json()
    assert c["sent_bytes"] == n and c["recv_bytes"] == n, c
    assert_same_stream(c, s)
    logs = cli.stderr() + srv.stderr()
    assert "the connection is on shared memory, where bytes do not leave this node" in logs, logs[-2000:]
    # Each move is a rebuilt link, at both ends, in a few milliseconds. (A receiver asleep
    # on the socket used to miss the news of a move off shared memory about one time in
    # three and hold it up for 200 ms.)
    took = [int(m) for m in re.findall(r"link rebuilt .* after (\d+) ms", logs)]
    assert len(took) >= 8 and max(took) < 100, took


def test_a_configured_chain_keeps_shared_memory_and_codes_on_tcp(procs):
    """Two programs of one node with `VMI_CHAIN=lz4` (as with a node-wide default chain):
    their connection still gets shared memory (before, any chain kept it on TCP for its
    whole life), and the chains each end offered at set-up wait there; moved to TCP, both
    directions code with lz4, and back on shared memory they stand aside again."""
    port = PORTS["device_shm_env"]
    addr = f"{H1_IP}:{port}"
    rate, seconds = 4 * MiB, 6
    n = rate * seconds
    srv, cli = local_stream(procs, port, n, rate, {"VMI_LOG": "debug", "VMI_SHM": "1", "VMI_CHAIN": "lz4"})
    ends = functools.partial(local_ends, addr)
    e = wait_status(H1, ends("shm", ""), 10, "both ends on shared memory, the chain waiting")
    gid, past = e[0]["gid"], e[0]["bytes_received"]
    vmictl_ok(H1, "move", gid, "tcp")
    e = wait_status(H1, ends("tcp", "lz4", past), 10, "both ends on TCP, coding with lz4 both ways")
    vmictl_ok(H1, "move", gid, "shm")
    wait_status(H1, ends("shm", "lz4", e[0]["bytes_received"]), 10, "back on shared memory, lz4 kept")
    cli.wait(timeout=seconds + 30)
    srv.wait(timeout=10)
    c, s = cli.last_json(), srv.last_json()
    assert c["sent_bytes"] == n and c["recv_bytes"] == n, c
    assert_same_stream(c, s)
    assert "stands aside on shared memory" in cli.stderr() + srv.stderr()


def test_device_refused_clearly(procs):
    """An unknown device, a process that does not exist here, and a command line without a
    target are refused with a message that says why; the connection goes on untouched."""
    r = vmictl(CLIENT, "device", "load", "brotli", "--all")
    assert r.returncode == 1 and "no such device: brotli" in r.stderr and "lz4" in r.stderr, \
        (r.returncode, r.stdout, r.stderr)
    r = vmictl(CLIENT, "device", "load", "lz4", "--pid", "999999")
    assert r.returncode == 1 and "999999" in r.stderr, (r.returncode, r.stdout, r.stderr)
    r = vmictl(CLIENT, "device", "load", "lz4")
    assert r.returncode == 2 and "--gid GID, --pid PID or --all" in r.stderr, r.stderr
    r = vmictl(CLIENT, "device", "frobnicate")
    assert r.returncode == 2 and "load, unload or list" in r.stderr, r.stderr


def test_compressors_stay_inside_the_layer():
    """The compressors are linked into the preloaded library but none of their symbols is
    exported: a program that uses its own libzstd or liblz4 keeps calling its own."""
    r = subprocess.run(["nm", "-D", "--defined-only", str(PRELOAD_LIB)], capture_output=True,
                       text=True, check=True)
    names = [l.split()[-1] for l in r.stdout.splitlines() if l.strip()]
    leaked = [n for n in names if n.upper().startswith(("ZSTD", "LZ4", "HUF_", "FSE_", "ZDICT"))]
    assert names and not leaked, leaked
    r = subprocess.run(["readelf", "-d", str(PRELOAD_LIB)], capture_output=True, text=True,
                       check=True)
    assert "zstd" not in r.stdout and "lz4" not in r.stdout, r.stdout
