//! The API-server side: the client ([`client`]), watches of Services, EndpointSlices and this
//! Node turned into the proxiers' `on_*` calls, and one-shot reads of the same state
//! ([`list`]). The only module that talks to the API server, events aside.
//!
//! The watches decode Services and EndpointSlices slim ([`objects`]). Event handling
//! ([`ServiceEvents`], [`SliceEvents`], [`NodeEvents`]) takes kube-runtime
//! watcher events, not clients, so tests feed hand-made streams. It keeps only object keys
//! (no API objects): the trackers hold the compact state, and a re-list (`Init` …
//! `InitApply`* … `InitDone`) deletes whatever was known but not listed again, so a dropped
//! watch or a 410 Gone loses nothing.
//!
//! Given an event recorder ([`ServiceEvents::with_events`], [`SliceEvents::with_events`]), a
//! Service or EndpointSlice skipped as invalid, or with addresses skipped because their text
//! cannot be written into rules, gets a Warning event, once per problem and object version
//! (see [`InvalidObjectReporter`]); syncs never raise these.

pub mod client;
pub mod events;
pub mod list;
pub mod objects;
pub mod pod_cidr;
pub mod watch;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use kube::runtime::watcher::Event;

use crate::k8s::events::{
    EventRecorder, InvalidObjectReporter, REASON_INVALID_ENDPOINT_SLICE, REASON_INVALID_SERVICE, object_version,
};
use crate::model::NamespacedName;
use crate::tracker::endpoint_slice_cache::endpoint_slice_keys;
use crate::tracker::{ChangeRecorder, LABEL_SERVICE_NAME};

/// Label excluding a Service (and its slices) from this proxy.
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// Label marking the EndpointSlices of headless Services.
pub const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";
/// The label selector of the Service and EndpointSlice watches (upstream's informers).
pub const WATCH_LABEL_SELECTOR: &str = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// What the watches feed: one IP family's change recorder. Every call only records (it
/// never waits for a sync) and says whether a sync is wanted.
pub trait ChangeSink: Send + Sync {
    /// The current state of a Service (`None`: deleted).
    fn on_service(&self, service: NamespacedName, current: Option<&Service>) -> bool;
    /// An EndpointSlice added or updated, or deleted (`removed`).
    fn on_endpoint_slice(&self, slice: &EndpointSlice, removed: bool) -> bool;
    /// This node (`None`: deleted).
    fn on_node(&self, node: Option<&Node>) -> bool;
    /// Services were listed once; answers whether both kinds now have been.
    fn on_services_synced(&self) -> bool;
    /// EndpointSlices were listed once; answers whether both kinds now have been.
    fn on_endpoint_slices_synced(&self) -> bool;
    /// Why the last recorded state of `service` was rejected, if it was.
    fn invalid_service(&self, service: &NamespacedName) -> Option<String>;
    /// The addresses of `service` the proxier skips as unwritable (one line each).
    fn skipped_addresses(&self, service: &Service) -> Vec<String>;
    /// The endpoints of `slice` the proxier skips for their address (one line each).
    fn skipped_endpoint_addresses(&self, slice: &EndpointSlice) -> Vec<String>;
}

impl ChangeSink for ChangeRecorder {
    fn on_service(&self, service: NamespacedName, current: Option<&Service>) -> bool {
        ChangeRecorder::on_service(self, service, current)
    }
    fn on_endpoint_slice(&self, slice: &EndpointSlice, removed: bool) -> bool {
        ChangeRecorder::on_endpoint_slice(self, slice, removed)
    }
    fn on_node(&self, node: Option<&Node>) -> bool {
        ChangeRecorder::on_node(self, node)
    }
    fn on_services_synced(&self) -> bool {
        ChangeRecorder::on_services_synced(self)
    }
    fn on_endpoint_slices_synced(&self) -> bool {
        ChangeRecorder::on_endpoint_slices_synced(self)
    }
    fn invalid_service(&self, service: &NamespacedName) -> Option<String> {
        ChangeRecorder::invalid_service(self, service).map(|e| e.to_string())
    }
    fn skipped_addresses(&self, service: &Service) -> Vec<String> {
        ChangeRecorder::skipped_addresses(self, service)
    }
    fn skipped_endpoint_addresses(&self, slice: &EndpointSlice) -> Vec<String> {
        ChangeRecorder::skipped_endpoint_addresses(self, slice)
    }
}

/// Asks a proxier for a sync (its runner's trigger, plus whatever is recorded when a sync is
/// queued: health, metrics).
pub type SyncRequest = Arc<dyn Fn() + Send + Sync>;

/// The proxiers (one per IP family) fed by the same watches, with their sync triggers.
#[derive(Clone)]
pub struct ProxierSet {
    members: Vec<(Arc<dyn ChangeSink>, SyncRequest)>,
}

impl ProxierSet {
    pub fn new(members: Vec<(Arc<dyn ChangeSink>, SyncRequest)>) -> Self {
        ProxierSet { members }
    }

