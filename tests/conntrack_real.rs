//! Stale conntrack cleanup against the real kernel, in a private network namespace (root
//! only): UDP entries are inserted by hand with `conntrack -I` (DNATed ones with `--dst-nat`,
//! so the kernel marks them as DNAT like a real KUBE-SEP rule would), the service and endpoint
//! changes go through the real trackers, and `clean_stale_entries` (1.29) or `reconcile`
//! (1.32+) runs the `conntrack` tool inside the namespace. Afterwards `conntrack -L` must show
//! exactly the entries that are not stale.

use std::collections::BTreeSet;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Service;
use kube_proxy_rs::compat::{Features, Release};
use kube_proxy_rs::exec::RealExec;
use kube_proxy_rs::model::{IpFamily, NamespacedName, Protocol, ServicePortName};
use kube_proxy_rs::node::conntrack::netlink::NetlinkConntrack;
use kube_proxy_rs::node::conntrack::{
    CleanupSummary, Conntrack, ConntrackEntry, EndpointMatch, ExecConntrack, ReconcileSummary, clean_stale_entries,
    reconcile,
};
use kube_proxy_rs::tracker::testing::{ep, slice, svc};
use kube_proxy_rs::tracker::{
    EndpointChangeTracker, EndpointsMap, ServiceChangeTracker, ServiceEndpoint, ServicePortMap,
};

use crate::require_root;
use crate::support::netns::Netns;

const CLIENT: &str = "198.18.0.10";
const NODE_IP: &str = "198.18.0.1";

const DNS_CLUSTER_IP: &str = "198.18.100.10";
const DNS_EXTERNAL_IP: &str = "203.0.113.10";
const DNS_LB_IP: &str = "203.0.113.20";
const DNS_NODE_PORT: u16 = 30053;
const REMOVED_EP: &str = "198.18.1.5";
const KEPT_EP: &str = "198.18.1.6";
const EP_PORT: u16 = 5353;

const LATE_CLUSTER_IP: &str = "198.18.100.20";
const LATE_NODE_PORT: u16 = 30054;
const LATE_EP: &str = "198.18.1.7";

const GONE_CLUSTER_IP: &str = "198.18.100.30";
const GONE_EP: &str = "198.18.1.8";

const UNRELATED_IP: &str = "198.18.200.1";

