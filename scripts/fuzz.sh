#!/usr/bin/env bash
# Runs every fuzz target for a fixed number of iterations (default 200000 each), or at most
# VMI_FUZZ_SECONDS per target (default 60: a target whose inputs grow slow to run cannot
# stretch the suite), on stable Rust (no sanitizer). Installs cargo-fuzz if it is missing.
#
#   scripts/fuzz.sh [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-200000}"
seconds="${VMI_FUZZ_SECONDS:-60}"
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked -q
for t in frame_header rx_stream agent_msg stats_slot seccomp_filter proc_status core_link_bytes mx_packet agent_mesh agent_config exec_record proc_fdinfo proc_arp head_summary directory_record filter_decode chain_policy accept_table event_stream shm_ring exec_state; do
    echo "--- fuzz $t ($runs runs, at most $seconds s)"
    log="$(mktemp)"
    if ! cargo fuzz run -s none "$t" -- -runs="$runs" -max_total_time="$seconds" -max_len=4096 >"$log" 2>&1; then
        tail -40 "$log"
        echo "fuzz target $t FAILED" >&2
        exit 1
    fi
    grep -E "^Done" "$log"
    rm -f "$log"
done
