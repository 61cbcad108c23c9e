//! Drift between the service maps in the kernel and the agent's record of them.
//!
//! The maps are pinned, so anything with `CAP_BPF` (bpftool, another agent, a bug) can change
//! them behind the agent's back; the agent only writes differences, so such a change would stay
//! until the frontend it hits changes again. The check compares every entry of every map whose
//! entries the agent owns — frontends, backend slots (both generations: the live one, and
//! a switched-out one for its grace), backends, the affinity match set, source ranges and Maglev tables — with
//! [`super::map_writer::MapWriter::expected_content`], and the repair writes the expected value
//! back or deletes the stray entry. The node maps (`KPR_NODE_CONFIG`, `KPR_NODE_ADDRS`) are
//! compared with what `tc` last wrote. Maps the datapath writes itself (conntrack, affinity
//! entries, UDP sockets' backends) have no expected content: only their orphans — entries of
//! Services or backends that are gone — are reported and deleted (`orphans`). Reverse NAT
//! entries and counters are not checked.
//!
//! The repair follows the update protocol: everything a frontend points to is written before
//! the frontend, and stray entries are deleted only after the frontends are right, so a repair
//! never makes a frontend point at a missing slot or backend.

pub(super) mod orphans;
pub(super) mod reader;

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Debug,
};

use ipnet::IpNet;
use proxy_common::{
    AffinityMatchKey, BackendSlotKey, FrontendValue, MaglevBlock, MaglevKey, SLOT_BLOCK_SLOTS,
    SlotBlock, map_names,
};
use serde::Serialize;

use crate::maps::map_writer::{
    BackendValue, FrontendMapKey, MapOps, MapWriteError, MapsContent, frontend_key_of,
};
pub use crate::maps::touched_keys::Entry;

/// How one entry differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DriftKind {
    /// The agent wrote it; the map does not have it.
    Missing,
    /// The map has it with another value.
    Changed,
    /// The map has it; the agent never wrote it (or deleted it).
    Extra,
    /// An entry the datapath wrote (conntrack, affinity, a UDP socket's backend) that points
    /// at a Service or backend that no longer exists (see `orphans`).
    Orphan,
}

impl std::fmt::Display for DriftKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DriftKind::Missing => "missing",
            DriftKind::Changed => "changed",
            DriftKind::Extra => "extra",
            DriftKind::Orphan => "orphan",
        })
    }
}

/// One entry that differs, described for people (and `--json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Drift {
    /// The pinned map's name (`KPR_*`); also the `map` label of the repair counter.
    pub map: &'static str,
    pub kind: DriftKind,
    pub entry: String,
    /// The value the agent wrote (absent for `extra`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expected: Option<String>,
    /// The value in the map (absent for `missing`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub found: Option<String>,
}

/// The differences between `expected` and `found`, map by map in a fixed order.
#[cfg(test)]
pub fn diff(expected: &MapsContent, found: &MapsContent) -> Vec<Drift> {
    diff_keyed(expected, found)
        .into_iter()
        .map(|keyed| keyed.drift)
        .collect()
}

