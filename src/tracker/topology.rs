//! Endpoint selection for one service port (upstream `CategorizeEndpoints`): which endpoints
//! "Cluster" and "Local" traffic policy use, and which endpoint chains must exist.
//!
//! Pure function of the endpoints, the service port, the node's labels and the release
//! emulated: whether hints need the topology annotation is decided per service
//! ([`ServicePortInfo::hints_enabled`]); node hints (`trafficDistribution: PreferSameNode`)
//! count only with PreferSameTrafficDistribution.

use std::collections::{BTreeMap, HashSet};

use crate::compat::Features;
use crate::model::{EndpointInfo, EndpointRef, NodeHints, ServicePortInfo};

/// The node label holding the node's zone.
pub(crate) const LABEL_TOPOLOGY_ZONE: &str = "topology.kubernetes.io/zone";

/// The endpoint sets of one service port, each in the order of the input (the endpoints map
/// keeps them sorted by endpoint string).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Categorized<'a> {
    /// Endpoints for "Cluster" traffic policy; empty when the port never uses it.
    pub cluster: Vec<&'a EndpointRef>,
    /// Endpoints for "Local" traffic policy; empty when the port never uses it.
    pub local: Vec<&'a EndpointRef>,
    /// Every endpoint this node may send traffic to under the port's policies: the union
    /// of `cluster` and `local`, one entry per endpoint string. These are the endpoint
    /// chains to write.
    pub all_reachable: Vec<&'a EndpointRef>,
    /// Whether the service has any usable endpoint anywhere in the cluster (decides between
    /// REJECT and DROP-for-no-local-endpoints).
    pub has_any_endpoints: bool,
}

/// Splits `endpoints` of `svc` into the Cluster and Local sets, exactly as upstream:
///
/// - Cluster: ready endpoints, narrowed to those hinted for this node or this node's zone
///   when such hints apply; if none are ready anywhere, the serving-and-terminating ones.
/// - Local: local ready endpoints, or if there are none, local serving-and-terminating ones.
///   Topology is never applied to Local.
///
/// Upstream builds `all_reachable` through a Go map when the two sets can differ, so its
/// order is random there; here it always follows the input order.
pub(crate) fn categorize_endpoints<'a>(
    endpoints: &'a [EndpointRef],
    svc: &ServicePortInfo,
    features: &Features,
    node_labels: &BTreeMap<String, String>,
) -> Categorized<'a> {
    let mut out = Categorized::default();
    let mut use_topology = false;

    if svc.uses_cluster_endpoints() {
        let zone = node_labels.get(LABEL_TOPOLOGY_ZONE).map(String::as_str).unwrap_or("");
        let mode = topology_mode(endpoints, svc, features, zone);
        use_topology = mode != TopologyMode::None;
        out.cluster = filter(endpoints, |ep| {
            ep.ready
                && match mode {
                    TopologyMode::None => true,
                    TopologyMode::SameNode => ep.node_hints == NodeHints::ThisNode,
                    TopologyMode::SameZone => ep.zone_hints.contains(zone),
                }
        });
        // With no ready endpoint for the zone, topology would already have been ruled out,
        // so an empty set here means nothing is ready anywhere.
        if out.cluster.is_empty() {
            out.cluster = filter(endpoints, EndpointInfo::is_serving_terminating);
        }
        out.has_any_endpoints = !out.cluster.is_empty();
    }

    if !svc.uses_local_endpoints() {
        out.all_reachable = out.cluster.clone();
        return out;
    }

    let mut has_local_ready = false;
    let mut has_local_serving_terminating = false;
    for ep in endpoints {
        if ep.ready {
            out.has_any_endpoints = true;
            has_local_ready |= ep.is_local;
        } else if ep.is_serving_terminating() {
            out.has_any_endpoints = true;
            has_local_serving_terminating |= ep.is_local;
        }
    }

    let mut use_serving_terminating = false;
    if has_local_ready {
        out.local = filter(endpoints, |ep| ep.is_local && ep.ready);
    } else if has_local_serving_terminating {
        use_serving_terminating = true;
        out.local = filter(endpoints, |ep| ep.is_local && ep.is_serving_terminating());
    }

    if !svc.uses_cluster_endpoints() {
        out.all_reachable = out.local.clone();
        return out;
    }

    if !use_topology && !use_serving_terminating {
        // Local holds only ready endpoints and Cluster holds every ready endpoint, so
        // Cluster already contains Local.
        out.all_reachable = out.cluster.clone();
        return out;
    }

    let chosen: HashSet<&str> = out.cluster.iter().chain(out.local.iter()).map(|ep| ep.endpoint.as_str()).collect();
    let mut seen = HashSet::new();
    out.all_reachable = endpoints
        .iter()
        .filter(|ep| chosen.contains(ep.endpoint.as_str()) && seen.insert(ep.endpoint.as_str()))
        .collect();
    out
}

