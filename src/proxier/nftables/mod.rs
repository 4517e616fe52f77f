//! The nftables proxier (upstream's `pkg/proxy/nftables`): one IP family's `kube-proxy` table,
//! written as upstream's proxier of the emulated release (1.31 to 1.37) writes it, through as
//! few operations as the kernel needs.
//!
//! * [`names`]: upstream's chain and set names (`service-ULMVA6XW-ns1/svc1/tcp/p80`, …).
//! * [`render`]: pure. The table's fixed objects ([`render::base_table`]) and what each
//!   service port contributes ([`render::fragment`]: its chains and rules, affinity sets and
//!   elements in the shared sets and maps), with each release's rule text.
//! * [`plan`]: what the kernel holds and what it should hold in, one [`Transaction`] out. A
//!   partial sync knows what the kernel holds from memory (it renders the changed service
//!   ports' old fragments again from the inputs it kept, and counts who claims each element),
//!   so steady-state syncs never list the table and send only what changed; a full sync lists
//!   the table and writes only what differs, which adopts a table written by upstream's
//!   kube-proxy and repairs changes made from outside.
//! * [`NftablesProxier`]: the sync orchestration, as [`crate::proxier::Proxier`] does it for
//!   iptables: the same change recorder, full or partial per release, stale chains deleted a
//!   sync after they went out of use (more than a second later), a sync with nothing to write
//!   checking that the table still exists (full when it was deleted from outside), the same
//!   report for metrics, health, health-check node ports and conntrack cleanup (a
//!   [`CleanupJob`] the caller hands to the family's cleaner: no conntrack work in the sync).
//!
//! The resulting table equals, object for object, what upstream's proxier leaves for the same
//! state and release (checked against upstream's own unit-test fixtures in
//! tests/nftables_rules.rs), so a node switches between the two in either direction. Where
//! this differs from upstream on purpose it is recorded in docs/upstream-versions.md
//! ("nftables mode"): element comments are cut to 128 bytes in every release (nft refuses
//! longer ones, so upstream before 1.37 fails every sync), `iifname` is written for the
//! interface-based local-traffic detectors in every release (upstream before 1.34.x wrote
//! `iif`, which nft rejects for a wildcard), an affinity set whose timeout changed is
//! re-created (upstream's `add` leaves the old timeout), and when two Services claim one
//! element key with different values the smallest value wins (upstream: the last in Go's
//! map order). A sync with nothing to write checks that the table still exists and syncs in
//! full when it was deleted from outside (upstream's notices only when a later change's
//! transaction fails, or, from 1.34, at its hourly full sync).

pub mod names;
pub mod plan;
pub mod render;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;

use crate::compat::FULL_SYNC_PERIOD;
use crate::model::{Cidr, IpFamily, NamespacedName};
use crate::nftables::{Chain, Family, NftError, Nftables, Operation, Transaction};
use crate::node::conntrack::cleaner::{CleanupJob, RuleWrites};
use crate::proxier::{NetworkInterfaces, ServiceHealthState};
use crate::tracker::{
    ChangeObserver, ChangeRecorder, EndpointsMap, EndpointsUpdateResult, LocalReadyEndpoints, ServicePortMap,
    ServiceUpdateResult,
};

pub use plan::{PlanStats, StaleChains};
pub use render::NftRenderConfig;

/// Settings of one nftables proxier (one IP family).
#[derive(Debug, Clone)]
pub struct NftProxierConfig {
    pub render: NftRenderConfig,
    /// This node's name: endpoints on it are local.
    pub hostname: String,
    /// How long to wait before retrying after a failed sync.
    pub sync_period: Duration,
}

/// Why a sync failed.
#[derive(Debug, thiserror::Error)]
pub enum NftSyncError {
    /// The kernel refused the sync's transaction: nothing of it was applied
    /// (`sync_proxy_rules_nftables_sync_failures_total`).
    #[error("nftables sync failed: {source}")]
    Transaction { source: NftError },
}

