//! UDP conntrack cleanup on a DNS-heavy node (issue 28): the real binary in a node namespace
//! against the test API server holding 50 DNS-style UDP Services × 10 endpoints and one TCP
//! Service, with the namespace's conntrack table loaded (`conntrack -R`) with UDP entries
//! spread evenly over every endpoint of every DNS Service.
//!
//! * `conntrack_regression_guard` (in the suite, 5000 entries): what must hold at any size,
//!   timing aside. Single endpoint changes and a rollout replacing all ten endpoints of one
//!   Service each delete exactly the stale entries (every entry answered by a removed
//!   endpoint, nothing else: the entries of the new endpoints, of the other Services and the
//!   unrelated ones stay), the network-programming latency is recorded per change, each
//!   cleanup is counted by the reconciler's metrics, and a TCP Service change made right
//!   after the rollout is programmed.
//! * `conntrack_benchmark` (ignored; run by hand, reported in docs/performance.md): the same
//!   at `KPR_CT_ENTRIES` (default 250000) with `KPR_CHANGES` single changes (default 20):
//!   per change the time to the rule in the kernel (the new endpoint's chain probed every
//!   10 ms), the latency metric the daemon recorded for it, and its cleanup's duration (the
//!   reconciler's histogram); the rollout's time to its rules, its cleanup's duration and
//!   exactness; the TCP change's time to the kernel while that cleanup runs. Then, on the
//!   same table in the same run, the primitives: one listing over netlink and with
//!   `conntrack -L`, one netlink batch deleting a rollout's stale entries, upstream's way
//!   (a listing, then a second dump deleting what its filters match) and the way before
//!   issue 28 (one `conntrack -D` per stale filter).
//!
//!       sudo KPR_CT_ENTRIES=250000 cargo nextest run --release \
//!           --run-ignored only -E 'test(conntrack_benchmark)' --no-capture

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::jiff::Timestamp;
use kube_proxy_rs::exec::RealExec;
use kube_proxy_rs::model::chains::endpoint_chain_name;
use kube_proxy_rs::model::{IpFamily, Protocol};
use kube_proxy_rs::node::conntrack::netlink::NetlinkConntrack;
use kube_proxy_rs::node::conntrack::{Conntrack, ConntrackEntry, ExecConntrack, FlowFilter};
use kube_proxy_rs::tracker::testing::{node, slice, svc};

use crate::require_root;
use crate::support::e2e::{DaemonProcess, METRICS_ADDR, TempDir, daemon_args, in_netns, topology};
use crate::support::netns::Netns;

const NODE: &str = "node-ct";
const SERVICES: usize = 50;
const ENDPOINTS: usize = 10;
const DNS_PORT: u16 = 53;
const TARGET_PORT: u16 = 5353;
const WEB_IP: &str = "198.18.101.1";
/// The Service the rollout replaces every endpoint of.
const ROLLOUT: usize = 7;

fn dns_ip(i: usize) -> String {
    format!("198.18.100.{}", i + 1)
}

fn endpoint_ip(i: usize, j: usize) -> String {
    format!("198.19.{i}.{}", j + 1)
}

fn dns_chain(i: usize, ip: &str) -> String {
    endpoint_chain_name(&format!("kube-system/dns-{i}:dns"), "udp", &format!("{ip}:{TARGET_PORT}"))
}

fn dns_slice(i: usize, ips: &[String]) -> EndpointSlice {
    let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
    slice("kube-system", &format!("dns-{i}"), &format!("dns-{i}-1"))
        .udp("dns", i32::from(TARGET_PORT))
        .ips(&ips)
        .annotation("endpoints.kubernetes.io/last-change-trigger-time", &Timestamp::now().to_string())
        .build()
}

fn web_slice(ip: &str) -> EndpointSlice {
    slice("ns1", "web", "web-1")
        .tcp("http", 8080)
        .ips(&[ip])
        .annotation("endpoints.kubernetes.io/last-change-trigger-time", &Timestamp::now().to_string())
        .build()
}

