//! Kubernetes Events (events.k8s.io/v1), as upstream's `k8s.io/client-go/tools/events`
//! broadcaster posts them for kube-proxy: reporting controller `kube-proxy`, reporting
//! instance `kube-proxy-<hostname>`, one Event object per first occurrence named
//! `<object name>.<hex nanoseconds>`, and repeats folded into that object's `series`.
//!
//! Callers hold an [`EventRecorder`]: [`EventRecorder::record`] never blocks and never fails.
//! [`KubeEventRecorder`] queues records on a bounded channel (full: dropped and counted) for
//! a background task that creates and patches the Events; API errors are logged, transient
//! ones retried a bounded number of times, none is ever fatal. [`FakeEventRecorder`] keeps
//! the calls for tests. [`Aggregator`] is the pure part (what to create, what to patch, when
//! a series ends) and [`InvalidObjectReporter`] decides when an object skipped as invalid
//! deserves a Warning (once per problem and object generation, not on every sync).
//!
//! Nothing here decides anything about rules; the renderer never sees events.
//!
//! Why not kube's `kube::runtime::events::Recorder` (kube-runtime 5.0.0, as locked; issue
//! 15): it writes the same events.k8s.io/v1 shape (`reportingController`,
//! `reportingInstance`, `action`, `reason`, `note`, `<object>.<hex nanoseconds>` names, a
//! six-minute cache), but its `publish` is one awaited API write per call and it lacks what
//! upstream's broadcaster does and this module keeps:
//! - Repeats: every repeat is a PATCH at once (count + 1, `lastObservedTime` now), where
//!   upstream patches the second occurrence and folds later ones into periodic series
//!   updates ([`Aggregator::flush`]); an event storm becomes a write storm.
//! - The patch is the whole Event as a JSON merge patch, not a patch of `series` alone;
//!   when the Event has expired on the server (404) the write fails, where upstream (and
//!   [`EventOp::Patch`] here) creates it again, series included.
//! - No retries of transient failures (upstream: 12 tries about 10 s apart), no write
//!   timeout, no bounded queue: callers would have to await the API server, and
//!   [`EventRecorder::record`] must never block.
//! - No limits: `note` (1 kB), `reason`/`action`/`reportingInstance` (128 characters) and the
//!   name (253 bytes) go out uncut, so the API server rejects the event; two events in one
//!   nanosecond get the same name; the cache is unbounded.
//! - Times come from `Timestamp::now()` inside `publish`, so the series logic cannot be
//!   tested with a fake clock, and `eventTime` carries nanoseconds the API then drops.
//!
//! Both key repeats as upstream's `getKey` does (type, action, reason, regarding; the
//! reporting controller and instance are fixed here): the note is not part of it, so a
//! repeat with another note counts in the first Event's series, which keeps its note.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
#[cfg(any(test, feature = "testing"))]
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams, PostParams};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::model::NamespacedName;

/// `reportingController` of every Event (upstream `NewRecorder(scheme, "kube-proxy")`).
pub const REPORTING_CONTROLLER: &str = "kube-proxy";

/// The start-up event on the Node (upstream `birthCry`).
pub const REASON_STARTING: &str = "Starting";
/// Action of the Node events raised while starting (upstream's `StartKubeProxy`).
pub const ACTION_START: &str = "StartKubeProxy";
/// A Service's health-check node port could not be opened (action [`ACTION_LISTEN`]).
pub const REASON_FAILED_SERVICE_HEALTHCHECK: &str = "FailedToStartServiceHealthcheck";
pub const ACTION_LISTEN: &str = "Listen";
/// The proxier healthz server could not bind (on the Node, action [`ACTION_START`]).
pub const REASON_FAILED_PROXIER_HEALTHCHECK: &str = "FailedToStartProxierHealthcheck";
/// The metrics server could not bind (on the Node, action [`ACTION_START`]).
pub const REASON_FAILED_METRIC_SERVER: &str = "FailedToStartMetricServer";
/// A Service this proxy skips because it is invalid (action [`ACTION_SKIP`]).
pub const REASON_INVALID_SERVICE: &str = "InvalidService";
/// An EndpointSlice this proxy skips because it is invalid (action [`ACTION_SKIP`]).
pub const REASON_INVALID_ENDPOINT_SLICE: &str = "InvalidEndpointSlice";
pub const ACTION_SKIP: &str = "Skip";

