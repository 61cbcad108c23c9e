//! Service load-balancing maps: frontends → backend slots → backends, reverse NAT for socket
//! hooks, and session affinity.
//!
//! Update protocol (agent side): a frontend's backends are written into the slots of the
//! generation the frontend does *not* use yet, then the frontend value is switched to that
//! generation and count in one map update, and the old generation's slots are deleted a grace
//! (one second) after that, not at once: a reader that read the frontend just before the switch
//! looks its slot up afterwards and must still find it. A reader therefore always sees a
//! complete backend set, old or new, never a mix, unless held up for longer than the grace.
//!
//! IPv4 and IPv6 have their own frontend, backend and reverse-NAT maps; slots, affinity and the
//! affinity match map are shared (service and backend ids come from one id space per kind).

/// Names of the maps, as declared in `proxy-ebpf` and pinned under the agent's bpffs directory.
pub mod map_names {
    pub const FRONTENDS4: &str = "KPR_FRONTENDS4";
    pub const FRONTENDS6: &str = "KPR_FRONTENDS6";
    pub const BACKEND_SLOTS: &str = "KPR_BACKEND_SLOTS";
    pub const BACKENDS4: &str = "KPR_BACKENDS4";
    pub const BACKENDS6: &str = "KPR_BACKENDS6";
    pub const REVNAT4: &str = "KPR_REVNAT4";
    pub const REVNAT6: &str = "KPR_REVNAT6";
    pub const AFFINITY: &str = "KPR_AFFINITY";
    pub const AFFINITY_MATCH: &str = "KPR_AFFINITY_MATCH";
    pub const STATS: &str = "KPR_STATS";
    /// The tc conntrack, one map per family (IPv4 entries are a third of the size).
    pub const CT4: &str = "KPR_CT4";
    pub const CT6: &str = "KPR_CT6";
    /// The tc conntrack's flows not yet answered (a TCP client's SYN, before its ACK), apart
    /// from the rest so that a SYN flood evicts only its own kind (netfilter's early drop).
    pub const CT4_NEW: &str = "KPR_CT4_NEW";
    pub const CT6_NEW: &str = "KPR_CT6_NEW";
    pub const SOURCE_RANGES: &str = "KPR_SOURCE_RANGES";
    pub const NODE_ADDRS: &str = "KPR_NODE_ADDRS";
    pub const NODE_CONFIG: &str = "KPR_NODE_CONFIG";
    pub const SNAT_IFACES: &str = "KPR_SNAT_IFACES";
    pub const MAGLEV: &str = "KPR_MAGLEV";
    pub const UDP_STICKY: &str = "KPR_UDP_STICKY";
    pub const SERVICE_NAMES: &str = "KPR_SERVICE_NAMES";
    /// Each frontend's traffic counters, indexed by its service id ([`super::ServiceTraffic`]).
    pub const SERVICE_TRAFFIC: &str = "KPR_SERVICE_TRAFFIC";
    /// The packets and bytes of each frontend's flows the tc programs translate, per CPU, by
    /// service id ([`super::ServicePackets`]).
    pub const SERVICE_PACKETS: &str = "KPR_SERVICE_PACKETS";
    /// The new connections each frontend gave each endpoint (`--service-traffic-endpoints`),
    /// by [`super::EndpointTrafficKey`].
    pub const ENDPOINT_TRAFFIC: &str = "KPR_ENDPOINT_TRAFFIC";
    /// The ports the tc ingress programs care about ([`super::PortFilter`]), one entry.
    pub const PORT_FILTER: &str = "KPR_PORT_FILTER";
    /// The node's route generation (one `u32`), which the agent bumps on every route, rule,
    /// neighbour and link change: the next hops conntrack entries keep
    /// ([`super::NextHop`]) are valid only under the generation they were resolved in.
    pub const ROUTE_GENERATION: &str = "KPR_ROUTE_GENERATION";
    /// The tc programs of each family the entry programs tail-call (a program array, pinned so
    /// that it outlives the agent; not in [`PINNED`]: it holds programs, not state).
    pub const TC_FAMILY: &str = "KPR_TC_FAMILY";
    /// The tc programs of later IP fragments the family programs tail-call (pinned and not in
    /// [`PINNED`], as [`TC_FAMILY`]).
    pub const TC_FRAGMENT: &str = "KPR_TC_FRAGMENT";
    /// The interfaces the XDP program may redirect to (a device map: ifindex → ifindex),
    /// filled by the agent with the interfaces it attached XDP to (pinned and not in
    /// [`PINNED`], as [`TC_FAMILY`]).
    pub const XDP_TARGETS: &str = "KPR_XDP_TARGETS";
    /// The XDP programs of a new flow's first packet the XDP entry program tail-calls, one per
    /// family (`program_names::XDP_NEW_FLOW`; pinned and not in [`PINNED`], as [`TC_FAMILY`]).
    /// A name of its own since the XDP programs are multi-buffer (`xdp.frags`): a program
    /// array takes the frags-ness of the first program that uses it for its lifetime, so the
    /// single-buffer builds' array ([`XDP_NEW_FLOW_SINGLE_BUFFER`]) cannot hold these.
    pub const XDP_NEW_FLOW: &str = "KPR_XDP_NEW_FLOW_FRAGS";
    /// The program array of [`XDP_NEW_FLOW`]'s programs as builds before multi-buffer XDP
    /// pinned it, owned by single-buffer programs; unpinned at start (the previous agent's
    /// XDP program holds it until its link gets this build's program). An agent of such a
    /// build, downgraded to, pins a new one of its own.
    pub const XDP_NEW_FLOW_SINGLE_BUFFER: &str = "KPR_XDP_NEW_FLOW";
    /// The first fragments' ports by datagram ([`super::FragmentKey`]; not pinned: a
    /// datagram's fragments arrive within a moment, and a restart loses a few at most).
    pub const FRAGMENTS: &str = "KPR_FRAGMENTS";

    /// Every map the agent pins (and `--cleanup` removes).
    pub const PINNED: [&str; 26] = [
        FRONTENDS4,
        FRONTENDS6,
        BACKEND_SLOTS,
        BACKENDS4,
        BACKENDS6,
        REVNAT4,
        REVNAT6,
        AFFINITY,
        AFFINITY_MATCH,
        STATS,
        CT4,
        CT6,
        CT4_NEW,
        CT6_NEW,
        SOURCE_RANGES,
        NODE_ADDRS,
        NODE_CONFIG,
        SNAT_IFACES,
        MAGLEV,
        UDP_STICKY,
        SERVICE_NAMES,
        SERVICE_TRAFFIC,
        SERVICE_PACKETS,
        ENDPOINT_TRAFFIC,
        PORT_FILTER,
        ROUTE_GENERATION,
    ];
}

