//! Service changes: [`ServiceChangeTracker`] records what each Service looked like before
//! the last sync and what it looks like now; [`ServicePortMap::apply`] applies those
//! changes to the proxier's map (upstream `ServiceChangeTracker` / `ServicePortMap.Update`).
//!
//! Recording never touches the applied map, so event handlers can run while a sync renders.
//! A change is recorded from the Service's current state alone
//! ([`ServiceChangeTracker::record`]): the tracker remembers the ports it last recorded for
//! every Service, which is what the previous state of the next change is, so no API objects
//! are kept and no caller needs the applied map.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::ops::Deref;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Service;

use crate::compat::Features;

use crate::model::{
    InvalidService, IpFamily, NamespacedName, Protocol, ServicePortName, ServicePortRef, service_ports,
};

/// Service port entries keyed by [`ServicePortName`]; a newtype over the `HashMap` so it can
/// carry `update`, and derefs to it for ordinary map access.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServicePortMap(HashMap<ServicePortName, ServicePortRef>);

/// HealthCheckNodePort of every Service that has one (upstream `HealthCheckNodePorts()`).
pub(crate) type HealthCheckNodePorts = BTreeMap<NamespacedName, u16>;

/// What [`ServicePortMap::update`] changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceUpdateResult {
    /// Every Service added, updated or deleted since the previous update (the set a
    /// partial sync must rewrite).
    pub updated_services: HashSet<NamespacedName>,
    /// Cluster IPs of UDP service ports that went away; conntrack entries for them may be
    /// stale.
    pub deleted_udp_cluster_ips: BTreeSet<String>,
}

impl ServicePortMap {
    pub fn new() -> ServicePortMap {
        ServicePortMap::default()
    }

    /// Applies and clears the changes recorded in `tracker` (upstream
    /// `ServicePortMap.Update`).
    pub fn update(&mut self, tracker: &mut ServiceChangeTracker) -> ServiceUpdateResult {
        self.apply(tracker.take_changes())
    }

    /// Applies changes taken out of a tracker ([`ServiceChangeTracker::take_changes`]).
    pub fn apply(&mut self, changes: ServiceChanges) -> ServiceUpdateResult {
        let mut result = ServiceUpdateResult::default();
        for (service, change) in changes.0 {
            result.updated_services.insert(service);
            let ServiceChange { previous, current } = change;
            for (name, info) in current.0.iter() {
                self.0.insert(name.clone(), Arc::clone(info));
            }
            // Ports still present are updates, not deletions.
            for name in previous.0.keys().filter(|name| !current.0.contains_key(*name)) {
                match self.0.remove(name) {
                    Some(info) if info.protocol == Protocol::Udp => {
                        result.deleted_udp_cluster_ips.insert(info.cluster_ip.clone());
                    }
                    Some(_) => {}
                    None => {
                        tracing::debug!(port = %name, "removed service port was not in the map")
                    }
                }
            }
        }
        result
    }

    /// The HealthCheckNodePort of every Service with a non-zero one.
    pub(crate) fn health_check_node_ports(&self) -> HealthCheckNodePorts {
        self.0
            .iter()
            .filter_map(|(name, info)| {
                let port = u16::try_from(info.health_check_node_port).ok().filter(|p| *p != 0)?;
                Some((name.service.clone(), port))
            })
            .collect()
    }
}

