//! What one `nft -f` transaction costs against a kube-proxy-like `kube-proxy` table of
//! N services (one service chain and one endpoint chain per service, a `service-ips`
//! verdict map and a `cluster-ips` set of N elements each), through the real runner
//! ([`NftRunner`]) in a network namespace this program creates and always deletes.
//!
//!     cargo run --release --example nft_floor -- [SERVICES] [REPEATS]
//!
//! (defaults 10000 and 9; needs root; at 10000 a full write takes minutes: a kill other than
//! a panic leaves the namespace named in the first line, to `ip netns del`). Each line reports the median, minimum and maximum
//! wall time of REPEATS runs of one transaction kind, each run a fresh `ip netns exec nft`
//! process as the daemon starts it:
//!
//! * `add table` alone: the process, nft's start-up and cache, a batch that changes nothing;
//! * a set element added / deleted (`cluster-ips`): no verdicts, no table validation;
//! * a verdict-map element with a `goto` added / deleted (`service-ips`): the kernel
//!   re-validates the table for a new jump/goto;
//! * a verdict-map element with `drop` (`no-endpoint-services`);
//! * one chain with one `goto` rule added, then the chain deleted: the validation floor;
//! * a service's chain rewritten (flush and two rules, one a `goto`): a typical sync;
//! * listing and parsing the whole table;
//! * a full write of the table into a namespace without it, in knftables' `Dump()` order
//!   (chains, sets, rules, elements) and with the rules holding anonymous sets moved up
//!   (see [`anonymous_sets_first`]): on kernel 6.18 a full write grows with the square of
//!   the number of such rules.

// An example program prints its output.
#![allow(clippy::print_stdout)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kube_proxy_rs::exec::{Command, Exec, RealExec};
use kube_proxy_rs::nftables::{
    BaseChain, Chain, ChainType, Element, Family, Hook, NftOptions, NftRunner, Nftables, Operation, Rule, Set, SetKind,
    Transaction,
};

/// A network namespace deleted on drop (also when a run panics).
struct Netns(String);