/// Writes UDP entries into the node's table with one `conntrack -R`; each client tuple is
/// unique (`next` numbers them across calls). `flows` are (service, endpoint IP, count).
struct Loader {
    next: usize,
    dir: std::path::PathBuf,
}

impl Loader {
    fn client(n: usize) -> (String, u16) {
        let block = n / 50_000;
        let within = n % 50_000;
        (format!("198.18.{}.{}", 200 + block, 1 + within % 200), 1024 + (within / 200) as u16)
    }

    fn load(&mut self, ns: &Netns, flows: &[(String, String, usize)]) {
        let mut text = String::new();
        for (dst, endpoint, count) in flows {
            for _ in 0..*count {
                let (src, sport) = Self::client(self.next);
                self.next += 1;
                text.push_str(&format!(
                    "-I -p udp -s {src} -d {dst} --sport {sport} --dport {DNS_PORT} --reply-src {endpoint} \
                     --reply-dst {src} --reply-port-src {TARGET_PORT} --reply-port-dst {sport} --timeout 3600 \
                     --dst-nat {endpoint}\n"
                ));
            }
        }
        let path = self.dir.join("entries");
        std::fs::write(&path, text).expect("write entries");
        let out = ns.run(&["conntrack", "-R", path.to_str().expect("path")]);
        assert!(out.success(), "conntrack -R: {}", out.combined());
    }
}

/// The daemon's metrics page.
fn metrics_text(ns: &Netns) -> String {
    in_netns(&ns.name, || {
        let mut s = std::net::TcpStream::connect_timeout(&METRICS_ADDR.parse().unwrap(), Duration::from_secs(2))
            .expect("metrics server");
        s.set_read_timeout(Some(Duration::from_secs(5))).ok();
        write!(s, "GET /metrics HTTP/1.0\r\nHost: {METRICS_ADDR}\r\n\r\n").expect("request");
        let mut text = String::new();
        s.read_to_string(&mut text).expect("response");
        text
    })
}

/// A sample of the IPv4 series of `name` (or the unlabelled one).
fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let value = match rest.strip_prefix('{') {
                Some(labelled) if labelled.contains("IPv4") => labelled.split_once("} ")?.1,
                Some(_) => return None,
                None => rest.strip_prefix(' ')?,
            };
            value.parse::<f64>().ok()
        })
        .sum()
}

/// What the metrics say about syncs and cleanups so far.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Counters {
    programming_count: f64,
    programming_sum: f64,
    cleanup_count: f64,
    cleanup_sum: f64,
    deleted: f64,
}

fn counters(ns: &Netns) -> Counters {
    let text = metrics_text(ns);
    Counters {
        programming_count: sample(&text, "kubeproxy_network_programming_duration_seconds_count"),
        programming_sum: sample(&text, "kubeproxy_network_programming_duration_seconds_sum"),
        cleanup_count: sample(&text, "kubeproxy_conntrack_reconciler_sync_duration_seconds_count"),
        cleanup_sum: sample(&text, "kubeproxy_conntrack_reconciler_sync_duration_seconds_sum"),
        deleted: sample(&text, "kubeproxy_conntrack_reconciler_deleted_entries_total"),
    }
}

fn chain_exists(ns: &Netns, chain: &str) -> bool {
    ns.run(&["nft", "list", "chain", "ip", "nat", chain]).success()
}

