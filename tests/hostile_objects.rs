//! Hostile objects (issue 14): Services and EndpointSlices with arbitrary strings and numbers in
//! every field the proxier reads — names, namespaces, port names and numbers, protocols, IP
//! strings, CIDRs, annotations, zone and hostname labels, node names, affinity timeouts — next to
//! well-formed Services. For every generated cluster:
//!
//! * rendering does not panic;
//! * every hostile Service is either rendered or skipped with a warning naming it;
//! * the well-formed Services keep exactly the rules they have without the hostile ones (one
//!   malicious object never costs the others their rules);
//! * as root, real `iptables-restore --test` accepts the payload (legacy and nft), in a network
//!   namespace of our own.
//!
//! The same clusters in nftables mode (every release 1.31–1.37 in turn, both families): the
//! `NftablesProxier` writes through the real `NftRunner` into a network namespace of our own,
//! so every transaction a generated cluster gives is one the kernel applied (a refusal fails
//! the sync, and the test with nft's error); the table read back from the kernel holds every
//! line of the well-formed Services' (their chains, rules and map elements) and each hostile
//! Service is rendered or warned about. Without root the strict fake kernel stands in.

use std::io::Write as _;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::{Value, json};

use kube_proxy_rs::cmd::cli::{IpFamilyArg, RenderArgs, RenderOptions};
use kube_proxy_rs::compat::Release;
use kube_proxy_rs::manifest::Snapshot;
use kube_proxy_rs::model::{IpFamily, NamespacedName};
use kube_proxy_rs::nftables::fake::FakeNftables;
use kube_proxy_rs::nftables::{Family, NftOptions, NftRunner, Nftables, Operation, Transaction};
use kube_proxy_rs::proxier::StaticInterfaces;
use kube_proxy_rs::proxier::nftables::{NftProxierConfig, NftSyncOutcome, NftablesProxier};

use crate::support::netns::{Netns, is_root};

/// Strings an attacker (or a sloppy API server of the 1.29 era) could put in a field.
fn hostile_string() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::collection::vec(any::<char>(), 0..24).prop_map(|c| c.into_iter().collect::<String>()),
        2 => prop::collection::vec(prop::sample::select(vec!['a', 'z', '0', '9', '-', '.', '_', ':', '/', ' ', '"', '\\', '\n', '\'', '#', '%', 'é', '\u{2028}', '\u{85}', '\0']), 0..80)
            .prop_map(|c| c.into_iter().collect::<String>()),
        3 => prop::sample::select(vec![
            "", "web", "x\n-A INPUT -j ACCEPT", "q\"uote", "back\\slash", "tab\there", "a b",
            "010.244.1.6", "::ffff:10.244.1.5", "10.244.1.5", "fd00::5", "198.18.0.1", "1.2.3.4.5",
            "203.0.113.0/24", "::ffff:203.0.113.0/120", "198.18.7.1/16", "0.0.0.0/0", "010.0.0.0/8",
            "TCP", "UDP", "SCTP", "tcp", "ICMP", "Auto", "PreferClose", "PreferSameNode", "zone-a",
            "node-a", "node-b", "None", "ClientIP", "Local", "Cluster", "VIP", "Proxy",
            "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            // The longest valid name (63): the longest chain, set and comment names.
            "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb9",
        ])
        .prop_map(str::to_string),
    ]
}

/// A field that is usually one of `valid` and sometimes hostile, so that generated Services
/// are rendered as well as skipped.
fn field(valid: &'static [&'static str]) -> BoxedStrategy<String> {
    prop_oneof![3 => prop::sample::select(valid).prop_map(str::to_string), 1 => hostile_string()].boxed()
}

fn port_number() -> BoxedStrategy<i64> {
    prop_oneof![3 => 1i64..65536, 1 => hostile_int()].boxed()
}