/// [`diff`], each difference with the write that repairs it (which also names its entry).
pub fn diff_keyed(expected: &MapsContent, found: &MapsContent) -> Vec<Keyed> {
    let mut out = Vec::new();
    let frontends = |content: &MapsContent| -> BTreeMap<FrontendMapKey, FrontendValue> {
        content.frontends.iter().copied().collect()
    };
    let (expected_frontends, found_frontends) = (frontends(expected), frontends(found));
    compare(
        &expected_frontends,
        &found_frontends,
        Describe {
            map_of: |(key, _): &(FrontendMapKey, FrontendValue)| frontend_map(key),
            key: describe_frontend_key,
            value: describe_frontend,
            put: Fix::PutFrontend,
            delete: |key: FrontendMapKey, _: FrontendValue| Fix::DeleteFrontend(key),
        },
        &mut out,
    );
    compare(
        &expected.slots,
        &found.slots,
        Describe {
            map_of: |_: &(BackendSlotKey, SlotBlock)| map_names::BACKEND_SLOTS,
            key: describe_slot,
            value: describe_slot_block,
            put: Fix::PutSlot,
            delete: |key: BackendSlotKey, _: SlotBlock| Fix::DeleteSlot(key),
        },
        &mut out,
    );
    compare(
        &expected.backends,
        &found.backends,
        Describe {
            map_of: |(_, backend): &(u32, BackendValue)| backend.map_name(),
            key: |id: &u32| format!("backend {id}"),
            value: |backend: &BackendValue| backend.socket_addr().to_string(),
            put: Fix::PutBackend,
            delete: Fix::DeleteBackend,
        },
        &mut out,
    );
    compare(
        &as_map(&expected.affinity_matches),
        &as_map(&found.affinity_matches),
        Describe {
            map_of: |_: &(AffinityMatchKey, ())| map_names::AFFINITY_MATCH,
            key: |key: &AffinityMatchKey| {
                format!("service {} backend {}", key.service_id, key.backend_id)
            },
            value: |&(): &()| "present".to_string(),
            put: |key: AffinityMatchKey, ()| Fix::PutAffinityMatch(key),
            delete: |key: AffinityMatchKey, ()| Fix::DeleteAffinityMatch(key),
        },
        &mut out,
    );
    compare(
        &as_map(&expected.source_ranges),
        &as_map(&found.source_ranges),
        Describe {
            map_of: |_: &((u32, IpNet), ())| map_names::SOURCE_RANGES,
            key: |(service_id, range): &(u32, IpNet)| format!("service {service_id} range {range}"),
            value: |&(): &()| "present".to_string(),
            put: |(service_id, range): (u32, IpNet), ()| Fix::PutSourceRange(service_id, range),
            delete: |(service_id, range): (u32, IpNet), ()| {
                Fix::DeleteSourceRange(service_id, range)
            },
        },
        &mut out,
    );
    compare(
        &expected.maglev,
        &found.maglev,
        Describe {
            map_of: |_: &(MaglevKey, MaglevBlock)| map_names::MAGLEV,
            key: |key: &MaglevKey| {
                format!(
                    "service {} block {} generation {}",
                    key.service_id, key.block, key.generation
                )
            },
            value: |block: &MaglevBlock| format!("{:?}", block.backend_ids),
            put: Fix::PutMaglev,
            delete: |key: MaglevKey, _: MaglevBlock| Fix::DeleteMaglev(key),
        },
        &mut out,
    );
    out
}

/// One difference, and the write that repairs it.
#[derive(Debug, Clone, PartialEq)]
pub struct Keyed {
    pub drift: Drift,
    pub fix: Fix,
}

/// The write that makes one entry what the agent wrote: the expected value back, or the stray
/// entry deleted (a backend with its value, whose family says which map holds it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fix {
    PutFrontend(FrontendMapKey, FrontendValue),
    DeleteFrontend(FrontendMapKey),
    PutSlot(BackendSlotKey, SlotBlock),
    DeleteSlot(BackendSlotKey),
    PutBackend(u32, BackendValue),
    DeleteBackend(u32, BackendValue),
    PutAffinityMatch(AffinityMatchKey),
    DeleteAffinityMatch(AffinityMatchKey),
    PutSourceRange(u32, IpNet),
    DeleteSourceRange(u32, IpNet),
    PutMaglev(MaglevKey, MaglevBlock),
    DeleteMaglev(MaglevKey),
}

impl Fix {
    /// The entry it writes.
    pub fn entry(&self) -> Entry {
        match *self {
            Fix::PutFrontend(key, _) | Fix::DeleteFrontend(key) => Entry::Frontend(key),
            Fix::PutSlot(key, _) | Fix::DeleteSlot(key) => Entry::Slot(key),
            Fix::PutBackend(id, _) | Fix::DeleteBackend(id, _) => Entry::Backend(id),
            Fix::PutAffinityMatch(key) | Fix::DeleteAffinityMatch(key) => Entry::AffinityMatch(key),
            Fix::PutSourceRange(id, _) | Fix::DeleteSourceRange(id, _) => Entry::SourceRangesOf(id),
            Fix::PutMaglev(key, _) | Fix::DeleteMaglev(key) => Entry::Maglev(key),
        }
    }

