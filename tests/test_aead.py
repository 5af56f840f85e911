"""The `aead` devices: every frame sealed (AES-256-GCM or ChaCha20-Poly1305) under a key each
chain gets from its own X25519 exchange, inside the chain's offer and answer.

Shown here: loaded and unloaded on a live checksummed stream of words (data an observer could
read) moving both ways, the wire carries none of the words while a sealing device is on and
plenty while none is (a capture of the client's interface with tcpdump); each side takes a new
key on the schedule `VMI_REKEY` sets; and records altered on the way (a flipped bit, a record
replayed at another offset, a record sealed under another key), and frames slipped in that a
sealed stream only takes with a tag (an end of stream, an offer turning the sealing off, bytes
in clear) close the connection with a log line that says what was wrong and ECONNRESET for
the program; acknowledgements of a sealed stream count only with a tag under the
connection's secret (one slipped in with none is not counted, and the stream survives a
failover after it; one with a forged tag closes the connection). (Failover, exec, fork and
migration under a sealed chain are in test_chain.py, the "chain" place of the real-program
tests and test_migration.py.)
"""

import json
import re
import time

import pytest

from helpers import (BASELINE, ETH0, ETH1, H1, H2, H2_IP, PORTS, Watcher, assert_same_stream,
                     both_ways, python_prog, vmictl_ok, wait_conn, wait_for, words_on_wire)

pytestmark = pytest.mark.skipif(BASELINE, reason="devices are the layer's: on plain TCP there "
                                "is nothing to test")

MiB = 1 << 20
CLIENT, SERVER = H1, H2
def test_aead_loaded_live_seals_the_wire_and_takes_new_keys(procs, tmp_path):
    """Words move both ways; `aead` is loaded on the connection (from the client's node),
    unloaded through the other node's agent, and `lz4` then `aead:chacha20-poly1305` loaded
    and unloaded. While a sealing device is on, a capture of the wire holds none of the words;
    with none on, it holds thousands. VMI_REKEY=1M makes each side take a new key for every
    MiB it seals. The streams stay exact."""
    port = PORTS["aead_live"]
    addr = f"{H2_IP}:{port}"
    rate, seconds = 3 * MiB, 16
    n = rate * seconds
    env = {"VMI_LOG": "info", "VMI_REKEY": "1M"}
    srv = procs.server(SERVER, python_prog("stream.py", "server", "--bind", addr, "--count", "1",
                                           "--hold", "1", "--rate", rate, "--text"), port,
                       layer=True, env=env, name="stream-server")
    cli = procs.start(CLIENT, python_prog("stream.py", "client", "--connect", addr, "--bytes", n,
                                          "--server-bytes", n, "--seed", port, "--rate", rate,
                                          "--hold", "1", "--text"),
                      layer=True, env=env, name="stream-client")
    c = wait_conn(CLIENT, addr, lambda c: c.get("bytes_sent", 0) > 0
                  and c.get("bytes_received", 0) > 0, 10, "the stream moving both ways")
    gid = c["gid"]
    plain, _ = words_on_wire(CLIENT, tmp_path, "plain")
    assert plain > 1000, f"the plain stream's words should be on the wire: {plain}"

    vmictl_ok(CLIENT, "device", "load", "aead", "--gid", gid)
    both_ways(gid, "aead:aes-256-gcm")
    sealed, size = words_on_wire(CLIENT, tmp_path, "aes")
    assert sealed == 0, f"{sealed} words in {size} bytes of the wire under aead"
    time.sleep(1)
    vmictl_ok(CLIENT, "--node", H2_IP, "device", "unload", "aead", "--gid", gid)
    both_ways(gid, "")

    vmictl_ok(CLIENT, "device", "load", "lz4", "--gid", gid)
    both_ways(gid, "lz4")
    vmictl_ok(CLIENT, "--node", H2_IP, "device", "load", "aead:chacha20-poly1305", "--gid", gid)
    both_ways(gid, "lz4,aead:chacha20-poly1305")
    sealed, size = words_on_wire(CLIENT, tmp_path, "chacha")
    assert sealed == 0, f"{sealed} words in {size} bytes of the wire under lz4,chacha20"
    time.sleep(1)
    vmictl_ok(CLIENT, "device", "unload", "aead:chacha20-poly1305", "--gid", gid)
    both_ways(gid, "lz4")
    vmictl_ok(CLIENT, "device", "unload", "lz4", "--gid", gid)
    both_ways(gid, "")

    cli.wait(timeout=seconds + 30)
    srv.wait(timeout=10)
    c, s = cli.last_json(), srv.last_json()
    assert c["sent_bytes"] == n and c["recv_bytes"] == n, c
    assert_same_stream(c, s)
    for p in (cli, srv):
        rekeys = p.stderr().count("takes a new key")
        assert rekeys >= 2, f"{p.name} took {rekeys} new keys under VMI_REKEY=1M"


