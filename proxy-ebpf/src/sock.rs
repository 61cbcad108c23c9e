//! Socket-level load balancing: cgroup sock_addr hooks.
//!
//! - `connect4/6` (TCP and connected UDP): the destination is rewritten once per socket, so
//!   established traffic flows to the backend with no per-packet work at all.
//! - `sendmsg4/6` (unconnected UDP): the same translation, per datagram.
//! - `recvmsg4/6` (unconnected UDP): replies from the backend are shown as coming from the
//!   service address, so a DNS-style client accepts them.
//! - `getpeername4/6`: the application sees the service address it dialled.
//! - IPv4-mapped IPv6 destinations (`::ffff:a.b.c.d`, AF_INET6 sockets of Java/.NET) are
//!   translated as the IPv4 frontend by the `6` hooks.
//!
//! The reverse maps are keyed like Cilium's `lb{4,6}_reverse_sk`: (socket cookie, backend
//! address, backend port). That is exactly what recvmsg (the datagram's source) and getpeername
//! (the connected peer) see, and it lets the agent find the sockets translated to a backend.

use aya_ebpf::{
    EbpfContext as _,
    bindings::bpf_sock_addr,
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_set_retval},
    maps::lpm_trie::Key,
    programs::SockAddrContext,
};
use proxy_common::{
    FrontendValue, StatIndex, TrafficEvent, frontend_flags,
    ip_family::{self, IpFamily as _},
    lookup::{self, Admit, Matched},
};

use crate::{
    lb::{Decision, select_backend},
    maps::{Destination, FamilyMaps, KPR_NODE_CONFIG, KPR_REVNAT6, KPR_SOURCE_RANGES},
    nat::draining,
    stats::bump,
    traffic,
};

/// Let the syscall proceed (with whatever address the program left in the context). recvmsg
/// and getpeername programs must always return this (the verifier enforces it).
const ALLOW: i32 = 1;
/// Fail the syscall with the error set by `bpf_set_retval` (EPERM if none was set).
const DENY: i32 = 0;
const ECONNREFUSED: i32 = 111;
const EHOSTUNREACH: i32 = 113;

/// Which hook is translating, for the counters.
#[derive(Clone, Copy)]
pub enum Hook {
    Connect,
    Sendmsg,
}

impl Hook {
    /// Whether the choice is remembered per socket: an unconnected UDP socket's datagrams
    /// each pass `sendmsg`; a connected socket is translated once anyway.
    fn per_socket(self) -> bool {
        matches!(self, Hook::Sendmsg)
    }

    fn translated(self) -> StatIndex {
        match self {
            Hook::Connect => StatIndex::Translated,
            Hook::Sendmsg => StatIndex::SendmsgTranslated,
        }
    }
    fn rejected(self) -> StatIndex {
        match self {
            Hook::Connect => StatIndex::RejectedNoBackends,
            Hook::Sendmsg => StatIndex::SendmsgRejectedNoBackends,
        }
    }
}

#[inline(always)]
fn socket_cookie(ctx: &SockAddrContext) -> u64 {
    // SAFETY: sock_addr programs may ask for the cookie of the socket they run for.
    unsafe { bpf_get_socket_cookie(ctx.as_ptr()) }
}

/// The client identity for session affinity: the socket's network namespace (see
/// `proxy_common::AffinityKey` for why not the source address).
#[inline(always)]
fn netns_cookie(ctx: &SockAddrContext) -> u64 {
    // SAFETY: bpf_get_netns_cookie accepts the sock_addr context (kernel ≥ 5.7).
    unsafe { bpf_get_netns_cookie(ctx.as_ptr()) }
}

/// The port as the hooks store it: network byte order in the low 16 bits of `user_port`.
#[inline(always)]
fn user_port(sa: &bpf_sock_addr) -> u16 {
    sa.user_port as u16
}

/// `user_ip6` word by word: the kernel only accepts 4-byte loads and stores of these context
/// fields, and volatile accesses stop LLVM from merging two of them into one 8-byte access,
/// which the verifier would reject.
#[inline(always)]
fn read_ip6(sa: &bpf_sock_addr) -> [u32; 4] {
    let p = &sa.user_ip6;
    // SAFETY: the pointers come from a valid reference to the context.
    unsafe {
        [
            core::ptr::read_volatile(&p[0]),
            core::ptr::read_volatile(&p[1]),
            core::ptr::read_volatile(&p[2]),
            core::ptr::read_volatile(&p[3]),
        ]
    }
}

