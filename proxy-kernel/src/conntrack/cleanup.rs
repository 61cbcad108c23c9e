//! Stale conntrack entries after endpoint changes (kube-proxy's pkg/proxy/conntrack/cleanup.go,
//! a reconciler rather than event-based deletes).
//!
//! For every UDP (and, unlike kube-proxy today, SCTP) service port, an entry whose original
//! destination is one of the port's frontends (ClusterIP, externalIPs, load-balancer IPs — or
//! its NodePort on any address) is stale when its reply source, the backend a DNAT chose, is not
//! a serving endpoint any more. Such an entry would keep steering the flow to a dead backend
//! (kubernetes#48370), and an entry created while the Service had no endpoints (not DNATed, so
//! its reply source is the frontend itself) would keep black-holing it after endpoints appear.
//!
//! A port without serving endpoints has an empty endpoint set and all its DNATed entries are
//! removed: kube-proxy from 1.32 to 1.36 skipped such ports, so entries pinned to the last
//! endpoint survived its removal; 1.37 removes them too.
//!
//! Frontends that are gone (a deleted Service, a removed port or address: [`GoneFrontends`])
//! are matched with an empty endpoint set too, as kube-proxy does for deleted UDP Services since
//! 1.37: a one-way sender (statsd, syslog) refreshes its entry with every datagram and would
//! otherwise keep reaching the old backend's address — perhaps another pod's by now — after the
//! rules are gone. A frontend that is live again goes by its live endpoints.
//!
//! TCP goes further than kube-proxy, which leaves TCP entries alone: when a TCP frontend address
//! (ClusterIP, externalIP, LB IP) gets its first serving endpoint ([`ServedStreams`], the first
//! sync included), its entries that were never translated (reply source = original destination)
//! go. A client that tried the address before it was programmed (an agent's slow first sync)
//! left them — a SYN to a ClusterIP goes out by the default route and gets no answer, so the
//! entry waits in SYN_SENT for two minutes — and each later connection from a reused source port
//! matched one, kept its untranslated destination and was black-holed. DNATed entries, live
//! connections, are never touched.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use super::netlink::{ConntrackEntry, ConntrackError, Ctnetlink};
use proxy_model::desired::{FamilySnapshot, IpFamily, Protocol};

/// Why an entry goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StaleFilter {
    /// Original destination is a frontend address:port whose endpoints do not include the reply
    /// source.
    Frontend,
    /// Original destination port is a NodePort whose endpoints do not include the reply source.
    NodePort,
    /// A TCP connection to a frontend address that has just been given serving endpoints, made
    /// before: never translated, it would keep its source port's next connections from being.
    Untranslated,
}

/// Serving endpoint addresses per frontend, per protocol.
#[derive(Debug, Default)]
struct Frontends {
    by_address: BTreeMap<(u8, IpAddr, u16), BTreeSet<IpAddr>>,
    by_node_port: BTreeMap<(u8, u16), BTreeSet<IpAddr>>,
}

/// The UDP and SCTP frontends of a snapshot, as addresses and NodePorts: what a later sync
/// compares with to find the ones that went.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct GoneFrontends {
    by_address: BTreeSet<(u8, IpAddr, u16)>,
    by_node_port: BTreeSet<(u8, u16)>,
}

impl GoneFrontends {
    /// Every UDP and SCTP frontend of `snapshot`.
    pub fn of(snapshot: &FamilySnapshot) -> Self {
        let frontends = frontends(snapshot, &Self::default());
        Self {
            by_address: frontends.by_address.into_keys().collect(),
            by_node_port: frontends.by_node_port.into_keys().collect(),
        }
    }

    /// Adds the frontends of `before` that `now` lacks, and forgets those `now` has again.
    pub fn add_gone(&mut self, before: &Self, now: &Self) {
        self.by_address
            .extend(before.by_address.difference(&now.by_address));
        self.by_node_port
            .extend(before.by_node_port.difference(&now.by_node_port));
        self.by_address.retain(|key| !now.by_address.contains(key));
        self.by_node_port
            .retain(|key| !now.by_node_port.contains(key));
    }

    pub fn is_empty(&self) -> bool {
        self.by_address.is_empty() && self.by_node_port.is_empty()
    }
}

/// The TCP frontend addresses and ports (ClusterIP, externalIPs, LB IPs) with a serving
/// endpoint: a later sync compares with them to find the newly served ones.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ServedStreams {
    by_address: BTreeSet<(IpAddr, u16)>,
}

