"""A hostile or confused peer on a virtual connection (tests/programs/hostile.py).

The attacker runs without the layer in H2 but registers its connection with H2's agent
itself, exactly as a layer would, so the echo server's layer in H1 accepts it as virtual and
expects frames. It then sends something that is not a valid frame stream. For each case:

* the server's side closes the connection (the attacker reads end of stream or a reset within
  2 s) and sends it nothing;
* the layer logs one clear line naming the connection's GID, the peer and the reason;
* the server program itself saw an error on that connection (ECONNRESET), never garbage;
* the server keeps serving: a normal layered client's echo round trip works, virtually.

Case "valid" speaks the protocol correctly and checks the framed answers byte by byte
against the documented wire format.
"""

import time

import pytest

from helpers import (BASELINE, H1, H1_IP, H2, H2_IP, Watcher, assert_virtual, block_port,
                     python_prog)

# case -> the reason the layer must give (None: a bad magic, computed from the bytes sent)
GARBAGE = {
    "http_request_line": "malformed frame: bad frame magic 0x47",
    "http_request": "malformed frame: bad frame magic 0x47",
    "bad_magic": "malformed frame: bad frame magic 0x00",
    "out_of_order": "frame at offset 1000, stream is at 0",
    "bad_kind": "malformed frame: unknown frame kind 99",
    "zero_len": "malformed frame: frame length 0 out of bounds",
    "ack_beyond": "peer acknowledged 1000000 bytes, only 0 were sent",
    "data_ack_beyond": "peer acknowledged 1000000 bytes, only 0 were sent",
    "random": None,
}
CASES = list(GARBAGE) + ["valid"]
SEED = 2024
SERVER_ENV = {"VMI_LOG": "warn"}
ATTACK_WAIT = 2.0  # seconds the attacker waits for the server's side to close


def closed_record(srv, peer, timeout=3.0):
    """The server program's "closed" line for the connection from peer (waits for it)."""
    deadline = time.monotonic() + timeout
    while True:
        recs = [r for r in srv.json_lines() if r.get("event") == "closed" and r["peer"] == peer]
        if recs or time.monotonic() > deadline:
            return recs[-1] if recs else None
        time.sleep(0.05)


def run_probe(procs, addr):
    with Watcher(H1, H2) as w:
        probe = procs.run(H2, python_prog("hostile.py", "probe", "--connect", addr,
                                          "--hold", "0.5"),
                          layer=True, name="probe", timeout=30, check=False)
    r = probe.last_json()
    assert r["ok"] and probe.returncode == 0, \
        f"a normal layered client failed after the hostile connection: {r}"
    assert_virtual(w, H1, addr, H2, client_pid=probe.pid)


@pytest.mark.skipif(BASELINE, reason="needs the agents (the attacker talks to one)")
@pytest.mark.parametrize("case", CASES)
def test_hostile_peer(procs, case):
    port = block_port("hostile", CASES.index(case))
    addr = f"{H1_IP}:{port}"
    srv = procs.server(H1, python_prog("hostile.py", "server", "--bind", addr), port,
                       layer=True, env=SERVER_ENV, name="echo-server")
    srv.assert_layer_loaded()
    atk = procs.run(H2, python_prog("hostile.py", "attack", "--connect", addr, "--case", case,
                                    "--seed", SEED + CASES.index(case), "--wait", ATTACK_WAIT),
                    layer=False, name=f"attack-{case}", timeout=20, check=False)
    a = atk.last_json()
    assert a.get("hello_answer") == "Welcome", f"the agent did not accept Hello: {a}"
    assert a.get("connect_answer") == "Virtual", \
        f"the agent answered {a.get('connect_answer')} to Connect; the test needs Virtual: {a}"
    assert "error" not in a, f"the attacker failed: {a}"
    assert srv.alive(), srv.failure("the server died after the hostile connection")
    peer = a["local"]
    assert peer.rpartition(":")[0] == H2_IP, a

    if case == "valid":
        check_valid(a, srv, peer)
        run_probe(procs, addr)
        return
    problems = garbage_problems(case, a, srv, peer)
    # Whatever happened to the hostile connection, the server must go on serving.
    try:
        run_probe(procs, addr)
    except AssertionError as exc:
        problems.append(f"afterwards: {exc}")
    if not srv.alive():
        problems.append("the server died")
    assert not problems, f"hostile case {case!r} (attacker {a}):\n  " + "\n  ".join(problems) \
        + f"\n--- server stderr ---\n{srv.stderr()[-2000:]}"


def garbage_problems(case, a, srv, peer):
    problems = []
    if a["outcome"] not in ("eof", "reset"):
        problems.append(f"the server's side did not close the connection within "
                        f"{ATTACK_WAIT} s (outcome {a['outcome']!r})")
    if a["received_hex"]:
        problems.append(f"the server sent {len(a['received_hex']) // 2} bytes on a connection "
                        f"it should reject: {a['received_hex'][:96]}")

    reason = GARBAGE[case] or f"malformed frame: bad frame magic 0x{a['first_byte']:02x}"
    want = f"virtual connection {a['gid']} with {peer}: {reason}; closing it " \
           "(the program sees ECONNRESET)"
    log = srv.stderr()
    if want not in log:
        problems.append(f"the layer did not log {want!r}")

    rec = closed_record(srv, peer)
    if rec is None:
        problems.append("the server program never saw the connection end (it is still "
                        "waiting on it)")
    else:
        if not rec["error"] or "ConnectionResetError" not in rec["error"]:
            seen = rec["error"] or "a clean end of stream (once the attacker gave up and closed)"
            problems.append(f"the server program saw {seen}, expected ConnectionResetError")
        # A data frame whose payload is in order may reach the program before its bogus ack
        # is noticed; nothing else may.
        allowed = {0, 5} if case == "data_ack_beyond" else {0}
        if rec["received"] not in allowed:
            problems.append(f"the server program received {rec['received']} bytes of garbage")
        if rec["sent"]:
            problems.append(f"the server program managed to send {rec['sent']} bytes")
    return problems


def check_valid(a, srv, peer):
    f1, f2 = a["frames"]
    # The echo of 'hello': our 5 bytes delivered, its own stream starts at 0.
    assert f1 == {"magic": 0xA7, "kind": 1, "flags": 0, "len": 5, "seq": 0, "ack": 5,
                  "payload": "hello"}, a
    # The echo of 'world!': its stream at 5, our 11 bytes delivered.
    assert f2 == {"magic": 0xA7, "kind": 1, "flags": 0, "len": 6, "seq": 5, "ack": 11,
                  "payload": "world!"}, a
    assert a["outcome"] == "eof" and a["received_hex"] == "", \
        f"after our end of stream the server should close cleanly with nothing more: {a}"
    rec = closed_record(srv, peer)
    assert rec == {"event": "closed", "peer": peer, "received": 11, "sent": 11,
                   "error": None}, rec
    assert "closing it" not in srv.stderr(), srv.stderr()
