"""Readings of /proc that the harnesses share (bench.py, scale.py): memory, CPU time, threads,
context switches and descriptors of a process. Each returns None (or an empty or zero
reading) for a process that is gone or cannot be read."""

import contextlib
import os
from pathlib import Path

CLK = os.sysconf("SC_CLK_TCK")


def status_kb(pid, key):
    """Field `key` of /proc/PID/status in KiB (VmRSS, RssAnon, RssShmem, ...)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def pss_kb(pid):
    """Proportional set size of a process (Pss of /proc/PID/smaps_rollup), KiB."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def cpu_s(pid, tid=None):
    """User + system CPU seconds of a process (all its threads), or of its thread `tid`."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    try:
        f = Path(path).read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / CLK
    except (OSError, ValueError, IndexError):
        return None


def threads(pid):
    """{tid: comm} of a process."""
    out = {}
    with contextlib.suppress(OSError):
        for t in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                out[int(t)] = Path(f"/proc/{pid}/task/{t}/comm").read_text().strip()
    return out


def ctxt(pid):
    """Context switches (voluntary + involuntary) of every thread of a process."""
    total = 0
    for tid in threads(pid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
                if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                    total += int(line.split()[1])
    return total


def nfds(pid):
    """Open descriptors of a process."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
