"""Shared pieces of the integration suite.

Everything the tests need to know about the machine lives here: the binaries, the namespace
topology and its addresses, every port, every timeout. Then process control inside namespace
hosts (with or without the layer), `vmictl status --json` snapshots taken while programs run,
and the assertions built on them (virtual or plain, byte counts).

Set VMI_TEST_BASELINE=1 to run the whole suite on plain TCP: no LD_PRELOAD, no agents, and the
vmictl assertions are not evaluated (the report header says so). It tells a harness or
environment problem from a layer problem; it is never how the suite is run for real.
"""

import contextlib
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

# ---------------------------------------------------------------------------------------------
# Paths and binaries

REPO = Path(__file__).resolve().parent.parent
RELEASE = REPO / "target" / "release"
PRELOAD_LIB = RELEASE / "libvmi_preload.so"
AGENT_BIN = RELEASE / "vmi-agent"
VMICTL_BIN = RELEASE / "vmictl"
MIGRATE_BIN = RELEASE / "vmi-migrate"
PROGRAMS = REPO / "tests" / "programs"
TOPO_SCRIPT = REPO / "scripts" / "topo.sh"
# The interpreter running pytest (a real binary, not a shell shim), for the Python programs.
PYTHON = sys.executable

SYSTEM_TOOLS = ["nsenter", "ss", "env", "iperf3", "sockperf", "redis-server", "redis-cli",
                "redis-benchmark", "curl"]

BASELINE = os.environ.get("VMI_TEST_BASELINE") == "1"
LAYER_LOG = os.environ.get("VMI_TEST_LOG", "warn")          # VMI_LOG for layered programs
AGENT_LOG = os.environ.get("VMI_TEST_AGENT_LOG", "info")    # VMI_LOG for the agents

# ---------------------------------------------------------------------------------------------
# Topology: three namespace hosts on two networks; agents on hosts 1 and 2 only.

PREFIX = "vmit"
NET0 = "10.78.0"
NET1 = "10.78.1"
NUM_HOSTS = 3
H1, H2, H3 = "vmit1", "vmit2", "vmit3"
AGENT_HOSTS = (H1, H2)
NO_AGENT_HOST = H3
AGENT_PORT = 7787
# Every agent the tests start takes rebuilt links on AGENT_PORT and the 3 ports after it
# (vmi-agent --relink-ports): the failover tests go through the port choice by GID.
AGENT_RELINK_PORTS = 4


def host_ip(host, net=0):
    """Address of a host on network 0 (eth0) or 1 (eth1)."""
    index = int(host[len(PREFIX):])
    return f"{NET0 if net == 0 else NET1}.{index}"


H1_IP, H2_IP, H3_IP = host_ip(H1), host_ip(H2), host_ip(H3)
H1_IP1 = host_ip(H1, 1)
H3_IP1 = host_ip(H3, 1)
H2_IP1 = host_ip(H2, 1)
LOOPBACK = "127.0.0.1"

# Interfaces inside every host, and the host-side pieces of topo.sh that carry them.
ETH0, ETH1 = "eth0", "eth1"
IFACES = (ETH0, ETH1)


def iface(net):
    """Interface name of network 0 or 1 inside a host."""
    return IFACES[net]


def host_veth(host, net=0):
    """Host-side veth end of a host's network 0 or 1 (scripts/topo.sh: PREFIXie0 / PREFIXie1)."""
    return f"{host}e{net}"


def bridge(net=0):
    """Bridge of network 0 or 1 (scripts/topo.sh: PREFIXbr0 / PREFIXbr1)."""
    return f"{PREFIX}br{net}"

# ---------------------------------------------------------------------------------------------
# Ports: one per use, so no test meets a port another left in TIME_WAIT.

PORTS = {
    "iperf3_plain": 15201,
    "iperf3_parallel4": 15202,
    "iperf3_reverse": 15203,
    "iperf3_local_eth0": 15204,
    "iperf3_local_lo": 15205,
    "sockperf_ping_pong": 11201,
    "sockperf_throughput": 11202,
    "sockperf_under_load": 11203,
    "redis_benchmark": 16301,
    "redis_big_value": 16302,
    "http": 18001,
    "http_no_agent": 18002,
    "nginx_download": 18101,
    "nginx_keepalive": 18102,
    "nginx_failover": 18103,
    "nginx_wrk": 18104,
    "postgres_pgbench": 18201,
    "echo": 17001,
    "fork_hash": 17101,
    "fork_both": 17102,
    "stream_net0": 17201,
    "stream_net1": 17202,
    "stream_local": 17203,
    "stream_loopback": 17204,
    "stream_tiny": 17205,
    "shm_stream_local": 17651,
    "shm_stream_loopback": 17652,
    "shm_refused": 17653,
    "shm_not_offered": 17654,
    "shm_other_host": 17655,
    "shm_move": 17656,
    "shm_move_stalled": 17657,
    "shm_move_fork": 17658,
    "shm_move_two_hosts": 17659,
    "shm_send_before_accept": 17660,
    "shm_send_before_accept_nb": 17661,
    "shm_move_nonblocking": 17662,
    "shm_corked": 17663,
    "shm_event_loop": 17664,
    "shm_event_loop_poll": 17665,
    "shm_event_loop_edge": 17666,
    "shm_event_loop_level": 17667,
    "shm_event_loop_bound": 17668,
    "shm_event_loop_poll0": 17669,
    "shm_bell_moves": 17670,
    "shm_busy_poll_kernel": 17671,
    "shm_busy_epoll_kernel": 17672,
    "shm_say_and_close": 17673,
    "shm_say_and_close_empty": 17674,
    "shm_say_and_close_reset": 17675,
    "shm_timeouts": 17680,            # to 17695: a port per case, native and layered
    "mixed_iperf3_plain_server": 15301,
    "mixed_iperf3_plain_client": 15302,
    "mixed_stream_plain_server": 17301,
    "mixed_stream_plain_client": 17302,
    "mixed_banner_plain_server": 17303,
    "mixed_banner_plain_client": 17304,
    "mixed_disabled": 17305,
    "no_agent_stream_out": 17401,
    "no_agent_banner_in": 17402,
    "exec_fork_exec": 17701,
    "exec_subprocess": 17702,
    "failover_loud": 17801,
    "failover_blackhole": 17802,
    "failover_flap": 17803,
    "failover_all_down": 17804,
    "failover_net_admin": 17805,
    "failover_agent_kill": 17806,
    "failover_grace": 17807,
    "failover_resume_attack": 17808,
    "failover_new_conn_admin": 17809,
    "failover_new_conn_link": 17810,
    "failover_fork_shared": 17811,
    "failover_after_exec": 17812,
    "failover_fork_idle_holder": 17813,     # and 17814
    "failover_spawn": 17815,
    "failover_after_subprocess": 17816,
    "failover_many": 17817,
    "failover_idle_moves": 17818,
    "failover_calm": 17819,
    "failover_iperf3": 15401,
    "failover_redis": 16401,
    "migrate_client": 17901,
    "migrate_server": 17902,
    "migrate_both": 17903,
    "migrate_loop": 17904,
    "migrate_net_down": 17905,
    "migrate_listener": 17906,
    "migrate_dump_fails": 17907,
    "migrate_restore_fails": 17908,
    "migrate_ssh": 17909,
    "migrate_ssh_fails": 17910,
    "migrate_vmictl": 17914,
    "migrate_specific": 17911,
    "migrate_shm": 17912,
    "migrate_shm_closed": 17913,
    "migrate_redis": 16402,
    "sandbox_sshd": 19001,              # and 19002
    "sandbox_forward_local": 19003,     # and 19004
    "sandbox_forward_target": 19005,    # and 19006
    "sandbox_echo": 19007,              # and 19008
    "sandbox_reader": 19009,            # and 19010
    "sandbox_chroot": 19011,
    "sandbox_pthread_exit": 19012,      # and 19013
    "sandbox_exec_filtered": 19014,
    "sandbox_landlock": 19015,
    "sandbox_reader_chain": 19016,      # and 19017
    "chain_setup": 17921,
    "chain_live": 17922,
    "chain_nb": 17923,
    "chain_failover": 17924,
    "chain_unknown": 17925,
    "chain_migrate": 17926,
    "device_loop": 17927,
    "device_pid": 17928,
    "device_busy": 17929,
    "device_policy": 17930,
    "aead_live": 17931,
    "aead_attack": 17932,               # to 17934, and 17938
    "tap_profile": 17935,
    "tap_capture": 17936,
    "plugins": 17937,
    "aead_slip": 17940,                 # to 17942
    "device_shm": 17943,
    "stream_early_net0": 17944,
    "stream_early_local": 17945,
    "sink_layer": 17946,
    "failover_heartbeats_lost": 17947,
    "sink_ctl": 17950,                  # to 17959
    "sequential_closes": 17960,
    "progress_native": 17961,
    "progress_layer": 17962,
    "failover_exit_after_end": 17963,
    "setup_block": 17964,
    "setup_one_way": 17965,
    "setup_restart": 17966,
    "splice_stream": 17967,
    "splice_half": 17968,
    "splice_sigpipe": 17969,
    "splice_off": 17970,
    "splice_auto_pingpong": 17988,
    "splice_auto_stream": 17989,
    "splice_off_big": 17990,
    "quick_acks": 17971,
    "setup_reuse": 17972,
    "setup_reuse_fork": 17973,
    "setup_table": 17974,
    "setup_owner": 17975,
    "gather_writev": 17976,
    "two_frames": 17977,
    "shm_withdrawn_moves": 17978,
    "shm_moved_busy_nested": 17987,
    "memcached": 17979,
    "memcached_values": 17980,
    "shm_self_fork_moves": 17981,
    "setup_tickets": 17982,
    "setup_refused": 17983,
    "setup_refused_native": 17984,
    "setup_tickets_here": 17985,
    "setup_tickets_here_tcp": 17986,
    "close_mid_frame": 17991,
    "close_mid_frame_chain": 17992,
    "device_receiver": 17993,
    "device_shm_env": 17994,
    "aead_ack_forged": 17995,
    "aead_ack_tag": 17996,
}
assert len(set(PORTS.values())) == len(PORTS), "duplicate port in PORTS"
assert not set(range(AGENT_PORT, AGENT_PORT + AGENT_RELINK_PORTS)) & set(PORTS.values())