/// Longest `note` the API accepts (1 kB); longer ones are cut at a character boundary.
const MAX_NOTE_BYTES: usize = 1024;
/// Longest `reportingInstance`, `reason` and `action` the API accepts.
const MAX_FIELD_CHARS: usize = 128;
/// Longest object name (DNS subdomain).
const MAX_NAME_LEN: usize = 253;

/// The `type` of an Event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventType {
    Normal,
    Warning,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Normal => "Normal",
            EventType::Warning => "Warning",
        }
    }
}

impl std::fmt::Display for EventType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One call of [`EventRecorder::record`].
#[derive(Debug, Clone, PartialEq)]
pub struct EventRecord {
    pub regarding: ObjectReference,
    pub type_: EventType,
    pub reason: String,
    pub action: String,
    pub note: String,
}

impl EventRecord {
    pub fn new(regarding: ObjectReference, type_: EventType, reason: &str, action: &str, note: &str) -> Self {
        EventRecord { regarding, type_, reason: reason.to_owned(), action: action.to_owned(), note: note.to_owned() }
    }
}

/// Records Events about API objects. Never blocks and never fails: Events are best-effort.
pub trait EventRecorder: Send + Sync {
    fn record(&self, regarding: ObjectReference, type_: EventType, reason: &str, action: &str, note: &str);
}

/// A recorder that drops everything (tools and tests that do not look at events).
#[derive(Debug, Default)]
pub struct NoopEventRecorder;

impl EventRecorder for NoopEventRecorder {
    fn record(&self, _: ObjectReference, _: EventType, _: &str, _: &str, _: &str) {}
}

/// Keeps every call, for tests.
#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Default)]
pub struct FakeEventRecorder {
    records: Mutex<Vec<EventRecord>>,
}

#[cfg(any(test, feature = "testing"))]
impl FakeEventRecorder {
    pub fn new() -> Self {
        FakeEventRecorder::default()
    }

    /// Every call so far, in order.
    pub fn records(&self) -> Vec<EventRecord> {
        self.records.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// The calls with `reason`.
    pub fn with_reason(&self, reason: &str) -> Vec<EventRecord> {
        self.records().into_iter().filter(|r| r.reason == reason).collect()
    }

    /// Forgets the calls so far.
    pub fn clear(&self) {
        self.records.lock().unwrap_or_else(PoisonError::into_inner).clear();
    }
}

#[cfg(any(test, feature = "testing"))]
impl EventRecorder for FakeEventRecorder {
    fn record(&self, regarding: ObjectReference, type_: EventType, reason: &str, action: &str, note: &str) {
        let record = EventRecord::new(regarding, type_, reason, action, note);
        self.records.lock().unwrap_or_else(PoisonError::into_inner).push(record);
    }
}

/// The reference upstream puts on Node events: cluster-scoped, the node name as UID (the
/// convention `kubectl describe node` searches events by).
pub fn node_ref(node_name: &str) -> ObjectReference {
    ObjectReference {
        kind: Some("Node".into()),
        name: Some(node_name.into()),
        uid: Some(node_name.into()),
        ..Default::default()
    }
}

/// A reference to a Service known only by name (upstream's health-check events).
pub fn service_ref(service: &NamespacedName) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Service".into()),
        namespace: Some(service.namespace.clone()),
        name: Some(service.name.clone()),
        ..Default::default()
    }
}

/// `kube-proxy-<hostname>`, as upstream's `NewRecorder` names this instance (at most 128
/// characters).
pub fn reporting_instance(hostname: &str) -> String {
    truncate_chars(&format!("{REPORTING_CONTROLLER}-{hostname}"), MAX_FIELD_CHARS)
}

fn truncate_chars(s: &str, max: usize) -> String {
    s.chars().take(max).collect()
}

fn truncate_bytes(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Nanoseconds since the Unix epoch of `t` (0 before it).
fn unix_nanos(t: SystemTime) -> i128 {
    t.duration_since(SystemTime::UNIX_EPOCH).map(|d| i128::try_from(d.as_nanos()).unwrap_or(i128::MAX)).unwrap_or(0)
}

/// `t` as the API's microsecond time.
fn micro_time(t: SystemTime) -> MicroTime {
    let since_epoch = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let seconds = i64::try_from(since_epoch.as_secs()).unwrap_or(i64::MAX);
    // The API keeps microseconds; dropping the rest keeps what we send equal to what is stored.
    let micros = since_epoch.subsec_micros();
    let nanos = i32::try_from(micros * 1000).unwrap_or(0);
    MicroTime(Timestamp::new(seconds, nanos).unwrap_or(Timestamp::MAX))
}

/// What makes two records the same event for aggregation, as upstream's `getKey`: the
/// object, type, reason and action — not the note, so a repeat with another note counts in
/// the first one's series and keeps its note.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    regarding: [Option<String>; 6],
    type_: EventType,
    reason: String,
    action: String,
}

