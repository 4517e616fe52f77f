//! The EndpointSlice cache (upstream `EndpointSliceCache`): every slice of every Service,
//! as last applied and as pending, so that endpoints are merged across all of a Service's
//! slices and an endpoint moving from one slice to another is never dropped in between.
//!
//! Slices are kept per Service and per slice name. Turning slices into [`EndpointInfo`]s
//! happens only when changes are checked out, once per sync.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use k8s_openapi::api::discovery::v1::EndpointSlice;

use super::endpoints::EndpointsMap;
use crate::model::ip::parse_ip_sloppy;
use crate::model::{EndpointInfo, EndpointRef, IpFamily, NamespacedName, Protocol, ServicePortName};

/// The label naming the Service an EndpointSlice belongs to.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";

/// Why an EndpointSlice cannot be filed under a Service.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidEndpointSlice {
    #[error("endpoint slice {namespace}/{name}: no {LABEL_SERVICE_NAME} label")]
    NoServiceName { namespace: String, name: String },
    #[error("endpoint slice {namespace:?}/{name:?}: name and namespace must be set")]
    NoName { namespace: String, name: String },
}

/// The Service an EndpointSlice belongs to and the slice's own name.
pub fn endpoint_slice_keys(slice: &EndpointSlice) -> Result<(NamespacedName, String), InvalidEndpointSlice> {
    let namespace = slice.metadata.namespace.clone().unwrap_or_default();
    let name = slice.metadata.name.clone().unwrap_or_default();
    let service_name =
        slice.metadata.labels.as_ref().and_then(|labels| labels.get(LABEL_SERVICE_NAME)).filter(|s| !s.is_empty());
    let Some(service_name) = service_name else {
        return Err(InvalidEndpointSlice::NoServiceName { namespace, name });
    };
    if namespace.is_empty() || name.is_empty() {
        return Err(InvalidEndpointSlice::NoName { namespace, name });
    }
    Ok((NamespacedName::new(namespace, service_name.clone()), name))
}

/// A recorded slice update: the whole object (compared as a whole, like upstream's
/// `reflect.DeepEqual`) and whether it is a removal.
#[derive(Debug, Clone, PartialEq)]
struct SliceData {
    slice: Arc<EndpointSlice>,
    remove: bool,
}

/// Applied and pending slices of one Service, by slice name.
#[derive(Debug, Default)]
struct SliceTracker {
    applied: BTreeMap<String, SliceData>,
    pending: BTreeMap<String, SliceData>,
}

/// The endpoints of one Service before and after applying its pending slices.
#[derive(Debug, Default)]
pub(crate) struct EndpointsChange {
    pub(crate) previous: EndpointsMap,
    pub(crate) current: EndpointsMap,
}

/// EndpointSlices of one IP family, per Service and slice name.
#[derive(Debug)]
pub struct EndpointSliceCache {
    /// This node's name: endpoints whose `nodeName` equals it are local. Empty means no
    /// endpoint is local.
    node_name: String,
    family: IpFamily,
    services: HashMap<NamespacedName, SliceTracker>,
}

impl EndpointSliceCache {
    pub fn new(node_name: impl Into<String>, family: IpFamily) -> EndpointSliceCache {
        EndpointSliceCache { node_name: node_name.into(), family, services: HashMap::new() }
    }

    /// Records `slice` (or its removal) as pending. Returns whether that changes anything:
    /// an update identical to the pending (or, with none pending, the applied) version is
    /// not a change, nor is removing a slice the cache never saw.
    pub fn update_pending(&mut self, slice: &EndpointSlice, remove: bool) -> Result<bool, InvalidEndpointSlice> {
        let (service, slice_name) = endpoint_slice_keys(slice)?;
        let data = SliceData { slice: Arc::new(slice.clone()), remove };
        let changed = match self.services.get(&service) {
            Some(tracker) => match (tracker.pending.get(&slice_name), tracker.applied.get(&slice_name)) {
                (Some(pending), _) => *pending != data,
                (None, Some(applied)) => *applied != data,
                (None, None) => !remove,
            },
            None => !remove,
        };
        if changed {
            self.services.entry(service).or_default().pending.insert(slice_name, data);
        }
        Ok(changed)
    }

