//! The `render` command: cluster snapshots from YAML in, each sync's rules out, computed by the
//! same proxier the daemon runs against an in-memory kernel.
//!
//! * iptables mode: each sync's iptables-restore input, against an in-memory iptables that
//!   keeps the chains each sync leaves behind (what stale-chain cleanup looks at).
//! * nftables mode (`--proxy-mode nftables` or the config's `mode: nftables`): the whole
//!   `kube-proxy` table after each sync as `add …` lines (knftables' fake `Dump()`, what
//!   upstream's unit tests compare), kept by [`FakeNftables`]. ServiceCIDR objects in the
//!   manifests reach the proxier as the daemon's watch would bring them.

use std::collections::{BTreeSet, HashSet};
use std::io::Write;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;

use crate::cmd::cli::{NfacctArg, RenderArgs, RenderOptions};
use crate::config::{self, ProxyMode, Settings};
use crate::iptables::chain_tracker::ChainTracker;
use crate::iptables::runner::{IptablesVersion, RANDOM_FULLY_MIN_VERSION};
use crate::manifest::{self, Snapshot};
use crate::model::node::{NodeInfo, NodeIps};
use crate::model::{IpFamily, NamespacedName};
use crate::nftables::Family;
use crate::nftables::fake::FakeNftables;
use crate::proxier::local_detect::LocalDetector;
use crate::proxier::nftables::{NftProxierConfig, NftRenderConfig, NftSyncOutcome, NftablesProxier};
use crate::proxier::nodeport_addresses::NodePortAddresses;
use crate::proxier::{Proxier, ProxierConfig, RenderConfig, StaticInterfaces, SyncOutcome};
use crate::tracker::ChangeRecorder;

#[derive(Debug, thiserror::Error)]
pub enum RenderCmdError {
    #[error(transparent)]
    Manifest(#[from] manifest::ManifestError),
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error("{path}: invalid configuration:\n  {}", errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n  "))]
    InvalidConfig { path: String, errors: Vec<config::FieldError> },
    #[error("invalid --iptables-version {0:?}: expected X.Y.Z")]
    IptablesVersion(String),
    #[error("failed to write output: {0}")]
    Output(#[from] std::io::Error),
    #[error("sync {sync} failed: {reason}")]
    Sync { sync: usize, reason: String },
    #[error(transparent)]
    IptablesOnly(IptablesOnly),
}

impl RenderCmdError {
    /// Exit code: 2 for bad input (files, config, flags), 1 for anything else.
    pub fn exit_code(&self) -> i32 {
        match self {
            RenderCmdError::Manifest(_)
            | RenderCmdError::Config(_)
            | RenderCmdError::InvalidConfig { .. }
            | RenderCmdError::IptablesVersion(_)
            | RenderCmdError::IptablesOnly(_) => 2,
            RenderCmdError::Output(_) | RenderCmdError::Sync { .. } => 1,
        }
    }
}

/// `--random-fully` needs iptables 1.6.2 or later.
fn random_fully_supported(version: &str) -> Result<bool, RenderCmdError> {
    IptablesVersion::parse(version.trim().trim_start_matches('v'))
        .map(|v| v >= RANDOM_FULLY_MIN_VERSION)
        .ok_or_else(|| RenderCmdError::IptablesVersion(version.to_string()))
}

/// The config file (or upstream's defaults) with the release and gate flags applied over it.
pub(crate) fn load_settings(options: &RenderOptions) -> Result<Settings, RenderCmdError> {
    let path = options.config.as_deref();
    let mut raw = match path {
        Some(p) => config::load_config_file(p)?.into_config_logged(p),
        None => config::KubeProxyConfiguration::default(),
    };
    if let Some(mode) = options.proxy_mode {
        raw.mode = ProxyMode::from(mode).as_str().to_string();
    }
    if let Some(version) = &options.compatibility_version {
        raw.compatibility_version = version.clone();
    }
    for gates in &options.feature_gates {
        raw.feature_gates.extend(gates.0.clone());
    }
    Settings::from_config(&raw).map_err(|errors| RenderCmdError::InvalidConfig {
        path: path.map_or_else(|| "flags (no --config)".to_string(), |p| p.display().to_string()),
        errors,
    })
}

/// The proxy mode `options` ask for: `--proxy-mode`, else the `--config` file's `mode`, else
/// iptables (the config is only read, not validated: `trace --rules` does not use it
/// otherwise).
pub fn requested_mode(options: &RenderOptions) -> Result<ProxyMode, RenderCmdError> {
    if let Some(mode) = options.proxy_mode {
        return Ok(mode.into());
    }
    let Some(path) = options.config.as_deref() else {
        return Ok(ProxyMode::Iptables);
    };
    let mode = config::load_config_file(path)?.config.mode;
    // As `Settings` reads it (any other word fails validation where the config is used).
    Ok(if mode == ProxyMode::Nftables.as_str() { ProxyMode::Nftables } else { ProxyMode::Iptables })
}

/// The error `trace` and `diff` give when asked about nftables mode: they read iptables
/// rules only (for now).
#[derive(Debug, thiserror::Error)]
#[error(
    "{command} reads iptables rules only for now; nftables mode (--proxy-mode nftables or a config with \
     mode: nftables) is not supported. To see the nftables rules, run `kube-proxy-rs render --proxy-mode \
     nftables` on the manifests"
)]
pub struct IptablesOnly {
    pub command: &'static str,
}

/// `Err` when `options` ask `command` (`trace`, `diff`) about nftables mode.
pub fn require_iptables_mode(options: &RenderOptions, command: &'static str) -> Result<(), RenderCmdError> {
    match requested_mode(options)? {
        ProxyMode::Iptables => Ok(()),
        ProxyMode::Nftables => Err(RenderCmdError::IptablesOnly(IptablesOnly { command })),
    }
}

/// What a render assumes of the node beyond the manifests: whether it has the nfacct
/// accounting objects, and whether its `nf_conntrack_tcp_be_liberal` sysctl is set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeFacts {
    pub nfacct: bool,
    pub conntrack_tcp_be_liberal: bool,
}

