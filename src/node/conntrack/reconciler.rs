//! The conntrack reconciler of upstream 1.32 and later (`pkg/proxy/conntrack/cleanup.go`,
//! PR #127318): instead of deleting entries per change, list the family's UDP conntrack
//! entries and delete those that point a service frontend at something that is not one of its
//! serving endpoints.
//!
//! An entry is stale when its original destination is `serviceIP:port` (cluster IP,
//! load-balancer IPs — only VIP-mode ones, the service model already drops `ipMode: Proxy` —
//! and external IPs) or `*:nodePort` of a UDP service port **with at least one serving
//! endpoint**, and its reply source is not one of those endpoints. Services without serving
//! endpoints are skipped (their REJECT rule handles new packets), traffic policy, topology and
//! terminating state are ignored, TCP and SCTP entries are never touched. What "one of those
//! endpoints" means depends on the release ([`EndpointMatch`]):
//!
//! * 1.32 and 1.33: the reply source IP is a serving endpoint's IP (1.32 as of its patch
//!   releases with PR #130484 cherry-picked: frontends are matched on IP *and* port);
//! * 1.34 and later: the reply source IP *and port* are a serving endpoint's IP and target
//!   port (PR #130542), so a changed target port also clears the old flows.
//!
//! The decision is pure: [`ServingFrontends`] is what a sync's service and endpoint maps say
//! (built once per sync, small: the UDP frontends and their backends), and
//! [`ServingFrontends::stale_entries`] picks the stale ones among the listed entries.
//! [`reconcile`] lists once through the [`Conntrack`] trait and deletes exactly the stale
//! entries it found in one batch ([`Conntrack::delete_entries`]), so its cost is one walk of
//! the table plus the deletions, whatever the number of stale flows or endpoints. Upstream
//! 1.35 lists and then passes one filter per stale orig-dst/reply-src pair to a second
//! netlink dump that deletes what matches (two walks); the entries deleted are the same
//! (every entry a filter would match is itself stale, and every stale entry makes a filter),
//! except that an entry created between the listing and the deletion is never touched here.
//! [`stale_flow_filters`] keeps upstream's filters, for the tests and the benchmark's
//! comparison with the earlier way (one `conntrack -D` per filter).
//!
//! The production [`Conntrack`] talks netlink ([`super::netlink`]); the text parser of
//! `conntrack -L` ([`parse_entries`]) serves [`super::ExecConntrack`], which the tests and the
//! benchmark use to compare with the tool. It is hand-written because nothing parses
//! conntrack-tools' text format; it takes only what it needs, skips any line it does not
//! understand, and is checked against the real tool in `tests/conntrack_real.rs`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;

use super::Conntrack;
use crate::compat::Release;
use crate::model::ip::parse_ip_sloppy;
use crate::model::{IpFamily, Protocol};
use crate::tracker::{EndpointsMap, ServicePortMap};

/// How a conntrack entry's reply source is compared with a service's serving endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointMatch {
    /// The reply source IP is a serving endpoint's IP (1.32, 1.33).
    Ip,
    /// The reply source IP and port are a serving endpoint's IP and port (1.34 and later).
    IpAndPort,
}

impl EndpointMatch {
    /// The comparison `release` makes (only meaningful where it has the reconciler).
    pub fn for_release(release: Release) -> EndpointMatch {
        if release.conntrack_reconciler_matches_endpoint_port() { EndpointMatch::IpAndPort } else { EndpointMatch::Ip }
    }
}

/// One conntrack entry: its original and reply tuples, and what else names it in the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConntrackEntry {
    pub protocol: Protocol,
    pub orig_src: IpAddr,
    pub orig_dst: IpAddr,
    pub orig_sport: u16,
    pub orig_dport: u16,
    pub reply_src: IpAddr,
    pub reply_dst: IpAddr,
    pub reply_sport: u16,
    pub reply_dport: u16,
    /// The conntrack zone (0 unless something put the flow in another): part of the key a
    /// deletion looks the entry up by.
    pub zone: u16,
    /// The kernel's id of the entry, when the listing gave it (netlink does; the tool's text
    /// does only with `-o id`): a deletion that names it removes this entry and never one
    /// that replaced it under the same tuple after the listing.
    pub id: Option<u32>,
}

