//! The proxier's endpoints map ([`EndpointsMap`]): every service port's endpoints, and what
//! applying a batch of changes to it changed ([`EndpointsUpdateResult`]). Changes come from
//! [`super::endpoints::EndpointChangeTracker`]; applying them lives there too, so this file
//! depends on nothing else in the tracker (the slice cache builds maps of this type).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::ops::Deref;

use k8s_openapi::jiff::Timestamp;

use crate::model::{EndpointRef, NamespacedName, Protocol, ServicePortName};

/// Endpoints of every service port, keyed by [`ServicePortName`], each list sorted by
/// endpoint string; a newtype over the `HashMap` so it can carry `update`, and derefs to it
/// for ordinary map access.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EndpointsMap(HashMap<ServicePortName, Vec<EndpointRef>>);

/// Number of distinct local ready endpoint IPs per Service (upstream
/// `LocalReadyEndpoints()`), for the health-check servers.
pub(crate) type LocalReadyEndpoints = BTreeMap<NamespacedName, usize>;

/// One endpoint of one service port.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceEndpoint {
    pub service_port_name: ServicePortName,
    /// `ip:port`, as [`crate::model::EndpointInfo::endpoint`].
    pub endpoint: String,
}

/// What [`EndpointsMap::update`] changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EndpointsUpdateResult {
    /// Every Service whose endpoints were added, updated or deleted since the previous
    /// update (the set a partial sync must rewrite).
    pub updated_services: HashSet<NamespacedName>,
    /// UDP endpoints that were ready and are gone (or no longer ready); conntrack entries
    /// pointing at them must be deleted. Sorted.
    pub deleted_udp_endpoints: Vec<ServiceEndpoint>,
    /// UDP service ports that went from no ready endpoint to some; conntrack entries that
    /// black-holed them must be deleted. Sorted.
    pub newly_active_udp_services: Vec<ServicePortName>,
    /// Some changed Service had or has a UDP port (upstream `ConntrackCleanupRequired`): the
    /// conntrack reconciler of 1.32+ runs after the sync.
    pub conntrack_cleanup_required: bool,
    /// Trigger times of the applied changes, per Service, for the network programming
    /// latency metric.
    pub last_change_trigger_times: HashMap<NamespacedName, Vec<Timestamp>>,
}

impl EndpointsMap {
    pub fn new() -> EndpointsMap {
        EndpointsMap::default()
    }

    /// Only [`EndpointsMap::apply`] changes a map, through these two.
    pub(super) fn insert(&mut self, name: ServicePortName, endpoints: Vec<EndpointRef>) {
        self.0.insert(name, endpoints);
    }

    pub(super) fn remove(&mut self, name: &ServicePortName) {
        self.0.remove(name);
    }

    /// Distinct IPs of local ready endpoints per Service, counting `10.0.0.1:80` and
    /// `10.0.0.1:443` once. Terminating endpoints do not count, so a node whose endpoints
    /// are all terminating fails its health check.
    pub(crate) fn local_ready_endpoints(&self) -> LocalReadyEndpoints {
        let mut ips: BTreeMap<&NamespacedName, BTreeSet<&str>> = BTreeMap::new();
        for (name, endpoints) in &self.0 {
            for ep in endpoints.iter().filter(|ep| ep.ready && ep.is_local) {
                ips.entry(&name.service).or_default().insert(ep.ip());
            }
        }
        ips.into_iter().map(|(service, set)| (service.clone(), set.len())).collect()
    }
}

/// Upstream `detectStaleConntrackEntries` for one Service's change.
pub(super) fn detect_stale_conntrack_entries(
    previous: &EndpointsMap,
    current: &EndpointsMap,
    result: &mut EndpointsUpdateResult,
) {
    for (name, old_endpoints) in previous.iter().filter(|(n, _)| n.protocol == Protocol::Udp) {
        let new_endpoints = current.get(name).map(Vec::as_slice).unwrap_or_default();
        // An endpoint that was not ready got no traffic, so it has no entries.
        for old in old_endpoints.iter().filter(|ep| ep.ready) {
            let still_there = new_endpoints
                .iter()
                .any(|new| new.endpoint == old.endpoint && new.is_local == old.is_local && new.ready == old.ready);
            if !still_there {
                result
                    .deleted_udp_endpoints
                    .push(ServiceEndpoint { service_port_name: name.clone(), endpoint: old.endpoint.clone() });
            }
        }
    }
    for (name, new_endpoints) in current.iter().filter(|(n, _)| n.protocol == Protocol::Udp) {
        let had_ready = previous.get(name).is_some_and(|eps| eps.iter().any(|ep| ep.ready));
        if !had_ready && new_endpoints.iter().any(|ep| ep.ready) {
            result.newly_active_udp_services.push(name.clone());
        }
    }
}

impl Deref for EndpointsMap {
    type Target = HashMap<ServicePortName, Vec<EndpointRef>>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl FromIterator<(ServicePortName, Vec<EndpointRef>)> for EndpointsMap {
    fn from_iter<I: IntoIterator<Item = (ServicePortName, Vec<EndpointRef>)>>(iter: I) -> Self {
        EndpointsMap(iter.into_iter().collect())
    }
}

impl<'a> IntoIterator for &'a EndpointsMap {
    type Item = (&'a ServicePortName, &'a Vec<EndpointRef>);
    type IntoIter = std::collections::hash_map::Iter<'a, ServicePortName, Vec<EndpointRef>>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}
