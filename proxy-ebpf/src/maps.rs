//! Map declarations. Names and value types come from `proxy-common`; the agent may resize every
//! map before loading (`EbpfLoader::set_max_entries`), the sizes here are the defaults.
//! All maps are pinned by name so the agent can find (and, after a restart, re-adopt) them under
//! its bpffs directory.
//!
//! Memory: the backend maps are arrays indexed by the agent's dense backend ids, costing what
//! their values need. The hash maps only the agent writes are not preallocated
//! (`BPF_F_NO_PREALLOC`), so their kernel memory follows the Services there are; their capacity
//! is a bound, and costs only the bucket array (16 bytes per slot of capacity, rounded up to a power of two). The
//! LRU maps the datapath writes cannot be (the kernel preallocates every LRU hash map): the
//! agent sizes them from the node's memory (`dataplane::ebpf::map_sizes`).

use core::{marker::PhantomData, ptr};

use aya_ebpf::{
    bindings::{BPF_F_MMAPABLE, BPF_F_NO_PREALLOC},
    helpers::bpf_map_lookup_elem,
    macros::map,
    maps::{
        Array, DevMapHash, HashMap, LpmTrie, LruHashMap, PerCpuArray, PerCpuHashMap, ProgramArray,
    },
};
use proxy_common::{
    AffinityKey, AffinityMatchKey, AffinityValue, Backend4, Backend6, BackendSlotKey, CtKey,
    CtKey4, CtValue, CtValue4, EndpointTrafficKey, Frontend4Key, Frontend6Key, FrontendValue,
    MaglevBlock, MaglevKey, NodeAddrKey, NodeConfig, PortFilter, RevNat4, RevNat4Key, RevNat6,
    RevNat6Key, ServiceName, ServicePackets, ServiceTraffic, SlotBlock, SnatAddrs, SourceRangeKey,
    TcFamilyProgram, TcFragmentProgram, default_sizes,
    ip_family::{self, IpFamily},
    lookup::FrontendMaps,
};

#[map]
pub static KPR_FRONTENDS4: HashMap<Frontend4Key, FrontendValue> =
    HashMap::pinned(default_sizes::FRONTENDS, BPF_F_NO_PREALLOC);

#[map]
pub static KPR_FRONTENDS6: HashMap<Frontend6Key, FrontendValue> =
    HashMap::pinned(default_sizes::FRONTENDS, BPF_F_NO_PREALLOC);

/// Backend slots: (service id, block, generation) → the backend ids of a block of slots.
#[map]
pub static KPR_BACKEND_SLOTS: HashMap<BackendSlotKey, SlotBlock> =
    HashMap::pinned(default_sizes::BACKEND_SLOTS, BPF_F_NO_PREALLOC);

/// Maglev lookup tables: (service id, block, generation) → the backend ids of a block of
/// slots. Not preallocated: the capacity is a bound (`--bpf-map-maglev`), the memory follows
/// the tables actually written, and with `--lb-algorithm random` there are none.
#[map]
pub static KPR_MAGLEV: HashMap<MaglevKey, MaglevBlock> =
    HashMap::pinned(default_sizes::MAGLEV, BPF_F_NO_PREALLOC);

/// Backend id → backend: arrays, as the agent hands out ids densely from 1 (index 0 is never
/// used), so their memory is capacity × value size with no per-element overhead. A removed
/// backend is the zero value (`proxy_common::BackendEntry`); the agent sizes both to the
/// backends' capacity plus index 0.
#[map]
pub static KPR_BACKENDS4: Array<Backend4> = Array::pinned(default_sizes::BACKENDS + 1, 0);

#[map]
pub static KPR_BACKENDS6: Array<Backend6> = Array::pinned(default_sizes::BACKENDS + 1, 0);

