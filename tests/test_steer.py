"""Steering the whole cluster from one node: `vmictl --cluster net down|up NET` takes a network
out of service on every node the cluster view lists (and puts it back), with a line per node;
a user who is not root is refused on every node and nothing changes. `net` and `move` answer
in JSON too, here and on another node, errors included."""

import json

from helpers import (ETH1, H1, H1_IP, H2, H2_IP, H3, extra_agent, vmictl, vmictl_as_nobody,
                     vmictl_status, wait_status)


def admin(host, net):
    return {n["name"]: n["admin"] for n in vmictl_status(host)["networks"]}[net]


def test_a_network_out_of_service_on_every_node(procs, tmp_path):
    with extra_agent(H3, tmp_path, "agent-steer", args=["--peers", f"{H1_IP},{H2_IP}"]):
        names = {h: vmictl_status(h)["node"] for h in (H1, H2, H3)}
        wait_status(H3, lambda s: {p["node"] for p in s["paths"]} >= {names[H1], names[H2]},
                    10, "host 3 hears hosts 1 and 2")
        try:
            r = vmictl_as_nobody(H3, "--cluster", "net", "down", ETH1, timeout=30)
            assert r.returncode == 1, r
            lines = r.stdout.splitlines()
            assert len(lines) == 3 and all("not allowed" in x for x in lines), r.stdout
            assert all(admin(h, ETH1) == "up" for h in names), "a refused change was made"

            r = vmictl(H3, "--cluster", "net", "down", ETH1, "--json", timeout=30)
            assert r.returncode == 0, r.stdout + r.stderr
            per_node = {x["node"]: x for x in map(json.loads, r.stdout.splitlines())}
            assert set(per_node) == set(names.values()), per_node
            assert all(x["ok"] for x in per_node.values()), per_node
            assert all(admin(h, ETH1) == "down" for h in names), \
                {h: admin(h, ETH1) for h in names}

            r = vmictl(H3, "--cluster", "net", "up", ETH1, timeout=30)
            assert r.returncode == 0, r.stdout + r.stderr
            assert sorted(r.stdout.splitlines()) == sorted(
                f"node {n}: network {ETH1} back in service" for n in names.values()), r.stdout
            assert all(admin(h, ETH1) == "up" for h in names)
            # A network some node does not have: that node says so, the others did it.
            r = vmictl(H3, "--cluster", "net", "down", "eth7", timeout=30)
            assert r.returncode == 1 and len(r.stdout.splitlines()) == 3, r.stdout
            # One node, here or there, with --json; and an error as JSON.
            r = vmictl(H1, "net", "down", ETH1, "--json", timeout=15)
            assert r.returncode == 0, r
            assert json.loads(r.stdout) == {"network": ETH1, "admin": "down", "node": None,
                                            "ok": True}, r.stdout
            r = vmictl(H3, "--node", names[H1], "net", "up", ETH1, "--json", timeout=15)
            assert r.returncode == 0, r
            assert json.loads(r.stdout) == {"network": ETH1, "admin": "up", "node": names[H1],
                                            "ok": True}, r.stdout
            assert admin(H1, ETH1) == "up"
            r = vmictl(H1, "move", "00" * 16, "tcp", "--json", timeout=15)
            a = json.loads(r.stdout)
            assert r.returncode == 1 and a["ok"] is False and "no process" in a["error"], r
            # The same asked of host 1 from host 3: host 1's answer comes back.
            r = vmictl(H3, "--node", names[H1], "move", "00" * 16, "tcp", "--json", timeout=15)
            a = json.loads(r.stdout)
            assert r.returncode == 1 and a["node"] == names[H1] and \
                "no process on this node holds" in a["error"], r
        finally:
            for h in names:
                vmictl(h, "net", "up", ETH1, timeout=15)
