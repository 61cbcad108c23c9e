//! BPF conntrack for the tc programs: one LRU entry per direction of a flow, each holding the
//! tuple a matching packet is rewritten to (Cilium keeps NAT state apart from CT; one map is
//! enough here because the agent never inspects flows, and it halves the lookups).
//!
//! Forward entries (client → frontend) carry an idle timeout, refreshed by packets; when it
//! passes, the next packet is a new flow and picks a backend again. A TCP FIN or RST in either
//! direction marks the forward entry `CLOSING`, which shortens its timeout to
//! `ct_timeout::TCP_CLOSE_NS`, and a SYN on a closing entry starts a new flow at once (a client
//! reusing its port). Reply entries have no timeout of their own: they are only reached
//! through a live flow's backend. A SNAT reply entry whose flow is dead (forward entry gone,
//! expired, or now pointing elsewhere) is overwritten when a new flow's port probe hits it;
//! the agent's garbage collection deletes the rest (see `proxy-agent`'s `dataplane::ebpf::ct`).

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
};
use proxy_common::{CtKey, CtValue, ct_flags, ct_timeout};

use crate::{
    maps::{KPR_CT, KPR_TC_SCRATCH},
    parse::Packet,
};

/// Refresh `last_seen_ns` at most this often: a write per packet would bounce the entry's cache
/// line between CPUs for no gain in precision.
const REFRESH_NS: u64 = ct_timeout::NANOS_PER_SECOND;

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

/// Whether the forward entry still carries packet `pkt` of its flow: within its idle timeout,
/// and not a closing entry met by a new connection's SYN (the client reused its port; the
/// old connection is over, so the new one chooses its backend again).
#[inline(always)]
pub fn carries(value: &CtValue, pkt: &Packet, now: u64) -> bool {
    if value.flags & ct_flags::CLOSING != 0 && pkt.opens() {
        return false;
    }
    !ct_timeout::expired(pkt.proto, value.flags, value.last_seen_ns, now)
}

/// Refreshes a forward entry for `pkt`; a FIN or RST marks it closing.
#[inline(always)]
pub fn touch(entry: *mut CtValue, value: &CtValue, pkt: &Packet, now: u64) {
    if pkt.closes() && value.flags & ct_flags::CLOSING == 0 {
        // SAFETY: `entry` comes from a successful lookup. A racing writer on another CPU
        // stores another timestamp (as good as ours) or the same bit; a racing new-flow write
        // replaces the whole value, and losing our bit then only keeps a new flow open.
        unsafe {
            (*entry).flags = value.flags | ct_flags::CLOSING;
            (*entry).last_seen_ns = now;
        }
    } else if now.wrapping_sub(value.last_seen_ns) > REFRESH_NS {
        // SAFETY: as above.
        unsafe { (*entry).last_seen_ns = now };
    }
}

/// The key of the entry for the other direction of `value`'s flow: the packet a rewrite to
/// `value` will be answered with. A forward entry's reverse is its reply entry's key and a
/// reply entry's reverse is its forward entry's key.
#[inline(always)]
fn reverse_key(value: &CtValue, proto: u8, family: u8) -> CtKey {
    CtKey {
        src: value.dst,
        dst: value.src,
        sport: value.dport,
        dport: value.sport,
        proto,
        family,
        _pad: 0,
    }
}

/// Whether forward entry `forward` rewrites to the reverse of reply key `reply_key`, i.e. is
/// the flow that reply entry belongs to (a newer flow of the same client tuple is not).
#[inline(always)]
fn answers(forward: &CtValue, reply_key: &CtKey) -> bool {
    forward.flags & ct_flags::REPLY == 0
        && forward.src == reply_key.dst
        && forward.sport == reply_key.dport
        && forward.dst == reply_key.src
        && forward.dport == reply_key.sport
}

/// A FIN or RST from the backend (`pkt`, matching reply entry `reply`): marks the flow's forward
/// entry closing. Not inlined: the reverse key's stack stays out of the callers' frames.
#[inline(never)]
pub fn close_from_reply(pkt: &Packet, reply: &CtValue) {
    let forward_key = reverse_key(reply, pkt.proto, pkt.family);
    let Some(entry) = KPR_CT.get_ptr_mut(forward_key) else {
        return;
    };
    // SAFETY: from a successful lookup; see `touch` for races.
    let forward = unsafe { &*entry };
    if !answers(forward, &pkt.ct_key()) {
        return;
    }
    // SAFETY: bpf_ktime_get_ns has no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    touch(entry, forward, pkt, now);
}

/// Whether the entry under `reply_key` (found in use by a SNAT port probe) is the reply entry
/// of a dead flow: its forward entry is missing, expired, or belongs to a newer flow of the
/// same client tuple. Not inlined, and entries are read in place with the forward key in the
/// scratch slot: called from `new_flow`, its frame stacks on `external`'s and `new_flow`'s
/// within the verifier's 512 bytes.
#[inline(never)]
fn reply_is_stale(reply_key: &CtKey) -> bool {
    let Some(reply) = KPR_CT.get_ptr(reply_key) else {
        // Gone since the probe: free.
        return true;
    };
    let Some(scratch) = KPR_TC_SCRATCH.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: `reply` comes from a successful lookup (a racing update writes a whole, equally
    // valid value); the per-CPU scratch slot is ours until the program ends, and
    // `probe_key` is disjoint from the `reply_key` the caller lent us.
    let (reply, probe_key) = unsafe { (&*reply, &mut (*scratch).probe_key) };
    if reply.flags & ct_flags::REPLY == 0 {
        return false;
    }
    *probe_key = reverse_key(reply, reply_key.proto, reply_key.family);
    // By reference: a copy would put the key back on this frame's stack.
    let probe_key: &CtKey = probe_key;
    let Some(forward) = KPR_CT.get_ptr(probe_key) else {
        return true;
    };
    // SAFETY: as `reply` above.
    let forward = unsafe { &*forward };
    // SAFETY: bpf_ktime_get_ns has no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    !answers(forward, reply_key)
        || ct_timeout::expired(reply_key.proto, forward.flags, forward.last_seen_ns, now)
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
/// `reply_key.dport`, network order); `None` when every probe hit a port in use. A port whose
/// reply entry belongs to a dead flow is free: that entry is replaced. Without this, closed
/// flows would hold their ports until LRU eviction and a client making many short connections
/// to one backend would run out after ~4.5k of them.
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
        if reply_is_stale(reply_key) {
            // Delete, then insert only if still absent: of two CPUs reclaiming the same port
            // at once, one wins and the other probes on.
            remove(reply_key);
            if KPR_CT
                .insert(*reply_key, reply, u64::from(BPF_NOEXIST))
                .is_ok()
            {
                return Some(port);
            }
        }
    }
    None
}