/// One UDP flow from [`CLIENT`], identified by its unique client port.
struct Flow {
    client_port: u16,
    dst: &'static str,
    dport: u16,
    /// The endpoint (address, port) it was DNATed to; `None` for a flow nobody NATed (what a
    /// REJECTed or unrelated packet leaves behind).
    dnat: Option<(&'static str, u16)>,
    /// Whether the cleanup must delete it.
    stale: bool,
}

const FLOWS: &[Flow] = &[
    // Service dns lost REMOVED_EP: its flows via every service address and the node port go.
    Flow { client_port: 40001, dst: DNS_CLUSTER_IP, dport: 53, dnat: Some((REMOVED_EP, EP_PORT)), stale: true },
    Flow { client_port: 40002, dst: DNS_EXTERNAL_IP, dport: 53, dnat: Some((REMOVED_EP, EP_PORT)), stale: true },
    Flow { client_port: 40003, dst: DNS_LB_IP, dport: 53, dnat: Some((REMOVED_EP, EP_PORT)), stale: true },
    Flow { client_port: 40004, dst: NODE_IP, dport: DNS_NODE_PORT, dnat: Some((REMOVED_EP, EP_PORT)), stale: true },
    // ... while the flows to the endpoint it kept stay.
    Flow { client_port: 40011, dst: DNS_CLUSTER_IP, dport: 53, dnat: Some((KEPT_EP, EP_PORT)), stale: false },
    Flow { client_port: 40012, dst: DNS_LB_IP, dport: 53, dnat: Some((KEPT_EP, EP_PORT)), stale: false },
    Flow { client_port: 40013, dst: NODE_IP, dport: DNS_NODE_PORT, dnat: Some((KEPT_EP, EP_PORT)), stale: false },
    // Service late had no endpoint (its packets were rejected) and now has one.
    Flow { client_port: 40021, dst: LATE_CLUSTER_IP, dport: 53, dnat: None, stale: true },
    Flow { client_port: 40022, dst: NODE_IP, dport: LATE_NODE_PORT, dnat: None, stale: true },
    // Service gone was deleted.
    Flow { client_port: 40031, dst: GONE_CLUSTER_IP, dport: 53, dnat: Some((GONE_EP, EP_PORT)), stale: true },
    // Nothing to do with any service.
    Flow { client_port: 40041, dst: UNRELATED_IP, dport: 53, dnat: None, stale: false },
    Flow { client_port: 40042, dst: UNRELATED_IP, dport: 53, dnat: Some((REMOVED_EP, EP_PORT)), stale: false },
];

fn insert(ns: &Netns, flow: &Flow) {
    insert_proto(ns, flow, "udp");
}

fn insert_proto(ns: &Netns, flow: &Flow, protocol: &str) {
    let (reply_src, reply_sport) = flow.dnat.unwrap_or((flow.dst, flow.dport));
    let (cport, dport, rsport) = (flow.client_port.to_string(), flow.dport.to_string(), reply_sport.to_string());
    let mut argv = vec![
        "conntrack",
        "-I",
        "-p",
        protocol,
        "-s",
        CLIENT,
        "-d",
        flow.dst,
        "--sport",
        &cport,
        "--dport",
        &dport,
        "--reply-src",
        reply_src,
        "--reply-dst",
        CLIENT,
        "--reply-port-src",
        &rsport,
        "--reply-port-dst",
        &cport,
        "--timeout",
        "600",
    ];
    if protocol == "tcp" {
        argv.extend(["--state", "ESTABLISHED"]);
    }
    if let Some((endpoint, _)) = flow.dnat {
        argv.extend(["--dst-nat", endpoint]);
    }
    ns.ok(&argv);
}

/// Client ports of the UDP entries in the namespace's table.
fn remaining_flows(ns: &Netns) -> BTreeSet<u16> {
    let out = ns.run(&["conntrack", "-L", "-p", "udp"]);
    assert!(out.success(), "conntrack -L: {}", out.combined());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            let sport = line.split_whitespace().find_map(|field| field.strip_prefix("sport="))?;
            sport.parse().ok()
        })
        .collect()
}

fn spn(name: &str) -> ServicePortName {
    ServicePortName::new(NamespacedName::new("ns1", name), "dns", Protocol::Udp)
}

