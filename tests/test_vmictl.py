"""The agents answer `vmictl status --json` with the documented shape."""

from helpers import AGENT_HOSTS, BASELINE, status_problems, vmictl_status


def test_status_shape(topology):
    if BASELINE:
        return
    nodes = []
    for host in AGENT_HOSTS:
        status = vmictl_status(host)
        problems = status_problems(status)
        assert not problems, f"{host}: " + "\n".join(problems)
        nodes.append(status["node"])
    assert len(set(nodes)) == len(nodes), f"agents share a node name: {nodes}"


def test_output_into_a_pipe_closed_early(topology):
    """`vmictl status | head -1`, or any reader that stops before vmictl prints: vmictl ends
    quietly, as a command-line tool does, instead of panicking on the print that fails."""
    if BASELINE:
        return
    import subprocess
    from helpers import H1, VMICTL_BIN
    # The reading end closes before vmictl has its answer from the agent to print.
    p = subprocess.Popen(["nsenter", f"--net=/run/netns/{H1}", VMICTL_BIN, "status"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    _, err = p.communicate(timeout=20)
    assert b"panicked" not in err, err.decode(errors="replace")
