//! The sync loop against real iptables in a private network namespace, both backends:
//! it programs the rules on start, and when someone flushes our chains and deletes the
//! canaries it repairs everything with a full resync within one sync period; on shutdown it
//! removes the canaries and leaves the service rules in place.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube_proxy_rs::daemon::sync_loop::{SyncLoop, lock};
use kube_proxy_rs::iptables::Iptables;
use kube_proxy_rs::iptables::runner::Backend;
use kube_proxy_rs::model::{IpFamily, NamespacedName};
use kube_proxy_rs::proxier::{Proxier, ProxierConfig, StaticInterfaces};
use kube_proxy_rs::tracker::testing::{ep, slice, svc};
use tokio_util::sync::CancellationToken;

use crate::require_root;
use crate::support::harness::{TEST_NODE_NAME, upstream_interfaces, upstream_render_config};
use crate::support::netns::Netns;
use crate::support::poll::poll_until;

const SYNC_PERIOD: Duration = Duration::from_secs(2);

/// How often the waits below check the namespace's rules (each check runs iptables-save).
const POLL: Duration = Duration::from_millis(100);

fn programmed(ns: &Netns, backend: &str) -> bool {
    let nat = ns.ok(&[&format!("iptables-{backend}-save"), "-t", "nat"]);
    nat.contains("-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES")
        && nat.contains("--to-destination 10.1.0.1:8080")
        && nat.contains(":KUBE-PROXY-CANARY")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushed_rules_are_repaired_within_one_sync_period() {
    require_root!();
    for (backend, name) in [(Backend::Nft, "nft"), (Backend::Legacy, "legacy")] {
        let ns = Netns::create(&format!("loop-{name}"));
        let runner: Arc<dyn Iptables> = Arc::new(ns.runner(backend, IpFamily::V4));
        let cfg = ProxierConfig {
            render: upstream_render_config(IpFamily::V4),
            hostname: TEST_NODE_NAME.into(),
            sync_period: SYNC_PERIOD,
        };
        let proxier =
            Arc::new(Mutex::new(Proxier::new(cfg, runner.clone(), Arc::new(StaticInterfaces(upstream_interfaces())))));
        {
            let p = lock(&proxier);
            let web = svc("ns1", "web").cluster_ip("172.30.0.1").tcp("http", 80).build();
            p.on_service_state(NamespacedName::of_object(&web.metadata), Some(&web));
            p.on_endpoint_slice_update(
                &slice("ns1", "web", "web-1").tcp("http", 8080).endpoint(ep("10.1.0.1")).build(),
                false,
            );
            p.on_services_synced();
            p.on_endpoint_slices_synced();
        }
        let sync_loop =
            SyncLoop::new(proxier.clone(), runner.clone(), Duration::from_millis(100), SYNC_PERIOD).expect("sync loop");
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(sync_loop.run(shutdown.clone(), |_| {}));

        let took = poll_until(Duration::from_secs(10), POLL, || programmed(&ns, name)).await;
        assert!(took.is_some(), "{name}: rules never programmed");

        // A firewall reload: our nat rules flushed, the canaries deleted everywhere.
        let ipt = format!("iptables-{name}");
        ns.ok(&[&ipt, "-t", "nat", "-F"]);
        for table in ["mangle", "nat", "filter"] {
            ns.ok(&[&ipt, "-t", table, "-X", "KUBE-PROXY-CANARY"]);
        }
        assert!(!programmed(&ns, name));
        let took = poll_until(SYNC_PERIOD * 3, POLL, || programmed(&ns, name)).await;
        let took = took.unwrap_or_else(|| panic!("{name}: flushed rules not repaired"));
        // Detection takes at most one sync period (the canary poll); the slack covers the sync.
        assert!(took <= SYNC_PERIOD + Duration::from_secs(2), "{name}: repair took {took:?}");

        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("loop stops")
            .expect("loop task")
            .expect("no sync panicked");
        let nat = ns.ok(&[&format!("iptables-{name}-save"), "-t", "nat"]);
        assert!(!nat.contains("KUBE-PROXY-CANARY"), "{name}: canary left after shutdown");
        assert!(nat.contains("--to-destination 10.1.0.1:8080"), "{name}: service rules must stay after shutdown");
    }
}
