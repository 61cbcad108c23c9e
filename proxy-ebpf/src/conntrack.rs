//! BPF conntrack for the tc programs: one LRU entry per direction of a flow, each holding the
//! tuple a matching packet is rewritten to (Cilium keeps NAT state apart from CT; one map per
//! family is enough here because the agent never inspects flows, and it halves the lookups).
//!
//! IPv4 flows live in `KPR_CT4` in entries sized for IPv4 ([`CtKey4`], [`CtValue4`]: 128 bytes
//! of kernel memory an entry against 176), IPv6 flows in `KPR_CT6`. The rest of the datapath
//! works on the wide [`CtKey`] and [`CtValue`] of both families: this module converts at the
//! maps' edge. A lookup copies the entry found into one of the scratch slot's views (widened
//! for IPv4) and writes go back to the map by key (`mark`): a pointer into either map, kept
//! past the family branch, would make the verifier follow every later path once per map (the
//! two pointers' states never prune each other), which took a program past its 1M
//! instructions; the copy makes both branches end in the same state.
//!
//! Forward entries (client → frontend) carry an idle timeout, refreshed by packets; when it
//! passes, the next packet is a new flow and picks a backend again. A TCP flow whose client has
//! sent only its SYN has a short one (`ct_timeout::TCP_SYN_NS`): a SYN flood holds entries and
//! SNAT ports for a minute, not a day. A TCP FIN or RST in either direction marks the forward
//! entry `CLOSING`, which shortens its timeout to `ct_timeout::TCP_CLOSE_NS`, and a SYN on a
//! closing entry starts a new flow at once (a client reusing its port).
//!
//! A TCP flow's entries are written to `KPR_CT4_NEW`/`KPR_CT6_NEW` until the client's first
//! segment after its SYN (`promote`): there a spoofed SYN flood evicts only other unanswered
//! flows (and the SNAT ports they hold go back with them; a new flow that finds no free port
//! takes one an unanswered flow holds, `snat_port`), never an established flow, as
//! netfilter's early drop takes unassured entries first. Lookups try the established map
//! first; a key is in one of a family's maps at most (`update`).
//!
//! Reply entries are refreshed by the backend's packets. The LRU map may evict one direction
//! of a live flow: a reply whose forward entry is gone rebuilds it (same backend, same SNAT
//! port), and until the reply entry has idled past `ct_timeout::ORPHAN_REPLY_NS` neither a
//! SNAT port probe nor the agent's GC takes it. A reply entry whose flow is dead (forward entry
//! expired or now pointing elsewhere, or gone and the reply idle) is overwritten when a new
//! flow needs its key; the agent's garbage collection deletes the rest (see `proxy-agent`'s
//! `dataplane::ebpf::tc_conntrack`).

use core::ptr;

use aya_ebpf::bindings::BPF_NOEXIST;
use proxy_common::{
    CtKey, CtKey4, CtValue, CtValue4, NextHop, StatIndex,
    conntrack::{answers, holds_reply, orphaned, write_reverse_key},
    ct_flags, ct_timeout,
    maglev::flow_hash,
    proto,
};

use crate::{
    clock,
    maps::{KPR_CT4, KPR_CT4_NEW, KPR_CT6, KPR_CT6_NEW, TcScratch, scratch},
    parse::Packet,
    stats::bump,
};

/// Refresh `last_seen_ns` at most this often: a write per packet would bounce the entry's cache
/// line between CPUs for no gain in precision.
const REFRESH_NS: u64 = ct_timeout::NANOS_PER_SECOND;

/// SNAT source ports: `--bpf-snat-port-range`, which the agent also reserves from the node's
/// ephemeral ports (`net.ipv4.ip_local_reserved_ports`), so a translated flow never takes the
/// 4-tuple of a connection the node itself makes to the backend. Frozen read-only globals the
/// agent sets before loading.
#[unsafe(no_mangle)]
static KPR_SNAT_PORT_MIN: u32 = 49_152;
#[unsafe(no_mangle)]
static KPR_SNAT_PORT_COUNT: u32 = 16_384;
/// Probes for a free SNAT port (after the client's own port) before giving up; bounded for the
/// verifier (each probe is verified as unrolled code: 32 made loading take seconds). The ports
/// probed are a sequence hashed from the client's tuple (uniform over the range, like random
/// ones), so a mid-stream packet whose forward entry was evicted can find its flow's port
/// again (`snat_port` with `find`). At 90 % of the range in use 16 probes all fail with
/// probability 19 %, 8 did with 43 %; at 75 %, 1 % against 10 %.
const SNAT_ATTEMPTS: u32 = 16;

/// Whether `port` (network order) lies in the SNAT port range.
#[inline(always)]
pub fn in_snat_range(port: u16) -> bool {
    // SAFETY: plain reads of read-only globals (volatile: frozen by the loader, not constants).
    let (min, count) = unsafe {
        (
            core::ptr::read_volatile(&raw const KPR_SNAT_PORT_MIN),
            core::ptr::read_volatile(&raw const KPR_SNAT_PORT_COUNT),
        )
    };
    u32::from(u16::from_be(port)).wrapping_sub(min) < count
}

/// Which of the scratch slot's views a lookup copies its entry into: entries in use at the
/// same time need different ones.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum View {
    A,
    B,
}

