"""Programs under the layer in a host with no agent (vmit3) fall back to plain TCP."""

import hashlib
import os

from helpers import (H1, H1_IP, H2, H3, H3_IP, NO_AGENT_HOST, PORTS, PYTHON, Watcher,
                     VmictlError, assert_plain, assert_same_stream, python_prog, vmictl_status)

MiB = 1 << 20
BANNER_DEADLINE = 1.0


def test_no_agent_really_absent(topology):
    try:
        vmictl_status(NO_AGENT_HOST)
    except VmictlError:
        return
    raise AssertionError(f"vmictl found an agent in {NO_AGENT_HOST}, which must have none")


def test_no_agent_curl_http_server(procs, workdir):
    port = PORTS["http_no_agent"]
    served = workdir / "www"
    served.mkdir()
    data = os.urandom(8 * MiB)
    (served / "file").write_bytes(data)
    out = workdir / "download"
    srv = procs.server(H3, [PYTHON, "-m", "http.server", port, "--bind", H3_IP, "--directory",
                            served], port, layer=True, name="http-server")
    srv.assert_layer_loaded()
    procs.run(H3, ["curl", "-sS", "--fail", "--max-time", "30", "-o", out,
                   f"http://{H3_IP}:{port}/file"], layer=True, name="curl", timeout=35)
    assert hashlib.sha256(out.read_bytes()).digest() == hashlib.sha256(data).digest()


def test_no_agent_client_to_layered_server(procs):
    """Layered client without an agent (host 3) to a layered server with one (host 1)."""
    port = PORTS["no_agent_stream_out"]
    addr = f"{H1_IP}:{port}"
    srv = procs.server(H1, python_prog("stream.py", "server", "--bind", addr, "--count", "1",
                                       "--hold", "1"),
                       port, layer=True, name="stream-server")
    with Watcher(H1) as w:
        cli = procs.start(H3, python_prog("stream.py", "client", "--connect", addr,
                                          "--bytes", 8 * MiB, "--seed", port, "--hold", "1"),
                          layer=True, name="stream-client")
        cli.assert_layer_loaded()
        cli.wait(timeout=40)
        srv.wait(timeout=10)
    assert_same_stream(cli.last_json(), srv.last_json())
    assert_plain(w, addr, server_host=H1)


def test_no_agent_server_speaks_first(procs):
    """Layered client with an agent (host 2) to a layered greeting server without one (host
    3): the client's side must learn quickly that the peer is plain."""
    port = PORTS["no_agent_banner_in"]
    addr = f"{H3_IP}:{port}"
    srv = procs.server(H3, python_prog("banner.py", "server", "--bind", addr), port,
                       layer=True, name="banner-server")
    srv.assert_layer_loaded()
    with Watcher(H2) as w:
        cli = procs.run(H2, python_prog("banner.py", "client", "--connect", addr,
                                        "--hold", "1"),
                        layer=True, name="banner-client", timeout=30, check=False)
    r = cli.last_json()
    assert r["banner_ok"], f"greeting not received byte-exact: {r}"
    assert r["banner_seconds"] < BANNER_DEADLINE, \
        f"greeting took {r['banner_seconds']:.3f} s to arrive (limit {BANNER_DEADLINE} s)"
    assert r["echo_ok"] and cli.returncode == 0, r
    assert_plain(w, addr, client_host=H2)