impl ConntrackEntry {
    /// A UDP/TCP/SCTP entry in zone 0 with no id (tests and fixtures).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        protocol: Protocol,
        (orig_src, orig_sport): (IpAddr, u16),
        (orig_dst, orig_dport): (IpAddr, u16),
        (reply_src, reply_sport): (IpAddr, u16),
        (reply_dst, reply_dport): (IpAddr, u16),
    ) -> ConntrackEntry {
        ConntrackEntry {
            protocol,
            orig_src,
            orig_dst,
            orig_sport,
            orig_dport,
            reply_src,
            reply_dst,
            reply_sport,
            reply_dport,
            zone: 0,
            id: None,
        }
    }

    /// The family of its original tuple.
    pub fn family(&self) -> IpFamily {
        IpFamily::of(&self.orig_dst)
    }

    /// The `conntrack` arguments (without the program) that delete this entry and no other:
    /// its original tuple and zone. Each such run walks the whole table (the tool filters a
    /// dump), which is why only the tests and the benchmark use it.
    pub fn delete_args(&self) -> Vec<String> {
        let mut args = vec![
            "-D".to_owned(),
            "-p".to_owned(),
            self.protocol.lower().to_owned(),
            "-s".to_owned(),
            self.orig_src.to_string(),
            "-d".to_owned(),
            self.orig_dst.to_string(),
            "--sport".to_owned(),
            self.orig_sport.to_string(),
            "--dport".to_owned(),
            self.orig_dport.to_string(),
        ];
        if self.zone != 0 {
            args.extend(["-w".to_owned(), self.zone.to_string()]);
        }
        if self.family() == IpFamily::V6 {
            args.extend(["-f".to_owned(), "ipv6".to_owned()]);
        }
        args
    }
}

impl fmt::Display for ConntrackEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} -> {} reply {} -> {}",
            self.protocol.lower(),
            SocketText(self.orig_src, self.orig_sport),
            SocketText(self.orig_dst, self.orig_dport),
            SocketText(self.reply_src, self.reply_sport),
            SocketText(self.reply_dst, self.reply_dport),
        )?;
        if self.zone != 0 {
            write!(f, " zone {}", self.zone)?;
        }
        Ok(())
    }
}

/// `ip:port` / `[ip]:port`.
struct SocketText(IpAddr, u16);

impl fmt::Display for SocketText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            IpAddr::V4(ip) => write!(f, "{ip}:{}", self.1),
            IpAddr::V6(ip) => write!(f, "[{ip}]:{}", self.1),
        }
    }
}

/// One deletion: every entry of `protocol` whose original destination port is `orig_dport`
/// (and destination address `orig_dst`, when set) and whose reply comes from `reply_src`
/// (and port `reply_sport`, when set). Upstream's `filterForIPPortNAT` (with an address) and
/// `filterForPortNAT` (node ports, without one).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FlowFilter {
    pub family: IpFamily,
    pub protocol: Protocol,
    pub orig_dst: Option<IpAddr>,
    pub orig_dport: u16,
    pub reply_src: IpAddr,
    pub reply_sport: Option<u16>,
}

impl FlowFilter {
    /// Whether `entry` is one the filter deletes.
    pub fn matches(&self, entry: &ConntrackEntry) -> bool {
        entry.protocol == self.protocol
            && IpFamily::of(&entry.orig_dst) == self.family
            && self.orig_dst.is_none_or(|ip| ip == entry.orig_dst)
            && entry.orig_dport == self.orig_dport
            && entry.reply_src == self.reply_src
            && self.reply_sport.is_none_or(|port| port == entry.reply_sport)
    }

    /// The `conntrack` arguments (without the program) that delete what the filter matches.
    pub fn args(&self) -> Vec<String> {
        let mut args = vec!["-D".to_owned(), "-p".to_owned(), self.protocol.lower().to_owned()];
        if let Some(ip) = self.orig_dst {
            args.extend(["--orig-dst".to_owned(), ip.to_string()]);
        }
        args.extend(["--dport".to_owned(), self.orig_dport.to_string()]);
        args.extend(["--reply-src".to_owned(), self.reply_src.to_string()]);
        if let Some(port) = self.reply_sport {
            args.extend(["--reply-port-src".to_owned(), port.to_string()]);
        }
        if self.family == IpFamily::V6 {
            args.extend(["-f".to_owned(), "ipv6".to_owned()]);
        }
        args
    }
}

impl fmt::Display for FlowFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} conntrack entries to ", self.protocol)?;
        match self.orig_dst {
            Some(ip) => write!(f, "{}", SocketText(ip, self.orig_dport))?,
            None => write!(f, "port {}", self.orig_dport)?,
        }
        write!(f, " answered by {}", self.reply_src)?;
        if let Some(port) = self.reply_sport {
            write!(f, " port {port}")?;
        }
        Ok(())
    }
}

/// A serving endpoint as the reply source of an entry is compared with it.
type Backend = (IpAddr, Option<u16>);

/// The frontends of one family's UDP service ports that have serving endpoints, each with
/// the backends that may answer it: everything the reconciler needs of a sync's state. Any
/// proxier builds it from its service and endpoint maps after a successful sync
/// ([`ServingFrontends::new`]); it holds only UDP frontends, so it is small, and a cleanup
/// judging entries against it can run while later syncs change the maps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServingFrontends {
    family: IpFamily,
    matching: EndpointMatch,
    by_address: BTreeMap<(IpAddr, u16), BTreeSet<Backend>>,
    by_node_port: BTreeMap<u16, BTreeSet<Backend>>,
}

impl ServingFrontends {
    /// The frontends of `family`'s UDP service ports with at least one serving endpoint in
    /// `services` and `endpoints` (the maps after a sync), compared as `matching` says.
    pub fn new(
        matching: EndpointMatch,
        family: IpFamily,
        services: &ServicePortMap,
        endpoints: &EndpointsMap,
    ) -> ServingFrontends {
        ServingFrontends::build(matching, false, family, services, endpoints)
    }

