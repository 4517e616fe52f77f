//! The nftables proxier at scale, without a kernel: N synthetic services × M endpoints go
//! through the trackers into an `NftablesProxier` whose "kernel" keeps the table in memory
//! (`FakeNftables`, `--fake`) or only counts what it is sent (default, so the heap figures are
//! the proxier's alone). Every transaction's `nft -f` text is made (`Transaction::text`, as
//! the kernel runner makes it) and measured inside the timed sync; with `--fake` the fake's
//! applying (a copy of the whole table per transaction, for atomicity) is inside it too.
//!
//!     cargo run --release --example nft_scale -- 5000 50 [--release 1.35] [--fake | --kernel] [--runs 3] [--partials 9] [--chunk OPS] [--affinity-every K] [--upstream] [--nft-only] [--kernel-names] [--set-floor-only] [--floor-writer nft|netlink|both]
//!
//! `--kernel` (root): the daemon's writer ([`NetlinkNftables`]: netlink batches for what it
//! encodes, the [`NftRunner`] for the rest; `--nft-only`: the runner alone; `--kernel-names`:
//! the writer names anonymous maps `__map%d` as nft does, for comparison) in a network
//! namespace this program creates for each run and deletes (also on a panic; a kill leaves
//! `kprs-nft-scale-PID-RUN` to `ip netns del`). Each kernel run also measures the floor on the
//! table the first sync wrote: one transaction adding one chain and one `goto` rule, by
//! `nft -f` and over netlink (median of `--partials` each), so the syncs can be read against
//! what any transaction costs.
//! `--chunk OPS` sets the proxier's chunk size for full syncs (`with_chunk_operations`).
//! `--affinity-every K`: session affinity on every K-th Service (default 7; 0: none).
//! `--upstream` (with `--kernel`): each run also writes the same cluster's first sync as
//! upstream's full sync writes it ([`upstream_first_sync`]: one transaction, upstream's order)
//! with one `nft -f` into a fresh namespace, timed, so the two can be compared in one run;
//! and the kernel's floor for that many sets ([`set_floor`], through nft and through the
//! netlink writer; `--floor-writer` picks one). `--set-floor-only`: that floor alone (no
//! proxier run).
//! The load averages are printed around the first sync (the machine may be shared).
//!
//! Each run (a fresh proxier): the first (full) sync; `--partials` one-endpoint changes (one
//! endpoint of one Service gets another address; one partial sync each); a forced full sync
//! against the table (with `--fake`: the table as listed, so nothing should be sent; without:
//! no table, so everything is; with `--kernel`: the table as the kernel lists it). Prints each run, then the medians over the runs (a run's
//! partial figure is the median of its partial syncs).

// An example reports on stdout.
#![allow(clippy::print_stdout)]

use std::alloc;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cap::Cap;
use kube_proxy_rs::compat::Release;
use kube_proxy_rs::exec::{Command, Exec, RealExec};
use kube_proxy_rs::model::NamespacedName;
use kube_proxy_rs::nftables::fake::FakeNftables;
use kube_proxy_rs::nftables::netlink::{KernelNetlink, NetlinkNftables};
use kube_proxy_rs::nftables::{
    Chain, Family, NftError, NftOptions, NftRunner, Nftables, Operation, Rule, TableState, Transaction,
};
use kube_proxy_rs::proxier::StaticInterfaces;
use kube_proxy_rs::proxier::nftables::{NftSyncOutcome, NftablesProxier, bench_node_config};
use kube_proxy_rs::synthetic::{self, ClusterShape};

#[global_allocator]
static ALLOCATOR: Cap<alloc::System> = Cap::new(alloc::System, usize::MAX);

/// A network namespace deleted on drop (also when a run panics).
struct Netns(String);

impl Netns {
    fn create(run: usize) -> Netns {
        let name = format!("kprs-nft-scale-{}-{run}", std::process::id());
        let out = RealExec.run(&Command::new("ip").args(["netns", "add", name.as_str()])).expect("run ip");
        assert!(out.success(), "ip netns add {name}: {}", out.combined());
        Netns(name)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        match RealExec.run(&Command::new("ip").args(["netns", "del", self.0.as_str()])) {
            Ok(out) if out.success() => {}
            Ok(out) => eprintln!("ip netns del {}: {}", self.0, out.combined()),
            Err(e) => eprintln!("ip netns del {}: {e}", self.0),
        }
    }
}

