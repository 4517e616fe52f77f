//! Composition root: builds the real exec, iptables runners and (later) the daemon's tasks.

use std::sync::Arc;
use std::time::Duration;

use crate::exec::{Exec, RealExec};
use crate::iptables::Iptables;
use crate::iptables::runner::{IptablesRunner, RunnerOptions, detect_backend};
use crate::model::IpFamily;
use crate::proxier::cleanup::cleanup_leftovers;

/// Longest any single iptables command may take, so that a wedged binary cannot hold a
/// family's sync loop (upstream sets no bound at all). The longest single command measured at
/// upstream's scale limit (10k Services, 100k endpoints, docs/performance.md "Scale") is the
/// first full restore on iptables-legacy, 28–31 s (on iptables-nft the first sync is split
/// into smaller restores); 300 s leaves ten times that for slower nodes. A killed restore
/// fails the sync, which is retried, and a node whose restores really take longer shows it in
/// the logs (`did not finish within 300s and was killed`) and in `/healthz`.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(300);

/// The iptables runners for IPv4 and IPv6, on the backend the host already uses.
pub(crate) fn iptables_runners(exec: Arc<dyn Exec>) -> [IptablesRunner; 2] {
    let detection = detect_backend(exec.clone(), None, COMMAND_TIMEOUT);
    tracing::info!(
        backend = ?detection.backend,
        legacy_rules = detection.legacy_rules,
        nft_rules = detection.nft_rules,
        reason = detection.reason,
        "chose iptables backend"
    );
    [IpFamily::V4, IpFamily::V6].map(|family| {
        let options = RunnerOptions {
            backend: detection.backend,
            netns: None,
            command_timeout: COMMAND_TIMEOUT,
            ..RunnerOptions::default()
        };
        IptablesRunner::new(exec.clone(), family, options)
    })
}

/// `--cleanup`: removes our rules and chains from both families, in both modes (upstream
/// `CleanupLeftovers` of every mode). Returns whether everything succeeded; a family whose
/// iptables or nft is not usable is skipped.
pub fn cleanup() -> bool {
    let exec: Arc<dyn Exec> = Arc::new(RealExec);
    let runners = iptables_runners(exec.clone());
    let iptables_ok = cleanup_iptables(&runners.each_ref().map(|r| r as &dyn Iptables));
    let nftables_ok = cleanup_nftables(exec);
    iptables_ok && nftables_ok
}

/// Removes iptables mode's rules and chains (the families whose iptables is present).
fn cleanup_iptables(runners: &[&dyn Iptables]) -> bool {
    let mut ok = true;
    for &runner in runners {
        let family = runner.family();
        if !runner.present() {
            tracing::info!(%family, "iptables not present for this family; nothing to clean up");
            continue;
        }
        let report = cleanup_leftovers(runner);
        tracing::info!(%family, deleted = report.deleted.len(), kept_referenced = report.kept_referenced.len(), errors = report.errors.len(), "iptables cleanup finished");
        ok &= report.success();
    }
    ok
}

/// Deletes nftables mode's `kube-proxy` tables (both families; a missing table is fine).
fn cleanup_nftables(exec: Arc<dyn Exec>) -> bool {
    crate::nftables::runner::cleanup_tables(exec, &nft_options()).is_empty()
}

fn nft_options() -> crate::nftables::runner::NftOptions {
    crate::nftables::runner::NftOptions { command_timeout: COMMAND_TIMEOUT, ..Default::default() }
}

