"""A forking server: connections inherited across fork(), used by the child, the parent, or
both."""

import pytest

from helpers import H1, H1_IP, PLACES, Watcher, assert_virtual, place, python_prog

CONNECTIONS = 8


@pytest.mark.parametrize("where", list(PLACES))
def test_fork_child_serves(procs, where):
    host, env, substrate, port = place(where, "fork_hash")
    addr = f"{H1_IP}:{port}"
    srv = procs.server(H1, python_prog("fork_server.py", "--bind", addr, "--mode", "hash",
                                       "--hold", "1"),
                       port, layer=True, name="fork-server", env=env)
    with Watcher(H1, host) as w:
        cli = procs.run(host, python_prog("fork_client.py", "--connect", addr, "--mode", "hash",
                                        "--connections", CONNECTIONS,
                                        "--max-bytes", 4 << 20, "--seed", "11"),
                        layer=True, name="fork-client", timeout=40, env=env)
    r = cli.last_json()
    assert r["ok"] == CONNECTIONS and not r["errors"], r
    # The parent closed its copy at once: the latest records name the children.
    assert_virtual(w, H1, addr, host, min_conns=CONNECTIONS, c2s_bytes=r["bytes"], exact=True,
                   client_pid=cli.pid, server_pids_not={srv.pid}, substrate=substrate)
    assert srv.alive(), "the forking server died"


@pytest.mark.parametrize("where", list(PLACES))
def test_fork_parent_and_child_both_write(procs, where):
    host, env, substrate, port = place(where, "fork_both")
    addr = f"{H1_IP}:{port}"
    srv = procs.server(H1, python_prog("fork_server.py", "--bind", addr, "--mode", "both",
                                       "--hold", "1"),
                       port, layer=True, name="fork-server", env=env)
    with Watcher(H1, host) as w:
        cli = procs.run(host, python_prog("fork_client.py", "--connect", addr, "--mode", "both",
                                        "--connections", "2"),
                        layer=True, name="fork-client", timeout=40, env=env)
    r = cli.last_json()
    assert r["ok"] == 2 and not r["errors"], r
    # "child\n" is sent before the snapshots of the parent's one-second wait.
    assert_virtual(w, H1, addr, host, min_conns=2, client_pid=cli.pid, substrate=substrate)
    assert srv.alive(), "the forking server died"
