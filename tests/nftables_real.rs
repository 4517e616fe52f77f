//! The nftables runner, listing, canonical rule text and the fake's model against the real
//! `nft` and kernel, each test in private network namespaces it creates and always deletes.
//!
//! These tests need root (to create namespaces); without it they print why and pass (under
//! CI they fail instead). Addresses come only from 198.18.0.0/15, 203.0.113.0/24 and fd00::/8.

use std::sync::Arc;
use std::time::Duration;

use std::sync::atomic::Ordering;

use kube_proxy_rs::exec::RealExec;
use kube_proxy_rs::nftables::fake::FakeNftables;
use kube_proxy_rs::nftables::netlink::encode::{self, AnonymousNames};
use kube_proxy_rs::nftables::netlink::{KernelNetlink, NetlinkNftables};
use kube_proxy_rs::nftables::{
    BaseChain, Chain, ChainType, Element, Family, Hook, NftError, NftOptions, NftRunner, Nftables, Operation, Rule,
    Set, SetKind, TableState, Transaction, cleanup_tables,
};

use crate::require_root;
use crate::support::netns::Netns;

fn runner(ns: &Netns, family: Family) -> NftRunner {
    let options =
        NftOptions { netns: Some(ns.name.clone()), command_timeout: Duration::from_secs(60), ..NftOptions::default() };
    NftRunner::new(Arc::new(RealExec), family, options).expect("nft is usable in the namespace")
}

fn options(ns: &Netns) -> NftOptions {
    NftOptions { netns: Some(ns.name.clone()), command_timeout: Duration::from_secs(60), ..NftOptions::default() }
}

fn base(name: &str, chain_type: ChainType, hook: Hook, priority: i32) -> Operation {
    Operation::AddChain(Chain {
        name: name.into(),
        base: Some(BaseChain { chain_type, hook, priority }),
        comment: None,
    })
}

fn chain(name: &str) -> Operation {
    Operation::AddChain(Chain::regular(name))
}

fn rule(chain: &str, text: &str) -> Operation {
    Operation::AddRule(Rule { chain: chain.into(), text: text.into(), comment: None })
}

fn rule_c(chain: &str, text: &str, comment: &str) -> Operation {
    Operation::AddRule(Rule { chain: chain.into(), text: text.into(), comment: Some(comment.into()) })
}

fn set(kind: SetKind, name: &str, set_type: &str, comment: Option<&str>) -> Operation {
    Operation::AddSet(Set {
        kind,
        name: name.into(),
        set_type: set_type.into(),
        flags: vec![],
        timeout_secs: None,
        comment: comment.map(Into::into),
    })
}

fn element(kind: SetKind, set: &str, key: &[&str], value: Option<&str>, comment: Option<&str>) -> Operation {
    Operation::AddElement(Element {
        kind,
        set: set.into(),
        key: key.iter().map(|s| s.to_string()).collect(),
        value: value.map(|v| vec![v.to_string()]).unwrap_or_default(),
        comment: comment.map(Into::into),
    })
}