impl Key {
    fn of(r: &EventRecord) -> Key {
        let o = &r.regarding;
        Key {
            regarding: [
                o.api_version.clone(),
                o.kind.clone(),
                o.namespace.clone(),
                o.name.clone(),
                o.uid.clone(),
                o.field_path.clone(),
            ],
            type_: r.type_,
            reason: r.reason.clone(),
            action: r.action.clone(),
        }
    }
}

/// One event in the cache: the object as created and how often it was seen.
#[derive(Debug)]
struct Series {
    event: Event,
    count: i32,
    /// The count the API server last heard of.
    flushed: i32,
    last_seen: Instant,
    last_observed: SystemTime,
}

/// A write to the API.
#[derive(Debug, Clone, PartialEq)]
pub enum EventOp {
    /// Create this Event.
    Create(Box<Event>),
    /// Set the `series` of this Event (it carries the series); create it if it is gone.
    Patch(Box<Event>),
}

impl EventOp {
    pub fn event(&self) -> &Event {
        match self {
            EventOp::Create(e) | EventOp::Patch(e) => e,
        }
    }
}

/// The pure part of the recorder (upstream `eventBroadcasterImpl.recordToSink` and
/// `finishSeries`): the first record of an event creates an Event object; repeats within
/// `window` of the previous one only count, and [`Aggregator::flush`] turns the counts into
/// at most one `series` patch per event per call. An event not seen for `window` is
/// forgotten, so a later repeat starts a new Event object.
#[derive(Debug)]
pub struct Aggregator {
    reporting_instance: String,
    window: Duration,
    /// Most events the cache holds; beyond it new events are still created but not
    /// aggregated (bounded memory under an event storm).
    max_cached: usize,
    cache: HashMap<Key, Series>,
    /// Last nanosecond stamp used in a name, so two events in one nanosecond differ.
    last_name_nanos: i128,
}

impl Aggregator {
    pub fn new(reporting_instance: impl Into<String>, window: Duration, max_cached: usize) -> Self {
        Aggregator {
            reporting_instance: reporting_instance.into(),
            window,
            max_cached,
            cache: HashMap::new(),
            last_name_nanos: 0,
        }
    }

    /// Takes one record seen at `now` (`wall`: the same moment on the clock).
    pub fn observe(&mut self, record: &EventRecord, now: Instant, wall: SystemTime) -> Vec<EventOp> {
        let key = Key::of(record);
        let mut ops = Vec::new();
        if let Some(series) = self.cache.get_mut(&key) {
            if now.saturating_duration_since(series.last_seen) <= self.window {
                series.count += 1;
                series.last_seen = now;
                series.last_observed = wall;
                return ops;
            }
            // The series ended without a flush since its last repeat: settle it first.
            if let Some(op) = patch_if_unflushed(series) {
                ops.push(op);
            }
            self.cache.remove(&key);
        }
        let event = self.make_event(record, wall);
        if self.cache.len() < self.max_cached {
            self.cache.insert(
                key,
                Series { event: event.clone(), count: 1, flushed: 1, last_seen: now, last_observed: wall },
            );
        }
        ops.push(EventOp::Create(Box::new(event)));
        ops
    }

    /// The `series` patches owed since the last call, then forgets events whose series
    /// ended (not seen for `window`).
    pub fn flush(&mut self, now: Instant) -> Vec<EventOp> {
        let ops = self.cache.values_mut().filter_map(patch_if_unflushed).collect();
        let window = self.window;
        self.cache.retain(|_, s| now.saturating_duration_since(s.last_seen) <= window);
        ops
    }

    /// Events currently aggregated.
    pub fn cached(&self) -> usize {
        self.cache.len()
    }

