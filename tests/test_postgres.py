"""PostgreSQL with pgbench, both under the layer.

The postmaster accepts each connection and forks a backend that serves it, closing its own
copy at once: every virtual connection is handed across fork to a process that runs for the
whole session. The backends wait with epoll on the client's socket and their latches, the
clients (pgbench, two threads) with poll. pgbench checks every transaction; the test checks
that none failed, that the connections were virtual at both ends, and that their server ends
belong to the backends, not to the postmaster.

PostgreSQL refuses to run as root: the server and the clients run as the `postgres` user
(both, so that two programs on one host may share memory: the layer's memory file is private
to its user), in a data folder of their own under /tmp.
"""

import pwd
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from helpers import BASELINE, H1, H1_IP, PLACES, Watcher, assert_virtual, place

PG_BIN = Path("/usr/lib/postgresql/15/bin")
CLIENTS = 4


def as_postgres(argv):
    return ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", *argv]


@pytest.fixture
def pgdata():
    """An initialised, empty cluster owned by postgres (removed afterwards)."""
    user = pwd.getpwnam("postgres")
    top = Path(tempfile.mkdtemp(prefix="vmi-pg-"))
    try:
        top.chmod(0o755)
        data, sock = top / "data", top / "sock"
        for d in (data, sock):
            d.mkdir()
            shutil.chown(d, user.pw_uid, user.pw_gid)
        subprocess.run(as_postgres([PG_BIN / "initdb", "-D", data, "-A", "trust", "-U",
                                    "postgres", "--no-sync"]),
                       check=True, capture_output=True, timeout=60)
        # The test hosts' networks may connect (initdb trusts only loopback).
        with open(data / "pg_hba.conf", "a") as f:
            f.write("host all all 0.0.0.0/0 trust\n")
        yield data, sock
    finally:
        shutil.rmtree(top, ignore_errors=True)


def postgres(procs, pgdata, port, env):
    data, sock = pgdata
    return procs.server(H1, as_postgres([
        PG_BIN / "postgres", "-D", data, "-h", H1_IP, "-p", port, "-k", sock,
        "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
        "-c", "max_connections=30", "-c", "shared_buffers=32MB", "-c", "logging_collector=off",
    ]), port, layer=True, name="postgres", env=env)


def pgbench(procs, host, port, env, name, *args, timeout=60):
    return procs.run(host, as_postgres([PG_BIN / "pgbench", "-h", H1_IP, "-p", port,
                                        "-U", "postgres", *args, "postgres"]),
                     layer=True, name=name, timeout=timeout, env=env)


@pytest.mark.parametrize("where", list(PLACES))
def test_pgbench(procs, pgdata, where):
    host, env, substrate, port = place(where, "postgres_pgbench")
    srv = postgres(procs, pgdata, port, env)
    pgbench(procs, host, port, env, "pgbench-init", "-i", "-s", "2", "-q")
    with Watcher(H1, host) as w:
        run = pgbench(procs, host, port, env, "pgbench", "-c", CLIENTS, "-j", "2", "-T", "4",
                      "-P", "1", "--no-vacuum")
    out = run.stdout()
    tps = re.search(r"^tps = ([0-9.]+)", out, re.M)
    assert tps and float(tps.group(1)) > 0, out[-2000:]
    done = re.search(r"number of transactions actually processed: (\d+)", out)
    assert done and int(done.group(1)) > 0, out[-2000:]
    failed = re.search(r"number of failed transactions: (\d+)", out)
    assert failed is None or int(failed.group(1)) == 0, out[-2000:]
    # Each pgbench client is one connection, served by a backend the postmaster forked.
    assert_virtual(w, H1, f"{H1_IP}:{port}", host, min_conns=CLIENTS, substrate=substrate,
                   server_pids_not=None if BASELINE else {srv.pid})
    assert srv.alive(), "postgres died"