/// Every rule shape upstream's proxier writes (1.31 to 1.37), in chains hooked where the
/// kernel accepts them (nat statements in nat chains, `reject` in filter input/forward/output).
fn every_rule_shape(family: Family) -> Transaction {
    let x = family.addr_selector();
    let (addr, cip, cip2, ep, ep2, lb, cidr, other_cidr, local, loopback) = match family {
        Family::Ip => (
            "ipv4_addr",
            "198.18.0.41",
            "198.18.0.42",
            "198.19.0.1",
            "198.19.0.2",
            "203.0.113.7",
            "198.18.0.0/16",
            "198.20.0.0/16",
            "198.19.0.0/16",
            "127.0.0.0/8",
        ),
        Family::Ip6 => (
            "ipv6_addr",
            "fd00:18::41",
            "fd00:18::42",
            "fd00:19::1",
            "fd00:19::2",
            "fd00:203::7",
            "fd00:18::/64",
            "fd00:20::/64",
            "fd00:19::/64",
            "::1",
        ),
    };
    let (dnat_ep, dnat_ep2) = match family {
        Family::Ip => (format!("{ep}:80"), format!("{ep2}:8080")),
        Family::Ip6 => (format!("[{ep}]:80"), format!("[{ep2}]:8080")),
    };
    let m = SetKind::Map;
    let s = SetKind::Set;
    let verdict3 = format!("{addr} . inet_proto . inet_service : verdict");
    let ops = vec![
        Operation::AddTable,
        base("filter-prerouting-pre-dnat", ChainType::Filter, Hook::Prerouting, -110),
        base("filter-output-pre-dnat", ChainType::Filter, Hook::Output, -110),
        base("filter-input", ChainType::Filter, Hook::Input, 0),
        base("filter-forward", ChainType::Filter, Hook::Forward, 0),
        base("filter-output", ChainType::Filter, Hook::Output, 0),
        base("filter-output-post-dnat", ChainType::Filter, Hook::Output, -90),
        base("nat-prerouting", ChainType::Nat, Hook::Prerouting, -100),
        base("nat-output", ChainType::Nat, Hook::Output, -100),
        base("nat-postrouting", ChainType::Nat, Hook::Postrouting, 100),
        chain("nodeport-endpoints-check"),
        chain("service-endpoints-check"),
        chain("firewall-check"),
        chain("services"),
        chain("masquerading"),
        chain("cluster-ips-check"),
        chain("mark-for-masquerade"),
        Operation::AddChain(Chain {
            name: "reject-chain".into(),
            base: None,
            comment: Some("helper for @no-endpoint-services / @no-endpoint-nodeports".into()),
        }),
        chain("endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"),
        chain("endpoint-B"),
        chain("service-ULMVA6XW-ns1/svc1/tcp/p80"),
        chain("external-ULMVA6XW-ns1/svc1/tcp/p80"),
        chain("firewall-ULMVA6XW-ns1/svc1/tcp/p80"),
        chain("local-ULMVA6XW-ns1/svc1/tcp/p80"),
        set(s, "cluster-ips", addr, Some("Active ClusterIPs")),
        set(s, "nodeport-ips", addr, Some("IPs that accept NodePort traffic")),
        set(
            s,
            "hairpin-connections",
            &format!("{addr} . {addr} . inet_proto . inet_service"),
            Some("service hairpin connections"),
        ),
        Operation::AddSet(Set {
            kind: s,
            name: "affinity-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80".into(),
            set_type: addr.into(),
            flags: vec!["dynamic".into(), "timeout".into()],
            timeout_secs: Some(10800),
            comment: None,
        }),
        set(m, "no-endpoint-services", &verdict3, Some("vmap to drop or reject packets to services with no endpoints")),
        set(
            m,
            "no-endpoint-nodeports",
            "inet_proto . inet_service : verdict",
            Some("vmap to drop or reject packets to service nodeports with no endpoints"),
        ),
        set(m, "firewall-ips", &verdict3, Some("destinations that are subject to LoadBalancerSourceRanges")),
        set(m, "service-ips", &verdict3, Some("ClusterIP, ExternalIP and LoadBalancer IP traffic")),
        set(m, "service-nodeports", "inet_proto . inet_service : verdict", Some("NodePort traffic")),
        Operation::AddCounter("localhost-nodeport-rejected-tcp".into()),
        // The jumps from the base chains.
        rule("filter-input", "ct state new jump nodeport-endpoints-check"),
        rule("filter-input", "ct state new jump service-endpoints-check"),
        rule("filter-forward", "ct state new jump service-endpoints-check"),
        rule("filter-output", "ct state new jump service-endpoints-check"),
        rule("filter-prerouting-pre-dnat", "ct state new jump firewall-check"),
        rule("filter-output-pre-dnat", "ct state new jump firewall-check"),
        rule("nat-output", "jump services"),
        rule("nat-prerouting", "jump services"),
        rule("nat-postrouting", "jump masquerading"),
        rule("filter-forward", "ct state new jump cluster-ips-check"),
        rule("filter-output-post-dnat", "ct state new jump cluster-ips-check"),
        // Masquerading, both generations.
        rule("mark-for-masquerade", "mark set mark or 0x4000"),
        rule("masquerading", "mark and 0x4000 == 0 return"),
        rule("masquerading", "mark set mark xor 0x4000"),
        rule("masquerading", "masquerade fully-random"),
        rule("masquerading", "mark and 0x00004000 != 0 mark set mark xor 0x00004000 masquerade fully-random"),
        rule(
            "masquerading",
            &format!(
                "ct status dnat {x} saddr . {x} daddr . meta l4proto . th dport @hairpin-connections masquerade fully-random"
            ),
        ),
        // Filter checks.
        rule_c(
            "cluster-ips-check",
            &format!("{x} daddr @cluster-ips reject"),
            "Reject traffic to invalid ports of ClusterIPs",
        ),
        rule_c("cluster-ips-check", &format!("{x} daddr {{ {cidr} }} drop"), "Drop traffic to unallocated ClusterIPs"),
        rule_c(
            "cluster-ips-check",
            &format!("{x} daddr {{ {cidr},{other_cidr} }} drop"),
            "Drop traffic to unallocated ClusterIPs",
        ),
        rule("reject-chain", "reject"),
        rule("reject-chain", "counter name \"localhost-nodeport-rejected-tcp\" reject"),
        rule("service-endpoints-check", &format!("{x} daddr . meta l4proto . th dport vmap @no-endpoint-services")),
        rule(
            "nodeport-endpoints-check",
            &format!("{x} daddr @nodeport-ips meta l4proto . th dport vmap @no-endpoint-nodeports"),
        ),
        rule(
            "nodeport-endpoints-check",
            &format!("{x} daddr != {loopback} meta l4proto . th dport vmap @no-endpoint-nodeports"),
        ),
        rule(
            "nodeport-endpoints-check",
            &format!("{x} daddr {loopback} meta l4proto . th dport vmap @no-endpoint-nodeports"),
        ),
        rule("firewall-check", &format!("{x} daddr . meta l4proto . th dport vmap @firewall-ips")),
        rule("firewall-ULMVA6XW-ns1/svc1/tcp/p80", &format!("{x} saddr != {{ {local} }} drop")),
        rule(
            "firewall-ULMVA6XW-ns1/svc1/tcp/p80",
            &format!("{x} saddr != {{ {other_cidr} , {local} , {lb} , {cip} }} drop"),
        ),
        // Apart (the one above touches in IPv4: nft merges it, so the writer leaves it to nft).
        rule("firewall-ULMVA6XW-ns1/svc1/tcp/p80", &format!("{x} saddr != {{ {lb} , {other_cidr} , {cip} }} drop")),
        rule("cluster-ips-check", &format!("{x} daddr {{ {other_cidr},{lb} }} drop")),
        // The services chain, both generations.
        rule_c(
            "services",
            &format!("{x} daddr @cluster-ips {x} saddr != {local} mark set mark or 0x00004000"),
            "masquerade clusterIP traffic from outside cluster",
        ),
        rule_c(
            "services",
            &format!("{x} daddr @cluster-ips mark set mark or 0x00004000"),
            "masquerade all clusterIP traffic",
        ),
        rule("services", &format!("{x} daddr . meta l4proto . th dport vmap @service-ips")),
        rule("services", &format!("{x} daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports")),
        rule(
            "services",
            &format!("fib daddr type local {x} daddr != {loopback} meta l4proto . th dport vmap @service-nodeports"),
        ),
        // Per service port: 1.31–1.33, 1.34–1.35 and 1.36+ shapes.
        rule(
            "service-ULMVA6XW-ns1/svc1/tcp/p80",
            &format!("{x} daddr {cip} tcp dport 80 {x} saddr != {local} jump mark-for-masquerade"),
        ),
        rule(
            "service-ULMVA6XW-ns1/svc1/tcp/p80",
            &format!("{x} daddr {cip} {x} saddr != {local} jump mark-for-masquerade"),
        ),
        rule("service-ULMVA6XW-ns1/svc1/tcp/p80", &format!("{x} daddr {cip} jump mark-for-masquerade")),
        rule("service-ULMVA6XW-ns1/svc1/tcp/p80", &format!("{x} daddr {cip} iif != lo jump mark-for-masquerade")),
        rule(
            "service-ULMVA6XW-ns1/svc1/tcp/p80",
            &format!(
                "{x} saddr @affinity-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80 goto endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"
            ),
        ),
        rule(
            "service-ULMVA6XW-ns1/svc1/tcp/p80",
            "numgen random mod 2 vmap { 0 : goto endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80 , 1 : goto endpoint-B }",
        ),
        rule("service-ULMVA6XW-ns1/svc1/tcp/p80", "numgen random mod 1 vmap { 0 : goto endpoint-B }"),
        rule(
            "local-ULMVA6XW-ns1/svc1/tcp/p80",
            &format!(
                "meta l4proto tcp dnat {x} addr . port to numgen random mod 2 map {{ 0 : {ep} . 80 , 1 : {ep2} . 8080 }}"
            ),
        ),
        rule("local-ULMVA6XW-ns1/svc1/tcp/p80", &format!("meta l4proto tcp dnat to {dnat_ep}")),
        rule("external-ULMVA6XW-ns1/svc1/tcp/p80", "jump mark-for-masquerade"),
        rule_c("external-ULMVA6XW-ns1/svc1/tcp/p80", "mark set mark or 0x00004000", "masquerade"),
        rule_c(
            "external-ULMVA6XW-ns1/svc1/tcp/p80",
            &format!("{x} saddr {local} goto service-ULMVA6XW-ns1/svc1/tcp/p80"),
            "short-circuit pod traffic",
        ),
        rule_c(
            "external-ULMVA6XW-ns1/svc1/tcp/p80",
            "fib saddr type local jump mark-for-masquerade",
            "masquerade local traffic",
        ),
        rule_c(
            "external-ULMVA6XW-ns1/svc1/tcp/p80",
            "fib saddr type local mark set mark or 0x00004000",
            "masquerade local traffic",
        ),
        rule_c(
            "external-ULMVA6XW-ns1/svc1/tcp/p80",
            "fib saddr type local goto service-ULMVA6XW-ns1/svc1/tcp/p80",
            "short-circuit local traffic",
        ),
        rule("external-ULMVA6XW-ns1/svc1/tcp/p80", "goto local-ULMVA6XW-ns1/svc1/tcp/p80"),
        rule("endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80", &format!("{x} saddr {ep} jump mark-for-masquerade")),
        rule(
            "endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80",
            &format!("update @affinity-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80 {{ {x} saddr }}"),
        ),
        rule("endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80", &format!("meta l4proto tcp dnat to {dnat_ep}")),
        rule("endpoint-B", &format!("meta l4proto udp dnat to {dnat_ep2}")),
        rule("endpoint-B", &format!("meta l4proto sctp dnat to {dnat_ep2}")),
        // Elements of every store.
        element(s, "cluster-ips", &[cip], None, None),
        element(s, "cluster-ips", &[cip2], None, None),
        element(s, "nodeport-ips", &[lb], None, None),
        element(s, "hairpin-connections", &[ep, ep, "tcp", "80"], None, None),
        element(m, "service-ips", &[cip, "tcp", "80"], Some("goto service-ULMVA6XW-ns1/svc1/tcp/p80"), None),
        element(m, "service-ips", &[lb, "tcp", "80"], Some("goto external-ULMVA6XW-ns1/svc1/tcp/p80"), None),
        element(m, "firewall-ips", &[lb, "tcp", "80"], Some("goto firewall-ULMVA6XW-ns1/svc1/tcp/p80"), None),
        element(m, "service-nodeports", &["tcp", "30080"], Some("goto external-ULMVA6XW-ns1/svc1/tcp/p80"), None),
        element(m, "no-endpoint-services", &[cip2, "udp", "53"], Some("goto reject-chain"), Some("ns6/svc6:p80")),
        element(m, "no-endpoint-services", &[cip2, "sctp", "5"], Some("drop"), Some("ns6/svc6")),
        element(m, "no-endpoint-nodeports", &["tcp", "30081"], Some("drop"), Some("ns2/svc2:p80")),
    ];
    Transaction { ops }
}