    /// The frontends as `release`'s reconciler sees them: its endpoint comparison, and from
    /// 1.37 (PR #139629) the UDP service ports without serving endpoints too, with no
    /// backend, so every entry to them is stale: flows DNATed to endpoints that all went away
    /// (a scale-down to zero) never meet the service's REJECT rule, and one-way senders keep
    /// them alive forever.
    pub fn for_release(
        release: Release,
        family: IpFamily,
        services: &ServicePortMap,
        endpoints: &EndpointsMap,
    ) -> ServingFrontends {
        let matching = EndpointMatch::for_release(release);
        let unserved = release.conntrack_reconciler_cleans_services_without_endpoints();
        ServingFrontends::build(matching, unserved, family, services, endpoints)
    }

    fn build(
        matching: EndpointMatch,
        include_unserved: bool,
        family: IpFamily,
        services: &ServicePortMap,
        endpoints: &EndpointsMap,
    ) -> ServingFrontends {
        // Two service ports cannot legitimately share a frontend; if a broken cluster makes
        // them, the union keeps the entries either would keep (upstream keeps whichever map
        // write came last).
        let mut by_address: BTreeMap<(IpAddr, u16), BTreeSet<Backend>> = BTreeMap::new();
        let mut by_node_port: BTreeMap<u16, BTreeSet<Backend>> = BTreeMap::new();
        for (name, info) in services.iter() {
            if info.protocol != Protocol::Udp {
                continue;
            }
            let backends: BTreeSet<Backend> = endpoints
                .get(name)
                .into_iter()
                .flatten()
                .filter(|ep| ep.serving)
                .filter_map(|ep| {
                    let ip = parse_ip_sloppy(ep.ip())?;
                    let port = match matching {
                        EndpointMatch::Ip => None,
                        EndpointMatch::IpAndPort => Some(u16::try_from(ep.port).ok()?),
                    };
                    Some((ip, port))
                })
                .collect();
            // Up to 1.36 a service without serving endpoints has nothing to clean: its REJECT
            // rule turns new packets away (but not flows conntrack already DNATs, #139628).
            if backends.is_empty() && !include_unserved {
                continue;
            }
            if let Ok(port) = u16::try_from(info.port) {
                let addresses =
                    std::iter::once(&info.cluster_ip).chain(&info.load_balancer_ips).chain(&info.external_ips);
                for ip in addresses.filter_map(|text| parse_ip_sloppy(text)) {
                    by_address.entry((ip, port)).or_default().extend(backends.iter().copied());
                }
            }
            if let Some(node_port) = u16::try_from(info.node_port).ok().filter(|p| *p != 0) {
                by_node_port.entry(node_port).or_default().extend(backends.iter().copied());
            }
        }
        ServingFrontends { family, matching, by_address, by_node_port }
    }

    pub fn family(&self) -> IpFamily {
        self.family
    }

    /// How many frontends (service addresses and node ports) have serving endpoints.
    pub fn len(&self) -> usize {
        self.by_address.len() + self.by_node_port.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The reply source of `entry` as it is compared with the backends.
    fn reply(&self, entry: &ConntrackEntry) -> Backend {
        match self.matching {
            EndpointMatch::Ip => (entry.reply_src, None),
            EndpointMatch::IpAndPort => (entry.reply_src, Some(entry.reply_sport)),
        }
    }

    /// Whether `entry` is one of this family's UDP entries to a frontend here that none of
    /// its backends answers.
    pub fn is_stale(&self, entry: &ConntrackEntry) -> bool {
        self.filters_for(entry).next().is_some()
    }

    /// The stale entries among `entries`, in their order.
    pub fn stale_entries(&self, entries: &[ConntrackEntry]) -> Vec<ConntrackEntry> {
        entries.iter().filter(|e| self.is_stale(e)).copied().collect()
    }

    /// Upstream's filters that delete `entry` when it is stale: one for its address frontend,
    /// one for its node port (none when it is not stale).
    fn filters_for(&self, entry: &ConntrackEntry) -> impl Iterator<Item = FlowFilter> + '_ {
        let relevant = entry.protocol == Protocol::Udp && entry.family() == self.family;
        let reply = self.reply(entry);
        let filter = move |orig_dst| FlowFilter {
            family: self.family,
            protocol: Protocol::Udp,
            orig_dst,
            orig_dport: entry.orig_dport,
            reply_src: reply.0,
            reply_sport: reply.1,
        };
        let by_address = relevant
            && self.by_address.get(&(entry.orig_dst, entry.orig_dport)).is_some_and(|eps| !eps.contains(&reply));
        let by_node_port =
            relevant && self.by_node_port.get(&entry.orig_dport).is_some_and(|eps| !eps.contains(&reply));
        let address = by_address.then(|| filter(Some(entry.orig_dst)));
        let node_port = by_node_port.then(|| filter(None));
        address.into_iter().chain(node_port)
    }
}