/// The entry for `key` in the established map or else in the unanswered flows' map (see
/// `maps::KPR_CT4_NEW`), copied into `view` (an IPv4 one widened), its `_pad` 1 when it came
/// from the unanswered flows' map ([`unanswered`]). The copy is read only: write with [`mark`].
/// IPv6 entries are copied too: pointers into two maps would keep the verifier from pruning
/// either path against the other after the call.
#[inline(never)]
pub fn lookup<const V6: bool>(key: &CtKey, view: View) -> Option<&'static CtValue> {
    let scratch = scratch()?;
    // SAFETY: the per-CPU scratch slot is ours until the program ends, the views used as
    // `View` says.
    let to = unsafe {
        match view {
            View::A => &raw mut (*scratch).view_a,
            View::B => &raw mut (*scratch).view_b,
        }
    };
    if V6 {
        let (from, new) = match KPR_CT6.get_ptr(key) {
            Some(from) => (from, 0),
            None => (KPR_CT6_NEW.get_ptr(key)?, 1),
        };
        // SAFETY: the map value comes from a successful lookup; a racing update writes a
        // whole, equally valid value.
        unsafe {
            copy_into(&*from, to, new);
            return Some(&*to);
        }
    }
    let (_, key4) = narrow_key(key)?;
    let (from, new) = match KPR_CT4.get_ptr(key4) {
        Some(from) => (from, 0),
        None => (KPR_CT4_NEW.get_ptr(key4)?, 1),
    };
    // SAFETY: as above.
    unsafe {
        widen_into(&*from, to, new);
        Some(&*to)
    }
}

/// Whether `value` (from [`lookup`]) is an entry of the unanswered flows' map.
#[inline(always)]
pub fn unanswered(value: &CtValue) -> bool {
    value._pad != 0
}

/// `key` narrowed into the scratch slot's `key4` (with the slot), field by field: a whole
/// `CtKey4` would be built on the stack first, and it is passed on by reference, off the stack.
#[inline(always)]
fn narrow_key(key: &CtKey) -> Option<(*mut TcScratch, &'static CtKey4)> {
    let scratch = scratch()?;
    // SAFETY: the per-CPU scratch slot is ours until the program ends; `key4` is used only
    // within this module's functions, never across them.
    let to = unsafe { &mut (*scratch).key4 };
    to.src = key.src[0];
    to.dst = key.dst[0];
    to.sport = key.sport;
    to.dport = key.dport;
    to.proto = key.proto;
    to._pad = [0; 3];
    Some((scratch, to))
}

/// Volatile: LLVM would otherwise carry the copied values (and the zero words) in registers
/// into the callers, spilling them around calls and forking code on the constants, which
/// cost the verifier a quarter more instructions.
#[inline(always)]
unsafe fn widen_into(from: &CtValue4, to: *mut CtValue, new: u8) {
    // SAFETY: the caller's `to` is valid for a `CtValue`.
    unsafe {
        ptr::write_volatile(&raw mut (*to).src, [from.src, 0, 0, 0]);
        ptr::write_volatile(&raw mut (*to).dst, [from.dst, 0, 0, 0]);
        ptr::write_volatile(&raw mut (*to).sport, from.sport);
        ptr::write_volatile(&raw mut (*to).dport, from.dport);
        ptr::write_volatile(&raw mut (*to).flags, from.flags);
        ptr::write_volatile(&raw mut (*to)._pad, new);
        ptr::write_volatile(&raw mut (*to).out_mac, from.out_mac);
        ptr::write_volatile(&raw mut (*to).out_ifindex, from.out_ifindex);
        ptr::write_volatile(&raw mut (*to).last_seen_ns, from.last_seen_ns);
        ptr::write_volatile(&raw mut (*to).service_id, from.service_id);
        copy_next_hop(&from.next_hop, &raw mut (*to).next_hop);
    }
}

/// [`widen_into`] for IPv6 entries.
#[inline(always)]
unsafe fn copy_into(from: &CtValue, to: *mut CtValue, new: u8) {
    // SAFETY: the caller's `to` is valid for a `CtValue`.
    unsafe {
        ptr::write_volatile(&raw mut (*to).src, from.src);
        ptr::write_volatile(&raw mut (*to).dst, from.dst);
        ptr::write_volatile(&raw mut (*to).sport, from.sport);
        ptr::write_volatile(&raw mut (*to).dport, from.dport);
        ptr::write_volatile(&raw mut (*to).flags, from.flags);
        ptr::write_volatile(&raw mut (*to)._pad, new);
        ptr::write_volatile(&raw mut (*to).out_mac, from.out_mac);
        ptr::write_volatile(&raw mut (*to).out_ifindex, from.out_ifindex);
        ptr::write_volatile(&raw mut (*to).last_seen_ns, from.last_seen_ns);
        ptr::write_volatile(&raw mut (*to).service_id, from.service_id);
        copy_next_hop(&from.next_hop, &raw mut (*to).next_hop);
    }
}