/// Names of the eBPF programs in the object.
pub mod program_names {
    pub const CONNECT4: &str = "kpr_connect4";
    pub const CONNECT6: &str = "kpr_connect6";
    pub const SENDMSG4: &str = "kpr_sendmsg4";
    pub const SENDMSG6: &str = "kpr_sendmsg6";
    pub const RECVMSG4: &str = "kpr_recvmsg4";
    pub const RECVMSG6: &str = "kpr_recvmsg6";
    pub const GETPEERNAME4: &str = "kpr_getpeername4";
    pub const GETPEERNAME6: &str = "kpr_getpeername6";
    /// tc ingress on the node's external interfaces: service traffic from outside the node and
    /// replies of remote backends.
    pub const TC_EXTERNAL: &str = "kpr_tc_external";
    /// tc ingress on every other interface (pod veths): replies of local backends.
    pub const TC_REPLY: &str = "kpr_tc_reply";
    /// tc egress on every interface that has one of the ingress programs: the source half of
    /// a translation on the netfilter path (after the host's FORWARD and POSTROUTING).
    pub const TC_EGRESS: &str = "kpr_tc_egress";
    /// XDP on the node's external interfaces (`--bpf-xdp`): established fast-path flows
    /// translated and redirected from the driver; everything else passes to `kpr_tc_external`.
    pub const XDP_EXTERNAL: &str = "kpr_xdp_external";
    /// The first packet of a new external flow in XDP, per family, tail-called by
    /// [`XDP_EXTERNAL`] through `KPR_XDP_NEW_FLOW`: the slot is the index here (IPv4, IPv6).
    pub const XDP_NEW_FLOW: [&str; 2] = ["kpr_xdp_new_flow4", "kpr_xdp_new_flow6"];
    /// Stands in for the IPv6 family programs (`KPR_TC_FAMILY`) while the node has no IPv6
    /// Service: passes every packet on, as the entry program does with one that is not ours.
    /// Verified in no time, where the IPv6 programs take the kernel's verifier about as long
    /// as the IPv4 ones.
    pub const TC_IDLE: &str = "kpr_tc_idle";
    /// [`TC_IDLE`] for the IPv6 slot of `KPR_XDP_NEW_FLOW_FRAGS`: the packet goes on to tc.
    pub const XDP_IDLE: &str = "kpr_xdp_idle";

    /// Every socket program, attached to the cgroup in this order.
    pub const ALL: [&str; 8] = [
        CONNECT4,
        CONNECT6,
        SENDMSG4,
        SENDMSG6,
        RECVMSG4,
        RECVMSG6,
        GETPEERNAME4,
        GETPEERNAME6,
    ];
}

/// Default capacities; the agent may override them before loading.
pub mod default_sizes {
    pub const FRONTENDS: u32 = 65_536;
    pub const BACKEND_SLOTS: u32 = 262_144;
    pub const BACKENDS: u32 = 262_144;
    pub const REVNAT: u32 = 262_144;
    pub const AFFINITY: u32 = 65_536;
    /// Unconnected UDP sockets remembered with their backend per frontend (LRU).
    pub const UDP_STICKY: u32 = 65_536;
    /// Slots of the per-CPU counter array: more than [`crate::StatIndex::COUNT`], so a newer
    /// object with more counters still fits a map pinned by an older agent.
    pub const STATS: u32 = 64;
    /// BPF conntrack entries (two per flow: original and reply direction).
    pub const CT: u32 = 262_144;
    /// Entries of the unanswered flows' maps ([`super::map_names::CT4_NEW`]): this share of
    /// [`CT`] (a quarter).
    pub const CT_NEW_SHARE: u32 = 4;
    pub const SOURCE_RANGES: u32 = 16_384;
    pub const NODE_ADDRS: u32 = 1_024;
    /// External interfaces with an address to masquerade to.
    pub const SNAT_IFACES: u32 = 256;
    /// Interfaces the XDP program redirects to.
    pub const XDP_TARGETS: u32 = 256;
    /// Maglev table blocks of [`crate::MAGLEV_BLOCK_SLOTS`] slots (`--bpf-map-maglev`): 1024
    /// frontends × 64 blocks (the default table size of 1021 slots). Not preallocated.
    pub const MAGLEV: u32 = 65_536;
    /// IP datagrams whose first fragment's ports the tc programs remember for the later
    /// fragments (LRU; only datagrams of Service flows, see [`super::FragmentKey`]).
    pub const FRAGMENTS: u32 = 8_192;
}

/// Which traffic a frontend applies to.
pub mod scope {
    /// Traffic from local sockets (the cgroup socket hooks).
    pub const INTERNAL: u8 = 0;
    /// Packets arriving from outside the node (the tc programs). A NodePort frontend has the
    /// unspecified address (`0.0.0.0`/`::`) and matches every address in `KPR_NODE_ADDRS`.
    pub const EXTERNAL: u8 = 1;
}

/// Bits of [`FrontendValue::flags`].
pub mod frontend_flags {
    /// `sessionAffinity: ClientIP`: [`super::FrontendValue::affinity_timeout`] is in use.
    pub const AFFINITY: u8 = 1;
    /// `externalTrafficPolicy: Local`: keep the client address (no SNAT).
    pub const PRESERVE_CLIENT: u8 = 2;
    /// With no backends, drop silently (kube-proxy's DROP for "no local endpoints") instead of
    /// answering ICMP port unreachable (its REJECT for "no endpoints"). On a socket frontend the
    /// syscall fails with `EHOSTUNREACH` instead of `ECONNREFUSED`.
    pub const DROP_NO_BACKENDS: u8 = 4;
    /// `loadBalancerSourceRanges`: only clients in `KPR_SOURCE_RANGES` for this service id.
    /// On a socket frontend (an LB IP the ranges guard): only processes of the node's own
    /// namespace are translated there, judged by the node address; pods' connections pass
    /// untranslated to the tc program on their veth, which sees their source address.
    pub const SOURCE_RANGES: u8 = 8;
    /// A ClusterIP reached from outside the node: SNAT only like kube-proxy's
    /// `KUBE-SVC` masquerade rule (masqueradeAll, or a client outside the cluster CIDR).
    pub const CLUSTER_IP: u8 = 16;
    /// `--lb-algorithm maglev`: the tc programs pick new flows' backends from the frontend's
    /// Maglev table in `KPR_MAGLEV` ([`super::FrontendValue::maglev_size`] slots) by a hash
    /// of the 5-tuple. Only on external frontends; session affinity still goes first.
    pub const MAGLEV: u8 = 32;
    /// An unconnected UDP socket keeps the backend its first datagram to this frontend chose
    /// (`KPR_UDP_STICKY`, keyed by socket cookie) while that backend stays in the service, as
    /// kube-proxy's conntrack keeps a 5-tuple on one backend. Socket frontends of UDP ports;
    /// the agent's map writer tracks their members in `KPR_AFFINITY_MATCH`.
    pub const STICKY_SOCKET: u8 = 64;
}

