//! Endpoint changes: [`EndpointChangeTracker`] files EndpointSlice events into the
//! [`EndpointSliceCache`]; [`EndpointsMap::update`] applies them to the proxier's map and
//! reports what conntrack cleanup and metrics need (upstream `EndpointsChangeTracker` /
//! `EndpointsMap.Update`).

use std::collections::{BTreeMap, HashMap, HashSet};

use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::jiff::Timestamp;

use super::endpoint_slice_cache::{EndpointSliceCache, endpoint_slice_keys};
use super::endpoints_map::{EndpointsMap, EndpointsUpdateResult, detect_stale_conntrack_entries};
use crate::model::{IpFamily, NamespacedName, Protocol};

/// Annotation on EndpointSlices recording when the change they carry was triggered.
pub(crate) const ANNOTATION_LAST_CHANGE_TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

impl EndpointsMap {
    /// Applies and clears the changes recorded in `tracker`.
    pub fn update(&mut self, tracker: &mut EndpointChangeTracker) -> EndpointsUpdateResult {
        self.apply(tracker.take_changes())
    }

    /// Applies changes taken out of a tracker ([`EndpointChangeTracker::take_changes`]).
    pub fn apply(&mut self, changes: EndpointChanges) -> EndpointsUpdateResult {
        let mut result = EndpointsUpdateResult::default();
        for (service, change) in changes.changes {
            for name in change.previous.keys() {
                self.remove(name);
            }
            for (name, endpoints) in change.current.iter() {
                self.insert(name.clone(), endpoints.clone());
            }
            detect_stale_conntrack_entries(&change.previous, &change.current, &mut result);
            result.conntrack_cleanup_required |=
                change.previous.keys().chain(change.current.keys()).any(|name| name.protocol == Protocol::Udp);
            result.updated_services.insert(service);
        }
        result.deleted_udp_endpoints.sort();
        result.newly_active_udp_services.sort();
        result.last_change_trigger_times = changes.last_change_trigger_times;
        result
    }
}

/// Changes taken out of an [`EndpointChangeTracker`] (each Service's endpoints before and
/// after), to be applied with [`EndpointsMap::apply`] outside the tracker's lock.
#[derive(Debug, Default)]
pub struct EndpointChanges {
    changes: BTreeMap<NamespacedName, super::endpoint_slice_cache::EndpointsChange>,
    last_change_trigger_times: HashMap<NamespacedName, Vec<Timestamp>>,
}

impl EndpointChanges {
    /// Services with changes in this batch.
    pub fn services(&self) -> impl Iterator<Item = &NamespacedName> {
        self.changes.keys()
    }
}

/// Unapplied EndpointSlice changes for one IP family.
#[derive(Debug)]
pub struct EndpointChangeTracker {
    family: IpFamily,
    cache: EndpointSliceCache,
    /// Trigger times of pending changes per Service (only those after `start_time`).
    last_change_trigger_times: HashMap<NamespacedName, Vec<Timestamp>>,
    /// When the tracker was created: older trigger times predate this process (e.g. all
    /// slices listed at startup) and would distort the latency metric.
    start_time: Timestamp,
}

impl EndpointChangeTracker {
    /// A tracker for `family`; endpoints on `node_name` are local.
    pub fn new(node_name: impl Into<String>, family: IpFamily) -> EndpointChangeTracker {
        EndpointChangeTracker::with_start_time(node_name, family, now())
    }

    /// As [`EndpointChangeTracker::new`], with an explicit start time (for tests).
    pub(crate) fn with_start_time(
        node_name: impl Into<String>,
        family: IpFamily,
        start_time: Timestamp,
    ) -> EndpointChangeTracker {
        EndpointChangeTracker {
            family,
            cache: EndpointSliceCache::new(node_name, family),
            last_change_trigger_times: HashMap::new(),
            start_time,
        }
    }

    /// Reads slices as `release` does (see [`EndpointSliceCache::with_release`]).
    pub fn with_release(mut self, release: crate::compat::Release) -> EndpointChangeTracker {
        self.cache = self.cache.with_release(release);
        self
    }

    pub fn family(&self) -> IpFamily {
        self.family
    }