    /// Applies `f` to every recorder; asks for a sync where it says so.
    fn each(&self, f: impl Fn(&dyn ChangeSink) -> bool) {
        for (sink, request_sync) in &self.members {
            if f(sink.as_ref()) {
                request_sync();
            }
        }
    }

    /// Why the proxiers rejected the current state of `service` (each distinct reason once;
    /// empty when none did).
    fn invalid_service(&self, service: &NamespacedName) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for (sink, _) in &self.members {
            if let Some(text) = sink.invalid_service(service)
                && !out.contains(&text)
            {
                out.push(text);
            }
        }
        out
    }

    /// The addresses of `service` the proxiers skip as unwritable. Every proxier reads the
    /// Service as the same release, whatever its family, so the first one answers.
    fn skipped_addresses(&self, service: &Service) -> Vec<String> {
        self.members.first().map(|(sink, _)| sink.skipped_addresses(service)).unwrap_or_default()
    }

    /// The endpoints of `slice` the proxiers skip for their address (same release for all).
    fn skipped_endpoint_addresses(&self, slice: &EndpointSlice) -> Vec<String> {
        self.members.first().map(|(sink, _)| sink.skipped_endpoint_addresses(slice)).unwrap_or_default()
    }
}

fn key(meta: &ObjectMeta) -> NamespacedName {
    NamespacedName::new(meta.namespace.clone().unwrap_or_default(), meta.name.clone().unwrap_or_default())
}

/// Service watch state: which Services are known, and the keys seen during a re-list.
#[derive(Debug, Default)]
pub struct ServiceEvents {
    known: HashSet<NamespacedName>,
    relisted: Option<HashSet<NamespacedName>>,
    synced: bool,
    /// Raises the Warning events for Services the proxiers reject (none: no events).
    invalid: Option<InvalidObjectReporter>,
}

impl ServiceEvents {
    /// Also raises a Warning event on every Service the proxiers reject as invalid.
    pub fn with_events(recorder: Arc<dyn EventRecorder>) -> Self {
        ServiceEvents {
            invalid: Some(InvalidObjectReporter::new(recorder, REASON_INVALID_SERVICE)),
            ..ServiceEvents::default()
        }
    }

    pub fn handle(&mut self, event: Event<Service>, proxiers: &ProxierSet) {
        match event {
            Event::Apply(svc) | Event::InitApply(svc) => {
                let name = key(&svc.metadata);
                if let Some(seen) = self.relisted.as_mut() {
                    seen.insert(name.clone());
                }
                self.known.insert(name.clone());
                proxiers.each(|p| p.on_service(name.clone(), Some(&svc)));
                if let Some(reporter) = self.invalid.as_mut() {
                    let mut problems = proxiers.invalid_service(&name);
                    problems.extend(proxiers.skipped_addresses(&svc));
                    reporter.observe(&name, &object_version(&svc.metadata), &problems, &svc.object_ref(&()));
                }
            }
            Event::Delete(svc) => {
                let name = key(&svc.metadata);
                self.known.remove(&name);
                self.forget(&name);
                proxiers.each(|p| p.on_service(name.clone(), None));
            }
            Event::Init => self.relisted = Some(HashSet::new()),
            Event::InitDone => {
                let seen = self.relisted.take().unwrap_or_default();
                let gone: Vec<NamespacedName> = self.known.difference(&seen).cloned().collect();
                for name in gone {
                    tracing::debug!(service = %name, "service not re-listed; treating it as deleted");
                    self.known.remove(&name);
                    self.forget(&name);
                    proxiers.each(|p| p.on_service(name.clone(), None));
                }
                if !self.synced {
                    self.synced = true;
                    tracing::info!(services = self.known.len(), "services listed");
                    proxiers.each(|p| p.on_services_synced());
                }
            }
        }
    }

    pub fn known(&self) -> usize {
        self.known.len()
    }

    fn forget(&mut self, name: &NamespacedName) {
        if let Some(reporter) = self.invalid.as_mut() {
            reporter.forget(name);
        }
    }
}

/// What a deletion needs to know about a slice we no longer have the object of.
#[derive(Debug, Clone)]
struct SliceKey {
    service: String,
    address_type: String,
}

/// EndpointSlice watch state.
#[derive(Debug, Default)]
pub struct SliceEvents {
    known: HashMap<NamespacedName, SliceKey>,
    relisted: Option<HashSet<NamespacedName>>,
    synced: bool,
    /// Raises the Warning events for slices that cannot be used (none: no events).
    invalid: Option<InvalidObjectReporter>,
}

impl SliceEvents {
    /// Also raises a Warning event on every IP EndpointSlice the proxiers cannot file under
    /// a Service (no `kubernetes.io/service-name` label).
    pub fn with_events(recorder: Arc<dyn EventRecorder>) -> Self {
        SliceEvents {
            invalid: Some(InvalidObjectReporter::new(recorder, REASON_INVALID_ENDPOINT_SLICE)),
            ..SliceEvents::default()
        }
    }