/// Which hints narrow a service's Cluster endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TopologyMode {
    None,
    SameNode,
    SameZone,
}

/// Upstream `topologyModeFromHints` (1.29: `canUseTopology`): hints are used only when the
/// service may use them; node hints when every ready endpoint has one and one names this
/// node (PreferSameTrafficDistribution only); otherwise zone hints when the node has a
/// zone, every ready endpoint carries zone hints and at least one is for this zone.
fn topology_mode(endpoints: &[EndpointRef], svc: &ServicePortInfo, features: &Features, zone: &str) -> TopologyMode {
    if !svc.hints_enabled {
        return TopologyMode::None;
    }
    if features.prefer_same_traffic_distribution {
        let ready = || endpoints.iter().filter(|ep| ep.ready);
        let all_have_node_hints = ready().all(|ep| ep.node_hints != NodeHints::None);
        let has_endpoint_for_node = ready().any(|ep| ep.node_hints == NodeHints::ThisNode);
        if all_have_node_hints && has_endpoint_for_node {
            return TopologyMode::SameNode;
        }
    }
    if can_use_zone_hints(endpoints, svc, zone) { TopologyMode::SameZone } else { TopologyMode::None }
}

/// Zone hints apply: the node has a zone, every ready endpoint carries zone hints and at
/// least one is hinted for this node's zone.
fn can_use_zone_hints(endpoints: &[EndpointRef], svc: &ServicePortInfo, zone: &str) -> bool {
    if zone.is_empty() {
        tracing::debug!(service = %svc.name_string, "node has no zone label, ignoring topology hints");
        return false;
    }
    let mut has_endpoint_for_zone = false;
    for ep in endpoints.iter().filter(|ep| ep.ready) {
        if ep.zone_hints.is_empty() {
            tracing::debug!(
                service = %svc.name_string,
                endpoint = %ep.endpoint,
                "an endpoint has no zone hint, ignoring topology hints"
            );
            return false;
        }
        has_endpoint_for_zone |= ep.zone_hints.contains(zone);
    }
    if !has_endpoint_for_zone {
        tracing::debug!(service = %svc.name_string, %zone, "no endpoint hinted for this zone, ignoring topology hints");
    }
    has_endpoint_for_zone
}