#[test]
fn stale_udp_entries_are_deleted_and_live_ones_kept() {
    require_root!();
    let ns = Netns::create("ct");

    for flow in FLOWS {
        insert(&ns, flow);
    }
    let all: BTreeSet<u16> = FLOWS.iter().map(|f| f.client_port).collect();
    assert_eq!(remaining_flows(&ns), all, "inserted entries");

    // State before: dns with two endpoints, late without any, gone with one.
    let dns = dns_service();
    let late = svc("ns1", "late")
        .type_("NodePort")
        .cluster_ip(LATE_CLUSTER_IP)
        .port("dns", "UDP", 53, i32::from(LATE_NODE_PORT))
        .build();
    let gone = svc("ns1", "gone").cluster_ip(GONE_CLUSTER_IP).udp("dns", 53).build();
    let dns_before =
        slice("ns1", "dns", "dns-1").udp("dns", 5353).endpoint(ep(REMOVED_EP)).endpoint(ep(KEPT_EP)).build();
    let gone_slice = slice("ns1", "gone", "gone-1").udp("dns", 5353).endpoint(ep(GONE_EP)).build();

    let mut services = ServiceChangeTracker::new(IpFamily::V4, kube_proxy_rs::compat::Features::default());
    let mut endpoints = EndpointChangeTracker::new("node-1", IpFamily::V4);
    for s in [&dns, &late, &gone] {
        services.update(None, Some(s));
    }
    endpoints.endpoint_slice_update(&dns_before, false);
    endpoints.endpoint_slice_update(&gone_slice, false);
    let mut service_map = ServicePortMap::new();
    let mut endpoints_map = EndpointsMap::new();
    service_map.update(&mut services);
    endpoints_map.update(&mut endpoints);

    // The changes of the sync under test.
    let dns_after = slice("ns1", "dns", "dns-1").udp("dns", 5353).endpoint(ep(KEPT_EP)).build();
    let late_slice = slice("ns1", "late", "late-1").udp("dns", 5353).endpoint(ep(LATE_EP)).build();
    endpoints.endpoint_slice_update(&dns_after, false);
    endpoints.endpoint_slice_update(&late_slice, false);
    endpoints.endpoint_slice_update(&gone_slice, true);
    services.update(Some(&gone), None);
    let svc_result = service_map.update(&mut services);
    let ep_result = endpoints_map.update(&mut endpoints);

    assert_eq!(svc_result.deleted_udp_cluster_ips, BTreeSet::from([GONE_CLUSTER_IP.to_owned()]));
    assert_eq!(ep_result.newly_active_udp_services, [spn("late")]);
    let deleted_dns: Vec<&ServiceEndpoint> =
        ep_result.deleted_udp_endpoints.iter().filter(|e| e.service_port_name == spn("dns")).collect();
    assert_eq!(deleted_dns.len(), 1, "{:?}", ep_result.deleted_udp_endpoints);
    assert_eq!(deleted_dns[0].endpoint, format!("{REMOVED_EP}:{EP_PORT}"));

    let ct = ExecConntrack::new(Arc::new(RealExec)).in_netns(ns.name.clone());
    let summary = clean_stale_entries(&ct, IpFamily::V4, &service_map, &svc_result, &ep_result);
    assert_eq!(summary.failures, 0, "{summary:?}");

    let kept: BTreeSet<u16> = FLOWS.iter().filter(|f| !f.stale).map(|f| f.client_port).collect();
    assert_eq!(remaining_flows(&ns), kept, "entries left after the cleanup");

    // Again: nothing matches any more, and conntrack's "0 flow entries have been deleted"
    // (exit status 1) is not a failure.
    let again = clean_stale_entries(&ct, IpFamily::V4, &service_map, &svc_result, &ep_result);
    assert_eq!(again, CleanupSummary { requests: summary.requests, failures: 0 });
    assert_eq!(remaining_flows(&ns), kept);
}

// ---- The reconciler (1.32+) -----------------------------------------------------------------

const QUIET_CLUSTER_IP: &str = "198.18.100.40";
const OLD_EP_PORT: u16 = 5300;

/// Flows for the reconciler: `stale` is what 1.34+ deletes (endpoint IP and port compared);
/// `stale_by_ip` what 1.32/1.33 delete (endpoint IP only).
struct ReconcileFlow {
    flow: Flow,
    stale_by_ip: bool,
}

const fn rflow(
    client_port: u16,
    dst: &'static str,
    dport: u16,
    dnat: Option<(&'static str, u16)>,
    stale: bool,
    stale_by_ip: bool,
) -> ReconcileFlow {
    ReconcileFlow { flow: Flow { client_port, dst, dport, dnat, stale }, stale_by_ip }
}

const RECONCILE_FLOWS: &[ReconcileFlow] = &[
    // Answered by the endpoint that went away, through every frontend of dns.
    rflow(41001, DNS_CLUSTER_IP, 53, Some((REMOVED_EP, EP_PORT)), true, true),
    rflow(41002, DNS_EXTERNAL_IP, 53, Some((REMOVED_EP, EP_PORT)), true, true),
    rflow(41003, DNS_LB_IP, 53, Some((REMOVED_EP, EP_PORT)), true, true),
    rflow(41004, NODE_IP, DNS_NODE_PORT, Some((REMOVED_EP, EP_PORT)), true, true),
    // Never DNATed (a packet that met the REJECT): answered by the cluster IP itself.
    rflow(41005, DNS_CLUSTER_IP, 53, None, true, true),
    // The kept endpoint, but from its old target port: stale only when ports count (1.34+).
    rflow(41006, DNS_CLUSTER_IP, 53, Some((KEPT_EP, OLD_EP_PORT)), true, false),
    // Answered by the serving endpoint: kept.
    rflow(41011, DNS_CLUSTER_IP, 53, Some((KEPT_EP, EP_PORT)), false, false),
    rflow(41012, DNS_LB_IP, 53, Some((KEPT_EP, EP_PORT)), false, false),
    rflow(41013, NODE_IP, DNS_NODE_PORT, Some((KEPT_EP, EP_PORT)), false, false),
    // Another port of the cluster IP is not a frontend of dns:53.
    rflow(41021, DNS_CLUSTER_IP, 54, Some((REMOVED_EP, EP_PORT)), false, false),
    // A service without serving endpoints is left alone.
    rflow(41022, QUIET_CLUSTER_IP, 53, Some((REMOVED_EP, EP_PORT)), false, false),
    // Not a service address.
    rflow(41023, UNRELATED_IP, 53, Some((REMOVED_EP, EP_PORT)), false, false),
];

/// A TCP flow to dns's cluster IP answered by the removed endpoint: never touched.
const TCP_FLOW: Flow =
    Flow { client_port: 41031, dst: DNS_CLUSTER_IP, dport: 53, dnat: Some((REMOVED_EP, EP_PORT)), stale: false };

/// Client ports of every entry (any protocol) in the namespace's table.
fn remaining_all(ns: &Netns) -> BTreeSet<u16> {
    let out = ns.run(&["conntrack", "-L"]);
    assert!(out.success(), "conntrack -L: {}", out.combined());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().find_map(|field| field.strip_prefix("sport="))?.parse().ok())
        .collect()
}

