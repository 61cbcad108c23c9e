//! The time the programs stamp conntrack, affinity and rate-limit state with:
//! `CLOCK_MONOTONIC`, read as the kernel's time of the last tick (`bpf_ktime_get_coarse_ns`)
//! where the kernel has it. Every one of those times is compared with timeouts of a second or
//! more, for which a tick (1–10 ms) is exact enough; and the precise read goes to the clock
//! source, which in a VM (a TSC read the hypervisor traps or scales) costs tens of
//! nanoseconds on every established packet, where the coarse one reads the time the kernel
//! kept at its last tick.
//!
//! Both reads are the same clock, the coarse one up to a tick behind: the agent (conntrack
//! garbage collection, adopted flows) reads `CLOCK_MONOTONIC`, so the times it writes may be
//! a tick ahead of what a program reads next; every comparison of two times saturates, so such
//! a time counts as now.

use aya_ebpf::helpers::{bpf_ktime_get_coarse_ns, bpf_ktime_get_ns};

/// 0 when the agent found no `bpf_ktime_get_coarse_ns` (kernel < 5.11) or was told not to use
/// it (`--bpf-disable-feature coarse-clock`). The loader sets it before loading; as a frozen
/// read-only global the verifier knows its value and never visits the call the kernel lacks
/// (it would reject an unknown helper).
#[unsafe(no_mangle)]
static KPR_USE_COARSE_CLOCK: u8 = 1;

/// Now, in ns of `CLOCK_MONOTONIC` (see the module).
#[inline(always)]
pub fn now_ns() -> u64 {
    // SAFETY: a read of a plain global the loader initialised.
    if unsafe { core::ptr::read_volatile(&raw const KPR_USE_COARSE_CLOCK) } != 0 {
        // SAFETY: no preconditions; every program type here has it from 5.11 on.
        unsafe { bpf_ktime_get_coarse_ns() }
    } else {
        // SAFETY: no preconditions.
        unsafe { bpf_ktime_get_ns() }
    }
}
