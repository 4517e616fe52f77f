//! Reading chain names through the `nft` CLI on hosts whose iptables is the nf_tables
//! flavour.
//!
//! `iptables-nft-save` builds its whole rule cache before printing, which grows
//! quadratically with the number of chains (minutes at 10k services), while `nft list chains`
//! prints only names and takes well under a second there. The proxier needs just the names
//! (to find stale chains), so on nft this is how they are read. iptables-nft keeps its tables
//! as ordinary nf_tables tables named after the iptables table (`ip nat`, `ip6 filter`), so
//! `nft` sees exactly the chains `iptables-nft-save` would print.

use super::Table;
use crate::model::IpFamily;

/// The nf_tables family word of an IP family's iptables tables.
pub(crate) fn nft_family(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    }
}

/// The chain names of table `table` of `family` in the output of `nft list chains FAMILY`
/// (which lists every table of the family):
///
/// ```text
/// table ip nat {
///         chain KUBE-SERVICES {
///         }
///         chain PREROUTING {
///                 type nat hook prerouting priority dstnat; policy accept;
///         }
/// }
/// ```
///
/// Names `nft` had to quote are unquoted.
pub(crate) fn chains_from_nft_listing(listing: &str, family: IpFamily, table: Table) -> Vec<String> {
    let family = nft_family(family);
    let mut in_table = false;
    let mut names = Vec::new();
    for line in listing.lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("table ") {
            let mut words = rest.split_whitespace();
            in_table = words.next() == Some(family) && words.next().map(unquote) == Some(table.as_str());
        } else if in_table && let Some(rest) = line.strip_prefix("chain ") {
            let name = rest.strip_suffix('{').unwrap_or(rest).trim();
            if !name.is_empty() {
                names.push(unquote(name).to_string());
            }
        }
    }
    names
}

fn unquote(word: &str) -> &str {
    word.strip_prefix('"').and_then(|w| w.strip_suffix('"')).unwrap_or(word)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LISTING: &str = "table ip filter {
\tchain KUBE-SERVICES {
\t}
\tchain INPUT {
\t\ttype filter hook input priority filter; policy accept;
\t}
}
table ip nat {
\tchain KUBE-SVC-ABCDEFGHIJKLMNOP {
\t}
\tchain PREROUTING {
\t\ttype nat hook prerouting priority dstnat; policy accept;
\t}
\tchain \"odd name\" {
\t}
}
table ip6 nat {
\tchain KUBE-SEP-ABCDEFGHIJKLMNOP {
\t}
}
table inet natural {
\tchain X {
\t}
}
";

    #[test]
    fn reads_the_chains_of_one_table_and_family() {
        assert_eq!(
            chains_from_nft_listing(LISTING, IpFamily::V4, Table::Nat),
            ["KUBE-SVC-ABCDEFGHIJKLMNOP", "PREROUTING", "odd name"]
        );
        assert_eq!(chains_from_nft_listing(LISTING, IpFamily::V4, Table::Filter), ["KUBE-SERVICES", "INPUT"]);
        assert_eq!(chains_from_nft_listing(LISTING, IpFamily::V6, Table::Nat), ["KUBE-SEP-ABCDEFGHIJKLMNOP"]);
        assert!(chains_from_nft_listing(LISTING, IpFamily::V6, Table::Filter).is_empty());
        assert!(chains_from_nft_listing("", IpFamily::V4, Table::Nat).is_empty());
    }
}