    /// Records an added or updated (`remove == false`) or deleted slice. Returns whether
    /// this event changed anything that needs a sync. Slices of the other address family
    /// (and FQDN slices) and slices that cannot be filed under a Service are ignored.
    pub fn endpoint_slice_update(&mut self, slice: &EndpointSlice, remove: bool) -> bool {
        if slice.address_type != self.family.slice_address_type() {
            tracing::trace!(
                address_type = slice.address_type.as_str(),
                family = %self.family,
                "ignoring endpoint slice of another address type"
            );
            return false;
        }
        let service = match endpoint_slice_keys(slice) {
            Ok((service, _)) => service,
            Err(err) => {
                tracing::info!("ignoring endpoint slice: {err}");
                return false;
            }
        };
        let changed = match self.cache.update_pending(slice, remove) {
            Ok(changed) => changed,
            Err(err) => {
                tracing::info!("ignoring endpoint slice: {err}");
                return false;
            }
        };
        if changed {
            // A deleted slice's trigger time is that of its last update, not of the delete.
            if remove {
                self.last_change_trigger_times.remove(&service);
            } else if let Some(time) = last_change_trigger_time(slice)
                && time > self.start_time
            {
                self.last_change_trigger_times.entry(service).or_default().push(time);
            }
        }
        changed
    }

    /// Marks every pending slice update as applied and takes out what it changed.
    pub(crate) fn take_changes(&mut self) -> EndpointChanges {
        EndpointChanges {
            changes: self.cache.checkout_changes(),
            last_change_trigger_times: std::mem::take(&mut self.last_change_trigger_times),
        }
    }

    /// Services with unapplied endpoint changes (call before [`EndpointsMap::update`]).
    pub(crate) fn pending_changes(&self) -> HashSet<NamespacedName> {
        self.cache.pending_services()
    }
}

/// The current time (jiff is built without its `std` feature, so no `Timestamp::now`).
fn now() -> Timestamp {
    let since_epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let seconds = i64::try_from(since_epoch.as_secs()).unwrap_or(i64::MAX);
    let nanos = i32::try_from(since_epoch.subsec_nanos()).unwrap_or(0);
    Timestamp::new(seconds, nanos).unwrap_or(Timestamp::MAX)
}

