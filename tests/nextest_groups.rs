//! Tests that drive the real kernel (network namespaces, iptables, conntrack) run one at a
//! time in nextest's `real-kernel` group, chosen by a test-name filter in
//! `.config/nextest.toml`. A filter by name silently misses a new module that does not
//! happen to match it; this check ties the filter to what the modules do: every module of
//! the integration binary that needs root or a network namespace must match the filter.

use std::path::Path;

/// What a module that touches the real kernel contains.
const REAL_KERNEL_MARKERS: &[&str] = &["require_root!(", "Netns::", "netns::", "ip netns"];

/// The regex inside `filter = 'test(/…/)'` of the `real-kernel` override.
fn real_kernel_filter(config: &str) -> regex::Regex {
    let line =
        config.lines().find(|l| l.trim_start().starts_with("filter")).expect(".config/nextest.toml has a filter line");
    let start = line.find("test(/").expect("filter is test(/regex/)") + "test(/".len();
    let end = line.rfind("/)").expect("filter is test(/regex/)");
    regex::Regex::new(&line[start..end]).expect("the filter is a valid regex")
}

/// The modules (of `integration.rs`'s `mod` lines) that touch the real kernel but whose tests
/// the filter does not select.
fn unselected(filter: &regex::Regex, modules: &[(String, String)]) -> Vec<String> {
    modules
        .iter()
        .filter(|(_, text)| REAL_KERNEL_MARKERS.iter().any(|m| text.contains(m)))
        .filter(|(name, _)| !filter.is_match(&format!("{name}::some_test")))
        .map(|(name, _)| name.clone())
        .collect()
}

fn integration_modules(tests: &Path) -> Vec<(String, String)> {
    let main = std::fs::read_to_string(tests.join("integration.rs")).expect("tests/integration.rs");
    main.lines()
        .filter_map(|l| l.strip_prefix("mod ")?.strip_suffix(';'))
        // support is shared code, not tests; this module names the markers itself.
        .filter(|name| !["support", "nextest_groups"].contains(name))
        .map(|name| {
            let file = tests.join(format!("{name}.rs"));
            let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            (name.to_string(), text)
        })
        .collect()
}

#[test]
fn every_real_kernel_module_runs_in_the_serial_group() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = std::fs::read_to_string(root.join(".config/nextest.toml")).expect(".config/nextest.toml");
    let filter = real_kernel_filter(&config);
    let modules = integration_modules(&root.join("tests"));
    assert!(modules.len() > 20, "found the integration modules: {}", modules.len());
    let real = modules.iter().filter(|(_, t)| REAL_KERNEL_MARKERS.iter().any(|m| t.contains(m))).count();
    assert!(real >= 10, "found the real-kernel modules: {real}");
    let missing = unselected(&filter, &modules);
    assert!(
        missing.is_empty(),
        "modules touching the real kernel that .config/nextest.toml's real-kernel filter does not select \
         (add them to the filter): {missing:?}"
    );
}

#[test]
fn the_check_finds_a_real_kernel_module_outside_the_filter() {
    let filter = real_kernel_filter("filter = 'test(/iptables_real|^e2e_/)'\n");
    let modules = vec![
        ("iptables_real".to_string(), "require_root!();".to_string()),
        ("e2e_new".to_string(), "let ns = Netns::new();".to_string()),
        ("new_kernel_test".to_string(), "let ns = netns::create();".to_string()),
        ("pure".to_string(), "assert_eq!(1, 1);".to_string()),
    ];
    assert_eq!(unselected(&filter, &modules), vec!["new_kernel_test".to_string()]);
}
