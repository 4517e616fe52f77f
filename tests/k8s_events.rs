//! Watch events (as kube-runtime's watcher yields them) drive the proxiers correctly: nothing
//! is synced before both lists are in, updates apply, and a re-list after a dropped watch or a
//! 410 Gone deletes what disappeared during the outage, so the rules match the API exactly.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher::Event;
use kube_proxy_rs::daemon::runner::BoundedFrequencyRunner;
use kube_proxy_rs::daemon::sync_loop::{SharedProxier, lock};
use kube_proxy_rs::iptables::fake::FakeIptables;
use kube_proxy_rs::k8s::{NodeEvents, ProxierSet, ServiceEvents, SliceEvents};
use kube_proxy_rs::model::IpFamily;
use kube_proxy_rs::proxier::SyncOutcome;
use kube_proxy_rs::tracker::testing::{node, slice, svc};

use crate::support::harness::{TEST_NODE_NAME, TestProxier, proxier_set_member, shared_test_proxier};

struct Cluster {
    proxier: SharedProxier,
    ipt: Arc<FakeIptables>,
    set: ProxierSet,
    // Keeps the handles' runner alive (the loop itself is not run: tests sync by hand).
    _runner: BoundedFrequencyRunner,
    services: ServiceEvents,
    slices: SliceEvents,
    nodes: NodeEvents,
    now: Instant,
}

impl Cluster {
    fn new() -> Cluster {
        let (proxier, ipt, runner) = shared_test_proxier();
        let set = ProxierSet::new(vec![proxier_set_member(&proxier, runner.handle())]);
        Cluster {
            proxier,
            ipt,
            set,
            _runner: runner,
            services: ServiceEvents::default(),
            slices: SliceEvents::default(),
            nodes: NodeEvents::default(),
            now: Instant::now(),
        }
    }

    fn svc(&mut self, e: Event<Service>) {
        self.services.handle(e, &self.set);
    }

    fn slice(&mut self, e: Event<EndpointSlice>) {
        self.slices.handle(e, &self.set);
    }

    fn sync(&mut self) -> Option<bool> {
        self.now += Duration::from_secs(31);
        match lock(&self.proxier).sync(self.now) {
            SyncOutcome::NotInitialized => None,
            SyncOutcome::Synced(r) => {
                assert!(r.result.is_ok(), "{:?}", r.result);
                Some(r.full)
            }
        }
    }
}

fn web(ip: &str) -> Service {
    svc("ns1", "web").cluster_ip(ip).tcp("http", 80).build()
}

fn web_slice(ips: &[&str]) -> EndpointSlice {
    slice("ns1", "web", "web-1").tcp("http", 8080).ips(ips).build()
}

/// The kernel state a fresh proxier produces for exactly these objects.
fn reference(services: &[Service], slices: &[EndpointSlice]) -> String {
    let mut fp = TestProxier::new(IpFamily::V4);
    fp.add_services(services);
    fp.add_slices(slices);
    fp.sync();
    fp.ipt.save_all()
}

#[test]
fn nothing_syncs_until_both_lists_are_in() {
    let mut c = Cluster::new();
    c.svc(Event::Init);
    c.svc(Event::InitApply(web("172.30.0.1")));
    c.svc(Event::InitDone);
    assert_eq!(c.sync(), None, "endpoint slices not listed yet");
    c.slice(Event::Init);
    c.slice(Event::InitApply(web_slice(&["10.1.0.1"])));
    c.slice(Event::InitDone);
    assert_eq!(c.sync(), Some(true));
    assert_eq!(c.ipt.save_all(), reference(&[web("172.30.0.1")], &[web_slice(&["10.1.0.1"])]));
}

