//! BPF conntrack for the tc programs: one LRU entry per direction of a flow, each holding the
//! tuple a matching packet is rewritten to (Cilium keeps NAT state apart from CT; one map is
//! enough here because the agent never inspects flows, and it halves the lookups).
//!
//! Forward entries (client → frontend) carry an idle timeout, refreshed by packets; when it
//! passes, the next packet is a new flow and picks a backend again. Reply entries have no
//! timeout of their own: they are only reached through a live flow's backend and are
//! overwritten or evicted (LRU) after it.

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_get_prandom_u32};
use proxy_common::{CtKey, CtValue, proto};

use crate::maps::KPR_CT;

const NANOS_PER_SECOND: u64 = 1_000_000_000;
/// kube-proxy's `tcpEstablishedTimeout` default (the kernel conntrack setting it tunes).
const TCP_TIMEOUT_NS: u64 = 24 * 3600 * NANOS_PER_SECOND;
/// The kernel's `nf_conntrack_udp_timeout_stream`.
const UDP_TIMEOUT_NS: u64 = 120 * NANOS_PER_SECOND;
/// The kernel's `nf_conntrack_sctp_timeout_established` (210 s, several of SCTP's default 30 s
/// heartbeats, so an idle association keeps its entry). There is no SCTP state machine here:
/// ABORT and SHUTDOWN COMPLETE do not end an entry early, because without tracking
/// verification tags (as the kernel's conntrack does) a spoofed chunk could tear down the NAT
/// of a live association.
const SCTP_TIMEOUT_NS: u64 = 210 * NANOS_PER_SECOND;
/// Refresh `last_seen_ns` at most this often: a write per packet would bounce the entry's cache
/// line between CPUs for no gain in precision.
const REFRESH_NS: u64 = NANOS_PER_SECOND;

/// SNAT source ports, above Linux's default ephemeral range (32768–60999), so a translated
/// flow never takes the 4-tuple of a connection the node itself makes to the backend.
const SNAT_PORT_MIN: u32 = 61_000;
const SNAT_PORT_COUNT: u32 = 65_536 - SNAT_PORT_MIN;
/// Random probes for a free SNAT port before giving up; bounded for the verifier.
const SNAT_ATTEMPTS: u32 = 8;

/// The entry for `key`, as a pointer into the map (for in-place refresh).
#[inline(always)]
pub fn lookup(key: &CtKey) -> Option<*mut CtValue> {
    KPR_CT.get_ptr_mut(key)
}

/// Whether a forward entry is still within its idle timeout.
#[inline(always)]
pub fn is_fresh(value: &CtValue, protocol: u8, now: u64) -> bool {
    let timeout = match protocol {
        proto::TCP => TCP_TIMEOUT_NS,
        proto::SCTP => SCTP_TIMEOUT_NS,
        _ => UDP_TIMEOUT_NS,
    };
    now.wrapping_sub(value.last_seen_ns) <= timeout
}

#[inline(always)]
pub fn touch(entry: *mut CtValue, value: &CtValue, now: u64) {
    if now.wrapping_sub(value.last_seen_ns) > REFRESH_NS {
        // SAFETY: `entry` comes from a successful lookup; a racing writer on another CPU can
        // only store another timestamp, which is as good as ours.
        unsafe { (*entry).last_seen_ns = now };
    }
}

#[inline(always)]
pub fn insert(key: &CtKey, value: &CtValue) -> Result<(), i32> {
    KPR_CT.insert(key, value, 0)
}

#[inline(always)]
pub fn remove(key: &CtKey) {
    // Best effort: a leftover reply entry is harmless and ages out of the LRU.
    let _ = KPR_CT.remove(key);
}

/// Inserts the reply entry of a source-NATed flow under a free SNAT port (written into
/// `reply_key.dport`, network order); `None` when every probe hit a port in use.
#[inline(always)]
pub fn insert_snat_reply(reply_key: &mut CtKey, reply: &CtValue) -> Option<u16> {
    for _ in 0..SNAT_ATTEMPTS {
        // SAFETY: bpf_get_prandom_u32 has no preconditions.
        let random = unsafe { bpf_get_prandom_u32() };
        let port = ((SNAT_PORT_MIN + random % SNAT_PORT_COUNT) as u16).to_be();
        reply_key.dport = port;
        if KPR_CT
            .insert(*reply_key, reply, u64::from(BPF_NOEXIST))
            .is_ok()
        {
            return Some(port);
        }
    }
    None
}
