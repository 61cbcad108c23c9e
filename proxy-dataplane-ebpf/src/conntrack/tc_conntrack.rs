//! The tc programs' conntrack (`KPR_CT4`, `KPR_CT6`: [`ConntrackMaps`]) from user space: reading it (tests, diagnostics),
//! purging the entries of backends that left a Service, and garbage collection of dead flows.
//!
//! Garbage collection (periodic, see [`gc_round`]): the datapath treats an expired forward entry as
//! absent but never deletes it, and a reply entry outlives its flow; the LRU would evict them
//! only under pressure, at the cost of live flows' entries when the map is full. Each run
//! deletes forward entries past their idle timeout (`proxy_common::ct_timeout`, the
//! datapath's own constants) together with their reply entries, and reply entries whose
//! forward entry is gone or belongs to a newer flow.
//!
//! The design's rule: after an endpoint goes away no UDP flow keeps using it. A BPF conntrack
//! entry pins a flow to its backend for as long as packets keep coming (the idle timeout is
//! refreshed by each packet), so a client that keeps one source port — a DNS resolver, a game,
//! a QUIC connection — would keep sending to a deleted pod forever. After each apply, the
//! entries of every removed (frontend, backend) pair are deleted: the next packet of such a flow
//! is a new flow and picks a live backend. TCP entries stay (kube-proxy leaves TCP conntrack
//! alone too): a backend leaves the live set when it starts terminating, in every rolling
//! update, and its established connections must drain there; a TCP packet that is not a SYN
//! never starts a flow in the datapath, so a purged entry could only turn into a reset. Entries
//! of TCP flows to a deleted pod idle out or are closed by FIN/RST like any other.
//!
//! Cost: the LRU hash map has no secondary index, so GC and purges walk the whole map from
//! user space (about 0.5 s for a full 262 144-entry table), in batches with a cursor that
//! survives deletions ([`CtWalk`]). They run on the conntrack worker's thread
//! (`ct_worker`), never in the sync loop; a purge only after applies that removed backends of
//! external frontends, deleting only entries that match.

use std::net::IpAddr;

use aya::{
    Pod,
    maps::{Map, MapData},
};
use proxy_common::{
    CtKey, CtKey4, CtValue, CtValue4, PortFilter,
    conntrack::{holds_reply, orphaned, reverse_key},
    ct_flags, ct_timeout, family,
};

use crate::{
    conntrack::ct_maps::ConntrackMaps,
    maps::map_writer::{RemovedBackend, ip4_to_map, ip6_to_map},
};
use proxy_kernel::bpf::map_batch::{BatchAttr, lookup_batch};
use proxy_model::desired::Scope;

/// Address words and family of an IP address as the maps store them.
fn words(addr: IpAddr) -> ([u32; 4], u8) {
    match addr {
        IpAddr::V4(a) => ([ip4_to_map(a), 0, 0, 0], family::V4),
        IpAddr::V6(a) => (ip6_to_map(a), family::V6),
    }
}

/// A removed (frontend, backend) pair in map representation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stale {
    /// `None`: a NodePort (any node address).
    frontend_addr: Option<[u32; 4]>,
    /// Network order.
    frontend_port: u16,
    proto: u8,
    family: u8,
    backend_addr: [u32; 4],
    /// Network order.
    backend_port: u16,
}

impl Stale {
    fn of(removed: &RemovedBackend) -> Option<Self> {
        // Socket-level frontends never create tc conntrack entries; TCP flows drain.
        if removed.frontend.scope != Scope::External
            || removed.frontend.protocol == proxy_model::desired::Protocol::Tcp
        {
            return None;
        }
        let (backend_addr, family) = words(removed.backend.ip());
        let (frontend_words, frontend_family) = words(removed.frontend.addr);
        if frontend_family != family {
            return None;
        }
        Some(Self {
            frontend_addr: (!removed.frontend.addr.is_unspecified()).then_some(frontend_words),
            frontend_port: removed.frontend.port.to_be(),
            proto: removed.frontend.protocol.number(),
            family,
            backend_addr,
            backend_port: removed.backend.port().to_be(),
        })
    }

    fn frontend_matches(&self, addr: &[u32; 4], port: u16) -> bool {
        port == self.frontend_port && self.frontend_addr.is_none_or(|a| a == *addr)
    }

