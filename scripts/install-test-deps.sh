#!/usr/bin/env bash
# Installs the system tools the tests use (iptables with both backends, iproute2, conntrack,
# openssl for test certificates, unshare, nft for reading chain names on iptables-nft hosts,
# nfacct for the accounting objects rules of 1.31 and later count with;
# mmdebstrap, umoci and binutils for the image test, which builds the image with
# scripts/image.sh).
# Idempotent: does nothing when they are present. Needs root to install; without root it
# only warns, and the tests that need root skip themselves.
set -euo pipefail
need=()
command -v iptables-legacy-restore >/dev/null 2>&1 || need+=(iptables)
command -v iptables-nft-restore >/dev/null 2>&1 || need+=(iptables)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v conntrack >/dev/null 2>&1 || need+=(conntrack)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
command -v unshare >/dev/null 2>&1 || need+=(util-linux)
command -v nft >/dev/null 2>&1 || need+=(nftables)
command -v nfacct >/dev/null 2>&1 || need+=(nfacct)
command -v mmdebstrap >/dev/null 2>&1 || need+=(mmdebstrap)
command -v umoci >/dev/null 2>&1 || need+=(umoci)
command -v readelf >/dev/null 2>&1 || need+=(binutils)
command -v objcopy >/dev/null 2>&1 || need+=(binutils)
if [ "${#need[@]}" -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "note: ${need[*]} missing and not root; tests needing them will skip" >&2
    exit 0
fi
apt-get update
DEBIAN_FRONTEND=noninteractive apt-get install -y $(printf '%s\n' "${need[@]}" | sort -u)
