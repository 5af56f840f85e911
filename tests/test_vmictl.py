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
