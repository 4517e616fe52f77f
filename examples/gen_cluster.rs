//! Writes a synthetic cluster manifest: `cargo run --release --example gen_cluster -- SERVICES ENDPOINTS_PER_SERVICE [AFFINITY_EVERY] > cluster.yaml`
//! (every AFFINITY_EVERY-th service with ClientIP affinity; default 7, 0 for none).

// An example program prints its output.
#![allow(clippy::print_stdout)]

use kube_proxy_rs::synthetic::{self, ClusterShape};

fn main() {
    let mut args = std::env::args().skip(1);
    let services = args.next().and_then(|a| a.parse().ok()).unwrap_or(1000);
    let endpoints_per_service = args.next().and_then(|a| a.parse().ok()).unwrap_or(10);
    let mut shape = ClusterShape::new(services, endpoints_per_service);
    if let Some(every) = args.next().and_then(|a| a.parse().ok()) {
        shape.affinity_every = every;
    }
    let cluster = synthetic::cluster(shape);
    match synthetic::cluster_yaml(&cluster) {
        Ok(yaml) => print!("{yaml}"),
        Err(e) => {
            eprintln!("failed to write YAML: {e}");
            std::process::exit(1);
        }
    }
}
