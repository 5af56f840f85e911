#!/usr/bin/env bash
# Install what the integration tests and benchmarks need on a fresh Debian 12 machine.
# Run as root. Safe to run again: already installed packages are left as they are.
set -euo pipefail

if [ "$(id -u)" -ne 0 ]; then
    echo "setup.sh: must run as root" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive

APT_PACKAGES=(
    iperf3
    sockperf
    redis-server
    redis-tools
    memcached
    libmemcached-tools
    socat
    netcat-openbsd
    iproute2
    curl
    nginx
    wrk
    postgresql
    openssh-server
    openssh-client
    nftables
    tcpdump
    tshark
    strace
    python3-pip
    gcc
    openmpi-bin
    libopenmpi-dev
    mpich
    libmpich-dev
    netpipe-openmpi
    mandoc
    systemd
    chromium
    etcd-server
    etcd-client
    protobuf-compiler
    libprotobuf-dev
    binutils
    libibverbs-dev
    libfabric-dev
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done

if [ "${#missing[@]}" -gt 0 ]; then
    echo "setup.sh: installing ${missing[*]}"
    # (tshark's package asks whether ordinary users may capture: no.)
    echo "wireshark-common wireshark-common/install-setuid boolean false" | debconf-set-selections
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
    echo "setup.sh: system packages already installed"
fi

# The package starts a redis server on 127.0.0.1:6379; the tests start their own.
if command -v systemctl >/dev/null 2>&1; then
    systemctl stop redis-server >/dev/null 2>&1 || true
    systemctl disable redis-server >/dev/null 2>&1 || true
fi
service redis-server stop >/dev/null 2>&1 || true
# Likewise memcached on 127.0.0.1:11211,
if command -v systemctl >/dev/null 2>&1; then
    systemctl stop memcached >/dev/null 2>&1 || true
    systemctl disable memcached >/dev/null 2>&1 || true
fi
service memcached stop >/dev/null 2>&1 || true
# nginx on port 80 and the cluster PostgreSQL makes (the tests make their own).
if command -v systemctl >/dev/null 2>&1; then
    systemctl stop nginx >/dev/null 2>&1 || true
    systemctl disable nginx >/dev/null 2>&1 || true
fi
service nginx stop >/dev/null 2>&1 || true
if command -v systemctl >/dev/null 2>&1; then
    systemctl stop postgresql >/dev/null 2>&1 || true
    systemctl disable postgresql >/dev/null 2>&1 || true
fi
service postgresql stop >/dev/null 2>&1 || true
# And the OpenSSH server on port 22 (the tests start their own sshd).
if command -v systemctl >/dev/null 2>&1; then
    systemctl stop ssh >/dev/null 2>&1 || true
    systemctl disable ssh >/dev/null 2>&1 || true
fi
service ssh stop >/dev/null 2>&1 || true

# And etcd on 127.0.0.1:2379 (the directory tests start their own cluster).
if command -v systemctl >/dev/null 2>&1; then
    systemctl stop etcd >/dev/null 2>&1 || true
    systemctl disable etcd >/dev/null 2>&1 || true
fi
service etcd stop >/dev/null 2>&1 || true

# Python packages, for whichever python3 comes first on PATH.
PY=python3
export PIP_ROOT_USER_ACTION=ignore
if ! "$PY" -c 'import pytest, matplotlib' >/dev/null 2>&1; then
    echo "setup.sh: installing pytest and matplotlib for $(command -v "$PY")"
    if ! "$PY" -m pip --version >/dev/null 2>&1; then
        "$PY" -m ensurepip --upgrade >/dev/null 2>&1 || true
    fi
    PIP=("$PY" -m pip install -q --disable-pip-version-check --no-warn-script-location)
    if ! "${PIP[@]}" pytest matplotlib 2>/dev/null; then
        # Debian's own python3 refuses system-wide installs (PEP 668, "externally managed").
        "${PIP[@]}" --break-system-packages pytest matplotlib
    fi
else
    echo "setup.sh: pytest and matplotlib already available"
fi

# CRIU 4.2, privately (migration tests and benchmarks).
"$(dirname "$0")/install-criu.sh"

echo "setup.sh: done"
