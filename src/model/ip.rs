//! Address and CIDR parsing with the leniency Kubernetes uses (`netutils.ParseIPSloppy`:
//! IPv4 octets may carry leading zeros) and Go's canonical text form on output.
//!
//! Text that reaches iptables or conntrack must mean to them what it means to Kubernetes. API
//! servers of the 1.29 era accept `010.244.1.6`, `::ffff:10.244.1.5` or `10.0.0.0/08`, which
//! iptables either rejects (failing the whole restore payload) or reads as octal (`010.1.1.1`
//! is 8.1.1.1 there, a `/010` prefix is /8: masks are parsed with `strtoul(…, 0)`).
//! [`parse_canonical_ip`] and [`Cidr::parse_canonical`] accept only canonical text: IPv4
//! exactly as Go prints it, prefixes in plain decimal. IPv6 text may be spelled any RFC 4291
//! way (upper case, uncompressed): ip6tables and conntrack read every such spelling as
//! Kubernetes does, and 1.29 writes it as given, so it stays as upstream writes it; only the
//! IPv4-mapped forms, which are IPv4 to Kubernetes, are refused.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::names::IpFamily;

/// Parses an IP address the way Kubernetes does: leading zeros in IPv4 octets are read as
/// decimal, and IPv4-mapped IPv6 addresses become IPv4 (Go treats them as IPv4).
pub(crate) fn parse_ip_sloppy(s: &str) -> Option<IpAddr> {
    parse_ip_sloppy_raw(s).map(normalize)
}

/// [`parse_ip_sloppy`] without mapping IPv4-mapped addresses to IPv4 (a CIDR's prefix length
/// depends on how its address was written). Leading zeros are also accepted in the dotted
/// tail of an IPv6 address (`::ffff:010.0.0.1`), as Go's forked parser does.
fn parse_ip_sloppy_raw(s: &str) -> Option<IpAddr> {
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(ip);
    }
    if let Some((head, tail)) = s.rsplit_once(':')
        && tail.contains('.')
    {
        let v4 = parse_ipv4_leading_zeros(tail)?;
        return format!("{head}:{v4}").parse::<Ipv6Addr>().ok().map(IpAddr::V6);
    }
    parse_ipv4_leading_zeros(s).map(IpAddr::V4)
}

/// Maps IPv4-mapped IPv6 addresses to IPv4, leaves everything else alone.
pub(crate) fn normalize(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    }
}

fn parse_ipv4_leading_zeros(s: &str) -> Option<Ipv4Addr> {
    let mut octets = [0u8; 4];
    let mut parts = s.split('.');
    for octet in &mut octets {
        *octet = u8::try_from(parse_decimal_leading_zeros(parts.next()?)?).ok()?;
    }
    if parts.next().is_some() {
        return None;
    }
    Some(Ipv4Addr::from(octets))
}

/// A non-empty run of decimal digits, any number of leading zeros allowed (Go's `dtoi`, as
/// used by the forked parser for octets and prefix lengths); `None` above 65535.
fn parse_decimal_leading_zeros(s: &str) -> Option<u16> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let significant = s.trim_start_matches('0');
    if significant.len() > 5 {
        return None;
    }
    if significant.is_empty() { Some(0) } else { significant.parse().ok() }
}

/// Why an address or CIDR text cannot be written into rules.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum AddressTextError {
    #[error("{text:?} is not an IP address")]
    Invalid { text: String },
    #[error("{text:?} is not in canonical form (it means {canonical})")]
    NotCanonical { text: String, canonical: String },
}

/// Parses `text` as an address and requires text iptables reads as Kubernetes does: an IPv4
/// address (IPv4-mapped ones included) spelled as [`format_ip`] writes it (no leading zeros,
/// a dotted quad), an IPv6 address in any RFC 4291 spelling.
pub(crate) fn parse_canonical_ip(text: &str) -> Result<IpAddr, AddressTextError> {
    let ip = parse_ip_sloppy(text).ok_or_else(|| AddressTextError::Invalid { text: text.to_owned() })?;
    let canonical = format_ip(&ip);
    if ip.is_ipv4() && canonical != text {
        return Err(AddressTextError::NotCanonical { text: text.to_owned(), canonical });
    }
    Ok(ip)
}

