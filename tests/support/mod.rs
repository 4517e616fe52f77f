//! Shared test support: a proxier wired to the fake iptables, a rules assertion that prints a
//! readable diff pointing at the calling test, and the polling helper. The object fixture
//! builders are the library's (`kube_proxy_rs::tracker::testing`, the `testing` feature).

#![allow(dead_code)]

pub mod apiserver;
pub mod cluster_net;
pub mod e2e;
pub mod harness;
pub mod kubeadm;
pub mod netns;
pub mod nft;
pub mod poll;
pub mod rng;

/// Asserts two iptables-restore texts are equal, printing a line diff on failure.
#[track_caller]
pub fn assert_rules_eq(expected: &str, actual: &str) {
    let expected = dedent(expected);
    if expected == actual {
        return;
    }
    panic!("rules differ (- expected, + actual):\n{}\nfull actual:\n{actual}", line_diff(&expected, actual));
}

/// A line diff of two texts: `-` lines only in `expected`, `+` lines only in `actual`.
pub fn line_diff(expected: &str, actual: &str) -> String {
    let mut out = String::new();
    for change in similar::TextDiff::from_lines(expected, actual).iter_all_changes() {
        let sign = match change.tag() {
            similar::ChangeTag::Delete => "-",
            similar::ChangeTag::Insert => "+",
            similar::ChangeTag::Equal => " ",
        };
        out.push_str(sign);
        out.push_str(change.as_str().unwrap_or(""));
        if !change.as_str().unwrap_or("").ends_with('\n') {
            out.push('\n');
        }
    }
    out
}

/// The filter and nat tables of `ipt` as saved, in a form two kernels can be compared by:
/// each table's chains sorted by name (nft lists them in creation order, legacy
/// alphabetically), counters zeroed, comments dropped, and the chains in `leave_out` removed.
pub fn canonical_rules(ipt: &dyn kube_proxy_rs::iptables::Iptables, leave_out: &[&str]) -> String {
    use kube_proxy_rs::iptables::Table;
    use kube_proxy_rs::iptables::dump::Dump;
    let mut out = String::new();
    for table in [Table::Filter, Table::Nat] {
        let mut buf = Vec::new();
        ipt.save_into(table, &mut buf).expect("save");
        let mut dump = Dump::parse(&String::from_utf8(buf).expect("utf-8")).expect("save output parses");
        for t in &mut dump.tables {
            t.chains.retain(|c| !leave_out.contains(&c.name.as_str()));
            t.chains.sort_by(|a, b| a.name.cmp(&b.name));
            for c in &mut t.chains {
                c.packets = 0;
                c.bytes = 0;
            }
        }
        out.push_str(&dump.to_string());
    }
    out
}

/// Strips the common leading whitespace of an indented multi-line literal and a leading
/// newline, so expected rules can be written indented in the test source.
pub fn dedent(s: &str) -> String {
    let s = s.strip_prefix('\n').unwrap_or(s);
    let indent = s.lines().filter(|l| !l.trim().is_empty()).map(|l| l.len() - l.trim_start().len()).min().unwrap_or(0);
    let mut out = String::with_capacity(s.len());
    for line in s.lines() {
        if line.trim().is_empty() {
            continue;
        }
        out.push_str(&line[indent.min(line.len())..]);
        out.push('\n');
    }
    out
}