/// The skb mark bit the ingress programs set on a packet they translated on the netfilter path,
/// so that egress finishes only translations ingress started: a packet that merely has the
/// same tuple as a tracked flow (a client reaching a backend's pod address directly from the
/// same port, a pod answering from its own socket) is not rewritten. Bit 12: clear of
/// kube-proxy's masquerade and drop bits (0x4000, 0x8000), Calico's default mask
/// (0xffff0000) and Istio's 0x539; egress clears it again.
pub const TRANSLATED_MARK: u32 = 0x1000;

/// Bits of [`CtValue::flags`].
pub mod ct_flags {
    /// The entry translates replies (backend → client direction).
    pub const REPLY: u8 = 1;
    /// The flow was source-NATed to the node address.
    pub const SNAT: u8 = 2;
    /// Forward entries of TCP flows: a FIN or RST was seen in either direction, so the entry
    /// idles out after [`super::ct_timeout::TCP_CLOSE_NS`] instead of the established timeout.
    pub const CLOSING: u8 = 4;
    /// Netfilter path only: an entry the egress program applies (it rewrites the source of a
    /// packet the host already routed through FORWARD/POSTROUTING), keyed by the tuple after
    /// the ingress half (destination) of the translation. With `REPLY`: the un-DNAT of a
    /// SNATed flow's reply (backend → client, rewritten to come from the frontend); without:
    /// the SNAT of its forward packets (client → backend, rewritten to come from the node).
    /// The agent's garbage collection keeps it while the flow it mirrors lives.
    pub const EGRESS: u8 = 8;
    /// Forward entries of TCP flows: the client sent a segment other than its SYN, so the
    /// handshake got an answer. Until then the entry idles out after
    /// [`super::ct_timeout::TCP_SYN_NS`]: a SYN flood must not hold entries and SNAT ports for
    /// the established timeout.
    pub const ESTABLISHED: u8 = 16;
    /// Reply entries of flows whose backend is an address of this node (a host-network
    /// endpoint): the host delivered the translated packet to its own socket, so the
    /// backend's packets leave the node's stack rather than arrive on an interface. The
    /// egress program translates them (on either path, without the ingress mark); such a flow
    /// is never source-NATed, as kube-proxy's MASQUERADE in POSTROUTING never sees a packet
    /// delivered locally.
    pub const HOST_BACKEND: u8 = 32;
    /// Forward entries the agent adopted at start from the kernel's conntrack: a UDP or SCTP
    /// flow that netfilter (kube-proxy's rules, or the iptables mode's) already DNATs. Its
    /// packets go to the stack untranslated, where the kernel's conntrack entry keeps applying
    /// its NAT — after the rules are gone too — so the flow keeps its backend across the
    /// takeover. The value's `dst`/`dport` is that backend (for the purge of removed
    /// backends); the entry idles out like any UDP/SCTP flow, and the next packet starts a
    /// flow of the datapath's own.
    pub const KERNEL_NAT: u8 = 64;
    /// Both entries of a flow whose tuple between client and backend — what the netfilter
    /// path shows the kernel's conntrack (destination rewritten at ingress, source at egress),
    /// and the key of its egress entries — another live flow already holds: a flow of ours
    /// from the same client address and port to the same backend through another frontend
    /// (clients reuse a port towards another destination), or a connection of the previous
    /// rules in the kernel's conntrack (an adopted `KERNEL_NAT` entry under that tuple). On
    /// the netfilter path the two would share egress entries (one's packets leaving with the
    /// other's translation), and the kernel would drop the new one's packets as a clash or
    /// remap its source port behind the egress program's back. Its packets take the fast path
    /// instead (both halves at ingress, redirected), on a node that otherwise uses the
    /// netfilter path: netfilter's FORWARD and POSTROUTING do not see them.
    pub const BYPASS: u8 = 128;
}

/// Idle timeouts of `KPR_CT` forward entries, shared by the datapath (which treats an expired
/// entry as absent) and the agent's garbage collection (which deletes it), so both agree on
/// what is dead. Clock: `bpf_ktime_get_ns`, i.e. `CLOCK_MONOTONIC`.
pub mod ct_timeout {
    use super::ct_flags;
    use crate::proto;

    pub const NANOS_PER_SECOND: u64 = 1_000_000_000;
    /// kube-proxy's `tcpEstablishedTimeout` default (the kernel conntrack setting it tunes).
    pub const TCP_NS: u64 = 24 * 3600 * NANOS_PER_SECOND;
    /// A TCP flow after a FIN or RST in either direction: Cilium's CT close timeout (10 s), one
    /// value for FIN and RST. Netfilter keeps a FIN-closed flow 120 s (its TIME_WAIT), but
    /// that only guards the translation of late retransmissions; here it would also hold the
    /// flow's SNAT port, limiting a client to 4536 / 120 s ≈ 38 new connections per second to
    /// one backend through SNAT, against ≈ 450 with 10 s. The timeout restarts with each
    /// packet, so a half-closed connection that still moves data keeps its entry.
    pub const TCP_CLOSE_NS: u64 = 10 * NANOS_PER_SECOND;
    /// A TCP flow whose client has sent nothing but its SYN (no
    /// [`ct_flags::ESTABLISHED`]): Cilium's `CT_SYN_TIMEOUT` and the kernel's
    /// `nf_conntrack_tcp_timeout_syn_recv` (60 s). A retransmitted SYN refreshes it, and a
    /// client whose handshake completes sends its ACK within one round trip.
    pub const TCP_SYN_NS: u64 = 60 * NANOS_PER_SECOND;
    /// The kernel's `nf_conntrack_udp_timeout_stream`.
    pub const UDP_NS: u64 = 120 * NANOS_PER_SECOND;
    /// The kernel's `nf_conntrack_sctp_timeout_established` (210 s, several of SCTP's default
    /// 30 s heartbeats, so an idle association keeps its entry). There is no SCTP state
    /// machine here: ABORT and SHUTDOWN COMPLETE do not end an entry early, because without
    /// tracking verification tags (as the kernel's conntrack does) a spoofed chunk could tear
    /// down the NAT of a live association.
    pub const SCTP_NS: u64 = 210 * NANOS_PER_SECOND;
    /// Reply entries carry the time of their flow's last reply (refreshed at most once a
    /// second, as forward entries); a reply entry whose forward entry is gone is an orphan only
    /// when it has been idle longer than this. Until then its flow may be alive with its
    /// forward entry evicted (the next reply rebuilds it), so neither the agent's GC nor a SNAT
    /// port probe takes it; and a reply entry written just before its forward entry (the
    /// datapath's order) is never mistaken for an orphan.
    pub const ORPHAN_REPLY_NS: u64 = TCP_CLOSE_NS;