    /// The Event upstream's `makeEvent` builds: named `<object>.<hex nanoseconds>` in the
    /// object's namespace (`default` for cluster-scoped objects).
    fn make_event(&mut self, r: &EventRecord, wall: SystemTime) -> Event {
        let nanos = unix_nanos(wall).max(self.last_name_nanos + 1);
        self.last_name_nanos = nanos;
        let suffix = format!(".{nanos:x}");
        let object = r.regarding.name.as_deref().unwrap_or("");
        let object = truncate_bytes(object, MAX_NAME_LEN - suffix.len());
        let namespace = r.regarding.namespace.as_deref().filter(|ns| !ns.is_empty()).unwrap_or("default");
        Event {
            metadata: ObjectMeta {
                name: Some(format!("{object}{suffix}")),
                namespace: Some(namespace.to_owned()),
                ..Default::default()
            },
            event_time: Some(micro_time(wall)),
            reporting_controller: Some(REPORTING_CONTROLLER.to_owned()),
            reporting_instance: Some(self.reporting_instance.clone()),
            action: Some(truncate_chars(&r.action, MAX_FIELD_CHARS)),
            reason: Some(truncate_chars(&r.reason, MAX_FIELD_CHARS)),
            regarding: Some(r.regarding.clone()),
            note: Some(truncate_bytes(&r.note, MAX_NOTE_BYTES).to_owned()),
            type_: Some(r.type_.as_str().to_owned()),
            ..Default::default()
        }
    }
}

fn patch_if_unflushed(series: &mut Series) -> Option<EventOp> {
    if series.count <= series.flushed {
        return None;
    }
    series.flushed = series.count;
    let mut event = series.event.clone();
    event.series = Some(EventSeries { count: series.count, last_observed_time: micro_time(series.last_observed) });
    Some(EventOp::Patch(Box::new(event)))
}

/// Tuning of [`KubeEventRecorder`]. The defaults follow upstream's broadcaster: 1000 queued
/// events, a series ends after 6 minutes without a repeat, 12 tries per write about 10 s
/// apart.
#[derive(Debug, Clone)]
pub struct EventOptions {
    /// Records waiting for the background task; more are dropped (and counted).
    pub queue_capacity: usize,
    /// How often repeats are written out as `series` patches, and failed writes retried.
    pub flush_interval: Duration,
    /// Repeats closer than this to the previous one join its series.
    pub series_window: Duration,
    /// Tries per write before it is given up (transient errors only).
    pub max_attempts: u32,
    /// Events aggregated at most at once.
    pub max_cached: usize,
    /// How long the task keeps writing after shutdown.
    pub shutdown_flush: Duration,
    /// Longest one write may take before it counts as a transient failure (a hung API server
    /// must not hold the queue for the client's minutes-long read timeout).
    pub write_timeout: Duration,
}

impl Default for EventOptions {
    fn default() -> Self {
        EventOptions {
            queue_capacity: 1000,
            flush_interval: Duration::from_secs(10),
            series_window: Duration::from_secs(6 * 60),
            max_attempts: 12,
            max_cached: 4096,
            shutdown_flush: Duration::from_secs(2),
            write_timeout: Duration::from_secs(10),
        }
    }
}

/// Posts events.k8s.io/v1 Events through the API server, from a background task.
pub struct KubeEventRecorder {
    /// To the background task; `try_send` only, so callers never wait.
    tx: mpsc::Sender<EventRecord>,
    dropped: AtomicU64,
}

impl std::fmt::Debug for KubeEventRecorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeEventRecorder").field("dropped", &self.dropped()).finish_non_exhaustive()
    }
}

impl KubeEventRecorder {
    /// Starts the background task on the current runtime; it runs until `shutdown`, then
    /// writes what it still holds for at most `options.shutdown_flush`.
    pub fn start(
        client: kube::Client,
        reporting_instance: String,
        options: EventOptions,
        shutdown: CancellationToken,
    ) -> (Arc<KubeEventRecorder>, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::channel(options.queue_capacity.max(1));
        let worker = Worker {
            client,
            aggregator: Aggregator::new(reporting_instance, options.series_window, options.max_cached),
            retries: VecDeque::new(),
            options,
        };
        let task = tokio::spawn(worker.run(rx, shutdown));
        (Arc::new(KubeEventRecorder { tx, dropped: AtomicU64::new(0) }), task)
    }