/// Numbers: in range, at the edges, and far out of every range a port or timeout has.
fn hostile_int() -> impl Strategy<Value = i64> {
    prop_oneof![
        2 => 1i64..65536,
        1 => prop::sample::select(vec![0i64, -1, 65535, 65536, 30000, 32767, 86400, 86401, i64::from(i32::MAX), i64::from(i32::MIN)]),
        1 => any::<i64>(),
    ]
}

fn hostile_service() -> impl Strategy<Value = Value> {
    (
        (field(&["ns1", "ns-2", "kube-system"]), field(&["web", "api", "dns-1"]), field(&["http", "", "dns-tcp"]), field(&["TCP", "UDP", "SCTP"])),
        (port_number(), prop_oneof![3 => 30000i64..32768, 1 => hostile_int()], port_number(), prop_oneof![3 => 1i64..86401, 1 => hostile_int()]),
        (
            field(&["198.18.2.1", "198.18.2.2", "198.18.3.9"]),
            prop::collection::vec(field(&["203.0.113.5", "198.18.9.9"]), 0..3),
            prop::collection::vec(field(&["203.0.113.0/24", "198.18.0.0/15"]), 0..3),
        ),
        (field(&["LoadBalancer", "NodePort"]), field(&["Cluster", "Local"]), field(&["203.0.113.77", "198.18.40.1"]), field(&["VIP", "Proxy"]), field(&["Auto", "", "PreferClose"])),
    )
        .prop_map(|((ns, name, port_name, protocol), (port, node_port, target, timeout), (cluster_ip, external, ranges), (kind, policy, ingress, mode, hint_mode))| {
            json!({
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"namespace": ns, "name": name, "annotations": {"service.kubernetes.io/topology-mode": hint_mode}},
                "spec": {
                    "type": kind,
                    "clusterIP": cluster_ip,
                    "clusterIPs": [cluster_ip],
                    "externalIPs": external,
                    "loadBalancerSourceRanges": ranges,
                    "externalTrafficPolicy": policy,
                    "internalTrafficPolicy": policy,
                    "sessionAffinity": "ClientIP",
                    "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": timeout}},
                    "trafficDistribution": mode,
                    "ports": [{"name": port_name, "protocol": protocol, "port": port, "nodePort": node_port, "targetPort": target}],
                },
                "status": {"loadBalancer": {"ingress": [{"ip": ingress, "ipMode": mode}]}},
            })
        })
}

fn hostile_slice(service: &Value) -> impl Strategy<Value = Value> + use<> {
    let (ns, name, port_name) = (
        service["metadata"]["namespace"].clone(),
        service["metadata"]["name"].clone(),
        service["spec"]["ports"][0]["name"].clone(),
    );
    (
        prop::collection::vec(
            (field(&["198.19.2.1", "198.19.2.2", "198.19.3.3"]), field(&["zone-a", "zone-b"]), field(&["node-a", "node-b"]), any::<bool>()),
            1..4,
        ),
        port_number(),
        field(&["TCP", "UDP", "SCTP"]),
        prop::sample::select(vec!["IPv4", "IPv4", "IPv4", "IPv6", "FQDN", "bogus"]),
    )
        .prop_map(move |(endpoints, port, protocol, address_type)| {
            let endpoints: Vec<Value> = endpoints
                .into_iter()
                .map(|(address, zone, node, ready)| {
                    json!({
                        "addresses": [address],
                        "conditions": {"ready": ready, "serving": ready, "terminating": !ready},
                        "nodeName": node,
                        "zone": zone,
                        "hints": {"forZones": [{"name": zone}], "forNodes": [{"name": node}]},
                    })
                })
                .collect();
            json!({
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {"namespace": ns, "name": format!("{}-1", name.as_str().unwrap_or_default()), "labels": {"kubernetes.io/service-name": name}},
                "addressType": address_type,
                "endpoints": endpoints,
                "ports": [{"name": port_name, "protocol": protocol, "port": port}],
            })
        })
}