/// The filters that delete the stale entries among `entries` (upstream `CleanStaleEntries`'s
/// decision), sorted and without duplicates. Pure: `services` and `endpoints` are the
/// family's maps after the sync, `entries` what was listed for `family`. The entries they
/// match are exactly [`ServingFrontends::stale_entries`].
pub fn stale_flow_filters(
    matching: EndpointMatch,
    family: IpFamily,
    services: &ServicePortMap,
    endpoints: &EndpointsMap,
    entries: &[ConntrackEntry],
) -> Vec<FlowFilter> {
    ServingFrontends::new(matching, family, services, endpoints).filters(entries)
}

impl ServingFrontends {
    /// Upstream's filters for the stale entries among `entries`, sorted, without duplicates.
    pub fn filters(&self, entries: &[ConntrackEntry]) -> Vec<FlowFilter> {
        let filters: BTreeSet<FlowFilter> = entries.iter().flat_map(|e| self.filters_for(e)).collect();
        filters.into_iter().collect()
    }
}

/// What one [`reconcile`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReconcileSummary {
    /// Whether the entries could be listed; when not, nothing else was done (and upstream
    /// records no metric).
    pub listed: bool,
    /// UDP entries listed.
    pub entries: usize,
    /// Stale entries found (all deleted in one batch).
    pub stale: usize,
    /// Entries the batch removed.
    pub deleted: u64,
    /// Stale entries that were gone by the time the batch reached them (expired, or removed
    /// by someone else): not failures.
    pub gone: u64,
    /// Deletions that failed (logged; a whole batch that could not run counts every entry).
    pub failures: u64,
}

/// Lists the family's UDP entries, decides which are stale and deletes them (upstream
/// `CleanStaleEntries`, 1.32 and later). Failures are logged and summarised, never returned:
/// a stale entry costs one client until it times out, a failed sync would cost everyone.
pub fn reconcile(
    ct: &dyn Conntrack,
    matching: EndpointMatch,
    family: IpFamily,
    services: &ServicePortMap,
    endpoints: &EndpointsMap,
) -> ReconcileSummary {
    let frontends = ServingFrontends::new(matching, family, services, endpoints);
    let Some(entries) = list_udp(ct, family) else {
        return ReconcileSummary::default();
    };
    delete_stale(ct, &frontends, &entries)
}

/// The family's UDP entries, or `None` (logged) when they cannot be listed.
pub(crate) fn list_udp(ct: &dyn Conntrack, family: IpFamily) -> Option<Vec<ConntrackEntry>> {
    tracing::debug!(family = %family, "reconciling conntrack entries");
    match ct.list_entries(family, Protocol::Udp) {
        Ok(entries) => Some(entries),
        Err(err) => {
            tracing::error!(family = %family, error = %err, "failed to list conntrack entries");
            None
        }
    }
}

/// Deletes the entries of `listed` that are stale by `frontends`, in one batch.
pub(crate) fn delete_stale(
    ct: &dyn Conntrack,
    frontends: &ServingFrontends,
    listed: &[ConntrackEntry],
) -> ReconcileSummary {
    let family = frontends.family();
    let stale = frontends.stale_entries(listed);
    let mut summary =
        ReconcileSummary { listed: true, entries: listed.len(), stale: stale.len(), ..Default::default() };
    if !stale.is_empty() {
        match ct.delete_entries(family, &stale) {
            Ok(outcome) => {
                summary.deleted = outcome.deleted;
                summary.gone = outcome.gone;
                summary.failures = outcome.failed;
                if let Some(first) = &outcome.first_failure {
                    tracing::error!(family = %family, failed = outcome.failed, first = %first, "failed to delete stale conntrack entries");
                }
            }
            Err(err) => {
                summary.failures = stale.len() as u64;
                tracing::error!(family = %family, entries = stale.len(), error = %err, "failed to delete stale conntrack entries");
            }
        }
    }
    tracing::debug!(
        family = %family,
        entries = summary.entries,
        stale = summary.stale,
        deleted = summary.deleted,
        gone = summary.gone,
        failures = summary.failures,
        "finished reconciling conntrack entries"
    );
    summary
}

/// The entries in `conntrack -L` output (default or `-o extended` format). Lines that are not
/// a TCP, UDP or SCTP entry with both tuples complete are skipped; nothing here panics.
pub(crate) fn parse_entries(text: &str) -> Vec<ConntrackEntry> {
    text.lines().filter_map(parse_entry).collect()
}

