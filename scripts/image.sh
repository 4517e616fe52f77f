#!/usr/bin/env bash
# Builds the kube-proxy-rs container image without a container engine or a registry: a Debian
# bookworm root filesystem from Debian packages (mmdebstrap: iptables with both the nft and
# legacy backends, ip6tables, nftables' `nft`, conntrack, nfacct) plus the stripped release binary at
# /usr/local/bin/kube-proxy-rs (and as /usr/local/bin/kube-proxy, where upstream's image has it
# and kubeadm's DaemonSet runs it), written as an OCI image (umoci) in two layers: the Debian
# base (shared between versions) and the binary.
#
#   sudo bash scripts/image.sh          # then: podman load -i PATH   or   docker load -i PATH
#
# The last line printed (the only one on stdout) is the path of the OCI archive, a tar of the
# OCI image layout (the layout directory itself is `oci/` beside it). Docker before 25 cannot
# load an OCI archive, so the same image (same config, same image ID) is also written beside it
# as a gzipped docker-archive (skopeo), kube-proxy-rs-VERSION.docker.tar.gz, which every docker
# version loads. Run as root (mmdebstrap and umoci unpack need it); missing tools are installed
# with apt-get.
#
# Reproducible: with the same commit and the same Debian mirror state the image digest is the
# same. Timestamps come from git (SOURCE_DATE_EPOCH: the commit time for the binary layer and
# the image, the last commit of this script for the Debian layer), never the clock. Pin the
# mirror state with a snapshot, e.g.
# KPRS_DEBIAN_MIRROR=http://snapshot.debian.org/archive/debian/20251124T000000Z and
# KPRS_DEBIAN_SECURITY_MIRROR=http://snapshot.debian.org/archive/debian-security/20251124T000000Z.
#
# Environment:
#   KPRS_BINARY         a built kube-proxy-rs to package instead of `cargo build --release`
#                       (the test suite passes the binary it tests)
#   KPRS_IMAGE_DIR      output directory [${CARGO_TARGET_DIR:-target}/image]
#   KPRS_IMAGE_NAME     the name written into the archive [kube-proxy-rs:VERSION]
#   KPRS_DEBIAN_MIRROR, KPRS_DEBIAN_SECURITY_MIRROR   Debian mirrors [deb.debian.org]
#   KPRS_BASE_MAX_AGE_DAYS   reuse a cached Debian layer this many days [7], then rebuild it
#                            (picks up security updates); 0 always rebuilds
set -euo pipefail
# Paths given in the environment are relative to where the script is run from.
caller=$PWD
abs() { case "$1" in /*) echo "$1" ;; *) echo "$caller/$1" ;; esac; }
[ -z "${KPRS_BINARY:-}" ] || KPRS_BINARY=$(abs "$KPRS_BINARY")
[ -z "${KPRS_IMAGE_DIR:-}" ] || KPRS_IMAGE_DIR=$(abs "$KPRS_IMAGE_DIR")
cd "$(dirname "$0")/.."

log() { echo "image.sh: $*" >&2; }
die() {
    log "error: $*"
    exit 1
}

# ---- Tools ------------------------------------------------------------------------------
[ "$(id -u)" -eq 0 ] || die "run as root (sudo): mmdebstrap and umoci unpack need it"
need=()
command -v mmdebstrap >/dev/null 2>&1 || need+=(mmdebstrap)
command -v umoci >/dev/null 2>&1 || need+=(umoci)
command -v skopeo >/dev/null 2>&1 || need+=(skopeo)
command -v objcopy >/dev/null 2>&1 || need+=(binutils)
command -v strip >/dev/null 2>&1 || need+=(binutils)
command -v flock >/dev/null 2>&1 || need+=(util-linux)
if [ "${#need[@]}" -gt 0 ]; then
    log "installing $(printf '%s\n' "${need[@]}" | sort -u | tr '\n' ' ')"
    apt-get update >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y $(printf '%s\n' "${need[@]}" | sort -u) >&2
fi

out=${KPRS_IMAGE_DIR:-${CARGO_TARGET_DIR:-target}/image}
mkdir -p "$out"
out=$(cd "$out" && pwd)
# One build at a time per output directory (parallel test runs share it).
exec 9>"$out/.lock"
flock 9

# ---- The binary -------------------------------------------------------------------------
if [ -n "${KPRS_BINARY:-}" ]; then
    bin=$KPRS_BINARY
else
    log "cargo build --release"
    cargo build --release --locked >&2
    bin=${CARGO_TARGET_DIR:-target}/release/kube-proxy-rs
fi
[ -x "$bin" ] || die "no executable at $bin"
# Version and commit as the binary itself reports them, so the labels cannot disagree with it:
# "kube-proxy-rs 0.1.0 (git commit abc...)".
version_line=$("$bin" --version)
version=$(sed -n 's/^kube-proxy-rs \([^ ]*\) (git commit \([^)]*\))$/\1/p' <<<"$version_line")
commit=$(sed -n 's/^kube-proxy-rs \([^ ]*\) (git commit \([^)]*\))$/\2/p' <<<"$version_line")
[ -n "$version" ] && [ -n "$commit" ] || die "unexpected \`$bin --version\` output: $version_line"
name=${KPRS_IMAGE_NAME:-kube-proxy-rs:$version}

# Timestamps from git, never the clock (0 outside a checkout).
epoch=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct "$commit" 2>/dev/null || git log -1 --format=%ct 2>/dev/null || echo 0)}
base_epoch=$(git log -1 --format=%ct -- scripts/image.sh 2>/dev/null || true)
base_epoch=${base_epoch:-$epoch}
iso() { date -u -d "@$1" +%Y-%m-%dT%H:%M:%SZ; }

# The shipped binary without debug info (symbols kept, so panics name their functions); the
# debug info goes to kube-proxy-rs.debug beside the image, linked by --add-gnu-debuglink.
objcopy --only-keep-debug "$bin" "$out/kube-proxy-rs.debug"
strip --strip-debug -o "$out/kube-proxy-rs" "$bin"
(cd "$out" && objcopy --add-gnu-debuglink=kube-proxy-rs.debug kube-proxy-rs)
touch -d "@$epoch" "$out/kube-proxy-rs" "$out/kube-proxy-rs.debug"

# ---- The Debian layer (cached) ----------------------------------------------------------
mirror=${KPRS_DEBIAN_MIRROR:-http://deb.debian.org/debian}
security=${KPRS_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
packages=iptables,nftables,conntrack,nfacct,ca-certificates
debstrap=(
    --variant=essential
    --include="$packages"
    --aptopt='APT::Install-Recommends "false"'
    --dpkgopt='path-exclude=/usr/share/doc/*'
    --dpkgopt='path-include=/usr/share/doc/*/copyright'
    --dpkgopt='path-exclude=/usr/share/man/*'
    --dpkgopt='path-exclude=/usr/share/info/*'
    --dpkgopt='path-exclude=/usr/share/locale/*'
    --dpkgopt='path-exclude=/usr/share/lintian/*'
    --dpkgopt='path-exclude=/usr/lib/*/gconv/*'
    bookworm
)
sources=(
    "deb $mirror bookworm main"
    "deb $mirror bookworm-updates main"
    "deb $security bookworm-security main"
)
# Merged /usr without the usrmerge package (which pulls in perl).
hooks=/usr/share/mmdebstrap/hooks/merged-usr
[ -d "$hooks" ] || die "$hooks missing (mmdebstrap >= 1.0 ships it)"
base_key=$(printf '%s\n' "${debstrap[@]}" "${sources[@]}" "$base_epoch" | sha256sum | cut -c1-16)
base="$out/base-$base_key.tar"
max_age=${KPRS_BASE_MAX_AGE_DAYS:-7}
if [ -f "$base" ] && [ "$max_age" -gt 0 ] && [ -n "$(find "$base" -mtime -"$max_age")" ]; then
    log "reusing Debian layer $base"
