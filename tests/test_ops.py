"""Operating the agent: the configuration file, the systemd unit, --help, the man pages, and
log lines an operator can act on.

Agents here run in network namespaces of their own (prefix "vmiops", deleted when each test
ends, pass or fail), with settings from a configuration file, not in the suite's topology.
The documentation checks read the flags from the code, so that a flag added without its
documentation fails here.
"""

import json
import re
import shutil
import subprocess
import time

import pytest

from helpers import (AGENT_BIN, REPO, VMICTL_BIN, AgentProc, capture as run, clean_env,
                     in_netns as in_ns)

NS_PREFIX = "vmiops"
MAN = REPO / "man"
EXAMPLE_CONFIG = REPO / "packaging" / "agent.toml"
UNIT = REPO / "packaging" / "systemd" / "vmi-agent.service"
AGENT_SRC = REPO / "agent" / "src"
START_TIMEOUT = 10.0
PATH_TIMEOUT = 10.0

# Flags that are not settings (no configuration key).
AGENT_ACTIONS = {"--config", "--init", "--check-config", "--help", "--version"}


# ---------------------------------------------------------------------------------------------
# What the code accepts


def agent_flags():
    """Every flag vmi-agent's command-line parser matches."""
    src = (AGENT_SRC / "config.rs").read_text()
    body = src[src.index("pub fn parse_args"):src.index("pub struct ConfigError")]
    flags = set(re.findall(r'"(--[a-z][a-z-]*)"', body))
    assert {"--config", "--port", "--socket", "--help"} <= flags, flags
    return flags


def agent_keys():
    src = (AGENT_SRC / "config.rs").read_text()
    m = re.search(r"pub const KEYS: \[&str; \d+\] = \[(.*?)\];", src, re.S)
    return set(re.findall(r'"([a-z-]+)"', m.group(1)))


def vmictl_flags():
    src = (AGENT_SRC / "bin" / "vmictl.rs").read_text()
    flags = set(re.findall(r'"(--[a-z][a-z-]*)"', src))
    assert {"--socket", "--node", "--json", "--follow", "--cluster", "--help"} <= flags, flags
    return flags


def vmictl_commands():
    src = (AGENT_SRC / "bin" / "vmictl.rs").read_text()
    cmds = re.findall(r'\("([a-z]+)", USAGE_[A-Z]+\)', src)
    assert {"status", "net", "move", "where", "events"} <= set(cmds), cmds
    return cmds


def env_vars(files):
    names = set()
    for f in files:
        text = f.read_text()
        names |= set(re.findall(r'env::var(?:_os)?\("([A-Z_]+)"\)', text))
        names |= set(re.findall(r'\benv\("([A-Z_]+)"\)', text))
    return names


def man_text(page):
    """A man page's source with roff escapes for dashes and fonts undone, for searching."""
    text = (MAN / page).read_text()
    text = re.sub(r"\\f[BIRP]", "", text).replace("\\-", "-").replace("\\%", "").replace("\\(dq", '"')
    return text


def man_section(text, name):
    m = re.search(rf"^\.SH {re.escape(name)}\n(.*?)(?=^\.SH |\Z)", text, re.S | re.M)
    assert m, f"no section {name}"
    return m.group(1)


# ---------------------------------------------------------------------------------------------
# --help and usage errors