    /// Records dropped because the queue was full (or the task had stopped).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

impl EventRecorder for KubeEventRecorder {
    fn record(&self, regarding: ObjectReference, type_: EventType, reason: &str, action: &str, note: &str) {
        tracing::debug!(
            kind = regarding.kind.as_deref().unwrap_or(""),
            namespace = regarding.namespace.as_deref().unwrap_or(""),
            name = regarding.name.as_deref().unwrap_or(""),
            %type_,
            reason,
            action,
            note,
            "event occurred"
        );
        let record = EventRecord::new(regarding, type_, reason, action, note);
        if let Err(e) = self.tx.try_send(record) {
            let dropped = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
            match e {
                // Log on 1, 2, 4, 8, … drops so a storm does not become a log storm.
                mpsc::error::TrySendError::Full(_) if dropped.is_power_of_two() => {
                    tracing::warn!(dropped, reason, "event queue full; dropping events")
                }
                mpsc::error::TrySendError::Full(_) => {}
                mpsc::error::TrySendError::Closed(_) => {
                    tracing::debug!(reason, "event recorder stopped; dropping event")
                }
            }
        }
    }
}

/// Why a write failed, and whether trying again can help.
#[derive(Debug, thiserror::Error)]
enum WriteError {
    #[error("failed to write event {name}: {source}")]
    Transient {
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("server rejected event {name}: {source}")]
    Rejected {
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("event {name} already exists: {source}")]
    AlreadyExists {
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("writing event {name} took longer than {timeout:?}")]
    TimedOut { name: String, timeout: Duration },
}

/// A write waiting to be tried again.
#[derive(Debug)]
struct Retry {
    op: EventOp,
    attempts: u32,
}

/// The background task: aggregates records and writes them.
struct Worker {
    client: kube::Client,
    aggregator: Aggregator,
    /// Writes that failed transiently; tried again on the next flush tick.
    retries: VecDeque<Retry>,
    options: EventOptions,
}

impl Worker {
    async fn run(mut self, mut rx: mpsc::Receiver<EventRecord>, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(self.options.flush_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            // The tick goes before records so a steady stream of them cannot starve the
            // series patches and retries; writes in progress give way to shutdown.
            let stopped = tokio::select! {
                biased;
                () = shutdown.cancelled() => true,
                _ = tick.tick() => until_cancelled(&shutdown, self.on_tick()).await,
                record = rx.recv() => match record {
                    Some(record) => until_cancelled(&shutdown, self.on_record(&record)).await,
                    None => true,
                },
            };
            if stopped {
                break;
            }
        }
        // Write what is still queued or owed, briefly: the process is stopping.
        rx.close();
        let limit = self.options.shutdown_flush;
        let flush = async {
            while let Some(record) = rx.recv().await {
                self.on_record(&record).await;
            }
            for op in self.aggregator.flush(Instant::now()) {
                self.write(op, 0, false).await;
            }
        };
        if tokio::time::timeout(limit, flush).await.is_err() {
            tracing::debug!("gave up writing events at shutdown");
        }
    }

    async fn on_record(&mut self, record: &EventRecord) {
        for op in self.aggregator.observe(record, Instant::now(), SystemTime::now()) {
            self.write(op, 0, true).await;
        }
    }

    async fn on_tick(&mut self) {
        // Retries first: a create that failed goes before the patches of its series.
        for Retry { op, attempts } in std::mem::take(&mut self.retries) {
            self.write(op, attempts, true).await;
        }
        for op in self.aggregator.flush(Instant::now()) {
            self.write(op, 0, true).await;
        }
    }

    /// Writes `op` (tried `attempts` times before); a transient failure is queued for
    /// another try when `retry`.
    async fn write(&mut self, op: EventOp, attempts: u32, retry: bool) {
        let Err(err) = self.try_write(&op).await else {
            return;
        };
        let attempts = attempts + 1;
        match err {
            WriteError::Transient { .. } | WriteError::TimedOut { .. }
                if retry && attempts < self.options.max_attempts =>
            {
                tracing::warn!(error = %err, attempts, "failed to write event; will retry");
                if self.retries.len() >= self.options.queue_capacity {
                    // Oldest first out: the newest events say the most about now.
                    self.retries.pop_front();
                }
                self.retries.push_back(Retry { op, attempts });
            }
            WriteError::Transient { .. } | WriteError::TimedOut { .. } => {
                tracing::error!(error = %err, attempts, "failed to write event; giving up")
            }
            WriteError::Rejected { .. } => tracing::error!(error = %err, "event rejected; not retrying"),
            // A retried create after its series already re-created the Event: nothing lost.
            WriteError::AlreadyExists { .. } => tracing::debug!(error = %err, "event already exists"),
        }
    }

    async fn try_write(&self, op: &EventOp) -> Result<(), WriteError> {
        let timeout = self.options.write_timeout;
        match tokio::time::timeout(timeout, self.try_write_once(op)).await {
            Ok(result) => result,
            Err(_) => Err(WriteError::TimedOut { name: op.event().metadata.name.clone().unwrap_or_default(), timeout }),
        }
    }

