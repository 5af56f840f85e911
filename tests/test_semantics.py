"""Socket semantics on a virtual connection, call by call (tests/programs/semantics.c).

Every scenario runs twice: under the layer on both sides (H2 -> H1, the connection must be
virtual) and natively, without any preload, as a control. Both programs check each call
against what native Linux TCP does, so a scenario that fails natively is a bug of the test,
and one that fails only under the layer is a bug of the layer.
"""

import contextlib
import shutil
import subprocess

import pytest

from helpers import (BASELINE, H1, H1_IP, H2, PROGRAMS, Watcher, assert_virtual, block_port)

SCENARIOS = [
    "peek",
    "peek_two_writes",
    "waitall",
    "dontwait",
    "nb_connect",
    "nonblock_fcntl",
    "nonblock_fionbio",
    "fionread",
    "poll",
    "select",
    "epoll_lt",
    "epoll_et",
    "epoll_oneshot",
    "epoll_nested",
    "shutdown_wr",
    "shutdown_wr_bulk",
    "close_before_peer_reads",
    "close_with_unread",
    "exit_after_shutdown_wr",
    "dup",
    "dup2",
    "dup3",
    "fcntl_dupfd",
    "readv_writev",
    "sendmsg_recvmsg",
    "sendfile",
    "names",
    "epipe",
    "sigpipe",
    "close_at_once",
    "linger_zero",
    "sndtimeo",
]

# Scenarios in which another process (a forked child) uses the client's connection.
CHILD_USES_CONNECTION = {"sigpipe"}

HOLD_MS = 500          # both ends keep the new connection open this long (vmictl snapshots)
CLIENT_TIMEOUT = 25.0  # the programs give up on their own after 12 s
SERVER_TIMEOUT = 10.0  # after the client finished

CASES = [(s, m) for s in SCENARIOS for m in ("layer", "native")]


@pytest.fixture(scope="session")
def semantics_bin(tmp_path_factory):
    """tests/programs/semantics.c, compiled for this session."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.fail("gcc not found on PATH: tests/programs/semantics.c cannot be compiled "
                    "(apt-get install gcc)", pytrace=False)
    out = tmp_path_factory.mktemp("semantics") / "semantics"
    r = subprocess.run([gcc, "-O2", "-Wall", "-o", str(out), str(PROGRAMS / "semantics.c")],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        pytest.fail(f"gcc failed to compile tests/programs/semantics.c:\n{r.stderr}",
                    pytrace=False)
    return out


def test_scenario_list_matches_program(semantics_bin):
    r = subprocess.run([semantics_bin, "list"], capture_output=True, text=True, timeout=10)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == SCENARIOS, \
        "SCENARIOS in test_semantics.py and in semantics.c differ"


def result(proc, role):
    lines = [r for r in proc.json_lines() if r.get("role") == role]
    if not lines:
        raise proc.failure(f"the {role} printed no result line")
    return lines[-1]


@pytest.mark.parametrize("scenario,mode", CASES, ids=[f"{s}-{m}" for s, m in CASES])
def test_semantics(procs, semantics_bin, scenario, mode):
    layered = mode == "layer"
    port = block_port(f"semantics_{mode}", SCENARIOS.index(scenario))
    addr = f"{H1_IP}:{port}"
    hold = HOLD_MS if layered else 0
    srv = procs.server(H1, [semantics_bin, "server", scenario, addr, hold], port,
                       layer=layered, name=f"{scenario}-server")
    if layered:
        srv.assert_layer_loaded()
    with (Watcher(H1, H2) if layered else contextlib.nullcontext()) as w:
        cli = procs.start(H2, [semantics_bin, "client", scenario, addr, hold], layer=layered,
                          name=f"{scenario}-client")
        if layered:
            cli.assert_layer_loaded()
        cli.wait(timeout=CLIENT_TIMEOUT, check=False)
        srv.wait(timeout=SERVER_TIMEOUT, check=False)
    s, c = result(srv, "server"), result(cli, "client")

    where = "under the layer" if layered and not BASELINE else \
        "on native TCP (no layer): the scenario itself is wrong, not the layer"
    failed = [f"{r['role']}, step '{r['step']}': {r['error']}" for r in (s, c) if not r["ok"]]
    assert not failed, f"{scenario} failed {where}:\n  " + "\n  ".join(failed)
    assert srv.returncode == 0 and cli.returncode == 0, \
        f"exit status server {srv.returncode}, client {cli.returncode}"

    # getsockname/getpeername at one end are getpeername/getsockname at the other.
    assert s["local"] == addr and c["peer"] == addr, (s, c)
    assert c["local"] == s["peer"], (s, c)

    if layered:
        pid = None if scenario in CHILD_USES_CONNECTION else cli.pid
        assert_virtual(w, H1, addr, H2, client_pid=pid)