/// Which kernel the proxier writes to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Transactions are counted and dropped.
    Counting,
    /// `FakeNftables` applies them in memory.
    Fake,
    /// The real runner, in a namespace of its own.
    Kernel,
}

/// A kernel that counts every transaction (operations, transactions, bytes of `nft -f` text)
/// and hands it to the inner kernel when there is one.
struct Counting {
    inner: Option<Arc<dyn Nftables>>,
    ops: AtomicUsize,
    txs: AtomicUsize,
    bytes: AtomicUsize,
}

impl Nftables for Counting {
    fn family(&self) -> Family {
        Family::Ip
    }

    fn object_comments(&self) -> bool {
        self.inner.as_ref().is_none_or(|k| k.object_comments())
    }

    fn run(&self, tx: &Transaction) -> Result<(), NftError> {
        self.ops.fetch_add(tx.len(), Ordering::Relaxed);
        self.txs.fetch_add(1, Ordering::Relaxed);
        // What the writer would send.
        let text = tx.text(Family::Ip, self.object_comments());
        self.bytes.fetch_add(text.len(), Ordering::Relaxed);
        // For experiments by hand: every transaction's text, appended to this file.
        if let Ok(path) = std::env::var("NFT_SCALE_DUMP") {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path).expect("dump file");
            writeln!(f, "# transaction: {} operations", tx.len()).expect("dump");
            f.write_all(text.as_bytes()).expect("dump");
        }
        match &self.inner {
            Some(fake) => fake.run(tx),
            None => Ok(()),
        }
    }

    fn check(&self, tx: &Transaction) -> Result<(), NftError> {
        match &self.inner {
            Some(fake) => fake.check(tx),
            None => Ok(()),
        }
    }

    fn list_table(&self) -> Result<Option<TableState>, NftError> {
        match &self.inner {
            Some(fake) => fake.list_table(),
            None => Ok(None),
        }
    }
}

impl Counting {
    /// (operations, transactions, bytes) since the last call.
    fn take(&self) -> (usize, usize, usize) {
        (
            self.ops.swap(0, Ordering::Relaxed),
            self.txs.swap(0, Ordering::Relaxed),
            self.bytes.swap(0, Ordering::Relaxed),
        )
    }
}

fn mb(bytes: usize) -> String {
    format!("{:.1}", bytes as f64 / 1e6)
}

/// VmHWM: the process's peak resident set.
fn peak_rss() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse::<usize>().ok())
        .unwrap_or(0)
        * 1024
}

/// The load averages (`/proc/loadavg`): the machine is shared.
fn load() -> String {
    std::fs::read_to_string("/proc/loadavg").unwrap_or_default().split(' ').take(3).collect::<Vec<_>>().join(" ")
}

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

/// One sync's figures.
#[derive(Clone, Copy, Debug, Default)]
struct Phase {
    elapsed: Duration,
    ops: usize,
    txs: usize,
    bytes: usize,
    full: bool,
}

fn sync(proxier: &mut NftablesProxier, kernel: &Counting, now: Instant, what: &str) -> Phase {
    kernel.take();
    let started = Instant::now();
    let report = match proxier.sync(now) {
        NftSyncOutcome::Synced(r) => r,
        NftSyncOutcome::NotInitialized => panic!("not initialised"),
    };
    let elapsed = started.elapsed();
    assert!(report.result.is_ok(), "{what}: {:?}", report.result);
    let (ops, txs, bytes) = kernel.take();
    assert_eq!(ops, report.stats.operations + report.stats.stale_chains_deleted, "{what}");
    Phase { elapsed, ops, txs, bytes, full: report.full }
}

fn median_by<T: Copy>(items: &[T], key: impl Fn(&T) -> Duration) -> T {
    let mut sorted = items.to_vec();
    sorted.sort_by_key(|t| key(t));
    sorted[sorted.len() / 2]
}

fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1e3)
}