    /// The idle timeout of a forward entry of `protocol` with `flags`.
    #[inline(always)]
    pub fn forward_ns(protocol: u8, flags: u8) -> u64 {
        match protocol {
            proto::TCP if flags & ct_flags::CLOSING != 0 => TCP_CLOSE_NS,
            proto::TCP if flags & ct_flags::ESTABLISHED == 0 => TCP_SYN_NS,
            proto::TCP => TCP_NS,
            proto::SCTP => SCTP_NS,
            _ => UDP_NS,
        }
    }

    /// Whether a forward entry last seen at `last_seen_ns` is past its idle timeout at `now`.
    #[inline(always)]
    pub fn expired(protocol: u8, flags: u8, last_seen_ns: u64, now: u64) -> bool {
        now.saturating_sub(last_seen_ns) > forward_ns(protocol, flags)
    }
}

/// Bits of [`NodeConfig::flags`].
pub mod node_flags {
    pub const CLUSTER_CIDR4: u32 = 1;
    pub const CLUSTER_CIDR6: u32 = 2;
    pub const MASQUERADE_ALL: u32 = 4;
    /// IPv4 localhost NodePorts are served on every `127.0.0.0/8` address (kube-proxy's
    /// match-all `--dst-type LOCAL` jump with `localhostNodePorts`): the socket hooks treat any
    /// loopback destination as a NodePort address. With explicit `nodePortAddresses`, loopback
    /// addresses are listed in `KPR_NODE_ADDRS` one by one instead.
    pub const LOCALHOST_NODEPORTS: u32 = 8;
    /// `--detect-local-mode BridgeInterface` / `InterfaceNamePrefix`: pod traffic is told by
    /// its interface, and pod interfaces never get the external tc program, so whatever that
    /// program sees is not local (kube-proxy's `! -i <bridge>` / `! -i <prefix>+` masquerade
    /// rule matches) and a ClusterIP reached there is masqueraded; the cluster CIDRs are unused.
    pub const LOCAL_BY_INTERFACE: u32 = 16;
    /// `--tc-fast-path`: translated external traffic is sent with `bpf_redirect_neigh` and
    /// skips the host's netfilter FORWARD and POSTROUTING (so a CNI's netfilter policy does not
    /// apply to it). Without it (the default), ingress rewrites the destination and returns
    /// the packet to the stack, and the egress program rewrites the source after POSTROUTING.
    pub const FAST_PATH: u32 = 32;
    /// The node has switched to the iptables mode, which keeps these programs only for the
    /// flows they already carry (`--mode-switch-drain-period`): the tc programs translate
    /// established flows and replies but start none, the socket hooks translate nothing new
    /// (reverse translation of existing sockets goes on), so every new connection meets the
    /// iptables rules.
    pub const DRAINING: u32 = 1 << 11;
    /// The agent has not yet adopted every flow the kernel's conntrack NATs (from its start
    /// until the adoption after its first sync, the last moment netfilter rules start flows):
    /// a TCP segment without any entry may be one of those, so the tc programs do not write a
    /// flow for it from their own choice (they still recover one whose reply entry is theirs).
    pub const KERNEL_FLOWS: u32 = 1 << 12;
    /// `--bpf-socket-lb-host-namespace-only` (Cilium's `socketLB.hostNamespaceOnly`): the
    /// socket hooks translate only sockets of the node's namespace
    /// ([`super::NodeConfig::host_netns_cookie`]); pods' sockets keep the Service address, and
    /// the tc program on the host side of their interfaces load-balances their packets
    /// (internal frontends, per packet), so a sidecar in the pod sees what the application
    /// dialled. Ignored while the cookie is unknown (0): every socket is translated then.
    pub const HOST_NAMESPACE_ONLY: u32 = 64;
    /// `--service-traffic-max-series 0`: nobody reads the per-Service packets and bytes, so the
    /// tc programs and XDP do not count them (`KPR_SERVICE_PACKETS`): a packet then costs what
    /// it did before they were counted (the benchmark's §4 compares the two).
    pub const NO_PACKET_COUNTS: u32 = 1 << 13;
    /// `--service-traffic-endpoints` (with the per-Service metrics on): each new connection is
    /// also counted for the endpoint it was given (`KPR_ENDPOINT_TRAFFIC`).
    pub const ENDPOINT_COUNTS: u32 = 1 << 14;
}

/// The slots of `KPR_TC_FAMILY`: each tc entry program (`kpr_tc_external`, `kpr_tc_reply`,
/// `kpr_tc_egress`) hands an IPv4 packet to its slot here and an IPv6 one to the next.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcFamilyProgram {
    External4 = 0,
    External6 = 1,
    Reply4 = 2,
    Reply6 = 3,
    Egress4 = 4,
    Egress6 = 5,
}

impl TcFamilyProgram {
    pub const ALL: [TcFamilyProgram; 6] = [
        TcFamilyProgram::External4,
        TcFamilyProgram::External6,
        TcFamilyProgram::Reply4,
        TcFamilyProgram::Reply6,
        TcFamilyProgram::Egress4,
        TcFamilyProgram::Egress6,
    ];

    /// The program in the slot, as `proxy-ebpf` names it.
    pub const fn program(self) -> &'static str {
        match self {
            TcFamilyProgram::External4 => "kpr_tc_external4",
            TcFamilyProgram::External6 => "kpr_tc_external6",
            TcFamilyProgram::Reply4 => "kpr_tc_reply4",
            TcFamilyProgram::Reply6 => "kpr_tc_reply6",
            TcFamilyProgram::Egress4 => "kpr_tc_egress4",
            TcFamilyProgram::Egress6 => "kpr_tc_egress6",
        }
    }

    /// Whether the slot is an IPv6 program's.
    pub const fn ipv6(self) -> bool {
        matches!(
            self,
            TcFamilyProgram::External6 | TcFamilyProgram::Reply6 | TcFamilyProgram::Egress6
        )
    }
}

/// The slots of `KPR_TC_FRAGMENT`: a family program hands a later IP fragment (no L4 header)
/// to its direction's and family's slot here. Apart from the family programs so that the
/// verifier checks the fragment path once, not along every path of theirs.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcFragmentProgram {
    Ingress4 = 0,
    Ingress6 = 1,
    Egress4 = 2,
    Egress6 = 3,
}

impl TcFragmentProgram {
    pub const ALL: [TcFragmentProgram; 4] = [
        TcFragmentProgram::Ingress4,
        TcFragmentProgram::Ingress6,
        TcFragmentProgram::Egress4,
        TcFragmentProgram::Egress6,
    ];