/// Field by field, as the rest of the copy: a whole `NextHop` written at once went through a
/// stack temporary, which grew `lookup`'s frame past what the deepest call chain can take.
#[inline(always)]
unsafe fn copy_next_hop(from: &NextHop, to: *mut NextHop) {
    // SAFETY: the caller's `to` is valid for a `NextHop`.
    unsafe {
        ptr::write_volatile(&raw mut (*to).ifindex, from.ifindex);
        ptr::write_volatile(&raw mut (*to).mtu, from.mtu);
        ptr::write_volatile(&raw mut (*to).dmac, from.dmac);
        ptr::write_volatile(&raw mut (*to).smac, from.smac);
        ptr::write_volatile(&raw mut (*to).epoch, from.epoch);
        ptr::write_volatile(&raw mut (*to).generation, from.generation);
    }
}

#[inline(always)]
fn narrow_into(from: &CtValue, to: &mut CtValue4) {
    to.src = from.src[0];
    to.dst = from.dst[0];
    to.sport = from.sport;
    to.dport = from.dport;
    to.flags = from.flags;
    to._pad = 0;
    to.out_mac = from.out_mac;
    to.out_ifindex = from.out_ifindex;
    to.last_seen_ns = from.last_seen_ns;
    to.service_id = from.service_id;
    to._pad2 = 0;
    to.next_hop = from.next_hop;
}

/// Keeps `hop` in the entry under `key`, where the flow's next packets find it ([`lookup`]
/// copies it). Best effort: an entry gone meanwhile keeps nothing, and a racing writer stores
/// the same next hop or a whole new value. Inlined into its one caller (`nat::keep_next_hop`,
/// not inlined itself): one frame less on a chain the verifier bounds at 512 bytes.
#[inline(always)]
pub fn keep_next_hop<const V6: bool>(key: &CtKey, hop: &NextHop) {
    let entry = if V6 {
        let Some(entry) = KPR_CT6
            .get_ptr_mut(key)
            .or_else(|| KPR_CT6_NEW.get_ptr_mut(key))
        else {
            return;
        };
        // SAFETY: from a successful lookup; see `mark` for races.
        unsafe { &mut (*entry).next_hop }
    } else {
        let Some(entry) = narrow_key(key).and_then(|(_, key4)| {
            KPR_CT4
                .get_ptr_mut(key4)
                .or_else(|| KPR_CT4_NEW.get_ptr_mut(key4))
        }) else {
            return;
        };
        // SAFETY: from a successful lookup; see `mark` for races.
        unsafe { &mut (*entry).next_hop }
    };
    *entry = *hop;
}

/// Adds `flags` to the entry under `key` in its map and, unless `now` is 0, sets its last
/// packet's time. A racing writer on another CPU stores another timestamp (as good as ours)
/// or flags of its own (added to, never taken from, as ours are); a racing new-flow write
/// replaces the whole value, and losing our bits then only keeps a new flow open (or
/// half-open, for its short timeout).
#[inline(never)]
fn mark<const V6: bool>(key: &CtKey, flags: u8, now: u64) {
    let (entry_flags, last_seen_ns) = if V6 {
        let Some(entry) = KPR_CT6
            .get_ptr_mut(key)
            .or_else(|| KPR_CT6_NEW.get_ptr_mut(key))
        else {
            return;
        };
        // SAFETY: from a successful lookup; see above for races.
        unsafe { (&mut (*entry).flags, &mut (*entry).last_seen_ns) }
    } else {
        let Some(entry) = narrow_key(key).and_then(|(_, key4)| {
            KPR_CT4
                .get_ptr_mut(key4)
                .or_else(|| KPR_CT4_NEW.get_ptr_mut(key4))
        }) else {
            return;
        };
        // SAFETY: from a successful lookup; see above for races.
        unsafe { (&mut (*entry).flags, &mut (*entry).last_seen_ns) }
    };
    *entry_flags |= flags;
    if now != 0 {
        *last_seen_ns = now;
    }
}

/// Writes `value` under `key` in the maps of its family with the map update `flags`
/// (`BPF_NOEXIST`: only if absent from both maps), into the unanswered flows' map when the
/// scratch slot's `ct_new` says the flow being written is one (`new_flow` sets it), else
/// into the established map; a write over an entry removes the key from the other map, so a
/// key is in one map at most. `true`: written.
#[inline(never)]
fn update<const V6: bool>(key: &CtKey, value: &CtValue, flags: u64) -> bool {
    let Some(scratch) = scratch() else {
        return false;
    };
    // SAFETY: the per-CPU scratch slot is ours until the program ends.
    let new = unsafe { (*scratch).ct_new } != 0;
    let noexist = flags == u64::from(BPF_NOEXIST);
    if V6 {
        let (to, other) = if new {
            (&KPR_CT6_NEW, &KPR_CT6)
        } else {
            (&KPR_CT6, &KPR_CT6_NEW)
        };
        if noexist {
            if other.get_ptr(key).is_some() {
                return false;
            }
        } else {
            let _ = other.remove(key);
        }
        return to.insert(key, value, flags).is_ok();
    }
    let Some((scratch, key4)) = narrow_key(key) else {
        return false;
    };
    let (to, other) = if new {
        (&KPR_CT4_NEW, &KPR_CT4)
    } else {
        (&KPR_CT4, &KPR_CT4_NEW)
    };
    if noexist {
        if other.get_ptr(key4).is_some() {
            return false;
        }
    } else {
        let _ = other.remove(key4);
    }
    // SAFETY: as in `lookup`.
    unsafe {
        let value4 = &mut (*scratch).value4;
        narrow_into(value, value4);
        // By reference: key and value stay in the scratch slot, off the stack.
        let (key4, value4): (&CtKey4, &CtValue4) = (key4, value4);
        to.insert(key4, value4, flags).is_ok()
    }
}

