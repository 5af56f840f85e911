#!/usr/bin/env bash
# The demo, end to end: builds vmi, makes two namespace hosts, starts an agent in each, runs
# real unmodified programs under the layer between them, and shows what `vmictl` sees.
#
#   scripts/demo.sh        (as root; scripts/setup.sh installs the programs it uses)
#
# Everything it creates (hosts vmid1/vmid2, bridges, processes) is removed at the end, also on
# failure or Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PREFIX=vmid
export VMI_NET0=10.76.0 VMI_NET1=10.76.1
H1=${PREFIX}1 H2=${PREFIX}2
S=$VMI_NET0.2
PRELOAD=$ROOT/target/release/libvmi_preload.so
LOG=$(mktemp -d /tmp/vmi-demo.XXXXXX)
in_host() { local h=$1; shift; nsenter --net=/run/netns/"$h" "$@"; }
layered() { local h=$1; shift; nsenter --net=/run/netns/"$h" env LD_PRELOAD="$PRELOAD" "$@"; }
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
same_stream() {
    python3 - "$1" "$2" <<'PY'
import json, sys
c = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
s = json.loads(open(sys.argv[2]).read().strip().splitlines()[-1])
ok = c["sent_sha256"] == s["recv_sha256"] and s["sent_sha256"] == c["recv_sha256"]
print(f"  client sent {c['sent_bytes']} B, server received {s['recv_bytes']} B; server sent {s['sent_bytes']} B, client received {c['recv_bytes']} B")
print("  SHA-256 equal both ways:", ok)
sys.exit(0 if ok else 1)
PY
}

cleanup() {
    set +e
    for pid in $(jobs -p); do kill "$pid" 2>/dev/null; done
    wait 2>/dev/null
    scripts/topo.sh down 2 "$PREFIX" >/dev/null 2>&1
}
trap cleanup EXIT INT TERM

for t in iperf3 python3 nsenter ip; do
    command -v "$t" >/dev/null || { echo "demo: $t is missing; run scripts/setup.sh first" >&2; exit 1; }
done

say "build"
cargo build --release --workspace 2>&1 | tail -1

say "two hosts ($H1 $VMI_NET0.1, $H2 $VMI_NET0.2), two networks each"
scripts/topo.sh down-all "$PREFIX" >/dev/null 2>&1 || true
scripts/topo.sh up 2 "$PREFIX"

say "one vmi-agent per host, sharing a new cluster key"
target/release/vmi-agent --init --key "$LOG/cluster.key"
for h in $H1 $H2; do
    VMI_CLUSTER_KEY="$LOG/cluster.key" VMI_LOG=info in_host "$h" target/release/vmi-agent >"$LOG/agent-$h.log" 2>&1 &
done
for h in $H1 $H2; do
    for _ in $(seq 50); do in_host "$h" target/release/vmictl status --json >/dev/null 2>&1 && break; sleep 0.1; done
done
echo "agents up (logs in $LOG)"

say "iperf3 under the layer: server in $H2, client in $H1"
layered "$H2" iperf3 -s -p 5201 >"$LOG/iperf3-server.log" 2>&1 &
sleep 0.5
layered "$H1" iperf3 -c "$S" -p 5201 -t 4 -P 2 >"$LOG/iperf3-client.log" 2>&1 &
client=$!
sleep 2
say "vmictl status in $H1 while iperf3 runs"
in_host "$H1" target/release/vmictl status
wait "$client"
tail -4 "$LOG/iperf3-client.log"

say "a checksummed two-way stream (64 MiB each way, 20 MB/s), both ends under the layer; $H1's eth0 fails in the middle"
layered "$H2" python3 tests/programs/stream.py server --bind "$S:7000" --count 1 --hold 1 --rate 20000000 >"$LOG/stream-server.json" 2>"$LOG/stream-server.err" &
sleep 0.5
layered "$H1" python3 tests/programs/stream.py client --connect "$S:7000" --bytes 67108864 --seed 7 --hold 1 --rate 20000000 >"$LOG/stream-client.json" 2>"$LOG/stream-client.err" &
client=$!
sleep 1.2
echo "  before: $(in_host "$H1" target/release/vmictl status --json | python3 -c '
import json, sys
for c in json.load(sys.stdin)["connections"]:
    print("{gid} on {network} ({link_local} -> {link_peer}), sent {bytes_sent}".format(**c))')"