    /// The program in the slot, as `proxy-ebpf` names it.
    pub const fn program(self) -> &'static str {
        match self {
            TcFragmentProgram::Ingress4 => "kpr_tc_fragment_ingress4",
            TcFragmentProgram::Ingress6 => "kpr_tc_fragment_ingress6",
            TcFragmentProgram::Egress4 => "kpr_tc_fragment_egress4",
            TcFragmentProgram::Egress6 => "kpr_tc_fragment_egress6",
        }
    }

    /// Whether the slot is an IPv6 program's.
    pub const fn ipv6(self) -> bool {
        matches!(
            self,
            TcFragmentProgram::Ingress6 | TcFragmentProgram::Egress6
        )
    }

    /// The ingress or egress program of a family.
    pub const fn of(egress: bool, v6: bool) -> Self {
        match (egress, v6) {
            (false, false) => TcFragmentProgram::Ingress4,
            (false, true) => TcFragmentProgram::Ingress6,
            (true, false) => TcFragmentProgram::Egress4,
            (true, true) => TcFragmentProgram::Egress6,
        }
    }
}

/// Address family byte of [`CtKey`] (the kernel's `AF_*` values).
pub mod family {
    pub const V4: u8 = 2;
    pub const V6: u8 = 10;
}

/// Key of `KPR_FRONTENDS4`: a service address as a client dials it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Frontend4Key {
    /// IPv4 address, network byte order.
    pub addr: u32,
    /// Port, network byte order.
    pub port: u16,
    /// IP protocol number (see [`crate::proto`]).
    pub proto: u8,
    /// See [`crate::scope`].
    pub scope: u8,
}

/// Key of `KPR_FRONTENDS6`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Frontend6Key {
    /// IPv6 address as four network-order words, as in `bpf_sock_addr.user_ip6`.
    pub addr: [u32; 4],
    pub port: u16,
    pub proto: u8,
    pub scope: u8,
}

/// Value of `KPR_FRONTENDS4` and `KPR_FRONTENDS6`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct FrontendValue {
    /// Identifies this frontend's backend slots; allocated by the agent, never 0.
    pub service_id: u32,
    /// Number of backend slots in use in `generation`; 0 means "reject".
    pub backend_count: u16,
    /// Which of the two slot generations (0 or 1) is live.
    pub generation: u8,
    /// See [`crate::frontend_flags`].
    pub flags: u8,
    /// `sessionAffinity` timeout in seconds (with [`frontend_flags::AFFINITY`]).
    pub affinity_timeout: u32,
    /// Slots of the Maglev table in `generation` (with [`frontend_flags::MAGLEV`]; 0
    /// otherwise). Written in the same update as the generation switch, like the count.
    pub maglev_size: u32,
}

/// Slots per `KPR_BACKEND_SLOTS` entry. A hash-map element costs the kernel 56 bytes (header
/// and list node) beside its key and value, each rounded up to 8, so one per slot made a 4-byte
/// backend id cost 72 bytes; a block of 8 ids costs 96 for up to 8 slots, and a frontend's
/// generation is written (and read back) in `backend_count.div_ceil(8)` entries.
pub const SLOT_BLOCK_SLOTS: u32 = 8;

/// Key of `KPR_BACKEND_SLOTS`: one block of a frontend generation's slots (slots
/// `block * SLOT_BLOCK_SLOTS ..`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendSlotKey {
    pub service_id: u32,
    /// Block index in `0..backend_count.div_ceil(SLOT_BLOCK_SLOTS)`.
    pub block: u16,
    pub generation: u8,
    pub _pad: u8,
}

/// Value of `KPR_BACKEND_SLOTS`: the backend ids of one block's slots; in the last block the
/// entries past the frontend's `backend_count` are 0 and never read.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct SlotBlock {
    pub backend_ids: [u32; SLOT_BLOCK_SLOTS as usize],
}

/// Slots per `KPR_MAGLEV` entry. A hash-map element costs far more than its 4-byte value
/// (measured with fdinfo `memlock`: 160 bytes per single-slot element, so 163 KiB for a
/// 1021-slot table); blocks of 16 bring a table to 64 elements, 18 KiB (286 bytes each), and
/// the agent's writes per table from 1021 to 64.
pub const MAGLEV_BLOCK_SLOTS: u32 = 16;

/// Key of `KPR_MAGLEV`: one block of a frontend's Maglev lookup table (slots
/// `block * MAGLEV_BLOCK_SLOTS ..`). Generations work as for [`BackendSlotKey`]: the idle
/// generation's table is written in full before the frontend switches to it, and the old one
/// is deleted a grace after.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MaglevKey {
    pub service_id: u32,
    /// Block index in `0..maglev_size.div_ceil(MAGLEV_BLOCK_SLOTS)`.
    pub block: u32,
    pub generation: u8,
    pub _pad: [u8; 3],
}

/// Value of `KPR_MAGLEV`: the backend ids of one block's slots (in the last block, entries
/// past the table size repeat a valid id and are never read).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct MaglevBlock {
    pub backend_ids: [u32; MAGLEV_BLOCK_SLOTS as usize],
}

/// A value of `KPR_BACKENDS4/6`: arrays indexed by backend id (ids are dense, handed out from 1
/// by the agent), so an array of the backends' capacity costs about what its entries need,
/// where a hash map element cost six times its value. An array has every index: a removed
/// backend is written as the zero value, and readers (the programs, `inspect`, the agent's
/// drift check) take a value without a protocol for an absent backend, as a hash miss was.
pub trait BackendEntry: Copy {
    /// Whether the slot holds a backend: every backend has a protocol (TCP, UDP, SCTP), the
    /// zero value written for a removed one has none.
    fn in_use(&self) -> bool;
}

/// Value of `KPR_BACKENDS4` (indexed by a `u32` backend id allocated by the agent; see
/// [`BackendEntry`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Backend4 {
    /// IPv4 address, network byte order.
    pub addr: u32,
    /// Port, network byte order.
    pub port: u16,
    pub proto: u8,
    pub flags: u8,
}

/// Value of `KPR_BACKENDS6` (see [`BackendEntry`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Backend6 {
    pub addr: [u32; 4],
    pub port: u16,
    pub proto: u8,
    pub flags: u8,
}

impl BackendEntry for Backend4 {
    #[inline(always)]
    fn in_use(&self) -> bool {
        self.proto != 0
    }
}

impl BackendEntry for Backend6 {
    #[inline(always)]
    fn in_use(&self) -> bool {
        self.proto != 0
    }
}

/// Key of `KPR_REVNAT4`, like Cilium's `lb4_reverse_sk`: a socket and the backend it was sent
/// to. `getpeername()` and `recvmsg()` see exactly this (the socket's cookie and the backend as
/// the peer), so one lookup finds the service address to show instead.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RevNat4Key {
    pub cookie: u64,
    /// Backend address, network byte order.
    pub addr: u32,
    /// Backend port, network byte order.
    pub port: u16,
    pub _pad: u16,
}

/// Value of `KPR_REVNAT4`: the service address the application used.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct RevNat4 {
    pub addr: u32,
    pub port: u16,
    pub _pad: u16,
}

/// Key of `KPR_REVNAT6`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RevNat6Key {
    pub cookie: u64,
    pub addr: [u32; 4],
    pub port: u16,
    pub _pad: [u16; 3],
}

/// Value of `KPR_REVNAT6`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct RevNat6 {
    pub addr: [u32; 4],
    pub port: u16,
    pub _pad: u16,
}

