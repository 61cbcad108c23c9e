//! Per-Service counters, by the frontend's service id: what happened to its connections
//! (`KPR_SERVICE_TRAFFIC`, once per connection) and the packets and bytes of its flows through
//! tc and XDP (`KPR_SERVICE_PACKETS`, per packet, by the service id a flow's conntrack entries
//! carry).

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use aya_ebpf::{bindings::BPF_NOEXIST, programs::TcContext};
use proxy_common::{
    EndpointTrafficKey, ServicePackets, TrafficDirection, TrafficEvent, family, node_flags, probe,
    proto,
};

use crate::{
    maps::{
        KPR_ENDPOINT_TRAFFIC, KPR_NODE_CONFIG, KPR_SERVICE_PACKETS, KPR_SERVICE_TRAFFIC, scratch,
    },
    packet::{ETH_HLEN, Packet},
};

/// Counts a tc packet of a flow whose entry carries `service_id` (0: not counted): the segments
/// of a GRO-merged packet (`gso_segs`) and its IP bytes. Not inlined, and every test inside:
/// the verifier follows a branch in the caller on to the caller's end, once per side (a
/// register holding a different value on each keeps the states from pruning each other), while
/// the paths out of a call whose result is unused meet again at once.
#[inline(never)]
pub fn count_tc_packet(ctx: &TcContext, service_id: u32, direction: TrafficDirection) {
    if service_id == 0 {
        return;
    }
    // SAFETY: the context pointer is the program's own __sk_buff.
    let (len, segs) = unsafe { ((*ctx.skb.skb).len, (*ctx.skb.skb).gso_segs) };
    count_packet(
        service_id,
        direction,
        segs.max(1),
        len.saturating_sub(ETH_HLEN as u32),
    );
}

/// [`count_tc_packet`] for the first packet of a new flow `pkt`: not the self-test's probe (its
/// flow's entries are deleted after its one packet).
#[inline(never)]
pub fn count_first_tc_packet(ctx: &TcContext, pkt: &Packet, service_id: u32) {
    if !probe::is_probe(&pkt.src, pkt.sport, pkt.is_v6()) {
        count_tc_packet(ctx, service_id, TrafficDirection::Forward);
    }
}

/// Adds `packets` and `bytes` to the frontend's counters of this CPU, making its entry on the
/// first packet. Inlined into the callers above, which are not: the zero value of a new entry
/// lives on their frame, not on `service`'s (shared with the new-flow chain's 512 bytes).
#[inline(always)]
pub fn count_packet(service_id: u32, direction: TrafficDirection, packets: u32, bytes: u32) {
    // Nobody reads them (`--service-traffic-max-series 0`): the packet costs one array lookup.
    if KPR_NODE_CONFIG
        .get(0)
        .is_some_and(|config| config.flags & node_flags::NO_PACKET_COUNTS != 0)
    {
        return;
    }
    let entry = match KPR_SERVICE_PACKETS.get_ptr_mut(service_id) {
        Some(entry) => entry,
        None => {
            // Of two CPUs making it at once, one inserts and the other finds it.
            let _ = KPR_SERVICE_PACKETS.insert(
                service_id,
                ServicePackets::default(),
                u64::from(BPF_NOEXIST),
            );
            let Some(entry) = KPR_SERVICE_PACKETS.get_ptr_mut(service_id) else {
                return;
            };
            entry
        }
    };
    let index = direction as usize;
    // SAFETY: the pointer comes from a successful lookup and is this CPU's own copy of the
    // value: no other CPU writes it, so plain adds (a shared atomic would bounce the line).
    unsafe {
        if let Some(count) = (*entry).packets.get_mut(index) {
            *count += u64::from(packets);
        }
        if let Some(count) = (*entry).bytes.get_mut(index) {
            *count += u64::from(bytes);
        }
    }
}

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

/// Counts a new connection to the frontend with `service_id` for the endpoint it was given
/// (`addr`, `port`, network order), while the agent asks for it (`node_flags::ENDPOINT_COUNTS`,
/// `--service-traffic-endpoints`).
#[inline(always)]
pub fn count_endpoint(service_id: u32, addr: &[u32; 4], port: u16, v6: bool) {
    if !KPR_NODE_CONFIG
        .get(0)
        .is_some_and(|config| config.flags & node_flags::ENDPOINT_COUNTS != 0)
    {
        return;
    }
    let key = EndpointTrafficKey {
        service_id,
        addr: *addr,
        port,
        family: if v6 { family::V6 } else { family::V4 },
        _pad: 0,
    };
    if KPR_ENDPOINT_TRAFFIC.get_ptr_mut(key).is_none() {
        // Of two CPUs making it at once, one inserts and the other finds it. A full map
        // refuses the pair: its connections go uncounted.
        let _ = KPR_ENDPOINT_TRAFFIC.insert(key, 0, u64::from(BPF_NOEXIST));
    }
    if let Some(count) = KPR_ENDPOINT_TRAFFIC.get_ptr_mut(key) {
        // SAFETY: the pointer comes from a successful lookup and stays valid while the
        // program runs; other CPUs add to the same value, hence the atomic add (its result
        // unused: the plain `lock +=`, see `count`).
        unsafe {
            atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(count, 1);
        }
    }
}

/// [`count_endpoint`] for the flow `new_flow` just wrote for `pkt` (its forward entry, in the
/// scratch slot, holds the backend): as `new_flow` counts the connection, neither a recovered
/// mid-stream TCP flow nor the self-test's probe. Not inlined, and called once `new_flow` has
/// returned: the key then lives on a frame of its own, not under the new-flow chain's, which
/// is at the verifier's 512-byte limit.
#[inline(never)]
pub fn count_new_flow_endpoint(pkt: &Packet, service_id: u32) {
    if (pkt.proto == proto::TCP && !pkt.opens())
        || probe::is_probe(&pkt.src, pkt.sport, pkt.is_v6())
    {
        return;
    }
    let Some(scratch) = scratch() else {
        return;
    };
    // SAFETY: the per-CPU slot is ours until the program ends; `new_flow` left the flow's
    // forward entry in it.
    let (addr, port) = unsafe { ((*scratch).forward.dst, (*scratch).forward.dport) };
    count_endpoint(service_id, &addr, port, pkt.is_v6());
}
