//! nftables mode under faults, with real packets: the `kube-proxy-rs` binary in node-a of the
//! small cluster network (tests/support/cluster_net.rs), configured by a `--config` file with
//! `mode: nftables` and a short `nftables.syncPeriod` (release 1.37, the default). `nft` runs
//! through a wrapper first on the daemon's PATH that can refuse one transaction; the
//! `kube-proxy` table is deleted from outside; the API server goes away and comes back.
//! Root only.

use std::time::{Duration, Instant};

use kube_proxy_rs::tracker::testing::{ep, slice, svc};

use crate::require_root;
use crate::support::cluster_net::{
    CLUSTER_CIDR, CPOD, Cluster, NODE_A, NsName, POD_A1, POD_A2, POD_B1, Pod, SERVE_PORT, sa, tally, tcp_request,
    tcp_requests,
};
use crate::support::e2e::{HEALTHZ_ADDR, METRICS_ADDR, bind_in_netns, http_get};
use crate::support::poll::{SLOW_POLL, eventually, poll_until};

const NS: &str = "ns1";
/// The daemon's `nftables.syncPeriod` (and so its retry interval after a failed sync).
const SYNC_PERIOD: Duration = Duration::from_secs(2);
const PROGRAMMED: Duration = Duration::from_secs(30);

fn pods_slice(svc: &str, pods: &[&Pod]) -> kube_proxy_rs::tracker::testing::SliceBuilder {
    let mut b = slice(NS, svc, &format!("{svc}-1")).tcp("http", i32::from(SERVE_PORT));
    for p in pods {
        b = b.endpoint(ep(&p.ip).node(p.node));
    }
    b
}

fn web(name: &str, ip: &str) -> kube_proxy_rs::tracker::testing::SvcBuilder {
    svc(NS, name).cluster_ip(ip).tcp("http", 80)
}

/// The daemon's command line: a config file in nftables mode with a short sync period
/// (nftables mode takes its periods from the `nftables` section, which has no flags).
fn nft_daemon_args(c: &Cluster) -> Vec<String> {
    let config = c.dir.path().join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
             clientConnection:\n  kubeconfig: {kubeconfig}\nhostnameOverride: {NODE_A}\n\
             healthzBindAddress: {HEALTHZ_ADDR}\nmetricsBindAddress: {METRICS_ADDR}\n\
             clusterCIDR: {CLUSTER_CIDR}\nconntrack:\n  maxPerCore: 0\nmode: nftables\n\
             nftables:\n  syncPeriod: {}s\n  minSyncPeriod: 100ms\n",
            SYNC_PERIOD.as_secs(),
            kubeconfig = c.dir.kubeconfig(&c.server).display(),
        ),
    )
    .expect("write config");
    vec![format!("--config={}", config.display()), "-v=2".into()]
}

/// An `nft` wrapper in `bin`: a transaction (`nft -f -`) whose text contains the word in the
/// file `fail-next` is refused, as nft refuses one the kernel rejects, and the file removed
/// (one failure); the refused text goes to `refused`. Everything else runs the real nft.
fn nft_wrapper(bin: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(bin).expect("wrapper dir");
    let dir = bin.display();
    let script = format!(
        "#!/bin/sh\n\
         [ \"$1\" = -f ] || exec /usr/sbin/nft \"$@\"\n\
         input=$(mktemp)\n\
         cat >\"$input\"\n\
         if [ -e {dir}/fail-next ] && grep -qF -- \"$(cat {dir}/fail-next)\" \"$input\"; then\n\
         \x20 rm -f {dir}/fail-next\n\
         \x20 cp \"$input\" {dir}/refused\n\
         \x20 rm -f \"$input\"\n\
         \x20 echo '/dev/stdin:1:1-20: Error: Could not process rule: Device or resource busy (injected)' >&2\n\
         \x20 exit 1\n\
         fi\n\
         /usr/sbin/nft \"$@\" <\"$input\"\n\
         rc=$?\n\
         rm -f \"$input\"\n\
         exit $rc\n"
    );
    let path = bin.join("nft");
    std::fs::write(&path, script).expect("write wrapper");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod wrapper");
}

/// A counter's value (summed over its series) on the daemon's metrics page, 0 when absent.
fn metric(c: &Cluster, name: &str) -> f64 {
    let Some((_, body)) = http_get(&c.node_a, METRICS_ADDR, "/metrics") else { return 0.0 };
    body.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let value = match rest.strip_prefix('{') {
                Some(labelled) => labelled.split_once("} ")?.1,
                None => rest.strip_prefix(' ')?,
            };
            value.trim().parse::<f64>().ok()
        })
        .sum()
}