def test_help_of_every_command():
    r = run([AGENT_BIN, "--help"])
    assert r.returncode == 0 and r.stdout.startswith("usage: vmi-agent"), r
    for f in agent_flags():
        assert f in r.stdout, f"vmi-agent --help does not mention {f}"
    assert run([AGENT_BIN, "-h"]).stdout == r.stdout
    v = run([AGENT_BIN, "--version"])
    assert v.returncode == 0 and v.stdout.startswith("vmi-agent "), v

    r = run([VMICTL_BIN, "--help"])
    assert r.returncode == 0 and r.stdout.startswith("usage: vmictl"), r
    assert run([VMICTL_BIN, "help"]).stdout == r.stdout
    for f in vmictl_flags() - {"--follow", "--cluster"}:
        assert f in r.stdout, f"vmictl --help does not mention {f}"
    assert run([VMICTL_BIN, "--version"]).stdout.startswith("vmictl ")
    for cmd in vmictl_commands():
        assert cmd in r.stdout
        h = run([VMICTL_BIN, "help", cmd])
        assert h.returncode == 0 and h.stdout.startswith("usage: ") and f" {cmd}" in h.stdout.split("\n")[0], h
        for argv in ([cmd, "--help"], [cmd, "-h"], ["--socket", "nowhere", cmd, "--help"]):
            o = run([VMICTL_BIN, *argv])
            assert o.returncode == 0 and o.stdout == h.stdout, (argv, o)
    assert "--follow" in run([VMICTL_BIN, "help", "events"]).stdout
    assert "--cluster" in run([VMICTL_BIN, "help", "status"]).stdout
    # A later word after --help on a command with operands is the command's help too.
    assert run([VMICTL_BIN, "net", "down", "--help"]).stdout == run([VMICTL_BIN, "help", "net"]).stdout


@pytest.mark.parametrize("argv", [
    ["bogus"], ["help", "bogus"], ["--bogus"], ["net", "sideways", "eth0"], ["net"],
    ["move", "nothex", "tcp"], ["move", "00" * 16, "sideways"], ["where"], ["status", "--follow"],
    ["--cluster", "move", "00" * 16, "tcp"], ["migrate", "12"], ["migrate", "x", "--to", "h"], ["status", "status"], ["--socket"], [],
])
def test_vmictl_usage_errors_exit_2(argv):
    r = run([VMICTL_BIN, *argv], env=clean_env())
    assert r.returncode == 2, r
    assert r.stderr.startswith("vmictl: ") and "usage: vmictl" in r.stderr, r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize("argv", [["--bogus"], ["--port"], ["--port", "x"], ["--init=yes"],
                                  ["--metrics", "localhost"], ["--peers", "a.b"]])
def test_agent_usage_errors_exit_2(argv):
    r = run([AGENT_BIN, *argv], env=clean_env())
    assert r.returncode == 2 and r.stderr.startswith("vmi-agent: "), r


def test_vmictl_without_agent_fails_with_1():
    r = run([VMICTL_BIN, "--socket", "vmiops-no-such-agent", "status"], env=clean_env())
    assert r.returncode == 1 and "no agent on @vmiops-no-such-agent" in r.stderr, r


# ---------------------------------------------------------------------------------------------
# Man pages, example configuration, unit


def test_man_pages_render_without_warnings():
    pages = [MAN / "vmi-agent.8", MAN / "vmictl.8"]
    if shutil.which("mandoc"):
        r = run(["mandoc", "-T", "lint", "-W", "all", *pages])
    elif shutil.which("groff"):
        r = run(["groff", "-man", "-ww", "-z", *pages])
    else:
        pytest.skip("neither mandoc nor groff (scripts/setup.sh installs mandoc)")
    assert r.returncode == 0 and r.stdout + r.stderr == "", r.stdout + r.stderr
    version = run([AGENT_BIN, "--version"]).stdout.split()[-1]
    for p in pages:
        text = p.read_text()
        assert text.startswith(".TH "), p
        assert f'"vmi {version}"' in text.split("\n")[0], f"{p.name} is not of version {version}"
        for section in ("NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "ENVIRONMENT", "FILES",
                        "EXIT STATUS", "EXAMPLES", "SEE ALSO"):
            assert f"\n.SH {section}\n" in text, f"{p.name}: no {section}"


