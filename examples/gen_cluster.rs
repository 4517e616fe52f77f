//! Writes a synthetic cluster manifest: `cargo run --release --example gen_cluster -- SERVICES ENDPOINTS_PER_SERVICE > cluster.yaml`.

// An example program prints its output.
#![allow(clippy::print_stdout)]

use kube_proxy_rs::synthetic::{self, ClusterShape};

fn main() {
    let mut args = std::env::args().skip(1);
    let services = args.next().and_then(|a| a.parse().ok()).unwrap_or(1000);
    let endpoints_per_service = args.next().and_then(|a| a.parse().ok()).unwrap_or(10);
    let cluster = synthetic::cluster(ClusterShape { services, endpoints_per_service });
    match synthetic::cluster_yaml(&cluster) {
        Ok(yaml) => print!("{yaml}"),
        Err(e) => {
            eprintln!("failed to write YAML: {e}");
            std::process::exit(1);
        }
    }
}