@pytest.mark.parametrize("attack,logged", [
    ("flip", "a sealed record failed authentication"),
    ("replay", "a replayed record"),
    ("foreign", "a sealed record failed authentication"),
    ("share", "a key share of a chain offer or answer failed authentication"),
    ("fin", "an end of stream with no tag on a sealed stream failed authentication"),
    ("offer", "a change of chain on a sealed stream failed authentication"),
    ("clear", "a data frame in clear on a sealed stream failed authentication"),
])
def test_aead_refuses_altered_records(procs, attack, logged):
    """The client's layer alters its 20th sealed frame (VMI_TAMPER, as an attacker on the
    path would): a flipped bit, the record of the frame before it, or a record sealed under
    another key; or the key share of its first offer (an attacker putting its own share in
    the exchange); or it slips in, before that frame, an end of stream (a truncation), an
    offer of a chain that does not seal (turning the sealing off), or bytes in clear, none
    with the tag a sealed stream owes. The server's layer refuses it, says why in its log,
    and the server program sees ECONNRESET; nothing altered reaches it (and no early end of
    stream either)."""
    port = {"flip": 0, "replay": 1, "foreign": 2, "share": 6}.get(attack)
    port = PORTS["aead_attack"] + port if port is not None else \
        PORTS["aead_slip"] + ["fin", "offer", "clear"].index(attack)
    addr = f"{H2_IP}:{port}"
    n = 8 * MiB
    srv = procs.server(SERVER, python_prog("stream.py", "server", "--bind", addr, "--count", "1",
                                           "--hold", "0"), port, layer=True,
                       env={"VMI_LOG": "info"}, name="stream-server")
    cli = procs.start(CLIENT, python_prog("stream.py", "client", "--connect", addr, "--bytes", n,
                                          "--server-bytes", 0, "--seed", port, "--rate", 4 * MiB),
                      layer=True, name="stream-client",
                      env={"VMI_CHAIN": "aead", "VMI_LOG": "info", "VMI_GRACE": "3",
                           "VMI_TAMPER": f"{attack}:{1 if attack == 'share' else 20}"})
    srv.wait(timeout=30, check=False)
    s = srv.last_json()
    assert "error" in s and "ConnectionResetError" in s["error"], (json.dumps(s), srv.stderr()[-3000:])
    assert s.get("recv_bytes", 0) < n, s
    log = srv.stderr()
    assert logged in log and "ECONNRESET" in log, log[-2000:]
    assert ("chain offer 1" if attack == "share" else "sealed frame 20") in cli.stderr(), \
        cli.stderr()[-2000:]
    cli.stop()


def forged_ack_run(procs, attack, port, rate, n, pauses=(), window="2M"):
    """A stream from the client to the server, sealed both ways (VMI_CHAIN=aead), whose
    server's layer slips in a forged acknowledgement before the first it sends alone."""
    addr = f"{H2_IP}:{port}"
    env = {"VMI_CHAIN": "aead", "VMI_LOG": "info"}
    pause = [a for at, s in pauses for a in ("--pause", f"{at}:{s}")]
    srv = procs.server(SERVER, python_prog("stream.py", "server", "--bind", addr, "--count", "1",
                                           "--hold", "1", *pause), port, layer=True,
                       env={**env, "VMI_TAMPER": f"{attack}:1"}, name="stream-server")
    cli = procs.start(CLIENT, python_prog("stream.py", "client", "--connect", addr, "--bytes", n,
                                          "--server-bytes", 0, "--seed", port, "--rate", rate,
                                          "--hold", "1"),
                      layer=True, env={**env, "VMI_GRACE": "20", "VMI_WINDOW": window},
                      name="stream-client")
    return addr, srv, cli