/// Key of `KPR_AFFINITY`: a client and a frontend. For socket-level LB the client is the
/// network namespace cookie of the connecting socket (like Cilium): the connect/sendmsg hooks
/// run before the kernel picks a source address, so "client IP" is not known there, and every
/// socket of one pod shares its namespace.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AffinityKey {
    pub client: u64,
    pub service_id: u32,
    pub _pad: u32,
}

/// Value of `KPR_AFFINITY`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct AffinityValue {
    pub backend_id: u32,
    pub _pad: u32,
    /// `bpf_ktime_get_ns()` of the last connection that used this entry.
    pub last_used_ns: u64,
}

/// Value of `KPR_SERVICE_NAMES` (key: service id): the Service port a frontend's service id
/// belongs to, `namespace/name:port` in UTF-8 (at most 63 + 1 + 63 + 1 + 15 bytes). Only user
/// space reads it — `proxy-agent inspect` names what it shows without asking the agent.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServiceName {
    pub len: u16,
    /// How clients reach this frontend ([`frontend_kind`]; 0: not recorded, as agents before
    /// it wrote).
    pub kind: u8,
    /// The IP protocol number ([`crate::proto`]; 0: not recorded).
    pub proto: u8,
    pub bytes: [u8; SERVICE_NAME_MAX],
}

/// [`ServiceName::kind`]: the frontend kinds kube-proxy writes rules for.
pub mod frontend_kind {
    pub const CLUSTER_IP: u8 = 1;
    pub const NODE_PORT: u8 = 2;
    pub const LOAD_BALANCER: u8 = 3;
    pub const EXTERNAL_IP: u8 = 4;
}

/// Room for the longest `namespace/name:port`, rounded up to keep the value 4-byte aligned.
pub const SERVICE_NAME_MAX: usize = 156;

impl ServiceName {
    /// `None` when `name` does not fit (it cannot for valid Kubernetes names).
    pub fn new(name: &str, kind: u8, proto: u8) -> Option<Self> {
        let len = name.len();
        if len > SERVICE_NAME_MAX {
            return None;
        }
        let mut bytes = [0u8; SERVICE_NAME_MAX];
        bytes[..len].copy_from_slice(name.as_bytes());
        Some(Self {
            len: len as u16,
            kind,
            proto,
            bytes,
        })
    }

    /// The name, if the bytes are what [`ServiceName::new`] wrote.
    pub fn as_str(&self) -> Option<&str> {
        core::str::from_utf8(self.bytes.get(..usize::from(self.len))?).ok()
    }
}

/// Value of `KPR_SERVICE_TRAFFIC` (an array indexed by service id): what happened to the
/// connections a frontend was dialled with. One value shared by the CPUs and added to
/// atomically: a per-CPU array would cost its size once per CPU, and these counters change
/// once per connection, not per packet. The fields are in [`TrafficEvent`]'s order.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ServiceTraffic {
    pub counts: [u64; TrafficEvent::COUNT],
}

/// What a [`ServiceTraffic`] counts: the index of its count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub enum TrafficEvent {
    /// A connection (TCP, SCTP) or flow (UDP) was given a backend.
    NewConnection = 0,
    /// Refused: the Service has no endpoints (kube-proxy's REJECT).
    Rejected = 1,
    /// Dropped: the client is outside `loadBalancerSourceRanges`.
    DroppedSourceRange = 2,
    /// Dropped: every endpoint is on another node (kube-proxy's DROP for "no local endpoints").
    DroppedNoLocal = 3,
}

impl TrafficEvent {
    pub const COUNT: usize = 4;
}

/// Value of `KPR_SERVICE_PACKETS` (a per-CPU hash keyed by service id): the packets and bytes
/// (IP bytes: the frame past its Ethernet header) of the flows the tc programs (and XDP)
/// translate for a frontend, by [`TrafficDirection`]. Per CPU, as these change with every
/// packet: one shared value would bounce its cache line between the CPUs. A hash rather than
/// an array: an array costs its whole size once per CPU, and only the frontends reached through
/// tc (NodePorts, external IPs, LB IPs, a ClusterIP from outside) ever get an entry, on their
/// first flow's first packet. The socket hooks see no packets: a ClusterIP's connections from
/// the node and its pods have none.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ServicePackets {
    pub packets: [u64; TrafficDirection::COUNT],
    pub bytes: [u64; TrafficDirection::COUNT],
}

/// Key of `KPR_ENDPOINT_TRAFFIC` (value: `u64`, the new connections, added to atomically):
/// a frontend's service id and the endpoint a new connection to it was given. Written where a
/// backend is chosen (the socket hooks, tc's new flows) while [`node_flags::ENDPOINT_COUNTS`]
/// is set; a hash, as only the pairs that were used get an entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct EndpointTrafficKey {
    pub service_id: u32,
    /// The endpoint's address (IPv4: the first word), network order.
    pub addr: [u32; 4],
    /// The endpoint's port, network order.
    pub port: u16,
    /// [`family::V4`] or [`family::V6`].
    pub family: u8,
    pub _pad: u8,
}

/// The direction of a flow's packet: the index of its [`ServicePackets`] counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub enum TrafficDirection {
    /// The client's packets, to the backend (a forward conntrack entry's).
    Forward = 0,
    /// The backend's packets, back to the client (a reply entry's).
    Reply = 1,
}

impl TrafficDirection {
    pub const COUNT: usize = 2;
}

/// Key of `KPR_AFFINITY_MATCH` (value: `u8`, unused): present exactly while `backend_id` is in
/// the live backend set of `service_id`, so an affinity entry never leads to a backend that was
/// removed from the service (it may still exist for other services under the same id).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AffinityMatchKey {
    pub service_id: u32,
    pub backend_id: u32,
}

/// A packet's 5-tuple as the tc programs and the agent work with it, for both families (an
/// IPv4 address in word 0, the other words zero); the key of `KPR_CT6`. IPv4 flows are stored
/// in `KPR_CT4` as [`CtKey4`] ([`CtKey4::narrow`], [`CtKey4::widen`]). Addresses and ports in
/// network byte order.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct CtKey {
    pub src: [u32; 4],
    pub dst: [u32; 4],
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    /// See [`family`].
    pub family: u8,
    pub _pad: u16,
}

/// An IP datagram in `KPR_FRAGMENTS`: its addresses, IP ID and protocol (IPv4 in word 0 of the
/// addresses; the IPv4 ID is 16 bits, IPv6's 32), as a fragment of it carries them. The value
/// is its first fragment's ports as the L4 header holds them (network byte order, source in
/// the low half of the word as loaded). Only datagrams of Service flows are recorded: a first
/// fragment to a frontend, or of a flow in the conntrack.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct FragmentKey {
    pub src: [u32; 4],
    pub dst: [u32; 4],
    pub id: u32,
    pub proto: u8,
    /// See [`family`].
    pub family: u8,
    pub _pad: u16,
}

