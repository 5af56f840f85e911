"""An asyncio echo server and 300 concurrent asyncio clients, across hosts, all layered; and
a client that opens and closes connections one after the other."""

import pytest

from helpers import (H1, H1_IP, H2, PLACES, PORTS, PYTHON, Watcher, assert_virtual, place,
                     python_prog)

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


SEQUENTIAL = 40

# Connects, reads the banner, sends a line, reads it back, closes; SEQUENTIAL times, one
# connection after the other (the last one held a second, for vmictl to see). Prints the
# number of connections that went right.
SEQUENTIAL_CLIENT = r"""
import socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ok = 0
for i in range(n):
    s = socket.create_connection((host, port))
    f = s.makefile("rb")
    f.readline()
    line = b"line %d\n" % i
    s.sendall(line)
    ok += f.readline() == line
    if i == n - 1:
        time.sleep(1)
    f.close()
    s.close()
print(ok, flush=True)
"""


def test_sequential_connections_share_one_closing_thread(procs, tmp_path):
    """A client that opens and closes connections one after the other (as one that fetches
    a page per connection does): after each close the layer reads what the peer's layer
    still sends (its last acknowledgements) on a thread of its own, and that thread must
    serve the whole run instead of being started for each connection (a thread per
    connection cost a third of the layer's extra time per connection in a sequential
    connect-and-close loop). strace counts the threads the client starts."""
    port = PORTS["sequential_closes"]
    addr = f"{H1_IP}:{port}"
    procs.server(H1, python_prog("banner.py", "server", "--bind", addr), port, layer=True,
                 name="banner-server")
    trace = tmp_path / "clone.trace"
    with Watcher(H1, H2) as w:
        cli = procs.run(H2, ["strace", "-f", "-qq", "-e", "trace=clone,clone3", "-o", trace,
                             PYTHON, "-c", SEQUENTIAL_CLIENT, H1_IP, port, SEQUENTIAL],
                        layer=True, name="sequential-client", timeout=60)
    assert cli.stdout().split()[-1:] == [str(SEQUENTIAL)], cli.failure("connections went wrong")
    assert_virtual(w, H1, addr, H2, min_conns=1)
    clones = [line for line in trace.read_text().splitlines() if "clone" in line]
    # The control thread, the closing thread, and a little room (never one per connection).
    assert len(clones) <= 4, f"{len(clones)} threads started for {SEQUENTIAL} connections:\n" + \
        "\n".join(clones[:10])

