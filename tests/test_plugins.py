"""Device plug-ins: shared libraries from a plug-in folder (`plugins/vmi_device.h`), loaded
into running programs with `vmictl device load NAME`.

The suite builds the example plug-in (`plugins/example/xor.c`, every byte XORed with a byte
of its offset) and three broken ones with gcc, starts agents that take the folder
(`--plugins`) on a socket and port of their own, and runs a checksummed stream of words under
the layer with `VMI_PLUGINS` naming the folder. `xor` goes on both directions (the words leave
the wire) and off again; each broken plug-in (another interface version, no entry point, a
failed initialisation) is refused with a log line that says why, and the connection keeps its
chain; a name with no file is refused by the agent. The streams stay exact.
"""

import json
import shutil
import subprocess
import time

import pytest

from helpers import (BASELINE, H1, H2, H2_IP, PORTS, REPO, assert_same_stream, extra_agent,
                     python_prog, vmictl, vmictl_ok, words_on_wire)

pytestmark = [
    pytest.mark.skipif(BASELINE, reason="plug-ins are the layer's"),
    pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc (scripts/setup.sh)"),
]

MiB = 1 << 20
CLIENT, SERVER = H1, H2
SOCK, PORT0 = "vmi-plugins", 7960

BROKEN = {
    # name: (source, what the refusal says)
    "badver": ('#include "vmi_device.h"\n'
               'static size_t m(size_t n) { return n; }\n'
               'static const struct vmi_device d = { .abi = 7, .name = "badver", .max_out = m };\n'
               'const struct vmi_device *vmi_device_entry(void) { return &d; }\n',
               "interface version 7"),
    "nosym": ('int vmi_device_entry_v0(void) { return 0; }\n', "no symbol vmi_device_entry"),
    "noinit": ('#include "vmi_device.h"\n'
               'const struct vmi_device *vmi_device_entry(void) { return 0; }\n',
               "initialisation failed"),
}


def build(folder):
    inc = REPO / "plugins"
    out = folder / "libvmi_dev_xor.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-Wall", "-Werror", f"-I{inc}", "-o", out,
                    inc / "example" / "xor.c"], check=True)
    for name, (src, _) in BROKEN.items():
        c = folder / f"{name}.c"
        c.write_text(src)
        subprocess.run(["gcc", "-shared", "-fPIC", f"-I{inc}", "-o",
                        folder / f"libvmi_dev_{name}.so", c], check=True)
        c.unlink()


def chains(host, gid):
    st = json.loads(vmictl_ok(host, "--socket", SOCK, "status", "--json").stdout)
    c = next((c for c in st.get("connections", []) if c.get("gid") == gid), None)
    ch = (c or {}).get("chain") or {}
    return ch.get("send"), ch.get("recv")


def both_ways(gid, want, timeout=5):
    deadline = time.monotonic() + timeout
    while True:
        now = [chains(h, gid) for h in (CLIENT, SERVER)]
        if all(c == (want, want) for c in now):
            return
        assert time.monotonic() < deadline, f"chains {now}, expected {want!r} both ways"
        time.sleep(0.1)


def test_plugins_loaded_into_running_programs_and_bad_ones_refused(procs, tmp_path):
    folder = tmp_path / "plugins"
    folder.mkdir()
    build(folder)
    args = ["--socket", SOCK, "--port", PORT0, "--plugins", folder]
    env = {"VMI_AGENT_SOCKET": SOCK, "VMI_PLUGINS": str(folder), "VMI_LOG": "info"}
    with extra_agent(H1, tmp_path, "agent-plug-h1", args=args), \
            extra_agent(H2, tmp_path, "agent-plug-h2", args=args):
        port = PORTS["plugins"]
        addr = f"{H2_IP}:{port}"
        rate, seconds = 3 * MiB, 12
        n = rate * seconds
        srv = procs.server(SERVER, python_prog("stream.py", "server", "--bind", addr, "--count",
                                               "1", "--hold", "1", "--rate", rate, "--text"),
                           port, layer=True, env=env, name="stream-server")
        cli = procs.start(CLIENT, python_prog("stream.py", "client", "--connect", addr, "--bytes",
                                              n, "--server-bytes", n, "--seed", port, "--rate",
                                              rate, "--hold", "1", "--text"),
                          layer=True, env=env, name="stream-client")
        deadline = time.monotonic() + 10
        gid = None
        while gid is None:
            st = json.loads(vmictl_ok(CLIENT, "--socket", SOCK, "status", "--json").stdout)
            gid = next((c["gid"] for c in st.get("connections", [])
                        if c.get("pid") == cli.pid and c.get("bytes_received", 0) > 0), None)
            assert gid or time.monotonic() < deadline, "no connection moving both ways"
            time.sleep(0.1)

        r = vmictl_ok(CLIENT, "--socket", SOCK, "device", "load", "xor", "--gid", gid)
        assert "1 connection" in r.stdout, r.stdout
        both_ways(gid, "xor")
        words, size = words_on_wire(CLIENT, tmp_path, "xor")
        assert words == 0, f"{words} words in {size} bytes of the wire under the xor plug-in"
        vmictl_ok(CLIENT, "--socket", SOCK, "--node", H2_IP, "device", "unload", "xor", "--gid",
                  gid)
        both_ways(gid, "")

        for name, (_, why) in BROKEN.items():
            vmictl_ok(CLIENT, "--socket", SOCK, "device", "load", name, "--gid", gid)
            time.sleep(1.0)
            assert chains(CLIENT, gid) == ("", ""), f"{name}: the chain changed"
            log = cli.stderr()
            assert f"libvmi_dev_{name}.so refused" in log and why in log, log[-3000:]

        r = vmictl(CLIENT, "--socket", SOCK, "device", "load", "brotli", "--gid", gid)
        assert r.returncode == 1 and "no such device: brotli" in r.stderr \
            and "badver, noinit, nosym, xor" in r.stderr, r.stderr

        cli.wait(timeout=seconds + 30)
        srv.wait(timeout=10)
    c, s = cli.last_json(), srv.last_json()
    assert c["sent_bytes"] == n and c["recv_bytes"] == n, c
    assert_same_stream(c, s)
