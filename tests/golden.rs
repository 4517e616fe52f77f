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
//! byte; every failing scenario is reported with a unified diff.
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

#[test]
fn golden_scenarios() {
    let update = std::env::var("UPDATE_GOLDEN").is_ok_and(|v| v == "1");
    let dirs = scenarios();
    assert!(!dirs.is_empty(), "no scenarios under {}", golden_dir().display());
    let mut failures = Vec::new();
    for dir in &dirs {
        if let Err(report) = run_scenario(dir, update) {
            failures.push((dir.file_name().unwrap_or_default().to_string_lossy().into_owned(), report));
        }
    }
    if !failures.is_empty() {
        for (_, report) in &failures {
            eprintln!("{report}");
        }
        let names: Vec<&str> = failures.iter().map(|(n, _)| n.as_str()).collect();
        panic!(
            "{} of {} golden scenarios failed: {}\n(diffs above; `-` = expected, `+` = actual. \
             Set UPDATE_GOLDEN=1 to accept the actual output ONLY after checking it against upstream.)",
            failures.len(),
            dirs.len(),
            names.join(", ")
        );
    }
}
