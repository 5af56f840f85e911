"""iperf3 between layered client and server."""

import pytest

from helpers import H1, H1_IP, LOOPBACK, PLACES, PORTS, Watcher, assert_virtual, place


def iperf3_result(proc):
    """Parsed `iperf3 --json` output of a client, checked for errors and throughput."""
    res = proc.json()
    assert "error" not in res, f"iperf3 reported an error: {res['error']}"
    end = res["end"]
    sent, received = end["sum_sent"], end["sum_received"]
    assert sent["bytes"] > 0 and received["bytes"] > 0, end
    assert sent["bits_per_second"] > 0 and received["bits_per_second"] > 0, end
    return res


CROSS = [("plain", []), ("parallel4", ["-P", "4"]), ("reverse", ["-R"])]


@pytest.mark.parametrize("where", list(PLACES))
@pytest.mark.parametrize("name,extra", CROSS, ids=[c[0] for c in CROSS])
def test_iperf3(procs, name, extra, where):
    host, env, substrate, port = place(where, f"iperf3_{name}")
    addr = f"{H1_IP}:{port}"
    procs.server(H1, ["iperf3", "-s", "-B", H1_IP, "-p", port], port, layer=True,
                 name="iperf3-server", env=env)
    with Watcher(H1, host) as w:
        cli = procs.run(host, ["iperf3", "-c", H1_IP, "-p", port, "-t", "3", "--json", *extra],
                        layer=True, name="iperf3-client", timeout=40, env=env)
    res = iperf3_result(cli)
    streams = int(extra[1]) if "-P" in extra else 1
    moved = res["end"]["sum_received"]["bytes"]
    flow = {"s2c_bytes": moved} if "-R" in extra else {"c2s_bytes": moved}
    # One control connection plus one connection per stream.
    assert_virtual(w, H1, addr, host, min_conns=1 + streams, substrate=substrate, **flow)


LOCAL = [("local_eth0", H1_IP), ("local_lo", LOOPBACK)]


@pytest.mark.parametrize("name,ip", LOCAL, ids=[c[0] for c in LOCAL])
def test_iperf3_within_host(procs, name, ip):
    port = PORTS[f"iperf3_{name}"]
    addr = f"{ip}:{port}"
    procs.server(H1, ["iperf3", "-s", "-B", ip, "-p", port], port, layer=True,
                 name="iperf3-server")
    with Watcher(H1) as w:
        cli = procs.run(H1, ["iperf3", "-c", ip, "-p", port, "-t", "3", "--json"],
                        layer=True, name="iperf3-client", timeout=40)
    res = iperf3_result(cli)
    assert_virtual(w, H1, addr, H1, min_conns=2,
                   c2s_bytes=res["end"]["sum_received"]["bytes"])