/// The listing of what was written equals the model's "as listed" view: the parser reads
/// every field back and the canonicaliser predicts nft's words for every rule shape.
#[test]
fn every_rule_shape_reads_back_as_predicted() {
    require_root!();
    for family in [Family::Ip, Family::Ip6] {
        let ns = Netns::create("nft-shapes");
        let nft = runner(&ns, family);
        assert!(nft.object_comments(), "this kernel keeps object comments");
        assert_eq!(nft.list_table().expect("list"), None, "a fresh namespace has no table");
        let tx = every_rule_shape(family);
        let mut model = TableState::default();
        model.apply(&tx).expect("the model accepts every shape");
        nft.check(&tx).expect("nft --check accepts every shape");
        assert_eq!(nft.list_table().expect("list"), None, "--check applies nothing");
        nft.run(&tx).unwrap_or_else(|e| panic!("{family}: {e}"));
        let listed = nft.list_table().expect("list").expect("the table exists");
        let expected = model.as_listed();
        for (name, chain) in &expected.chains {
            assert_eq!(Some(chain), listed.chains.get(name), "{family}: chain {name}");
        }
        for (name, set) in &expected.sets {
            assert_eq!(Some(set), listed.sets.get(name), "{family}: set {name}");
        }
        assert_eq!(listed, expected, "{family}: the whole table");
    }
}

/// nft's refusals, at each stage where they happen (its evaluation of the text, the
/// kernel's answer to the batch), name the failing line(s) with the lines around the first,
/// and nothing of the transaction is applied.
#[test]
fn a_refused_transaction_names_the_line_and_changes_nothing() {
    require_root!();
    let ns = Netns::create("nft-refused");
    let nft = runner(&ns, Family::Ip);

    // The kernel refuses a jump to a missing chain (ENOENT, after nft evaluated the text).
    let mut tx = Transaction::new();
    tx.push(Operation::AddTable);
    tx.push(chain("a"));
    tx.push(rule("a", "ip daddr 198.18.0.1 drop"));
    tx.push(rule("a", "jump nowhere"));
    tx.push(chain("b"));
    let err = nft.run(&tx).expect_err("a jump to a missing chain");
    let text = err.to_string();
    assert!(matches!(err, NftError::Rejected { family: Family::Ip, .. }), "{text}");
    assert!(text.contains("line 4: Could not process rule: No such file or directory"), "{text}");
    assert!(text.contains("  3 | add rule ip kube-proxy a ip daddr 198.18.0.1 drop"), "{text}");
    assert!(text.contains("> 4 | add rule ip kube-proxy a jump nowhere"), "{text}");
    assert!(text.contains("  5 | add chain ip kube-proxy b"), "{text}");
    assert!(err.is_not_found(), "knftables' IsNotFound holds for ENOENT: {text}");
    assert!(nft.check(&tx).is_err(), "--check refuses it too");
    assert_eq!(nft.list_table().expect("list"), None, "nothing of the transaction was applied");

    // nft's evaluation refuses two lines: both are named, the first with its context.
    let mut tx = Transaction::new();
    tx.push(Operation::AddTable);
    tx.push(chain("a"));
    tx.push(Operation::AddSet(Set {
        kind: SetKind::Set,
        name: "s".into(),
        set_type: "ipv4_addr".into(),
        flags: vec![],
        timeout_secs: None,
        comment: None,
    }));
    tx.push(rule("a", "ip daddr @nothing drop"));
    tx.push(rule("a", "ip daddr @s drop"));
    tx.push(rule("a", "bogus words"));
    let err = nft.run(&tx).expect_err("a missing set and a syntax error");
    let text = err.to_string();
    assert!(text.contains("line 4: No such file or directory"), "{text}");
    assert!(text.contains("line 6: "), "{text}");
    assert!(text.contains("> 4 | add rule ip kube-proxy a ip daddr @nothing drop"), "{text}");
    assert_eq!(nft.list_table().expect("list"), None, "nothing of the transaction was applied");

    // The kernel refuses an existing key with another value (EEXIST), not a not-found.
    let mut start = Transaction::new();
    start.push(Operation::AddTable);
    start.push(chain("a"));
    start.push(set(SetKind::Map, "m", "ipv4_addr . inet_proto . inet_service : verdict", Some("a map")));
    start.push(element(SetKind::Map, "m", &["198.18.0.1", "tcp", "80"], Some("goto a"), None));
    nft.run(&start).expect("the starting table");
    let before = nft.list_table().expect("list");
    let mut tx = Transaction::new();
    tx.push(chain("c"));
    tx.push(element(SetKind::Map, "m", &["198.18.0.2", "tcp", "80"], Some("drop"), None));
    tx.push(element(SetKind::Map, "m", &["198.18.0.1", "tcp", "80"], Some("drop"), Some("ns/svc:p")));
    let err = nft.run(&tx).expect_err("another value for an existing key");
    let text = err.to_string();
    assert!(text.contains("line 3: Could not process rule: File exists"), "{text}");
    assert!(
        text.contains("> 3 | add element ip kube-proxy m { 198.18.0.1 . tcp . 80 comment \"ns/svc:p\" : drop }"),
        "{text}"
    );
    assert!(!err.is_not_found(), "{text}");
    assert_eq!(nft.list_table().expect("list"), before, "nothing of the transaction was applied");
}