/// nftables mode's writers, one per family whose `nft` works (knftables' checks: version and
/// object comments): netlink for what it encodes, `nft` for the rest and for listing
/// (`KUBE_PROXY_RS_NFT_WRITER=nft`: `nft` for everything), after upstream's kernel check (5.13 or later, unless
/// `KUBE_PROXY_NFTABLES_SKIP_KERNEL_VERSION_CHECK` is set; up to 1.32 the check ran only when
/// it was set).
fn nftables_writers(
    exec: &Arc<dyn Exec>,
    release: crate::compat::Release,
) -> Result<[Option<Arc<dyn crate::nftables::Nftables>>; 2], AppError> {
    use crate::nftables::kernel::{KernelCheck, check_host_kernel};
    use crate::nftables::netlink;
    use crate::nftables::runner::NftRunner;
    let check =
        if release <= crate::compat::Release::V1_32 { KernelCheck::InvertedUpTo1_32 } else { KernelCheck::Fixed };
    check_host_kernel(check).map_err(|e| AppError::Nftables(e.to_string()))?;
    Ok([crate::nftables::Family::Ip, crate::nftables::Family::Ip6].map(|family| {
        match NftRunner::new(exec.clone(), family, nft_options()) {
            Ok(runner) if netlink::cli_only_from_env() => {
                tracing::info!(%family, version = %runner.version(), env = netlink::WRITER_ENV, "using nft for every transaction");
                Some(Arc::new(runner) as Arc<dyn crate::nftables::Nftables>)
            }
            Ok(runner) => {
                tracing::info!(%family, version = %runner.version(), "using netlink for per-service changes, nft for the rest");
                let writer = netlink::NetlinkNftables::new(Arc::new(runner), Arc::new(netlink::KernelNetlink::new()));
                Some(Arc::new(writer) as Arc<dyn crate::nftables::Nftables>)
            }
            Err(e) => {
                tracing::warn!(%family, error = %e, "nftables is not usable for this family");
                None
            }
        }
    }))
}

/// How the daemon ended without an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stopped {
    /// SIGTERM or SIGINT: the rules stay in place.
    Signal,
    /// `--init-only` finished initialising the node.
    Initialized,
    /// Something the daemon was built from changed; it exits (non-zero, as upstream) so the
    /// DaemonSet starts it again from the new state. Expected, not a failure.
    Restart(RestartReason),
}

/// Why the daemon exits to be restarted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RestartReason {
    /// The `--config` file changed (its message says how).
    #[error("{0}")]
    ConfigFileChanged(String),
    /// The Node changed in a way the daemon was built on (its podCIDRs in NodeCIDR mode).
    #[error("{0}")]
    NodeChanged(String),
}

/// The configuration's validation errors, one per field.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
pub struct InvalidConfiguration(pub Vec<crate::config::FieldError>);

