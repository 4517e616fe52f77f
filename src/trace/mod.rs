//! The packet tracer: what the node's rules do to one new connection, computed from the rules
//! text alone (upstream's test `tracePacket`, made precise and given to operators as
//! `kube-proxy-rs trace`). Pure: no I/O, used by the command and by the tests alike.
//!
//! [`ruleset`] loads `iptables-save` / `iptables-restore` text (checking every rule, keeping
//! its text, parsing it when a packet first reaches it), [`rule`] parses one rule's matches
//! and target, [`engine`] follows the packet through the built-in chains, and
//! [`report`] is the result (`--json` and the human form).

pub mod engine;
pub mod report;
pub mod rule;
pub mod ruleset;

pub(crate) use engine::TraceError;
pub use engine::{Packet, trace};
pub use report::{Trace, Verdict};
pub use rule::Proto;
pub(crate) use ruleset::LoadError;
pub use ruleset::RuleSet;

/// Loads `text` (assuming kube-proxy's jump rules when the built-in chains are empty) and
/// traces `pkt` through it.
pub fn trace_text(text: &str, pkt: &Packet, local_addresses: &[std::net::IpAddr]) -> Result<Trace, TraceTextError> {
    let mut rules = RuleSet::parse(text)?;
    rules.assume_jump_rules_if_missing();
    Ok(trace(&rules, pkt, local_addresses)?)
}

