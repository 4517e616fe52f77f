//! The daemon at scale: the real binary in a node namespace against the test API server
//! holding N synthetic services × 10 endpoints.
//!
//! * `scale_regression_guard` (in the suite): 500 services on iptables-nft, where the first
//!   sync's restore is large enough to be split. It checks what must hold at any size: the
//!   node ends with exactly the rules one upstream-style restore of the same state gives,
//!   single endpoint changes reach the kernel, and the nat table is never read whole with
//!   `iptables-save` (a wrapper first on PATH logs every call).
//! * `scale_benchmark` (ignored; run by hand, reported in docs/performance.md): the figures
//!   for issue 10 at `KPR_SERVICES` (default 10000) on `KPR_BACKEND` (nft or legacy; default
//!   nft): time to program every service, network-programming latency of
//!   `KPR_CHANGES` single endpoint changes (p50/p99), the daemon's sync phases, RSS (end and
//!   peak), the kernel's floor for any restore into the programmed table (one rule into a
//!   scratch chain), and beside them what upstream's way costs on the same state in the same
//!   run (its partial sync's restore of every top-level nat chain; one `--noflush` restore of
//!   the full payload into a fresh namespace, capped at `KPR_UPSTREAM_LIMIT` seconds; one
//!   `iptables-save -t nat` of the programmed node). `KPR_AFFINITY_EVERY` sets the share of
//!   services with ClientIP affinity (default every 7th; 0 for none).
//!
//!       sudo KPR_SERVICES=10000 KPR_BACKEND=nft cargo nextest run --release \
//!           --run-ignored only -E 'test(scale_benchmark)' --no-capture

use std::path::Path;
use std::time::{Duration, Instant};

use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube_proxy_rs::iptables::runner::Backend;
use kube_proxy_rs::model::chains::endpoint_chain_name;
use kube_proxy_rs::synthetic::{self, ClusterShape};

use crate::require_root;
use crate::support::e2e::{BIN, DaemonProcess, TempDir, create_nfacct_objects, daemon_args, topology};
use crate::support::netns::Netns;

pub(crate) const NODE: &str = "node-e2e";
pub(crate) const ENDPOINTS: usize = 10;

/// The backend `KPR_BACKEND` names (default nft).
fn backend_from_env() -> Backend {
    match std::env::var("KPR_BACKEND").as_deref() {
        Ok("legacy") => Backend::Legacy,
        _ => Backend::Nft,
    }
}

/// Whether nat chain `chain` exists in `ns` (a cheap probe, not a whole-table read on nft).
fn chain_exists(backend: Backend, ns: &Netns, chain: &str) -> bool {
    match backend {
        Backend::Legacy => ns.run(&["iptables-legacy", "-w", "-t", "nat", "-S", chain]).success(),
        _ => ns.run(&["nft", "list", "chain", "ip", "nat", chain]).success(),
    }
}

/// `iptables*-save` wrappers first on PATH that log their arguments to `log` and run the
/// real binary.
fn logging_save_wrappers(bin: &Path, log: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(bin).expect("wrapper dir");
    for family in ["iptables", "ip6tables"] {
        for infix in ["", "-nft", "-legacy"] {
            let name = format!("{family}{infix}-save");
            let script =
                format!("#!/bin/sh\necho \"{name} $*\" >> '{}'\nexec /usr/sbin/{name} \"$@\"\n", log.display());
            let path = bin.join(&name);
            std::fs::write(&path, script).expect("write wrapper");
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod wrapper");
        }
    }
}

/// Service `i`'s slice (`per` endpoints) with its first endpoint replaced by `198.19.x.y`
/// (change `k`).
pub(crate) fn one_endpoint_changed(i: usize, per: usize, k: usize) -> (EndpointSlice, String) {
    let mut s = synthetic::slice(i, per, 0);
    let ip = format!("198.19.{}.{}", (k / 250) % 250, k % 250 + 1);
    s.endpoints[0].addresses = vec![ip.clone()];
    (s, ip)
}