    /// Its place in a repair, by the update protocol: what frontends point to is written
    /// first, then the frontends; stray frontends are deleted before what they point to.
    fn order(&self) -> u8 {
        match self {
            Fix::PutBackend(..) => 0,
            Fix::PutSlot(..) => 1,
            Fix::PutAffinityMatch(_) => 2,
            Fix::PutSourceRange(..) => 3,
            Fix::PutMaglev(..) => 4,
            Fix::PutFrontend(..) => 5,
            Fix::DeleteFrontend(_) => 6,
            Fix::DeleteSlot(_) => 7,
            Fix::DeleteMaglev(_) => 8,
            Fix::DeleteAffinityMatch(_) => 9,
            Fix::DeleteSourceRange(..) => 10,
            Fix::DeleteBackend(..) => 11,
        }
    }

    /// Writes it: the map's name and the result.
    fn apply(&self, maps: &mut impl MapOps) -> (&'static str, Result<(), MapWriteError>) {
        match *self {
            Fix::PutFrontend(key, value) => (frontend_map(&key), maps.put_frontend(key, value)),
            Fix::DeleteFrontend(key) => (frontend_map(&key), maps.delete_frontend(key)),
            Fix::PutSlot(key, block) => (map_names::BACKEND_SLOTS, maps.put_slot(key, block)),
            Fix::DeleteSlot(key) => (map_names::BACKEND_SLOTS, maps.delete_slot(key)),
            Fix::PutBackend(id, backend) => (backend.map_name(), maps.put_backend(id, backend)),
            Fix::DeleteBackend(id, backend) => {
                (backend.map_name(), maps.delete_backend(id, backend))
            }
            Fix::PutAffinityMatch(key) => (map_names::AFFINITY_MATCH, maps.put_affinity_match(key)),
            Fix::DeleteAffinityMatch(key) => {
                (map_names::AFFINITY_MATCH, maps.delete_affinity_match(key))
            }
            Fix::PutSourceRange(id, range) => {
                (map_names::SOURCE_RANGES, maps.put_source_range(id, range))
            }
            Fix::DeleteSourceRange(id, range) => (
                map_names::SOURCE_RANGES,
                maps.delete_source_range(id, range),
            ),
            Fix::PutMaglev(key, block) => (map_names::MAGLEV, maps.put_maglev(key, block)),
            Fix::DeleteMaglev(key) => (map_names::MAGLEV, maps.delete_maglev(key)),
        }
    }
}

/// How [`compare`] names and repairs the entries of one map.
struct Describe<M, DK, DV, P, D> {
    map_of: M,
    key: DK,
    value: DV,
    put: P,
    delete: D,
}

fn as_map<K: Ord + Copy>(set: &BTreeSet<K>) -> BTreeMap<K, ()> {
    set.iter().map(|key| (*key, ())).collect()
}

/// Walks two sorted maps side by side: one pass over both, no tree lookup per entry (a million
/// entries at 30k Services). Reports missing and changed entries in key order, then extra ones.
/// `map_of` names the map of an entry (the family of a backend is in its value, so it gets the
/// found or expected value with the key).
fn compare<K: Ord + Copy, V: PartialEq + Copy>(
    expected: &BTreeMap<K, V>,
    found: &BTreeMap<K, V>,
    describe: Describe<
        impl Fn(&(K, V)) -> &'static str,
        impl Fn(&K) -> String,
        impl Fn(&V) -> String,
        impl Fn(K, V) -> Fix,
        impl Fn(K, V) -> Fix,
    >,
    out: &mut Vec<Keyed>,
) {
    let mut found_entries = found.iter().peekable();
    let mut extra = Vec::new();
    for (key, want) in expected {
        while let Some((stray, have)) = found_entries.next_if(|(k, _)| *k < key) {
            extra.push((stray, have));
        }
        let have = found_entries
            .next_if(|(k, _)| *k == key)
            .map(|(_, have)| have);
        match have {
            Some(have) if have == want => {}
            have => out.push(Keyed {
                drift: Drift {
                    map: (describe.map_of)(&(*key, *want)),
                    kind: if have.is_some() {
                        DriftKind::Changed
                    } else {
                        DriftKind::Missing
                    },
                    entry: (describe.key)(key),
                    expected: Some((describe.value)(want)),
                    found: have.map(&describe.value),
                },
                fix: (describe.put)(*key, *want),
            }),
        }
    }
    for (key, have) in extra.into_iter().chain(found_entries) {
        out.push(Keyed {
            drift: Drift {
                map: (describe.map_of)(&(*key, *have)),
                kind: DriftKind::Extra,
                entry: (describe.key)(key),
                expected: None,
                found: Some((describe.value)(have)),
            },
            fix: (describe.delete)(*key, *have),
        });
    }
}

