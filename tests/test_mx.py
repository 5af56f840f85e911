"""The Myrinet-style messaging protocol (`substrate::mx`) on real raw Ethernet between two
namespace hosts: AF_PACKET sockets on eth1 with EtherType 0x86DF (`mx-stream`), through the
kernel's packet rings (`--io ring`, the driver the layer's sink uses) and with one system call
per frame (`--io call`). Every byte is checked at the receiver; with 1% of the frames dropped
by nftables at both ends, the stream still arrives whole (a dropped frame costs a resend, not
the stream); without loss nothing is sent twice; ping-pong messages come back unchanged."""

import json
import subprocess

import pytest

from helpers import ETH1, H1, H2, RELEASE

MX_STREAM = RELEASE / "mx-stream"
MIB = 1 << 20


def mac(host, ifname=ETH1):
    out = subprocess.run(["ip", "-n", host, "-br", "link", "show", ifname], capture_output=True,
                         text=True, check=True, timeout=5).stdout.split()
    return out[2]


def run_pair(procs, session, first, second, args, io="ring"):
    """`mx-stream FIRST` on host 2, then `mx-stream SECOND` on host 1; both JSON lines."""
    common = ["--session", session, "--io", io, *args]
    a = procs.start(H2, [MX_STREAM, first, "--iface", ETH1, "--peer", mac(H1), *common],
                    layer=False, name=f"mx-{first}-{io}")
    b = procs.run(H1, [MX_STREAM, second, "--iface", ETH1, "--peer", mac(H2), *common],
                  layer=False, name=f"mx-{second}-{io}", timeout=90)
    a.wait(timeout=30)
    return json.loads(b.stdout()), json.loads(a.stdout())


def run_stream(procs, session, nbytes, io="ring"):
    return run_pair(procs, session, "recv", "send", ["--bytes", nbytes], io)


class Loss:
    """Drops `percent` of the protocol's frames arriving on eth1 of the given hosts."""

    def __init__(self, hosts, percent):
        self.hosts, self.percent = hosts, percent

    def __enter__(self):
        for h in self.hosts:
            rules = (f'table netdev vmit_mx {{\n chain in {{\n'
                     f'  type filter hook ingress device "{ETH1}" priority 0;\n'
                     f'  ether type 0x86df numgen random mod 100 < {self.percent} drop\n }}\n}}\n')
            subprocess.run(["nsenter", f"--net=/run/netns/{h}", "nft", "-f", "-"], input=rules,
                           text=True, check=True, timeout=10)
        return self

    def __exit__(self, *exc):
        for h in self.hosts:
            subprocess.run(["nsenter", f"--net=/run/netns/{h}", "nft", "delete", "table", "netdev",
                            "vmit_mx"], capture_output=True, timeout=10)


@pytest.mark.parametrize("io", ["ring", "call"])
def test_mx_stream_over_raw_ethernet(procs, io):
    s, r = run_stream(procs, 11, 128 * MIB, io)
    assert s["ok"] and r["ok"], (s, r)
    assert s["io"] == r["io"] == io
    assert s["bytes"] == r["bytes"] == 128 * MIB
    assert r["refused"] == 0 and s["refused"] == 0
    if io == "ring":
        # Rings: a system call per batch of frames, not per frame. A frame per call makes
        # about 2,000-6,000 calls a MiB here at MTU 1500 (data, pulls, the polls between);
        # the rings about 45. The bound leaves room for a slow machine, whose rings run
        # empty (a poll each time) more often.
        assert s["syscalls"] + r["syscalls"] < 500 * 128, (s, r)


def test_mx_stream_without_loss_sends_nothing_twice(procs):
    # Announcements waiting behind a message being pulled are not timed out: before, about
    # 3% of the messages went twice without any loss (some 1,700 in 64 MiB, all through the
    # stream). What is tolerated: a side that does not run for longer than the 20 ms
    # time-out (a cold start, or a busy machine) makes the window of announcements (256 of
    # 38 bytes) go again once; here that happens in about one run of three to seven, at the
    # start. Three such stalls are allowed.
    s, r = run_stream(procs, 13, 64 * MIB)
    assert s["ok"] and r["ok"], (s, r)
    assert r["kernel_drops"] == 0 and s["kernel_drops"] == 0, (s, r)
    assert s["resent"] <= 3 * 256, f"{s['resent']} messages sent again without loss: {s} {r}"


@pytest.mark.parametrize("size", [1, 64, 4096, 65536])
def test_mx_ping_pong_messages_come_back_whole(procs, size):
    ping, pong = run_pair(procs, 14, "pong", "ping", ["--iters", 300, "--msg", size,
                                                      "--spin-us", 0])
    assert ping["ok"] and pong["ok"], (ping, pong)
    assert ping["iters"] == 300 and ping["msg"] == size
    assert 0 < ping["p50_us"] < 5000, ping


def test_mx_stream_survives_dropped_frames(procs):
    with Loss([H1, H2], 1):
        s, r = run_stream(procs, 12, 64 * MIB)
    assert s["ok"] and r["ok"], (s, r)
    assert r["bytes"] == 64 * MIB
    assert s["resent"] + r["pulled_again"] > 0, f"1% loss and nothing was sent again: {s} {r}"
