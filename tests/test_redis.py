"""redis-server, redis-benchmark and redis-cli, all under the layer."""

import os
import re

import pytest

from helpers import H1, H1_IP, H2, PLACES, PORTS, Watcher, assert_virtual, place


def redis_server(procs, port, env=None):
    return procs.server(H1, ["redis-server", "--port", port, "--bind", H1_IP, "--save", "",
                             "--appendonly", "no", "--protected-mode", "no"],
                        port, layer=True, name="redis-server", env=env)


@pytest.mark.parametrize("where", list(PLACES))
def test_redis_benchmark(procs, where):
    host, env, substrate, port = place(where, "redis_benchmark")
    redis_server(procs, port, env)
    with Watcher(H1, host) as w:
        bench = procs.run(host, ["redis-benchmark", "-h", H1_IP, "-p", port, "-n", "20000",
                                 "-q", "-t", "set,get,lpush"],
                          layer=True, name="redis-benchmark", timeout=50, env=env)
    # With -q the progress lines end in \r; the final figures are "SET: 68493.15 requests per
    # second, p50=0.367 msec".
    out = bench.stdout().replace("\r", "\n")
    for test in ("SET", "GET", "LPUSH"):
        m = re.search(rf"^{test}: ([0-9.]+) requests per second", out, re.M)
        assert m, f"redis-benchmark printed no result for {test}:\n{out[-2000:]}"
        assert float(m.group(1)) > 0, m.group(0)
    # redis-benchmark runs 50 clients at once.
    assert_virtual(w, H1, f"{H1_IP}:{port}", host, min_conns=50, substrate=substrate)


def test_redis_big_value(procs, workdir):
    port = PORTS["redis_big_value"]
    redis_server(procs, port)
    value = os.urandom(1 << 20)
    (workdir / "value").write_bytes(value)
    cli = ["redis-cli", "-h", H1_IP, "-p", port]
    with Watcher(H1, H2) as w:
        setp = procs.run(H2, [*cli, "-x", "SET", "bigkey"], layer=True, name="redis-cli-set",
                         stdin_path=workdir / "value")
        assert setp.stdout().strip() == "OK", setp.stdout()
        # Three GETs on one connection, half a second apart: long-lived enough to be seen.
        getp = procs.start(H2, [*cli, "-r", "3", "-i", "0.5", "--raw", "GET", "bigkey"],
                           layer=True, name="redis-cli-get")
        getp.wait(timeout=30)
    got = getp.out_path.read_bytes()
    expected = (value + b"\n") * 3
    assert len(got) == len(expected), f"GET returned {len(got)} bytes, expected {len(expected)}"
    assert got == expected, "GET returned different content than SET stored"
    assert_virtual(w, H1, f"{H1_IP}:{port}", H2, s2c_bytes=len(expected))
