//! Upstream's own nftables-mode fixtures (pkg/proxy/nftables/proxier_test.go, transcribed in
//! tests/nft_fixtures/, see its README): the cluster state of each test goes through our
//! trackers into the nftables proxier on the fake kernel, and the kernel's table must equal
//! the test's expected table after upstream's normalisation (`sortNFTablesTransaction`),
//! byte for byte, for every release the fixture stands for.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kube_proxy_rs::compat::Release;
use kube_proxy_rs::manifest::{Snapshot, load_manifest_str};
use kube_proxy_rs::nftables::{Family, sort_dump};

use crate::support::nft::{FakeSettings, NftTestProxier, assert_table_eq, kernel_with};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/nft_fixtures")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn snapshot(path: &Path) -> Snapshot {
    let (snapshot, warnings) = load_manifest_str(&read(path), path).unwrap_or_else(|e| panic!("{e}"));
    assert!(warnings.is_empty(), "{}: {warnings:?}", path.display());
    snapshot
}

fn settings(dir: &Path) -> FakeSettings {
    FakeSettings::from_fixture_yaml(&read(&dir.join("proxier.yaml")))
}

/// The fixture directory of `test` for `release`: its own, or (for the tests only read at
/// the 1.33 commit) the 1.33 one for 1.31 and 1.32.
fn fixture(release: Release, test: &str) -> PathBuf {
    let family = match release {
        r if r < Release::V1_33 => "1.31-1.32",
        r if r < "1.34".parse().expect("release") => "1.33",
        r if r < Release::V1_36 => "1.34-1.35",
        _ => "1.36-1.37",
    };
    let dir = fixtures().join(family).join(test);
    if dir.exists() { dir } else { fixtures().join("1.33").join(test) }
}

/// Upstream's sorted form of each `expected*.nft` equals the transcribed `.sorted.nft`: our
/// `sort_dump` is upstream's `sortNFTablesTransaction`.
#[test]
fn nftables_fixture_sorted_forms_match_sort_dump() {
    let mut checked = 0;
    for family in std::fs::read_dir(fixtures()).expect("fixtures") {
        let family = family.expect("entry").path();
        if !family.is_dir() {
            continue;
        }
        for test in std::fs::read_dir(&family).expect("dir") {
            let test = test.expect("entry").path();
            for file in std::fs::read_dir(&test).into_iter().flatten() {
                let file = file.expect("entry").path();
                let name = file.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
                if name.starts_with("expected") && name.ends_with(".nft") && !name.ends_with(".sorted.nft") {
                    let sorted = file.with_file_name(name.replace(".nft", ".sorted.nft"));
                    assert_eq!(sort_dump(&read(&file)), read(&sorted), "{}", file.display());
                    checked += 1;
                }
            }
        }
    }
    assert!(checked >= 30, "only {checked} expected files found");
}

fn overall(release: Release, test: &str) {
    let dir = fixture(release, test);
    let settings = settings(&dir);
    let mut fp = NftTestProxier::new(&settings, release);
    fp.apply_snapshot(&Snapshot::default(), &snapshot(&dir.join("input.yaml")));
    let report = fp.sync();
    assert!(report.full);
    assert_table_eq(&format!("{release} {test}"), &read(&dir.join("expected.nft")), &fp.nft.dump());
    // Nothing changed: the next sync sends nothing, and a forced full sync finds nothing to
    // repair.
    assert_eq!(fp.sync().stats.operations, 0, "{release} {test}: a sync without changes");
    fp.proxier.force_full_sync();
    let report = fp.sync();
    assert!(report.full);
    assert_eq!(
        report.stats.operations, 0,
        "{release} {test}: full sync of an up-to-date table:\n{:?}",
        report.transaction
    );
}

#[test]
fn nftables_overall_rules_every_release() {
    for release in Release::nftables_all() {
        overall(release, "TestOverallNFTablesRules");
    }
}