/// The tuple a packet matching a [`CtKey`] is rewritten to. One entry per direction, so both
/// the forward (DNAT, optionally SNAT) and the reply (reverse) translation are one lookup. The
/// value of `KPR_CT6`; IPv4 flows' is [`CtValue4`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct CtValue {
    pub src: [u32; 4],
    pub dst: [u32; 4],
    pub sport: u16,
    pub dport: u16,
    /// See [`ct_flags`].
    pub flags: u8,
    pub _pad: u8,
    /// Reply entries: the link-layer address the client's packets arrived from (the previous
    /// hop), for [`CtValue::out_ifindex`].
    pub out_mac: [u8; 6],
    /// Reply entries: the interface the client's packets arrived on, which its replies leave
    /// by where routing would send them elsewhere (a node with several uplinks); 0: routing
    /// decides (forward entries, and clients on interfaces without a link-layer header).
    pub out_ifindex: u32,
    /// `bpf_ktime_get_ns()` of the last packet (forward entries), for the idle timeout.
    pub last_seen_ns: u64,
    /// The service id of the frontend the flow was started to, whose packet and byte counters
    /// ([`ServicePackets`]) its packets add to; 0: not counted (an adopted flow of the kernel's
    /// NAT, or an entry migrated from a layout without it).
    pub service_id: u32,
    pub _pad2: u32,
    /// Where the fast path sent this entry's last translated packet; see [`NextHop`].
    pub next_hop: NextHop,
}

/// The next hop a fast-path fib lookup resolved for a conntrack entry's translated packets,
/// kept in the entry so that the flow's next packets skip the lookup. Valid while
/// `generation` is the node's route generation (the one entry of `KPR_ROUTE_GENERATION`,
/// which the agent bumps on every route, rule, neighbour and link change) and `epoch` the
/// epoch of the entry's `last_seen_ns` ([`NextHop::epoch_of`]: looked up again at least every
/// second or so of the flow's life, also while no agent runs to bump the generation);
/// `ifindex` 0: none.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct NextHop {
    pub ifindex: u32,
    /// The egress interface's MTU the lookup reported: a longer packet (not GSO) is looked
    /// up again, and answered as too big.
    pub mtu: u16,
    pub dmac: [u8; 6],
    pub smac: [u8; 6],
    pub epoch: u16,
    pub generation: u32,
}

impl NextHop {
    /// No next hop kept.
    pub const NONE: Self = Self {
        ifindex: 0,
        mtu: 0,
        dmac: [0; 6],
        smac: [0; 6],
        epoch: 0,
        generation: 0,
    };

    /// Bits of a `bpf_ktime_get_ns()` an epoch spans: 2^30 ns, about 1.07 s.
    pub const EPOCH_SHIFT: u32 = 30;

    /// Whether this next hop may still be used for an entry whose last packet was at
    /// `last_seen_ns`, under the node's route `generation` (the packet's length is the caller's
    /// to check: tc and XDP know the MTU differently).
    #[inline(always)]
    pub fn kept_under(&self, generation: u32, last_seen_ns: u64) -> bool {
        self.ifindex != 0
            && self.generation == generation
            && self.epoch == Self::epoch_of(last_seen_ns)
    }

    /// The epoch of a time in ns (wrapping; only compared for equality).
    #[inline(always)]
    #[expect(
        clippy::cast_possible_truncation,
        reason = "an epoch is compared for equality only: its low bits are enough"
    )]
    pub fn epoch_of(ns: u64) -> u16 {
        (ns >> Self::EPOCH_SHIFT) as u16
    }
}

/// Key of `KPR_CT4`: an IPv4 [`CtKey`] without the unused address words.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct CtKey4 {
    pub src: u32,
    pub dst: u32,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub _pad: [u8; 3],
}

impl CtKey4 {
    #[inline(always)]
    pub fn narrow(key: &CtKey) -> CtKey4 {
        CtKey4 {
            src: key.src[0],
            dst: key.dst[0],
            sport: key.sport,
            dport: key.dport,
            proto: key.proto,
            _pad: [0; 3],
        }
    }

    #[inline(always)]
    pub fn widen(&self) -> CtKey {
        CtKey {
            src: [self.src, 0, 0, 0],
            dst: [self.dst, 0, 0, 0],
            sport: self.sport,
            dport: self.dport,
            proto: self.proto,
            family: family::V4,
            _pad: 0,
        }
    }
}

/// Value of `KPR_CT4`: an IPv4 [`CtValue`] without the unused address words.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct CtValue4 {
    pub src: u32,
    pub dst: u32,
    pub sport: u16,
    pub dport: u16,
    pub flags: u8,
    pub _pad: u8,
    pub out_mac: [u8; 6],
    pub out_ifindex: u32,
    pub last_seen_ns: u64,
    pub service_id: u32,
    pub _pad2: u32,
    pub next_hop: NextHop,
}

impl CtValue4 {
    #[inline(always)]
    pub fn narrow(value: &CtValue) -> CtValue4 {
        CtValue4 {
            src: value.src[0],
            dst: value.dst[0],
            sport: value.sport,
            dport: value.dport,
            flags: value.flags,
            _pad: 0,
            out_mac: value.out_mac,
            out_ifindex: value.out_ifindex,
            last_seen_ns: value.last_seen_ns,
            service_id: value.service_id,
            _pad2: 0,
            next_hop: value.next_hop,
        }
    }

    #[inline(always)]
    pub fn widen(&self) -> CtValue {
        CtValue {
            src: [self.src, 0, 0, 0],
            dst: [self.dst, 0, 0, 0],
            sport: self.sport,
            dport: self.dport,
            flags: self.flags,
            _pad: 0,
            out_mac: self.out_mac,
            out_ifindex: self.out_ifindex,
            last_seen_ns: self.last_seen_ns,
            service_id: self.service_id,
            _pad2: 0,
            next_hop: self.next_hop,
        }
    }
}

/// Data of a `KPR_SOURCE_RANGES` LPM key: a frontend's service id, then the client address
/// (IPv4 in word 0). The prefix length counts the 32 service-id bits plus the range's prefix.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SourceRangeKey {
    pub service_id: u32,
    pub addr: [u32; 4],
}

/// Key of `KPR_NODE_ADDRS` (value `u8`, unused): an address of this node that accepts
/// NodePorts (`nodePortAddresses`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeAddrKey {
    pub addr: [u32; 4],
    pub family: u8,
    pub _pad: [u8; 3],
}

/// Value of `KPR_SNAT_IFACES` (key: an external interface's ifindex, `u32`): the addresses a
/// flow is source-NATed to when the route to its backend leaves by that interface, as
/// MASQUERADE takes the outgoing interface's address (0: none of that family there, the
/// `NodeConfig` address applies).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SnatAddrs {
    pub snat6: [u32; 4],
    pub snat4: u32,
    /// The interface's link-layer address (all-zero on interfaces without one): the source
    /// of replies sent out by it directly (`CtValue::out_ifindex`).
    pub mac: [u8; 6],
    pub _pad: [u8; 2],
}

