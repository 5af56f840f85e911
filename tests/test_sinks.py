"""Sink plug-ins (`plugins/vmi_sink.h`): link devices loaded at run time, RDMA verbs first.

- The layer never links RDMA libraries: `readelf -d` of libvmi_preload.so names no
  libibverbs, librdmacm or libfabric.
- The verbs sink (`plugins/sinks/verbs.c`, built here with gcc against libibverbs and
  libfabric) reports no device on a node without RDMA (this machine's kernel has none:
  `ibv_get_device_list` fails with ENOSYS); so does the agent, which probes the plug-ins of its
  folder at start (`vmictl status`).
- A program that asks for it (`VMI_SUBSTRATE=verbs`) gets its virtual connection over kernel
  TCP in the same set-up, with one log line that says why.
- The conformance tests every sink passes (`sink-check`: the connection core over one sink's
  links between two hosts): a stream both ways, the same with its link cut three times, and a
  ping-pong from 1 B to 64 KiB with its link cut twice; for kernel TCP (the reference) and for
  the verbs sink run through libfabric's tcp provider (the plug-in's code as on RDMA hardware,
  with another provider beneath it).
- The Myrinet-style protocol on raw Ethernet (`--sink mx`: its own acknowledgement and
  retransmission, packet rings) passes the same tests, and the stream again with 1% of the
  hosts' mx frames dropped by nftables (what a dropped frame costs is a resend).
- A broken sink plug-in (another interface version, no entry point, a missing function) is
  refused with a message that says why.
"""

import json
import shutil
import subprocess
import time

import pytest

import contextlib

from helpers import (BASELINE, ETH0, H1, H1_IP, H2, PORTS, PRELOAD_LIB, RELEASE, REPO,
                     assert_same_stream, extra_agent, in_netns, python_prog, vmictl_ok)

pytestmark = [
    pytest.mark.skipif(BASELINE, reason="sinks are the layer's"),
    pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc (scripts/setup.sh)"),
]

MiB = 1 << 20
SINK_CHECK = RELEASE / "sink-check"
SOCK, PORT0 = "vmi-sinks", 7970

BROKEN = {
    # name: (source, what the refusal says)
    "badver": ('#include "vmi_sink.h"\n'
               'static const struct vmi_sink s = { .abi = 9, .name = "badver" };\n'
               'const struct vmi_sink *vmi_sink_entry(void) { return &s; }\n',
               "interface version 9"),
    "nosym": ('int vmi_sink_entry_v0(void) { return 0; }\n', "no symbol vmi_sink_entry"),
    "nofn": ('#include "vmi_sink.h"\n'
             'static const struct vmi_sink s = { .abi = VMI_SINK_ABI, .name = "nofn" };\n'
             'const struct vmi_sink *vmi_sink_entry(void) { return &s; }\n',
             "has no probe function"),
}


@pytest.fixture(scope="module")
def plugins(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sinks")
    inc = REPO / "plugins"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{inc}",
                    "-o", folder / "libvmi_sink_verbs.so", inc / "sinks" / "verbs.c", "-lfabric",
                    "-libverbs"], check=True)
    broken = tmp_path_factory.mktemp("broken-sinks")
    for name, (src, _) in BROKEN.items():
        c = broken / f"{name}.c"
        c.write_text(src)
        subprocess.run(["gcc", "-shared", "-fPIC", f"-I{inc}", "-o",
                        broken / f"libvmi_sink_{name}.so", c], check=True)
    return folder, broken


