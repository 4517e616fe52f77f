//! A proxier wired to the fake iptables, set up like upstream's `NewFakeProxier` so upstream's
//! expected rules can be compared directly.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube_proxy_rs::iptables::fake::FakeIptables;
use kube_proxy_rs::model::{Cidr, IpFamily, NamespacedName};
use kube_proxy_rs::proxier::local_detect::LocalDetector;
use kube_proxy_rs::proxier::nodeport_addresses::NodePortAddresses;
use kube_proxy_rs::proxier::{Proxier, ProxierConfig, RenderConfig, StaticInterfaces, SyncOutcome, SyncReport};

pub const TEST_NODE_NAME: &str = "test-node";
pub const TEST_NODE_IP: &str = "192.168.0.2";
pub const TEST_NODE_IP_ALT: &str = "192.168.1.2";
pub const TEST_EXTERNAL_IP: &str = "192.168.99.11";
pub const TEST_NODE_IPV6: &str = "2001:db8::1";
pub const TEST_NODE_IPV6_ALT: &str = "2001:db8:1::2";

/// Upstream's fake proxier setup: pod CIDR 10.0.0.0/8 (fd00:10::/64), mark `0x4000`, node IP
/// 192.168.0.2, localhost NodePorts on, nodePortAddresses matching everything, no
/// `--random-fully`.
pub fn upstream_render_config(family: IpFamily) -> RenderConfig {
    let (pod_cidr, node_ip) = match family {
        IpFamily::V4 => ("10.0.0.0/8", TEST_NODE_IP),
        IpFamily::V6 => ("fd00:10::/64", TEST_NODE_IPV6),
    };
    RenderConfig {
        family,
        masquerade_all: false,
        masquerade_mark: "0x4000".into(),
        localhost_nodeports: true,
        local_detector: LocalDetector::Cidr(Cidr::parse_sloppy(pod_cidr).expect("cidr")),
        node_ip: Some(node_ip.parse().expect("ip")),
        node_port_addresses: NodePortAddresses::new(family, &[]),
        random_fully: false,
        conntrack_tcp_liberal: false,
        features: kube_proxy_rs::compat::Features::of(kube_proxy_rs::compat::Release::V1_29),
    }
}

/// The interface addresses upstream's fake network reports.
pub fn upstream_interfaces() -> Vec<std::net::IpAddr> {
    ["127.0.0.1", "::1", TEST_NODE_IP, TEST_NODE_IP_ALT, TEST_EXTERNAL_IP, TEST_NODE_IPV6, TEST_NODE_IPV6_ALT]
        .iter()
        .map(|a| a.parse().expect("ip"))
        .collect()
}

/// A proxier shared the way the daemon shares it (for event-driven tests), on the fake
/// iptables, with an idle runner whose handle records sync requests.
pub fn shared_test_proxier() -> (
    kube_proxy_rs::daemon::sync_loop::SharedProxier,
    Arc<FakeIptables>,
    kube_proxy_rs::daemon::runner::BoundedFrequencyRunner,
) {
    let ipt = Arc::new(FakeIptables::new(IpFamily::V4));
    let cfg = ProxierConfig {
        render: upstream_render_config(IpFamily::V4),
        hostname: TEST_NODE_NAME.into(),
        sync_period: Duration::from_secs(30),
    };
    let proxier = Arc::new(std::sync::Mutex::new(Proxier::new(
        cfg,
        ipt.clone(),
        Arc::new(StaticInterfaces(upstream_interfaces())),
    )));
    let runner = kube_proxy_rs::daemon::runner::BoundedFrequencyRunner::new(
        "test",
        Duration::ZERO,
        Duration::from_secs(3600),
        kube_proxy_rs::daemon::runner::Pacing::Burst(2),
    )
    .expect("runner");
    (proxier, ipt, runner)
}

pub struct TestProxier {
    pub proxier: Proxier,
    pub ipt: Arc<FakeIptables>,
    now: Instant,
    /// Runs each sync's conntrack cleanup right after it (the daemon hands it to a cleaner).
    conntrack: Option<Arc<dyn kube_proxy_rs::node::conntrack::Conntrack>>,
    /// The cleanup run after the last sync, if it left one that did something.
    pub last_cleanup: Option<kube_proxy_rs::node::conntrack::cleaner::CleanupRun>,
}

impl TestProxier {
    pub fn new(family: IpFamily) -> Self {
        Self::with_config(upstream_render_config(family))
    }

