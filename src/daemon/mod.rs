//! The daemon's assembly: one proxier per IP family the node supports, their sync loops,
//! the health and metrics servers, service health-check ports, and the hooks that connect
//! them (upstream `newProxyServer` / `createProxier` / `Run`).
//!
//! [`Daemon::build`] takes every side effect as a dependency ([`DaemonDeps`], the event
//! recorder included) so the assembly is tested with fakes; `app` wires the real ones, the
//! API watches and the servers.

pub mod app;
pub mod runner;
pub mod sync_loop;
pub mod tasks;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Node;
use tokio_util::sync::CancellationToken;

use crate::config::{DetectLocal, ProxyMode, Settings};
use crate::daemon::sync_loop::{Shared, SharedProxier, SyncLoop, lock};
use crate::iptables::Iptables;
use crate::k8s::ProxierSet;
use crate::k8s::events::{
    ACTION_LISTEN, ACTION_START, EventRecorder, EventType, REASON_FAILED_SERVICE_HEALTHCHECK, REASON_STARTING,
    node_ref, service_ref,
};
use crate::metrics::Metrics;
use crate::model::IpFamily;
use crate::model::node::{NodeInfo, NodeIps};
use crate::nftables::Nftables;
use crate::node::conntrack::Conntrack;
use crate::node::conntrack::cleaner::{CleanupRun, ConntrackCleaner};
use crate::node::nfacct::Nfacct;
use crate::node::sysctl::{
    ConntrackOutcome, READ_ONLY_SYSFS_MESSAGE, READ_ONLY_SYSFS_REASON, Sysctl, check_bridge_nf_call_iptables,
    conntrack_tcp_be_liberal, ensure_route_localnet,
};
use crate::proxier::local_detect::LocalDetector;
use crate::proxier::nftables::{NftProxierConfig, NftRenderConfig, NftSyncReport, NftablesProxier};
use crate::proxier::nodeport_addresses::NodePortAddresses;
use crate::proxier::{NetworkInterfaces, Proxier, ProxierConfig, RenderConfig, ServiceHealthState, SyncReport};
use crate::serve::health::{ProxierHealthServer, SyncMark, SystemClock};
use crate::serve::healthcheck::{ServiceHealthServer, listen_addresses};

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("no {mode} support for the node's primary IP family {family}")]
    PrimaryFamilyUnsupported { family: IpFamily, mode: ProxyMode },
    #[error("failed to set up sysctl {name}: {reason}")]
    Sysctl { name: &'static str, reason: String },
    #[error("failed to create the sync loop: {0}")]
    Runner(#[from] crate::daemon::runner::RunnerError),
    #[error("failed to create metrics: {0}")]
    Metrics(#[from] crate::metrics::MetricsError),
}

/// How long an nftables sync loop may go without a sync: upstream's runner runs one every
/// `syncPeriod` from 1.34 (mostly partial, full once an hour), every hour before.
fn nftables_max_interval(settings: &Settings) -> Duration {
    if settings.features.release.nft_has_periodic_full_sync() {
        settings.sync_period
    } else {
        crate::daemon::sync_loop::MAX_INTERVAL
    }
}

/// The side effects the daemon is built on.
pub struct DaemonDeps {
    /// iptables per family (absent or not `present()`: that family is not supported).
    pub iptables_v4: Option<Arc<dyn Iptables>>,
    pub iptables_v6: Option<Arc<dyn Iptables>>,
    pub sysctl: Arc<dyn Sysctl>,
    pub interfaces: Arc<dyn NetworkInterfaces>,
    pub conntrack: Option<Arc<dyn Conntrack>>,
    /// Netfilter accounting objects (rules of 1.31 and later count with them).
    pub nfacct: Option<Arc<dyn Nfacct>>,
    /// nftables per family, in nftables mode (absent: that family is not supported).
    pub nftables_v4: Option<Arc<dyn Nftables>>,
    pub nftables_v6: Option<Arc<dyn Nftables>>,
    /// Where Kubernetes Events go (the start-up event, health-check failures).
    pub events: Arc<dyn EventRecorder>,
}

/// One family's proxier and its loop (before the loop runs), in the configured mode.
pub struct FamilyProxier {
    pub family: IpFamily,
    pub rules: ModeProxier,
    /// Where the family's conntrack cleaner deletes stale entries (none: no cleanup).
    pub conntrack: Option<Arc<dyn Conntrack>>,
}

/// A family's proxier and sync loop in one mode.
pub enum ModeProxier {
    Iptables { proxier: SharedProxier, sync_loop: SyncLoop<Proxier> },
    Nftables { proxier: Shared<NftablesProxier>, sync_loop: SyncLoop<NftablesProxier> },
}

impl FamilyProxier {
    /// The iptables proxier (tests sync it by hand); `None` in another mode.
    pub fn iptables(&self) -> Option<&SharedProxier> {
        match &self.rules {
            ModeProxier::Iptables { proxier, .. } => Some(proxier),
            ModeProxier::Nftables { .. } => None,
        }
    }

    /// The nftables proxier (tests sync it by hand); `None` in another mode.
    pub fn nftables(&self) -> Option<&Shared<NftablesProxier>> {
        match &self.rules {
            ModeProxier::Nftables { proxier, .. } => Some(proxier),
            ModeProxier::Iptables { .. } => None,
        }
    }

    fn recorder(&self) -> Arc<crate::tracker::ChangeRecorder> {
        match &self.rules {
            ModeProxier::Iptables { proxier, .. } => lock(proxier).recorder(),
            ModeProxier::Nftables { proxier, .. } => lock(proxier).recorder(),
        }
    }

    fn handle(&self) -> crate::daemon::runner::RunnerHandle {
        match &self.rules {
            ModeProxier::Iptables { sync_loop, .. } => sync_loop.handle(),
            ModeProxier::Nftables { sync_loop, .. } => sync_loop.handle(),
        }
    }

    fn rule_writes(&self) -> Arc<crate::node::conntrack::cleaner::RuleWrites> {
        match &self.rules {
            ModeProxier::Iptables { proxier, .. } => lock(proxier).rule_writes(),
            ModeProxier::Nftables { proxier, .. } => lock(proxier).rule_writes(),
        }
    }

    fn node_port_addresses(&self) -> NodePortAddresses {
        match &self.rules {
            ModeProxier::Iptables { proxier, .. } => lock(proxier).config().render.node_port_addresses.clone(),
            ModeProxier::Nftables { proxier, .. } => lock(proxier).config().render.node_port_addresses.clone(),
        }
    }
}

/// The assembled daemon, ready to run.
pub struct Daemon {
    pub hostname: String,
    pub families: Vec<FamilyProxier>,
    pub health: Arc<ProxierHealthServer>,
    pub metrics: Arc<Metrics>,
    pub events: Arc<dyn EventRecorder>,
    /// Removes the other mode's rules once every family has synced (none: nothing to do).
    leftovers: Option<Arc<LeftoverCleanup>>,
}

/// Runs the other mode's cleanup once, after the first successful sync of every family, on
/// a thread of its own (it execs iptables or nft; no loop waits for it).
struct LeftoverCleanup {
    waiting: std::sync::Mutex<std::collections::BTreeSet<IpFamily>>,
    cleanup: std::sync::Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl LeftoverCleanup {
    fn family_synced(&self, family: IpFamily) {
        let mut waiting = self.waiting.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !waiting.remove(&family) || !waiting.is_empty() {
            return;
        }
        drop(waiting);
        if let Some(cleanup) = self.cleanup.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take() {
            let spawned = std::thread::Builder::new().name("leftover-cleanup".into()).spawn(move || {
                tracing::info!("every family synced; removing the other proxy mode's leftover rules");
                cleanup();
            });
            if let Err(e) = spawned {
                tracing::error!(error = %e, "could not start the cleanup of the other mode's rules");
            }
        }
    }
}

impl Daemon {
    /// Runs `cleanup` (removing the other proxy mode's rules) once every family has synced.
    pub fn with_leftover_cleanup(mut self, cleanup: Box<dyn FnOnce() + Send>) -> Daemon {
        self.leftovers = Some(Arc::new(LeftoverCleanup {
            waiting: std::sync::Mutex::new(self.families.iter().map(|f| f.family).collect()),
            cleanup: std::sync::Mutex::new(Some(cleanup)),
        }));
        self
    }

    /// Decides the families (the node's primary one must be supported; both when both are:
    /// dual stack), sets the sysctls the rules depend on, and builds a proxier per family.
    pub fn build(
        settings: &Settings,
        hostname: String,
        node: Option<&Node>,
        deps: &DaemonDeps,
    ) -> Result<Daemon, DaemonError> {
        let node_info = node.map(NodeInfo::from_node).unwrap_or_default();
        let node_ips = NodeIps::detect(&node_info.host_ips, Some(settings.bind_address));
        // A family is supported when the mode's tool works for it.
        let (v4, v6) = match settings.mode {
            ProxyMode::Iptables => {
                let supported = |ipt: &Option<Arc<dyn Iptables>>| ipt.as_ref().is_some_and(|i| i.present());
                (supported(&deps.iptables_v4), supported(&deps.iptables_v6))
            }
            ProxyMode::Nftables => (deps.nftables_v4.is_some(), deps.nftables_v6.is_some()),
        };
        let primary_ok = match node_ips.primary {
            IpFamily::V4 => v4,
            IpFamily::V6 => v6,
        };
        if !primary_ok {
            return Err(DaemonError::PrimaryFamilyUnsupported { family: node_ips.primary, mode: settings.mode });
        }
        if v4 && v6 {
            tracing::info!(primary = %node_ips.primary, mode = %settings.mode, "running in dual-stack mode");
        } else {
            tracing::info!(family = %node_ips.primary, mode = %settings.mode, "running in single-stack mode");
        }
        let families: Vec<IpFamily> =
            [(IpFamily::V4, v4), (IpFamily::V6, v6)].into_iter().filter(|(_, ok)| *ok).map(|(f, _)| f).collect();

        let metrics = Arc::new(Metrics::for_mode(settings.features.release, settings.mode)?);
        if let (ProxyMode::Iptables, Some(nfacct)) = (settings.mode, &deps.nfacct) {
            metrics.register_nfacct(nfacct)?;
        }
        let health = Arc::new(ProxierHealthServer::new(
            settings.sync_period * 2,
            settings.features.release,
            Arc::new(SystemClock),
            Some(metrics.clone()),
        ));
        let tcp_liberal = settings.mode == ProxyMode::Iptables && conntrack_tcp_be_liberal(deps.sysctl.as_ref());
        // Bridged pod traffic skips these rules without br_netfilter; say so once, at start.
        check_bridge_nf_call_iptables(deps.sysctl.as_ref());
        let node_port_cidrs =
            NodePortAddresses::resolve_keywords(&settings.node_port_addresses, &[node_ips.v4, node_ips.v6]);

        let mut built = Vec::new();
        for family in families {
            let node_port_addresses = NodePortAddresses::new(family, &node_port_cidrs);
            if settings.detect_local == DetectLocal::NodeCidr && node_info.pod_cidrs.is_empty() {
                tracing::warn!("detect-local-mode NodeCIDR but the node has no podCIDRs yet; using no local detector");
            }
            let local_detector = LocalDetector::from_mode(&settings.detect_local, family, &node_info.pod_cidrs);
            if settings.mode == ProxyMode::Nftables {
                let nft = match family {
                    IpFamily::V4 => deps.nftables_v4.clone(),
                    IpFamily::V6 => deps.nftables_v6.clone(),
                }
                .expect("families are those with nftables");
                let render = NftRenderConfig {
                    family,
                    masquerade_all: settings.masquerade_all,
                    masquerade_mark: settings.masquerade_mark.clone(),
                    local_detector,
                    node_ip: Some(node_ips.get(family)),
                    node_port_addresses,
                    features: settings.features,
                };
                let cfg = NftProxierConfig { render, hostname: hostname.clone(), sync_period: settings.sync_period };
                let proxier = NftablesProxier::with_recorder(cfg, nft, deps.interfaces.clone(), Some(metrics.clone()));
                if let Some(node) = node {
                    proxier.on_node_update(Some(node));
                }
                let proxier = Arc::new(std::sync::Mutex::new(proxier));
                let sync_loop = SyncLoop::without_canary(
                    proxier.clone(),
                    settings.min_sync_period,
                    nftables_max_interval(settings),
                )?;
                health.updated(family);
                built.push(FamilyProxier {
                    family,
                    rules: ModeProxier::Nftables { proxier, sync_loop },
                    conntrack: deps.conntrack.clone(),
                });
                continue;
            }
            let ipt = match family {
                IpFamily::V4 => deps.iptables_v4.clone(),
                IpFamily::V6 => deps.iptables_v6.clone(),
            }
            .expect("families are those with iptables");
            let localhost_nodeports =
                family == IpFamily::V4 && settings.localhost_nodeports && node_port_addresses.contains_ipv4_loopback();
            if localhost_nodeports {
                ensure_route_localnet(deps.sysctl.as_ref()).map_err(|e| DaemonError::Sysctl {
                    name: "net/ipv4/conf/all/route_localnet",
                    reason: e.to_string(),
                })?;
            }
            let render = RenderConfig {
                family,
                masquerade_all: settings.masquerade_all,
                masquerade_mark: settings.masquerade_mark.clone(),
                localhost_nodeports,
                local_detector,
                node_ip: Some(node_ips.get(family)),
                node_port_addresses,
                random_fully: ipt.has_random_fully(),
                conntrack_tcp_liberal: tcp_liberal,
                features: settings.features,
            };
            let cfg = ProxierConfig { render, hostname: hostname.clone(), sync_period: settings.sync_period };
            let progress_health = health.clone();
            let mut proxier = Proxier::with_recorder(cfg, ipt.clone(), deps.interfaces.clone(), Some(metrics.clone()))
                .with_progress(Arc::new(move || progress_health.sync_progress(family)));
            if let Some(nfacct) = &deps.nfacct {
                proxier = proxier.with_nfacct(nfacct.clone());
            }
            if let Some(node) = node {
                proxier.on_node_update(Some(node));
            }
            let proxier = Arc::new(std::sync::Mutex::new(proxier));
            let sync_loop = SyncLoop::new(proxier.clone(), ipt, settings.min_sync_period, settings.sync_period)?;
            // Upstream marks each family healthy when its loop starts.
            health.updated(family);
            built.push(FamilyProxier {
                family,
                rules: ModeProxier::Iptables { proxier, sync_loop },
                conntrack: deps.conntrack.clone(),
            });
        }
        if let Some(node) = node {
            health.sync_node(node);
        }
        Ok(Daemon { hostname, families: built, health, metrics, events: deps.events.clone(), leftovers: None })
    }

    /// Where the ServiceCIDR watch reports the CIDRs of all ServiceCIDR objects: the nftables
    /// proxiers (their drop rule for unallocated ClusterIPs), when MultiCIDRServiceAllocator is
    /// on; `None` when nothing needs them (iptables mode, as upstream's iptables proxier
    /// ignores them).
    pub fn service_cidr_callback(&self, settings: &Settings) -> Option<crate::k8s::watch::ServiceCidrCallback> {
        if !settings.features.multi_cidr_service_allocator {
            return None;
        }
        let sinks: Vec<_> =
            self.families.iter().filter_map(|f| f.nftables()).map(|p| lock(p).service_cidr_sink()).collect();
        if sinks.is_empty() {
            return None;
        }
        // They are only stored, for the next full sync (as upstream).
        Some(Arc::new(move |cidrs: &[String]| sinks.iter().for_each(|sink| sink(cidrs))))
    }

    /// Announces on this Node that the proxy started (upstream `birthCry`, raised once the
    /// watches run and before the first sync).
    pub fn birth_cry(&self) {
        self.events.record(node_ref(&self.hostname), EventType::Normal, REASON_STARTING, ACTION_START, "");
    }

    /// The proxiers' recorders as the watches feed them; asking for a sync also records a
    /// queued update (health and metrics).
    pub fn proxier_set(&self) -> ProxierSet {
        let members = self
            .families
            .iter()
            .map(|f| {
                let health = self.health.clone();
                let metrics = self.metrics.clone();
                let family = f.family;
                let handle = f.handle();
                let request: crate::k8s::SyncRequest = Arc::new(move || {
                    health.queued_update(family);
                    metrics.sync_queued(family, SystemTime::now());
                    handle.run();
                });
                let sink: Arc<dyn crate::k8s::ChangeSink> = f.recorder();
                (sink, request)
            })
            .collect();
        ProxierSet::new(members)
    }

    /// Runs the sync loops until `shutdown`; every sync is recorded in metrics and health,
    /// and successful ones update the service health checks (when given) from every
    /// family's last published state, so no loop ever waits for another family's sync. Then
    /// the sync's conntrack cleanup goes to the family's cleaner, which runs it beside later
    /// syncs: metrics, `/healthz` and the next change never wait for it.
    ///
    /// Returns when every loop has stopped after `shutdown`, or with the first loop that
    /// ended before it (the others are then stopped); a cleanup still running is told to
    /// stop and not waited for.
    pub async fn run_loops(
        self,
        shutdown: CancellationToken,
        service_health: Option<Arc<ServiceHealthServer>>,
    ) -> Result<(), tasks::TaskEnded> {
        let published = Arc::new(std::sync::Mutex::new(BTreeMap::<IpFamily, ServiceHealthState>::new()));
        let mut loops = tasks::Tasks::new();
        let mut cleaners = Vec::new();
        for f in self.families {
            let cleaner = match &f.conntrack {
                Some(ct) => {
                    let metrics = self.metrics.clone();
                    let on_run = Arc::new(move |run: &CleanupRun| metrics.record_conntrack_cleanup(run));
                    let rules = f.rule_writes();
                    match ConntrackCleaner::start(f.family, ct.clone(), rules, on_run) {
                        Ok(cleaner) => Some(Arc::new(cleaner)),
                        Err(e) => {
                            tracing::error!(family = %f.family, error = %e, "failed to start the conntrack cleanup; stale entries will not be deleted");
                            None
                        }
                    }
                }
                None => None,
            };
            cleaners.extend(cleaner.clone());
            let after_sync = AfterSync {
                family: f.family,
                health: self.health.clone(),
                metrics: self.metrics.clone(),
                service_health: service_health.clone(),
                events: self.events.clone(),
                published: published.clone(),
                cleaner,
                leftovers: self.leftovers.clone(),
            };
            let family = f.family;
            let health = self.health.clone();
            let on_start = move || health.sync_starting(family);
            let run = match f.rules {
                ModeProxier::Iptables { sync_loop, .. } => tokio::spawn(sync_loop.run_observed(
                    shutdown.clone(),
                    on_start,
                    move |report: &SyncReport, mark| after_sync.report(report, mark),
                )),
                ModeProxier::Nftables { sync_loop, .. } => tokio::spawn(sync_loop.run_observed(
                    shutdown.clone(),
                    on_start,
                    move |report: &NftSyncReport, mark| after_sync.report(report, mark),
                )),
            };
            loops.spawn(format!("sync loop ({family})"), async move {
                match run.await {
                    Ok(ended) => ended.map_err(|e| e.to_string()),
                    Err(e) => Err(format!("sync loop task failed: {e}")),
                }
            });
        }
        let stop_cleaners = || cleaners.iter().for_each(|c| c.stop());
        while let Some(ended) = loops.next_ended().await {
            if !shutdown.is_cancelled() {
                stop_cleaners();
                return Err(ended);
            }
        }
        stop_cleaners();
        Ok(())
    }
}

/// What the daemon does with each sync's report, in either mode: metrics, health, the
/// service health checks (from every family's last published state, so no loop waits for
/// another family's sync), then the sync's conntrack cleanup goes to the family's cleaner.
struct AfterSync {
    family: IpFamily,
    health: Arc<ProxierHealthServer>,
    metrics: Arc<Metrics>,
    service_health: Option<Arc<ServiceHealthServer>>,
    events: Arc<dyn EventRecorder>,
    published: Arc<std::sync::Mutex<BTreeMap<IpFamily, ServiceHealthState>>>,
    cleaner: Option<Arc<ConntrackCleaner>>,
    leftovers: Option<Arc<LeftoverCleanup>>,
}

/// The parts of a sync's report the daemon acts on, whichever mode wrote the rules.
trait ReportView {
    fn record_metrics(&self, metrics: &Metrics, family: IpFamily, now: SystemTime);
    fn succeeded(&self) -> bool;
    fn service_health(&self) -> Option<&ServiceHealthState>;
    fn conntrack_cleanup(&self) -> Option<&crate::node::conntrack::cleaner::CleanupJob>;
}

impl ReportView for SyncReport {
    fn record_metrics(&self, metrics: &Metrics, family: IpFamily, now: SystemTime) {
        metrics.record_sync(family, self, self.elapsed, now);
    }
    fn succeeded(&self) -> bool {
        self.result.is_ok()
    }
    fn service_health(&self) -> Option<&ServiceHealthState> {
        self.service_health.as_ref()
    }
    fn conntrack_cleanup(&self) -> Option<&crate::node::conntrack::cleaner::CleanupJob> {
        self.conntrack_cleanup.as_ref()
    }
}

impl ReportView for NftSyncReport {
    fn record_metrics(&self, metrics: &Metrics, family: IpFamily, now: SystemTime) {
        metrics.record_nftables_sync(family, self, now);
    }
    fn succeeded(&self) -> bool {
        self.result.is_ok()
    }
    fn service_health(&self) -> Option<&ServiceHealthState> {
        self.service_health.as_ref()
    }
    fn conntrack_cleanup(&self) -> Option<&crate::node::conntrack::cleaner::CleanupJob> {
        self.conntrack_cleanup.as_ref()
    }
}

impl AfterSync {
    /// `mark`: where the health's queue stood when the sync took its changes.
    fn report(&self, report: &impl ReportView, mark: SyncMark) {
        let family = self.family;
        report.record_metrics(&self.metrics, family, SystemTime::now());
        if !report.succeeded() {
            self.health.sync_failed(family);
            return;
        }
        self.health.synced(family, mark);
        if let (Some(sh), Some(state)) = (&self.service_health, report.service_health()) {
            let mut all = self.published.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            all.insert(family, state.clone());
            sync_service_health(sh, all.values(), self.events.as_ref());
        }
        if let (Some(cleaner), Some(job)) = (&self.cleaner, report.conntrack_cleanup()) {
            cleaner.submit(job.clone());
        }
        if let Some(leftovers) = &self.leftovers {
            leftovers.family_synced(family);
        }
    }
}

/// Health-check node ports and local ready endpoints over all families (a dual-stack
/// Service appears in both; a single-family one in its own), from each family's state as of
/// its last successful sync. A port that cannot be opened is a Warning event on its Service
/// (upstream `FailedToStartServiceHealthcheck`), raised again on every retry: the recorder
/// folds the repeats into one Event's series.
pub(crate) fn sync_service_health<'a>(
    server: &ServiceHealthServer,
    families: impl IntoIterator<Item = &'a ServiceHealthState>,
    events: &dyn EventRecorder,
) {
    let mut ports = BTreeMap::new();
    let mut local = BTreeMap::new();
    for state in families {
        ports.extend(state.ports.iter().map(|(k, v)| (k.clone(), *v)));
        for (svc, n) in &state.local_endpoints {
            let e = local.entry(svc.clone()).or_insert(0);
            *e = std::cmp::max(*e, *n);
        }
    }
    for err in server.sync_services(&ports) {
        tracing::warn!(error = %err, "failed to start service health check; retrying on the next sync");
        events.record(
            service_ref(err.service()),
            EventType::Warning,
            REASON_FAILED_SERVICE_HEALTHCHECK,
            ACTION_LISTEN,
            &err.to_string(),
        );
    }
    server.sync_endpoints(&local);
}

/// Upstream's Node event when the conntrack hash table could not be resized because `/sys`
/// is read-only (reason and message as upstream writes them).
pub fn report_conntrack_outcome(outcome: &ConntrackOutcome, hostname: &str, events: &dyn EventRecorder) {
    if outcome.read_only_sysfs {
        events.record(
            node_ref(hostname),
            EventType::Warning,
            READ_ONLY_SYSFS_REASON,
            ACTION_START,
            READ_ONLY_SYSFS_MESSAGE,
        );
    }
}

/// The service health-check server listening on the node-port addresses of all families.
pub(crate) fn service_health_server(
    daemon: &Daemon,
    interfaces: &dyn NetworkInterfaces,
    runtime: tokio::runtime::Handle,
    shutdown: CancellationToken,
) -> Arc<ServiceHealthServer> {
    let npas: Vec<NodePortAddresses> = daemon.families.iter().map(FamilyProxier::node_port_addresses).collect();
    let refs: Vec<&NodePortAddresses> = npas.iter().collect();
    let ips: Vec<IpAddr> = listen_addresses(&refs, interfaces);
    Arc::new(ServiceHealthServer::new(daemon.hostname.clone(), ips, daemon.health.clone(), runtime, shutdown))
}

/// How long the daemon waits for the loops to stop after shutdown.
pub(crate) const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
