//! The nftables proxier wired to the fake kernel (`FakeNftables`), set up like upstream's
//! `NewFakeProxier` in pkg/proxy/nftables, and knftables' `ParseDump` for tables given as
//! `add …` lines.

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube_proxy_rs::compat::{Features, Release};
use kube_proxy_rs::manifest::Snapshot;
use kube_proxy_rs::model::{Cidr, IpFamily, NamespacedName};
use kube_proxy_rs::nftables::fake::FakeNftables;
use kube_proxy_rs::nftables::{
    BaseChain, Chain, ChainType, Element, Family, Hook, Operation, Rule, Set, SetKind, TableState, Transaction,
    sort_dump,
};
use kube_proxy_rs::proxier::StaticInterfaces;
use kube_proxy_rs::proxier::local_detect::LocalDetector;
use kube_proxy_rs::proxier::nftables::{
    NftProxierConfig, NftRenderConfig, NftSyncOutcome, NftSyncReport, NftablesProxier,
};
use kube_proxy_rs::proxier::nodeport_addresses::NodePortAddresses;

use super::harness::{TEST_EXTERNAL_IP, TEST_NODE_IP, TEST_NODE_IP_ALT, TEST_NODE_IPV6, TEST_NODE_IPV6_ALT};

/// The settings of upstream's fake nftables proxier (`NewFakeProxier`).
#[derive(Debug, Clone)]
pub struct FakeSettings {
    pub family: IpFamily,
    pub node_name: String,
    pub node_ip: IpAddr,
    pub pod_cidr: String,
    pub service_cidrs: Vec<String>,
    pub node_port_addresses: Vec<String>,
    pub interface_addrs: Vec<IpAddr>,
    pub masquerade_mark: String,
    pub masquerade_all: bool,
    pub detect_local: bool,
    /// Full syncs larger than this go out in pieces (`None`: the proxier's default).
    pub chunk_operations: Option<usize>,
}

impl FakeSettings {
    /// `NewFakeProxier(family)` of the 1.34 tests (node `test-node`).
    pub fn upstream(family: IpFamily) -> FakeSettings {
        let (node_ip, pod_cidr, service_cidr) = match family {
            IpFamily::V4 => (TEST_NODE_IP, "10.0.0.0/8", "172.30.0.0/16"),
            IpFamily::V6 => (TEST_NODE_IPV6, "fd00:10::/64", "fd00:10:96::/112"),
        };
        FakeSettings {
            family,
            node_name: "test-node".into(),
            node_ip: node_ip.parse().expect("ip"),
            pod_cidr: pod_cidr.into(),
            service_cidrs: vec![service_cidr.into()],
            node_port_addresses: vec![format!("{TEST_NODE_IP}/32"), format!("{TEST_NODE_IPV6}/128")],
            interface_addrs: [
                "127.0.0.1",
                "::1",
                TEST_NODE_IP,
                TEST_NODE_IP_ALT,
                TEST_EXTERNAL_IP,
                TEST_NODE_IPV6,
                TEST_NODE_IPV6_ALT,
            ]
            .iter()
            .map(|a| a.parse().expect("ip"))
            .collect(),
            masquerade_mark: "0x4000".into(),
            masquerade_all: false,
            detect_local: true,
            chunk_operations: None,
        }
    }

    /// The settings a fixture's `proxier.yaml` gives (its fields over [`FakeSettings::upstream`]).
    pub fn from_fixture_yaml(text: &str) -> FakeSettings {
        let v: serde_yaml::Value = serde_yaml::from_str(text).expect("proxier.yaml parses");
        let family = match v["ipFamily"].as_str() {
            Some("IPv6") => IpFamily::V6,
            _ => IpFamily::V4,
        };
        let mut s = FakeSettings::upstream(family);
        let strings = |v: &serde_yaml::Value| -> Vec<String> {
            v.as_sequence()
                .map(|a| a.iter().filter_map(|x| x.as_str().map(str::to_string)).collect())
                .unwrap_or_default()
        };
        if let Some(name) = v["nodeName"].as_str().or_else(|| v["hostname"].as_str()) {
            s.node_name = name.to_string();
        }
        if let Some(ip) = v["nodeIP"].as_str() {
            s.node_ip = ip.parse().expect("nodeIP");
        }
        if let Some(cidr) = v["localDetector"]["clusterCIDR"].as_str() {
            s.pod_cidr = cidr.to_string();
        }
        if v["serviceCIDRs"].is_sequence() {
            s.service_cidrs = strings(&v["serviceCIDRs"]);
        }
        if v["nodePortAddresses"].is_sequence() {
            s.node_port_addresses = strings(&v["nodePortAddresses"]);
        }
        if let Some(ifaces) = v["interfaceAddresses"].as_mapping() {
            s.interface_addrs = ifaces
                .values()
                .flat_map(strings)
                .map(|a| a.split('/').next().unwrap_or_default().parse().expect("interface address"))
                .collect();
        }
        if let Some(mark) = v["masqueradeMark"].as_str() {
            s.masquerade_mark = mark.to_string();
        }
        if let Some(all) = v["masqueradeAll"].as_bool() {
            s.masquerade_all = all;
        }
        s
    }