def test_man_pages_document_every_flag_key_command_and_variable():
    agent = man_text("vmi-agent.8")
    options = man_section(agent, "OPTIONS")
    for f in agent_flags():
        assert re.search(rf'^\.[A-Z]+ (-[a-zA-Z] ", " )?{re.escape(f)}\b', options, re.M), \
            f"vmi-agent(8) OPTIONS lacks {f}"
        assert f in man_section(agent, "SYNOPSIS"), f"vmi-agent(8) SYNOPSIS lacks {f}"
    keys = agent_keys()
    assert keys == {f[2:] for f in agent_flags() - AGENT_ACTIONS}, "a setting without a flag or key"
    cfg = man_section(agent, "CONFIGURATION FILE")
    for k in keys:
        assert re.search(rf"^\.[A-Z]+ \"?{re.escape(k)}( |\")", cfg, re.M), f"vmi-agent(8) lacks key {k}"
    agent_src = [p for p in AGENT_SRC.glob("*.rs")]
    for var in env_vars(agent_src):
        assert f".B {var}" in man_section(agent, "ENVIRONMENT"), f"vmi-agent(8) lacks ${var}"
    for status in ("0", "1", "2"):
        assert f".TP\n{status}\n" in man_section(agent, "EXIT STATUS")

    ctl = man_text("vmictl.8")
    for f in vmictl_flags():
        assert re.search(rf'^\.[A-Z]+ (-[a-zA-Z] ", " )?{re.escape(f)}\b', man_section(ctl, "OPTIONS"), re.M), \
            f"vmictl(8) OPTIONS lacks {f}"
    for cmd in [*vmictl_commands(), "help"]:
        assert re.search(rf"^\.[A-Z]+ \"?(--cluster )?{cmd}\b", man_section(ctl, "COMMANDS"), re.M), \
            f"vmictl(8) COMMANDS lacks {cmd}"
        assert cmd in man_section(ctl, "SYNOPSIS")
    for var in env_vars([AGENT_SRC / "bin" / "vmictl.rs"]):
        assert f".B {var}" in man_section(ctl, "ENVIRONMENT"), f"vmictl(8) lacks ${var}"
    for status in ("0", "1", "2"):
        assert f".TP\n{status}\n" in man_section(ctl, "EXIT STATUS")


def uncommented_example():
    """packaging/agent.toml with every `# key = value` line made a setting."""
    out = []
    for line in EXAMPLE_CONFIG.read_text().splitlines():
        m = re.match(r"^# ([a-z-]+ = .*)$", line)
        if m:
            out.append(m.group(1))
    return "\n".join(out) + "\n"


def test_example_config_has_every_key_with_its_default(tmp_path):
    text = uncommented_example()
    keys = {line.split(" = ")[0] for line in text.splitlines()}
    # Keys without a default value (node: the node's address; web-token and the directory's
    # TLS files: none) have an example.
    no_default = ("node", "web-token", "directory-ca", "directory-cert", "directory-key")
    missing = agent_keys() - keys - set(no_default)
    assert not missing, f"packaging/agent.toml lacks {missing}"
    for k in no_default:
        assert re.search(rf"^# .*\b{k} = ", EXAMPLE_CONFIG.read_text(), re.M), f"no {k} example"
    key = tmp_path / "cluster.key"
    run([AGENT_BIN, "--init", "--key", key], check=True, env=clean_env())
    example = tmp_path / "example.toml"
    example.write_text(text)
    env = clean_env()
    a = run([AGENT_BIN, "--check-config", "--config", example, "--key", key], env=env)
    b = run([AGENT_BIN, "--check-config", "--config", "/dev/null", "--key", key], env=env)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout, f"the example's values are not the defaults:\n{a.stdout}\n{b.stdout}"