    /// Upstream's fake proxier setup behaving as `release`.
    pub fn with_release(family: IpFamily, release: kube_proxy_rs::compat::Release) -> Self {
        let mut render = upstream_render_config(family);
        render.features = kube_proxy_rs::compat::Features::of(release);
        Self::with_config(render)
    }

    pub fn with_config(render: RenderConfig) -> Self {
        let family = render.family;
        let ipt = Arc::new(FakeIptables::new(family));
        ipt.set_has_random_fully(render.random_fully);
        let cfg = ProxierConfig { render, hostname: TEST_NODE_NAME.into(), sync_period: Duration::from_secs(30) };
        let proxier =
            Proxier::new(cfg, ipt.clone(), Arc::new(StaticInterfaces(upstream_interfaces()))).with_payload_recording();
        proxier.on_services_synced();
        proxier.on_endpoint_slices_synced();
        TestProxier { proxier, ipt, now: Instant::now(), conntrack: None, last_cleanup: None }
    }

    /// The same proxier, running each sync's conntrack cleanup through `ct` right after it.
    pub fn with_conntrack(self, ct: Arc<dyn kube_proxy_rs::node::conntrack::Conntrack>) -> Self {
        TestProxier { conntrack: Some(ct), ..self }
    }

    /// The reconciler's run after the last sync, when it ran and listed the table.
    #[allow(dead_code)]
    pub fn last_reconcile(&self) -> Option<kube_proxy_rs::node::conntrack::cleaner::ConntrackReconcile> {
        self.last_cleanup.as_ref().and_then(|run| run.reconcile())
    }

    pub fn add_services(&mut self, services: &[Service]) {
        for s in services {
            self.proxier.on_service_state(NamespacedName::of_object(&s.metadata), Some(s));
        }
    }

    pub fn update_service(&mut self, _old: &Service, new: &Service) {
        self.proxier.on_service_state(NamespacedName::of_object(&new.metadata), Some(new));
    }

    pub fn delete_service(&mut self, old: &Service) {
        self.proxier.on_service_state(NamespacedName::of_object(&old.metadata), None);
    }

    pub fn add_slices(&mut self, slices: &[EndpointSlice]) {
        for s in slices {
            self.proxier.on_endpoint_slice_update(s, false);
        }
    }

    pub fn delete_slice(&mut self, s: &EndpointSlice) {
        self.proxier.on_endpoint_slice_update(s, true);
    }

    pub fn set_node(&mut self, node: &Node) {
        self.proxier.on_node_update(Some(node));
    }

    /// Runs one sync, which must succeed, a sync period after the previous one (so it looks
    /// for stale chains, in large-cluster mode too).
    #[track_caller]
    pub fn sync(&mut self) -> SyncReport {
        self.sync_after(Duration::from_secs(31))
    }

    /// Runs one sync, which must succeed, `elapsed` after the previous one.
    #[track_caller]
    pub fn sync_after(&mut self, elapsed: Duration) -> SyncReport {
        self.now += elapsed;
        match self.proxier.sync(self.now) {
            SyncOutcome::Synced(report) => {
                if let Err(e) = &report.result {
                    panic!("sync failed: {e}\npayload:\n{}", report.payload.as_deref().unwrap_or_default());
                }
                self.last_cleanup = match (&self.conntrack, &report.conntrack_cleanup) {
                    (Some(ct), Some(job)) => job.run(ct.as_ref()),
                    _ => None,
                };
                *report
            }
            SyncOutcome::NotInitialized => panic!("proxier not initialized"),
        }
    }

    /// Syncs and returns the restore payload.
    #[track_caller]
    pub fn sync_payload(&mut self) -> String {
        self.sync().payload.expect("the test proxier records payloads")
    }
}

/// A [`kube_proxy_rs::k8s::ProxierSet`] member for `proxier`: its recorder, and a sync request
/// that runs `handle`.
#[allow(dead_code)]
pub fn proxier_set_member(
    proxier: &kube_proxy_rs::daemon::sync_loop::SharedProxier,
    handle: kube_proxy_rs::daemon::runner::RunnerHandle,
) -> (Arc<dyn kube_proxy_rs::k8s::ChangeSink>, kube_proxy_rs::k8s::SyncRequest) {
    let recorder = proxier.lock().unwrap_or_else(std::sync::PoisonError::into_inner).recorder();
    (recorder, Arc::new(move || handle.run()))
}
