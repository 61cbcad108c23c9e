//! The iptables tools, as kube-proxy's `pkg/util/iptables` runs them: which backend and version
//! the host has (`detect.rs`), running `iptables-restore`/`-save` (`exec.rs`), reading a dump
//! (`save.rs`), holding netfilter's NAT hooks while DNATed connections drain after a switch to
//! the eBPF mode (`nat_hold.rs`), and kube-proxy's nfacct packet counters over nfnetlink
//! (`nfacct.rs`).

pub mod detect;
pub mod exec;
pub mod nat_hold;
pub mod nfacct;
pub mod save;
