#!/usr/bin/env bash
# The soak of issue 14: the real daemon against the test API server for KPR_SOAK_SECONDS
# (default 1800) of random churn with faults injected (tests/e2e_soak.rs, soak_30_minutes).
# Root only (network namespaces). Prints the checkpoint table at the end; the whole output is
# kept in KPR_SOAK_LOG (default /tmp/kpr-soak.log). KPR_SOAK_SEED picks another churn.
#
#     sudo scripts/soak.sh
#     sudo KPR_SOAK_SECONDS=600 KPR_SOAK_SEED=7 scripts/soak.sh
set -euo pipefail
cd "$(dirname "$0")/.."
log=${KPR_SOAK_LOG:-/tmp/kpr-soak.log}
status=0
nice -n 19 cargo nextest run --release --run-ignored only -E 'test(soak_30_minutes)' --no-capture 2>&1 \
    | tee "$log" || status=$?
echo
echo "checkpoints (t: seconds since start; conv: seconds until the kernel matched the render;"
echo "fds: open descriptors other than listening sockets; lst: listening sockets):"
grep '^soak' "$log" || true
exit "$status"
