"""The agent's web view (`vmi-agent --web`), in a real browser.

Three hosts of their own (network namespaces vmiweb1..3, two networks joined by bridges in a
fourth namespace, vmiweb-sw; all deleted when the module ends, pass or fail), an agent in
each with a cluster key made for the run, and one virtual connection under the layer from
host 1 to host 2 that moves bytes all along. Host 1 serves the view on 127.0.0.1, host 3 on
its own address with a token.

The page is loaded in headless Chromium inside host 1 (Debian's `chromium`, installed by
scripts/setup.sh): what it shows is checked against `vmictl --cluster status --json`, and a
screenshot is kept under the module's temporary folder (web-view.png, web-view-dead-path.png).
The suite's shared hosts (vmit*) are not used.
"""

import atexit
import base64
import html.parser
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from helpers import (AGENT_BIN, PRELOAD_LIB, PROGRAMS, PYTHON, VMICTL_BIN, capture as run,
                     clean_env, in_netns as in_ns, require_root_and_build)

PREFIX = "vmiweb"
HOSTS = [f"{PREFIX}{i}" for i in (1, 2, 3)]
SWITCH = f"{PREFIX}-sw"
NETS = 2
WEB_PORT = 8780
TOKEN_PORT = 8781
SERVER_PORT = 9100
START_TIMEOUT = 10.0
PATH_TIMEOUT = 10.0
DEAD_TIMEOUT = 5.0        # a link down until the view shows its paths dead
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_TIMEOUT = 90.0
TOKEN = "vmiweb-" + os.urandom(16).hex()


def ip_of(host, net=0):
    return f"10.253.{net}.{HOSTS.index(host) + 1}"


def node_of(host):
    return f"web{HOSTS.index(host) + 1}"