/// One `conntrack -L` line: `udp 17 29 src=A dst=B sport=1 dport=2 [UNREPLIED] src=C dst=D
/// sport=3 dport=4 mark=0 use=1` (the extended format puts `ipv4 2` in front).
fn parse_entry(line: &str) -> Option<ConntrackEntry> {
    let mut protocol = None;
    // src, dst, sport, dport of the original (0) and reply (1) tuple.
    let mut ips: [[Option<IpAddr>; 2]; 2] = [[None; 2]; 2];
    let mut ports: [[Option<u16>; 2]; 2] = [[None; 2]; 2];
    let mut tuple = 0usize;
    let (mut zone, mut id) = (0u16, None);
    for token in line.split_whitespace() {
        let Some((key, value)) = token.split_once('=') else {
            if protocol.is_none() && ips[0][0].is_none() {
                protocol = match token {
                    "tcp" => Some(Protocol::Tcp),
                    "udp" => Some(Protocol::Udp),
                    "sctp" => Some(Protocol::Sctp),
                    _ => None,
                };
            }
            continue;
        };
        let (slot, is_ip) = match key {
            "src" => (0, true),
            "dst" => (1, true),
            "sport" => (0, false),
            "dport" => (1, false),
            "zone" => {
                zone = value.parse().ok()?;
                continue;
            }
            "id" => {
                id = Some(value.parse().ok()?);
                continue;
            }
            _ => continue,
        };
        // The second `src=` starts the reply tuple.
        if key == "src" && ips[0][0].is_some() {
            tuple = 1;
        }
        if tuple > 1 {
            return None;
        }
        if is_ip {
            let ip = value.parse::<IpAddr>().ok()?;
            if ips[tuple][slot].replace(ip).is_some() {
                return None;
            }
        } else {
            let port = value.parse::<u16>().ok()?;
            if ports[tuple][slot].replace(port).is_some() {
                return None;
            }
        }
    }
    Some(ConntrackEntry {
        protocol: protocol?,
        orig_src: ips[0][0]?,
        orig_dst: ips[0][1]?,
        orig_sport: ports[0][0]?,
        orig_dport: ports[0][1]?,
        reply_src: ips[1][0]?,
        reply_dst: ips[1][1]?,
        reply_sport: ports[1][0]?,
        reply_dport: ports[1][1]?,
        zone,
        id,
    })
}

