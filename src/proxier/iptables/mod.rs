//! iptables mode's proxier: owns the service and endpoint maps, drains its
//! [`ChangeRecorder`] into them, renders the rules and hands them to iptables (upstream's
//! iptables `Proxier`).
//!
//! Event handlers only record changes, into the recorder ([`Proxier::recorder`]), which has
//! its own short lock: they never wait for a sync. The runner decides when to call
//! [`Proxier::sync`]. Nothing is applied until Services and EndpointSlices have both been
//! listed once.

pub mod cleanup;
pub mod render;

use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;

use crate::compat::FULL_SYNC_PERIOD;
use crate::iptables::{self, FlushFlag, Iptables, RestoreCounters, RulePosition, Table};
use crate::model::NamespacedName;
use crate::model::chains::{self, NatChains};
use crate::node::conntrack::cleaner::{CleanupJob, RuleWrites};
use crate::node::nfacct::{Nfacct, NfacctCounters};
use crate::tracker::{
    ChangeObserver, ChangeRecorder, EndpointsMap, EndpointsUpdateResult, HealthCheckNodePorts, LocalReadyEndpoints,
    ServicePortMap, ServiceUpdateResult,
};

pub use render::{RenderConfig, RenderStats, Rendered};

/// A jump from a built-in chain to one of ours, ensured with `-I` on every full sync (these
/// rules live in chains we do not own, so they cannot go through iptables-restore).
#[derive(Debug, Clone, Copy)]
pub struct JumpChain {
    pub table: Table,
    pub dst: &'static str,
    pub src: &'static str,
    pub comment: &'static str,
    pub extra_args: &'static [&'static str],
}

impl JumpChain {
    /// The rule arguments, as upstream builds them.
    pub fn args(&self) -> Vec<&'static str> {
        let mut args: Vec<&'static str> = self.extra_args.to_vec();
        if !self.comment.is_empty() {
            args.extend(["-m", "comment", "--comment", self.comment]);
        }
        args.extend(["-j", self.dst]);
        args
    }
}

const CTSTATE_NEW: &[&str] = &["-m", "conntrack", "--ctstate", "NEW"];

/// Jumps from the built-in chains into ours (upstream `iptablesJumpChains`).
pub const JUMP_CHAINS: &[JumpChain] = &[
    JumpChain {
        table: Table::Filter,
        dst: chains::KUBE_EXTERNAL_SERVICES,
        src: iptables::CHAIN_INPUT,
        comment: "kubernetes externally-visible service portals",
        extra_args: CTSTATE_NEW,
    },
    JumpChain {
        table: Table::Filter,
        dst: chains::KUBE_EXTERNAL_SERVICES,
        src: iptables::CHAIN_FORWARD,
        comment: "kubernetes externally-visible service portals",
        extra_args: CTSTATE_NEW,
    },
    JumpChain {
        table: Table::Filter,
        dst: chains::KUBE_NODEPORTS,
        src: iptables::CHAIN_INPUT,
        comment: "kubernetes health check service ports",
        extra_args: &[],
    },
    JumpChain {
        table: Table::Filter,
        dst: chains::KUBE_SERVICES,
        src: iptables::CHAIN_FORWARD,
        comment: "kubernetes service portals",
        extra_args: CTSTATE_NEW,
    },
    JumpChain {
        table: Table::Filter,
        dst: chains::KUBE_SERVICES,
        src: iptables::CHAIN_OUTPUT,
        comment: "kubernetes service portals",
        extra_args: CTSTATE_NEW,
    },
    JumpChain {
        table: Table::Filter,
        dst: chains::KUBE_FORWARD,
        src: iptables::CHAIN_FORWARD,
        comment: "kubernetes forwarding rules",
        extra_args: &[],
    },
    JumpChain {
        table: Table::Filter,
        dst: chains::KUBE_PROXY_FIREWALL,
        src: iptables::CHAIN_INPUT,
        comment: "kubernetes load balancer firewall",
        extra_args: CTSTATE_NEW,
    },
    JumpChain {
        table: Table::Filter,
        dst: chains::KUBE_PROXY_FIREWALL,
        src: iptables::CHAIN_OUTPUT,
        comment: "kubernetes load balancer firewall",
        extra_args: CTSTATE_NEW,
    },
    JumpChain {
        table: Table::Filter,
        dst: chains::KUBE_PROXY_FIREWALL,
        src: iptables::CHAIN_FORWARD,
        comment: "kubernetes load balancer firewall",
        extra_args: CTSTATE_NEW,
    },
    JumpChain {
        table: Table::Nat,
        dst: chains::KUBE_SERVICES,
        src: iptables::CHAIN_OUTPUT,
        comment: "kubernetes service portals",
        extra_args: &[],
    },
    JumpChain {
        table: Table::Nat,
        dst: chains::KUBE_SERVICES,
        src: iptables::CHAIN_PREROUTING,
        comment: "kubernetes service portals",
        extra_args: &[],
    },
    JumpChain {
        table: Table::Nat,
        dst: chains::KUBE_POSTROUTING,
        src: iptables::CHAIN_POSTROUTING,
        comment: "kubernetes postrouting rules",
        extra_args: &[],
    },
];

