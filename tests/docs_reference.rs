//! The operator reference docs cannot silently go stale: every flag the CLI accepts, every
//! configuration field and every registered metric must be listed in docs/, and nothing may be
//! listed there that no longer exists.
//!
//! The lists are read from the docs' Markdown tables: the "Flag" column of
//! docs/configuration.md (split at each "## The `X` command" heading, one part per
//! subcommand), its "Field" column, and the "Metric" column of docs/metrics.md. The code side
//! comes from the library itself: the clap `Command` behind `Cli`, the effective default
//! configuration serialized with `to_yaml`, and the metrics registry.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, UNIX_EPOCH};

use clap::CommandFactory;
use kube_proxy_rs::cmd::cli::{Cli, DaemonArgs};
use kube_proxy_rs::cmd::options;
use kube_proxy_rs::compat::Release;
use kube_proxy_rs::config::{KubeProxyConfiguration, OutputRouting, Quantity, VModuleItem};
use kube_proxy_rs::metrics::Metrics;
use kube_proxy_rs::model::IpFamily;
use kube_proxy_rs::proxier::{RenderStats, SyncReport};
use kube_proxy_rs::tracker::{EndpointsUpdateResult, ServiceUpdateResult};
use prometheus::proto::MetricType;

fn read_doc(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// One Markdown table: its header cells and body rows (cells trimmed).
struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

fn split_row(line: &str) -> Vec<String> {
    let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
    inner.split('|').map(|c| c.trim().to_string()).collect()
}

/// The tables of `md`: runs of lines starting with `|`, the second being the `---` separator.
fn tables(md: &str) -> Vec<Table> {
    let mut out = Vec::new();
    let mut block: Vec<&str> = Vec::new();
    for line in md.lines().chain(std::iter::once("")) {
        if line.starts_with('|') {
            block.push(line);
            continue;
        }
        if block.len() >= 2 && block[1].contains("---") {
            let header = split_row(block[0]);
            let rows: Vec<Vec<String>> = block[2..].iter().map(|l| split_row(l)).collect();
            for (i, row) in rows.iter().enumerate() {
                assert_eq!(row.len(), header.len(), "table {header:?}: row {i} has {} cells: {row:?}", row.len());
            }
            out.push(Table { header, rows });
        }
        block.clear();
    }
    out
}

/// The cells of every table's column named `header`.
fn column(md: &str, header: &str) -> Vec<String> {
    let mut cells = Vec::new();
    for table in tables(md) {
        if let Some(i) = table.header.iter().position(|h| h == header) {
            cells.extend(table.rows.into_iter().map(|mut r| r.swap_remove(i)));
        }
    }
    cells
}

/// The `code spans` of a cell, in order.
fn code_spans(cell: &str) -> Vec<String> {
    cell.split('`').skip(1).step_by(2).map(str::to_string).collect()
}

fn report(what: &str, missing: &BTreeSet<String>, stale: &BTreeSet<String>) -> Option<String> {
    if missing.is_empty() && stale.is_empty() {
        return None;
    }
    Some(format!("{what}:\n  missing from the docs: {missing:?}\n  documented but not in the code: {stale:?}"))
}

fn compare(what: &str, code: &BTreeSet<String>, docs: &BTreeSet<String>) {
    let missing: BTreeSet<String> = code.difference(docs).cloned().collect();
    let stale: BTreeSet<String> = docs.difference(code).cloned().collect();
    if let Some(msg) = report(what, &missing, &stale) {
        panic!("{msg}");
    }
}

// ---- Flags ---------------------------------------------------------------------------------

/// Every flag spelling a command accepts: `--long` and `-s` (help and version included).
fn accepted_flags(cmd: &clap::Command) -> BTreeSet<String> {
    let mut flags = BTreeSet::new();
    for arg in cmd.get_arguments().filter(|a| !a.is_positional()) {
        if let Some(long) = arg.get_long() {
            flags.insert(format!("--{long}"));
        }
        if let Some(short) = arg.get_short() {
            flags.insert(format!("-{short}"));
        }
    }
    flags
}

/// Flags named in the "Flag" column of a part of configuration.md.
fn documented_flags(part: &str) -> BTreeSet<String> {
    column(part, "Flag").iter().flat_map(|cell| code_spans(cell)).filter(|span| span.starts_with('-')).collect()
}

/// configuration.md split into the daemon's part and one part per subcommand heading
/// (`## The \`NAME\` command`), up to the next `## ` heading.
fn doc_parts(md: &str) -> (String, BTreeMap<String, String>) {
    let mut daemon = String::new();
    let mut subcommands: BTreeMap<String, String> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in md.lines() {
        if let Some(heading) = line.strip_prefix("## ") {
            current = heading.strip_prefix("The `").and_then(|rest| rest.strip_suffix("` command")).map(str::to_string);
        }
        let target = match &current {
            Some(name) => subcommands.entry(name.clone()).or_default(),
            None => &mut daemon,
        };
        target.push_str(line);
        target.push('\n');
    }
    (daemon, subcommands)
}

#[test]
fn every_flag_is_documented() {
    let md = read_doc("configuration.md");
    let (daemon_part, subcommand_parts) = doc_parts(&md);
    let mut cmd = Cli::command();
    cmd.build();

    compare("daemon flags (docs/configuration.md)", &accepted_flags(&cmd), &documented_flags(&daemon_part));

    let subcommands: BTreeSet<String> =
        cmd.get_subcommands().map(|s| s.get_name().to_string()).filter(|n| n != "help").collect();
    assert!(subcommands.contains("render"), "{subcommands:?}");
    let documented: BTreeSet<String> = subcommand_parts.keys().cloned().collect();
    compare("subcommand sections (## The `NAME` command)", &subcommands, &documented);
    for name in &subcommands {
        let sub = cmd.find_subcommand(name).expect("listed above");
        compare(
            &format!("`{name}` flags (docs/configuration.md)"),
            &accepted_flags(sub),
            &documented_flags(&subcommand_parts[name]),
        );
    }
}

// ---- Configuration fields --------------------------------------------------------------

/// Leaf field paths of a serialized configuration (`iptables.syncPeriod`). Lists and the
/// `featureGates` map are leaves: their entries are values, not fields.
fn leaf_paths(value: &serde_yaml::Value, prefix: &str, out: &mut BTreeSet<String>) {
    let serde_yaml::Value::Mapping(map) = value else {
        out.insert(prefix.to_string());
        return;
    };
    for (key, child) in map {
        let key = key.as_str().expect("string keys");
        let path = if prefix.is_empty() { key.to_string() } else { format!("{prefix}.{key}") };
        if path == "featureGates" {
            out.insert(path);
        } else {
            leaf_paths(child, &path, out);
        }
    }
}

fn fields_of(cfg: &KubeProxyConfiguration) -> BTreeSet<String> {
    let yaml: serde_yaml::Value = serde_yaml::from_str(&cfg.to_yaml()).expect("to_yaml output parses");
    let mut paths = BTreeSet::new();
    leaf_paths(&yaml, "", &mut paths);
    paths
}

/// The effective configuration with no flags: what `--write-config-to` writes.
fn effective_defaults() -> KubeProxyConfiguration {
    options::resolve(&DaemonArgs::default(), None).expect("defaults are valid")
}

/// The defaults plus a value in every field that `to_yaml` omits when empty, so that every
/// field the file format has shows up.
fn every_field_set() -> KubeProxyConfiguration {
    let mut cfg = effective_defaults();
    cfg.feature_gates.insert("SomeGate".into(), true);
    cfg.compatibility_version = "1.31".into();
    cfg.windows_run_as_service = true;
    cfg.logging.vmodule = Some(vec![VModuleItem { file_pattern: "proxier*".into(), verbosity: 4 }]);
    cfg.logging.options.json.split_stream = true;
    cfg.logging.options.text = Some(OutputRouting { split_stream: true, info_buffer_size: Some(Quantity("0".into())) });
    cfg
}

fn documented_fields() -> BTreeSet<String> {
    let md = read_doc("configuration.md");
    column(&md, "Field")
        .iter()
        .map(|cell| {
            code_spans(cell).into_iter().next().unwrap_or_else(|| panic!("Field cell without `path`: {cell:?}"))
        })
        .collect()
}

#[test]
fn every_default_config_field_is_documented() {
    let defaults = fields_of(&effective_defaults());
    assert!(defaults.len() > 50, "walked too few fields: {defaults:?}");
    assert!(defaults.contains("iptables.masqueradeBit") && defaults.contains("logging.options.json.infoBufferSize"));
    let missing: BTreeSet<String> = defaults.difference(&documented_fields()).cloned().collect();
    assert!(missing.is_empty(), "fields of the default configuration missing from docs/configuration.md: {missing:?}");
}

#[test]
fn documented_fields_are_exactly_the_file_format() {
    let all = fields_of(&every_field_set());
    assert!(all.is_superset(&fields_of(&effective_defaults())));
    compare("configuration fields (docs/configuration.md)", &all, &documented_fields());
}

// ---- Metrics -----------------------------------------------------------------------------

/// A metrics registry of `release` in which every collector has been written, so that
/// `gather` lists the labelled ones too.
fn exercised_metrics(release: Release) -> Metrics {
    let m = Metrics::new(release).expect("metrics");
    // Both accounting objects exist and have counted (registered from 1.31 only).
    let nfacct = kube_proxy_rs::node::nfacct::FakeNfacct::new();
    for object in [
        kube_proxy_rs::node::nfacct::CT_STATE_INVALID_DROPPED,
        kube_proxy_rs::node::nfacct::LOCALHOST_NODEPORTS_ACCEPTED,
    ] {
        kube_proxy_rs::node::nfacct::Nfacct::ensure(&nfacct, object).expect("fake object");
        nfacct.count(object, 1);
    }
    let nfacct: std::sync::Arc<dyn kube_proxy_rs::node::nfacct::Nfacct> = std::sync::Arc::new(nfacct);
    m.register_nfacct(&nfacct).expect("nfacct collectors");
    m.service_update_observed(1);
    m.endpoint_slice_update_observed(true);
    m.sync_queued(IpFamily::V4, UNIX_EPOCH + Duration::from_secs(1));
    m.restore_failed(IpFamily::V4);
    m.healthz_answered(200);
    m.livez_answered(200);
    let mut sync = SyncReport {
        full: true,
        payload: None,
        stats: RenderStats { nat_rules: 3, filter_rules: 1, ..RenderStats::default() },
        service_update: ServiceUpdateResult::default(),
        endpoints_update: EndpointsUpdateResult::default(),
        result: Ok(()),
        retry_after: None,
        elapsed: Duration::from_millis(2),
        service_health: None,
        conntrack_cleanup: None,
    };
    m.record_sync(IpFamily::V4, &sync, sync.elapsed, UNIX_EPOCH + Duration::from_secs(2));
    // A conntrack reconciler run, so its metrics (1.33+) have a series.
    use kube_proxy_rs::node::conntrack::cleaner::{CleanupOutcome, CleanupRun};
    m.record_conntrack_cleanup(&CleanupRun {
        family: IpFamily::V4,
        elapsed: Duration::from_millis(1),
        outcome: CleanupOutcome::Reconciled(kube_proxy_rs::node::conntrack::ReconcileSummary {
            listed: true,
            entries: 1,
            stale: 1,
            deleted: 1,
            ..Default::default()
        }),
    });
    // A failed partial sync, so the partial-failure counter has a series in every release.
    sync.full = false;
    sync.result = Err(kube_proxy_rs::proxier::SyncError::Restore {
        source: kube_proxy_rs::iptables::IptablesError::RestoreLine {
            command: "iptables-restore".into(),
            line: 1,
            output: String::new(),
            context: String::new(),
        },
        context: String::new(),
    });
    m.record_sync(IpFamily::V4, &sync, sync.elapsed, UNIX_EPOCH + Duration::from_secs(3));
    m
}

/// nftables mode's registry of `release` after a failed sync whose stale-chain cleanup failed
/// too, so both of its counters have a series.
fn exercised_nftables_metrics(release: Release) -> Metrics {
    use kube_proxy_rs::nftables::{Family, NftError};
    use kube_proxy_rs::proxier::nftables::{NftSyncError, NftSyncReport};
    let m = Metrics::for_mode(release, kube_proxy_rs::config::ProxyMode::Nftables).expect("metrics");
    let report = NftSyncReport {
        full: true,
        transaction: None,
        stats: Default::default(),
        service_update: ServiceUpdateResult::default(),
        endpoints_update: EndpointsUpdateResult::default(),
        result: Err(NftSyncError::Transaction {
            source: NftError::Rejected { family: Family::Ip, message: "refused".into() },
        }),
        retry_after: None,
        elapsed: Duration::from_millis(2),
        stale_chain_cleanup_failed: true,
        service_health: None,
        conntrack_cleanup: None,
    };
    m.record_nftables_sync(IpFamily::V4, &report, UNIX_EPOCH + Duration::from_secs(2));
    m
}

fn type_name(t: MetricType) -> &'static str {
    match t {
        MetricType::COUNTER => "counter",
        MetricType::GAUGE => "gauge",
        MetricType::HISTOGRAM => "histogram",
        MetricType::SUMMARY => "summary",
        MetricType::UNTYPED => "untyped",
    }
}

