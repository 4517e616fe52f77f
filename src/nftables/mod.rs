//! The nftables layer: kube-proxy's `kube-proxy` table in the `ip` and `ip6` families, the
//! transactions that change it (in the text `nft -f` reads, which is also what upstream's
//! knftables writes), and the kernel writer behind the [`Nftables`] trait.
//!
//! Nothing outside this module knows how `nft` is invoked or how nf_tables messages look.
//! The nftables proxier (`proxier::nftables`) builds [`Transaction`]s; the writer applies
//! them atomically: [`netlink::NetlinkNftables`] sends what it can encode as one netlink
//! batch and the rest through [`NftRunner`] (`nft -f -`).

pub mod canonical;
/// Also `render`'s kernel in nftables mode (the table each sync leaves, in memory), so it is
/// part of the binary, not only of the test doubles.
pub mod fake;
pub mod kernel;
pub mod listing;
pub mod netlink;
pub mod runner;
pub mod table;
pub mod transaction;

use std::fmt;

use crate::model::IpFamily;

pub use canonical::canonical_rule;
pub use runner::{NftOptions, NftRunner, cleanup_tables};
pub use table::{ApplyError, ApplyErrorReason, TableState, sort_dump};
pub use transaction::{BaseChain, Chain, ChainType, Element, Hook, Operation, Rule, Set, SetKind, Transaction};

/// The one table kube-proxy owns in each family.
pub const TABLE: &str = "kube-proxy";

/// The comment upstream gives the table.
pub const TABLE_COMMENT: &str = "rules for kube-proxy";

/// An nftables address family kube-proxy uses: `ip` (IPv4) or `ip6` (IPv6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    Ip,
    Ip6,
}

impl Family {
    pub fn as_str(self) -> &'static str {
        match self {
            Family::Ip => "ip",
            Family::Ip6 => "ip6",
        }
    }

    /// The address selector in rules: `ip` or `ip6` (`ip daddr`, `ip6 saddr`).
    pub fn addr_selector(self) -> &'static str {
        self.as_str()
    }

    /// The element type of an address: `ipv4_addr` or `ipv6_addr`.
    pub fn addr_type(self) -> &'static str {
        match self {
            Family::Ip => "ipv4_addr",
            Family::Ip6 => "ipv6_addr",
        }
    }

    pub fn ip_family(self) -> IpFamily {
        match self {
            Family::Ip => IpFamily::V4,
            Family::Ip6 => IpFamily::V6,
        }
    }
}

impl From<IpFamily> for Family {
    fn from(family: IpFamily) -> Family {
        match family {
            IpFamily::V4 => Family::Ip,
            IpFamily::V6 => Family::Ip6,
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why talking to nftables failed.
#[derive(Debug, thiserror::Error)]
pub enum NftError {
    /// The kernel (or `nft`) refused a transaction; nothing of it was applied.
    #[error("nftables transaction failed for family {family}: {message}")]
    Rejected { family: Family, message: String },
    /// The table could not be read.
    #[error("failed to list table {family} kube-proxy: {message}")]
    List { family: Family, message: String },
    /// `nft` could not be run at all, or is unusable (missing, too old, no permission).
    #[error("nft is not usable for family {family}: {message}")]
    Unavailable { family: Family, message: String },
}

impl NftError {
    /// Whether nft said the object does not exist (knftables' `IsNotFound`: "No such file or
    /// directory"), as when deleting a table that is not there.
    pub fn is_not_found(&self) -> bool {
        match self {
            NftError::Rejected { message, .. } | NftError::List { message, .. } => runner::is_not_found_output(message),
            NftError::Unavailable { .. } => false,
        }
    }
}

/// One family's `kube-proxy` table in the kernel (upstream's `knftables.Interface`, reduced
/// to what kube-proxy uses). Implementations: the `nft` runner, and `fake::FakeNftables`.
pub trait Nftables: Send + Sync {
    fn family(&self) -> Family;

    /// Applies `tx` atomically (all of it or nothing).
    fn run(&self, tx: &Transaction) -> Result<(), NftError>;

    /// Checks `tx` without applying it (`nft --check`).
    fn check(&self, tx: &Transaction) -> Result<(), NftError>;

    /// Reads the whole table; `None` when it does not exist. Rules come back as nft lists
    /// them, in its canonical words: compare with [`canonical_rule`] of what was written (or
    /// use [`TableState::as_listed`] on a whole model).
    fn list_table(&self) -> Result<Option<TableState>, NftError>;

    /// Whether the kernel keeps comments on tables, chains, sets and maps (knftables leaves
    /// them out when it does not: `noObjectComments`).
    fn object_comments(&self) -> bool {
        true
    }
}

/// Go's `%q` for the strings kube-proxy writes (comments): double quotes, with `"` and `\`
/// escaped and control characters as Go writes them. Object names never need quoting.
pub fn go_quote(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            '\u{7}' => out.push_str("\\a"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\u{b}' => out.push_str("\\v"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_quote_escapes_like_go() {
        assert_eq!(go_quote("ns1/svc1:p80"), "\"ns1/svc1:p80\"");
        assert_eq!(go_quote("a\"b\\c\nd\x01"), "\"a\\\"b\\\\c\\nd\\x01\"");
    }
}