#[test]
fn cleanup_deletes_both_tables_and_nothing_else() {
    require_root!();
    let ns = Netns::create("nft-cleanup");
    // Nothing to clean: no error.
    assert!(cleanup_tables(Arc::new(RealExec), &options(&ns)).is_empty());
    for family in [Family::Ip, Family::Ip6] {
        let nft = runner(&ns, family);
        let mut tx = Transaction::new();
        tx.push(Operation::AddTable);
        tx.push(chain("services"));
        tx.push(base("nat-output", ChainType::Nat, Hook::Output, -100));
        tx.push(rule("nat-output", "jump services"));
        nft.run(&tx).expect("a table");
    }
    ns.ok(&["nft", "add", "table", "ip", "someone-else"]);
    // Upstream's table is in `ip` and `ip6` only: an `inet` one of the same name is not ours.
    ns.ok(&["nft", "add", "table", "inet", "kube-proxy"]);
    let tables = ns.ok(&["nft", "list", "tables"]);
    assert_eq!(tables.lines().count(), 4, "{tables}");
    assert!(cleanup_tables(Arc::new(RealExec), &options(&ns)).is_empty());
    let tables = ns.ok(&["nft", "list", "tables"]);
    assert_eq!(tables.trim(), "table ip someone-else\ntable inet kube-proxy", "only ours are gone");
    // A second cleanup finds nothing and is fine.
    assert!(cleanup_tables(Arc::new(RealExec), &options(&ns)).is_empty());
    // Without a usable nft the families are skipped, not failed.
    let missing = NftOptions { program: "/nonexistent/nft".into(), ..options(&ns) };
    assert!(cleanup_tables(Arc::new(RealExec), &missing).is_empty());
}

/// A small deterministic generator (xorshift64*), so failures replay.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

const CHAINS: usize = 5;