fn row(name: &str, p: &Phase) {
    println!(
        "| {name} (full: {}) | {} | {} in {} | {} | {} | {} | {} |",
        p.full,
        ms(p.elapsed),
        p.ops,
        p.txs,
        p.bytes,
        mb(ALLOCATOR.allocated()),
        mb(ALLOCATOR.max_allocated()),
        mb(peak_rss())
    );
}

#[derive(Clone, Copy)]
struct Run {
    first: Phase,
    partial: Phase,
    forced: Phase,
    /// Kernel mode: one transaction adding a chain and a `goto` rule (median), by `nft -f`.
    floor: Option<Duration>,
    /// The same over netlink (kernel mode without `--nft-only`).
    netlink_floor: Option<Duration>,
    /// Kernel mode with `--upstream`: upstream's first sync, one `nft -f` (no table before).
    upstream: Option<Duration>,
    /// Kernel mode with `--upstream`: [`set_floor`] for the same numbers of sets.
    set_floor: Option<Duration>,
}

/// The median time of `repeats` transactions each adding a chain with one `goto` rule to the
/// table the proxier wrote (then deleting it, untimed). `masquerading` is a fixed chain in every release.
fn chain_floor(kernel: &dyn Nftables, repeats: usize) -> Duration {
    let mut times: Vec<Duration> = (0..repeats)
        .map(|r| {
            let name = format!("floor-{r}");
            let add = Transaction {
                ops: vec![
                    Operation::AddChain(Chain::regular(name.clone())),
                    Operation::AddRule(Rule { chain: name.clone(), text: "goto masquerading".into(), comment: None }),
                ],
            };
            let started = Instant::now();
            kernel.run(&add).unwrap_or_else(|e| panic!("{e}"));
            let elapsed = started.elapsed();
            kernel.run(&Transaction { ops: vec![Operation::DeleteChain(name)] }).unwrap_or_else(|e| panic!("{e}"));
            elapsed
        })
        .collect();
    times.sort();
    times[times.len() / 2]
}

struct Options {
    services: usize,
    per: usize,
    release: Release,
    mode: Mode,
    partials: usize,
    chunk: Option<usize>,
    affinity_every: usize,
    upstream: bool,
    nft_only: bool,
    /// The netlink writer names anonymous maps `__map%d`, as nft does (`--kernel-names`).
    kernel_names: bool,
}

/// A proxier on `kernel` fed the synthetic cluster of `o` (objects made one at a time and
/// dropped, as the watches do), its full syncs in pieces of `chunk` operations.
fn fed_proxier(o: &Options, kernel: Arc<dyn Nftables>, chunk: Option<usize>) -> NftablesProxier {
    let cfg = bench_node_config(o.release, synthetic::NODE_NAME);
    let mut proxier =
        NftablesProxier::new(cfg, kernel, Arc::new(StaticInterfaces(vec!["192.168.0.2".parse().expect("ip")])));
    if let Some(chunk) = chunk {
        proxier = proxier.with_chunk_operations(chunk);
    }
    proxier.on_service_cidrs(&["172.16.0.0/12".into()]);
    for i in 0..o.services {
        let s = synthetic::shaped_service(i, o.affinity_every);
        proxier.on_service_state(NamespacedName::of_object(&s.metadata), Some(&s));
        proxier.on_endpoint_slice_update(&synthetic::slice(i, o.per, 0), false);
    }
    proxier.on_services_synced();
    proxier.on_endpoint_slices_synced();
    proxier
}

/// A kernel that cannot list its table (so the proxier writes every object and flushes
/// every chain and set, as upstream's full sync does) and keeps what it is sent.
struct Capture(std::sync::Mutex<Vec<Transaction>>);

impl Nftables for Capture {
    fn family(&self) -> Family {
        Family::Ip
    }

    fn run(&self, tx: &Transaction) -> Result<(), NftError> {
        self.0.lock().expect("capture").push(tx.clone());
        Ok(())
    }

    fn check(&self, _: &Transaction) -> Result<(), NftError> {
        Ok(())
    }

    fn list_table(&self) -> Result<Option<TableState>, NftError> {
        Err(NftError::List { family: Family::Ip, message: "not listed: writing as upstream".into() })
    }
}

