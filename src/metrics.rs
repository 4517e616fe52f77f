//! Prometheus metrics: the collectors upstream kube-proxy exports in iptables mode, with its
//! exact names, types, label names, help text and histogram buckets, as of the emulated
//! release: from 1.33 the per-sync metrics carry an `ip_family` label (`IPv4`/`IPv6`, upstream
//! PR #129173); up to 1.32 they are unlabelled and both families' proxiers write the same
//! series.
//!
//! One [`Metrics`] value holds every collector, registered once in its own [`Registry`]; the
//! proxier, the change handlers and the health server write to it through typed methods, and the
//! metrics server reads it with [`Metrics::encode_text`]. Nothing here reads a clock (callers
//! pass `now` and measured durations in), and the only I/O is at scrape time, through the
//! [`Nfacct`] trait: from 1.31 the accounting objects' packet counts are exported as counters
//! (upstream's `nfacctMetricCollector`).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus::{
    Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

use crate::compat::Release;
use crate::config::ProxyMode;
use crate::iptables::Table;
use crate::model::IpFamily;
use crate::node::conntrack::cleaner::CleanupRun;
use crate::node::nfacct::{self, Nfacct};
use crate::proxier::nftables::NftSyncReport;
use crate::proxier::{SyncError, SyncReport};

/// Upstream's `kubeProxySubsystem`: every metric name starts with `kubeproxy_`.
pub(crate) const SUBSYSTEM: &str = "kubeproxy";

/// The first release whose per-sync metrics carry `ip_family` (docs/upstream-versions.md row 8).
pub(crate) const IP_FAMILY_LABEL_SINCE: Release = Release::V1_33;

/// The label name upstream uses.
pub(crate) const IP_FAMILY_LABEL: &str = "ip_family";

/// `Content-Type` of the text exposition format.
pub(crate) const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("failed to create metric {name}: {source}")]
    Create { name: &'static str, source: prometheus::Error },
    #[error("failed to register metric {name}: {source}")]
    Register { name: &'static str, source: prometheus::Error },
    #[error("failed to encode metrics: {0}")]
    Encode(prometheus::Error),
}

pub type Result<T, E = MetricsError> = std::result::Result<T, E>;

/// Every kube-proxy collector (upstream `pkg/proxy/metrics`). The per-sync ones are vectors
/// in every release: before 1.33 with no label of their own (their single child is created
/// up front, so they are exported from the start as plain metrics are), from 1.33 with
/// `ip_family` last. Write them through the methods, which supply the family when due.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    /// Whether the per-sync metrics carry `ip_family` (release >= 1.33).
    by_family: bool,
    /// Whether the accounting-object counters exist in this release (1.31 and later).
    nfacct_counters: bool,
    /// `sync_proxy_rules_duration_seconds`: every sync, full or partial.
    pub sync_proxy_rules_duration: HistogramVec,
    pub sync_full_proxy_rules_duration: HistogramVec,
    pub sync_partial_proxy_rules_duration: HistogramVec,
    /// Unix time of the last successful sync.
    pub sync_proxy_rules_last_timestamp: GaugeVec,
    /// Unix time a sync was last asked for.
    pub sync_proxy_rules_last_queued_timestamp: GaugeVec,
    /// From an EndpointSlice's trigger time to its rules being in place.
    pub network_programming_duration: HistogramVec,
    pub endpoint_changes_pending: IntGauge,
    pub endpoint_changes_total: IntCounter,
    pub service_changes_pending: IntGauge,
    pub service_changes_total: IntCounter,
    pub iptables_restore_failures_total: IntCounterVec,
    pub iptables_partial_restore_failures_total: IntCounterVec,
    /// Rules kube-proxy owns, per table (`table` label).
    pub iptables_rules_total: IntGaugeVec,
    /// Rules written by the last sync, per table (`table` label).
    pub iptables_rules_last_sync: IntGaugeVec,
    /// nftables transactions of a sync the kernel refused (registered in nftables mode).
    pub nftables_sync_failures_total: IntCounterVec,
    /// Deletions of stale chains that failed (registered in nftables mode).
    pub nftables_cleanup_failures_total: IntCounterVec,
    /// Services with a Local policy and no local endpoint (`traffic_policy` label:
    /// `internal` / `external`).
    pub no_local_endpoints_total: IntGaugeVec,
    /// Answers of `/healthz`, by status code (`code` label).
    pub proxy_healthz_total: IntCounterVec,
    /// Answers of `/livez`, by status code (`code` label).
    pub proxy_livez_total: IntCounterVec,
    /// The conntrack reconciler's metrics, in the releases that have them (1.33 and later).
    pub conntrack_reconciler: Option<ConntrackReconcilerMetrics>,
}

/// Upstream's `ReconcileConntrackFlowsLatency` and `ReconcileConntrackFlowsDeletedEntriesTotal`
/// (PRs #130200, #130204, release 1.33), both labelled `ip_family` only.
#[derive(Clone)]
pub struct ConntrackReconcilerMetrics {
    /// `conntrack_reconciler_sync_duration_seconds`: one observation per reconciler run that
    /// could list the table.
    pub sync_duration: HistogramVec,
    /// `conntrack_reconciler_deleted_entries_total`.
    pub deleted_entries_total: IntCounterVec,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

/// Help text as component-base renders it for ALPHA metrics.
fn alpha(help: &str) -> String {
    format!("[ALPHA] {help}")
}

/// Go's `prometheus.ExponentialBuckets`.
fn exponential_buckets(start: f64, factor: f64, count: usize) -> Vec<f64> {
    std::iter::successors(Some(start), |b| Some(b * factor)).take(count).collect()
}

/// Go's `prometheus.LinearBuckets`.
fn linear_buckets(start: f64, width: f64, count: usize) -> Vec<f64> {
    std::iter::successors(Some(start), |b| Some(b + width)).take(count).collect()
}

/// Buckets of `sync_*proxy_rules_duration_seconds`: 1ms doubling to ~16s.
pub(crate) fn sync_duration_buckets() -> Vec<f64> {
    exponential_buckets(0.001, 2.0, 15)
}

/// Buckets of `conntrack_reconciler_sync_duration_seconds`: 1ms doubling. The first seven
/// (0.001 … 0.064) are in upstream PR #130200's sample output; the count is not, and is taken
/// as the sync histograms' 15 (docs/upstream-versions.md row 9).
pub(crate) fn conntrack_reconciler_buckets() -> Vec<f64> {
    exponential_buckets(0.001, 2.0, 15)
}

/// Buckets of `network_programming_duration_seconds`. component-base's `MergeBuckets` starts
/// from a zero-filled one-element slice, so the first bucket is `0`.
pub(crate) fn network_programming_buckets() -> Vec<f64> {
    let mut buckets = vec![0.0];
    buckets.extend(linear_buckets(0.25, 0.25, 2));
    buckets.extend(linear_buckets(1.0, 1.0, 59));
    buckets.extend(linear_buckets(60.0, 5.0, 12));
    buckets.extend(linear_buckets(120.0, 30.0, 7));
    buckets
}

struct Builder {
    registry: Registry,
    by_family: bool,
}

impl Builder {
    fn register<C: prometheus::core::Collector + Clone + 'static>(&self, name: &'static str, c: C) -> Result<C> {
        self.registry.register(Box::new(c.clone())).map_err(|source| MetricsError::Register { name, source })?;
        Ok(c)
    }

