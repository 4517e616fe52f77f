//! `kube-proxy-rs diff` reading the cluster state from the API server (`--kubeconfig`), as the
//! daemon does, against node rules given as a file: it reports exactly what it reports with
//! the same state from manifests, follows changes made in the API server, and fails clearly
//! when the API server or the kubeconfig cannot be used.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use k8s_openapi::api::discovery::v1::EndpointSlice;

use crate::support::apiserver::ApiServer;
use crate::support::e2e::{BIN, TempDir};

fn golden(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(name)
}

fn run(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("run kube-proxy-rs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The node's rules as they would be after a sync of `cluster`: the render output with the
/// jump rules from the built-in chains added, as an installed node has them.
fn node_rules(cluster: &Path) -> String {
    let out = run(&["render", "--hostname-override", "node-a", &cluster.display().to_string()]);
    assert!(out.status.success(), "render: {}", text(&out.stderr));
    let mut rules = String::new();
    let mut table = String::new();
    for line in text(&out.stdout).lines() {
        if let Some(name) = line.strip_prefix('*') {
            table = name.to_string();
        }
        if line == "COMMIT" {
            for jump in kube_proxy_rs::proxier::JUMP_CHAINS.iter().filter(|j| j.table.as_str() == table) {
                let words: Vec<String> = jump
                    .args()
                    .iter()
                    .map(|w| if w.contains(' ') { format!("\"{w}\"") } else { (*w).to_string() })
                    .collect();
                rules.push_str(&format!("-A {} {}\n", jump.src, words.join(" ")));
            }
        }
        rules.push_str(line);
        rules.push('\n');
    }
    rules
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diff_reads_the_cluster_from_the_api_server_as_from_manifests() {
    let cluster = golden("clusterip-probabilities").join("cluster.yaml");
    let (snapshot, warnings) = kube_proxy_rs::manifest::load_manifests(std::slice::from_ref(&cluster)).expect("load");
    assert!(warnings.is_empty(), "{warnings:?}");
    let server = ApiServer::start().await;
    for o in &snapshot.nodes {
        server.create(o);
    }
    for o in &snapshot.services {
        server.create(o);
    }
    for o in &snapshot.endpoint_slices {
        server.create(o);
    }
    let dir = TempDir::new("diff-api");
    let kubeconfig = dir.kubeconfig(&server);
    let rules_path = dir.path().join("node.rules");
    std::fs::write(&rules_path, node_rules(&cluster)).expect("write rules");
    let (kubeconfig, rules_path, cluster) =
        (kubeconfig.display().to_string(), rules_path.display().to_string(), cluster.display().to_string());
    let from_api = ["diff", "--hostname-override", "node-a", "--node-rules", &rules_path, "--kubeconfig", &kubeconfig];

    // The child blocks this thread; the API server runs on the other worker.
    let out = tokio::task::block_in_place(|| run(&from_api));
    assert_eq!(out.status.code(), Some(0), "{}{}", text(&out.stdout), text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "no differences");

    // One of web's two slices goes away in the API server: its endpoints' rules are now on the
    // node but not rendered, and the report names the service, as with manifests that lack
    // the slice.
    let slices: Vec<EndpointSlice> = server.objects();
    let gone = slices.iter().find(|s| s.metadata.name.as_deref() == Some("web-2")).expect("slice web-2");
    server.delete(gone);
    let out = tokio::task::block_in_place(|| run(&from_api));
    let report = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{report}{}", text(&out.stderr));
    assert!(report.contains("app/web:http:\n") && report.contains("(on the node, not rendered)"), "{report}");

    let trimmed = dir.path().join("without-web-2.yaml");
    let yaml = std::fs::read_to_string(&cluster).expect("read cluster");
    let docs: Vec<&str> = yaml.split("\n---\n").filter(|d| !d.contains("name: web-2")).collect();
    std::fs::write(&trimmed, docs.join("\n---\n")).expect("write trimmed");
    let trimmed = trimmed.display().to_string();
    let from_files = tokio::task::block_in_place(|| {
        run(&["diff", "--hostname-override", "node-a", "--node-rules", &rules_path, &trimmed])
    });
    assert_eq!(text(&from_files.stdout), report, "the same state from manifests gives the same report");
}

#[test]
fn diff_names_the_kubeconfig_or_server_it_could_not_use() {
    let out = run(&["diff", "--node-rules", "/dev/null", "--kubeconfig", "/nonexistent/kubeconfig"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("kubeconfig /nonexistent/kubeconfig: "), "{}", text(&out.stderr));

    // Nothing listens there: the list fails, naming what it was reading.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let out = run(&["diff", "--node-rules", "/dev/null", "--master", &format!("http://127.0.0.1:{port}")]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("failed to list Services from the API server"), "{}", text(&out.stderr));

    let out = run(&["diff", "--kubeconfig", "k", "cluster.yaml"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("cannot be used with"), "{}", text(&out.stderr));
}

/// `diff` reads iptables rules only: asked about nftables mode (the flag, or a config whose
/// mode is nftables) it refuses before reading the node or the API server, pointing at
/// `render`; its help says so.
#[test]
fn nftables_mode_is_refused_with_a_pointer_to_render() {
    let dir = TempDir::new("diff-nft");
    let config = dir.path().join("config.yaml");
    std::fs::write(
        &config,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\n",
    )
    .expect("write config");
    let config = config.display().to_string();
    let cluster = golden("clusterip-probabilities").join("cluster.yaml").display().to_string();
    // Nothing listens there: a diff that got as far as the API server would exit 3.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let master = format!("http://127.0.0.1:{port}");
    let cases: [Vec<&str>; 4] = [
        vec!["--proxy-mode", "nftables", "--node-rules", "/dev/null", &cluster],
        vec!["--config", &config, "--node-rules", "/dev/null", &cluster],
        vec!["--proxy-mode", "nftables", "--node-rules", "/dev/null", "--master", &master],
        // The live node: refused before its rules are read.
        vec!["--proxy-mode", "nftables", &cluster],
    ];
    for case in &cases {
        let out = run(&std::iter::once("diff").chain(case.iter().copied()).collect::<Vec<_>>());
        assert_eq!(out.status.code(), Some(2), "{case:?}: {}", text(&out.stderr));
        let err = text(&out.stderr);
        assert!(err.contains("diff reads iptables rules only for now"), "{case:?}: {err}");
        assert!(err.contains("kube-proxy-rs render --proxy-mode nftables"), "{case:?}: {err}");
        assert!(out.stdout.is_empty(), "{case:?}");
    }
    // iptables mode by flag: compared as before (the empty node differs: exit 1).
    let out = run(&[
        "diff",
        "--proxy-mode",
        "iptables",
        "--node-rules",
        "/dev/null",
        "--hostname-override",
        "node-a",
        &cluster,
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));

    let help = run(&["diff", "--help"]);
    let help = text(&help.stdout);
    assert!(help.contains("Reads iptables rules only for now"), "{help}");
    assert!(help.contains("render --proxy-mode") && help.contains("nftables"), "{help}");
}