# Where a real-program test runs its client: on another host (the layers talk over kernel
# TCP), or on the server's host (shared memory). Shared-memory runs use their ports + 10000.
# "chain": across hosts with the chain `double,lz4,aead` on both directions of every
# connection (VMI_CHAIN at both ends): real programs through a chain that changes every
# frame's length (`double`, a test filter), compresses it (`lz4`, which always finds the
# doubled bytes worth compressing, so every frame goes through both filters) and seals it
# (`aead`, AES-256-GCM under a key from the chain's own key exchange).
PLACES = {"hosts": (H2, {}, "tcp", 0), "shm": (H1, {"VMI_SHM": "1"}, "shm", 10000),
          "chain": (H2, {"VMI_CHAIN": "double,lz4,aead"}, "tcp/double,lz4,aead:aes-256-gcm",
                    12000)}


def place(where, port_name):
    """(client host, layer environment, expected substrate, port) for a place."""
    host, env, substrate, offset = PLACES[where]
    return host, env, substrate, PORTS[port_name] + offset


# Blocks of ports for tests parametrized over many cases: case i uses base + i.
PORT_BLOCK_SIZE = 50
PORT_BLOCKS = {
    "semantics_layer": 17500,
    "semantics_native": 17550,
    "hostile": 17600,
    "ready": 19100,
    "trust": 19200,
    "cluster": 19250,
}


def block_port(block, index):
    """Port of case `index` of a parametrized test (see PORT_BLOCKS)."""
    assert 0 <= index < PORT_BLOCK_SIZE, f"{block}: case {index} is outside its port block"
    return PORT_BLOCKS[block] + index


assert not any(b <= p < b + PORT_BLOCK_SIZE for b in PORT_BLOCKS.values()
               for p in list(PORTS.values()) + list(range(AGENT_PORT, AGENT_PORT + AGENT_RELINK_PORTS))), \
    "PORTS overlap a port block"
assert all(b - a >= PORT_BLOCK_SIZE for a, b in zip(sorted(PORT_BLOCKS.values()),
                                                   sorted(PORT_BLOCKS.values())[1:])), \
    "port blocks overlap"

# ---------------------------------------------------------------------------------------------
# Timeouts (seconds)

AGENT_READY_TIMEOUT = 10.0
LISTEN_TIMEOUT = 10.0
VMICTL_TIMEOUT = 5.0
RUN_TIMEOUT = 45.0          # default for one client program
STOP_GRACE = 3.0            # SIGTERM to SIGKILL
POLL_INTERVAL = 0.1         # vmictl snapshots while traffic runs
LOG_TAIL_LINES = 150

# Link failure: what the agents and the layer promise (agent flags --probe-interval and
# --dead-after, layer variable VMI_GRACE), and how long the tests wait for it.
PROBE_INTERVAL_MS = 30      # agent default
DEAD_AFTER_MS = 50          # agent default: a path silent this long is dead
GRACE_ENV = "VMI_GRACE"     # seconds a connection waits with no network working (default 60)
DEFAULT_GRACE = 60.0
FAILOVER_TIMEOUT = 5.0      # a fault until vmictl shows the connection on the other network
PATH_RECOVERY_TIMEOUT = 8.0  # a repaired network until the agents see its paths alive again
IP_TIMEOUT = 5.0            # one `ip` command

# ---------------------------------------------------------------------------------------------
# Process groups started by the suite, for the last-resort cleanup at exit.

_ALL_GROUPS = set()
_ALL_GROUPS_LOCK = threading.Lock()