/// The slice's last-change-trigger-time annotation, if present and valid RFC 3339.
fn last_change_trigger_time(slice: &EndpointSlice) -> Option<Timestamp> {
    let value = slice.metadata.annotations.as_ref()?.get(ANNOTATION_LAST_CHANGE_TRIGGER_TIME)?;
    match value.parse::<Timestamp>() {
        Ok(time) => Some(time),
        Err(err) => {
            tracing::warn!(value = value.as_str(), "invalid {ANNOTATION_LAST_CHANGE_TRIGGER_TIME} annotation: {err}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::model::ServicePortName;
    use crate::tracker::endpoints_map::{LocalReadyEndpoints, ServiceEndpoint};
    use crate::tracker::testing::{SliceBuilder, bare_ep, slice};

    const NODE: &str = "test-node";

    fn tracker() -> EndpointChangeTracker {
        EndpointChangeTracker::with_start_time(NODE, IpFamily::V4, Timestamp::UNIX_EPOCH)
    }

    fn spn(ns: &str, name: &str, port: &str) -> ServicePortName {
        ServicePortName::new(NamespacedName::new(ns, name), port, Protocol::Udp)
    }

    /// `(endpoint, is_local)` per service port, in map order.
    type Summary = BTreeMap<ServicePortName, Vec<(String, bool)>>;

    fn summary(map: &EndpointsMap) -> Summary {
        map.iter()
            .map(|(name, eps)| (name.clone(), eps.iter().map(|e| (e.endpoint.clone(), e.is_local)).collect()))
            .collect()
    }

    /// `(namespace, service, port, [(endpoint, is_local)])`.
    type Row<'a> = (&'a str, &'a str, &'a str, &'a [(&'a str, bool)]);

    fn expect(entries: &[Row<'_>]) -> Summary {
        entries
            .iter()
            .map(|(ns, name, port, eps)| (spn(ns, name, port), eps.iter().map(|(e, l)| (e.to_string(), *l)).collect()))
            .collect()
    }

    fn udp(b: SliceBuilder, ports: &[(&str, i32)]) -> SliceBuilder {
        ports.iter().fold(b, |b, (name, port)| b.port(name, "UDP", *port))
    }

    struct Case {
        name: &'static str,
        previous: Vec<Option<EndpointSlice>>,
        current: Vec<Option<EndpointSlice>>,
        old: Summary,
        expected: Summary,
        deleted: Vec<(ServicePortName, &'static str)>,
        newly_active: Vec<ServicePortName>,
        local: LocalReadyEndpoints,
    }

    // The slices of upstream's TestUpdateEndpointsMap (iptables proxier_test.go).
    fn named_port_local() -> EndpointSlice {
        udp(slice("ns1", "ep1", "ep1-1").endpoint(bare_ep("10.1.1.1").node(NODE)), &[("p11", 11)]).build()
    }
    fn named_port() -> EndpointSlice {
        udp(slice("ns1", "ep1", "ep1-1").endpoint(bare_ep("10.1.1.1")), &[("p11", 11)]).build()
    }
    fn subset2() -> EndpointSlice {
        udp(slice("ns1", "ep1", "ep1-2").endpoint(bare_ep("10.1.1.2")), &[("p12", 12)]).build()
    }
    fn subset_local2() -> EndpointSlice {
        udp(slice("ns1", "ep1", "ep1-2").endpoint(bare_ep("10.1.1.2").node(NODE)), &[("p12", 12)]).build()
    }
    fn named_ports_local_no_local() -> EndpointSlice {
        udp(
            slice("ns1", "ep1", "ep1-1").endpoint(bare_ep("10.1.1.1")).endpoint(bare_ep("10.1.1.2").node(NODE)),
            &[("p11", 11), ("p12", 12)],
        )
        .build()
    }
    fn multiple_subsets_multiple_ports_local() -> Vec<Option<EndpointSlice>> {
        vec![
            Some(
                udp(slice("ns1", "ep1", "ep1-1").endpoint(bare_ep("10.1.1.1").node(NODE)), &[("p11", 11), ("p12", 12)])
                    .build(),
            ),
            Some(udp(slice("ns1", "ep1", "ep1-2").endpoint(bare_ep("10.1.1.3")), &[("p13", 13)]).build()),
        ]
    }
    fn multiple_subsets_ips_ports() -> Vec<Option<EndpointSlice>> {
        vec![
            Some(
                udp(
                    slice("ns1", "ep1", "ep1-1").endpoint(bare_ep("10.1.1.1")).endpoint(bare_ep("10.1.1.2").node(NODE)),
                    &[("p11", 11), ("p12", 12)],
                )
                .build(),
            ),
            Some(
                udp(
                    slice("ns1", "ep1", "ep1-2").endpoint(bare_ep("10.1.1.3")).endpoint(bare_ep("10.1.1.4").node(NODE)),
                    &[("p13", 13), ("p14", 14)],
                )
                .build(),
            ),
            Some(
                udp(
                    slice("ns2", "ep2", "ep2-1").endpoint(bare_ep("10.2.2.1")).endpoint(bare_ep("10.2.2.2").node(NODE)),
                    &[("p21", 21), ("p22", 22)],
                )
                .build(),
            ),
        ]
    }

    fn cases() -> Vec<Case> {
        let nn = NamespacedName::new;
        let ep1_named = expect(&[("ns1", "ep1", "p11", &[("10.1.1.1:11", false)])]);
        vec![
            Case {
                name: "nothing",
                previous: vec![],
                current: vec![],
                old: Summary::new(),
                expected: Summary::new(),
                deleted: vec![],
                newly_active: vec![],
                local: LocalReadyEndpoints::new(),
            },
            Case {
                name: "no change, named port, local",
                previous: vec![Some(named_port_local())],
                current: vec![Some(named_port_local())],
                old: expect(&[("ns1", "ep1", "p11", &[("10.1.1.1:11", true)])]),
                expected: expect(&[("ns1", "ep1", "p11", &[("10.1.1.1:11", true)])]),
                deleted: vec![],
                newly_active: vec![],
                local: LocalReadyEndpoints::from([(nn("ns1", "ep1"), 1)]),
            },
            Case {
                name: "no change, multiple subsets",
                previous: vec![Some(named_port()), Some(subset2())],
                current: vec![Some(named_port()), Some(subset2())],
                old: expect(&[
                    ("ns1", "ep1", "p11", &[("10.1.1.1:11", false)]),
                    ("ns1", "ep1", "p12", &[("10.1.1.2:12", false)]),
                ]),
                expected: expect(&[
                    ("ns1", "ep1", "p11", &[("10.1.1.1:11", false)]),
                    ("ns1", "ep1", "p12", &[("10.1.1.2:12", false)]),
                ]),
                deleted: vec![],
                newly_active: vec![],
                local: LocalReadyEndpoints::new(),
            },
            Case {
                name: "no change, multiple subsets, multiple ports, local",
                previous: multiple_subsets_multiple_ports_local(),
                current: multiple_subsets_multiple_ports_local(),
                old: expect(&[
                    ("ns1", "ep1", "p11", &[("10.1.1.1:11", true)]),
                    ("ns1", "ep1", "p12", &[("10.1.1.1:12", true)]),
                    ("ns1", "ep1", "p13", &[("10.1.1.3:13", false)]),
                ]),
                expected: expect(&[
                    ("ns1", "ep1", "p11", &[("10.1.1.1:11", true)]),
                    ("ns1", "ep1", "p12", &[("10.1.1.1:12", true)]),
                    ("ns1", "ep1", "p13", &[("10.1.1.3:13", false)]),
                ]),
                deleted: vec![],
                newly_active: vec![],
                local: LocalReadyEndpoints::from([(nn("ns1", "ep1"), 1)]),
            },
            Case {
                name: "no change, multiple endpoints, subsets, IPs, and ports",
                previous: multiple_subsets_ips_ports(),
                current: multiple_subsets_ips_ports(),
                old: expect(&[
                    ("ns1", "ep1", "p11", &[("10.1.1.1:11", false), ("10.1.1.2:11", true)]),
                    ("ns1", "ep1", "p12", &[("10.1.1.1:12", false), ("10.1.1.2:12", true)]),
                    ("ns1", "ep1", "p13", &[("10.1.1.3:13", false), ("10.1.1.4:13", true)]),
                    ("ns1", "ep1", "p14", &[("10.1.1.3:14", false), ("10.1.1.4:14", true)]),
                    ("ns2", "ep2", "p21", &[("10.2.2.1:21", false), ("10.2.2.2:21", true)]),
                    ("ns2", "ep2", "p22", &[("10.2.2.1:22", false), ("10.2.2.2:22", true)]),
                ]),
                expected: expect(&[
                    ("ns1", "ep1", "p11", &[("10.1.1.1:11", false), ("10.1.1.2:11", true)]),
                    ("ns1", "ep1", "p12", &[("10.1.1.1:12", false), ("10.1.1.2:12", true)]),
                    ("ns1", "ep1", "p13", &[("10.1.1.3:13", false), ("10.1.1.4:13", true)]),
                    ("ns1", "ep1", "p14", &[("10.1.1.3:14", false), ("10.1.1.4:14", true)]),
                    ("ns2", "ep2", "p21", &[("10.2.2.1:21", false), ("10.2.2.2:21", true)]),
                    ("ns2", "ep2", "p22", &[("10.2.2.1:22", false), ("10.2.2.2:22", true)]),
                ]),
                deleted: vec![],
                newly_active: vec![],
                local: LocalReadyEndpoints::from([(nn("ns1", "ep1"), 2), (nn("ns2", "ep2"), 1)]),
            },
            Case {
                name: "add an Endpoints",
                previous: vec![None],
                current: vec![Some(named_port_local())],
                old: Summary::new(),
                expected: expect(&[("ns1", "ep1", "p11", &[("10.1.1.1:11", true)])]),
                deleted: vec![],
                newly_active: vec![spn("ns1", "ep1", "p11")],
                local: LocalReadyEndpoints::from([(nn("ns1", "ep1"), 1)]),
            },
            Case {
                name: "remove an Endpoints",
                previous: vec![Some(named_port_local())],
                current: vec![None],
                old: expect(&[("ns1", "ep1", "p11", &[("10.1.1.1:11", true)])]),
                expected: Summary::new(),
                deleted: vec![(spn("ns1", "ep1", "p11"), "10.1.1.1:11")],
                newly_active: vec![],
                local: LocalReadyEndpoints::new(),
            },
            Case {
                name: "add an IP and port",
                previous: vec![Some(named_port())],
                current: vec![Some(named_ports_local_no_local())],
                old: ep1_named.clone(),
                expected: expect(&[
                    ("ns1", "ep1", "p11", &[("10.1.1.1:11", false), ("10.1.1.2:11", true)]),
                    ("ns1", "ep1", "p12", &[("10.1.1.1:12", false), ("10.1.1.2:12", true)]),
                ]),
                deleted: vec![],
                newly_active: vec![spn("ns1", "ep1", "p12")],
                local: LocalReadyEndpoints::from([(nn("ns1", "ep1"), 1)]),
            },
            Case {
                name: "remove an IP and port",
                previous: vec![Some(named_ports_local_no_local())],
                current: vec![Some(named_port())],
                old: expect(&[
                    ("ns1", "ep1", "p11", &[("10.1.1.1:11", false), ("10.1.1.2:11", true)]),
                    ("ns1", "ep1", "p12", &[("10.1.1.1:12", false), ("10.1.1.2:12", true)]),
                ]),
                expected: ep1_named.clone(),
                deleted: vec![
                    (spn("ns1", "ep1", "p11"), "10.1.1.2:11"),
                    (spn("ns1", "ep1", "p12"), "10.1.1.1:12"),
                    (spn("ns1", "ep1", "p12"), "10.1.1.2:12"),
                ],
                newly_active: vec![],
                local: LocalReadyEndpoints::new(),
            },
            Case {
                name: "add a subset",
                previous: vec![Some(named_port()), None],
                current: vec![Some(named_port()), Some(subset_local2())],
                old: ep1_named.clone(),
                expected: expect(&[
                    ("ns1", "ep1", "p11", &[("10.1.1.1:11", false)]),
                    ("ns1", "ep1", "p12", &[("10.1.1.2:12", true)]),
                ]),
                deleted: vec![],
                newly_active: vec![spn("ns1", "ep1", "p12")],
                local: LocalReadyEndpoints::from([(nn("ns1", "ep1"), 1)]),
            },
            Case {
                name: "remove a subset",
                previous: vec![Some(named_port()), Some(subset2())],
                current: vec![Some(named_port()), None],
                old: expect(&[
                    ("ns1", "ep1", "p11", &[("10.1.1.1:11", false)]),
                    ("ns1", "ep1", "p12", &[("10.1.1.2:12", false)]),
                ]),
                expected: ep1_named.clone(),
                deleted: vec![(spn("ns1", "ep1", "p12"), "10.1.1.2:12")],
                newly_active: vec![],
                local: LocalReadyEndpoints::new(),
            },
            Case {
                name: "rename a port",
                previous: vec![Some(named_port())],
                current: vec![Some(
                    udp(slice("ns1", "ep1", "ep1-1").endpoint(bare_ep("10.1.1.1")), &[("p11-2", 11)]).build(),
                )],
                old: ep1_named.clone(),
                expected: expect(&[("ns1", "ep1", "p11-2", &[("10.1.1.1:11", false)])]),
                deleted: vec![(spn("ns1", "ep1", "p11"), "10.1.1.1:11")],
                newly_active: vec![spn("ns1", "ep1", "p11-2")],
                local: LocalReadyEndpoints::new(),
            },
            Case {
                name: "renumber a port",
                previous: vec![Some(named_port())],
                current: vec![Some(
                    udp(slice("ns1", "ep1", "ep1-1").endpoint(bare_ep("10.1.1.1")), &[("p11", 22)]).build(),
                )],
                old: ep1_named.clone(),
                expected: expect(&[("ns1", "ep1", "p11", &[("10.1.1.1:22", false)])]),
                deleted: vec![(spn("ns1", "ep1", "p11"), "10.1.1.1:11")],
                newly_active: vec![],
                local: LocalReadyEndpoints::new(),
            },
            complex_add_and_remove(),
            Case {
                name: "change from 0 endpoint address to 1 unnamed port",
                previous: vec![Some(slice("ns1", "ep1", "ep1-1").build())],
                current: vec![Some(named_port())],
                old: Summary::new(),
                expected: ep1_named,
                deleted: vec![],
                newly_active: vec![spn("ns1", "ep1", "p11")],
                local: LocalReadyEndpoints::new(),
            },
        ]
    }

    fn complex_add_and_remove() -> Case {
        let s = |ns: &str, svc: &str, n: &str, eps: &[(&str, bool)], ports: &[(&str, i32)]| {
            let b = eps.iter().fold(slice(ns, svc, n), |b, (addr, local)| {
                b.endpoint(if *local { bare_ep(addr).node(NODE) } else { bare_ep(addr) })
            });
            Some(udp(b, ports).build())
        };
        Case {
            name: "complex add and remove",
            previous: vec![
                s("ns1", "ep1", "ep1-1", &[("10.1.1.1", false)], &[("p11", 11)]),
                None,
                s("ns2", "ep2", "ep2-1", &[("10.2.2.2", true), ("10.2.2.22", true)], &[("p22", 22)]),
                s("ns2", "ep2", "ep2-2", &[("10.2.2.3", true)], &[("p23", 23)]),
                None,
                s("ns4", "ep4", "ep4-1", &[("10.4.4.4", true), ("10.4.4.5", true)], &[("p44", 44)]),
                s("ns4", "ep4", "ep4-2", &[("10.4.4.6", true)], &[("p45", 45)]),
            ],
            current: vec![
                s("ns1", "ep1", "ep1-1", &[("10.1.1.1", false), ("10.1.1.11", false)], &[("p11", 11)]),
                s("ns1", "ep1", "ep1-2", &[("10.1.1.2", false)], &[("p12", 12), ("p122", 122)]),
                None,
                None,
                s("ns3", "ep3", "ep3-1", &[("10.3.3.3", false)], &[("p33", 33)]),
                s("ns4", "ep4", "ep4-1", &[("10.4.4.4", true)], &[("p44", 44)]),
                None,
            ],
            old: expect(&[
                ("ns1", "ep1", "p11", &[("10.1.1.1:11", false)]),
                ("ns2", "ep2", "p22", &[("10.2.2.22:22", true), ("10.2.2.2:22", true)]),
                ("ns2", "ep2", "p23", &[("10.2.2.3:23", true)]),
                ("ns4", "ep4", "p44", &[("10.4.4.4:44", true), ("10.4.4.5:44", true)]),
                ("ns4", "ep4", "p45", &[("10.4.4.6:45", true)]),
            ]),
            // Sorted as strings: "10.1.1.11:11" < "10.1.1.1:11".
            expected: expect(&[
                ("ns1", "ep1", "p11", &[("10.1.1.11:11", false), ("10.1.1.1:11", false)]),
                ("ns1", "ep1", "p12", &[("10.1.1.2:12", false)]),
                ("ns1", "ep1", "p122", &[("10.1.1.2:122", false)]),
                ("ns3", "ep3", "p33", &[("10.3.3.3:33", false)]),
                ("ns4", "ep4", "p44", &[("10.4.4.4:44", true)]),
            ]),
            deleted: vec![
                (spn("ns2", "ep2", "p22"), "10.2.2.2:22"),
                (spn("ns2", "ep2", "p22"), "10.2.2.22:22"),
                (spn("ns2", "ep2", "p23"), "10.2.2.3:23"),
                (spn("ns4", "ep4", "p44"), "10.4.4.5:44"),
                (spn("ns4", "ep4", "p45"), "10.4.4.6:45"),
            ],
            newly_active: vec![spn("ns1", "ep1", "p12"), spn("ns1", "ep1", "p122"), spn("ns3", "ep3", "p33")],
            local: LocalReadyEndpoints::from([(NamespacedName::new("ns4", "ep4"), 1)]),
        }
    }

    // Upstream TestUpdateEndpointsMap.
    #[test]
    fn update_endpoints_map_matches_upstream_cases() {
        for case in cases() {
            assert_eq!(case.previous.len(), case.current.len(), "{}", case.name);
            let mut tracker = tracker();
            let mut map = EndpointsMap::new();
            for s in case.previous.iter().flatten() {
                tracker.endpoint_slice_update(s, false);
            }
            map.update(&mut tracker);
            assert_eq!(summary(&map), case.old, "{}: before", case.name);

            for (prev, curr) in case.previous.iter().zip(&case.current) {
                match (prev, curr) {
                    (_, Some(curr)) => tracker.endpoint_slice_update(curr, false),
                    (Some(prev), None) => tracker.endpoint_slice_update(prev, true),
                    (None, None) => false,
                };
            }
            let result = map.update(&mut tracker);
            assert_eq!(summary(&map), case.expected, "{}: after", case.name);
            let mut deleted: Vec<ServiceEndpoint> = case
                .deleted
                .iter()
                .map(|(name, e)| ServiceEndpoint { service_port_name: name.clone(), endpoint: e.to_string() })
                .collect();
            deleted.sort();
            assert_eq!(result.deleted_udp_endpoints, deleted, "{}: deleted", case.name);
            let mut newly_active = case.newly_active.clone();
            newly_active.sort();
            assert_eq!(result.newly_active_udp_services, newly_active, "{}: newly active", case.name);
            assert_eq!(map.local_ready_endpoints(), case.local, "{}: local", case.name);
        }
    }

    // Upstream TestHealthCheckNodePortWhenTerminating.
    #[test]
    fn local_ready_endpoints_ignore_terminating() {
        let base = || slice("ns1", "svc1", "svc1-1").port("", "TCP", 80);
        let ready = base()
            .endpoint(bare_ep("10.0.1.1").conditions(Some(true), None, None).node(NODE))
            .endpoint(bare_ep("10.0.1.2").conditions(Some(true), None, None).node(NODE))
            .endpoint(bare_ep("10.0.1.3").conditions(Some(true), None, None).node(NODE))
            .endpoint(bare_ep("10.0.1.4").conditions(Some(false), None, None).node(NODE))
            .build();
        let mut tracker = tracker();
        let mut map = EndpointsMap::new();
        tracker.endpoint_slice_update(&ready, false);
        map.update(&mut tracker);
        assert_eq!(map.local_ready_endpoints(), LocalReadyEndpoints::from([(NamespacedName::new("ns1", "svc1"), 3)]));

        let terminating = base()
            .endpoint(bare_ep("10.0.1.1").conditions(Some(false), Some(true), Some(false)).node(NODE))
            .endpoint(bare_ep("10.0.1.2").conditions(Some(false), Some(true), Some(true)).node(NODE))
            .endpoint(bare_ep("10.0.1.3").conditions(Some(false), Some(true), Some(true)).node(NODE))
            .endpoint(bare_ep("10.0.1.4").conditions(Some(false), Some(false), Some(true)).node(NODE))
            .build();
        tracker.endpoint_slice_update(&terminating, false);
        map.update(&mut tracker);
        assert!(map.local_ready_endpoints().is_empty());
    }

    #[test]
    fn local_ready_endpoints_count_ips_once_across_ports() {
        let s = slice("ns", "svc", "svc-1")
            .port("http", "TCP", 80)
            .port("https", "TCP", 443)
            .endpoint(bare_ep("10.0.0.1").node(NODE))
            .endpoint(bare_ep("10.0.0.2"))
            .build();
        let mut tracker = tracker();
        let mut map = EndpointsMap::new();
        tracker.endpoint_slice_update(&s, false);
        map.update(&mut tracker);
        assert_eq!(map.local_ready_endpoints(), LocalReadyEndpoints::from([(NamespacedName::new("ns", "svc"), 1)]));
    }

    #[test]
    fn unready_udp_endpoints_are_not_stale_and_do_not_activate() {
        // Upstream TestProxierDeleteNodePortStaleUDP: a not-ready endpoint does not make the
        // service newly active; becoming ready does.
        let base = || slice("ns1", "svc1", "svc1-1").port("p80", "UDP", 80);
        let mut tracker = tracker();
        let mut map = EndpointsMap::new();
        tracker.endpoint_slice_update(
            &base().endpoint(bare_ep("10.180.0.1").conditions(Some(false), None, None)).build(),
            false,
        );
        let result = map.update(&mut tracker);
        assert!(result.newly_active_udp_services.is_empty());
        tracker.endpoint_slice_update(
            &base().endpoint(bare_ep("10.180.0.1").conditions(Some(true), None, None)).build(),
            false,
        );
        let result = map.update(&mut tracker);
        assert_eq!(result.newly_active_udp_services, [spn("ns1", "svc1", "p80")]);
        // Going unready makes the (previously ready) endpoint stale.
        tracker.endpoint_slice_update(
            &base().endpoint(bare_ep("10.180.0.1").conditions(Some(false), None, None)).build(),
            false,
        );
        let result = map.update(&mut tracker);
        assert_eq!(result.deleted_udp_endpoints.len(), 1);
        assert!(result.deleted_udp_endpoints[0].endpoint == "10.180.0.1:80");
    }

    #[test]
    fn tcp_changes_report_nothing_for_conntrack() {
        let s = slice("ns", "svc", "svc-1").port("p", "TCP", 80).endpoint(bare_ep("10.0.0.1")).build();
        let mut tracker = tracker();
        let mut map = EndpointsMap::new();
        tracker.endpoint_slice_update(&s, false);
        let result = map.update(&mut tracker);
        assert!(result.newly_active_udp_services.is_empty());
        assert_eq!(result.updated_services, HashSet::from([NamespacedName::new("ns", "svc")]));
        tracker.endpoint_slice_update(&s, true);
        let result = map.update(&mut tracker);
        assert!(result.deleted_udp_endpoints.is_empty());
        assert!(map.is_empty());
    }

    #[test]
    fn other_address_types_and_unlabelled_slices_are_ignored() {
        let mut tracker = tracker();
        let v6 =
            slice("ns", "svc", "v6").address_type("IPv6").port("p", "TCP", 80).endpoint(bare_ep("fd00::1")).build();
        let fqdn = slice("ns", "svc", "fqdn")
            .address_type("FQDN")
            .port("p", "TCP", 80)
            .endpoint(bare_ep("example.com"))
            .build();
        assert!(!tracker.endpoint_slice_update(&v6, false));
        assert!(!tracker.endpoint_slice_update(&fqdn, false));
        let mut unlabelled = slice("ns", "svc", "x").port("p", "TCP", 80).endpoint(bare_ep("10.0.0.1")).build();
        unlabelled.metadata.labels = None;
        assert!(!tracker.endpoint_slice_update(&unlabelled, false));
        let mut unnamed = slice("ns", "svc", "x").build();
        unnamed.metadata.name = None;
        assert!(!tracker.endpoint_slice_update(&unnamed, false));
        assert!(tracker.pending_changes().is_empty());

        let mut v6_tracker = EndpointChangeTracker::with_start_time(NODE, IpFamily::V6, Timestamp::UNIX_EPOCH);
        assert!(v6_tracker.endpoint_slice_update(&v6, false));
        let mut map = EndpointsMap::new();
        map.update(&mut v6_tracker);
        let eps = &map[&ServicePortName::new(NamespacedName::new("ns", "svc"), "p", Protocol::Tcp)];
        assert_eq!(eps[0].endpoint, "[fd00::1]:80");
        assert_eq!(eps[0].ip(), "fd00::1");
    }

    #[test]
    fn pending_changes_and_no_op_updates() {
        let s = slice("ns", "svc", "svc-1").port("p", "TCP", 80).endpoint(bare_ep("10.0.0.1")).build();
        let mut tracker = tracker();
        // Removing a slice never seen is not a change.
        assert!(!tracker.endpoint_slice_update(&s, true));
        assert!(tracker.endpoint_slice_update(&s, false));
        // The same object again is not a change.
        assert!(!tracker.endpoint_slice_update(&s, false));
        assert_eq!(tracker.pending_changes(), HashSet::from([NamespacedName::new("ns", "svc")]));
        let mut map = EndpointsMap::new();
        map.update(&mut tracker);
        assert!(tracker.pending_changes().is_empty());
        assert!(!tracker.endpoint_slice_update(&s, false));
        // Added and removed between syncs: a (no-op) change for the service.
        let other = slice("ns", "other", "other-1").port("p", "TCP", 80).endpoint(bare_ep("10.0.0.2")).build();
        assert!(tracker.endpoint_slice_update(&other, false));
        assert!(tracker.endpoint_slice_update(&other, true));
        let result = map.update(&mut tracker);
        assert_eq!(result.updated_services, HashSet::from([NamespacedName::new("ns", "other")]));
        assert_eq!(map.len(), 1);
    }

    #[test]
    fn last_change_trigger_times() {
        let start: Timestamp = "2024-01-01T00:00:00Z".parse().unwrap();
        let mut tracker = EndpointChangeTracker::with_start_time(NODE, IpFamily::V4, start);
        let with_time = |name: &str, t: &str| {
            slice("ns", "svc", name)
                .port("p", "TCP", 80)
                .endpoint(bare_ep("10.0.0.1"))
                .annotation(ANNOTATION_LAST_CHANGE_TRIGGER_TIME, t)
                .build()
        };
        tracker.endpoint_slice_update(&with_time("a", "2023-12-31T23:59:59Z"), false); // before start
        tracker.endpoint_slice_update(&with_time("b", "2024-01-01T00:00:01.5Z"), false);
        tracker.endpoint_slice_update(&with_time("c", "not a time"), false);
        tracker.endpoint_slice_update(&with_time("d", "2024-01-01T02:00:00+01:00"), false);
        let mut map = EndpointsMap::new();
        let result = map.update(&mut tracker);
        let times = &result.last_change_trigger_times[&NamespacedName::new("ns", "svc")];
        let expected: Vec<Timestamp> =
            ["2024-01-01T00:00:01.5Z", "2024-01-01T01:00:00Z"].iter().map(|t| t.parse().unwrap()).collect();
        assert_eq!(times, &expected);
        // Times are handed out once.
        assert!(map.update(&mut tracker).last_change_trigger_times.is_empty());

        // Deleting a slice drops the service's pending trigger times.
        tracker.endpoint_slice_update(&with_time("e", "2024-01-02T00:00:00Z"), false);
        tracker.endpoint_slice_update(&with_time("b", "2024-01-02T00:00:00Z"), true);
        assert!(map.update(&mut tracker).last_change_trigger_times.is_empty());
    }
}