impl NodeFacts {
    /// `render`'s defaults (a node with nfacct support and the kernel's strict TCP tracking,
    /// as upstream's unit-test proxier has), with the flags applied over them.
    pub fn from_flags(options: &RenderOptions) -> NodeFacts {
        NodeFacts::default().with_flags(options)
    }

    /// These facts with whatever the flags say instead.
    pub fn with_flags(mut self, options: &RenderOptions) -> NodeFacts {
        if let Some(nfacct) = options.nfacct {
            self.nfacct = nfacct == NfacctArg::Present;
        }
        if let Some(liberal) = options.conntrack_tcp_be_liberal {
            self.conntrack_tcp_be_liberal = liberal;
        }
        self
    }
}

impl Default for NodeFacts {
    fn default() -> Self {
        NodeFacts { nfacct: true, conntrack_tcp_be_liberal: false }
    }
}

/// The node a render acted as, as `render` resolved it from the flags and manifests.
#[derive(Debug, Clone)]
pub struct RenderedNode {
    pub hostname: String,
    /// The node IP of the rendered family (unspecified when none is known).
    pub node_ip: IpAddr,
    /// The interface addresses nodePortAddresses was resolved against.
    pub interface_addresses: Vec<IpAddr>,
}

impl RenderedNode {
    /// The node's own addresses: its interface addresses and node IP.
    pub fn local_addresses(&self) -> Vec<IpAddr> {
        let mut out = self.interface_addresses.clone();
        if !self.node_ip.is_unspecified() && !out.contains(&self.node_ip) {
            out.push(self.node_ip);
        }
        out
    }
}

/// Runs `render`, writing each sync's header and payload to `out`.
pub fn run(args: &RenderArgs, out: &mut dyn Write) -> Result<(), RenderCmdError> {
    run_node(args, out).map(|_| ())
}

/// [`run`], also saying which node it rendered for.
pub fn run_node(args: &RenderArgs, out: &mut dyn Write) -> Result<RenderedNode, RenderCmdError> {
    run_node_with(args, NodeFacts::from_flags(&args.options), out)
}

/// [`run_node`] for a node with `facts`.
pub(crate) fn run_node_with(
    args: &RenderArgs,
    facts: NodeFacts,
    out: &mut dyn Write,
) -> Result<RenderedNode, RenderCmdError> {
    // Load every snapshot before printing anything: a bad file fails the whole command.
    let mut snapshots = Vec::with_capacity(1 + args.then.len());
    snapshots.push(load(&args.manifests)?);
    for path in &args.then {
        snapshots.push(load(std::slice::from_ref(path))?);
    }
    render_snapshots_with(args, &load_settings(&args.options)?, facts, &snapshots, out)
}