impl ServedStreams {
    /// Every TCP frontend address of `snapshot` with a serving endpoint.
    pub fn of(snapshot: &FamilySnapshot) -> Self {
        let mut by_address = BTreeSet::new();
        for port in snapshot.service_ports.values() {
            if port.protocol != Protocol::Tcp || !port.endpoints.iter().any(|e| e.serving) {
                continue;
            }
            by_address.extend(port.frontend_addresses().map(|addr| (*addr, port.port)));
        }
        Self { by_address }
    }

    /// Adds the frontends `now` serves that `before` did not (as [`GoneFrontends::add_gone`]
    /// collects the ones that went, until a cleanup succeeds).
    pub fn add_newly(&mut self, before: &Self, now: &Self) {
        self.by_address
            .extend(now.by_address.difference(&before.by_address));
    }

    pub fn is_empty(&self) -> bool {
        self.by_address.is_empty()
    }
}

fn frontends(snapshot: &FamilySnapshot, gone: &GoneFrontends) -> Frontends {
    // Gone ones first, with no endpoint: a live frontend of the same key replaces them.
    let mut frontends = Frontends {
        by_address: gone
            .by_address
            .iter()
            .map(|key| (*key, BTreeSet::new()))
            .collect(),
        by_node_port: gone
            .by_node_port
            .iter()
            .map(|key| (*key, BTreeSet::new()))
            .collect(),
    };
    for port in snapshot.service_ports.values() {
        if !matches!(port.protocol, Protocol::Udp | Protocol::Sctp) {
            continue;
        }
        let proto = port.protocol.number();
        // kube-proxy's IsServing(): ready or serving-terminating; policies and topology are
        // deliberately ignored, an endpoint other nodes may use is not stale here either.
        let serving: BTreeSet<IpAddr> = port
            .endpoints
            .iter()
            .filter(|e| e.serving)
            .map(|e| e.addr)
            .collect();
        for addr in port.frontend_addresses() {
            frontends
                .by_address
                .insert((proto, *addr, port.port), serving.clone());
        }
        if let Some(node_port) = port.node_port {
            frontends
                .by_node_port
                .insert((proto, node_port), serving.clone());
        }
    }
    frontends
}

/// The entries that are stale for `snapshot`, the frontends that are `gone` and the TCP ones
/// `newly_served`, with the reason.
pub fn stale_filters(
    snapshot: &FamilySnapshot,
    gone: &GoneFrontends,
    newly_served: &ServedStreams,
    entries: &[ConntrackEntry],
) -> Vec<(ConntrackEntry, StaleFilter)> {
    let frontends = frontends(snapshot, gone);
    let mut stale = Vec::new();
    for entry in entries {
        let original = &entry.original;
        let backend = entry.reply.src;
        if original.protocol == Protocol::Tcp.number() {
            if !entry.dnat()
                && newly_served
                    .by_address
                    .contains(&(original.dst, original.dst_port))
            {
                stale.push((*entry, StaleFilter::Untranslated));
            }
            continue;
        }
        let key = (original.protocol, original.dst, original.dst_port);
        if let Some(serving) = frontends.by_address.get(&key) {
            if !serving.contains(&backend) {
                stale.push((*entry, StaleFilter::Frontend));
            }
            continue;
        }
        if let Some(serving) = frontends
            .by_node_port
            .get(&(original.protocol, original.dst_port))
            && !serving.contains(&backend)
        {
            stale.push((*entry, StaleFilter::NodePort));
        }
    }
    stale
}

/// What one reconcile did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CleanupReport {
    pub scanned: usize,
    pub deleted: usize,
    pub failed: usize,
}

/// Dumps the conntrack table of `family` in the current network namespace and deletes the
/// entries that are stale for `snapshot`, the `gone` frontends and the `newly_served` ones.
pub fn reconcile(
    family: IpFamily,
    snapshot: &FamilySnapshot,
    gone: &GoneFrontends,
    newly_served: &ServedStreams,
) -> Result<CleanupReport, ConntrackError> {
    let mut ctnetlink = Ctnetlink::open()?;
    let entries = ctnetlink.dump(family)?;
    let mut report = CleanupReport {
        scanned: entries.len(),
        ..CleanupReport::default()
    };
    for (entry, reason) in stale_filters(snapshot, gone, newly_served, &entries) {
        match ctnetlink.delete(&entry.original) {
            Ok(()) => {
                tracing::debug!(?entry, ?reason, "deleted stale conntrack entry");
                report.deleted += 1;
            }
            Err(error) => {
                tracing::warn!(?entry, %error, "cannot delete stale conntrack entry");
                report.failed += 1;
            }
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests;