def kill_group(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_all_groups():
    with _ALL_GROUPS_LOCK:
        groups = list(_ALL_GROUPS)
        _ALL_GROUPS.clear()
    for pgid in groups:
        kill_group(pgid, signal.SIGKILL)


def process_gone(pid):
    """True once PID has exited (a zombie counts): it may vanish between any two looks."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")
    except (FileNotFoundError, ProcessLookupError):
        return True


class HarnessError(AssertionError):
    """A program misbehaved (exit status, timeout, unparsable output)."""


def tail(path, lines=LOG_TAIL_LINES):
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
    parts = text.splitlines()
    if len(parts) > lines:
        return f"... ({len(parts) - lines} earlier lines in {path})\n" + "\n".join(parts[-lines:])
    return text


def layer_env():
    if BASELINE:
        return {}
    return {"LD_PRELOAD": str(PRELOAD_LIB), "VMI_LOG": LAYER_LOG}


def host_argv(host, argv, env):
    """Command line that runs argv inside host's network namespace with exactly env added.

    nsenter only joins the network namespace (not the mount namespace, unlike `ip netns
    exec`); `env` drops any inherited LD_PRELOAD so that only the target program, never
    nsenter or env themselves, gets the layer. All three exec, so the pid is the program's.
    """
    envargs = ["env", "-u", "LD_PRELOAD", "-u", "VMI_DISABLE", "-u", "VMI_LOG"]
    envargs += [f"{k}={v}" for k, v in env.items()]
    return ["nsenter", f"--net=/run/netns/{host}", *envargs, *[str(a) for a in argv]]


def _proc_text(path):
    try:
        return Path(path).read_text(errors="replace").strip()
    except OSError:
        return "?"


def _descendants(root):
    """root and every process below it, in the order found (a namespace host's programs are
    still the harness's descendants: nsenter execs into them)."""
    children = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = _proc_text(entry / "stat")
        try:
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        found.append(pid)
        todo.extend(sorted(children.get(pid, [])))
    return found


def _calls_of(tid, seconds=0.5, most=24):
    """The system calls thread `tid` makes for `seconds` (strace), at most `most` lines."""
    try:
        r = subprocess.run(["timeout", str(seconds), "strace", "-p", str(tid), "-s", "16"],
                           capture_output=True, text=True, timeout=seconds + 5)
    except Exception as exc:            # a snapshot must never hide the failure itself
        return [f"strace: {exc}"]
    out = [l for l in r.stderr.splitlines() if not l.startswith(("strace: Process", "strace: detached"))]
    return out[:most] or ["(no system calls: it spins in user space)"]


def hang_snapshot(root):
    """What a program that did not finish was doing, taken before it is killed: each thread
    of each process below it with its state, kernel wait channel and system call, then the
    layer's view of those processes' connections on every agent host. This is what tells a
    lost wake-up in the layer from a program that waits for its own reasons."""
    pids = _descendants(root)
    lines = ["--- what the program's processes were doing when the time ran out ---"]
    for pid in pids:
        comm = _proc_text(f"/proc/{pid}/comm")
        lines.append(f"pid {pid} ({comm})")
        try:
            tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
        for tid in tids[:16]:
            base = f"/proc/{pid}/task/{tid}"
            state = "".join(_proc_text(f"{base}/stat").rsplit(")", 1)[-1].split()[:1])
            lines.append(f"  tid {tid} ({_proc_text(base + '/comm')}) state "
                         f"{state} wchan {_proc_text(base + '/wchan')} "
                         f"syscall {_proc_text(base + '/syscall')[:60]}")
            if state == "R":
                # A thread that spins: which calls it goes round (half a second of them).
                lines.extend("    " + l for l in _calls_of(tid))
    for host in AGENT_HOSTS:
        # The kernel's queues of these processes' TCP sockets (bytes the layer wrote that the
        # peer's program has not read sit in one of them, or in neither).
        try:
            ss = subprocess.run(["nsenter", f"--net=/run/netns/{host}", "ss", "-Htnpi"],
                                capture_output=True, text=True, timeout=5).stdout.splitlines()
        except Exception as exc:        # a snapshot must never hide the failure itself
            ss = [f"ss: {exc}"]
        mine = [l for l in ss if any(f"pid={p}," in l for p in pids)]
        lines.append(f"--- TCP sockets of these processes in {host} (state recv-q send-q "
                     f"local peer): {len(mine)}")
        lines.extend("  " + " ".join(l.split()[:5]) for l in mine[:32])
        try:
            status = vmictl_status(host)
        except Exception as exc:        # a snapshot must never hide the failure itself
            lines.append(f"--- vmictl status in {host}: {exc}")
            continue
        conns = [c for c in status.get("connections") or [] if c.get("pid") in pids]
        lines.append(f"--- vmictl status in {host}: {len(conns)} connections of these "
                     "processes")
        lines.extend(json.dumps(c, sort_keys=True) for c in conns)
    return "\n".join(lines)


class Proc:
    """One program started in a namespace host, in its own process group."""

    def __init__(self, name, host, argv, layer, env, logdir, stdin_path=None, cwd=None):
        self.name = name
        self.host = host
        self.argv = [str(a) for a in argv]
        self.layer = layer
        self.out_path = Path(logdir) / f"{name}.stdout"
        self.err_path = Path(logdir) / f"{name}.stderr"
        full_env = dict(layer_env() if layer else {})
        full_env.update(env or {})
        self.cmdline = host_argv(host, self.argv, full_env)
        stdin = open(stdin_path, "rb") if stdin_path else subprocess.DEVNULL
        try:
            with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
                self.popen = subprocess.Popen(self.cmdline, stdin=stdin, stdout=out, stderr=err,
                                              start_new_session=True, cwd=cwd)
        finally:
            if stdin_path:
                stdin.close()
        with _ALL_GROUPS_LOCK:
            _ALL_GROUPS.add(self.popen.pid)
        self.started = time.monotonic()

    @property
    def pid(self):
        return self.popen.pid

    @property
    def returncode(self):
        return self.popen.returncode

    def alive(self):
        return self.popen.poll() is None

    def describe(self):
        status = "running" if self.alive() else f"exit status {self.popen.returncode}"
        what = "with the layer" if self.layer and not BASELINE else "plain"
        return f"{self.name} (pid {self.pid}, host {self.host}, {what}, {status}): " \
               f"{' '.join(self.argv)}"

    def failure(self, why):
        return HarnessError(
            f"{self.describe()}\n{why}\n--- stderr tail ({self.err_path}) ---\n"
            f"{tail(self.err_path, 40)}\n--- stdout tail ({self.out_path}) ---\n"
            f"{tail(self.out_path, 20)}")

    def wait(self, timeout=RUN_TIMEOUT, check=True):
        """Wait for exit; kill the group and fail if it takes longer than timeout."""
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            snapshot = hang_snapshot(self.pid)
            self.stop()
            raise self.failure(f"did not finish within {timeout} s (killed)\n{snapshot}") \
                from None
        if check and self.popen.returncode != 0:
            raise self.failure(f"exit status {self.popen.returncode}")
        return self.popen.returncode

    def stop(self):
        """SIGTERM the whole group, SIGKILL it if still there after STOP_GRACE."""
        if self.alive():
            kill_group(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=STOP_GRACE)
            except subprocess.TimeoutExpired:
                pass
        # Children (a forking server's) may outlive the leader: always sweep the group.
        kill_group(self.pid, signal.SIGKILL)
        try:
            self.popen.wait(timeout=STOP_GRACE)
        except subprocess.TimeoutExpired:
            pass
        with _ALL_GROUPS_LOCK:
            _ALL_GROUPS.discard(self.pid)

    def stdout(self):
        return self.out_path.read_text(errors="replace")

    def stderr(self):
        return self.err_path.read_text(errors="replace")

    def json(self):
        """The whole stdout as one JSON document."""
        try:
            return json.loads(self.stdout())
        except ValueError as exc:
            raise self.failure(f"stdout is not JSON: {exc}") from None

    def json_lines(self):
        """Every stdout line that is a JSON object."""
        out = []
        for line in self.stdout().splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError as exc:
                    raise self.failure(f"bad JSON line {line!r}: {exc}") from None
        return out

    def last_json(self):
        lines = self.json_lines()
        if not lines:
            raise self.failure("printed no JSON result")
        return lines[-1]

    def assert_layer_loaded(self, timeout=5.0):
        """Check (while the program runs) that the layer is mapped into it."""
        if BASELINE:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                maps = Path(f"/proc/{self.pid}/maps").read_text()
            except OSError:
                maps = ""
            if PRELOAD_LIB.name in maps:
                return
            if not self.alive():
                break
            time.sleep(0.02)
        raise self.failure(f"{PRELOAD_LIB.name} is not mapped into the process; "
                           "the test would prove nothing about the layer")


def wait_listening(host, port, proc=None, timeout=LISTEN_TIMEOUT):
    """Wait until something listens on TCP port in host, without connecting to it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = subprocess.run(["nsenter", f"--net=/run/netns/{host}", "ss", "-Hltn",
                            "sport", "=", f":{port}"],
                           capture_output=True, text=True, timeout=VMICTL_TIMEOUT)
        if r.returncode == 0 and r.stdout.strip():
            return
        if proc is not None and not proc.alive():
            raise proc.failure(f"exited before listening on port {port}")
        time.sleep(0.05)
    if proc is not None:
        raise proc.failure(f"not listening on port {port} after {timeout} s")
    raise HarnessError(f"nothing listens on {host} port {port} after {timeout} s")


class Runner:
    """The programs one test starts; all of them are stopped when the test ends."""

    def __init__(self, logdir):
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.procs = []

    def start(self, host, argv, *, layer, name, env=None, stdin_path=None, cwd=None):
        name = f"{len(self.procs) + 1:02d}-{name}"
        p = Proc(name, host, argv, layer, env, self.logdir, stdin_path=stdin_path, cwd=cwd)
        self.procs.append(p)
        return p

    def run(self, host, argv, *, layer, name, timeout=RUN_TIMEOUT, check=True, env=None,
            stdin_path=None, cwd=None):
        """Start a program and wait for it to finish (exit status 0 unless check=False)."""
        p = self.start(host, argv, layer=layer, name=name, env=env, stdin_path=stdin_path,
                       cwd=cwd)
        p.wait(timeout=timeout, check=check)
        return p

    def server(self, host, argv, port, *, layer, name, env=None, cwd=None):
        """Start a server and wait until it listens on port."""
        p = self.start(host, argv, layer=layer, name=name, env=env, cwd=cwd)
        wait_listening(host, port, proc=p)
        return p

    def cleanup(self):
        for p in reversed(self.procs):
            p.stop()

    def report(self):
        parts = []
        for p in self.procs:
            parts.append(f"=== {p.describe()}\n--- stderr ({p.err_path}) ---\n{tail(p.err_path)}"
                         f"\n--- stdout ({p.out_path}) ---\n{tail(p.out_path, 30)}")
        return "\n".join(parts)


def python_prog(name, *args):
    """argv for one of the programs in tests/programs."""
    return [PYTHON, PROGRAMS / name, *args]


# ---------------------------------------------------------------------------------------------
# vmictl

class VmictlError(AssertionError):
    pass


def vmictl_status(host, timeout=VMICTL_TIMEOUT):
    """`vmictl status --json` inside host, parsed."""
    cmd = host_argv(host, [VMICTL_BIN, "status", "--json"], {})
    try:
        r = subprocess.run(cmd, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise VmictlError(f"vmictl status --json in {host} did not answer in {timeout} s") \
            from None
    if r.returncode != 0:
        raise VmictlError(f"vmictl status --json in {host}: exit status {r.returncode}: "
                          f"{r.stderr.decode(errors='replace').strip()[-500:]}")
    try:
        return json.loads(r.stdout)
    except ValueError as exc:
        raise VmictlError(f"vmictl status --json in {host} printed no JSON ({exc}): "
                          f"{r.stdout[:500]!r}") from None


_GID = re.compile(r"^[0-9a-f]{32}$")
_ADDR = re.compile(r"^\d{1,3}(\.\d{1,3}){3}:\d{1,5}$")
_CONN_INT_FIELDS = ("pid", "bytes_sent", "bytes_received", "msgs_sent", "msgs_received",
                    "unacked_bytes", "window")


def status_problems(status):
    """Ways a status document departs from the documented shape (empty list if none)."""
    problems = []
    if not isinstance(status, dict):
        return [f"not an object: {status!r:.200}"]
    if not isinstance(status.get("node"), str) or not status.get("node"):
        problems.append(f"node: expected a non-empty string, got {status.get('node')!r}")
    procs = status.get("processes")
    if not isinstance(procs, list):
        problems.append(f"processes: expected a list, got {procs!r:.200}")
    else:
        for p in procs:
            if not (isinstance(p, dict) and isinstance(p.get("pid"), int)
                    and isinstance(p.get("name"), str)
                    and isinstance(p.get("connections"), int)):
                problems.append(f"bad process entry {p!r:.200}")
    conns = status.get("connections")
    if not isinstance(conns, list):
        problems.append(f"connections: expected a list, got {conns!r:.200}")
        return problems
    for c in conns:
        if not isinstance(c, dict):
            problems.append(f"bad connection entry {c!r:.200}")
            continue
        bad = []
        if not (isinstance(c.get("gid"), str) and _GID.match(c["gid"])):
            bad.append("gid")
        for f in ("local", "peer"):
            if not (isinstance(c.get(f), str) and _ADDR.match(c[f])):
                bad.append(f)
        if not isinstance(c.get("substrate"), str):
            bad.append("substrate")
        ch = c.get("chain")
        if not (isinstance(ch, dict) and all(isinstance(ch.get(k), str) for k in ("send", "recv"))):
            bad.append("chain")
        for f in _CONN_INT_FIELDS:
            if not (isinstance(c.get(f), int) and c[f] >= 0):
                bad.append(f)
        if bad:
            problems.append(f"connection entry with bad {', '.join(bad)}: {c!r:.300}")
    return problems


class Watcher:
    """Polls `vmictl status --json` on some hosts while a test's traffic runs.

    Connections appear in vmictl only while a process holds them open, so the union of
    everything seen during the run is what the assertions look at. For each (host, gid,
    local) the latest record is kept, with byte and message counters at their maximum.
    """

    def __init__(self, *hosts, interval=POLL_INTERVAL):
        self.hosts = [h for h in hosts]
        self.interval = interval
        self.conns = {h: {} for h in self.hosts}
        self.processes = {h: {} for h in self.hosts}
        self.snapshots = {h: 0 for h in self.hosts}
        self.errors = {h: [] for h in self.hosts}
        self.problems = []
        self._stop = threading.Event()
        self._thread = None
        self._lock = threading.Lock()

    def __enter__(self):
        if not BASELINE:
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name="vmictl-watcher")
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    def stop(self):
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=VMICTL_TIMEOUT * len(self.hosts) + 5)
        self._thread = None
        self.poll_once()

    def _loop(self):
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.interval)

    def poll_once(self):
        for h in self.hosts:
            try:
                status = vmictl_status(h)
            except VmictlError as exc:
                with self._lock:
                    self.errors[h].append(str(exc))
                continue
            self._merge(h, status)

    def _merge(self, host, status):
        problems = status_problems(status)
        with self._lock:
            self.snapshots[host] += 1
            if problems:
                self.problems.extend(f"{host}: {p}" for p in problems[:5])
                if len(self.problems) > 50:
                    del self.problems[50:]
            for p in status.get("processes") or []:
                if isinstance(p, dict) and "pid" in p:
                    self.processes[host][p["pid"]] = p
            for c in status.get("connections") or []:
                if not isinstance(c, dict):
                    continue
                key = (c.get("gid"), c.get("local"), c.get("peer"))
                old = self.conns[host].get(key)
                rec = dict(c)
                if old is not None:
                    for f in ("bytes_sent", "bytes_received", "msgs_sent", "msgs_received"):
                        if isinstance(old.get(f), int) and isinstance(rec.get(f), int):
                            rec[f] = max(old[f], rec[f])
                self.conns[host][key] = rec

    def connections(self, host):
        with self._lock:
            return list(self.conns[host].values())

    def require_snapshots(self, *hosts, minimum=2):
        """Fail unless vmictl answered often enough on hosts while the traffic ran."""
        for h in hosts or self.hosts:
            if self.snapshots[h] < minimum:
                errs = "\n".join(self.errors[h][-5:]) or "(no errors recorded)"
                raise VmictlError(f"only {self.snapshots[h]} vmictl snapshots of {h} were "
                                  f"taken while the programs ran (need {minimum}); last "
                                  f"errors:\n{errs}")
        if self.problems:
            raise VmictlError("vmictl status --json does not have the documented shape:\n"
                              + "\n".join(self.problems[:20]))

    def summary(self, host):
        conns = self.connections(host)
        lines = [f"{host}: {self.snapshots[host]} snapshots, {len(conns)} connections seen, "
                 f"{len(self.errors[host])} vmictl errors"]
        for c in conns[:40]:
            lines.append(f"  gid={c.get('gid')} pid={c.get('pid')} local={c.get('local')} "
                         f"peer={c.get('peer')} sent={c.get('bytes_sent')} "
                         f"received={c.get('bytes_received')}")
        if len(conns) > 40:
            lines.append(f"  ... {len(conns) - 40} more")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Assertions on what vmictl saw

BYTES_LOW_FRACTION = 0.5    # a snapshot may precede the last bytes of a short-lived connection
BYTES_HIGH_FRACTION = 1.05
BYTES_HIGH_SLACK = 1 << 20  # control traffic (iperf3's control connection, headers)


def server_ends(watcher, host, server_addr):
    return [c for c in watcher.connections(host) if c.get("local") == server_addr]


def client_ends(watcher, host, server_addr):
    return [c for c in watcher.connections(host) if c.get("peer") == server_addr]


def _check_bytes(what, counted, expected, exact, watcher, hosts):
    if exact:
        ok = counted == expected
        rule = "exactly"
    else:
        low = int(expected * BYTES_LOW_FRACTION)
        high = int(expected * BYTES_HIGH_FRACTION) + BYTES_HIGH_SLACK
        ok = low <= counted <= high
        rule = f"between {low} and {high} for"
    if not ok:
        seen = "\n".join(watcher.summary(h) for h in hosts)
        raise AssertionError(f"{what}: vmictl counted {counted} bytes, expected {rule} "
                             f"{expected} moved by the programs\n{seen}")


def assert_virtual(watcher, server_host, server_addr, client_host, *, min_conns=1,
                   c2s_bytes=None, s2c_bytes=None, exact=False, client_pid=None,
                   server_pids_not=None, substrate=None):
    """The connections to server_addr were virtual at both ends.

    Both hosts must list at least min_conns connections to/from server_addr, both ends of a
    connection carry the same GID, and (if given) the bytes vmictl counted match what the
    programs moved (c2s: client to server, s2c: server to client).
    """
    if BASELINE:
        return
    hosts = sorted({server_host, client_host})
    watcher.require_snapshots(*hosts)
    srv = server_ends(watcher, server_host, server_addr)
    cli = client_ends(watcher, client_host, server_addr)
    seen = "\n".join(watcher.summary(h) for h in hosts)
    assert len(srv) >= min_conns, \
        f"{server_host} listed {len(srv)} virtual connections at {server_addr} " \
        f"(server ends), expected at least {min_conns}\n{seen}"
    assert len(cli) >= min_conns, \
        f"{client_host} listed {len(cli)} virtual connections to {server_addr} " \
        f"(client ends), expected at least {min_conns}\n{seen}"
    common = {c["gid"] for c in srv} & {c["gid"] for c in cli}
    assert len(common) >= min_conns, \
        f"only {len(common)} GIDs are listed at both ends of connections to {server_addr}, " \
        f"expected at least {min_conns} (both ends of a virtual connection share its GID)" \
        f"\n{seen}"
    if client_pid is not None:
        pids = {c["pid"] for c in cli}
        assert pids == {client_pid}, \
            f"client ends of connections to {server_addr} list pids {sorted(pids)}, " \
            f"expected only the client's pid {client_pid}\n{seen}"
    if substrate is not None:
        # "tcp/CHAIN": kernel TCP, with filters CHAIN on the connections (see PLACES).
        substrate, _, chain = substrate.partition("/")
        other = [(c["gid"], c["substrate"]) for c in srv + cli if c["substrate"] != substrate]
        assert not other, f"connections to {server_addr} not on {substrate}: {other[:5]}\n{seen}"
        two_way = any(c.get("bytes_sent", 0) > 0 and c.get("bytes_received", 0) > 0 for c in cli)
        if chain and two_way:
            # (A side learns that its offer was taken only by reading: without bytes both
            # ways nothing says the chain was used.) Some direction of some connection was coded: its sender lists the chain for
            # what it sends and its receiver for what it receives. (A side that sends a few
            # bytes and never reads again does not see the answer to its offer: its bytes go
            # plain, and only the peer lists the chain, as taken.)
            def ch(c, k):
                return (c.get("chain") or {}).get(k)
            by_gid = {c["gid"]: c for c in srv}
            assert any(c["gid"] in by_gid and ((ch(c, "send") == chain
                                                 and ch(by_gid[c["gid"]], "recv") == chain)
                                                or (ch(c, "recv") == chain
                                                    and ch(by_gid[c["gid"]], "send") == chain))
                       for c in cli), \
                f"no connection to {server_addr} listed chain {chain!r} at both ends " \
                f"ends: server ends {[c.get('chain') for c in srv][:8]}, client ends " \
                f"{[c.get('chain') for c in cli][:8]}\n{seen}"
    if server_pids_not is not None:
        bad = [c for c in srv if c["pid"] in server_pids_not]
        assert not bad, f"server ends still attributed to pid(s) {server_pids_not} in " \
                        f"their latest snapshot: {bad[:5]}\n{seen}"
    if c2s_bytes is not None:
        _check_bytes(f"bytes_sent at the client ends ({client_host})",
                     sum(c["bytes_sent"] for c in cli), c2s_bytes, exact, watcher, hosts)
        _check_bytes(f"bytes_received at the server ends ({server_host})",
                     sum(c["bytes_received"] for c in srv), c2s_bytes, exact, watcher, hosts)
    if s2c_bytes is not None:
        _check_bytes(f"bytes_sent at the server ends ({server_host})",
                     sum(c["bytes_sent"] for c in srv), s2c_bytes, exact, watcher, hosts)
        _check_bytes(f"bytes_received at the client ends ({client_host})",
                     sum(c["bytes_received"] for c in cli), s2c_bytes, exact, watcher, hosts)


def assert_plain(watcher, server_addr, *, server_host=None, client_host=None):
    """No host lists a connection to/from server_addr as virtual."""
    if BASELINE:
        return
    hosts = [h for h in (server_host, client_host) if h is not None]
    watcher.require_snapshots(*hosts)
    for host in hosts:
        listed = server_ends(watcher, host, server_addr) + client_ends(watcher, host,
                                                                       server_addr)
        assert not listed, \
            f"{host} lists connections to/from {server_addr} as virtual, but only one " \
            f"side runs the layer: they must stay plain TCP\n{watcher.summary(host)}"


def assert_same_stream(client, server):
    """Two stream.py results (client and server side of one connection) agree."""
    for r in (client, server):
        assert "error" not in r, f"stream.py {r.get('role')} reported an error: {r}"
    assert client["sent_bytes"] == server["recv_bytes"], \
        f"client sent {client['sent_bytes']} bytes, server received {server['recv_bytes']}"
    assert client["sent_sha256"] == server["recv_sha256"], \
        "client->server bytes differ (SHA-256 of what the client sent and what the server " \
        f"received): {client['sent_sha256']} != {server['recv_sha256']}"
    assert server["sent_bytes"] == client["recv_bytes"], \
        f"server sent {server['sent_bytes']} bytes, client received {client['recv_bytes']}"
    assert server["sent_sha256"] == client["recv_sha256"], \
        "server->client bytes differ (SHA-256 of what the server sent and what the client " \
        f"received): {server['sent_sha256']} != {client['recv_sha256']}"


# ---------------------------------------------------------------------------------------------
# Topology and agents

def topo(*args):
    env = dict(os.environ, VMI_NET0=NET0, VMI_NET1=NET1)
    r = subprocess.run(["bash", str(TOPO_SCRIPT), *args], env=env, capture_output=True,
                       text=True, timeout=60)
    if r.returncode != 0:
        raise HarnessError(f"scripts/topo.sh {' '.join(args)} failed ({r.returncode}):\n"
                           f"{r.stdout}{r.stderr}")
    return r.stdout


def topo_up():
    topo("down-all", PREFIX)
    topo("up", str(NUM_HOSTS), PREFIX)


def topo_down():
    topo("down-all", PREFIX)


_CLUSTER_KEYS = {}


def cluster_key(name="cluster"):
    """A cluster key file made with `vmi-agent --init` for this test session (one per
    name: agents given another name's key are strangers to the session's cluster); removed
    at exit."""
    if name not in _CLUSTER_KEYS:
        import atexit
        import shutil
        import tempfile
        d = Path(tempfile.mkdtemp(prefix="vmit-key-"))
        atexit.register(shutil.rmtree, d, True)
        path = d / f"{name}.key"
        subprocess.run([str(AGENT_BIN), "--init", "--key", str(path)], check=True,
                       capture_output=True, timeout=10)
        _CLUSTER_KEYS[name] = path
    return _CLUSTER_KEYS[name]


class Agent:
    """vmi-agent running in the foreground inside one host, with the session's cluster key
    unless `key` names another."""

    def __init__(self, host, logdir, name=None, args=(), key="cluster"):
        self.host = host
        self.key = cluster_key(key)
        args = ["--relink-ports", AGENT_RELINK_PORTS, *args]
        self.proc = Proc(name or f"agent-{host}", host, [AGENT_BIN, *map(str, args)], layer=False,
                         env={"VMI_LOG": AGENT_LOG, "VMI_CLUSTER_KEY": str(self.key)},
                         logdir=logdir)

    def wait_ready(self, timeout=AGENT_READY_TIMEOUT):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if not self.proc.alive():
                raise self.proc.failure("vmi-agent exited during start-up")
            try:
                status = vmictl_status(self.host, timeout=max(0.5, deadline - time.monotonic()))
            except VmictlError as exc:
                last = exc
                time.sleep(0.1)
                continue
            return status
        raise self.proc.failure(f"vmictl status --json did not succeed within {timeout} s "
                                f"of starting the agent; last error: {last}")

    def stop(self):
        self.proc.stop()


# ---------------------------------------------------------------------------------------------
# Link failure: faults injected into the topology, and what vmictl says about networks, paths
# and the physical links of virtual connections

# The agents a test started beyond the session's (their logs go in its failure report).
TEST_AGENTS = []


@contextlib.contextmanager
def extra_agent(host, logdir, name, args=(), key="cluster"):
    """An agent in host beyond the session's two (for a test or a module), ready; stopped
    when the block ends."""
    agent = Agent(host, logdir, name=name, args=args, key=key)
    TEST_AGENTS.append(agent)
    try:
        agent.wait_ready()
        yield agent
    finally:
        agent.stop()


NOBODY = 65534   # the unprivileged user of tests that check who may do what


def rated_stream(procs, server_host, server_ip, client_host, port, nbytes, rate):
    """A layered stream.py server (one connection) and a client sending nbytes at rate bytes
    per second, so the connection stays open a while; (client Proc, server address)."""
    addr = f"{server_ip}:{port}"
    procs.server(server_host, python_prog("stream.py", "server", "--bind", addr, "--count", "1"),
                 port, layer=True, name=f"server-{port}")
    cli = procs.start(client_host, python_prog("stream.py", "client", "--connect", addr,
                                               "--bytes", nbytes, "--seed", port, "--rate", rate),
                      layer=True, name=f"client-{port}")
    return cli, addr


@contextlib.contextmanager
def public_copies(*files):
    """A folder (removed afterwards) with copies of files that any user may read and run
    (the build folder may not be open to other users)."""
    import shutil
    import tempfile
    d = Path(tempfile.mkdtemp(prefix="vmit-public-"))
    try:
        os.chmod(d, 0o755)
        for f in files:
            shutil.copy(f, d / Path(f).name)
            os.chmod(d / Path(f).name, 0o755)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def require_root_and_build():
    """Fails the calling fixture unless it runs as root with the agent, vmictl and the layer
    built (tests that make network namespaces of their own)."""
    if os.geteuid() != 0:
        pytest.fail("needs root (network namespaces)", pytrace=False)
    for path in (AGENT_BIN, VMICTL_BIN, PRELOAD_LIB):
        if not path.is_file():
            pytest.fail(f"{path} is missing: build the workspace first", pytrace=False)


def capture(argv, timeout=20, **kw):
    """argv run to its end, output captured as text; the CompletedProcess."""
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout,
                          **kw)


def in_netns(ns, argv, **kw):
    """argv run inside network namespace ns (nsenter: the network namespace only), captured."""
    return capture(["nsenter", f"--net=/run/netns/{ns}", *argv], **kw)


def as_nobody(host, argv, env=None, timeout=20):
    """argv run in host as the unprivileged user NOBODY; the CompletedProcess."""
    return subprocess.run(host_argv(host, ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                                           "--clear-groups", *map(str, argv)], env or {}),
                          capture_output=True, text=True, timeout=timeout)


def vmictl_as_nobody(host, *args, timeout=20):
    """`vmictl ARGS` in host as NOBODY (from a copy any user may run)."""
    with public_copies(VMICTL_BIN) as d:
        return as_nobody(host, [d / "vmictl", *args], timeout=timeout)


def scrape_metrics(host, addr):
    """The OpenMetrics text an agent serves at http://addr/metrics, fetched inside host."""
    r = subprocess.run(host_argv(host, ["curl", "-sS", "--fail", "--max-time", "5",
                                        f"http://{addr}/metrics"], {}),
                       capture_output=True, text=True, timeout=10)
    assert r.returncode == 0, r.stderr
    return r.stdout


def metric_samples(text, name):
    """{labels text: value} of every sample of metric `name` in OpenMetrics text."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, value = line.rsplit(" ", 1)
        base, _, rest = key.partition("{")
        if base == name:
            out[rest.rstrip("}")] = float(value)
    return out


def metric(text, name, **labels):
    """The value of the sample of `name` with these labels (0 when absent)."""
    for rest, value in metric_samples(text, name).items():
        got = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
        if all(got.get(k) == f'"{v}"' for k, v in labels.items()):
            return value
    return 0.0


def ip_cmd(*args):
    """`ip ARGS` on the machine (pass "-n", HOST to act inside a host); its stdout."""
    argv = ["ip", *[str(a) for a in args]]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise HarnessError(f"{' '.join(argv)} did not finish within {IP_TIMEOUT} s") from None
    if r.returncode != 0:
        raise HarnessError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def link_down(host, ifname=ETH0):
    """Loud failure: the interface goes down inside the host. Its routes go with it, so the
    host's sends on that network fail at once (its IPv4 address stays)."""
    ip_cmd("-n", host, "link", "set", "dev", ifname, "down")


def link_up(host, ifname=ETH0):
    """Undoes link_down (idempotent)."""
    ip_cmd("-n", host, "link", "set", "dev", ifname, "up")


def blackhole(host, net=0):
    """Silent failure: the host's veth is taken off its network's bridge. Inside the host the
    interface stays up with its address and routes, sends succeed, and nothing arrives in
    either direction: only silence tells."""
    ip_cmd("link", "set", "dev", host_veth(host, net), "nomaster")


def unblackhole(host, net=0):
    """Undoes blackhole (idempotent)."""
    ip_cmd("link", "set", "dev", host_veth(host, net), "master", bridge(net))
    ip_cmd("link", "set", "dev", host_veth(host, net), "up")


def link_is_up(host, ifname):
    """True if the interface inside host is administratively up."""
    out = ip_cmd("-n", host, "-o", "link", "show", "dev", ifname)
    m = re.search(r"<([^>]*)>", out)
    return bool(m) and "UP" in m.group(1).split(",")


def veth_attached(host, net=0):
    """True if the host's veth of network `net` is on its bridge."""
    return f"master {bridge(net)} " in ip_cmd("-o", "link", "show", "dev", host_veth(host, net))


class Flapper:
    """Takes an interface of a host down and up again, every `period` seconds (down for one
    period, up for the next) for `duration` seconds, in a thread. It always leaves the
    interface up, also when stopped early or when an `ip` command fails."""

    def __init__(self, host, ifname=ETH0, period=0.2, duration=10.0):
        self.host = host
        self.ifname = ifname
        self.period = period
        self.duration = duration
        self.toggles = 0
        self.error = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"flap-{host}-{ifname}")

    def start(self):
        self._thread.start()
        return self

    def _run(self):
        deadline = time.monotonic() + self.duration
        down = False
        try:
            while not self._stop.is_set() and time.monotonic() < deadline:
                (link_up if down else link_down)(self.host, self.ifname)
                down = not down
                self.toggles += 1
                self._stop.wait(self.period)
        except Exception as exc:  # reported by check()
            self.error = exc
        finally:
            try:
                link_up(self.host, self.ifname)
            except Exception as exc:
                self.error = self.error or exc

    def join(self, timeout=None):
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self):
        self._stop.set()
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join(timeout=IP_TIMEOUT * 2)

    def check(self):
        if self.error is not None:
            raise HarnessError(f"flapping {self.ifname} of {self.host} failed after "
                               f"{self.toggles} changes: {self.error}")