/// What one call to [`NftablesProxier::sync`] did.
#[derive(Debug)]
pub enum NftSyncOutcome {
    /// Services or EndpointSlices have not been listed yet; nothing was touched.
    NotInitialized,
    Synced(Box<NftSyncReport>),
}

/// Counts of one sync, for metrics and logs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NftSyncStats {
    /// Service ports in the map, and their endpoints.
    pub services: usize,
    pub endpoints: usize,
    /// Services whose internal (resp. external) traffic policy is Local with no local
    /// endpoint (`sync_proxy_rules_no_local_endpoints_total`).
    pub no_local_endpoints_internal: usize,
    pub no_local_endpoints_external: usize,
    /// Operations in the sync's transaction (0: nothing was sent).
    pub operations: usize,
    /// Whether the full sync read the table from the kernel (false: it could not, and wrote
    /// everything blind).
    pub listed: bool,
    /// Stale chains deleted (in their own transaction, before the sync's).
    pub stale_chains_deleted: usize,
    pub plan: PlanStats,
}

/// The report of one sync: what the daemon needs for metrics, health, the service
/// health-check servers and conntrack cleanup (the fields mean what they mean in
/// [`crate::proxier::SyncReport`]).
#[derive(Debug)]
pub struct NftSyncReport {
    pub full: bool,
    /// The main transaction as `nft -f` text, when recording ([`NftablesProxier::with_transaction_recording`]).
    pub transaction: Option<String>,
    pub stats: NftSyncStats,
    pub service_update: ServiceUpdateResult,
    pub endpoints_update: EndpointsUpdateResult,
    /// `Err` when the sync failed; the next sync will be full and should come after
    /// `retry_after`.
    pub result: Result<(), NftSyncError>,
    pub retry_after: Option<Duration>,
    pub elapsed: Duration,
    /// Deleting stale chains failed (`sync_proxy_rules_nftables_cleanup_failures_total`).
    pub stale_chain_cleanup_failed: bool,
    /// What the service health-check servers need after this sync (set when it succeeded).
    pub service_health: Option<ServiceHealthState>,
    /// The conntrack cleanup this sync leaves (set when it succeeded and there is one), as
    /// [`crate::proxier::SyncReport::conntrack_cleanup`]: the sync never runs it; its caller
    /// hands it to the family's cleaner (`node::conntrack::cleaner`).
    pub conntrack_cleanup: Option<CleanupJob>,
}

/// Stores the ServiceCIDRs for a proxier without locking it ([`NftablesProxier::service_cidr_sink`]).
pub type ServiceCidrSink = Arc<dyn Fn(&[String]) + Send + Sync>;

/// Keeps the CIDRs of `family` (upstream: `netutils.IsIPv4CIDRString`, the rest IPv6),
/// sorted and without repeats.
fn store_service_cidrs(store: &Mutex<Vec<String>>, family: IpFamily, cidrs: &[String]) {
    let mut mine: Vec<String> = cidrs
        .iter()
        .filter(|c| {
            let v4 = Cidr::parse_sloppy(c).is_some_and(|p| p.family() == IpFamily::V4);
            v4 == (family == IpFamily::V4)
        })
        .cloned()
        .collect();
    mine.sort();
    mine.dedup();
    *store.lock().unwrap_or_else(PoisonError::into_inner) = mine;
}

/// One IP family's nftables proxier.
pub struct NftablesProxier {
    cfg: NftProxierConfig,
    nft: Arc<dyn Nftables>,
    interfaces: Arc<dyn NetworkInterfaces>,
    changes: Arc<ChangeRecorder>,
    /// The ServiceCIDRs of this family, sorted (set from the watch at any time; used by full
    /// syncs only, as upstream).
    service_cidrs: Arc<Mutex<Vec<String>>>,
    services: ServicePortMap,
    endpoints: EndpointsMap,
    node_labels: Option<BTreeMap<String, String>>,
    needs_full_sync: bool,
    /// What the kernel holds for the service ports (valid while `needs_full_sync` is false).
    committed: plan::Committed,
    stale_chains: StaleChains,
    /// Local ready endpoints per Service, for the health-check servers (kept up to date per
    /// changed Service).
    local_ready: LocalReadyEndpoints,
    last_full_sync: Option<Instant>,
    /// Counts the syncs that began writing rules; the conntrack cleaner reads it to tell
    /// whether the rules changed while it listed the table.
    rule_writes: Arc<RuleWrites>,
    record_transactions: bool,
    /// Full syncs larger than this go out in several transactions.
    chunk_operations: usize,
}