/// kubelet's chains, ensured on full syncs but never removed by cleanup.
pub(crate) const KUBELET_JUMP_CHAINS: &[JumpChain] = &[
    JumpChain {
        table: Table::Filter,
        dst: chains::KUBE_FIREWALL,
        src: iptables::CHAIN_INPUT,
        comment: "",
        extra_args: &[],
    },
    JumpChain {
        table: Table::Filter,
        dst: chains::KUBE_FIREWALL,
        src: iptables::CHAIN_OUTPUT,
        comment: "",
        extra_args: &[],
    },
];

/// Where the host's interface addresses come from (for nodePortAddresses).
pub trait NetworkInterfaces: Send + Sync {
    fn interface_addrs(&self) -> std::io::Result<Vec<IpAddr>>;
}

/// A fixed list of addresses (tests and the `render` command).
#[derive(Debug, Clone, Default)]
pub struct StaticInterfaces(pub Vec<IpAddr>);

impl NetworkInterfaces for StaticInterfaces {
    fn interface_addrs(&self) -> std::io::Result<Vec<IpAddr>> {
        Ok(self.0.clone())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("failed to ensure chain {table}/{chain}: {source}")]
    EnsureChain { table: Table, chain: &'static str, source: iptables::IptablesError },
    #[error("failed to ensure jump {table}/{src} -> {dst}: {source}")]
    EnsureJump { table: Table, src: &'static str, dst: &'static str, source: iptables::IptablesError },
    #[error("failed to execute iptables-restore: {source}{context}")]
    Restore { source: iptables::IptablesError, context: String },
}

/// What one call to [`Proxier::sync`] did.
#[derive(Debug)]
pub enum SyncOutcome {
    /// Services or EndpointSlices have not been listed yet; nothing was touched.
    NotInitialized,
    /// Rules were written (or writing failed) as described.
    Synced(Box<SyncReport>),
}

#[derive(Debug)]
pub struct SyncReport {
    /// Whether this was a full sync.
    pub full: bool,
    /// The restore input in upstream's layout (also on failure), when the proxier records
    /// it ([`Proxier::with_payload_recording`]): the daemon does not, as the input is
    /// written straight into `iptables-restore` and never held whole.
    pub payload: Option<String>,
    pub stats: RenderStats,
    pub service_update: ServiceUpdateResult,
    pub endpoints_update: EndpointsUpdateResult,
    /// `Err` when the sync failed; the next sync will be full and should come after
    /// `retry_after`.
    pub result: Result<(), SyncError>,
    pub retry_after: Option<Duration>,
    /// How long the sync took (for the latency metrics).
    pub elapsed: Duration,
    /// What the service health-check servers need after this sync (set when it succeeded).
    pub service_health: Option<ServiceHealthState>,
    /// The conntrack cleanup this sync leaves (set when it succeeded and there is one): the
    /// sync never runs it, its caller hands it to the family's cleaner, which runs it while
    /// later syncs go on (`node::conntrack::cleaner`).
    pub conntrack_cleanup: Option<CleanupJob>,
}

/// The health-check node ports and local ready endpoint counts of one family, as of the last
/// successful sync: published with the report so nobody has to lock a proxier to read them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceHealthState {
    pub ports: HealthCheckNodePorts,
    pub local_endpoints: LocalReadyEndpoints,
}

