//! Shared test support: fixture builders, a proxier wired to the fake iptables, and a rules
//! assertion that prints a readable diff pointing at the calling test.

#![allow(dead_code)]

pub mod apiserver;
pub mod cluster_net;
pub mod e2e;
pub mod fixtures;
pub mod harness;
pub mod netns;

/// Asserts two iptables-restore texts are equal, printing a line diff on failure.
#[track_caller]
pub fn assert_rules_eq(expected: &str, actual: &str) {
    let expected = dedent(expected);
    if expected == actual {
        return;
    }
    let diff = similar::TextDiff::from_lines(expected.as_str(), actual);
    let mut out = String::new();
    for change in diff.iter_all_changes() {
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
    panic!("rules differ (- expected, + actual):\n{out}\nfull actual:\n{actual}");
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