fn describe_frontend_key(key: &FrontendMapKey) -> String {
    match frontend_key_of(key) {
        Some(key) => key.to_string(),
        // A key the agent never writes (unknown protocol or scope): show it raw.
        None => format!("{key:?}"),
    }
}

fn describe_frontend(value: &FrontendValue) -> String {
    format!(
        "service {} backends {} generation {} flags {:#04x} affinity {}s maglev {}",
        value.service_id,
        value.backend_count,
        value.generation,
        value.flags,
        value.affinity_timeout,
        value.maglev_size
    )
}

/// The backend ids of a block's slots (a last block's unused entries are 0: left out).
fn describe_slot_block(block: &SlotBlock) -> String {
    let ids: Vec<String> = block
        .backend_ids
        .iter()
        .filter(|&&id| id != 0)
        .map(u32::to_string)
        .collect();
    format!("backends {}", ids.join(","))
}

fn describe_slot(key: &BackendSlotKey) -> String {
    format!(
        "service {} slots from {} generation {}",
        key.service_id,
        u32::from(key.block) * SLOT_BLOCK_SLOTS,
        key.generation
    )
}

/// Why a drift check compared nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DriftNotChecked {
    /// The record knows it differs from the maps (an adopted frontend is damaged, or its
    /// Maglev table incomplete).
    #[error("an adopted frontend is damaged; the next full sync rewrites it")]
    Damaged,
    /// The maps could not be opened for reading.
    #[error("the maps cannot be read")]
    Unreadable,
    /// Another check started after this one (or its record was given up): what it found can
    /// no longer be told apart from the agent's own writes since.
    #[error("superseded by a later check")]
    Superseded,
}

/// One check: what differed, and what the repair (if asked for) did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct DriftCheck {
    pub drift: Vec<Drift>,
    pub repair: RepairReport,
    /// Entries compared (expected and found, all maps), for the log and the benchmark.
    pub entries_compared: usize,
}

/// Entries compared (expected and found, all maps).
pub fn entries(expected: &MapsContent, found: &MapsContent) -> usize {
    size(expected) + size(found)
}

fn size(content: &MapsContent) -> usize {
    content.frontends.len()
        + content.slots.len()
        + content.backends.len()
        + content.affinity_matches.len()
        + content.source_ranges.len()
        + content.maglev.len()
}

/// What a repair did: entries fixed per map, and writes that failed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RepairReport {
    pub repaired: BTreeMap<&'static str, u64>,
    pub errors: Vec<(&'static str, MapWriteError)>,
}

/// Makes the maps hold what the agent wrote again: the writes `fixes` name, in update-protocol
/// order (everything a frontend points to, then the frontends; stray frontends deleted before
/// what they point to), so a repair never makes a frontend point at a missing slot or backend.
pub fn repair<'a>(
    fixes: impl IntoIterator<Item = &'a Fix>,
    maps: &mut impl MapOps,
) -> RepairReport {
    let mut fixes: Vec<&Fix> = fixes.into_iter().collect();
    fixes.sort_by_key(|fix| fix.order());
    let mut report = RepairReport::default();
    for fix in fixes {
        match fix.apply(maps) {
            (map, Ok(())) => *report.repaired.entry(map).or_default() += 1,
            (map, Err(error)) => report.errors.push((map, error)),
        }
    }
    report
}

fn frontend_map(key: &FrontendMapKey) -> &'static str {
    match key {
        FrontendMapKey::V4(_) => map_names::FRONTENDS4,
        FrontendMapKey::V6(_) => map_names::FRONTENDS6,
    }
}

// Unit tests: `map_writer/tests/drift.rs` (they share the in-memory maps of the map_writer's tests).
