//! Applies a restore input to a network namespace the way the daemon's first sync does on
//! iptables-nft (split into pieces by `restore_plan`), and reports the time per budget:
//! the tool used to choose `restore_plan::DEFAULT_BUDGET` (docs/performance.md).
//!
//!     cargo run --release --example split_restore -- PAYLOAD NETNS BUDGET [RESTORE_BIN]
//!
//! The namespace should hold what the daemon creates before its first restore (the
//! top-level chains and the jumps to them from the built-in chains).

// An example program prints its output.
#![allow(clippy::print_stdout)]

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kube_proxy_rs::iptables::restore_plan;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [payload, netns, budget, rest @ ..] = args.as_slice() else {
        eprintln!("usage: split_restore PAYLOAD NETNS BUDGET [RESTORE_BIN]");
        std::process::exit(2);
    };
    let restore_bin = rest.first().map_or("iptables-nft-restore", String::as_str);
    let data = std::fs::read(payload).unwrap_or_else(|e| {
        eprintln!("reading {payload}: {e}");
        std::process::exit(1);
    });
    let budget: u64 = budget.parse().unwrap_or_else(|e| {
        eprintln!("budget {budget:?}: {e}");
        std::process::exit(2);
    });
    let started = Instant::now();
    let texts: Vec<Vec<u8>> = match restore_plan::split(&data, budget) {
        Some(plan) => plan.pieces.iter().map(|p| plan.text(p)).collect(),
        None => vec![data.clone()],
    };
    let planned = started.elapsed();
    let mut slowest = Duration::ZERO;
    for (i, text) in texts.iter().enumerate() {
        let t = Instant::now();
        let mut child = Command::new("ip")
            .args(["netns", "exec", netns, restore_bin, "--noflush", "--counters"])
            .stdin(Stdio::piped())
            .spawn()
            .expect("spawn restore");
        child.stdin.take().expect("stdin").write_all(text).expect("write piece");
        let status = child.wait().expect("wait restore");
        if !status.success() {
            eprintln!("piece {i} failed");
            std::process::exit(1);
        }
        slowest = slowest.max(t.elapsed());
    }
    println!(
        "budget {budget}: {} pieces, total {:.2} s (planning {:.2} s), slowest piece {:.2} s",
        texts.len(),
        started.elapsed().as_secs_f64(),
        planned.as_secs_f64(),
        slowest.as_secs_f64()
    );
}
