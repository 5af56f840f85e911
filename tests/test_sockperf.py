"""sockperf over TCP between a layered server and a layered client."""

import re

import pytest

from helpers import H1, H1_IP, PLACES, Watcher, assert_virtual, place

MSG_SIZE = 64

MODES = {
    # mode: (pattern that must be in the client's output, name)
    "ping-pong": r"Summary: Latency is [0-9.]+ usec",
    "throughput": r"Summary: Message Rate is [0-9]+ \[msg/sec\]",
    "under-load": r"Summary: Latency is [0-9.]+ usec",
}


@pytest.mark.parametrize("where", list(PLACES))
@pytest.mark.parametrize("mode", list(MODES))
def test_sockperf(procs, mode, where):
    host, env, substrate, port = place(where, "sockperf_" + mode.replace("-", "_"))
    addr = f"{H1_IP}:{port}"
    procs.server(H1, ["sockperf", "server", "--tcp", "-i", H1_IP, "-p", port], port,
                 layer=True, name="sockperf-server", env=env)
    with Watcher(H1, host) as w:
        # sockperf sizes its sequence space for about a million round trips per second and
        # fails beyond ("_seqN > m_maxSequenceNo"): shared memory is faster, so cap the rate.
        rate = ["--mps", "900000"] if mode == "ping-pong" else []
        cli = procs.run(host, ["sockperf", mode, "--tcp", "-i", H1_IP, "-p", port, "-t", "3",
                               "--msg-size", MSG_SIZE, *rate],
                        layer=True, name=f"sockperf-{mode}", timeout=40, env=env)
    out = cli.stdout() + cli.stderr()
    assert re.search(MODES[mode], out), \
        f"sockperf {mode} printed no result summary:\n{out[-3000:]}"
    assert "ERROR" not in out, f"sockperf {mode} reported an error:\n{out[-3000:]}"
    if mode == "throughput":
        sent = int(re.search(r"Total of (\d+) messages sent", out).group(1))
        assert sent > 0
        # The warm-up messages come on top of the counted ones.
        assert_virtual(w, H1, addr, host, c2s_bytes=sent * MSG_SIZE, substrate=substrate)
    else:
        m = re.search(r"\[Total Run\].*SentMessages=(\d+); ReceivedMessages=(\d+)", out)
        assert m, f"no [Total Run] line in sockperf output:\n{out[-3000:]}"
        sent, received = int(m.group(1)), int(m.group(2))
        assert sent > 0 and received > 0, m.group(0)
        assert_virtual(w, H1, addr, host, c2s_bytes=sent * MSG_SIZE,
                       s2c_bytes=received * MSG_SIZE, substrate=substrate)