def needed(lib):
    out = subprocess.run(["readelf", "-d", lib], capture_output=True, text=True,
                         check=True).stdout
    return [line.split("[")[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


def test_the_layer_links_no_rdma_library_and_the_plugin_does(plugins):
    libs = needed(PRELOAD_LIB)
    assert libs and not [n for n in libs if any(k in n for k in ("ibverbs", "rdmacm", "fabric"))], libs
    plug = needed(plugins[0] / "libvmi_sink_verbs.so")
    assert any("libibverbs" in n for n in plug) and any("libfabric" in n for n in plug), plug


def probe(procs, folder, name, env=None):
    r = procs.run(H1, [SINK_CHECK, "probe", "--sink", name, "--plugins", folder], layer=False,
                  name=f"probe-{name}", env=env, check=False)
    return r


def test_no_rdma_device_here_and_broken_plugins_refused(procs, plugins):
    folder, broken = plugins
    r = probe(procs, folder, "verbs")
    got = r.last_json()
    if got["devices"] > 0:
        # (A machine with RDMA devices: the probe names them.)
        assert "devices through libfabric's verbs provider" in got["why"], got
    else:
        assert got["devices"] == 0 and "no RDMA device" in got["why"], got
    # The same code through libfabric's tcp provider finds devices (the host's interfaces).
    got = probe(procs, folder, "verbs", env={"VMI_VERBS_PROVIDER": "tcp"}).last_json()
    assert got["devices"] > 0, got
    for name, (_, why) in BROKEN.items():
        r = probe(procs, broken, name)
        err = r.stderr()
        assert r.returncode == 1 and why in err and f"sink plug-in {name}" in err, err


CASES = [
    # name, sink, mode, extra arguments
    ("tcp-stream", "tcp", "stream", ["--bytes", 32 * MiB]),
    ("tcp-cuts", "tcp", "stream", ["--bytes", 32 * MiB, "--cuts", 3]),
    ("tcp-pingpong", "tcp", "pingpong", ["--cuts", 2, "--reps", 100]),
    ("verbs-stream", "verbs", "stream", ["--bytes", 32 * MiB]),
    ("verbs-cuts", "verbs", "stream", ["--bytes", 32 * MiB, "--cuts", 3]),
    ("verbs-pingpong", "verbs", "pingpong", ["--cuts", 2, "--reps", 100]),
    ("mx-stream", "mx", "stream", ["--bytes", 32 * MiB]),
    ("mx-cuts", "mx", "stream", ["--bytes", 32 * MiB, "--cuts", 3]),
    ("mx-pingpong", "mx", "pingpong", ["--cuts", 2, "--reps", 100]),
    ("mx-lossy", "mx", "stream", ["--bytes", 32 * MiB, "--cuts", 1]),
]

LOSS_TABLE = "vmit_mxloss"


@contextlib.contextmanager
def mx_loss(percent):
    """nftables drops `percent`% of the mx frames (EtherType 0x86df) arriving at either
    host's first interface; the counts of dropped frames, per host, when the block ends."""
    rules = (f'table netdev {LOSS_TABLE} {{\n chain in {{\n'
             f'  type filter hook ingress device "{ETH0}" priority 0; policy accept;\n'
             f'  ether type 0x86df numgen random mod 100 < {percent} counter drop\n }}\n}}\n')
    drops = {}
    try:
        for h in (H1, H2):
            r = in_netns(h, ["nft", "-f", "-"], input=rules)
            assert r.returncode == 0, r.stderr
        yield drops
    finally:
        for h in (H1, H2):
            r = in_netns(h, ["nft", "list", "table", "netdev", LOSS_TABLE])
            words = r.stdout.split()
            drops[h] = int(words[words.index("packets") + 1]) if "packets" in words else 0
            in_netns(h, ["nft", "delete", "table", "netdev", LOSS_TABLE])


@pytest.mark.parametrize("name,sink,mode,extra", CASES, ids=[c[0] for c in CASES])
def test_every_sink_passes_the_same_conformance_tests(procs, plugins, name, sink, mode, extra):
    folder = plugins[0]
    env = {"VMI_VERBS_PROVIDER": "tcp"}
    ctl = f"{H1_IP}:{PORTS['sink_ctl'] + [c[0] for c in CASES].index(name)}"
    with (mx_loss(1) if name == "mx-lossy" else contextlib.nullcontext({})) as drops:
        c, s = conformance(procs, folder, env, ctl, name, sink, mode, extra)
    if name == "mx-lossy":
        assert drops[H1] > 0 and drops[H2] > 0, f"no frame dropped: {drops}"
    assert c["mismatch"] is None and s["mismatch"] is None, (c, s)
    assert c["done"] and s["done"] and c["end"] and s["end"], (c, s)
    assert c["received"] == s["sent"] and s["received"] == c["sent"], (c, s)
    cuts = int(dict(zip(extra[::2], extra[1::2])).get("--cuts", 0))
    assert c["links"] == cuts + 1 and s["links"] == cuts + 1, (c, s)
    if mode == "stream":
        assert c["sent"] == 32 * MiB and s["sent"] == 32 * MiB, (c, s)
    else:
        assert [int(k) for k in c["rtt_us"]] == [1, 64, 1024, 4096, 65536], c
    print(json.dumps({"case": name, "client": c, "server": s}))


def conformance(procs, folder, env, ctl, name, sink, mode, extra):
    """sink-check serve in host 1 and run in host 2; their reports (client, server)."""
    srv = procs.start(H1, [SINK_CHECK, "serve", "--sink", sink, "--plugins", folder, "--ip",
                           H1_IP, "--ctl", ctl], layer=False, name=f"serve-{name}", env=env)
    procs_wait_line(srv, "listening")
    cli = procs.run(H2, [SINK_CHECK, "run", "--sink", sink, "--plugins", folder, "--ctl", ctl,
                         "--mode", mode, *map(str, extra)], layer=False, name=f"run-{name}",
                    env=env, timeout=240)
    srv.wait(timeout=30)
    return cli.last_json(), srv.last_json()


def procs_wait_line(proc, word, timeout=10):
    deadline = time.monotonic() + timeout
    while word not in proc.stdout():
        if not proc.alive():
            raise proc.failure(f"exited before saying {word!r}")
        assert time.monotonic() < deadline, f"{proc.name}: no {word!r} in {timeout} s"
        time.sleep(0.05)


def test_a_program_asking_for_verbs_gets_kernel_tcp_in_the_same_setup(procs, plugins, tmp_path):
    folder = plugins[0]
    args = ["--socket", SOCK, "--port", PORT0, "--plugins", folder]
    env = {"VMI_AGENT_SOCKET": SOCK, "VMI_SUBSTRATE": "verbs"}
    with extra_agent(H1, tmp_path, "agent-sinks-h1", args=args), \
            extra_agent(H2, tmp_path, "agent-sinks-h2", args=args):
        st = json.loads(vmictl_ok(H1, "--socket", SOCK, "status", "--json").stdout)
        verbs = [s for s in st["sinks"] if s["name"] == "verbs"]
        assert verbs, st["sinks"]
        hardware = verbs[0]["devices"] > 0
        text = vmictl_ok(H1, "--socket", SOCK, "status").stdout
        if hardware:
            assert f"verbs ({verbs[0]['devices']} devices: " in text, text
        else:
            assert "no RDMA device" in verbs[0]["why"], st["sinks"]
            assert "substrates: tcp, shm, verbs (no device: no RDMA device" in text, text
        port = PORTS["sink_layer"]
        addr = f"{H1_IP}:{port}"
        srv = procs.server(H1, python_prog("stream.py", "server", "--bind", addr, "--count", "1",
                                           "--hold", "2"),
                           port, layer=True, env=env, name="stream-server")
        cli = procs.start(H2, python_prog("stream.py", "client", "--connect", addr, "--bytes",
                                          4 * MiB, "--seed", port, "--hold", "2"),
                          layer=True, env=env, name="stream-client")
        deadline = time.monotonic() + 10
        ends = []
        while len(ends) < 2 and time.monotonic() < deadline:
            ends = []
            for h in (H1, H2):
                s = json.loads(vmictl_ok(h, "--socket", SOCK, "status", "--json").stdout)
                ends += [c for c in s.get("connections", []) if addr in (c.get("local"), c.get("peer"))]
            time.sleep(0.1)
        assert len(ends) == 2 and ends[0]["gid"] == ends[1]["gid"], ends
        cli.wait(timeout=30)
        srv.wait(timeout=10)
    assert_same_stream(cli.last_json(), srv.last_json())
    lines = [ln for ln in cli.stderr().splitlines() if "VMI_SUBSTRATE=verbs" in ln]
    why = "do not run over sink plug-ins yet" if hardware else "no RDMA device"
    assert len(lines) == 1 and why in lines[0] and "kernel TCP" in lines[0], cli.stderr()[-2000:]