#[test]
fn updates_and_deletes_apply() {
    let mut c = Cluster::new();
    for e in [Event::Init, Event::InitApply(web("172.30.0.1")), Event::InitDone] {
        c.svc(e);
    }
    for e in [Event::Init, Event::InitApply(web_slice(&["10.1.0.1"])), Event::InitDone] {
        c.slice(e);
    }
    c.sync();
    c.svc(Event::Apply(web("172.30.0.9")));
    c.slice(Event::Apply(web_slice(&["10.1.0.2", "10.1.0.3"])));
    assert_eq!(c.sync(), Some(false));
    assert_eq!(c.ipt.save_all(), reference(&[web("172.30.0.9")], &[web_slice(&["10.1.0.2", "10.1.0.3"])]));
    c.slice(Event::Delete(web_slice(&["10.1.0.2", "10.1.0.3"])));
    c.svc(Event::Delete(web("172.30.0.9")));
    c.sync();
    assert_eq!(c.ipt.save_all(), reference(&[], &[]));
}

#[test]
fn relist_after_an_outage_loses_nothing() {
    let mut c = Cluster::new();
    let api = svc("ns1", "api").cluster_ip("172.30.0.2").tcp("http", 80).build();
    let api_slice = slice("ns1", "api", "api-1").tcp("http", 8080).ips(&["10.2.0.1"]).build();
    for e in [Event::Init, Event::InitApply(web("172.30.0.1")), Event::InitApply(api.clone()), Event::InitDone] {
        c.svc(e);
    }
    for e in
        [Event::Init, Event::InitApply(web_slice(&["10.1.0.1"])), Event::InitApply(api_slice.clone()), Event::InitDone]
    {
        c.slice(e);
    }
    c.sync();

    // The watch drops (or answers 410 Gone); meanwhile api and its slice are deleted, db is
    // created and web's endpoints move. The watcher re-lists: Init, InitApply..., InitDone.
    let db = svc("ns2", "db").cluster_ip("172.30.0.3").udp("dns", 53).build();
    let db_slice = slice("ns2", "db", "db-1").udp("dns", 5353).ips(&["10.3.0.1"]).build();
    for e in [Event::Init, Event::InitApply(web("172.30.0.1")), Event::InitApply(db.clone()), Event::InitDone] {
        c.svc(e);
    }
    for e in
        [Event::Init, Event::InitApply(web_slice(&["10.1.0.7"])), Event::InitApply(db_slice.clone()), Event::InitDone]
    {
        c.slice(e);
    }
    assert_eq!(c.services.known(), 2);
    assert_eq!(c.slices.known(), 2);
    assert_eq!(c.sync(), Some(false), "a re-list is an ordinary partial sync");
    assert_eq!(c.ipt.save_all(), reference(&[web("172.30.0.1"), db], &[web_slice(&["10.1.0.7"]), db_slice]));
}

#[test]
fn node_label_changes_force_a_full_sync() {
    let mut c = Cluster::new();
    c.svc(Event::Init);
    c.svc(Event::InitDone);
    c.slice(Event::Init);
    c.slice(Event::InitDone);
    c.sync();
    assert_eq!(c.sync(), Some(false));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    let on_node = move |n: Option<&k8s_openapi::api::core::v1::Node>| {
        seen2.lock().expect("lock").push(n.and_then(|n| n.metadata.name.clone()));
    };
    let zone_a = node(TEST_NODE_NAME, &[("topology.kubernetes.io/zone", "a")], &[], &[]);
    c.nodes.handle(Event::Apply(zone_a.clone()), &c.set, &on_node);
    assert_eq!(c.sync(), Some(true));
    c.nodes.handle(Event::Apply(zone_a), &c.set, &on_node);
    assert_eq!(c.sync(), Some(false), "same labels: no full sync");
    // A re-list that no longer contains the node means it was deleted.
    c.nodes.handle(Event::Init, &c.set, &on_node);
    c.nodes.handle(Event::InitDone, &c.set, &on_node);
    assert_eq!(c.sync(), Some(true));
    assert_eq!(
        *seen.lock().expect("lock"),
        vec![Some(TEST_NODE_NAME.to_string()), Some(TEST_NODE_NAME.to_string()), None]
    );
}
