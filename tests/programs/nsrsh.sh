#!/bin/sh
# The remote shell MPI launchers use (Open MPI's plm_rsh_agent, MPICH's -launcher-exec) for
# namespace hosts: skips the options ssh would take, takes the host name (a network namespace
# under /run/netns) and runs the rest of the command line there.
while [ $# -gt 0 ]; do
    case "$1" in
        -*) shift ;;
        *) break ;;
    esac
done
host=$1
shift
exec nsenter --net="/run/netns/$host" sh -c "$*"
