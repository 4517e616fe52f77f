//! Golden scenarios: `tests/golden/<name>/` holds a cluster snapshot and the exact
//! `kube-proxy-rs render` output expected for it, derived by hand from upstream kube-proxy's
//! Go source (release 1.29 unless the scenario's `args` select another release with
//! `--compatibility-version`), not from this program. See `tests/golden/README.md`.
//!
//! Each scenario directory contains:
//!
//! * `args`: the command-line arguments, one per line (e.g. `--hostname-override`, `node-a`);
//! * `cluster.yaml`: the first snapshot;
//! * `config.yaml` (optional): passed as `--config`;
//! * `then-1.yaml`, `then-2.yaml`, ... (optional): later snapshots, passed as `--then` in order;
//! * `expected.rules`: the exact stdout.
//!
//! The binary is run as `kube-proxy-rs render <args> [--config config.yaml] cluster.yaml
//! [--then then-1.yaml ...]` from the scenario directory and its stdout is compared byte for
//! byte; a failing scenario is reported with a unified diff. Each scenario is its own test
//! (`golden::<name with underscores>`).
//!
//! `UPDATE_GOLDEN=1` rewrites `expected.rules` with the actual output instead of failing.
//! Only use it after reviewing the diff against the upstream Go source: the expected files
//! are the independent oracle, and regenerating them from our own output makes the test
//! meaningless for the scenarios it touches.

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use similar::TextDiff;

const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy-rs");

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join("golden")
}

/// The scenario directories, sorted by name.
fn scenarios() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = fs::read_dir(golden_dir())
        .expect("read tests/golden")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    dirs
}

/// `then-N.yaml` files of a scenario, in numeric order of N.
fn then_files(dir: &Path) -> Vec<String> {
    let mut thens: Vec<(u32, String)> = fs::read_dir(dir)
        .expect("read scenario dir")
        .filter_map(|e| {
            let name = e.expect("dir entry").file_name().into_string().ok()?;
            let n = name.strip_prefix("then-")?.strip_suffix(".yaml")?.parse().ok()?;
            Some((n, name))
        })
        .collect();
    thens.sort();
    thens.into_iter().map(|(_, name)| name).collect()
}

/// The full argument list for a scenario (paths relative to the scenario directory).
fn render_args(dir: &Path) -> Result<Vec<String>, String> {
    let args_file = dir.join("args");
    let text = fs::read_to_string(&args_file).map_err(|e| format!("cannot read {}: {e}", args_file.display()))?;
    let mut args = vec!["render".to_string()];
    args.extend(text.lines().filter(|l| !l.trim().is_empty()).map(str::to_string));
    // The scenarios reproduce release 1.29 unless their `args` name another release.
    if !args.iter().any(|a| a.starts_with("--compatibility-version")) {
        args.extend(["--compatibility-version".to_string(), "1.29".to_string()]);
    }
    if dir.join("config.yaml").is_file() {
        args.push("--config".into());
        args.push("config.yaml".into());
    }
    if !dir.join("cluster.yaml").is_file() {
        return Err(format!("{} has no cluster.yaml", dir.display()));
    }
    args.push("cluster.yaml".into());
    for then in then_files(dir) {
        args.push("--then".into());
        args.push(then);
    }
    Ok(args)
}