#[derive(Debug, thiserror::Error)]
pub enum TraceTextError {
    #[error("invalid rules: {0}")]
    Load(#[from] LoadError),
    #[error(transparent)]
    Trace(#[from] TraceError),
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;

    const NODE: &str = "192.168.0.2";

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn pkt(src: &str, dst: &str, dport: u16) -> Packet {
        Packet { src: ip(src), dst: ip(dst), dport, proto: Proto::Tcp, in_interface: None, out_interface: None }
    }

    fn run(text: &str, p: &Packet) -> Trace {
        trace_text(text, p, &[ip(NODE)]).unwrap_or_else(|e| panic!("{e}"))
    }

    fn dests(t: &Trace) -> Vec<(String, f64, bool)> {
        t.destinations.iter().map(|d| (d.address.clone(), d.probability, d.masquerade)).collect()
    }

    /// A ClusterIP with three endpoints, a NodePort, affinity-free, as render writes it.
    const CLUSTER: &str = r#"*filter
:KUBE-NODEPORTS - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
-A KUBE-SERVICES -m comment --comment "ns1/gone:p80 has no endpoints" -m tcp -p tcp -d 172.30.0.50 --dport 80 -j REJECT
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x00004000/0x00004000 -j ACCEPT
COMMIT
*nat
:KUBE-NODEPORTS - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-EXT-A - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-SEP-1 - [0:0]
:KUBE-SEP-2 - [0:0]
:KUBE-SEP-3 - [0:0]
:KUBE-SVC-A - [0:0]
-A KUBE-NODEPORTS -m comment --comment ns1/svc1:p80 -m tcp -p tcp --dport 30080 -j KUBE-EXT-A
-A KUBE-SERVICES -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d 172.30.0.41 --dport 80 -j KUBE-SVC-A
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-EXT-A -m comment --comment "masquerade traffic for ns1/svc1:p80 external destinations" -j KUBE-MARK-MASQ
-A KUBE-EXT-A -j KUBE-SVC-A
-A KUBE-MARK-MASQ -j MARK --or-mark 0x00004000
-A KUBE-POSTROUTING -m mark ! --mark 0x00004000/0x00004000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x00004000
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
-A KUBE-SEP-1 -m comment --comment ns1/svc1:p80 -s 10.180.0.4 -j KUBE-MARK-MASQ
-A KUBE-SEP-1 -m comment --comment ns1/svc1:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.0.4:8080
-A KUBE-SEP-2 -m comment --comment ns1/svc1:p80 -s 10.180.0.5 -j KUBE-MARK-MASQ
-A KUBE-SEP-2 -m comment --comment ns1/svc1:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.0.5:8080
-A KUBE-SEP-3 -m comment --comment ns1/svc1:p80 -s 10.180.1.6 -j KUBE-MARK-MASQ
-A KUBE-SEP-3 -m comment --comment ns1/svc1:p80 -m tcp -p tcp -j DNAT --to-destination 10.180.1.6:8080
-A KUBE-SVC-A -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp -p tcp -d 172.30.0.41 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ
-A KUBE-SVC-A -m comment --comment "ns1/svc1:p80 -> 10.180.0.4:8080" -m statistic --mode random --probability 0.3333333333 -j KUBE-SEP-1
-A KUBE-SVC-A -m comment --comment "ns1/svc1:p80 -> 10.180.0.5:8080" -m statistic --mode random --probability 0.5000000000 -j KUBE-SEP-2
-A KUBE-SVC-A -m comment --comment "ns1/svc1:p80 -> 10.180.1.6:8080" -j KUBE-SEP-3
COMMIT
"#;

    #[test]
    fn cluster_ip_from_a_pod_spreads_without_masquerade() {
        let t = run(CLUSTER, &pkt("10.0.1.9", "172.30.0.41", 80));
        assert_eq!(t.verdict, Verdict::Dnat);
        assert_eq!(
            dests(&t),
            vec![
                ("10.180.0.4:8080".into(), 0.333333333, false),
                ("10.180.0.5:8080".into(), 0.333333333, false),
                ("10.180.1.6:8080".into(), 0.333333333, false),
            ]
        );
        let sum: f64 = t.destinations.iter().map(|d| d.probability).sum();
        assert!((sum - 1.0).abs() < 1e-6, "{sum}");
        // The path starts at the assumed PREROUTING jump and reaches each endpoint chain.
        assert_eq!(t.path[0].chain, "PREROUTING");
        assert_eq!(t.path[0].line, None);
        assert!(t.path.iter().any(|s| s.chain == "KUBE-SVC-A" && s.target == "KUBE-SEP-3"));
    }

    #[test]
    fn cluster_ip_from_outside_the_cluster_cidr_is_masqueraded() {
        let t = run(CLUSTER, &pkt("192.168.5.5", "172.30.0.41", 80));
        assert!(t.destinations.iter().all(|d| d.masquerade), "{t:?}");
        assert_eq!(t.destinations.len(), 3);
    }

    #[test]
    fn hairpin_endpoint_to_itself_is_masqueraded() {
        let t = run(CLUSTER, &pkt("10.180.0.4", "172.30.0.41", 80));
        let d = dests(&t);
        assert_eq!(d[0], ("10.180.0.4:8080".into(), 0.333333333, true));
        assert!(!d[1].2 && !d[2].2, "{d:?}");
    }

    #[test]
    fn node_port_on_the_node_ip_and_from_the_node_itself() {
        let t = run(CLUSTER, &pkt("203.0.113.7", NODE, 30080));
        assert_eq!(t.verdict, Verdict::Dnat);
        assert!(t.destinations.iter().all(|d| d.masquerade));
        // Locally generated: nat OUTPUT (assumed jump) leads to the same place.
        let t = run(CLUSTER, &pkt(NODE, NODE, 30080));
        assert_eq!(t.destinations.len(), 3);
        assert_eq!(t.path[0].chain, "OUTPUT");
        // Not the node: not a node port.
        let t = run(CLUSTER, &pkt("203.0.113.7", "192.168.0.99", 30080));
        assert_eq!(t.verdict, Verdict::Accept);
        assert_eq!(dests(&t), vec![("192.168.0.99:30080".into(), 1.0, false)]);
    }

    #[test]
    fn service_without_endpoints_is_rejected_and_other_ports_pass() {
        let t = run(CLUSTER, &pkt("10.0.1.9", "172.30.0.50", 80));
        assert_eq!(t.verdict, Verdict::Reject);
        assert!(t.destinations.is_empty());
        assert_eq!(run(CLUSTER, &pkt("10.0.1.9", "172.30.0.41", 81)).verdict, Verdict::Accept);
    }

    #[test]
    fn affinity_rules_are_branches_that_a_first_packet_does_not_take() {
        let text = "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-A - [0:0]\n:KUBE-SEP-1 - [0:0]\n:KUBE-SEP-2 - [0:0]\n\
            -A KUBE-SERVICES -d 172.30.0.41/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-A\n\
            -A KUBE-SVC-A -m recent --rcheck --seconds 10800 --reap --name KUBE-SEP-1 --mask 255.255.255.255 --rsource -j KUBE-SEP-1\n\
            -A KUBE-SVC-A -m recent --rcheck --seconds 10800 --reap --name KUBE-SEP-2 --mask 255.255.255.255 --rsource -j KUBE-SEP-2\n\
            -A KUBE-SVC-A -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-1\n\
            -A KUBE-SVC-A -j KUBE-SEP-2\n\
            -A KUBE-SEP-1 -p tcp -m recent --set --name KUBE-SEP-1 --mask 255.255.255.255 --rsource -m tcp -j DNAT --to-destination 10.180.0.4:80\n\
            -A KUBE-SEP-2 -p tcp -m recent --set --name KUBE-SEP-2 --mask 255.255.255.255 --rsource -m tcp -j DNAT --to-destination 10.180.0.5:80\n\
            COMMIT\n";
        let t = run(text, &pkt("10.0.1.9", "172.30.0.41", 80));
        assert_eq!(dests(&t), vec![("10.180.0.4:80".into(), 0.5, false), ("10.180.0.5:80".into(), 0.5, false)]);
        let affinity: Vec<&str> = t.path.iter().filter(|s| s.affinity).map(|s| s.target.as_str()).collect();
        assert_eq!(affinity, vec!["KUBE-SEP-1", "KUBE-SEP-2"]);
        let json = t.to_json();
        assert!(json.contains(r#""affinity":true"#), "{json}");
    }

    #[test]
    fn filter_policy_drop_and_chain_errors() {
        let text = "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD DROP [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n";
        let t = run(text, &pkt("203.0.113.7", "10.1.1.1", 80));
        assert_eq!(t.verdict, Verdict::Drop);
        assert_eq!(t.path.last().unwrap().rule, ":FORWARD DROP (policy)");
        // To the node itself: INPUT, accepted.
        assert_eq!(run(text, &pkt("203.0.113.7", NODE, 80)).verdict, Verdict::Accept);

        let missing = "*nat\n:PREROUTING ACCEPT [0:0]\n-A PREROUTING -j KUBE-NOWHERE\nCOMMIT\n";
        let e = trace_text(missing, &pkt("203.0.113.7", NODE, 80), &[]).unwrap_err();
        assert!(e.to_string().contains("line 3") && e.to_string().contains("KUBE-NOWHERE"), "{e}");

        let unsupported =
            "*nat\n:PREROUTING ACCEPT [0:0]\n:X - [0:0]\n-A PREROUTING -p tcp -m set --match-set s src -j X\nCOMMIT\n";
        let e = trace_text(unsupported, &pkt("203.0.113.7", NODE, 80), &[]).unwrap_err();
        assert!(e.to_string().contains("line 4") && e.to_string().contains("-m set"), "{e}");

        let looping = "*nat\n:PREROUTING ACCEPT [0:0]\n:X - [0:0]\n-A PREROUTING -j X\n-A X -j X\nCOMMIT\n";
        assert!(matches!(
            trace_text(looping, &pkt("203.0.113.7", NODE, 80), &[]),
            Err(TraceTextError::Trace(TraceError::TooDeep { .. }))
        ));
    }

    #[test]
    fn interfaces_must_be_given_when_a_rule_needs_them() {
        let text = "*nat\n:PREROUTING ACCEPT [0:0]\n:M - [0:0]\n-A PREROUTING ! -i cbr0 -j M\n-A M -j DNAT --to-destination 10.0.0.1:1\nCOMMIT\n";
        let e = trace_text(text, &pkt("203.0.113.7", NODE, 80), &[]).unwrap_err();
        assert!(e.to_string().contains("--in-interface"), "{e}");
        let mut p = pkt("203.0.113.7", "10.9.9.9", 80);
        p.in_interface = Some("eth0".into());
        assert_eq!(trace_text(text, &p, &[]).unwrap().verdict, Verdict::Dnat);
        p.in_interface = Some("cbr0".into());
        assert_eq!(trace_text(text, &p, &[]).unwrap().verdict, Verdict::Accept);
    }

    #[test]
    fn goto_returns_to_the_caller_of_the_calling_chain() {
        let text = "*nat\n:PREROUTING ACCEPT [0:0]\n:A - [0:0]\n:B - [0:0]\n\
            -A PREROUTING -j A\n-A PREROUTING -j DNAT --to-destination 10.0.0.9:9\n\
            -A A -g B\n-A A -j DNAT --to-destination 10.0.0.1:1\n-A B -j RETURN\nCOMMIT\n";
        let t = trace_text(text, &pkt("203.0.113.7", "10.9.9.9", 80), &[]).unwrap();
        assert_eq!(dests(&t), vec![("10.0.0.9:9".into(), 1.0, false)]);
    }

    #[test]
    fn json_shape_is_the_contract() {
        let t = run(CLUSTER, &pkt("10.0.1.9", "172.30.0.41", 80));
        let v: serde_json::Value = serde_json::from_str(&t.to_json()).unwrap();
        let obj = v.as_object().unwrap();
        let mut keys: Vec<&String> = obj.keys().collect();
        keys.sort();
        assert_eq!(keys, vec!["destinations", "path", "verdict"]);
        assert_eq!(v["verdict"], "DNAT");
        let d = &v["destinations"][0];
        assert_eq!(d["address"], "10.180.0.4:8080");
        assert!(d["probability"].is_f64());
        assert_eq!(d["masquerade"], false);
        assert!(v["path"].as_array().unwrap().iter().all(|s| s["rule"].is_string() && s["table"].is_string()));
    }

    /// `CLUSTER` with `extra` (chain declarations and rules) added at the end of its nat
    /// table; returns the text and the 1-based line of the first added line.
    fn cluster_with_nat(extra: &str) -> (String, usize) {
        let at = CLUSTER.rfind("COMMIT\n").unwrap();
        let line = CLUSTER[..at].lines().count() + 1;
        (format!("{}{extra}{}", &CLUSTER[..at], &CLUSTER[at..]), line)
    }

    #[test]
    fn a_malformed_rule_in_a_chain_no_packet_enters_still_fails_the_load() {
        let (text, first) = cluster_with_nat(":OTHER - [0:0]\n-A OTHER -s 10.0.0.0/33 -j ACCEPT\n");
        let e = trace_text(&text, &pkt("10.0.1.9", "172.30.0.41", 80), &[ip(NODE)]).unwrap_err();
        assert!(e.to_string().starts_with(&format!("invalid rules: line {}: bad rule", first + 1)), "{e}");
        assert!(e.to_string().contains("10.0.0.0/33"), "{e}");
        let (text, first) = cluster_with_nat(":OTHER - [0:0]\n-A OTHER -m comment --comment \"open -j X\n");
        let e = RuleSet::parse(&text).unwrap_err();
        assert_eq!(e.line, first + 1, "{e}");
    }

    #[test]
    fn unsupported_rules_in_chains_no_packet_enters_do_not_change_the_verdict() {
        let (text, _) = cluster_with_nat(
            ":OTHER - [0:0]\n-A OTHER -m set --match-set blocked src -j DROP\n-A OTHER -j CT --notrack\n",
        );
        let p = pkt("10.0.1.9", "172.30.0.41", 80);
        let mut rules = RuleSet::parse(&text).unwrap();
        rules.assume_jump_rules_if_missing();
        let t = trace(&rules, &p, &[ip(NODE)]).unwrap();
        assert_eq!(t, run(CLUSTER, &p));
        assert_eq!(t.verdict, Verdict::Dnat);
        assert!(rules.chain("nat", "OTHER").unwrap().rules.iter().all(|r| !r.is_parsed()));
        // Reached, they stop the trace naming the rule.
        let (reached, first) = cluster_with_nat(
            ":OTHER - [0:0]\n-A OTHER -m set --match-set blocked src -j DROP\n-I KUBE-SERVICES 1 -j OTHER\n",
        );
        let e = trace_text(&reached, &p, &[ip(NODE)]).unwrap_err();
        assert!(e.to_string().starts_with(&format!("line {}: ", first + 1)) && e.to_string().contains("-m set"), "{e}");
    }

    #[test]
    fn rules_are_parsed_when_a_packet_first_reaches_them() {
        let mut rules = RuleSet::parse(CLUSTER).unwrap();
        rules.assume_jump_rules_if_missing();
        let all = |chain: &str| rules.chain("nat", chain).unwrap().rules.iter().all(|r| r.is_parsed());
        let none = |chain: &str| rules.chain("nat", chain).unwrap().rules.iter().all(|r| !r.is_parsed());
        assert!(none("KUBE-SERVICES") && none("KUBE-SVC-A") && none("KUBE-NODEPORTS"));
        // A miss walks KUBE-SERVICES and the node-port chain, nothing else.
        trace(&rules, &pkt("10.0.1.9", "172.30.0.99", 80), &[ip(NODE)]).unwrap();
        assert!(all("KUBE-SERVICES") && none("KUBE-SVC-A") && none("KUBE-SEP-1"));
        trace(&rules, &pkt("10.0.1.9", "172.30.0.41", 80), &[ip(NODE)]).unwrap();
        assert!(all("KUBE-SVC-A") && all("KUBE-SEP-1") && none("KUBE-NODEPORTS") && none("KUBE-EXT-A"));
    }

    /// Packets to every `-d ADDR ... --dport PORT` of `text`, from a pod, from outside and
    /// from the node, plus one to an address no rule names.
    fn packets_for(text: &str) -> Vec<Packet> {
        let mut targets: Vec<(IpAddr, u16, Proto)> = Vec::new();
        for line in text.lines().filter(|l| l.starts_with("-A ")) {
            let words = rule::split_words(line).unwrap();
            let after = |opt: &str| words.iter().position(|w| w == opt).and_then(|i| words.get(i + 1));
            let (Some(dst), Some(port), Some(proto)) = (after("-d"), after("--dport"), after("-p")) else { continue };
            let (Ok(dst), Ok(port), Some(proto)) =
                (dst.split('/').next().unwrap_or_default().parse(), port.parse(), Proto::parse(proto))
            else {
                continue;
            };
            targets.push((dst, port, proto));
        }
        targets.sort_by_key(|(ip, port, proto)| (*ip, *port, proto.as_str()));
        targets.dedup();
        let v6 = targets.first().is_some_and(|(ip, ..)| ip.is_ipv6());
        let (srcs, miss) = if v6 {
            (["fd00:10:64::50", "fd00:ffff::7", "fd00:192:168:10::11"], "fd00:30::ffff")
        } else {
            (["10.64.1.50", "203.0.113.7", "192.168.10.11"], "172.30.255.254")
        };
        targets.push((ip(miss), 80, Proto::Tcp));
        let mut out = Vec::new();
        for (dst, dport, proto) in targets {
            for src in srcs {
                out.push(Packet {
                    src: ip(src),
                    dst,
                    dport,
                    proto,
                    in_interface: Some("eth0".into()),
                    out_interface: Some("eth1".into()),
                });
            }
        }
        out
    }

    #[test]
    fn lazy_parsing_traces_exactly_as_parsing_everything_first_on_the_golden_rules() {
        let golden = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
        let local = [ip("192.168.10.11"), ip("fd00:192:168:10::11")];
        let (mut scenarios, mut dnat, mut left_unparsed) = (0, 0, 0);
        for entry in std::fs::read_dir(&golden).unwrap() {
            let dir = entry.unwrap().path();
            let Ok(text) = std::fs::read_to_string(dir.join("expected.rules")) else { continue };
            scenarios += 1;
            let mut lazy = RuleSet::parse(&text).unwrap();
            lazy.assume_jump_rules_if_missing();
            let mut eager = RuleSet::parse(&text).unwrap();
            eager.assume_jump_rules_if_missing();
            eager.parse_every_rule();
            for p in packets_for(&text) {
                let l = trace(&lazy, &p, &local);
                assert_eq!(l, trace(&eager, &p, &local), "{}: {p:?}", dir.display());
                dnat += usize::from(l.is_ok_and(|t| t.verdict == Verdict::Dnat));
            }
            // What was parsed lazily is what a fresh parse gives.
            for table in ["nat", "filter"] {
                for (_, chain) in lazy.chains(table) {
                    for r in &chain.rules {
                        if !r.is_parsed() {
                            left_unparsed += 1;
                            continue;
                        }
                        let fresh = rule::parse_rule(r.body()).map_err(|e| e.to_string());
                        assert_eq!(
                            r.rule().map_err(str::to_string),
                            fresh.as_ref().map_err(String::clone),
                            "{}",
                            r.text()
                        );
                    }
                }
            }
        }
        assert!(scenarios >= 20, "golden scenarios not found under {}", golden.display());
        assert!(dnat > 100, "only {dnat} packets were DNATed: the packets miss the services");
        assert!(left_unparsed > 0, "every rule was parsed: nothing was lazy");
    }

    #[test]
    fn ipv6_addresses_are_bracketed() {
        let text = "*nat\n:KUBE-SERVICES - [0:0]\n-A KUBE-SERVICES -d fd00:30::41/128 -p tcp -m tcp --dport 80 -j DNAT --to-destination [fd00:180::4]:8080\nCOMMIT\n";
        let t = trace_text(text, &pkt("fd00:1::9", "fd00:30::41", 80), &[]).unwrap();
        assert_eq!(dests(&t), vec![("[fd00:180::4]:8080".into(), 1.0, false)]);
        assert!(matches!(
            trace_text(text, &pkt("10.0.0.1", "fd00:30::41", 80), &[]),
            Err(TraceTextError::Trace(TraceError::MixedFamilies { .. }))
        ));
    }
}
