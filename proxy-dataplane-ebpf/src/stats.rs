//! Reading the per-CPU datapath counters.

use aya::maps::{MapData, PerCpuArray};
use proxy_common::StatIndex;
use tracing::warn;

pub fn read_stats(map: &PerCpuArray<MapData, u64>) -> Vec<(StatIndex, u64)> {
    StatIndex::ALL
        .iter()
        .filter_map(|&index| match map.get(&(index as u32), 0) {
            Ok(per_cpu) => Some((index, per_cpu.iter().sum())),
            Err(error) => {
                warn!(counter = index.name(), %error, "cannot read datapath counter");
                None
            }
        })
        .collect()
}
