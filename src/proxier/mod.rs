//! The proxier: owns the service and endpoint maps, drains the change trackers into them,
//! renders the rules and hands them to iptables (upstream's iptables `Proxier`).
//!
//! Event handlers only record changes ([`Proxier::on_service_update`] and friends); the
//! runner decides when to call [`Proxier::sync`]. Nothing is applied until Services and
//! EndpointSlices have both been listed once.

pub mod chains;
pub mod local_detect;
pub mod nodeport_addresses;
pub mod render;

use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;

use crate::conntrack::{Conntrack, clean_stale_entries};
use crate::iptables::{self, FlushFlag, Iptables, RestoreCounters, RulePosition, Table};
use crate::model::NamespacedName;
use crate::tracker::{
    EndpointChangeTracker, EndpointsMap, EndpointsUpdateResult, ServiceChangeTracker, ServicePortMap,
    ServiceUpdateResult,
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
pub const KUBELET_JUMP_CHAINS: &[JumpChain] = &[
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
    /// The restore input (also on failure, for diagnostics).
    pub payload: String,
    pub stats: RenderStats,
    pub service_update: ServiceUpdateResult,
    pub endpoints_update: EndpointsUpdateResult,
    /// `Err` when the sync failed; the next sync will be full and should come after
    /// `retry_after`.
    pub result: Result<(), SyncError>,
    pub retry_after: Option<Duration>,
    /// How long the sync took (for the latency metrics).
    pub elapsed: Duration,
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
    service_changes: ServiceChangeTracker,
    endpoint_changes: EndpointChangeTracker,
    services: ServicePortMap,
    endpoints: EndpointsMap,
    node_labels: Option<BTreeMap<String, String>>,
    services_synced: bool,
    endpoint_slices_synced: bool,
    needs_full_sync: bool,
    render_state: render::RenderState,
    last_cleanup: Option<Instant>,
    /// Clears stale UDP/SCTP conntrack entries after successful syncs; `None` in `render`.
    conntrack: Option<Arc<dyn Conntrack>>,
    /// Told about every recorded change (the change metrics); `None` in `render`.
    observer: Option<Arc<dyn ChangeObserver>>,
}

/// Observes the change trackers the way upstream's change metrics do.
pub trait ChangeObserver: Send + Sync {
    /// A Service event was recorded; `pending` Services now have unapplied changes.
    fn service_change(&self, pending: usize);
    /// An EndpointSlice event of this proxier's address type was recorded; `change_needed`
    /// says whether it changed anything.
    fn endpoint_slice_change(&self, change_needed: bool);
}

impl Proxier {
    pub fn new(cfg: ProxierConfig, iptables: Arc<dyn Iptables>, interfaces: Arc<dyn NetworkInterfaces>) -> Self {
        let family = cfg.render.family;
        Proxier {
            service_changes: ServiceChangeTracker::new(family),
            endpoint_changes: EndpointChangeTracker::new(cfg.hostname.clone(), family),
            cfg,
            iptables,
            interfaces,
            services: ServicePortMap::default(),
            endpoints: EndpointsMap::default(),
            node_labels: None,
            services_synced: false,
            endpoint_slices_synced: false,
            needs_full_sync: true,
            render_state: render::RenderState::default(),
            last_cleanup: None,
            conntrack: None,
            observer: None,
        }
    }

    /// Clears stale conntrack entries through `conntrack` after every successful sync, as
    /// upstream does at the end of `syncProxyRules`.
    pub fn with_conntrack(mut self, conntrack: Arc<dyn Conntrack>) -> Self {
        self.conntrack = Some(conntrack);
        self
    }

    pub fn with_change_observer(mut self, observer: Arc<dyn ChangeObserver>) -> Self {
        self.observer = Some(observer);
        self
    }

    fn observe_service_change(&self) {
        if let Some(o) = &self.observer {
            o.service_change(self.service_changes.pending());
        }
    }

    pub fn config(&self) -> &ProxierConfig {
        &self.cfg
    }

    /// Records a Service add (`previous` None), update or delete (`current` None). Returns
    /// whether a sync is wanted.
    pub fn on_service_update(&mut self, previous: Option<&Service>, current: Option<&Service>) -> bool {
        let changed = self.service_changes.update(previous, current);
        self.observe_service_change();
        changed && self.is_initialized()
    }

    /// Records the current state of a Service seen by a watch (`current` None: deleted),
    /// without needing the previous object. Returns whether a sync is wanted.
    pub fn on_service_state(&mut self, service: NamespacedName, current: Option<&Service>) -> bool {
        let services = &self.services;
        let applied = || {
            services.iter().filter(|(name, _)| name.service == service).map(|(k, v)| (k.clone(), v.clone())).collect()
        };
        let changed = self.service_changes.update_from_applied(service.clone(), applied, current);
        self.observe_service_change();
        changed && self.is_initialized()
    }

    /// Records an EndpointSlice add/update, or its deletion. Returns whether a sync is wanted.
    pub fn on_endpoint_slice_update(&mut self, slice: &EndpointSlice, removed: bool) -> bool {
        let changed = self.endpoint_changes.endpoint_slice_update(slice, removed);
        if let Some(o) = &self.observer
            && slice.address_type == self.cfg.render.family.slice_address_type()
        {
            o.endpoint_slice_change(changed);
        }
        changed && self.is_initialized()
    }

    pub fn on_services_synced(&mut self) {
        self.services_synced = true;
    }

    pub fn on_endpoint_slices_synced(&mut self) {
        self.endpoint_slices_synced = true;
    }

    /// Records this node's labels; a change forces the next sync to be full (topology may
    /// move endpoints in or out of every service). Returns whether a sync is wanted.
    pub fn on_node_update(&mut self, node: Option<&Node>) -> bool {
        let labels = node.map(|n| n.metadata.labels.clone().unwrap_or_default());
        if let Some(n) = node
            && n.metadata.name.as_deref() != Some(self.cfg.hostname.as_str())
        {
            tracing::error!(
                event_node = n.metadata.name.as_deref().unwrap_or(""),
                current_node = %self.cfg.hostname,
                "received a watch event for a node that doesn't match the current node"
            );
            return false;
        }
        if labels == self.node_labels {
            return false;
        }
        self.node_labels = labels;
        self.needs_full_sync = true;
        true
    }

    /// Forces the next sync to be full (the canary saw our rules flushed).
    pub fn force_full_sync(&mut self) {
        self.needs_full_sync = true;
    }

    pub fn is_initialized(&self) -> bool {
        self.services_synced && self.endpoint_slices_synced
    }

    /// Services with changes not yet applied (what a partial sync would rewrite).
    pub fn pending_changes(&self) -> HashSet<NamespacedName> {
        let mut set = self.service_changes.pending_changes();
        set.extend(self.endpoint_changes.pending_changes());
        set
    }

    pub fn services(&self) -> &ServicePortMap {
        &self.services
    }

    /// Why this proxier rejected the current state of `service`, if it did.
    pub fn invalid_service(&self, service: &NamespacedName) -> Option<&crate::model::InvalidService> {
        self.service_changes.invalid(service)
    }

    pub fn endpoints(&self) -> &EndpointsMap {
        &self.endpoints
    }

    /// Applies pending changes and writes the rules. `now` drives the large-cluster cleanup
    /// cadence.
    pub fn sync(&mut self, now: Instant) -> SyncOutcome {
        if !self.is_initialized() {
            tracing::debug!("not syncing iptables until Services and EndpointSlices have been received");
            return SyncOutcome::NotInitialized;
        }
        let try_partial = !self.needs_full_sync;
        let started = Instant::now();
        let service_update = self.services.update(&mut self.service_changes);
        let endpoints_update = self.endpoints.update(&mut self.endpoint_changes);

        let mut report = SyncReport {
            full: !try_partial,
            payload: String::new(),
            stats: RenderStats::default(),
            service_update,
            endpoints_update,
            result: Ok(()),
            retry_after: None,
            elapsed: Duration::ZERO,
        };

        if !try_partial {
            if let Err(e) = self.ensure_jump_chains() {
                report.elapsed = started.elapsed();
                return SyncOutcome::Synced(Box::new(self.failed(report, e)));
            }
            self.render_state.reset();
        }

        let changed: Option<HashSet<NamespacedName>> = try_partial.then(|| {
            let mut set: HashSet<NamespacedName> = report.service_update.updated_services.clone();
            set.extend(report.endpoints_update.updated_services.iter().cloned());
            set
        });

        let large =
            render::total_endpoints(&self.services, &self.endpoints) > render::LARGE_CLUSTER_ENDPOINTS_THRESHOLD;
        let cleanup_due =
            !large || self.last_cleanup.is_none_or(|t| now.saturating_duration_since(t) > self.cfg.sync_period);
        let existing = if cleanup_due {
            let mut buf = Vec::new();
            match self.iptables.save_into(Table::Nat, &mut buf) {
                Ok(()) => {
                    self.last_cleanup = Some(now);
                    Some(iptables::save::chains_from_table(&buf))
                }
                Err(e) => {
                    tracing::error!(error = %e, "failed to execute iptables-save: stale chains will not be deleted");
                    None
                }
            }
        } else {
            None
        };

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
            existing_nat_chains: existing.as_ref(),
        };
        let mut rendered = render::render(&self.cfg.render, &input, &self.render_state);
        tracing::debug!(
            services = rendered.stats.services,
            endpoints = rendered.stats.endpoints,
            filter_rules = rendered.stats.filter_rules,
            nat_rules = rendered.stats.nat_rules,
            nat_chains = rendered.stats.nat_chains,
            bytes = rendered.payload.len(),
            full = rendered.full,
            "reloading service iptables data"
        );
        report.stats = rendered.stats.clone();

        match self.iptables.restore_all(rendered.payload.as_bytes(), FlushFlag::NoFlush, RestoreCounters::Counters) {
            Ok(()) => {
                self.render_state.commit(&mut rendered);
                self.needs_full_sync = false;
                report.payload = rendered.payload;
                if let Some(ct) = &self.conntrack {
                    clean_stale_entries(
                        ct.as_ref(),
                        self.cfg.render.family,
                        &self.services,
                        &report.service_update,
                        &report.endpoints_update,
                    );
                }
                report.elapsed = started.elapsed();
                SyncOutcome::Synced(Box::new(report))
            }
            Err(e) => {
                let context = e
                    .restore_line()
                    .map(|line| {
                        format!("\n{}", iptables::save::format_line_context(rendered.payload.as_bytes(), line, 3))
                    })
                    .unwrap_or_default();
                report.payload = rendered.payload;
                let err = SyncError::Restore { source: e, context };
                report.elapsed = started.elapsed();
                SyncOutcome::Synced(Box::new(self.failed(report, err)))
            }
        }
    }

    fn failed(&mut self, mut report: SyncReport, err: SyncError) -> SyncReport {
        tracing::error!(error = %err, retry_after = ?self.cfg.sync_period, "sync failed");
        // The trackers were drained: only a full sync can restore a known state.
        self.needs_full_sync = true;
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
