"""Mixed pairs: only one side runs the layer. Such connections must stay plain TCP, byte for
byte, with nothing added and no delay, in both directions and for protocols where the server
speaks first."""

import pytest

from helpers import (H1, H1_IP, H2, PORTS, Watcher, assert_plain, assert_same_stream,
                     python_prog)

MiB = 1 << 20
BANNER_DEADLINE = 1.0  # seconds from connect() to the whole greeting

# (name, server layered, client layered)
SIDES = [("plain_server", False, True), ("plain_client", True, False)]
IDS = [s[0] for s in SIDES]


def layered_proc(srv, cli, server_layered):
    return srv if server_layered else cli


@pytest.mark.parametrize("name,server_layer,client_layer", SIDES, ids=IDS)
def test_mixed_iperf3(procs, name, server_layer, client_layer):
    port = PORTS[f"mixed_iperf3_{name}"]
    addr = f"{H1_IP}:{port}"
    srv = procs.server(H1, ["iperf3", "-s", "-B", H1_IP, "-p", port], port,
                       layer=server_layer, name="iperf3-server")
    with Watcher(H1, H2) as w:
        cli = procs.start(H2, ["iperf3", "-c", H1_IP, "-p", port, "-t", "2", "--json"],
                          layer=client_layer, name="iperf3-client")
        layered_proc(srv, cli, server_layer).assert_layer_loaded()
        cli.wait(timeout=30)
    res = cli.json()
    assert "error" not in res, res["error"]
    assert res["end"]["sum_received"]["bits_per_second"] > 0, res["end"]
    assert_plain(w, addr, server_host=H1, client_host=H2)


@pytest.mark.parametrize("name,server_layer,client_layer", SIDES, ids=IDS)
def test_mixed_stream(procs, name, server_layer, client_layer):
    port = PORTS[f"mixed_stream_{name}"]
    addr = f"{H1_IP}:{port}"
    srv = procs.server(H1, python_prog("stream.py", "server", "--bind", addr, "--count", "1",
                                       "--hold", "1"),
                       port, layer=server_layer, name="stream-server")
    with Watcher(H1, H2) as w:
        cli = procs.start(H2, python_prog("stream.py", "client", "--connect", addr,
                                          "--bytes", 16 * MiB, "--seed", port, "--hold", "1"),
                          layer=client_layer, name="stream-client")
        layered_proc(srv, cli, server_layer).assert_layer_loaded()
        cli.wait(timeout=40)
        srv.wait(timeout=10)
    assert_same_stream(cli.last_json(), srv.last_json())
    assert_plain(w, addr, server_host=H1, client_host=H2)


@pytest.mark.parametrize("name,server_layer,client_layer", SIDES, ids=IDS)
def test_mixed_server_speaks_first(procs, name, server_layer, client_layer):
    port = PORTS[f"mixed_banner_{name}"]
    addr = f"{H1_IP}:{port}"
    srv = procs.server(H1, python_prog("banner.py", "server", "--bind", addr), port,
                       layer=server_layer, name="banner-server")
    with Watcher(H1, H2) as w:
        cli = procs.start(H2, python_prog("banner.py", "client", "--connect", addr,
                                          "--hold", "1"),
                          layer=client_layer, name="banner-client")
        layered_proc(srv, cli, server_layer).assert_layer_loaded()
        cli.wait(timeout=30, check=False)
    r = cli.last_json()
    assert r["banner_ok"], f"greeting not received byte-exact: {r}"
    assert r["banner_seconds"] < BANNER_DEADLINE, \
        f"greeting took {r['banner_seconds']:.3f} s to arrive (limit {BANNER_DEADLINE} s)"
    assert r["echo_ok"] and "error" not in r, r
    assert cli.returncode == 0, r
    assert_plain(w, addr, server_host=H1, client_host=H2)


def test_layer_disabled_stays_plain(procs):
    """VMI_DISABLE=1: both sides preload the layer but switch it off."""
    port = PORTS["mixed_disabled"]
    addr = f"{H1_IP}:{port}"
    off = {"VMI_DISABLE": "1"}
    srv = procs.server(H1, python_prog("stream.py", "server", "--bind", addr, "--count", "1",
                                       "--hold", "1"),
                       port, layer=True, env=off, name="stream-server")
    with Watcher(H1, H2) as w:
        cli = procs.run(H2, python_prog("stream.py", "client", "--connect", addr,
                                        "--bytes", 4 * MiB, "--seed", port, "--hold", "1"),
                        layer=True, env=off, name="stream-client", timeout=40)
        srv.wait(timeout=10)
    assert_same_stream(cli.last_json(), srv.last_json())
    assert_plain(w, addr, server_host=H1, client_host=H2)