impl NftablesProxier {
    pub fn new(cfg: NftProxierConfig, nft: Arc<dyn Nftables>, interfaces: Arc<dyn NetworkInterfaces>) -> Self {
        NftablesProxier::with_recorder(cfg, nft, interfaces, None)
    }

    /// A proxier whose recorder reports every recorded change to `observer` (the change
    /// metrics).
    pub fn with_recorder(
        cfg: NftProxierConfig,
        nft: Arc<dyn Nftables>,
        interfaces: Arc<dyn NetworkInterfaces>,
        observer: Option<Arc<dyn ChangeObserver>>,
    ) -> Self {
        let render = &cfg.render;
        let changes = Arc::new(ChangeRecorder::new(render.family, render.features, cfg.hostname.clone(), observer));
        NftablesProxier {
            cfg,
            nft,
            interfaces,
            changes,
            service_cidrs: Arc::default(),
            services: ServicePortMap::default(),
            endpoints: EndpointsMap::default(),
            node_labels: None,
            needs_full_sync: true,
            committed: plan::Committed::default(),
            stale_chains: StaleChains::new(),
            local_ready: LocalReadyEndpoints::new(),
            last_full_sync: None,
            rule_writes: RuleWrites::new(),
            record_transactions: false,
            chunk_operations: plan::CHUNK_OPERATIONS,
        }
    }

    /// Keeps each sync's transaction, as text, in its report (`render` and tests).
    pub fn with_transaction_recording(mut self) -> Self {
        self.record_transactions = true;
        self
    }

    /// Sends full syncs larger than `operations` in several transactions, each ending where
    /// the table is consistent (default [`plan::CHUNK_OPERATIONS`]; partial syncs are always
    /// one transaction).
    pub fn with_chunk_operations(mut self, operations: usize) -> Self {
        self.chunk_operations = operations.max(1);
        self
    }

    /// The count of rule writes this proxier has begun, for its conntrack cleaner
    /// ([`crate::proxier::Proxier::rule_writes`]): a successful sync's report carries the
    /// cleanup it leaves, tagged with the number of its write.
    pub fn rule_writes(&self) -> Arc<RuleWrites> {
        self.rule_writes.clone()
    }

    pub fn config(&self) -> &NftProxierConfig {
        &self.cfg
    }

    /// The recorder event handlers feed; recording through it never waits for a sync.
    pub fn recorder(&self) -> Arc<ChangeRecorder> {
        self.changes.clone()
    }

    pub fn family(&self) -> IpFamily {
        self.cfg.render.family
    }

    pub fn services(&self) -> &ServicePortMap {
        &self.services
    }

    pub fn endpoints(&self) -> &EndpointsMap {
        &self.endpoints
    }

    /// The per-service chains flushed and waiting for deletion.
    pub fn stale_chains(&self) -> &StaleChains {
        &self.stale_chains
    }

    /// Records the current state of a Service (`None`: deleted). Returns whether a sync is
    /// wanted.
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

    /// Records this node's labels (a topology change forces the next sync to be full).
    pub fn on_node_update(&self, node: Option<&Node>) -> bool {
        self.changes.on_node(node)
    }

