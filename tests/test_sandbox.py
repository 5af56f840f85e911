"""Sandboxed and privilege-dropping programs under the layer.

The layer must never get a program killed, and its threads must never spin or outlive it:

* OpenSSH (`sshd` and `ssh` both under the layer, across hosts and on one host, where the
  connection uses shared memory): sshd's pre-authentication child runs under a seccomp filter
  that kills it for any call outside its list (`sendto` among them), in a chroot, as user
  `sshd`, with a descriptor limit of zero. Remote commands, 32 MiB each way with equal SHA-256,
  `scp` and `sftp` of a file, and a TCP port forwarded through the session carrying a
  checksummed stream; the SSH connection is virtual at both ends.
* tests/programs/sandboxed.c: a program that connects, then installs a filter allowing only
  the calls it makes itself (read, write, close, exit), through `prctl` (its thread) or
  `seccomp(TSYNC)` (every thread, the layer's too), and streams both ways or only reads; a
  chrooted server that drops to `nobody` after `accept`, through a link failure; a main thread
  that ends with `pthread_exit` (alone, or while a worker goes on); a program exec'd under a
  filter the layer cannot read (it then stays out of the way: plain TCP); a client that
  locks itself down with Landlock (no files, no TCP connect, no abstract sockets) and keeps
  its connection through a failover.

After each test no process of the test is left, and layered processes that are idle use no
CPU time.
"""

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from helpers import (BASELINE, ETH0, H1, H1_IP, H2, PROGRAMS, PORTS, Watcher,
                     assert_plain, assert_same_stream, assert_virtual, python_prog,
                     sha256_file, vmictl_status, wait_listening, write_random_file)

SSHD = "/usr/sbin/sshd"
MIB = 1 << 20