    pub fn handle(&mut self, event: Event<EndpointSlice>, proxiers: &ProxierSet) {
        match event {
            Event::Apply(slice) | Event::InitApply(slice) => {
                let name = key(&slice.metadata);
                if let Some(seen) = self.relisted.as_mut() {
                    seen.insert(name.clone());
                }
                if let Some(reporter) = self.invalid.as_mut() {
                    let problems = slice_problems(&slice, proxiers);
                    reporter.observe(&name, &object_version(&slice.metadata), &problems, &slice.object_ref(&()));
                }
                let service =
                    slice.metadata.labels.as_ref().and_then(|l| l.get(LABEL_SERVICE_NAME)).cloned().unwrap_or_default();
                let previous = self
                    .known
                    .insert(name, SliceKey { service: service.clone(), address_type: slice.address_type.clone() });
                // A slice re-labelled to another service leaves the old one; one whose address
                // type changed (immutable in a real API server, not in every input) leaves the
                // other family's proxier, which would otherwise keep its endpoints forever.
                if let Some(old) =
                    previous.filter(|old| old.service != service || old.address_type != slice.address_type)
                {
                    let gone = synthetic_slice(&key(&slice.metadata), &old);
                    proxiers.each(|p| p.on_endpoint_slice(&gone, true));
                }
                proxiers.each(|p| p.on_endpoint_slice(&slice, false));
            }
            Event::Delete(slice) => {
                let name = key(&slice.metadata);
                self.known.remove(&name);
                if let Some(reporter) = self.invalid.as_mut() {
                    reporter.forget(&name);
                }
                proxiers.each(|p| p.on_endpoint_slice(&slice, true));
            }
            Event::Init => self.relisted = Some(HashSet::new()),
            Event::InitDone => {
                let seen = self.relisted.take().unwrap_or_default();
                let gone: Vec<NamespacedName> = self.known.keys().filter(|k| !seen.contains(*k)).cloned().collect();
                for name in gone {
                    if let Some(reporter) = self.invalid.as_mut() {
                        reporter.forget(&name);
                    }
                    if let Some(old) = self.known.remove(&name) {
                        tracing::debug!(slice = %name, "endpoint slice not re-listed; treating it as deleted");
                        let slice = synthetic_slice(&name, &old);
                        proxiers.each(|p| p.on_endpoint_slice(&slice, true));
                    }
                }
                if !self.synced {
                    self.synced = true;
                    tracing::info!(slices = self.known.len(), "endpoint slices listed");
                    proxiers.each(|p| p.on_endpoint_slices_synced());
                }
            }
        }
    }

    pub fn known(&self) -> usize {
        self.known.len()
    }
}

/// Why the proxiers skip `slice` as a whole, or some of its endpoints (FQDN slices are not for proxies at all, so they
/// are never invalid here).
fn slice_problems(slice: &EndpointSlice, proxiers: &ProxierSet) -> Vec<String> {
    if !matches!(slice.address_type.as_str(), "IPv4" | "IPv6") {
        return Vec::new();
    }
    match endpoint_slice_keys(slice) {
        Ok(_) => proxiers.skipped_endpoint_addresses(slice),
        Err(err) => vec![err.to_string()],
    }
}

/// A stand-in for a slice whose deletion we only learned of by its absence: enough for the
/// tracker to drop it (namespace, name, service label, address type).
fn synthetic_slice(name: &NamespacedName, key: &SliceKey) -> EndpointSlice {
    let mut labels = std::collections::BTreeMap::new();
    labels.insert(LABEL_SERVICE_NAME.to_string(), key.service.clone());
    EndpointSlice {
        metadata: ObjectMeta {
            namespace: Some(name.namespace.clone()),
            name: Some(name.name.clone()),
            labels: Some(labels),
            ..Default::default()
        },
        address_type: key.address_type.clone(),
        endpoints: Vec::new(),
        ports: None,
    }
}

/// Watch state of this node (field selector `metadata.name=<hostname>`).
#[derive(Debug, Default)]
pub struct NodeEvents {
    present: bool,
    relisted: bool,
}

impl NodeEvents {
    /// `on_node` also sees every state of the Node (health's node eligibility).
    pub fn handle(&mut self, event: Event<Node>, proxiers: &ProxierSet, on_node: &dyn Fn(Option<&Node>)) {
        match event {
            Event::Apply(node) | Event::InitApply(node) => {
                self.present = true;
                self.relisted = true;
                on_node(Some(&node));
                proxiers.each(|p| p.on_node(Some(&node)));
            }
            Event::Delete(_) => {
                self.present = false;
                on_node(None);
                proxiers.each(|p| p.on_node(None));
            }
            Event::Init => self.relisted = false,
            Event::InitDone => {
                if self.present && !self.relisted {
                    self.present = false;
                    on_node(None);
                    proxiers.each(|p| p.on_node(None));
                }
            }
        }
    }
}