else
    log "building the Debian layer with mmdebstrap (bookworm: $packages)"
    rm -f "$out"/base-*.tar
    SOURCE_DATE_EPOCH=$base_epoch mmdebstrap --format=tar --hook-dir="$hooks" "${debstrap[@]}" "$base.partial" "${sources[@]}" >&2
    mv "$base.partial" "$base"
fi

# ---- The image --------------------------------------------------------------------------
archive="$out/kube-proxy-rs-$version.oci.tar"
docker_archive="$out/kube-proxy-rs-$version.docker.tar.gz"
stamp=$(cat "$0" "$base" "$out/kube-proxy-rs" <(echo "$name $epoch") | sha256sum | cut -c1-64)
if [ -f "$archive" ] && [ -f "$docker_archive" ] && [ "$(cat "$out/stamp" 2>/dev/null)" = "$stamp" ]; then
    log "image up to date"
    echo "$archive"
    exit 0
fi
rm -f "$out/stamp"

work="$out/work"
rm -rf "$work" "$out/oci"
mkdir -p "$work"
trap 'rm -rf "$work"' EXIT
umoci init --layout "$work/oci" >&2
umoci new --image "$work/oci:build" >&2
umoci unpack --image "$work/oci:build" "$work/bundle" >&2
tar -xf "$base" -C "$work/bundle/rootfs"
umoci repack --refresh-bundle --image "$work/oci:build" --history.created="$(iso "$base_epoch")" \
    --history.created_by="mmdebstrap --variant=essential bookworm: $packages" "$work/bundle" >&2

