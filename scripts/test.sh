#!/usr/bin/env bash
# Runs every test (unit, integration incl. real iptables in network namespaces, CLI) with one
# release build reused for all of them, then the habits the build enforces: formatting, clippy
# with warnings as errors, and the API docs (broken intra-doc links are errors). Installs the
# system tools the tests need first. Arguments go to the test runner (then only the tests run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-test-deps.sh
cargo fmt --all --check
if ! command -v cargo-nextest >/dev/null 2>&1; then
    cargo test --release --workspace --no-fail-fast "$@"
else
    cargo nextest run --release --workspace --no-fail-fast "$@"
fi
if [ "$#" -eq 0 ]; then
    cargo clippy --release --all-targets -- -D warnings
    # With the test doubles (the `testing` feature) and the crate-private items, which is what
    # this crate's readers (its developers) need; links to private items then resolve.
    RUSTDOCFLAGS="-D warnings -A rustdoc::private_intra_doc_links" \
        cargo doc --release --no-deps --document-private-items --features testing
fi