/// Waits until every chain exists; how long after `since`.
async fn wait_chains(ns: &Netns, chains: &[String], since: Instant, daemon: &DaemonProcess) -> Duration {
    loop {
        assert!(since.elapsed() < Duration::from_secs(60), "{chains:?} never programmed\n{}", daemon.log_text());
        if chains.iter().all(|c| chain_exists(ns, c)) {
            return since.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until the reconciler has finished `runs` runs; the counters then. (A scrape reads
/// the deleted-entries counter before the duration histogram, so a run that lands between
/// the two reads shows in the next scrape's counter: take the counters from a scrape after
/// the one that saw the run.)
async fn wait_cleanups(ns: &Netns, runs: f64, daemon: &DaemonProcess) -> Counters {
    let started = Instant::now();
    loop {
        if counters(ns).cleanup_count >= runs {
            return counters(ns);
        }
        assert!(started.elapsed() < Duration::from_secs(120), "cleanup {runs} never ran\n{}", daemon.log_text());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    percentile(&v, 50.0)
}

/// The table's UDP entries as (client, client port) keys.
fn table(ct: &NetlinkConntrack) -> BTreeSet<(IpAddr, u16, IpAddr)> {
    ct.list_entries(IpFamily::V4, Protocol::Udp)
        .expect("list")
        .into_iter()
        .map(|e| (e.orig_src, e.orig_sport, e.reply_src))
        .collect()
}

struct Run {
    entries: usize,
    /// Per single change: (to the kernel, metric, cleanup) in seconds.
    changes: Vec<(f64, f64, f64)>,
    rollout_in_kernel: f64,
    rollout_metric: f64,
    rollout_cleanup: f64,
    rollout_deleted: usize,
    tcp_in_kernel: f64,
    tcp_overlapped: bool,
}

/// Everything a run keeps alive; dropped daemon first, namespaces last.
struct Rig {
    daemon: DaemonProcess,
    _server: crate::support::apiserver::ApiServer,
    dir: TempDir,
    node_ns: Netns,
    _api_ns: Netns,
}

async fn run(entries_total: usize, changes: usize) -> (Run, Rig) {
    // The table is the host's (shared by every namespace): make room.
    let max: usize = std::fs::read_to_string("/proc/sys/net/netfilter/nf_conntrack_max")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    if max < entries_total * 2 + 100_000 {
        std::fs::write("/proc/sys/net/netfilter/nf_conntrack_max", (entries_total * 2 + 100_000).to_string())
            .expect("raise nf_conntrack_max");
    }
    let (api_ns, node_ns, server) = topology("ctb").await;
    let dir = TempDir::new("ctb");
    server.create(&node(NODE, &[], &["198.18.96.0/24"], &["198.18.20.2"]));
    for i in 0..SERVICES {
        server.create(&svc("kube-system", &format!("dns-{i}")).cluster_ip(&dns_ip(i)).udp("dns", 53).build());
        let ips: Vec<String> = (0..ENDPOINTS).map(|j| endpoint_ip(i, j)).collect();
        server.create(&dns_slice(i, &ips));
    }
    server.create(&svc("ns1", "web").cluster_ip(WEB_IP).tcp("http", 80).build());
    server.create(&web_slice("198.19.250.1"));

    // Entries spread evenly over every endpoint, plus unrelated UDP traffic.
    let per_endpoint = entries_total / (SERVICES * ENDPOINTS + 1);
    let mut loader = Loader { next: 0, dir: dir.path().to_path_buf() };
    let mut flows = Vec::new();
    for i in 0..SERVICES {
        for j in 0..ENDPOINTS {
            flows.push((dns_ip(i), endpoint_ip(i, j), per_endpoint));
        }
    }
    flows.push(("198.18.150.1".into(), "198.18.150.1".into(), per_endpoint));
    let loading = Instant::now();
    loader.load(&node_ns, &flows);
    eprintln!("loaded {} entries in {:.2?}", loader.next, loading.elapsed());

    node_ns.ok(&["iptables-nft", "-t", "mangle", "-N", "KUBE-KUBELET-CANARY"]);
    let mut args = daemon_args(&dir.kubeconfig(&server), NODE);
    args.extend(["--iptables-min-sync-period=1s".into(), "--iptables-sync-period=30s".into(), "--v=2".into()]);
    let daemon = DaemonProcess::start(&node_ns, &args, dir.path().join("daemon.log"), &[]);
    let started = Instant::now();
    let last = dns_chain(SERVICES - 1, &endpoint_ip(SERVICES - 1, ENDPOINTS - 1));
    wait_chains(&node_ns, &[last], started, &daemon).await;
    // The first sync's reconciliation (every endpoint is new: nothing stale).
    let mut seen = wait_cleanups(&node_ns, 1.0, &daemon).await;
    assert_eq!(seen.deleted, 0.0, "the first sync's cleanup deletes nothing");
    tokio::time::sleep(Duration::from_millis(1_200)).await;

    let ct = NetlinkConntrack::new(Arc::new(RealExec)).in_netns(node_ns.name.clone());
    let mut current: Vec<Vec<String>> =
        (0..SERVICES).map(|i| (0..ENDPOINTS).map(|j| endpoint_ip(i, j)).collect()).collect();
    let mut measured = Vec::new();
    for k in 0..changes {
        let i = (k * 7 + 3) % SERVICES;
        if i == ROLLOUT {
            continue;
        }
        let j = k % ENDPOINTS;
        let new_ip = format!("198.19.{}.{}", 100 + k / 200, 1 + k % 200);
        let old_ip = std::mem::replace(&mut current[i][j], new_ip.clone());
        let before = table(&ct);
        let changed = Instant::now();
        server.update(&dns_slice(i, &current[i]));
        let in_kernel = wait_chains(&node_ns, &[dns_chain(i, &new_ip)], changed, &daemon).await;
        let now = wait_cleanups(&node_ns, seen.cleanup_count + 1.0, &daemon).await;
        assert_eq!(now.programming_count, seen.programming_count + 1.0, "one latency observation per change");
        let one =
            (in_kernel.as_secs_f64(), now.programming_sum - seen.programming_sum, now.cleanup_sum - seen.cleanup_sum);
        eprintln!("change {k}: in the kernel {:.3} s, metric {:.3} s, cleanup {:.3} s", one.0, one.1, one.2);
        measured.push(one);
        // Exactly the old endpoint's entries went.
        let after = table(&ct);
        let old: IpAddr = old_ip.parse().unwrap();
        let want: BTreeSet<_> = before.iter().filter(|e| e.2 != old).copied().collect();
        assert_eq!(after.len(), want.len(), "change {k}: exactly the stale entries deleted");
        assert!(after == want, "change {k}: exactly the stale entries deleted");
        assert_eq!(now.deleted - seen.deleted, (before.len() - want.len()) as f64, "change {k}");
        // Clients re-resolve through the new endpoint: the table keeps its size.
        loader.load(&node_ns, &[(dns_ip(i), new_ip, per_endpoint)]);
        seen = now;
        tokio::time::sleep(Duration::from_millis(1_100)).await;
    }

    // The rollout: every endpoint of one Service replaced at once; a TCP change follows as
    // soon as its rules are in the kernel, while its cleanup runs.
    let before = table(&ct);
    let old: BTreeSet<IpAddr> = current[ROLLOUT].iter().map(|ip| ip.parse().unwrap()).collect();
    current[ROLLOUT] = (0..ENDPOINTS).map(|j| format!("198.19.{}.{}", 200 + ROLLOUT / 50, 1 + j)).collect();
    let chains: Vec<String> = current[ROLLOUT].iter().map(|ip| dns_chain(ROLLOUT, ip)).collect();
    let changed = Instant::now();
    server.update(&dns_slice(ROLLOUT, &current[ROLLOUT]));
    let rollout_in_kernel = wait_chains(&node_ns, &chains, changed, &daemon).await;
    // Its sync records the latency right after the restore (milliseconds after the probe).
    let recorded = loop {
        let c = counters(&node_ns);
        if c.programming_count > seen.programming_count {
            break c;
        }
        assert!(changed.elapsed() < Duration::from_secs(60), "{}", daemon.log_text());
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let cleanup_running_at_tcp = recorded.cleanup_count < seen.cleanup_count + 1.0;
    let tcp_changed = Instant::now();
    server.update(&web_slice("198.19.250.2"));
    let web_chain = endpoint_chain_name("ns1/web:http", "tcp", "198.19.250.2:8080");
    let tcp_in_kernel = wait_chains(&node_ns, &[web_chain], tcp_changed, &daemon).await;
    let now = wait_cleanups(&node_ns, seen.cleanup_count + 1.0, &daemon).await;
    let after = table(&ct);
    let want: BTreeSet<_> = before.iter().filter(|e| !old.contains(&e.2)).copied().collect();
    let rollout_deleted = before.len() - want.len();
    assert!(rollout_deleted > 0);
    assert!(after == want, "the rollout's cleanup deletes exactly the stale entries");
    assert_eq!(now.deleted - seen.deleted, rollout_deleted as f64);
    let run = Run {
        entries: loader.next,
        changes: measured,
        rollout_in_kernel: rollout_in_kernel.as_secs_f64(),
        rollout_metric: recorded.programming_sum - seen.programming_sum,
        rollout_cleanup: now.cleanup_sum - seen.cleanup_sum,
        rollout_deleted,
        tcp_in_kernel: tcp_in_kernel.as_secs_f64(),
        tcp_overlapped: cleanup_running_at_tcp,
    };
    (run, Rig { daemon, _server: server, dir, node_ns, _api_ns: api_ns })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conntrack_regression_guard() {
    require_root!();
    let (run, rig) = run(5_000, 3).await;
    let daemon = &rig.daemon;
    assert_eq!(run.changes.len(), 3);
    for (k, (in_kernel, metric, _)) in run.changes.iter().enumerate() {
        assert!(*metric > 0.0 && *in_kernel > 0.0, "change {k}: {in_kernel} {metric}");
    }
    assert_eq!(run.rollout_deleted, ENDPOINTS * (5_000 / (SERVICES * ENDPOINTS + 1)));
    let log = daemon.log_text();
    assert!(!log.contains("failed to delete stale conntrack entries"), "{log}");
    assert!(!log.contains("failed to list conntrack entries"), "{log}");
}

/// Times `f` `n` times; the median in seconds.
fn timed(n: usize, mut f: impl FnMut()) -> f64 {
    median(
        (0..n)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: run by hand (docs/performance.md)"]
async fn conntrack_benchmark() {
    require_root!();
    let entries: usize = std::env::var("KPR_CT_ENTRIES").ok().and_then(|v| v.parse().ok()).unwrap_or(250_000);
    let changes: usize = std::env::var("KPR_CHANGES").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
    let (run, rig) = run(entries, changes).await;
    let Rig { daemon, _server, dir, node_ns: ns, _api_ns } = rig;
    if let Ok(keep) = std::env::var("KPR_KEEP_LOG") {
        let _ = std::fs::write(&keep, daemon.log_text());
    }
    drop(daemon);

    let column = |f: fn(&(f64, f64, f64)) -> f64| {
        let mut v: Vec<f64> = run.changes.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        (percentile(&v, 50.0), percentile(&v, 99.0))
    };
    let (kernel50, kernel99) = column(|c| c.0);
    let (metric50, metric99) = column(|c| c.1);
    let (cleanup50, cleanup99) = column(|c| c.2);
    let gap = median(run.changes.iter().map(|c| c.1 - c.0).collect());
    eprintln!("== {} UDP entries, {} single changes ==", run.entries, run.changes.len());
    eprintln!("rule in the kernel      p50 {kernel50:.3} s  p99 {kernel99:.3} s");
    eprintln!(
        "latency metric          p50 {metric50:.3} s  p99 {metric99:.3} s  (metric - kernel, median {gap:+.3} s)"
    );
    eprintln!("cleanup (reconciler)    p50 {cleanup50:.3} s  p99 {cleanup99:.3} s");
    eprintln!(
        "rollout: rules in the kernel {:.3} s, metric {:.3} s, cleanup {:.3} s, {} entries deleted, exact",
        run.rollout_in_kernel, run.rollout_metric, run.rollout_cleanup, run.rollout_deleted
    );
    eprintln!(
        "TCP change right after the rollout: in the kernel {:.3} s (cleanup still running then: {})",
        run.tcp_in_kernel, run.tcp_overlapped
    );

    // The primitives on the same table.
    let netlink = NetlinkConntrack::new(Arc::new(RealExec)).in_netns(ns.name.clone());
    let tool = ExecConntrack::new(Arc::new(RealExec)).in_netns(ns.name.clone());
    let size = netlink.list_entries(IpFamily::V4, Protocol::Udp).expect("list").len();
    let list_netlink = timed(3, || drop(netlink.list_entries(IpFamily::V4, Protocol::Udp).expect("list")));
    let list_tool = timed(3, || drop(tool.list_entries(IpFamily::V4, Protocol::Udp).expect("conntrack -L")));
    // A rollout's worth of stale entries: ten endpoints of a Service that has none of them.
    let stale_service = "198.18.150.2".to_string();
    let gone: Vec<String> = (0..ENDPOINTS).map(|j| format!("198.19.240.{}", j + 1)).collect();
    let per_endpoint = entries / (SERVICES * ENDPOINTS + 1);
    let mut loader = Loader { next: run.entries, dir: dir.path().to_path_buf() };
    let stale_flows: Vec<_> = gone.iter().map(|ip| (stale_service.clone(), ip.clone(), per_endpoint)).collect();
    let filters: Vec<FlowFilter> = gone
        .iter()
        .map(|ip| FlowFilter {
            family: IpFamily::V4,
            protocol: Protocol::Udp,
            orig_dst: Some(stale_service.parse().unwrap()),
            orig_dport: DNS_PORT,
            reply_src: ip.parse().unwrap(),
            reply_sport: Some(TARGET_PORT),
        })
        .collect();
    let is_stale = |e: &ConntrackEntry| filters.iter().any(|f| f.matches(e));
    let mut ours = Vec::new();
    let mut upstream = Vec::new();
    let mut before = Vec::new();
    let mut batch = Vec::new();
    for _ in 0..3 {
        // Ours: one listing, one batch of exactly the stale entries.
        loader.load(&ns, &stale_flows);
        let t = Instant::now();
        let listed = netlink.list_entries(IpFamily::V4, Protocol::Udp).expect("list");
        let stale: Vec<_> = listed.into_iter().filter(|e| is_stale(e)).collect();
        let d = Instant::now();
        let out = netlink.delete_entries(IpFamily::V4, &stale).expect("batch");
        batch.push(d.elapsed().as_secs_f64());
        ours.push(t.elapsed().as_secs_f64());
        assert_eq!(out.deleted as usize, ENDPOINTS * per_endpoint);
        // Upstream's: a listing to decide the filters, then a second dump deleting what they
        // match (vishvananda/netlink's ConntrackDeleteFilters).
        loader.load(&ns, &stale_flows);
        let t = Instant::now();
        let listed = netlink.list_entries(IpFamily::V4, Protocol::Udp).expect("list");
        assert!(listed.iter().any(&is_stale));
        let dumped = netlink.dump(IpFamily::V4).expect("dump");
        let matched: Vec<_> = dumped.into_iter().filter(|e| is_stale(e)).collect();
        let out = netlink.delete_entries(IpFamily::V4, &matched).expect("batch");
        upstream.push(t.elapsed().as_secs_f64());
        assert_eq!(out.deleted as usize, ENDPOINTS * per_endpoint);
        // Before issue 28: `conntrack -L`, then one `conntrack -D` per filter.
        loader.load(&ns, &stale_flows);
        let t = Instant::now();
        let listed = tool.list_entries(IpFamily::V4, Protocol::Udp).expect("conntrack -L");
        assert!(listed.iter().any(&is_stale));
        let deleted: u64 = filters.iter().map(|f| tool.delete_flows(f).expect("conntrack -D")).sum();
        before.push(t.elapsed().as_secs_f64());
        assert_eq!(deleted as usize, ENDPOINTS * per_endpoint);
    }
    eprintln!("== primitives on the same table ({size} UDP entries; medians of 3) ==");
    eprintln!("one listing: netlink {list_netlink:.3} s, conntrack -L {list_tool:.3} s");
    eprintln!("one netlink batch deleting {} entries: {:.3} s", ENDPOINTS * per_endpoint, median(batch));
    eprintln!(
        "rollout cleanup, {} stale entries behind {} filters: ours (one listing + one batch) {:.3} s, \
         upstream's (listing + dump-and-delete) {:.3} s, before issue 28 (conntrack -L + one -D per filter) {:.3} s",
        ENDPOINTS * per_endpoint,
        filters.len(),
        median(ours),
        median(upstream),
        median(before)
    );
}
