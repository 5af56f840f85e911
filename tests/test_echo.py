"""An asyncio echo server and 300 concurrent asyncio clients, across hosts, all layered."""

import pytest

from helpers import H1, H1_IP, PLACES, Watcher, assert_virtual, place, python_prog

CLIENTS = 300


@pytest.mark.parametrize("where", list(PLACES))
def test_asyncio_echo_300_clients(procs, where):
    host, env, substrate, port = place(where, "echo")
    addr = f"{H1_IP}:{port}"
    procs.server(H1, python_prog("echo_server.py", "--bind", addr), port, layer=True,
                 name="echo-server", env=env)
    with Watcher(H1, host) as w:
        cli = procs.run(host, python_prog("echo_clients.py", "--connect", addr, "--clients",
                                        CLIENTS, "--messages", "20", "--max-size", "65536",
                                        "--seed", "3", "--hold", "1"),
                        layer=True, name="echo-clients", timeout=50, env=env)
    r = cli.last_json()
    assert r["mismatches"] == 0 and r["error_count"] == 0, r
    assert r["completed"] == CLIENTS and r["messages"] == CLIENTS * 20, r
    assert r["bytes_received"] == r["bytes_sent"], r
    assert_virtual(w, H1, addr, host, min_conns=CLIENTS, c2s_bytes=r["bytes_sent"],
                   s2c_bytes=r["bytes_received"], exact=True, substrate=substrate)
