"""Shared memory between two programs on one node (VMI_SHM=1): the bytes go through rings
in memory both processes map, the descriptor stays the TCP socket and carries only wake-ups.

Checked with the checksummed stream program: equal SHA-256 both ways, exact byte counts, the
connection listed as "shm" at both ends by `vmictl status --json`. A layer that does not
take shared memory answers the offer with a refusal, and a layer that does not offer it is
not asked: both connections then carry TCP frames. Programs on two hosts never use it.
"""

import pytest

from helpers import (BASELINE, H1, H1_IP, H2, LOOPBACK, PORTS, Watcher, assert_same_stream,
                     assert_virtual, python_prog)

pytestmark = pytest.mark.skipif(BASELINE, reason="shared memory is the layer's work")

MiB = 1 << 20
ON = {"VMI_SHM": "1"}
OFF = {"VMI_SHM": "0"}


def stream(procs, port_name, server_ip, *, up, down, srv_env, cli_env, client_host=H1,
           extra=()):
    port = PORTS[port_name]
    addr = f"{server_ip}:{port}"
    srv = procs.server(H1, python_prog("stream.py", "server", "--bind", addr, "--count", "1",
                                       "--hold", "1"), port, layer=True, name="stream-server",
                       env=srv_env)
    with Watcher(H1, client_host) as w:
        cli = procs.run(client_host,
                        python_prog("stream.py", "client", "--connect", addr, "--bytes", up,
                                    "--server-bytes", down, "--seed", port, "--hold", "1",
                                    *extra),
                        layer=True, name="stream-client", timeout=60, env=cli_env)
        srv.wait(timeout=10)
    c, s = cli.last_json(), srv.last_json()
    assert c["sent_bytes"] == up and c["recv_bytes"] == down, c
    assert_same_stream(c, s)
    return w, addr, cli


@pytest.mark.parametrize("name,ip", [("local", H1_IP), ("loopback", LOOPBACK)])
def test_stream_over_shared_memory(procs, name, ip):
    w, addr, cli = stream(procs, f"shm_stream_{name}", ip, up=64 * MiB, down=48 * MiB,
                          srv_env=ON, cli_env=ON)
    assert_virtual(w, H1, addr, H1, c2s_bytes=64 * MiB + 24, s2c_bytes=48 * MiB, exact=True,
                   client_pid=cli.pid, substrate="shm")


def test_refused_offer_uses_tcp(procs):
    """The client offers, the server's layer has VMI_SHM=0: it refuses, both use TCP."""
    w, addr, _ = stream(procs, "shm_refused", H1_IP, up=8 * MiB, down=8 * MiB, srv_env=OFF,
                        cli_env=ON)
    assert_virtual(w, H1, addr, H1, c2s_bytes=8 * MiB + 24, s2c_bytes=8 * MiB, exact=True,
                   substrate="tcp")


def test_no_offer_uses_tcp(procs):
    w, addr, _ = stream(procs, "shm_not_offered", H1_IP, up=4 * MiB, down=4 * MiB,
                        srv_env=ON, cli_env=OFF)
    assert_virtual(w, H1, addr, H1, substrate="tcp")


def test_two_hosts_use_tcp(procs):
    w, addr, _ = stream(procs, "shm_other_host", H1_IP, up=4 * MiB, down=4 * MiB,
                        srv_env=ON, cli_env=ON, client_host=H2)
    assert_virtual(w, H1, addr, H2, substrate="tcp")
