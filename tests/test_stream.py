"""Checksummed two-way streams (tests/programs/stream.py) between layered programs."""

import time

import pytest

from helpers import (H1, H1_IP, H1_IP1, H2, LOOPBACK, PORTS, Watcher, assert_same_stream,
                     assert_virtual, python_prog)

MiB = 1 << 20

CASES = [
    # name, server host, server ip, client host, client->server bytes, server->client bytes
    ("net0", H1, H1_IP, H2, 32 * MiB, 24 * MiB),
    ("net1", H1, H1_IP1, H2, 8 * MiB, 8 * MiB),
    ("local", H1, H1_IP, H1, 16 * MiB, 16 * MiB),
    ("loopback", H1, LOOPBACK, H1, 16 * MiB, 16 * MiB),
    ("tiny", H1, H1_IP, H2, 1, 0),
]


@pytest.mark.parametrize("name,server_host,server_ip,client_host,up,down", CASES,
                         ids=[c[0] for c in CASES])
def test_stream(procs, name, server_host, server_ip, client_host, up, down):
    port = PORTS[f"stream_{name}"]
    addr = f"{server_ip}:{port}"
    srv = procs.server(server_host, python_prog("stream.py", "server", "--bind", addr,
                                                "--count", "1", "--hold", "1"),
                       port, layer=True, name="stream-server")
    with Watcher(server_host, client_host) as w:
        cli = procs.run(client_host,
                        python_prog("stream.py", "client", "--connect", addr, "--bytes", up,
                                    "--server-bytes", down, "--seed", port, "--hold", "1"),
                        layer=True, name="stream-client", timeout=50)
        srv.wait(timeout=10)
    c, s = cli.last_json(), srv.last_json()
    assert c["sent_bytes"] == up and c["recv_bytes"] == down, c
    assert_same_stream(c, s)
    assert c["peer"] == addr and s["local"] == addr, (c, s)
    # The client also sent stream.py's 24-byte header on the connection.
    assert_virtual(w, server_host, addr, client_host, c2s_bytes=up + 24, s2c_bytes=down,
                   exact=True, client_pid=cli.pid)


@pytest.mark.parametrize("name,client_host", [("net0", H2), ("local", H1)])
def test_a_client_that_starts_before_its_server_gets_a_virtual_connection(procs, name,
                                                                         client_host):
    # The client tries every 5 ms from before the server runs: the layer must neither keep
    # the refusals' answer ("no listener there") nor let a connect slip in between the
    # server's listen and the agent learning of it.
    port = PORTS[f"stream_early_{name}"]
    addr = f"{H1_IP}:{port}"
    with Watcher(H1, client_host) as w:
        cli = procs.start(client_host,
                          python_prog("stream.py", "client", "--connect", addr, "--bytes", MiB,
                                      "--seed", port, "--retry", 20, "--hold", "1"),
                          layer=True, name="early-client")
        time.sleep(0.7)
        if not cli.alive():
            raise cli.failure("the client gave up before the server started")
        srv = procs.start(H1, python_prog("stream.py", "server", "--bind", addr, "--count", "1",
                                          "--hold", "1"),
                          layer=True, name="late-server")
        cli.wait(timeout=40)
        srv.wait(timeout=10)
    c, s = cli.last_json(), srv.last_json()
    assert c["tries"] > 10, f"the client did not try before the server listened: {c}"
    assert_same_stream(c, s)
    assert_virtual(w, H1, addr, client_host, c2s_bytes=MiB + 24, s2c_bytes=MiB, exact=True,
                   client_pid=cli.pid)


@pytest.mark.parametrize("chain", ["none", "double"])
def test_a_close_right_after_a_send_taken_in_part_loses_nothing(procs, chain):
    """The client sends without blocking until the kernel takes only part of a frame (the
    server reads nothing for a second), then closes at once: the rest of that frame is still
    in the layer's ring. The end of stream must go after it, never before: a FIN in the middle
    of a frame cut the stream short (with a chain, the peer's layer waited for good for the
    rest of a coded frame). The server reads every byte the client's sends accepted."""
    port = PORTS["close_mid_frame" + ("_chain" if chain != "none" else "")]
    addr = f"{H1_IP}:{port}"
    env = {"VMI_CHAIN": chain}
    srv = procs.server(H1, python_prog("close_mid_frame.py", "server", "--addr", addr,
                                       "--delay", "1"), port, layer=True, env=env,
                       name="mid-frame-server")
    cli = procs.run(H2, python_prog("close_mid_frame.py", "client", "--addr", addr), layer=True,
                    env=env, name="mid-frame-client", timeout=30)
    srv.wait(timeout=30)
    c, s = cli.last_json(), srv.last_json()
    assert c["sent"] > 0, c
    assert s["error"] is None and s["received"] == c["sent"] and s["sha256"] == c["sha256"], (c, s)