/// Settings of one proxier (one IP family).
#[derive(Debug, Clone)]
pub struct ProxierConfig {
    pub render: RenderConfig,
    pub hostname: String,
    pub sync_period: Duration,
}

/// One IP family's proxier.
pub struct Proxier {
    cfg: ProxierConfig,
    iptables: Arc<dyn Iptables>,
    interfaces: Arc<dyn NetworkInterfaces>,
    /// Where event handlers record changes (shared with them; its own short lock).
    changes: Arc<ChangeRecorder>,
    services: ServicePortMap,
    endpoints: EndpointsMap,
    /// This node's labels as of the last drain.
    node_labels: Option<BTreeMap<String, String>>,
    /// A failed sync leaves the kernel in a state only a full sync can repair.
    needs_full_sync: bool,
    render_state: render::RenderState,
    /// The per-service nat chains the kernel holds, as far as this proxier knows: read from
    /// the kernel only when unknown (at start, after a failed restore, after our rules were
    /// flushed from outside), then kept up to date from what each restore wrote and deleted.
    kernel_chains: Option<NatChains>,
    last_cleanup: Option<Instant>,
    /// When the last successful full sync ended (as upstream's `lastFullSync`): from 1.33 a
    /// sync is full again once this is [`FULL_SYNC_PERIOD`] old
    /// ([`Proxier::periodic_full_sync_due`]).
    last_full_sync: Option<Instant>,
    /// Counts the restores begun; the conntrack cleaner reads it to tell whether the rules
    /// changed while it listed the table.
    rule_writes: Arc<RuleWrites>,
    /// Told after each step of a restore that succeeded (liveness).
    progress: Option<SyncProgress>,
    /// Creates the accounting objects the rules of 1.31 and later count with.
    nfacct: Option<Arc<dyn Nfacct>>,
    /// The accounting objects the last full sync made sure of.
    nfacct_counters: NfacctCounters,
    /// Keep each restore input's text in the sync report.
    record_payloads: bool,
}

/// Called after each step of a restore that succeeded.
pub(crate) type SyncProgress = Arc<dyn Fn() + Send + Sync>;

impl Proxier {
    pub fn new(cfg: ProxierConfig, iptables: Arc<dyn Iptables>, interfaces: Arc<dyn NetworkInterfaces>) -> Self {
        Proxier::with_recorder(cfg, iptables, interfaces, None)
    }

    /// A proxier whose recorder reports every recorded change to `observer` (the change
    /// metrics).
    pub(crate) fn with_recorder(
        cfg: ProxierConfig,
        iptables: Arc<dyn Iptables>,
        interfaces: Arc<dyn NetworkInterfaces>,
        observer: Option<Arc<dyn ChangeObserver>>,
    ) -> Self {
        let changes =
            Arc::new(ChangeRecorder::new(cfg.render.family, cfg.render.features, cfg.hostname.clone(), observer));
        Proxier {
            cfg,
            iptables,
            interfaces,
            changes,
            services: ServicePortMap::default(),
            endpoints: EndpointsMap::default(),
            node_labels: None,
            needs_full_sync: true,
            render_state: render::RenderState::default(),
            kernel_chains: None,
            last_cleanup: None,
            last_full_sync: None,
            rule_writes: RuleWrites::new(),
            progress: None,
            nfacct: None,
            nfacct_counters: NfacctCounters::default(),
            record_payloads: false,
        }
    }