    pub fn render_config(&self, release: Release) -> NftRenderConfig {
        NftRenderConfig {
            family: self.family,
            masquerade_all: self.masquerade_all,
            masquerade_mark: self.masquerade_mark.clone(),
            local_detector: if self.detect_local {
                LocalDetector::Cidr(Cidr::parse_sloppy(&self.pod_cidr).expect("pod cidr"))
            } else {
                LocalDetector::NoOp
            },
            node_ip: Some(self.node_ip),
            node_port_addresses: NodePortAddresses::new(self.family, &self.node_port_addresses),
            features: Features::of(release),
        }
    }
}

/// An nftables proxier on the fake kernel, with a clock the test moves.
pub struct NftTestProxier {
    pub proxier: NftablesProxier,
    pub nft: Arc<FakeNftables>,
    pub now: Instant,
    pub family: Family,
}

impl NftTestProxier {
    pub fn new(settings: &FakeSettings, release: Release) -> NftTestProxier {
        let family = Family::from(settings.family);
        Self::on_kernel(settings, release, Arc::new(FakeNftables::new(family)))
    }

    /// A proxier of `release` on `nft` (a kernel that may already hold a table).
    pub fn on_kernel(settings: &FakeSettings, release: Release, nft: Arc<FakeNftables>) -> NftTestProxier {
        let cfg = NftProxierConfig {
            render: settings.render_config(release),
            hostname: settings.node_name.clone(),
            sync_period: Duration::from_secs(30),
        };
        let mut proxier =
            NftablesProxier::new(cfg, nft.clone(), Arc::new(StaticInterfaces(settings.interface_addrs.clone())))
                .with_transaction_recording();
        if let Some(n) = settings.chunk_operations {
            proxier = proxier.with_chunk_operations(n);
        }
        proxier.on_service_cidrs(&settings.service_cidrs);
        proxier.on_services_synced();
        proxier.on_endpoint_slices_synced();
        NftTestProxier { proxier, nft, now: Instant::now(), family: Family::from(settings.family) }
    }

    pub fn add_services(&mut self, services: &[Service]) {
        for s in services {
            self.proxier.on_service_state(NamespacedName::of_object(&s.metadata), Some(s));
        }
    }

    pub fn delete_service(&mut self, old: &Service) {
        self.proxier.on_service_state(NamespacedName::of_object(&old.metadata), None);
    }

    pub fn add_slices(&mut self, slices: &[EndpointSlice]) {
        for s in slices {
            self.proxier.on_endpoint_slice_update(s, false);
        }
    }

    pub fn delete_slice(&mut self, s: &EndpointSlice) {
        self.proxier.on_endpoint_slice_update(s, true);
    }

    pub fn set_node(&mut self, node: &Node) {
        self.proxier.on_node_update(Some(node));
    }

    /// Feeds the difference between two cluster states, as watch events would.
    pub fn apply_snapshot(&mut self, old: &Snapshot, new: &Snapshot) {
        let current: HashSet<NamespacedName> =
            new.services.iter().map(|s| NamespacedName::of_object(&s.metadata)).collect();
        for svc in &old.services {
            if !current.contains(&NamespacedName::of_object(&svc.metadata)) {
                self.delete_service(svc);
            }
        }
        self.add_services(&new.services);
        let key = |s: &EndpointSlice| NamespacedName::of_object(&s.metadata);
        let slices: HashSet<NamespacedName> = new.endpoint_slices.iter().map(key).collect();
        for slice in &old.endpoint_slices {
            if !slices.contains(&key(slice)) {
                self.delete_slice(slice);
            }
        }
        self.add_slices(&new.endpoint_slices);
    }

    /// One sync, `elapsed` after the previous one; it must succeed.
    #[track_caller]
    pub fn sync_after(&mut self, elapsed: Duration) -> NftSyncReport {
        self.now += elapsed;
        match self.proxier.sync(self.now) {
            NftSyncOutcome::Synced(report) => {
                if let Err(e) = &report.result {
                    panic!("sync failed: {e}\ntransaction:\n{}", report.transaction.as_deref().unwrap_or_default());
                }
                *report
            }
            NftSyncOutcome::NotInitialized => panic!("proxier not initialized"),
        }
    }

    /// One sync a millisecond after the previous one.
    #[track_caller]
    pub fn sync(&mut self) -> NftSyncReport {
        self.sync_after(Duration::from_millis(1))
    }

    /// The kernel's table in upstream's normal form.
    pub fn sorted_dump(&self) -> String {
        sort_dump(&self.nft.dump())
    }
}

