//! `render --proxy-mode nftables`: per sync a `# sync N: full|partial` line, then the whole
//! `kube-proxy` table as knftables' fake `Dump()` writes it, in an order that builds the
//! table from nothing; `--then` snapshots two seconds apart (stale chains flushed, then
//! deleted a sync later); ServiceCIDR documents; releases before 1.31 refused. (That `nft -f`
//! takes the output is tests/render_restore.rs, on the real kernel.)

use std::path::PathBuf;
use std::process::{Command, Output};

use kube_proxy_rs::nftables::{Family, TableState};

use crate::support::e2e::TempDir;
use crate::support::nft::parse_dump;

const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy-rs");
const EXAMPLE: &str = "examples/cluster.yaml";

fn render(args: &[&str]) -> Output {
    Command::new(BIN).arg("render").args(args).output().expect("run kube-proxy-rs render")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[track_caller]
fn rendered(args: &[&str]) -> String {
    let out = render(args);
    assert!(out.status.success(), "render {args:?} failed: {}", stderr(&out));
    stdout(&out)
}

/// Splits render output into its syncs: (header, table dump).
fn syncs(text: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for line in text.lines() {
        if line.starts_with("# sync ") {
            out.push((line.to_string(), String::new()));
        } else if let Some((_, dump)) = out.last_mut() {
            dump.push_str(line);
            dump.push('\n');
        } else {
            panic!("output does not start with a sync header: {line:?}");
        }
    }
    out
}

/// The example cluster without the `web` Service and its slice, and with `api`'s one
/// endpoint replaced: a Service and an endpoint whose chains fall out of use.
fn example_without_web() -> String {
    let text = std::fs::read_to_string(EXAMPLE).expect("example");
    let docs: Vec<&str> =
        text.split("\n---\n").filter(|d| !d.contains("name: web}") && !d.contains("name: web-abc12")).collect();
    assert_eq!(docs.len(), text.split("\n---\n").count() - 2, "the example has web's Service and slice");
    docs.join("\n---\n").replace("10.244.2.9]", "10.244.2.10]")
}

fn write(dir: &TempDir, name: &str, text: &str) -> PathBuf {
    let path = dir.path().join(name);
    std::fs::write(&path, text).expect("write manifest");
    path
}

fn chain_line(family: &str, chain: &str) -> String {
    format!("add chain {family} kube-proxy {chain}\n")
}

fn has_rules(dump: &str, chain: &str) -> bool {
    dump.lines().any(|l| l.starts_with(&format!("add rule ip kube-proxy {chain} ")))
}

#[test]
fn example_cluster_renders_the_table_in_nftables_mode() {
    let text = rendered(&["--proxy-mode", "nftables", "--hostname-override", "node-a", EXAMPLE]);
    let first = syncs(&text);
    assert_eq!(first.len(), 1, "{text}");
    let (header, dump) = &first[0];
    assert_eq!(header, "# sync 1: full");
    assert!(dump.starts_with("add table ip kube-proxy { comment \"rules for kube-proxy\" ; }\n"), "{dump}");
    assert!(dump.lines().all(|l| l.starts_with("add ")), "only add lines:\n{dump}");
    // The example's services, as upstream names and writes them.
    for line in [
        "add element ip kube-proxy service-ips { 10.96.0.10 . tcp . 80 : goto service-SUSTUHLJ-default/web/tcp/http }",
        "add rule ip kube-proxy service-SUSTUHLJ-default/web/tcp/http meta l4proto tcp dnat ip addr . port to numgen random mod 2 map { 0 : 10.244.1.5 . 8080 , 1 : 10.244.2.7 . 8080 }",
        "add element ip kube-proxy service-nodeports { tcp . 30443 : goto external-6BI3YCZC-default/api/tcp/https }",
        "add rule ip kube-proxy firewall-SFDBSQB2-shop/frontend/tcp/http ip saddr != { 203.0.113.0/24 } drop",
        "add element ip kube-proxy no-endpoint-services { 10.96.0.53 . udp . 53 comment \"default/dns-lookaside:dns\" : goto reject-chain }",
        "add rule ip kube-proxy masquerading mark and 0x00004000 != 0 mark set mark xor 0x00004000 masquerade fully-random",
    ] {
        assert!(dump.lines().any(|l| l == line), "missing {line:?} in:\n{dump}");
    }
    // In order, the lines build the table from nothing (every jump, @set and map verdict
    // names an object declared above it), and the table dumps back to the same text.
    let table = parse_dump(dump, Family::Ip);
    assert_eq!(&table.dump(Family::Ip), dump);
    let (chains, rules, sets, elements) = table.counts();
    assert!(chains > 20 && rules > 30 && sets > 5 && elements > 10, "{:?}", table.counts());

    // The config's `mode: nftables` renders the same; the flag wins over the config.
    let dir = TempDir::new("render-nft-config");
    let config = write(
        &dir,
        "config.yaml",
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\n",
    );
    let config = config.display().to_string();
    assert_eq!(rendered(&["--config", &config, "--hostname-override", "node-a", EXAMPLE]), text);
    let iptables =
        rendered(&["--config", &config, "--proxy-mode", "iptables", "--hostname-override", "node-a", EXAMPLE]);
    assert!(iptables.starts_with("# sync 1: full\n*filter\n"), "{iptables}");

    // The nftables section's masqueradeBit applies in this mode.
    let config = write(
        &dir,
        "bit.yaml",
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\n\
         nftables: {masqueradeBit: 9}\n",
    );
    let text = rendered(&["--config", &config.display().to_string(), "--hostname-override", "node-a", EXAMPLE]);
    assert!(text.contains("mark and 0x00000200 != 0"), "{text}");

    // The other family: the ip6 table, built from nothing too.
    let v6 = rendered(&["--proxy-mode", "nftables", "--ip-family", "ipv6", "--hostname-override", "node-a", EXAMPLE]);
    let (_, dump) = &syncs(&v6)[0];
    assert!(dump.starts_with("add table ip6 kube-proxy "), "{dump}");
    assert!(!dump.contains(" ip kube-proxy ") && !dump.contains("10.96."), "{dump}");
    assert_eq!(parse_dump(dump, Family::Ip6).dump(Family::Ip6), *dump);
}

/// Each `--then` is a partial sync two seconds after the previous one: a chain that falls out
/// of use is flushed in the sync that drops it (still declared) and deleted in the next.
#[test]
fn then_snapshots_are_partial_syncs_that_flush_then_delete_stale_chains() {
    let dir = TempDir::new("render-nft-then");
    let second = write(&dir, "2.yaml", &example_without_web());
    let second = second.display().to_string();
    let web = "service-SUSTUHLJ-default/web/tcp/http";
    let old_endpoint = "endpoint-TWB26MXB-default/api/tcp/https__10.244.2.9/8443";
    for release in ["1.31", "1.35", "1.37"] {
        let text = rendered(&[
            "--proxy-mode",
            "nftables",
            "--compatibility-version",
            release,
            "--hostname-override",
            "node-a",
            EXAMPLE,
            "--then",
            &second,
            "--then",
            &second,
        ]);
        let all = syncs(&text);
        let headers: Vec<&str> = all.iter().map(|(h, _)| h.as_str()).collect();
        assert_eq!(headers, ["# sync 1: full", "# sync 2: partial", "# sync 3: partial"], "{release}");
        let (first, second_dump, third) = (&all[0].1, &all[1].1, &all[2].1);
        // Sync 1: both chains in use.
        for chain in [web, old_endpoint] {
            assert!(first.contains(&chain_line("ip", chain)) && has_rules(first, chain), "{release}: {chain}");
        }
        // Sync 2: nothing refers to them any more; they are flushed, not yet deleted.
        for chain in [web, old_endpoint] {
            assert!(second_dump.contains(&chain_line("ip", chain)), "{release}: {chain} kept a sync:\n{second_dump}");
            assert!(!has_rules(second_dump, chain), "{release}: {chain} flushed:\n{second_dump}");
            assert!(!second_dump.contains(&format!("goto {chain}")), "{release}: nothing refers to {chain}");
        }
        assert!(!second_dump.contains("10.96.0.10 "), "{release}: web's ClusterIP is gone");
        assert!(second_dump.contains("dnat to 10.244.2.10:8443"), "{release}: api's new endpoint");
        // Sync 3, more than a second later: deleted.
        for chain in [web, old_endpoint] {
            assert!(!third.contains(chain), "{release}: {chain} deleted:\n{third}");
        }
        // Apart from the deleted chains (web's endpoint chains too, in releases that have
        // them for a Service without affinity), nothing changed between syncs 2 and 3.
        let stale = |l: &str| l.contains("-default/web/") || l.contains(old_endpoint);
        assert!(!third.lines().any(stale), "{release}: every stale chain deleted:\n{third}");
        let without = |dump: &str| -> String { dump.lines().filter(|l| !stale(l)).map(|l| format!("{l}\n")).collect() };
        assert_eq!(without(second_dump), *third, "{release}");
        for (i, (_, dump)) in all.iter().enumerate() {
            let table: TableState = parse_dump(dump, Family::Ip);
            assert_eq!(&table.dump(Family::Ip), dump, "{release}: sync {} builds from nothing", i + 1);
        }
    }
}

const SERVICE_CIDRS: &str = "apiVersion: networking.k8s.io/v1
kind: ServiceCIDR
metadata: {name: kubernetes}
spec:
  cidrs: [10.96.0.0/16, fd00:96::/112]
---
apiVersion: networking.k8s.io/v1
kind: ServiceCIDRList
items:
- metadata: {name: extra}
  spec: {cidrs: [10.97.0.0/16, 10.96.0.0/16]}
- metadata: {name: broken}
  spec: {cidrs: [not-a-cidr]}
";

/// ServiceCIDR documents feed the `cluster-ips-check` drop rule (their family's CIDRs, all
/// objects' together), where the daemon would watch them (MultiCIDRServiceAllocator, on from
/// 1.33); without them there is no drop rule, as on a cluster without ServiceCIDRs.
#[test]
fn service_cidr_documents_drive_the_cluster_ips_check_drop_rule() {
    let dir = TempDir::new("render-nft-cidrs");
    let cidrs = write(&dir, "cidrs.yaml", SERVICE_CIDRS).display().to_string();
    let drop_rule = |family: &str, list: &str| {
        format!(
            "add rule {family} kube-proxy cluster-ips-check {family} daddr {{ {list} }} drop comment \"Drop traffic to unallocated ClusterIPs\"\n"
        )
    };
    let base = ["--proxy-mode", "nftables", "--hostname-override", "node-a"];
    let args = |extra: &[&str]| -> Vec<String> { base.iter().chain(extra).map(|s| s.to_string()).collect() };
    let run = |extra: &[&str]| {
        let args = args(extra);
        render(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };

    let without = rendered(&args(&[EXAMPLE]).iter().map(String::as_str).collect::<Vec<_>>());
    assert!(!without.contains("drop comment \"Drop traffic to unallocated ClusterIPs\""), "{without}");
    let out = run(&[EXAMPLE, &cidrs]);
    assert!(out.status.success(), "{}", stderr(&out));
    let with = stdout(&out);
    assert!(with.contains(&drop_rule("ip", "10.96.0.0/16,10.97.0.0/16")), "{with}");
    // The bad CIDR is left out, naming its object.
    assert!(
        stderr(&out).contains("ServiceCIDR broken: spec.cidrs[0] \"not-a-cidr\" is not a CIDR"),
        "{}",
        stderr(&out)
    );
    // Only the rule differs.
    let differing: Vec<&str> = with.lines().filter(|l| !without.lines().any(|w| w == *l)).collect();
    assert_eq!(differing.len(), 1, "{differing:?}");
    assert_eq!(without.lines().count() + 1, with.lines().count());

    let v6 = rendered(&args(&["--ip-family", "ipv6", EXAMPLE, &cidrs]).iter().map(String::as_str).collect::<Vec<_>>());
    assert!(v6.contains(&drop_rule("ip6", "fd00:96::/112")), "{v6}");

    // 1.32: MultiCIDRServiceAllocator is off, ServiceCIDRs are not watched; the gate turns it on.
    let out = run(&["--compatibility-version", "1.32", EXAMPLE, &cidrs]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stdout(&out).contains("Drop traffic to unallocated"), "{}", stdout(&out));
    assert!(stderr(&out).contains("MultiCIDRServiceAllocator is off"), "{}", stderr(&out));
    let gated = rendered(
        &args(&[
            "--compatibility-version",
            "1.32",
            "--feature-gates",
            "MultiCIDRServiceAllocator=true",
            EXAMPLE,
            &cidrs,
        ])
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>(),
    );
    assert!(gated.contains(&drop_rule("ip", "10.96.0.0/16,10.97.0.0/16")), "{gated}");

    // As upstream, a change of ServiceCIDRs waits for the next full sync: a partial sync
    // after the objects appear leaves the rule as it was.
    let then =
        write(&dir, "then.yaml", &format!("{}\n---\n{SERVICE_CIDRS}", std::fs::read_to_string(EXAMPLE).unwrap()));
    let text = rendered(
        &args(&[EXAMPLE, "--then", &then.display().to_string()]).iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let both = syncs(&text);
    assert_eq!(both[1].0, "# sync 2: partial");
    assert!(!both[1].1.contains("Drop traffic to unallocated"), "{}", both[1].1);
}

#[test]
fn releases_before_1_31_refuse_nftables_mode() {
    for release in ["1.29", "1.30"] {
        let out = render(&[
            "--proxy-mode",
            "nftables",
            "--compatibility-version",
            release,
            "--hostname-override",
            "n",
            EXAMPLE,
        ]);
        assert_eq!(out.status.code(), Some(2), "{release}: {}", stderr(&out));
        let err = stderr(&out);
        assert!(err.contains("mode: Invalid value: \"nftables\""), "{err}");
        assert!(err.contains(&format!("off by default in {release}")), "{err}");
        assert!(err.contains("releases 1.31 and later"), "{err}");
        assert!(stdout(&out).is_empty());
    }
    // From the config file too, naming it.
    let dir = TempDir::new("render-nft-old");
    let config = write(
        &dir,
        "old.yaml",
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\n",
    );
    let config = config.display().to_string();
    let out = render(&["--config", &config, "--compatibility-version", "1.30", "--hostname-override", "n", EXAMPLE]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains(&format!("{config}: invalid configuration")), "{}", stderr(&out));
    assert!(stderr(&out).contains("off by default in 1.30"), "{}", stderr(&out));
    // The gate turned off in a release that has the mode.
    let out = render(&[
        "--proxy-mode",
        "nftables",
        "--feature-gates",
        "NFTablesProxyMode=false",
        "--compatibility-version",
        "1.31",
        EXAMPLE,
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("NFTablesProxyMode is disabled"), "{}", stderr(&out));
    // An unknown mode is a flag error.
    let out = render(&["--proxy-mode", "ipvs", EXAMPLE]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("ipvs"), "{}", stderr(&out));
}

/// Objects that cannot be used are skipped with a warning naming them, as in iptables mode;
/// the rest renders. A manifest that is not YAML fails the command naming the file.
#[test]
fn bad_objects_are_named_and_skipped() {
    let dir = TempDir::new("render-nft-bad");
    let bad = write(
        &dir,
        "bad.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: {namespace: default, name: broken}\nspec:\n  ports: 7\n---\n\
         apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: odd}\nspec: {cidrs: {a: b}}\n---\n\
         apiVersion: v1\nkind: Service\nmetadata: {namespace: default, name: bad-ip}\n\
         spec: {clusterIP: 10.96.0.999, ports: [{port: 80, protocol: TCP}]}\n",
    );
    let out =
        render(&["--proxy-mode", "nftables", "--hostname-override", "node-a", EXAMPLE, &bad.display().to_string()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("Service default/broken"), "{err}");
    assert!(err.contains("ServiceCIDR odd"), "{err}");
    let text = stdout(&out);
    assert!(text.contains("service-SUSTUHLJ-default/web/tcp/http"), "the others keep their rules");
    assert!(!text.contains("bad-ip") && !text.contains("broken"), "{text}");

    let yaml = write(&dir, "syntax.yaml", "apiVersion: v1\nkind: Service\nmetadata: [a\n");
    let out = render(&["--proxy-mode", "nftables", &yaml.display().to_string()]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("syntax.yaml"), "{}", stderr(&out));
    assert!(stdout(&out).is_empty());
}

#[test]
fn help_says_what_nftables_mode_prints() {
    let out = Command::new(BIN).args(["render", "--help"]).output().expect("help");
    let help = stdout(&out);
    assert!(help.contains("--proxy-mode <iptables|nftables>"), "{help}");
    assert!(help.contains("kube-proxy table after each sync"), "{help}");
}
