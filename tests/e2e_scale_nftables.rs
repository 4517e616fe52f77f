//! nftables mode at scale, beside iptables mode (issue 27): the real binary in a node
//! namespace with `--proxy-mode=nftables` against the test API server holding N synthetic
//! services × M endpoints, measured as `e2e_scale` measures iptables mode.
//!
//! Every `nft` the daemon runs goes through a wrapper first on its PATH (the daemon runs
//! `nft` by name: `NftOptions::program`), which appends the call's arguments to a log.
//! Steady state is from the first full sync's completion through the last endpoint change:
//! a `list` there fails the test (the daemon must work from memory, not from listings).
//!
//! * `nftables_scale_regression_guard` (in the suite): 500 services × 10 endpoints. Every
//!   service and endpoint is programmed, single endpoint changes reach the kernel (one
//!   latency observation each: the daemon logs the sync that wrote it, then a probe of
//!   the service chain confirms it), the steady state writes over netlink and runs no `nft`
//!   at all (no listing, no `nft -f`), and
//!   the whole table replayed as upstream's full sync writes it (one transaction into a
//!   fresh namespace, the benchmark's reference below) lists back as the node's table.
//! * `scale_benchmark_both_modes` (ignored; run by hand, reported in docs/performance.md,
//!   "Daemon scale, both modes"): the same cluster in iptables mode (iptables-nft, as
//!   `e2e_scale::scale_benchmark` runs it) and in nftables mode, one after the other in one
//!   run, each in fresh namespaces: time from start to programmed, network-programming
//!   latency p50/p99 of `KPR_CHANGES` single endpoint changes, RSS (end and peak), the
//!   table reads in steady state; then, on the nftables node's programmed state (daemon
//!   stopped, rules left): upstream's way — one `nft -f` of the whole table as its full
//!   sync writes it into a fresh namespace (capped at `KPR_UPSTREAM_LIMIT` s), one
//!   `nft --json list table ip kube-proxy` (what upstream reads on every sync) — and the
//!   kernel's floors (a one-element transaction; a chain with one `goto` rule, which makes
//!   the kernel re-validate the table), medians of 9.
//!
//!       sudo KPR_SERVICES=10000 KPR_ENDPOINTS=10 cargo nextest run --release \
//!           --run-ignored only -E 'test(scale_benchmark_both_modes)' --no-capture
//!
//! Sizes: `KPR_SERVICES` (default 10000), `KPR_ENDPOINTS` (10), `KPR_CHANGES` (30),
//! `KPR_AFFINITY_EVERY` (every 7th service has ClientIP affinity; 0: none), `KPR_MODES`
//! (`both`, `iptables` or `nftables`), `KPR_UPSTREAM_LIMIT` (900 s), `KPR_PROGRAM_LIMIT`
//! (seconds to wait for the first sync; default 120 + services / 5).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kube_proxy_rs::exec::RealExec;
use kube_proxy_rs::model::{NamespacedName, Protocol, ServicePortName};
use kube_proxy_rs::nftables::table::ChainState;
use kube_proxy_rs::nftables::{
    Element, Family, NftOptions, NftRunner, Nftables, Operation, Rule, TableState, Transaction,
};
use kube_proxy_rs::proxier::nftables::names::{EndpointNames, ServicePortChains, is_affinity_set};
use kube_proxy_rs::synthetic::{self, ClusterShape};

use crate::e2e_scale::{self, ENDPOINTS, NODE, one_endpoint_changed, percentile};
use crate::require_root;
use crate::support::e2e::{DaemonProcess, TempDir, daemon_args, topology};
use crate::support::netns::Netns;

const TABLE: &str = "kube-proxy";

/// Service `i`'s port name, as the synthetic cluster names it.
fn service_port(i: usize) -> ServicePortName {
    ServicePortName::new(NamespacedName::new(format!("ns-{}", i % 100), format!("svc-{i}")), "http", Protocol::Tcp)
}

/// The endpoint chain of service `i`'s endpoint `ip` (target port 8080). From 1.36 only
/// services with ClientIP affinity have endpoint chains; the others DNAT through a map in
/// their service chain.
fn endpoint_chain(i: usize, ip: &str) -> String {
    EndpointNames::new(&service_port(i), ip, 8080).chain
}

/// Service `i`'s `service-…` chain (its Cluster-policy endpoints).
fn service_chain(i: usize) -> String {
    ServicePortChains::new(&service_port(i)).cluster
}

