//! The pure model of a node's Service proxy: kube-proxy's flags and configuration, the API
//! objects in compact form, and the desired state each dataplane applies. Nothing here touches
//! the kernel or needs an async runtime: this crate has neither as a dependency, so the compiler
//! keeps it that way.

pub mod btree;
pub mod cli;
pub mod config;
pub mod desired;
pub mod forward_policy;
pub mod ip_family;
pub mod logging;
pub mod objects;
pub mod proxy_mode;
pub mod time_format;
pub mod traffic;
pub mod yaml;