/// (socket cookie, backend) → service address. LRU: entries of closed sockets age out without
/// the agent having to track socket lifetimes.
#[map]
pub static KPR_REVNAT4: LruHashMap<RevNat4Key, RevNat4> =
    LruHashMap::pinned(default_sizes::REVNAT, 0);

#[map]
pub static KPR_REVNAT6: LruHashMap<RevNat6Key, RevNat6> =
    LruHashMap::pinned(default_sizes::REVNAT, 0);

/// (client netns, service) → backend and last use. LRU: idle clients age out by themselves;
/// the timeout itself is checked on lookup.
#[map]
pub static KPR_AFFINITY: LruHashMap<AffinityKey, AffinityValue> =
    LruHashMap::pinned(default_sizes::AFFINITY, 0);

/// (socket cookie, service) → backend of an unconnected UDP socket (frontends with
/// `STICKY_SOCKET`). LRU: closed sockets age out by themselves; `last_used_ns` is unused.
#[map]
pub static KPR_UDP_STICKY: LruHashMap<AffinityKey, AffinityValue> =
    LruHashMap::pinned(default_sizes::UDP_STICKY, 0);

/// (service, backend) pairs that are live; see `proxy_common::AffinityMatchKey`.
#[map]
pub static KPR_AFFINITY_MATCH: HashMap<AffinityMatchKey, u8> =
    HashMap::pinned(default_sizes::BACKEND_SLOTS, BPF_F_NO_PREALLOC);

/// Service id → `namespace/name:port`, written by the agent for `proxy-agent inspect`; no
/// program reads it.
#[map]
pub static KPR_SERVICE_NAMES: HashMap<u32, ServiceName> =
    HashMap::pinned(default_sizes::FRONTENDS, BPF_F_NO_PREALLOC);

/// Service id → what happened to its connections; the agent sizes it to the frontends map's
/// capacity (plus slot 0, which no id uses).
#[map]
pub static KPR_SERVICE_TRAFFIC: Array<ServiceTraffic> = Array::pinned(default_sizes::FRONTENDS, 0);

/// Service id → the packets and bytes of its frontend's flows through tc and XDP, per CPU
/// (`traffic::count_packet`). An entry per frontend the tc programs translate for, made by its
/// first flow's first packet, so a node's ClusterIP-only frontends (served at the socket) cost
/// nothing; the agent sizes it like `KPR_SERVICE_TRAFFIC` and deletes an id's entry when it
/// hands the id to another frontend.
#[map]
pub static KPR_SERVICE_PACKETS: PerCpuHashMap<u32, ServicePackets> =
    PerCpuHashMap::pinned(default_sizes::FRONTENDS, BPF_F_NO_PREALLOC);

/// (Service id, endpoint) → new connections (`traffic::count_endpoint`), while the agent
/// sets `node_flags::ENDPOINT_COUNTS`. An entry per pair that was used; the agent sizes it
/// like the frontends and deletes an id's entries when it hands the id to another frontend.
#[map]
pub static KPR_ENDPOINT_TRAFFIC: HashMap<EndpointTrafficKey, u64> =
    HashMap::pinned(default_sizes::FRONTENDS, BPF_F_NO_PREALLOC);

#[map]
pub static KPR_STATS: PerCpuArray<u64> = PerCpuArray::pinned(default_sizes::STATS, 0);

/// tc conntrack: packet 5-tuple → the tuple to rewrite it to, one entry per direction, one map
/// per family (`conntrack` converts IPv4 entries at the map's edge). LRU, so a full table
/// evicts the least recently used flows instead of refusing new ones.
#[map]
pub static KPR_CT4: LruHashMap<CtKey4, CtValue4> = LruHashMap::pinned(default_sizes::CT, 0);

#[map]
pub static KPR_CT6: LruHashMap<CtKey, CtValue> = LruHashMap::pinned(default_sizes::CT, 0);