/// The UDP LoadBalancer both tests use: a cluster IP, an external IP, a node port and a
/// load-balancer IP, so every kind of frontend has flows.
fn dns_service() -> Service {
    svc("ns1", "dns")
        .type_("LoadBalancer")
        .cluster_ip(DNS_CLUSTER_IP)
        .external_ips(&[DNS_EXTERNAL_IP])
        .port("dns", "UDP", 53, i32::from(DNS_NODE_PORT))
        .lb_ingress(&[DNS_LB_IP])
        .build()
}

/// The maps after dns lost REMOVED_EP (KEPT_EP serving on EP_PORT) and quiet has only a
/// terminating, not serving endpoint.
fn reconcile_maps(release: Release) -> (ServicePortMap, EndpointsMap) {
    let dns = dns_service();
    let quiet = svc("ns1", "quiet").cluster_ip(QUIET_CLUSTER_IP).udp("dns", 53).build();
    let dns_slice = slice("ns1", "dns", "dns-1").udp("dns", i32::from(EP_PORT)).endpoint(ep(KEPT_EP)).build();
    let quiet_slice =
        slice("ns1", "quiet", "quiet-1").udp("dns", i32::from(EP_PORT)).endpoint(ep(REMOVED_EP).not_ready()).build();
    let mut services = ServiceChangeTracker::new(IpFamily::V4, Features::of(release));
    let mut endpoints = EndpointChangeTracker::new("node-1", IpFamily::V4);
    services.update(None, Some(&dns));
    services.update(None, Some(&quiet));
    endpoints.endpoint_slice_update(&dns_slice, false);
    endpoints.endpoint_slice_update(&quiet_slice, false);
    let mut service_map = ServicePortMap::new();
    let mut endpoints_map = EndpointsMap::new();
    service_map.update(&mut services);
    let result = endpoints_map.update(&mut endpoints);
    assert!(result.conntrack_cleanup_required, "UDP endpoint changes require the reconciler");
    (service_map, endpoints_map)
}

/// Which client of the table a test uses: the tool (what the text parser reads) or netlink
/// (what the daemon uses).
#[derive(Debug, Clone, Copy)]
enum Client {
    Tool,
    Netlink,
}

impl Client {
    fn open(self, ns: &Netns) -> Box<dyn Conntrack> {
        match self {
            Client::Tool => Box::new(ExecConntrack::new(Arc::new(RealExec)).in_netns(ns.name.clone())),
            Client::Netlink => Box::new(NetlinkConntrack::new(Arc::new(RealExec)).in_netns(ns.name.clone())),
        }
    }
}

