//! [`ChangeRecorder`]: the inbox of one proxier. Watch handlers record Service, EndpointSlice
//! and Node changes into it; the proxier's sync drains it. It has its own short lock, held
//! only while a change is recorded or the pending changes are taken out, never while rules
//! are rendered or written, so a sync that takes minutes never makes a handler (or the async
//! runtime thread it runs on) wait. This is upstream's split: change trackers behind their own
//! mutexes, the proxier's sync behind another.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;

use super::{EndpointChangeTracker, EndpointChanges, ServiceChangeTracker, ServiceChanges};
use crate::compat::Features;
use crate::model::{InvalidService, IpFamily, NamespacedName};
use crate::tracker::topology::LABEL_TOPOLOGY_ZONE;

/// Observes the change trackers the way upstream's change metrics do.
pub trait ChangeObserver: Send + Sync {
    /// A Service event was recorded; `pending` Services now have unapplied changes.
    fn service_change(&self, pending: usize);
    /// An EndpointSlice event of this recorder's address type was recorded; `change_needed`
    /// says whether it changed anything.
    fn endpoint_slice_change(&self, change_needed: bool);
}

/// Everything recorded since the last drain.
#[derive(Debug, Default)]
pub struct DrainedChanges {
    pub services: ServiceChanges,
    pub endpoints: EndpointChanges,
    /// This node's labels as last recorded (`None`: no Node seen).
    pub node_labels: Option<BTreeMap<String, String>>,
    /// The next sync must write everything (node labels changed, or a full resync was asked
    /// for).
    pub full_sync: bool,
    /// The kernel may no longer hold what was written (our rules were flushed from outside):
    /// what it holds must be read again.
    pub kernel_changed: bool,
}

#[derive(Debug)]
struct Pending {
    services: ServiceChangeTracker,
    endpoints: EndpointChangeTracker,
    node_labels: Option<BTreeMap<String, String>>,
    services_synced: bool,
    endpoint_slices_synced: bool,
    full_sync: bool,
    kernel_changed: bool,
}

/// The change trackers of one IP family's proxier, behind one short lock.
pub struct ChangeRecorder {
    family: IpFamily,
    /// The release whose reading of Services applies.
    features: Features,
    hostname: String,
    pending: Mutex<Pending>,
    /// Told about every recorded change (the change metrics); `None` in `render`.
    observer: Option<Arc<dyn ChangeObserver>>,
}

impl std::fmt::Debug for ChangeRecorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChangeRecorder").field("family", &self.family).field("hostname", &self.hostname).finish()
    }
}

impl ChangeRecorder {
    /// A recorder for `family` on the node named `hostname` (its endpoints are local),
    /// reading Services as the release in `features` does. The first drain asks for a full
    /// sync and a fresh read of the kernel.
    pub fn new(
        family: IpFamily,
        features: Features,
        hostname: impl Into<String>,
        observer: Option<Arc<dyn ChangeObserver>>,
    ) -> Self {
        let hostname = hostname.into();
        ChangeRecorder {
            family,
            features,
            pending: Mutex::new(Pending {
                services: ServiceChangeTracker::new(family, features),
                endpoints: EndpointChangeTracker::new(hostname.clone(), family).with_release(features.release),
                node_labels: None,
                services_synced: false,
                endpoint_slices_synced: false,
                full_sync: true,
                kernel_changed: true,
            }),
            hostname,
            observer,
        }
    }

    pub fn family(&self) -> IpFamily {
        self.family
    }

    fn lock(&self) -> MutexGuard<'_, Pending> {
        // Recording cannot leave the trackers half-updated in a way a later record or drain
        // could not cope with; a panic elsewhere must not stop every watch.
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records the current state of a Service (`None`: deleted). Returns whether a sync is
    /// wanted.
    pub(crate) fn on_service(&self, service: NamespacedName, current: Option<&Service>) -> bool {
        let mut p = self.lock();
        let changed = p.services.record(service, current);
        if let Some(o) = &self.observer {
            o.service_change(p.services.pending());
        }
        changed && p.initialized()
    }

    /// Records an EndpointSlice add/update, or its deletion. Returns whether a sync is wanted.
    pub(crate) fn on_endpoint_slice(&self, slice: &EndpointSlice, removed: bool) -> bool {
        let mut p = self.lock();
        let changed = p.endpoints.endpoint_slice_update(slice, removed);
        if let Some(o) = &self.observer
            && slice.address_type == self.family.slice_address_type()
        {
            o.endpoint_slice_change(changed);
        }
        changed && p.initialized()
    }

    /// Services have been listed once. Returns whether both kinds now have been.
    pub fn on_services_synced(&self) -> bool {
        let mut p = self.lock();
        p.services_synced = true;
        p.initialized()
    }