def test_systemd_unit_verifies(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("no systemd-analyze (scripts/setup.sh installs systemd)")
    text = UNIT.read_text()
    assert "\nType=notify\n" in text and "\nRestart=on-failure\n" in text
    assert "\nRestartPreventExitStatus=2\n" in text
    # systemd-analyze checks that ExecStart's program exists: the built one stands in for
    # the installed one.
    assert "ExecStart=/usr/local/bin/vmi-agent\n" in text
    unit = tmp_path / "vmi-agent.service"
    unit.write_text(text.replace("/usr/local/bin/vmi-agent", str(AGENT_BIN)))
    r = run(["systemd-analyze", "verify", "--man=no", unit], timeout=60)
    assert r.returncode == 0 and r.stdout + r.stderr == "", r.stdout + r.stderr
    r = run(["systemd-analyze", "security", "--offline=yes", unit], timeout=60)
    if r.returncode == 0:
        m = re.search(r"Overall exposure level for vmi-agent.service: ([0-9.]+)", r.stdout + r.stderr)
        assert m and float(m.group(1)) < 4.0, r.stdout[-2000:]


# ---------------------------------------------------------------------------------------------
# Agents in namespaces of their own


class Netns:
    """Network namespaces vmiops-*, each with its loopback up; deleted by close()."""

    def __init__(self):
        self.names = []

    def add(self, suffix):
        name = f"{NS_PREFIX}-{suffix}"
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
        self.names.append(name)
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        return name

    def close(self):
        for n in self.names:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


@pytest.fixture
def ops(tmp_path):
    """Namespaces and agents of one test, all gone when it ends (pass or fail)."""

    class Ops:
        def __init__(self):
            self.netns = Netns()
            self.agents = []
            self.key = tmp_path / "cluster.key"
            run([AGENT_BIN, "--init", "--key", self.key], check=True, env=clean_env())

        def agent(self, ns, args, name):
            a = AgentProc(ns, args, tmp_path, name)
            self.agents.append(a)
            return a

        def config(self, name, text):
            p = tmp_path / f"{name}.toml"
            p.write_text(text)
            return p

    o = Ops()
    try:
        yield o
    finally:
        for a in o.agents:
            a.stop()
        o.netns.close()


def listening(ns):
    """What ss says listens in ns: (unix abstract names, TCP ports, UDP ports)."""
    x = in_ns(ns, ["ss", "-xlnH"]).stdout
    t = in_ns(ns, ["ss", "-tlnH"]).stdout
    u = in_ns(ns, ["ss", "-ulnH"]).stdout
    ports = lambda out: {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if line.strip()}
    names = {w for line in x.splitlines() for w in line.split() if w.startswith("@")}
    return names, ports(t), ports(u)


def status(ns, sock):
    r = in_ns(ns, [VMICTL_BIN, "--socket", sock, "status", "--json"], env=clean_env())
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_agent_runs_from_a_config_file_alone(ops):
    ns = ops.netns.add("a")
    cfg = ops.config("a", f"""# every value differs from its default
key = "{ops.key}"
socket = "vmiops-sock"
port = 7790
node = "ops-node"
probe-interval = 20
dead-after = 200
sweep-every = 1000
log = "warn"
""")
    a = ops.agent(ns, ["--config", cfg], "agent")
    msg = a.wait_ready()
    assert "STATUS=node ops-node, local socket @vmiops-sock, agents on port 7790" in msg, msg
    names, tcp, udp = listening(ns)
    assert "@vmiops-sock" in names, names
    assert 7790 in tcp and 7790 in udp and 7787 not in tcp, (tcp, udp)
    s = status(ns, "vmiops-sock")
    assert s["node"] == "ops-node"
    # log = "warn": the start-up line (info) is not written.
    assert "for node ops-node" not in a.log(), a.log()
    r = in_ns(ns, [VMICTL_BIN, "status"], env=clean_env())
    assert r.returncode == 1 and "no agent on @vmi-agent" in r.stderr, r


def test_flags_override_the_config_file(ops):
    ns = ops.netns.add("b")
    cfg = ops.config("b", f'key = "{ops.key}"\nsocket = "vmiops-file"\nport = 7790\nnode = "from-file"\nlog = "warn"\n')
    r = run([AGENT_BIN, "--config", cfg, "--check-config", "--port", "7791"], env=clean_env())
    assert r.returncode == 0 and "port = 7791\n" in r.stdout and 'socket = "vmiops-file"' in r.stdout, r
    a = ops.agent(ns, ["--config", cfg, "--port=7791", "--node", "from-flag", "--log", "info"], "agent")
    a.wait_ready()
    names, tcp, udp = listening(ns)
    assert "@vmiops-file" in names and 7791 in tcp and 7791 in udp and 7790 not in tcp, (names, tcp, udp)
    assert status(ns, "vmiops-file")["node"] == "from-flag"
    assert "vmi-agent" in a.log() and "for node from-flag" in a.log(), a.log()


@pytest.mark.parametrize("text, line, key, words", [
    ('port = 7787\nprot = 7788\n', 2, "prot", "unknown field"),
    ('# comment\n\nport = "7788"\n', 3, "port", "invalid type"),
    ('port = 99999\n', 1, "port", ""),
    ('peers = [\n  "10.0.0.2",\n  "not-an-address",\n]\n', 3, "peers", "invalid IP address"),
    ('metrics = "localhost"\n', 1, "metrics", "ADDR:PORT"),
    ('[agent]\nport = 1\n', 1, "agent", "unknown field"),
    ('port = 1\nport = 2\n', 2, "port", "duplicate"),
])
def test_a_bad_config_file_is_refused_with_file_line_and_key(ops, text, line, key, words):
    cfg = ops.config("bad", text)
    for extra in ([], ["--check-config"]):
        r = run([AGENT_BIN, "--config", cfg, "--key", ops.key, "--socket", "vmiops-never", *extra],
                env=clean_env(), timeout=10)
        assert r.returncode == 2, r
        err = r.stderr
        assert f"configuration file {cfg}: line {line}" in err, err
        assert f'key "{key}"' in err and words in err and "not started" in err, err


def test_settings_that_do_not_fit_together_are_refused(ops):
    cfg = ops.config("bad", f'key = "{ops.key}"\n# heartbeats\nprobe-interval = 100\n')
    r = run([AGENT_BIN, "--config", cfg], env=clean_env())
    assert r.returncode == 2, r
    assert f"dead-after 50 ms (default) must be above probe-interval 100 ms ({cfg} line 3)" in r.stderr, r.stderr
    r = run([AGENT_BIN, "--config", cfg, "--dead-after", "300", "--check-config"], env=clean_env())
    assert r.returncode == 0 and "dead-after = 300" in r.stdout, r
    r = run([AGENT_BIN, "--config", ops.config("l", 'log = "info,["\n'), "--check-config"], env=clean_env())
    assert r.returncode == 2 and "log " in r.stderr, r
    r = run([AGENT_BIN, "--config", ops.config("nokey", 'key = "/nonexistent/vmiops.key"\n'),
             "--check-config"], env=clean_env())
    assert r.returncode == 2 and "/nonexistent/vmiops.key" in r.stderr and "vmi-agent --init" in r.stderr, r
    r = run([AGENT_BIN, "--config", "/nonexistent/vmiops.toml"], env=clean_env())
    assert r.returncode == 2 and "configuration file /nonexistent/vmiops.toml" in r.stderr, r


def test_environment_sits_between_file_and_flags(ops, tmp_path):
    cfg = ops.config("env", 'key = "/from/file"\nlog = "warn"\n')
    r = run([AGENT_BIN, "--config", cfg, "--check-config"], env=clean_env(VMI_CLUSTER_KEY=str(ops.key), VMI_LOG="debug"))
    assert r.returncode == 0, r
    assert f'key = "{ops.key}"' in r.stdout and 'log = "debug"' in r.stdout, r.stdout
    r = run([AGENT_BIN, "--config", cfg, "--check-config", "--key", ops.key, "--log", "error"],
            env=clean_env(VMI_CLUSTER_KEY="/from/env", VMI_LOG="debug"))
    assert r.returncode == 0 and 'log = "error"' in r.stdout, r


def test_a_taken_socket_is_exit_1_with_a_hint(ops):
    ns = ops.netns.add("c")
    cfg = ops.config("c", f'key = "{ops.key}"\nsocket = "vmiops-c"\n')
    ops.agent(ns, ["--config", cfg], "first").wait_ready()
    r = in_ns(ns, [AGENT_BIN, "--config", cfg], env=clean_env())
    assert r.returncode == 1, r
    assert "cannot listen on abstract socket @vmiops-c" in r.stderr and "another agent" in r.stderr, r.stderr
    r = in_ns(ns, [AGENT_BIN, "--config", cfg, "--socket", "vmiops-c2"], env=clean_env())
    assert r.returncode == 1 and "cannot listen on 0.0.0.0:7787 (TCP)" in r.stderr and "ss -tlpn" in r.stderr, r


def wait_paths(ns, sock, state, timeout=PATH_TIMEOUT):
    deadline = time.monotonic() + timeout
    paths = []
    while time.monotonic() < deadline:
        paths = status(ns, sock)["paths"]
        if paths and all(p["state"] == state for p in paths):
            return paths
        time.sleep(0.1)
    raise AssertionError(f"paths in {ns} not {state} within {timeout} s: {paths}")


def test_a_dead_path_is_logged_with_addresses_network_node_reason_and_hint(ops):
    a_ns, b_ns = ops.netns.add("pa"), ops.netns.add("pb")
    subprocess.run(["ip", "link", "add", "vmiops-a0", "netns", a_ns, "type", "veth",
                    "peer", "name", "vmiops-b0", "netns", b_ns], check=True)
    for ns, dev, ip in ((a_ns, "vmiops-a0", "10.251.0.1"), (b_ns, "vmiops-b0", "10.251.0.2")):
        subprocess.run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev], check=True)
        subprocess.run(["ip", "-n", ns, "link", "set", dev, "up"], check=True)
    agents = {}
    for ns, node, peer in ((a_ns, "ops-a", "10.251.0.2"), (b_ns, "ops-b", "10.251.0.1")):
        cfg = ops.config(node, f'key = "{ops.key}"\nsocket = "vmiops"\nnode = "{node}"\npeers = ["{peer}"]\n'
                               'probe-interval = 10\ndead-after = 100\n')
        agents[node] = ops.agent(ns, ["--config", cfg], node)
    for a in agents.values():
        a.wait_ready()
    wait_paths(a_ns, "vmiops", "alive")
    wait_paths(b_ns, "vmiops", "alive")
    subprocess.run(["ip", "-n", a_ns, "link", "set", "vmiops-a0", "down"], check=True)
    wait_paths(b_ns, "vmiops", "dead")
    deadline = time.monotonic() + 5
    want = ("path 10.251.0.2 -> 10.251.0.1 on vmiops-b0 (node ops-a) is dead: no heartbeat for ")
    while want not in agents["ops-b"].log() and time.monotonic() < deadline:
        time.sleep(0.1)
    log = agents["ops-b"].log()
    line = next((l for l in log.splitlines() if want in l), None)
    assert line, log[-3000:]
    assert re.search(r"no heartbeat for \d+ ms \(limit 100 ms\)", line), line
    assert "its connections move to another network" in line
    assert "(check the link, the agent on 10.251.0.1, and that UDP port 7787 is open both ways)" in line, line
    subprocess.run(["ip", "-n", a_ns, "link", "set", "vmiops-a0", "up"], check=True)
    wait_paths(b_ns, "vmiops", "alive")
    assert "path 10.251.0.2 -> 10.251.0.1 on vmiops-b0 (node ops-a) works again" in agents["ops-b"].log()


