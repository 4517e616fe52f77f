//! `kube-proxy-rs --cleanup` on real iptables in a private network namespace, for both
//! backends: removes every chain and jump of ours, keeps everyone else's rules, and a second
//! run succeeds and changes nothing.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kube_proxy_rs::iptables::Iptables;
use kube_proxy_rs::iptables::runner::Backend;
use kube_proxy_rs::model::{IpFamily, NamespacedName};
use kube_proxy_rs::proxier::{Proxier, ProxierConfig, StaticInterfaces, SyncOutcome};
use kube_proxy_rs::tracker::testing::{ep, slice, svc};

use crate::require_root;
use crate::support::harness::{TEST_NODE_NAME, upstream_interfaces, upstream_render_config};
use crate::support::netns::Netns;

const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy-rs");

const FOREIGN: &str = "*nat\n:OTHER-OWNER - [0:0]\n-A OTHER-OWNER -d 198.18.0.1/32 -j RETURN\n-A PREROUTING -j OTHER-OWNER\nCOMMIT\n*filter\n:OTHER-FILTER - [0:0]\n-A OTHER-FILTER -s 203.0.113.0/24 -j ACCEPT\n-A INPUT -j OTHER-FILTER\nCOMMIT\n";

fn save_all(ns: &Netns, backend: &str) -> String {
    ns.ok(&[&format!("iptables-{backend}-save")])
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| format!("{l}\n"))
        .collect()
}

fn cleanup(ns: &Netns) -> (bool, String) {
    let out = ns.run(&[BIN, "--cleanup"]);
    (out.success(), out.combined())
}

#[test]
fn cleanup_removes_our_rules_only_and_is_idempotent() {
    require_root!();
    for (backend, name) in [(Backend::Nft, "nft"), (Backend::Legacy, "legacy")] {
        let ns = Netns::create(&format!("cleanup-{name}"));
        let out = ns.run_with_stdin(&[&format!("iptables-{name}-restore"), "--noflush"], FOREIGN);
        assert!(out.success(), "{name}: seeding: {}", out.combined());

        // Program a realistic rule set through the proxier.
        let runner: Arc<dyn Iptables> = Arc::new(ns.runner(backend, IpFamily::V4));
        let cfg = ProxierConfig {
            render: upstream_render_config(IpFamily::V4),
            hostname: TEST_NODE_NAME.into(),
            sync_period: Duration::from_secs(30),
        };
        let mut proxier = Proxier::new(cfg, runner, Arc::new(StaticInterfaces(upstream_interfaces())));
        proxier.on_services_synced();
        proxier.on_endpoint_slices_synced();
        let web = svc("ns1", "web").type_("LoadBalancer").cluster_ip("172.30.0.1").node_port("http", 80, 30080);
        let web = web.lb_ingress(&["203.0.113.7"]).source_ranges(&["198.18.0.0/15"]).build();
        let empty = svc("ns1", "empty").cluster_ip("172.30.0.2").tcp("http", 80).build();
        proxier.on_service_state(NamespacedName::of_object(&web.metadata), Some(&web));
        proxier.on_service_state(NamespacedName::of_object(&empty.metadata), Some(&empty));
        let eps = slice("ns1", "web", "web-1").tcp("http", 8080).endpoint(ep("10.1.0.1")).build();
        proxier.on_endpoint_slice_update(&eps, false);
        match proxier.sync(Instant::now()) {
            SyncOutcome::Synced(r) => assert!(r.result.is_ok(), "{name}: sync failed: {:?}", r.result),
            other => panic!("{name}: {other:?}"),
        }
        // The sync loop's canaries (its monitor creates them in mangle, nat and filter).
        for table in ["mangle", "nat", "filter"] {
            ns.ok(&[&format!("iptables-{name}"), "-t", table, "-N", "KUBE-PROXY-CANARY"]);
        }
        let before = save_all(&ns, name);
        assert!(before.contains(":KUBE-SVC-"), "{name}: nothing installed:\n{before}");
        assert_eq!(before.matches(":KUBE-PROXY-CANARY").count(), 3, "{name}:\n{before}");

        let (ok, log) = cleanup(&ns);
        assert!(ok, "{name}: --cleanup failed: {log}");
        let after = save_all(&ns, name);
        let ours: Vec<&str> = after
            .lines()
            .filter(|l| l.contains("KUBE-") && !l.contains("KUBE-FIREWALL") && !l.contains("KUBE-KUBELET-CANARY"))
            .collect();
        assert!(ours.is_empty(), "{name}: left behind after --cleanup:\n{}", ours.join("\n"));
        for foreign in [
            "-A OTHER-OWNER -d 198.18.0.1/32 -j RETURN",
            "-A PREROUTING -j OTHER-OWNER",
            "-A OTHER-FILTER -s 203.0.113.0/24 -j ACCEPT",
            "-A INPUT -j OTHER-FILTER",
        ] {
            assert!(after.contains(foreign), "{name}: foreign rule {foreign:?} lost:\n{after}");
        }

        let (ok, log) = cleanup(&ns);
        assert!(ok, "{name}: second --cleanup failed: {log}");
        assert_eq!(save_all(&ns, name), after, "{name}: second --cleanup changed something");
    }
}