/// One random operation of the kinds kube-proxy uses. Chains are ordered (`c0` … `c4`, the
/// base chain `in` before them): a rule or map element only ever jumps forward, so no loop
/// can form (the kernel refuses loops; kube-proxy never makes one). Maps are used only from
/// the base chain for the same reason.
fn random_op(rng: &mut Rng, family: Family) -> Operation {
    let x = family.addr_selector();
    let addr = |rng: &mut Rng| match family {
        Family::Ip => format!("198.18.0.{}", rng.below(4) + 1),
        Family::Ip6 => format!("fd00:18::{}", rng.below(4) + 1),
    };
    let prefix = match family {
        Family::Ip => "198.18.0.0/24",
        Family::Ip6 => "fd00:18::/64",
    };
    let chain_name = |i: usize| format!("c{i}");
    let later = |rng: &mut Rng, from: Option<usize>| {
        let first = from.map_or(0, |i| i + 1);
        if first >= CHAINS { None } else { Some(chain_name(first + rng.below(CHAINS - first))) }
    };
    let verdict = |rng: &mut Rng| match rng.below(3) {
        0 => "drop".to_string(),
        _ => format!("goto {}", chain_name(rng.below(CHAINS))),
    };
    match rng.below(16) {
        0 => Operation::AddTable,
        1 => Operation::DeleteTable,
        2 | 3 => {
            if rng.chance(15) {
                base("in", ChainType::Filter, Hook::Input, if rng.chance(80) { 0 } else { 10 })
            } else if rng.chance(10) {
                chain("in") // a regular add of the base chain (upstream's add+delete at start)
            } else if rng.chance(25) {
                // Comments on chains; a second add with another comment changes nothing.
                let comment = if rng.chance(50) { "a chain" } else { "another comment" };
                Operation::AddChain(Chain {
                    name: chain_name(rng.below(CHAINS)),
                    base: None,
                    comment: Some(comment.into()),
                })
            } else {
                chain(&chain_name(rng.below(CHAINS)))
            }
        }
        4 => Operation::FlushChain(if rng.chance(20) { "in".into() } else { chain_name(rng.below(CHAINS)) }),
        5 => Operation::DeleteChain(if rng.chance(10) { "in".into() } else { chain_name(rng.below(CHAINS)) }),
        6..=8 => {
            let from = if rng.chance(30) { None } else { Some(rng.below(CHAINS)) };
            let owner = from.map_or("in".to_string(), chain_name);
            let target = later(rng, from);
            let text = match (rng.below(9), target) {
                (0, Some(t)) => format!("{x} daddr {} jump {t}", addr(rng)),
                (1, Some(t)) => format!("goto {t}"),
                (2, Some(t)) => {
                    let other = later(rng, from).unwrap_or_else(|| t.clone());
                    format!("numgen random mod 2 vmap {{ 0 : goto {t} , 1 : goto {other} }}")
                }
                (3, _) => format!("{x} saddr @s0 drop"),
                (4, _) if from.is_none() => format!("{x} daddr . meta l4proto . th dport vmap @m0"),
                (5, _) if from.is_none() => "meta l4proto . th dport vmap @m1".to_string(),
                (6, _) => format!("{x} saddr != {{ {prefix} , {} }} mark set mark or 0x4000", addr(rng)),
                // The session-affinity shapes, on a set with a timeout.
                (7, _) => format!("update @a0 {{ {x} saddr }}"),
                (8, Some(t)) => format!("{x} saddr @a0 goto {t}"),
                _ => format!("{x} daddr {} counter drop", addr(rng)),
            };
            if rng.chance(20) { rule_c(&owner, &text, "a comment") } else { rule(&owner, &text) }
        }
        9 => match rng.below(4) {
            0 => set(SetKind::Set, "s0", family.addr_type(), Some("a set")),
            1 => Operation::AddSet(Set {
                kind: SetKind::Set,
                name: "a0".into(),
                set_type: family.addr_type().into(),
                // Adding the set again with another timeout (or none) replaces its timeout;
                // with other flags it is refused; another comment changes nothing.
                flags: if rng.chance(90) { vec!["dynamic".into(), "timeout".into()] } else { vec!["timeout".into()] },
                timeout_secs: match rng.below(3) {
                    0 => Some(10800),
                    1 => Some(60),
                    _ => None,
                },
                comment: rng.chance(50).then(|| "affinity".into()),
            }),
            2 => {
                set(SetKind::Map, "m0", &format!("{} . inet_proto . inet_service : verdict", family.addr_type()), None)
            }
            _ => set(SetKind::Map, "m1", "inet_proto . inet_service : verdict", Some("a map")),
        },
        10 => match rng.below(5) {
            0 => Operation::DeleteSet { kind: SetKind::Set, name: "s0".into() },
            1 => Operation::DeleteSet { kind: SetKind::Map, name: "m0".into() },
            2 => Operation::DeleteSet { kind: SetKind::Set, name: "a0".into() },
            3 => Operation::FlushSet { kind: SetKind::Set, name: "s0".into() },
            _ => Operation::FlushSet { kind: SetKind::Map, name: "m1".into() },
        },
        11..=13 => match rng.below(3) {
            0 => element(SetKind::Set, "s0", &[&addr(rng)], None, None),
            1 => {
                let a = addr(rng);
                let v = verdict(rng);
                element(SetKind::Map, "m0", &[&a, "tcp", "80"], Some(&v), rng.chance(30).then_some("ns/svc:p"))
            }
            _ => {
                let port = (30000 + rng.below(3)).to_string();
                let v = verdict(rng);
                element(SetKind::Map, "m1", &["udp", &port], Some(&v), None)
            }
        },
        14 => match rng.below(3) {
            0 => Operation::DeleteElement { kind: SetKind::Set, set: "s0".into(), key: vec![addr(rng)] },
            1 => Operation::DeleteElement {
                kind: SetKind::Map,
                set: "m0".into(),
                key: vec![addr(rng), "tcp".into(), "80".into()],
            },
            _ => Operation::DeleteElement {
                kind: SetKind::Map,
                set: "m1".into(),
                key: vec!["udp".into(), (30000 + rng.below(3)).to_string()],
            },
        },
        _ => {
            if rng.chance(50) {
                Operation::AddCounter("k0".into())
            } else {
                Operation::DeleteCounter("k0".into())
            }
        }
    }
}

/// The name of an operation's kind (`AddChain`, `DeleteElement`, …).
fn op_kind(op: &Operation) -> String {
    let debug = format!("{op:?}");
    debug.split(|c: char| !c.is_ascii_alphanumeric()).next().unwrap_or_default().to_string()
}