def test_an_agent_of_another_cluster_is_refused_with_a_hint(ops, tmp_path):
    a_ns, b_ns = ops.netns.add("ka"), ops.netns.add("kb")
    subprocess.run(["ip", "link", "add", "vmiops-ka0", "netns", a_ns, "type", "veth",
                    "peer", "name", "vmiops-kb0", "netns", b_ns], check=True)
    for ns, dev, ip in ((a_ns, "vmiops-ka0", "10.251.1.1"), (b_ns, "vmiops-kb0", "10.251.1.2")):
        subprocess.run(["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev], check=True)
        subprocess.run(["ip", "-n", ns, "link", "set", dev, "up"], check=True)
    other = tmp_path / "other.key"
    run([AGENT_BIN, "--init", "--key", other], check=True, env=clean_env())
    a = ops.agent(a_ns, ["--key", ops.key, "--socket", "vmiops", "--peers", "10.251.1.2"], "ka")
    b = ops.agent(b_ns, ["--key", other, "--socket", "vmiops", "--peers", "10.251.1.1"], "kb")
    a.wait_ready()
    b.wait_ready()
    deadline = time.monotonic() + PATH_TIMEOUT
    while "refused: a heartbeat from 10.251.1.2" not in a.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    line = next((l for l in a.log().splitlines() if "refused: a heartbeat from 10.251.1.2" in l), None)
    assert line, a.log()[-3000:]
    assert "of this kind so far; compare the cluster key's fingerprint in `vmictl status` on both nodes" in line, line
