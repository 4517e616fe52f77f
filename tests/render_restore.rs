//! What `render` prints is accepted by the real `iptables-restore`, nft and legacy, in a
//! private network namespace: the full sync and the partial syncs after it, in order, and the
//! kernel ends up with exactly our chains. Needs root (CI runs as root); skips otherwise.

use std::process::{Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy-rs");

fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// A network namespace deleted on drop, even when the test fails.
struct Netns(String);

impl Netns {
    fn new(tag: &str) -> Netns {
        let name = format!("kpr-{tag}-{}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &name]).status();
        let ok = Command::new("ip").args(["netns", "add", &name]).status().is_ok_and(|s| s.success());
        assert!(ok, "ip netns add {name} failed");
        Netns(name)
    }

    fn run(&self, program: &str, args: &[&str], stdin: Option<&str>) -> (bool, String) {
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.0, program])
            .args(args)
            .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {program}: {e}"));
        if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
            use std::io::Write;
            pipe.write_all(text.as_bytes()).expect("write stdin");
        }
        let out = child.wait_with_output().expect("wait");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.success(), text)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

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
    if !is_root() {
        eprintln!("skipping render_output_is_accepted_by_real_iptables_restore: needs root for network namespaces");
        return;
    }
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
        let ns = Netns::new(backend);
        let restore = format!("iptables-{backend}-restore");
        let save = format!("iptables-{backend}-save");
        // Someone else's rules, which must survive every restore.
        let (ok, msg) = ns.run(
            &restore,
            &["--noflush"],
            Some("*nat\n:OTHER-OWNER - [0:0]\n-A OTHER-OWNER -d 198.18.0.1/32 -j RETURN\nCOMMIT\n"),
        );
        assert!(ok, "{backend}: seeding foreign rules: {msg}");
        for (i, payload) in payloads.iter().enumerate() {
            let (ok, msg) = ns.run(&restore, &["--noflush", "--counters"], Some(payload));
            assert!(ok, "{backend}: sync {} rejected: {msg}\n{payload}", i + 1);
        }
        let (ok, saved) = ns.run(&save, &["-t", "nat"], None);
        assert!(ok, "{backend}: save: {saved}");
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
