//! Applies a restore input to a network namespace the way the daemon's first sync does on
//! iptables-nft (reordered and cut into pieces by `restore_plan`), and reports the time per budget:
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
    let mut ordered = Vec::new();
    if let Err(e) = restore_plan::write_dependency_ordered(&data, &mut ordered) {
        eprintln!("{payload}: {e}");
        std::process::exit(1);
    }
    let planned = started.elapsed();
    let mut slowest = Duration::ZERO;
    let mut cutter = restore_plan::Cutter::new(budget, |piece: &restore_plan::Piece<'_>| {
        let t = Instant::now();
        let mut child = Command::new("ip")
            .args(["netns", "exec", netns, restore_bin, "--noflush", "--counters"])
            .stdin(Stdio::piped())
            .spawn()
            .expect("spawn restore");
        child.stdin.take().expect("stdin").write_all(piece.text).expect("write piece");
        let status = child.wait().expect("wait restore");
        if !status.success() {
            eprintln!("the piece starting at line {} failed", piece.input_line(1));
            std::process::exit(1);
        }
        slowest = slowest.max(t.elapsed());
        Ok(())
    });
    cutter.write_all(&ordered).expect("cut");
    let pieces = cutter.finish().expect("cut");
    println!(
        "budget {budget}: {pieces} pieces, total {:.2} s (ordering {:.2} s), slowest piece {:.2} s",
        started.elapsed().as_secs_f64(),
        planned.as_secs_f64(),
        slowest.as_secs_f64()
    );
}
