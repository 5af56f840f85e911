"""Agents trust only their cluster (a shared cluster key), and local users only what is theirs.

- A host whose agent holds another key cannot announce a connection: its programs' connections
  stay plain, and the cluster's agent logs and counts the refused channel.
- A Connect sent in clear to the agents' port is refused and changes nothing: a plain
  connection from the very source it named stays plain.
- Heartbeats no key sealed, and heartbeats recorded earlier and sent again from the real
  node's address, do not keep a dead path alive; both are counted.
- A capture of the agents' traffic while a virtual connection is set up shows only sealed
  data: each agent channel starts with the channel's magic, each heartbeat with its own, and
  neither the connection's GID nor a node name appears anywhere.
- A local user who is not root cannot take a network out of service or move another user's
  connection, and sees only its own processes in `vmictl status`.
- An agent without a key file, or with one others can read, does not start.
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from programs.stranger import pcap_packets
from helpers import (AGENT_BIN, AGENT_PORT, ETH0, H1, H1_IP, H2, H2_IP, H3, H3_IP, NOBODY,
                     PRELOAD_LIB, PYTHON, VMICTL_BIN, as_nobody, assert_plain, assert_same_stream,
                     assert_virtual, block_port, extra_agent, host_argv, public_copies,
                     python_prog, vmictl_status, wait_status, Watcher)

MiB = 1 << 20


def refused(host):
    return vmictl_status(host)["mesh"]["refused"]


def port(i):
    return block_port("trust", i)


def stream_pair(procs, server_host, server_ip, client_host, p, nbytes=4 * MiB):
    addr = f"{server_ip}:{p}"
    srv = procs.server(server_host, python_prog("stream.py", "server", "--bind", addr, "--count",
                                                "1", "--hold", "1"),
                       p, layer=True, name=f"stream-server-{p}")
    cli = procs.run(client_host, python_prog("stream.py", "client", "--connect", addr, "--bytes",
                                             nbytes, "--seed", p, "--hold", "1"),
                    layer=True, name=f"stream-client-{p}", timeout=40)
    srv.wait(timeout=10)
    assert_same_stream(cli.last_json(), srv.last_json())
    return addr


def test_an_agent_with_another_key_cannot_announce_connections(procs, tmp_path):
    before = refused(H1)["channel"]
    with extra_agent(H3, tmp_path, "agent-stranger", key="stranger") as stranger:
        assert vmictl_status(H3)["mesh"]["key"] != vmictl_status(H1)["mesh"]["key"]
        with Watcher(H1, H3) as w:
            addr = stream_pair(procs, H1, H1_IP, H3, port(0))
        assert_plain(w, addr, server_host=H1, client_host=H3)
        log = stranger.proc.stderr() + stranger.proc.stdout()
    assert refused(H1)["channel"] > before, "the cluster's agent did not count the stranger"
    assert "not of this cluster" in log, log[-2000:]


def test_a_connect_in_clear_is_refused_and_changes_nothing(procs):
    p = port(1)
    addr = f"{H1_IP}:{p}"
    src_port = port(2)
    before = refused(H1)["clear"]
    procs.server(H1, python_prog("echo_server.py", "--bind", addr), p, layer=True,
                 name="echo-server")
    r = procs.run(H3, python_prog("stranger.py", "clear-connect", "--target",
                                  f"{H1_IP}:{AGENT_PORT}", "--src", f"{H3_IP}:{src_port}",
                                  "--dst", addr), layer=False, name="clear-connect")
    answer = r.last_json()
    assert answer["answer"] in ("Error", "closed"), answer
    assert refused(H1)["clear"] > before
    # Had the agent believed it, the echo server would take this plain connection from the
    # named source for a virtual one and its bytes for the layer's frames.
    code = ("import socket,os,hashlib,json\n"
            f"s=socket.socket(); s.bind(('{H3_IP}',{src_port})); s.connect(('{H1_IP}',{p}))\n"
            "d=os.urandom(1<<20); s.sendall(d); s.shutdown(socket.SHUT_WR)\n"
            "b=b''\n"
            "while True:\n  c=s.recv(65536)\n  if not c: break\n  b+=c\n"
            "print(json.dumps({'same': b==d, 'n': len(b)}))\n")
    with Watcher(H1) as w:
        echo = procs.run(H3, [PYTHON, "-c", code], layer=False, name="plain-client", timeout=30)
    assert echo.last_json()["same"], echo.last_json()
    assert_plain(w, addr, server_host=H1)


def path_state(status, peer_ip):
    return [p["state"] for p in status["paths"] if p["peer"] == peer_ip]


class Capture:
    """tcpdump inside a host, writing a pcap file."""

    def __init__(self, procs, host, path, expr, iface="any"):
        self.path = path
        self.proc = procs.start(host, ["tcpdump", "-U", "-n", "-Z", "root", "-i", iface, "-w", path, expr],
                                layer=False, name=f"tcpdump-{host}-{path.stem}")
        deadline = time.monotonic() + 10
        while "listening on" not in self.proc.stderr():
            assert self.proc.alive(), self.proc.stderr()
            assert time.monotonic() < deadline, "tcpdump did not start"
            time.sleep(0.05)

    def stop(self):
        time.sleep(0.3)
        os.kill(self.proc.pid, signal.SIGINT)
        self.proc.wait(timeout=10, check=False)
        return self.path.read_bytes()


def test_forged_and_replayed_heartbeats_do_not_keep_a_dead_path_alive(procs, agent_control,
                                                                      tmp_path):
    # A connection between the two hosts makes their agents watch the paths between them.
    stream_pair(procs, H1, H1_IP, H2, port(6), nbytes=MiB)
    wait_status(H1, lambda s: "alive" in path_state(s, H2_IP), 10, f"path to {H2_IP} alive")
    cap = Capture(procs, H1, tmp_path / "heartbeats.pcap", f"udp and src host {H2_IP}",
                  iface=ETH0)
    time.sleep(1.0)
    cap.stop()
    before = refused(H1)
    agent_control.kill(H2)
    wait_status(H1, lambda s: path_state(s, H2_IP) == ["dead"], 5, f"path to {H2_IP} dead")
    target = f"{H1_IP}:{AGENT_PORT}"
    bind = f"{H2_IP}:{AGENT_PORT}"
    replay = procs.start(H2, python_prog("stranger.py", "replay", "--target", target, "--pcap",
                                         cap.path, "--from-ip", H2_IP, "--rounds", 3,
                                         "--bind", bind), layer=False, name="replay")
    forge = procs.start(H2, python_prog("stranger.py", "forge", "--target", target, "--count",
                                        200, "--bind", bind), layer=False, name="forge")
    states = set()
    while replay.alive() or forge.alive():
        states.update(path_state(vmictl_status(H1), H2_IP))
        time.sleep(0.05)
    replay.wait(timeout=5)
    forge.wait(timeout=5)
    sent = replay.last_json()
    assert sent["distinct"] >= 20, f"too few heartbeats recorded: {sent}"
    assert states == {"dead"}, f"the path to {H2_IP} came back on replayed or forged " \
                               f"heartbeats: {states}"
    after = refused(H1)
    assert after["replayed_heartbeats"] > before["replayed_heartbeats"]
    assert after["forged_heartbeats"] >= before["forged_heartbeats"] + 200
    agent_control.restore()
    wait_status(H1, lambda s: "alive" in path_state(s, H2_IP), 10,
                f"path to {H2_IP} alive with the real agent back")


def test_agent_traffic_carries_no_secret_and_no_message_in_clear(procs, tmp_path):
    cap = Capture(procs, H1, tmp_path / "mesh.pcap", f"port {AGENT_PORT}")
    # A fresh agent in host 3 opens a new channel to host 1's agent for the connection.
    with extra_agent(H3, tmp_path, "agent-h3"), Watcher(H1, H3) as w:
        addr = stream_pair(procs, H1, H1_IP, H3, port(3), nbytes=MiB)
        time.sleep(0.5)
        nodes = [vmictl_status(h)["node"].encode() for h in (H1, H3)]
    data = cap.stop()
    assert_virtual(w, H1, addr, H3)
    gids = {c["gid"] for c in w.connections(H1) if c.get("local") == addr}
    assert gids
    needles = [bytes.fromhex(g) for g in gids] + [bytes.fromhex(g)[::-1] for g in gids]
    needles += nodes
    streams, udp = {}, []
    for proto, src, sport, dst, dport, flags, payload in pcap_packets(data):
        if proto == "udp":
            udp.append(payload)
        else:
            key = (src, sport, dst, dport)
            s = streams.setdefault(key, {"syn": False, "bytes": b""})
            s["syn"] |= bool(flags & 0x02) and not flags & 0x10
            s["bytes"] += payload
    # A layer's dial that rebuilds a link (a failover: on a busy machine a heartbeat late by a
    # millisecond is enough) also reaches the agent's port: its `Resume` (a 34-byte message,
    # tag 12) names the connection in clear by design, and what follows is the connection's
    # own stream. Such links, both directions, are not the agents' traffic.
    links = {k for k, s in streams.items()
             if k[3] == AGENT_PORT and s["syn"] and s["bytes"][:5] == (34).to_bytes(4, "little") + b"\x0c"}
    links |= {(d, dp, src, sp) for (src, sp, d, dp) in links}
    agents = {k: s for k, s in streams.items() if k not in links}
    dialed = [s for (src, sp, dst, dp), s in agents.items() if dp == AGENT_PORT and s["syn"]]
    assert dialed, f"no agent channel opened during the capture: {list(streams)}"
    assert udp, "no heartbeat captured"
    for s in dialed:
        assert s["bytes"][:4] == b"VMIM", f"an agent connection began in clear: {s['bytes'][:64]}"
    assert all(d[:4] == b"VMIP" for d in udp), "a heartbeat in clear"
    everything = b"".join(s["bytes"] for s in agents.values()) + b"".join(udp)
    for n in needles:
        assert n not in everything, f"{n!r} appears in the agents' traffic"


@pytest.fixture
def copies():
    """vmictl, the layer and stream.py where user nobody can read them."""
    with public_copies(VMICTL_BIN, PRELOAD_LIB, Path(__file__).parent / "programs" / "stream.py") as d:
        yield d


def test_local_users_cannot_steer_the_node_and_see_only_their_own(procs, copies):
    ctl = copies / "vmictl"
    r = as_nobody(H1, [ctl, "net", "down", ETH0])
    assert r.returncode != 0 and "not allowed" in r.stderr + r.stdout, r
    assert all(n["admin"] == "up" for n in vmictl_status(H1)["networks"])
    # A root-owned server and a connection to it, and a server of nobody's own.
    p, mine = port(4), port(5)
    root_addr = f"{H1_IP}:{p}"
    root_srv = procs.server(H1, python_prog("stream.py", "server", "--bind", root_addr), p,
                            layer=True, name="root-server")
    argv = host_argv(H1, ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                          "/usr/bin/python3", copies / "stream.py", "server", "--bind",
                          f"{H1_IP}:{mine}"],
                     {"LD_PRELOAD": str(copies / "libvmi_preload.so")})
    theirs = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        cli = procs.start(H2, python_prog("stream.py", "client", "--connect", root_addr,
                                          "--bytes", 64 * MiB, "--seed", p, "--rate",
                                          8 * MiB), layer=True, name="client")
        st = wait_status(H1, lambda s: s if any(c["local"] == root_addr for c in s["connections"])
                         and any(l["addr"].endswith(f":{mine}") for l in s["listeners"]) else None,
                         10, "the connection and both listeners listed")
        gid = next(c["gid"] for c in st["connections"] if c["local"] == root_addr)
        r = as_nobody(H1, [ctl, "status", "--json"])
        assert r.returncode == 0, r
        seen = json.loads(r.stdout)
        assert seen["connections"] == [], seen["connections"]
        assert [l["addr"] for l in seen["listeners"]] == [f"{H1_IP}:{mine}"], seen["listeners"]
        assert {x["pid"] for x in seen["processes"]} == {theirs.pid} or \
            all(x["name"].startswith("python") for x in seen["processes"]), seen["processes"]
        assert seen["networks"] and seen["paths"], "the node itself stays visible"
        r = as_nobody(H1, [ctl, "move", gid, "tcp"])
        assert r.returncode != 0 and "not allowed" in r.stderr + r.stdout, r
        r = as_nobody(H1, [ctl, "chain", gid, "double"])
        assert r.returncode != 0 and "not allowed to change the filters" in r.stderr + r.stdout, r
        r = as_nobody(H1, [ctl, "device", "load", "lz4", "--gid", gid])
        assert r.returncode != 0 and "not allowed to load a device" in r.stderr + r.stdout, r
        r = as_nobody(H1, [ctl, "device", "load", "lz4", "--pid", str(root_srv.pid)])
        assert r.returncode != 0 and "not allowed" in r.stderr + r.stdout, r
        # --all means every connection the asker may manage: none of root's.
        r = as_nobody(H1, [ctl, "device", "load", "lz4", "--all"])
        assert r.returncode == 0 and "(0 connection(s))" in r.stdout, r
        time.sleep(0.5)
        c = next(c for c in vmictl_status(H1)["connections"] if c["gid"] == gid)
        assert (c.get("chain") or {}).get("send", "") == "", c
        cli.wait(timeout=30)
    finally:
        os.killpg(theirs.pid, signal.SIGKILL)
        theirs.wait(timeout=5)
    assert refused(H1)["local"] >= 5


def test_an_agent_without_a_private_key_does_not_start(tmp_path):
    missing = tmp_path / "none.key"
    r = subprocess.run(host_argv(H3, [AGENT_BIN, "--key", missing], {}), capture_output=True,
                       text=True, timeout=10)
    assert r.returncode != 0 and "vmi-agent --init" in r.stderr, r.stderr
    key = tmp_path / "open.key"
    subprocess.run([AGENT_BIN, "--init", "--key", key], check=True, capture_output=True)
    r = subprocess.run([AGENT_BIN, "--init", "--key", key], capture_output=True, text=True)
    assert r.returncode != 0, "an existing key was overwritten"
    os.chmod(key, 0o644)
    r = subprocess.run(host_argv(H3, [AGENT_BIN, "--key", key], {}), capture_output=True,
                       text=True, timeout=10)
    assert r.returncode != 0 and "open to other users" in r.stderr, r.stderr
