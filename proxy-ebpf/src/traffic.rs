//! Per-Service counters (`KPR_SERVICE_TRAFFIC`), by the frontend's service id.

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use proxy_common::TrafficEvent;

use crate::maps::KPR_SERVICE_TRAFFIC;

/// Counts `event` for the frontend with `service_id`. An id past the array's end (the agent
/// sized it down, or turned counting off) is not counted.
#[inline(always)]
pub fn count(service_id: u32, event: TrafficEvent) {
    if let Some(traffic) = KPR_SERVICE_TRAFFIC.get_ptr_mut(service_id) {
        // SAFETY: the pointer comes from a successful lookup of an array element, which stays
        // valid while the program runs; other CPUs add to the same element, hence the atomic
        // add. Its old value is left unused, so LLVM emits the plain `lock +=` every kernel
        // with BPF atomics takes (a used result needs BPF_FETCH). `core`'s `AtomicU64` has no
        // read-modify-write operations on the BPF target, hence the intrinsic.
        unsafe {
            atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(
                &raw mut (*traffic).counts[event as usize],
                1,
            );
        }
    }
}
