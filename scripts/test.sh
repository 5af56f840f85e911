#!/usr/bin/env bash
# The project's test command: build, unit and model tests, then the integration suite on real
# programs across namespace hosts (needs root and scripts/setup.sh's packages).
#
#   scripts/test.sh [extra pytest arguments, e.g. -k iperf3]
set -euo pipefail

cd "$(dirname "$0")/.."

cargo build --release --workspace
cargo test --release --workspace
python3 -m pytest -x -v tests/ "$@"
scripts/fuzz.sh "${VMI_FUZZ_RUNS:-5000000}"
