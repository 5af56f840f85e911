"""The Myrinet-style messaging protocol (`substrate::mx`) on real raw Ethernet between two
namespace hosts: AF_PACKET sockets on eth1 with EtherType 0x86DF (`mx-stream`, the protocol
with a one-packet-per-system-call driver). Every byte is checked at the receiver; with 1% of
the frames dropped by nftables at both ends, the stream still arrives whole (a dropped frame
costs a resend, not the stream)."""

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


def run_stream(procs, session, nbytes):
    recv = procs.start(H2, [MX_STREAM, "recv", "--iface", ETH1, "--peer", mac(H1), "--session",
                            session, "--bytes", nbytes], layer=False, name="mx-recv")
    send = procs.run(H1, [MX_STREAM, "send", "--iface", ETH1, "--peer", mac(H2), "--session",
                          session, "--bytes", nbytes], layer=False, name="mx-send", timeout=90)
    recv.wait(timeout=30)
    return json.loads(send.stdout()), json.loads(recv.stdout())


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


def test_mx_stream_over_raw_ethernet(procs):
    s, r = run_stream(procs, 11, 128 * MIB)
    assert s["ok"] and r["ok"], (s, r)
    assert s["bytes"] == r["bytes"] == 128 * MIB
    assert r["refused"] == 0 and s["refused"] == 0


def test_mx_stream_survives_dropped_frames(procs):
    with Loss([H1, H2], 1):
        s, r = run_stream(procs, 12, 64 * MIB)
    assert s["ok"] and r["ok"], (s, r)
    assert r["bytes"] == 64 * MIB
    assert s["resent"] + r["pulled_again"] > 0, f"1% loss and nothing was sent again: {s} {r}"