install -D -m 0755 "$out/kube-proxy-rs" "$work/bundle/rootfs/usr/local/bin/kube-proxy-rs"
# Where upstream's image has its binary and kubeadm's DaemonSet runs it from: the same program
# (the name it is run by shows in its help, nothing else changes).
ln -sf kube-proxy-rs "$work/bundle/rootfs/usr/local/bin/kube-proxy"
touch -h -d "@$epoch" "$work/bundle/rootfs/usr/local/bin/kube-proxy"
touch -d "@$epoch" "$work/bundle/rootfs/usr/local/bin/kube-proxy-rs"
touch -d "@$base_epoch" "$work/bundle/rootfs/usr/local/bin"
umoci repack --image "$work/oci:build" --history.created="$(iso "$epoch")" \
    --history.created_by="kube-proxy-rs $version (git commit $commit)" "$work/bundle" >&2

created=$(iso "$epoch")
meta=(
    "org.opencontainers.image.title=kube-proxy-rs"
    "org.opencontainers.image.description=A drop-in replacement for Kubernetes kube-proxy"
    "org.opencontainers.image.version=$version"
    "org.opencontainers.image.revision=$commit"
    "org.opencontainers.image.created=$created"
    "org.opencontainers.image.licenses=Apache-2.0"
    "org.opencontainers.image.base.name=debian:bookworm (mmdebstrap)"
)
# The host's architecture: mmdebstrap builds for it, and so does cargo.
arch=$(dpkg --print-architecture)
config=(--created="$created" --os=linux --architecture="$arch" --no-history
    --config.entrypoint=/usr/local/bin/kube-proxy-rs
    --config.env=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin)
for m in "${meta[@]}"; do
    config+=(--manifest.annotation="$m" --config.label="$m")
done
umoci config --image "$work/oci:build" "${config[@]}" >&2
umoci tag --image "$work/oci:build" image >&2
umoci rm --image "$work/oci:build" >&2
umoci gc --layout "$work/oci" >&2
# The name loaders use: podman reads ref.name, docker io.containerd.image.name.
sed -i "s|\"org.opencontainers.image.ref.name\":\"image\"|\"io.containerd.image.name\":\"$name\",\"org.opencontainers.image.ref.name\":\"$name\"|" \
    "$work/oci/index.json"
grep -q "\"org.opencontainers.image.ref.name\":\"$name\"" "$work/oci/index.json" || die "naming the image in index.json failed"

find "$work/oci" -exec touch -h -d "@$epoch" {} +
rm -f "$archive"
tar --sort=name --mtime="@$epoch" --owner=0 --group=0 --numeric-owner -C "$work/oci" \
    -cf "$archive.partial" oci-layout index.json blobs
mv "$archive.partial" "$archive"

# For Docker < 25 (e.g. Debian bookworm's docker.io 20.10), which rejects OCI archives. skopeo
# writes the layers uncompressed with fixed timestamps; gzip -n (no name, no time) keeps it
# reproducible, and docker load reads it compressed.
rm -f "$docker_archive"
TMPDIR="$work" skopeo copy --quiet "oci-archive:$archive" "docker-archive:$work/docker.tar:$name" >&2
gzip -n -c "$work/docker.tar" >"$docker_archive.partial"
touch -d "@$epoch" "$docker_archive.partial"
mv "$docker_archive.partial" "$docker_archive"
mv "$work/oci" "$out/oci"
echo "$stamp" >"$out/stamp"

manifest=$(sed -n 's/.*"digest":"\(sha256:[0-9a-f]*\)".*/\1/p' "$out/oci/index.json")
log "$name ($commit): manifest $manifest, $(du -k "$archive" | cut -f1) KiB archive"
log "for docker < 25: $docker_archive ($(du -k "$docker_archive" | cut -f1) KiB)"
echo "$archive"