#[inline(always)]
fn write_ip6(sa: &mut bpf_sock_addr, addr: [u32; 4]) {
    let p = &mut sa.user_ip6;
    // SAFETY: as in read_ip6.
    unsafe {
        core::ptr::write_volatile(&mut p[0], addr[0]);
        core::ptr::write_volatile(&mut p[1], addr[1]);
        core::ptr::write_volatile(&mut p[2], addr[2]);
        core::ptr::write_volatile(&mut p[3], addr[3]);
    }
}

/// The protocol as a frontend key byte; `None` for anything that cannot be a Service protocol.
#[inline(always)]
fn protocol(sa: &bpf_sock_addr) -> Option<u8> {
    u8::try_from(sa.protocol).ok()
}

/// The address family's view of the hook's destination in `bpf_sock_addr`.
trait SockFamily: FamilyMaps {
    fn read_dst(sa: &bpf_sock_addr) -> [u32; 4];
    fn write_dst(sa: &mut bpf_sock_addr, addr: &[u32; 4]);
}

impl SockFamily for ip_family::V4 {
    #[inline(always)]
    fn read_dst(sa: &bpf_sock_addr) -> [u32; 4] {
        [sa.user_ip4, 0, 0, 0]
    }
    #[inline(always)]
    fn write_dst(sa: &mut bpf_sock_addr, addr: &[u32; 4]) {
        sa.user_ip4 = addr[0];
    }
}

impl SockFamily for ip_family::V6 {
    #[inline(always)]
    fn read_dst(sa: &bpf_sock_addr) -> [u32; 4] {
        read_ip6(sa)
    }
    #[inline(always)]
    fn write_dst(sa: &mut bpf_sock_addr, addr: &[u32; 4]) {
        write_ip6(sa, *addr);
    }
}

pub fn translate4(ctx: &SockAddrContext, hook: Hook) -> i32 {
    translate::<ip_family::V4>(ctx, hook)
}

pub fn translate6(ctx: &SockAddrContext, hook: Hook) -> i32 {
    translate::<ip_family::V6>(ctx, hook)
}

#[inline(always)]
fn translate<F: SockFamily>(ctx: &SockAddrContext, hook: Hook) -> i32 {
    // Draining for the iptables mode: new connections are its rules' (`node_flags::DRAINING`).
    if draining() {
        return ALLOW;
    }
    // SAFETY: the kernel passes a valid bpf_sock_addr; the verifier checks each field access.
    let sa = unsafe { &mut *ctx.sock_addr };
    let Some(proto) = protocol(sa) else {
        return ALLOW;
    };
    let dst = F::read_dst(sa);
    if F::V6
        && let Some(v4) = ipv4_mapped(dst)
    {
        return translate_mapped(ctx, sa, v4, proto, hook);
    }
    let port = user_port(sa);
    let (backend, kept) = match choose::<F>(ctx, &dst, port, proto, hook) {
        Ok(chosen) => chosen,
        Err(verdict) => return verdict,
    };
    let (addr, backend_port) = F::backend_addr(&backend);
    // Best effort: without the entry getpeername/recvmsg show the backend address. A socket
    // that keeps its backend has its entry already: no map write per datagram.
    if !kept {
        let revnat_key = F::revnat_key(socket_cookie(ctx), &addr, backend_port);
        let revnat = F::revnat(&dst, port);
        if F::revnat_map().insert(revnat_key, revnat, 0).is_err() {
            bump(StatIndex::RevNatUpdateFailed);
        }
    }
    F::write_dst(sa, &addr);
    sa.user_port = u32::from(backend_port);
    bump(hook.translated());
    ALLOW
}

/// The frontend for the destination (`proxy_common::lookup::socket_frontend`: exact, else a
/// NodePort) and the backend for this socket, or the verdict when there is none to translate
/// to. The agent deletes a switched-out generation's slots a grace (1 s) after the switch, so
/// a connect that read the frontend just before it still finds its slot; should the slot be
/// gone all the same (the hook held up longer, slots deleted behind the agent's back), it
/// reads the frontend once more and chooses from the live generation, whose slots were all
/// written before its switch, instead of refusing a Service that has backends.
#[inline(always)]
fn choose<F: SockFamily>(
    ctx: &SockAddrContext,
    dst: &[u32; 4],
    port: u16,
    proto: u8,
    hook: Hook,
) -> Result<(F::Backend, bool), i32> {
    let mut frontend = find_frontend::<F>(dst, port, proto).ok_or(ALLOW)?;
    if left_to_tc(ctx) {
        return Err(ALLOW);
    }
    let socket = hook.per_socket().then(|| socket_cookie(ctx));
    if let Some(verdict) = admit(ctx, &frontend, F::V6) {
        return Err(verdict);
    }
    let mut decision = select_backend(
        &frontend,
        || netns_cookie(ctx),
        || None,
        socket,
        F::backend_map(),
    );
    if matches!(decision, Decision::BackendMissing)
        && let Some(again) = find_frontend::<F>(dst, port, proto)
        && again.generation != frontend.generation
    {
        frontend = again;
        decision = select_backend(
            &frontend,
            || netns_cookie(ctx),
            || None,
            socket,
            F::backend_map(),
        );
    }
    match decision {
        Decision::NoBackends => Err(no_backends(&frontend, hook)),
        Decision::BackendMissing => Err(backend_missing(ctx)),
        Decision::Backend(backend, _) => {
            traffic::count(frontend.service_id, TrafficEvent::NewConnection);
            let (addr, port) = F::backend_addr(&backend);
            traffic::count_endpoint(frontend.service_id, &addr, port, F::V6);
            Ok((backend, false))
        }
        Decision::Kept(backend) => Ok((backend, true)),
    }
}

