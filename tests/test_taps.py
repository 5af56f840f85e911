"""Taps: devices that watch one end of a live connection without changing a byte.

`profile` (`vmictl device load profile --gid GID`, read with `vmictl profile GID`) counts the
program's calls, their sizes, the time between them and bytes per second; `vmictl capture
GID -w FILE` writes the traffic as the program sees it as pcapng, which tshark must read as an
ordinary TCP conversation with the program's own addresses, the exact bytes both ways and no
sequence-number complaint. The program (tests/programs/paced.py) sends messages whose count,
size, spacing and content are known, so every figure is checked exactly.
"""

import importlib.util
import json
import subprocess
import threading
import time

import pytest

from helpers import (BASELINE, H1, H1_IP, H2, H2_IP, PORTS, PROGRAMS, python_prog, vmictl,
                     vmictl_as_nobody, vmictl_ok, wait_conn)

pytestmark = pytest.mark.skipif(BASELINE, reason="taps are the layer's: on plain TCP there is "
                                "nothing to test")

CLIENT, SERVER = H1, H2

_spec = importlib.util.spec_from_file_location("paced", PROGRAMS / "paced.py")
paced = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(paced)


def start_pair(procs, tmp_path, port, count, size, every, hold=3):
    addr = f"{H2_IP}:{port}"
    go = tmp_path / f"go-{port}"
    procs.server(SERVER, python_prog("paced.py", "server", "--bind", addr), port, layer=True,
                 name="echo-server")
    cli = procs.start(CLIENT, python_prog("paced.py", "client", "--connect", addr, "--go", go,
                                          "--count", count, "--size", size, "--every", every,
                                          "--hold", hold),
                      layer=True, env={"VMI_LOG": "info"}, name="paced-client")
    c = wait_conn(CLIENT, addr, lambda c: True, 10, "the connection")
    return cli, c, go


def finished(cli, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = cli.stdout().strip()
        if out:
            r = json.loads(out.splitlines()[-1])
            assert "error" not in r, r
            return r
        time.sleep(0.05)
    raise AssertionError("the client did not finish")


def test_profile_counts_the_programs_calls(procs, tmp_path):
    """40 messages of 1000 bytes, 20 ms apart, echoed: with profile loaded on the client's
    end before they go, `vmictl profile` (here, and from the other node) counts exactly 40
    sends of 1000 bytes (all in the 512-1023 bucket), 39 gaps of about 20 ms, 40,000 bytes
    received and over the seconds; a user who does not own the process is refused; after
    unload there is no profile."""
    count, size = 40, 1000
    cli, c, go = start_pair(procs, tmp_path, PORTS["tap_profile"], count, size, 20)
    gid = c["gid"]
    r = vmictl_ok(CLIENT, "device", "load", "profile", "--gid", gid)
    assert "1 connection" in r.stdout, r.stdout
    r = vmictl_as_nobody(CLIENT, "profile", gid)
    assert r.returncode == 1 and "not allowed" in r.stderr, (r.returncode, r.stdout, r.stderr)
    time.sleep(0.5)
    go.touch()
    res = finished(cli)
    assert res["same"] and res["sent"] == count * size, res
    v = json.loads(vmictl_ok(CLIENT, "profile", gid, "--json").stdout)
    snd, rcv = v["send"], v["recv"]
    assert (snd["calls"], snd["bytes"]) == (count, count * size), snd
    assert dict(map(tuple, snd["sizes"])) == {512: count}, snd["sizes"]
    gaps = dict(map(tuple, snd["gaps_us"]))
    assert sum(gaps.values()) == count - 1, gaps
    assert gaps.get(16384, 0) >= (count - 1) * 3 // 4, f"most gaps 16-32 ms: {gaps}"
    assert rcv["bytes"] == count * size and rcv["calls"] >= 1, rcv
    assert sum(n for _, n in rcv["sizes"]) == rcv["calls"], rcv
    assert sum(b for _, b in snd["per_second"]) == count * size, snd["per_second"]
    remote = json.loads(vmictl_ok(SERVER, "--node", H1_IP, "profile", gid, "--json").stdout)
    assert remote["send"]["bytes"] == count * size, remote
    svg = tmp_path / "profile.svg"
    table = vmictl_ok(CLIENT, "profile", gid, "--plot", svg).stdout
    assert f"{count} calls, {count * size} bytes" in table and "size of a call" in table, table
    assert svg.read_text().startswith("<svg") and "<polyline" in svg.read_text()
    vmictl_ok(CLIENT, "device", "unload", "profile", "--gid", gid)
    time.sleep(0.3)
    r = vmictl(CLIENT, "profile", gid)
    assert r.returncode == 1 and "no profile" in r.stderr, (r.returncode, r.stderr)


def tshark(*args):
    r = subprocess.run(["tshark", *map(str, args)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_capture_reads_in_tshark_as_the_conversation(procs, tmp_path):
    """30 messages of 3000 bytes and their echo, captured with `vmictl capture -w FILE`:
    tshark reads one TCP conversation between the program's own addresses, 90,000 bytes each
    way, the exact bytes the program sent and got back (tshark's "follow" of the stream),
    and finds nothing wrong with it (no malformed packet, no TCP analysis flag: lost
    segment, retransmission, window full...)."""
    count, size = 30, 3000
    port = PORTS["tap_capture"]
    cli, c, go = start_pair(procs, tmp_path, port, count, size, 10)
    gid = c["gid"]
    pcap = tmp_path / "conn.pcapng"
    out = []
    t = threading.Thread(target=lambda: out.append(
        vmictl(CLIENT, "capture", gid, "-w", pcap, "--duration", 4, "--json", timeout=30)))
    t.start()
    deadline = time.monotonic() + 10
    while not (pcap.exists() and pcap.stat().st_size > 0):
        assert time.monotonic() < deadline, "the capture did not start"
        time.sleep(0.05)
    go.touch()
    res = finished(cli)
    assert res["same"], res
    t.join(timeout=30)
    r = out[0]
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"], r.stdout
    # One conversation, the program's own addresses; the bytes each way.
    fields = tshark("-r", pcap, "-T", "fields", "-e", "ip.src", "-e", "tcp.srcport", "-e",
                    "ip.dst", "-e", "tcp.dstport", "-e", "tcp.len")
    sent = {}
    for line in fields.splitlines():
        src, sport, dst, dport, n = line.split("\t")
        sent[(src, sport, dst, dport)] = sent.get((src, sport, dst, dport), 0) + int(n)
    cport = str(c["local"].rsplit(":", 1)[1]) if "local" in c else None
    assert len(sent) == 2, sent
    (a, na), (b, nb) = sorted(sent.items(), key=lambda kv: kv[0][1] == str(port))
    assert a[0] == H1_IP and a[2] == H2_IP and a[3] == str(port), a
    assert cport is None or a[1] == cport, (a, cport)
    assert (na, nb) == (count * size, count * size), sent
    # The stream's content, both ways.
    follow = tshark("-r", pcap, "-q", "-z", "follow,tcp,raw,0")
    out_hex, back_hex = [], []
    for line in follow.splitlines():
        h = line.strip()
        if not h or any(ch not in "0123456789abcdef" for ch in h):
            continue
        (back_hex if line.startswith("\t") else out_hex).append(h)
    want = paced.payload(count, size)
    assert bytes.fromhex("".join(out_hex)) == want
    assert bytes.fromhex("".join(back_hex)) == want
    # Nothing tshark's analysis would flag.
    bad = tshark("-r", pcap, "-Y", "_ws.malformed || tcp.analysis.flags")
    assert bad.strip() == "", bad