/// Renders `snapshots` (the first, then each later one as a partial sync) with the flags of
/// `args` (its manifest paths are not read).
pub fn render_snapshots(
    args: &RenderArgs,
    snapshots: &[Snapshot],
    out: &mut dyn Write,
) -> Result<RenderedNode, RenderCmdError> {
    render_snapshots_with(args, &load_settings(&args.options)?, NodeFacts::from_flags(&args.options), snapshots, out)
}

/// [`render_snapshots`] with the settings already loaded from `args` ([`load_settings`]) and
/// the node's facts resolved.
pub(crate) fn render_snapshots_with(
    args: &RenderArgs,
    settings: &Settings,
    facts: NodeFacts,
    snapshots: &[Snapshot],
    out: &mut dyn Write,
) -> Result<RenderedNode, RenderCmdError> {
    let empty = Snapshot::default();
    let node = ResolvedNode::resolve(args, settings, snapshots.first().unwrap_or(&empty));
    match settings.mode {
        ProxyMode::Iptables => render_iptables(args, settings, facts, node, snapshots, out),
        ProxyMode::Nftables => render_nftables(settings, node, snapshots, out),
    }
}

/// The node a render acts as, and what the proxier's settings take from it.
struct ResolvedNode {
    family: IpFamily,
    hostname: String,
    node_ip: IpAddr,
    interface_addrs: Vec<IpAddr>,
    node_port_addresses: NodePortAddresses,
    local_detector: LocalDetector,
}

impl ResolvedNode {
    /// From the flags, the settings and the first snapshot's Node of this hostname.
    fn resolve(args: &RenderArgs, settings: &Settings, first: &Snapshot) -> ResolvedNode {
        let family = IpFamily::from(args.ip_family);
        let hostname = node_name(&args.options, settings);
        let node = first.nodes.iter().find(|n| n.metadata.name.as_deref() == Some(hostname.as_str()));
        let node_info = node.map(NodeInfo::from_node).unwrap_or_default();
        if node.is_none() {
            tracing::warn!(hostname = %hostname, "no Node object for this hostname in the manifests; node IP defaults apply");
        }
        let node_ips = NodeIps::detect(&node_info.host_ips, Some(settings.bind_address));
        let interface_addrs: Vec<IpAddr> = if args.options.interface_addresses.is_empty() {
            node_info.addresses.clone()
        } else {
            args.options.interface_addresses.clone()
        };
        let node_port_cidrs =
            NodePortAddresses::resolve_keywords(&settings.node_port_addresses, &[node_ips.v4, node_ips.v6]);
        ResolvedNode {
            family,
            node_ip: node_ips.get(family),
            interface_addrs,
            node_port_addresses: NodePortAddresses::new(family, &node_port_cidrs),
            local_detector: LocalDetector::from_mode(&settings.detect_local, family, &node_info.pod_cidrs),
            hostname,
        }
    }

    fn report(&self) -> RenderedNode {
        RenderedNode {
            hostname: self.hostname.clone(),
            node_ip: self.node_ip,
            interface_addresses: self.interface_addrs.clone(),
        }
    }
}