/// Moves the entry under `key` from the unanswered flows' map to the established one, if it
/// is there (overwriting: a key is in one map at most, so what the established map holds
/// under it is older).
#[inline(never)]
fn promote_entry<const V6: bool>(key: &CtKey) {
    if V6 {
        let Some(value) = KPR_CT6_NEW.get_ptr(key) else {
            return;
        };
        // SAFETY: from a successful lookup; the helper copies the value. By reference: the
        // helper reads it from the map, not from a copy on the stack.
        let value: &CtValue = unsafe { &*value };
        if KPR_CT6.insert(key, value, 0).is_ok() {
            let _ = KPR_CT6_NEW.remove(key);
        }
        return;
    }
    let Some((_, key4)) = narrow_key(key) else {
        return;
    };
    let key4: &CtKey4 = key4;
    let Some(value) = KPR_CT4_NEW.get_ptr(key4) else {
        return;
    };
    // SAFETY: as above.
    let value: &CtValue4 = unsafe { &*value };
    if KPR_CT4.insert(key4, value, 0).is_ok() {
        let _ = KPR_CT4_NEW.remove(key4);
    }
}

/// Moves the unanswered flow whose forward entry (`key`, `value`) the client's packet `pkt`
/// just marked established to the established map: its forward and reply entries and, for a
/// SNATed flow on the netfilter path, its egress entries. Only the client's segment after
/// its SYN does it, never the backend's SYN-ACK: a backend answers a spoofed SYN too. Not
/// inlined; keys are built in the scratch slot's `probe_key`, off the stack.
#[inline(never)]
fn promote<const V6: bool>(key: &CtKey, value: &CtValue, pkt: &Packet) {
    promote_entry::<V6>(key);
    let Some(scratch) = scratch() else {
        return;
    };
    // SAFETY: the per-CPU scratch slot is ours until the program ends; `probe_key` is
    // disjoint from the key the caller lent us (the packet's, in `flow_key`), and this path
    // (an established flow's packet) never reaches `new_flow`.
    let probe_key = unsafe { &mut (*scratch).probe_key };
    write_reverse_key(probe_key, value, pkt.proto, pkt.family);
    promote_entry::<V6>(probe_key);
    if value.flags & (ct_flags::SNAT | ct_flags::BYPASS) != ct_flags::SNAT {
        return;
    }
    // The egress entries (`tc::insert_egress`): the forward packet as the host routes it
    // after ingress (client → backend) and the backend's reply to it.
    probe_key.src = pkt.src;
    probe_key.dst = value.dst;
    probe_key.sport = pkt.sport;
    probe_key.dport = value.dport;
    promote_entry::<V6>(probe_key);
    probe_key.src = value.dst;
    probe_key.dst = pkt.src;
    probe_key.sport = value.dport;
    probe_key.dport = pkt.sport;
    promote_entry::<V6>(probe_key);
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

/// Refreshes a forward entry for `pkt`; a FIN or RST marks it closing, and a client's TCP
/// segment other than a SYN established (its handshake was answered).
#[inline(always)]
pub fn touch<const V6: bool>(key: &CtKey, value: &CtValue, pkt: &Packet, now: u64) {
    let mut flags = value.flags;
    if pkt.closes() {
        flags |= ct_flags::CLOSING;
    }
    if pkt.proto == proto::TCP && !pkt.opens() {
        flags |= ct_flags::ESTABLISHED;
    }
    if flags != value.flags || now.saturating_sub(value.last_seen_ns) > REFRESH_NS {
        mark::<V6>(key, flags & !value.flags, now);
    }
    // A FIN or RST never promotes: `reply_seen` passes the backend's on to the forward entry,
    // and a backend resets spoofed SYNs to a closed port.
    if unanswered(value) && flags & ct_flags::ESTABLISHED != 0 && !pkt.closes() {
        promote::<V6>(key, value, pkt);
    }
}

/// Whether forward entry `forward` is the flow whose reply is `pkt` (backend → SNAT address or
/// client).
#[inline(always)]
fn answers_packet(forward: &CtValue, pkt: &Packet) -> bool {
    forward.flags & ct_flags::REPLY == 0
        && forward.src == pkt.dst
        && forward.sport == pkt.dport
        && forward.dst == pkt.src
        && forward.dport == pkt.sport
}

/// A backend's packet `pkt` matched reply entry `entry`: refreshes it (at most once a second),
/// passes a FIN or RST on to the flow's forward entry, and rebuilds that entry if the LRU
/// evicted it — same backend, same SNAT port: the flow is neither re-balanced nor does its
/// port go to another flow. Not rebuilt from a SYN-ACK (a SYN flood's backends retransmit
/// those), and never for egress entries. Not inlined, and the forward key and value are built
/// in the scratch slot: the caller's frame is `service`'s. Returns whether it rebuilt the
/// forward entry, for the caller to count: a used return value keeps a stale stack pointer
/// out of R0 at exit, which the verifier refuses (LLVM drops an unused one).
#[inline(never)]
pub fn reply_seen<const V6: bool>(key: &CtKey, reply: &CtValue, pkt: &Packet, now: u64) -> bool {
    if reply.flags & ct_flags::EGRESS != 0 {
        return false;
    }
    let refresh = now.saturating_sub(reply.last_seen_ns) > REFRESH_NS;
    if !refresh && !pkt.closes() {
        return false;
    }
    if refresh {
        mark::<V6>(key, 0, now);
    }
    let Some(scratch) = scratch() else {
        return false;
    };
    // SAFETY: the per-CPU scratch slot is ours until the program ends; this path (a reply)
    // never reaches `new_flow`, the other user of these fields.
    let (forward_key, forward) = unsafe { (&mut (*scratch).probe_key, &mut (*scratch).forward) };
    write_reverse_key(forward_key, reply, pkt.proto, pkt.family);
    let forward_key: &CtKey = forward_key;
    if let Some(existing) = lookup::<V6>(forward_key, View::B) {
        if pkt.closes() && answers_packet(existing, pkt) {
            touch::<V6>(forward_key, existing, pkt, now);
        }
        return false;
    }
    if pkt.proto == proto::TCP && pkt.syn() {
        return false;
    }
    let snat = pkt.dst != reply.dst || pkt.dport != reply.dport;
    *forward = CtValue {
        src: pkt.dst,
        dst: pkt.src,
        sport: pkt.dport,
        dport: pkt.sport,
        flags: if snat { ct_flags::SNAT } else { 0 }
            | reply.flags & ct_flags::BYPASS
            | ct_flags::ESTABLISHED
            | if pkt.closes() { ct_flags::CLOSING } else { 0 },
        _pad: 0,
        out_mac: [0; 6],
        out_ifindex: 0,
        last_seen_ns: now,
        service_id: reply.service_id,
        _pad2: 0,
        next_hop: NextHop::NONE,
    };
    // NOEXIST: a new flow of the client tuple written meanwhile wins. An established flow's
    // entry: into the established map.
    // SAFETY: as above.
    unsafe { (*scratch).ct_new = 0 };
    // By reference: a copy would put the value on this frame's stack.
    let forward: &CtValue = forward;
    update::<V6>(forward_key, forward, u64::from(BPF_NOEXIST))
}

/// What a reply entry found in use under a key a new flow wants belongs to (`reply_holder`).
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Holder {
    /// Nobody live: the key is free to take.
    Dead,
    /// A live flow.
    Live,
    /// A live TCP flow whose client has sent nothing after its SYN (its entries wait in
    /// `KPR_CT4_NEW`/`KPR_CT6_NEW`): what a spoofed SYN flood leaves, and the oldest such a
    /// SNAT port search has met so far. Its port is taken when no free one is found
    /// (`snat_port`).
    Unanswered,
}

/// Who holds the entry under `reply_key` (found in use when a new flow of client tuple
/// `own_key` wants that key). It is the reply entry of a dead flow when its forward entry is
/// expired or belongs to a newer flow of the same client tuple, or is missing and the reply
/// has idled past `ORPHAN_REPLY_NS` (a live flow's forward entry may have been evicted: its
/// next reply rebuilds it). An earlier flow of `own_key` itself is dead: the new flow replaces
/// it. A live unanswered flow is `Unanswered` with its forward entry there, or without it once
/// past `WRITING_NS`.
/// Not inlined, and entries are read in place with the forward key in the scratch slot:
/// called from `new_flow`, its frame stacks on `external`'s and `new_flow`'s within the
/// verifier's 512 bytes.
#[inline(never)]
pub fn reply_holder<const V6: bool>(reply_key: &CtKey, own_key: &CtKey) -> Holder {
    let Some(reply) = lookup::<V6>(reply_key, View::A) else {
        // Gone since the probe: free.
        return Holder::Dead;
    };
    let Some(scratch) = scratch() else {
        return Holder::Live;
    };
    // SAFETY: the per-CPU scratch slot is ours until the program ends, and `probe_key` is
    // disjoint from the `reply_key` the caller lent us.
    let probe_key = unsafe { &mut (*scratch).probe_key };
    if reply.flags & ct_flags::REPLY == 0 {
        return Holder::Live;
    }
    write_reverse_key(probe_key, reply, reply_key.proto, reply_key.family);
    // By reference: a copy would put the key back on this frame's stack.
    let probe_key: &CtKey = probe_key;
    if probe_key == own_key {
        return Holder::Dead;
    }
    let now = clock::now_ns();
    let Some(forward) = lookup::<V6>(probe_key, View::B) else {
        return if orphaned(reply, now) {
            Holder::Dead
        } else if unanswered(reply) && now.saturating_sub(reply.last_seen_ns) > WRITING_NS {
            oldest_unanswered(reply.last_seen_ns)
        } else {
            Holder::Live
        };
    };
    // A TCP flow that saw its FIN or RST no longer holds the tuple, as netfilter lets a new
    // connection take the tuple of one in TIME_WAIT/CLOSE (`nf_nat_used_tuple_harder`): a
    // client reconnecting from the same port through another frontend is not refused for the
    // closed flow's 10 s.
    if !holds_reply(forward, reply_key, now)
        || (reply_key.proto == proto::TCP && forward.flags & ct_flags::CLOSING != 0)
    {
        Holder::Dead
    } else if unanswered(forward) && unanswered(reply) {
        // The client's packets only: a backend retransmits its SYN-ACK to a spoofed client.
        oldest_unanswered(forward.last_seen_ns)
    } else {
        Holder::Live
    }
}

/// A reply entry of an unanswered flow without its forward entry, younger than this, may be a
/// new flow's that another CPU is writing (the reply entry first): it is not taken.
const WRITING_NS: u64 = ct_timeout::NANOS_PER_SECOND / 1000;

/// `Holder::Unanswered` when the unanswered flow last heard from at `seen_ns` is the oldest
/// one the SNAT port search has met so far (recorded in the scratch slot), else `Holder::Live`:
/// of the ports unanswered flows hold, the search takes the one of the flow silent longest,
/// never a handshake a round trip old that a flood's younger entries outnumber.
#[inline(always)]
fn oldest_unanswered(seen_ns: u64) -> Holder {
    let Some(scratch) = scratch() else {
        return Holder::Live;
    };
    // SAFETY: the per-CPU scratch slot is ours until the program ends.
    unsafe {
        if seen_ns >= (*scratch).oldest_unanswered_ns {
            return Holder::Live;
        }
        (*scratch).oldest_unanswered_ns = seen_ns;
    }
    Holder::Unanswered
}

/// Who holds the tuple a backend answers a new flow with before any SNAT (its reply key with the
/// client's address and port): the tuple the netfilter path shows the kernel for the flow, and
/// the key of its egress entries (see `ct_flags::BYPASS`).
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Tuple {
    /// Nobody live: the netfilter path is the flow's.
    Free,
    /// A connection of the previous rules in the kernel's conntrack (an adopted `KERNEL_NAT`
    /// entry that has not idled out).
    Kernel,
    /// A live flow of ours without SNAT (its reply entry).
    Flow,
    /// A live SNATed flow of ours on the netfilter path (its egress reply entry).
    Egress,
}

/// Who holds `reply_key` for the new flow of client tuple `own_key` (an earlier flow of that
/// tuple holds nothing: the new flow replaces it). A TCP flow that saw its FIN or RST holds
/// nothing either, as for `reply_holder`. Not inlined, and the holder's forward key is built
/// in the scratch slot's `probe_key`, where `divert_holder` finds it: called from `new_flow`.
#[inline(never)]
pub fn tuple_holder<const V6: bool>(reply_key: &CtKey, own_key: &CtKey, now: u64) -> Tuple {
    let Some(entry) = lookup::<V6>(reply_key, View::A) else {
        return Tuple::Free;
    };
    if entry.flags & ct_flags::KERNEL_NAT != 0 {
        return if ct_timeout::expired(reply_key.proto, entry.flags, entry.last_seen_ns, now) {
            Tuple::Free
        } else {
            Tuple::Kernel
        };
    }
    if entry.flags & ct_flags::REPLY == 0 {
        return Tuple::Free;
    }
    let Some(scratch) = scratch() else {
        return Tuple::Free;
    };
    // SAFETY: the per-CPU scratch slot is ours until the program ends; `probe_key` is disjoint
    // from the keys the caller lent us.
    let probe_key = unsafe { &mut (*scratch).probe_key };
    write_reverse_key(probe_key, entry, reply_key.proto, reply_key.family);
    // By reference: a copy would put the key on this frame's stack.
    let probe_key: &CtKey = probe_key;
    if probe_key == own_key {
        return Tuple::Free;
    }
    let Some(forward) = lookup::<V6>(probe_key, View::B) else {
        return Tuple::Free;
    };
    let live = forward.flags & ct_flags::REPLY == 0
        && forward.dst == reply_key.src
        && forward.dport == reply_key.sport
        && !(reply_key.proto == proto::TCP && forward.flags & ct_flags::CLOSING != 0)
        && !ct_timeout::expired(reply_key.proto, forward.flags, forward.last_seen_ns, now);
    if !live {
        Tuple::Free
    } else if entry.flags & ct_flags::EGRESS != 0 {
        Tuple::Egress
    } else {
        Tuple::Flow
    }
}

/// Moves the live SNATed flow `tuple_holder` found (`Tuple::Egress`, its forward key still in
/// the scratch slot's `probe_key`) to the fast path, so that a new flow without SNAT can take
/// the tuple its egress entries hold: its packets no longer need them. A packet of it already
/// between ingress and egress misses its egress half; TCP sends it again.
#[inline(never)]
pub fn divert_holder<const V6: bool>() {
    let Some(scratch) = scratch() else {
        return;
    };
    // SAFETY: the per-CPU scratch slot is ours until the program ends. Keys by reference: a
    // copy would put them on this frame's stack.
    let forward_key: &CtKey = unsafe { &(*scratch).probe_key };
    let Some(forward) = lookup::<V6>(forward_key, View::A) else {
        return;
    };
    // A racing writer stores a whole value (a new flow of that client tuple, which then needs
    // no diverting) or a timestamp.
    mark::<V6>(forward_key, ct_flags::BYPASS, 0);
    let (proto, family) = (forward_key.proto, forward_key.family);
    // SAFETY: as above. The reply key goes where the forward key was, which is read no more.
    unsafe { write_reverse_key(&mut (*scratch).probe_key, forward, proto, family) };
    // SAFETY: as above.
    let reply_key: &CtKey = unsafe { &(*scratch).probe_key };
    mark::<V6>(reply_key, ct_flags::BYPASS, 0);
}

#[inline(always)]
pub fn insert<const V6: bool>(key: &CtKey, value: &CtValue) -> bool {
    update::<V6>(key, value, 0)
}

#[inline(never)]
pub fn remove<const V6: bool>(key: &CtKey) {
    // Best effort: a leftover reply entry is harmless and ages out of the LRU.
    if V6 {
        let _ = KPR_CT6.remove(key);
        let _ = KPR_CT6_NEW.remove(key);
        return;
    }
    if let Some((_, key4)) = narrow_key(key) {
        let _ = KPR_CT4.remove(key4);
        let _ = KPR_CT4_NEW.remove(key4);
    }
}

/// Inserts the reply entry of a flow without SNAT. Never over another live flow's entry (the
/// same backend and client tuple through another frontend): its replies would come back from
/// the wrong frontend. `false`: not inserted (counted).
#[inline(always)]
pub fn insert_reply<const V6: bool>(reply_key: &CtKey, reply: &CtValue, own_key: &CtKey) -> bool {
    if update::<V6>(reply_key, reply, u64::from(BPF_NOEXIST)) {
        return true;
    }
    if reply_holder::<V6>(reply_key, own_key) != Holder::Dead {
        bump(StatIndex::TcReplyClash);
        return false;
    }
    if update::<V6>(reply_key, reply, 0) {
        return true;
    }
    bump(StatIndex::TcCtFailed);
    false
}

/// Who holds the key of a reply entry.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ReplyKey {
    Free,
    /// The reply entry `reply` of a flow of ours (not one the kernel's NAT carries): the flow
    /// a mid-stream packet without forward entry belongs to.
    Flow,
    /// Another flow.
    Taken,
}

