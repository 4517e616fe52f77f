//! The EndpointSlice cache (upstream `EndpointSliceCache`): every slice of every Service,
//! as last applied and as pending, so that endpoints are merged across all of a Service's
//! slices and an endpoint moving from one slice to another is never dropped in between.
//!
//! Slices are kept per Service and per slice name, not as API objects but as the endpoint
//! records the proxier renders from ([`EndpointInfo`]s per service port), built once when a
//! slice arrives. The endpoints map shares those records (`Arc`s), so an endpoint costs one
//! record however many maps hold it. Merging a Service's slices happens only when changes
//! are checked out, once per sync.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use k8s_openapi::api::discovery::v1::{Endpoint, EndpointSlice};

use super::endpoints_map::EndpointsMap;
use crate::compat::Release;
use crate::model::ip::{AddressTextError, format_ip, parse_canonical_ip, parse_ip_sloppy};
use crate::model::{EndpointInfo, EndpointRef, IpFamily, NamespacedName, NodeHints, Protocol, ServicePortName};

/// The label naming the Service an EndpointSlice belongs to.
pub(crate) const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";

/// Why an EndpointSlice cannot be filed under a Service.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidEndpointSlice {
    #[error("endpoint slice {namespace}/{name}: no {LABEL_SERVICE_NAME} label")]
    NoServiceName { namespace: String, name: String },
    #[error("endpoint slice {namespace:?}/{name:?}: name and namespace must be set")]
    NoName { namespace: String, name: String },
}

/// The Service an EndpointSlice belongs to and the slice's own name.
pub(crate) fn endpoint_slice_keys(slice: &EndpointSlice) -> Result<(NamespacedName, String), InvalidEndpointSlice> {
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

/// Every endpoint of an IP slice skipped because its address cannot be written into rules
/// (invalid, or before 1.31 not in canonical form, see [`parse_canonical_ip`]): one line per
/// endpoint, naming the slice, for the Warning events the watch side raises. Family
/// mismatches are not listed (the other family's proxier may use them).
pub(crate) fn skipped_endpoint_addresses(slice: &EndpointSlice, release: Release) -> Vec<String> {
    if !matches!(slice.address_type.as_str(), "IPv4" | "IPv6") {
        return Vec::new();
    }
    let namespace = slice.metadata.namespace.as_deref().unwrap_or("");
    let name = slice.metadata.name.as_deref().unwrap_or("");
    let mut out = Vec::new();
    for (index, ep) in slice.endpoints.iter().enumerate() {
        let problem = match ep.addresses.first().map(|a| parse_canonical_ip(a)) {
            Some(Err(AddressTextError::NotCanonical { .. })) if release.writes_canonical_endpoint_addresses() => None,
            Some(Err(err)) => Some(err),
            _ => None,
        };
        if let Some(err) = problem {
            out.push(format!(
                "endpoint slice {namespace}/{name}: endpoints[{index}].addresses[0]: {err}; endpoint skipped"
            ));
        }
    }
    out
}

/// What the proxier uses of one EndpointSlice: for each of its valid ports, in the slice's
/// order, the endpoints with a valid address of this family, in the slice's order. Two
/// versions of a slice that differ only in fields the proxier ignores (targetRef,
/// hostname, metadata, …) are equal, so such an update is not a change.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SliceRecord {
    ports: Box<[(ServicePortName, Box<[EndpointRef]>)]>,
}

/// A recorded slice update: `None` is a removal.
type SliceData = Option<SliceRecord>;

/// Applied and pending slices of one Service, each sorted by slice name. Most Services have
/// one slice, so these are vectors sized to fit rather than maps: there are as many of
/// them as Services.
#[derive(Debug, Default)]
struct SliceTracker {
    applied: Vec<(String, SliceRecord)>,
    pending: Vec<(String, SliceData)>,
}

/// The entry for `name` in a vector sorted by name.
fn find<'v, T>(entries: &'v [(String, T)], name: &str) -> Option<&'v T> {
    entries.binary_search_by(|(n, _)| n.as_str().cmp(name)).ok().map(|i| &entries[i].1)
}