/// The service port a per-service object belongs to (`PREFIX-HASH-ns/name/proto/port`, an
/// endpoint's `…__ip/port`); "" for the fixed objects (no `/`).
fn service_port_of(name: &str) -> &str {
    if !name.contains('/') {
        return "";
    }
    let rest = name.splitn(3, '-').nth(2).unwrap_or(name);
    rest.split("__").next().unwrap_or(rest)
}

/// The first full sync as upstream's writes it: one transaction, the proxier's objects in
/// upstream's order (knftables sends operations as the proxier adds them): the fixed
/// objects, then service port by service port its chains and affinity sets added and
/// flushed, its map elements, its rules; set elements that name no chain (`cluster-ips`)
/// last. Made from this proxier's blind full sync (every object added and flushed, as
/// upstream's full sync does) regrouped by service port.
fn upstream_first_sync(o: &Options) -> Transaction {
    let capture = Arc::new(Capture(std::sync::Mutex::new(Vec::new())));
    let mut proxier = fed_proxier(o, capture.clone(), Some(usize::MAX));
    match proxier.sync(Instant::now()) {
        NftSyncOutcome::Synced(r) => assert!(r.result.is_ok(), "{:?}", r.result),
        NftSyncOutcome::NotInitialized => panic!("not initialised"),
    }
    let txs = std::mem::take(&mut *capture.0.lock().expect("capture"));
    assert_eq!(txs.len(), 1, "one transaction");
    let mut groups: Vec<(String, Vec<Operation>)> = Vec::new();
    let mut index: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    let mut last = Vec::new();
    for op in txs.into_iter().flat_map(|t| t.ops) {
        let key = match &op {
            Operation::AddChain(c) => Some(service_port_of(&c.name).to_string()),
            Operation::FlushChain(n) | Operation::DeleteChain(n) => Some(service_port_of(n).to_string()),
            Operation::AddRule(r) => Some(service_port_of(&r.chain).to_string()),
            Operation::AddSet(set) => Some(service_port_of(&set.name).to_string()),
            Operation::FlushSet { name, .. } => Some(service_port_of(name).to_string()),
            Operation::AddElement(e) => e
                .value
                .iter()
                .find_map(|v| v.strip_prefix("goto ").or_else(|| v.strip_prefix("jump ")))
                .map(|chain| service_port_of(chain).to_string()),
            Operation::AddTable => Some(String::new()),
            _ => None,
        };
        match key {
            Some(key) => {
                let i = *index.entry(key.clone()).or_insert_with(|| {
                    groups.push((key, Vec::new()));
                    groups.len() - 1
                });
                groups[i].1.push(op);
            }
            None => last.push(op),
        }
    }
    let mut ops: Vec<Operation> = groups.into_iter().flat_map(|(_, ops)| ops).collect();
    ops.extend(last);
    Transaction { ops }
}

/// Writes `tx` with one `ip netns exec NS nft -f FILE` into a namespace of its own (no table
/// before), as upstream's first sync does; returns the wall time.
fn replay(tx: &Transaction, run: usize, check_only: bool) -> Duration {
    let ns = Netns::create(1000 + run);
    let path = std::env::temp_dir().join(format!("nft-scale-upstream-{}.nft", std::process::id()));
    std::fs::write(&path, tx.text(Family::Ip, true)).expect("write the transaction");
    let file = path.to_string_lossy().to_string();
    let mut args = vec!["netns", "exec", ns.0.as_str(), "nft"];
    if check_only {
        args.push("-c");
    }
    args.extend(["-f", file.as_str()]);
    let started = Instant::now();
    let out = RealExec.run(&Command::new("ip").args(args)).expect("run nft");
    let elapsed = started.elapsed();
    assert!(out.success(), "upstream's first sync: {}", out.combined());
    let _ = std::fs::remove_file(&path);
    drop(ns);
    elapsed
}

