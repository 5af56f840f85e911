"""System calls the layer adds to a program's own: none for the patterns MPI progress engines
use (issue: native speed for every program).

tests/programs/progress.py exchanges request/response messages as Open MPI's TCP transport
does: each message a `writev` of a header and a body, read back by busy polling with a zero
time-out and `readv` into a header and a body buffer until it is whole, non-blocking and
stopping at EAGAIN. The client runs under `strace -c -f` once natively and once under the
layer (both ends layered, the connection virtual), and its receive and send calls per
message must be the same within a small margin (an acknowledgement the layer sends alone now
and then). Buffer by buffer, a two-buffer `readv` of a small message cost the layer two
receive calls where the kernel takes one.
"""


import pytest

from helpers import (BASELINE, H1, H1_IP, H2, PORTS, Watcher, assert_virtual, python_prog,
                     strace_counts)

MESSAGES = 2000
RECEIVE = ("read", "readv", "recvfrom", "recvmsg")
SEND = ("write", "writev", "sendto", "sendmsg")


def run(procs, tmp_path, layer):
    tag = "layer" if layer else "native"
    port = PORTS[f"progress_{tag}"]
    addr = f"{H1_IP}:{port}"
    procs.server(H1, python_prog("progress.py", "server", "--bind", addr), port, layer=layer,
                 name=f"progress-server-{tag}")
    trace = tmp_path / f"{tag}.strace"
    with Watcher(H1, H2) as w:
        cli = procs.run(H2, ["strace", "-c", "-f", "-o", trace,
                             *python_prog("progress.py", "client", "--connect", addr,
                                          "--messages", MESSAGES, "--size", 64,
                                          "--hold", 1)],
                        layer=layer, name=f"progress-client-{tag}", timeout=120)
    r = cli.last_json()
    assert r["bad"] == 0 and r["messages"] == MESSAGES, r
    if layer:
        assert_virtual(w, H1, addr, H2, min_conns=1)
    c = strace_counts(trace)
    return sum(c.get(n, 0) for n in RECEIVE), sum(c.get(n, 0) for n in SEND), c


@pytest.mark.skipif(BASELINE, reason="compares the layer with the kernel alone")
def test_mpi_style_progress_adds_no_system_calls(procs, tmp_path):
    n_recv, n_send, native = run(procs, tmp_path, False)
    l_recv, l_send, layered = run(procs, tmp_path, True)
    detail = f"native {native}\nlayer {layered}"
    # The Python start-up reads files and writes nothing: its calls are the same both times.
    assert n_recv >= MESSAGES and n_send >= MESSAGES, detail
    slack = MESSAGES // 20
    assert l_recv <= n_recv + slack, f"receive calls: {l_recv} under the layer, {n_recv} natively\n{detail}"
    assert l_send <= n_send + slack, f"send calls: {l_send} under the layer, {n_send} natively\n{detail}"