/// Sets `name` to `value` in a vector sorted by name, growing it by exactly one if needed.
fn upsert<T>(entries: &mut Vec<(String, T)>, name: String, value: T) {
    match entries.binary_search_by(|(n, _)| n.as_str().cmp(&name)) {
        Ok(i) => entries[i].1 = value,
        Err(i) => {
            entries.reserve_exact(1);
            entries.insert(i, (name, value));
        }
    }
}

/// Removes `name` from a vector sorted by name.
fn remove<T>(entries: &mut Vec<(String, T)>, name: &str) {
    if let Ok(i) = entries.binary_search_by(|(n, _)| n.as_str().cmp(name)) {
        entries.remove(i);
        if entries.capacity() > 2 * entries.len() {
            entries.shrink_to_fit();
        }
    }
}

/// The endpoints of one Service before and after applying its pending slices.
#[derive(Debug, Default)]
pub(crate) struct EndpointsChange {
    pub(crate) previous: EndpointsMap,
    pub(crate) current: EndpointsMap,
}

/// EndpointSlices of one IP family, per Service and slice name.
#[derive(Debug)]
pub(crate) struct EndpointSliceCache {
    /// This node's name: endpoints whose `nodeName` equals it are local. Empty means no
    /// endpoint is local.
    node_name: String,
    family: IpFamily,
    /// Addresses are parsed leniently and written canonically (1.31+); otherwise, as 1.29,
    /// written as given, and skipped unless canonical.
    canonical_addresses: bool,
    /// How duplicated endpoints are resolved ([`Release::prefers_non_terminating_duplicate_endpoints`]).
    duplicates: DuplicateRule,
    services: HashMap<NamespacedName, SliceTracker>,
}

impl EndpointSliceCache {
    /// A cache reading slices as 1.29 does; see [`EndpointSliceCache::with_release`].
    pub fn new(node_name: impl Into<String>, family: IpFamily) -> EndpointSliceCache {
        EndpointSliceCache {
            node_name: node_name.into(),
            family,
            canonical_addresses: false,
            duplicates: DuplicateRule::FirstUnlessLaterLocal,
            services: HashMap::new(),
        }
    }

    /// Reads slice addresses as `release` does (canonical text from 1.31).
    pub fn with_release(mut self, release: Release) -> EndpointSliceCache {
        self.canonical_addresses = release.writes_canonical_endpoint_addresses();
        self.duplicates = if release.prefers_non_terminating_duplicate_endpoints() {
            DuplicateRule::LastUnlessTerminating
        } else {
            DuplicateRule::FirstUnlessLaterLocal
        };
        self
    }