/// The kernel's floor for the sets of a first sync: `anonymous` chains each with one rule
/// holding an anonymous map, then `named` affinity-like sets each named by two rules, written
/// in the cheapest order found (anonymous maps before any named set exists; in each piece
/// its declarations, then their rules) in transactions of `chunk` operations into a fresh
/// namespace; no elements,
/// no other rules. Every set the kernel adds walks the table's list of sets (name checks,
/// anonymous-set numbering) and every rule naming a set looks it up in that list, so this is
/// what any writer of upstream's rule shapes pays. `writer`: through `nft -f` (nft's
/// `__map%d` names, which the kernel numbers), or the daemon's netlink writer (its own
/// names). The table and the chain everything jumps to are written first, untimed. Returns
/// the wall time and the system CPU time of writing the rest.
fn set_floor(anonymous: usize, named: usize, chunk: usize, run: usize, writer: FloorWriter) -> (Duration, f64) {
    let ns = Netns::create(2000 + run);
    let options =
        NftOptions { netns: Some(ns.0.clone()), command_timeout: Duration::from_secs(900), ..NftOptions::default() };
    let nft = Arc::new(NftRunner::new(Arc::new(RealExec), Family::Ip, options).unwrap_or_else(|e| panic!("{e}")));
    nft.run(&Transaction { ops: vec![Operation::AddTable, Operation::AddChain(Chain::regular("t"))] })
        .unwrap_or_else(|e| panic!("set floor's table: {e}"));
    let out: Arc<dyn Nftables> = match writer {
        FloorWriter::Nft => nft.clone(),
        FloorWriter::Netlink => {
            Arc::new(NetlinkNftables::new(nft.clone(), Arc::new(KernelNetlink::in_netns(ns.0.clone()))))
        }
    };
    let rule = |chain: String, text: String| Operation::AddRule(Rule { chain, text, comment: None });
    // Each piece declares its chains, then gives each its map (as the planner orders a
    // piece: declarations, then the rules holding anonymous maps).
    let mut ops = Vec::new();
    let per_piece = (chunk.max(2) / 2).max(1);
    for block in (0..anonymous).collect::<Vec<_>>().chunks(per_piece) {
        ops.extend(block.iter().map(|i| Operation::AddChain(Chain::regular(format!("c{i}")))));
        ops.extend(
            block.iter().map(|i| rule(format!("c{i}"), "numgen random mod 2 vmap { 0 : goto t , 1 : goto t }".into())),
        );
    }
    for i in 0..named {
        ops.push(Operation::AddSet(kube_proxy_rs::nftables::Set {
            kind: kube_proxy_rs::nftables::SetKind::Set,
            name: format!("a{i}"),
            set_type: "ipv4_addr".into(),
            flags: vec!["dynamic".into(), "timeout".into()],
            timeout_secs: Some(10800),
            comment: None,
        }));
        ops.push(Operation::AddChain(Chain::regular(format!("e{i}"))));
    }
    for i in 0..named {
        ops.push(rule(format!("e{i}"), format!("ip saddr @a{i} goto t")));
        ops.push(rule(format!("e{i}"), format!("update @a{i} {{ ip saddr }}")));
    }
    let cpu = cpu_times();
    let started = Instant::now();
    for piece in ops.chunks(chunk.max(1)) {
        out.run(&Transaction { ops: piece.to_vec() }).unwrap_or_else(|e| panic!("set floor: {e}"));
    }
    let elapsed = started.elapsed();
    let system = cpu_times().1 - cpu.1;
    drop(out);
    drop(nft);
    drop(ns);
    (elapsed, system)
}

/// Who writes the set floor ([`set_floor`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FloorWriter {
    Nft,
    Netlink,
}

/// `--floor-writer nft|netlink|both` (default both).
fn floor_writers() -> Vec<FloorWriter> {
    let pos = std::env::args().position(|a| a == "--floor-writer");
    match pos.and_then(|i| std::env::args().nth(i + 1)).as_deref() {
        Some("nft") => vec![FloorWriter::Nft],
        Some("netlink") => vec![FloorWriter::Netlink],
        _ => vec![FloorWriter::Nft, FloorWriter::Netlink],
    }
}

/// Prints one set floor's row.
fn print_floor(anonymous: usize, named: usize, chunk: usize, writer: FloorWriter, (wall, system): (Duration, f64)) {
    println!(
        "| set floor ({writer:?}): {anonymous} anonymous maps, {named} named sets (2 references each), pieces of {chunk} | {} | system CPU {system:.2} s |",
        ms(wall)
    );
}