    /// Keeps each sync's restore input, as text, in its report (the `render` command and
    /// tests; it costs a copy of the input).
    pub fn with_payload_recording(mut self) -> Self {
        self.record_payloads = true;
        self
    }

    /// The recorder event handlers feed; recording through it never waits for a sync.
    pub fn recorder(&self) -> Arc<ChangeRecorder> {
        self.changes.clone()
    }

    /// The count of restores this proxier has begun, for its conntrack cleaner: a successful
    /// sync's report carries the cleanup it leaves (upstream deletes stale entries at the end
    /// of `syncProxyRules`: per change up to 1.31, with the reconciler from 1.32), tagged
    /// with the number of its restore.
    pub fn rule_writes(&self) -> Arc<RuleWrites> {
        self.rule_writes.clone()
    }

    /// Makes sure of the accounting objects through `nfacct` on every full sync, and names
    /// the ones that exist in the rules (releases 1.31 and later), as upstream.
    pub(crate) fn with_nfacct(mut self, nfacct: Arc<dyn Nfacct>) -> Self {
        self.nfacct = Some(nfacct);
        self
    }

    /// Reports sync progress to `progress` (the daemon's liveness).
    pub(crate) fn with_progress(mut self, progress: SyncProgress) -> Self {
        self.progress = Some(progress);
        self
    }

    pub fn config(&self) -> &ProxierConfig {
        &self.cfg
    }

    /// Records the current state of a Service (`current` None: deleted). Returns whether a
    /// sync is wanted. The one way a Service change reaches the proxier: the watches, `render`,
    /// `diff` and the tests all come through here.
    pub fn on_service_state(&self, service: NamespacedName, current: Option<&Service>) -> bool {
        self.changes.on_service(service, current)
    }

    /// Records an EndpointSlice add/update, or its deletion. Returns whether a sync is wanted.
    pub fn on_endpoint_slice_update(&self, slice: &EndpointSlice, removed: bool) -> bool {
        self.changes.on_endpoint_slice(slice, removed)
    }

    pub fn on_services_synced(&self) {
        self.changes.on_services_synced();
    }

    pub fn on_endpoint_slices_synced(&self) {
        self.changes.on_endpoint_slices_synced();
    }

    /// Records this node's labels (a change forces the next sync to be full). Returns
    /// whether a sync is wanted.
    pub fn on_node_update(&self, node: Option<&Node>) -> bool {
        self.changes.on_node(node)
    }

    /// Forces the next sync to be full, reading the kernel first (our rules were flushed from
    /// outside).
    pub fn force_full_sync(&self) {
        self.changes.resync_from_kernel();
    }

    /// The IP family this proxier programs.
    pub fn family(&self) -> crate::model::IpFamily {
        self.cfg.render.family
    }

    pub fn services(&self) -> &ServicePortMap {
        &self.services
    }

    pub fn endpoints(&self) -> &EndpointsMap {
        &self.endpoints
    }