/// Who holds `reply_key`: nobody, the flow whose reply entry is `reply`, or another flow.
#[inline(never)]
pub fn reply_key_holder<const V6: bool>(reply_key: &CtKey, reply: &CtValue) -> ReplyKey {
    let Some(entry) = lookup::<V6>(reply_key, View::A) else {
        return ReplyKey::Free;
    };
    if entry.flags & ct_flags::REPLY != 0
        && entry.flags & ct_flags::KERNEL_NAT == 0
        && entry.src == reply.src
        && entry.dst == reply.dst
        && entry.sport == reply.sport
        && entry.dport == reply.dport
    {
        ReplyKey::Flow
    } else {
        ReplyKey::Taken
    }
}

/// Inserts reply entry `reply` under `key` if absent. By reference: a copy of the key would
/// be on `new_flow`'s frame (`snat_port` is inlined there), within the verifier's 512-byte
/// combined stack.
#[inline(always)]
fn reserve<const V6: bool>(key: &CtKey, reply: &CtValue) -> bool {
    update::<V6>(key, reply, u64::from(BPF_NOEXIST))
}

/// The SNAT port of a mid-stream packet's flow (`snat_port` with `find`).
pub enum SnatPort {
    /// Its reply entry is there: the port the flow has.
    Found(u16),
    /// Its reply entry is gone too: the first free port of the flow's sequence, reserved
    /// again (the port the flow got when it started unless an earlier one has been freed).
    Reserved(u16),
}

