#!/usr/bin/env python3
"""Tries to take over a virtual connection by resuming it, knowing its GID but not its secret.

    resume_attack.py --gid HEX --target IP:PORT [--target IP:PORT ...] [--timeout S]
                     [--seed N]

Run it WITHOUT the layer. For every target (a node agent's TCP port, 7787) it makes these
attempts, each on a fresh TCP connection:

    random_mac      Resume{gid, nonce_a}; expects Challenge{nonce_b}; then Proof with a random
                    byte count and a random mac
    zero_proof      the same, then Proof{delivered 0, mac 0}
    guessed_secret  the same, then Proof{delivered 0, mac} with the mac computed exactly as a
                    real peer does, but keyed with a guessed secret
    unknown_gid     Resume for a random GID nobody holds

Agent protocol (substrate/src/wire/agent.rs): a little-endian u32 body length, then the body,
a tag byte and the fields, integers little-endian:

    9  Error{reason: u32 length + UTF-8}
    12 Resume{gid: u128, nonce: u128, from_active: u8}
    13 Challenge{nonce: u128}
    14 Proof{delivered: u64, mac: u128, agents, shm: u8}
    15 Ready{delivered: u64, mac: u128, agents, sent: u64, shm: u8}

(from_active 1: the dialer claims the connecting side, so the link goes to the accepting
side's process, the server attacked here; shm 0: no shared-memory offer.)

(agents: a u32 count of addresses, then each address; the attacker sends none).

mac = the first 16 bytes, read as a little-endian u128, of HMAC-SHA256 keyed with the 16-byte
little-endian connection secret over b"vmi-resume-a" + gid + nonce_a + nonce_b (16 bytes
little-endian each) + delivered (8 bytes little-endian) + the agents field as sent.

Prints one JSON line per attempt:

    {"target": "ip:port", "case": "...", "gid": "hex", "resume_reply": R, "proof_reply": P,
     "reason": "...", "outcome": O}

where R and P are "Challenge", "Ready", "Error", another tag name, "closed" (end of stream or
reset), "timeout" (no answer within --timeout), or null when that step was not reached, and O
is "refused" (Error or closed after the Proof, or Error for an unknown GID),
"refused_at_resume" (Error or closed right after Resume for the connection's own GID),
"taken_over" (the holder answered Ready: the attack worked), "hung" (no answer), "unexpected"
or "connect_failed". A last line {"summary": true, "attempts": N, "taken_over": K} follows.
Exit status 3 if any attempt took the connection over, else 0.
"""

import argparse
import hashlib
import hmac
import json
import random
import socket
import struct
import sys

ERROR, RESUME, CHALLENGE, PROOF, READY = 9, 12, 13, 14, 15
TAG_NAMES = {1: "Hello", 2: "Listen", 3: "Unlisten", 4: "Connect", 5: "Accept", 6: "Virtual",
             7: "Plain", 8: "Ok", 9: "Error", 10: "Status", 11: "StatusReply", 12: "Resume",
             13: "Challenge", 14: "Proof", 15: "Ready"}
MAX_REPLY = 1 << 20
CASES = ["random_mac", "zero_proof", "guessed_secret", "unknown_gid"]


def u128(v):
    return v.to_bytes(16, "little")


NO_AGENTS = struct.pack("<I", 0)


def msg(tag, body=b""):
    payload = bytes([tag]) + body
    return struct.pack("<I", len(payload)) + payload


def resume_mac(secret, gid, nonce_a, nonce_b, delivered):
    d = hmac.new(u128(secret), b"vmi-resume-a" + u128(gid) + u128(nonce_a) + u128(nonce_b)
                 + struct.pack("<Q", delivered) + NO_AGENTS, hashlib.sha256).digest()
    return int.from_bytes(d[:16], "little")


class Closed(Exception):
    pass