#[test]
fn every_metric_is_documented() {
    // Every metric of any release: 1.29's, and the newest's (which adds the accounting counters).
    let mut families = exercised_metrics(Release::V1_29).registry().gather();
    families.extend(exercised_metrics(Release::NEWEST).registry().gather());
    families.extend(exercised_nftables_metrics("1.31".parse().expect("release")).registry().gather());
    // Stable: where both releases have a metric, 1.29's (unlabelled) one is kept.
    families.sort_by(|a, b| a.name().cmp(b.name()));
    families.dedup_by(|later, first| later.name() == first.name());
    let code: BTreeSet<String> = families.iter().map(|f| f.name().to_string()).collect();
    assert!(code.len() >= 19, "{code:?}");

    let md = read_doc("metrics.md");
    let table = tables(&md)
        .into_iter()
        .find(|t| t.header.first().is_some_and(|h| h == "Metric"))
        .expect("docs/metrics.md has a table whose first column is Metric");
    let col = |name: &str| table.header.iter().position(|h| h == name).unwrap_or_else(|| panic!("no {name} column"));
    let (type_col, labels_col, family_col) = (col("Type"), col("Labels"), col("`ip_family` from 1.33"));
    let mut docs = BTreeMap::new();
    let mut by_family = BTreeMap::new();
    for row in &table.rows {
        let name = code_spans(&row[0]).into_iter().next().unwrap_or_else(|| panic!("Metric cell: {:?}", row[0]));
        docs.insert(name.clone(), (row[type_col].clone(), code_spans(&row[labels_col]).into_iter().next()));
        by_family.insert(name, row[family_col].trim() == "yes");
    }
    compare("metrics (docs/metrics.md)", &code, &docs.keys().cloned().collect());

    for family in &families {
        let (doc_type, doc_label) = &docs[family.name()];
        assert_eq!(doc_type, type_name(family.get_field_type()), "{}: Type column", family.name());
        let labels: Vec<&str> = family.get_metric()[0].get_label().iter().map(|l| l.name()).collect();
        assert_eq!(
            labels,
            doc_label.iter().map(String::as_str).collect::<Vec<_>>(),
            "{}: Labels column",
            family.name()
        );
    }

    // From 1.33 the metrics marked `yes` carry ip_family, the others keep their labels.
    for family in exercised_metrics(Release::NEWEST).registry().gather() {
        let labels: Vec<&str> = family.get_metric()[0].get_label().iter().map(|l| l.name()).collect();
        assert_eq!(
            labels.contains(&"ip_family"),
            by_family[family.name()],
            "{}: `ip_family` from 1.33 column ({labels:?})",
            family.name()
        );
    }
}