impl Deref for ServicePortMap {
    type Target = HashMap<ServicePortName, ServicePortRef>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl FromIterator<(ServicePortName, ServicePortRef)> for ServicePortMap {
    fn from_iter<I: IntoIterator<Item = (ServicePortName, ServicePortRef)>>(iter: I) -> Self {
        ServicePortMap(iter.into_iter().collect())
    }
}

impl<'a> IntoIterator for &'a ServicePortMap {
    type Item = (&'a ServicePortName, &'a ServicePortRef);
    type IntoIter = std::collections::hash_map::Iter<'a, ServicePortName, ServicePortRef>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

/// The ports of one Service before the first unapplied change and after the last one.
#[derive(Debug)]
struct ServiceChange {
    previous: ServicePortMap,
    current: ServicePortMap,
}

/// Changes taken out of a [`ServiceChangeTracker`], to be applied with
/// [`ServicePortMap::apply`] (outside whatever lock guards the tracker).
#[derive(Debug, Default)]
pub struct ServiceChanges(HashMap<NamespacedName, ServiceChange>);

impl ServiceChanges {
    /// Services with changes in this batch.
    pub fn services(&self) -> impl Iterator<Item = &NamespacedName> {
        self.0.keys()
    }
}

/// Unapplied Service changes for one IP family, keyed by Service.
#[derive(Debug)]
pub struct ServiceChangeTracker {
    family: IpFamily,
    /// The release emulated: which ingress IPs count and whether hints need the annotation.
    features: Features,
    items: HashMap<NamespacedName, ServiceChange>,
    /// The ports last recorded for each Service that has any: the previous state of its next
    /// change.
    recorded: HashMap<NamespacedName, ServicePortMap>,
    /// Why each Service whose current state failed validation was rejected (only those:
    /// the watch side reads it to raise one Warning event per problem).
    invalid: HashMap<NamespacedName, InvalidService>,
}

impl ServiceChangeTracker {
    pub fn new(family: IpFamily, features: Features) -> ServiceChangeTracker {
        ServiceChangeTracker {
            family,
            features,
            items: HashMap::new(),
            recorded: HashMap::new(),
            invalid: HashMap::new(),
        }
    }

    /// Takes every pending change out, leaving the tracker with none.
    pub(crate) fn take_changes(&mut self) -> ServiceChanges {
        ServiceChanges(std::mem::take(&mut self.items))
    }

    /// How many Services have changes not yet applied.
    pub fn pending(&self) -> usize {
        self.items.len()
    }

    pub fn family(&self) -> IpFamily {
        self.family
    }

    /// Records an add (`None`, `Some`), update (`Some`, `Some`) or delete (`Some`, `None`):
    /// the same as [`ServiceChangeTracker::record`] of the Service both name, since the
    /// tracker knows the previous state itself. Returns whether any change is pending.
    pub fn update(&mut self, previous: Option<&Service>, current: Option<&Service>) -> bool {
        let Some(svc) = current.or(previous) else {
            return false;
        };
        let service = NamespacedName::new(
            svc.metadata.namespace.clone().unwrap_or_default(),
            svc.metadata.name.clone().unwrap_or_default(),
        );
        self.record(service, current)
    }

    /// Records the current state of `service` (`None`: deleted). Changes accumulate per
    /// Service from the state last recorded before the first unapplied change; a Service
    /// whose ports end up as they were is dropped. Returns whether any change is pending
    /// (for any Service), like upstream.
    ///
    /// A Service that fails validation is logged and treated as having no ports, so an
    /// update to an invalid spec removes its rules.
    pub fn record(&mut self, service: NamespacedName, current: Option<&Service>) -> bool {
        let current_map = self.current_port_map(&service, current);
        let last = if current_map.is_empty() {
            self.recorded.remove(&service)
        } else {
            self.recorded.insert(service.clone(), current_map.clone())
        };
        let change = self
            .items
            .entry(service.clone())
            .or_insert_with(|| ServiceChange { previous: last.unwrap_or_default(), current: ServicePortMap::new() });
        change.current = current_map;
        if change.previous == change.current {
            self.items.remove(&service);
        }
        !self.items.is_empty()
    }

    /// Services with unapplied changes (call before [`ServicePortMap::update`]).
    pub(crate) fn pending_changes(&self) -> HashSet<NamespacedName> {
        self.items.keys().cloned().collect()
    }