fn reconcile_in_netns(release: Release, client: Client, stale: impl Fn(&ReconcileFlow) -> bool) {
    let ns = Netns::create("ctrec");
    for f in RECONCILE_FLOWS {
        insert(&ns, &f.flow);
    }
    insert_proto(&ns, &TCP_FLOW, "tcp");
    let all: BTreeSet<u16> = RECONCILE_FLOWS.iter().map(|f| f.flow.client_port).chain([TCP_FLOW.client_port]).collect();
    assert_eq!(remaining_all(&ns), all, "inserted entries");

    let ct = client.open(&ns);
    let ct = ct.as_ref();
    // The lister reads back exactly what was inserted (the parser against the real tool).
    let listed = ct.list_entries(IpFamily::V4, Protocol::Udp).expect("conntrack -L");
    let first = listed.iter().find(|e| e.orig_sport == 41004).expect("listed 41004");
    let want = ConntrackEntry {
        protocol: Protocol::Udp,
        orig_src: CLIENT.parse().unwrap(),
        orig_dst: NODE_IP.parse().unwrap(),
        orig_sport: 41004,
        orig_dport: DNS_NODE_PORT,
        reply_src: REMOVED_EP.parse().unwrap(),
        reply_dst: CLIENT.parse().unwrap(),
        reply_sport: EP_PORT,
        reply_dport: 41004,
        zone: 0,
        id: None,
    };
    assert_eq!(ConntrackEntry { id: None, ..*first }, want);
    assert_eq!(listed.len(), RECONCILE_FLOWS.len(), "only the UDP entries: {listed:?}");
    assert!(ct.list_entries(IpFamily::V6, Protocol::Udp).expect("conntrack -L -f ipv6").is_empty());

    let (services, endpoints) = reconcile_maps(release);
    let matching = EndpointMatch::for_release(release);
    let summary = reconcile(ct, matching, IpFamily::V4, &services, &endpoints);
    let stale_count = RECONCILE_FLOWS.iter().filter(|f| stale(f)).count() as u64;
    assert_eq!(summary.failures, 0, "{summary:?}");
    assert_eq!(summary.deleted, stale_count, "{release}: {summary:?}");
    let kept: BTreeSet<u16> = RECONCILE_FLOWS
        .iter()
        .filter(|f| !stale(f))
        .map(|f| f.flow.client_port)
        .chain([TCP_FLOW.client_port])
        .collect();
    assert_eq!(remaining_all(&ns), kept, "{release}: entries left after the reconciler");

    // Again: nothing is stale any more.
    let again = reconcile(ct, matching, IpFamily::V4, &services, &endpoints);
    assert_eq!(
        again,
        ReconcileSummary { listed: true, entries: kept.len() - 1, stale: 0, deleted: 0, gone: 0, failures: 0 },
        "{release}"
    );
    assert_eq!(remaining_all(&ns), kept);
}

#[test]
fn reconciler_deletes_only_entries_no_serving_endpoint_answers() {
    require_root!();
    reconcile_in_netns(Release::V1_35, Client::Netlink, |f| f.flow.stale);
    reconcile_in_netns(Release::V1_35, Client::Tool, |f| f.flow.stale);
}

#[test]
fn reconciler_of_1_33_compares_endpoint_ips_only() {
    require_root!();
    reconcile_in_netns(Release::V1_33, Client::Netlink, |f| f.stale_by_ip);
    reconcile_in_netns(Release::V1_33, Client::Tool, |f| f.stale_by_ip);
}

// ---- Netlink against the tool ---------------------------------------------------------------

