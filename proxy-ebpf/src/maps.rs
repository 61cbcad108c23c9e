//! Map declarations. Names and value types come from `proxy-common`; the agent may resize every
//! map before loading (`EbpfLoader::set_max_entries`), the sizes here are the defaults.
//! All maps are pinned by name so the agent can find them under its bpffs directory.

use aya_ebpf::{
    macros::map,
    maps::{HashMap, LruHashMap, PerCpuArray},
};
use proxy_common::{
    Backend4, BackendSlotKey, Frontend4Key, FrontendValue, RevNat4, StatIndex, default_sizes,
};

#[map]
pub static KPR_FRONTENDS4: HashMap<Frontend4Key, FrontendValue> =
    HashMap::pinned(default_sizes::FRONTENDS, 0);

#[map]
pub static KPR_BACKEND_SLOTS: HashMap<BackendSlotKey, u32> =
    HashMap::pinned(default_sizes::BACKEND_SLOTS, 0);

#[map]
pub static KPR_BACKENDS4: HashMap<u32, Backend4> = HashMap::pinned(default_sizes::BACKENDS, 0);

/// Socket cookie → what the socket originally dialled. LRU: entries of closed sockets age out
/// without the agent having to track socket lifetimes.
#[map]
pub static KPR_REVNAT4: LruHashMap<u64, RevNat4> = LruHashMap::pinned(default_sizes::REVNAT, 0);

#[map]
pub static KPR_STATS: PerCpuArray<u64> = PerCpuArray::pinned(StatIndex::COUNT, 0);
