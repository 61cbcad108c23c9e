//! The kernel clients every dataplane and the agent stand on: netlink framing, netfilter's
//! conntrack, the node's addresses and links, the bpf(2) calls aya does not make, and the
//! iptables tools. Each speaks to the kernel (or its tools) and decides no Service policy: what
//! to ask for comes from `proxy_model`.

pub mod bpf;
pub mod conntrack;
pub mod forward_policy;
pub mod iptables;
pub mod netlink;
pub mod node;