    /// The CIDRs of every ServiceCIDR object (upstream's `OnServiceCIDRsChanged`): those of
    /// this family are kept, sorted (upstream's order is a Go set's, i.e. random), for the
    /// `Drop traffic to unallocated ClusterIPs` rule, which changes at the next full sync; no
    /// sync is asked for, as upstream. A CIDR that does not parse counts as IPv6, as in
    /// upstream (`netutils.IsIPv4CIDRString`).
    pub fn on_service_cidrs(&self, cidrs: &[String]) {
        store_service_cidrs(&self.service_cidrs, self.cfg.render.family, cidrs);
    }

    /// [`Self::on_service_cidrs`] for the watch, which must not wait for a sync holding the
    /// proxier.
    pub fn service_cidr_sink(&self) -> ServiceCidrSink {
        let store = self.service_cidrs.clone();
        let family = self.cfg.render.family;
        Arc::new(move |cidrs: &[String]| store_service_cidrs(&store, family, cidrs))
    }

    /// Forces the next sync to be full (it lists the table first).
    pub fn force_full_sync(&self) {
        self.changes.resync_from_kernel();
    }

    fn family_nft(&self) -> Family {
        self.cfg.render.family()
    }

    /// Applies pending changes and writes the table. `now` is the sync's time: stale chains
    /// are deleted once unused for more than a second of it, and from 1.34 a sync is full
    /// once the last full sync is an hour old.
    pub fn sync(&mut self, now: Instant) -> NftSyncOutcome {
        let Some(drained) = self.changes.drain() else {
            tracing::debug!("not syncing nftables until Services and EndpointSlices have been received");
            return NftSyncOutcome::NotInitialized;
        };
        let started = Instant::now();
        let release = self.cfg.render.features.release;
        if drained.full_sync || drained.kernel_changed {
            self.needs_full_sync = true;
        }
        if release.nft_has_periodic_full_sync()
            && self.last_full_sync.is_some_and(|t| now.saturating_duration_since(t) > FULL_SYNC_PERIOD)
        {
            tracing::debug!(period = ?FULL_SYNC_PERIOD, "last full sync is older than the full sync period: syncing in full");
            self.needs_full_sync = true;
        }
        self.node_labels = drained.node_labels;
        let service_update = self.services.apply(drained.services);
        let endpoints_update = self.endpoints.apply(drained.endpoints);

        let mut stats = NftSyncStats::default();
        let stale_chain_cleanup_failed = self.delete_stale_chains(now, &mut stats);
        if stale_chain_cleanup_failed && release.nft_has_periodic_full_sync() {
            self.needs_full_sync = true;
        }
        let nothing_changed =
            service_update.updated_services.is_empty() && endpoints_update.updated_services.is_empty();
        if !self.needs_full_sync && nothing_changed && !self.table_exists() {
            tracing::info!(family = %self.family_nft(), "the kube-proxy table is gone (deleted from outside?): syncing in full");
            self.needs_full_sync = true;
        }
        let full = self.needs_full_sync;

        let empty_labels = BTreeMap::new();
        let input = plan::SyncInput {
            services: &self.services,
            endpoints: &self.endpoints,
            node_labels: self.node_labels.as_ref().unwrap_or(&empty_labels),
        };
        let stale_before = self.stale_chains.clone();
        // The rules may change from here on (a large full sync sends pieces while it plans);
        // deleting stale chains above did not change them (nothing used those chains).
        let rules = self.rule_writes.begin();
        // Large full syncs go out in pieces as they are planned (plan::CHUNK_OPERATIONS).
        let nft = self.nft.clone();
        let record = self.record_transactions;
        let chunk_operations = self.chunk_operations;
        let (family, object_comments) = (self.family_nft(), self.nft.object_comments());
        let mut recorded = String::new();
        let mut send = |tx: Transaction| {
            if record {
                recorded.push_str(&tx.text(family, object_comments));
            }
            nft.run(&tx)
        };
        let changed = (!full).then(|| {
            plan::ChangedServices::new(
                service_update.updated_services.iter().chain(endpoints_update.updated_services.iter()).cloned(),
            )
        });
        let planned = match &changed {
            None => {
                let cidrs = self.service_cidrs.lock().unwrap_or_else(PoisonError::into_inner).clone();
                let interface_addrs = self.interface_addrs();
                let base = render::base_table(
                    &self.cfg.render,
                    &render::BaseInput { service_cidrs: &cidrs, interface_addrs: &interface_addrs },
                );
                let planned = match self.nft.list_table() {
                    Ok(listed) => {
                        stats.listed = true;
                        plan::plan_full(
                            &self.cfg.render,
                            base,
                            listed,
                            &mut self.stale_chains,
                            &input,
                            now,
                            Some(plan::Chunks { sink: &mut send, operations: chunk_operations }),
                        )
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "failed to list the nftables table: writing every object");
                        plan::plan_blind(
                            &self.cfg.render,
                            base,
                            &input,
                            Some(plan::Chunks { sink: &mut send, operations: chunk_operations }),
                        )
                    }
                };
                planned.map(|(plan, committed)| {
                    self.committed = committed;
                    plan
                })
            }
            Some(changed) => Ok(plan::plan_partial(
                &self.cfg.render,
                &mut self.committed,
                &mut self.stale_chains,
                &input,
                changed,
                now,
            )),
        };
        let planned = match planned {
            Ok(plan) => plan,
            Err(source) => {
                // A piece of a large full sync failed: the rest was not sent.
                let report = NftSyncReport {
                    full,
                    transaction: record.then_some(recorded),
                    stats,
                    service_update,
                    endpoints_update,
                    result: Ok(()),
                    retry_after: None,
                    elapsed: Duration::ZERO,
                    stale_chain_cleanup_failed,
                    service_health: None,
                    conntrack_cleanup: None,
                };
                return NftSyncOutcome::Synced(Box::new(self.failed(report, source, stale_before, started)));
            }
        };
        let totals = self.committed.totals;
        stats.services = self.services.len();
        stats.endpoints = totals.endpoints;
        stats.no_local_endpoints_internal = totals.no_local_endpoints_internal;
        stats.no_local_endpoints_external = totals.no_local_endpoints_external;
        stats.operations = planned.tx.len() + planned.stats.operations_sent_before;
        stats.plan = planned.stats;
        tracing::debug!(
            full,
            services = stats.services,
            endpoints = stats.endpoints,
            services_computed = stats.plan.services_computed,
            operations = stats.operations,
            "reloading service nftables data"
        );
        let transaction = record.then(|| {
            recorded.push_str(&planned.tx.text(family, object_comments));
            recorded
        });