async fn wait_answered(c: &Cluster, from: &impl NsName, dst: std::net::SocketAddr, pods: &[&str], limit: Duration) {
    let answered = poll_until(
        limit,
        SLOW_POLL,
        || matches!(tcp_request(from, dst, None), Ok(r) if pods.contains(&r.pod.as_str())),
    );
    if answered.await.is_none() {
        panic!("{dst} not answered by {pods:?} within {limit:?}\n{}\n{}", c.nft_table("ip"), c.log());
    }
}

fn ok_all(c: &Cluster, from: &impl NsName, dst: std::net::SocketAddr, n: usize, what: &str) {
    let (_, failures) = tally(&tcp_requests(from, dst, None, n));
    assert!(failures.is_empty(), "{what}: {} of {n} failed: {failures:?}\n{}", failures.len(), c.log());
}

fn started(tag: &str, c: &mut Cluster, env: &[(&str, &str)]) {
    let args = nft_daemon_args(c);
    c.start_daemon_exactly(&args, env);
    eprintln!("{tag}: daemon started in nftables mode, syncPeriod {SYNC_PERIOD:?}");
}

/// The kernel refuses one transaction (the partial sync adding an endpoint): the failure is
/// counted and logged, nothing else changes it, and the retry (full, after syncPeriod)
/// programs the endpoint; the Service keeps answering from its other endpoints throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nftables_refused_transaction_is_retried_in_full() {
    require_root!();
    let mut c = Cluster::network("nftfail").await;
    let bin = c.dir.path().join("bin");
    nft_wrapper(&bin);
    let path = format!("{}:/usr/sbin:/usr/bin:/sbin:/bin", bin.display());
    // The refusal is injected into nft: every transaction goes through it (the netlink
    // writer's refusals are tested in nftables_real; the daemon's retry is the same).
    started("refused transaction", &mut c, &[("PATH", &path), ("KUBE_PROXY_RS_NFT_WRITER", "nft")]);
    let (a1, a2, b1) = (c.pod(POD_A1), c.pod(POD_A2), c.pod(POD_B1));
    let cpod = &c.pod(CPOD).ns;
    let http = sa("198.19.0.10", 80);
    c.server.create(&web("web", "198.19.0.10").build());
    c.server.create(&pods_slice("web", &[a1, a2]).build());
    wait_answered(&c, cpod, http, &[a1.name, a2.name], PROGRAMMED).await;
    let failures_before = metric(&c, "kubeproxy_sync_proxy_rules_nftables_sync_failures_total");
    let full_before = metric(&c, "kubeproxy_sync_full_proxy_rules_duration_seconds_count");
    assert!(full_before >= 1.0, "the first sync was full");

    // One object changes; its partial sync is refused.
    std::fs::write(bin.join("fail-next"), &b1.ip).expect("arm the wrapper");
    c.server.update(&pods_slice("web", &[a1, a2, b1]).build());
    eventually("the transaction refused", PROGRAMMED, || bin.join("refused").exists()).await;
    let refused_at = Instant::now();
    let refused = std::fs::read_to_string(bin.join("refused")).expect("refused text");
    assert!(!refused.contains("add table"), "the refused transaction was a partial sync:\n{refused}");
    assert!(!c.nft_table("ip").contains(&b1.ip), "nothing of the refused transaction applied");
    ok_all(&c, cpod, http, 10, "the Service's other endpoints after the refusal");
    let retried = poll_until(SYNC_PERIOD * 2 + Duration::from_secs(1), Duration::from_millis(50), || {
        c.nft_table("ip").contains(&b1.ip)
    });
    let Some(_) = retried.await else {
        panic!("the refused change was not retried within 2 × syncPeriod + 1 s\n{}", c.log());
    };
    let retry_took = refused_at.elapsed();
    eprintln!("refused transaction retried and applied {retry_took:?} after the refusal (syncPeriod {SYNC_PERIOD:?})");
    wait_answered(&c, cpod, http, &[b1.name], SYNC_PERIOD).await;
    assert!(!bin.join("fail-next").exists(), "exactly one refusal");
    let log = c.log();
    assert!(log.contains("nftables sync failed") && log.contains("injected"), "the failure is logged:\n{log}");
    let failures = metric(&c, "kubeproxy_sync_proxy_rules_nftables_sync_failures_total");
    assert_eq!(failures, failures_before + 1.0, "one failure counted\n{log}");
    let full = metric(&c, "kubeproxy_sync_full_proxy_rules_duration_seconds_count");
    assert!(full > full_before, "the retry was a full sync ({full_before} -> {full} full syncs)\n{log}");
    ok_all(&c, cpod, http, 30, "after the retry");
}