/// iptables mode: each sync's iptables-restore input.
fn render_iptables(
    args: &RenderArgs,
    settings: &Settings,
    facts: NodeFacts,
    node: ResolvedNode,
    snapshots: &[Snapshot],
    out: &mut dyn Write,
) -> Result<RenderedNode, RenderCmdError> {
    let random_fully = random_fully_supported(&args.options.iptables_version)?;
    let report = node.report();
    let family = node.family;
    // Localhost NodePorts exist only for IPv4, and only when nodePortAddresses admits loopback.
    let localhost_nodeports =
        family == IpFamily::V4 && settings.localhost_nodeports && node.node_port_addresses.contains_ipv4_loopback();
    let cfg = ProxierConfig {
        render: RenderConfig {
            family,
            masquerade_all: settings.masquerade_all,
            masquerade_mark: settings.masquerade_mark.clone(),
            localhost_nodeports,
            local_detector: node.local_detector,
            node_ip: Some(node.node_ip),
            node_port_addresses: node.node_port_addresses,
            random_fully,
            // The daemon sets the sysctl when the config asks for liberal tracking, and then
            // reads it back: either way the INVALID drop is left out.
            conntrack_tcp_liberal: facts.conntrack_tcp_be_liberal || settings.conntrack.tcp_be_liberal,
            features: settings.features,
        },
        hostname: node.hostname.clone(),
        sync_period: settings.sync_period,
    };
    let kernel = Arc::new(ChainTracker::new(family, random_fully));
    // With nfacct, the accounting objects exist (releases 1.31 and later name them in their
    // rules), as upstream's unit tests assume and as a node with nfacct support has them;
    // without, they cannot be created and the rules are those of such a node.
    let nfacct = if facts.nfacct {
        crate::node::nfacct::FakeNfacct::new()
    } else {
        crate::node::nfacct::FakeNfacct::unavailable()
    };
    let mut proxier = Proxier::new(cfg, kernel, Arc::new(StaticInterfaces(node.interface_addrs)))
        .with_payload_recording()
        .with_nfacct(Arc::new(nfacct));

    // Snapshots are taken to arrive a sync period apart, so large-cluster mode also cleans
    // up stale chains on every sync, as the daemon would eventually.
    let step = settings.sync_period + Duration::from_millis(1);
    let start = Instant::now();
    let empty = Snapshot::default();
    let mut previous = &empty;
    for (i, snapshot) in snapshots.iter().enumerate() {
        apply_snapshot(&proxier.recorder(), previous, snapshot, &node.hostname);
        if i == 0 {
            proxier.on_services_synced();
            proxier.on_endpoint_slices_synced();
        }
        let now = start + step * u32::try_from(i).unwrap_or(u32::MAX);
        match proxier.sync(now) {
            SyncOutcome::NotInitialized => {
                return Err(RenderCmdError::Sync { sync: i + 1, reason: "proxier not initialized".into() });
            }
            SyncOutcome::Synced(report) => {
                if let Err(e) = &report.result {
                    return Err(RenderCmdError::Sync { sync: i + 1, reason: e.to_string() });
                }
                writeln!(out, "# sync {}: {}", i + 1, if report.full { "full" } else { "partial" })?;
                out.write_all(report.payload.as_deref().unwrap_or_default().as_bytes())?;
            }
        }
        previous = snapshot;
    }
    out.flush()?;
    Ok(report)
}

/// How far apart the syncs of an nftables render are: more than the second after which
/// upstream deletes a chain it flushed when it fell out of use, so a chain a `--then`
/// snapshot leaves unused is flushed in that sync and deleted in the next one (the
/// iptables render's step, a sync period, would also do; two seconds is upstream's own
/// test step, `ageStaleChains`).
pub const NFTABLES_SYNC_STEP: Duration = Duration::from_secs(2);

/// nftables mode: the whole `kube-proxy` table after each sync, as knftables' fake `Dump()`
/// writes it (the form upstream's unit tests compare; an order `nft -f` accepts on a node
/// without the table). The kernel is [`FakeNftables`]; the proxier's clock is the `now` each
/// sync is given, [`NFTABLES_SYNC_STEP`] apart.
fn render_nftables(
    settings: &Settings,
    node: ResolvedNode,
    snapshots: &[Snapshot],
    out: &mut dyn Write,
) -> Result<RenderedNode, RenderCmdError> {
    let report = node.report();
    let family = node.family;
    let cfg = NftProxierConfig {
        render: NftRenderConfig {
            family,
            masquerade_all: settings.masquerade_all,
            masquerade_mark: settings.masquerade_mark.clone(),
            local_detector: node.local_detector,
            node_ip: Some(node.node_ip),
            node_port_addresses: node.node_port_addresses,
            features: settings.features,
        },
        hostname: node.hostname.clone(),
        sync_period: settings.sync_period,
    };
    let kernel = Arc::new(FakeNftables::new(Family::from(family)));
    let mut proxier = NftablesProxier::new(cfg, kernel.clone(), Arc::new(StaticInterfaces(node.interface_addrs)));
    // The daemon watches ServiceCIDRs only with MultiCIDRServiceAllocator on.
    let watch_service_cidrs = settings.features.multi_cidr_service_allocator;
    if !watch_service_cidrs && snapshots.iter().any(|s| !s.service_cidrs.is_empty()) {
        tracing::warn!(
            release = %settings.features.release,
            "ServiceCIDR objects ignored: feature gate MultiCIDRServiceAllocator is off, so kube-proxy does not watch them"
        );
    }

    let start = Instant::now();
    let empty = Snapshot::default();
    let mut previous = &empty;
    for (i, snapshot) in snapshots.iter().enumerate() {
        apply_snapshot(&proxier.recorder(), previous, snapshot, &node.hostname);
        if watch_service_cidrs {
            // As the watch reports them: stored for the next full sync.
            proxier.on_service_cidrs(&service_cidrs(snapshot));
        }
        if i == 0 {
            proxier.on_services_synced();
            proxier.on_endpoint_slices_synced();
        }
        let now = start + NFTABLES_SYNC_STEP * u32::try_from(i).unwrap_or(u32::MAX);
        match proxier.sync(now) {
            NftSyncOutcome::NotInitialized => {
                return Err(RenderCmdError::Sync { sync: i + 1, reason: "proxier not initialized".into() });
            }
            NftSyncOutcome::Synced(report) => {
                if let Err(e) = &report.result {
                    return Err(RenderCmdError::Sync { sync: i + 1, reason: e.to_string() });
                }
                writeln!(out, "# sync {}: {}", i + 1, if report.full { "full" } else { "partial" })?;
                out.write_all(kernel.dump().as_bytes())?;
            }
        }
        // Only the table is needed, not what the fake was asked.
        kernel.clear_calls();
        previous = snapshot;
    }
    out.flush()?;
    Ok(report)
}