    /// Services with pending slice updates.
    pub fn pending_services(&self) -> HashSet<NamespacedName> {
        self.services
            .iter()
            .filter(|(_, tracker)| !tracker.pending.is_empty())
            .map(|(service, _)| service.clone())
            .collect()
    }

    /// Marks every pending update as applied and returns, per changed Service, its
    /// endpoints before and after.
    pub(crate) fn checkout_changes(&mut self) -> BTreeMap<NamespacedName, EndpointsChange> {
        let builder = Builder { node_name: &self.node_name, family: self.family };
        let mut changes = BTreeMap::new();
        let mut emptied = Vec::new();
        for (service, tracker) in self.services.iter_mut() {
            if tracker.pending.is_empty() {
                continue;
            }
            let previous = builder.build(service, tracker.applied.values());
            for (name, data) in std::mem::take(&mut tracker.pending) {
                if data.remove {
                    tracker.applied.remove(&name);
                } else {
                    tracker.applied.insert(name, data);
                }
            }
            let current = builder.build(service, tracker.applied.values());
            if tracker.applied.is_empty() {
                emptied.push(service.clone());
            }
            changes.insert(service.clone(), EndpointsChange { previous, current });
        }
        for service in emptied {
            self.services.remove(&service);
        }
        changes
    }
}

/// Turns slices into endpoints for one node and family.
struct Builder<'a> {
    node_name: &'a str,
    family: IpFamily,
}

