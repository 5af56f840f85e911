"""memcached and its load generator (memcaslap, from libmemcached-tools), under the layer."""

import re
import shutil

import pytest

from helpers import H1, H1_IP, PLACES, PORTS, Watcher, assert_virtual, place, python_prog


@pytest.fixture(autouse=True)
def need_memcached():
    if not shutil.which("memcached") or not shutil.which("memcaslap"):
        pytest.fail("memcached and memcaslap are missing: run scripts/setup.sh", pytrace=False)


def memcached(procs, port, env=None):
    # (Four worker threads, each with its own epoll instance, as memcached runs by default.)
    return procs.server(H1, ["memcached", "-u", "root", "-l", H1_IP, "-p", port, "-U", "0",
                             "-t", "4", "-m", "256", "-I", "1m"],
                        port, layer=True, name="memcached", env=env)


@pytest.mark.parametrize("where", list(PLACES))
def test_memcaslap_load(procs, where):
    """memcaslap's mix of gets and sets from 50 connections for a few seconds, a fifth of the
    values it gets back verified: it completes with no failed verification, and every
    connection is virtual (on the substrate of the place)."""
    host, env, substrate, port = place(where, "memcached")
    memcached(procs, port, env)
    with Watcher(H1, host) as w:
        load = procs.run(host, ["memcaslap", "-s", f"{H1_IP}:{port}", "-t", "3s", "-c", "50", "-T", "2",
                                 "--verify=0.2"],
                         layer=True, name="memcaslap", timeout=60, env=env)
    out = load.stdout()
    m = re.search(r"Run time: [0-9.]+s Ops: (\d+) TPS: (\d+)", out)
    assert m and int(m.group(1)) > 1000, f"memcaslap printed no result:\n{out[-2000:]}"
    verified = re.search(r"^verify_failed: (\d+)", out, re.M)
    assert verified and int(verified.group(1)) == 0, f"memcaslap's verification:\n{out[-2000:]}"
    assert_virtual(w, H1, f"{H1_IP}:{port}", host, min_conns=50, substrate=substrate)


@pytest.mark.parametrize("where", list(PLACES))
def test_values_come_back_whole(procs, where):
    """Values of 1 B to 512 KiB set and read back over the text protocol by four connections
    at once, pipelined, every byte checked."""
    host, env, substrate, port = place(where, "memcached_values")
    memcached(procs, port, env)
    with Watcher(H1, host) as w:
        c = procs.run(host, python_prog("mc_check.py", "--server", f"{H1_IP}:{port}", "--conns", 4,
                                        "--rounds", 12, "--seconds", 2),
                      layer=True, name="mc-check", timeout=90, env=env)
    r = c.last_json()
    assert "error" not in r and r["bad"] == 0 and r["gets"] > 4 * 12 * 9 and r["bytes"] > 1 << 20, r
    assert_virtual(w, H1, f"{H1_IP}:{port}", host, min_conns=4, substrate=substrate)