    /// Whether no change is pending.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Why `service`, as last recorded, was rejected (`None`: it is valid, skipped for an
    /// ordinary reason, or gone).
    pub fn invalid(&self, service: &NamespacedName) -> Option<&InvalidService> {
        self.invalid.get(service)
    }

    /// The ports of the current state of `service`, remembering whether it was rejected.
    fn current_port_map(&mut self, service: &NamespacedName, svc: Option<&Service>) -> ServicePortMap {
        let Some(svc) = svc else {
            self.invalid.remove(service);
            return ServicePortMap::new();
        };
        match service_ports(svc, self.family, &self.features) {
            Ok(ports) => {
                self.invalid.remove(service);
                ports.into_iter().map(|info| (info.name.clone(), Arc::new(info))).collect()
            }
            Err(err) => {
                tracing::warn!(family = %self.family, "ignoring invalid service: {err}");
                self.invalid.insert(service.clone(), err);
                ServicePortMap::new()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tracker::testing::svc;

    fn nn(ns: &str, name: &str) -> NamespacedName {
        NamespacedName::new(ns, name)
    }

    fn apply(map: &mut ServicePortMap, tracker: &mut ServiceChangeTracker) -> ServiceUpdateResult {
        map.update(tracker)
    }

    // Upstream TestBuildServiceMapAddRemove.
    #[test]
    fn add_and_remove_services() {
        let services = [
            svc("somewhere-else", "cluster-ip")
                .type_("ClusterIP")
                .bare_cluster_ip("172.30.55.4")
                .port("something", "UDP", 1234, 0)
                .port("somethingelse", "UDP", 1235, 0)
                .port("sctpport", "SCTP", 1236, 0)
                .build(),
            svc("somewhere-else", "node-port")
                .type_("NodePort")
                .bare_cluster_ip("172.30.55.10")
                .port("blahblah", "UDP", 345, 678)
                .port("moreblahblah", "TCP", 344, 677)
                .port("muchmoreblah", "SCTP", 343, 676)
                .build(),
            svc("somewhere", "load-balancer")
                .type_("LoadBalancer")
                .bare_cluster_ip("172.30.55.11")
                .port("foobar", "UDP", 8675, 30061)
                .port("baz", "UDP", 8676, 30062)
                .lb_ingress(&["1.2.3.4"])
                .build(),
            svc("somewhere", "only-local-load-balancer")
                .type_("LoadBalancer")
                .bare_cluster_ip("172.30.55.12")
                .port("foobar2", "UDP", 8677, 30063)
                .port("baz", "UDP", 8678, 30064)
                .lb_ingress(&["5.6.7.8"])
                .external_policy("Local")
                .health_check_node_port(345)
                .build(),
        ];
        let mut tracker = ServiceChangeTracker::new(IpFamily::V4, Features::default());
        let mut map = ServicePortMap::new();
        for svc in &services {
            assert!(tracker.update(None, Some(svc)));
        }
        assert_eq!(tracker.pending_changes().len(), 4);
        let result = apply(&mut map, &mut tracker);
        assert_eq!(map.len(), 10);
        assert!(result.deleted_udp_cluster_ips.is_empty());
        assert_eq!(result.updated_services.len(), 4);
        assert!(tracker.is_empty());
        assert_eq!(
            map.health_check_node_ports(),
            HealthCheckNodePorts::from([(nn("somewhere", "only-local-load-balancer"), 345)])
        );

        // services[0] loses its first port; the others are deleted.
        let one_port = svc("somewhere-else", "cluster-ip")
            .type_("ClusterIP")
            .bare_cluster_ip("172.30.55.4")
            .port("somethingelse", "UDP", 1235, 0)
            .build();
        tracker.update(Some(&services[0]), Some(&one_port));
        for svc in &services[1..] {
            tracker.update(Some(svc), None);
        }
        let result = apply(&mut map, &mut tracker);
        assert_eq!(map.len(), 1);
        // The surviving service's IP is there too: one of its UDP ports went away.
        let expected: BTreeSet<String> =
            ["172.30.55.10", "172.30.55.4", "172.30.55.11", "172.30.55.12"].map(String::from).into();
        assert_eq!(result.deleted_udp_cluster_ips, expected);
        assert!(map.health_check_node_ports().is_empty());
    }

    // Upstream TestBuildServiceMapServiceHeadless / ServiceTypeExternalName.
    #[test]
    fn headless_and_external_name_services_are_ignored() {
        let mut tracker = ServiceChangeTracker::new(IpFamily::V4, Features::default());
        let headless = svc("somewhere-else", "headless")
            .type_("ClusterIP")
            .bare_cluster_ip("None")
            .port("rpc", "UDP", 1234, 0)
            .build();
        let headless_no_port =
            svc("somewhere-else", "headless-without-port").type_("ClusterIP").bare_cluster_ip("None").build();
        let external_name = svc("somewhere-else", "external-name")
            .type_("ExternalName")
            .bare_cluster_ip("172.30.55.4")
            .port("blah", "UDP", 1235, 0)
            .build();
        for svc in [&headless, &headless_no_port, &external_name] {
            assert!(!tracker.update(None, Some(svc)), "{:?}", svc.metadata.name);
        }
        let mut map = ServicePortMap::new();
        let result = apply(&mut map, &mut tracker);
        assert!(map.is_empty());
        assert!(result.deleted_udp_cluster_ips.is_empty() && result.updated_services.is_empty());
        assert!(map.health_check_node_ports().is_empty());
    }

    // Upstream TestBuildServiceMapServiceUpdate.
    #[test]
    fn update_service_type_back_and_forth() {
        let v1 = svc("somewhere", "some-service")
            .type_("ClusterIP")
            .bare_cluster_ip("172.30.55.4")
            .port("something", "UDP", 1234, 0)
            .port("somethingelse", "TCP", 1235, 0)
            .build();
        let v2 = svc("somewhere", "some-service")
            .type_("LoadBalancer")
            .bare_cluster_ip("172.30.55.4")
            .port("something", "UDP", 1234, 4321)
            .port("somethingelse", "TCP", 1235, 5321)
            .lb_ingress(&["1.2.3.4"])
            .external_policy("Local")
            .health_check_node_port(345)
            .build();
        let mut tracker = ServiceChangeTracker::new(IpFamily::V4, Features::default());
        let mut map = ServicePortMap::new();

        tracker.update(None, Some(&v1));
        let result = apply(&mut map, &mut tracker);
        assert_eq!(map.len(), 2);
        assert!(result.deleted_udp_cluster_ips.is_empty());
        assert!(map.health_check_node_ports().is_empty());

        assert!(tracker.update(Some(&v1), Some(&v2)));
        let result = apply(&mut map, &mut tracker);
        assert_eq!(map.len(), 2);
        assert!(result.deleted_udp_cluster_ips.is_empty());
        assert_eq!(map.health_check_node_ports().len(), 1);

        // No change: nothing recorded, the map stays.
        assert!(!tracker.update(Some(&v2), Some(&v2)));
        let result = apply(&mut map, &mut tracker);
        assert_eq!(map.len(), 2);
        assert!(result.updated_services.is_empty());
        assert_eq!(map.health_check_node_ports().len(), 1);

        tracker.update(Some(&v2), Some(&v1));
        let result = apply(&mut map, &mut tracker);
        assert_eq!(map.len(), 2);
        assert!(result.deleted_udp_cluster_ips.is_empty());
        assert!(map.health_check_node_ports().is_empty());
    }

    #[test]
    fn changes_that_cancel_out_are_dropped() {
        let a = svc("ns", "s").bare_cluster_ip("10.0.0.1").port("p", "TCP", 80, 0).build();
        let b = svc("ns", "s").bare_cluster_ip("10.0.0.1").port("p", "TCP", 8080, 0).build();
        let mut tracker = ServiceChangeTracker::new(IpFamily::V4, Features::default());
        assert!(tracker.update(None, Some(&a)));
        // A sync applies it.
        let _ = tracker.take_changes();
        assert!(tracker.update(Some(&a), Some(&b)));
        assert_eq!(tracker.pending_changes(), HashSet::from([nn("ns", "s")]));
        // Back to what the map last saw: no change pending.
        assert!(!tracker.update(Some(&b), Some(&a)));
        assert!(tracker.pending_changes().is_empty());
        // Added then deleted before a sync: nothing to do.
        let c = svc("ns", "c").bare_cluster_ip("10.0.0.3").port("p", "TCP", 80, 0).build();
        assert!(tracker.update(None, Some(&c)));
        assert!(!tracker.update(Some(&c), None));
        assert!(!tracker.update(None, None));
    }

    #[test]
    fn other_family_and_invalid_services() {
        let v6_only = svc("ns", "v6").cluster_ips_with_families(&[("fd00::1", "IPv6")]).port("p", "TCP", 80, 0).build();
        let mut v4 = ServiceChangeTracker::new(IpFamily::V4, Features::default());
        assert!(!v4.update(None, Some(&v6_only)));
        let mut v6 = ServiceChangeTracker::new(IpFamily::V6, Features::default());
        assert!(v6.update(None, Some(&v6_only)));

        // A valid service updated to an invalid one loses its ports.
        let good = svc("ns", "s").bare_cluster_ip("10.0.0.1").port("p", "UDP", 53, 0).build();
        let bad = svc("ns", "s").bare_cluster_ip("10.0.0.1").port("p", "UDP", 0, 0).build();
        let mut map = ServicePortMap::new();
        v4.update(None, Some(&good));
        map.update(&mut v4);
        assert_eq!(map.len(), 1);
        assert!(v4.update(Some(&good), Some(&bad)));
        let result = map.update(&mut v4);
        assert!(map.is_empty());
        assert_eq!(result.deleted_udp_cluster_ips, BTreeSet::from(["10.0.0.1".to_owned()]));

        // The rejection is remembered while the current state is invalid (for the event),
        // and forgotten once it is fixed or deleted.
        assert!(matches!(v4.invalid(&nn("ns", "s")), Some(InvalidService::Port { port: 0, .. })));
        assert!(v4.invalid(&nn("ns", "v6")).is_none(), "another family's service is not invalid");
        v4.update(Some(&bad), Some(&good));
        assert!(v4.invalid(&nn("ns", "s")).is_none());
        v4.record(nn("ns", "s"), Some(&bad));
        assert!(v4.invalid(&nn("ns", "s")).is_some());
        v4.record(nn("ns", "s"), None);
        assert!(v4.invalid(&nn("ns", "s")).is_none());
    }

    #[test]
    fn protocol_change_replaces_the_port() {
        let udp = svc("ns", "s").bare_cluster_ip("10.0.0.1").port("dns", "UDP", 53, 0).build();
        let tcp = svc("ns", "s").bare_cluster_ip("10.0.0.1").port("dns", "TCP", 53, 0).build();
        let mut tracker = ServiceChangeTracker::new(IpFamily::V4, Features::default());
        let mut map = ServicePortMap::new();
        tracker.update(None, Some(&udp));
        map.update(&mut tracker);
        tracker.update(Some(&udp), Some(&tcp));
        let result = map.update(&mut tracker);
        assert_eq!(map.len(), 1);
        assert_eq!(map.values().next().unwrap().protocol, Protocol::Tcp);
        assert_eq!(result.deleted_udp_cluster_ips, BTreeSet::from(["10.0.0.1".to_owned()]));
        assert_eq!(result.updated_services, HashSet::from([nn("ns", "s")]));
    }
}
