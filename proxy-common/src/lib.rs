//! Map keys and values shared by the eBPF programs (`proxy-ebpf`) and the agent.
//!
//! Every type is `#[repr(C)]` with explicit padding fields, so the kernel and user space agree on
//! the layout byte for byte and no uninitialised padding ever reaches a map (the verifier rejects
//! stack reads of uninitialised bytes, and hash maps compare keys bytewise).
//!
//! Addresses and ports are stored in network byte order, exactly as the socket hooks see them in
//! `bpf_sock_addr`, so the datapath never swaps bytes.
#![no_std]

pub mod addr;
pub mod conntrack;
pub mod crc32c;
pub mod inet_checksum;
pub mod ip_family;
pub mod lookup;
pub mod maglev;
pub mod maps;
pub mod probe;
pub mod select;
pub mod stats;

pub use maps::*;
pub use stats::*;

/// IP protocol numbers used in frontend keys.
pub mod proto {
    pub const TCP: u8 = 6;
    pub const UDP: u8 = 17;
    pub const SCTP: u8 = 132;
}

#[cfg(feature = "user")]
mod pod {
    use super::*;

    // SAFETY: every type below is `#[repr(C)]`, `Copy`, made only of integers, and its padding is
    // spelled out as named fields, so any bit pattern is valid and no byte is uninitialised.
    unsafe impl aya::Pod for Frontend4Key {}
    // SAFETY: as above.
    unsafe impl aya::Pod for Frontend6Key {}
    // SAFETY: as above.
    unsafe impl aya::Pod for FrontendValue {}
    // SAFETY: as above.
    unsafe impl aya::Pod for BackendSlotKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for MaglevKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for MaglevBlock {}
    // SAFETY: as above.
    unsafe impl aya::Pod for SlotBlock {}
    // SAFETY: as above.
    unsafe impl aya::Pod for Backend4 {}
    // SAFETY: as above.
    unsafe impl aya::Pod for Backend6 {}
    // SAFETY: as above.
    unsafe impl aya::Pod for RevNat4Key {}
    // SAFETY: as above.
    unsafe impl aya::Pod for RevNat4 {}
    // SAFETY: as above.
    unsafe impl aya::Pod for RevNat6Key {}
    // SAFETY: as above.
    unsafe impl aya::Pod for RevNat6 {}
    // SAFETY: as above.
    unsafe impl aya::Pod for AffinityKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for AffinityValue {}
    // SAFETY: as above.
    unsafe impl aya::Pod for ServiceName {}
    // SAFETY: as above.
    unsafe impl aya::Pod for ServiceTraffic {}
    // SAFETY: as above.
    unsafe impl aya::Pod for ServicePackets {}
    // SAFETY: as above.
    unsafe impl aya::Pod for EndpointTrafficKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for AffinityMatchKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for CtKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for FragmentKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for CtValue {}
    // SAFETY: as above.
    unsafe impl aya::Pod for CtKey4 {}
    // SAFETY: as above.
    unsafe impl aya::Pod for CtValue4 {}
    // SAFETY: as above.
    unsafe impl aya::Pod for SourceRangeKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for NodeAddrKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for NodeConfig {}
    // SAFETY: as above.
    unsafe impl aya::Pod for SnatAddrs {}
    // SAFETY: as above.
    unsafe impl aya::Pod for PortFilter {}
}