/// `FakeNftables` and the kernel (through the runner), fed the same random transactions,
/// accept and refuse the same ones (in `--check` and for real) and hold the same table after
/// each, as `nft list` shows it. The daemon's writer (netlink for what it encodes) is a third
/// party in a namespace of its own: it accepts and refuses as nft does and leaves the same
/// table.
#[test]
fn the_fake_and_the_kernel_agree_on_random_transactions() {
    require_root!();
    let mut disagreements = Vec::new();
    let (mut accepted, mut refused) = (0, 0);
    let mut kinds_accepted = std::collections::BTreeSet::new();
    let (mut netlink_accepted, mut netlink_refused) = (0, 0);
    for (seed, family) in [(1u64, Family::Ip), (2, Family::Ip6), (3, Family::Ip), (4, Family::Ip)] {
        let ns = Netns::create("nft-model");
        let nft = runner(&ns, family);
        let fake = FakeNftables::new(family);
        let writer_ns = Netns::create("nft-model-nl");
        let writer = netlink_writer(&writer_ns, family);
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ seed);
        // Start from a table with every object, so that most operations have something to
        // act on.
        let mut setup = Transaction::new();
        setup.push(Operation::AddTable);
        setup.push(base("in", ChainType::Filter, Hook::Input, 0));
        for i in 0..CHAINS {
            setup.push(chain(&format!("c{i}")));
        }
        setup.push(set(SetKind::Set, "s0", family.addr_type(), Some("a set")));
        setup.push(Operation::AddSet(Set {
            kind: SetKind::Set,
            name: "a0".into(),
            set_type: family.addr_type().into(),
            flags: vec!["dynamic".into(), "timeout".into()],
            timeout_secs: Some(10800),
            comment: None,
        }));
        setup.push(set(
            SetKind::Map,
            "m0",
            &format!("{} . inet_proto . inet_service : verdict", family.addr_type()),
            None,
        ));
        setup.push(set(SetKind::Map, "m1", "inet_proto . inet_service : verdict", Some("a map")));
        fake.run(&setup).expect("fake setup");
        nft.run(&setup).expect("kernel setup");
        writer.run(&setup).expect("writer setup");
        for round in 0..60 {
            let mut tx = Transaction::new();
            for _ in 0..1 + rng.below(4) {
                tx.push(random_op(&mut rng, family));
            }
            let checked_by_fake = fake.check(&tx).is_ok();
            let checked_by_kernel = nft.check(&tx).is_ok();
            if checked_by_fake != checked_by_kernel {
                disagreements.push(format!(
                    "seed {seed} round {round} ({family}): --check: fake {checked_by_fake}, kernel {checked_by_kernel}\n{}",
                    tx.text(family, true)
                ));
            }
            let by_fake = fake.run(&tx);
            let by_kernel = nft.run(&tx);
            let over_netlink = encode::transaction(family, &tx.ops).is_ok();
            let by_writer = writer.run(&tx);
            match (&by_kernel, &by_writer, over_netlink) {
                (Ok(()), Ok(()), true) => netlink_accepted += 1,
                (Err(_), Err(_), true) => netlink_refused += 1,
                (Ok(()), Ok(()), false) | (Err(_), Err(_), false) => {}
                _ => disagreements.push(format!(
                    "seed {seed} round {round} ({family}), writer over netlink: {over_netlink}:\n{}nft: {:?}\nwriter: {:?}\n",
                    tx.text(family, true),
                    by_kernel.as_ref().err().map(|e| e.to_string()),
                    by_writer.as_ref().err().map(|e| e.to_string()),
                )),
            }
            match (&by_fake, &by_kernel) {
                (Ok(()), Ok(())) => {
                    accepted += 1;
                    kinds_accepted.extend(tx.ops.iter().map(op_kind));
                }
                (Err(_), Err(_)) => refused += 1,
                _ => disagreements.push(format!(
                    "seed {seed} round {round} ({family}):\n{}fake: {:?}\nkernel: {:?}\n",
                    tx.text(family, true),
                    by_fake.as_ref().err().map(|e| e.to_string()),
                    by_kernel.as_ref().err().map(|e| e.to_string()),
                )),
            }
            let listed = nft.list_table().expect("list the kernel's table");
            let written = writer.list_table().expect("list the writer's table");
            if written != listed {
                disagreements.push(format!(
                    "seed {seed} round {round} ({family}): the writer's table differs after\n{}nft: {listed:#?}\nwriter: {written:#?}\n",
                    tx.text(family, true)
                ));
            }
            let expected = fake.list_table().expect("list the fake's table");
            if listed != expected {
                disagreements.push(format!(
                    "seed {seed} round {round} ({family}): tables differ after\n{}kernel: {listed:#?}\nfake: {expected:#?}\n",
                    tx.text(family, true)
                ));
                // Continue from what the kernel holds.
                fake.set_table(listed.unwrap_or_default());
            }
        }
    }
    assert!(disagreements.is_empty(), "{} disagreements:\n{}", disagreements.len(), disagreements.join("\n"));
    // Both answers were exercised, many times, and every kind of operation was applied.
    assert!(accepted >= 40 && refused >= 40, "accepted {accepted}, refused {refused}");
    let every_kind = [
        "AddTable",
        "DeleteTable",
        "AddChain",
        "FlushChain",
        "DeleteChain",
        "AddRule",
        "AddSet",
        "FlushSet",
        "DeleteSet",
        "AddElement",
        "DeleteElement",
        "AddCounter",
        "DeleteCounter",
    ];
    let missing: Vec<_> = every_kind.iter().filter(|k| !kinds_accepted.contains(**k)).collect();
    assert!(missing.is_empty(), "never applied: {missing:?}");
    assert!(
        netlink_accepted >= 20 && netlink_refused >= 10,
        "over netlink: accepted {netlink_accepted}, refused {netlink_refused}"
    );
}

/// The kernel's answers the model encodes, one case at a time (each against the same
/// starting table): the model and the kernel accept or refuse each alike.
#[test]
fn the_model_refuses_what_the_kernel_refuses() {
    require_root!();
    let family = Family::Ip;
    let verdicts = "ipv4_addr . inet_proto . inet_service : verdict";
    let affinity = |flags: &[&str], timeout_secs: Option<u64>| {
        Operation::AddSet(Set {
            kind: SetKind::Set,
            name: "affinity".into(),
            set_type: "ipv4_addr".into(),
            flags: flags.iter().map(|f| f.to_string()).collect(),
            timeout_secs,
            comment: Some("session affinity".into()),
        })
    };
    let start = Transaction {
        ops: vec![
            Operation::AddTable,
            base("nat-prerouting", ChainType::Nat, Hook::Prerouting, -100),
            chain("services"),
            chain("service-A"),
            chain("lone"),
            set(SetKind::Map, "service-ips", verdicts, None),
            set(SetKind::Set, "cluster-ips", "ipv4_addr", None),
            rule("nat-prerouting", "jump services"),
            rule("services", "ip daddr . meta l4proto . th dport vmap @service-ips"),
            rule("services", "ip daddr @cluster-ips counter"),
            rule("lone", "ip daddr 198.18.0.9 counter"),
            affinity(&["dynamic", "timeout"], Some(10800)),
            rule("service-A", "update @affinity { ip saddr }"),
            element(SetKind::Map, "service-ips", &["198.18.0.1", "tcp", "80"], Some("goto service-A"), None),
        ],
    };
    let cases: Vec<(&str, Vec<Operation>, bool)> = vec![
        (
            "add an element again with the same value",
            vec![element(SetKind::Map, "service-ips", &["198.18.0.1", "tcp", "80"], Some("goto service-A"), None)],
            true,
        ),
        (
            "add an element again with another value",
            vec![element(SetKind::Map, "service-ips", &["198.18.0.1", "tcp", "80"], Some("drop"), None)],
            false,
        ),
        (
            "change a value by delete then add",
            vec![
                Operation::DeleteElement {
                    kind: SetKind::Map,
                    set: "service-ips".into(),
                    key: vec!["198.18.0.1".into(), "tcp".into(), "80".into()],
                },
                element(SetKind::Map, "service-ips", &["198.18.0.1", "tcp", "80"], Some("drop"), None),
            ],
            true,
        ),
        (
            "delete a missing element",
            vec![Operation::DeleteElement {
                kind: SetKind::Set,
                set: "cluster-ips".into(),
                key: vec!["198.18.0.7".into()],
            }],
            false,
        ),
        ("delete a chain a map element points at", vec![Operation::DeleteChain("service-A".into())], false),
        ("delete a chain a rule jumps to", vec![Operation::DeleteChain("services".into())], false),
        ("delete a chain with rules nothing refers to", vec![Operation::DeleteChain("lone".into())], true),
        (
            "delete a set a rule uses",
            vec![Operation::DeleteSet { kind: SetKind::Set, name: "cluster-ips".into() }],
            false,
        ),
        (
            "delete a map a rule uses",
            vec![Operation::DeleteSet { kind: SetKind::Map, name: "service-ips".into() }],
            false,
        ),
        ("flush a chain something jumps to", vec![Operation::FlushChain("services".into())], true),
        ("a jump to a missing chain", vec![rule("lone", "jump nowhere")], false),
        ("a missing set", vec![rule("lone", "ip daddr @nothing drop")], false),
        (
            "an element pointing at a missing chain",
            vec![element(SetKind::Map, "service-ips", &["198.18.0.2", "tcp", "80"], Some("goto nowhere"), None)],
            false,
        ),
        ("a regular add of an existing base chain", vec![chain("nat-prerouting")], true),
        (
            "upstream's add and delete of a base chain holding rules",
            vec![chain("nat-prerouting"), Operation::DeleteChain("nat-prerouting".into())],
            true,
        ),
        (
            "a base chain again with another priority",
            vec![base("nat-prerouting", ChainType::Nat, Hook::Prerouting, -90)],
            false,
        ),
        ("a regular chain again as a base chain", vec![base("lone", ChainType::Filter, Hook::Input, 0)], false),
        ("a set again with another type", vec![set(SetKind::Set, "cluster-ips", "ipv6_addr", None)], false),
        ("a set again with other flags", vec![affinity(&["timeout"], Some(10800))], false),
        ("a set again with another timeout", vec![affinity(&["dynamic", "timeout"], Some(60))], true),
        ("a set again without its timeout", vec![affinity(&["dynamic", "timeout"], None)], true),
        ("delete the table", vec![Operation::DeleteTable], true),
        (
            "add a counter and delete it",
            vec![Operation::AddCounter("k".into()), Operation::DeleteCounter("k".into())],
            true,
        ),
        ("delete a missing counter", vec![Operation::DeleteCounter("k".into())], false),
    ];
    let mut disagreements = Vec::new();
    for (what, ops, kernel_accepts) in cases {
        let ns = Netns::create("nft-cases");
        let nft = runner(&ns, family);
        nft.run(&start).expect("the starting table");
        let mut model = TableState::default();
        model.apply(&start).expect("the model's starting table");
        let tx = Transaction { ops };
        let by_kernel = nft.run(&tx);
        let by_model = model.apply(&tx);
        assert_eq!(by_kernel.is_ok(), kernel_accepts, "{what}: the kernel's answer changed: {by_kernel:?}");
        if by_kernel.is_ok() != by_model.is_ok() {
            disagreements.push(format!("{what}: kernel {by_kernel:?}, model {by_model:?}"));
            continue;
        }
        let listed = nft.list_table().expect("list");
        if listed != model.exists.then(|| model.as_listed()) {
            disagreements.push(format!("{what}: the tables differ afterwards"));
        }
    }
    assert!(disagreements.is_empty(), "{}", disagreements.join("\n"));
}