/// Words of each half of a [`PortFilter`]: one bit per port.
pub const PORT_FILTER_WORDS: usize = 1024;

/// The single entry of `KPR_PORT_FILTER`: which TCP, UDP and SCTP ports a packet must have for
/// the tc ingress programs to look at it, so that most of a node's traffic (pod to pod, the
/// node's own connections) is passed on after one array lookup, before any hash lookup or tail
/// call. A packet is looked at when its destination port is a frontend's (a new flow, a
/// client's packet of an established one) or its source port a backend's (a backend's reply),
/// or its destination port is in the SNAT range (a remote backend's reply to the SNAT address).
/// Bits are only added while Services change; the agent clears a port once neither a frontend,
/// a backend nor a conntrack entry has used it for two garbage collection rounds, so an
/// established flow keeps its translation after its Service is gone, as netfilter's conntrack
/// keeps it for kube-proxy.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortFilter {
    /// Nonzero once the agent wrote the ports of everything it programmed: until then (a map
    /// created by an upgrade, before the new agent's first sync) every packet is looked at.
    pub armed: u64,
    /// Bit `p`: `p` is a frontend's port (host order).
    pub destination: [u64; PORT_FILTER_WORDS],
    /// Bit `p`: `p` is a backend's port (host order).
    pub source: [u64; PORT_FILTER_WORDS],
}

impl PortFilter {
    pub const EMPTY: Self = Self {
        armed: 0,
        destination: [0; PORT_FILTER_WORDS],
        source: [0; PORT_FILTER_WORDS],
    };

    /// Whether the programs must look at a packet with these ports (host order), by the bits
    /// alone (the SNAT range is the program's own test).
    #[inline(always)]
    pub fn wants(&self, source: u16, destination: u16) -> bool {
        self.armed == 0 || bit(&self.destination, destination) || bit(&self.source, source)
    }

    pub fn set_destination(&mut self, port: u16) -> bool {
        set(&mut self.destination, port)
    }

    pub fn set_source(&mut self, port: u16) -> bool {
        set(&mut self.source, port)
    }

    pub fn has_destination(&self, port: u16) -> bool {
        bit(&self.destination, port)
    }

    pub fn has_source(&self, port: u16) -> bool {
        bit(&self.source, port)
    }
}

/// The word (in either half) of a [`PortFilter`] that holds `port`'s bit, and the bit.
#[inline(always)]
pub fn port_bit(port: u16) -> (usize, u64) {
    // `port >> 6` is below 1024: no bounds check is left in the program.
    (usize::from(port >> 6), 1 << (port & 63))
}

#[inline(always)]
fn bit(words: &[u64; PORT_FILTER_WORDS], port: u16) -> bool {
    let (index, mask) = port_bit(port);
    words[index] & mask != 0
}

/// Sets the port's bit; whether it was clear.
fn set(words: &mut [u64; PORT_FILTER_WORDS], port: u16) -> bool {
    let (index, mask) = port_bit(port);
    let word = &mut words[index];
    let was_clear = *word & mask == 0;
    *word |= mask;
    was_clear
}

/// The single entry of `KPR_NODE_CONFIG`: node facts the tc programs need.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct NodeConfig {
    /// The address external flows are source-NATed to (0: none, flows are not SNATed).
    pub snat4: u32,
    /// `clusterCIDR` (IPv4) address and mask, with [`node_flags::CLUSTER_CIDR4`].
    pub cluster4: u32,
    pub cluster4_mask: u32,
    /// See [`node_flags`].
    pub flags: u32,
    pub snat6: [u32; 4],
    pub cluster6: [u32; 4],
    pub cluster6_mask: [u32; 4],
    /// The network namespace cookie of the node's own namespace (the agent's): the socket
    /// hooks tell host processes from pods by it, for LB IPs guarded by source ranges.
    pub host_netns_cookie: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[test]
    fn the_port_filter_wants_every_packet_until_armed_then_its_ports_only() {
        let mut filter = PortFilter::EMPTY;
        assert!(filter.wants(40_000, 22), "unarmed");
        filter.armed = 1;
        assert!(!filter.wants(40_000, 22));
        assert!(filter.set_destination(30_080));
        assert!(!filter.set_destination(30_080), "set already");
        assert!(filter.set_source(8_080));
        assert!(filter.wants(40_000, 30_080), "to a frontend");
        assert!(filter.wants(8_080, 40_000), "from a backend");
        assert!(!filter.wants(30_080, 8_080), "each port in its own half");
        for port in [0, 63, 64, 65_535] {
            filter.set_destination(port);
            assert!(
                filter.has_destination(port) && !filter.has_source(port),
                "{port}"
            );
        }
    }

    #[test]
    fn layouts_have_no_implicit_padding() {
        assert_eq!(size_of::<Frontend4Key>(), 8);
        assert_eq!(size_of::<Frontend6Key>(), 20);
        assert_eq!(size_of::<FrontendValue>(), 16);
        assert_eq!(size_of::<BackendSlotKey>(), 8);
        assert_eq!(size_of::<SlotBlock>(), 32);
        assert_eq!(size_of::<MaglevKey>(), 12);
        assert_eq!(size_of::<MaglevBlock>(), 64);
        assert_eq!(size_of::<Backend4>(), 8);
        assert_eq!(size_of::<Backend6>(), 20);
        assert_eq!(size_of::<RevNat4Key>(), 16);
        assert_eq!(size_of::<RevNat4>(), 8);
        assert_eq!(size_of::<RevNat6Key>(), 32);
        assert_eq!(size_of::<RevNat6>(), 20);
        assert_eq!(size_of::<AffinityKey>(), 16);
        assert_eq!(size_of::<AffinityValue>(), 16);
        assert_eq!(size_of::<AffinityMatchKey>(), 8);
        assert_eq!(size_of::<CtKey>(), 40);
        assert_eq!(size_of::<CtValue>(), 88);
        assert_eq!(size_of::<CtKey4>(), 16);
        assert_eq!(size_of::<CtValue4>(), 64);
        assert_eq!(size_of::<NextHop>(), 24);
        assert_eq!(size_of::<ServicePackets>(), 32);
        assert_eq!(size_of::<EndpointTrafficKey>(), 24);
        assert_eq!(size_of::<SourceRangeKey>(), 20);
        assert_eq!(size_of::<NodeAddrKey>(), 20);
        assert_eq!(size_of::<NodeConfig>(), 72);
        assert_eq!(size_of::<PortFilter>(), 8 + 2 * 8 * PORT_FILTER_WORDS);
        assert_eq!(size_of::<SnatAddrs>(), 28);
    }
}