/// Two well-formed Services with endpoints, the yardstick.
fn good_objects() -> (Vec<Service>, Vec<EndpointSlice>) {
    let mut services = Vec::new();
    let mut slices = Vec::new();
    for (i, kind) in ["ClusterIP", "NodePort"].iter().enumerate() {
        services.push(
            serde_json::from_value(json!({
                "metadata": {"namespace": "good", "name": format!("good-{i}")},
                "spec": {"type": kind, "clusterIP": format!("198.18.1.{}", i + 1), "clusterIPs": [format!("198.18.1.{}", i + 1)],
                         "ports": [{"name": "http", "protocol": "TCP", "port": 80, "nodePort": 30100 + i, "targetPort": 8080}]},
            }))
            .expect("good service"),
        );
        slices.push(
            serde_json::from_value(json!({
                "metadata": {"namespace": "good", "name": format!("good-{i}-1"), "labels": {"kubernetes.io/service-name": format!("good-{i}")}},
                "addressType": "IPv4",
                "endpoints": [{"addresses": [format!("198.19.1.{}", i + 1)], "conditions": {"ready": true}, "nodeName": "node-a", "zone": "zone-a"}],
                "ports": [{"name": "http", "protocol": "TCP", "port": 8080}],
            }))
            .expect("good slice"),
        );
    }
    (services, slices)
}

fn node() -> Node {
    serde_json::from_value(json!({
        "metadata": {"name": "node-a", "labels": {"topology.kubernetes.io/zone": "zone-a", "kubernetes.io/hostname": "node-a"}},
        "spec": {"podCIDR": "198.18.128.0/24", "podCIDRs": ["198.18.128.0/24"]},
        "status": {"addresses": [{"type": "InternalIP", "address": "198.18.0.10"}]},
    }))
    .expect("node")
}

/// A `Write` that collects the log lines of one render.
#[derive(Clone, Default)]
struct LogBuffer(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogBuffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Renders `snapshot` as `render` does; the payload and the warnings logged meanwhile.
fn render(snapshot: &Snapshot) -> (String, String) {
    let args = RenderArgs {
        options: RenderOptions {
            config: None,
            hostname_override: Some("node-a".into()),
            interface_addresses: vec![],
            iptables_version: "1.8.9".into(),
            compatibility_version: None,
            proxy_mode: None,
            feature_gates: vec![],
            nfacct: None,
            conntrack_tcp_be_liberal: None,
        },
        ip_family: IpFamilyArg::Ipv4,
        manifests: vec![],
        then: vec![],
    };
    let logs = LogBuffer::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .finish();
    let mut out = Vec::new();
    tracing::subscriber::with_default(subscriber, || {
        kube_proxy_rs::cmd::render::render_snapshots(&args, std::slice::from_ref(snapshot), &mut out)
    })
    .expect("render never fails on object content");
    let logs = String::from_utf8_lossy(&logs.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)).into_owned();
    (String::from_utf8_lossy(&out).into_owned(), logs)
}

/// The lines of `payload` that belong to the well-formed Services (their comments name them).
fn good_lines(payload: &str) -> Vec<&str> {
    payload.lines().filter(|l| l.contains("good/good-")).collect()
}