fn one_run(o: &Options, run: usize) -> Run {
    let (services, per, partials) = (o.services, o.per, o.partials);
    let fake = Arc::new(FakeNftables::new(Family::Ip));
    let netns = (o.mode == Mode::Kernel).then(|| Netns::create(run));
    // Kernel mode: the nft runner alone, and the daemon's writer (netlink for what it
    // encodes, nft for the rest) unless `--nft-only`.
    let cli: Option<Arc<NftRunner>> = netns.as_ref().map(|ns| {
        let options = NftOptions {
            netns: Some(ns.0.clone()),
            command_timeout: Duration::from_secs(900),
            ..NftOptions::default()
        };
        Arc::new(NftRunner::new(Arc::new(RealExec), Family::Ip, options).unwrap_or_else(|e| panic!("{e}")))
    });
    let writer: Option<Arc<NetlinkNftables>> = match (&netns, &cli) {
        (Some(ns), Some(cli)) if !o.nft_only => {
            let netlink = Arc::new(KernelNetlink::in_netns(ns.0.clone()));
            Some(Arc::new(if o.kernel_names {
                NetlinkNftables::with_kernel_names(cli.clone(), netlink)
            } else {
                NetlinkNftables::new(cli.clone(), netlink)
            }))
        }
        _ => None,
    };
    let inner: Option<Arc<dyn Nftables>> = match (&writer, &cli, o.mode) {
        (Some(w), _, _) => Some(w.clone()),
        (None, Some(cli), _) => Some(cli.clone()),
        (None, None, Mode::Fake) => Some(fake.clone()),
        (None, None, _) => None,
    };
    let kernel = Arc::new(Counting {
        inner: inner.clone(),
        ops: AtomicUsize::new(0),
        txs: AtomicUsize::new(0),
        bytes: AtomicUsize::new(0),
    });
    let mut proxier = fed_proxier(o, kernel.clone(), o.chunk);
    println!("live heap before the first sync (trackers, pending changes): {} MB", mb(ALLOCATOR.allocated()));
    println!();
    println!(
        "| phase | time (ms) | operations in transactions | nft text (bytes) | live heap (MB) | peak heap (MB) | VmHWM (MB) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");

    let mut now = Instant::now();
    println!("load before the first sync: {}", load());
    let cpu_before = cpu_times();
    let first = sync(&mut proxier, &kernel, now, "first sync");
    row("first sync", &first);
    let cpu_after = cpu_times();
    println!(
        "CPU of the first sync (this process and the nft processes it waited for): user {:.2} s, system {:.2} s",
        cpu_after.0 - cpu_before.0,
        cpu_after.1 - cpu_before.1
    );
    println!("load after the first sync: {}", load());
    let floor = cli.as_deref().map(|k| chain_floor(k, partials));
    if let Some(f) = floor {
        println!("| floor: one chain + one `goto` rule, one `nft -f` (median) | {} | 2 in 1 | | | | |", ms(f));
    }
    let netlink_floor = writer.as_deref().map(|k| chain_floor(k, partials));
    if let Some(f) = netlink_floor {
        println!("| floor: one chain + one `goto` rule, one netlink batch (median) | {} | 2 in 1 | | | | |", ms(f));
    }

    let mut partial = Vec::new();
    for k in 0..partials {
        now += Duration::from_secs(2);
        let i = (k * 997 + 1) % services;
        let mut changed = synthetic::slice(i, per, 0);
        let moved = synthetic::slice(i, per, k + 1);
        changed.endpoints[0].addresses = moved.endpoints[0].addresses.clone();
        proxier.on_endpoint_slice_update(&changed, false);
        let p = sync(&mut proxier, &kernel, now, "one endpoint changed");
        assert!(!p.full, "a partial sync");
        if k == 0 {
            row("one endpoint changed (first)", &p);
        }
        partial.push(p);
        // Back to the original slice, so each change is against the first state.
        proxier.on_endpoint_slice_update(&synthetic::slice(i, per, 0), false);
        now += Duration::from_secs(2);
        sync(&mut proxier, &kernel, now, "changed back");
        // A sync with nothing to do deletes the chains gone stale, so the next change's sync
        // is only its own transaction.
        now += Duration::from_secs(2);
        sync(&mut proxier, &kernel, now, "stale chains deleted");
    }
    let partial = median_by(&partial, |p| p.elapsed);
    row("one endpoint changed (median)", &partial);
    if let Some(w) = &writer {
        println!(
            "transactions so far: {} over netlink, {} through nft",
            w.stats.netlink.load(Ordering::Relaxed),
            w.stats.cli.load(Ordering::Relaxed)
        );
    }

    now += Duration::from_secs(2);
    proxier.force_full_sync();
    let forced = sync(&mut proxier, &kernel, now, "forced full sync");
    row("forced full sync", &forced);
    if o.mode == Mode::Fake {
        let (chains, rules, sets, elements) = fake.table().counts();
        println!("table: {chains} chains, {rules} rules, {sets} sets and maps, {elements} elements");
    }
    println!();
    drop(proxier);
    drop(inner);
    drop(writer);
    drop(cli);
    drop(kernel);
    drop(netns);
    let upstream = (o.upstream && o.mode == Mode::Kernel).then(|| {
        let tx = upstream_first_sync(o);
        println!("upstream's first sync: {} operations in 1 transaction; load: {}", tx.len(), load());
        let t = replay(&tx, run, false);
        println!("| upstream's first sync, one `nft -f` | {} | {} in 1 | | | | |", ms(t), tx.len());
        let (anonymous, named) = set_counts(&tx);
        let chunk = o.chunk.unwrap_or(kube_proxy_rs::proxier::nftables::plan::CHUNK_OPERATIONS);
        let mut f = Duration::ZERO;
        for writer in floor_writers() {
            let floor = set_floor(anonymous, named, chunk, run, writer);
            print_floor(anonymous, named, chunk, writer, floor);
            f = floor.0;
        }
        println!("load after upstream's and the set floor: {}", load());
        println!();
        (t, f)
    });
    Run {
        first,
        partial,
        forced,
        floor,
        netlink_floor,
        upstream: upstream.map(|u| u.0),
        set_floor: upstream.map(|u| u.1),
    }
}