/// Formats an address as Go's `net.IP.String()` does (RFC 5952 for IPv6, dotted quad for
/// IPv4 and IPv4-mapped addresses).
pub(crate) fn format_ip(ip: &IpAddr) -> String {
    normalize(*ip).to_string()
}

/// `ip:port`, with brackets around IPv6 addresses (Go's `net.JoinHostPort`).
pub(crate) fn join_host_port(ip: &str, port: i32) -> String {
    if ip.contains(':') { format!("[{ip}]:{port}") } else { format!("{ip}:{port}") }
}

/// An IP network: the masked network address and prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// Parses `addr/prefix` leniently (see [`parse_ip_sloppy`]); the host bits are masked off,
    /// as Go's `net.ParseCIDR` does for the network it returns.
    pub fn parse_sloppy(s: &str) -> Option<Cidr> {
        let (addr, prefix) = s.split_once('/')?;
        let prefix = u8::try_from(parse_decimal_leading_zeros(prefix)?).ok()?;
        // An address written as IPv6 keeps its IPv6 prefix length, even when IPv4-mapped
        // (see [`Cidr::canonical`]).
        Cidr::new(parse_ip_sloppy_raw(addr)?, prefix)
    }

    /// Parses `addr/prefix` and requires both parts to be spelled canonically: the address as
    /// [`parse_canonical_ip`] does, the prefix in decimal without leading zeros. Host bits may
    /// be set (iptables masks them, as the API allows); only the spelling is checked. An
    /// IPv4-mapped IPv6 network is IPv4 to Kubernetes but keeps an IPv6 prefix length, which
    /// iptables rejects: it is never canonical.
    pub(crate) fn parse_canonical(text: &str) -> Result<Cidr, AddressTextError> {
        let cidr = Cidr::parse_sloppy(text).ok_or_else(|| AddressTextError::Invalid { text: text.to_owned() })?;
        let (addr, prefix) = text.split_once('/').unwrap_or((text, ""));
        let addr_canonical = match addr.parse::<IpAddr>() {
            Ok(IpAddr::V4(v4)) => v4.to_string() == addr,
            Ok(IpAddr::V6(v6)) => v6.to_ipv4_mapped().is_none(),
            Err(_) => false,
        };
        if !addr_canonical || prefix != cidr.prefix.to_string() {
            return Err(AddressTextError::NotCanonical { text: text.to_owned(), canonical: cidr.meaning() });
        }
        Ok(cidr)
    }

    /// The network as Kubernetes reads it, canonically spelled (Go's `IPNet.String()`).
    fn meaning(&self) -> String {
        self.canonical().to_string()
    }

    /// The network as Go's `*net.IPNet` holds it: an IPv4-mapped IPv6 network with a prefix
    /// of at least 96 is the IPv4 network it maps (`::ffff:10.0.0.0/104` is `10.0.0.0/8`),
    /// which is also how `IPNet.String()` writes it and `IPNet.Contains` matches it.
    pub fn canonical(self) -> Cidr {
        match self.addr {
            IpAddr::V6(v6) if self.prefix >= 96 => match v6.to_ipv4_mapped() {
                Some(v4) => Cidr { addr: IpAddr::V4(v4), prefix: self.prefix - 96 },
                None => self,
            },
            _ => self,
        }
    }

    /// A network from an address and prefix; `None` if the prefix is too long for the family.
    pub fn new(ip: IpAddr, prefix: u8) -> Option<Cidr> {
        match ip {
            IpAddr::V4(v4) => {
                if prefix > 32 {
                    return None;
                }
                let mask = if prefix == 0 { 0 } else { u32::MAX << (32 - prefix) };
                Some(Cidr { addr: IpAddr::V4(Ipv4Addr::from(u32::from(v4) & mask)), prefix })
            }
            IpAddr::V6(v6) => {
                if prefix > 128 {
                    return None;
                }
                let mask = if prefix == 0 { 0 } else { u128::MAX << (128 - prefix) };
                Some(Cidr { addr: IpAddr::V6(Ipv6Addr::from(u128::from(v6) & mask)), prefix })
            }
        }
    }

    pub fn family(&self) -> IpFamily {
        match self.addr {
            IpAddr::V4(_) => IpFamily::V4,
            IpAddr::V6(_) => IpFamily::V6,
        }
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    pub fn network(&self) -> IpAddr {
        self.addr
    }

    /// Whether `ip` (normalised, so IPv4-mapped addresses count as IPv4) lies in this network.
    pub fn contains(&self, ip: &IpAddr) -> bool {
        match (self.addr, normalize(*ip)) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = if self.prefix == 0 { 0 } else { u32::MAX << (32 - self.prefix) };
                u32::from(ip) & mask == u32::from(net)
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = if self.prefix == 0 { 0 } else { u128::MAX << (128 - self.prefix) };
                u128::from(ip) & mask == u128::from(net)
            }
            _ => false,
        }
    }

    /// `0.0.0.0/0` or `::/0`.
    pub(crate) fn is_zero(&self) -> bool {
        self.prefix == 0
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sloppy_ipv4_accepts_leading_zeros() {
        assert_eq!(parse_ip_sloppy("010.001.002.003"), Some("10.1.2.3".parse().unwrap()));
        assert_eq!(parse_ip_sloppy("0010.01.0002.00003"), Some("10.1.2.3".parse().unwrap()));
        assert_eq!(parse_ip_sloppy("::ffff:010.0.0.1"), Some("10.0.0.1".parse().unwrap()));
        assert_eq!(parse_ip_sloppy("fd00::010.0.0.1"), Some("fd00::a00:1".parse().unwrap()));
        assert_eq!(parse_ip_sloppy("0256.1.1.1"), None);
        assert_eq!(parse_ip_sloppy("10.1.2"), None);
        assert_eq!(parse_ip_sloppy("256.1.1.1"), None);
        assert_eq!(parse_ip_sloppy("not-an-ip"), None);
    }

    #[test]
    fn ipv6_formats_like_go() {
        let ip = parse_ip_sloppy("FD00:0:0:0:0:0:0:1").unwrap();
        assert_eq!(format_ip(&ip), "fd00::1");
        let ip = parse_ip_sloppy("::ffff:1.2.3.4").unwrap();
        assert_eq!(format_ip(&ip), "1.2.3.4");
        assert_eq!(join_host_port("fd00::1", 80), "[fd00::1]:80");
        assert_eq!(join_host_port("10.0.0.1", 80), "10.0.0.1:80");
    }

    #[test]
    fn cidr_masks_and_contains() {
        let c = Cidr::parse_sloppy("10.1.2.3/8").unwrap();
        assert_eq!(c.to_string(), "10.0.0.0/8");
        assert!(c.contains(&"10.200.0.1".parse().unwrap()));
        assert!(!c.contains(&"11.0.0.1".parse().unwrap()));
        assert!(!c.contains(&"fd00::1".parse().unwrap()));
        let z = Cidr::parse_sloppy("::/0").unwrap();
        assert!(z.is_zero());
        assert!(z.contains(&"fd00::1".parse().unwrap()));
        assert!(Cidr::parse_sloppy("10.0.0.0/33").is_none());
        assert!(Cidr::parse_sloppy("10.0.0.0").is_none());
        assert!(Cidr::parse_sloppy("10.0.0.0/").is_none());
        // Go's dtoi: leading zeros in octets and prefixes are decimal.
        assert_eq!(Cidr::parse_sloppy("192.168.010.7/0016").unwrap().to_string(), "192.168.0.0/16");
        assert!(Cidr::parse_sloppy("10.0.0.0/+8").is_none());
    }

    #[test]
    fn cidrs_print_as_go_ipnet_string() {
        let go = |text: &str| Cidr::parse_sloppy(text).map(|c| c.canonical().to_string());
        assert_eq!(go("198.18.7.1/16").as_deref(), Some("198.18.0.0/16"));
        assert_eq!(go("2001:DB8:0:0::1/64").as_deref(), Some("2001:db8::/64"));
        assert_eq!(go("::ffff:10.1.2.3/104").as_deref(), Some("10.0.0.0/8"));
        assert_eq!(go("::ffff:203.0.113.9/120").as_deref(), Some("203.0.113.0/24"));
        // Below /96 the mask cuts into the ::ffff: marker: an IPv6 network.
        assert_eq!(go("::ffff:10.0.0.0/88").as_deref(), Some("::ff00:0:0/88"));
        let mapped = Cidr::parse_sloppy("::ffff:10.0.0.0/104").unwrap().canonical();
        assert_eq!(mapped.family(), IpFamily::V4);
        assert!(mapped.contains(&"10.9.8.7".parse().unwrap()));
    }

    fn not_canonical(text: &str, canonical: &str) -> AddressTextError {
        AddressTextError::NotCanonical { text: text.into(), canonical: canonical.into() }
    }

    #[test]
    fn canonical_ips_only() {
        for ok in ["10.244.1.6", "0.0.0.0", "203.0.113.255", "fd00::1", "::", "::1", "2001:db8::ffff:0:1", "::102:304"]
        {
            assert_eq!(parse_canonical_ip(ok).map(|ip| format_ip(&ip)), Ok(ok.to_owned()), "{ok}");
        }
        // ip6tables and conntrack read every RFC 4291 spelling as Kubernetes does (and 1.29
        // writes it as given).
        for (ok, meaning) in [("FD00::1", "fd00::1"), ("fd00:0:0:0:0:0:0:1", "fd00::1"), ("fd00::0001", "fd00::1")] {
            assert_eq!(parse_canonical_ip(ok).map(|ip| format_ip(&ip)), Ok(meaning.to_owned()), "{ok}");
        }
        // Each of these is a valid address to Kubernetes' sloppy parser, and each is rejected
        // (or misread as octal) by iptables or conntrack.
        for (text, canonical) in [
            ("010.244.1.6", "10.244.1.6"),
            ("10.244.1.09", "10.244.1.9"),
            ("08.1.1.1", "8.1.1.1"),
            ("::ffff:10.244.1.5", "10.244.1.5"),
            ("::FFFF:10.244.1.5", "10.244.1.5"),
            ("0:0:0:0:0:ffff:0a00:0001", "10.0.0.1"),
        ] {
            assert_eq!(parse_canonical_ip(text), Err(not_canonical(text, canonical)), "{text}");
        }
        for bad in ["", " 10.0.0.1", "10.0.0.1 ", "10.0.0", "1.2.3.4.5", "256.0.0.1", "fd00::1%eth0", "x"] {
            assert_eq!(parse_canonical_ip(bad), Err(AddressTextError::Invalid { text: bad.into() }), "{bad:?}");
        }
    }

    #[test]
    fn canonical_cidrs_only() {
        for ok in ["10.0.0.0/8", "0.0.0.0/0", "203.0.113.7/32", "fd00::/8", "::/0", "fd00::1/128", "FD00:0::/8"] {
            assert!(Cidr::parse_canonical(ok).is_ok(), "{ok}");
        }
        // Host bits are the API's business, not a spelling problem: iptables masks them.
        assert_eq!(Cidr::parse_canonical("10.0.0.1/8").map(|c| c.to_string()), Ok("10.0.0.0/8".to_owned()));
        for (text, canonical) in [
            ("10.0.0.0/008", "10.0.0.0/8"),
            ("10.0.0.0/08", "10.0.0.0/8"),
            ("10.64.0.0/010", "10.64.0.0/10"),
            ("192.168.0.0/016", "192.168.0.0/16"),
            ("010.0.0.0/8", "10.0.0.0/8"),
            ("::ffff:10.0.0.0/104", "10.0.0.0/8"),
            ("::ffff:203.0.113.0/120", "203.0.113.0/24"),
            // strtoul(…, 0) reads 064 as octal 52.
            ("fd00::/064", "fd00::/64"),
        ] {
            assert_eq!(Cidr::parse_canonical(text), Err(not_canonical(text, canonical)), "{text}");
        }
        for bad in ["10.0.0.0", "10.0.0.0/33", "10.0.0.0/", "/8", "10.0.0.0/-1", "10.0.0.0/+8"] {
            assert_eq!(Cidr::parse_canonical(bad), Err(AddressTextError::Invalid { text: bad.into() }), "{bad}");
        }
    }
}