    /// Applies pending changes and writes the rules. `now` drives the large-cluster cleanup
    /// cadence.
    pub fn sync(&mut self, now: Instant) -> SyncOutcome {
        let Some(drained) = self.changes.drain() else {
            tracing::debug!("not syncing iptables until Services and EndpointSlices have been received");
            return SyncOutcome::NotInitialized;
        };
        let started = Instant::now();
        if drained.full_sync {
            self.needs_full_sync = true;
        }
        if !self.needs_full_sync && self.periodic_full_sync_due(now) {
            tracing::debug!(period = ?FULL_SYNC_PERIOD, "last full sync is older than the full sync period: syncing in full");
            self.needs_full_sync = true;
        }
        self.node_labels = drained.node_labels;
        let try_partial = !self.needs_full_sync;
        let service_update = self.services.apply(drained.services);
        let endpoints_update = self.endpoints.apply(drained.endpoints);

        let mut report = SyncReport {
            full: !try_partial,
            payload: None,
            stats: RenderStats::default(),
            service_update,
            endpoints_update,
            result: Ok(()),
            retry_after: None,
            elapsed: Duration::ZERO,
            service_health: None,
            conntrack_cleanup: None,
        };

        if !try_partial {
            if let Err(e) = self.ensure_jump_chains() {
                report.elapsed = started.elapsed();
                return SyncOutcome::Synced(Box::new(self.failed(report, e)));
            }
            self.render_state.reset();
            if let Some(nfacct) = &self.nfacct
                && self.cfg.render.features.release.has_nfacct_counters()
            {
                self.nfacct_counters = NfacctCounters::ensure(nfacct.as_ref());
            }
        }

        let changed: Option<HashSet<NamespacedName>> = try_partial.then(|| {
            let mut set: HashSet<NamespacedName> = report.service_update.updated_services.clone();
            set.extend(report.endpoints_update.updated_services.iter().cloned());
            set
        });

        if drained.kernel_changed {
            self.kernel_chains = None;
        }
        let mut read_time = Duration::ZERO;
        let large =
            render::total_endpoints(&self.services, &self.endpoints) > render::LARGE_CLUSTER_ENDPOINTS_THRESHOLD;
        let cleanup_due =
            !large || self.last_cleanup.is_none_or(|t| now.saturating_duration_since(t) > self.cfg.sync_period);
        if cleanup_due && self.kernel_chains.is_none() {
            let reading = Instant::now();
            let listed = self.iptables.list_chains(Table::Nat);
            read_time = reading.elapsed();
            match listed {
                Ok(names) => self.kernel_chains = Some(NatChains::from_names(names)),
                Err(e) => {
                    tracing::error!(error = %e, "failed to list the nat chains: stale chains will not be deleted");
                }
            }
        }
        let existing = if cleanup_due { self.kernel_chains.as_ref() } else { None };
        let cleaned = existing.is_some();
        if cleaned {
            self.last_cleanup = Some(now);
        }

        let interface_addrs = if self.cfg.render.node_port_addresses.match_all() {
            Vec::new()
        } else {
            self.interfaces.interface_addrs().unwrap_or_else(|e| {
                tracing::error!(error = %e, "failed to list interface addresses; services with node ports may not work as intended");
                Vec::new()
            })
        };
        let empty_labels = BTreeMap::new();
        let input = render::RenderInput {
            services: &self.services,
            endpoints: &self.endpoints,
            node_labels: self.node_labels.as_ref().unwrap_or(&empty_labels),
            interface_addrs: &interface_addrs,
            changed: changed.as_ref(),
            existing_nat_chains: existing,
            nfacct: self.nfacct_counters,
        };
        let rendering = Instant::now();
        let rendered = render::render(&self.cfg.render, &input, &self.render_state);
        let render_time = rendering.elapsed();
        tracing::debug!(
            services = rendered.stats.services,
            endpoints = rendered.stats.endpoints,
            services_computed = rendered.stats.services_computed,
            filter_rules = rendered.stats.filter_rules,
            nat_rules = rendered.stats.nat_rules,
            nat_chains = rendered.stats.nat_chains,
            full = rendered.full,
            "reloading service iptables data"
        );
        report.stats = rendered.stats.clone();
        if self.record_payloads {
            report.payload = Some(rendered.payload());
        }

        let progress = self.progress.clone();
        let mut on_step = move || {
            if let Some(progress) = &progress {
                progress();
            }
        };
        let rules = self.rule_writes.begin();
        let restoring = Instant::now();
        let counted = iptables::CountedInput::new(&rendered);
        let restored =
            self.iptables.restore_input(&counted, FlushFlag::NoFlush, RestoreCounters::Counters, &mut on_step);
        let restore_time = restoring.elapsed();
        let bytes = counted.bytes();
        let mut written = rendered.into_outcome();
        match restored {
            Ok(()) => {
                let active = std::mem::take(&mut written.active_nat_chains);
                match (&mut self.kernel_chains, cleaned) {
                    // Every chain not in use was deleted as stale.
                    (known, true) => *known = Some(NatChains::from_keys(active)),
                    (Some(known), false) => known.extend(&active),
                    (None, false) => {}
                }
                self.render_state.commit(written);
                self.needs_full_sync = false;
                if report.full {
                    self.last_full_sync = Some(now + started.elapsed());
                }
                report.service_health = Some(ServiceHealthState {
                    ports: self.services.health_check_node_ports(),
                    local_endpoints: self.endpoints.local_ready_endpoints(),
                });
                // Only after the rules that stop new flows to removed endpoints are in place.
                report.conntrack_cleanup = CleanupJob::after_sync(
                    self.cfg.render.features.release,
                    self.cfg.render.family,
                    rules,
                    &self.services,
                    &self.endpoints,
                    &report.service_update,
                    &report.endpoints_update,
                );
                report.elapsed = started.elapsed();
                // Upstream logs "SyncProxyRules complete" at -v 2 (debug here).
                tracing::debug!(
                    full = report.full,
                    elapsed_ms = report.elapsed.as_millis() as u64,
                    read_ms = read_time.as_millis() as u64,
                    render_ms = render_time.as_millis() as u64,
                    restore_ms = restore_time.as_millis() as u64,
                    bytes,
                    "sync complete"
                );
                SyncOutcome::Synced(Box::new(report))
            }
            Err(e) => {
                let context = e.restore_context().map(|c| format!("\n{c}")).unwrap_or_default();
                let err = SyncError::Restore { source: e, context };
                report.elapsed = started.elapsed();
                SyncOutcome::Synced(Box::new(self.failed(report, err)))
            }
        }
    }