@pytest.fixture(scope="session")
def sandboxed_bin(tmp_path_factory):
    """tests/programs/sandboxed.c, compiled for this session."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.fail("gcc not found on PATH (apt-get install gcc)", pytrace=False)
    out = tmp_path_factory.mktemp("sandboxed") / "sandboxed"
    r = subprocess.run([gcc, "-O2", "-Wall", "-pthread", "-o", str(out),
                        str(PROGRAMS / "sandboxed.c")], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        pytest.fail(f"gcc failed to compile tests/programs/sandboxed.c:\n{r.stderr}", pytrace=False)
    return out


def cpu_ns(pid):
    """Nanoseconds on a CPU of every thread of a process so far (schedstat: exact, unlike
    the clock-tick counts of /proc/PID/stat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total


IDLE_BUDGET_NS = 3_000_000


def assert_idle(pids, seconds=1.5):
    """Layered processes that have nothing to do use no CPU time: at most IDLE_BUDGET_NS in
    `seconds` (a thread that spins or polls in a loop uses all of them)."""
    if BASELINE:
        return
    before = {p: cpu_ns(p) for p in pids}
    time.sleep(seconds)
    used = {p: cpu_ns(p) - t for p, t in before.items()}
    busy = {p: f"{ns / 1e6:.2f} ms" for p, ns in used.items() if ns > IDLE_BUDGET_NS}
    assert not busy, f"idle processes used CPU in {seconds} s: {busy}"


def children(pid):
    """Pids whose parent is `pid`."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == pid:
                out.append(int(d.name))
    return out


def wait_no_children(pid, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = children(pid)
        if not left:
            return
        time.sleep(0.1)
    states = {c: Path(f"/proc/{c}/stat").read_text().split()[2] for c in children(pid)}
    pytest.fail(f"processes of sshd {pid} still there {timeout} s after the sessions ended: "
                f"{states}")


def logged_gids(proc, arrow):
    """GIDs a layered program (VMI_LOG=info) logged as virtual connections it made (`->`) or
    accepted (`<-`)."""
    return set(re.findall(r"virtual connection ([0-9a-f]{32}): \S+ " + re.escape(arrow), proc.stderr()))


def assert_virtual_logged(client, server):
    """A connection too short for vmictl's snapshots: both layers logged it as virtual, with
    the same GID."""
    if BASELINE:
        return
    c, s = logged_gids(client, "->"), logged_gids(server, "<-")
    assert c and c & s, f"client logged virtual connections {c}, server {s}: no GID in common"


# ---------------------------------------------------------------------------------------------
# OpenSSH

class Ssh:
    """An sshd under the layer in H1 and the ssh command line for a client host."""

    def __init__(self, procs, tmp, port):
        self.procs, self.tmp, self.port = procs, tmp, port
        self.key = tmp / "client_key"
        host_key = tmp / "host_key"
        for k in (self.key, host_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(k)],
                           check=True, timeout=30)
        auth = tmp / "authorized_keys"
        auth.write_text(Path(f"{self.key}.pub").read_text())
        auth.chmod(0o600)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        cfg = tmp / "sshd_config"
        cfg.write_text("\n".join([
            f"Port {port}", f"HostKey {host_key}", f"AuthorizedKeysFile {auth}",
            "PermitRootLogin yes", "PasswordAuthentication no",
            "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no", "PidFile none",
            "LogLevel VERBOSE", "AllowTcpForwarding yes", "Subsystem sftp internal-sftp", ""]))
        self.sshd = procs.server(H1, [SSHD, "-D", "-e", "-f", cfg], port, layer=True, name="sshd",
                                 env={"VMI_LOG": "info"})

    def opts(self):
        return ["-F", "/dev/null", "-i", self.key, "-o", "StrictHostKeyChecking=no",
                "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes",
                "-o", "LogLevel=ERROR"]

    def ssh(self, *remote):
        return ["ssh", *self.opts(), "-p", self.port, f"root@{H1_IP}", *remote]

    def run(self, host, *remote, name, stdin_path=None, timeout=90):
        return self.procs.run(host, self.ssh(*remote), layer=True, name=name,
                              stdin_path=stdin_path, timeout=timeout, env={"VMI_LOG": "info"})


@pytest.mark.parametrize("where", ["hosts", "node"])
def test_openssh(procs, tmp_path, where):
    client_host = H2 if where == "hosts" else H1
    substrate = "tcp" if where == "hosts" else "shm"
    offset = 0 if where == "hosts" else 1
    ssh = Ssh(procs, tmp_path, PORTS["sandbox_sshd"] + offset)
    addr = f"{H1_IP}:{ssh.port}"

    # A remote command.
    r = ssh.run(client_host, "echo", "hello-from-sshd", name="ssh-echo")
    assert r.stdout().strip() == "hello-from-sshd", r.stdout()

    # 32 MiB up and down through a session, checked on both sides.
    blob = tmp_path / "blob"
    digest = write_random_file(blob, 32 * MIB)
    with Watcher(H1, client_host) as w:
        up = ssh.run(client_host, "sha256sum", name="ssh-up", stdin_path=blob)
    assert up.stdout().split()[0] == digest, "32 MiB sent through ssh arrived different"
    assert_virtual(w, H1, addr, client_host, substrate=substrate)
    down = ssh.run(client_host, "cat", str(blob), name="ssh-down")
    assert sha256_file(down.out_path) == digest, "32 MiB read through ssh arrived different"

    # scp (SFTP protocol) both ways, and sftp.
    back = tmp_path / "scp-back"
    remote = tmp_path / "scp-remote"
    scp = ["scp", *ssh.opts(), "-P", ssh.port]
    info = {"VMI_LOG": "info"}
    ups = procs.run(client_host, [*scp, blob, f"root@{H1_IP}:{remote}"], layer=True,
                    name="scp-up", env=info)
    downs = procs.run(client_host, [*scp, f"root@{H1_IP}:{remote}", back], layer=True,
                      name="scp-down", env=info)
    assert sha256_file(remote) == digest and sha256_file(back) == digest
    batch = tmp_path / "sftp-batch"
    got = tmp_path / "sftp-got"
    batch.write_text(f"put {blob} {tmp_path / 'sftp-remote'}\nget {tmp_path / 'sftp-remote'} {got}\n")
    sftp = procs.run(client_host, ["sftp", *ssh.opts(), "-P", ssh.port, "-b", batch,
                                   f"root@{H1_IP}"], layer=True, name="sftp", env=info)
    assert sha256_file(tmp_path / "sftp-remote") == digest and sha256_file(got) == digest
    for p in (r, down, ups, downs, sftp):
        assert_virtual_logged(p, ssh.sshd)

    # A port forwarded through the session carries a checksummed stream.
    lport = PORTS["sandbox_forward_local"] + offset
    tport = PORTS["sandbox_forward_target"] + offset
    target = procs.server(H1, python_prog("stream.py", "server", "--bind", f"{H1_IP}:{tport}",
                                          "--count", "1"),
                          tport, layer=True, name="forward-target", env={"VMI_LOG": "info"})
    fwd = procs.start(client_host, ["ssh", *ssh.opts(), "-N", "-o", "ExitOnForwardFailure=yes",
                                    "-L", f"127.0.0.1:{lport}:{H1_IP}:{tport}", "-p", ssh.port,
                                    f"root@{H1_IP}"], layer=True, name="ssh-forward",
                      env=info)
    wait_listening(client_host, lport, proc=fwd)
    cli = procs.run(client_host, python_prog("stream.py", "client", "--connect",
                                            f"127.0.0.1:{lport}", "--bytes", 8 * MIB,
                                            "--server-bytes", 8 * MIB, "--seed", "5"),
                    layer=True, name="forward-client", timeout=60, env=info)
    target.wait(timeout=30)
    assert_same_stream(cli.last_json(), target.last_json())
    # Every leg is virtual: the SSH connection, the program's connection to ssh's forwarding
    # listener, and sshd's session's connection to the target.
    assert_virtual_logged(fwd, ssh.sshd)
    assert_virtual_logged(cli, fwd)
    assert_virtual_logged(ssh.sshd, target)
    fwd.stop()

    # Every session process ended; the listener (and its control thread) sits idle, and
    # vmictl no longer lists the sessions' connections (sshd re-execs itself for each: the
    # listener's copy must not stay behind as a connection nobody holds).
    wait_no_children(ssh.sshd.pid)
    if not BASELINE:
        deadline = time.monotonic() + 10
        while True:
            left = [c for c in vmictl_status(H1)["connections"]
                    if c["local"].endswith(f":{ssh.port}") or c["peer"].endswith(f":{ssh.port}")]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not left, f"vmictl still lists {len(left)} connections of ended sessions: {left[:3]}"
    assert ssh.sshd.alive(), "sshd died"
    assert_idle([ssh.sshd.pid])
    assert "SIGSYS" not in ssh.sshd.stderr() and "killed" not in ssh.sshd.stderr(), \
        ssh.sshd.stderr()[-2000:]


# ---------------------------------------------------------------------------------------------
# Programs that restrict themselves

def seccomp_run(procs, sandboxed_bin, how, mode, nbytes, port, server_argv, server_env=None):
    """A server under the layer in H1 (`server_argv(addr)`), the sandboxed program in H2 in
    `mode`, filter installed `how`: every byte checked, virtual at both ends, server idle.
    Returns the server."""
    addr = f"{H1_IP}:{port}"
    srv = procs.server(H1, server_argv(addr), port, layer=True, name="server",
                       env={"VMI_LOG": "info", **(server_env or {})})
    args = [sandboxed_bin, mode, addr, nbytes] + (["tsync"] if how == "tsync" else [])
    cli = procs.run(H2, args, layer=True, name=mode, timeout=60, env={"VMI_LOG": "info"})
    r = cli.last_json()
    assert r["ok"] and r["bytes"] == nbytes, r
    assert_virtual_logged(cli, srv)
    assert_idle([srv.pid])
    return srv


@pytest.mark.parametrize("how", ["prctl", "tsync"])
def test_seccomp_client_streams_both_ways(procs, sandboxed_bin, how):
    seccomp_run(procs, sandboxed_bin, how, "seccomp-client", 24 * MIB,
                PORTS["sandbox_echo"] + (how == "tsync"),
                lambda addr: python_prog("echo_server.py", "--bind", addr))


@pytest.mark.parametrize("how", ["prctl", "tsync"])
def test_seccomp_reader_refuses_filters_it_cannot_read(procs, sandboxed_bin, how):
    """The server offers a chain of filters (VMI_CHAIN=double) to a reader whose filter
    forbids setsockopt, which coded frames need (a receive buffer that holds them whole):
    the reader's layer refuses the chain, the server's says so, and every byte arrives."""
    srv = seccomp_run(procs, sandboxed_bin, how, "seccomp-reader", 16 * MIB,
                      PORTS["sandbox_reader_chain"] + (how == "tsync"),
                      lambda addr: [sandboxed_bin, "stream-server", addr, 16 * MIB],
                      server_env={"VMI_CHAIN": "double"})
    assert "refused chain 1" in srv.stderr(), srv.stderr()[-2000:]


@pytest.mark.parametrize("how", ["prctl", "tsync"])
def test_seccomp_reader_gets_everything(procs, sandboxed_bin, how):
    """A sandboxed thread that only reads: the peer's window must still open (acks)."""
    seccomp_run(procs, sandboxed_bin, how, "seccomp-reader", 48 * MIB,
                PORTS["sandbox_reader"] + (how == "tsync"),
                lambda addr: [sandboxed_bin, "stream-server", addr, 48 * MIB])


def test_chrooted_server_drops_privileges_and_fails_over(procs, sandboxed_bin, tmp_path, faults):
    """chroot + setgroups/setgid/setuid(nobody) after accept; then a link dies mid-stream."""
    port = PORTS["sandbox_chroot"]
    addr = f"{H1_IP}:{port}"
    root = tmp_path / "empty-root"
    root.mkdir()
    srv = procs.server(H1, [sandboxed_bin, "chroot-server", addr, root, 65534], port, layer=True,
                       name="chroot-server", env={"VMI_LOG": "info"})
    total = 768 * MIB
    with Watcher(H1, H2) as w:
        cli = procs.start(H2, [sandboxed_bin, "echo-client", addr, total], layer=True,
                          name="echo-client", env={"VMI_LOG": "info"})
        time.sleep(1.0)
        if not BASELINE:
            faults.link_down(H2, ETH0)
        cli.wait(timeout=90)
        srv.wait(timeout=30)
    assert cli.last_json()["ok"], cli.stdout()
    r = srv.last_json()
    assert r["ok"] and r["bytes"] == total and r["uid"] == 65534, r
    assert_virtual(w, H1, addr, H2)
    if not BASELINE:
        assert "link rebuilt" in cli.stderr() and "link rebuilt" in srv.stderr(), \
            "the link was not rebuilt at both ends (the test's fault came too late?)"


def test_landlocked_client_keeps_its_connection_through_a_failover(procs, sandboxed_bin, faults):
    """Landlock after connect: no files, no TCP connect or bind, no abstract Unix sockets (the
    layer's agent socket is one). The connection keeps working and fails over (the layer's
    thread, started before, is outside the domain)."""
    port = PORTS["sandbox_landlock"]
    addr = f"{H1_IP}:{port}"
    echo = procs.server(H1, python_prog("echo_server.py", "--bind", addr), port, layer=True,
                        name="echo-server", env={"VMI_LOG": "info"})
    with Watcher(H2) as w:
        cli = procs.start(H2, [sandboxed_bin, "landlock-client", addr, 512 * MIB], layer=True,
                          name="landlock-client", env={"VMI_LOG": "info"})
        time.sleep(1.0)
        if not BASELINE:
            faults.link_down(H2, ETH0)
        cli.wait(timeout=90)
    if not BASELINE:
        # vmictl shows the process's sandbox (Landlock needs no_new_privs).
        seen = w.processes[H2].get(cli.pid, {}).get("sandbox", "")
        assert "no_new_privs" in seen, f"vmictl said sandbox {seen!r} for the landlocked client"
    assert cli.last_json()["ok"], cli.stdout()
    assert_virtual_logged(cli, echo)
    if not BASELINE:
        assert "link rebuilt" in cli.stderr(), "the landlocked client's link was not rebuilt"
    assert_idle([echo.pid])


@pytest.mark.parametrize("mode", ["alone", "worker"])
def test_main_thread_pthread_exit(procs, sandboxed_bin, mode):
    """The process ends when the program's last thread does, not when ours does."""
    port = PORTS["sandbox_pthread_exit"] + (mode == "worker")
    addr = f"{H1_IP}:{port}"
    echo = procs.server(H1, python_prog("echo_server.py", "--bind", addr), port, layer=True,
                        name="echo-server")
    started = time.monotonic()
    cli = procs.run(H2, [sandboxed_bin, "pthread-exit", addr, 4 * MIB, mode], layer=True,
                    name="pthread-exit", timeout=20)
    took = time.monotonic() - started
    assert all(r["ok"] for r in cli.json_lines()), cli.stdout()
    assert len(cli.json_lines()) == 1, cli.stdout()
    assert took < 10, f"the process ended {took:.1f} s after starting"
    assert_idle([echo.pid])


def test_filter_from_before_exec_keeps_the_layer_out(procs, sandboxed_bin):
    """A filter installed before exec cannot be read: new connections stay plain TCP."""
    port = PORTS["sandbox_exec_filtered"]
    addr = f"{H1_IP}:{port}"
    procs.server(H1, python_prog("echo_server.py", "--bind", addr), port, layer=True,
                 name="echo-server")
    with Watcher(H1, H2) as w:
        cli = procs.run(H2, [sandboxed_bin, "exec-filtered", sandboxed_bin, "echo-client", addr,
                             8 * MIB], layer=True, name="exec-filtered", timeout=30)
    assert cli.last_json()["ok"], cli.stdout()
    assert_plain(w, addr, server_host=H1, client_host=H2)
