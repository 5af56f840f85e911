#!/usr/bin/env bash
# Install CRIU 4.2 privately, without touching the system's libc or package state.
#
# Debian 12's criu 3.17 cannot dump on current kernels (vDSO bounds), and 4.1 cannot dump a
# process with an inet socket on kernels >= 6.16 (SO_PASSSEC). criu 4.2 from Debian's unstable
# suite works. Its packages (and the libc they were built against) are unpacked into one folder
# and criu runs through the dynamic loader of that folder, so nothing on the system changes.
#
# Usage: scripts/install-criu.sh [PREFIX]   (default /opt/vmi/criu)
# Result: PREFIX/bin/criu, a wrapper that runs the private criu.  Safe to run again.
set -euo pipefail

PREFIX="${1:-${VMI_CRIU_PREFIX:-/opt/vmi/criu}}"
WRAPPER="$PREFIX/bin/criu"

if [ -x "$WRAPPER" ] && "$WRAPPER" --version 2>/dev/null | grep -q "Version: 4\.\([2-9]\|[1-9][0-9]\)"; then
    echo "install-criu.sh: $("$WRAPPER" --version | head -1) already in $PREFIX"
    exit 0
fi

# The mirror the system already uses (deb822 or one-line format).
MIRROR=""
if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    MIRROR=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
fi
if [ -z "$MIRROR" ] && [ -f /etc/apt/sources.list ]; then
    MIRROR=$(awk '$1 == "deb" && $2 !~ /^\[/ {print $2; exit}' /etc/apt/sources.list)
fi
MIRROR="${MIRROR:-http://deb.debian.org/debian}"

WORK=$(mktemp -d /tmp/vmi-criu.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/lists/partial" "$WORK/archives/partial" "$WORK/debs"
echo "deb $MIRROR sid main" >"$WORK/sources.list"
APT_OPTS=(
    -o "Dir::Etc::sourcelist=$WORK/sources.list"
    -o "Dir::Etc::sourceparts=-"
    -o "Dir::State::Lists=$WORK/lists"
    -o "Dir::State::status=/dev/null"
    -o "Dir::Cache::archives=$WORK/archives"
    -o "Dir::Cache::pkgcache="
    -o "Dir::Cache::srcpkgcache="
    -o "APT::Architecture=amd64"
    -o "APT::Sandbox::User=root"
)

echo "install-criu.sh: reading the package index of $MIRROR sid"
apt-get "${APT_OPTS[@]}" -qq update

mapfile -t PKGS < <(apt-cache "${APT_OPTS[@]}" depends --recurse --no-recommends --no-suggests \
    --no-conflicts --no-breaks --no-replaces --no-enhances --no-pre-depends criu \
    | grep -v '^[ <]' | sort -u)
if [ "${#PKGS[@]}" -lt 2 ]; then
    echo "install-criu.sh: could not resolve criu's dependencies from $MIRROR sid" >&2
    exit 1
fi
echo "install-criu.sh: downloading ${#PKGS[@]} packages"
(cd "$WORK/debs" && apt-get "${APT_OPTS[@]}" -qq download "${PKGS[@]}")

STAGE="$WORK/root"
mkdir -p "$STAGE"
for deb in "$WORK"/debs/*.deb; do
    dpkg -x "$deb" "$STAGE"
done
LIBDIR="$STAGE/usr/lib/x86_64-linux-gnu"
if [ ! -x "$STAGE/usr/sbin/criu" ] || [ ! -e "$LIBDIR/ld-linux-x86-64.so.2" ]; then
    echo "install-criu.sh: the unpacked packages lack criu or its loader" >&2
    exit 1
fi

rm -rf "$PREFIX"
mkdir -p "$(dirname "$PREFIX")"
mv "$STAGE" "$PREFIX"
mkdir -p "$PREFIX/bin"
cat >"$WRAPPER" <<EOF
#!/bin/sh
# Runs the private CRIU with its own loader and libraries (see scripts/install-criu.sh).
exec "$PREFIX/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" \\
    --library-path "$PREFIX/usr/lib/x86_64-linux-gnu" "$PREFIX/usr/sbin/criu" "\$@"
EOF
chmod 755 "$WRAPPER"

"$WRAPPER" --version | head -1
if ! "$WRAPPER" check 2>&1 | tail -1 | grep -q "Looks good"; then
    echo "install-criu.sh: warning: 'criu check' does not say 'Looks good':" >&2
    "$WRAPPER" check 2>&1 | tail -5 >&2 || true
fi
echo "install-criu.sh: criu installed in $PREFIX (run $WRAPPER)"