/// Whether a service chain's rules (as nft lists them) send traffic to endpoint `ip`: a
/// `goto` to its endpoint chain (whose name holds `__IP/PORT`) or an `IP . PORT` entry of
/// the DNAT map.
fn mentions_endpoint(rules: &str, ip: &str) -> bool {
    rules.contains(&format!("__{ip}/8080")) || rules.contains(&format!("{ip} . 8080"))
}

/// Whether service `i`'s chain in `ns` sends traffic to endpoint `ip` (one chain is listed,
/// not the table; the probe's own `nft` is not the daemon's, so the wrapper does not log it).
/// No time limit: nft builds its cache of the whole table first, over a minute at 10k on a
/// loaded machine.
fn endpoint_programmed(ns: &Netns, i: usize, ip: &str) -> bool {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", &ns.name, "nft", "list", "chain", "ip", TABLE, &service_chain(i)])
        .output()
        .expect("run nft");
    out.status.success() && mentions_endpoint(&String::from_utf8_lossy(&out.stdout), ip)
}

/// An `nft` wrapper in `bin` that appends `nft ARGS` to `log` and runs the real one.
fn logging_nft_wrapper(bin: &Path, log: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(bin).expect("wrapper dir");
    let script = format!("#!/bin/sh\necho \"nft $*\" >> '{}'\nexec /usr/sbin/nft \"$@\"\n", log.display());
    let path = bin.join("nft");
    std::fs::write(&path, script).expect("write wrapper");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod wrapper");
}

/// The calls that read a table or ruleset (`nft … list …`).
fn listings(calls: &str) -> Vec<&str> {
    calls.lines().filter(|l| l.split_whitespace().any(|w| w == "list")).collect()
}

/// The calls that write a transaction (`nft -f -`, not `--check`).
fn writes(calls: &str) -> usize {
    calls.lines().filter(|l| l.contains("-f") && !l.contains("--check")).count()
}

/// One IPv4 sync as the daemon logged it at `-v 2` (`sync complete full=… elapsed_ms=…`).
#[derive(Debug, Clone, Copy)]
struct NftSync {
    full: bool,
    elapsed_ms: u64,
    /// Service ports the sync computed (its `reloading service nftables data` line): 0 for
    /// a periodic sync with nothing to do.
    computed: u64,
}