    /// Whether the entry belongs to a flow of this frontend to this backend. A forward entry
    /// is keyed by what the client sent (the frontend) and rewrites to the backend; a reply
    /// entry is keyed by what the backend sends and rewrites back to the frontend.
    fn matches(&self, key: &CtKey, value: &CtValue) -> bool {
        if key.proto != self.proto || key.family != self.family {
            return false;
        }
        if value.flags & ct_flags::REPLY == 0 {
            value.dst == self.backend_addr
                && value.dport == self.backend_port
                && self.frontend_matches(&key.dst, key.dport)
        } else {
            key.src == self.backend_addr
                && key.sport == self.backend_port
                && self.frontend_matches(&value.src, value.sport)
        }
    }
}

/// The conntrack keys to delete for `removed`, from a snapshot of the map.
pub fn stale_keys<'a>(
    entries: impl IntoIterator<Item = &'a (CtKey, CtValue)>,
    removed: &[RemovedBackend],
) -> Vec<CtKey> {
    let stale: Vec<Stale> = removed.iter().filter_map(Stale::of).collect();
    if stale.is_empty() {
        return Vec::new();
    }
    entries
        .into_iter()
        .filter(|(key, value)| stale.iter().any(|s| s.matches(key, value)))
        .map(|(key, _)| *key)
        .collect()
}

/// The removed pairs whose flows the tc programs track. With
/// `--bpf-socket-lb-host-namespace-only` (`internal_in_tc`) that includes the socket-level
/// frontends: pods' flows to them are tc flows, keyed by the frontend as external ones are, so
/// they are purged the same way (as External pairs: duplicates of a ClusterIP's external pair
/// only match the same entries).
pub fn tracked(removed: &[RemovedBackend], internal_in_tc: bool) -> Vec<RemovedBackend> {
    removed
        .iter()
        .map(|r| {
            let mut r = *r;
            if internal_in_tc {
                r.frontend.scope = Scope::External;
            }
            r
        })
        .collect()
}

/// Whether any removed pair can have tc conntrack entries (saves the walk otherwise).
pub fn any_external(removed: &[RemovedBackend]) -> bool {
    removed.iter().any(|r| Stale::of(r).is_some())
}

/// What a purge did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PurgeReport {
    pub scanned: usize,
    pub deleted: usize,
}

/// Deletes the entries of removed backends.
pub fn purge<T: std::borrow::BorrowMut<MapData>>(
    map: &mut ConntrackMaps<T>,
    removed: &[RemovedBackend],
) -> PurgeReport {
    if !any_external(removed) {
        return PurgeReport::default();
    }
    let all = map.entries();
    let mut report = PurgeReport {
        scanned: all.len(),
        deleted: 0,
    };
    for key in stale_keys(&all, removed) {
        // Already gone (evicted, or the flow's other entry raced us): nothing to do.
        if map.remove(&key).is_ok() {
            report.deleted += 1;
        }
    }
    report
}

/// The port of a live entry that the ingress programs' port filter must let in: a forward
/// entry's destination port (the frontend's, which the client's packets carry) and a reply
/// entry's source port (the backend's). Egress entries are the egress program's, which the
/// filter does not apply to.
pub fn note_ports(key: &CtKey, value: &CtValue, ports: &mut PortFilter) {
    if is_egress(value) {
        return;
    }
    if is_reply(value) {
        ports.set_source(u16::from_be(key.sport));
    } else {
        ports.set_destination(u16::from_be(key.dport));
    }
}

fn is_reply(value: &CtValue) -> bool {
    value.flags & ct_flags::REPLY != 0
}

fn forward_expired(key: &CtKey, value: &CtValue, now: u64) -> bool {
    ct_timeout::expired(key.proto, value.flags, value.last_seen_ns, now)
}

/// Whether reply entry (`key`, `value`) is dead given the forward entry `forward` of its
/// client tuple (if any): that entry is gone, expired or of a newer flow. A reply entry
/// younger than `ORPHAN_REPLY_NS` is kept whatever: the datapath writes it just before the
/// forward entry, so a walk can see it alone.
fn reply_dead(key: &CtKey, value: &CtValue, forward: Option<&CtValue>, now: u64) -> bool {
    let alive = forward.is_some_and(|f| holds_reply(f, key, now));
    !alive && orphaned(value, now)
}