    /// Whether this release's periodic full sync is due at `now`: the last full sync is
    /// more than [`FULL_SYNC_PERIOD`] old, and (from 1.34) the last sync was not in
    /// large-cluster mode, where upstream skips it. The runner syncs at least once an hour
    /// (its maximum interval, re-armed when a sync ends), so an idle proxier gets there too.
    fn periodic_full_sync_due(&self, now: Instant) -> bool {
        let release = self.cfg.render.features.release;
        let large = self.render_state.large_cluster_mode() == Some(true);
        release.has_periodic_full_sync()
            && !(large && release.skips_periodic_full_sync_in_large_clusters())
            && self.last_full_sync.is_some_and(|t| now.saturating_duration_since(t) > FULL_SYNC_PERIOD)
    }

    fn failed(&mut self, mut report: SyncReport, err: SyncError) -> SyncReport {
        tracing::error!(error = %err, retry_after = ?self.cfg.sync_period, "sync failed");
        // The trackers were drained: only a full sync can restore a known state, and only a
        // fresh read says which chains the kernel holds now.
        self.needs_full_sync = true;
        self.kernel_chains = None;
        self.render_state.reset();
        report.result = Err(err);
        report.retry_after = Some(self.cfg.sync_period);
        report
    }

    fn ensure_jump_chains(&self) -> Result<(), SyncError> {
        for jump in JUMP_CHAINS.iter().chain(KUBELET_JUMP_CHAINS) {
            self.iptables.ensure_chain(jump.table, jump.dst).map_err(|source| SyncError::EnsureChain {
                table: jump.table,
                chain: jump.dst,
                source,
            })?;
            self.iptables
                .ensure_rule(RulePosition::Prepend, jump.table, jump.src, &jump.args())
                .map_err(|source| SyncError::EnsureJump { table: jump.table, src: jump.src, dst: jump.dst, source })?;
        }
        Ok(())
    }
}
