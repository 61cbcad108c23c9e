//! Map declarations. Names and value types come from `proxy-common`; the agent may resize every
//! map before loading (`EbpfLoader::set_max_entries`), the sizes here are the defaults.
//! All maps are pinned by name so the agent can find (and, after a restart, re-adopt) them under
//! its bpffs directory.

use aya_ebpf::{
    macros::map,
    maps::{HashMap, LruHashMap, PerCpuArray},
};
use proxy_common::{
    AffinityKey, AffinityMatchKey, AffinityValue, Backend4, Backend6, BackendSlotKey, Frontend4Key,
    Frontend6Key, FrontendValue, RevNat4, RevNat4Key, RevNat6, RevNat6Key, default_sizes,
};

#[map]
pub static KPR_FRONTENDS4: HashMap<Frontend4Key, FrontendValue> =
    HashMap::pinned(default_sizes::FRONTENDS, 0);

#[map]
pub static KPR_FRONTENDS6: HashMap<Frontend6Key, FrontendValue> =
    HashMap::pinned(default_sizes::FRONTENDS, 0);

#[map]
pub static KPR_BACKEND_SLOTS: HashMap<BackendSlotKey, u32> =
    HashMap::pinned(default_sizes::BACKEND_SLOTS, 0);

#[map]
pub static KPR_BACKENDS4: HashMap<u32, Backend4> = HashMap::pinned(default_sizes::BACKENDS, 0);

#[map]
pub static KPR_BACKENDS6: HashMap<u32, Backend6> = HashMap::pinned(default_sizes::BACKENDS, 0);

/// (socket cookie, backend) → service address. LRU: entries of closed sockets age out without
/// the agent having to track socket lifetimes.
#[map]
pub static KPR_REVNAT4: LruHashMap<RevNat4Key, RevNat4> =
    LruHashMap::pinned(default_sizes::REVNAT, 0);

#[map]
pub static KPR_REVNAT6: LruHashMap<RevNat6Key, RevNat6> =
    LruHashMap::pinned(default_sizes::REVNAT, 0);

/// (client netns, service) → backend and last use. LRU: idle clients age out by themselves;
/// the timeout itself is checked on lookup.
#[map]
pub static KPR_AFFINITY: LruHashMap<AffinityKey, AffinityValue> =
    LruHashMap::pinned(default_sizes::AFFINITY, 0);

/// (service, backend) pairs that are live; see `proxy_common::AffinityMatchKey`.
#[map]
pub static KPR_AFFINITY_MATCH: HashMap<AffinityMatchKey, u8> =
    HashMap::pinned(default_sizes::BACKEND_SLOTS, 0);

#[map]
pub static KPR_STATS: PerCpuArray<u64> = PerCpuArray::pinned(default_sizes::STATS, 0);
