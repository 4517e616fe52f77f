#!/usr/bin/env bash
# Installs the system tools the tests use (iptables in both backends, iproute2, conntrack).
# Idempotent; needs root and access to the Debian package mirrors.
set -euo pipefail
need=()
command -v iptables-legacy-restore >/dev/null 2>&1 || need+=(iptables)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v conntrack >/dev/null 2>&1 || need+=(conntrack)
if [ "${#need[@]}" -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "missing ${need[*]} and not root: install them by hand" >&2
        exit 1
    fi
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y "${need[@]}"
fi