def recv_exact(sock, n):
    buf = b""
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise Closed(repr(exc)) from None
        if not chunk:
            raise Closed(f"end of stream after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def read_reply(sock):
    """(name, fields) of the next message; ("closed", why) or ("timeout", None)."""
    try:
        (n,) = struct.unpack("<I", recv_exact(sock, 4))
        if n == 0 or n > MAX_REPLY:
            return "garbage", f"body length {n}"
        body = recv_exact(sock, n)
    except Closed as exc:
        return "closed", str(exc)
    except socket.timeout:
        return "timeout", None
    tag, rest = body[0], body[1:]
    name = TAG_NAMES.get(tag, f"tag {tag}")
    if tag == CHALLENGE and len(rest) == 16:
        return name, int.from_bytes(rest, "little")
    if tag == ERROR and len(rest) >= 4:
        (k,) = struct.unpack("<I", rest[:4])
        return name, rest[4:4 + k].decode(errors="replace")
    if tag == READY and len(rest) >= 28:
        return name, {"delivered": struct.unpack("<Q", rest[:8])[0]}
    return name, rest.hex()[:200]


def send(sock, data):
    try:
        sock.sendall(data)
        return True
    except OSError:
        return False


def attempt(target, case, gid, rng, timeout):
    out = {"target": f"{target[0]}:{target[1]}", "case": case, "resume_reply": None,
           "proof_reply": None, "reason": None}
    if case == "unknown_gid":
        gid = rng.getrandbits(128)
    out["gid"] = f"{gid:032x}"
    try:
        sock = socket.create_connection(target, timeout=timeout)
    except OSError as exc:
        out.update(outcome="connect_failed", reason=repr(exc))
        return out
    sock.settimeout(timeout)
    try:
        nonce_a = rng.getrandbits(128)
        if not send(sock, msg(RESUME, u128(gid) + u128(nonce_a) + b"\x01")):
            out.update(resume_reply="closed", outcome="refused_at_resume",
                       reason="could not send Resume")
            return out
        name, fields = read_reply(sock)
        out["resume_reply"] = name
        if name != "Challenge":
            out["reason"] = fields if isinstance(fields, str) else None
            if name in ("Error", "closed"):
                out["outcome"] = "refused" if case == "unknown_gid" else "refused_at_resume"
            elif name == "timeout":
                out["outcome"] = "hung"
            else:
                out["outcome"] = "unexpected"
            return out
        nonce_b = fields
        if case == "random_mac":
            delivered, mac = rng.getrandbits(32), rng.getrandbits(128)
        elif case == "zero_proof":
            delivered, mac = 0, 0
        elif case == "guessed_secret":
            delivered = 0
            mac = resume_mac(rng.getrandbits(128), gid, nonce_a, nonce_b, delivered)
        else:
            # An unknown GID must not get as far as a Challenge.
            delivered, mac = 0, rng.getrandbits(128)
        if not send(sock, msg(PROOF, struct.pack("<Q", delivered) + u128(mac) + NO_AGENTS + b"\x00")):
            out.update(proof_reply="closed", outcome="refused",
                       reason="closed before the Proof was sent")
            return out
        name, fields = read_reply(sock)
        out["proof_reply"] = name
        out["reason"] = fields if isinstance(fields, str) else None
        if name == "Ready":
            out["outcome"] = "taken_over"
        elif name in ("Error", "closed"):
            out["outcome"] = "refused" if case != "unknown_gid" else "unexpected"
        elif name == "timeout":
            out["outcome"] = "hung"
        else:
            out["outcome"] = "unexpected"
        return out
    finally:
        sock.close()


def parse_addr(text):
    host, _, port = text.rpartition(":")
    if not host or not port:
        raise argparse.ArgumentTypeError(f"expected IP:PORT, got {text!r}")
    return host, int(port)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gid", required=True, help="the connection's GID, 32 hex digits")
    p.add_argument("--target", type=parse_addr, action="append", required=True,
                   help="agent address IP:PORT (repeatable)")
    p.add_argument("--timeout", type=float, default=3.0,
                   help="seconds to wait for each answer")
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args()
    gid = int(args.gid, 16)
    rng = random.Random(args.seed) if args.seed is not None else random.SystemRandom()
    taken = attempts = 0
    for target in args.target:
        for case in CASES:
            r = attempt(target, case, gid, rng, args.timeout)
            attempts += 1
            taken += r["outcome"] == "taken_over"
            print(json.dumps(r), flush=True)
    print(json.dumps({"summary": True, "attempts": attempts, "taken_over": taken}), flush=True)
    return 3 if taken else 0


if __name__ == "__main__":
    sys.exit(main())