def vmictl(host, *args, timeout=VMICTL_TIMEOUT):
    """`vmictl ARGS` inside host: the CompletedProcess (text), whatever its exit status."""
    cmd = host_argv(host, [VMICTL_BIN, *args], {})
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise VmictlError(f"vmictl {' '.join(map(str, args))} in {host} did not answer in "
                          f"{timeout} s") from None


def vmictl_ok(host, *args):
    r = vmictl(host, *args)
    if r.returncode != 0:
        raise VmictlError(f"vmictl {' '.join(map(str, args))} in {host}: exit status "
                          f"{r.returncode}: {(r.stderr + r.stdout).strip()[-500:]}")
    return r


def net_down(host, name):
    """`vmictl net down NAME` in host: the node takes that network out of service."""
    return vmictl_ok(host, "net", "down", name)


def net_up(host, name):
    """`vmictl net up NAME` in host: the network is back in service."""
    return vmictl_ok(host, "net", "up", name)


class Faults:
    """The network faults one test injects. Each is remembered before it is made; a test may
    undo one itself (link_up, unblackhole, net_up), and restore() (the `faults` fixture calls
    it when the test ends, passed or failed) undoes all the others in reverse order, trying
    every one even if some fail."""

    def __init__(self):
        self._undo = []         # (key, description, function)
        self._flappers = []

    def _remember(self, key, what, fn):
        self._undo.append((key, what, fn))

    def _forget(self, key):
        self._undo = [u for u in self._undo if u[0] != key]

    def link_down(self, host, ifname=ETH0):
        self._remember(("link", host, ifname), f"ip -n {host} link set {ifname} up",
                       lambda: link_up(host, ifname))
        link_down(host, ifname)

    def link_up(self, host, ifname=ETH0):
        link_up(host, ifname)
        self._forget(("link", host, ifname))

    def blackhole(self, host, net=0):
        self._remember(("bridge", host, net),
                       f"ip link set {host_veth(host, net)} master {bridge(net)}",
                       lambda: unblackhole(host, net))
        blackhole(host, net)

    def unblackhole(self, host, net=0):
        unblackhole(host, net)
        self._forget(("bridge", host, net))

    def net_down(self, host, name):
        self._remember(("net", host, name), f"vmictl net up {name} in {host}",
                       lambda: net_up(host, name))
        return net_down(host, name)

    def net_up(self, host, name):
        r = net_up(host, name)
        self._forget(("net", host, name))
        return r

    def flap(self, host, ifname=ETH0, period=0.2, duration=10.0):
        """Starts a Flapper (stopped by restore() at the latest); returns it."""
        self._remember(("flap", host, ifname), f"ip -n {host} link set {ifname} up",
                       lambda: link_up(host, ifname))
        f = Flapper(host, ifname, period, duration)
        self._flappers.append(f)
        return f.start()

    def restore(self):
        errors = []
        for f in self._flappers:
            f.stop()
        self._flappers.clear()
        for _, what, fn in reversed(self._undo):
            try:
                fn()
            except Exception as exc:
                errors.append(f"{what}: {exc}")
        self._undo.clear()
        if errors:
            raise HarnessError("could not undo the test's network faults (later tests may "
                               "fail for that reason):\n  " + "\n  ".join(errors))