ip -n "$H1" link set dev eth0 down
echo "  ip -n $H1 link set dev eth0 down"
sleep 1
echo "  after:  $(in_host "$H1" target/release/vmictl status --json | python3 -c '
import json, sys
for c in json.load(sys.stdin)["connections"]:
    print("{gid} on {network} ({link_local} -> {link_peer}), sent {bytes_sent}, {failovers} failover(s); the program still sees {local} -> {peer}".format(**c))')"
wait "$client"
ip -n "$H1" link set dev eth0 up
sleep 0.5
same_stream "$LOG/stream-client.json" "$LOG/stream-server.json"

say "devices loaded into the running programs and unloaded again (vmictl device): lz4 compression, zstd from the other node, then aead encryption (keys exchanged in band)"
layered "$H2" python3 tests/programs/stream.py server --bind "$S:7002" --count 1 --hold 1 --rate 20000000 --text >"$LOG/chain-server.json" 2>"$LOG/chain-server.err" &
sleep 0.5
layered "$H1" python3 tests/programs/stream.py client --connect "$S:7002" --bytes 150000000 --seed 11 --hold 1 --rate 20000000 --text >"$LOG/chain-client.json" 2>"$LOG/chain-client.err" &
client=$!
sleep 0.8
chains() { in_host "$1" target/release/vmictl status --json | python3 -c '
import json, sys
for c in json.load(sys.stdin)["connections"]:
    if sys.argv[1] in (c["peer"], c["local"]):
        print(c["gid"] if sys.argv[2] == "gid" else "  {}: {} -> {}, chain out {!r} in {!r}, sent {}".format(
            sys.argv[3], c["local"], c["peer"], c["chain"]["send"], c["chain"]["recv"], c["bytes_sent"]))
        if sys.argv[2] == "gid":
            break' "$S:7002" "$2" "$1"; }
gid=$(chains "$H1" gid | head -1)
for step in "$H1:device load lz4" "$H1:device unload lz4" "$H1:--node $S device load zstd" "$H1:--node $S device unload zstd" "$H1:--node $S device load aead" "$H1:device unload aead"; do
    h=${step%%:*}
    # shellcheck disable=SC2086
    set -- ${step#*:}
    echo "  in $h: vmictl $* --gid $gid"
    in_host "$h" target/release/vmictl "$@" --gid "$gid" | sed 's/^/    /'
    sleep 0.6
    chains "$H1" show
    chains "$H2" show
done
wait "$client"
same_stream "$LOG/chain-client.json" "$LOG/chain-server.json"

say "two programs on $H2 talk through shared memory; moved to TCP and back while they stream (vmictl move)"
layered "$H2" python3 tests/programs/stream.py server --bind "$S:7001" --count 1 --hold 1 --rate 20000000 >"$LOG/shm-server.json" 2>"$LOG/shm-server.err" &
sleep 0.5
layered "$H2" python3 tests/programs/stream.py client --connect "$S:7001" --bytes 80000000 --seed 9 --hold 1 --rate 20000000 >"$LOG/shm-client.json" 2>"$LOG/shm-client.err" &
client=$!
sleep 0.8
ends() { in_host "$H2" target/release/vmictl status --json | python3 -c '
import json, sys
for c in json.load(sys.stdin)["connections"]:
    if sys.argv[1] in (c["peer"], c["local"]):
        print(c["gid"] if sys.argv[2] == "gid" else "  {local} -> {peer}: {substrate}, sent {bytes_sent}".format(**c))
        if sys.argv[2] == "gid":
            break' "$S:7001" "$1"; }
gid=$(ends gid | head -1)
ends show
for to in tcp shm; do
    echo "  vmictl move $gid $to"
    in_host "$H2" target/release/vmictl move "$gid" "$to" >/dev/null
    sleep 0.6
    ends show
done
wait "$client"
same_stream "$LOG/shm-client.json" "$LOG/shm-server.json"

say "a program without the layer stays plain TCP: curl (plain) from a layered http.server"
mkdir -p "$LOG/www" && head -c 1048576 /dev/urandom >"$LOG/www/blob"
(cd "$LOG/www" && layered "$H2" python3 -m http.server 8080 --bind "$S" >"$LOG/http.log" 2>&1) &
sleep 1
in_host "$H1" curl -s -o "$LOG/blob.out" "http://$S:8080/blob"
cmp "$LOG/www/blob" "$LOG/blob.out" && echo "  plain curl got the file byte for byte"
in_host "$H2" target/release/vmictl status --json | python3 -c '
import json, sys; r = json.load(sys.stdin); print("  virtual connections now on", r["node"], ":", len(r["connections"]))'

say "done; tearing down"
