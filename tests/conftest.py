"""Fixtures of the integration suite.

Session: three namespace hosts (scripts/topo.sh, prefix "vmit", networks 10.78.0/24 and
10.78.1/24), a vmi-agent in hosts 1 and 2, none in host 3. Torn down at the end of the
session, on failure, on SIGTERM and, as a last resort, at interpreter exit.

Per test: `procs`, a Runner that starts programs in hosts with or without the layer, logs
their output under the test's temporary folder and stops them all when the test ends. When a
test fails, the logs of its programs and of the agents are attached to the report.

For link-failure tests: `faults` injects network faults and undoes them all when the test
ends; `agent_control` kills agents and restarts them (again, at the latest, when the test
ends, before the dead-agent check).
"""

import atexit
import os
import shutil
import signal
import sys

import pytest

import helpers
from helpers import (AGENT_BIN, AGENT_HOSTS, BASELINE, PATH_RECOVERY_TIMEOUT, PRELOAD_LIB,
                     PYTHON, SYSTEM_TOOLS, VMICTL_BIN, Agent, AgentControl, Faults, Runner,
                     VmictlError, tail, topo_down, topo_up, vmictl_status, wait_paths_alive)

_SESSION = {"topology_up": False, "agents": {}}


def _last_resort_cleanup():
    helpers.kill_all_groups()
    if _SESSION["topology_up"]:
        _SESSION["topology_up"] = False
        try:
            topo_down()
        except Exception as exc:  # at exit there is no one left to raise to
            print(f"vmi tests: topology teardown failed: {exc}", file=sys.stderr)


atexit.register(_last_resort_cleanup)


def _on_sigterm(signum, frame):
    # Unwind through pytest so that fixture teardown runs.
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config):
    signal.signal(signal.SIGTERM, _on_sigterm)


def pytest_report_header(config):
    lines = [f"vmi: layer {PRELOAD_LIB}", f"vmi: agent {AGENT_BIN}, vmictl {VMICTL_BIN}",
             f"vmi: programs run by {PYTHON}"]
    if BASELINE:
        lines.append("vmi: *** BASELINE MODE (VMI_TEST_BASELINE=1): no layer, no agents, "
                     "vmictl assertions NOT evaluated ***")
    return lines


def _prerequisites():
    problems = []
    if os.geteuid() != 0:
        problems.append("the suite must run as root (network namespaces, nsenter)")
    for tool in SYSTEM_TOOLS:
        if shutil.which(tool) is None:
            problems.append(f"{tool} not found on PATH (run scripts/setup.sh)")
    if not BASELINE:
        for path in (PRELOAD_LIB, AGENT_BIN, VMICTL_BIN):
            if not path.is_file():
                problems.append(f"{path} is missing: run `cargo build --release --workspace` "
                                "at the repository root first (scripts/test.sh does)")
    return problems


def _dead_agents():
    return [a for a in _SESSION["agents"].values() if not a.proc.alive()]


@pytest.fixture(scope="session")
def topology(tmp_path_factory):
    problems = _prerequisites()
    if problems:
        pytest.fail("cannot run the integration suite:\n  " + "\n  ".join(problems),
                    pytrace=False)
    logdir = tmp_path_factory.mktemp("agents")
    try:
        _SESSION["topology_up"] = True
        topo_up()
        if not BASELINE:
            for host in AGENT_HOSTS:
                _SESSION["agents"][host] = Agent(host, logdir)
            for agent in _SESSION["agents"].values():
                agent.wait_ready()
        yield _SESSION
    finally:
        dead = _dead_agents()
        if dead:
            print("\nvmi: agents that died during the session:\n  "
                  + "\n  ".join(a.proc.describe() for a in dead), file=sys.stderr)
        for agent in _SESSION["agents"].values():
            agent.stop()
        helpers.kill_all_groups()
        if _SESSION["topology_up"]:
            _SESSION["topology_up"] = False
            topo_down()


@pytest.fixture
def procs(topology, tmp_path, request):
    dead = _dead_agents()
    if dead:
        pytest.fail("vmi-agent died before this test:\n" + "\n".join(
            a.proc.describe() + "\n" + tail(a.proc.err_path, 40) for a in dead), pytrace=False)
    runner = Runner(tmp_path / "logs")
    request.node._vmi_runner = runner
    try:
        yield runner
    finally:
        runner.cleanup()
    dead = _dead_agents()
    if dead:
        pytest.fail("vmi-agent died during this test:\n" + "\n".join(
            a.proc.describe() + "\n" + tail(a.proc.err_path, 40) for a in dead), pytrace=False)


@pytest.fixture
def faults(procs):
    """helpers.Faults for one test: every link, bridge port and `vmictl net` change it makes
    is undone when the test ends (before its programs are stopped), then the agents are
    given PATH_RECOVERY_TIMEOUT to see every path alive again."""
    f = Faults()
    try:
        yield f
    finally:
        try:
            f.restore()
        finally:
            if not wait_paths_alive(AGENT_HOSTS, PATH_RECOVERY_TIMEOUT):
                print(f"\nvmi: paths not all alive {PATH_RECOVERY_TIMEOUT} s after the test's "
                      "faults were undone", file=sys.stderr)


@pytest.fixture
def agent_control(procs, topology):
    """helpers.AgentControl over the session's agents; any agent the test killed is started
    again when the test ends (before `procs` checks that no agent died)."""
    ctl = AgentControl(topology["agents"])
    try:
        yield ctl
    finally:
        ctl.restore()


@pytest.fixture
def workdir(tmp_path):
    """A scratch folder for files the programs read or write; emptied after the test."""
    path = tmp_path / "work"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _agent_report():
    parts = []
    for agent in helpers.TEST_AGENTS:
        parts.append(f"=== {agent.proc.describe()} (started for the test or its module)\n--- stderr "
                     f"({agent.proc.err_path}) ---\n{tail(agent.proc.err_path)}")
    for host, agent in _SESSION["agents"].items():
        parts.append(f"=== {agent.proc.describe()}\n--- stderr ({agent.proc.err_path}) ---\n"
                     f"{tail(agent.proc.err_path)}")
        if not _SESSION["topology_up"]:
            continue
        try:
            status = vmictl_status(host)
            conns = status.get("connections") or []
            parts.append(f"--- vmictl status in {host} after the failure: node "
                         f"{status.get('node')!r}, {len(status.get('processes') or [])} "
                         f"processes, {len(conns)} connections")
        except VmictlError as exc:
            parts.append(f"--- vmictl status in {host} after the failure: {exc}")
    return "\n".join(parts)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # (An agent a module's fixture runs stays in the reports while it runs.)
    helpers.TEST_AGENTS[:] = [a for a in helpers.TEST_AGENTS if a.proc.alive()]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    runner = getattr(item, "_vmi_runner", None)
    if runner is not None and runner.procs:
        report.sections.append(("vmi: programs of this test", runner.report()))
    if _SESSION["agents"] or helpers.TEST_AGENTS:
        report.sections.append(("vmi: agents", _agent_report()))