/// Probe `attempt` (≥ 1) of the SNAT port sequence of a flow whose tuple hashes to `hash`.
#[inline(always)]
fn probe(hash: u32, attempt: u32) -> u32 {
    let h = (hash ^ attempt.wrapping_mul(0x9e37_79b9)).wrapping_mul(0x85eb_ca6b);
    h ^ (h >> 16)
}

/// Inserts the reply entry of a source-NATed flow under a free SNAT port (written into
/// `reply_key.dport`, network order); `None` when every probe hit a port in use. The client's
/// own port (in `reply_key.dport` on entry) is tried first when it lies in the range, as
/// netfilter keeps it when free; then the flow's hashed sequence. A port whose reply entry
/// belongs to a dead flow is free: that entry is replaced. Without this, closed flows would
/// hold their ports until LRU eviction and a client making many short connections to one
/// backend would run out. When every probe hits a port in use, the port of the oldest
/// unanswered flow among them is taken over (`take_over`): a spoofed SYN flood cannot hold the
/// range.
///
/// With `find` (a mid-stream packet without forward entry), the same sequence is searched for
/// the port whose reply entry is `reply` already, the port the live flow got when it started;
/// without one and with `rewrite`, the first port of the sequence that nobody holds is
/// reserved again.
#[inline(always)]
pub fn snat_port<const V6: bool>(
    reply_key: &mut CtKey,
    reply: &CtValue,
    own_key: &CtKey,
    find: bool,
    rewrite: bool,
) -> Option<SnatPort> {
    // SAFETY: plain reads of read-only globals (volatile: frozen by the loader, not constants).
    let (min, count) = unsafe {
        (
            core::ptr::read_volatile(&raw const KPR_SNAT_PORT_MIN),
            core::ptr::read_volatile(&raw const KPR_SNAT_PORT_COUNT).max(1),
        )
    };
    let client = u32::from(u16::from_be(reply_key.dport));
    let ports = (u32::from(own_key.sport) << 16) | u32::from(own_key.dport);
    let hash = flow_hash(&own_key.src, &own_key.dst, ports, own_key.proto);
    if let Some(scratch) = scratch() {
        // SAFETY: the per-CPU scratch slot is ours until the program ends.
        unsafe {
            (*scratch).oldest_unanswered_ns = u64::MAX;
            core::ptr::write_volatile(&raw mut (*scratch).snat_spare, 0);
        }
    }
    for attempt in 0..=SNAT_ATTEMPTS {
        let port = if attempt == 0 {
            if client.wrapping_sub(min) >= count {
                continue;
            }
            client
        } else {
            min + probe(hash, attempt) % count
        };
        let port = (port as u16).to_be();
        reply_key.dport = port;
        if find {
            match reply_key_holder::<V6>(reply_key, reply) {
                ReplyKey::Flow => return Some(SnatPort::Found(port)),
                ReplyKey::Free if spare() == 0 => set_spare(port),
                _ => {}
            }
            continue;
        }
        if reserve::<V6>(reply_key, reply) {
            return Some(SnatPort::Reserved(port));
        }
        match reply_holder::<V6>(reply_key, own_key) {
            Holder::Dead => {
                // Delete, then insert only if still absent: of two CPUs reclaiming the same
                // port at once, one wins and the other probes on.
                remove::<V6>(reply_key);
                if reserve::<V6>(reply_key, reply) {
                    return Some(SnatPort::Reserved(port));
                }
            }
            Holder::Unanswered => set_spare(port),
            Holder::Live => {}
        }
    }
    let spare = spare();
    if spare == 0 {
        return None;
    }
    reply_key.dport = spare;
    if find {
        if rewrite && reserve::<V6>(reply_key, reply) {
            return Some(SnatPort::Reserved(spare));
        }
        return None;
    }
    if take_over::<V6>(reply_key, reply) {
        bump(StatIndex::TcSnatPortReclaimed);
        return Some(SnatPort::Reserved(spare));
    }
    None
}