    async fn try_write_once(&self, op: &EventOp) -> Result<(), WriteError> {
        let event = op.event();
        let name = event.metadata.name.clone().unwrap_or_default();
        let namespace = event.metadata.namespace.as_deref().unwrap_or("default");
        let api: kube::Api<Event> = kube::Api::namespaced(self.client.clone(), namespace);
        let result = match op {
            EventOp::Create(event) => api.create(&PostParams::default(), event).await.map(drop),
            EventOp::Patch(event) => {
                let patch = serde_json::json!({ "series": event.series });
                match api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
                    // The Event expired or was deleted: create it again, series and all.
                    Err(kube::Error::Api(status)) if status.code == 404 => {
                        let mut event = (**event).clone();
                        event.metadata.resource_version = None;
                        api.create(&PostParams::default(), &event).await.map(drop)
                    }
                    other => other.map(drop),
                }
            }
        };
        result.map_err(|source| classify(name, source))
    }
}

/// Runs `work` unless `shutdown` fires first; returns whether it did.
async fn until_cancelled(shutdown: &CancellationToken, work: impl std::future::Future<Output = ()>) -> bool {
    tokio::select! {
        biased;
        () = shutdown.cancelled() => true,
        () = work => false,
    }
}

/// Upstream `recordEvent`: server rejections are final (a conflict or a bad object will not
/// get better); throttling, server errors and transport failures are worth another try.
fn classify(name: String, source: kube::Error) -> WriteError {
    match &source {
        kube::Error::Api(status) if status.code == 409 => WriteError::AlreadyExists { name, source },
        kube::Error::Api(status) if status.code == 429 || status.code >= 500 => WriteError::Transient { name, source },
        kube::Error::Api(_) => WriteError::Rejected { name, source },
        _ => WriteError::Transient { name, source },
    }
}

/// Raises a Warning on objects skipped as invalid: once per distinct problem and object
/// version (the `metadata.generation` when the object has one, else its resourceVersion),
/// so re-lists and syncs do not repeat it. Holds state only for objects that are currently
/// invalid.
pub struct InvalidObjectReporter {
    recorder: Arc<dyn EventRecorder>,
    reason: &'static str,
    reported: HashMap<NamespacedName, Reported>,
}

#[derive(Debug)]
struct Reported {
    version: String,
    notes: Vec<String>,
}

impl std::fmt::Debug for InvalidObjectReporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InvalidObjectReporter")
            .field("reason", &self.reason)
            .field("reported", &self.reported)
            .finish_non_exhaustive()
    }
}

impl InvalidObjectReporter {
    /// Reports with `reason` (e.g. [`REASON_INVALID_SERVICE`]) and action [`ACTION_SKIP`].
    pub fn new(recorder: Arc<dyn EventRecorder>, reason: &'static str) -> Self {
        InvalidObjectReporter { recorder, reason, reported: HashMap::new() }
    }

    /// The object `key` at `version` has `problems` (none: it is valid). The problems not yet
    /// reported for this version become one Warning on `regarding`, notes joined by "; ".
    pub fn observe(&mut self, key: &NamespacedName, version: &str, problems: &[String], regarding: &ObjectReference) {
        if problems.is_empty() {
            self.reported.remove(key);
            return;
        }
        let entry = self
            .reported
            .entry(key.clone())
            .or_insert_with(|| Reported { version: version.to_owned(), notes: Vec::new() });
        if entry.version != version {
            entry.version = version.to_owned();
            entry.notes.clear();
        }
        let new: Vec<&str> = problems.iter().filter(|p| !entry.notes.contains(p)).map(String::as_str).collect();
        if new.is_empty() {
            return;
        }
        // One Warning for all of them: repeats of an object's reason count in its first
        // Event's series whatever their note (upstream's key), so later notes would be lost.
        self.recorder.record(regarding.clone(), EventType::Warning, self.reason, ACTION_SKIP, &new.join("; "));
        entry.notes.extend(new.into_iter().map(str::to_owned));
    }

    /// The object is gone.
    pub fn forget(&mut self, key: &NamespacedName) {
        self.reported.remove(key);
    }

    /// Objects currently known to be invalid.
    pub fn invalid_objects(&self) -> usize {
        self.reported.len()
    }
}

