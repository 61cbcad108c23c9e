//! Service load-balancing maps: frontends → backend slots → backends, reverse NAT for socket
//! hooks, and session affinity.
//!
//! Update protocol (agent side): a frontend's backends are written into the slots of the
//! generation the frontend does *not* use yet, then the frontend value is switched to that
//! generation and count in one map update, and only then are the old generation's slots deleted.
//! A reader therefore always sees a complete backend set, old or new, never a mix.
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

    /// Every map the agent pins (and `--cleanup` removes).
    pub const PINNED: [&str; 10] = [
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
    /// Slots of the per-CPU counter array: more than [`crate::StatIndex::COUNT`], so a newer
    /// object with more counters still fits a map pinned by an older agent.
    pub const STATS: u32 = 64;
}

/// Which traffic a frontend applies to.
pub mod scope {
    /// Traffic from local sockets (the cgroup socket hooks).
    pub const INTERNAL: u8 = 0;
}

/// Bits of [`FrontendValue::flags`].
pub mod frontend_flags {
    /// `sessionAffinity: ClientIP`: [`super::FrontendValue::affinity_timeout`] is in use.
    pub const AFFINITY: u8 = 1;
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
    pub _pad: u32,
}

/// Key of `KPR_BACKEND_SLOTS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendSlotKey {
    pub service_id: u32,
    /// Slot index in `0..backend_count`.
    pub slot: u16,
    pub generation: u8,
    pub _pad: u8,
}

/// Value of `KPR_BACKENDS4` (keyed by a `u32` backend id allocated by the agent).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Backend4 {
    /// IPv4 address, network byte order.
    pub addr: u32,
    /// Port, network byte order.
    pub port: u16,
    pub proto: u8,
    pub flags: u8,
}

/// Value of `KPR_BACKENDS6`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Backend6 {
    pub addr: [u32; 4],
    pub port: u16,
    pub proto: u8,
    pub flags: u8,
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

/// Key of `KPR_AFFINITY_MATCH` (value: `u8`, unused): present exactly while `backend_id` is in
/// the live backend set of `service_id`, so an affinity entry never leads to a backend that was
/// removed from the service (it may still exist for other services under the same id).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AffinityMatchKey {
    pub service_id: u32,
    pub backend_id: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[test]
    fn layouts_have_no_implicit_padding() {
        assert_eq!(size_of::<Frontend4Key>(), 8);
        assert_eq!(size_of::<Frontend6Key>(), 20);
        assert_eq!(size_of::<FrontendValue>(), 16);
        assert_eq!(size_of::<BackendSlotKey>(), 8);
        assert_eq!(size_of::<Backend4>(), 8);
        assert_eq!(size_of::<Backend6>(), 20);
        assert_eq!(size_of::<RevNat4Key>(), 16);
        assert_eq!(size_of::<RevNat4>(), 8);
        assert_eq!(size_of::<RevNat6Key>(), 32);
        assert_eq!(size_of::<RevNat6>(), 20);
        assert_eq!(size_of::<AffinityKey>(), 16);
        assert_eq!(size_of::<AffinityValue>(), 16);
        assert_eq!(size_of::<AffinityMatchKey>(), 8);
    }
}