def client_conns(status, server_addr):
    """Connections of a status document whose peer is server_addr (client ends)."""
    return [c for c in status.get("connections") or [] if c.get("peer") == server_addr]


def server_conns(status, server_addr):
    """Connections of a status document whose local address is server_addr (server ends)."""
    return [c for c in status.get("connections") or [] if c.get("local") == server_addr]


def describe_links(status):
    """Networks, paths and the physical links of connections of a status document, for
    failure messages."""
    if not isinstance(status, dict):
        return f"(no status: {status!r:.200})"
    lines = [f"node {status.get('node')!r}"]
    for n in status.get("networks") or []:
        lines.append(f"  network {n}")
    for p in status.get("paths") or []:
        lines.append(f"  path {p}")
    for c in (status.get("connections") or [])[:20]:
        lines.append(f"  connection gid={c.get('gid')} pid={c.get('pid')} "
                     f"local={c.get('local')} peer={c.get('peer')} "
                     f"network={c.get('network')!r} link={c.get('link_local')}->"
                     f"{c.get('link_peer')} failovers={c.get('failovers')} "
                     f"state={c.get('link')!r} error={c.get('error')} "
                     f"sent={c.get('bytes_sent')} received={c.get('bytes_received')}")
    return "\n".join(lines)


def wait_status(host, check, timeout, what):
    """Polls `vmictl status --json` in host until check(status) is truthy; returns that value.
    Fails with the last status seen if it does not happen within timeout seconds."""
    deadline = time.monotonic() + timeout
    last, err = None, None
    while True:
        try:
            last = vmictl_status(host)
            got = check(last)
            if got:
                return got
        except VmictlError as exc:
            err = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen in {host} within {timeout} s\nlast status: "
                                 f"{describe_links(last)}\nlast vmictl error: {err}")
        time.sleep(POLL_INTERVAL)


