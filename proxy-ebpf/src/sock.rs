//! Socket-level load balancing: cgroup sock_addr hooks.
//!
//! - `connect4/6` (TCP and connected UDP): the destination is rewritten once per socket, so
//!   established traffic flows to the backend with no per-packet work at all.
//! - `sendmsg4/6` (unconnected UDP): the same translation, per datagram.
//! - `recvmsg4/6` (unconnected UDP): replies from the backend are shown as coming from the
//!   service address, so a DNS-style client accepts them.
//! - `getpeername4/6`: the application sees the service address it dialled.
//!
//! The reverse maps are keyed like Cilium's `lb{4,6}_reverse_sk`: (socket cookie, backend
//! address, backend port). That is exactly what recvmsg (the datagram's source) and getpeername
//! (the connected peer) see, and it lets the agent find the sockets translated to a backend.

use aya_ebpf::{
    EbpfContext as _,
    bindings::bpf_sock_addr,
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_set_retval},
    programs::SockAddrContext,
};
use proxy_common::{
    Frontend4Key, Frontend6Key, RevNat4, RevNat4Key, RevNat6, RevNat6Key, StatIndex, scope,
};

use crate::{
    lb::{Decision, select_backend},
    maps::{
        KPR_BACKENDS4, KPR_BACKENDS6, KPR_FRONTENDS4, KPR_FRONTENDS6, KPR_REVNAT4, KPR_REVNAT6,
    },
    stats::bump,
};

/// Let the syscall proceed (with whatever address the program left in the context). recvmsg
/// and getpeername programs must always return this (the verifier enforces it).
const ALLOW: i32 = 1;
/// Fail the syscall with the error set by `bpf_set_retval` (EPERM if none was set).
const DENY: i32 = 0;
const ECONNREFUSED: i32 = 111;

/// Which hook is translating, for the counters.
#[derive(Clone, Copy)]
pub enum Hook {
    Connect,
    Sendmsg,
}

impl Hook {
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

pub fn translate4(ctx: &SockAddrContext, hook: Hook) -> i32 {
    // SAFETY: the kernel passes a valid bpf_sock_addr; the verifier checks each field access.
    let sa = unsafe { &mut *ctx.sock_addr };
    let Some(proto) = protocol(sa) else {
        return ALLOW;
    };
    let key = Frontend4Key {
        addr: sa.user_ip4,
        port: user_port(sa),
        proto,
        scope: scope::INTERNAL,
    };
    // SAFETY: the value is copied out at once (whole-value updates by the agent).
    let Some(frontend) = (unsafe { KPR_FRONTENDS4.get(key) }).copied() else {
        return ALLOW;
    };
    match select_backend(&frontend, || netns_cookie(ctx), || None, &KPR_BACKENDS4) {
        Decision::NoBackends => {
            bump(hook.rejected());
            refuse()
        }
        Decision::BackendMissing => backend_missing(ctx),
        Decision::Backend(backend) => {
            let revnat_key = RevNat4Key {
                cookie: socket_cookie(ctx),
                addr: backend.addr,
                port: backend.port,
                _pad: 0,
            };
            let revnat = RevNat4 {
                addr: key.addr,
                port: key.port,
                _pad: 0,
            };
            // Best effort: without the entry getpeername/recvmsg show the backend address.
            if KPR_REVNAT4.insert(revnat_key, revnat, 0).is_err() {
                bump(StatIndex::RevNatUpdateFailed);
            }
            sa.user_ip4 = backend.addr;
            sa.user_port = u32::from(backend.port);
            bump(hook.translated());
            ALLOW
        }
    }
}

pub fn translate6(ctx: &SockAddrContext, hook: Hook) -> i32 {
    // SAFETY: the kernel passes a valid bpf_sock_addr; the verifier checks each field access.
    let sa = unsafe { &mut *ctx.sock_addr };
    let Some(proto) = protocol(sa) else {
        return ALLOW;
    };
    let key = Frontend6Key {
        addr: read_ip6(sa),
        port: user_port(sa),
        proto,
        scope: scope::INTERNAL,
    };
    // SAFETY: as in translate4.
    let Some(frontend) = (unsafe { KPR_FRONTENDS6.get(key) }).copied() else {
        return ALLOW;
    };
    match select_backend(&frontend, || netns_cookie(ctx), || None, &KPR_BACKENDS6) {
        Decision::NoBackends => {
            bump(hook.rejected());
            refuse()
        }
        Decision::BackendMissing => backend_missing(ctx),
        Decision::Backend(backend) => {
            let revnat_key = RevNat6Key {
                cookie: socket_cookie(ctx),
                addr: backend.addr,
                port: backend.port,
                _pad: [0; 3],
            };
            let revnat = RevNat6 {
                addr: key.addr,
                port: key.port,
                _pad: 0,
            };
            if KPR_REVNAT6.insert(revnat_key, revnat, 0).is_err() {
                bump(StatIndex::RevNatUpdateFailed);
            }
            write_ip6(sa, backend.addr);
            sa.user_port = u32::from(backend.port);
            bump(hook.translated());
            ALLOW
        }
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
    // SAFETY: bpf_set_retval is available to connect and sendmsg hooks (kernel ≥ 5.18).
    unsafe { bpf_set_retval(-ECONNREFUSED) };
    DENY
}

/// recvmsg (the datagram's source) and getpeername (the connected peer): backend → service.
pub fn reverse4(ctx: &SockAddrContext, stat: StatIndex) -> i32 {
    // SAFETY: the kernel passes a valid bpf_sock_addr; the verifier checks each field access.
    let sa = unsafe { &mut *ctx.sock_addr };
    let key = RevNat4Key {
        cookie: socket_cookie(ctx),
        addr: sa.user_ip4,
        port: user_port(sa),
        _pad: 0,
    };
    // SAFETY: the value is copied out at once.
    if let Some(revnat) = (unsafe { KPR_REVNAT4.get(key) }).copied() {
        sa.user_ip4 = revnat.addr;
        sa.user_port = u32::from(revnat.port);
        bump(stat);
    }
    ALLOW
}

pub fn reverse6(ctx: &SockAddrContext, stat: StatIndex) -> i32 {
    // SAFETY: the kernel passes a valid bpf_sock_addr; the verifier checks each field access.
    let sa = unsafe { &mut *ctx.sock_addr };
    let key = RevNat6Key {
        cookie: socket_cookie(ctx),
        addr: read_ip6(sa),
        port: user_port(sa),
        _pad: [0; 3],
    };
    // SAFETY: the value is copied out at once.
    if let Some(revnat) = (unsafe { KPR_REVNAT6.get(key) }).copied() {
        write_ip6(sa, revnat.addr);
        sa.user_port = u32::from(revnat.port);
        bump(stat);
    }
    ALLOW
}