// ---- Links between the docs -----------------------------------------------------------------

/// GitHub's anchor for a heading: lower-cased, punctuation other than `-` and `_` dropped,
/// spaces turned into `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(md: &str) -> BTreeSet<String> {
    let mut in_code = false;
    let mut out = BTreeSet::new();
    for line in md.lines() {
        if line.starts_with("```") {
            in_code = !in_code;
        } else if !in_code && line.starts_with('#') {
            out.insert(slug(line.trim_start_matches('#')));
        }
    }
    out
}

/// Relative Markdown link targets `](target)` of `md` (web links excluded).
fn relative_links(md: &str) -> Vec<String> {
    md.split("](")
        .skip(1)
        .filter_map(|rest| rest.split_once(')').map(|(target, _)| target.to_string()))
        .filter(|t| !t.contains("://"))
        .collect()
}

#[test]
fn links_between_docs_resolve() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let pages = ["README.md", "docs/architecture.md", "docs/configuration.md", "docs/metrics.md", "docs/operations.md"];
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in pages {
        let path = root.join(page);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{page}: {e}"));
        for link in relative_links(&text) {
            let (file, anchor) = link.split_once('#').unwrap_or((link.as_str(), ""));
            let target = if file.is_empty() { path.clone() } else { path.parent().expect("in a directory").join(file) };
            checked += 1;
            let Ok(target_text) = std::fs::read_to_string(&target) else {
                broken.push(format!("{page}: {link} (no such file)"));
                continue;
            };
            if !anchor.is_empty()
                && target.extension().is_some_and(|e| e == "md")
                && !anchors(&target_text).contains(anchor)
            {
                broken.push(format!("{page}: {link} (no such heading)"));
            }
        }
    }
    assert!(checked > 20, "found only {checked} links");
    assert!(broken.is_empty(), "broken links: {broken:#?}");
}

