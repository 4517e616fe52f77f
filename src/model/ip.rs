//! Address and CIDR parsing with the leniency Kubernetes uses (`netutils.ParseIPSloppy`:
//! IPv4 octets may carry leading zeros) and Go's canonical text form on output.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::names::IpFamily;

/// Parses an IP address the way Kubernetes does: leading zeros in IPv4 octets are read as
/// decimal, and IPv4-mapped IPv6 addresses become IPv4 (Go treats them as IPv4).
pub fn parse_ip_sloppy(s: &str) -> Option<IpAddr> {
    let ip = match s.parse::<IpAddr>() {
        Ok(ip) => ip,
        Err(_) => IpAddr::V4(parse_ipv4_leading_zeros(s)?),
    };
    Some(normalize(ip))
}

/// Maps IPv4-mapped IPv6 addresses to IPv4, leaves everything else alone.
pub fn normalize(ip: IpAddr) -> IpAddr {
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
        let part = parts.next()?;
        if part.is_empty() || part.len() > 3 || !part.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        *octet = part.parse::<u8>().ok()?;
    }
    if parts.next().is_some() {
        return None;
    }
    Some(Ipv4Addr::from(octets))
}

/// Formats an address as Go's `net.IP.String()` does (RFC 5952 for IPv6, dotted quad for
/// IPv4 and IPv4-mapped addresses).
pub fn format_ip(ip: &IpAddr) -> String {
    normalize(*ip).to_string()
}

/// `ip:port`, with brackets around IPv6 addresses (Go's `net.JoinHostPort`).
pub fn join_host_port(ip: &str, port: i32) -> String {
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
        if prefix.is_empty() || !prefix.bytes().all(|b| b.is_ascii_digit()) || prefix.len() > 3 {
            return None;
        }
        let prefix: u8 = prefix.parse().ok()?;
        // A mapped address keeps IPv6 prefix semantics in Go only when written as IPv6; we
        // accept plain forms only.
        let ip = match addr.parse::<IpAddr>() {
            Ok(ip) => ip,
            Err(_) => IpAddr::V4(parse_ipv4_leading_zeros(addr)?),
        };
        Cidr::new(ip, prefix)
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
    pub fn is_zero(&self) -> bool {
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
    }
}
