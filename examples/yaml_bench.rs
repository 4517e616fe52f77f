//! Times loading a manifest file three ways, to justify `src/manifest/fast.rs` (see the
//! module docs of `src/manifest.rs`): our loader (fast converter + serde_json, typed objects),
//! serde_yaml into untyped values, and serde-saphyr into untyped values and into typed objects.
//!
//!     cargo run --release --example gen_cluster -- 10000 10 > /tmp/c.yaml
//!     cargo run --release --example yaml_bench -- /tmp/c.yaml
#![allow(clippy::print_stdout)]

use std::time::{Duration, Instant};

#[derive(serde::Deserialize)]
#[serde(tag = "kind")]
#[allow(dead_code)]
enum Obj {
    Service(Box<k8s_openapi::api::core::v1::Service>),
    EndpointSlice(Box<k8s_openapi::api::discovery::v1::EndpointSlice>),
    Node(Box<k8s_openapi::api::core::v1::Node>),
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let path = std::env::args().nth(1).expect("usage: yaml_bench MANIFEST");
    let text = std::fs::read_to_string(&path).expect("read manifest");
    let (mut ours, mut yaml, mut saphyr_value, mut saphyr_typed) = (vec![], vec![], vec![], vec![]);
    let unlimited = || serde_saphyr::options! { budget: None };
    for _ in 0..3 {
        let t = Instant::now();
        let (snapshot, _) = kube_proxy_rs::manifest::load_manifest_str(&text, std::path::Path::new(&path)).unwrap();
        ours.push(t.elapsed());
        assert!(!snapshot.services.is_empty());
        let t = Instant::now();
        let docs: Vec<serde_json::Value> =
            serde_yaml::Deserializer::from_str(&text).map(|d| serde::Deserialize::deserialize(d).unwrap()).collect();
        yaml.push(t.elapsed());
        assert!(!docs.is_empty());
        let t = Instant::now();
        let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple_with_options(&text, unlimited()).unwrap();
        saphyr_value.push(t.elapsed());
        assert!(!docs.is_empty());
        let t = Instant::now();
        let typed: Vec<Obj> = serde_saphyr::from_multiple_with_options(&text, unlimited()).unwrap();
        saphyr_typed.push(t.elapsed());
        assert!(!typed.is_empty());
    }
    println!(
        "{} MB, medians of 3: ours {:?}, serde_yaml (values) {:?}, serde-saphyr (values) {:?}, serde-saphyr (typed) {:?}",
        text.len() / 1_000_000,
        median(ours),
        median(yaml),
        median(saphyr_value),
        median(saphyr_typed)
    );
}
