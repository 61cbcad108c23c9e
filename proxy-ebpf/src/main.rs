//! eBPF programs of kubeproxy-rs. Entry points are thin; the logic lives in one module per
//! concern (maps, service lookup and backend selection, counters, socket hooks; for tc: packet
//! parsing, conntrack, NAT, checksums, SCTP's CRC32c, ICMP replies, ICMP errors of translated
//! flows, IP fragments).
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]
// The BPF target's `core` atomics lack read-modify-write operations; the intrinsic has them
// (the eBPF object is built with the pinned nightly anyway, for `build-std`).
#![cfg_attr(target_arch = "bpf", feature(core_intrinsics))]
#![cfg_attr(
    target_arch = "bpf",
    expect(internal_features, reason = "atomic_xadd, see traffic.rs")
)]

// The programs only make sense for the BPF target; on the host this crate is an empty binary so
// `cargo check/clippy --workspace` keep working.
#[cfg(target_arch = "bpf")]
mod clock;
#[cfg(target_arch = "bpf")]
mod conntrack;
#[cfg(target_arch = "bpf")]
mod csum;
#[cfg(target_arch = "bpf")]
mod fragments;
#[cfg(target_arch = "bpf")]
mod icmp;
#[cfg(target_arch = "bpf")]
mod icmp_error;
#[cfg(target_arch = "bpf")]
mod lb;
#[cfg(target_arch = "bpf")]
mod maps;
#[cfg(target_arch = "bpf")]
mod nat;
#[cfg(target_arch = "bpf")]
mod packet;
#[cfg(target_arch = "bpf")]
mod parse;
#[cfg(target_arch = "bpf")]
mod port_filter;
#[cfg(target_arch = "bpf")]
mod sctp;
#[cfg(target_arch = "bpf")]
mod sock;
#[cfg(target_arch = "bpf")]
mod stats;
#[cfg(target_arch = "bpf")]
mod tc;
#[cfg(target_arch = "bpf")]
mod traffic;
#[cfg(target_arch = "bpf")]
mod xdp;

#[cfg(target_arch = "bpf")]
mod programs {
    use aya_ebpf::{
        macros::{cgroup_sock_addr, classifier, xdp},
        programs::{SockAddrContext, TcContext, XdpContext},
    };
    use proxy_common::{StatIndex, TcFamilyProgram};

    use crate::sock::{Hook, reverse4, reverse6, translate4, translate6};

    /// `connect()` of TCP and UDP sockets in the attached cgroup: service address → backend.
    #[cgroup_sock_addr(connect4)]
    pub fn kpr_connect4(ctx: SockAddrContext) -> i32 {
        translate4(&ctx, Hook::Connect)
    }

    #[cgroup_sock_addr(connect6)]
    pub fn kpr_connect6(ctx: SockAddrContext) -> i32 {
        translate6(&ctx, Hook::Connect)
    }

    /// Unconnected UDP `sendmsg()`/`sendto()`: service address → backend, per datagram.
    #[cgroup_sock_addr(sendmsg4)]
    pub fn kpr_sendmsg4(ctx: SockAddrContext) -> i32 {
        translate4(&ctx, Hook::Sendmsg)
    }

    #[cgroup_sock_addr(sendmsg6)]
    pub fn kpr_sendmsg6(ctx: SockAddrContext) -> i32 {
        translate6(&ctx, Hook::Sendmsg)
    }

    /// UDP `recvmsg()`/`recvfrom()`: a reply from the backend appears to come from the service.
    #[cgroup_sock_addr(recvmsg4)]
    pub fn kpr_recvmsg4(ctx: SockAddrContext) -> i32 {
        reverse4(&ctx, StatIndex::RecvmsgRewritten)
    }

    #[cgroup_sock_addr(recvmsg6)]
    pub fn kpr_recvmsg6(ctx: SockAddrContext) -> i32 {
        reverse6(&ctx, StatIndex::RecvmsgRewritten)
    }

    /// `getpeername()`: show the service address the application dialled, not the backend.
    #[cgroup_sock_addr(getpeername4)]
    pub fn kpr_getpeername4(ctx: SockAddrContext) -> i32 {
        reverse4(&ctx, StatIndex::PeerNameRewritten)
    }

    #[cgroup_sock_addr(getpeername6)]
    pub fn kpr_getpeername6(ctx: SockAddrContext) -> i32 {
        reverse6(&ctx, StatIndex::PeerNameRewritten)
    }

    /// tc ingress of the node's external interfaces: NodePort, externalIPs, LoadBalancer IPs
    /// and ClusterIPs from outside; replies of remote backends. Hands the packet to the
    /// program of its family (`tc::family`).
    #[classifier]
    pub fn kpr_tc_external(ctx: TcContext) -> i32 {
        crate::tc::family(&ctx, TcFamilyProgram::External4)
    }

    /// tc ingress of the other interfaces (pod veths): replies of local backends; pods' flows to
    /// guarded LB IPs, and with host-namespace-only socket LB to every Service.
    #[classifier]
    pub fn kpr_tc_reply(ctx: TcContext) -> i32 {
        crate::tc::family(&ctx, TcFamilyProgram::Reply4)
    }