/// The entries of TCP flows whose client has sent only its SYN: a spoofed SYN flood fills this
/// map, and its LRU evicts only other unanswered flows, never an established one (netfilter's
/// early drop of unassured entries). The client's first segment after the SYN moves the flow's
/// entries to `KPR_CT4`/`KPR_CT6` (`conntrack::promote`); a backend's SYN-ACK does not, as a
/// backend answers spoofed SYNs too.
#[map]
pub static KPR_CT4_NEW: LruHashMap<CtKey4, CtValue4> =
    LruHashMap::pinned(default_sizes::CT / default_sizes::CT_NEW_SHARE, 0);

#[map]
pub static KPR_CT6_NEW: LruHashMap<CtKey, CtValue> =
    LruHashMap::pinned(default_sizes::CT / default_sizes::CT_NEW_SHARE, 0);

/// ICMP REJECT rate limiting: the client (its address as a [`NodeAddrKey`]) → its token
/// bucket (`icmp::allowed`). Not pinned: a restart only refills the buckets.
#[map]
pub static KPR_ICMP_RATE: LruHashMap<NodeAddrKey, IcmpBucket> =
    LruHashMap::with_max_entries(16_384, 0);

/// One client's tokens, in nanoseconds of allowance as the kernel's `inet_peer_xrlim_allow`
/// counts jiffies.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IcmpBucket {
    pub tokens: u64,
    pub last: u64,
}

/// `loadBalancerSourceRanges`: (service id, client prefix) → present.
#[map]
pub static KPR_SOURCE_RANGES: LpmTrie<SourceRangeKey, u8> =
    LpmTrie::pinned(default_sizes::SOURCE_RANGES, 0);

/// The node addresses that accept NodePorts.
#[map]
pub static KPR_NODE_ADDRS: HashMap<NodeAddrKey, u8> =
    HashMap::pinned(default_sizes::NODE_ADDRS, BPF_F_NO_PREALLOC);

/// One [`PortFilter`] at index 0: the ports the tc ingress programs look at
/// (`port_filter`), written by the agent.
#[map]
pub static KPR_PORT_FILTER: Array<PortFilter> = Array::pinned(1, BPF_F_MMAPABLE);

/// One [`NodeConfig`] at index 0.
#[map]
pub static KPR_NODE_CONFIG: Array<NodeConfig> = Array::pinned(1, 0);

/// The node's route generation at index 0 (see `proxy_common::NextHop`): written by the
/// agent's route watch, apart from the node config the syncs write.
#[map]
pub static KPR_ROUTE_GENERATION: Array<u32> = Array::pinned(1, 0);

/// External interface (ifindex) → the addresses a new flow is masqueraded to when the route to
/// its backend leaves by that interface (`tc::route_to_backend`); written by the agent.
#[map]
pub static KPR_SNAT_IFACES: HashMap<u32, SnatAddrs> =
    HashMap::pinned(default_sizes::SNAT_IFACES, BPF_F_NO_PREALLOC);