impl Builder<'_> {
    /// The endpoints map of one Service from its slices (upstream `getEndpointsMap`).
    fn build<'a>(&self, service: &NamespacedName, slices: impl Iterator<Item = &'a SliceData>) -> EndpointsMap {
        // Per service port, endpoints keyed (and so sorted) by endpoint string.
        let mut by_port: BTreeMap<ServicePortName, BTreeMap<String, EndpointRef>> = BTreeMap::new();
        for data in slices {
            let slice = &data.slice;
            for port in slice.ports.iter().flatten() {
                let Some(port_name) = port.name.as_ref() else {
                    tracing::debug!(%service, "ignoring endpoint slice port with no name");
                    continue;
                };
                let number = match port.port {
                    Some(n) if (1..=65535).contains(&n) => n,
                    None | Some(0) => {
                        tracing::debug!(%service, port = port_name.as_str(), "ignoring endpoint slice port with no number");
                        continue;
                    }
                    Some(other) => {
                        tracing::warn!(
                            %service,
                            slice = slice.metadata.name.as_deref().unwrap_or(""),
                            port = port_name.as_str(),
                            number = other,
                            "ignoring endpoint slice port outside 1-65535"
                        );
                        continue;
                    }
                };
                // The API defaults the protocol to TCP; an absent one is read the same way.
                let protocol = match port.protocol.as_deref() {
                    None => Protocol::Tcp,
                    Some(p) => match Protocol::from_api(p) {
                        Some(protocol) => protocol,
                        None => {
                            tracing::warn!(%service, slice = slice.metadata.name.as_deref().unwrap_or(""), port = port_name.as_str(), protocol = p, "ignoring endpoint port with unknown protocol");
                            continue;
                        }
                    },
                };
                let name = ServicePortName::new(service.clone(), port_name.clone(), protocol);
                let set = by_port.entry(name.clone()).or_default();
                self.add_endpoints(set, &name, slice, number);
            }
        }
        let mut map = EndpointsMap::new();
        for (name, set) in by_port {
            if !set.is_empty() {
                map.insert(name, set.into_values().collect());
            }
        }
        map
    }

    /// Adds the endpoints of `slice` for one of its ports (upstream `addEndpoints`).
    fn add_endpoints(
        &self,
        set: &mut BTreeMap<String, EndpointRef>,
        service_port: &ServicePortName,
        slice: &EndpointSlice,
        port: i32,
    ) {
        let slice_name = slice.metadata.name.as_deref().unwrap_or("");
        for ep in &slice.endpoints {
            let Some(address) = ep.addresses.first() else {
                tracing::debug!(slice = slice_name, "ignoring endpoint with no address");
                continue;
            };
            match parse_ip_sloppy(address) {
                Some(ip) if IpFamily::of(&ip) == self.family => {}
                _ => {
                    tracing::warn!(
                        service = %service_port,
                        slice = slice_name,
                        address = address.as_str(),
                        family = %self.family,
                        "ignoring endpoint address that is not a valid address of this family"
                    );
                    continue;
                }
            }
            let is_local = !self.node_name.is_empty() && ep.node_name.as_deref() == Some(self.node_name);
            let conditions = ep.conditions.as_ref();
            // 1.29 writes the address as it appears in the slice, both in the endpoint
            // string (DNAT target, chain hash) and in IP() (hairpin rule); it is only
            // validated here.
            let mut info = EndpointInfo::new(service_port, address, port);
            info.is_local = is_local;
            // Absent ready/serving mean true, absent terminating means false.
            info.ready = conditions.and_then(|c| c.ready).unwrap_or(true);
            info.serving = conditions.and_then(|c| c.serving).unwrap_or(true);
            info.terminating = conditions.and_then(|c| c.terminating).unwrap_or(false);
            if let Some(zones) = ep.hints.as_ref().and_then(|h| h.for_zones.as_ref()) {
                info.zone_hints = zones.iter().map(|z| z.name.clone()).collect();
            }
            // The same endpoint may appear twice (e.g. while moving between slices); a
            // local copy wins.
            if is_local || !set.contains_key(&info.endpoint) {
                set.insert(info.endpoint.clone(), Arc::new(info));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::discovery::v1::EndpointPort;

    use super::*;
    use crate::tracker::testing::{ep, slice};

    const NODE: &str = "host1";

    fn spn(port: &str, protocol: Protocol) -> ServicePortName {
        ServicePortName::new(NamespacedName::new("ns1", "svc1"), port, protocol)
    }

    /// Applies `slices` (name order irrelevant) and returns the resulting endpoints map.
    fn apply(cache: &mut EndpointSliceCache, slices: &[(EndpointSlice, bool)]) -> EndpointsMap {
        for (s, remove) in slices {
            cache.update_pending(s, *remove).expect("valid slice");
        }
        let mut changes = cache.checkout_changes();
        changes.remove(&NamespacedName::new("ns1", "svc1")).map(|c| c.current).unwrap_or_default()
    }

    fn endpoints(map: &EndpointsMap, name: &ServicePortName) -> Vec<String> {
        map.get(name).map(|eps| eps.iter().map(|e| e.endpoint.clone()).collect()).unwrap_or_default()
    }

    #[test]
    fn endpoints_merge_across_slices_sorted_by_string() {
        let mut cache = EndpointSliceCache::new(NODE, IpFamily::V4);
        let a = slice("ns1", "svc1", "svc1-a")
            .port("http", 80, "TCP")
            .endpoint(ep("10.0.1.3"))
            .endpoint(ep("10.0.1.10"))
            .build();
        let b = slice("ns1", "svc1", "svc1-b")
            .port("http", 80, "TCP")
            .port("dns", 53, "UDP")
            .endpoint(ep("10.0.1.2"))
            .build();
        let map = apply(&mut cache, &[(a, false), (b, false)]);
        assert_eq!(endpoints(&map, &spn("http", Protocol::Tcp)), ["10.0.1.10:80", "10.0.1.2:80", "10.0.1.3:80"]);
        assert_eq!(endpoints(&map, &spn("dns", Protocol::Udp)), ["10.0.1.2:53"]);
        assert_eq!(map.len(), 2);
    }

    #[test]
    fn endpoint_moving_between_slices_is_never_lost() {
        let mut cache = EndpointSliceCache::new(NODE, IpFamily::V4);
        let with = |name: &str, ips: &[&str]| {
            ips.iter().fold(slice("ns1", "svc1", name).port("p", 80, "TCP"), |b, ip| b.endpoint(ep(ip))).build()
        };
        let p = spn("p", Protocol::Tcp);
        let map = apply(&mut cache, &[(with("s1", &["10.0.0.1", "10.0.0.2"]), false)]);
        assert_eq!(endpoints(&map, &p), ["10.0.0.1:80", "10.0.0.2:80"]);
        // 10.0.0.2 shows up in s2 before it disappears from s1: seen twice, kept once.
        let map = apply(&mut cache, &[(with("s2", &["10.0.0.2"]), false)]);
        assert_eq!(endpoints(&map, &p), ["10.0.0.1:80", "10.0.0.2:80"]);
        let map = apply(&mut cache, &[(with("s1", &["10.0.0.1"]), false)]);
        assert_eq!(endpoints(&map, &p), ["10.0.0.1:80", "10.0.0.2:80"]);
        // The other order: gone from s1 first, then in s3, within one sync.
        let map = apply(&mut cache, &[(with("s1", &[]), false), (with("s3", &["10.0.0.1"]), false)]);
        assert_eq!(endpoints(&map, &p), ["10.0.0.1:80", "10.0.0.2:80"]);
    }

    #[test]
    fn duplicate_endpoint_prefers_the_local_copy() {
        let mut cache = EndpointSliceCache::new(NODE, IpFamily::V4);
        // "a" sorts first, so the remote copy is seen first and must be replaced.
        let a = slice("ns1", "svc1", "a").port("p", 80, "TCP").endpoint(ep("10.0.0.1").node("other")).build();
        let b = slice("ns1", "svc1", "b").port("p", 80, "TCP").endpoint(ep("10.0.0.1").node(NODE)).build();
        let map = apply(&mut cache, &[(a.clone(), false), (b, false)]);
        let eps = &map[&spn("p", Protocol::Tcp)];
        assert_eq!(eps.len(), 1);
        assert!(eps[0].is_local);
        // With no local copy the first one stays.
        let mut cache = EndpointSliceCache::new(NODE, IpFamily::V4);
        let c = slice("ns1", "svc1", "c")
            .port("p", 80, "TCP")
            .endpoint(ep("10.0.0.1").conditions(Some(false), Some(false), None))
            .build();
        let map = apply(&mut cache, &[(a, false), (c, false)]);
        assert!(map[&spn("p", Protocol::Tcp)][0].ready);
    }

    #[test]
    fn conditions_default_like_upstream() {
        let mut cache = EndpointSliceCache::new(NODE, IpFamily::V4);
        let s = slice("ns1", "svc1", "s")
            .port("p", 80, "TCP")
            .endpoint(ep("10.0.0.1")) // no conditions at all
            .endpoint(ep("10.0.0.2").conditions(None, None, None))
            .endpoint(ep("10.0.0.3").conditions(Some(false), None, None))
            .endpoint(ep("10.0.0.4").conditions(Some(false), Some(true), Some(true)))
            .endpoint(ep("10.0.0.5").conditions(Some(false), Some(false), Some(true)))
            .build();
        let map = apply(&mut cache, &[(s, false)]);
        let got: Vec<(bool, bool, bool)> =
            map[&spn("p", Protocol::Tcp)].iter().map(|e| (e.ready, e.serving, e.terminating)).collect();
        assert_eq!(
            got,
            [(true, true, false), (true, true, false), (false, true, false), (false, true, true), (false, false, true),]
        );
    }

    #[test]
    fn locality_zone_hints_and_names() {
        let mut cache = EndpointSliceCache::new(NODE, IpFamily::V4);
        let s = slice("ns1", "svc1", "s")
            .port("p80", 80, "TCP")
            .endpoint(ep("10.180.0.1").node(NODE).zones(&["zone-a", "zone-b"]))
            .endpoint(ep("10.180.0.2").node("host2"))
            .build();
        let map = apply(&mut cache, &[(s, false)]);
        let eps = &map[&spn("p80", Protocol::Tcp)];
        assert!(eps[0].is_local && !eps[1].is_local);
        assert_eq!(eps[0].zone_hints.iter().map(String::as_str).collect::<Vec<_>>(), ["zone-a", "zone-b"]);
        assert!(eps[1].zone_hints.is_empty());
        // Upstream's own test name for ns1/svc1:p80 endpoint 10.180.0.1:80.
        assert_eq!(eps[0].chain_name, "KUBE-SEP-SXIVWICOYRO3J4NJ");
        assert_eq!(eps[0].ip, "10.180.0.1");
        assert_eq!(eps[0].port, 80);

        // Without a node name nothing is local.
        let mut cache = EndpointSliceCache::new("", IpFamily::V4);
        let s = slice("ns1", "svc1", "s").port("p", 80, "TCP").endpoint(ep("10.0.0.1").node("")).build();
        assert!(!apply(&mut cache, &[(s, false)])[&spn("p", Protocol::Tcp)][0].is_local);
    }

    #[test]
    fn address_text_is_kept_as_written() {
        let mut cache = EndpointSliceCache::new(NODE, IpFamily::V6);
        let s = slice("ns1", "svc1", "s").address_type("IPv6").port("p", 80, "TCP").endpoint(ep("FD00:0::1")).build();
        let map = apply(&mut cache, &[(s, false)]);
        let e = &map[&spn("p", Protocol::Tcp)][0];
        assert_eq!(e.endpoint, "[FD00:0::1]:80");
        // 1.29's IP() is the address as written too, so hairpin and DNAT rules agree.
        assert_eq!(e.ip, "FD00:0::1");
    }

    #[test]
    fn invalid_ports_and_endpoints_are_skipped() {
        let mut cache = EndpointSliceCache::new(NODE, IpFamily::V4);
        let s = slice("ns1", "svc1", "s")
            .raw_port(EndpointPort { name: None, port: Some(81), ..Default::default() })
            .raw_port(EndpointPort { name: Some("noport".into()), port: None, ..Default::default() })
            .raw_port(EndpointPort { name: Some("zero".into()), port: Some(0), ..Default::default() })
            .raw_port(EndpointPort { name: Some("big".into()), port: Some(70000), ..Default::default() })
            .port("icmp", 1, "ICMP")
            // An absent protocol is read as TCP.
            .raw_port(EndpointPort { name: Some("noproto".into()), port: Some(82), ..Default::default() })
            .endpoint(ep("10.0.0.1"))
            .endpoint(ep("10.0.0.2").no_addresses())
            .endpoint(ep("fd00::1"))
            .endpoint(ep("not-an-ip"))
            .build();
        let map = apply(&mut cache, &[(s, false)]);
        assert_eq!(map.len(), 1);
        assert_eq!(endpoints(&map, &spn("noproto", Protocol::Tcp)), ["10.0.0.1:82"]);
    }

    #[test]
    fn port_without_endpoints_is_absent() {
        let mut cache = EndpointSliceCache::new(NODE, IpFamily::V4);
        let s = slice("ns1", "svc1", "s").port("p", 80, "TCP").build();
        assert!(apply(&mut cache, &[(s, false)]).is_empty());
    }

    #[test]
    fn change_detection_compares_with_pending_then_applied() {
        let mut cache = EndpointSliceCache::new(NODE, IpFamily::V4);
        let v1 = slice("ns1", "svc1", "s").port("p", 80, "TCP").endpoint(ep("10.0.0.1")).build();
        let v2 = slice("ns1", "svc1", "s").port("p", 80, "TCP").endpoint(ep("10.0.0.2")).build();
        assert_eq!(cache.update_pending(&v1, true), Ok(false));
        assert_eq!(cache.update_pending(&v1, false), Ok(true));
        assert_eq!(cache.update_pending(&v1, false), Ok(false));
        assert_eq!(cache.update_pending(&v2, false), Ok(true));
        // Back to v1 while v2 is pending: a change relative to the pending value.
        assert_eq!(cache.update_pending(&v1, false), Ok(true));
        let changes = cache.checkout_changes();
        assert_eq!(changes.len(), 1);
        assert!(cache.pending_services().is_empty());
        // Compared with the applied value now.
        assert_eq!(cache.update_pending(&v1, false), Ok(false));
        assert_eq!(cache.update_pending(&v1, true), Ok(true));
        let change = cache.checkout_changes().remove(&NamespacedName::new("ns1", "svc1")).unwrap();
        assert_eq!(change.previous.len(), 1);
        assert!(change.current.is_empty());
        // The Service's entry goes once its last slice is gone.
        assert!(cache.services.is_empty());
    }

    #[test]
    fn slice_keys() {
        let s = slice("ns1", "svc1", "svc1-abc").build();
        assert_eq!(endpoint_slice_keys(&s), Ok((NamespacedName::new("ns1", "svc1"), "svc1-abc".to_owned())));
        let mut no_label = s.clone();
        no_label.metadata.labels = Some(Default::default());
        let err = endpoint_slice_keys(&no_label).unwrap_err();
        assert_eq!(err.to_string(), "endpoint slice ns1/svc1-abc: no kubernetes.io/service-name label");
        let mut no_ns = s;
        no_ns.metadata.namespace = None;
        assert!(matches!(endpoint_slice_keys(&no_ns), Err(InvalidEndpointSlice::NoName { .. })));
    }
}
