//! Socket-level load balancing: the cgroup sock_addr hooks rewrite the destination of
//! `connect()` once per socket, so established traffic flows to the backend with no per-packet
//! work at all.

use aya_ebpf::{
    EbpfContext as _,
    helpers::{bpf_get_socket_cookie, bpf_set_retval},
    programs::SockAddrContext,
};
use proxy_common::{Frontend4Key, RevNat4, StatIndex, scope};

use crate::{
    lb::{Decision, select_backend},
    maps::KPR_REVNAT4,
    stats::bump,
};

/// Let the syscall proceed (with whatever address the program left in the context).
const ALLOW: i32 = 1;
/// Fail the syscall with the error set by `bpf_set_retval` (EPERM if none was set).
const DENY: i32 = 0;
const ECONNREFUSED: i32 = 111;

pub fn connect4(ctx: &SockAddrContext) -> i32 {
    // SAFETY: the kernel passes a valid bpf_sock_addr; the verifier checks each field access.
    let sa = unsafe { &mut *ctx.sock_addr };
    let protocol = sa.protocol;
    if protocol > u32::from(u8::MAX) {
        return ALLOW;
    }
    let key = Frontend4Key {
        addr: sa.user_ip4,
        // user_port holds the port in network byte order in its low 16 bits.
        port: sa.user_port as u16,
        proto: protocol as u8,
        scope: scope::INTERNAL,
    };
    match select_backend(&key) {
        Decision::NotAService => ALLOW,
        Decision::NoBackends => {
            bump(StatIndex::RejectedNoBackends);
            refuse()
        }
        Decision::BackendMissing => {
            bump(StatIndex::BackendMissing);
            // Should never happen with the agent's update protocol, so it is worth a log line.
            aya_log_ebpf::warn!(ctx, "frontend without its backend slot; connect refused");
            refuse()
        }
        Decision::Backend(backend) => {
            // SAFETY: sock_addr programs may ask for the cookie of the socket being connected.
            let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
            let revnat = RevNat4 {
                frontend_addr: key.addr,
                backend_addr: backend.addr,
                frontend_port: key.port,
                backend_port: backend.port,
                _pad: 0,
            };
            // Best effort: without the entry only getpeername() shows the backend address.
            let _ = KPR_REVNAT4.insert(cookie, revnat, 0);
            sa.user_ip4 = backend.addr;
            sa.user_port = u32::from(backend.port);
            bump(StatIndex::Translated);
            ALLOW
        }
    }
}

/// kube-proxy REJECTs traffic to services without endpoints, so clients see "connection
/// refused" at once instead of a timeout. Returning DENY alone would give EPERM.
fn refuse() -> i32 {
    // SAFETY: bpf_set_retval is available to connect hooks (kernel ≥ 5.18).
    unsafe { bpf_set_retval(-ECONNREFUSED) };
    DENY
}

pub fn getpeername4(ctx: &SockAddrContext) -> i32 {
    // SAFETY: as in connect4.
    let sa = unsafe { &mut *ctx.sock_addr };
    // SAFETY: as in connect4.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    // SAFETY: the value is copied out at once.
    let Some(revnat) = (unsafe { KPR_REVNAT4.get(cookie) }).copied() else {
        return ALLOW;
    };
    // Only rewrite if the socket is still connected to the backend we chose; a reconnect to
    // another address reuses the cookie.
    if sa.user_ip4 == revnat.backend_addr && sa.user_port as u16 == revnat.backend_port {
        sa.user_ip4 = revnat.frontend_addr;
        sa.user_port = u32::from(revnat.frontend_port);
        bump(StatIndex::PeerNameRewritten);
    }
    ALLOW
}