/// Per-CPU scratch space for the tc programs' larger temporaries: the verifier limits the
/// combined stack of a BPF-to-BPF call chain to 512 bytes, and a new flow needs three
/// conntrack tuples plus a fib query. Not pinned: it holds nothing between packets.
#[repr(C)]
pub struct TcScratch {
    /// A new flow's own (forward) key: `tc::new_flow` builds it here, out of arguments.
    pub flow_key: CtKey,
    pub forward: CtValue,
    pub reply: CtValue,
    pub reply_key: CtKey,
    /// The forward key a SNAT port probe checks when it hits a port in use.
    pub probe_key: CtKey,
    /// The keys of a SNATed flow's egress entries (netfilter path), written by `new_flow`.
    pub egress_key: CtKey,
    pub fib: aya_ebpf::bindings::bpf_fib_lookup,
    /// A new flow's SNAT address from the route to its backend (`tc::route_to_backend`): the
    /// egress interface's address of the packet's family, all-zero for none.
    pub egress_snat: [u32; 4],
    /// A `struct bpf_sock_tuple` for the socket lookup of `tc::orphan_segment` (IPv4: the
    /// first 3 words).
    pub sock_tuple: [u32; 9],
    /// An IPv4 key and value on their way into or out of `KPR_CT4` (`conntrack`).
    pub key4: CtKey4,
    pub value4: CtValue4,
    /// Entries looked up, copied (IPv4 ones widened; `conntrack::View`).
    pub view_a: CtValue,
    pub view_b: CtValue,
    /// The last packet's time of the oldest unanswered flow a SNAT port search has met
    /// (`conntrack::snat_port`): the one whose port it takes if none is free.
    pub oldest_unanswered_ns: u64,
    /// A datagram's key in the fragment map (`fragments`).
    pub frag_key: proxy_common::FragmentKey,
    /// Non-zero while `new_flow` writes an unanswered flow (a TCP SYN's): `conntrack`'s
    /// writes then go to the unanswered flows' map.
    pub ct_new: u32,
    /// The packet `parse` read, where the program reads it from (`parse::into_scratch`).
    pub packet: crate::packet::Packet,
    /// A translated packet's own key and the next hop its entry is to keep
    /// (`nat::keep_next_hop`).
    pub hop_key: CtKey,
    pub hop: proxy_common::NextHop,
    /// The counter a translated packet is counted under, on its way into `nat::translate`
    /// (see `nat::translate_view`).
    pub translate_stat: u32,
    /// The port a SNAT port search falls back on (`conntrack::snat_port`), network order.
    pub snat_spare: u16,
}

/// The tc programs of each family (`proxy_common::TcFamilyProgram` slots), written by the
/// agent when it attaches the entry programs that tail-call them. Pinned: the kernel empties a
/// program array when its last user-space reference goes, and the programs outlive the agent.
/// Shared with the next agent's programs, so filling it is what switches the datapath to them.
#[map]
pub static KPR_TC_FAMILY: ProgramArray = ProgramArray::pinned(TcFamilyProgram::ALL.len() as u32, 0);

/// The tc programs of later IP fragments (`proxy_common::TcFragmentProgram` slots), written
/// with `KPR_TC_FAMILY` and pinned for the same reasons.
#[map]
pub static KPR_TC_FRAGMENT: ProgramArray =
    ProgramArray::pinned(TcFragmentProgram::ALL.len() as u32, 0);

/// The interfaces the XDP program redirects to (`xdp`): the agent writes those it attached XDP
/// to. A next hop elsewhere (a local pod's veth, whose peer may not take XDP frames) is left to
/// tc. Pinned, as the program arrays: the XDP link outlives the agent.
#[map]
pub static KPR_XDP_TARGETS: DevMapHash = DevMapHash::pinned(default_sizes::XDP_TARGETS, 0);

/// The XDP programs of new flows' first packets, one per family (slot 0 IPv4, 1 IPv6;
/// `proxy_common::program_names::XDP_NEW_FLOW`), tail-called by `kpr_xdp_external`: each is
/// verified with its family's conntrack code only, as the tc family programs are. Pinned, as
/// the tc program arrays. Named for the multi-buffer programs it holds: the kernel fixes a
/// program array's frags-ness with the first program that uses it, and the single-buffer
/// builds' pinned `KPR_XDP_NEW_FLOW` would refuse them (see `map_names::XDP_NEW_FLOW`).
#[map]
pub static KPR_XDP_NEW_FLOW_FRAGS: ProgramArray = ProgramArray::pinned(2, 0);

/// Shared by tc and XDP: on one CPU they never run at once (XDP runs in the driver's NAPI
/// poll, before an skb exists; tc later in the same softirq, or with bottom halves disabled).
#[map]
pub static KPR_TC_SCRATCH: PerCpuArray<TcScratch> = PerCpuArray::with_max_entries(1, 0);

