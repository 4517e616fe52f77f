//! The packet tracer: what the node's rules do to one new connection, computed from the rules
//! text alone (upstream's test `tracePacket`, made precise and given to operators as
//! `kube-proxy-rs trace`). Pure: no I/O, used by the command and by the tests alike.
//!
//! [`ruleset`] loads `iptables-save` / `iptables-restore` text, [`rule`] parses one rule's
//! matches and target, [`engine`] follows the packet through the built-in chains, and
//! [`report`] is the result (`--json` and the human form).

pub mod engine;
pub mod report;
pub mod rule;
pub mod ruleset;

pub use engine::{Packet, TraceError, trace};
pub use report::{Destination, Step, Trace, Verdict};
pub use rule::Proto;
pub use ruleset::{LoadError, RuleSet};

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
