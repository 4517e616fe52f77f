//! The container image `scripts/image.sh` builds, run the way a node runs it. The script
//! packages the binary under test (built once, cached in `target/image/`); the test reads the
//! OCI archive a user would load (index, manifest, config, digests, labels), unpacks its layers,
//! and runs the daemon from the unpacked root filesystem — chrooted, so the image's own
//! iptables, nft, conntrack and libraries do the work — in a node network namespace against
//! the test API server: it picks the backend the node uses, programs the rules, answers
//! /healthz, clears conntrack entries, and `--cleanup` from the image removes its rules.
//! Both backends, so the image's iptables-nft and iptables-legacy are each shown to agree with
//! the host kernel. nftables mode too: with `--proxy-mode=nftables` the image's `nft` programs
//! the `kube-proxy` tables and `--cleanup` from the image deletes them. The docker-archive
//! written beside it (for Docker < 25) is checked to be the same image. Root only (CI is root);
//! needs the Debian mirror the first time.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

use kube_proxy_rs::tracker::testing::{node, slice, svc};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::require_root;
use crate::support::cluster_net::{CLUSTER_CIDR, CPOD, Cluster, NODE_A, POD_A1, POD_B1, SERVE_PORT, sa, tcp_request};
use crate::support::e2e::{
    API_IP, BIN, DaemonProcess, NODE_IP, TempDir, daemon_args, kubeconfig_text, test_certificates, tls_acceptor,
    topology,
};
use crate::support::kubeadm;
use crate::support::netns::Netns;
use crate::support::poll::{SLOW_POLL, poll_until};

const ENTRYPOINT: &str = "/usr/local/bin/kube-proxy-rs";

/// The repository root (scripts/image.sh lives there).
fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Builds the image from the binary under test (once per test process; the script itself
/// skips the work when its inputs have not changed) and returns the OCI archive's path.
fn image_archive() -> PathBuf {
    static BUILT: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(path) = built.as_ref() {
        return path.clone();
    }
    // target/<profile>/kube-proxy-rs → target/image, beside the cargo outputs.
    let target = Path::new(BIN).parent().and_then(Path::parent).expect("target dir");
    let out = Command::new("bash")
        .arg(repo_root().join("scripts/image.sh"))
        .env("KPRS_BINARY", BIN)
        .env("KPRS_IMAGE_DIR", target.join("image"))
        .output()
        .expect("run scripts/image.sh");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "scripts/image.sh failed ({}):\n{stderr}", out.status);
    let stdout = String::from_utf8(out.stdout).expect("utf-8");
    let last = stdout.lines().last().unwrap_or_else(|| panic!("scripts/image.sh printed nothing\n{stderr}"));
    let path = PathBuf::from(last.trim());
    assert!(path.is_file(), "the last line of scripts/image.sh is not a file: {last:?}\n{stderr}");
    *built = Some(path.clone());
    path
}

fn sha256_hex(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// A blob of the layout, by descriptor, after checking its digest and size.
fn blob(layout: &Path, descriptor: &Value) -> PathBuf {
    let digest = descriptor["digest"].as_str().expect("descriptor digest");
    let hex = digest.strip_prefix("sha256:").unwrap_or_else(|| panic!("not a sha256 digest: {digest}"));
    let path = layout.join("blobs/sha256").join(hex);
    assert_eq!(sha256_hex(&path), hex, "blob {digest} does not match its digest");
    let size = std::fs::metadata(&path).expect("blob").len();
    assert_eq!(Some(size), descriptor["size"].as_u64(), "blob {digest}: size differs from its descriptor");
    path
}

fn json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).expect("read json"))
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The image unpacked: the archive's layout checked, its layers extracted in order.
struct Unpacked {
    dir: TempDir,
    annotations: BTreeMap<String, String>,
}

impl Unpacked {
    fn rootfs(&self) -> PathBuf {
        self.dir.path().join("rootfs")
    }

    fn rootfs_str(&self) -> String {
        self.rootfs().display().to_string()
    }
}