/// `nft list table F kube-proxy`, as text and as the kernel's bytecode (`--debug=netlink`),
/// in `ns`.
fn listings(ns: &Netns, family: Family) -> (String, String) {
    let f = family.as_str();
    let text = ns.ok(&["nft", "list", "table", f, "kube-proxy"]);
    let bytecode = ns.ok(&["nft", "--debug=netlink", "list", "table", f, "kube-proxy"]);
    // What upstream's knftables reads (`nft --json list table`) reads the same too.
    let json = ns.ok(&["nft", "--json", "list", "table", f, "kube-proxy"]);
    (format!("{text}\n{json}"), sorted_element_runs(&anonymous_names_numbered(&bytecode)))
}

/// The bytecode listing with every anonymous set's name (`__map3`, `__set0`, or the netlink
/// writer's own `__k…`) replaced by `__anonN`, N counting names in order of first
/// appearance: two tables built alike name them alike, whoever picked the names (the
/// text listing never shows them).
fn anonymous_names_numbered(listing: &str) -> String {
    let mut names: Vec<String> = Vec::new();
    let mut out = String::with_capacity(listing.len());
    for (i, line) in listing.split('\n').enumerate() {
        if i > 0 {
            out.push('\n');
        }
        let words: Vec<String> = line
            .split(' ')
            .map(|word| {
                let (at, name) = word.strip_prefix('@').map_or(("", word), |rest| ("@", rest));
                if !(name.starts_with("__map") || name.starts_with("__set") || name.starts_with("__k")) {
                    return word.to_string();
                }
                let n = names.iter().position(|known| known == name).unwrap_or_else(|| {
                    names.push(name.to_string());
                    names.len() - 1
                });
                format!("{at}__anon{n}")
            })
            .collect();
        out.push_str(&words.join(" "));
    }
    out
}

/// The bytecode listing with each set's element lines sorted: the kernel walks a hash set in
/// an order of its own, which differs between two tables holding the same elements.
fn sorted_element_runs(listing: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    let mut run: Vec<&str> = Vec::new();
    for line in listing.lines() {
        if line.starts_with("\telement ") {
            run.push(line);
            continue;
        }
        run.sort_unstable();
        out.append(&mut run);
        out.push(line);
    }
    run.sort_unstable();
    out.append(&mut run);
    out.join("\n")
}

/// The lines only one of two listings has (for a failure message).
fn line_diff(ours: &str, nft: &str) -> String {
    let only = |a: &str, b: &str| a.lines().filter(|l| !b.lines().any(|m| m == *l)).collect::<Vec<_>>().join("\n");
    format!("\nonly in ours:\n{}\nonly in nft's:\n{}", only(ours, nft), only(nft, ours))
}

fn netlink_writer(ns: &Netns, family: Family) -> Arc<NetlinkNftables> {
    Arc::new(NetlinkNftables::new(Arc::new(runner(ns, family)), Arc::new(KernelNetlink::in_netns(ns.name.clone()))))
}

/// The netlink writer gives the kernel what nft gives it. Every rule shape upstream writes,
/// one operation per transaction, goes through nft in one namespace and through the writer in
/// another (over netlink for the forms it encodes, through nft for the rest); after each
/// operation both tables list the same, as text and as the kernel's bytecode.
#[test]
fn the_netlink_writer_writes_what_nft_writes() {
    require_root!();
    for family in [Family::Ip, Family::Ip6] {
        let reference_ns = Netns::create("nl-nft");
        let ours_ns = Netns::create("nl-ours");
        let reference = runner(&reference_ns, family);
        let writer = netlink_writer(&ours_ns, family);
        let mut encodable = 0;
        for op in every_rule_shape(family).ops {
            let tx = Transaction { ops: vec![op] };
            if encode::transaction(family, &tx.ops).is_ok() {
                encodable += 1;
            }
            reference.run(&tx).unwrap_or_else(|e| panic!("{family}: nft: {e}"));
            writer.run(&tx).unwrap_or_else(|e| panic!("{family}: the writer: {e}"));
            let (want_text, want_code) = listings(&reference_ns, family);
            let (text, code) = listings(&ours_ns, family);
            let line = tx.text(family, true);
            assert!(text == want_text, "{family}: after {line}{}", line_diff(&text, &want_text));
            assert!(code == want_code, "{family}: bytecode after {line}{}", line_diff(&code, &want_code));
        }
        let over_netlink = writer.stats.netlink.load(Ordering::Relaxed);
        assert_eq!(over_netlink, encodable, "{family}: every encodable operation went over netlink");
        // Chains, per-service rules, sets and elements: most of the shapes.
        assert!(over_netlink >= 45, "{family}: {over_netlink} operations over netlink");
    }
}