fn endpoint_chain(i: usize, ip: &str) -> String {
    endpoint_chain_name(&format!("ns-{}/svc-{i}:http", i % 100), "tcp", &format!("{ip}:8080"))
}

pub(crate) fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

pub(crate) struct ScaleRun {
    pub(crate) programmed: Duration,
    pub(crate) latencies: Vec<Duration>,
    pub(crate) probe: Duration,
    pub(crate) peak_rss_kb: u64,
    /// Resident at the end, after every change was synced (VmRSS).
    pub(crate) rss_kb: u64,
    pub(crate) log: String,
    pub(crate) save_calls: String,
    /// The start of `save_calls` (the log only grows): the calls made before the first
    /// endpoint change (start-up and the first sync).
    pub(crate) save_calls_at_start: String,
    /// The endpoint chains the changes created (stale once put back; large-cluster mode
    /// deletes them at most once per sync period).
    pub(crate) changed_chains: Vec<String>,
}

/// How many syncs the daemon has logged as complete.
fn sync_count(log: &str) -> usize {
    log.matches("sync complete").count()
}

/// Waits until endpoint chain `chain` (change `k`, written at `changed`) is in the kernel
/// and returns how long after `changed` it got there.
///
/// On nft the chain is probed every 10 ms (8 ms a probe at 10k). On legacy a probe reads
/// the whole table under the xtables lock (0.5 s at 10k), and a restore that starts during
/// one waits for it, so probing would slow what it measures; there the daemon's
/// `sync complete` lines are watched instead (its restore has returned, so the rule is in
/// the kernel by then) and the chain is probed once per completed sync to confirm it.
async fn wait_programmed(
    backend: Backend,
    node_ns: &Netns,
    chain: &str,
    daemon: &DaemonProcess,
    syncs_before: usize,
    changed: Instant,
    k: usize,
) -> Duration {
    let mut syncs_seen = syncs_before;
    loop {
        assert!(changed.elapsed() < Duration::from_secs(120), "change {k} never programmed\n{}", daemon.log_text());
        match backend {
            Backend::Legacy => {
                let now = sync_count(&daemon.log_text());
                let seen_at = changed.elapsed();
                if now > syncs_seen {
                    syncs_seen = now;
                    if chain_exists(backend, node_ns, chain) {
                        return seen_at;
                    }
                }
            }
            _ => {
                if chain_exists(backend, node_ns, chain) {
                    return changed.elapsed();
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Starts the daemon on a cluster of `services`, waits until the last service is
/// programmed, then makes `changes` single endpoint changes one at a time, each waited for
/// in the kernel.
pub(crate) async fn run_daemon(
    node_ns: &Netns,
    server: &crate::support::apiserver::ApiServer,
    dir: &TempDir,
    backend: Backend,
    shape: ClusterShape,
    changes: usize,
) -> ScaleRun {
    let services = shape.services;
    let cluster = synthetic::cluster(shape);
    let mut n = cluster.node.clone();
    n.metadata.name = Some(NODE.into());
    server.create(&n);
    for s in &cluster.services {
        server.create(s);
    }
    for s in &cluster.slices {
        server.create(s);
    }
    // The kubelet's hint chain tells the daemon which backend the node uses.
    node_ns.ok(&[&format!("iptables-{backend}"), "-t", "mangle", "-N", "KUBE-KUBELET-CANARY"]);

    let bin = dir.path().join("bin");
    let save_log = dir.path().join("save-calls");
    logging_save_wrappers(&bin, &save_log);
    let path = format!("{}:/usr/sbin:/usr/bin:/sbin:/bin", bin.display());
    let mut args = daemon_args(&dir.kubeconfig(server), NODE);
    args.extend(["--iptables-min-sync-period=1s".into(), "--iptables-sync-period=30s".into(), "--v=2".into()]);
    let started = Instant::now();
    // As the DaemonSet runs it (deploy/kube-proxy-rs.yaml).
    let env = [("PATH", path.as_str()), ("MALLOC_MMAP_THRESHOLD_", "131072")];
    let daemon = DaemonProcess::start(node_ns, &args, dir.path().join("daemon.log"), &env);
    let pid = daemon.pid();

    // Programmed once the full sync that wrote the cluster has completed (its restore puts
    // KUBE-SERVICES last, so no chain probe tells earlier that every service is reachable).
    let last = services - 1;
    let per = shape.endpoints_per_service;
    let last_chain = endpoint_chain(last, &synthetic::slice(last, per, 0).endpoints[0].addresses[0]);
    // 10k services take 20 s on nft (735 s before the split restore): a guard run that hangs
    // must not hold CI for long.
    let limit = Duration::from_secs(60 + services as u64 / 5);
    let full_sync_done = |log: &str| sync_phases(log).iter().any(|p| p.full && p.bytes > 100_000);
    while !full_sync_done(&daemon.log_text()) {
        assert!(started.elapsed() < limit, "not programmed within {limit:?}\n{}", daemon.log_text());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(chain_exists(backend, node_ns, &last_chain), "the last service's endpoint chain exists");
    let programmed = started.elapsed();
    // Let the first sync's follow-ups settle before measuring single changes.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let save_calls_at_start = std::fs::read_to_string(&save_log).unwrap_or_default();
    let probe_start = Instant::now();
    assert!(chain_exists(backend, node_ns, &last_chain));
    let probe = probe_start.elapsed();

    let mut latencies = Vec::new();
    let mut changed_chains = Vec::new();
    for k in 0..changes {
        let i = (k * 7919) % services;
        let (slice, ip) = one_endpoint_changed(i, per, k);
        let chain = endpoint_chain(i, &ip);
        let before = sync_count(&daemon.log_text());
        let changed = Instant::now();
        server.update(&slice);
        latencies.push(wait_programmed(backend, node_ns, &chain, &daemon, before, changed, k).await);
        changed_chains.push(chain);
        // Put it back (also a change), wait until that is synced too, and let minSyncPeriod
        // pass, so every change arrives alone at an idle proxier, as the stream does.
        server.update(&synthetic::slice(i, per, 0));
        let put_back = Instant::now();
        while sync_count(&daemon.log_text()) < before + 2 {
            assert!(put_back.elapsed() < Duration::from_secs(120), "put-back {k} never synced\n{}", daemon.log_text());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(1_200)).await;
    }
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let status_kb = |field: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    let (peak_rss_kb, rss_kb) = (status_kb("VmHWM:"), status_kb("VmRSS:"));
    let log = daemon.log_text();
    drop(daemon);
    if let Ok(keep) = std::env::var("KPR_KEEP_LOG") {
        let _ = std::fs::write(&keep, &log);
    }
    ScaleRun {
        programmed,
        latencies,
        probe,
        peak_rss_kb,
        rss_kb,
        log,
        save_calls: std::fs::read_to_string(&save_log).unwrap_or_default(),
        save_calls_at_start,
        changed_chains,
    }
}

/// The full payload the daemon's first sync writes, as `render` prints it.
fn full_payload(dir: &TempDir, shape: ClusterShape) -> String {
    let mut cluster = synthetic::cluster(shape);
    cluster.node.metadata.name = Some(NODE.into());
    let yaml = synthetic::cluster_yaml(&cluster).expect("yaml");
    let manifest = dir.path().join("cluster.yaml");
    std::fs::write(&manifest, yaml).expect("write manifest");
    let out = std::process::Command::new(BIN)
        .args(["render", "--hostname-override", NODE, "--iptables-version", "1.8.9"])
        .arg(&manifest)
        .output()
        .expect("run render");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8")
}

/// One sync as the daemon logged it (`sync complete` at -v 2); times in milliseconds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SyncPhases {
    pub(crate) full: bool,
    pub(crate) elapsed: u64,
    pub(crate) read: u64,
    pub(crate) render: u64,
    pub(crate) restore: u64,
    pub(crate) bytes: u64,
}

/// The syncs the daemon logged.
pub(crate) fn sync_phases(log: &str) -> Vec<SyncPhases> {
    let field = |line: &str, name: &str| -> Option<u64> {
        let at = line.find(&format!("{name}="))? + name.len() + 1;
        line[at..].split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
    };
    log.lines()
        .filter(|l| l.contains("sync complete"))
        .filter_map(|l| {
            Some(SyncPhases {
                full: l.contains("full=true"),
                elapsed: field(l, "elapsed_ms")?,
                read: field(l, "read_ms")?,
                render: field(l, "render_ms")?,
                restore: field(l, "restore_ms")?,
                bytes: field(l, "bytes")?,
            })
        })
        .collect()
}

pub(crate) fn nat_reads(save_calls: &str) -> Vec<&str> {
    save_calls.lines().filter(|l| !l.contains("mangle")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scale_regression_guard() {
    require_root!();
    let shape = ClusterShape::new(500, ENDPOINTS);
    let (_api_ns, node_ns, server) = topology("scale").await;
    let dir = TempDir::new("scale");
    let run = run_daemon(&node_ns, &server, &dir, Backend::Nft, shape, 3).await;
    assert!(run.log.contains("backend=nft"), "{}", run.log);
    assert!(run.log.contains("restored in pieces"), "the first sync was applied in pieces: {}", run.log);
    assert!(nat_reads(&run.save_calls).is_empty(), "the nat table was read whole: {}", run.save_calls);
    let phases = sync_phases(&run.log);
    assert!(phases.iter().any(|p| p.full), "a full sync was logged: {}", run.log);

    // The node ends where one upstream-style restore of the same state ends (the last
    // endpoint change was put back, so the state is the synthetic cluster).
    let payload = full_payload(&dir, shape);
    let reference = Netns::create("scale-ref");
    reference.ok(&["iptables-nft", "-t", "mangle", "-N", "KUBE-KUBELET-CANARY"]);
    create_nfacct_objects(&reference);
    let body: String = payload.lines().filter(|l| !l.starts_with("# sync")).map(|l| format!("{l}\n")).collect();
    let out = reference.run_with_stdin(&["iptables-nft-restore", "--noflush"], &body);
    assert!(out.success(), "reference restore: {}", out.combined());
    let mut ours = kube_chains(&node_ns);
    assert_eq!(run.changed_chains.len(), 3);
    ours.retain(|l| {
        !run.changed_chains.iter().any(|c| l.starts_with(&format!(":{c}")) || l.starts_with(&format!("-A {c} ")))
    });
    let theirs = kube_chains(&reference);
    assert!(ours.len() > shape.services * 10, "{}", ours.len());
    if ours != theirs {
        let only_ours: Vec<_> = ours.iter().filter(|c| !theirs.contains(c)).take(10).collect();
        let only_theirs: Vec<_> = theirs.iter().filter(|c| !ours.contains(c)).take(10).collect();
        panic!("rules differ: only on the node {only_ours:?}, only in the reference {only_theirs:?}");
    }
}

/// Per-service chains and their rules in `ns`'s nat table, sorted (the jump rules the
/// daemon adds to built-in chains and its canary are left out: the reference has neither).
fn kube_chains(ns: &Netns) -> Vec<String> {
    let save = ns.ok(&["iptables-nft-save", "-t", "nat"]);
    let mut lines: Vec<String> = save
        .lines()
        .filter(|l| l.starts_with(":KUBE-") || l.starts_with("-A KUBE-"))
        .filter(|l| !l.contains("KUBE-PROXY-CANARY") && !l.contains("KUBE-KUBELET-CANARY"))
        .map(|l| if l.starts_with(':') { l.split(' ').next().unwrap_or(l).to_string() } else { l.to_string() })
        .collect();
    lines.sort();
    lines
}

/// Restores `payloads[0]` (then `payloads[1..]`, untimed, to undo it) five times into `ns`;
/// the median time of the first.
fn median_restore(ns: &Netns, restore_bin: &str, dir: &TempDir, name: &str, payloads: &[String]) -> Duration {
    let mut times = Vec::new();
    for round in 0..5 {
        for (i, payload) in payloads.iter().enumerate() {
            let input = dir.path().join(format!("{name}-{i}"));
            std::fs::write(&input, payload).expect("write payload");
            let t = Instant::now();
            let status = std::process::Command::new("ip")
                .args(["netns", "exec", &ns.name, restore_bin, "--noflush", "--counters"])
                .stdin(std::fs::File::open(&input).expect("open payload"))
                .status()
                .expect("run restore");
            assert!(status.success(), "{name} restore {i} (round {round}) failed");
            if i == 0 {
                times.push(t.elapsed());
            }
        }
    }
    times.sort();
    times[times.len() / 2]
}

/// Adds one rule in a scratch nat chain, then removes the chain.
fn floor_payloads() -> Vec<String> {
    vec![
        "*nat\n:KPR-BENCH-FLOOR - [0:0]\n-A KPR-BENCH-FLOOR -j RETURN\nCOMMIT\n".into(),
        "*nat\n:KPR-BENCH-FLOOR - [0:0]\n-X KPR-BENCH-FLOOR\nCOMMIT\n".into(),
    ]
}

/// The nat section of `payload` reduced to its top-level chains (not per service), as
/// upstream writes them on every partial sync.
fn top_level_nat(payload: &str) -> String {
    let per_service = |chain: &str| {
        ["KUBE-SVC-", "KUBE-SVL-", "KUBE-SEP-", "KUBE-EXT-", "KUBE-FW-"].iter().any(|p| chain.starts_with(p))
    };
    let nat = payload.split("*nat\n").nth(1).expect("nat section");
    let mut out = String::from("*nat\n");
    for line in nat.lines() {
        let chain = line.strip_prefix(':').or_else(|| line.strip_prefix("-A ")).and_then(|l| l.split(' ').next());
        if chain.is_some_and(|c| !per_service(c)) {
            out.push_str(line);
            out.push('\n');
        }
    }
    out.push_str("COMMIT\n");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run by hand, reported in docs/performance.md"]
async fn scale_benchmark() {
    require_root!();
    let env = |name: &str, default: usize| std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    let services = env("KPR_SERVICES", 10_000);
    let changes = env("KPR_CHANGES", 30);
    let upstream_limit = Duration::from_secs(env("KPR_UPSTREAM_LIMIT", 900) as u64);
    let backend = backend_from_env();
    let mut shape = ClusterShape::new(services, ENDPOINTS);
    shape.affinity_every = env("KPR_AFFINITY_EVERY", ClusterShape::DEFAULT_AFFINITY_EVERY);
    let (_api_ns, node_ns, server) = topology("bench").await;
    let dir = TempDir::new("bench");
    let run = run_daemon(&node_ns, &server, &dir, backend, shape, changes).await;
    let mut lat = run.latencies.clone();
    lat.sort();
    let phases = sync_phases(&run.log);
    // The full sync that wrote the cluster (one may run first, before the lists arrived).
    let first = phases.iter().filter(|p| p.full).max_by_key(|p| p.bytes).copied();
    let partial: Vec<_> = phases.iter().filter(|p| !p.full).collect();
    let median = |mut v: Vec<u64>| {
        v.sort_unstable();
        v.get(v.len() / 2).copied().unwrap_or(0)
    };

    let affinity = match shape.affinity_every {
        0 => "no session affinity".to_string(),
        n => format!("ClientIP affinity on every {n}th service"),
    };
    eprintln!("== scale benchmark: {services} services x {ENDPOINTS} endpoints, {affinity}, {} ==", backend.as_str());
    eprintln!("programmed (start -> last service in the kernel): {:.1} s", run.programmed.as_secs_f64());
    if let Some(p) = first {
        eprintln!(
            "full sync: {} ms (read {} ms, render {} ms, restore {} ms, {} bytes)",
            p.elapsed, p.read, p.render, p.restore, p.bytes
        );
    }
    eprintln!(
        "partial syncs ({}): median {} ms (read {} ms, render {} ms, restore {} ms), max {} ms",
        partial.len(),
        median(partial.iter().map(|p| p.elapsed).collect()),
        median(partial.iter().map(|p| p.read).collect()),
        median(partial.iter().map(|p| p.render).collect()),
        median(partial.iter().map(|p| p.restore).collect()),
        partial.iter().map(|p| p.elapsed).max().unwrap_or(0),
    );
    eprintln!(
        "network programming latency ({} changes): p50 {:.3} s, p99 {:.3} s, max {:.3} s (probe alone {:.3} s)",
        lat.len(),
        percentile(&lat, 50.0).as_secs_f64(),
        percentile(&lat, 99.0).as_secs_f64(),
        lat.last().copied().unwrap_or_default().as_secs_f64(),
        run.probe.as_secs_f64()
    );
    eprintln!("RSS: {:.1} MB at the end, peak {:.1} MB", run.rss_kb as f64 / 1024.0, run.peak_rss_kb as f64 / 1024.0);
    let steady = run.save_calls.strip_prefix(run.save_calls_at_start.as_str()).unwrap_or(&run.save_calls);
    let steady_reads = nat_reads(steady).len();
    eprintln!(
        "nat table reads with iptables-save: {} at start-up and in the first sync, {steady_reads} during the change stream",
        nat_reads(&run.save_calls_at_start).len()
    );
    // Upstream's way on the same state, same run: one save of the programmed node, and one
    // restore of the full payload into a fresh namespace (each may take minutes on nft).
    let in_ns = |ns: &Netns, script: &str| {
        std::process::Command::new("ip")
            .args(["netns", "exec", &ns.name, "timeout", &upstream_limit.as_secs().to_string(), "sh", "-c", script])
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    };
    let save_bin = format!("iptables-{}-save", backend.as_str());
    let t = Instant::now();
    let saved = in_ns(&node_ns, &format!("{save_bin} -t nat > /dev/null"));
    let save_time = t.elapsed();
    let save_note = if saved {
        format!("{:.1} s", save_time.as_secs_f64())
    } else {
        format!("failed or stopped after {:.1} s", save_time.as_secs_f64())
    };
    let payload = full_payload(&dir, shape);
    let body: String = payload.lines().filter(|l| !l.starts_with("# sync")).map(|l| format!("{l}\n")).collect();

    // The kernel's share of any partial sync (the daemon has stopped; its rules stay): one
    // rule added to a scratch nat chain, the smallest transaction that is not a no-op.
    let restore_bin = format!("iptables-{}-restore", backend.as_str());
    let floor = median_restore(&node_ns, &restore_bin, &dir, "floor", &floor_payloads());
    // Upstream's partial sync rewrites every top-level nat chain (KUBE-SERVICES: a rule per
    // service) besides the changed services' chains.
    let upstream_partial = median_restore(&node_ns, &restore_bin, &dir, "upstream-partial", &[top_level_nat(&body)]);
    eprintln!(
        "kernel floor, one-rule {restore_bin} --noflush into this table: median {:.3} s; upstream's partial sync (every top-level nat chain rewritten, {} bytes): median {:.3} s",
        floor.as_secs_f64(),
        top_level_nat(&body).len(),
        upstream_partial.as_secs_f64()
    );
    let fresh = Netns::create("bench-up");
    create_nfacct_objects(&fresh);
    let input = dir.path().join("payload");
    std::fs::write(&input, &body).expect("payload");
    let t = Instant::now();
    let restored = in_ns(&fresh, &format!("{restore_bin} --noflush < '{}'", input.display()));
    let restore_time = t.elapsed();
    let restore_note = if restored {
        format!("{:.1} s", restore_time.as_secs_f64())
    } else {
        format!("failed or stopped after {:.1} s (limit {} s)", restore_time.as_secs_f64(), upstream_limit.as_secs())
    };

    eprintln!(
        "upstream's way, same state: one {restore_bin} --noflush of the full payload ({} bytes): {restore_note}; one {save_bin} -t nat: {save_note}",
        body.len(),
    );
    assert_eq!(lat.len(), changes);
    assert_eq!(steady_reads, 0, "the nat table was read whole in steady state: {}", run.save_calls);
}
