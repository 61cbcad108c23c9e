//! Node settings: what the Node object and the host's addresses decide, as kube-proxy's
//! `NodeManager` (pkg/proxy/node.go) and `ProxyServer` setup (cmd/kube-proxy/app/server.go,
//! server_linux.go) do.
//!
//! - `settings.rs`: pure functions (Node object, host addresses, configuration) →
//!   [`NodeSettings`]: pod CIDRs, node IPs, NodePort addresses per family, localhost NodePorts,
//!   health check node port listen addresses, the resolved `detectLocalMode`.
//! - `addresses.rs`: the host's interfaces and addresses (`getifaddrs`), and kube-proxy's
//!   `NodePortAddresses` per family.
//! - `links.rs`: link state, kind (bridge, veth, vxlan...) and hardware type (`RTM_GETLINK`).
//! - `ebpf.rs`: the tc programs' node facts (`NodeConfig`, `KPR_NODE_ADDRS`) from the settings.
//! - `changes.rs`: which Node updates matter (kubelet heartbeats do not).
//! - `watch.rs`: netlink address events (RTM_NEWADDR/RTM_DELADDR) → a sync.
//! - `route_watch.rs`: netlink route, rule, neighbour and link events → a callback (the tc fast
//!   path's next hops kept in conntrack entries are looked up again).
//! - `manager.rs`: [`NodeManager`], the stateful part `run.rs` drives: the NodeCIDR wait, exit on
//!   a podCIDR change, recomputing the settings on every sync.

mod addresses;
mod detect_local;
pub mod ebpf;
mod links;
mod manager;
mod route_watch;
mod settings;
mod watch;

pub use addresses::{Interface, NodePortAddressSet, host_interfaces, is_global_unicast};
pub use detect_local::DetectLocalMode;
pub use links::{ARPHRD_ETHER, Link};
pub use manager::{NodeError, NodeManager, POD_CIDR_POLL_TIMEOUT};
pub use proxy_model::objects::{NodeChange, node_change};
pub use route_watch::RouteWatch;
pub use settings::{FamilySettings, NodeInputs, NodeSettings, detect_node_ips, node_host_ips};
pub use watch::AddressWatcher;

#[cfg(test)]
mod tests;