        let mut report = NftSyncReport {
            full,
            transaction,
            stats,
            service_update,
            endpoints_update,
            result: Ok(()),
            retry_after: None,
            elapsed: Duration::ZERO,
            stale_chain_cleanup_failed,
            service_health: None,
            conntrack_cleanup: None,
        };
        let applied = if planned.tx.is_empty() { Ok(()) } else { self.nft.run(&planned.tx) };
        match applied {
            Ok(()) => {
                self.needs_full_sync = false;
                if full {
                    self.last_full_sync = Some(now);
                }
                self.refresh_local_ready(changed.as_ref());
                report.service_health = Some(ServiceHealthState {
                    ports: self.services.health_check_node_ports(),
                    local_endpoints: self.local_ready.clone(),
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
                tracing::debug!(full, elapsed_ms = report.elapsed.as_millis() as u64, "sync complete");
            }
            Err(source) => {
                return NftSyncOutcome::Synced(Box::new(self.failed(report, source, stale_before, started)));
            }
        }
        NftSyncOutcome::Synced(Box::new(report))
    }

    /// Records a failed sync: nothing of the failing transaction was applied (pieces of a
    /// large full sync sent before it were), the trackers were drained, so only a full sync
    /// (which lists the table) can restore a known state; the chains it would have flushed
    /// were not.
    fn failed(
        &mut self,
        mut report: NftSyncReport,
        source: NftError,
        stale_before: StaleChains,
        started: Instant,
    ) -> NftSyncReport {
        tracing::error!(error = %source, retry_after = ?self.cfg.sync_period, "nftables sync failed");
        self.needs_full_sync = true;
        self.committed = plan::Committed::default();
        self.stale_chains = stale_before;
        report.result = Err(NftSyncError::Transaction { source });
        report.retry_after = Some(self.cfg.sync_period);
        report.elapsed = started.elapsed();
        report
    }

    /// Brings the local ready endpoint counts up to date: all of them after a full sync, those
    /// of the `changed` Services after a partial one (as [`EndpointsMap`]'s
    /// `local_ready_endpoints` counts them, without walking every endpoint of the cluster).
    fn refresh_local_ready(&mut self, changed: Option<&plan::ChangedServices>) {
        let Some(changed) = changed else {
            self.local_ready = self.endpoints.local_ready_endpoints();
            return;
        };
        self.local_ready.retain(|service, _| !changed.contains(service));
        let mut ips: BTreeMap<&NamespacedName, std::collections::BTreeSet<&str>> = BTreeMap::new();
        for (name, endpoints) in self.endpoints.iter() {
            if !changed.contains(&name.service) {
                continue;
            }
            for ep in endpoints.iter().filter(|ep| ep.ready && ep.is_local) {
                ips.entry(&name.service).or_default().insert(ep.ip());
            }
        }
        for (service, set) in ips {
            self.local_ready.insert(service.clone(), set.len());
        }
    }

    /// Deletes, in a transaction of their own, the stale chains unused for more than a second
    /// (upstream does this first in every sync). Returns whether that failed; the chains are
    /// then kept for a later try.
    fn delete_stale_chains(&mut self, now: Instant, stats: &mut NftSyncStats) -> bool {
        let due = plan::due_stale_chains(&self.stale_chains, now);
        if due.is_empty() {
            return false;
        }
        tracing::info!(chains = due.len(), "deleting stale nftables chains");
        let tx = Transaction { ops: due.iter().map(|name| Operation::DeleteChain(name.clone())).collect() };
        match self.nft.run(&tx) {
            Ok(()) => {
                for name in &due {
                    self.stale_chains.remove(name);
                }
                stats.stale_chains_deleted = due.len();
                false
            }
            Err(e) => {
                tracing::error!(error = %e, "unable to delete stale chains; will retry later");
                true
            }
        }
    }

    /// Whether the table still exists, asked of the kernel by `nft --check` of an `add chain`
    /// of the `services` chain (refused with "No such file or directory" without the table;
    /// nothing is applied either way, and nothing is listed). A partial sync with nothing to
    /// write would not notice a table deleted from outside (upstream's does not: it waits for
    /// a change whose transaction fails, or from 1.34 for its hourly full sync); with this, the
    /// next periodic sync rebuilds it. Any other error counts as present: the sync goes on as
    /// it would have.
    fn table_exists(&self) -> bool {
        let probe = Transaction { ops: vec![Operation::AddChain(Chain::regular(render::SERVICES))] };
        match self.nft.check(&probe) {
            Ok(()) => true,
            Err(e) if e.is_not_found() => false,
            Err(e) => {
                tracing::warn!(error = %e, "could not check that the kube-proxy table exists");
                true
            }
        }
    }

    fn interface_addrs(&self) -> Vec<IpAddr> {
        if self.cfg.render.node_port_addresses.match_all() {
            return Vec::new();
        }
        self.interfaces.interface_addrs().unwrap_or_else(|e| {
            tracing::error!(error = %e, "failed to get node IP addresses matching nodePortAddresses; services with node ports may not work as intended");
            Vec::new()
        })
    }
}

/// The node of the benchmarks (examples/nft_scale.rs) and of this module's unit tests:
/// IPv4, node 192.168.0.2 (also the only node-port address), pods in 10.0.0.0/8, the
/// default mark and sync period.
#[cfg(any(test, feature = "testing"))]
pub fn bench_node_config(release: crate::compat::Release, hostname: &str) -> NftProxierConfig {
    use crate::compat::Features;
    use crate::proxier::local_detect::LocalDetector;
    use crate::proxier::nodeport_addresses::NodePortAddresses;

    let render = NftRenderConfig {
        family: IpFamily::V4,
        masquerade_all: false,
        masquerade_mark: "0x00004000".into(),
        local_detector: LocalDetector::Cidr(Cidr::parse_sloppy("10.0.0.0/8").expect("cidr")),
        node_ip: Some("192.168.0.2".parse().expect("ip")),
        node_port_addresses: NodePortAddresses::new(IpFamily::V4, &["192.168.0.2/32".into()]),
        features: Features::of(release),
    };
    NftProxierConfig { render, hostname: hostname.into(), sync_period: Duration::from_secs(30) }
}

/// A proxier on a fake kernel for this module's unit tests ([`bench_node_config`],
/// `hostname` synthetic::NODE_NAME).
#[cfg(test)]
pub(crate) fn test_proxier(release: crate::compat::Release, nft: Arc<dyn Nftables>) -> NftablesProxier {
    use crate::proxier::StaticInterfaces;

    let cfg = bench_node_config(release, crate::synthetic::NODE_NAME);
    NftablesProxier::new(cfg, nft, Arc::new(StaticInterfaces(vec!["192.168.0.2".parse().expect("ip")])))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compat::Release;
    use crate::nftables::fake::FakeNftables;
    use crate::tracker::testing::{slice, svc};

    fn proxier(nft: Arc<FakeNftables>) -> NftablesProxier {
        test_proxier(Release::V1_37, nft)
    }

    fn synced(p: &mut NftablesProxier, now: Instant) -> NftSyncReport {
        match p.sync(now) {
            NftSyncOutcome::Synced(report) => {
                assert!(report.result.is_ok(), "{:?}", report.result);
                *report
            }
            NftSyncOutcome::NotInitialized => panic!("not initialized"),
        }
    }

    #[test]
    fn a_sync_with_nothing_to_write_rebuilds_a_table_deleted_from_outside() {
        let nft = Arc::new(FakeNftables::new(Family::Ip));
        let mut p = proxier(nft.clone());
        let web = svc("ns1", "web").cluster_ip("172.30.0.41").tcp("http", 80).build();
        p.on_service_state(NamespacedName::of_object(&web.metadata), Some(&web));
        p.on_endpoint_slice_update(&slice("ns1", "web", "web-1").tcp("http", 8080).ips(&["10.1.0.1"]).build(), false);
        p.on_services_synced();
        p.on_endpoint_slices_synced();
        let now = Instant::now();
        assert!(synced(&mut p, now).full);
        let written = nft.list_table().unwrap().expect("table written");

        // Nothing changed and the table is there: a partial sync that writes nothing and
        // lists nothing.
        let (runs, lists) = (nft.run_count(), nft.list_count());
        let idle = synced(&mut p, now + Duration::from_secs(30));
        assert!(!idle.full);
        assert_eq!((nft.run_count(), nft.list_count()), (runs, lists), "an idle sync only checks");

        // Deleted from outside: the next sync, with nothing changed, is full and rebuilds it.
        nft.run(&Transaction { ops: vec![Operation::DeleteTable] }).unwrap();
        assert_eq!(nft.list_table().unwrap(), None);
        let rebuilt = synced(&mut p, now + Duration::from_secs(60));
        assert!(rebuilt.full, "a deleted table makes the sync full");
        assert_eq!(nft.list_table().unwrap(), Some(written));
        assert!(!synced(&mut p, now + Duration::from_secs(90)).full, "and the next one partial again");
    }

    #[test]
    fn a_failed_table_check_leaves_the_sync_partial() {
        let nft = Arc::new(FakeNftables::new(Family::Ip));
        let mut p = proxier(nft.clone());
        p.on_services_synced();
        p.on_endpoint_slices_synced();
        let now = Instant::now();
        assert!(synced(&mut p, now).full);
        nft.fail_next_checks(1);
        assert!(!synced(&mut p, now + Duration::from_secs(30)).full, "an error other than not-found changes nothing");
    }
}