fn is_egress(value: &CtValue) -> bool {
    value.flags & ct_flags::EGRESS != 0
}

/// Whether entry (`key`, `value`) is dead; `lookup` reads other entries (a snapshot or the
/// live map). Egress entries (netfilter path, `ct_flags::EGRESS`) are never refreshed by the
/// datapath: they live exactly as long as the SNATed flow they mirror.
/// - egress reply entry (backend → client): its flow's forward entry (client → frontend, the
///   reverse of its value) is alive, SNATed, and goes to this backend;
/// - egress forward entry (client → backend): its flow's reply entry (backend → SNAT address,
///   the reverse of its value) exists and that flow's forward entry is alive.
fn entry_dead(
    key: &CtKey,
    value: &CtValue,
    lookup: impl Fn(&CtKey) -> Option<CtValue>,
    now: u64,
) -> bool {
    if is_egress(value) {
        let alive = if is_reply(value) {
            let forward_key = reverse_key(key, value);
            lookup(&forward_key).is_some_and(|f| {
                !is_reply(&f)
                    && f.flags & ct_flags::SNAT != 0
                    && f.dst == key.src
                    && f.dport == key.sport
                    && !forward_expired(&forward_key, &f, now)
            })
        } else {
            let reply_key = reverse_key(key, value);
            lookup(&reply_key).is_some_and(|reply| {
                is_reply(&reply)
                    && !is_egress(&reply)
                    && reply.dst == key.src
                    && reply.dport == key.sport
                    && {
                        let forward_key = reverse_key(&reply_key, &reply);
                        lookup(&forward_key).is_some_and(|f| holds_reply(&f, &reply_key, now))
                    }
            })
        };
        return !alive && orphaned(value, now);
    }
    if is_reply(value) {
        let forward = lookup(&reverse_key(key, value));
        reply_dead(key, value, forward.as_ref(), now)
    } else {
        forward_expired(key, value, now)
    }
}

/// The keys a garbage collection round deletes from a snapshot of the map taken at monotonic
/// time `now` (the decision `gc_round` makes on the live map, on a snapshot for tests) (`bpf_ktime_get_ns`'s clock): expired forward entries, the reply entries of
/// their flows, dead reply entries and the egress entries of dead flows. At most `limit` keys.
#[cfg(test)]
pub fn gc_keys(entries: &[(CtKey, CtValue)], now: u64, limit: usize) -> Vec<CtKey> {
    let by_key: std::collections::HashMap<&CtKey, &CtValue> =
        entries.iter().map(|(k, v)| (k, v)).collect();
    let lookup = |k: &CtKey| by_key.get(k).map(|v| **v);
    let mut keys = Vec::new();
    for (key, value) in entries {
        if keys.len() >= limit {
            break;
        }
        // An expired forward entry's reply entry is found dead on its own when the walk
        // reaches it unless it is younger than ORPHAN_REPLY_NS, which a reply entry of an
        // expired flow cannot be: it was written when the flow began.
        if entry_dead(key, value, lookup, now) {
            keys.push(*key);
        }
    }
    keys
}

/// What a garbage collection run did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct GcReport {
    /// Entries walked.
    pub scanned: usize,
    pub deleted_forward: usize,
    pub deleted_reply: usize,
    /// Entries left (`scanned` less the deletions).
    pub remaining: usize,
}

const MAX_BATCH: usize = 1 << 20;

/// A resumable walk over the conntrack map, in batches (`BPF_MAP_LOOKUP_BATCH`, Linux ≥ 5.6).
/// Its cursor is the kernel's bucket index, not a key: a key-based walk (`get_next_key`)
/// restarts from the first bucket when the key it stands on is deleted — by a GC or purge,
/// by the datapath, by LRU eviction — and so revisits entries or never ends under churn. This
/// one goes on where it stopped: every entry present for the whole round is visited exactly
/// once, entries deleted before their bucket is reached are not visited.
#[derive(Debug, Default)]
pub struct CtWalk {
    /// The kernel's opaque batch token (a bucket index for hash maps); `None` at the start.
    cursor: Option<u64>,
    finished: bool,
}

impl CtWalk {
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether the round is over (the last batch reached the end of the map).
    pub fn finished(&self) -> bool {
        self.finished
    }