fn filter(endpoints: &[EndpointRef], keep: impl Fn(&EndpointInfo) -> bool) -> Vec<&EndpointRef> {
    endpoints.iter().filter(|ep| keep(ep)).collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::compat::Release;
    use crate::model::{IpFamily, NamespacedName, Protocol, ServicePortName, service_ports};
    use crate::tracker::testing;

    /// The release of the upstream unit tests these cases come from.
    fn v1_29() -> Features {
        Features::of(Release::V1_29)
    }

    /// A service port like upstream's `NewBaseServiceInfo(..., nodePort, ..., etpLocal,
    /// itpLocal, ..., hintsAnnotation)` test helper.
    fn svc(node_port: i32, etp_local: bool, itp_local: bool, hints: bool) -> ServicePortInfo {
        let built = testing::svc("ns", "svc").bare_cluster_ip("10.96.0.1").port("", "TCP", 80, 0).build();
        let mut info = service_ports(&built, IpFamily::V4, &v1_29()).unwrap().remove(0);
        info.node_port = node_port;
        info.external_policy_local = etp_local;
        info.internal_policy_local = itp_local;
        info.hints_enabled = hints;
        info
    }

    #[derive(Clone, Copy)]
    struct E {
        addr: &'static str,
        zones: &'static [&'static str],
        ready: bool,
        serving: bool,
        terminating: bool,
        local: bool,
    }

    const fn e(addr: &'static str) -> E {
        E { addr, zones: &[], ready: true, serving: true, terminating: false, local: false }
    }

    impl E {
        const fn zones(mut self, zones: &'static [&'static str]) -> E {
            self.zones = zones;
            self
        }
        const fn unready(mut self) -> E {
            self.ready = false;
            self.serving = false;
            self
        }
        const fn serving_terminating(mut self) -> E {
            self.ready = false;
            self.serving = true;
            self.terminating = true;
            self
        }
        const fn local(mut self) -> E {
            self.local = true;
            self
        }
    }

    fn endpoints(list: &[E]) -> Vec<EndpointRef> {
        let name = ServicePortName::new(NamespacedName::new("ns", "svc"), "", Protocol::Tcp);
        let mut out: Vec<EndpointRef> = list
            .iter()
            .map(|e| {
                let (ip, port) = e.addr.rsplit_once(':').unwrap();
                let mut info = EndpointInfo::new(&name, ip, port.parse().unwrap());
                info.zone_hints = e.zones.iter().map(|z| z.to_string()).collect();
                info.ready = e.ready;
                info.serving = e.serving;
                info.terminating = e.terminating;
                info.is_local = e.local;
                Arc::new(info)
            })
            .collect();
        out.sort_by(|a, b| a.endpoint.cmp(&b.endpoint));
        out
    }

    fn zone(z: &str) -> BTreeMap<String, String> {
        BTreeMap::from([(LABEL_TOPOLOGY_ZONE.to_owned(), z.to_owned())])
    }

    fn names<'a>(eps: &[&'a EndpointRef]) -> Vec<&'a str> {
        eps.iter().map(|e| e.endpoint.as_str()).collect()
    }

    struct Case {
        name: &'static str,
        labels: BTreeMap<String, String>,
        svc: ServicePortInfo,
        endpoints: Vec<E>,
        cluster: &'static [&'static str],
        local: &'static [&'static str],
        /// `None`: the union of `cluster` and `local` (upstream's test derives it the same way).
        all: Option<&'static [&'static str]>,
    }

    const ZONED: [E; 4] = [
        e("10.1.2.3:80").zones(&["zone-a"]),
        e("10.1.2.4:80").zones(&["zone-b"]),
        e("10.1.2.5:80").zones(&["zone-c"]),
        e("10.1.2.6:80").zones(&["zone-a"]),
    ];
    const ALL_ZONED: &[&str] = &["10.1.2.3:80", "10.1.2.4:80", "10.1.2.5:80", "10.1.2.6:80"];

    // Cases of upstream's TestCategorizeEndpoints (topology_test.go).
    fn cases() -> Vec<Case> {
        let a = || zone("zone-a");
        let none = BTreeMap::new;
        vec![
            Case {
                name: "hints enabled, hints annotation == auto",
                labels: a(),
                svc: svc(0, false, false, true),
                endpoints: ZONED.to_vec(),
                cluster: &["10.1.2.3:80", "10.1.2.6:80"],
                local: &[],
                all: None,
            },
            Case {
                name: "hints, hints annotation == disabled, hints ignored",
                labels: a(),
                svc: svc(0, false, false, false),
                endpoints: ZONED.to_vec(),
                cluster: ALL_ZONED,
                local: &[],
                all: None,
            },
            Case {
                name: "externalTrafficPolicy: Local, topology ignored for Local endpoints",
                labels: a(),
                svc: svc(8080, true, false, true),
                endpoints: vec![ZONED[0].local(), ZONED[1].local(), ZONED[2], ZONED[3]],
                cluster: &["10.1.2.3:80", "10.1.2.6:80"],
                local: &["10.1.2.3:80", "10.1.2.4:80"],
                all: Some(&["10.1.2.3:80", "10.1.2.4:80", "10.1.2.6:80"]),
            },
            Case {
                name: "internalTrafficPolicy: Local, topology ignored for Local endpoints",
                labels: a(),
                svc: svc(8080, false, true, true),
                endpoints: vec![ZONED[0].local(), ZONED[1].local(), ZONED[2], ZONED[3]],
                cluster: &["10.1.2.3:80", "10.1.2.6:80"],
                local: &["10.1.2.3:80", "10.1.2.4:80"],
                all: Some(&["10.1.2.3:80", "10.1.2.4:80", "10.1.2.6:80"]),
            },
            Case {
                name: "empty node labels",
                labels: none(),
                svc: svc(0, false, false, true),
                endpoints: vec![ZONED[0]],
                cluster: &["10.1.2.3:80"],
                local: &[],
                all: None,
            },
            Case {
                name: "empty zone label",
                labels: zone(""),
                svc: svc(0, false, false, true),
                endpoints: vec![ZONED[0]],
                cluster: &["10.1.2.3:80"],
                local: &[],
                all: None,
            },
            Case {
                name: "node in different zone, no endpoint filtering",
                labels: zone("zone-b"),
                svc: svc(0, false, false, true),
                endpoints: vec![ZONED[0], ZONED[2]],
                cluster: &["10.1.2.3:80", "10.1.2.5:80"],
                local: &[],
                all: None,
            },
            Case {
                name: "unready endpoint",
                labels: a(),
                svc: svc(0, false, false, true),
                endpoints: vec![ZONED[0], ZONED[1], ZONED[2], ZONED[3].unready()],
                cluster: &["10.1.2.3:80"],
                local: &[],
                all: None,
            },
            Case {
                name: "only unready endpoints in same zone (should not filter)",
                labels: a(),
                svc: svc(0, false, false, true),
                endpoints: vec![ZONED[0].unready(), ZONED[1], ZONED[2], ZONED[3].unready()],
                cluster: &["10.1.2.4:80", "10.1.2.5:80"],
                local: &[],
                all: None,
            },
            Case {
                name: "missing hints, no filtering applied",
                labels: a(),
                svc: svc(0, false, false, true),
                endpoints: vec![ZONED[0], ZONED[1], e("10.1.2.5:80"), ZONED[3]],
                cluster: ALL_ZONED,
                local: &[],
                all: None,
            },
            Case {
                name: "multiple hints per endpoint, filtering includes any endpoint with zone included",
                labels: zone("zone-c"),
                svc: svc(0, false, false, true),
                endpoints: vec![
                    e("10.1.2.3:80").zones(&["zone-a", "zone-b", "zone-c"]),
                    e("10.1.2.4:80").zones(&["zone-b", "zone-c"]),
                    e("10.1.2.5:80").zones(&["zone-b", "zone-d"]),
                    e("10.1.2.6:80").zones(&["zone-c"]),
                ],
                cluster: &["10.1.2.3:80", "10.1.2.4:80", "10.1.2.6:80"],
                local: &[],
                all: None,
            },
            Case {
                name: "conflicting topology and localness require merging allEndpoints",
                labels: a(),
                svc: svc(8080, false, true, true),
                endpoints: vec![
                    e("10.0.0.0:80").zones(&["zone-a"]).local(),
                    e("10.0.0.1:80").zones(&["zone-b"]).local(),
                    e("10.0.0.2:80").zones(&["zone-a"]),
                    e("10.0.0.3:80").zones(&["zone-b"]),
                ],
                cluster: &["10.0.0.0:80", "10.0.0.2:80"],
                local: &["10.0.0.0:80", "10.0.0.1:80"],
                all: Some(&["10.0.0.0:80", "10.0.0.1:80", "10.0.0.2:80"]),
            },
            Case {
                name: "internalTrafficPolicy: Local, with empty endpoints",
                labels: none(),
                svc: svc(0, false, true, false),
                endpoints: vec![],
                cluster: &[],
                local: &[],
                all: None,
            },
            Case {
                name: "internalTrafficPolicy: Local, but all endpoints are remote",
                labels: none(),
                svc: svc(0, false, true, false),
                endpoints: vec![e("10.0.0.0:80"), e("10.0.0.1:80")],
                cluster: &[],
                local: &[],
                all: None,
            },
            Case {
                name: "internalTrafficPolicy: Local, all endpoints are local",
                labels: none(),
                svc: svc(0, false, true, false),
                endpoints: vec![e("10.0.0.0:80").local(), e("10.0.0.1:80").local()],
                cluster: &[],
                local: &["10.0.0.0:80", "10.0.0.1:80"],
                all: None,
            },
            Case {
                name: "internalTrafficPolicy: Local, some endpoints are local",
                labels: none(),
                svc: svc(0, false, true, false),
                endpoints: vec![e("10.0.0.0:80").local(), e("10.0.0.1:80")],
                cluster: &[],
                local: &["10.0.0.0:80"],
                all: None,
            },
            Case {
                name: "Cluster traffic policy, endpoints not Ready",
                labels: none(),
                svc: svc(0, false, false, false),
                endpoints: vec![e("10.0.0.0:80").unready(), e("10.0.0.1:80").unready()],
                cluster: &[],
                local: &[],
                all: None,
            },
            Case {
                name: "Cluster traffic policy, some endpoints are Ready",
                labels: none(),
                svc: svc(0, false, false, false),
                endpoints: vec![e("10.0.0.0:80").unready(), e("10.0.0.1:80")],
                cluster: &["10.0.0.1:80"],
                local: &[],
                all: None,
            },
            Case {
                name: "Cluster traffic policy, all endpoints are terminating",
                labels: none(),
                svc: svc(0, false, false, false),
                endpoints: vec![e("10.0.0.0:80").serving_terminating().local(), e("10.0.0.1:80").serving_terminating()],
                cluster: &["10.0.0.0:80", "10.0.0.1:80"],
                local: &[],
                all: None,
            },
            Case {
                name: "iTP: Local, eTP: Cluster, some endpoints local",
                labels: none(),
                svc: svc(8080, false, true, false),
                endpoints: vec![e("10.0.0.0:80").local(), e("10.0.0.1:80")],
                cluster: &["10.0.0.0:80", "10.0.0.1:80"],
                local: &["10.0.0.0:80"],
                all: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            },
            Case {
                name: "iTP: Cluster, eTP: Local, some endpoints local",
                labels: none(),
                svc: svc(8080, true, false, false),
                endpoints: vec![e("10.0.0.0:80").local(), e("10.0.0.1:80")],
                cluster: &["10.0.0.0:80", "10.0.0.1:80"],
                local: &["10.0.0.0:80"],
                all: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            },
            Case {
                name: "iTP: Local, eTP: Local, some endpoints local",
                labels: none(),
                svc: svc(8080, true, true, false),
                endpoints: vec![e("10.0.0.0:80").local(), e("10.0.0.1:80")],
                cluster: &["10.0.0.0:80", "10.0.0.1:80"],
                local: &["10.0.0.0:80"],
                all: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            },
            Case {
                name: "iTP: Local, eTP: Local, all endpoints remote",
                labels: none(),
                svc: svc(8080, true, true, false),
                endpoints: vec![e("10.0.0.0:80"), e("10.0.0.1:80")],
                cluster: &["10.0.0.0:80", "10.0.0.1:80"],
                local: &[],
                all: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            },
            Case {
                name: "iTP: Local, eTP: Local, all endpoints remote and terminating",
                labels: none(),
                svc: svc(8080, true, true, false),
                endpoints: vec![e("10.0.0.0:80").serving_terminating(), e("10.0.0.1:80").serving_terminating()],
                cluster: &["10.0.0.0:80", "10.0.0.1:80"],
                local: &[],
                all: Some(&["10.0.0.0:80", "10.0.0.1:80"]),
            },
            Case {
                name: "iTP: Cluster, eTP: Local, with terminating endpoints",
                labels: none(),
                svc: svc(8080, true, false, false),
                endpoints: vec![
                    e("10.0.0.0:80"),
                    e("10.0.0.1:80").unready().local(),
                    e("10.0.0.2:80").serving_terminating().local(),
                    e("10.0.0.3:80").serving_terminating(),
                ],
                cluster: &["10.0.0.0:80"],
                local: &["10.0.0.2:80"],
                all: Some(&["10.0.0.0:80", "10.0.0.2:80"]),
            },
            Case {
                name: "no cluster endpoints for iTP:Local internal-only service",
                labels: none(),
                svc: svc(0, false, true, false),
                endpoints: vec![e("10.0.0.0:80"), e("10.0.0.1:80").local()],
                cluster: &[],
                local: &["10.0.0.1:80"],
                all: None,
            },
        ]
    }

    #[test]
    fn categorize_endpoints_matches_upstream_cases() {
        for case in cases() {
            let eps = endpoints(&case.endpoints);
            let got = categorize_endpoints(&eps, &case.svc, &v1_29(), &case.labels);
            assert_eq!(names(&got.cluster), case.cluster, "{}: cluster", case.name);
            assert_eq!(names(&got.local), case.local, "{}: local", case.name);
            let all: Vec<&str> = match case.all {
                Some(all) => all.to_vec(),
                None if case.local.is_empty() => case.cluster.to_vec(),
                None => case.local.to_vec(),
            };
            assert_eq!(names(&got.all_reachable), all, "{}: all reachable", case.name);
        }
    }

    #[test]
    fn has_any_endpoints() {
        let none = BTreeMap::new();
        // Cluster policy: any ready or serving-terminating endpoint anywhere.
        let eps = endpoints(&[e("10.0.0.1:80").unready()]);
        assert!(!categorize_endpoints(&eps, &svc(0, false, false, false), &v1_29(), &none).has_any_endpoints);
        let eps = endpoints(&[e("10.0.0.1:80").serving_terminating()]);
        assert!(categorize_endpoints(&eps, &svc(0, false, false, false), &v1_29(), &none).has_any_endpoints);
        // Local-only policy: remote endpoints still count as "the service has endpoints",
        // which turns "no local endpoints" into DROP rather than REJECT.
        let eps = endpoints(&[e("10.0.0.1:80")]);
        let got = categorize_endpoints(&eps, &svc(0, false, true, false), &v1_29(), &none);
        assert!(got.has_any_endpoints);
        assert!(got.local.is_empty() && got.all_reachable.is_empty());
        assert!(!categorize_endpoints(&[], &svc(0, false, true, false), &v1_29(), &none).has_any_endpoints);
    }

    #[test]
    fn topology_not_used_when_a_ready_endpoint_lacks_hints() {
        // An unready endpoint without hints does not disable topology.
        let eps = endpoints(&[
            e("10.0.0.1:80").zones(&["zone-a"]),
            e("10.0.0.2:80").zones(&["zone-b"]),
            e("10.0.0.3:80").unready(),
        ]);
        let got = categorize_endpoints(&eps, &svc(0, false, false, true), &v1_29(), &zone("zone-a"));
        assert_eq!(names(&got.cluster), ["10.0.0.1:80"]);
    }

    #[test]
    fn local_serving_terminating_fallback_merges_all_reachable() {
        // eTP Local with a terminating local endpoint and a ready remote one: Local uses
        // the terminating endpoint, Cluster the ready one, and both chains are needed.
        let eps = endpoints(&[e("10.0.0.1:80"), e("10.0.0.2:80").serving_terminating().local()]);
        let got = categorize_endpoints(&eps, &svc(30080, true, false, false), &v1_29(), &BTreeMap::new());
        assert_eq!(names(&got.cluster), ["10.0.0.1:80"]);
        assert_eq!(names(&got.local), ["10.0.0.2:80"]);
        assert_eq!(names(&got.all_reachable), ["10.0.0.1:80", "10.0.0.2:80"]);
    }
}