/// The well-formed and decodable objects of one generated cluster: the snapshot (good
/// objects first), and the hostile Services of `family` that must be rendered or warned
/// about (skipped silently by design, as upstream: headless ones and those of the other
/// family).
fn cluster_snapshot(
    good: &(Vec<Service>, Vec<EndpointSlice>),
    objects: Vec<(Value, Value)>,
    family: IpFamily,
) -> (Snapshot, Vec<(String, String)>) {
    let mut snapshot = Snapshot {
        services: good.0.clone(),
        endpoint_slices: good.1.clone(),
        nodes: vec![node()],
        ..Snapshot::default()
    };
    let mut names = Vec::new();
    for (svc, slice) in objects {
        // What does not even decode into the API types (a timeout beyond i32...) is skipped
        // by the manifest loader, with a warning, before the proxier sees it.
        if let Ok(s) = serde_json::from_value::<Service>(svc) {
            let cluster_ip = s.spec.as_ref().and_then(|spec| spec.cluster_ip.as_deref()).unwrap_or_default();
            let v6 = cluster_ip.parse::<std::net::Ipv6Addr>();
            // An IPv4-mapped address (`::ffff:10.0.0.1`) is IPv4 to upstream (Go's `To4`), so
            // neither family's proxier must name it; the IPv4 half skips it as the iptables
            // test does.
            let of_family = match family {
                IpFamily::V4 => v6.is_err(),
                IpFamily::V6 => v6.is_ok_and(|ip| ip.to_ipv4_mapped().is_none()),
            };
            if !matches!(cluster_ip, "" | "None") && of_family {
                let meta = &s.metadata;
                names.push((meta.namespace.clone().unwrap_or_default(), meta.name.clone().unwrap_or_default()));
            }
            snapshot.services.push(s);
        }
        if let Ok(s) = serde_json::from_value::<EndpointSlice>(slice) {
            snapshot.endpoint_slices.push(s);
        }
    }
    (snapshot, names)
}