    /// tc egress of every interface with one of the above (netfilter path): the source half
    /// of a translation (SNAT, or the frontend address on a reply), after the host's
    /// FORWARD and POSTROUTING; on either path, the frontend address on the replies of
    /// host-network backends on this node.
    #[classifier]
    pub fn kpr_tc_egress(ctx: TcContext) -> i32 {
        crate::tc::family(&ctx, TcFamilyProgram::Egress4)
    }

    /// XDP on the node's external interfaces (`--bpf-xdp`): fast-path flows translated and
    /// redirected in the driver (a new flow's first packet by `kpr_xdp_new_flow4/6`);
    /// everything else passes on to `kpr_tc_external`.
    ///
    /// All three are multi-buffer programs (`xdp.frags`, `BPF_F_XDP_HAS_FRAGS`): a driver
    /// refuses a single-buffer program on an interface whose MTU does not fit one page (veth
    /// above about 3.5 kB, NICs with jumbo frames), and a frame larger than a page then
    /// arrives in several buffers, of which direct packet access sees the first (see
    /// `xdp.rs`). The tail-called two must be frags too: the kernel refuses a program in a
    /// program array whose owner differs in frags-ness, at load (`bpf_check_tail_call`) and
    /// at update.
    #[xdp(frags)]
    pub fn kpr_xdp_external(ctx: XdpContext) -> u32 {
        crate::xdp::external(&ctx)
    }

    /// XDP: the first packet of a new external flow (`xdp::first_packet`), tail-called by
    /// `kpr_xdp_external` per family.
    #[xdp(frags)]
    pub fn kpr_xdp_new_flow4(ctx: XdpContext) -> u32 {
        crate::xdp::first_packet::<false>(&ctx)
    }

    #[xdp(frags)]
    pub fn kpr_xdp_new_flow6(ctx: XdpContext) -> u32 {
        crate::xdp::first_packet::<true>(&ctx)
    }

    /// Stands in for the IPv6 programs in `KPR_TC_FAMILY` until the node has an IPv6 Service
    /// (`program_names::TC_IDLE`): the agent loads those only then, which spares the verifier
    /// nearly half of its work on an IPv4-only cluster.
    #[classifier]
    pub fn kpr_tc_idle(_ctx: TcContext) -> i32 {
        crate::tc::NEXT
    }

    /// The same for the IPv6 slot of `KPR_XDP_NEW_FLOW_FRAGS`: on to tc, which passes it on.
    #[xdp(frags)]
    pub fn kpr_xdp_idle(_ctx: XdpContext) -> u32 {
        aya_ebpf::bindings::xdp_action::XDP_PASS
    }

    // The programs of one family each, reached by tail call from the three above: each is
    // verified with its family's conntrack code only (see `tc::family`).

    #[classifier]
    pub fn kpr_tc_external4(ctx: TcContext) -> i32 {
        crate::tc::external::<false>(&ctx)
    }

    #[classifier]
    pub fn kpr_tc_external6(ctx: TcContext) -> i32 {
        crate::tc::external::<true>(&ctx)
    }

    #[classifier]
    pub fn kpr_tc_reply4(ctx: TcContext) -> i32 {
        crate::tc::reply::<false>(&ctx)
    }

    #[classifier]
    pub fn kpr_tc_reply6(ctx: TcContext) -> i32 {
        crate::tc::reply::<true>(&ctx)
    }

    #[classifier]
    pub fn kpr_tc_egress4(ctx: TcContext) -> i32 {
        crate::tc::egress::<false>(&ctx)
    }

    #[classifier]
    pub fn kpr_tc_egress6(ctx: TcContext) -> i32 {
        crate::tc::egress::<true>(&ctx)
    }

    // The programs of later IP fragments, reached by tail call from the family programs
    // (`fragments`): verified once, not along every path of those.

    #[classifier]
    pub fn kpr_tc_fragment_ingress4(ctx: TcContext) -> i32 {
        crate::tc::fragment_ingress::<false>(&ctx)
    }

    #[classifier]
    pub fn kpr_tc_fragment_ingress6(ctx: TcContext) -> i32 {
        crate::tc::fragment_ingress::<true>(&ctx)
    }

    #[classifier]
    pub fn kpr_tc_fragment_egress4(ctx: TcContext) -> i32 {
        crate::tc::fragment_egress::<false>(&ctx)
    }

    #[classifier]
    pub fn kpr_tc_fragment_egress6(ctx: TcContext) -> i32 {
        crate::tc::fragment_egress::<true>(&ctx)
    }
}

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any program that could reach this; it exists only to link.
    loop {}
}

// The kernel reads this string, not Cargo.toml: only a GPL-compatible one ("Dual MIT/GPL" is on
// its list, Apache-2.0 is not) unlocks GPL-only helpers and kfuncs (e.g. the conntrack and
// socket-destroy kfuncs), so the eBPF crate is licensed "MIT OR GPL-2.0-only", as aya's
// templates do, while the user-space crates are Apache-2.0.
#[cfg(target_arch = "bpf")]
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

#[cfg(not(target_arch = "bpf"))]
fn main() {}