/// The anonymous maps (rules holding one) and the affinity sets of a first sync.
fn set_counts(tx: &Transaction) -> (usize, usize) {
    let anonymous = tx
        .ops
        .iter()
        .filter(|op| matches!(op, Operation::AddRule(r) if r.text.contains('{') && !r.text.contains("update @")))
        .count();
    let named =
        tx.ops.iter().filter(|op| matches!(op, Operation::AddSet(set) if set.name.starts_with("affinity-"))).count();
    (anonymous, named)
}

/// User and system CPU seconds of this process plus its waited-for children (nft): the
/// kernel's work for a netlink batch or an `nft -f` is system time of the sender, so this
/// reads through a machine shared with other work better than wall time does.
fn cpu_times() -> (f64, f64) {
    use nix::sys::resource::{UsageWho, getrusage};
    let secs = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 / 1e6;
    let mut user = 0.0;
    let mut sys = 0.0;
    for who in [UsageWho::RUSAGE_SELF, UsageWho::RUSAGE_CHILDREN] {
        if let Ok(u) = getrusage(who) {
            user += secs(u.user_time());
            sys += secs(u.system_time());
        }
    }
    (user, sys)
}

fn main() {
    let positional: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let services = positional.first().copied().unwrap_or(10_000);
    let per = positional.get(1).copied().unwrap_or(10);
    let release: Release = match arg("--release").as_deref() {
        Some("1.36") => Release::V1_36,
        Some("1.37") => Release::V1_37,
        Some(r) => r.parse().expect("release"),
        None => Release::V1_35,
    };
    let mode = if std::env::args().any(|a| a == "--kernel") {
        Mode::Kernel
    } else if std::env::args().any(|a| a == "--fake") {
        Mode::Fake
    } else {
        Mode::Counting
    };
    let runs: usize = arg("--runs").and_then(|p| p.parse().ok()).unwrap_or(3).max(1);
    let partials: usize = arg("--partials").and_then(|p| p.parse().ok()).unwrap_or(9).max(1);
    let chunk: Option<usize> = arg("--chunk").and_then(|p| p.parse().ok());
    let affinity_every: usize =
        arg("--affinity-every").and_then(|p| p.parse().ok()).unwrap_or(ClusterShape::DEFAULT_AFFINITY_EVERY);
    let upstream = std::env::args().any(|a| a == "--upstream");
    let nft_only = std::env::args().any(|a| a == "--nft-only");
    let kernel_names = std::env::args().any(|a| a == "--kernel-names");
    println!(
        "{services} services × {per} endpoints (affinity on every {affinity_every}th), release {release}, kernel: {}, {runs} runs of {partials} partial syncs, chunk {}",
        match mode {
            Mode::Kernel if nft_only => "nft in a network namespace",
            Mode::Kernel if kernel_names =>
                "netlink writer (nft for the rest; maps named __map%d) in a network namespace",
            Mode::Kernel => "netlink writer (nft for the rest) in a network namespace",
            Mode::Fake => "FakeNftables (applies)",
            Mode::Counting => "counting only",
        },
        chunk.map_or("default".to_string(), |c| c.to_string()),
    );
    let options =
        Options { services, per, release, mode, partials, chunk, affinity_every, upstream, nft_only, kernel_names };
    if std::env::args().any(|a| a == "--set-floor-only") {
        // Only the kernel's floor for this cluster's sets (see `set_floor`), for sizes where
        // a whole run would take too long.
        let (anonymous, named) = set_counts(&upstream_first_sync(&options));
        let chunk = chunk.unwrap_or(kube_proxy_rs::proxier::nftables::plan::CHUNK_OPERATIONS);
        for writer in floor_writers() {
            println!("load before: {}", load());
            let floor = set_floor(anonymous, named, chunk, 0, writer);
            print_floor(anonymous, named, chunk, writer, floor);
            println!("load after: {}", load());
        }
        return;
    }
    let mut all = Vec::new();
    for run in 0..runs {
        println!("## run {}", run + 1);
        all.push(one_run(&options, run));
    }
    let first = median_by(&all.iter().map(|r| r.first).collect::<Vec<_>>(), |p| p.elapsed);
    let partial = median_by(&all.iter().map(|r| r.partial).collect::<Vec<_>>(), |p| p.elapsed);
    let forced = median_by(&all.iter().map(|r| r.forced).collect::<Vec<_>>(), |p| p.elapsed);
    println!("## medians over {runs} runs");
    println!("| phase | time (ms) | operations in transactions | nft text (bytes) |");
    println!("|---|---:|---:|---:|");
    for (name, p) in [("first sync", first), ("one endpoint changed", partial), ("forced full sync", forced)] {
        println!("| {name} | {} | {} in {} | {} |", ms(p.elapsed), p.ops, p.txs, p.bytes);
    }
    let floors: Vec<Duration> = all.iter().filter_map(|r| r.floor).collect();
    if !floors.is_empty() {
        let mut floors = floors;
        floors.sort();
        println!("| floor: chain + `goto` rule, `nft -f` | {} | 2 in 1 | |", ms(floors[floors.len() / 2]));
    }
    let mut netlink_floors: Vec<Duration> = all.iter().filter_map(|r| r.netlink_floor).collect();
    if !netlink_floors.is_empty() {
        netlink_floors.sort();
        println!(
            "| floor: chain + `goto` rule, netlink | {} | 2 in 1 | |",
            ms(netlink_floors[netlink_floors.len() / 2])
        );
    }
    let mut upstream: Vec<Duration> = all.iter().filter_map(|r| r.upstream).collect();
    if !upstream.is_empty() {
        upstream.sort();
        let u = upstream[upstream.len() / 2];
        println!("| upstream's first sync, one `nft -f` | {} | | |", ms(u));
        println!("ratio upstream / ours (first sync, medians): {:.2}", u.as_secs_f64() / first.elapsed.as_secs_f64());
    }
    let mut set_floors: Vec<Duration> = all.iter().filter_map(|r| r.set_floor).collect();
    if !set_floors.is_empty() {
        set_floors.sort();
        let f = set_floors[set_floors.len() / 2];
        println!("| set floor (same sets, cheapest order) | {} | | |", ms(f));
        println!("ratio ours / set floor (first sync, medians): {:.2}", first.elapsed.as_secs_f64() / f.as_secs_f64());
    }
}