/// Asserts that the kernel's table, in upstream's normal form, is `expected` in upstream's
/// normal form, with a line diff on failure.
#[track_caller]
pub fn assert_table_eq(what: &str, expected: &str, actual_dump: &str) {
    let (want, got) = (sort_dump(expected), sort_dump(actual_dump));
    if want != got {
        panic!("{what}: table differs (- expected, + actual):\n{}", super::line_diff(&want, &got));
    }
}

/// Reads a table written as `add …` lines (knftables' `Dump()` form, as `ParseDump` reads it:
/// blank and `#` lines skipped) and applies it to an empty kernel of `family`.
pub fn parse_dump(text: &str, family: Family) -> TableState {
    let mut tx = Transaction::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        tx.push(parse_line(line, family).unwrap_or_else(|| panic!("cannot parse dump line {line:?}")));
    }
    let mut table = TableState::default();
    table.apply(&tx).unwrap_or_else(|e| panic!("dump does not apply: {e}"));
    table
}

/// Splits ` comment "…"` off the end of `s`.
fn split_comment(s: &str) -> (&str, Option<String>) {
    match s.find(" comment \"") {
        Some(i) if s.ends_with('"') => {
            let quoted = &s[i + " comment \"".len()..s.len() - 1];
            (&s[..i], Some(quoted.replace("\\\"", "\"").replace("\\\\", "\\")))
        }
        _ => (s, None),
    }
}

/// `{ a ; b ; }` attributes of a chain or set line, by their first word.
fn attributes(body: &str) -> Vec<(String, String)> {
    let inner = body.trim().trim_start_matches('{').trim_end_matches('}');
    inner
        .split(" ;")
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(|a| match a.split_once(' ') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None => (a.to_string(), String::new()),
        })
        .collect()
}

fn parse_line(line: &str, family: Family) -> Option<Operation> {
    let prefix = format!(" {family} kube-proxy");
    let (verb_kind, rest) = line.split_once(&prefix)?;
    let rest = rest.trim_start();
    match verb_kind {
        "add table" => Some(Operation::AddTable),
        "add chain" => {
            let (name, body) = rest.split_once(' ').unwrap_or((rest, ""));
            let mut chain = Chain::regular(name);
            for (key, value) in attributes(body) {
                match key.as_str() {
                    "type" => {
                        // `filter hook input priority 0`
                        let words: Vec<&str> = value.split_whitespace().collect();
                        let chain_type = if words.first() == Some(&"nat") { ChainType::Nat } else { ChainType::Filter };
                        let hook = match words.get(2).copied() {
                            Some("prerouting") => Hook::Prerouting,
                            Some("input") => Hook::Input,
                            Some("forward") => Hook::Forward,
                            Some("output") => Hook::Output,
                            _ => Hook::Postrouting,
                        };
                        let priority = words.get(4)?.parse().ok()?;
                        chain.base = Some(BaseChain { chain_type, hook, priority });
                    }
                    "comment" => chain.comment = Some(value.trim_matches('"').to_string()),
                    _ => {}
                }
            }
            Some(Operation::AddChain(chain))
        }
        "add set" | "add map" => {
            let kind = if verb_kind == "add set" { SetKind::Set } else { SetKind::Map };
            let (name, body) = rest.split_once(' ')?;
            let mut set = Set {
                kind,
                name: name.to_string(),
                set_type: String::new(),
                flags: Vec::new(),
                timeout_secs: None,
                comment: None,
            };
            for (key, value) in attributes(body) {
                match key.as_str() {
                    "type" => set.set_type = value,
                    "flags" => set.flags = value.split(',').map(str::to_string).collect(),
                    "timeout" => set.timeout_secs = value.trim_end_matches('s').parse().ok(),
                    "comment" => set.comment = Some(value.trim_matches('"').to_string()),
                    _ => {}
                }
            }
            Some(Operation::AddSet(set))
        }
        "add rule" => {
            let (chain, text) = rest.split_once(' ')?;
            let (text, comment) = split_comment(text);
            Some(Operation::AddRule(Rule { chain: chain.to_string(), text: text.to_string(), comment }))
        }
        "add element" => {
            let (set, body) = rest.split_once(' ')?;
            let inner = body.trim().strip_prefix('{')?.strip_suffix('}')?.trim();
            let (before_value, value) = match inner.split_once(" : ") {
                Some((k, v)) => (k, Some(v)),
                None => (inner, None),
            };
            let (key, comment) = split_comment(before_value);
            let parts = |s: &str| s.split(" . ").map(str::to_string).collect::<Vec<_>>();
            let kind = if value.is_some() { SetKind::Map } else { SetKind::Set };
            Some(Operation::AddElement(Element {
                kind,
                set: set.to_string(),
                key: parts(key),
                value: value.map(parts).unwrap_or_default(),
                comment,
            }))
        }
        _ => None,
    }
}

/// A kernel holding the table `text` describes.
pub fn kernel_with(text: &str, family: Family) -> Arc<FakeNftables> {
    let nft = Arc::new(FakeNftables::new(family));
    nft.set_table(parse_dump(text, family));
    nft
}