    fn opts(name: &'static str, help: &str) -> Opts {
        Opts::new(name, alpha(help)).subsystem(SUBSYSTEM)
    }

    /// The label names of a per-sync metric: `labels`, then `ip_family` when due.
    fn sync_labels<'a>(&self, labels: &[&'a str]) -> Vec<&'a str> {
        let mut names = labels.to_vec();
        if self.by_family {
            names.push(IP_FAMILY_LABEL);
        }
        names
    }

    fn histogram(&self, name: &'static str, help: &str, buckets: Vec<f64>) -> Result<HistogramVec> {
        let opts = HistogramOpts::new(name, alpha(help)).subsystem(SUBSYSTEM).buckets(buckets);
        let h =
            HistogramVec::new(opts, &self.sync_labels(&[])).map_err(|source| MetricsError::Create { name, source })?;
        if !self.by_family {
            h.with_label_values(&[] as &[&str]);
        }
        self.register(name, h)
    }

    fn gauge(&self, name: &'static str, help: &str) -> Result<GaugeVec> {
        let g = GaugeVec::new(Self::opts(name, help), &self.sync_labels(&[]))
            .map_err(|source| MetricsError::Create { name, source })?;
        if !self.by_family {
            g.with_label_values(&[] as &[&str]);
        }
        self.register(name, g)
    }

    fn sync_counter(&self, name: &'static str, help: &str) -> Result<IntCounterVec> {
        let c = IntCounterVec::new(Self::opts(name, help), &self.sync_labels(&[]))
            .map_err(|source| MetricsError::Create { name, source })?;
        if !self.by_family {
            c.with_label_values(&[] as &[&str]);
        }
        self.register(name, c)
    }

    fn int_gauge(&self, name: &'static str, help: &str) -> Result<IntGauge> {
        let g = IntGauge::with_opts(Self::opts(name, help)).map_err(|source| MetricsError::Create { name, source })?;
        self.register(name, g)
    }

    fn counter(&self, name: &'static str, help: &str) -> Result<IntCounter> {
        let c =
            IntCounter::with_opts(Self::opts(name, help)).map_err(|source| MetricsError::Create { name, source })?;
        self.register(name, c)
    }

    /// A per-sync gauge with its own `label` (and `ip_family` when due).
    fn sync_gauge_vec(&self, name: &'static str, help: &str, label: &str) -> Result<IntGaugeVec> {
        let g = IntGaugeVec::new(Self::opts(name, help), &self.sync_labels(&[label]))
            .map_err(|source| MetricsError::Create { name, source })?;
        self.register(name, g)
    }

    /// The conntrack reconciler's metrics (labelled `ip_family` in every release that has them).
    fn conntrack_reconciler(&self) -> Result<ConntrackReconcilerMetrics> {
        let name = "conntrack_reconciler_sync_duration_seconds";
        let opts = HistogramOpts::new(name, alpha("ReconcileConntrackFlowsLatency latency in seconds"))
            .subsystem(SUBSYSTEM)
            .buckets(conntrack_reconciler_buckets());
        let sync_duration =
            HistogramVec::new(opts, &[IP_FAMILY_LABEL]).map_err(|source| MetricsError::Create { name, source })?;
        Ok(ConntrackReconcilerMetrics {
            sync_duration: self.register(name, sync_duration)?,
            deleted_entries_total: self.counter_vec(
                "conntrack_reconciler_deleted_entries_total",
                "Cumulative conntrack flows deleted by conntrack reconciler",
                IP_FAMILY_LABEL,
            )?,
        })
    }

    fn counter_vec(&self, name: &'static str, help: &str, label: &str) -> Result<IntCounterVec> {
        let c = IntCounterVec::new(Self::opts(name, help), &[label])
            .map_err(|source| MetricsError::Create { name, source })?;
        self.register(name, c)
    }
}

/// Upstream's accounting counters: metric name (in the subsystem), help, nfacct object.
const NFACCT_COUNTERS: [(&str, &str, &str); 2] = [
    (
        "iptables_ct_state_invalid_dropped_packets_total",
        "packets dropped by iptables to work around conntrack problems",
        nfacct::CT_STATE_INVALID_DROPPED,
    ),
    (
        "iptables_localhost_nodeports_accepted_packets_total",
        "Number of packets accepted on nodeports of loopback interface",
        nfacct::LOCALHOST_NODEPORTS_ACCEPTED,
    ),
];

/// A counter whose value is an accounting object's packet count, read on every scrape.
struct NfacctCollector {
    nfacct: Arc<dyn Nfacct>,
    object: &'static str,
    opts: Opts,
    desc: Vec<prometheus::core::Desc>,
}

impl NfacctCollector {
    fn new(nfacct: Arc<dyn Nfacct>, name: &'static str, help: &str, object: &'static str) -> Result<Self> {
        let opts = Builder::opts(name, help);
        let probe =
            prometheus::Counter::with_opts(opts.clone()).map_err(|source| MetricsError::Create { name, source })?;
        let desc = prometheus::core::Collector::desc(&probe).into_iter().cloned().collect();
        Ok(NfacctCollector { nfacct, object, opts, desc })
    }
}