def delete_namespaces():
    for ns in [*HOSTS, SWITCH]:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class Group:
    """A process started in a session of its own (killed with its children)."""

    def __init__(self, argv, log, env=None):
        self.log_path = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen([str(a) for a in argv], stdout=out, stderr=subprocess.STDOUT,
                                         env=env or clean_env(), start_new_session=True)

    def alive(self):
        return self.proc.poll() is None

    def log(self):
        return self.log_path.read_text(errors="replace")

    def stop(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
            except ProcessLookupError:
                pass


class Web:
    """The module's hosts, agents and programs."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.groups = []
        self.agents = {}
        self.key = tmp / "cluster.key"
        self.token_file = tmp / "web.token"

    def start(self, argv, name, env=None):
        g = Group(argv, self.tmp / f"{name}.log", env)
        self.groups.append(g)
        return g

    def agent(self, host, extra):
        notify_path = self.tmp / f"{host}.notify"
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(notify_path))
        peers = ",".join(ip_of(h, net) for h in HOSTS if h != host for net in range(NETS))
        argv = ["nsenter", f"--net=/run/netns/{host}", AGENT_BIN, "--config", "/dev/null",
                "--key", self.key, "--node", node_of(host), "--peers", peers, *extra]
        g = self.start(argv, f"agent-{host}", clean_env(NOTIFY_SOCKET=str(notify_path), VMI_LOG="info"))
        self.agents[host] = (g, notify)

    def wait_ready(self):
        for host, (g, notify) in self.agents.items():
            notify.settimeout(START_TIMEOUT)
            try:
                msg = notify.recv(4096).decode()
            except socket.timeout:
                raise AssertionError(f"agent in {host} not ready; rc {g.proc.poll()}\n{g.log()[-3000:]}")
            assert "READY=1" in msg.split("\n"), msg

    def close(self):
        for g in reversed(self.groups):
            g.stop()
        for _, notify in self.agents.values():
            notify.close()
        delete_namespaces()


def build_hosts():
    delete_namespaces()
    subprocess.run(["ip", "netns", "add", SWITCH], check=True)
    for net in range(NETS):
        subprocess.run(["ip", "-n", SWITCH, "link", "add", f"br{net}", "type", "bridge"], check=True)
        subprocess.run(["ip", "-n", SWITCH, "link", "set", f"br{net}", "up"], check=True)
    for h in HOSTS:
        subprocess.run(["ip", "netns", "add", h], check=True)
        subprocess.run(["ip", "-n", h, "link", "set", "lo", "up"], check=True)
        for net in range(NETS):
            port = f"{h[-1]}n{net}"
            subprocess.run(["ip", "link", "add", f"eth{net}", "netns", h, "type", "veth",
                            "peer", "name", port, "netns", SWITCH], check=True)
            subprocess.run(["ip", "-n", h, "addr", "add", f"{ip_of(h, net)}/24", "dev", f"eth{net}"], check=True)
            subprocess.run(["ip", "-n", h, "link", "set", f"eth{net}", "up"], check=True)
            subprocess.run(["ip", "-n", SWITCH, "link", "set", port, "master", f"br{net}", "up"], check=True)


def cluster_status(host):
    r = in_ns(host, [VMICTL_BIN, "--cluster", "status", "--json"], env=clean_env())
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def all_paths(status):
    return [(n["node"], p) for n in status["nodes"] for p in n["paths"]]


def wait_for(what, check, timeout):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout} s")


def curl(host, url, headers=(), method="GET"):
    """(status code, headers text, body) of one request made inside host."""
    body = f"/tmp/{PREFIX}-curl-{os.getpid()}-{time.monotonic_ns()}"
    try:
        argv = ["curl", "-s", "-S", "-m", "10", "-X", method, "-o", body, "-D", "-", "-w", "\n%{http_code}"]
        for h in headers:
            argv += ["-H", h]
        r = in_ns(host, [*argv, url])
        assert r.returncode == 0, r.stderr
        head, _, code = r.stdout.rpartition("\n")
        with open(body) as f:
            return int(code), head, f.read()
    finally:
        if os.path.exists(body):
            os.unlink(body)


def chromium_argv(host, out_dir, *args):
    if CHROMIUM is None:
        pytest.fail("chromium is not installed (scripts/setup.sh installs Debian's chromium)", pytrace=False)
    # A profile of its own for each browser (two may run at once).
    home = Path(tempfile.mkdtemp(prefix="chromium-", dir=out_dir))
    return ["nsenter", f"--net=/run/netns/{host}", "env", f"HOME={home}", CHROMIUM, "--headless=new",
            "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
            "--disable-extensions", "--hide-scrollbars", f"--user-data-dir={home / 'profile'}",
            "--window-size=1400,900", *args]


def chromium(host, url, out_dir, *args):
    """Runs headless Chromium inside host on url (in virtual time: timers run ahead, network
    answers are awaited); its standard output (the DOM with --dump-dom). Every process it
    started is gone when this returns."""
    argv = chromium_argv(host, out_dir, "--virtual-time-budget=6000", *args, url)
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=CHROMIUM_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"chromium did not finish within {CHROMIUM_TIMEOUT} s: {err[-2000:]}")
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert p.returncode == 0, f"chromium exited {p.returncode}: {err[-3000:]}"
    return out


class Browser:
    """Headless Chromium inside a host, driven in real time through the DevTools protocol on
    a pipe (--remote-debugging-pipe: JSON messages ended by NUL, in on fd 3, out on fd 4)."""

    def __init__(self, host, out_dir):
        to_chrome, self._w = os.pipe()
        self._r, from_chrome = os.pipe()

        def fds():
            os.dup2(to_chrome, 3)
            os.dup2(from_chrome, 4)

        self.err = open(out_dir / "chromium.err", "w")
        self.proc = subprocess.Popen(chromium_argv(host, out_dir, "--remote-debugging-pipe", "about:blank"),
                                     stdout=self.err, stderr=subprocess.STDOUT, preexec_fn=fds,
                                     pass_fds=(3, 4), start_new_session=True)
        os.close(to_chrome)
        os.close(from_chrome)
        self._buf = b""
        self._id = 0
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": 1400, "height": 900, "deviceScaleFactor": 1, "mobile": False}, self.session)

    def call(self, method, params=None, session=None, timeout=30.0):
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._r], [], [], left)[0]:
                    raise AssertionError(f"chromium did not answer {method} within {timeout} s")
                chunk = os.read(self._r, 1 << 20)
                if not chunk:
                    raise AssertionError(f"chromium went away during {method} (rc {self.proc.poll()})")
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            m = json.loads(raw)
            if m.get("id") == self._id:
                assert "error" not in m, (method, m["error"])
                return m.get("result", {})

    def eval(self, expression):
        r = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                           "awaitPromise": True}, self.session)
        assert "exceptionDetails" not in r, r
        return r["result"].get("value")

    def open(self, url):
        self.call("Page.navigate", {"url": url}, self.session)

    def wait(self, expression, timeout=15.0, what=None):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                v = self.eval(expression)
            except AssertionError:
                v = None
            if v:
                return v
            time.sleep(0.2)
        raise AssertionError(f"the page: {what or expression} not within {timeout} s")

    def polls(self):
        return int(self.eval("Number(document.body && document.body.dataset.polls || 0)") or 0)

    def dom(self):
        return Dom(self.eval("document.documentElement.outerHTML"))

    def click(self, selector):
        assert self.eval(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); if (!e) return false;"
                         " e.dispatchEvent(new MouseEvent('click', {bubbles: true})); return true; })()"), selector

    def screenshot(self, path):
        data = self.call("Page.captureScreenshot", {"format": "png"}, self.session)["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        for fd in (self._r, self._w):
            os.close(fd)
        self.err.close()


@pytest.fixture
def browser(web):
    b = Browser(HOSTS[0], web.tmp)
    try:
        yield b
    finally:
        b.close()


class Dom(html.parser.HTMLParser):
    """What Chromium rendered: elements with their attributes, and the text under ids."""

    def __init__(self, text):
        super().__init__()
        self.elements = []
        self.stack = []
        self.text = {}
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.elements.append((tag, a))
        self.stack.append(a.get("id"))

    def handle_endtag(self, tag):
        if self.stack:
            self.stack.pop()

    def handle_data(self, data):
        for i in self.stack:
            if i:
                self.text[i] = self.text.get(i, "") + data

    def having(self, attr):
        return [a for _, a in self.elements if attr in a]

    def body(self):
        return next((a for t, a in self.elements if t == "body"), {})


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    require_root_and_build()
    tmp = tmp_path_factory.mktemp("web")
    w = Web(tmp)
    atexit.register(w.close)
    try:
        build_hosts()
        run([AGENT_BIN, "--init", "--key", w.key], check=True, env=clean_env())
        w.token_file.write_text(TOKEN + "\n")
        w.token_file.chmod(0o600)
        w.agent(HOSTS[0], ["--web", f"127.0.0.1:{WEB_PORT}"])
        w.agent(HOSTS[1], [])
        w.agent(HOSTS[2], ["--web", f"{ip_of(HOSTS[2])}:{TOKEN_PORT}", "--web-token", w.token_file])
        w.wait_ready()
        wait_for("every path alive", lambda: (lambda s: len(s["nodes"]) == 3 and all(
            p["state"] == "alive" for _, p in all_paths(s)) and len(all_paths(s)) == 12)(cluster_status(HOSTS[0])),
            PATH_TIMEOUT)
        layer = ["env", "-u", "LD_PRELOAD", f"LD_PRELOAD={PRELOAD_LIB}", "VMI_LOG=warn"]
        server = f"{ip_of(HOSTS[1])}:{SERVER_PORT}"
        w.start(["nsenter", f"--net=/run/netns/{HOSTS[1]}", *layer, PYTHON, PROGRAMS / "stream.py", "server",
                 "--bind", server, "--rate", "150000"], "server")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if in_ns(HOSTS[1], ["ss", "-tlnH", f"sport = :{SERVER_PORT}"]).stdout.strip():
                break
            time.sleep(0.1)
        w.client = w.start(["nsenter", f"--net=/run/netns/{HOSTS[0]}", *layer, PYTHON, PROGRAMS / "stream.py",
                            "client", "--connect", server, "--bytes", 200_000_000, "--server-bytes",
                            200_000_000, "--seed", 7, "--rate", 250000], "client")
        w.server_addr = server
        yield w
    finally:
        w.close()


def the_connection(status, server_addr):
    """The two ends of the module's connection: (client end on web1, server end on web2)."""
    ends = {}
    for n in status["nodes"]:
        for c in n["connections"]:
            if c["local"] == server_addr or c["peer"] == server_addr:
                ends[n["node"]] = c
    if node_of(HOSTS[0]) in ends and node_of(HOSTS[1]) in ends:
        return ends[node_of(HOSTS[0])], ends[node_of(HOSTS[1])]
    return None


def wait_connection(web):
    return wait_for("the connection in the cluster status",
                    lambda: web.client.alive() and the_connection(cluster_status(HOSTS[0]), web.server_addr), 10)


def shape(status):
    """What does not change from one moment to the next in a cluster status."""
    nodes = {}
    for n in status["nodes"]:
        nodes[n["node"]] = {
            "processes": sorted((p["pid"], p["name"]) for p in n["processes"]),
            "listeners": sorted(l["addr"] for l in n["listeners"]),
            "networks": sorted(tuple(sorted(x.items())) for x in n["networks"]),
            "paths": sorted((p["node"], p["local"], p["peer"], p["network"], p["state"]) for p in n["paths"]),
            "connections": sorted((c["gid"], c["pid"], c["local"], c["peer"], c["substrate"], c["direction"],
                                   c["network"], c["link"], c["failovers"]) for c in n["connections"]),
            "key": n["mesh"]["key"],
            "web": n["web"],
        }
    return {"node": status["node"], "nodes": nodes, "unreachable": sorted(u["node"] for u in status["unreachable"])}


VIEW = f"http://127.0.0.1:{WEB_PORT}"


def test_api_cluster_is_what_vmictl_shows(web):
    client_end, server_end = wait_connection(web)
    assert client_end["gid"] == server_end["gid"]
    # The same document, but for the counters that move between the two reads.
    for _ in range(10):
        before = cluster_status(HOSTS[0])
        code, head, body = curl(HOSTS[0], f"{VIEW}/api/cluster")
        after = cluster_status(HOSTS[0])
        assert code == 200 and "application/json" in head.lower(), (code, head)
        api = json.loads(body)
        if shape(api) == shape(before) == shape(after):
            break
        time.sleep(0.5)
    assert shape(api) == shape(before), (shape(api), shape(before))
    assert sorted(n["node"] for n in api["nodes"]) == ["web1", "web2", "web3"]
    ends = the_connection(api, web.server_addr)
    for end, was, now in zip(ends, the_connection(before, web.server_addr), the_connection(after, web.server_addr)):
        for k in ("bytes_sent", "bytes_received"):
            assert was[k] <= end[k] <= now[k], (k, was, end, now)
    assert set(ends[0]) == set(client_end), "the API's connections have the fields of vmictl's"
    # The cluster's events, from a number on: this node's and the other nodes', each naming
    # its node (the server's end of the connection was made on web2).
    code, _, body = curl(HOSTS[0], f"{VIEW}/api/events?since=0")
    ev = json.loads(body)
    assert code == 200 and ev["node"] == "web1" and ev["last"] >= len(ev["events"]) > 0, ev
    assert ev["via"] == "fan-out", ev["via"]
    for node, side in (("web1", "out"), ("web2", "in")):
        assert any(e["kind"] == "connection" and e.get("gid") == client_end["gid"] and e["node"] == node
                   and e["side"] == side for e in ev["events"]), (node, ev)
    assert [e["seq"] for e in ev["events"]] == sorted({e["seq"] for e in ev["events"]}), "numbered once each"
    code, _, body = curl(HOSTS[0], f"{VIEW}/api/events?since={ev['last']}")
    assert json.loads(body)["events"] == [] or all(e["seq"] > ev["last"] for e in json.loads(body)["events"])
    # vmictl web names the view; an agent without one says how to turn it on.
    r = in_ns(HOSTS[0], [VMICTL_BIN, "web"], env=clean_env())
    assert r.returncode == 0 and r.stdout.strip() == f"{VIEW}/", r
    r = in_ns(HOSTS[1], [VMICTL_BIN, "web"], env=clean_env())
    assert r.returncode == 1 and "--web 127.0.0.1:PORT" in r.stderr, r
    r = in_ns(HOSTS[0], [VMICTL_BIN, "--node", "web3", "web", "--json"], env=clean_env())
    assert r.returncode == 0 and json.loads(r.stdout)["token"] is True, r


def node_boxes(dom):
    return {a["data-node"] for a in dom.having("data-node") if "node" in a.get("class", "").split()}


def path_lines(dom):
    return [a for a in dom.having("data-state") if a.get("data-from")]


RATES_SHOWN = ("[...document.querySelectorAll('#conn-rows tr[data-gid]')]"
               ".some(r => Number(r.dataset.tx) > 0)")


def test_the_page_in_chromium_shows_the_cluster(web, browser):
    client_end, _ = wait_connection(web)
    out = web.tmp
    browser.open(f"{VIEW}/")
    browser.wait("Number(document.body.dataset.polls) >= 2", what="two polls")
    browser.wait(RATES_SHOWN, what="a connection's rate")
    dom = browser.dom()
    status = cluster_status(HOSTS[0])
    assert node_boxes(dom) == {n["node"] for n in status["nodes"]}, node_boxes(dom)
    rows = dom.having("data-gid")
    for n in status["nodes"]:
        for c in n["connections"]:
            assert any(r["data-gid"] == c["gid"] and r["data-node"] == n["node"]
                       and r["data-substrate"] == c["substrate"] for r in rows), (c, rows)
    assert client_end["gid"] in dom.text.get("conn-rows", "")
    assert "/s" in dom.text.get("conn-rows", "") and "tcp" in dom.text.get("conn-rows", "")
    # The client sends 250 kB/s (in bursts of up to 256 KiB): a rate of that order, not a total.
    client_row = next(r for r in rows if r["data-node"] == "web1" and r["data-gid"] == client_end["gid"])
    assert 0 < int(client_row.get("data-tx") or 0) < 5_000_000, client_row
    assert dom.text.get("self") == "web1" and dom.text.get("n-nodes") == "3"
    lines = path_lines(dom)
    assert len(lines) == 12 and all(a["data-state"] == "alive" for a in lines), lines
    assert {(a["data-from"], a["data-local"], a["data-peer"]) for a in lines} == \
        {(n, p["local"], p["peer"]) for n, p in all_paths(status)}
    assert "connection" in dom.text.get("ev-list", ""), "no connection event listed"
    # Events of the other nodes too, each with its node.
    listed = browser.eval("[...document.querySelectorAll('#ev-list li[data-kind=\"connection\"]')].map(l => l.dataset.node)")
    assert {"web1", "web2"} <= set(listed), listed
    assert "web2" in dom.text.get("ev-list", "")
    # It keeps polling.
    polls = browser.polls()
    browser.wait(f"Number(document.body.dataset.polls) > {polls}", timeout=5, what="another poll")
    shot = out / "web-view.png"
    browser.screenshot(shot)
    with open(shot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 20_000, "an empty screenshot?"

    # A click on a node: its connections, networks and paths alone.
    browser.click('g.node[data-node="web2"]')
    dom = browser.dom()
    rows = dom.having("data-gid")
    assert rows and all(r["data-node"] == "web2" for r in rows), rows
    detail = dom.text.get("detail", "")
    web2 = next(n for n in status["nodes"] if n["node"] == "web2")
    assert "Node web2" in detail and all(x["addr"] in detail for x in web2["networks"]), detail
    assert all(p["peer"] in detail for p in web2["paths"]), detail
    assert browser.eval("location.hash") == "#node=web2"
    browser.click('g.node[data-node="web3"]')
    dom = browser.dom()
    assert not dom.having("data-gid") and "no connection on web3" in dom.text.get("conn-rows", "")

    # A click on a connection: every field it reports.
    browser.click('g.node[data-node="web3"]')   # (a second click shows the whole cluster again)
    assert len(browser.dom().having("data-gid")) == 2
    browser.click(f'#conn-rows tr[data-node="web1"][data-gid="{client_end["gid"]}"]')
    browser.wait("document.getElementById('detail').textContent.includes('send rate')", what="details")
    detail = browser.dom().text.get("detail", "")
    for field in client_end:
        assert field in detail, (field, detail)
    for field in ("gid", "pid", "local", "peer", "substrate", "link_local", "link_peer", "network"):
        assert str(client_end[field]) in detail, (field, detail)
    assert "Other end" in detail and "web2 pid" in detail, detail
    browser.screenshot(out / "web-view-connection.png")

    # A drill-down is an address: loaded anew (here in virtual time, its DOM dumped), it
    # shows the same.
    dom = Dom(chromium(HOSTS[0], f"{VIEW}/#node=web2", out, "--dump-dom"))
    assert int(dom.body().get("data-polls", 0)) >= 2
    assert node_boxes(dom) == {"web1", "web2", "web3"}
    rows = dom.having("data-gid")
    assert rows and all(r["data-node"] == "web2" for r in rows), rows


def test_beyond_loopback_only_with_the_token(web, browser):
    # Without a token the agent does not start on another address.
    r = in_ns(HOSTS[2], [AGENT_BIN, "--config", "/dev/null", "--key", web.key, "--socket", "vmiweb-no",
                         "--port", "7799", "--web", f"0.0.0.0:{TOKEN_PORT + 1}"], env=clean_env(), timeout=10)
    assert r.returncode == 2 and "needs a token" in r.stderr and "not started" in r.stderr, r
    # Nor with a token others may read.
    loose = web.tmp / "loose.token"
    loose.write_text(TOKEN)
    loose.chmod(0o644)
    r = in_ns(HOSTS[2], [AGENT_BIN, "--config", "/dev/null", "--key", web.key, "--socket", "vmiweb-no",
                         "--port", "7799", "--web", f"0.0.0.0:{TOKEN_PORT + 1}", "--web-token", loose],
              env=clean_env(), timeout=10)
    assert r.returncode == 2 and "open to other users" in r.stderr, r

    url = f"http://{ip_of(HOSTS[2])}:{TOKEN_PORT}"
    code, head, body = curl(HOSTS[0], f"{url}/api/cluster")
    assert code == 401 and "www-authenticate: bearer" in head.lower(), (code, head)
    assert "web3" not in body
    code, _, _ = curl(HOSTS[0], f"{url}/api/cluster", ["Authorization: Bearer " + TOKEN[:-1] + "x"])
    assert code == 401
    code, _, body = curl(HOSTS[0], f"{url}/", [])
    assert code == 401 and "needs its token" in body
    code, _, body = curl(HOSTS[0], f"{url}/api/cluster", ["Authorization: Bearer " + TOKEN])
    assert code == 200 and json.loads(body)["node"] == "web3"
    code, _, body = curl(HOSTS[0], f"{url}/api/events?since=0&token={TOKEN}")
    assert code == 200 and json.loads(body)["node"] == "web3"
    # Read-only.
    code, _, _ = curl(HOSTS[0], f"{url}/api/cluster", ["Authorization: Bearer " + TOKEN], method="POST")
    assert code == 405
    # Refusals are counted and logged.
    s = json.loads(in_ns(HOSTS[2], [VMICTL_BIN, "status", "--json"], env=clean_env()).stdout)
    assert s["mesh"]["refused"]["web"] >= 3, s["mesh"]
    log = web.agents[HOSTS[2]][0].log()
    assert "refused: web view: a request without the token from 10.253.0.1:" in log, log[-3000:]
    assert TOKEN not in log
    # A browser given the token once: the page keeps it for the tab, out of the address bar,
    # and sends it as a header; a reload asks with it again.
    browser.open(f"{url}/?token={TOKEN}")
    browser.wait("Number(document.body.dataset.polls) >= 2", what="two polls with the token")
    assert node_boxes(browser.dom()) == {"web1", "web2", "web3"}
    assert browser.eval("location.href") == f"{url}/"
    assert browser.eval("sessionStorage.getItem('vmi-token')") == TOKEN
    browser.call("Page.reload", {}, browser.session)
    time.sleep(0.5)
    browser.wait("document.body && Number(document.body.dataset.polls) >= 1", what="the page after a reload")
    assert browser.eval("location.href") == f"{url}/"
    # Without a token, the loopback view answers only to its address or localhost (a site
    # whose name was made to point at 127.0.0.1 is refused).
    code, _, _ = curl(HOSTS[0], f"{VIEW}/api/cluster", ["Host: attacker.example"])
    assert code == 421
    code, _, _ = curl(HOSTS[0], f"http://localhost:{WEB_PORT}/api/cluster")
    assert code == 200


def test_a_dead_path_shows_within_seconds(web, browser):
    dead_ip, other_ip = ip_of(HOSTS[2], 0), ip_of(HOSTS[2], 1)
    browser.open(f"{VIEW}/")
    browser.wait("Number(document.body.dataset.polls) >= 1", what="a poll")
    assert all(a["data-state"] == "alive" for a in path_lines(browser.dom()))
    subprocess.run(["ip", "-n", HOSTS[2], "link", "set", "eth0", "down"], check=True)
    try:
        t0 = time.monotonic()

        def dead_in_api():
            code, _, body = curl(HOSTS[0], f"{VIEW}/api/cluster")
            s = json.loads(body)
            ps = [p for _, p in all_paths(s) if p["peer"] == dead_ip]
            return ps and all(p["state"] == "dead" for p in ps) and s

        s = wait_for("the paths to web3 on eth0 dead in /api/cluster", dead_in_api, DEAD_TIMEOUT)
        assert {n for n, p in all_paths(s) if p["peer"] == dead_ip} == {"web1", "web2"}
        others = [p for _, p in all_paths(s) if other_ip in (p["peer"], p["local"])]
        assert len(others) == 4 and all(p["state"] == "alive" for p in others), others
        # The page open all along shows it by itself.
        browser.wait(f"document.querySelectorAll('line[data-peer=\"{dead_ip}\"][data-state=\"dead\"]').length == 2",
                     timeout=DEAD_TIMEOUT, what="the dead paths")
        assert time.monotonic() - t0 < DEAD_TIMEOUT
        dom = browser.dom()
        lines = path_lines(dom)
        alive = [a for a in lines if a.get("data-peer") == other_ip]
        assert len(alive) == 2 and all(a["data-state"] == "alive" for a in alive), alive
        assert "Paths not alive" in dom.text.get("detail", "") and dead_ip in dom.text.get("detail", "")
        browser.wait(RATES_SHOWN, what="rates")
        browser.screenshot(web.tmp / "web-view-dead-path.png")
    finally:
        subprocess.run(["ip", "-n", HOSTS[2], "link", "set", "eth0", "up"], check=True)
    wait_for("paths alive again", lambda: all(p["state"] == "alive" for _, p in all_paths(cluster_status(HOSTS[0]))),
             PATH_TIMEOUT)
    browser.wait(f"document.querySelectorAll('line[data-peer=\"{dead_ip}\"][data-state=\"alive\"]').length == 2",
                 timeout=DEAD_TIMEOUT, what="the paths alive again")