/// The CIDRs of a snapshot's ServiceCIDR objects, as the daemon's watch reports them (the
/// union of their `spec.cidrs`, sorted, without repeats). One that is not a CIDR is left out
/// with a warning naming its object (the API server would not have admitted it).
fn service_cidrs(snapshot: &Snapshot) -> Vec<String> {
    let mut all = BTreeSet::new();
    for object in &snapshot.service_cidrs {
        let name = object.metadata.name.as_deref().unwrap_or_default();
        let cidrs = object.spec.as_ref().and_then(|s| s.cidrs.as_deref()).unwrap_or_default();
        for (index, cidr) in cidrs.iter().enumerate() {
            if crate::model::Cidr::parse_sloppy(cidr).is_some() {
                all.insert(cidr.clone());
            } else {
                tracing::warn!("ServiceCIDR {name}: spec.cidrs[{index}] {cidr:?} is not a CIDR; skipped");
            }
        }
    }
    all.into_iter().collect()
}

/// The node to act as: `--hostname-override`, else the config's, else the OS hostname.
pub fn node_name(options: &RenderOptions, settings: &Settings) -> String {
    options
        .hostname_override
        .clone()
        .or_else(|| settings.hostname_override.clone())
        .map(|h| h.trim().to_lowercase())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(crate::daemon::app::os_hostname)
}

fn load(paths: &[PathBuf]) -> Result<Snapshot, RenderCmdError> {
    let (snapshot, warnings) = manifest::load_manifests(paths)?;
    for w in warnings {
        tracing::warn!("{w}");
    }
    Ok(snapshot)
}

fn key(ns: Option<&String>, name: Option<&String>) -> (String, String) {
    (ns.cloned().unwrap_or_default(), name.cloned().unwrap_or_default())
}

/// Feeds the differences between two snapshots to a proxier's recorder, as watch events would.
fn apply_snapshot(recorder: &ChangeRecorder, old: &Snapshot, new: &Snapshot, hostname: &str) {
    let current: HashSet<NamespacedName> =
        new.services.iter().map(|s| NamespacedName::of_object(&s.metadata)).collect();
    for svc in &old.services {
        let name = NamespacedName::of_object(&svc.metadata);
        if !current.contains(&name) {
            recorder.on_service(name, None);
        }
    }
    for svc in &new.services {
        recorder.on_service(NamespacedName::of_object(&svc.metadata), Some(svc));
    }

    let new_slices: HashSet<(String, String)> =
        new.endpoint_slices.iter().map(|s| key(s.metadata.namespace.as_ref(), s.metadata.name.as_ref())).collect();
    for slice in &old.endpoint_slices {
        if !new_slices.contains(&key(slice.metadata.namespace.as_ref(), slice.metadata.name.as_ref())) {
            recorder.on_endpoint_slice(slice, true);
        }
    }
    for slice in &new.endpoint_slices {
        recorder.on_endpoint_slice(slice, false);
    }

    let node: Option<&Node> = new.nodes.iter().find(|n| n.metadata.name.as_deref() == Some(hostname));
    recorder.on_node(node);
}