impl prometheus::core::Collector for NfacctCollector {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        self.desc.iter().collect()
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        let packets = match self.nfacct.packets(self.object) {
            Ok(packets) => packets,
            Err(error) => {
                tracing::error!(%error, counter = self.object, "failed to collect nfacct counter");
                return Vec::new();
            }
        };
        let Ok(counter) = prometheus::Counter::with_opts(self.opts.clone()) else {
            return Vec::new();
        };
        // Packet counts stay far below 2^53, where f64 stops being exact.
        #[allow(clippy::cast_precision_loss)]
        counter.inc_by(packets as f64);
        prometheus::core::Collector::collect(&counter)
    }
}

fn unix_seconds(t: SystemTime) -> f64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_secs_f64(),
        Err(e) => -e.duration().as_secs_f64(),
    }
}

fn gauge_value(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl Metrics {
    /// The collectors of iptables mode in `release` ([`Metrics::for_mode`]).
    pub fn new(release: Release) -> Result<Metrics> {
        Metrics::for_mode(release, ProxyMode::Iptables)
    }

    /// Creates and registers every mode's collectors in a fresh registry, labelled as
    /// `release` labels them.
    fn all_modes(release: Release) -> Result<Metrics> {
        let b = Builder { registry: Registry::new(), by_family: release >= IP_FAMILY_LABEL_SINCE };
        let sync = sync_duration_buckets;
        Ok(Metrics {
            sync_proxy_rules_duration: b.histogram(
                "sync_proxy_rules_duration_seconds",
                "SyncProxyRules latency in seconds",
                sync(),
            )?,
            sync_full_proxy_rules_duration: b.histogram(
                "sync_full_proxy_rules_duration_seconds",
                "SyncProxyRules latency in seconds for full resyncs",
                sync(),
            )?,
            sync_partial_proxy_rules_duration: b.histogram(
                "sync_partial_proxy_rules_duration_seconds",
                "SyncProxyRules latency in seconds for partial resyncs",
                sync(),
            )?,
            sync_proxy_rules_last_timestamp: b.gauge(
                "sync_proxy_rules_last_timestamp_seconds",
                "The last time proxy rules were successfully synced",
            )?,
            sync_proxy_rules_last_queued_timestamp: b.gauge(
                "sync_proxy_rules_last_queued_timestamp_seconds",
                "The last time a sync of proxy rules was queued",
            )?,
            network_programming_duration: b.histogram(
                "network_programming_duration_seconds",
                "In Cluster Network Programming Latency in seconds",
                network_programming_buckets(),
            )?,
            endpoint_changes_pending: b
                .int_gauge("sync_proxy_rules_endpoint_changes_pending", "Pending proxy rules Endpoint changes")?,
            endpoint_changes_total: b
                .counter("sync_proxy_rules_endpoint_changes_total", "Cumulative proxy rules Endpoint changes")?,
            service_changes_pending: b
                .int_gauge("sync_proxy_rules_service_changes_pending", "Pending proxy rules Service changes")?,
            service_changes_total: b
                .counter("sync_proxy_rules_service_changes_total", "Cumulative proxy rules Service changes")?,
            iptables_restore_failures_total: b.sync_counter(
                "sync_proxy_rules_iptables_restore_failures_total",
                "Cumulative proxy iptables restore failures",
            )?,
            iptables_partial_restore_failures_total: b.sync_counter(
                "sync_proxy_rules_iptables_partial_restore_failures_total",
                "Cumulative proxy iptables partial restore failures",
            )?,
            iptables_rules_total: b.sync_gauge_vec(
                "sync_proxy_rules_iptables_total",
                "Total number of iptables rules owned by kube-proxy",
                "table",
            )?,
            iptables_rules_last_sync: b.sync_gauge_vec(
                "sync_proxy_rules_iptables_last",
                "Number of iptables rules written by kube-proxy in last sync",
                "table",
            )?,
            nftables_sync_failures_total: b.sync_counter(
                "sync_proxy_rules_nftables_sync_failures_total",
                "Cumulative proxy nftables sync failures",
            )?,
            nftables_cleanup_failures_total: b.sync_counter(
                "sync_proxy_rules_nftables_cleanup_failures_total",
                "Cumulative proxy nftables cleanup failures",
            )?,
            no_local_endpoints_total: b.sync_gauge_vec(
                "sync_proxy_rules_no_local_endpoints_total",
                "Number of services with a Local traffic policy and no endpoints",
                "traffic_policy",
            )?,
            proxy_healthz_total: b.counter_vec(
                "proxy_healthz_total",
                "Cumulative proxy healthz HTTP status",
                "code",
            )?,
            proxy_livez_total: b.counter_vec("proxy_livez_total", "Cumulative proxy livez HTTP status", "code")?,
            conntrack_reconciler: if release.has_conntrack_reconciler_metrics() {
                Some(b.conntrack_reconciler()?)
            } else {
                None
            },
            by_family: b.by_family,
            nfacct_counters: release.has_nfacct_counters(),
            registry: b.registry,
        })
    }

    /// The collectors of `mode` as `release` registers them: the iptables-only ones in
    /// iptables mode, the nftables-only ones in nftables mode; before 1.34 upstream
    /// registered every mode's metrics whatever the mode (its split came with 1.34's
    /// `RegisterMetrics(mode)`), so nftables mode has the iptables ones too.
    pub fn for_mode(release: Release, mode: ProxyMode) -> Result<Metrics> {
        let metrics = Metrics::all_modes(release)?;
        let unregister = |c: Box<dyn prometheus::core::Collector>| {
            // Registered just above: unregistering cannot fail.
            let _ = metrics.registry.unregister(c);
        };
        match mode {
            ProxyMode::Iptables => {
                unregister(Box::new(metrics.nftables_sync_failures_total.clone()));
                unregister(Box::new(metrics.nftables_cleanup_failures_total.clone()));
            }
            ProxyMode::Nftables if release >= Release::V1_34 => {
                unregister(Box::new(metrics.iptables_restore_failures_total.clone()));
                unregister(Box::new(metrics.iptables_partial_restore_failures_total.clone()));
                unregister(Box::new(metrics.iptables_rules_total.clone()));
                unregister(Box::new(metrics.iptables_rules_last_sync.clone()));
            }
            ProxyMode::Nftables => {}
        }
        Ok(metrics)
    }

    /// Registers the counters read from the accounting objects at scrape time, in the releases
    /// that have them (upstream registers them in iptables mode from 1.31). A counter whose
    /// object cannot be read has no sample, and so is absent from `/metrics`, as upstream's.
    pub fn register_nfacct(&self, nfacct: &Arc<dyn Nfacct>) -> Result<()> {
        if !self.nfacct_counters {
            return Ok(());
        }
        for (name, help, object) in NFACCT_COUNTERS {
            let collector = NfacctCollector::new(nfacct.clone(), name, help, object)?;
            self.registry.register(Box::new(collector)).map_err(|source| MetricsError::Register { name, source })?;
        }
        Ok(())
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Whether the per-sync metrics carry `ip_family`.
    pub fn by_family(&self) -> bool {
        self.by_family
    }

    /// Label values of a per-sync metric: `values`, then the family's when due.
    fn sync_values<'a>(&self, family: IpFamily, values: &[&'a str]) -> Vec<&'a str> {
        let mut all = values.to_vec();
        if self.by_family {
            all.push(family.api_name());
        }
        all
    }

    /// Every metric in the Prometheus text exposition format (what `/metrics` serves).
    pub fn encode_text(&self) -> Result<String> {
        let families = self.registry.gather();
        let mut out = Vec::new();
        TextEncoder::new().encode(&families, &mut out).map_err(MetricsError::Encode)?;
        String::from_utf8(out).map_err(|e| MetricsError::Encode(prometheus::Error::Msg(e.to_string())))
    }

    /// A Service event reached the change tracker; `pending` Services now have unapplied
    /// changes (upstream `ServiceChangeTracker.Update`).
    pub fn service_update_observed(&self, pending: usize) {
        self.service_changes_total.inc();
        self.service_changes_pending.set(gauge_value(pending));
    }

    /// An EndpointSlice event of a supported address type reached the change tracker;
    /// `change_needed` is what the tracker answered (upstream `EndpointSliceUpdate`).
    pub fn endpoint_slice_update_observed(&self, change_needed: bool) {
        self.endpoint_changes_total.inc();
        if change_needed {
            self.endpoint_changes_pending.inc();
        }
    }

    /// A sync of `family` was requested (upstream `Proxier.Sync` and the start of `SyncLoop`).
    pub fn sync_queued(&self, family: IpFamily, now: SystemTime) {
        self.sync_proxy_rules_last_queued_timestamp
            .with_label_values(&self.sync_values(family, &[]))
            .set(unix_seconds(now));
    }

    /// `iptables-restore` of `family` failed outside a sync (cleanup of leftover rules).
    pub fn restore_failed(&self, family: IpFamily) {
        self.iptables_restore_failures_total.with_label_values(&self.sync_values(family, &[])).inc();
    }

    pub fn healthz_answered(&self, code: u16) {
        self.proxy_healthz_total.with_label_values(&[code.to_string().as_str()]).inc();
    }

    pub fn livez_answered(&self, code: u16) {
        self.proxy_livez_total.with_label_values(&[code.to_string().as_str()]).inc();
    }

    /// Records one sync of `family` the way upstream's `syncProxyRules` does: latency always
    /// (full or partial), rule counts whenever rules were rendered, restore failures on
    /// failure, and on success the network programming latency of the applied EndpointSlice
    /// changes, the no-local-endpoint counts and the last-sync timestamp. The change trackers
    /// were drained, so both pending gauges drop to zero. A sync's conntrack cleanup runs
    /// after it, beside later syncs, and is recorded on its own
    /// ([`Metrics::record_conntrack_cleanup`]).
    ///
    /// `elapsed` is how long the sync took; `now` is the wall-clock time it finished, right
    /// after its restore (upstream takes both at the restore's success too, before its
    /// cleanup; only its sync duration includes the cleanup).
    pub fn record_sync(&self, family: IpFamily, report: &SyncReport, elapsed: Duration, now: SystemTime) {
        let fam = self.sync_values(family, &[]);
        self.sync_ran(&fam, report.full, elapsed);

        // A sync that failed while ensuring the jump rules rendered nothing.
        let rendered = !matches!(report.result, Err(SyncError::EnsureChain { .. } | SyncError::EnsureJump { .. }));
        if rendered {
            let stats = &report.stats;
            let nat_written = stats.nat_rules.saturating_sub(stats.deleted_chains);
            self.set_rules(family, Table::Filter, stats.filter_rules_total, stats.filter_rules);
            self.set_rules(family, Table::Nat, stats.nat_rules_total, nat_written);
        }

        match &report.result {
            Ok(()) => self.sync_succeeded(
                family,
                &report.endpoints_update,
                (report.stats.no_local_endpoints_internal, report.stats.no_local_endpoints_external),
                now,
            ),
            Err(err) => {
                if matches!(err, SyncError::Restore { .. }) {
                    self.iptables_restore_failures_total.with_label_values(&fam).inc();
                }
                if !report.full {
                    self.iptables_partial_restore_failures_total.with_label_values(&fam).inc();
                }
            }
        }
    }

    /// Records one nftables sync as upstream's nftables `syncProxyRules` does: latency
    /// (full or partial), failures of the transaction and of the stale-chain cleanup, and on
    /// success the network programming latency, the no-local-endpoint counts and the
    /// last-sync timestamp.
    pub fn record_nftables_sync(&self, family: IpFamily, report: &NftSyncReport, now: SystemTime) {
        let fam = self.sync_values(family, &[]);
        self.sync_ran(&fam, report.full, report.elapsed);
        if report.stale_chain_cleanup_failed {
            self.nftables_cleanup_failures_total.with_label_values(&fam).inc();
        }
        match &report.result {
            Ok(()) => self.sync_succeeded(
                family,
                &report.endpoints_update,
                (report.stats.no_local_endpoints_internal, report.stats.no_local_endpoints_external),
                now,
            ),
            Err(_) => self.nftables_sync_failures_total.with_label_values(&fam).inc(),
        }
    }

    /// What every sync records, in either mode: its duration (all syncs, and full or
    /// partial), and the change trackers drained.
    fn sync_ran(&self, fam: &[&str], full: bool, elapsed: Duration) {
        let seconds = elapsed.as_secs_f64();
        self.sync_proxy_rules_duration.with_label_values(fam).observe(seconds);
        let by_kind = if full { &self.sync_full_proxy_rules_duration } else { &self.sync_partial_proxy_rules_duration };
        by_kind.with_label_values(fam).observe(seconds);
        self.service_changes_pending.set(0);
        self.endpoint_changes_pending.set(0);
    }

    /// What a successful sync records, in either mode: the network programming latency of
    /// the EndpointSlice changes it applied, the Services with a Local policy and no local
    /// endpoint (`(internal, external)`), and the last-sync timestamp.
    fn sync_succeeded(
        &self,
        family: IpFamily,
        update: &crate::tracker::EndpointsUpdateResult,
        (no_local_internal, no_local_external): (usize, usize),
        now: SystemTime,
    ) {
        let fam = self.sync_values(family, &[]);
        let now_secs = unix_seconds(now);
        let programming = self.network_programming_duration.with_label_values(&fam);
        for times in update.last_change_trigger_times.values() {
            for t in times {
                let trigger = t.as_second() as f64 + f64::from(t.subsec_nanosecond()) / 1e9;
                programming.observe(now_secs - trigger);
            }
        }
        for (policy, count) in [("internal", no_local_internal), ("external", no_local_external)] {
            self.no_local_endpoints_total
                .with_label_values(&self.sync_values(family, &[policy]))
                .set(gauge_value(count));
        }
        self.sync_proxy_rules_last_timestamp.with_label_values(&fam).set(now_secs);
    }

    /// Records a finished conntrack cleanup: in the releases with the reconciler's metrics
    /// (1.33+), a reconciliation that could list the table (as upstream, which observes
    /// nothing when the listing fails).
    pub fn record_conntrack_cleanup(&self, run: &CleanupRun) {
        if let (Some(m), Some(reconciled)) = (&self.conntrack_reconciler, run.reconcile()) {
            let labels = [run.family.api_name()];
            m.deleted_entries_total.with_label_values(&labels).inc_by(reconciled.deleted);
            m.sync_duration.with_label_values(&labels).observe(reconciled.elapsed.as_secs_f64());
        }
    }

    fn set_rules(&self, family: IpFamily, table: Table, total: usize, last: usize) {
        let labels = self.sync_values(family, &[table.as_str()]);
        self.iptables_rules_total.with_label_values(&labels).set(gauge_value(total));
        self.iptables_rules_last_sync.with_label_values(&labels).set(gauge_value(last));
    }
}

