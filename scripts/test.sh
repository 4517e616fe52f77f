#!/usr/bin/env bash
# Runs every test (unit, integration incl. real iptables in network namespaces, CLI) with one
# release build reused for all of them. Installs the system tools the tests need first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-test-deps.sh
if ! command -v cargo-nextest >/dev/null 2>&1; then
    exec cargo test --release --workspace --no-fail-fast "$@"
fi
cargo nextest run --release --workspace --no-fail-fast "$@"