def wait_conn(host, server_addr, check, timeout, what, side="client"):
    """Waits until host lists a connection to (side "client") or at (side "server")
    server_addr for which check(connection) is true; returns that connection record."""
    pick = client_conns if side == "client" else server_conns

    def find(status):
        for c in pick(status, server_addr):
            if check(c):
                return c
        return None
    return wait_status(host, find, timeout, what)


def network_entry(status, name):
    """The entry of `networks` named name, or None."""
    for n in status.get("networks") or []:
        if isinstance(n, dict) and n.get("name") == name:
            return n
    return None


def paths_on(status, network):
    """Entries of `paths` on one of the node's networks (interface name)."""
    return [p for p in status.get("paths") or [] if isinstance(p, dict)
            and p.get("network") == network]


_IP = re.compile(r"^\d{1,3}(\.\d{1,3}){3}$")


def failover_problems(status):
    """Ways a status document departs from the documented link-failure fields: `networks`,
    `paths`, and network, link_local, link_peer, failovers of every connection."""
    problems = []
    nets = status.get("networks")
    if not isinstance(nets, list):
        problems.append(f"networks: expected a list, got {nets!r:.200}")
    else:
        for n in nets:
            if not (isinstance(n, dict) and isinstance(n.get("name"), str) and n["name"]
                    and isinstance(n.get("addr"), str) and n.get("admin") in ("up", "down")):
                problems.append(f"bad networks entry {n!r:.200}")
    paths = status.get("paths")
    if not isinstance(paths, list):
        problems.append(f"paths: expected a list, got {paths!r:.200}")
    else:
        for p in paths:
            if not (isinstance(p, dict) and isinstance(p.get("local"), str)
                    and isinstance(p.get("peer"), str) and isinstance(p.get("network"), str)
                    and p.get("state") in ("alive", "dead")
                    and isinstance(p.get("silent_ms"), int) and p["silent_ms"] >= 0):
                problems.append(f"bad paths entry {p!r:.200}")
    for c in status.get("connections") or []:
        if not isinstance(c, dict):
            continue
        bad = []
        if not (isinstance(c.get("network"), str) and c["network"]):
            bad.append("network")
        for f in ("link_local", "link_peer"):
            if not (isinstance(c.get(f), str) and _ADDR.match(c[f])):
                bad.append(f)
        if not (isinstance(c.get("failovers"), int) and c["failovers"] >= 0):
            bad.append("failovers")
        if bad:
            problems.append(f"connection entry with bad {', '.join(bad)}: {c!r:.300}")
    return problems