/// The count in conntrack-tools' "N flow entries have been deleted." line, if present.
pub(crate) fn deleted_count(output: &str) -> Option<u64> {
    output.lines().find_map(|line| {
        let before = line.split(" flow entries have been deleted").next().filter(|b| b.len() < line.len())?;
        before.rsplit(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{EndpointInfo, NamespacedName, ServicePortName};
    use crate::node::conntrack::FakeConntrack;
    use crate::tracker::testing::svc;
    use crate::tracker::{EndpointsMap, ServiceChangeTracker, ServicePortMap};
    use std::sync::Arc;

    const CLUSTER_IP: &str = "172.30.1.1";
    const EXTERNAL_IP: &str = "192.168.99.100";
    const LB_IP: &str = "203.0.113.20";
    const PROXY_LB_IP: &str = "203.0.113.21";
    const NODE_PORT: u16 = 30053;
    const SERVING: &str = "10.240.0.4";
    const GONE: &str = "10.240.0.9";
    const CLIENT: &str = "10.0.0.50";

    fn ip(text: &str) -> IpAddr {
        text.parse().expect("test IP")
    }

    fn spn(name: &str, port: &str, protocol: Protocol) -> ServicePortName {
        ServicePortName::new(NamespacedName::new("ns", name), port, protocol)
    }

    /// `ns/dns` (UDP 53, node port, external IP, one VIP and one Proxy LB ingress) and
    /// `ns/web` (TCP 53 on the same cluster IP, to show TCP is never touched), with the
    /// service model of `release` (which drops Proxy-mode ingress IPs from 1.30).
    fn services(release: Release) -> ServicePortMap {
        let mut dns = svc("ns", "dns")
            .type_("LoadBalancer")
            .bare_cluster_ip(CLUSTER_IP)
            .external_ips(&[EXTERNAL_IP])
            .port("dns", "UDP", 53, i32::from(NODE_PORT))
            .lb_ingress(&[LB_IP, PROXY_LB_IP])
            .build();
        let ingress = dns.status.as_mut().and_then(|s| s.load_balancer.as_mut()).and_then(|lb| lb.ingress.as_mut());
        ingress.expect("ingress")[1].ip_mode = Some("Proxy".into());
        let empty = svc("ns", "empty").bare_cluster_ip("172.30.1.2").port("dns", "UDP", 53, 0).build();
        let web = svc("ns", "web").bare_cluster_ip("172.30.1.3").port("dns", "TCP", 53, 0).build();
        let mut tracker = ServiceChangeTracker::new(IpFamily::V4, crate::compat::Features::of(release));
        for svc in [&dns, &empty, &web] {
            tracker.update(None, Some(svc));
        }
        let mut map = ServicePortMap::new();
        map.update(&mut tracker);
        map
    }

    fn endpoint(name: &ServicePortName, ip: &str, port: i32, serving: bool) -> Arc<EndpointInfo> {
        let mut info = EndpointInfo::new(name, ip, port);
        info.serving = serving;
        info.ready = serving;
        Arc::new(info)
    }

    /// dns: one serving endpoint on 5353 and one that stopped serving; empty: only a
    /// non-serving endpoint; web: a serving one.
    fn endpoints() -> EndpointsMap {
        let dns = spn("dns", "dns", Protocol::Udp);
        let empty = spn("empty", "dns", Protocol::Udp);
        let web = spn("web", "dns", Protocol::Tcp);
        [
            (dns.clone(), vec![endpoint(&dns, SERVING, 5353, true), endpoint(&dns, "10.240.0.5", 5353, false)]),
            (empty.clone(), vec![endpoint(&empty, "10.240.0.6", 5353, false)]),
            (web.clone(), vec![endpoint(&web, SERVING, 5353, true)]),
        ]
        .into_iter()
        .collect()
    }

    fn udp(dst: &str, dport: u16, reply_src: &str, reply_sport: u16) -> ConntrackEntry {
        flow(Protocol::Udp, dst, dport, reply_src, reply_sport)
    }

    fn flow(protocol: Protocol, dst: &str, dport: u16, reply_src: &str, reply_sport: u16) -> ConntrackEntry {
        ConntrackEntry {
            protocol,
            orig_src: ip(CLIENT),
            orig_dst: ip(dst),
            orig_sport: 40000,
            orig_dport: dport,
            reply_src: ip(reply_src),
            reply_dst: ip(CLIENT),
            reply_sport,
            reply_dport: 40000,
            zone: 0,
            id: None,
        }
    }

    /// Runs the reconciler over `table` with a fake and returns (deleted, kept) entries.
    fn run(release: Release, table: &[ConntrackEntry]) -> (Vec<ConntrackEntry>, Vec<ConntrackEntry>, ReconcileSummary) {
        let fake = FakeConntrack::new();
        fake.set_entries(table.to_vec());
        let summary =
            reconcile(&fake, EndpointMatch::for_release(release), IpFamily::V4, &services(release), &endpoints());
        let kept = fake.entries();
        let deleted = table.iter().filter(|e| !kept.contains(e)).copied().collect();
        (deleted, kept, summary)
    }

    #[test]
    fn entries_to_every_frontend_not_answered_by_a_serving_endpoint_are_deleted() {
        let stale = [
            udp(CLUSTER_IP, 53, GONE, 5353),
            udp(EXTERNAL_IP, 53, GONE, 5353),
            udp(LB_IP, 53, GONE, 5353),
            udp("192.168.1.10", NODE_PORT, GONE, 5353),
            // Never DNATed (what a REJECT-era packet leaves): answered by the service IP.
            udp(CLUSTER_IP, 53, CLUSTER_IP, 53),
        ];
        let live = [
            udp(CLUSTER_IP, 53, SERVING, 5353),
            udp(LB_IP, 53, SERVING, 5353),
            udp("192.168.1.10", NODE_PORT, SERVING, 5353),
            // Another port of the cluster IP is not this service port's frontend.
            udp(CLUSTER_IP, 54, GONE, 5353),
            // Not a service address at all.
            udp("10.96.99.99", 53, GONE, 5353),
        ];
        let table: Vec<_> = stale.iter().chain(&live).copied().collect();
        let (deleted, kept, summary) = run(Release::V1_35, &table);
        assert_eq!(deleted, stale);
        assert_eq!(kept, live);
        assert_eq!(summary, ReconcileSummary { listed: true, entries: 10, stale: 5, deleted: 5, gone: 0, failures: 0 });
        // One listing and one batch, whatever the number of stale flows and frontends.
        assert_eq!(fake_runs(&table), (1, 1));
    }

    /// (listings, deletion batches) of one reconcile over `table`.
    fn fake_runs(table: &[ConntrackEntry]) -> (usize, usize) {
        let fake = FakeConntrack::new();
        fake.set_entries(table.to_vec());
        reconcile(&fake, EndpointMatch::IpAndPort, IpFamily::V4, &services(Release::V1_35), &endpoints());
        (fake.listings().len(), fake.entry_deletions().len())
    }

    /// The entries the filters of upstream's way match are exactly the stale entries found.
    #[test]
    fn the_stale_entries_are_what_upstreams_filters_match() {
        let mut table = Vec::new();
        for (i, (dst, dport)) in
            [(CLUSTER_IP, 53), (EXTERNAL_IP, 53), (LB_IP, 53), ("192.168.1.10", NODE_PORT), (CLUSTER_IP, 54)]
                .into_iter()
                .enumerate()
        {
            for (j, (reply, rport)) in
                [(GONE, 5353), (SERVING, 5353), (SERVING, 5300), (CLUSTER_IP, 53)].into_iter().enumerate()
            {
                let mut e = udp(dst, dport, reply, rport);
                e.orig_sport = 40000 + (i * 10 + j) as u16;
                table.push(e);
            }
        }
        for release in [Release::V1_33, Release::V1_35] {
            let matching = EndpointMatch::for_release(release);
            let frontends = ServingFrontends::new(matching, IpFamily::V4, &services(release), &endpoints());
            let filters = frontends.filters(&table);
            let by_filters: Vec<_> = table.iter().filter(|e| filters.iter().any(|f| f.matches(e))).copied().collect();
            assert_eq!(frontends.stale_entries(&table), by_filters, "{release}");
            assert!(!by_filters.is_empty());
        }
    }

    #[test]
    fn proxy_mode_load_balancer_ips_are_not_frontends() {
        // From 1.30 a Proxy-mode ingress is not one of the service's IPs (row 1).
        let (deleted, _, _) = run(Release::V1_35, &[udp(PROXY_LB_IP, 53, GONE, 5353)]);
        assert!(deleted.is_empty(), "{deleted:?}");
    }

    #[test]
    fn a_service_without_serving_endpoints_is_skipped() {
        let (deleted, _, summary) = run(Release::V1_35, &[udp("172.30.1.2", 53, GONE, 5353)]);
        assert!(deleted.is_empty(), "{deleted:?}");
        assert_eq!(summary.stale, 0);
    }

    /// From 1.37 (PR #139629) a UDP service scaled to zero is reconciled with no backend: a
    /// flow still DNATed to an endpoint that went away is deleted (the REJECT rule never sees
    /// it), and so is any other entry to its frontends.
    #[test]
    fn from_1_37_a_service_without_serving_endpoints_loses_its_entries() {
        let table = [udp("172.30.1.2", 53, GONE, 5353), udp("172.30.1.2", 53, "172.30.1.2", 53)];
        for release in [Release::V1_35, Release::V1_36] {
            let frontends = ServingFrontends::for_release(release, IpFamily::V4, &services(release), &endpoints());
            assert!(frontends.stale_entries(&table).is_empty(), "{release}");
        }
        let frontends =
            ServingFrontends::for_release(Release::V1_37, IpFamily::V4, &services(Release::V1_37), &endpoints());
        assert_eq!(frontends.stale_entries(&table), table.to_vec());
        // Served services are judged as before.
        let served = [udp(CLUSTER_IP, 53, SERVING, 5353)];
        assert!(frontends.stale_entries(&served).is_empty());
    }

    #[test]
    fn tcp_entries_are_never_touched() {
        let table = [flow(Protocol::Tcp, CLUSTER_IP, 53, GONE, 5353), flow(Protocol::Tcp, "172.30.1.3", 53, GONE, 80)];
        let (deleted, _, _) = run(Release::V1_35, &table);
        assert!(deleted.is_empty(), "{deleted:?}");
    }

    #[test]
    fn endpoint_port_counts_from_1_34() {
        // Answered by the serving endpoint's IP from its old target port.
        let old_port = udp(CLUSTER_IP, 53, SERVING, 5300);
        let (deleted, _, _) = run(Release::V1_34, &[old_port]);
        assert_eq!(deleted, [old_port]);
        for release in [Release::V1_32, Release::V1_33] {
            let (deleted, _, _) = run(release, &[old_port]);
            assert!(deleted.is_empty(), "{release}: {deleted:?}");
        }
    }

    #[test]
    fn filters_are_upstreams_per_release() {
        let table = [udp(CLUSTER_IP, 53, GONE, 5353), udp("192.168.1.10", NODE_PORT, GONE, 5353)];
        let args = |release| {
            stale_flow_filters(
                EndpointMatch::for_release(release),
                IpFamily::V4,
                &services(release),
                &endpoints(),
                &table,
            )
            .iter()
            .map(|f| f.args().join(" "))
            .collect::<Vec<_>>()
        };
        assert_eq!(
            args(Release::V1_33),
            [
                "-D -p udp --dport 30053 --reply-src 10.240.0.9",
                "-D -p udp --orig-dst 172.30.1.1 --dport 53 --reply-src 10.240.0.9",
            ]
        );
        assert_eq!(
            args(Release::V1_35),
            [
                "-D -p udp --dport 30053 --reply-src 10.240.0.9 --reply-port-src 5353",
                "-D -p udp --orig-dst 172.30.1.1 --dport 53 --reply-src 10.240.0.9 --reply-port-src 5353",
            ]
        );
    }

    #[test]
    fn ipv6_filters_carry_the_family_flag() {
        let filter = FlowFilter {
            family: IpFamily::V6,
            protocol: Protocol::Udp,
            orig_dst: Some(ip("fd00:10:96::a")),
            orig_dport: 53,
            reply_src: ip("fd00:10:244::5"),
            reply_sport: Some(5353),
        };
        assert_eq!(
            filter.args().join(" "),
            "-D -p udp --orig-dst fd00:10:96::a --dport 53 --reply-src fd00:10:244::5 --reply-port-src 5353 -f ipv6"
        );
        assert_eq!(
            filter.to_string(),
            "UDP conntrack entries to [fd00:10:96::a]:53 answered by fd00:10:244::5 port 5353"
        );
    }

    #[test]
    fn a_failed_listing_deletes_nothing() {
        let fake = FakeConntrack::new();
        fake.set_entries(vec![udp(CLUSTER_IP, 53, GONE, 5353)]);
        fake.fail_listing(true);
        let summary = reconcile(&fake, EndpointMatch::IpAndPort, IpFamily::V4, &services(Release::V1_35), &endpoints());
        assert_eq!(summary, ReconcileSummary::default());
        assert_eq!(fake.entries().len(), 1);
    }

    #[test]
    fn a_failed_deletion_is_counted_and_the_rest_go_on() {
        let fake = FakeConntrack::new();
        let table = vec![udp(CLUSTER_IP, 53, GONE, 5353), udp(EXTERNAL_IP, 53, GONE, 5353)];
        fake.set_entries(table.clone());
        fake.fail_entry(table[0]);
        let summary = reconcile(&fake, EndpointMatch::IpAndPort, IpFamily::V4, &services(Release::V1_35), &endpoints());
        assert_eq!(summary, ReconcileSummary { listed: true, entries: 2, stale: 2, deleted: 1, gone: 0, failures: 1 });
        assert_eq!(fake.entry_deletions(), std::slice::from_ref(&table));
        assert_eq!(fake.entries(), [table[0]]);
    }

    #[test]
    fn entries_gone_before_the_batch_are_not_failures() {
        let fake = FakeConntrack::new();
        let table = vec![udp(CLUSTER_IP, 53, GONE, 5353), udp(EXTERNAL_IP, 53, GONE, 5353)];
        fake.set_entries(table.clone());
        // The first one expires between the listing and the deletion.
        fake.expire_after_listing(table[0]);
        let summary = reconcile(&fake, EndpointMatch::IpAndPort, IpFamily::V4, &services(Release::V1_35), &endpoints());
        assert_eq!(summary, ReconcileSummary { listed: true, entries: 2, stale: 2, deleted: 1, gone: 1, failures: 0 });
        assert!(fake.entries().is_empty());
    }

    #[test]
    fn parses_the_tools_default_and_extended_formats() {
        let text = "\
udp      17 29 src=10.0.0.50 dst=172.30.1.1 sport=40000 dport=53 [UNREPLIED] src=10.240.0.9 dst=10.0.0.50 sport=5353 dport=40000 mark=0 use=1
ipv6     10 udp      17 20 src=fd00::50 dst=fd00:10:96::a sport=40001 dport=53 src=fd00:10:244::5 dst=fd00::50 sport=5353 dport=40001 [ASSURED] mark=0 zone=3 use=1
tcp      6 431999 ESTABLISHED src=10.0.0.50 dst=172.30.1.3 sport=40002 dport=53 src=10.240.0.4 dst=10.0.0.50 sport=5353 dport=40002 [ASSURED] mark=0 use=1
conntrack v1.4.7 (conntrack-tools): 3 flow entries have been shown.
";
        let entries = parse_entries(text);
        assert_eq!(
            entries,
            [
                udp(CLUSTER_IP, 53, GONE, 5353),
                ConntrackEntry {
                    protocol: Protocol::Udp,
                    orig_src: ip("fd00::50"),
                    orig_dst: ip("fd00:10:96::a"),
                    orig_sport: 40001,
                    orig_dport: 53,
                    reply_src: ip("fd00:10:244::5"),
                    reply_dst: ip("fd00::50"),
                    reply_sport: 5353,
                    reply_dport: 40001,
                    zone: 3,
                    id: None,
                },
                ConntrackEntry {
                    orig_sport: 40002,
                    reply_dport: 40002,
                    ..flow(Protocol::Tcp, "172.30.1.3", 53, SERVING, 5353)
                },
            ]
        );
    }

    #[test]
    fn odd_lines_are_skipped_without_panicking() {
        let odd = [
            "",
            "   ",
            "garbage",
            "udp 17 29 src=10.0.0.1",
            "udp 17 29 src=10.0.0.1 dst=10.0.0.2 sport=1 dport=2",
            "udp 17 29 src=10.0.0.1 dst=10.0.0.2 sport=1 dport=2 src=10.0.0.3 dst=10.0.0.1 sport=x dport=1",
            "udp 17 29 src=10.0.0.1 dst=10.0.0.2 sport=1 dport=99999 src=10.0.0.3 dst=10.0.0.1 sport=2 dport=1",
            "udp 17 29 src=nope dst=10.0.0.2 sport=1 dport=2 src=10.0.0.3 dst=10.0.0.1 sport=2 dport=1",
            "udp 17 29 src=10.0.0.1 dst=10.0.0.2 dst=10.0.0.9 sport=1 dport=2 src=10.0.0.3 dst=10.0.0.1 sport=2 dport=1",
            "udp 17 29 src=10.0.0.1 dst=10.0.0.2 sport=1 dport=2 src=10.0.0.3 dst=10.0.0.1 sport=2 dport=1 src=10.0.0.4",
            "icmp 1 29 src=10.0.0.1 dst=10.0.0.2 type=8 code=0 id=1 src=10.0.0.2 dst=10.0.0.1 type=0 code=0 id=1",
            "= == src= sport= ☃",
        ];
        for line in odd {
            assert_eq!(parse_entries(line), [], "{line:?}");
        }
    }

    #[test]
    fn deleted_count_reads_the_tools_summary() {
        assert_eq!(deleted_count("conntrack v1.4.7 (conntrack-tools): 3 flow entries have been deleted.\n"), Some(3));
        assert_eq!(
            deleted_count("udp 17 ...\nconntrack v1.4.7 (conntrack-tools): 0 flow entries have been deleted.\n"),
            Some(0)
        );
        assert_eq!(deleted_count("something else"), None);
        assert_eq!(deleted_count(" flow entries have been deleted"), None);
    }
}
