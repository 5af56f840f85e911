"""A virtual connection handed to another program across exec (tests/programs/exec_handover.py).

The server, under the layer, accepts a virtual connection, echoes a greeting itself, then
starts a helper program that inherits the socket (fork + exec, or subprocess with pass_fds)
and closes its own copy. The helper (under the layer too, through the inherited
environment) echoes everything; the client checks every echo byte for byte.
"""

import pytest

from helpers import H1, H1_IP, PLACES, Watcher, assert_virtual, place, python_prog

# fork_exec: os.fork + os.execv (the fork hook sees the child); subprocess: Popen(pass_fds=...)
# spawns with vfork, which only the execve hook sees: it counts the new image as a holder, so
# the parent's close right after the spawn is not taken for the last close.
HOWS = ["fork_exec", "subprocess"]


@pytest.mark.parametrize("where", list(PLACES))
@pytest.mark.parametrize("how", HOWS)
def test_exec_handover(procs, how, where):
    host, env, substrate, port = place(where, f"exec_{how}")
    addr = f"{H1_IP}:{port}"
    srv = procs.server(H1, python_prog("exec_handover.py", "server", "--bind", addr,
                                       "--how", how),
                       port, layer=True, name="exec-server", env=env)
    srv.assert_layer_loaded()
    with Watcher(H1, host) as w:
        cli = procs.run(host, python_prog("exec_handover.py", "client", "--connect", addr,
                                        "--hold", "0.5"),
                        layer=True, name="exec-client", timeout=40, check=False, env=env)
        srv.wait(timeout=10, check=False)
    lines = srv.json_lines()
    helper = next((r for r in lines if r.get("role") == "helper"), None)
    server = next((r for r in lines if r.get("role") == "server"), None)
    c = cli.last_json()
    assert c["ok"], f"the echo across exec failed: {c['error']}\nhelper: {helper}\n" \
                    f"server: {server}\nserver stderr:\n{srv.stderr()[-3000:]}"
    assert helper is not None and "error" not in helper, helper
    assert helper["received"] == helper["sent"] == sum(c["echoed"]), (helper, c)
    assert server is not None and server["helper_status"] == 0, server
    assert srv.returncode == 0 and cli.returncode == 0
    assert_virtual(w, H1, addr, host, client_pid=cli.pid, substrate=substrate)