    /// The next batch of up to `max` entries (at least one bucket's: more when a bucket holds
    /// more) of a map of `K` → `V`. Empty once [`CtWalk::finished`].
    pub fn next_batch<K: Pod + Default, V: Pod + Default>(
        &mut self,
        map: std::os::fd::BorrowedFd<'_>,
        max: usize,
    ) -> std::io::Result<Vec<(K, V)>> {
        use std::os::fd::AsRawFd as _;
        if self.finished {
            return Ok(Vec::new());
        }
        let mut capacity = max.clamp(1, MAX_BATCH);
        loop {
            let mut keys = vec![K::default(); capacity];
            let mut values = vec![V::default(); capacity];
            let mut in_batch = self.cursor.unwrap_or(0);
            let mut out_batch = 0u64;
            let mut attr = BatchAttr {
                in_batch: if self.cursor.is_some() {
                    (&raw mut in_batch) as u64
                } else {
                    0
                },
                out_batch: (&raw mut out_batch) as u64,
                keys: keys.as_mut_ptr() as u64,
                values: values.as_mut_ptr() as u64,
                count: u32::try_from(capacity).unwrap_or(u32::MAX),
                map_fd: u32::try_from(map.as_raw_fd()).unwrap_or(u32::MAX),
                ..BatchAttr::default()
            };
            // SAFETY: the key and value arrays hold `capacity` elements of `K` and `V` (the
            // map's sizes, as the caller's map says) and the cursor words a hash map's bucket
            // index; all outlive the call.
            let error = unsafe { lookup_batch(&mut attr) }.err();
            let got = attr.count as usize;
            match error.as_ref().and_then(std::io::Error::raw_os_error) {
                // One bucket holds more than asked for: ask for more.
                Some(libc::ENOSPC) if capacity < MAX_BATCH => {
                    capacity = (capacity * 2).min(MAX_BATCH);
                    continue;
                }
                // The end of the map: `got` entries came with it.
                Some(libc::ENOENT) => self.finished = true,
                Some(_) => return Err(error.unwrap_or_else(std::io::Error::last_os_error)),
                None => self.cursor = Some(out_batch),
            }
            let got = got.min(capacity);
            keys.truncate(got);
            values.truncate(got);
            return Ok(keys.into_iter().zip(values).collect());
        }
    }
}

/// The fd of a conntrack map (an LRU hash map; a plain hash map in older objects).
fn map_fd(map: &Map) -> std::io::Result<std::os::fd::BorrowedFd<'_>> {
    use std::os::fd::AsFd as _;
    match map {
        Map::LruHashMap(data) | Map::HashMap(data) => Ok(data.fd().as_fd()),
        _ => Err(std::io::Error::other("the conntrack map is not a hash map")),
    }
}

/// The conntrack maps as the worker and the dataplane hold them (`KPR_CT4`, `KPR_CT6`, and
/// the unanswered flows' `KPR_CT4_NEW`, `KPR_CT6_NEW`: a purge of a removed backend's flows
/// covers those still in their handshake too).
#[derive(Debug)]
pub struct ConntrackPair<'a> {
    pub v4: &'a mut Map,
    pub v6: &'a mut Map,
    pub new4: &'a mut Map,
    pub new6: &'a mut Map,
}

/// A walk over the maps in turn, IPv4 first; entries widened.
#[derive(Debug, Default)]
struct PairWalk {
    v4: CtWalk,
    v6: CtWalk,
    new4: CtWalk,
    new6: CtWalk,
}

impl PairWalk {
    fn finished(&self) -> bool {
        self.v4.finished() && self.v6.finished() && self.new4.finished() && self.new6.finished()
    }

    fn next_batch(
        &mut self,
        maps: &ConntrackPair<'_>,
        max: usize,
    ) -> std::io::Result<Vec<(CtKey, CtValue)>> {
        if !self.v4.finished() {
            let batch = self
                .v4
                .next_batch::<CtKey4, CtValue4>(map_fd(maps.v4)?, max)?;
            return Ok(batch
                .into_iter()
                .map(|(k, v)| (k.widen(), v.widen()))
                .collect());
        }
        if !self.v6.finished() {
            return self.v6.next_batch(map_fd(maps.v6)?, max);
        }
        if !self.new4.finished() {
            let batch = self
                .new4
                .next_batch::<CtKey4, CtValue4>(map_fd(maps.new4)?, max)?;
            return Ok(batch
                .into_iter()
                .map(|(k, v)| (k.widen(), v.widen()))
                .collect());
        }
        self.new6.next_batch(map_fd(maps.new6)?, max)
    }
}

