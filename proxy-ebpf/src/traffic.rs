//! Per-Service counters (`KPR_SERVICE_TRAFFIC`), by the frontend's service id.

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use proxy_common::{TrafficEvent, probe};

use crate::{maps::KPR_SERVICE_TRAFFIC, packet::Packet};

/// Counts the new connection `pkt` starts to the frontend with `service_id`, once its flow's
/// conntrack entries are written (the packets after it find them and are not new): unless it
/// is the datapath self-test's probe, which runs the live program on a synthetic SYN.
#[inline(always)]
pub fn count_connection(pkt: &Packet, service_id: u32) {
    if !probe::is_probe(&pkt.src, pkt.sport, pkt.is_v6()) {
        count(service_id, TrafficEvent::NewConnection);
    }
}

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