/// Runs one scenario; `Err` carries a readable report.
fn run_scenario(dir: &Path, update: bool) -> Result<(), String> {
    let name = dir.file_name().unwrap_or_default().to_string_lossy().into_owned();
    let args = render_args(dir)?;
    let output = Command::new(BIN)
        .args(&args)
        .current_dir(dir)
        .env("RUST_LOG", "error")
        .output()
        .map_err(|e| format!("{name}: cannot run {BIN}: {e}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    if !output.status.success() {
        return Err(format!(
            "{name}: `kube-proxy-rs {}` exited with {}\nstderr:\n{}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr)
        ));
    }

    let expected_path = dir.join("expected.rules");
    if update {
        let old = fs::read_to_string(&expected_path).unwrap_or_default();
        if old != stdout {
            fs::write(&expected_path, &stdout).map_err(|e| format!("{name}: cannot write expected.rules: {e}"))?;
            eprintln!("golden: rewrote {}", expected_path.display());
        }
        return Ok(());
    }
    let expected = fs::read_to_string(&expected_path)
        .map_err(|e| format!("{name}: cannot read {}: {e}", expected_path.display()))?;
    if expected == stdout {
        return Ok(());
    }
    let diff = TextDiff::from_lines(&expected, &stdout);
    let mut report = format!("=== golden scenario `{name}` differs (`kube-proxy-rs {}`)\n", args.join(" "));
    let _ = write!(
        report,
        "{}",
        diff.unified_diff().context_radius(3).header(&format!("{name}/expected.rules"), &format!("{name} (actual)"))
    );
    Err(report)
}

/// Runs one scenario; the diff is the panic message.
fn check(name: &str) {
    let update = std::env::var("UPDATE_GOLDEN").is_ok_and(|v| v == "1");
    if let Err(report) = run_scenario(&golden_dir().join(name), update) {
        panic!(
            "{report}\n(`-` = expected, `+` = actual. Set UPDATE_GOLDEN=1 to accept the actual \
             output ONLY after checking it against upstream.)"
        );
    }
}

/// One test per scenario, so each can be run (and fails) on its own:
/// `cargo nextest run -E 'test(golden::nodeport)'`.
macro_rules! golden_scenarios {
    ($($test:ident => $dir:literal,)*) => {
        $(
            #[test]
            fn $test() {
                check($dir);
            }
        )*

        /// Every scenario directory has its test above, and every test its directory.
        #[test]
        fn every_scenario_directory_has_a_test() {
            let listed: Vec<&str> = vec![$($dir),*];
            let found: Vec<String> =
                scenarios().iter().map(|d| d.file_name().unwrap_or_default().to_string_lossy().into_owned()).collect();
            assert_eq!(listed, found, "add new scenarios to golden_scenarios! in tests/golden.rs");
        }
    };
}

golden_scenarios! {
    bad_ips_1_31 => "bad-ips-1.31",
    canonical_addresses => "canonical-addresses",
    clusterip_probabilities => "clusterip-probabilities",
    detect_local_bridge => "detect-local-bridge",
    detect_local_cluster_cidr => "detect-local-cluster-cidr",
    detect_local_interface_prefix => "detect-local-interface-prefix",
    detect_local_node_cidr => "detect-local-node-cidr",
    duplicate_endpoints => "duplicate-endpoints",
    duplicate_endpoints_1_36 => "duplicate-endpoints-1.36",
    etp_local => "etp-local",
    external_ips => "external-ips",
    external_ips_gate_off_1_36 => "external-ips-gate-off-1.36",
    ipv6 => "ipv6",
    itp_etp_local => "itp-etp-local",
    itp_local => "itp-local",
    large_cluster => "large-cluster",
    large_cluster_threshold => "large-cluster-threshold",
    loadbalancer => "loadbalancer",
    loadbalancer_ip_mode => "loadbalancer-ip-mode",
    loadbalancer_source_ranges => "loadbalancer-source-ranges",
    localhost_nodeports_off => "localhost-nodeports-off",
    masquerade_all => "masquerade-all",
    multi_port => "multi-port",
    no_endpoints => "no-endpoints",
    nodeport => "nodeport",
    nodeport_addresses => "nodeport-addresses",
    nodeport_addresses_localhost_off => "nodeport-addresses-localhost-off",
    nodeport_addresses_loopback => "nodeport-addresses-loopback",
    nodeport_keywords_1_37 => "nodeport-keywords-1.37",
    old_iptables => "old-iptables",
    ordering_by_service_name => "ordering-by-service-name",
    partial_sync => "partial-sync",
    partial_sync_policy => "partial-sync-policy",
    service_edge_cases => "service-edge-cases",
    session_affinity => "session-affinity",
    terminating_fallback => "terminating-fallback",
    topology_hints => "topology-hints",
    topology_hints_1_31 => "topology-hints-1.31",
    topology_hints_unusable => "topology-hints-unusable",
    topology_node_hints => "topology-node-hints",
    topology_node_hints_1_33 => "topology-node-hints-1.33",
    udp_sctp => "udp-sctp",
    zero_source_range_1_35 => "zero-source-range-1.35",
}