/// The scratch slot's index as a global (in the frozen `.rodata` map): `get_ptr_mut(0)` puts
/// the index on the caller's stack, 4 bytes that round up to 16 in every frame of the
/// verifier's 512-byte chain that looks the slot up.
static SCRATCH_SLOT: u32 = 0;

/// This CPU's scratch slot.
#[inline(always)]
pub fn scratch() -> Option<*mut TcScratch> {
    // SAFETY: the map definition and a key of the map's key type, both globals; the helper
    // returns this CPU's slot or null.
    let slot = unsafe {
        bpf_map_lookup_elem(
            ptr::from_ref(&KPR_TC_SCRATCH).cast_mut().cast(),
            ptr::from_ref(&SCRATCH_SLOT).cast(),
        )
    };
    (!slot.is_null()).then_some(slot.cast())
}

/// Each family's service maps, for code written once over both (`proxy_common::ip_family`).
pub trait FamilyMaps: IpFamily + 'static {
    /// `KPR_FRONTENDS4/6`.
    fn frontend_map() -> &'static HashMap<Self::FrontendKey, FrontendValue>;
    /// `KPR_BACKENDS4/6`.
    fn backend_map() -> &'static Array<Self::Backend>;
    /// `KPR_REVNAT4/6`.
    fn revnat_map() -> &'static LruHashMap<Self::RevNatKey, Self::RevNat>;
}

impl FamilyMaps for ip_family::V4 {
    #[inline(always)]
    fn frontend_map() -> &'static HashMap<Frontend4Key, FrontendValue> {
        &KPR_FRONTENDS4
    }
    #[inline(always)]
    fn backend_map() -> &'static Array<Backend4> {
        &KPR_BACKENDS4
    }
    #[inline(always)]
    fn revnat_map() -> &'static LruHashMap<RevNat4Key, RevNat4> {
        &KPR_REVNAT4
    }
}

impl FamilyMaps for ip_family::V6 {
    #[inline(always)]
    fn frontend_map() -> &'static HashMap<Frontend6Key, FrontendValue> {
        &KPR_FRONTENDS6
    }
    #[inline(always)]
    fn backend_map() -> &'static Array<Backend6> {
        &KPR_BACKENDS6
    }
    #[inline(always)]
    fn revnat_map() -> &'static LruHashMap<RevNat6Key, RevNat6> {
        &KPR_REVNAT6
    }
}

/// A destination of family `F` (address words, port in network order, protocol) as the
/// frontend lookups of `proxy_common::lookup` read the maps for it.
pub struct Destination<'a, F> {
    pub addr: &'a [u32; 4],
    pub port: u16,
    pub proto: u8,
    pub family: PhantomData<F>,
}

impl<'a, F> Destination<'a, F> {
    #[inline(always)]
    pub fn new(addr: &'a [u32; 4], port: u16, proto: u8) -> Self {
        Self {
            addr,
            port,
            proto,
            family: PhantomData,
        }
    }
}

impl<F: FamilyMaps> FrontendMaps for Destination<'_, F> {
    #[inline(always)]
    fn frontend(&mut self, wildcard: bool, scope: u8) -> Option<FrontendValue> {
        let addr = if wildcard { &[0; 4] } else { self.addr };
        let key = F::frontend_key(addr, self.port, self.proto, scope);
        // SAFETY: the value is copied out at once (whole-value updates by the agent).
        unsafe { F::frontend_map().get(key) }.copied()
    }
    #[inline(always)]
    fn node_port_address(&mut self) -> bool {
        let key = NodeAddrKey {
            addr: *self.addr,
            family: F::FAMILY,
            _pad: [0; 3],
        };
        // SAFETY: presence check only.
        unsafe { KPR_NODE_ADDRS.get(key) }.is_some()
    }
    #[inline(always)]
    fn node_config(&mut self) -> Option<&NodeConfig> {
        KPR_NODE_CONFIG.get(0)
    }
}