    /// EndpointSlices have been listed once. Returns whether both kinds now have been.
    pub fn on_endpoint_slices_synced(&self) -> bool {
        let mut p = self.lock();
        p.endpoint_slices_synced = true;
        p.initialized()
    }

    /// Records this node's labels; a change forces the next sync to be full (topology may
    /// move endpoints in or out of every service). Returns whether a sync is wanted.
    pub fn on_node(&self, node: Option<&Node>) -> bool {
        if let Some(n) = node
            && n.metadata.name.as_deref() != Some(self.hostname.as_str())
        {
            tracing::error!(
                event_node = n.metadata.name.as_deref().unwrap_or(""),
                current_node = %self.hostname,
                "received a watch event for a node that doesn't match the current node"
            );
            return false;
        }
        if self.features.release.tracks_only_topology_labels() {
            return self.on_node_topology(node);
        }
        let labels = node.map(|n| n.metadata.labels.clone().unwrap_or_default());
        let mut p = self.lock();
        if labels == p.node_labels {
            return false;
        }
        p.node_labels = labels;
        p.full_sync = true;
        true
    }

    /// [`ChangeRecorder::on_node`] from 1.34 (upstream's `NodeTopologyConfig`): only the
    /// zone label is kept, so a change to any other label (or an informer resync) costs no
    /// full sync; a deleted Node changes nothing; a Node without a zone is the start state.
    fn on_node_topology(&self, node: Option<&Node>) -> bool {
        let Some(node) = node else {
            return false;
        };
        let zone = node.metadata.labels.as_ref().and_then(|l| l.get_key_value(LABEL_TOPOLOGY_ZONE));
        let labels: BTreeMap<String, String> = zone.map(|(k, v)| (k.clone(), v.clone())).into_iter().collect();
        let mut p = self.lock();
        if p.node_labels.as_ref().map_or(labels.is_empty(), |known| *known == labels) {
            return false;
        }
        p.node_labels = Some(labels);
        p.full_sync = true;
        true
    }

    /// Forces the next sync to be full and to read the kernel again first (our rules were
    /// flushed from outside, or a sync ended in a state nobody can vouch for).
    pub(crate) fn resync_from_kernel(&self) {
        let mut p = self.lock();
        p.full_sync = true;
        p.kernel_changed = true;
    }

    /// The addresses of `service` skipped because their text cannot be written into rules
    /// in this release (see [`crate::model::skipped_addresses`]).
    pub(crate) fn skipped_addresses(&self, service: &Service) -> Vec<String> {
        crate::model::skipped_addresses(service, &self.features)
    }

    /// The endpoints of `slice` skipped because their address cannot be written into rules
    /// in this release (see [`crate::tracker::endpoint_slice_cache::skipped_endpoint_addresses`]).
    pub(crate) fn skipped_endpoint_addresses(&self, slice: &EndpointSlice) -> Vec<String> {
        super::endpoint_slice_cache::skipped_endpoint_addresses(slice, self.features.release)
    }

    /// Why the last recorded state of `service` was rejected, if it was.
    pub(crate) fn invalid_service(&self, service: &NamespacedName) -> Option<InvalidService> {
        self.lock().services.invalid(service).cloned()
    }

    /// Services with changes not yet drained.
    pub fn pending_services(&self) -> HashSet<NamespacedName> {
        let p = self.lock();
        let mut set = p.services.pending_changes();
        set.extend(p.endpoints.pending_changes());
        set
    }

    /// Takes out everything recorded (`None` until Services and EndpointSlices have both
    /// been listed: nothing may be applied before). Slices are merged per changed Service
    /// here, under the lock; applying the changes is the caller's business, outside it.
    pub fn drain(&self) -> Option<DrainedChanges> {
        let mut p = self.lock();
        if !p.initialized() {
            return None;
        }
        let drained = DrainedChanges {
            services: p.services.take_changes(),
            endpoints: p.endpoints.take_changes(),
            node_labels: p.node_labels.clone(),
            full_sync: std::mem::take(&mut p.full_sync),
            kernel_changed: std::mem::take(&mut p.kernel_changed),
        };
        Some(drained)
    }
}

