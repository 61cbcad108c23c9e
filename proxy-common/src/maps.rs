//! Service load-balancing maps: frontends → backend slots → backends, plus reverse NAT.
//!
//! Update protocol (agent side): a frontend's backends are written into the slots of the
//! generation the frontend does *not* use yet, then the frontend value is switched to that
//! generation and count in one map update, and only then are the old generation's slots deleted.
//! A reader therefore always sees a complete backend set, old or new, never a mix.

/// Names of the maps, as declared in `proxy-ebpf` and pinned under the agent's bpffs directory.
pub mod map_names {
    pub const FRONTENDS4: &str = "KPR_FRONTENDS4";
    pub const BACKEND_SLOTS: &str = "KPR_BACKEND_SLOTS";
    pub const BACKENDS4: &str = "KPR_BACKENDS4";
    pub const REVNAT4: &str = "KPR_REVNAT4";
    pub const STATS: &str = "KPR_STATS";
}

/// Names of the eBPF programs in the object.
pub mod program_names {
    pub const CONNECT4: &str = "kpr_connect4";
    pub const GETPEERNAME4: &str = "kpr_getpeername4";
}

/// Default capacities; the agent may override them before loading.
pub mod default_sizes {
    pub const FRONTENDS: u32 = 65_536;
    pub const BACKEND_SLOTS: u32 = 262_144;
    pub const BACKENDS: u32 = 262_144;
    pub const REVNAT: u32 = 262_144;
}

/// Which traffic a frontend applies to.
pub mod scope {
    /// Traffic from local sockets (the cgroup socket hooks).
    pub const INTERNAL: u8 = 0;
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

/// Value of `KPR_FRONTENDS4`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct FrontendValue {
    /// Identifies this frontend's backend slots; allocated by the agent, never 0.
    pub service_id: u32,
    /// Number of backend slots in use in `generation`; 0 means "reject".
    pub backend_count: u16,
    /// Which of the two slot generations (0 or 1) is live.
    pub generation: u8,
    /// Reserved for per-frontend flags.
    pub flags: u8,
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

/// Value of `KPR_REVNAT4`, keyed by socket cookie: what a translated socket originally dialled,
/// so `getpeername()` can show the service address instead of the backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct RevNat4 {
    pub frontend_addr: u32,
    pub backend_addr: u32,
    pub frontend_port: u16,
    pub backend_port: u16,
    pub _pad: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[test]
    fn layouts_have_no_implicit_padding() {
        assert_eq!(size_of::<Frontend4Key>(), 8);
        assert_eq!(size_of::<FrontendValue>(), 8);
        assert_eq!(size_of::<BackendSlotKey>(), 8);
        assert_eq!(size_of::<Backend4>(), 8);
        assert_eq!(size_of::<RevNat4>(), 16);
    }
}