fn unpack(archive: &Path, tag: &str) -> Unpacked {
    let dir = TempDir::new(tag);
    let layout = dir.path().join("layout");
    let rootfs = dir.path().join("rootfs");
    std::fs::create_dir_all(&layout).expect("mkdir");
    std::fs::create_dir_all(&rootfs).expect("mkdir");
    run(Command::new("tar").arg("-xf").arg(archive).arg("-C").arg(&layout));

    assert_eq!(json(&layout.join("oci-layout"))["imageLayoutVersion"], "1.0.0");
    let index = json(&layout.join("index.json"));
    let manifests = index["manifests"].as_array().expect("index manifests");
    assert_eq!(manifests.len(), 1, "one image in the archive: {index}");
    let name = format!("kube-proxy-rs:{}", env!("CARGO_PKG_VERSION"));
    // podman names the loaded image by ref.name, docker by io.containerd.image.name.
    assert_eq!(manifests[0]["annotations"]["org.opencontainers.image.ref.name"], name.as_str(), "{index}");
    assert_eq!(manifests[0]["annotations"]["io.containerd.image.name"], name.as_str(), "{index}");

    let manifest = json(&blob(&layout, &manifests[0]));
    assert_eq!(manifest["config"]["mediaType"], "application/vnd.oci.image.config.v1+json");
    let config = json(&blob(&layout, &manifest["config"]));
    assert_eq!(config["config"]["Entrypoint"], serde_json::json!([ENTRYPOINT]), "{config}");
    let env = config["config"]["Env"].as_array().expect("Env");
    assert!(
        env.iter().any(|e| e.as_str().is_some_and(|e| e.starts_with("PATH=") && e.contains("/usr/sbin"))),
        "{config}"
    );
    // Debian's name for the architecture the binary was built for.
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    assert_eq!((config["os"].as_str(), config["architecture"].as_str()), (Some("linux"), Some(arch)));

    let layers = manifest["layers"].as_array().expect("layers");
    assert_eq!(layers.len(), 2, "a Debian layer and a binary layer: {manifest}");
    for layer in layers {
        assert_eq!(layer["mediaType"], "application/vnd.oci.image.layer.v1.tar+gzip");
        // Layers from scratch have no whiteouts, so extracting them in order is the image.
        run(Command::new("tar").arg("-xzf").arg(blob(&layout, layer)).arg("-C").arg(&rootfs));
    }
    let annotations: BTreeMap<String, String> = manifest["annotations"]
        .as_object()
        .expect("manifest annotations")
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().expect("annotation string").to_string()))
        .collect();
    // The same metadata as config labels (what `docker inspect` shows).
    for (k, v) in &annotations {
        assert_eq!(config["config"]["Labels"][k], v.as_str(), "label {k}: {config}");
    }
    Unpacked { dir, annotations }
}

/// `argv` run from the image inside `ns`: chrooted into the rootfs, with /proc and /sys
/// mounted there (in the private mount namespace `ip netns exec` makes, gone when it exits).
fn in_image(ns: &Netns, rootfs: &str, argv: &[&str]) -> Command {
    let mut script =
        format!("set -e; mount -t proc proc {rootfs}/proc; mount -t sysfs sysfs {rootfs}/sys; exec chroot {rootfs}");
    for a in argv {
        script.push_str(&format!(" '{a}'"));
    }
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &ns.name, "sh", "-c", &script]);
    cmd
}

/// Runs `argv` from the image inside `ns`, which must succeed; returns stdout.
fn image_ok(ns: &Netns, rootfs: &str, argv: &[&str]) -> String {
    run(&mut in_image(ns, rootfs, argv))
}

/// What `kube-proxy-rs --version` prints: "kube-proxy-rs 0.1.0 (git commit abc…)".
fn version_line(cmd: &mut Command) -> String {
    run(cmd).trim().to_string()
}

