#!/usr/bin/env bash
# Runs every test (unit, integration, CLI) with one release build reused for all of them.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo nextest run --release --workspace --all-targets --no-fail-fast "$@"