#[test]
fn hostile_services_and_slices_never_cost_the_others_their_rules() {
    let netns = is_root().then(|| {
        let ns = Netns::create("hostile");
        crate::support::e2e::create_nfacct_objects(&ns);
        ns
    });
    let (good_services, good_slices) = good_objects();
    let baseline = Snapshot {
        services: good_services.clone(),
        endpoint_slices: good_slices.clone(),
        nodes: vec![node()],
        ..Snapshot::default()
    };
    let (baseline_payload, _) = render(&baseline);
    let baseline_good: Vec<String> = good_lines(&baseline_payload).into_iter().map(str::to_string).collect();
    assert!(baseline_good.len() > 10, "{baseline_payload}");

    let cluster =
        prop::collection::vec(hostile_service().prop_flat_map(|svc| (Just(svc.clone()), hostile_slice(&svc))), 1..4);
    let mut runner = TestRunner::new(Config { cases: 192, failure_persistence: None, ..Config::default() });
    let (rendered, skipped) = (std::cell::Cell::new(0), std::cell::Cell::new(0));
    runner
        .run(&cluster, |objects| {
            let mut snapshot = Snapshot {
                services: good_services.clone(),
                endpoint_slices: good_slices.clone(),
                nodes: vec![node()],
                ..Snapshot::default()
            };
            let mut names = Vec::new();
            for (svc, slice) in objects {
                // What does not even decode into the API types (a timeout beyond i32...) is
                // skipped by the manifest loader, with a warning, before the proxier sees it.
                if let Ok(s) = serde_json::from_value::<Service>(svc) {
                    // Skipped by design, silently, as upstream does: a headless Service (no
                    // cluster IP), and one of the other family (this renders IPv4).
                    let cluster_ip = s.spec.as_ref().and_then(|spec| spec.cluster_ip.as_deref()).unwrap_or_default();
                    let other_family = cluster_ip.parse::<std::net::Ipv6Addr>().is_ok();
                    if !matches!(cluster_ip, "" | "None") && !other_family {
                        let meta = &s.metadata;
                        names.push((meta.namespace.clone().unwrap_or_default(), meta.name.clone().unwrap_or_default()));
                    }
                    snapshot.services.push(s);
                }
                if let Ok(s) = serde_json::from_value::<EndpointSlice>(slice) {
                    snapshot.endpoint_slices.push(s);
                }
            }
            let (payload, logs) = render(&snapshot);

            // The well-formed Services' rules are all still there. (Hostile objects may add
            // lines naming them only by position, e.g. a duplicate ClusterIP, so compare the
            // set of good lines, not the order of the whole payload.)
            let good = good_lines(&payload);
            for line in &baseline_good {
                prop_assert!(good.contains(&line.as_str()), "lost {line:?}\npayload:\n{payload}\nlogs:\n{logs}");
            }
            // Each hostile Service is rendered (a rule comment names it) or a warning does.
            for (ns, name) in &names {
                // A comment names the service port `ns/name:port`, or `ns/name` for an unnamed port.
                let key = format!("{ns}/{name}");
                let in_rules = !name.is_empty()
                    && payload
                        .match_indices(&key)
                        .any(|(at, _)| matches!(payload.as_bytes().get(at + key.len()), Some(b':' | b' ' | b'"')));
                // Names that cannot be printed as they are appear as Rust's `{:?}` prints them.
                let escaped = format!("{name:?}");
                let warned = logs.contains(" WARN ") && (logs.contains(name.as_str()) || logs.contains(&escaped));
                prop_assert!(
                    in_rules || warned || name.is_empty(),
                    "{ns}/{name:?}: neither rendered nor warned\nlogs:\n{logs}"
                );
                let count = if in_rules { &rendered } else { &skipped };
                count.set(count.get() + 1);
            }
            if let Some(ns) = &netns {
                for backend in ["legacy", "nft"] {
                    let out =
                        ns.run_with_stdin(&[&format!("iptables-{backend}-restore"), "--test", "--noflush"], &payload);
                    prop_assert!(
                        out.success(),
                        "iptables-{backend}-restore --test rejected the payload: {}\n{payload}",
                        out.combined()
                    );
                }
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
    let (rendered, skipped) = (rendered.get(), skipped.get());
    eprintln!("hostile services rendered: {rendered}, skipped with a warning: {skipped}");
    assert!(rendered > 0 && skipped > 0, "the generator must produce both kinds: {rendered}/{skipped}");
    if netns.is_none() {
        assert!(!crate::support::netns::skipping_is_an_error(), "the iptables-restore half needs root, and CI is set");
        let _ = std::io::stderr().write_all(b"iptables-restore --test half skipped: not root\n");
    }
}

/// Configuration fields with values of every shape: each file either loads (then validation
/// accepts it or names the field) or fails naming the file.
fn config_text() -> impl Strategy<Value = (String, String)> {
    let keys = prop::sample::select(vec![
        "bindAddress",
        "clusterCIDR",
        "healthzBindAddress",
        "metricsBindAddress",
        "hostnameOverride",
        "mode",
        "nodePortAddresses",
        "detectLocalMode",
        "compatibilityVersion",
        "featureGates",
        "iptables",
        "conntrack",
        "clientConnection",
        "detectLocal",
        "oomScoreAdj",
        "portRange",
        "configSyncPeriod",
        "showHiddenMetricsForVersion",
        "bogusField",
    ]);
    let values = prop_oneof![
        hostile_string().prop_map(|s| serde_json::to_string(&s).unwrap_or_default()),
        hostile_int().prop_map(|n| n.to_string()),
        prop::sample::select(vec![
            "[]",
            "{}",
            "null",
            "true",
            "[\"primary\"]",
            "{masqueradeBit: 99}",
            "{minSyncPeriod: -1s}",
            "{syncPeriod: 1h, masqueradeAll: yes}",
            "{maxPerCore: -5}",
            "\"1.99\"",
            "\"1.31\"",
            "{a: b}",
            "[1, 2]",
            "\"010.0.0.1/8\"",
            "\"::ffff:1.2.3.4\"",
            "'0.0.0.0:99999'",
            "{kubeconfig: 7}",
        ])
        .prop_map(str::to_string),
    ];
    (keys, values).prop_map(|(k, v)| (k.to_string(), v)).prop_map(|(k, v)| {
        let text = format!("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n{k}: {v}\n");
        (k, text)
    })
}

#[test]
fn kernel_output_and_configuration_parsers_never_panic() {
    use kube_proxy_rs::iptables::runner::{IptablesVersion, parse_restore_error};
    use kube_proxy_rs::iptables::save;

    let golden = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/nodeport/expected.rules"),
    )
    .expect("golden rules");
    let lines: Vec<String> = golden.lines().map(str::to_string).collect();
    let line_count = lines.len();

    // iptables-save / restore text: a real dump with lines damaged, dropped, duplicated or
    // replaced by arbitrary bytes.
    let damaged = prop::collection::vec((0..line_count, 0u8..4, hostile_string()), 0..12).prop_map(move |edits| {
        let mut out = lines.clone();
        for (at, kind, junk) in edits {
            let at = at.min(out.len().saturating_sub(1));
            if out.is_empty() {
                break;
            }
            match kind {
                0 => out[at] = junk,
                1 => {
                    let keep = out[at].char_indices().nth(junk.len() % 40).map_or(out[at].len(), |(i, _)| i);
                    out[at].truncate(keep);
                }
                2 => {
                    out.remove(at);
                }
                _ => out.insert(at, junk),
            }
        }
        out.join("\n")
    });
    let mut runner = TestRunner::new(Config { cases: 512, failure_persistence: None, ..Config::default() });
    runner
        .run(&(damaged, any::<usize>(), hostile_string()), |(text, line, stderr)| {
            let _ = save::chains_from_table(text.as_bytes());
            let _ = save::format_line_context(text.as_bytes(), line % (line_count + 5), line % 7);
            if let Err(e) = kube_proxy_rs::trace::RuleSet::parse(&text) {
                let total = text.split('\n').count();
                prop_assert!(e.line >= 1 && e.line <= total, "error names line {} of {total}: {e}", e.line);
            }
            // Restore errors and version banners as iptables prints them, or not at all.
            for output in [
                stderr.clone(),
                format!("iptables-restore: line {line} failed\n{stderr}"),
                format!("iptables v{stderr}"),
            ] {
                let _ = parse_restore_error(&output);
                let _ = IptablesVersion::find_in(&output);
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));

    let mut runner = TestRunner::new(Config { cases: 512, failure_persistence: None, ..Config::default() });
    runner
        .run(&config_text(), |(key, text)| {
            let path = std::path::Path::new("config.yaml");
            match kube_proxy_rs::config::parse_config(&text, path) {
                Ok(cfg) => {
                    if let Err(errors) = kube_proxy_rs::config::Settings::from_config(&cfg.config) {
                        prop_assert!(!errors.is_empty());
                        let all: String = errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ");
                        // Validation names the field it rejects (nested fields by their path).
                        prop_assert!(
                            errors.iter().all(|e| !e.to_string().is_empty())
                                && all.to_lowercase().contains(&key.to_lowercase()[..3.min(key.len())]),
                            "{key}: {all}\n{text}"
                        );
                    }
                }
                Err(e) => prop_assert!(e.to_string().starts_with("config.yaml"), "{e}"),
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
}

/// One family's nftables proxier of `release` for the hostile clusters' node (node-a,
/// 198.18.0.10, pod CIDR 198.18.128.0/24), writing through `nft`.
fn nft_proxier(family: IpFamily, release: Release, nft: Arc<dyn Nftables>) -> NftablesProxier {
    use crate::support::nft::FakeSettings;
    let mut settings = FakeSettings::upstream(family);
    settings.node_name = "node-a".into();
    let (node_ip, pod_cidr, service_cidr) = match family {
        IpFamily::V4 => ("198.18.0.10", "198.18.128.0/24", "198.18.0.0/16"),
        IpFamily::V6 => ("fd00::10", "fd00:128::/64", "fd00::/112"),
    };
    settings.node_ip = node_ip.parse().expect("ip");
    settings.pod_cidr = pod_cidr.into();
    settings.service_cidrs = vec![service_cidr.into()];
    settings.node_port_addresses = vec![];
    settings.interface_addrs = vec![settings.node_ip];
    let cfg = NftProxierConfig {
        render: settings.render_config(release),
        hostname: settings.node_name.clone(),
        sync_period: std::time::Duration::from_secs(30),
    };
    let proxier = NftablesProxier::new(cfg, nft, Arc::new(StaticInterfaces(settings.interface_addrs.clone())))
        .with_transaction_recording();
    proxier.on_service_cidrs(&settings.service_cidrs);
    proxier
}

/// Where the nftables half writes: the real kernel (a namespace of our own) or the fake.
enum NftKernel {
    /// The namespace lives (and is deleted on drop) with the runners that write into it.
    Real {
        _netns: Netns,
        runners: [Arc<NftRunner>; 2],
    },
    Fake,
}

impl NftKernel {
    fn new() -> NftKernel {
        if !is_root() {
            assert!(!crate::support::netns::skipping_is_an_error(), "the nftables half needs root, and CI is set");
            let _ = std::io::stderr().write_all(b"nftables half on the fake kernel: not root\n");
            return NftKernel::Fake;
        }
        let netns = Netns::create("hostilenft");
        let runner = |family| {
            let options = NftOptions {
                netns: Some(netns.name.clone()),
                // The daemon's bound: nf_tables work of other namespaces (a large table being
                // written or deleted elsewhere on the machine) can hold a small transaction here
                // for tens of seconds.
                command_timeout: std::time::Duration::from_secs(300),
                ..NftOptions::default()
            };
            Arc::new(NftRunner::new(Arc::new(kube_proxy_rs::exec::RealExec), family, options).expect("nft works"))
        };
        let runners = [runner(Family::Ip), runner(Family::Ip6)];
        NftKernel::Real { _netns: netns, runners }
    }

    /// An empty table's kernel for `family`.
    fn writer(&self, family: IpFamily) -> Arc<dyn Nftables> {
        match self {
            NftKernel::Real { runners, .. } => {
                let runner = runners[usize::from(family == IpFamily::V6)].clone();
                // The previous case's table goes (absent when that case wrote nothing).
                if runner.list_table().expect("list").is_some() {
                    runner.run(&Transaction { ops: vec![Operation::DeleteTable] }).expect("delete the table");
                }
                runner
            }
            NftKernel::Fake => Arc::new(FakeNftables::new(Family::from(family))),
        }
    }
}

/// Syncs `snapshot` once through a fresh proxier on `kernel` and returns the table as the
/// kernel lists it (knftables' dump lines) and the warnings logged meanwhile; a refused
/// transaction is an error with nft's message and the transaction.
fn nft_sync(
    kernel: &NftKernel,
    family: IpFamily,
    release: Release,
    snapshot: &Snapshot,
) -> Result<(String, String), String> {
    let nft = kernel.writer(family);
    let mut proxier = nft_proxier(family, release, nft.clone());
    let logs = LogBuffer::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .finish();
    let outcome = tracing::subscriber::with_default(subscriber, || {
        proxier.on_node_update(snapshot.nodes.first());
        for svc in &snapshot.services {
            proxier.on_service_state(NamespacedName::of_object(&svc.metadata), Some(svc));
        }
        for slice in &snapshot.endpoint_slices {
            proxier.on_endpoint_slice_update(slice, false);
        }
        proxier.on_services_synced();
        proxier.on_endpoint_slices_synced();
        proxier.sync(std::time::Instant::now())
    });
    let logs = String::from_utf8_lossy(&logs.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)).into_owned();
    let NftSyncOutcome::Synced(report) = outcome else { return Err("not initialized".into()) };
    if let Err(e) = &report.result {
        return Err(format!("{family} {release}: {e}\ntransaction:\n{}", report.transaction.unwrap_or_default()));
    }
    let table = nft.list_table().map_err(|e| e.to_string())?.ok_or("no table after a successful sync")?;
    Ok((table.dump(Family::from(family)), logs))
}

/// Whether `line` of the baseline table may be missing from `dump` because a hostile
/// Service claims the same map element key (a duplicate NodePort, say): one key holds one
/// value (the smallest wins, docs/upstream-versions.md); the API server would have refused
/// the second Service.
fn key_claimed_by_another(line: &str, dump: &str) -> bool {
    // `add element ip kube-proxy MAP { KEY [comment "…"] : VALUE }`
    let key_end = [" comment ", " : "].iter().filter_map(|sep| line.find(sep)).min();
    match key_end {
        Some(end) if line.starts_with("add element ") => {
            let key = &line[..end];
            dump.lines().any(|l| {
                l != line && l.starts_with(key) && (l[end..].starts_with(" comment ") || l[end..].starts_with(" : "))
            })
        }
        _ => false,
    }
}

#[test]
fn hostile_services_never_cost_the_others_their_rules_in_nftables_mode() {
    let kernel = NftKernel::new();
    let good = good_objects();
    let releases: Vec<Release> = Release::nftables_all().collect();
    let baseline_snapshot = Snapshot {
        services: good.0.clone(),
        endpoint_slices: good.1.clone(),
        nodes: vec![node()],
        ..Snapshot::default()
    };
    let baselines: Vec<Vec<String>> = releases
        .iter()
        .map(|&release| {
            let (table, logs) =
                nft_sync(&kernel, IpFamily::V4, release, &baseline_snapshot).unwrap_or_else(|e| panic!("{e}"));
            assert!(!logs.contains(" WARN "), "{logs}");
            let lines: Vec<String> = good_lines(&table).into_iter().map(str::to_string).collect();
            assert!(lines.len() > 10 && lines.iter().any(|l| l.starts_with("add rule")), "{release}:\n{table}");
            lines
        })
        .collect();

    let cluster =
        prop::collection::vec(hostile_service().prop_flat_map(|svc| (Just(svc.clone()), hostile_slice(&svc))), 1..4);
    let mut runner = TestRunner::new(Config { cases: 128, failure_persistence: None, ..Config::default() });
    let (case, rendered, skipped) = (std::cell::Cell::new(0usize), std::cell::Cell::new(0), std::cell::Cell::new(0));
    let started = std::time::Instant::now();
    runner
        .run(&cluster, |objects| {
            let at = case.get();
            case.set(at + 1);
            let (release, baseline) = (releases[at % releases.len()], &baselines[at % releases.len()]);
            for family in [IpFamily::V4, IpFamily::V6] {
                let (snapshot, names) = cluster_snapshot(&good, objects.clone(), family);
                let (table, logs) = match nft_sync(&kernel, family, release, &snapshot) {
                    Ok(t) => t,
                    Err(e) => return Err(TestCaseError::fail(format!("the kernel refused a sync: {e}"))),
                };
                if family == IpFamily::V4 {
                    let good_now = good_lines(&table);
                    for line in baseline {
                        prop_assert!(
                            good_now.contains(&line.as_str()) || key_claimed_by_another(line, &table),
                            "{release}: lost {line:?}\ntable:\n{table}\nlogs:\n{logs}"
                        );
                    }
                }
                // Each hostile Service of this family is rendered (its chains or element
                // comments name it: `ns/name/proto/port`, `ns/name:port`) or a warning does.
                for (ns, name) in &names {
                    let in_rules = !name.is_empty()
                        && [format!("{ns}/{name}/"), format!("{ns}/{name}:"), format!("\"{ns}/{name}\"")]
                            .iter()
                            .any(|k| table.contains(k.as_str()));
                    let warned = logs.contains(" WARN ")
                        && (logs.contains(name.as_str()) || logs.contains(&format!("{name:?}")));
                    prop_assert!(
                        in_rules || warned || name.is_empty(),
                        "{family} {release}: {ns}/{name:?}: neither rendered nor warned\ntable:\n{table}\nlogs:\n{logs}"
                    );
                    let count = if in_rules { &rendered } else { &skipped };
                    count.set(count.get() + 1);
                }
            }
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
    let (rendered, skipped) = (rendered.get(), skipped.get());
    let real = matches!(kernel, NftKernel::Real { .. });
    eprintln!(
        "nftables mode ({}): {} clusters in {:.1}s; hostile services rendered: {rendered}, skipped with a warning: {skipped}",
        if real { "real kernel" } else { "fake kernel" },
        case.get(),
        started.elapsed().as_secs_f64()
    );
    assert!(rendered > 0 && skipped > 0, "the generator must produce both kinds: {rendered}/{skipped}");
}