/// The `kube-proxy` table deleted from outside is rebuilt with no change to the Services: the
/// next periodic sync has nothing to write, finds the table gone (an `nft --check`) and
/// syncs in full, so traffic is back within 2 × syncPeriod; a change after that is
/// programmed as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nftables_table_deleted_from_outside_is_rebuilt() {
    require_root!();
    let mut c = Cluster::network("nftdel").await;
    started("deleted table", &mut c, &[]);
    let (a1, a2) = (c.pod(POD_A1), c.pod(POD_A2));
    let cpod = &c.pod(CPOD).ns;
    c.server.create(&web("web", "198.19.0.10").build());
    c.server.create(&pods_slice("web", &[a1, a2]).build());
    let http = sa("198.19.0.10", 80);
    wait_answered(&c, cpod, http, &[a1.name, a2.name], PROGRAMMED).await;
    let before = c.nft_table("ip");

    let deleted = Instant::now();
    c.node_a.ok(&["nft", "delete", "table", "ip", "kube-proxy"]);
    assert!(tcp_request(cpod, http, None).is_err(), "the Service is gone with the table");
    let limit = SYNC_PERIOD * 2;
    let rebuilt = poll_until(limit, Duration::from_millis(50), || !c.nft_table("ip").is_empty()).await;
    let Some(took) = rebuilt else {
        panic!("the deleted table was not rebuilt within {limit:?}\n{}", c.log());
    };
    eprintln!("the deleted table was rebuilt {took:?} after the deletion (syncPeriod {SYNC_PERIOD:?})");
    wait_answered(&c, cpod, http, &[a1.name, a2.name], SYNC_PERIOD).await;
    assert_eq!(c.nft_table("ip"), before, "rebuilt as it was");
    let log = c.log();
    assert!(log.contains("the kube-proxy table is gone"), "the daemon says why it syncs in full:\n{log}");
    assert!(!log.contains("nftables sync failed"), "no failed sync on the way:\n{log}");
    assert!(deleted.elapsed() < PROGRAMMED);

    c.server.create(&web("later", "198.19.0.11").build());
    c.server.create(&pods_slice("later", &[a1]).build());
    wait_answered(&c, cpod, sa("198.19.0.11", 80), &[a1.name], PROGRAMMED).await;
    ok_all(&c, cpod, http, 20, "after the rebuild");
}

/// The API server goes away (connections refused, watches dropped) and comes back on the same
/// address: the rules stay and keep serving while it is gone, and the changes made meanwhile
/// (a Service added, another scaled down) are programmed once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nftables_api_server_down_then_back() {
    require_root!();
    let mut c = Cluster::network("nftapi").await;
    started("API server outage", &mut c, &[]);
    let (a1, a2, b1) = (c.pod(POD_A1), c.pod(POD_A2), c.pod(POD_B1));
    let (a1_name, a2_name, b1_name, b1_ip) = (a1.name, a2.name, b1.name, b1.ip.clone());
    let cpod = c.pod(CPOD).ns.name.clone();
    let (all, scaled_down) = (pods_slice("web", &[a1, a2, b1]).build(), pods_slice("web", &[a1]).build());
    let added_slice = pods_slice("added", &[a2]).build();
    c.server.create(&web("web", "198.19.0.10").build());
    c.server.create(&all);
    let http = sa("198.19.0.10", 80);
    wait_answered(&c, &cpod, http, &[a1_name, a2_name, b1_name], PROGRAMMED).await;
    let before = c.nft_table("ip");

    let addr = c.server.addr().to_string();
    c.server.go_down();
    let down = Instant::now();
    c.server.create(&web("added", "198.19.0.12").build());
    c.server.create(&added_slice);
    c.server.update(&scaled_down);
    while down.elapsed() < SYNC_PERIOD * 2 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(c.nft_table("ip"), before, "the rules stay while the API server is away\n{}", c.log());
        ok_all(&c, &cpod, http, 5, "while the API server is away");
    }
    let status = c.daemon.as_mut().expect("daemon").child.as_mut().expect("child").try_wait().expect("wait");
    assert!(status.is_none(), "the daemon keeps running\n{}", c.log());

    let back = Instant::now();
    c.server.come_back_on(bind_in_netns(&c.api_ns.name, &addr));
    wait_answered(&c, &cpod, sa("198.19.0.12", 80), &[a2_name], PROGRAMMED).await;
    eventually("pod-b1 removed", PROGRAMMED, || !c.nft_table("ip").contains(&b1_ip)).await;
    eprintln!("changes made during the outage programmed {:?} after the API server came back", back.elapsed());
    let (per_pod, failures) = tally(&tcp_requests(&cpod, http, None, 20));
    assert!(failures.is_empty() && per_pod.keys().all(|p| p == a1_name), "scaled down to pod-a1: {per_pod:?}");
    assert_eq!(http_get(&c.node_a, HEALTHZ_ADDR, "/healthz").map(|(s, _)| s), Some(200), "{}", c.log());
}