impl Netns {
    fn create() -> Netns {
        let name = format!("kprs-nft-floor-{}", std::process::id());
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

fn rule(chain: &str, text: String) -> Operation {
    Operation::AddRule(Rule { chain: chain.into(), text, comment: None })
}

fn base(name: &str, chain_type: ChainType, hook: Hook, priority: i32) -> Operation {
    Operation::AddChain(Chain {
        name: name.into(),
        base: Some(BaseChain { chain_type, hook, priority }),
        comment: None,
    })
}

fn map(name: &str, set_type: &str, comment: &str) -> Operation {
    Operation::AddSet(Set {
        kind: SetKind::Map,
        name: name.into(),
        set_type: set_type.into(),
        flags: vec![],
        timeout_secs: None,
        comment: Some(comment.into()),
    })
}

fn element(kind: SetKind, set: &str, key: Vec<String>, value: Vec<String>) -> Operation {
    Operation::AddElement(Element { kind, set: set.into(), key, value, comment: None })
}

/// Service `i`'s ClusterIP (198.18.0.0/16) and endpoint (198.19.0.0/16).
fn addresses(i: usize) -> (String, String) {
    let (hi, lo) = (i / 250 % 256, i % 250 + 1);
    (format!("198.18.{hi}.{lo}"), format!("198.19.{hi}.{lo}"))
}

fn service_chain(i: usize) -> String {
    format!("service-{i:08X}-ns{i}/svc{i}/tcp/p80")
}

fn endpoint_chain(i: usize) -> String {
    let (_, ep) = addresses(i);
    format!("endpoint-{i:08X}-ns{i}/svc{i}/tcp/p80__{ep}/80")
}

/// Service `i`'s chain rules (as upstream's 1.36 proxier writes them).
fn service_rules(i: usize) -> Vec<Operation> {
    let (cip, _) = addresses(i);
    let chain = service_chain(i);
    vec![
        rule(&chain, format!("ip daddr {cip} tcp dport 80 ip saddr != 198.19.0.0/16 jump mark-for-masquerade")),
        rule(&chain, format!("numgen random mod 1 vmap {{ 0 : goto {} }}", endpoint_chain(i))),
    ]
}

/// The whole table for `services` services.
fn full_table(services: usize) -> Transaction {
    let verdicts = "ipv4_addr . inet_proto . inet_service : verdict";
    let mut tx = Transaction::new();
    tx.push(Operation::AddTable);
    tx.push(base("nat-prerouting", ChainType::Nat, Hook::Prerouting, -100));
    tx.push(base("nat-output", ChainType::Nat, Hook::Output, -100));
    tx.push(base("nat-postrouting", ChainType::Nat, Hook::Postrouting, 100));
    tx.push(base("filter-forward", ChainType::Filter, Hook::Forward, 0));
    tx.push(base("filter-output", ChainType::Filter, Hook::Output, 0));
    for name in ["services", "masquerading", "mark-for-masquerade", "service-endpoints-check", "reject-chain"] {
        tx.push(Operation::AddChain(Chain::regular(name)));
    }
    tx.push(Operation::AddSet(Set {
        kind: SetKind::Set,
        name: "cluster-ips".into(),
        set_type: "ipv4_addr".into(),
        flags: vec![],
        timeout_secs: None,
        comment: Some("Active ClusterIPs".into()),
    }));
    tx.push(map("service-ips", verdicts, "ClusterIP, ExternalIP and LoadBalancer IP traffic"));
    tx.push(map("no-endpoint-services", verdicts, "vmap to drop or reject packets to services with no endpoints"));
    for i in 0..services {
        tx.push(Operation::AddChain(Chain::regular(service_chain(i))));
        tx.push(Operation::AddChain(Chain::regular(endpoint_chain(i))));
    }
    tx.push(rule("nat-prerouting", "jump services".into()));
    tx.push(rule("nat-output", "jump services".into()));
    tx.push(rule("nat-postrouting", "jump masquerading".into()));
    tx.push(rule("filter-forward", "ct state new jump service-endpoints-check".into()));
    tx.push(rule("filter-output", "ct state new jump service-endpoints-check".into()));
    tx.push(rule("mark-for-masquerade", "mark set mark or 0x4000".into()));
    tx.push(rule("masquerading", "mark and 0x4000 == 0 return".into()));
    tx.push(rule("masquerading", "mark set mark xor 0x4000".into()));
    tx.push(rule("masquerading", "masquerade fully-random".into()));
    tx.push(rule("reject-chain", "reject".into()));
    tx.push(rule("service-endpoints-check", "ip daddr . meta l4proto . th dport vmap @no-endpoint-services".into()));
    tx.push(rule("services", "ip daddr . meta l4proto . th dport vmap @service-ips".into()));
    for i in 0..services {
        let (cip, ep) = addresses(i);
        tx.ops.extend(service_rules(i));
        let endpoint = endpoint_chain(i);
        tx.push(rule(&endpoint, format!("ip saddr {ep} jump mark-for-masquerade")));
        tx.push(rule(&endpoint, format!("meta l4proto tcp dnat to {ep}:80")));
        tx.push(element(SetKind::Set, "cluster-ips", vec![cip.clone()], vec![]));
        tx.push(element(
            SetKind::Map,
            "service-ips",
            vec![cip, "tcp".into(), "80".into()],
            vec![format!("goto {}", service_chain(i))],
        ));
    }
    tx
}

/// `tx` with the rules that hold an anonymous set or map (`{ … }`) moved to just after the
/// last chain, set or counter is declared. The kernel (6.18) finds a set added in the same
/// batch by walking the batch from its start (once for its elements, once for the rule), so
/// the cost of each such rule grows with how much of the batch comes before it: this order
/// measures how much of a full write that is.
fn anonymous_sets_first(tx: &Transaction) -> Transaction {
    let anonymous = |op: &Operation| matches!(op, Operation::AddRule(rule) if rule.text.contains('{'));
    let declares = |op: &Operation| {
        matches!(op, Operation::AddTable | Operation::AddChain(_) | Operation::AddSet(_) | Operation::AddCounter(_))
    };
    let declared = tx.ops.iter().rposition(declares).map_or(0, |i| i + 1);
    let mut ops: Vec<Operation> = tx.ops[..declared].to_vec();
    ops.extend(tx.ops.iter().filter(|op| anonymous(op)).cloned());
    ops.extend(tx.ops[declared..].iter().filter(|op| !anonymous(op)).cloned());
    Transaction { ops }
}

fn median(mut times: Vec<Duration>) -> (Duration, Duration, Duration) {
    times.sort();
    (times[times.len() / 2], times[0], times[times.len() - 1])
}

fn report(what: &str, times: Vec<Duration>) {
    let n = times.len();
    let (median, min, max) = median(times);
    println!(
        "{what:<58} median {:>8.1} ms  (min {:>7.1}, max {:>7.1}, n={n})",
        median.as_secs_f64() * 1e3,
        min.as_secs_f64() * 1e3,
        max.as_secs_f64() * 1e3
    );
}

fn timed(nft: &NftRunner, tx: &Transaction) -> Duration {
    let started = Instant::now();
    nft.run(tx).unwrap_or_else(|e| panic!("{e}"));
    started.elapsed()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let parse = |i: usize, default: usize| {
        args.get(i).map_or(default, |a| {
            a.parse().unwrap_or_else(|e| {
                eprintln!("usage: nft_floor [SERVICES] [REPEATS]: {a:?}: {e}");
                std::process::exit(2);
            })
        })
    };
    let services = parse(0, 10_000).max(1);
    let repeats = parse(1, 9).max(1);

    let ns = Netns::create();
    let options =
        NftOptions { netns: Some(ns.0.clone()), command_timeout: Duration::from_secs(600), ..NftOptions::default() };
    let nft = NftRunner::new(Arc::new(RealExec), Family::Ip, options).unwrap_or_else(|e| panic!("{e}"));
    let table = full_table(services);
    let text_bytes = table.text(Family::Ip, true).len();
    let started = Instant::now();
    nft.run(&table).unwrap_or_else(|e| panic!("{e}"));
    println!(
        "namespace {}; nft {}; {services} services: {} operations, {:.1} MiB of nft text; first write {:.0} ms",
        ns.0,
        nft.version(),
        table.len(),
        text_bytes as f64 / (1 << 20) as f64,
        started.elapsed().as_secs_f64() * 1e3
    );

    let only = |op: Operation| Transaction { ops: vec![op] };
    report("add table (nothing changes)", (0..repeats).map(|_| timed(&nft, &only(Operation::AddTable))).collect());

    let extra = |r: usize| format!("198.18.255.{}", r % 250 + 1);
    let (mut add, mut delete) = (Vec::new(), Vec::new());
    for r in 0..repeats {
        add.push(timed(&nft, &only(element(SetKind::Set, "cluster-ips", vec![extra(r)], vec![]))));
        delete.push(timed(
            &nft,
            &only(Operation::DeleteElement { kind: SetKind::Set, set: "cluster-ips".into(), key: vec![extra(r)] }),
        ));
    }
    report("set element: add (cluster-ips)", add);
    report("set element: delete", delete);

    for (map, verdict, label) in [
        ("service-ips", format!("goto {}", service_chain(0)), "goto service-…"),
        ("no-endpoint-services", "drop".into(), "drop"),
    ] {
        let (mut add, mut delete) = (Vec::new(), Vec::new());
        let key = |r: usize| vec![extra(r), "tcp".to_string(), "8080".to_string()];
        for r in 0..repeats {
            add.push(timed(&nft, &only(element(SetKind::Map, map, key(r), vec![verdict.clone()]))));
            delete.push(timed(
                &nft,
                &only(Operation::DeleteElement { kind: SetKind::Map, set: map.into(), key: key(r) }),
            ));
        }
        report(&format!("map element `{label}`: add ({map})"), add);
        report("map element: delete", delete);
    }

    let (mut add, mut delete) = (Vec::new(), Vec::new());
    for r in 0..repeats {
        let name = format!("extra-{r}");
        add.push(timed(
            &nft,
            &Transaction {
                ops: vec![
                    Operation::AddChain(Chain::regular(name.clone())),
                    rule(&name, format!("goto {}", endpoint_chain(r % services))),
                ],
            },
        ));
        delete.push(timed(&nft, &only(Operation::DeleteChain(name))));
    }
    report("chain + one `goto` rule: add", add);
    report("that chain: delete (with its rule)", delete);

    let sync = (0..repeats)
        .map(|r| {
            let i = r * 7 % services;
            let mut tx = only(Operation::FlushChain(service_chain(i)));
            tx.ops.extend(service_rules(i));
            timed(&nft, &tx)
        })
        .collect();
    report("service chain: flush + 2 rules (one `goto`)", sync);

    let list = (0..repeats)
        .map(|_| {
            let started = Instant::now();
            let listed = nft.list_table().unwrap_or_else(|e| panic!("{e}")).expect("the table exists");
            assert_eq!(listed.chains.len(), 2 * services + 10);
            started.elapsed()
        })
        .collect();
    report("list and parse the whole table", list);

    let full_repeats = repeats.min(3);
    let reordered = anonymous_sets_first(&table);
    assert_eq!(reordered.len(), table.len());
    for (what, tx) in [
        ("full write, knftables' Dump order (no table before)", &table),
        ("full write, anonymous-set rules first (no table before)", &reordered),
    ] {
        let full = (0..full_repeats)
            .map(|_| {
                nft.run(&only(Operation::DeleteTable)).unwrap_or_else(|e| panic!("{e}"));
                timed(&nft, tx)
            })
            .collect();
        report(what, full);
    }
}
