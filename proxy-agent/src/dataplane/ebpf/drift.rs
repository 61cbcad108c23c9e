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

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Debug,
};

use ipnet::IpNet;
use proxy_common::{
    AffinityMatchKey, BackendSlotKey, FrontendValue, MaglevBlock, MaglevKey, map_names,
};
use serde::Serialize;

use super::map_writer::{
    BackendValue, FrontendMapKey, MapOps, MapWriteError, MapsContent, frontend_key_of,
};

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
pub fn diff(expected: &MapsContent, found: &MapsContent) -> Vec<Drift> {
    let mut out = Vec::new();
    let frontends = |content: &MapsContent| -> BTreeMap<FrontendMapKey, FrontendValue> {
        content.frontends.iter().copied().collect()
    };
    let (expected_frontends, found_frontends) = (frontends(expected), frontends(found));
    compare(
        &expected_frontends,
        &found_frontends,
        |(key, _)| frontend_map(key),
        describe_frontend_key,
        describe_frontend,
        &mut out,
    );
    compare(
        &expected.slots,
        &found.slots,
        |_| map_names::BACKEND_SLOTS,
        describe_slot,
        |id| format!("backend {id}"),
        &mut out,
    );
    compare(
        &expected.backends,
        &found.backends,
        |(_, backend)| backend_map(backend),
        |id| format!("backend {id}"),
        |backend| backend.socket_addr().to_string(),
        &mut out,
    );
    compare(
        &as_map(&expected.affinity_matches),
        &as_map(&found.affinity_matches),
        |_| map_names::AFFINITY_MATCH,
        |key: &AffinityMatchKey| format!("service {} backend {}", key.service_id, key.backend_id),
        |()| "present".to_string(),
        &mut out,
    );
    compare(
        &as_map(&expected.source_ranges),
        &as_map(&found.source_ranges),
        |_| map_names::SOURCE_RANGES,
        |(service_id, range): &(u32, IpNet)| format!("service {service_id} range {range}"),
        |()| "present".to_string(),
        &mut out,
    );
    compare(
        &expected.maglev,
        &found.maglev,
        |_| map_names::MAGLEV,
        |key: &MaglevKey| {
            format!(
                "service {} block {} generation {}",
                key.service_id, key.block, key.generation
            )
        },
        |block: &MaglevBlock| format!("{:?}", block.backend_ids),
        &mut out,
    );
    out
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
    map_of: impl Fn(&(K, V)) -> &'static str,
    describe_key: impl Fn(&K) -> String,
    describe_value: impl Fn(&V) -> String,
    out: &mut Vec<Drift>,
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
            have => out.push(Drift {
                map: map_of(&(*key, *want)),
                kind: if have.is_some() {
                    DriftKind::Changed
                } else {
                    DriftKind::Missing
                },
                entry: describe_key(key),
                expected: Some(describe_value(want)),
                found: have.map(&describe_value),
            }),
        }
    }
    for (key, have) in extra.into_iter().chain(found_entries) {
        out.push(Drift {
            map: map_of(&(*key, *have)),
            kind: DriftKind::Extra,
            entry: describe_key(key),
            expected: None,
            found: Some(describe_value(have)),
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

fn describe_slot(key: &BackendSlotKey) -> String {
    format!(
        "service {} slot {} generation {}",
        key.service_id, key.slot, key.generation
    )
}

/// One check: what differed, and what the repair (if asked for) did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct DriftCheck {
    pub drift: Vec<Drift>,
    pub repair: RepairReport,
    /// Entries compared (expected and found, all maps), for the log and the benchmark.
    pub entries_compared: usize,
}

/// Compares the maps (`found`) with `expected` and, with `fix`, repairs them.
pub fn check(
    expected: &MapsContent,
    found: &MapsContent,
    fix: bool,
    maps: &mut impl MapOps,
) -> DriftCheck {
    let drift = diff(expected, found);
    let repair = if fix && !drift.is_empty() {
        repair(expected, &drift, found, maps)
    } else {
        RepairReport::default()
    };
    DriftCheck {
        drift,
        repair,
        entries_compared: size(expected) + size(found),
    }
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

/// Makes the maps hold `expected` again where `drift` says they do not: writes first (what
/// frontends point to, then the frontends), deletes last.
pub fn repair(
    expected: &MapsContent,
    drift: &[Drift],
    found: &MapsContent,
    maps: &mut impl MapOps,
) -> RepairReport {
    let mut report = RepairReport::default();
    let mut done = |map: &'static str, result: Result<(), MapWriteError>| match result {
        Ok(()) => *report.repaired.entry(map).or_default() += 1,
        Err(error) => report.errors.push((map, error)),
    };
    let expected_frontends: BTreeMap<FrontendMapKey, FrontendValue> =
        expected.frontends.iter().copied().collect();
    let found_frontends: BTreeMap<FrontendMapKey, FrontendValue> =
        found.frontends.iter().copied().collect();
    // The drift list says which maps differ; the entries themselves come from the contents, so
    // a repair writes exactly the values the check compared with.
    let differs = |map: &str| drift.iter().any(|d| d.map == map);

    // 1. Everything a frontend may point to.
    if differs(map_names::BACKENDS4) || differs(map_names::BACKENDS6) {
        for (id, backend) in &expected.backends {
            if found.backends.get(id) != Some(backend) {
                let map = backend_map(backend);
                done(map, maps.put_backend(*id, *backend));
            }
        }
    }
    if differs(map_names::BACKEND_SLOTS) {
        for (key, id) in &expected.slots {
            if found.slots.get(key) != Some(id) {
                done(map_names::BACKEND_SLOTS, maps.put_slot(*key, *id));
            }
        }
    }
    if differs(map_names::AFFINITY_MATCH) {
        for key in expected
            .affinity_matches
            .difference(&found.affinity_matches)
        {
            done(map_names::AFFINITY_MATCH, maps.put_affinity_match(*key));
        }
    }
    if differs(map_names::SOURCE_RANGES) {
        for (service_id, range) in expected.source_ranges.difference(&found.source_ranges) {
            done(
                map_names::SOURCE_RANGES,
                maps.put_source_range(*service_id, *range),
            );
        }
    }
    if differs(map_names::MAGLEV) {
        for (key, block) in &expected.maglev {
            if found.maglev.get(key) != Some(block) {
                done(map_names::MAGLEV, maps.put_maglev(*key, *block));
            }
        }
    }
    // 2. The frontends, now that what they point to is there.
    for (key, value) in &expected_frontends {
        if found_frontends.get(key) != Some(value) {
            done(frontend_map(key), maps.put_frontend(*key, *value));
        }
    }
    // 3. Stray entries, frontends first so none is left pointing at a deleted slot.
    for key in found_frontends.keys() {
        if !expected_frontends.contains_key(key) {
            done(frontend_map(key), maps.delete_frontend(*key));
        }
    }
    for key in found.slots.keys() {
        if !expected.slots.contains_key(key) {
            done(map_names::BACKEND_SLOTS, maps.delete_slot(*key));
        }
    }
    for key in found.maglev.keys() {
        if !expected.maglev.contains_key(key) {
            done(map_names::MAGLEV, maps.delete_maglev(*key));
        }
    }
    for key in found
        .affinity_matches
        .difference(&expected.affinity_matches)
    {
        done(map_names::AFFINITY_MATCH, maps.delete_affinity_match(*key));
    }
    for (service_id, range) in found.source_ranges.difference(&expected.source_ranges) {
        done(
            map_names::SOURCE_RANGES,
            maps.delete_source_range(*service_id, *range),
        );
    }
    for (id, backend) in &found.backends {
        if !expected.backends.contains_key(id) {
            done(backend_map(backend), maps.delete_backend(*id, *backend));
        }
    }
    report
}

fn backend_map(backend: &BackendValue) -> &'static str {
    match backend {
        BackendValue::V4(_) => map_names::BACKENDS4,
        BackendValue::V6(_) => map_names::BACKENDS6,
    }
}

fn frontend_map(key: &FrontendMapKey) -> &'static str {
    match key {
        FrontendMapKey::V4(_) => map_names::FRONTENDS4,
        FrontendMapKey::V6(_) => map_names::FRONTENDS6,
    }
}

// Unit tests: `map_writer/tests/drift.rs` (they share the in-memory maps of the map_writer's tests).