def paths_alive(host):
    """True if host's agent answers and lists every path it knows toward the session's agent
    hosts as alive (an agent also keeps the dead paths toward agents that tests started and
    stopped in other hosts)."""
    try:
        status = vmictl_status(host)
    except VmictlError:
        return False
    ours = {host_ip(h, n) for h in AGENT_HOSTS for n in (0, 1)}
    return all(isinstance(p, dict) and p.get("state") == "alive"
               for p in status.get("paths") or [] if p.get("peer") in ours)


def wait_paths_alive(hosts, timeout=PATH_RECOVERY_TIMEOUT):
    """Waits until the agents of hosts see every path alive (after a fault was undone, so
    that the next test starts on a healthy topology); False if that does not happen."""
    if BASELINE:
        return True
    deadline = time.monotonic() + timeout
    while True:
        if all(paths_alive(h) for h in hosts):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_INTERVAL)


_RESTARTS = iter(range(1, 1 << 30))


class AgentControl:
    """Kills and restarts the session's agents (the dict the `topology` fixture shares, so
    the replacement is the one later tests, the dead-agent checks and the session teardown
    see). restore() restarts every agent that is not running."""

    def __init__(self, agents):
        self.agents = agents

    def kill(self, host, sig=signal.SIGKILL):
        """Sends sig (default SIGKILL: no clean-up at all) to host's agent and reaps it."""
        proc = self.agents[host].proc
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.popen.wait(timeout=STOP_GRACE)
        except subprocess.TimeoutExpired:
            raise proc.failure(f"vmi-agent did not die of signal {sig}") from None

    def restart(self, host):
        """Starts a new agent in host (stopping what is left of the old one); waits until
        vmictl answers."""
        old = self.agents[host]
        old.stop()
        new = Agent(host, old.proc.out_path.parent,
                    name=f"agent-{host}-restart{next(_RESTARTS)}")
        self.agents[host] = new
        new.wait_ready()
        return new

    def restore(self):
        for host, agent in list(self.agents.items()):
            if not agent.proc.alive():
                self.restart(host)