#[test]
fn image_metadata_binary_and_tools() {
    require_root!();
    let image = unpack(&image_archive(), "imgmeta");
    let rootfs = image.rootfs_str();

    // Labelled with the version and commit the binary reports, which is the one under test.
    let tested = version_line(Command::new(BIN).arg("--version"));
    assert_eq!(
        tested,
        format!("kube-proxy-rs {} (git commit {})", env!("CARGO_PKG_VERSION"), kube_proxy_rs::cmd::cli::GIT_COMMIT)
    );
    let ns = Netns::create("imgmeta");
    assert_eq!(version_line(&mut in_image(&ns, &rootfs, &[ENTRYPOINT, "--version"])), tested);
    let a = &image.annotations;
    assert_eq!(a.get("org.opencontainers.image.version").map(String::as_str), Some(env!("CARGO_PKG_VERSION")), "{a:?}");
    assert_eq!(
        a.get("org.opencontainers.image.revision").map(String::as_str),
        Some(kube_proxy_rs::cmd::cli::GIT_COMMIT),
        "{a:?}"
    );
    assert!(a.get("org.opencontainers.image.created").is_some_and(|c| c.ends_with('Z')), "{a:?}");

    // The shipped binary has no debug info (symbols stay, for backtraces).
    let sections =
        run(Command::new("readelf").args(["-S", "--wide"]).arg(image.rootfs().join("usr/local/bin/kube-proxy-rs")));
    for debug in [".debug_info", ".debug_line", ".debug_str"] {
        assert!(!sections.contains(debug), "the image's binary is not stripped ({debug}):\n{sections}");
    }
    assert!(sections.contains(".gnu_debuglink"), "{sections}");

    // The image's own tools run against this kernel: both iptables backends, IPv6, nft, conntrack.
    for tool in ["iptables-nft", "iptables-legacy", "ip6tables-nft", "ip6tables-legacy"] {
        image_ok(&ns, &rootfs, &[tool, "-t", "nat", "-L", "-n"]);
    }
    for tool in ["iptables-nft-restore", "iptables-legacy-restore", "ip6tables-nft-save", "ip6tables-legacy-save"] {
        image_ok(&ns, &rootfs, &[tool, "--version"]);
    }
    image_ok(&ns, &rootfs, &["nft", "list", "tables"]);
    image_ok(&ns, &rootfs, &["conntrack", "-L"]);
}