#[test]
fn nftables_bad_ips_every_release() {
    for release in Release::nftables_all() {
        overall(release, "TestBadIPs");
    }
}

/// TestSyncProxyRulesRepeated: 13 syncs of one proxier, partial after the first; the clock
/// moves two seconds before syncs 4, 8 and 12 (upstream's `ageStaleChains`), so chains that
/// went stale before are deleted then.
#[test]
fn nftables_sync_proxy_rules_repeated_every_release() {
    for release in Release::nftables_all() {
        let dir = fixture(release, "TestSyncProxyRulesRepeated");
        let mut fp = NftTestProxier::new(&settings(&dir), release);
        let mut previous = Snapshot::default();
        for step in 1..=13 {
            let state = snapshot(&dir.join(format!("step-{step}.yaml")));
            fp.apply_snapshot(&previous, &state);
            previous = state;
            let elapsed = if matches!(step, 4 | 8 | 12) { Duration::from_secs(2) } else { Duration::from_millis(1) };
            let report = fp.sync_after(elapsed);
            assert_eq!(report.full, step == 1, "{release} step {step}");
            let expected = match step {
                1..=10 => Some(step),
                11 => None,
                _ => Some(10),
            };
            if let Some(n) = expected {
                let want = read(&dir.join(format!("expected-{n}.nft")));
                assert_table_eq(&format!("{release} step {step}"), &want, &fp.nft.dump());
            }
            // Upstream's assertions on its stale-chain bookkeeping.
            let mut stale: Vec<&str> = fp.proxier.stale_chains().keys().map(String::as_str).collect();
            stale.sort_unstable();
            match step {
                9 if release < Release::V1_36 => assert_eq!(
                    stale,
                    [
                        "endpoint-SWWHDC7X-ns3/svc3/tcp/p80__10.0.3.2/80",
                        "endpoint-TQ2QKHCZ-ns3/svc3/tcp/p80__10.0.3.3/80",
                        "service-4AT6LBPK-ns3/svc3/tcp/p80"
                    ],
                    "{release} step 9"
                ),
                9 => assert_eq!(stale, ["service-4AT6LBPK-ns3/svc3/tcp/p80"], "{release} step 9"),
                10 => assert!(stale.is_empty(), "{release} step 10: {stale:?}"),
                13 => assert_eq!(report.stats.operations, 0, "{release} step 13"),
                _ => {}
            }
        }
    }
}

/// TestSyncProxyRulesStartup: the kernel holds a table (upstream's, for a slightly different
/// cluster state) when the proxier starts; its first sync adopts and fixes it.
#[test]
fn nftables_sync_proxy_rules_startup() {
    for release in Release::nftables_all().filter(|r| *r >= "1.34".parse().expect("release")) {
        let dir = fixture(release, "TestSyncProxyRulesStartup");
        let settings = settings(&dir);
        let family = Family::from(settings.family);
        let nft = kernel_with(&read(&dir.join("initial-state.nft")), family);
        let mut fp = NftTestProxier::on_kernel(&settings, release, nft);
        fp.apply_snapshot(&Snapshot::default(), &snapshot(&dir.join("input.yaml")));
        let report = fp.sync();
        assert!(report.full && report.stats.listed, "{release}");
        assert_table_eq(&format!("{release} startup"), &read(&dir.join("expected.nft")), &fp.nft.dump());
        // Only what differed was written: not the whole table.
        let fresh_ops = {
            let mut fresh = NftTestProxier::new(&settings, release);
            fresh.apply_snapshot(&Snapshot::default(), &snapshot(&dir.join("input.yaml")));
            fresh.sync().stats.operations
        };
        assert!(
            report.stats.operations * 3 < fresh_ops,
            "{release}: adopting the table took {} operations, a fresh table {fresh_ops}:\n{}",
            report.stats.operations,
            report.transaction.unwrap_or_default()
        );
    }
}