// ---- The checks themselves ---------------------------------------------------------------

#[test]
fn table_parsing_finds_rows_and_spans() {
    let md = "text\n\n| Field | Flag |\n| --- | --- |\n| `a.b` | `--x`, `-v` (deprecated) |\n| `c` | — |\n\n| Other |\n| --- |\n| `z` |\n";
    assert_eq!(column(md, "Field"), ["`a.b`", "`c`"]);
    assert_eq!(documented_flags(md), BTreeSet::from(["--x".to_string(), "-v".to_string()]));
    let (daemon, subs) =
        doc_parts("## A\n| Flag |\n| --- |\n| `--a` |\n## The `render` command\n| Flag |\n| --- |\n| `--b` |\n");
    assert_eq!(documented_flags(&daemon), BTreeSet::from(["--a".to_string()]));
    assert_eq!(documented_flags(&subs["render"]), BTreeSet::from(["--b".to_string()]));
    let missing = BTreeSet::from(["--gone".to_string()]);
    assert!(report("flags", &missing, &BTreeSet::new()).is_some_and(|m| m.contains("--gone")));
    assert!(report("flags", &BTreeSet::new(), &BTreeSet::new()).is_none());
    assert_eq!(slug(" `--cleanup`"), "--cleanup");
    assert_eq!(
        slug(" Metrics server (`metricsBindAddress`, default `127.0.0.1:10249`)"),
        "metrics-server-metricsbindaddress-default-12700110249"
    );
    assert_eq!(relative_links("see [a](b.md#c) and [d](https://x/y)"), ["b.md#c"]);
}