/// Docker before 25 cannot load an OCI archive, so the script writes the image again as a
/// docker-archive beside it. It must be the same image: the same config blob (so the same image
/// ID), the name docker tags it with, and the same layers (each layer's digest is the config's
/// diff_id for it).
#[test]
fn image_docker_archive_is_the_same_image() {
    require_root!();
    let archive = image_archive();
    let version = env!("CARGO_PKG_VERSION");
    let docker_archive = archive.with_file_name(format!("kube-proxy-rs-{version}.docker.tar.gz"));
    assert!(docker_archive.is_file(), "no docker-archive beside {}", archive.display());
    let dir = TempDir::new("imgdocker");
    let (layout, saved) = (dir.path().join("layout"), dir.path().join("docker"));
    for d in [&layout, &saved] {
        std::fs::create_dir_all(d).expect("mkdir");
    }
    run(Command::new("tar").arg("-xf").arg(&archive).arg("-C").arg(&layout));
    run(Command::new("tar").arg("-xzf").arg(&docker_archive).arg("-C").arg(&saved));

    let index = json(&layout.join("index.json"));
    let manifest = json(&blob(&layout, &index["manifests"][0]));
    let config = json(&blob(&layout, &manifest["config"]));
    let config_hex =
        manifest["config"]["digest"].as_str().and_then(|d| d.strip_prefix("sha256:")).expect("config digest");

    let saved_manifest = json(&saved.join("manifest.json"));
    let entries = saved_manifest.as_array().expect("manifest.json is a list");
    assert_eq!(entries.len(), 1, "one image in the docker-archive: {saved_manifest}");
    let entry = &entries[0];
    assert_eq!(entry["RepoTags"], serde_json::json!([format!("docker.io/library/kube-proxy-rs:{version}")]), "{entry}");
    let saved_config = entry["Config"].as_str().expect("Config");
    assert_eq!(saved_config, format!("{config_hex}.json"), "{entry}");
    assert_eq!(sha256_hex(&saved.join(saved_config)), config_hex, "the docker-archive's config differs");

    let diff_ids = config["rootfs"]["diff_ids"].as_array().expect("diff_ids");
    let layers = entry["Layers"].as_array().expect("Layers");
    assert_eq!(layers.len(), diff_ids.len(), "{entry}\n{config}");
    for (layer, diff_id) in layers.iter().zip(diff_ids) {
        let path = saved.join(layer.as_str().expect("layer path"));
        assert_eq!(Some(format!("sha256:{}", sha256_hex(&path)).as_str()), diff_id.as_str(), "layer {layer}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_runs_the_daemon_and_cleans_up_with_iptables_nft() {
    require_root!();
    daemon_from_image("nft").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_runs_the_daemon_and_cleans_up_with_iptables_legacy() {
    require_root!();
    daemon_from_image("legacy").await;
}

/// The image's daemon in nftables mode (`--proxy-mode=nftables`): the image's `nft` writes
/// both families' `kube-proxy` tables, a change follows, /healthz answers, and `--cleanup` from
/// the image deletes the tables (and nothing of iptables mode is written meanwhile).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_runs_the_daemon_in_nftables_mode_and_cleans_up() {
    require_root!();
    let image = unpack(&image_archive(), "imgnftables");
    let rootfs = image.rootfs_str();
    let (_api_ns, node_ns, server) = topology("imgnftables").await;
    server.create(&node("node-img", &[], &[], &[NODE_IP]));
    server.create(&svc("ns1", "web").cluster_ip("198.19.0.1").tcp("http", 80).build());
    server.create(&slice("ns1", "web", "web-1").tcp("http", 8080).ips(&["198.19.8.1"]).build());
    let table = |family: &str| -> String {
        let out = in_image(&node_ns, &rootfs, &["nft", "list", "table", family, "kube-proxy"]).output().expect("nft");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };

    let kubeconfig = image.rootfs().join("etc/kube-proxy-rs/kubeconfig");
    std::fs::create_dir_all(kubeconfig.parent().expect("parent")).expect("mkdir");
    std::fs::write(&kubeconfig, kubeconfig_text(&server)).expect("kubeconfig");
    let mut args = daemon_args(Path::new("/etc/kube-proxy-rs/kubeconfig"), "node-img");
    args.extend(["--proxy-mode=nftables", "-v=2"].map(String::from));
    let mut argv = vec![ENTRYPOINT];
    argv.extend(args.iter().map(String::as_str));
    let mut daemon = DaemonProcess::spawn(in_image(&node_ns, &rootfs, &argv), image.dir.path().join("daemon.log"));

    wait_for(&daemon, "the kube-proxy table programmed through the image's nft", || {
        let t = table("ip");
        t.contains("198.19.0.1 . tcp . 80") && t.contains("198.19.8.1")
    })
    .await;
    let ipv4 = table("ip");
    assert!(ipv4.contains("chain service-") && ipv4.contains("ns1/web/tcp/http"), "{ipv4}");
    assert!(table("ip6").contains("table ip6 kube-proxy"), "the IPv6 table too:\n{}", daemon.log_text());
    let log = daemon.log_text();
    assert!(log.contains("using netlink for per-service changes, nft for the rest"), "{log}");

    server.update(&slice("ns1", "web", "web-1").tcp("http", 8080).ips(&["198.19.8.2"]).build());
    wait_for(&daemon, "the new endpoint", || {
        let t = table("ip");
        t.contains("198.19.8.2") && !t.contains("198.19.8.1")
    })
    .await;
    let healthz = node_ns.ok(&[
        "bash",
        "-c",
        &format!("exec 3<>/dev/tcp/{NODE_IP}/10256; printf 'GET /healthz HTTP/1.0\\r\\n\\r\\n' >&3; cat <&3"),
    ]);
    assert!(healthz.starts_with("HTTP/1.") && healthz.contains(" 200 "), "{healthz}\n{}", daemon.log_text());
    let log = daemon.log_text();
    assert!(!log.contains(" ERROR "), "{log}");
    for backend in ["nft", "legacy"] {
        let nat = image_ok(&node_ns, &rootfs, &[&format!("iptables-{backend}-save"), "-t", "nat"]);
        assert!(!nat.contains("KUBE-SERVICES"), "iptables mode's rules written with iptables-{backend}:\n{nat}");
    }

    daemon.signal("TERM");
    let status = daemon.wait_exit(Duration::from_secs(20)).await;
    assert!(status.success(), "exit status {status}\n{}", daemon.log_text());
    assert!(table("ip").contains("198.19.8.2"), "the rules stay on shutdown");

    image_ok(&node_ns, &rootfs, &[ENTRYPOINT, "--cleanup"]);
    let tables = image_ok(&node_ns, &rootfs, &["nft", "list", "tables"]);
    assert!(!tables.contains("kube-proxy"), "left behind by --cleanup from the image:\n{tables}");
}

/// Polls `check` for up to 30 s, failing with the daemon's log.
async fn wait_for(daemon: &DaemonProcess, what: &str, check: impl FnMut() -> bool) {
    if poll_until(Duration::from_secs(30), SLOW_POLL, check).await.is_none() {
        panic!("timed out waiting for: {what}\ndaemon log:\n{}", daemon.log_text());
    }
}

/// The image's daemon on a node whose kubelet uses `backend` (its hint chain is there).
async fn daemon_from_image(backend: &str) {
    let other = if backend == "nft" { "legacy" } else { "nft" };
    let image = unpack(&image_archive(), &format!("img{backend}"));
    let rootfs = image.rootfs_str();
    let (_api_ns, node_ns, server) = topology(&format!("img{backend}")).await;
    server.create(&node("node-img", &[], &[], &[NODE_IP]));
    server.create(&svc("ns1", "web").cluster_ip("172.30.0.1").tcp("http", 80).build());
    server.create(&slice("ns1", "web", "web-1").tcp("http", 8080).ips(&["10.1.0.1"]).build());
    server.create(&svc("ns1", "dns").cluster_ip("172.30.0.10").udp("dns", 53).build());
    server.create(&slice("ns1", "dns", "dns-1").udp("dns", 53).ips(&["10.1.0.5"]).build());

    // The node's kubelet hint, written with the image's own iptables.
    image_ok(&node_ns, &rootfs, &[&format!("iptables-{backend}"), "-t", "mangle", "-N", "KUBE-KUBELET-CANARY"]);
    let save = |b: &str| -> String { image_ok(&node_ns, &rootfs, &[&format!("iptables-{b}-save")]) };

    let kubeconfig = image.rootfs().join("etc/kube-proxy-rs/kubeconfig");
    std::fs::create_dir_all(kubeconfig.parent().expect("parent")).expect("mkdir");
    std::fs::write(&kubeconfig, kubeconfig_text(&server)).expect("kubeconfig");
    let mut args = daemon_args(Path::new("/etc/kube-proxy-rs/kubeconfig"), "node-img");
    args.extend(["--iptables-sync-period=2s", "--iptables-min-sync-period=100ms", "-v=2"].map(String::from));
    let mut argv = vec![ENTRYPOINT];
    argv.extend(args.iter().map(String::as_str));
    let mut daemon = DaemonProcess::spawn(in_image(&node_ns, &rootfs, &argv), image.dir.path().join("daemon.log"));

    wait_for(&daemon, "rules programmed through the image's iptables", || {
        save(backend).contains("--to-destination 10.1.0.1:8080")
    })
    .await;
    let log = daemon.log_text();
    assert!(log.contains(&format!("backend={backend}")), "the daemon must pick the node's backend:\n{log}");
    let rules = save(backend);
    assert!(
        rules.contains("-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"),
        "{rules}"
    );
    assert!(rules.contains("--to-destination 10.1.0.5:53"), "{rules}");
    assert!(!save(other).contains("KUBE-SERVICES"), "nothing written with iptables-{other}");

    // /healthz answers 200.
    let healthz = node_ns.ok(&[
        "bash",
        "-c",
        &format!("exec 3<>/dev/tcp/{NODE_IP}/10256; printf 'GET /healthz HTTP/1.0\\r\\n\\r\\n' >&3; cat <&3"),
    ]);
    assert!(healthz.starts_with("HTTP/1.") && healthz.contains(" 200 "), "{healthz}\n{}", daemon.log_text());

    // A UDP endpoint going away makes the daemon (default release: the conntrack reconciler of
    // 1.32+) list the UDP conntrack table with the image's conntrack, which must reach the
    // kernel: the reconciliation finishes only when the listing succeeded.
    server.update(&slice("ns1", "dns", "dns-1").udp("dns", 53).ips(&["10.1.0.6"]).build());
    wait_for(&daemon, "the new UDP endpoint", || save(backend).contains("--to-destination 10.1.0.6:53")).await;
    wait_for(&daemon, "conntrack reconciliation after the UDP endpoint change", || {
        daemon.log_text().lines().any(|l| l.contains("finished reconciling conntrack entries") && l.contains("IPv4"))
    })
    .await;
    let log = daemon.log_text();
    assert!(!log.contains("failed to delete stale conntrack entries"), "{log}");
    assert!(!log.contains("failed to list conntrack entries"), "{log}");
    assert!(!log.contains(" ERROR "), "{log}");

    daemon.signal("TERM");
    let status = daemon.wait_exit(Duration::from_secs(20)).await;
    assert!(status.success(), "exit status {status}\n{}", daemon.log_text());

    // --cleanup from the image removes every rule of ours, leaving the kubelet's chain and
    // KUBE-FIREWALL (shared with the kubelet; upstream's cleanup leaves it too).
    image_ok(&node_ns, &rootfs, &[ENTRYPOINT, "--cleanup"]);
    let after = save(backend);
    let ours: Vec<&str> = after
        .lines()
        .filter(|l| l.contains("KUBE-") && !l.contains("KUBE-KUBELET-CANARY") && !l.contains("KUBE-FIREWALL"))
        .collect();
    assert!(ours.is_empty(), "left behind by --cleanup from the image:\n{}", ours.join("\n"));
    assert!(after.contains(":KUBE-KUBELET-CANARY"), "the kubelet's chain must stay:\n{after}");
}

/// `path` (absolute, as the image sees it) inside the unpacked `rootfs`, following the image's
/// symlinks within it (Debian's `/var/run` is a link to `/run`; writing through it from outside
/// would reach the host's `/run`).
fn image_path(rootfs: &Path, path: &str) -> PathBuf {
    let mut resolved = rootfs.to_path_buf();
    let mut pending: Vec<String> = path.split('/').filter(|p| !p.is_empty()).rev().map(String::from).collect();
    let mut links = 0;
    while let Some(part) = pending.pop() {
        let next = resolved.join(&part);
        match std::fs::read_link(&next) {
            Ok(target) => {
                links += 1;
                assert!(links < 40, "symlink loop under {}", rootfs.display());
                let target = target.to_string_lossy().into_owned();
                // An absolute target restarts at the image's root; a relative one is taken
                // from the link's directory, which `resolved` still is.
                if target.starts_with('/') {
                    resolved = rootfs.to_path_buf();
                }
                pending.extend(target.split('/').filter(|p| !p.is_empty()).rev().map(String::from));
            }
            Err(_) => resolved = next,
        }
    }
    assert!(resolved.starts_with(rootfs), "{path} resolves outside the image: {}", resolved.display());
    resolved
}

fn write_in_image(rootfs: &Path, path: &str, text: &str) {
    let file = image_path(rootfs, path);
    std::fs::create_dir_all(file.parent().expect("parent")).expect("mkdir in image");
    std::fs::write(&file, text).unwrap_or_else(|e| panic!("write {}: {e}", file.display()));
}

/// kubeadm's config.conf of each release from 1.35 to 1.37 is a valid configuration for us as
/// it stands, decoded strictly (every field is one we know).
#[test]
fn kubeadm_config_files_of_1_35_to_1_37_load() {
    for release in [35, 36, 37] {
        let text = kubeadm::config_conf(release, CLUSTER_CIDR);
        let decoded = kube_proxy_rs::config::parse_config(&text, Path::new("config.conf")).expect("decodes");
        assert!(!decoded.is_lenient(), "1.{release}: {}", decoded.strict_error_text());
        let settings = kube_proxy_rs::config::Settings::from_config(&decoded.config).expect("valid");
        assert_eq!(settings.client.kubeconfig.as_deref(), Some(Path::new("/var/lib/kube-proxy/kubeconfig.conf")));
        assert_eq!(settings.cluster_cidrs.len(), 2, "1.{release}");
        assert_eq!(settings.sync_period, Duration::from_secs(30), "zero values are defaulted");
    }
}

/// `kubectl -n kube-system set image ds/kube-proxy kube-proxy=OUR_IMAGE` on kubeadm's
/// DaemonSet: the image's root filesystem run exactly as that pod runs it — kubeadm's command
/// line (`/usr/local/bin/kube-proxy --config=/var/lib/kube-proxy/config.conf
/// --hostname-override=$(NODE_NAME)`), privileged, the ConfigMap's config.conf (kubeadm 1.37's,
/// plus one field we do not know) and kubeconfig.conf, the service account's token file and CA,
/// /run/xtables.lock — against the test API server over TLS with a bearer token. Traffic to a
/// ClusterIP reaches the pods. Then the credentials go wrong: a wrong token is an error naming
/// the kubeconfig, the server and the token file from the first request, retried; a missing
/// token file is an error and a retry until it is back, and then the node is programmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubeadm_daemonset_runs_with_only_the_image_changed() {
    require_root!();
    const TOKEN: &str = "kube-proxy-sa-token-7f3a";
    let image = unpack(&image_archive(), "imgkubeadm");
    let rootfs = image.rootfs();
    let certs = TempDir::new("kubeadm-certs");
    test_certificates(certs.path(), API_IP);
    let c = Cluster::network_tls("kubeadm", tls_acceptor(certs.path())).await;
    c.server.require_token(TOKEN);

    // The ConfigMap (kubeadm 1.37's config.conf with a field from a newer kubeadm), the
    // service account's files, and the xtables lock, where the pod has them.
    let config = format!("{}futureKubeadmField: true\n", kubeadm::config_conf(37, CLUSTER_CIDR));
    write_in_image(&rootfs, &format!("{}/config.conf", kubeadm::CONFIG_DIR), &config);
    write_in_image(
        &rootfs,
        &format!("{}/kubeconfig.conf", kubeadm::CONFIG_DIR),
        &kubeadm::kubeconfig_conf(&c.server.url()),
    );
    let ca = std::fs::read_to_string(certs.path().join("ca.crt")).expect("ca.crt");
    write_in_image(&rootfs, &format!("{}/ca.crt", kubeadm::SERVICE_ACCOUNT_DIR), &ca);
    write_in_image(&rootfs, &format!("{}/namespace", kubeadm::SERVICE_ACCOUNT_DIR), "kube-system");
    let token_file = image_path(&rootfs, &format!("{}/token", kubeadm::SERVICE_ACCOUNT_DIR));
    write_in_image(&rootfs, "/run/xtables.lock", "");
    let rootfs_str = image.rootfs_str();
    let start = |token: Option<&str>, run: &str| {
        match token {
            Some(token) => write_in_image(&rootfs, &format!("{}/token", kubeadm::SERVICE_ACCOUNT_DIR), token),
            None => {
                let _ = std::fs::remove_file(&token_file);
            }
        }
        let argv = kubeadm::command(NODE_A);
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        let mut cmd = in_image(&c.node_a, &rootfs_str, &argv);
        cmd.env("NODE_NAME", NODE_A).env_remove("RUST_LOG");
        DaemonProcess::spawn(cmd, image.dir.path().join(format!("kubeadm-{run}.log")))
    };

    c.server.create(&svc("ns1", "web").cluster_ip("198.19.0.50").tcp("http", 80).build());
    c.server.create(
        &slice("ns1", "web", "web-1")
            .tcp("http", i32::from(SERVE_PORT))
            .endpoint(kube_proxy_rs::tracker::testing::ep(&c.pod(POD_A1).ip).node(NODE_A))
            .endpoint(kube_proxy_rs::tracker::testing::ep(&c.pod(POD_B1).ip).node("node-b"))
            .build(),
    );
    let mut daemon = start(Some(TOKEN), "good");
    let cluster_ip = sa("198.19.0.50", 80);
    let answered = poll_until(Duration::from_secs(30), SLOW_POLL, || {
        tcp_request(&c.pod(CPOD).ns, cluster_ip, None)
            .is_ok_and(|r| r.pod == c.pod(POD_A1).name || r.pod == c.pod(POD_B1).name)
    });
    if answered.await.is_none() {
        panic!("the ClusterIP is not answered through kubeadm's pod spec:\n{}\n{}", c.nat(), daemon.log_text());
    }
    let log = daemon.log_text();
    let lenient = log
        .lines()
        .find(|l| l.contains("Using lenient decoding as strict decoding failed"))
        .unwrap_or_else(|| panic!("no warning for the unknown field:\n{log}"));
    assert!(lenient.contains("WARN") && lenient.contains("futureKubeadmField"), "{lenient}");
    assert!(c.server.requests().iter().all(|r| r.authorization.as_deref() == Some(&format!("Bearer {TOKEN}")[..])));
    // Privileged as kubeadm runs it: any refused kernel setting says so, not "use --init-only".
    assert!(!log.contains("--init-only"), "{log}");
    daemon.signal("TERM");
    assert!(daemon.wait_exit(Duration::from_secs(20)).await.success(), "{}", daemon.log_text());

    // A wrong token: an error naming the kubeconfig, the server and the token file, at once,
    // and retried (the process keeps running).
    let t = std::time::Instant::now();
    let mut daemon = start(Some("a-wrong-token"), "wrong");
    let unauthorized = |log: &str| log.lines().filter(|l| l.contains("ERROR") && l.contains("401")).count();
    let seen = poll_until(Duration::from_secs(30), SLOW_POLL, || unauthorized(&daemon.log_text()) >= 2).await;
    let log = daemon.log_text();
    assert!(seen.is_some(), "no repeated 401 errors:\n{log}");
    let first = log.lines().find(|l| l.contains("ERROR") && l.contains("401")).expect("an error");
    for part in
        ["/var/lib/kube-proxy/kubeconfig.conf", &c.server.url(), "/var/run/secrets/kubernetes.io/serviceaccount/token"]
    {
        assert!(first.contains(part), "the error names {part}: {first}");
    }
    assert!(t.elapsed() < Duration::from_secs(20), "the first 401 is an error at once: {:?}", t.elapsed());
    assert!(daemon.child.as_mut().expect("running").try_wait().expect("wait").is_none(), "retrying, not exiting");
    daemon.signal("TERM");
    assert!(daemon.wait_exit(Duration::from_secs(20)).await.success(), "{}", daemon.log_text());

    // No token file yet (the kubelet projects it): an error naming it, retried until it is
    // there; then the node is programmed.
    c.server.update(&svc("ns1", "web").cluster_ip("198.19.0.51").tcp("http", 80).build());
    let daemon = start(None, "missing");
    let missing = poll_until(Duration::from_secs(30), SLOW_POLL, || {
        daemon.log_text().lines().filter(|l| l.contains("ERROR")).count() >= 2
    })
    .await;
    let log = daemon.log_text();
    assert!(missing.is_some(), "no repeated errors without a token file:\n{log}");
    let error = log.lines().find(|l| l.contains("ERROR")).expect("an error");
    assert!(error.contains("kubeconfig.conf") && error.contains("retry"), "{error}");
    write_in_image(&rootfs, &format!("{}/token", kubeadm::SERVICE_ACCOUNT_DIR), TOKEN);
    let moved = poll_until(Duration::from_secs(60), SLOW_POLL, || c.nat().contains("198.19.0.51/32")).await;
    assert!(moved.is_some(), "programmed once the token file appeared:\n{}", daemon.log_text());
}
