//! The daemon's command line, run as the built binary: `--write-config-to` output round-trips
//! through `--config` unchanged, invalid flags and fields exit non-zero with one line per
//! problem naming the flag or field, non-iptables modes are refused, upstream's precedence
//! between `--config` and flags, and every upstream v1.29 flag is accepted. The `deploy`
//! submodule checks the manifests in deploy/.

mod deploy;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kube_proxy_rs::config;

const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy-rs");

/// A scratch directory removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("kpr-daemon-cli-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        Scratch(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    fn file(&self, name: &str, text: &str) -> PathBuf {
        let p = self.path(name);
        std::fs::write(&p, text).expect("write fixture");
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn run(args: &[&str]) -> Output {
    // RUST_LOG would change what is logged; the tests want the defaults.
    Command::new(BIN).args(args).env_remove("RUST_LOG").output().expect("run kube-proxy-rs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn arg(flag: &str, path: &Path) -> String {
    format!("{flag}={}", path.display())
}

const HEADER: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";

#[test]
fn write_config_to_round_trips_through_config() {
    let dir = Scratch::new("roundtrip");
    let first = dir.path("first.yaml");
    let flag_sets: [&[&str]; 3] = [
        &[],
        &[
            "--cluster-cidr=10.244.0.0/16,fd00:10:244::/56",
            "--masquerade-all",
            "--iptables-masquerade-bit",
            "13",
            "--iptables-sync-period=45s",
            "--iptables-min-sync-period=2s",
            "--iptables-localhost-nodeports=false",
            "--nodeport-addresses=10.0.0.0/8,fd00::/64",
            "--feature-gates=SomeGate=true",
            "--hostname-override=Node-A",
            "--kubeconfig=/var/lib/kube-proxy/kubeconfig.conf",
            "--kube-api-qps=0.5",
            "--bind-address=10.0.0.5",
            "--healthz-bind-address=10.0.0.5:10256",
            "--metrics-bind-address=[::]:10249",
            "--oom-score-adj=-998",
            "--conntrack-max-per-core=0",
            "--conntrack-udp-timeout=30s",
            "--detect-local-mode=BridgeInterface",
            "--pod-bridge-interface=cbr0",
            "-v=2",
            "--vmodule=proxier*=4",
            "--logging-format=json",
        ],
        &["--proxy-mode=iptables", "--nodeport-addresses=primary", "--show-hidden-metrics-for-version=1.36"],
    ];
    for (i, flags) in flag_sets.iter().enumerate() {
        let mut args: Vec<String> = flags.iter().map(|s| s.to_string()).collect();
        args.push(arg("--write-config-to", &first));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = run(&args);
        assert!(out.status.success(), "set {i}: {}", stderr(&out));
        assert!(out.stdout.is_empty());
        let written = std::fs::read_to_string(&first).expect("written");
        assert!(written.starts_with("apiVersion: kubeproxy.config.k8s.io/v1alpha1\n"), "{written}");
        assert!(written.contains("\nmode: iptables\n"), "set {i}: the effective mode is written: {written}");

        // Reading it back gives the same configuration, and writing that again the same bytes.
        let second = dir.path("second.yaml");
        let out = run(&[&arg("--config", &first), &arg("--write-config-to", &second)]);
        assert!(out.status.success(), "set {i}: {}", stderr(&out));
        let rewritten = std::fs::read_to_string(&second).expect("rewritten");
        assert_eq!(written, rewritten, "set {i}");
        let parsed = config::load_config_file(&first).expect("parses").into_strict().expect("strict");
        assert_eq!(parsed.clone().with_defaults(), parsed, "set {i}: the file is complete");
        assert_eq!(parsed.validate(), Ok(()), "set {i}");
    }
    let parsed = config::load_config_file(&first).expect("parses").into_strict().expect("strict");
    assert_eq!(parsed.node_port_addresses, Some(vec!["primary".to_string()]));
}

#[test]
fn write_config_to_writes_the_flags() {
    let dir = Scratch::new("flags");
    let out_path = dir.path("out.yaml");
    let out = run(&[
        "--masquerade-all",
        "--cluster-cidr",
        "10.0.0.0/8",
        "--hostname-override=Node-B",
        &arg("--write-config-to", &out_path),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let cfg = config::load_config_file(&out_path).expect("parses").into_strict().expect("strict");
    assert!(cfg.iptables.masquerade_all);
    assert_eq!(cfg.cluster_cidr, "10.0.0.0/8");
    assert_eq!(cfg.hostname_override, "node-b", "trimmed and lower-cased like upstream");
    assert_eq!(cfg.detect_local_mode, "ClusterCIDR");
}

#[test]
fn zero_values_that_defaulting_replaces_are_warned_about() {
    let dir = Scratch::new("zero");
    let out_path = dir.path("out.yaml");
    let out = run(&["--iptables-min-sync-period=0", &arg("--write-config-to", &out_path)]);
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("iptables.minSyncPeriod") && err.contains("read back"), "{err}");
    assert!(std::fs::read_to_string(&out_path).unwrap().contains("minSyncPeriod: 0s"));
}

/// Runs with `args` and returns stderr's lines, asserting exit code 1 and that each line is one
/// `kube-proxy-rs: ` message.
#[track_caller]
fn config_error_lines(args: &[&str]) -> Vec<String> {
    let out = run(args);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {}", stderr(&out));
    let lines: Vec<String> = stderr(&out).lines().map(str::to_string).collect();
    assert!(!lines.is_empty(), "{args:?}: no message");
    assert!(lines.iter().all(|l| l.starts_with("kube-proxy-rs: ")), "{args:?}: {lines:#?}");
    lines
}

#[test]
fn invalid_fields_from_flags_give_one_line_each_naming_flag_and_field() {
    let cases: &[(&[&str], &[&str])] = &[
        (&["--iptables-masquerade-bit=32"], &["iptables.masqueradeBit (--iptables-masquerade-bit): Invalid value: 32"]),
        (
            // Upstream reports both rules on syncPeriod (the second shows minSyncPeriod's value).
            &["--iptables-sync-period=0s"],
            &[
                "iptables.syncPeriod (--iptables-sync-period): Invalid value: \"0s\": must be greater than 0",
                "iptables.syncPeriod (--iptables-sync-period): Invalid value: \"1s\"",
            ],
        ),
        (&["--cluster-cidr=10.0.0.0"], &["clusterCIDR (--cluster-cidr): Invalid value: \"10.0.0.0\""]),
        (&["--nodeport-addresses=10.0.0.0/8,nope"], &["nodePortAddresses[1] (--nodeport-addresses)"]),
        (&["--oom-score-adj=-1001"], &["oomScoreAdj (--oom-score-adj)"]),
        (&["--detect-local-mode=BridgeInterface"], &["detectLocal.bridgeInterface: Invalid value: \"\""]),
        (&["--logging-format=xml"], &["logging.format (--logging-format)"]),
        (&["--conntrack-min=-1"], &["conntrack.min (--conntrack-min)"]),
        (&["--kube-api-burst=-1"], &["clientConnection.burst (--kube-api-burst)"]),
        (
            &["--show-hidden-metrics-for-version=1.20"],
            &["showHiddenMetricsForVersion (--show-hidden-metrics-for-version)"],
        ),
        (
            &["--iptables-masquerade-bit=99", "--config-sync-period=-1s", "--metrics-bind-address=10.0.0.1:0"],
            &[
                "configSyncPeriod (--config-sync-period)",
                "metricsBindAddress (--metrics-bind-address)",
                "iptables.masqueradeBit (--iptables-masquerade-bit)",
            ],
        ),
    ];
    for (args, expected) in cases {
        let lines = config_error_lines(args);
        assert_eq!(lines.len(), expected.len(), "{args:?}: one line per invalid field: {lines:#?}");
        for needle in *expected {
            assert!(lines.iter().any(|l| l.contains(needle)), "{args:?}: missing {needle:?} in {lines:#?}");
        }
    }
}

#[test]
fn unparsable_flag_values_are_one_line_naming_the_flag() {
    for (args, flag) in [
        (&["--iptables-masquerade-bit=abc"][..], "--iptables-masquerade-bit"),
        (&["--iptables-sync-period", "30"], "--iptables-sync-period"),
        (&["--bind-address=not-an-ip"], "--bind-address"),
        (&["--masquerade-all=maybe"], "--masquerade-all"),
        (&["--feature-gates=NoValue"], "--feature-gates"),
        (&["--no-such-flag"], "--no-such-flag"),
        (&["--masquerade-all", "false"], "--flag=false"),
    ] {
        let out = run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        let err = stderr(&out);
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.starts_with("kube-proxy-rs: ") && err.contains(flag), "{args:?}: {err}");
    }
}

#[test]
fn invalid_config_file_fields_name_the_file_and_field() {
    let dir = Scratch::new("badfile");
    let bad =
        dir.file("bad.yaml", &format!("{HEADER}iptables:\n  masqueradeBit: 40\nclusterCIDR: 10.0.0.0/8,10.1.0.0/16\n"));
    let lines = config_error_lines(&[&arg("--config", &bad)]);
    assert_eq!(lines.len(), 2, "{lines:#?}");
    let prefix = format!("kube-proxy-rs: {}: invalid configuration: ", bad.display());
    assert!(lines.iter().all(|l| l.starts_with(&prefix)), "{lines:#?}");
    assert!(lines.iter().any(|l| l.contains("iptables.masqueradeBit: Invalid value: 40")), "{lines:#?}");
    assert!(lines.iter().any(|l| l.contains("clusterCIDR: Invalid value")), "{lines:#?}");

    // Decode errors name the file, the line and the field.
    let wrong_type = dir.file("wrong-type.yaml", &format!("{HEADER}iptables:\n  masqueradeBit: many\n"));
    let lines = config_error_lines(&[&arg("--config", &wrong_type)]);
    assert_eq!(lines.len(), 1, "{lines:#?}");
    assert!(lines[0].contains(&format!("{}:4:", wrong_type.display())), "{lines:#?}");
    assert!(lines[0].contains("iptables.masqueradeBit: invalid type"), "{lines:#?}");

    // An unknown field is not fatal (upstream decodes leniently): a warning names the file
    // and the field, and the configuration is used (here written out).
    let unknown = dir.file("unknown.yaml", &format!("{HEADER}iptables:\n  masqueradeBits: 3\n  syncPeriod: 7s\n"));
    let written = dir.path("written.yaml");
    let out = run(&[&arg("--config", &unknown), &arg("--write-config-to", &written)]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let cfg = config::load_config_file(&written).expect("parses").into_strict().expect("strict");
    assert_eq!(cfg.iptables.sync_period.to_string(), "7s");
    let err = stderr(&out);
    let warning = err
        .lines()
        .find(|l| l.contains("WARN") && l.contains("Using lenient decoding as strict decoding failed"))
        .unwrap_or_else(|| panic!("no lenient-decoding warning:\n{err}"));
    assert!(warning.contains(&unknown.display().to_string()), "{warning}");
    assert!(warning.contains(r#"unknown field "iptables.masqueradeBits""#), "{warning}");
    assert!(!err.contains("invalid configuration"), "{err}");

    let missing = dir.path("missing.yaml");
    let lines = config_error_lines(&[&arg("--config", &missing)]);
    assert!(lines[0].contains("--config") && lines[0].contains("missing.yaml"), "{lines:#?}");

    let lines = config_error_lines(&["--hostname-override=   "]);
    assert_eq!(lines, ["kube-proxy-rs: --hostname-override: empty hostname-override is invalid"]);
}

#[test]
fn modes_other_than_iptables_and_nftables_are_refused() {
    let dir = Scratch::new("modes");
    for mode in ["ipvs", "kernelspace", "userspace"] {
        let lines = config_error_lines(&[&format!("--proxy-mode={mode}")]);
        assert_eq!(lines.len(), 1, "{lines:#?}");
        assert!(lines[0].contains(&format!("mode (--proxy-mode): Invalid value: \"{mode}\"")), "{lines:#?}");
        assert!(lines[0].contains("iptables"), "{lines:#?}");

        let file = dir.file("mode.yaml", &format!("{HEADER}mode: {mode}\n"));
        let lines = config_error_lines(&[&arg("--config", &file)]);
        assert!(lines[0].contains(&format!("mode: Invalid value: \"{mode}\"")), "{lines:#?}");
    }
    let lines = config_error_lines(&["--proxy-mode=ipvs"]);
    assert!(lines[0].contains("the iptables and nftables proxy modes"), "{lines:#?}");
    // nftables mode needs a release that has it.
    let lines = config_error_lines(&["--proxy-mode=nftables", "--compatibility-version=1.30"]);
    assert!(lines[0].contains("releases 1.31 and later"), "{lines:#?}");
    // Also refused when it would only be written out.
    let out_path = dir.path("never.yaml");
    config_error_lines(&["--proxy-mode=ipvs", &arg("--write-config-to", &out_path)]);
    assert!(!out_path.exists(), "nothing is written for an invalid configuration");
}

#[test]
fn config_file_takes_precedence_over_config_flags() {
    let dir = Scratch::new("precedence");
    let file = dir.file(
        "config.yaml",
        &format!("{HEADER}clusterCIDR: 10.0.0.0/8\nhostnameOverride: from-file\niptables:\n  masqueradeBit: 3\nlogging:\n  verbosity: 1\n"),
    );
    let out_path = dir.path("out.yaml");
    let out = run(&[
        &arg("--config", &file),
        "--cluster-cidr=192.168.0.0/16",
        "--masquerade-all",
        "--iptables-masquerade-bit=99",
        "--proxy-mode=ipvs",
        "--hostname-override=From-Flag",
        "-v",
        "3",
        &arg("--write-config-to", &out_path),
    ]);
    assert!(out.status.success(), "ignored flags are not validated either: {}", stderr(&out));
    let err = stderr(&out);
    let warning = err.lines().find(|l| l.contains("ignored because --config is given")).unwrap_or_default();
    for flag in ["--cluster-cidr", "--masquerade-all", "--iptables-masquerade-bit", "--proxy-mode"] {
        assert!(warning.contains(flag), "the ignored {flag} is named in a warning: {err}");
    }
    assert!(!warning.contains("--hostname-override") && !warning.contains("--v"), "{warning}");
    let cfg = config::load_config_file(&out_path).expect("parses").into_strict().expect("strict");
    assert_eq!(cfg.cluster_cidr, "10.0.0.0/8");
    assert!(!cfg.iptables.masquerade_all);
    assert_eq!(cfg.iptables.masquerade_bit, Some(3));
    assert_eq!(cfg.mode, "iptables");
    assert_eq!(cfg.hostname_override, "from-flag", "--hostname-override beats the file");
    assert_eq!(cfg.logging.verbosity, 3, "logging flags beat the file");
}

/// A kubeconfig (or its token file or CA) that cannot be read is an error naming it, logged
/// and retried (the kubelet may not have projected the files yet), never a silent crash loop;
/// SIGTERM still stops the process at once.
#[test]
fn daemon_without_a_cluster_fails_clearly_after_validating() {
    use std::io::{BufRead, BufReader};
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kube-proxy-rs"))
        .args(["--masquerade-all", "--kubeconfig", "/nonexistent/kubeconfig"])
        .env_remove("RUST_LOG")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run");
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr_pipe = child.stderr.take().expect("stderr");
    std::thread::spawn(move || {
        for line in BufReader::new(stderr_pipe).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut errors = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while errors.len() < 2 && std::time::Instant::now() < deadline {
        if let Ok(line) = rx.recv_timeout(std::time::Duration::from_millis(200))
            && line.contains("ERROR")
        {
            errors.push(line);
        }
    }
    let still_running = child.try_wait().expect("wait").is_none();
    let _ = std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    let status = child.wait().expect("wait");
    assert_eq!(errors.len(), 2, "an error per attempt, and a retry: {errors:#?}");
    for line in &errors {
        assert!(line.contains("failed to create the Kubernetes client"), "{line}");
        assert!(line.contains("/nonexistent/kubeconfig") && line.contains("retry"), "{line}");
    }
    assert!(still_running, "retrying, not exiting");
    assert_eq!(status.code(), Some(0), "SIGTERM ends the retries");
    // The configuration is checked first, as upstream does before anything else.
    assert_eq!(run(&["--iptables-masquerade-bit=40"]).status.code(), Some(1));
    assert_eq!(run(&["--cleanup", "--iptables-masquerade-bit=40"]).status.code(), Some(1));
}

/// Every flag upstream kube-proxy v1.29 registers on Linux (cmd/kube-proxy/app/server.go
/// `AddFlags` plus component-base's logging flags; `--version` and `--help` too).
const UPSTREAM_FLAGS: &[&str] = &[
    "bind-address",
    "bind-address-hard-fail",
    "cleanup",
    "cluster-cidr",
    "config",
    "config-sync-period",
    "conntrack-max-per-core",
    "conntrack-min",
    "conntrack-tcp-be-liberal",
    "conntrack-tcp-timeout-close-wait",
    "conntrack-tcp-timeout-established",
    "conntrack-udp-timeout",
    "conntrack-udp-timeout-stream",
    "detect-local-mode",
    "feature-gates",
    "healthz-bind-address",
    "healthz-port",
    "hostname-override",
    "init-only",
    "iptables-localhost-nodeports",
    "iptables-masquerade-bit",
    "iptables-min-sync-period",
    "iptables-sync-period",
    "ipvs-exclude-cidrs",
    "ipvs-min-sync-period",
    "ipvs-scheduler",
    "ipvs-strict-arp",
    "ipvs-sync-period",
    "ipvs-tcp-timeout",
    "ipvs-tcpfin-timeout",
    "ipvs-udp-timeout",
    "kube-api-burst",
    "kube-api-content-type",
    "kube-api-qps",
    "kubeconfig",
    "log-flush-frequency",
    "logging-format",
    "masquerade-all",
    "master",
    "metrics-bind-address",
    "metrics-port",
    "nodeport-addresses",
    "oom-score-adj",
    "pod-bridge-interface",
    "pod-interface-name-prefix",
    "profiling",
    "proxy-mode",
    "proxy-port-range",
    "show-hidden-metrics-for-version",
    "v",
    "vmodule",
    "write-config-to",
];

#[test]
fn every_upstream_flag_is_listed_in_help() {
    let out = run(&["--help"]);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in UPSTREAM_FLAGS {
        let needle = format!("--{flag}");
        let listed = help
            .split(|c: char| c.is_whitespace() || c == '[' || c == ',')
            .any(|w| w == needle || w.starts_with(&format!("{needle}=")) || w.starts_with(&format!("{needle}[")));
        assert!(listed, "--{flag} missing from --help:\n{help}");
    }
}

#[test]
fn typical_upstream_command_lines_are_accepted() {
    let dir = Scratch::new("upstream-args");
    let file = dir.file("config.conf", &format!("{HEADER}mode: iptables\n"));
    let out_path = dir.path("out.yaml");
    // kubeadm's DaemonSet arguments, and an old-style flags-only command line.
    let lines: [Vec<String>; 2] = [
        vec![arg("--config", &file), "--hostname-override=node-a".into()],
        [
            "--master=https://10.0.0.1:6443",
            "--kubeconfig=/var/lib/kube-proxy/kubeconfig",
            "--proxy-mode=iptables",
            "--masquerade-all",
            "--v=2",
            "--healthz-port=10256",
            "--metrics-port=0",
            "--proxy-port-range=30000-32767",
            "--ipvs-scheduler=rr",
            "--ipvs-exclude-cidrs=10.0.0.0/8",
            "--ipvs-strict-arp=false",
            "--conntrack-tcp-be-liberal=false",
            "--log-flush-frequency=5s",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
    ];
    for line in lines {
        let mut args: Vec<&str> = line.iter().map(String::as_str).collect();
        let target = arg("--write-config-to", &out_path);
        args.push(&target);
        let out = run(&args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
    }
    let cfg = config::load_config_file(&out_path).expect("parses").into_strict().expect("strict");
    assert_eq!(cfg.metrics_bind_address, "127.0.0.1:10249", "--metrics-port is ignored with --write-config-to");
    assert_eq!(cfg.port_range, "30000-32767");
    assert_eq!(cfg.ipvs.exclude_cidrs, Some(vec!["10.0.0.0/8".to_string()]));
}