/// Netlink lists what `conntrack -L` lists (the text parser against the kernel's own
/// messages), for both families, every protocol with ports, NAT and not, and another zone.
#[test]
fn netlink_lists_what_the_tool_lists() {
    require_root!();
    let ns = Netns::create("ctlist");
    for f in FLOWS {
        insert(&ns, f);
    }
    insert_proto(&ns, &TCP_FLOW, "tcp");
    ns.ok(&[
        "conntrack",
        "-I",
        "-p",
        "udp",
        "-s",
        CLIENT,
        "-d",
        DNS_CLUSTER_IP,
        "--sport",
        "42001",
        "--dport",
        "53",
        "--reply-src",
        REMOVED_EP,
        "--reply-dst",
        CLIENT,
        "--reply-port-src",
        "5353",
        "--reply-port-dst",
        "42001",
        "--timeout",
        "600",
        "-w",
        "7",
    ]);
    ns.ok(&[
        "conntrack",
        "-I",
        "-p",
        "udp",
        "-s",
        "fd00:18::10",
        "-d",
        "fd00:96::a",
        "--sport",
        "42002",
        "--dport",
        "53",
        "--reply-src",
        "fd00:244::5",
        "--reply-dst",
        "fd00:18::10",
        "--reply-port-src",
        "5353",
        "--reply-port-dst",
        "42002",
        "--timeout",
        "600",
        "--dst-nat",
        "fd00:244::5",
    ]);
    let tool = Client::Tool.open(&ns);
    let netlink = NetlinkConntrack::new(Arc::new(RealExec)).in_netns(ns.name.clone());
    for family in [IpFamily::V4, IpFamily::V6] {
        for protocol in [Protocol::Udp, Protocol::Tcp] {
            let by_tool: BTreeSet<_> = tool.list_entries(family, protocol).expect("conntrack -L").into_iter().collect();
            let listed = netlink.list_entries(family, protocol).expect("netlink dump");
            assert!(listed.iter().all(|e| e.id.is_some()), "the kernel names every entry: {listed:?}");
            let by_netlink: BTreeSet<_> = listed.into_iter().map(|e| ConntrackEntry { id: None, ..e }).collect();
            assert_eq!(by_netlink, by_tool, "{family} {protocol}");
            let inserted = family == IpFamily::V4 || protocol == Protocol::Udp;
            assert_eq!(!by_tool.is_empty(), inserted, "{family} {protocol}");
        }
    }
    let zoned = netlink.list_entries(IpFamily::V4, Protocol::Udp).unwrap().into_iter().find(|e| e.orig_sport == 42001);
    assert_eq!(zoned.map(|e| e.zone), Some(7));
}

/// A batch deletes exactly the entries named, in any zone; entries already gone, and an
/// entry whose id is not the one named (one that replaced the listed entry under the same
/// tuple), are counted as gone and left alone.
#[test]
fn netlink_deletes_exactly_the_listed_entries() {
    require_root!();
    let ns = Netns::create("ctdel");
    for f in FLOWS {
        insert(&ns, f);
    }
    ns.ok(&[
        "conntrack",
        "-I",
        "-p",
        "udp",
        "-s",
        CLIENT,
        "-d",
        DNS_CLUSTER_IP,
        "--sport",
        "42001",
        "--dport",
        "53",
        "--reply-src",
        REMOVED_EP,
        "--reply-dst",
        CLIENT,
        "--reply-port-src",
        "5353",
        "--reply-port-dst",
        "42001",
        "--timeout",
        "600",
        "-w",
        "7",
    ]);
    let ct = NetlinkConntrack::new(Arc::new(RealExec)).in_netns(ns.name.clone());
    let listed = ct.list_entries(IpFamily::V4, Protocol::Udp).expect("dump");
    let pick = |port: u16| *listed.iter().find(|e| e.orig_sport == port).expect("listed");
    let (a, b, zoned) = (pick(40001), pick(40002), pick(42001));
    // 40003 as if another entry had taken its tuple after the listing: the kernel reuses a
    // freed entry's memory, and so its id, so the test names another id instead.
    let replaced = ConntrackEntry { id: pick(40003).id.map(|id| id ^ 1), ..pick(40003) };
    // 40002 expires before the batch.
    ns.ok(&["conntrack", "-D", "-p", "udp", "--sport", "40002"]);

    let outcome = ct.delete_entries(IpFamily::V4, &[a, b, zoned, replaced]).expect("batch");
    assert_eq!((outcome.deleted, outcome.gone, outcome.failed), (2, 2, 0), "{outcome:?}");
    let left = remaining_flows(&ns);
    assert!(!left.contains(&40001) && !left.contains(&42001), "{left:?}");
    assert!(left.contains(&40003), "the replacing entry stays: {left:?}");
    let want: BTreeSet<u16> = FLOWS.iter().map(|f| f.client_port).filter(|p| ![40001, 40002].contains(p)).collect();
    assert_eq!(left, want);
    // Nothing to delete is a batch that does nothing.
    assert_eq!(ct.delete_entries(IpFamily::V4, &[]).expect("empty"), Default::default());
}