/// The version [`InvalidObjectReporter`] reports once per: the generation when set (it
/// changes only with the spec), else the resourceVersion.
pub fn object_version(meta: &ObjectMeta) -> String {
    match meta.generation {
        Some(g) => format!("g{g}"),
        None => format!("rv{}", meta.resource_version.as_deref().unwrap_or("")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(name: &str, reason: &str, note: &str) -> EventRecord {
        EventRecord {
            regarding: service_ref(&NamespacedName::new("ns1", name)),
            type_: EventType::Warning,
            reason: reason.into(),
            action: ACTION_LISTEN.into(),
            note: note.into(),
        }
    }

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000 + secs)
    }

    fn series_count(op: &EventOp) -> i32 {
        op.event().series.as_ref().map(|s| s.count).unwrap_or(0)
    }

    #[test]
    fn events_are_shaped_like_upstreams() {
        let mut agg = Aggregator::new(reporting_instance("node-a"), Duration::from_secs(360), 100);
        let start = Instant::now();
        let ops = agg.observe(
            &EventRecord {
                regarding: node_ref("node-a"),
                type_: EventType::Normal,
                reason: REASON_STARTING.into(),
                action: ACTION_START.into(),
                note: String::new(),
            },
            start,
            at(0),
        );
        let [EventOp::Create(e)] = ops.as_slice() else { panic!("one create expected: {ops:?}") };
        let nanos = unix_nanos(at(0));
        assert_eq!(e.metadata.name.as_deref(), Some(format!("node-a.{nanos:x}").as_str()));
        // Cluster-scoped objects' events live in "default".
        assert_eq!(e.metadata.namespace.as_deref(), Some("default"));
        assert_eq!(e.reporting_controller.as_deref(), Some("kube-proxy"));
        assert_eq!(e.reporting_instance.as_deref(), Some("kube-proxy-node-a"));
        assert_eq!(e.reason.as_deref(), Some("Starting"));
        assert_eq!(e.action.as_deref(), Some("StartKubeProxy"));
        assert_eq!(e.type_.as_deref(), Some("Normal"));
        assert_eq!(e.note.as_deref(), Some(""));
        assert!(e.series.is_none());
        let regarding = e.regarding.as_ref().expect("regarding");
        assert_eq!(regarding.kind.as_deref(), Some("Node"));
        assert_eq!(regarding.uid.as_deref(), Some("node-a"));
        let json = serde_json::to_value(&**e).expect("json");
        assert_eq!(json["eventTime"], "2023-11-14T22:13:20.000000Z");

        // A namespaced object's event lives in its namespace.
        let ops = agg.observe(&rec("web", "R", "n"), start, at(0));
        assert_eq!(ops[0].event().metadata.namespace.as_deref(), Some("ns1"));
        // Same nanosecond, still a distinct name.
        assert_eq!(ops[0].event().metadata.name.as_deref(), Some(format!("web.{:x}", nanos + 1).as_str()));
    }

    #[test]
    fn repeats_become_one_series_patch_per_flush() {
        let mut agg = Aggregator::new("kube-proxy-n", Duration::from_secs(360), 100);
        let t0 = Instant::now();
        let r = rec("lb", REASON_FAILED_SERVICE_HEALTHCHECK, "port in use");
        assert!(matches!(agg.observe(&r, t0, at(0)).as_slice(), [EventOp::Create(_)]));
        assert!(agg.flush(t0).is_empty(), "nothing repeated yet");
        for i in 1..=4 {
            assert!(agg.observe(&r, t0 + Duration::from_secs(i), at(i)).is_empty(), "repeat {i} only counts");
        }
        // Another note on the same object and reason counts in the same series, as upstream's
        // `getKey` leaves the note out; another reason is another event.
        let other_note = rec("lb", REASON_FAILED_SERVICE_HEALTHCHECK, "other");
        assert!(agg.observe(&other_note, t0 + Duration::from_secs(4), at(4)).is_empty());
        assert_eq!(agg.observe(&rec("lb", "OtherReason", "port in use"), t0, at(0)).len(), 1);

        let ops = agg.flush(t0 + Duration::from_secs(10));
        assert_eq!(ops.len(), 1, "{ops:?}");
        assert!(matches!(ops[0], EventOp::Patch(_)));
        assert_eq!(series_count(&ops[0]), 6);
        assert_eq!(ops[0].event().note.as_deref(), Some("port in use"), "the series keeps the first note");
        let series = ops[0].event().series.as_ref().unwrap();
        assert_eq!(serde_json::to_value(&series.last_observed_time).unwrap(), "2023-11-14T22:13:24.000000Z");
        assert!(agg.flush(t0 + Duration::from_secs(20)).is_empty(), "flushed counts are not patched again");

        assert!(agg.observe(&r, t0 + Duration::from_secs(30), at(30)).is_empty());
        let ops = agg.flush(t0 + Duration::from_secs(40));
        assert_eq!(series_count(&ops[0]), 7);

        // Quiet for longer than the window: the series ends, a repeat is a new Event.
        assert!(agg.flush(t0 + Duration::from_secs(400)).is_empty());
        assert_eq!(agg.cached(), 0);
        let ops = agg.observe(&r, t0 + Duration::from_secs(401), at(401));
        assert!(matches!(ops.as_slice(), [EventOp::Create(_)]));
    }

    #[test]
    fn an_unflushed_series_is_settled_before_a_new_event_starts() {
        let mut agg = Aggregator::new("kube-proxy-n", Duration::from_secs(60), 100);
        let t0 = Instant::now();
        let r = rec("lb", "R", "n");
        agg.observe(&r, t0, at(0));
        agg.observe(&r, t0 + Duration::from_secs(1), at(1));
        let ops = agg.observe(&r, t0 + Duration::from_secs(120), at(120));
        assert_eq!(ops.len(), 2, "{ops:?}");
        assert_eq!(series_count(&ops[0]), 2);
        assert!(matches!(ops[1], EventOp::Create(_)));
    }

    #[test]
    fn the_cache_is_bounded() {
        let mut agg = Aggregator::new("kube-proxy-n", Duration::from_secs(60), 2);
        let t0 = Instant::now();
        for name in ["a", "b", "c"] {
            agg.observe(&rec(name, "R", "n"), t0, at(0));
        }
        assert_eq!(agg.cached(), 2);
        // Not cached: every record is its own Event.
        assert_eq!(agg.observe(&rec("c", "R", "n"), t0, at(0)).len(), 1);
    }

    #[test]
    fn notes_and_fields_are_cut_to_api_limits() {
        let mut agg = Aggregator::new(reporting_instance(&"h".repeat(300)), Duration::from_secs(60), 10);
        let mut r = rec(&"s".repeat(300), &"R".repeat(200), &"é".repeat(1000));
        r.action = "A".repeat(200);
        let ops = agg.observe(&r, Instant::now(), at(0));
        let e = ops[0].event();
        assert_eq!(e.note.as_ref().unwrap().len(), 1024);
        assert_eq!(e.reason.as_ref().unwrap().len(), 128);
        assert_eq!(e.action.as_ref().unwrap().len(), 128);
        assert_eq!(e.reporting_instance.as_ref().unwrap().len(), 128);
        assert!(e.metadata.name.as_ref().unwrap().len() <= 253);
    }

    #[test]
    fn invalid_objects_are_reported_once_per_version_and_problem() {
        let fake = Arc::new(FakeEventRecorder::new());
        let mut reporter = InvalidObjectReporter::new(fake.clone(), REASON_INVALID_SERVICE);
        let key = NamespacedName::new("ns1", "bad");
        let reference = service_ref(&key);
        let problems = vec!["port 0".to_string()];
        reporter.observe(&key, "rv1", &problems, &reference);
        reporter.observe(&key, "rv1", &problems, &reference);
        assert_eq!(fake.records().len(), 1);
        let r = &fake.records()[0];
        assert_eq!(
            (r.type_, r.reason.as_str(), r.action.as_str(), r.note.as_str()),
            (EventType::Warning, "InvalidService", "Skip", "port 0")
        );

        // A second problem in the same version (the other family) is reported once.
        let two = vec!["port 0".to_string(), "cluster IP".to_string()];
        reporter.observe(&key, "rv1", &two, &reference);
        assert_eq!(fake.records().len(), 2);
        assert_eq!(fake.records()[1].note, "cluster IP");
        // Problems seen together are one Warning.
        let other = NamespacedName::new("ns1", "worse");
        let three = vec!["a".to_string(), "b".to_string(), "c".to_string()];
        reporter.observe(&other, "rv1", &three, &service_ref(&other));
        assert_eq!(fake.records().len(), 3);
        assert_eq!(fake.records()[2].note, "a; b; c");
        reporter.forget(&other);
        // A new version with the same problem: reported again.
        reporter.observe(&key, "rv2", &problems, &reference);
        assert_eq!(fake.records().len(), 4);
        // Fixed, then broken again at the same version token: reported again.
        reporter.observe(&key, "rv3", &[], &reference);
        assert_eq!(reporter.invalid_objects(), 0);
        reporter.observe(&key, "rv3", &problems, &reference);
        assert_eq!(fake.records().len(), 5);
        reporter.forget(&key);
        assert_eq!(reporter.invalid_objects(), 0);
    }

    #[test]
    fn object_version_prefers_generation() {
        let mut meta = ObjectMeta { resource_version: Some("42".into()), ..Default::default() };
        assert_eq!(object_version(&meta), "rv42");
        meta.generation = Some(3);
        assert_eq!(object_version(&meta), "g3");
    }
}