    /// Records `slice` (or its removal) as pending. Returns whether that changes anything:
    /// an update equal (in what the proxier uses) to the pending (or, with none pending, the
    /// applied) version is not a change, nor is removing a slice the cache never saw.
    pub(crate) fn update_pending(&mut self, slice: &EndpointSlice, remove: bool) -> Result<bool, InvalidEndpointSlice> {
        let (service, slice_name) = endpoint_slice_keys(slice)?;
        let data = if remove { None } else { Some(self.record(&service, slice)) };
        let changed = match self.services.get(&service) {
            Some(tracker) => match (find(&tracker.pending, &slice_name), find(&tracker.applied, &slice_name)) {
                (Some(pending), _) => *pending != data,
                (None, Some(applied)) => data.as_ref() != Some(applied),
                (None, None) => !remove,
            },
            None => !remove,
        };
        if changed {
            upsert(&mut self.services.entry(service).or_default().pending, slice_name, data);
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
        let mut changes = BTreeMap::new();
        let mut emptied = Vec::new();
        for (service, tracker) in self.services.iter_mut() {
            if tracker.pending.is_empty() {
                continue;
            }
            let previous = merge(tracker.applied.iter().map(|(_, record)| record), self.duplicates);
            for (name, data) in std::mem::take(&mut tracker.pending) {
                match data {
                    Some(record) => upsert(&mut tracker.applied, name, record),
                    None => remove(&mut tracker.applied, &name),
                }
            }
            let current = merge(tracker.applied.iter().map(|(_, record)| record), self.duplicates);
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

    /// The record of one slice of `service` (upstream's `addEndpoints` per port, done once
    /// per slice update rather than on every merge).
    fn record(&self, service: &NamespacedName, slice: &EndpointSlice) -> SliceRecord {
        let slice_name = slice.metadata.name.as_deref().unwrap_or("");
        let endpoints: Vec<(String, &Endpoint)> = slice
            .endpoints
            .iter()
            .filter_map(|ep| {
                let Some(address) = ep.addresses.first() else {
                    tracing::debug!(slice = slice_name, "ignoring endpoint with no address");
                    return None;
                };
                // Upstream 1.31+ writes `ParseIPSloppy(address).String()`; before that, the text
                // as given, which must then already be canonical (see `parse_canonical_ip`).
                let written = if self.canonical_addresses {
                    parse_ip_sloppy(address).map(|ip| (format_ip(&ip), ip))
                } else {
                    match parse_canonical_ip(address) {
                        Ok(ip) => Some((address.clone(), ip)),
                        Err(AddressTextError::NotCanonical { canonical, .. }) => {
                            tracing::warn!(
                                %service,
                                slice = slice_name,
                                address = address.as_str(),
                                canonical,
                                "ignoring endpoint address not in canonical form"
                            );
                            return None;
                        }
                        Err(_) => None,
                    }
                };
                match written {
                    Some((text, ip)) if IpFamily::of(&ip) == self.family => Some((text, ep)),
                    _ => {
                        tracing::warn!(
                            %service,
                            slice = slice_name,
                            address = address.as_str(),
                            family = %self.family,
                            "ignoring endpoint address that is not a valid address of this family"
                        );
                        None
                    }
                }
            })
            .collect();
        let ports = slice
            .ports
            .iter()
            .flatten()
            .filter_map(|port| {
                let (name, number) = valid_port(service, slice_name, port)?;
                let eps = endpoints.iter().map(|(address, ep)| Arc::new(self.endpoint(&name, address, number, ep)));
                let eps = eps.collect();
                Some((name, eps))
            })
            .collect::<Vec<_>>()
            .into_boxed_slice();
        SliceRecord { ports }
    }

    fn endpoint(&self, service_port: &ServicePortName, address: &str, port: i32, ep: &Endpoint) -> EndpointInfo {
        // 1.29 writes the address as it appears in the slice, both in the endpoint string
        // (DNAT target, chain hash) and in IP() (hairpin rule); only canonical text gets here
        // (as given before 1.31, made canonical from 1.31).
        let mut info = EndpointInfo::new(service_port, address, port);
        info.is_local = !self.node_name.is_empty() && ep.node_name.as_deref() == Some(self.node_name.as_str());
        let conditions = ep.conditions.as_ref();
        // Absent ready/serving mean true, absent terminating means false.
        info.ready = conditions.and_then(|c| c.ready).unwrap_or(true);
        info.serving = conditions.and_then(|c| c.serving).unwrap_or(true);
        info.terminating = conditions.and_then(|c| c.terminating).unwrap_or(false);
        if let Some(zones) = ep.hints.as_ref().and_then(|h| h.for_zones.as_ref()) {
            info.zone_hints = zones.iter().map(|z| z.name.clone()).collect();
        }
        if let Some(nodes) = ep.hints.as_ref().and_then(|h| h.for_nodes.as_ref()).filter(|n| !n.is_empty()) {
            let for_this_node = !self.node_name.is_empty() && nodes.iter().any(|n| n.name == self.node_name);
            info.node_hints = if for_this_node { NodeHints::ThisNode } else { NodeHints::OtherNodes };
        }
        info
    }
}

/// The service port an EndpointSlice port is for and its number, or `None` (logged) when
/// the port is unusable.
fn valid_port(
    service: &NamespacedName,
    slice_name: &str,
    port: &k8s_openapi::api::discovery::v1::EndpointPort,
) -> Option<(ServicePortName, i32)> {
    let Some(port_name) = port.name.as_ref() else {
        tracing::debug!(%service, "ignoring endpoint slice port with no name");
        return None;
    };
    let number = match port.port {
        Some(n) if (1..=65535).contains(&n) => n,
        None | Some(0) => {
            tracing::debug!(%service, port = port_name.as_str(), "ignoring endpoint slice port with no number");
            return None;
        }
        Some(other) => {
            tracing::warn!(
                %service,
                slice = slice_name,
                port = port_name.as_str(),
                number = other,
                "ignoring endpoint slice port outside 1-65535"
            );
            return None;
        }
    };
    // The API defaults the protocol to TCP; an absent one is read the same way.
    let protocol = match port.protocol.as_deref() {
        None => Protocol::Tcp,
        Some(p) => match Protocol::from_api(p) {
            Some(protocol) => protocol,
            None => {
                tracing::warn!(%service, slice = slice_name, port = port_name.as_str(), protocol = p, "ignoring endpoint port with unknown protocol");
                return None;
            }
        },
    };
    Some((ServicePortName::new(service.clone(), port_name.clone(), protocol), number))
}

/// Which copy of an endpoint (same address and port) that appears in more than one slice
/// of a Service is used (upstream `addEndpoints`; slices are taken in name order here, in
/// map order upstream).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DuplicateRule {
    /// Up to 1.35: the first copy, unless a later one is local to this node.
    FirstUnlessLaterLocal,
    /// From 1.36 (PR #135593): the last copy, unless it is terminating, so a pod IP reused
    /// by a new Pod while the old one still terminates gets the new Pod's conditions.
    LastUnlessTerminating,
}

/// The endpoints map of one Service from its slices (upstream `getEndpointsMap`): per
/// service port, the endpoints of all slices sorted by endpoint string. The same endpoint
/// may appear twice (e.g. while moving between slices); `duplicates` says which copy counts.
fn merge<'a>(records: impl Iterator<Item = &'a SliceRecord>, duplicates: DuplicateRule) -> EndpointsMap {
    let mut by_port: BTreeMap<&ServicePortName, BTreeMap<&str, &EndpointRef>> = BTreeMap::new();
    for record in records {
        for (name, endpoints) in record.ports.iter() {
            let set = by_port.entry(name).or_default();
            for ep in endpoints.iter() {
                let replace = match duplicates {
                    DuplicateRule::FirstUnlessLaterLocal => ep.is_local || !set.contains_key(ep.endpoint.as_str()),
                    DuplicateRule::LastUnlessTerminating => !ep.terminating || !set.contains_key(ep.endpoint.as_str()),
                };
                if replace {
                    set.insert(ep.endpoint.as_str(), ep);
                }
            }
        }
    }
    by_port
        .into_iter()
        .filter(|(_, set)| !set.is_empty())
        .map(|(name, set)| (name.clone(), set.into_values().map(Arc::clone).collect()))
        .collect()
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::discovery::v1::EndpointPort;

    use super::*;
    use crate::tracker::testing::{bare_ep, slice};

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
            .port("http", "TCP", 80)
            .endpoint(bare_ep("10.0.1.3"))
            .endpoint(bare_ep("10.0.1.10"))
            .build();
        let b = slice("ns1", "svc1", "svc1-b")
            .port("http", "TCP", 80)
            .port("dns", "UDP", 53)
            .endpoint(bare_ep("10.0.1.2"))
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
            ips.iter().fold(slice("ns1", "svc1", name).port("p", "TCP", 80), |b, ip| b.endpoint(bare_ep(ip))).build()
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

    /// From 1.36 (PR #135593): a non-terminating copy beats a terminating one (a pod IP reused
    /// while the old Pod terminates), and locality no longer decides.
    #[test]
    fn from_1_36_a_duplicate_endpoint_prefers_the_non_terminating_copy() {
        let old_pod = |name: &str| {
            slice("ns1", "svc1", name)
                .port("p", "TCP", 80)
                .endpoint(bare_ep("10.0.0.1").node(NODE).conditions(Some(false), Some(true), Some(true)))
                .build()
        };
        let new_pod = |name: &str| {
            slice("ns1", "svc1", name)
                .port("p", "TCP", 80)
                .endpoint(bare_ep("10.0.0.1").node("other").conditions(Some(true), Some(true), Some(false)))
                .build()
        };
        // Either slice order: the new Pod's copy is used from 1.36.
        for (first, second) in [(old_pod("a"), new_pod("b")), (new_pod("a"), old_pod("b"))] {
            let mut cache = EndpointSliceCache::new(NODE, IpFamily::V4).with_release(Release::V1_36);
            let map = apply(&mut cache, &[(first.clone(), false), (second.clone(), false)]);
            let eps = &map[&spn("p", Protocol::Tcp)];
            assert_eq!(eps.len(), 1);
            assert!(eps[0].ready && !eps[0].terminating && !eps[0].is_local);
            // Up to 1.35 the local (terminating) copy wins whatever the order.
            let mut cache = EndpointSliceCache::new(NODE, IpFamily::V4).with_release(Release::V1_35);
            let map = apply(&mut cache, &[(first, false), (second, false)]);
            let eps = &map[&spn("p", Protocol::Tcp)];
            assert!(eps[0].terminating && eps[0].is_local);
        }
    }

    #[test]
    fn duplicate_endpoint_prefers_the_local_copy() {
        let mut cache = EndpointSliceCache::new(NODE, IpFamily::V4);
        // "a" sorts first, so the remote copy is seen first and must be replaced.
        let a = slice("ns1", "svc1", "a").port("p", "TCP", 80).endpoint(bare_ep("10.0.0.1").node("other")).build();
        let b = slice("ns1", "svc1", "b").port("p", "TCP", 80).endpoint(bare_ep("10.0.0.1").node(NODE)).build();
        let map = apply(&mut cache, &[(a.clone(), false), (b, false)]);
        let eps = &map[&spn("p", Protocol::Tcp)];
        assert_eq!(eps.len(), 1);
        assert!(eps[0].is_local);
        // With no local copy the first one stays.
        let mut cache = EndpointSliceCache::new(NODE, IpFamily::V4);
        let c = slice("ns1", "svc1", "c")
            .port("p", "TCP", 80)
            .endpoint(bare_ep("10.0.0.1").conditions(Some(false), Some(false), None))
            .build();
        let map = apply(&mut cache, &[(a, false), (c, false)]);
        assert!(map[&spn("p", Protocol::Tcp)][0].ready);
    }

    #[test]
    fn conditions_default_like_upstream() {
        let mut cache = EndpointSliceCache::new(NODE, IpFamily::V4);
        let s = slice("ns1", "svc1", "s")
            .port("p", "TCP", 80)
            .endpoint(bare_ep("10.0.0.1")) // no conditions at all
            .endpoint(bare_ep("10.0.0.2").conditions(None, None, None))
            .endpoint(bare_ep("10.0.0.3").conditions(Some(false), None, None))
            .endpoint(bare_ep("10.0.0.4").conditions(Some(false), Some(true), Some(true)))
            .endpoint(bare_ep("10.0.0.5").conditions(Some(false), Some(false), Some(true)))
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
            .port("p80", "TCP", 80)
            .endpoint(bare_ep("10.180.0.1").node(NODE).hints(&["zone-a", "zone-b"]))
            .endpoint(bare_ep("10.180.0.2").node("host2"))
            .build();
        let map = apply(&mut cache, &[(s, false)]);
        let eps = &map[&spn("p80", Protocol::Tcp)];
        assert!(eps[0].is_local && !eps[1].is_local);
        assert_eq!(eps[0].zone_hints.iter().map(String::as_str).collect::<Vec<_>>(), ["zone-a", "zone-b"]);
        assert!(eps[1].zone_hints.is_empty());
        // Upstream's own test name for ns1/svc1:p80 endpoint 10.180.0.1:80.
        assert_eq!(eps[0].chain_name(), "KUBE-SEP-SXIVWICOYRO3J4NJ");
        assert_eq!(eps[0].ip(), "10.180.0.1");
        assert_eq!(eps[0].port, 80);

        // Without a node name nothing is local.
        let mut cache = EndpointSliceCache::new("", IpFamily::V4);
        let s = slice("ns1", "svc1", "s").port("p", "TCP", 80).endpoint(bare_ep("10.0.0.1").node("")).build();
        assert!(!apply(&mut cache, &[(s, false)])[&spn("p", Protocol::Tcp)][0].is_local);
    }

    #[test]
    fn address_text_is_kept_as_written() {
        let mut cache = EndpointSliceCache::new(NODE, IpFamily::V6);
        let s =
            slice("ns1", "svc1", "s").address_type("IPv6").port("p", "TCP", 80).endpoint(bare_ep("FD00:0::1")).build();
        let map = apply(&mut cache, &[(s, false)]);
        let e = &map[&spn("p", Protocol::Tcp)][0];
        assert_eq!(e.endpoint, "[FD00:0::1]:80");
        // 1.29's IP() is the address as written too, so hairpin and DNAT rules agree.
        assert_eq!(e.ip(), "FD00:0::1");
    }

    /// Spellings a 1.29-era API server accepts but iptables rejects (failing every restore)
    /// or reads as octal: the endpoint is skipped, its neighbours keep their chain names.
    #[test]
    fn addresses_not_in_canonical_form_are_skipped() {
        for (family, address_type, bad, good) in [
            (IpFamily::V4, "IPv4", "010.244.1.6", "10.244.1.7"),
            (IpFamily::V4, "IPv4", "10.244.1.09", "10.244.1.7"),
            (IpFamily::V4, "IPv4", "::ffff:10.244.1.5", "10.244.1.7"),
            (IpFamily::V4, "IPv4", "0:0:0:0:0:ffff:0a00:0001", "10.244.1.7"),
        ] {
            let mut cache = EndpointSliceCache::new(NODE, family);
            let s = slice("ns1", "svc1", "s")
                .address_type(address_type)
                .port("p", "TCP", 80)
                .endpoint(bare_ep(bad))
                .endpoint(bare_ep(good))
                .build();
            let map = apply(&mut cache, &[(s, false)]);
            let eps = &map[&spn("p", Protocol::Tcp)];
            assert_eq!(eps.len(), 1, "{bad} skipped");
            assert_eq!(eps[0].ip(), good);
            let alone =
                slice("ns1", "svc1", "s").address_type(address_type).port("p", "TCP", 80).endpoint(bare_ep(good));
            let mut reference = EndpointSliceCache::new(NODE, family);
            let expected = apply(&mut reference, &[(alone.build(), false)]);
            assert_eq!(eps[0].chain_name(), expected[&spn("p", Protocol::Tcp)][0].chain_name());
        }
    }

    /// Upstream `TestBadIPs` (1.31): `10.180.00.001` is used as `10.180.0.1` in the DNAT
    /// target, the hairpin match and the endpoint chain's hash; IPv4-mapped is IPv4.
    #[test]
    fn from_1_31_addresses_are_parsed_and_written_canonically() {
        for release in [Release::V1_31, Release::NEWEST] {
            let mut cache = EndpointSliceCache::new(NODE, IpFamily::V4).with_release(release);
            let s = slice("ns1", "svc1", "s")
                .port("p", "TCP", 80)
                .endpoint(bare_ep("10.180.00.001"))
                .endpoint(bare_ep("::ffff:10.244.1.5"))
                .endpoint(bare_ep("not-an-ip"))
                .build();
            let map = apply(&mut cache, &[(s.clone(), false)]);
            let eps = &map[&spn("p", Protocol::Tcp)];
            let ips: Vec<&str> = eps.iter().map(|e| e.ip()).collect();
            assert_eq!(ips, ["10.180.0.1", "10.244.1.5"], "{release}");
            let canonical = slice("ns1", "svc1", "s").port("p", "TCP", 80).endpoint(bare_ep("10.180.0.1")).build();
            let reference = apply(&mut EndpointSliceCache::new(NODE, IpFamily::V4), &[(canonical, false)]);
            assert_eq!(eps[0].chain_name(), reference[&spn("p", Protocol::Tcp)][0].chain_name(), "{release}");
            assert_eq!(
                skipped_endpoint_addresses(&s, release),
                [
                    "endpoint slice ns1/s: endpoints[2].addresses[0]: \"not-an-ip\" is not an IP address; endpoint skipped"
                ]
            );
        }
        // 1.30 still skips them (and says so).
        let mut cache = EndpointSliceCache::new(NODE, IpFamily::V4).with_release(Release::V1_30);
        let s = slice("ns1", "svc1", "s").port("p", "TCP", 80).endpoint(bare_ep("10.180.00.001")).build();
        let map = apply(&mut cache, &[(s.clone(), false)]);
        assert!(map.get(&spn("p", Protocol::Tcp)).is_none_or(|eps| eps.is_empty()));
        assert_eq!(skipped_endpoint_addresses(&s, Release::V1_30).len(), 1);
    }

    #[test]
    fn invalid_ports_and_endpoints_are_skipped() {
        let mut cache = EndpointSliceCache::new(NODE, IpFamily::V4);
        let s = slice("ns1", "svc1", "s")
            .raw_port(EndpointPort { name: None, port: Some(81), ..Default::default() })
            .raw_port(EndpointPort { name: Some("noport".into()), port: None, ..Default::default() })
            .raw_port(EndpointPort { name: Some("zero".into()), port: Some(0), ..Default::default() })
            .raw_port(EndpointPort { name: Some("big".into()), port: Some(70000), ..Default::default() })
            .port("icmp", "ICMP", 1)
            // An absent protocol is read as TCP.
            .raw_port(EndpointPort { name: Some("noproto".into()), port: Some(82), ..Default::default() })
            .endpoint(bare_ep("10.0.0.1"))
            .endpoint(bare_ep("10.0.0.2").no_addresses())
            .endpoint(bare_ep("fd00::1"))
            .endpoint(bare_ep("not-an-ip"))
            .build();
        let map = apply(&mut cache, &[(s, false)]);
        assert_eq!(map.len(), 1);
        assert_eq!(endpoints(&map, &spn("noproto", Protocol::Tcp)), ["10.0.0.1:82"]);
    }

    #[test]
    fn port_without_endpoints_is_absent() {
        let mut cache = EndpointSliceCache::new(NODE, IpFamily::V4);
        let s = slice("ns1", "svc1", "s").port("p", "TCP", 80).build();
        assert!(apply(&mut cache, &[(s, false)]).is_empty());
    }

    #[test]
    fn change_detection_compares_with_pending_then_applied() {
        let mut cache = EndpointSliceCache::new(NODE, IpFamily::V4);
        let v1 = slice("ns1", "svc1", "s").port("p", "TCP", 80).endpoint(bare_ep("10.0.0.1")).build();
        let v2 = slice("ns1", "svc1", "s").port("p", "TCP", 80).endpoint(bare_ep("10.0.0.2")).build();
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
    fn fields_the_proxier_ignores_are_not_kept_or_compared() {
        let mut cache = EndpointSliceCache::new(NODE, IpFamily::V4);
        let v1 = slice("ns1", "svc1", "s").port("p", "TCP", 80).endpoint(bare_ep("10.0.0.1").node("other")).build();
        assert_eq!(cache.update_pending(&v1, false), Ok(true));
        cache.checkout_changes();
        // Only a target reference, the hostname and an annotation differ.
        let mut v2 = v1.clone();
        v2.endpoints[0].hostname = Some("pod-1".into());
        v2.endpoints[0].target_ref = Some(k8s_openapi::api::core::v1::ObjectReference {
            kind: Some("Pod".into()),
            name: Some("pod-1".into()),
            ..Default::default()
        });
        v2.metadata.annotations = Some([("a".to_string(), "b".to_string())].into());
        assert_eq!(cache.update_pending(&v2, false), Ok(false));
        assert!(cache.pending_services().is_empty());
        // Any field it uses is a change: conditions, node (locality), zone hints.
        let mut v3 = v1.clone();
        v3.endpoints[0].node_name = Some(NODE.into());
        assert_eq!(cache.update_pending(&v3, false), Ok(true));
        let v4 = slice("ns1", "svc1", "s")
            .port("p", "TCP", 80)
            .endpoint(bare_ep("10.0.0.1").node("other").hints(&["z"]))
            .build();
        assert_eq!(cache.update_pending(&v4, false), Ok(true));
        let v5 = slice("ns1", "svc1", "s")
            .port("p", "TCP", 80)
            .endpoint(bare_ep("10.0.0.1").node("other").conditions(Some(false), None, None))
            .build();
        assert_eq!(cache.update_pending(&v5, false), Ok(true));
    }

    #[test]
    fn endpoints_map_shares_the_cached_records() {
        let mut cache = EndpointSliceCache::new(NODE, IpFamily::V4);
        let s = slice("ns1", "svc1", "s")
            .port("p", "TCP", 80)
            .endpoint(bare_ep("10.0.0.1"))
            .endpoint(bare_ep("10.0.0.2"))
            .build();
        let map = apply(&mut cache, &[(s, false)]);
        let service = NamespacedName::new("ns1", "svc1");
        let cached = &cache.services[&service].applied[0].1.ports[0].1;
        let mapped = &map[&spn("p", Protocol::Tcp)];
        assert_eq!(cached.len(), 2);
        for (c, m) in cached.iter().zip(mapped) {
            assert!(Arc::ptr_eq(c, m), "one record per endpoint, not a copy");
        }
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