def program_lines(text):
    """Lines of a layered program's output that are not the layer's own log lines."""
    return [line for line in text.splitlines() if not line.startswith("vmi[")]


def write_random_file(path, size):
    """Fills path with size random bytes; their SHA-256 (hex)."""
    h = hashlib.sha256()
    with open(path, "wb") as f:
        left = size
        while left:
            chunk = os.urandom(min(left, 1 << 20))
            f.write(chunk)
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def sha256_file(path):
    """SHA-256 (hex) of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def clean_env(**extra):
    """The environment without the settings the agent or the layer read from it."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VMI_CLUSTER_KEY", "VMI_LOG", "VMI_AGENT_SOCKET", "LD_PRELOAD", "NOTIFY_SOCKET")}
    env.update(extra)
    return env


class AgentProc:
    """vmi-agent in a namespace, its output in files; readiness through NOTIFY_SOCKET."""

    def __init__(self, ns, args, logdir, name):
        self.ns = ns
        self.err_path = logdir / f"{name}.err"
        self.notify_path = logdir / f"{name}.notify"
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(self.notify_path))
        env = clean_env(NOTIFY_SOCKET=str(self.notify_path))
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{ns}", str(AGENT_BIN), *map(str, args)],
                stdout=err, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, timeout=10.0):
        self.notify.settimeout(timeout)
        try:
            msg = self.notify.recv(4096).decode()
        except socket.timeout:
            raise AssertionError(f"no READY=1 within {timeout} s; rc {self.proc.poll()}\n{self.log()}")
        assert "READY=1" in msg.split("\n"), msg
        return msg

    def log(self):
        return self.err_path.read_text(errors="replace")

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        self.notify.close()


# ---------------------------------------------------------------------------------------------
# Hosts on one switch, for modules that build namespaces of their own (test_hierarchy,
# test_directory): one bridge in namespace PREFIX-sw, each host's eth0 on it.

def delete_star(prefix, hosts):
    """Removes the hosts (namespace names) and the switch namespace `prefix`-sw; what does not
    exist is skipped."""
    for h in [*hosts, f"{prefix}-sw"]:
        subprocess.run(["ip", "netns", "del", h], capture_output=True)


def build_star(prefix, hosts):
    """hosts: {namespace: (veth name on the switch, address/prefix)}; removes leftovers first."""
    delete_star(prefix, hosts)
    sw = f"{prefix}-sw"
    subprocess.run(["ip", "netns", "add", sw], check=True)
    subprocess.run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"], check=True)
    subprocess.run(["ip", "-n", sw, "link", "set", "br0", "up"], check=True)
    for h, (veth, addr) in hosts.items():
        subprocess.run(["ip", "netns", "add", h], check=True)
        subprocess.run(["ip", "-n", h, "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "link", "add", "eth0", "netns", h, "type", "veth", "peer", "name", veth,
                        "netns", sw], check=True)
        subprocess.run(["ip", "-n", h, "addr", "add", addr, "dev", "eth0"], check=True)
        subprocess.run(["ip", "-n", h, "link", "set", "eth0", "up"], check=True)
        subprocess.run(["ip", "-n", sw, "link", "set", veth, "master", "br0", "up"], check=True)


def wait_for(what, check, timeout, every=0.05):
    """check() until it is truthy (returned); AssertionError naming `what` after timeout s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout} s")


class Group:
    """A program in a session of its own (killed with its children), output in `log`."""

    def __init__(self, argv, log):
        self.log_path = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen([str(a) for a in argv], stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, env=clean_env(), start_new_session=True)

    def alive(self):
        return self.proc.poll() is None

    def stop(self, sig=9):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)

    def output(self):
        return self.log_path.read_text(errors="replace")

    def last_json(self):
        for line in reversed(self.output().splitlines()):
            if line.startswith("{"):
                return json.loads(line)
        raise AssertionError(f"no JSON result in {self.log_path}:\n{self.output()[-2000:]}")


# Words stream.py --text sends (long enough not to turn up by chance in coded bytes).
TEXT_WORDS = (b"connection", b"virtual", b"network", b"device", b"filter")


def words_on_wire(host, tmp_path, name, seconds=1.5):
    """How many of TEXT_WORDS (stream.py --text) a capture of host's eth0 holds, over
    `seconds`; and the capture's size."""
    path = tmp_path / f"{name}.pcap"
    r = in_netns(host, ["timeout", str(seconds), "tcpdump", "-i", ETH0, "-s", "0", "-U",
                          "-Z", "root", "-w", str(path), "tcp"])
    assert r.returncode in (0, 124), r.stderr
    data = path.read_bytes()
    assert len(data) > 256 << 10, f"the capture {name} holds only {len(data)} bytes"
    return sum(data.count(w) for w in TEXT_WORDS), len(data)


def chain_of(c):
    """(send, recv) chain of a connection record."""
    ch = c.get("chain") or {}
    return ch.get("send"), ch.get("recv")


def both_ways(gid, want, since_ms=0, timeout=5, hosts=(H1, H2)):
    """Waits until both ends of connection gid (on hosts) send and receive through chain
    `want`; returns how long after `since_ms` (wall clock) the later end switched what it
    sends."""
    at = []
    for host in hosts:
        c = wait_status(host, lambda st: next((c for c in st.get("connections", [])
                                               if c.get("gid") == gid
                                               and chain_of(c) == (want, want)), None),
                        timeout, f"{host}'s end of {gid} on chain {want!r} both ways")
        at.append(c["chain"]["send_since_ms"])
    return (max(at) - since_ms) / 1000


def strace_counts(path):
    """{syscall: calls} from an `strace -c` summary."""
    out = {}
    for line in Path(path).read_text().splitlines():
        m = re.match(r"\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$", line)
        if m and m.group(2) != "total":
            out[m.group(2)] = int(m.group(1))
    return out