fn both<'m>(maps: &'m mut ConntrackPair<'_>) -> std::io::Result<ConntrackMaps<&'m mut MapData>> {
    ConntrackMaps::borrow(
        &mut *maps.v4,
        &mut *maps.v6,
        &mut *maps.new4,
        &mut *maps.new6,
    )
    .map_err(std::io::Error::other)
}

/// Garbage collection of `map` in one round of batches of `batch` entries: expired forward
/// entries, the reply entries of their flows, dead reply entries and the egress entries of
/// dead flows (`entry_dead`). Each entry is read again just before the decision and kept if a
/// packet revived it since its batch was read, so only a flow that stays idle through the
/// round loses its entries. For the worker, which runs it off the sync
/// loop; a round's cost is bounded by the map's size, not by how much is deleted under it.
///
/// The ports of the entries it keeps go into `ports`, as the programs' port filter must keep
/// them (see [`note_ports`]).
pub fn gc_round(
    maps: &mut ConntrackPair<'_>,
    now: u64,
    batch: usize,
    ports: &mut PortFilter,
) -> std::io::Result<GcReport> {
    let mut walk = PairWalk::default();
    let mut report = GcReport::default();
    while !walk.finished() {
        let entries = walk.next_batch(maps, batch)?;
        let mut ct = both(maps)?;
        report.scanned += entries.len();
        for (key, _) in entries {
            // Read again: a packet since the batch may have revived it (or deleted it).
            let Some(value) = ct.get(&key) else {
                continue;
            };
            if entry_dead(&key, &value, |k| ct.get(k), now) && ct.remove(&key).is_ok() {
                if is_reply(&value) {
                    report.deleted_reply += 1;
                } else {
                    report.deleted_forward += 1;
                }
            } else {
                note_ports(&key, &value, ports);
            }
        }
    }
    report.remaining = report
        .scanned
        .saturating_sub(report.deleted_forward + report.deleted_reply);
    Ok(report)
}

/// Deletes the entries of `removed` backends in one round of batches (see [`purge`]).
pub fn purge_round(
    maps: &mut ConntrackPair<'_>,
    removed: &[RemovedBackend],
    batch: usize,
) -> std::io::Result<PurgeReport> {
    let mut report = PurgeReport::default();
    if !any_external(removed) {
        return Ok(report);
    }
    let mut walk = PairWalk::default();
    while !walk.finished() {
        let entries = walk.next_batch(maps, batch)?;
        report.scanned += entries.len();
        let stale = stale_keys(&entries, removed);
        let mut ct = both(maps)?;
        for key in stale {
            if ct.remove(&key).is_ok() {
                report.deleted += 1;
            }
        }
    }
    Ok(report)
}

