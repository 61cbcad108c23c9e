//! Conntrack and NAT from user space: the tc conntrack maps, their GC and purge on a worker, the
//! kernel's NAT flows at a takeover, the SNAT port range.

pub(super) mod ct_maps;
pub(super) mod ct_worker;
pub(super) mod kernel_nat;
pub mod reserved_ports;
pub(super) mod tc_conntrack;
