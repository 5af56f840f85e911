#!/usr/bin/env bash
# Namespace hosts on one machine: N hosts, each on two networks.
#
#   scripts/topo.sh up N [PREFIX]       build hosts PREFIX1..PREFIXN
#   scripts/topo.sh down N [PREFIX]     remove them (partial state is fine)
#   scripts/topo.sh down-all PREFIX     remove every namespace, bridge and veth named PREFIX*
#   scripts/topo.sh status [PREFIX]     show what exists
#
# Host i gets
#   eth0 = 10.77.0.i/24 on bridge PREFIXbr0   (subnet from VMI_NET0, default 10.77.0)
#   eth1 = 10.77.1.i/24 on bridge PREFIXbr1   (subnet from VMI_NET1, default 10.77.1)
# and its loopback up. Host-side veth ends are PREFIXie0 / PREFIXie1 (kernel limit 15 chars,
# so keep PREFIX to 6 characters or less). Start processes in a host with
#   nsenter --net=/run/netns/PREFIXi CMD...
# (not `ip netns exec`, which also makes a private mount namespace that CRIU refuses).
set -euo pipefail

DEFAULT_PREFIX=vmi-h
NET0=${VMI_NET0:-10.77.0}
NET1=${VMI_NET1:-10.77.1}

usage() {
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

check_prefix() {
    local prefix=$1
    if [ -z "$prefix" ] || [ "${#prefix}" -gt 6 ]; then
        echo "topo.sh: PREFIX must be 1..6 characters (got '$prefix')" >&2
        exit 2
    fi
    if ! [[ "$prefix" =~ ^[A-Za-z][A-Za-z0-9-]*$ ]]; then
        echo "topo.sh: PREFIX must be letters, digits and '-' (got '$prefix')" >&2
        exit 2
    fi
}

check_count() {
    local n=$1
    if ! [[ "$n" =~ ^[0-9]+$ ]] || [ "$n" -lt 1 ] || [ "$n" -gt 250 ]; then
        echo "topo.sh: N must be 1..250 (got '$n')" >&2
        exit 2
    fi
}

link_exists() { ip link show dev "$1" >/dev/null 2>&1; }
ns_exists() { [ -e "/run/netns/$1" ]; }

make_bridge() {
    local br=$1
    if ! link_exists "$br"; then
        ip link add name "$br" type bridge
    fi
    # No STP, forward at once; bridge itself carries no address.
    ip link set dev "$br" type bridge stp_state 0 forward_delay 0 2>/dev/null || true
    ip link set dev "$br" up
}

# attach HOST IFNAME HOSTSIDE BRIDGE ADDR
attach() {
    local host=$1 ifname=$2 hostside=$3 br=$4 addr=$5
    if ! ip -n "$host" link show dev "$ifname" >/dev/null 2>&1; then
        link_exists "$hostside" && ip link del dev "$hostside"
        ip link add name "$hostside" type veth peer name "${hostside}p"
        ip link set dev "${hostside}p" netns "$host"
        ip -n "$host" link set dev "${hostside}p" name "$ifname"
    fi
    ip link set dev "$hostside" master "$br"
    ip link set dev "$hostside" up
    ip -n "$host" addr replace "$addr/24" dev "$ifname"
    ip -n "$host" link set dev "$ifname" up
}

up() {
    local n=$1 prefix=$2
    check_count "$n"
    check_prefix "$prefix"
    make_bridge "${prefix}br0"
    make_bridge "${prefix}br1"
    local i host
    for i in $(seq 1 "$n"); do
        host="${prefix}${i}"
        ns_exists "$host" || ip netns add "$host"
        ip -n "$host" link set dev lo up
        attach "$host" eth0 "${prefix}${i}e0" "${prefix}br0" "${NET0}.${i}"
        attach "$host" eth1 "${prefix}${i}e1" "${prefix}br1" "${NET1}.${i}"
    done
    echo "topo.sh: $n hosts ${prefix}1..${prefix}${n} up (eth0 ${NET0}.i/24, eth1 ${NET1}.i/24)"
}

# Kill every process whose network namespace is the given one.
kill_ns_procs() {
    local host=$1 pids
    pids=$(ip netns pids "$host" 2>/dev/null || true)
    if [ -n "$pids" ]; then
        # shellcheck disable=SC2086
        kill -9 $pids 2>/dev/null || true
    fi
}

del_ns() {
    local host=$1
    if ns_exists "$host"; then
        kill_ns_procs "$host"
        ip netns del "$host" 2>/dev/null || true
    fi
}

del_link() {
    if link_exists "$1"; then
        ip link del dev "$1" 2>/dev/null || true
    fi
}

down() {
    local n=$1 prefix=$2
    check_count "$n"
    check_prefix "$prefix"
    local i
    for i in $(seq 1 "$n"); do
        del_ns "${prefix}${i}"
        del_link "${prefix}${i}e0"
        del_link "${prefix}${i}e1"
    done
    del_link "${prefix}br0"
    del_link "${prefix}br1"
    echo "topo.sh: hosts ${prefix}1..${prefix}${n} down"
}

down_all() {
    local prefix=$1
    check_prefix "$prefix"
    local name path
    for path in /run/netns/"$prefix"*; do
        [ -e "$path" ] || continue
        del_ns "${path##*/}"
    done
    # veths first, then bridges (ip -o prints "IDX: NAME@PEER: ...").
    for name in $(ip -o link show type veth | awk -F': ' '{print $2}' | cut -d@ -f1); do
        case "$name" in "$prefix"*) del_link "$name" ;; esac
    done
    for name in $(ip -o link show type bridge | awk -F': ' '{print $2}' | cut -d@ -f1); do
        case "$name" in "$prefix"*) del_link "$name" ;; esac
    done
    echo "topo.sh: everything named ${prefix}* removed"
}

status() {
    local prefix=$1 name path
    echo "namespaces:"
    for path in /run/netns/"$prefix"*; do
        [ -e "$path" ] || continue
        name=${path##*/}
        echo "  $name: $(ip -n "$name" -o -4 addr show | awk '{print $2"="$4}' | tr '\n' ' ')"
    done
    echo "links:"
    ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | while read -r name; do
        case "$name" in "$prefix"*) echo "  $name" ;; esac
    done
}

if [ "$(id -u)" -ne 0 ]; then
    echo "topo.sh: must run as root" >&2
    exit 1
fi

cmd=${1:-}
case "$cmd" in
    up)
        [ $# -ge 2 ] || usage
        up "$2" "${3:-$DEFAULT_PREFIX}"
        ;;
    down)
        [ $# -ge 2 ] || usage
        down "$2" "${3:-$DEFAULT_PREFIX}"
        ;;
    down-all)
        [ $# -ge 2 ] || usage
        down_all "$2"
        ;;
    status)
        status "${2:-$DEFAULT_PREFIX}"
        ;;
    *)
        usage
        ;;
esac