impl Pending {
    fn initialized(&self) -> bool {
        self.services_synced && self.endpoint_slices_synced
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tracker::testing::{bare_ep, slice, svc};

    fn recorder() -> ChangeRecorder {
        ChangeRecorder::new(IpFamily::V4, Features::default(), "node-a", None)
    }

    fn web() -> Service {
        svc("ns", "web").type_("ClusterIP").bare_cluster_ip("10.0.0.1").port("http", "TCP", 80, 0).build()
    }

    #[test]
    fn nothing_drains_before_both_lists() {
        let r = recorder();
        assert!(!r.on_service(NamespacedName::new("ns", "web"), Some(&web())), "not initialized: no sync wanted");
        assert!(r.drain().is_none());
        assert!(!r.on_services_synced());
        assert!(r.drain().is_none());
        assert!(r.on_endpoint_slices_synced());
        let d = r.drain().expect("initialized");
        assert_eq!(d.services.services().count(), 1);
        assert!(d.full_sync && d.kernel_changed, "the first sync is full and reads the kernel");
        let d = r.drain().expect("initialized");
        assert_eq!(d.services.services().count(), 0);
        assert!(!d.full_sync && !d.kernel_changed);
    }

    #[test]
    fn changes_are_recorded_from_state_alone() {
        let r = recorder();
        r.on_services_synced();
        r.on_endpoint_slices_synced();
        let name = NamespacedName::new("ns", "web");
        assert!(r.on_service(name.clone(), Some(&web())));
        r.drain();
        // The same state again is no change; a deletion is.
        assert!(!r.on_service(name.clone(), Some(&web())));
        assert!(r.on_service(name.clone(), None));
        assert_eq!(r.pending_services(), HashSet::from([name.clone()]));
        // Back to what was applied before the first pending change: nothing to do.
        assert!(!r.on_service(name.clone(), Some(&web())));
        assert!(r.pending_services().is_empty());
        let s = slice("ns", "web", "web-1").port("http", "TCP", 8080).endpoint(bare_ep("10.1.0.1")).build();
        assert!(r.on_endpoint_slice(&s, false));
        assert_eq!(r.drain().expect("initialized").endpoints.services().count(), 1);
    }

    #[test]
    fn node_labels_and_resyncs_force_full_syncs() {
        // Up to 1.33 every label counts.
        let r = ChangeRecorder::new(IpFamily::V4, Features::of(crate::compat::Release::V1_33), "node-a", None);
        r.on_services_synced();
        r.on_endpoint_slices_synced();
        r.drain();
        let mut node = Node::default();
        node.metadata.name = Some("node-a".into());
        assert!(r.on_node(Some(&node)));
        assert!(!r.on_node(Some(&node)), "same labels: nothing to do");
        let d = r.drain().expect("initialized");
        assert!(d.full_sync && !d.kernel_changed);
        assert_eq!(d.node_labels, Some(BTreeMap::new()));
        let mut other = Node::default();
        other.metadata.name = Some("node-b".into());
        assert!(!r.on_node(Some(&other)), "another node's events are ignored");
        r.resync_from_kernel();
        let d = r.drain().expect("initialized");
        assert!(d.full_sync && d.kernel_changed);
        let mut labelled = node.clone();
        labelled.metadata.labels = Some(BTreeMap::from([("team".to_string(), "a".to_string())]));
        assert!(r.on_node(Some(&labelled)), "up to 1.33 any label change is a full sync");
        assert!(r.on_node(None), "and so is the Node's deletion");
        assert_eq!(r.drain().expect("initialized").node_labels, None);
    }

    #[test]
    fn from_1_34_only_the_zone_label_counts() {
        let r = recorder();
        assert!(r.features.release.tracks_only_topology_labels(), "the default release");
        r.on_services_synced();
        r.on_endpoint_slices_synced();
        r.drain();
        let labelled = |labels: &[(&str, &str)]| {
            let mut node = Node::default();
            node.metadata.name = Some("node-a".into());
            node.metadata.labels = Some(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
            node
        };
        assert!(!r.on_node(Some(&labelled(&[]))), "no zone is where a proxier starts");
        assert!(!r.on_node(Some(&labelled(&[("team", "a")]))), "other labels do not count");
        assert!(!r.drain().expect("initialized").full_sync);
        let zone_a =
            labelled(&[("team", "a"), (LABEL_TOPOLOGY_ZONE, "zone-a"), ("topology.kubernetes.io/region", "r")]);
        assert!(r.on_node(Some(&zone_a)));
        let d = r.drain().expect("initialized");
        assert!(d.full_sync);
        assert_eq!(d.node_labels, Some(BTreeMap::from([(LABEL_TOPOLOGY_ZONE.to_string(), "zone-a".to_string())])));
        assert!(!r.on_node(Some(&labelled(&[(LABEL_TOPOLOGY_ZONE, "zone-a"), ("team", "b")]))));
        assert!(!r.on_node(None), "a deleted Node changes nothing");
        assert!(!r.drain().expect("initialized").full_sync);
        assert!(r.on_node(Some(&labelled(&[(LABEL_TOPOLOGY_ZONE, "zone-b")]))), "a new zone does");
        assert!(r.on_node(Some(&labelled(&[]))), "and so does losing it");
        assert_eq!(r.drain().expect("initialized").node_labels, Some(BTreeMap::new()));
        let mut other = labelled(&[(LABEL_TOPOLOGY_ZONE, "zone-c")]);
        other.metadata.name = Some("node-b".into());
        assert!(!r.on_node(Some(&other)), "another node's events are ignored");
    }
}
