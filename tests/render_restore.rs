//! What `render` prints is accepted by the real `iptables-restore`, nft and legacy, in a
//! private network namespace: the full sync and the partial syncs after it, in order, and the
//! kernel ends up with exactly our chains. Needs root (CI runs as root); skips otherwise.

use std::process::Command;

use crate::require_root;
use crate::support::netns::Netns;

const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy-rs");

/// Splits `render` output into its sync payloads.
fn syncs(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in text.lines() {
        if line.starts_with("# sync ") {
            out.push(String::new());
        } else if let Some(cur) = out.last_mut() {
            cur.push_str(line);
            cur.push('\n');
        }
    }
    out
}

#[test]
fn render_output_is_accepted_by_real_iptables_restore() {
    require_root!();
    let dir = std::env::temp_dir().join(format!("kpr-restore-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let base = std::fs::read_to_string("examples/cluster.yaml").expect("example");
    // Snapshot 2: a rollout of web's endpoints and api removed; snapshot 3: api back, with
    // new options.
    let second = base.replace("10.244.1.5", "10.244.1.6").replace("name: api\n", "name: api-renamed\n");
    let third = base.replace("sessionAffinity: ClientIP", "sessionAffinity: None");
    std::fs::write(dir.join("2.yaml"), second).expect("write");
    std::fs::write(dir.join("3.yaml"), third).expect("write");
    let out = Command::new(BIN)
        .args(["render", "--hostname-override", "node-a", "examples/cluster.yaml", "--then"])
        .arg(dir.join("2.yaml"))
        .arg("--then")
        .arg(dir.join("3.yaml"))
        .output()
        .expect("render");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let payloads = syncs(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(payloads.len(), 3);

    for backend in ["nft", "legacy"] {
        let ns = Netns::create(backend);
        let restore = format!("iptables-{backend}-restore");
        let save = format!("iptables-{backend}-save");
        // Someone else's rules, which must survive every restore.
        let out = ns.run_with_stdin(
            &[&restore, "--noflush"],
            "*nat\n:OTHER-OWNER - [0:0]\n-A OTHER-OWNER -d 198.18.0.1/32 -j RETURN\nCOMMIT\n",
        );
        assert!(out.success(), "{backend}: seeding foreign rules: {}", out.combined());
        for (i, payload) in payloads.iter().enumerate() {
            let out = ns.run_with_stdin(&[&restore, "--noflush", "--counters"], payload);
            assert!(out.success(), "{backend}: sync {} rejected: {}\n{payload}", i + 1, out.combined());
        }
        let saved = ns.ok(&[&save, "-t", "nat"]);
        assert!(saved.contains("-A OTHER-OWNER -d 198.18.0.1/32 -j RETURN"), "{backend}: foreign rule lost:\n{saved}");
        // Every KUBE- chain in the kernel is one the last full picture declares: nothing
        // stale left behind by the partial syncs.
        let kernel: Vec<&str> = saved
            .lines()
            .filter_map(|l| l.strip_prefix(':'))
            .filter_map(|l| l.split(' ').next())
            .filter(|c| c.starts_with("KUBE-"))
            .collect();
        let last_nat = payloads[0].split("*nat\n").nth(1).unwrap_or("");
        let expected_after_3: Vec<&str> =
            last_nat.lines().filter_map(|l| l.strip_prefix(':')).filter_map(|l| l.split(' ').next()).collect();
        // Snapshot 3 is snapshot 1 without affinity: same chain set as the first full sync.
        let mut k = kernel.clone();
        k.sort_unstable();
        let mut e = expected_after_3.clone();
        e.sort_unstable();
        assert_eq!(k, e, "{backend}: chains after the partial syncs differ from a full sync");
        assert!(!saved.contains("--rcheck"), "{backend}: affinity rules should be gone after sync 3:\n{saved}");
    }
}
