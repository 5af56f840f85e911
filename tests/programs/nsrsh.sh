#!/bin/sh
# The remote shell MPI launchers use (Open MPI's plm_rsh_agent, MPICH's -launcher-exec) for
# namespace hosts: skips the options ssh would take, takes the host name (a network namespace
# under /run/netns) and runs the rest of the command line there, with TMPDIR=/tmp/vmi-mpi-HOST.
while [ $# -gt 0 ]; do
    case "$1" in
        -*) shift ;;
        *) break ;;
    esac
done
host=$1
shift
# Each host its own temporary directory, as on real nodes: daemons of several namespace hosts
# sharing /tmp race to create Open MPI's session directories (mkdir fails with EEXIST).
TMPDIR="/tmp/vmi-mpi-$host"
mkdir -p "$TMPDIR"
export TMPDIR
exec nsenter --net="/run/netns/$host" sh -c "$*"