fn field(line: &str, name: &str) -> Option<u64> {
    let at = line.find(&format!("{name}="))? + name.len() + 1;
    line[at..].split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

/// The IPv4 family's completed syncs (the IPv6 proxier logs its own, of an empty cluster).
fn v4_syncs(log: &str) -> Vec<NftSync> {
    let mut computed = 0;
    let mut syncs = Vec::new();
    for l in log.lines().filter(|l| l.contains("family=IPv4")) {
        if l.contains("reloading service nftables data") {
            computed = field(l, "services_computed").unwrap_or(0);
        } else if l.contains("sync complete")
            && let Some(elapsed_ms) = field(l, "elapsed_ms")
        {
            syncs.push(NftSync { full: l.contains("full=true"), elapsed_ms, computed });
            computed = 0;
        }
    }
    syncs
}

/// How many IPv4 syncs after the first `from` wrote a change (a service port computed).
fn changes_synced(log: &str, from: usize) -> usize {
    v4_syncs(log).iter().skip(from).filter(|s| s.computed > 0).count()
}

/// The operations of the IPv4 family's full syncs (`reloading service nftables data`).
fn v4_full_sync_operations(log: &str) -> Vec<u64> {
    log.lines()
        .filter(|l| l.contains("reloading service nftables data") && l.contains("family=IPv4"))
        .filter(|l| l.contains("full=true"))
        .filter_map(|l| field(l, "operations"))
        .collect()
}

struct NftScaleRun {
    programmed: Duration,
    latencies: Vec<Duration>,
    probe: Duration,
    peak_rss_kb: u64,
    rss_kb: u64,
    log: String,
    /// Every `nft` the daemon ran, and those up to the end of the first full sync (the
    /// log only grows, so the steady state's calls are the rest).
    calls: String,
    calls_at_start: String,
    /// The changes made: (service, endpoint IP), each put back since.
    changed: Vec<(usize, String)>,
}

impl NftScaleRun {
    fn steady_calls(&self) -> &str {
        self.calls.strip_prefix(self.calls_at_start.as_str()).unwrap_or(&self.calls)
    }
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Starts the daemon in nftables mode on a cluster of `shape`, waits until the IPv4 table
/// is programmed (its first full sync logged complete, the last service's chain there),
/// then makes `changes` single endpoint changes one at a time, each waited for in the
/// kernel (the service chain probed every 10 ms until it sends to the new endpoint) and
/// put back.
async fn run_nft_daemon(
    node_ns: &Netns,
    server: &crate::support::apiserver::ApiServer,
    dir: &TempDir,
    shape: ClusterShape,
    changes: usize,
) -> NftScaleRun {
    let (services, per) = (shape.services, shape.endpoints_per_service);
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
    drop(cluster);

    let bin = dir.path().join("bin");
    let calls_log = dir.path().join("nft-calls");
    logging_nft_wrapper(&bin, &calls_log);
    let path = format!("{}:/usr/sbin:/usr/bin:/sbin:/bin", bin.display());
    let mut args = daemon_args(&dir.kubeconfig(server), NODE);
    args.extend(["--proxy-mode=nftables".into(), "--v=2".into()]);
    let started = Instant::now();
    // As the DaemonSet runs it (deploy/kube-proxy-rs.yaml).
    let env = [("PATH", path.as_str()), ("MALLOC_MMAP_THRESHOLD_", "131072")];
    let mut daemon = DaemonProcess::start(node_ns, &args, dir.path().join("daemon.log"), &env);
    let pid = daemon.pid();

    let last = services - 1;
    let last_ip = synthetic::slice(last, per, 0).endpoints[0].addresses[0].clone();
    let limit = Duration::from_secs(env_usize("KPR_PROGRAM_LIMIT", 120 + services / 5) as u64);
    // The proxier syncs only once Services and EndpointSlices were listed, so its first
    // full sync writes the whole cluster.
    while !v4_syncs(&daemon.log_text()).iter().any(|s| s.full) {
        let exited = daemon.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
        assert!(exited.is_none(), "the daemon exited ({exited:?})\n{}", daemon.log_text());
        assert!(started.elapsed() < limit, "not programmed within {limit:?}\n{}", daemon.log_text());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let programmed = started.elapsed();
    assert!(endpoint_programmed(node_ns, last, &last_ip), "the last service is programmed\n{}", daemon.log_text());
    // Let the first sync's follow-ups settle before measuring single changes.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let calls_at_start = std::fs::read_to_string(&calls_log).unwrap_or_default();
    let probe_start = Instant::now();
    assert!(endpoint_programmed(node_ns, last, &last_ip));
    let probe = probe_start.elapsed();

    let mut latencies = Vec::new();
    let mut changed = Vec::new();
    for k in 0..changes {
        let i = (k * 7919) % services;
        let (slice, ip) = one_endpoint_changed(i, per, k);
        let before = v4_syncs(&daemon.log_text()).len();
        let written = Instant::now();
        server.update(&slice);
        // Programmed once the daemon logs the sync that wrote it complete (its batch has
        // returned: the kernel committed it), then confirmed by one probe. The log is read
        // every 10 ms; probing instead would time nft's listing (0.7 s a probe at 1k).
        loop {
            assert!(written.elapsed() < Duration::from_secs(120), "change {k} never programmed\n{}", daemon.log_text());
            let seen = changes_synced(&daemon.log_text(), before) > 0;
            let at = written.elapsed();
            if seen {
                // Confirmed by a probe while probes are cheap (the guard's size); at scale a
                // probe costs more than the stream's pacing allows.
                if probe < Duration::from_secs(1) {
                    assert!(endpoint_programmed(node_ns, i, &ip), "change {k} synced but not in the kernel");
                }
                latencies.push(at);
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        changed.push((i, ip));
        // Put it back (also a change), wait until that is synced too, and let minSyncPeriod
        // pass, so every change arrives alone at an idle proxier.
        server.update(&synthetic::slice(i, per, 0));
        let put_back = Instant::now();
        while changes_synced(&daemon.log_text(), before) < 2 {
            assert!(put_back.elapsed() < Duration::from_secs(120), "put-back {k} never synced\n{}", daemon.log_text());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(1_200)).await;
    }
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let status_kb = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    let (peak_rss_kb, rss_kb) = (status_kb("VmHWM:"), status_kb("VmRSS:"));
    let calls = std::fs::read_to_string(&calls_log).unwrap_or_default();
    let log = daemon.log_text();
    drop(daemon);
    if let Ok(keep) = std::env::var("KPR_KEEP_LOG") {
        let _ = std::fs::write(format!("{keep}.nftables"), &log);
    }
    NftScaleRun { programmed, latencies, probe, peak_rss_kb, rss_kb, log, calls, calls_at_start, changed }
}

/// The real `nft` for the `ip` family inside `ns`.
fn runner_in(ns: &Netns) -> NftRunner {
    let options =
        NftOptions { netns: Some(ns.name.clone()), command_timeout: Duration::from_secs(900), ..NftOptions::default() };
    NftRunner::new(Arc::new(RealExec), Family::Ip, options).unwrap_or_else(|e| panic!("{e}"))
}

/// `ns`'s `ip kube-proxy` table as the daemon's full sync reads it (`nft -s -y -T list
/// table`, parsed), and how long that took.
fn listed_table(ns: &Netns) -> (TableState, Duration) {
    let runner = runner_in(ns);
    let t = Instant::now();
    let table = runner.list_table().unwrap_or_else(|e| panic!("{e}")).expect("the table exists");
    (table, t.elapsed())
}

/// The service port a per-service chain or affinity set belongs to (`ns/name/proto/port`
/// of `PREFIX-HASH-ns/name/proto/port[__ip/port]`); none for the fixed objects.
fn service_key(name: &str) -> Option<&str> {
    if !name.contains('/') {
        return None;
    }
    let (_prefix, rest) = name.split_once('-')?;
    let (_hash, rest) = rest.split_once('-')?;
    Some(rest.split("__").next().unwrap_or(rest))
}

/// The chain a map element's verdict goes to (`goto X` / `jump X`).
fn verdict_target(element_value: &[String]) -> Option<&str> {
    let [value] = element_value else { return None };
    value.strip_prefix("goto ").or_else(|| value.strip_prefix("jump "))
}

/// `table` written the way upstream's full sync writes a whole table, in one transaction:
/// the table; the fixed chains (base chains first) and sets and maps, each added and
/// flushed (`setupNFTables`); the fixed chains' rules; then service port by service port
/// its chains (added and flushed: `ensureChain`), affinity sets, the map elements that go
/// to its chains and its rules; then the remaining elements. Upstream walks its service
/// map in Go's random order; here service ports come sorted.
fn upstream_full_sync(table: &TableState) -> Transaction {
    let mut tx = Transaction::new();
    tx.push(Operation::AddTable);
    let mut fixed: Vec<&ChainState> = table.chains.values().filter(|c| service_key(&c.chain.name).is_none()).collect();
    fixed.sort_by_key(|c| c.chain.base.is_none());
    for c in &fixed {
        tx.push(Operation::AddChain(c.chain.clone()));
        tx.push(Operation::FlushChain(c.chain.name.clone()));
    }
    for s in table.sets.values().filter(|s| !is_affinity_set(&s.set.name)) {
        tx.push(Operation::AddSet(s.set.clone()));
        tx.push(Operation::FlushSet { kind: s.set.kind, name: s.set.name.clone() });
    }
    for name in &table.counters {
        tx.push(Operation::AddCounter(name.clone()));
    }
    let rules_of = |tx: &mut Transaction, c: &ChainState| {
        for (text, comment) in &c.rules {
            tx.push(Operation::AddRule(Rule {
                chain: c.chain.name.clone(),
                text: text.clone(),
                comment: comment.clone(),
            }));
        }
    };
    for c in &fixed {
        rules_of(&mut tx, c);
    }

    #[derive(Default)]
    struct Group<'a> {
        chains: Vec<&'a ChainState>,
        affinity: Vec<&'a kube_proxy_rs::nftables::Set>,
        elements: Vec<Element>,
    }
    let mut groups: BTreeMap<&str, Group<'_>> = BTreeMap::new();
    for c in table.chains.values() {
        if let Some(key) = service_key(&c.chain.name) {
            groups.entry(key).or_default().chains.push(c);
        }
    }
    let mut rest = Vec::new();
    for s in table.sets.values() {
        if is_affinity_set(&s.set.name)
            && let Some(key) = service_key(&s.set.name)
        {
            groups.entry(key).or_default().affinity.push(&s.set);
        }
        for e in s.elements.values() {
            let element = Element {
                kind: s.set.kind,
                set: s.set.name.clone(),
                key: e.key.clone(),
                value: e.value.clone(),
                comment: e.comment.clone(),
            };
            match verdict_target(&e.value).and_then(service_key).and_then(|k| groups.get_mut(k)) {
                Some(group) => group.elements.push(element),
                None => rest.push(element),
            }
        }
    }
    for group in groups.values() {
        for c in &group.chains {
            tx.push(Operation::AddChain(c.chain.clone()));
            tx.push(Operation::FlushChain(c.chain.name.clone()));
        }
        for s in &group.affinity {
            tx.push(Operation::AddSet((*s).clone()));
        }
        for e in &group.elements {
            tx.push(Operation::AddElement(e.clone()));
        }
        for c in &group.chains {
            rules_of(&mut tx, c);
        }
    }
    for e in rest {
        tx.push(Operation::AddElement(e));
    }
    tx
}

/// Runs `script` with `sh -c` inside `ns`, killed after `limit`; whether it succeeded and
/// how long it took.
fn timed_in(ns: &Netns, script: &str, limit: Duration) -> (bool, Duration) {
    let t = Instant::now();
    let ok = std::process::Command::new("ip")
        .args(["netns", "exec", &ns.name, "timeout", &limit.as_secs().to_string(), "sh", "-c", script])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    (ok, t.elapsed())
}

/// The median time of `repeats` runs of `nft -f` with `add` (each undone, untimed, by
/// `undo`) in `ns`.
fn median_nft(ns: &Netns, dir: &TempDir, name: &str, add: &str, undo: &str, repeats: usize) -> Duration {
    let (add_file, undo_file) = (dir.path().join(format!("{name}-add")), dir.path().join(format!("{name}-undo")));
    std::fs::write(&add_file, add).expect("write");
    std::fs::write(&undo_file, undo).expect("write");
    let mut times = Vec::new();
    for _ in 0..repeats {
        let (ok, took) = timed_in(ns, &format!("nft -f '{}'", add_file.display()), Duration::from_secs(600));
        assert!(ok, "{name}: nft -f of {add:?} failed");
        times.push(took);
        let (ok, _) = timed_in(ns, &format!("nft -f '{}'", undo_file.display()), Duration::from_secs(600));
        assert!(ok, "{name}: nft -f of {undo:?} failed");
    }
    times.sort();
    times[times.len() / 2]
}

/// Upstream's way and the kernel's floors on the programmed state of `node_ns` (its
/// daemon stopped).
struct OnTheSameState {
    table_counts: (usize, usize, usize, usize),
    /// The daemon's own start-up read: `nft -s -y -T list table` and its parsing.
    listed_in: Duration,
    /// Upstream's full sync: operations, bytes, outcome, time.
    full_ops: usize,
    full_bytes: usize,
    full_ok: bool,
    full_time: Duration,
    /// The replayed table lists as the node's (only when the replay finished).
    full_same_table: Option<bool>,
    json_ok: bool,
    json_time: Duration,
    json_bytes: u64,
    element_floor: Duration,
    chain_floor: Duration,
}

fn on_the_same_state(node_ns: &Netns, dir: &TempDir, limit: Duration) -> (OnTheSameState, TableState) {
    let (table, listed_in) = listed_table(node_ns);
    let json_out = dir.path().join("table.json");
    let (json_ok, json_time) =
        timed_in(node_ns, &format!("nft --json list table ip {TABLE} > '{}'", json_out.display()), limit);
    let json_bytes = std::fs::metadata(&json_out).map(|m| m.len()).unwrap_or(0);

    assert!(table.sets.contains_key("cluster-ips"), "the table has the cluster-ips set");
    let element = |verb: &str| format!("{verb} element ip {TABLE} cluster-ips {{ 203.0.113.250 }}\n");
    let element_floor = median_nft(node_ns, dir, "element-floor", &element("add"), &element("delete"), 9);
    let chain_floor = median_nft(
        node_ns,
        dir,
        "chain-floor",
        &format!("add chain ip {TABLE} kpr-floor\nadd rule ip {TABLE} kpr-floor goto masquerading\n"),
        &format!("delete chain ip {TABLE} kpr-floor\n"),
        9,
    );

    let tx = upstream_full_sync(&table);
    let text = tx.text(Family::Ip, true);
    let input = dir.path().join("upstream-full-sync.nft");
    std::fs::write(&input, &text).expect("write the full sync");
    let fresh = Netns::create("nft-up");
    let (full_ok, full_time) = timed_in(&fresh, &format!("nft -f '{}'", input.display()), limit);
    let full_same_table = full_ok.then(|| listed_table(&fresh).0 == table);
    let result = OnTheSameState {
        table_counts: table.counts(),
        listed_in,
        full_ops: tx.len(),
        full_bytes: text.len(),
        full_ok,
        full_time,
        full_same_table,
        json_ok,
        json_time,
        json_bytes,
        element_floor,
        chain_floor,
    };
    (result, table)
}

fn secs(d: Duration) -> String {
    format!("{:.3} s", d.as_secs_f64())
}

fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nftables_scale_regression_guard() {
    require_root!();
    let shape = ClusterShape::new(500, ENDPOINTS);
    let changes = 3;
    let (_api_ns, node_ns, server) = topology("nftscale").await;
    let dir = TempDir::new("nftscale");
    let run = run_nft_daemon(&node_ns, &server, &dir, shape, changes).await;
    assert!(run.log.contains("mode=nftables"), "{}", run.log);

    // The wrapper saw the daemon's nft: the start-up full sync reads the table once (it
    // adopts what is there). In steady state every change and put-back is written over
    // netlink (the writer encodes every per-service form), so no nft runs at all: neither a
    // listing nor a write.
    assert!(!listings(&run.calls_at_start).is_empty(), "the wrapper logged the start-up listing: {}", run.calls);
    let steady = run.steady_calls();
    assert!(listings(steady).is_empty(), "nft listed in steady state: {:?}", listings(steady));
    assert_eq!(writes(steady), 0, "a steady-state transaction went to nft, not over netlink: {steady}");
    assert_eq!(run.latencies.len(), changes);
    let syncs = v4_syncs(&run.log);
    assert!(syncs.iter().filter(|s| !s.full).count() >= 2 * changes, "partial syncs logged: {syncs:?}");

    // Every service and endpoint of the cluster (each change was put back) is programmed.
    let (table, _) = listed_table(&node_ns);
    let cluster = synthetic::cluster(shape);
    let cluster_ips = &table.sets["cluster-ips"].elements;
    let rules_text = |chain: &str| -> String {
        table
            .chains
            .get(chain)
            .map(|c| c.rules.iter().map(|(text, _)| format!("{text}\n")).collect())
            .unwrap_or_default()
    };
    for (i, (svc, slice)) in cluster.services.iter().zip(&cluster.slices).enumerate() {
        let rules = rules_text(&service_chain(i));
        let ip = svc.spec.as_ref().and_then(|s| s.cluster_ip.clone()).expect("cluster IP");
        assert!(cluster_ips.contains_key(&ip), "cluster-ips holds {ip}");
        let affinity = svc.spec.as_ref().and_then(|s| s.session_affinity.as_deref()) == Some("ClientIP");
        for ep in &slice.endpoints {
            let ep_ip = &ep.addresses[0];
            assert!(mentions_endpoint(&rules, ep_ip), "service {i} sends to {ep_ip}: {rules}");
            if affinity {
                let chain = endpoint_chain(i, ep_ip);
                assert!(!rules_text(&chain).is_empty(), "{chain} is programmed");
            }
        }
    }
    // The changes were put back: their endpoints are gone from the service chains (an
    // affinity service's endpoint chain is left flushed, then deleted a sync later).
    for (i, ip) in &run.changed {
        assert!(!mentions_endpoint(&rules_text(&service_chain(*i)), ip), "service {i} no longer sends to {ip}");
        assert!(rules_text(&endpoint_chain(*i, ip)).is_empty(), "endpoint chain of {ip} flushed or deleted");
    }

    // The benchmark's reference: the table written as upstream's full sync writes it, in
    // one transaction into a fresh namespace, lists back as the node's table.
    let tx = upstream_full_sync(&table);
    let fresh = Netns::create("nftscale-ref");
    let out = fresh.run_with_stdin(&["nft", "-f", "-"], &tx.text(Family::Ip, true));
    assert!(out.success(), "upstream-style full sync: {}", out.combined());
    let (replayed, _) = listed_table(&fresh);
    if replayed != table {
        let (a, b) = (table.dump(Family::Ip), replayed.dump(Family::Ip));
        let diff = crate::support::line_diff(&a, &b);
        let changed: Vec<&str> = diff.lines().filter(|l| !l.starts_with(' ')).take(40).collect();
        panic!("the replayed table differs (- node, + replayed):\n{}", changed.join("\n"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run by hand, reported in docs/performance.md"]
async fn scale_benchmark_both_modes() {
    require_root!();
    let services = env_usize("KPR_SERVICES", 10_000);
    let per = env_usize("KPR_ENDPOINTS", ENDPOINTS);
    let changes = env_usize("KPR_CHANGES", 30);
    let upstream_limit = Duration::from_secs(env_usize("KPR_UPSTREAM_LIMIT", 900) as u64);
    let modes = std::env::var("KPR_MODES").unwrap_or_else(|_| "both".into());
    let mut shape = ClusterShape::new(services, per);
    shape.affinity_every = env_usize("KPR_AFFINITY_EVERY", ClusterShape::DEFAULT_AFFINITY_EVERY);
    let affinity = match shape.affinity_every {
        0 => "no session affinity".to_string(),
        n => format!("ClientIP affinity on every {n}th service"),
    };
    eprintln!("== daemon scale, both modes: {services} services x {per} endpoints, {affinity}, {changes} changes ==");
    let mut rows: Vec<(String, String, String, String)> = Vec::new();
    let mut row = |what: &str, ipt: String, nft: String, upstream: String| {
        eprintln!("{what}: iptables {ipt} | nftables {nft} | upstream's way {upstream}");
        rows.push((what.to_string(), ipt, nft, upstream));
    };
    let lat_summary = |latencies: &[Duration]| {
        let mut lat = latencies.to_vec();
        lat.sort();
        format!(
            "{:.3} / {:.3} s (max {:.3} s)",
            percentile(&lat, 50.0).as_secs_f64(),
            percentile(&lat, 99.0).as_secs_f64(),
            lat.last().copied().unwrap_or_default().as_secs_f64()
        )
    };
    let mb = |kb: u64| format!("{:.1}", kb as f64 / 1024.0);

    let ipt = if modes != "nftables" {
        let (_api_ns, node_ns, server) = topology("bench-ipt").await;
        let dir = TempDir::new("bench-ipt");
        let run = e2e_scale::run_daemon(
            &node_ns,
            &server,
            &dir,
            kube_proxy_rs::iptables::runner::Backend::Nft,
            shape,
            changes,
        )
        .await;
        assert_eq!(run.latencies.len(), changes);
        Some(run)
    } else {
        None
    };
    let nft = if modes != "iptables" {
        let (_api_ns, node_ns, server) = topology("bench-nft").await;
        let dir = TempDir::new("bench-nft");
        let run = run_nft_daemon(&node_ns, &server, &dir, shape, changes).await;
        let same = on_the_same_state(&node_ns, &dir, upstream_limit).0;
        Some((run, same))
    } else {
        None
    };

    let dash = || "–".to_string();
    let ipt_phases = ipt.as_ref().map(|r| e2e_scale::sync_phases(&r.log)).unwrap_or_default();
    let ipt_full = ipt_phases.iter().filter(|p| p.full).max_by_key(|p| p.bytes).copied();
    let ipt_partial: Vec<u64> = ipt_phases.iter().filter(|p| !p.full).map(|p| p.elapsed).collect();
    let nft_syncs = nft.as_ref().map(|(r, _)| v4_syncs(&r.log)).unwrap_or_default();
    let nft_full = nft_syncs.iter().find(|s| s.full).copied();
    let nft_partial: Vec<u64> = nft_syncs.iter().filter(|s| !s.full).map(|s| s.elapsed_ms).collect();
    let nft_ops = nft.as_ref().and_then(|(r, _)| v4_full_sync_operations(&r.log).first().copied());

    row(
        "start to programmed",
        ipt.as_ref().map_or_else(dash, |r| format!("{:.1} s", r.programmed.as_secs_f64())),
        nft.as_ref().map_or_else(dash, |(r, _)| format!("{:.1} s", r.programmed.as_secs_f64())),
        nft.as_ref().map_or_else(dash, |(_, s)| {
            let outcome = if s.full_ok {
                format!("{:.1} s", s.full_time.as_secs_f64())
            } else {
                format!("failed or stopped after {:.1} s", s.full_time.as_secs_f64())
            };
            format!(
                "one `nft -f` of the whole table ({} ops, {:.1} MB): {outcome}",
                s.full_ops,
                s.full_bytes as f64 / 1e6
            )
        }),
    );
    row(
        "first full sync (daemon's log)",
        ipt_full.map_or_else(dash, |p| format!("{} ms ({} bytes restored)", p.elapsed, p.bytes)),
        nft_full.map_or_else(dash, |s| format!("{} ms ({} operations)", s.elapsed_ms, nft_ops.unwrap_or(0))),
        dash(),
    );
    row(
        "partial sync, median (max)",
        ipt.as_ref().map_or_else(dash, |_| {
            format!(
                "{} ms ({} ms), {} syncs",
                median(ipt_partial.clone()),
                ipt_partial.iter().max().unwrap_or(&0),
                ipt_partial.len()
            )
        }),
        nft.as_ref().map_or_else(dash, |_| {
            format!(
                "{} ms ({} ms), {} syncs",
                median(nft_partial.clone()),
                nft_partial.iter().max().unwrap_or(&0),
                nft_partial.len()
            )
        }),
        dash(),
    );
    row(
        "network-programming latency p50 / p99",
        ipt.as_ref().map_or_else(dash, |r| format!("{}; probe {}", lat_summary(&r.latencies), secs(r.probe))),
        nft.as_ref().map_or_else(dash, |(r, _)| format!("{}; probe {}", lat_summary(&r.latencies), secs(r.probe))),
        dash(),
    );
    row(
        "RSS end / peak (MB)",
        ipt.as_ref().map_or_else(dash, |r| format!("{} / {}", mb(r.rss_kb), mb(r.peak_rss_kb))),
        nft.as_ref().map_or_else(dash, |(r, _)| format!("{} / {}", mb(r.rss_kb), mb(r.peak_rss_kb))),
        dash(),
    );
    let ipt_steady_reads = ipt.as_ref().map(|r| {
        let steady = r.save_calls.strip_prefix(r.save_calls_at_start.as_str()).unwrap_or(&r.save_calls);
        e2e_scale::nat_reads(steady).len()
    });
    let nft_steady_lists = nft.as_ref().map(|(r, _)| listings(r.steady_calls()).len());
    row(
        "table reads in steady state",
        ipt_steady_reads.map_or_else(dash, |n| format!("{n} `iptables-save`")),
        nft.as_ref().map_or_else(dash, |(r, _)| {
            format!(
                "{} `nft list` ({} at start-up; {} `nft -f` in steady state)",
                listings(r.steady_calls()).len(),
                listings(&r.calls_at_start).len(),
                writes(r.steady_calls())
            )
        }),
        nft.as_ref().map_or_else(dash, |(_, s)| {
            let outcome = if s.json_ok { secs(s.json_time) } else { format!("failed after {}", secs(s.json_time)) };
            format!(
                "one `nft --json list table ip kube-proxy` every sync: {outcome} ({:.1} MB)",
                s.json_bytes as f64 / 1e6
            )
        }),
    );
    if let Some((_, s)) = &nft {
        let (chains, rules, sets, elements) = s.table_counts;
        row(
            "nftables table",
            dash(),
            format!(
                "{chains} chains, {rules} rules, {sets} sets/maps, {elements} elements; listed and parsed in {}",
                secs(s.listed_in)
            ),
            format!("replayed table lists as the node's: {:?}", s.full_same_table),
        );
        row(
            "kernel floor (median of 9 `nft -f`)",
            dash(),
            format!(
                "one element {}; one chain + `goto` rule (re-validation) {}",
                secs(s.element_floor),
                secs(s.chain_floor)
            ),
            "same floor".into(),
        );
    }
    eprintln!();
    eprintln!(
        "| {services} × {per} | iptables mode (iptables-nft) | nftables mode | upstream's way, nftables (same state) |"
    );
    eprintln!("|---|---|---|---|");
    for (what, a, b, c) in &rows {
        eprintln!("| {what} | {a} | {b} | {c} |");
    }
    if let Some(n) = ipt_steady_reads {
        assert_eq!(n, 0, "iptables mode read the nat table in steady state");
    }
    if let Some(n) = nft_steady_lists {
        assert_eq!(
            n,
            0,
            "nftables mode listed in steady state: {:?}",
            nft.as_ref().map(|(r, _)| listings(r.steady_calls()))
        );
    }
    if let Some((r, s)) = &nft {
        assert_eq!(r.latencies.len(), changes);
        assert_ne!(s.full_same_table, Some(false), "the replayed full sync lists as the node's table");
    }
}