/// The socket hooks' frontend for the destination, counting NodePort matches.
#[inline(always)]
fn find_frontend<F: SockFamily>(dst: &[u32; 4], port: u16, proto: u8) -> Option<FrontendValue> {
    let mut maps = Destination::<F>::new(dst, port, proto);
    let found = lookup::socket_frontend(&mut maps, dst, F::V6)?;
    if found.matched != Matched::Exact {
        bump(StatIndex::SockNodePort);
    }
    Some(found.frontend)
}

/// `::ffff:a.b.c.d` (network order words: 0, 0, 0x0000ffff, addr): the IPv4 address an
/// AF_INET6 socket dials this way. Java and .NET open dual-stack AF_INET6 sockets by default,
/// so their connections to IPv4 Services arrive at connect6/sendmsg6 in this form.
#[inline(always)]
fn ipv4_mapped(addr: [u32; 4]) -> Option<u32> {
    (addr[0] == 0 && addr[1] == 0 && addr[2] == u32::from_be(0x0000_ffff)).then_some(addr[3])
}

/// An IPv4-mapped destination of an AF_INET6 socket: translated as the IPv4 frontend (the
/// kernel sends IPv4 packets for it, so kube-proxy's IPv4 rules see it the same way), the
/// backend written back mapped, the reverse entry keyed by the mapped backend (which is what
/// recvmsg6/getpeername6 of that socket will show).
#[inline(always)]
fn translate_mapped(
    ctx: &SockAddrContext,
    sa: &mut bpf_sock_addr,
    addr: u32,
    proto: u8,
    hook: Hook,
) -> i32 {
    let port = user_port(sa);
    let (backend, kept) = match choose::<ip_family::V4>(ctx, &[addr, 0, 0, 0], port, proto, hook) {
        Ok(chosen) => chosen,
        Err(verdict) => return verdict,
    };
    let mapped = |a: u32| [0, 0, u32::from_be(0x0000_ffff), a];
    if !kept {
        let revnat_key =
            ip_family::V6::revnat_key(socket_cookie(ctx), &mapped(backend.addr), backend.port);
        let revnat = ip_family::V6::revnat(&mapped(addr), port);
        if KPR_REVNAT6.insert(revnat_key, revnat, 0).is_err() {
            bump(StatIndex::RevNatUpdateFailed);
        }
    }
    write_ip6(sa, mapped(backend.addr));
    sa.user_port = u32::from(backend.port);
    bump(hook.translated());
    ALLOW
}

/// `--bpf-socket-lb-host-namespace-only` (`proxy_common::lookup::left_to_tc`): a socket outside
/// the node's namespace keeps the address it dialled, so that a sidecar capturing by Service
/// address (iptables REDIRECT in the pod) still sees it; the tc program on the pod's interface
/// load-balances its packets instead. A socket left alone gets no reverse-NAT entry, so
/// recvmsg/getpeername (keyed by socket cookie) leave it alone too, while a pod socket
/// translated before the option was switched on keeps showing the Service address. Checked
/// after the frontend lookup, so that the counter says how much the option moved to tc.
#[inline(always)]
fn left_to_tc(ctx: &SockAddrContext) -> bool {
    let left = lookup::left_to_tc(KPR_NODE_CONFIG.get(0), |config| {
        netns_cookie(ctx) == config.host_netns_cookie
    });
    if left {
        bump(StatIndex::SockLeftToTc);
    }
    left
}