/// Anonymous maps the writer names itself: a second writer (a restarted daemon adopting the
/// table) names its maps apart from the first's, and both list as nft's would; should two
/// names ever meet, the kernel refuses the batch (the set is created exclusively) and
/// nothing changes, so no map is ever added to another's.
#[test]
fn writers_name_their_anonymous_maps_apart_and_a_clash_is_refused() {
    require_root!();
    let ns = Netns::create("nl-names");
    let family = Family::Ip;
    let setup = Transaction {
        ops: vec![
            Operation::AddTable,
            chain("endpoint-A"),
            chain("endpoint-B"),
            rule("endpoint-A", "meta l4proto tcp dnat to 198.19.0.1:80"),
            rule("endpoint-B", "meta l4proto tcp dnat to 198.19.0.2:80"),
        ],
    };
    runner(&ns, family).run(&setup).expect("the table, through nft");
    let service = |name: &str| Transaction {
        ops: vec![chain(name), rule(name, "numgen random mod 2 vmap { 0 : goto endpoint-A , 1 : goto endpoint-B }")],
    };
    let named = |prefix: &str| {
        NetlinkNftables::named(
            Arc::new(runner(&ns, family)),
            Arc::new(KernelNetlink::in_netns(ns.name.clone())),
            Some(AnonymousNames::with_prefix(prefix)),
        )
    };
    let first = named("__kT");
    first.run(&service("service-1")).expect("the first writer's map");
    let second = netlink_writer(&ns, family);
    second.run(&service("service-2")).expect("a second writer's map, named apart");
    assert_eq!(first.stats.netlink.load(Ordering::Relaxed) + second.stats.netlink.load(Ordering::Relaxed), 2);
    let text = ns.ok(&["nft", "list", "table", "ip", "kube-proxy"]);
    assert_eq!(
        text.matches("numgen random mod 2 vmap { 0 : goto endpoint-A, 1 : goto endpoint-B }").count(),
        2,
        "{text}"
    );

    let before = listings(&ns, family);
    let clash = named("__kT");
    let err = clash.run(&service("service-3")).expect_err("the name __kT0 exists");
    assert!(err.to_string().contains("File exists"), "{err}");
    assert_eq!(listings(&ns, family), before, "nothing of the refused batch was applied");
}

/// A partial sync's transaction (a new endpoint chain, the service chain rewritten, an old
/// endpoint chain flushed, elements changed) is one batch over netlink, and a batch the
/// kernel refuses changes nothing and names the operation.
#[test]
fn a_netlink_batch_is_atomic_and_names_what_the_kernel_refused() {
    require_root!();
    let ns = Netns::create("nl-atomic");
    let family = Family::Ip;
    let writer = netlink_writer(&ns, family);
    let svc = "service-ULMVA6XW-ns1/svc1/tcp/p80";
    let start = Transaction {
        ops: vec![
            Operation::AddTable,
            chain("mark-for-masquerade"),
            chain("endpoint-A"),
            chain(svc),
            set(SetKind::Map, "service-ips", "ipv4_addr . inet_proto . inet_service : verdict", Some("ips")),
            rule("endpoint-A", "meta l4proto tcp dnat to 198.19.0.1:80"),
            rule(svc, "numgen random mod 1 vmap { 0 : goto endpoint-A }"),
            element(SetKind::Map, "service-ips", &["198.18.0.41", "tcp", "80"], Some(&format!("goto {svc}")), None),
        ],
    };
    writer.run(&start).expect("the starting table (through nft: it adds the table)");
    assert_eq!(writer.stats.cli.load(Ordering::Relaxed), 1);

    let change = Transaction {
        ops: vec![
            chain("endpoint-B"),
            rule("endpoint-B", "ip saddr 198.19.0.2 jump mark-for-masquerade"),
            rule("endpoint-B", "meta l4proto tcp dnat to 198.19.0.2:80"),
            Operation::FlushChain(svc.into()),
            rule(svc, "ip daddr 198.18.0.41 tcp dport 80 ip saddr != 198.18.0.0/15 jump mark-for-masquerade"),
            rule(svc, "numgen random mod 2 vmap { 0 : goto endpoint-A , 1 : goto endpoint-B }"),
            Operation::FlushChain("endpoint-A".into()),
            Operation::DeleteElement {
                kind: SetKind::Map,
                set: "service-ips".into(),
                key: vec!["198.18.0.41".into(), "tcp".into(), "80".into()],
            },
            element(SetKind::Map, "service-ips", &["198.18.0.42", "tcp", "80"], Some(&format!("goto {svc}")), None),
        ],
    };
    let before = listings(&ns, family);
    let mut refused = change.clone();
    refused.ops.insert(3, rule("endpoint-B", "jump nowhere"));
    let err = writer.run(&refused).expect_err("a jump to a missing chain");
    assert_eq!(writer.stats.netlink.load(Ordering::Relaxed), 1, "sent over netlink");
    let text = err.to_string();
    assert!(text.contains("operation 4 of 10"), "{text}");
    assert!(text.contains("add rule ip kube-proxy endpoint-B jump nowhere"), "{text}");
    assert!(err.is_not_found(), "ENOENT reads as nft's not-found: {text}");
    assert_eq!(listings(&ns, family), before, "nothing of the refused batch was applied");

    writer.run(&change).expect("the change");
    assert_eq!(writer.stats.netlink.load(Ordering::Relaxed), 2);
    let listed = runner(&ns, family).list_table().expect("list").expect("table");
    let rules: Vec<&str> = listed.chains[svc].rules.iter().map(|(text, _)| text.as_str()).collect();
    assert_eq!(
        rules,
        [
            "ip daddr 198.18.0.41 tcp dport 80 ip saddr != 198.18.0.0/15 jump mark-for-masquerade",
            "numgen random mod 2 vmap { 0 : goto endpoint-A, 1 : goto endpoint-B }",
        ]
    );
    assert!(listed.chains["endpoint-A"].rules.is_empty(), "flushed");
    let keys: Vec<&str> = listed.sets["service-ips"].elements.keys().map(String::as_str).collect();
    assert_eq!(keys, ["198.18.0.42 . tcp . 80"]);
}