/// The port `snat_port` falls back on so far, network order; 0 (never in the range, which
/// starts at 1024) for none yet. With `find` the first port nobody holds, else the port of the
/// oldest unanswered flow met. Kept in the scratch slot rather than in a local: the verifier
/// tracks a local's value, and walked the remaining probes once with none yet and once with
/// one met, after every probe (a tenth of the verified instructions of the programs that start
/// flows). Calls of their own: inlined, they grew `new_flow`'s frame past the verifier's
/// 512-byte combined stack.
#[inline(never)]
fn spare() -> u16 {
    let Some(scratch) = scratch() else {
        return 0;
    };
    // SAFETY: the per-CPU scratch slot is ours until the program ends.
    unsafe { core::ptr::read_volatile(&raw const (*scratch).snat_spare) }
}

/// See [`spare`].
#[inline(never)]
fn set_spare(port: u16) {
    if let Some(scratch) = scratch() {
        // SAFETY: as above.
        unsafe { core::ptr::write_volatile(&raw mut (*scratch).snat_spare, port) };
    }
}

/// Gives the new flow (`reply`) the SNAT port under `reply_key` that an unanswered flow holds
/// (`Holder::Unanswered`): that flow's forward entry is removed and `reply` written in place
/// of its reply entry. Only when every probe found its port in use: a SYN flood then recycles
/// its own flows' ports, as netfilter's early drop frees unassured entries first, instead of
/// holding the range for the SYN timeout; established flows keep theirs. The flow taken over,
/// if a real client's, finds no entry for its ACK and gets a reset. Its egress entries, if
/// any, stay until the LRU or the agent's GC takes them: they match no packet of another flow
/// (their key is its client's tuple) and one of its client's new flows rewrites them. Not
/// inlined; keys are built in the scratch slot.
#[inline(never)]
fn take_over<const V6: bool>(reply_key: &CtKey, reply: &CtValue) -> bool {
    let Some(holder) = lookup::<V6>(reply_key, View::A) else {
        return reserve::<V6>(reply_key, reply);
    };
    // Promoted (its client answered) or replaced since the probe: not ours to take.
    if !unanswered(holder) || holder.flags & ct_flags::REPLY == 0 {
        return false;
    }
    let Some(scratch) = scratch() else {
        return false;
    };
    // SAFETY: the per-CPU scratch slot is ours until the program ends; `probe_key` is
    // disjoint from the keys the caller lent us.
    let probe_key = unsafe { &mut (*scratch).probe_key };
    write_reverse_key(probe_key, holder, reply_key.proto, reply_key.family);
    // By reference: a copy would put the key on this frame's stack.
    let probe_key: &CtKey = probe_key;
    // Its forward entry, unless a newer flow of that client tuple has it now.
    if lookup::<V6>(probe_key, View::B).is_some_and(|forward| answers(forward, reply_key)) {
        remove::<V6>(probe_key);
    }
    remove::<V6>(reply_key);
    reserve::<V6>(reply_key, reply)
}