/// `loadBalancerSourceRanges` for local sockets (`proxy_common::lookup::socket_admit`):
/// `None` lets the translation go on. A pod's socket is left untranslated (`ALLOW`): its
/// packets reach the tc program on the pod's veth, which checks the pod's address. A host
/// socket outside the ranges fails with `EHOSTUNREACH` where kube-proxy drops (a socket hook
/// has no packet to drop).
#[inline(always)]
fn admit(ctx: &SockAddrContext, frontend: &FrontendValue, v6: bool) -> Option<i32> {
    let admit = lookup::socket_admit(
        frontend,
        KPR_NODE_CONFIG.get(0),
        |config| netns_cookie(ctx) == config.host_netns_cookie,
        v6,
        |prefix, key| {
            let key = Key::new(prefix, *key);
            KPR_SOURCE_RANGES.get(&key).is_some()
        },
    );
    match admit {
        Admit::Translate => None,
        Admit::Leave => Some(ALLOW),
        Admit::Refuse => {
            bump(StatIndex::SockDroppedSourceRange);
            traffic::count(frontend.service_id, TrafficEvent::DroppedSourceRange);
            Some(unreachable())
        }
    }
}

/// A frontend without backends: kube-proxy REJECTs when the service has no endpoints at all
/// (ECONNREFUSED) and DROPs when its endpoints are all on other nodes
/// ([`frontend_flags::DROP_NO_BACKENDS`], `internalTrafficPolicy: Local`).
#[inline(always)]
fn no_backends(frontend: &FrontendValue, hook: Hook) -> i32 {
    if frontend.flags & frontend_flags::DROP_NO_BACKENDS != 0 {
        bump(StatIndex::SockDroppedNoLocal);
        traffic::count(frontend.service_id, TrafficEvent::DroppedNoLocal);
        return unreachable();
    }
    bump(hook.rejected());
    traffic::count(frontend.service_id, TrafficEvent::Rejected);
    refuse()
}

/// Where kube-proxy drops a packet the socket hook fails the syscall with `EHOSTUNREACH` at
/// once: there is no packet yet to drop, and a client that would time out learns the same a
/// few minutes earlier.
fn unreachable() -> i32 {
    set_retval(-EHOSTUNREACH);
    DENY
}

/// 0 when the agent found no `bpf_set_retval` for sock_addr hooks (kernel < 5.18) or was told
/// not to use it (`--bpf-disable-feature set-retval`): refused syscalls then fail with EPERM.
/// The loader sets it before loading; as a frozen read-only global the verifier knows its value
/// and never visits the call on such kernels (it would reject an unknown helper).
#[unsafe(no_mangle)]
static KPR_USE_SET_RETVAL: u8 = 1;

fn set_retval(error: i32) {
    // SAFETY: a read of a plain global the loader initialised.
    if unsafe { core::ptr::read_volatile(&raw const KPR_USE_SET_RETVAL) } != 0 {
        // SAFETY: bpf_set_retval is available to connect and sendmsg hooks (kernel ≥ 5.18).
        unsafe { bpf_set_retval(error) };
    }
}

fn backend_missing(ctx: &SockAddrContext) -> i32 {
    bump(StatIndex::BackendMissing);
    // Should never happen with the agent's update protocol, so it is worth a log line.
    aya_log_ebpf::warn!(ctx, "frontend without its backend slot; refused");
    refuse()
}

/// kube-proxy REJECTs traffic to services without endpoints, so clients see "connection
/// refused" at once instead of a timeout. Returning DENY alone would give EPERM. Both connect
/// and UDP sendmsg return this error from the syscall (udp_sendmsg passes the hook's error up).
fn refuse() -> i32 {
    set_retval(-ECONNREFUSED);
    DENY
}

/// recvmsg (the datagram's source) and getpeername (the connected peer): backend → service.
pub fn reverse4(ctx: &SockAddrContext, stat: StatIndex) -> i32 {
    reverse::<ip_family::V4>(ctx, stat)
}

pub fn reverse6(ctx: &SockAddrContext, stat: StatIndex) -> i32 {
    reverse::<ip_family::V6>(ctx, stat)
}

#[inline(always)]
fn reverse<F: SockFamily>(ctx: &SockAddrContext, stat: StatIndex) -> i32 {
    // SAFETY: the kernel passes a valid bpf_sock_addr; the verifier checks each field access.
    let sa = unsafe { &mut *ctx.sock_addr };
    let key = F::revnat_key(socket_cookie(ctx), &F::read_dst(sa), user_port(sa));
    // SAFETY: the value is copied out at once.
    if let Some(revnat) = (unsafe { F::revnat_map().get(key) }).copied() {
        let (addr, port) = F::revnat_addr(&revnat);
        F::write_dst(sa, &addr);
        sa.user_port = u32::from(port);
        bump(stat);
    }
    ALLOW
}