impl crate::tracker::ChangeObserver for Metrics {
    fn service_change(&self, pending: usize) {
        self.service_update_observed(pending);
    }

    fn endpoint_slice_change(&self, change_needed: bool) {
        self.endpoint_slice_update_observed(change_needed);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::jiff::Timestamp;
    use prometheus::proto::{MetricFamily, MetricType};

    use super::*;
    use crate::iptables::IptablesError;
    use crate::model::NamespacedName;
    use crate::node::conntrack::ReconcileSummary;
    use crate::node::conntrack::cleaner::CleanupOutcome;
    use crate::proxier::RenderStats;
    use crate::tracker::{EndpointsUpdateResult, ServiceUpdateResult};

    #[test]
    fn accounting_counters_are_read_at_scrape_time_from_1_31() {
        let fake = Arc::new(crate::node::nfacct::FakeNfacct::new());
        fake.ensure(nfacct::CT_STATE_INVALID_DROPPED).unwrap();
        fake.count(nfacct::CT_STATE_INVALID_DROPPED, 42);
        let nfacct: Arc<dyn Nfacct> = fake.clone();

        let m = Metrics::new(Release::V1_31).unwrap();
        m.register_nfacct(&nfacct).unwrap();
        let text = m.encode_text().unwrap();
        assert!(
            text.contains(
                "# HELP kubeproxy_iptables_ct_state_invalid_dropped_packets_total [ALPHA] packets dropped by \
                 iptables to work around conntrack problems\n\
                 # TYPE kubeproxy_iptables_ct_state_invalid_dropped_packets_total counter\n\
                 kubeproxy_iptables_ct_state_invalid_dropped_packets_total 42\n"
            ),
            "{text}"
        );
        // The localhost object does not exist: no sample, no family.
        assert!(!text.contains("localhost_nodeports"), "{text}");

        // Read again on the next scrape.
        fake.ensure(nfacct::LOCALHOST_NODEPORTS_ACCEPTED).unwrap();
        fake.count(nfacct::LOCALHOST_NODEPORTS_ACCEPTED, 7);
        fake.count(nfacct::CT_STATE_INVALID_DROPPED, 1);
        let text = m.encode_text().unwrap();
        assert!(text.contains("kubeproxy_iptables_ct_state_invalid_dropped_packets_total 43\n"), "{text}");
        assert!(
            text.contains(
                "# HELP kubeproxy_iptables_localhost_nodeports_accepted_packets_total [ALPHA] Number of packets \
                 accepted on nodeports of loopback interface\n"
            ) && text.contains("kubeproxy_iptables_localhost_nodeports_accepted_packets_total 7\n"),
            "{text}"
        );

        // Not in 1.30.
        let old = Metrics::new(Release::V1_30).unwrap();
        old.register_nfacct(&nfacct).unwrap();
        assert!(!old.encode_text().unwrap().contains("iptables_ct_state"));
    }

    /// The conntrack reconciler's metrics, added in 1.33 (docs/upstream-versions.md row 9;
    /// names, type, label and help from the metrics reference page and PRs #130200, #130204).
    const RECONCILER_FROM_1_33: &[(&str, MetricType, &[&str], &str)] = &[
        (
            "kubeproxy_conntrack_reconciler_sync_duration_seconds",
            MetricType::HISTOGRAM,
            &["ip_family"],
            "ReconcileConntrackFlowsLatency latency in seconds",
        ),
        (
            "kubeproxy_conntrack_reconciler_deleted_entries_total",
            MetricType::COUNTER,
            &["ip_family"],
            "Cumulative conntrack flows deleted by conntrack reconciler",
        ),
    ];

    /// Upstream 1.29 `pkg/proxy/metrics`: name, type, label names, help (without the
    /// `[ALPHA] ` prefix component-base adds). Later releases: see [`upstream_labels`].
    const UPSTREAM: &[(&str, MetricType, &[&str], &str)] = &[
        (
            "kubeproxy_sync_proxy_rules_duration_seconds",
            MetricType::HISTOGRAM,
            &[],
            "SyncProxyRules latency in seconds",
        ),
        (
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            MetricType::HISTOGRAM,
            &[],
            "SyncProxyRules latency in seconds for full resyncs",
        ),
        (
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            MetricType::HISTOGRAM,
            &[],
            "SyncProxyRules latency in seconds for partial resyncs",
        ),
        (
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            MetricType::GAUGE,
            &[],
            "The last time proxy rules were successfully synced",
        ),
        (
            "kubeproxy_network_programming_duration_seconds",
            MetricType::HISTOGRAM,
            &[],
            "In Cluster Network Programming Latency in seconds",
        ),
        (
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            MetricType::GAUGE,
            &[],
            "Pending proxy rules Endpoint changes",
        ),
        (
            "kubeproxy_sync_proxy_rules_endpoint_changes_total",
            MetricType::COUNTER,
            &[],
            "Cumulative proxy rules Endpoint changes",
        ),
        (
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            MetricType::GAUGE,
            &[],
            "Pending proxy rules Service changes",
        ),
        (
            "kubeproxy_sync_proxy_rules_service_changes_total",
            MetricType::COUNTER,
            &[],
            "Cumulative proxy rules Service changes",
        ),
        (
            "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
            MetricType::COUNTER,
            &[],
            "Cumulative proxy iptables restore failures",
        ),
        (
            "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total",
            MetricType::COUNTER,
            &[],
            "Cumulative proxy iptables partial restore failures",
        ),
        (
            "kubeproxy_sync_proxy_rules_iptables_total",
            MetricType::GAUGE,
            &["table"],
            "Total number of iptables rules owned by kube-proxy",
        ),
        (
            "kubeproxy_sync_proxy_rules_iptables_last",
            MetricType::GAUGE,
            &["table"],
            "Number of iptables rules written by kube-proxy in last sync",
        ),
        ("kubeproxy_proxy_healthz_total", MetricType::COUNTER, &["code"], "Cumulative proxy healthz HTTP status"),
        ("kubeproxy_proxy_livez_total", MetricType::COUNTER, &["code"], "Cumulative proxy livez HTTP status"),
        (
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            MetricType::GAUGE,
            &[],
            "The last time a sync of proxy rules was queued",
        ),
        (
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            MetricType::GAUGE,
            &["traffic_policy"],
            "Number of services with a Local traffic policy and no endpoints",
        ),
    ];

    fn report(full: bool, result: std::result::Result<(), SyncError>) -> SyncReport {
        SyncReport {
            full,
            payload: None,
            stats: RenderStats {
                filter_rules: 7,
                filter_rules_total: 7,
                nat_rules: 42,
                nat_rules_total: 100,
                deleted_chains: 2,
                no_local_endpoints_internal: 1,
                no_local_endpoints_external: 3,
                ..RenderStats::default()
            },
            service_update: ServiceUpdateResult::default(),
            endpoints_update: EndpointsUpdateResult::default(),
            result,
            elapsed: Duration::ZERO,
            retry_after: None,
            service_health: None,
            conntrack_cleanup: None,
        }
    }

    fn restore_error() -> SyncError {
        SyncError::Restore {
            source: IptablesError::RestoreLine {
                command: "iptables-restore".into(),
                line: 3,
                output: "bad".into(),
                context: String::new(),
            },
            context: String::new(),
        }
    }

    fn families(m: &Metrics) -> BTreeMap<String, MetricFamily> {
        m.registry().gather().into_iter().map(|f| (f.name().to_string(), f)).collect()
    }

    fn gauge(m: &Metrics, name: &str, label: Option<&str>) -> f64 {
        let fams = families(m);
        let fam = fams.get(name).unwrap_or_else(|| panic!("{name} not exported"));
        let metric = fam
            .get_metric()
            .iter()
            .find(|mt| label.is_none_or(|l| mt.get_label().iter().any(|p| p.value() == l)))
            .unwrap_or_else(|| panic!("{name}{{{label:?}}} not exported"));
        match fam.get_field_type() {
            MetricType::GAUGE => metric.get_gauge().get_value(),
            MetricType::COUNTER => metric.get_counter().get_value(),
            MetricType::HISTOGRAM => metric.get_histogram().get_sample_count() as f64,
            other => panic!("unexpected type {other:?}"),
        }
    }

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    /// The metrics of [`UPSTREAM`] that gain `ip_family` from 1.33 (upstream PR #129173,
    /// docs/upstream-versions.md row 8).
    const IP_FAMILY_FROM_1_33: &[&str] = &[
        "kubeproxy_sync_proxy_rules_duration_seconds",
        "kubeproxy_sync_full_proxy_rules_duration_seconds",
        "kubeproxy_sync_partial_proxy_rules_duration_seconds",
        "kubeproxy_network_programming_duration_seconds",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
        "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
        "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total",
        "kubeproxy_sync_proxy_rules_iptables_total",
        "kubeproxy_sync_proxy_rules_iptables_last",
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
    ];

    /// Upstream's label names of `name` in `release`, sorted as the exposition writes them.
    fn upstream_labels(release: Release, name: &str, labels_1_29: &[&'static str]) -> Vec<&'static str> {
        let mut labels = labels_1_29.to_vec();
        if release >= Release::V1_33 && IP_FAMILY_FROM_1_33.contains(&name) {
            labels.push("ip_family");
        }
        labels.sort_unstable();
        labels
    }

    /// Writes every collector once (vectors are exported only once they have a child): a
    /// queued sync, a successful full sync with an EndpointSlice trigger time, a failed
    /// partial one, a restore failure outside a sync and one answer of each probe.
    fn exercise(m: &Metrics, family: IpFamily) {
        m.service_update_observed(2);
        m.endpoint_slice_update_observed(true);
        m.sync_queued(family, UNIX_EPOCH + Duration::from_millis(1_500));
        let mut ok = report(true, Ok(()));
        let trigger = Timestamp::new(990, 500_000_000).unwrap();
        ok.endpoints_update.last_change_trigger_times.insert(NamespacedName::new("ns", "svc"), vec![trigger]);
        m.record_sync(family, &ok, Duration::from_millis(20), at(1_000));
        let reconciled = ReconcileSummary { listed: true, entries: 9, stale: 4, deleted: 4, ..Default::default() };
        m.record_conntrack_cleanup(&CleanupRun {
            family,
            elapsed: Duration::from_millis(3),
            outcome: CleanupOutcome::Reconciled(reconciled),
        });
        // A run whose listing failed is not observed.
        m.record_conntrack_cleanup(&CleanupRun {
            family,
            elapsed: Duration::from_millis(3),
            outcome: CleanupOutcome::Reconciled(ReconcileSummary::default()),
        });
        m.record_sync(family, &report(false, Err(restore_error())), Duration::from_millis(5), at(2_000));
        m.healthz_answered(200);
        m.livez_answered(503);
        m.restore_failed(family);
    }

    #[test]
    fn names_types_labels_and_help_match_upstream() {
        for release in Release::all() {
            let m = Metrics::new(release).unwrap();
            exercise(&m, IpFamily::V4);
            let fams = families(&m);
            let added: &[_] = if release >= Release::V1_33 { RECONCILER_FROM_1_33 } else { &[] };
            let expected: BTreeMap<&str, _> =
                UPSTREAM.iter().chain(added).map(|(n, t, l, h)| (*n, (*t, *l, *h))).collect();
            let got: Vec<&str> = fams.keys().map(String::as_str).collect();
            assert_eq!(
                got,
                expected.keys().copied().collect::<Vec<_>>(),
                "metric names differ from upstream {release}"
            );
            for (name, (ty, labels, help)) in expected {
                let fam = &fams[name];
                assert_eq!(fam.get_field_type(), ty, "{release} {name}: type");
                assert_eq!(fam.help(), format!("[ALPHA] {help}"), "{release} {name}: help");
                assert!(!fam.get_metric().is_empty(), "{release} {name}: no series");
                for metric in fam.get_metric() {
                    let names: Vec<&str> = metric.get_label().iter().map(|l| l.name()).collect();
                    assert_eq!(names, upstream_labels(release, name, labels), "{release} {name}: label names");
                }
            }
        }
    }

    /// Before 1.33 the exposition is byte for byte what it was when only 1.29 existed
    /// (`src/testdata/metrics-1.29.txt` was written by that code): fresh, then after
    /// [`exercise`].
    #[test]
    fn exposition_before_1_33_is_unchanged() {
        let fixture = include_str!("testdata/metrics-1.29.txt");
        for release in [Release::V1_29, Release::V1_32] {
            let m = Metrics::new(release).unwrap();
            let mut text = m.encode_text().unwrap();
            text.push_str("---\n");
            exercise(&m, IpFamily::V4);
            text.push_str(&m.encode_text().unwrap());
            assert_eq!(text, fixture, "{release}");
        }
        // Both families write the same series.
        let m = Metrics::new(Release::V1_29).unwrap();
        exercise(&m, IpFamily::V6);
        assert_eq!(m.encode_text().unwrap(), fixture.split("---\n").nth(1).unwrap());
    }

    #[test]
    fn exposition_from_1_33_has_ip_family() {
        let m = Metrics::new(Release::V1_35).unwrap();
        assert!(m.by_family());
        // Per-sync vectors export nothing until a family wrote them, as upstream's.
        let fresh = m.encode_text().unwrap();
        assert!(!fresh.contains("kubeproxy_sync_proxy_rules_duration_seconds"), "{fresh}");
        assert!(fresh.contains("kubeproxy_sync_proxy_rules_endpoint_changes_total 0\n"), "{fresh}");

        exercise(&m, IpFamily::V4);
        m.record_sync(IpFamily::V6, &report(true, Ok(())), Duration::from_millis(1), at(3_000));
        let text = m.encode_text().unwrap();
        for line in [
            r#"kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family="IPv4"} 2"#,
            r#"kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family="IPv6"} 1"#,
            r#"kubeproxy_sync_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="0.001"} 0"#,
            r#"kubeproxy_sync_full_proxy_rules_duration_seconds_count{ip_family="IPv6"} 1"#,
            r#"kubeproxy_sync_partial_proxy_rules_duration_seconds_sum{ip_family="IPv4"} 0.005"#,
            r#"kubeproxy_network_programming_duration_seconds_sum{ip_family="IPv4"} 9.5"#,
            r#"kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family="IPv4"} 1000"#,
            r#"kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family="IPv6"} 3000"#,
            r#"kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds{ip_family="IPv4"} 1.5"#,
            r#"kubeproxy_sync_proxy_rules_iptables_restore_failures_total{ip_family="IPv4"} 2"#,
            r#"kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total{ip_family="IPv4"} 1"#,
            r#"kubeproxy_sync_proxy_rules_iptables_total{ip_family="IPv4",table="nat"} 100"#,
            r#"kubeproxy_sync_proxy_rules_iptables_last{ip_family="IPv6",table="nat"} 40"#,
            r#"kubeproxy_sync_proxy_rules_iptables_last{ip_family="IPv4",table="filter"} 7"#,
            r#"kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family="IPv6",traffic_policy="external"} 3"#,
            "kubeproxy_sync_proxy_rules_service_changes_total 1",
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending 0",
            r#"kubeproxy_proxy_healthz_total{code="200"} 1"#,
            r#"kubeproxy_proxy_livez_total{code="503"} 1"#,
            r#"kubeproxy_conntrack_reconciler_sync_duration_seconds_bucket{ip_family="IPv4",le="0.002"} 0"#,
            r#"kubeproxy_conntrack_reconciler_sync_duration_seconds_bucket{ip_family="IPv4",le="0.004"} 1"#,
            r#"kubeproxy_conntrack_reconciler_sync_duration_seconds_bucket{ip_family="IPv4",le="16.384"} 1"#,
            r#"kubeproxy_conntrack_reconciler_sync_duration_seconds_count{ip_family="IPv4"} 1"#,
            r#"kubeproxy_conntrack_reconciler_deleted_entries_total{ip_family="IPv4"} 4"#,
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line}\n{text}");
        }
        // IPv6 never queued nor failed: no series of its own there.
        assert!(!text.contains(r#"last_queued_timestamp_seconds{ip_family="IPv6"}"#), "{text}");
        assert!(!text.contains(r#"restore_failures_total{ip_family="IPv6"}"#), "{text}");
    }

    #[test]
    fn histogram_buckets_match_upstream() {
        let sync = sync_duration_buckets();
        assert_eq!(sync.len(), 15);
        assert_eq!(sync[0], 0.001);
        assert_eq!(sync[14], 16.384);
        let net = network_programming_buckets();
        assert_eq!(net.len(), 1 + 2 + 59 + 12 + 7);
        assert_eq!(&net[..5], &[0.0, 0.25, 0.5, 1.0, 2.0]);
        assert_eq!(net[61], 59.0);
        assert_eq!(&net[62..64], &[60.0, 65.0]);
        assert_eq!(net[73], 115.0);
        assert_eq!(&net[74..], &[120.0, 150.0, 180.0, 210.0, 240.0, 270.0, 300.0]);
        assert!(net.windows(2).all(|w| w[0] < w[1]));

        let m = Metrics::new(Release::V1_29).unwrap();
        let text = m.encode_text().unwrap();
        assert!(text.contains("kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.001\"} 0"), "{text}");
        assert!(text.contains("kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"16.384\"} 0"), "{text}");
        assert!(text.contains("kubeproxy_network_programming_duration_seconds_bucket{le=\"0\"} 0"), "{text}");
        assert!(text.contains("# TYPE kubeproxy_sync_proxy_rules_endpoint_changes_total counter"), "{text}");
    }

    #[test]
    fn successful_full_sync() {
        let m = Metrics::new(Release::V1_29).unwrap();
        m.service_update_observed(2);
        m.endpoint_slice_update_observed(true);
        m.endpoint_slice_update_observed(false);
        assert_eq!(gauge(&m, "kubeproxy_sync_proxy_rules_service_changes_pending", None), 2.0);
        assert_eq!(gauge(&m, "kubeproxy_sync_proxy_rules_endpoint_changes_pending", None), 1.0);
        assert_eq!(gauge(&m, "kubeproxy_sync_proxy_rules_endpoint_changes_total", None), 2.0);

        let mut r = report(true, Ok(()));
        let trigger = Timestamp::new(990, 500_000_000).unwrap();
        r.endpoints_update.last_change_trigger_times.insert(NamespacedName::new("ns", "svc"), vec![trigger]);
        m.record_sync(IpFamily::V4, &r, Duration::from_millis(20), at(1_000));

        assert_eq!(gauge(&m, "kubeproxy_sync_proxy_rules_duration_seconds", None), 1.0);
        assert_eq!(gauge(&m, "kubeproxy_sync_full_proxy_rules_duration_seconds", None), 1.0);
        assert_eq!(gauge(&m, "kubeproxy_sync_partial_proxy_rules_duration_seconds", None), 0.0);
        assert_eq!(gauge(&m, "kubeproxy_sync_proxy_rules_service_changes_pending", None), 0.0);
        assert_eq!(gauge(&m, "kubeproxy_sync_proxy_rules_endpoint_changes_pending", None), 0.0);
        assert_eq!(gauge(&m, "kubeproxy_sync_proxy_rules_iptables_total", Some("filter")), 7.0);
        assert_eq!(gauge(&m, "kubeproxy_sync_proxy_rules_iptables_last", Some("filter")), 7.0);
        assert_eq!(gauge(&m, "kubeproxy_sync_proxy_rules_iptables_total", Some("nat")), 100.0);
        // The `-X` lines of deleted chains are not rules.
        assert_eq!(gauge(&m, "kubeproxy_sync_proxy_rules_iptables_last", Some("nat")), 40.0);
        assert_eq!(gauge(&m, "kubeproxy_sync_proxy_rules_no_local_endpoints_total", Some("internal")), 1.0);
        assert_eq!(gauge(&m, "kubeproxy_sync_proxy_rules_no_local_endpoints_total", Some("external")), 3.0);
        assert_eq!(gauge(&m, "kubeproxy_sync_proxy_rules_last_timestamp_seconds", None), 1000.0);
        let np = &families(&m)["kubeproxy_network_programming_duration_seconds"];
        let h = np.get_metric()[0].get_histogram();
        assert_eq!((h.get_sample_count(), h.get_sample_sum()), (1, 9.5));
        assert_eq!(gauge(&m, "kubeproxy_sync_proxy_rules_iptables_restore_failures_total", None), 0.0);
    }

    #[test]
    fn failed_partial_sync() {
        let m = Metrics::new(Release::V1_29).unwrap();
        m.record_sync(IpFamily::V4, &report(false, Err(restore_error())), Duration::from_millis(5), at(2_000));
        assert_eq!(gauge(&m, "kubeproxy_sync_partial_proxy_rules_duration_seconds", None), 1.0);
        assert_eq!(gauge(&m, "kubeproxy_sync_proxy_rules_iptables_restore_failures_total", None), 1.0);
        assert_eq!(gauge(&m, "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total", None), 1.0);
        // Rule counts are set before restoring, as upstream does; success-only metrics are not.
        assert_eq!(gauge(&m, "kubeproxy_sync_proxy_rules_iptables_total", Some("nat")), 100.0);
        assert_eq!(gauge(&m, "kubeproxy_sync_proxy_rules_last_timestamp_seconds", None), 0.0);
        assert!(!families(&m).contains_key("kubeproxy_sync_proxy_rules_no_local_endpoints_total"));
    }

    #[test]
    fn failure_before_rendering_sets_no_rule_counts() {
        let m = Metrics::new(Release::V1_29).unwrap();
        let err = SyncError::EnsureChain {
            table: Table::Filter,
            chain: "KUBE-SERVICES",
            source: IptablesError::Lock("busy".into()),
        };
        m.record_sync(IpFamily::V4, &report(true, Err(err)), Duration::from_millis(1), at(3_000));
        assert_eq!(gauge(&m, "kubeproxy_sync_full_proxy_rules_duration_seconds", None), 1.0);
        assert_eq!(gauge(&m, "kubeproxy_sync_proxy_rules_iptables_restore_failures_total", None), 0.0);
        assert_eq!(gauge(&m, "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total", None), 0.0);
        assert!(!families(&m).contains_key("kubeproxy_sync_proxy_rules_iptables_total"));
    }

    #[test]
    fn queued_timestamp_and_probe_counters() {
        let m = Metrics::new(Release::V1_29).unwrap();
        m.sync_queued(IpFamily::V4, UNIX_EPOCH + Duration::from_millis(1_500));
        assert_eq!(gauge(&m, "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds", None), 1.5);
        m.healthz_answered(200);
        m.healthz_answered(200);
        m.healthz_answered(503);
        assert_eq!(gauge(&m, "kubeproxy_proxy_healthz_total", Some("200")), 2.0);
        assert_eq!(gauge(&m, "kubeproxy_proxy_healthz_total", Some("503")), 1.0);
        m.restore_failed(IpFamily::V4);
        assert_eq!(gauge(&m, "kubeproxy_sync_proxy_rules_iptables_restore_failures_total", None), 1.0);
    }
}
