//! Per-CPU counters; per-CPU so the hot path never contends on a shared cache line.

use proxy_common::StatIndex;

use crate::maps::KPR_STATS;

#[inline(always)]
pub fn bump(index: StatIndex) {
    bump_slot(index as u32);
}

/// [`bump`] by the counter's slot: a `StatIndex` read back from memory, whose value the
/// verifier does not know (see `nat::translate_view`).
#[inline(always)]
pub fn bump_slot(slot: u32) {
    if let Some(counter) = KPR_STATS.get_ptr_mut(slot) {
        // SAFETY: the pointer comes from a successful map lookup and the slot is per-CPU, so
        // nothing else writes it while this program runs (programs are not preempted on a CPU).
        unsafe { *counter += 1 };
    }
}