/// The programs' clock (`CLOCK_MONOTONIC`; they read it as of the last tick where the kernel
/// has `bpf_ktime_get_coarse_ns`, so this may be up to a tick ahead of their times), for
/// [`gc_round`].
pub fn monotonic_ns() -> Result<u64, nix::Error> {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)?;
    let secs = u64::try_from(now.tv_sec()).unwrap_or(0);
    let nanos = u64::try_from(now.tv_nsec()).unwrap_or(0);
    Ok(secs * ct_timeout::NANOS_PER_SECOND + nanos)
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use proxy_common::proto;

    use super::*;
    use proxy_model::desired::{FrontendKey, Protocol};

    fn ip(a: [u8; 4]) -> [u32; 4] {
        [ip4_to_map(Ipv4Addr::from(a)), 0, 0, 0]
    }

    /// Forward and reply entries of a SNATed flow client → node:30080 → backend.
    fn flow(backend: [u8; 4], client_port: u16) -> [(CtKey, CtValue); 2] {
        let client = ip([10, 10, 0, 2]);
        let node = ip([10, 10, 0, 1]);
        let backend = ip(backend);
        let forward = (
            CtKey {
                src: client,
                dst: node,
                sport: client_port.to_be(),
                dport: 30080u16.to_be(),
                proto: proto::UDP,
                family: family::V4,
                _pad: 0,
            },
            CtValue {
                src: node,
                dst: backend,
                sport: 61_000u16.to_be(),
                dport: 8080u16.to_be(),
                flags: ct_flags::SNAT,
                ..CtValue::default()
            },
        );
        let reply = (
            CtKey {
                src: backend,
                dst: node,
                sport: 8080u16.to_be(),
                dport: 61_000u16.to_be(),
                proto: proto::UDP,
                family: family::V4,
                _pad: 0,
            },
            CtValue {
                src: node,
                dst: client,
                sport: 30080u16.to_be(),
                dport: client_port.to_be(),
                flags: ct_flags::REPLY,
                ..CtValue::default()
            },
        );
        [forward, reply]
    }

    #[test]
    fn live_entries_keep_the_frontend_port_and_the_backend_port_in_the_filter() {
        let [forward, reply] = flow([10, 244, 1, 2], 40_000);
        let mut ports = PortFilter::EMPTY;
        note_ports(&forward.0, &forward.1, &mut ports);
        note_ports(&reply.0, &reply.1, &mut ports);
        assert!(ports.has_destination(30080));
        assert!(ports.has_source(8080));
        // Not the client's port, nor the SNAT port (the program's range test covers it).
        assert!(!ports.has_source(40_000) && !ports.has_destination(61_000));
        // An egress entry is the egress program's: it adds nothing.
        let mut egress = forward.1;
        egress.flags |= ct_flags::EGRESS;
        let mut none = PortFilter::EMPTY;
        note_ports(&reply.0, &egress, &mut none);
        assert_eq!(none, PortFilter::EMPTY);
    }

    fn removed(addr: &str, port: u16, protocol: Protocol, backend: &str) -> RemovedBackend {
        RemovedBackend {
            frontend: FrontendKey {
                addr: addr.parse().expect("addr"),
                port,
                protocol,
                scope: Scope::External,
            },
            backend: backend.parse().expect("backend"),
        }
    }

    #[test]
    fn only_entries_of_removed_pairs_are_stale() {
        let mut entries = Vec::new();
        entries.extend(flow([10, 244, 2, 2], 40_000));
        entries.extend(flow([10, 244, 1, 2], 40_001));
        let gone = [removed("0.0.0.0", 30080, Protocol::Udp, "10.244.2.2:8080")];
        let keys = stale_keys(&entries, &gone);
        assert_eq!(keys, vec![entries[0].0, entries[1].0]);

        // Another protocol, port or frontend address: untouched.
        for other in [
            removed("0.0.0.0", 30080, Protocol::Tcp, "10.244.2.2:8080"),
            removed("0.0.0.0", 30081, Protocol::Udp, "10.244.2.2:8080"),
            removed("192.0.2.1", 30080, Protocol::Udp, "10.244.2.2:8080"),
            removed("0.0.0.0", 30080, Protocol::Udp, "10.244.2.2:8081"),
        ] {
            assert!(stale_keys(&entries, &[other]).is_empty(), "{other:?}");
        }
        // The exact node address as frontend (an externalIP equal to it) matches too.
        let exact = [removed(
            "10.10.0.1",
            30080,
            Protocol::Udp,
            "10.244.2.2:8080",
        )];
        assert_eq!(stale_keys(&entries, &exact).len(), 2);
        // Socket-level frontends have no tc entries.
        let mut internal = gone;
        internal[0].frontend.scope = Scope::Internal;
        assert!(!any_external(&internal));
        assert!(stale_keys(&entries, &internal).is_empty());
        // ... unless pods' flows to them are tc flows (host-namespace-only socket LB).
        assert_eq!(tracked(&internal, false), internal);
        assert_eq!(stale_keys(&entries, &tracked(&internal, true)).len(), 2);
    }

    /// `flow` with both entries last seen (reply: created) `age_s` before `now`.
    fn aged(backend: [u8; 4], client_port: u16, now: u64, age_s: u64) -> [(CtKey, CtValue); 2] {
        let mut entries = flow(backend, client_port);
        // Distinct SNAT ports per flow, as the datapath picks them.
        let snat = (61_000 + client_port % 1000).to_be();
        entries[0].1.sport = snat;
        entries[1].0.dport = snat;
        for (_, value) in &mut entries {
            value.last_seen_ns = now - age_s * ct_timeout::NANOS_PER_SECOND;
        }
        entries
    }

    #[test]
    fn gc_deletes_expired_flows_and_orphans_only() {
        let now = 1_000 * ct_timeout::NANOS_PER_SECOND;
        let live = aged([10, 244, 2, 2], 40_000, now, 100);
        let expired = aged([10, 244, 2, 2], 40_001, now, 130);
        let orphan = aged([10, 244, 2, 2], 40_002, now, 30);
        let young_orphan = aged([10, 244, 2, 2], 40_003, now, 1);
        // A newer flow of `orphan`'s client tuple took another SNAT port: the old reply
        // entry no longer answers it.
        let mut newer = aged([10, 244, 2, 2], 40_004, now, 5);
        newer[0].0 = orphan[0].0;
        let mut entries = Vec::new();
        entries.extend(live);
        entries.extend(expired);
        entries.push(orphan[1]);
        entries.push(young_orphan[1]);
        entries.extend(newer);
        let keys = gc_keys(&entries, now, usize::MAX);
        assert_eq!(keys, vec![expired[0].0, expired[1].0, orphan[1].0]);

        // TCP: a closing flow idle 11 s is dead, an established one is not.
        let mut tcp = aged([10, 244, 2, 2], 40_005, now, 11);
        for (key, _) in &mut tcp {
            key.proto = proto::TCP;
        }
        assert!(gc_keys(&tcp, now, usize::MAX).is_empty());
        tcp[0].1.flags |= ct_flags::CLOSING;
        assert_eq!(gc_keys(&tcp, now, usize::MAX).len(), 2);

        // The limit bounds a run.
        assert_eq!(gc_keys(&entries, now, 1), vec![expired[0].0]);
    }

    /// The egress entries (netfilter path) of `aged`'s flow: client → backend (SNAT) and
    /// backend → client (frontend address), as `new_flow` writes them.
    fn egress_of(flow: &[(CtKey, CtValue); 2]) -> [(CtKey, CtValue); 2] {
        let (fk, fv) = flow[0];
        let (_, rv) = flow[1];
        let forward = (
            CtKey {
                src: fk.src,
                dst: fv.dst,
                sport: fk.sport,
                dport: fv.dport,
                ..fk
            },
            CtValue {
                flags: fv.flags | ct_flags::EGRESS,
                // Written when the flow began, like its reply entry.
                last_seen_ns: rv.last_seen_ns,
                ..fv
            },
        );
        let reply = (
            CtKey {
                src: fv.dst,
                dst: fk.src,
                sport: fv.dport,
                dport: fk.sport,
                ..fk
            },
            CtValue {
                flags: rv.flags | ct_flags::EGRESS,
                ..rv
            },
        );
        [forward, reply]
    }

    #[test]
    fn gc_keeps_egress_entries_exactly_as_long_as_their_flow() {
        let now = 1_000 * ct_timeout::NANOS_PER_SECOND;
        // Written when the flow began (100 s ago), never refreshed: the live flow's forward
        // entry is what keeps them.
        let mut live = aged([10, 244, 2, 2], 40_000, now, 100);
        live[0].1.last_seen_ns = now - ct_timeout::NANOS_PER_SECOND;
        let expired = aged([10, 244, 2, 2], 40_001, now, 130);
        let mut entries = Vec::new();
        entries.extend(live);
        entries.extend(egress_of(&live));
        entries.extend(expired);
        let expired_egress = egress_of(&expired);
        entries.extend(expired_egress);
        let keys = gc_keys(&entries, now, usize::MAX);
        assert_eq!(
            keys,
            vec![
                expired[0].0,
                expired[1].0,
                expired_egress[0].0,
                expired_egress[1].0
            ]
        );

        // Once the flow's entries are gone, its egress entries are orphans; young ones stay
        // (the datapath writes them right after the flow's own).
        let orphans = egress_of(&live).to_vec();
        assert_eq!(gc_keys(&orphans, now, usize::MAX).len(), 2);
        let mut young = orphans.clone();
        for (_, value) in &mut young {
            value.last_seen_ns = now - ct_timeout::NANOS_PER_SECOND;
        }
        assert!(gc_keys(&young, now, usize::MAX).is_empty());
    }
}
