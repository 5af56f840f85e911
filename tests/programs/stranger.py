#!/usr/bin/env python3
"""A host without the cluster key trying to make the agents of a cluster do something.

    stranger.py clear-connect --target IP:PORT --src IP:PORT --dst IP:PORT [--seed N]
    stranger.py forge --target IP:PORT --count N [--bind IP:PORT]
    stranger.py replay --target IP:PORT --pcap FILE --from-ip IP [--rounds R] [--bind IP:PORT]
    stranger.py local-accept --local IP:PORT --peer IP:PORT

Run it WITHOUT the layer.

clear-connect  sends, in clear on the agents' TCP port, the Connect message another node's
               agent would send to announce a virtual connection from --src to --dst (a
               random GID and secret), and reports the answer: {"answer": "Error" | tag |
               "closed", "reason": "..."}.
forge          sends --count heartbeat datagrams to --target that no cluster key sealed:
               heartbeats in the old clear format, and random bytes behind the sealed
               format's magic. {"sent": N}
replay         sends again, --rounds times at 10 ms spacing, every UDP payload of the pcap
               file that came from --from-ip to the agents' port (heartbeats recorded
               earlier). {"sent": N, "distinct": D}
local-accept   asks the node's agent (its local socket, @vmi-agent), as whatever user runs
               it, about a connection from --peer accepted at --local, as an accepting
               layer would (Accept, tag 5) but without the accepted socket, and reports the
               answer's tag: {"answer": 6} (Virtual: the agent gave out the connection's
               identity and secret), 7 (Plain), or "closed".

Agent messages (substrate/src/wire/agent.rs): a little-endian u32 body length, then a tag
byte and the fields; Connect is tag 4 {src, dst: address, gid, secret: u128, window: u64,
aim: address, agents: u32 count + addresses}; Error is 9 {reason}; Probe is 24 {node: string,
seq: u64}.
"""

import argparse
import json
import os
import random
import socket
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hostile import agent_msg, enc_addr, enc_str, enc_u128  # noqa: E402

CONNECT, ACCEPT, ERROR, PROBE = 4, 5, 9, 24


def parse_addr(text):
    host, _, port = text.rpartition(":")
    return host, int(port)


def recv_exact(s, n):
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def clear_connect(a):
    rng = random.Random(a.seed)
    body = (enc_addr(*a.src) + enc_addr(*a.dst) + enc_u128(rng.getrandbits(128))
            + enc_u128(rng.getrandbits(128)) + struct.pack("<Q", 4 << 20) + enc_addr(*a.dst)
            + struct.pack("<I", 0))
    s = socket.create_connection(a.target, timeout=5)
    s.sendall(agent_msg(CONNECT, body))
    try:
        n = struct.unpack("<I", recv_exact(s, 4))[0]
        reply = recv_exact(s, n)
    except (EOFError, ConnectionError, socket.timeout):
        return {"answer": "closed"}
    if reply[0] == ERROR:
        ln = struct.unpack("<I", reply[1:5])[0]
        return {"answer": "Error", "reason": reply[5:5 + ln].decode(errors="replace")}
    return {"answer": reply[0]}


def local_accept(a):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect("\0vmi-agent")
    s.sendall(agent_msg(ACCEPT, enc_addr(*a.local) + enc_addr(*a.peer)))
    try:
        n = struct.unpack("<I", recv_exact(s, 4))[0]
        reply = recv_exact(s, n)
    except (EOFError, ConnectionError, socket.timeout):
        return {"answer": "closed"}
    return {"answer": reply[0]}


def udp(a):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if a.bind:
        s.bind(a.bind)
    return s


def forge(a):
    s = udp(a)
    for i in range(a.count):
        if i % 2:
            d = agent_msg(PROBE, enc_str("stranger") + struct.pack("<Q", i))
        else:
            d = b"VMIP" + os.urandom(24 + 40 + 16)
        s.sendto(d, a.target)
        time.sleep(0.005)
    return {"sent": a.count}


def pcap_packets(data):
    """(proto, src, sport, dst, dport, tcp_flags, payload) of each IPv4 TCP or UDP packet of a
    classic pcap file's bytes (Ethernet, Linux cooked v1 or v2 link types)."""
    magic = struct.unpack("<I", data[:4])[0]
    order = "<" if magic in (0xA1B2C3D4, 0xA1B23C4D) else ">"
    link = struct.unpack(order + "I", data[20:24])[0]
    skip = {1: 14, 113: 16, 276: 20}[link]
    off = 24
    while off + 16 <= len(data):
        incl = struct.unpack(order + "I", data[off + 8:off + 12])[0]
        pkt = data[off + 16:off + 16 + incl]
        off += 16 + incl
        ip = pkt[skip:]
        if len(ip) < 20 or ip[0] >> 4 != 4:
            continue
        ihl = (ip[0] & 15) * 4
        tot = struct.unpack(">H", ip[2:4])[0]
        src, dst = socket.inet_ntoa(ip[12:16]), socket.inet_ntoa(ip[16:20])
        t = ip[ihl:tot]
        sport, dport = struct.unpack(">HH", t[:4])
        if ip[9] == 6:
            yield "tcp", src, sport, dst, dport, t[13], t[(t[12] >> 4) * 4:]
        elif ip[9] == 17:
            yield "udp", src, sport, dst, dport, 0, t[8:]


def pcap_udp_payloads(path, src_ip, dport):
    """UDP payloads from src_ip to dport in a pcap file."""
    return [p for proto, src, _, _, dp, _, p in pcap_packets(open(path, "rb").read())
            if proto == "udp" and src == src_ip and dp == dport]


def replay(a):
    payloads = pcap_udp_payloads(a.pcap, a.from_ip, a.target[1])
    s = udp(a)
    sent = 0
    for _ in range(a.rounds):
        for p in payloads:
            s.sendto(p, a.target)
            sent += 1
            time.sleep(0.01)
    return {"sent": sent, "distinct": len(set(payloads))}


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("clear-connect")
    c.add_argument("--target", type=parse_addr, required=True)
    c.add_argument("--src", type=parse_addr, required=True)
    c.add_argument("--dst", type=parse_addr, required=True)
    c.add_argument("--seed", type=int, default=1)
    f = sub.add_parser("forge")
    f.add_argument("--target", type=parse_addr, required=True)
    f.add_argument("--count", type=int, default=100)
    f.add_argument("--bind", type=parse_addr)
    r = sub.add_parser("replay")
    r.add_argument("--target", type=parse_addr, required=True)
    r.add_argument("--pcap", required=True)
    r.add_argument("--from-ip", required=True)
    r.add_argument("--rounds", type=int, default=1)
    r.add_argument("--bind", type=parse_addr)
    la = sub.add_parser("local-accept")
    la.add_argument("--local", type=parse_addr, required=True)
    la.add_argument("--peer", type=parse_addr, required=True)
    a = ap.parse_args()
    out = {"clear-connect": clear_connect, "forge": forge, "replay": replay,
           "local-accept": local_accept}[a.cmd](a)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