def test_an_acknowledgement_with_no_tag_does_not_count_on_a_sealed_stream(procs, faults):
    """Someone on the path slips into a sealed stream's other direction an acknowledgement
    with no tag that claims more than the receiving program has read (VMI_TAMPER=ack:1 on the
    server: seven eighths of the bytes waiting in its socket besides, which the server lets
    pile up by not reading for a while; the client's window is 4 MiB, so the first
    acknowledgement alone goes at 2.5 MiB, and the server stops reading again right there).
    Counted, it would make the client's layer drop from its replay ring bytes the server has
    not read, lost when the network then fails (or the true acknowledgements that follow,
    saying less, would end the connection). The client's layer counts no acknowledgement
    without a tag once the server took its sealing chain: what it counts as acknowledged never
    passes what the server delivered, the link is rebuilt on the other network, and the stream
    arrives exact."""
    # (The layer's count includes the program's 24-byte header: the read that reaches this
    # point delivers 2.5 MiB and one byte, and sends the acknowledgement first.)
    stop_at = 5 * MiB // 2 - 24 + 1
    n = 6 * MiB
    addr, srv, cli = forged_ack_run(procs, "ack", PORTS["aead_ack_forged"], MiB, n,
                                    pauses=((2 * MiB, 1.5), (stop_at, 5)), window="4M")
    with Watcher(SERVER, CLIENT):
        line = wait_for("the forged acknowledgement", lambda: re.search(
            r"with no tag claiming (\d+) \(delivered (\d+)\)", srv.stderr()), 20)
        claim, delivered = int(line.group(1)), int(line.group(2))
        # (Meaningful only if it claims bytes the server will not have read at the failure.)
        assert claim > stop_at + 128 * 1024, f"claimed {claim}, delivered {delivered}"
        # The client keeps sending (1 MiB/s, within what the sockets hold), so its layer
        # applies what it read of the acknowledgements; it never counts more than the server
        # delivered (read first, the server's count then: that only grows).
        c = wait_conn(CLIENT, addr, lambda c: c.get("bytes_sent", 0) - c.get("unacked_bytes", 0)
                      >= delivered, 4, "the client's layer applying the acknowledgement")
        acked = c["bytes_sent"] - c["unacked_bytes"]
        s = wait_conn(SERVER, addr, lambda s: True, 5, "the server's end", side="server")
        assert acked <= s["bytes_received"], \
            f"counted {acked} acknowledged, the server delivered {s['bytes_received']}"
        faults.link_down(CLIENT, ETH0)
        wait_conn(CLIENT, addr, lambda e: e.get("gid") == c["gid"] and e.get("network") == ETH1
                  and (e.get("failovers") or 0) >= 1, 20, "the connection moved to eth1")
        cli.wait(timeout=60)
        srv.wait(timeout=15)
    c2, s = cli.last_json(), srv.last_json()
    assert "error" not in c2 and "error" not in s, (c2, s, cli.stderr()[-2000:])
    assert c2["sent_bytes"] == n and s["recv_bytes"] == n, (c2, s)
    assert_same_stream(c2, s)
    assert "failed authentication" not in cli.stderr() + srv.stderr()
    assert 'what it sends goes through chain "aead:aes-256-gcm"' in cli.stderr(), cli.stderr()[-2000:]


def test_an_acknowledgement_with_a_forged_tag_closes_the_connection(procs):
    """The same, with an acknowledgement whose tag was not made with the connection's
    secret (VMI_TAMPER=acktag:1): the client's layer refuses it, says so in its log, and the
    client program sees ECONNRESET."""
    addr, srv, cli = forged_ack_run(procs, "acktag", PORTS["aead_ack_tag"], 8 * MiB, 16 * MiB)
    cli.wait(timeout=30, check=False)
    c = cli.last_json()
    assert "error" in c and "ConnectionResetError" in c["error"], (json.dumps(c), cli.stderr()[-3000:])
    log = cli.stderr()
    assert "an acknowledgement on a sealed stream failed authentication" in log and "ECONNRESET" in log, \
        log[-2000:]
    assert "with a forged tag claiming" in srv.stderr(), srv.stderr()[-2000:]
    srv.stop()