/// Why the daemon stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Config(#[from] InvalidConfiguration),
    #[error("failed to create the Kubernetes client: {0}")]
    Client(#[from] crate::k8s::client::ClientError),
    #[error(transparent)]
    Daemon(#[from] crate::daemon::DaemonError),
    #[error("failed to bind {what} on {addr}: {source}")]
    Bind { what: &'static str, addr: std::net::SocketAddr, source: crate::serve::http::HttpError },
    #[error("failed to start the async runtime: {0}")]
    Runtime(std::io::Error),
    #[error("failed to set up the metrics server: {0}")]
    MetricsServer(#[from] crate::serve::health::HealthError),
    #[error(transparent)]
    PodCidr(#[from] crate::k8s::pod_cidr::PodCidrError),
    #[error(transparent)]
    TaskEnded(crate::daemon::tasks::TaskEnded),
    #[error(transparent)]
    Capabilities(#[from] crate::node::capabilities::CapabilityError),
    #[error("--init-only: failed to apply conntrack settings: {0}")]
    InitConntrack(crate::node::sysctl::SysctlError),
    #[error("nftables mode cannot run on this node: {0}")]
    Nftables(String),
}

/// The OS hostname as upstream's `GetHostname` normalises it.
pub(crate) fn os_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_default()
        .trim()
        .to_lowercase()
}

/// The daemon: builds everything from the effective configuration and runs until SIGTERM or
/// SIGINT (rules stay in place), or until the `--config` file changes (exit with a message so
/// the DaemonSet restarts it). With `init_only` (`--init-only`) it stops once the node is
/// initialised (sysctls set), before programming anything, as upstream does.
pub fn run_daemon(
    cfg: &crate::config::KubeProxyConfiguration,
    config_path: Option<&std::path::Path>,
    master: Option<&str>,
    init_only: bool,
) -> Result<Stopped, AppError> {
    let settings = crate::config::Settings::from_config(cfg).map_err(InvalidConfiguration)?;
    // Before any iptables command, so too few capabilities fail here, naming the missing one.
    // `--init-only` runs privileged (it writes /proc/sys); its failures name the sysctl.
    if !init_only {
        check_capabilities(settings.mode)?;
    }
    // Before any thread or socket exists, as Go's runtime does it for upstream.
    crate::node::fd_limit::raise_open_file_limit(&crate::node::fd_limit::ProcessOpenFileLimit);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(AppError::Runtime)?;
    let config_json = serde_json::to_value(cfg).unwrap_or(serde_json::Value::Null);
    runtime.block_on(daemon_main(
        settings,
        config_json,
        config_path.map(|p| p.to_path_buf()),
        master.map(str::to_string),
        init_only,
    ))
}

/// The capabilities `mode` needs (node::capabilities): iptables mode NET_ADMIN and NET_RAW,
/// nftables mode NET_ADMIN only, saying once that without NET_RAW iptables-legacy's leftovers
/// of iptables mode are neither read nor removed.
fn check_capabilities(mode: crate::config::ProxyMode) -> Result<(), AppError> {
    use crate::node::capabilities::{NFTABLES_LEGACY_LEFTOVERS, REQUIRED, REQUIRED_NFTABLES, check_this_process_for};
    match mode {
        crate::config::ProxyMode::Iptables => check_this_process_for(REQUIRED)?,
        crate::config::ProxyMode::Nftables => {
            check_this_process_for(REQUIRED_NFTABLES)?;
            if let Err(e) = check_this_process_for(&[NFTABLES_LEGACY_LEFTOVERS]) {
                tracing::info!(
                    "{e}. Without it iptables-legacy is not read: a node that ran kube-proxy in iptables mode on \
                     iptables-legacy keeps those rules until `kube-proxy-rs --cleanup` (deploy/cleanup-job.yaml) \
                     runs there once; iptables-nft's are removed"
                );
            }
        }
    }
    Ok(())
}

/// How a server that cannot bind is reported: a Warning with `reason` on this Node, raised on
/// every retry (the recorder folds the repeats into one series).
struct BindFailure<'a> {
    events: &'a dyn crate::k8s::events::EventRecorder,
    node: &'a str,
    reason: &'static str,
}

impl BindFailure<'_> {
    fn report(&self, what: &str, addr: std::net::SocketAddr, error: &dyn std::fmt::Display) {
        use crate::k8s::events::{ACTION_START, EventType, node_ref};
        let note = format!("failed to start {what} on {addr}: {error}");
        self.events.record(node_ref(self.node), EventType::Warning, self.reason, ACTION_START, &note);
    }
}

async fn bind_or_retry(
    what: &'static str,
    addr: std::net::SocketAddr,
    hard_fail: bool,
    failure: &BindFailure<'_>,
    shutdown: &tokio_util::sync::CancellationToken,
) -> Result<Option<tokio::net::TcpListener>, AppError> {
    loop {
        match crate::serve::http::bind(addr).await {
            Ok(l) => return Ok(Some(l)),
            Err(e) if hard_fail => return Err(AppError::Bind { what, addr, source: e }),
            Err(e) => {
                tracing::error!(what, %addr, error = %e, "failed to bind; retrying in 5s");
                failure.report(what, addr, &e);
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return Ok(None),
            () = tokio::time::sleep(Duration::from_secs(5)) => {}
        }
    }
}

async fn daemon_main(
    settings: crate::config::Settings,
    config_json: serde_json::Value,
    config_path: Option<std::path::PathBuf>,
    master: Option<String>,
    init_only: bool,
) -> Result<Stopped, AppError> {
    use crate::daemon::{Daemon, DaemonDeps, service_health_server};
    use tokio_util::sync::CancellationToken;

    let shutdown = CancellationToken::new();
    // Watch the config file from before anything else is read.
    let watcher = match &config_path {
        Some(p) => crate::config::watch::ConfigWatcher::new(p, crate::config::watch::DEFAULT_POLL_INTERVAL).ok(),
        None => None,
    };
    let Some(client) = build_client(settings.client.kubeconfig.as_deref(), master.as_deref(), &shutdown).await else {
        return Ok(Stopped::Signal);
    };
    let hostname = settings.hostname_override.clone().unwrap_or_else(os_hostname);
    tracing::info!(hostname = %hostname, "starting kube-proxy-rs");
    if settings.mode_unset && settings.features.release.warns_about_empty_mode() {
        tracing::warn!(
            "proxy mode is not set: using iptables; the default on Linux will change from iptables to nftables \
             in a future release, so set mode explicitly"
        );
    }
    for warning in crate::compat::Features::gate_warnings(settings.features.release, &settings.feature_gates) {
        tracing::warn!("{warning}");
    }
    // A signal while the API server cannot be reached (or refuses us) stops the process
    // cleanly, as it does later.
    let mut node = tokio::select! {
        node = crate::k8s::list::wait_for_node(&client, &hostname) => node,
        _ = wait_for_stop(None, &shutdown) => return Ok(Stopped::Signal),
    };
    let node_cidr_mode = settings.detect_local == crate::config::DetectLocal::NodeCidr;
    if node_cidr_mode && !node.as_ref().is_some_and(crate::k8s::pod_cidr::has_pod_cidrs) {
        tracing::info!(hostname = %hostname, "watching for node, awaiting podCIDR allocation");
        let n = tokio::select! {
            n = crate::k8s::pod_cidr::wait_for_pod_cidrs(&client, &hostname, crate::k8s::pod_cidr::POD_CIDR_WAIT) => n?,
            _ = wait_for_stop(None, &shutdown) => return Ok(Stopped::Signal),
        };
        node = Some(n);
    }
    let (recorder, events_task) = crate::k8s::events::KubeEventRecorder::start(
        client.clone(),
        crate::k8s::events::reporting_instance(&os_hostname()),
        crate::k8s::events::EventOptions::default(),
        shutdown.clone(),
    );
    let events: Arc<dyn crate::k8s::events::EventRecorder> = recorder;

    let exec: Arc<dyn Exec> = Arc::new(RealExec);
    let runners = iptables_runners(exec.clone());
    let mode = settings.mode;
    let [nft_v4, nft_v6] = match mode {
        crate::config::ProxyMode::Nftables => nftables_writers(&exec, settings.features.release)?,
        crate::config::ProxyMode::Iptables => [None, None],
    };
    let [v4, v6] = runners;
    let (v4, v6): (Arc<dyn Iptables>, Arc<dyn Iptables>) = (Arc::new(v4), Arc::new(v6));
    // The other mode's rules go once ours are in place (upstream removes them before its
    // first sync, leaving the node without service rules in between).
    let leftovers: Box<dyn FnOnce() + Send> = match mode {
        crate::config::ProxyMode::Iptables => {
            let exec = exec.clone();
            Box::new(move || {
                cleanup_nftables(exec);
            })
        }
        crate::config::ProxyMode::Nftables => {
            let (v4, v6) = (v4.clone(), v6.clone());
            Box::new(move || {
                cleanup_iptables(&[v4.as_ref(), v6.as_ref()]);
            })
        }
    };
    let sysctl: Arc<dyn crate::node::sysctl::Sysctl> = Arc::new(crate::node::sysctl::ProcSysctl::new());
    let interfaces: Arc<dyn crate::proxier::NetworkInterfaces> = Arc::new(HostInterfaces);
    match crate::node::sysctl::apply_conntrack_settings(
        sysctl.as_ref(),
        &crate::node::sysctl::RealConntrackSysfs::default(),
        &settings.conntrack,
        crate::node::sysctl::detect_num_cpu(),
        settings.features.release,
    ) {
        Ok(outcome) => crate::daemon::report_conntrack_outcome(&outcome, &hostname, events.as_ref()),
        // Setting these is what the init container is for; the daemon carries on as before.
        Err(e) if init_only => return Err(AppError::InitConntrack(e)),
        Err(e) => tracing::error!(error = %e, "failed to apply conntrack settings"),
    }
    let deps = DaemonDeps {
        iptables_v4: Some(v4),
        iptables_v6: Some(v6),
        sysctl,
        interfaces: interfaces.clone(),
        conntrack: Some(Arc::new(crate::node::conntrack::netlink::NetlinkConntrack::new(exec.clone()))),
        nfacct: Some(Arc::new(crate::node::nfacct::ExecNfacct::new(exec))),
        nftables_v4: nft_v4,
        nftables_v6: nft_v6,
        events: events.clone(),
    };
    let daemon = Daemon::build(&settings, hostname.clone(), node.as_ref(), &deps)?.with_leftover_cleanup(leftovers);
    if init_only {
        tracing::info!("system initialized and --init-only specified");
        return Ok(Stopped::Initialized);
    }
    crate::node::oom::apply_oom_score_adj(&crate::node::oom::ProcOomScoreAdjuster::default(), settings.oom_score_adj);

    let mut servers = Vec::new();
    let healthz_failure = BindFailure {
        events: events.as_ref(),
        node: &hostname,
        reason: crate::k8s::events::REASON_FAILED_PROXIER_HEALTHCHECK,
    };
    let metrics_failure = BindFailure {
        events: events.as_ref(),
        node: &hostname,
        reason: crate::k8s::events::REASON_FAILED_METRIC_SERVER,
    };
    if let Some(addr) = settings.healthz_bind_address
        && let Some(l) =
            bind_or_retry("healthz server", addr, settings.bind_address_hard_fail, &healthz_failure, &shutdown).await?
    {
        servers.push(tokio::spawn(daemon.health.clone().serve(l, shutdown.clone())));
    }
    if let Some(addr) = settings.metrics_bind_address {
        let server =
            crate::serve::health::MetricsServer::new(daemon.metrics.clone(), &config_json)?.with_proxy_mode(mode);
        if let Some(l) =
            bind_or_retry("metrics server", addr, settings.bind_address_hard_fail, &metrics_failure, &shutdown).await?
        {
            servers.push(tokio::spawn(Arc::new(server).serve(l, shutdown.clone())));
        }
    }
    let service_health =
        service_health_server(&daemon, interfaces.as_ref(), tokio::runtime::Handle::current(), shutdown.clone());

    let set = daemon.proxier_set();
    let health = daemon.health.clone();
    // NodeCIDR mode: a change of the node's podCIDRs means a restart (the detector was built
    // from them).
    let (restart_tx, mut restart_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let pod_cidr_guard =
        std::sync::Mutex::new(node_cidr_mode.then(|| crate::k8s::pod_cidr::PodCidrGuard::for_node(node.as_ref())));
    // From 1.37 a change of the Node's IPs, or its deletion, restarts the process too.
    let node_ip_guard = std::sync::Mutex::new(
        settings
            .features
            .release
            .exits_on_node_ip_change()
            .then(|| crate::k8s::pod_cidr::NodeIpGuard::for_node(node.as_ref())),
    );
    let on_node: crate::k8s::watch::NodeCallback = Arc::new(move |n| {
        match n {
            Some(n) => health.sync_node(n),
            None => health.node_deleted(),
        }
        let mut guard = pod_cidr_guard.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let pod_cidrs_changed = guard.as_mut().and_then(|g| g.on_node(n));
        drop(guard);
        let mut guard = node_ip_guard.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let node_ips_changed = guard.as_mut().and_then(|g| g.on_node(n));
        if let Some(why) = pod_cidrs_changed.or(node_ips_changed) {
            tracing::info!(reason = %why, "the node changed in a way this process was built on; restarting");
            let _ = restart_tx.send(why);
        }
    });
    // Supervised: either ending before shutdown ends the daemon with an error.
    let mut tasks = crate::daemon::tasks::Tasks::new();
    let watches = crate::k8s::watch::run_with_events(
        client,
        hostname,
        set,
        on_node,
        daemon.service_cidr_callback(&settings),
        Some(events.clone()),
        shutdown.clone(),
    );
    tasks.spawn("API watches", async move {
        watches.await;
        Ok(())
    });
    daemon.birth_cry();
    let loops = daemon.run_loops(shutdown.clone(), Some(service_health));
    tasks.spawn("sync loops", async move { loops.await.map_err(|e| e.to_string()) });

    let reason = tokio::select! {
        r = wait_for_stop(watcher.as_ref(), &shutdown) => match r {
            Some(changed) => Ok(Stopped::Restart(RestartReason::ConfigFileChanged(changed))),
            None => Ok(Stopped::Signal),
        },
        Some(why) = restart_rx.recv() => Ok(Stopped::Restart(RestartReason::NodeChanged(why))),
        ended = tasks.first_ended() => {
            tracing::error!(task = %ended.task, how = %ended.how, "a supervised task ended; exiting");
            Err(AppError::TaskEnded(ended))
        }
    };
    shutdown.cancel();
    let stopped = async {
        tasks.join_all().await;
        for s in servers {
            let _ = s.await;
        }
        // Last: it writes what the others reported while stopping.
        let _ = events_task.await;
    };
    if tokio::time::timeout(crate::daemon::SHUTDOWN_GRACE, stopped).await.is_err() {
        tracing::warn!("shutdown grace period over; exiting with tasks still running");
    }
    tracing::info!("stopped; service rules left in place");
    reason
}

/// Builds the API client, retrying (with backoff up to 30 s) while it cannot be built — a
/// kubeconfig, token file or CA that is missing or unreadable, perhaps not yet projected by
/// the kubelet — with an error naming what failed each time. `None` when a signal arrived
/// first.
async fn build_client(
    kubeconfig: Option<&std::path::Path>,
    master: Option<&str>,
    shutdown: &tokio_util::sync::CancellationToken,
) -> Option<kube::Client> {
    let mut delay = std::time::Duration::from_secs(1);
    loop {
        match crate::k8s::client::build(kubeconfig, master).await {
            Ok(client) => return Some(client),
            Err(e) => tracing::error!(
                error = %e,
                kubeconfig = %kubeconfig.map_or_else(|| "(in-cluster)".into(), |p| p.display().to_string()),
                retry_in = ?delay,
                "failed to create the Kubernetes client (check the kubeconfig, its token file and CA); retrying"
            ),
        }
        let stop = wait_for_stop(None, shutdown);
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            _ = stop => return None,
        }
        delay = (delay * 2).min(std::time::Duration::from_secs(30));
    }
}

/// Waits for SIGTERM/SIGINT (→ `None`) or a config file change (→ its message).
async fn wait_for_stop(
    watcher: Option<&crate::config::watch::ConfigWatcher>,
    shutdown: &tokio_util::sync::CancellationToken,
) -> Option<String> {
    let config_changed = async {
        match watcher {
            Some(w) => w.changed(shutdown).await.map(|c| format!("{c:?}")),
            None => std::future::pending().await,
        }
    };
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM");
            return config_changed.await;
        }
    };
    tokio::select! {
        _ = term.recv() => { tracing::info!("received SIGTERM; shutting down"); None }
        _ = tokio::signal::ctrl_c() => { tracing::info!("received SIGINT; shutting down"); None }
        msg = config_changed => msg.map(|m| format!("configuration file changed ({m}); exiting so it is reloaded")),
    }
}

/// The host's interface addresses, read from `/proc`: IPv4 from the local entries of the
/// kernel's FIB (`/proc/net/fib_trie`), IPv6 from `/proc/net/if_inet6`.
pub(crate) struct HostInterfaces;

impl crate::proxier::NetworkInterfaces for HostInterfaces {
    fn interface_addrs(&self) -> std::io::Result<Vec<std::net::IpAddr>> {
        let mut out = Vec::new();
        // IPv4: "local" entries of the main FIB (/proc/net/fib_trie lists /32 host LOCAL).
        let trie = std::fs::read_to_string("/proc/net/fib_trie").unwrap_or_default();
        let mut last: Option<std::net::IpAddr> = None;
        for line in trie.lines() {
            let t = line.trim_start();
            if let Some(rest) = t.strip_prefix("|-- ") {
                last = rest.trim().parse().ok();
            } else if t.starts_with("/32 host LOCAL")
                && let Some(ip) = last
                && !out.contains(&ip)
            {
                out.push(ip);
            }
        }
        // IPv6: /proc/net/if_inet6, 32 hex digits per address.
        let v6 = std::fs::read_to_string("/proc/net/if_inet6").unwrap_or_default();
        for line in v6.lines() {
            if let Some(hex) = line.split_whitespace().next()
                && hex.len() == 32
                && let Ok(v) = u128::from_str_radix(hex, 16)
            {
                out.push(std::net::IpAddr::V6(std::net::Ipv6Addr::from(v)));
            }
        }
        Ok(out)
    }
}
