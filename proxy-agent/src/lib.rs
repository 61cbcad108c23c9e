//! kubeproxy-rs node agent as a library: the binary (`src/main.rs`) only parses flags and sets up
//! logging; benchmarks and tests can drive the same modules.

pub mod btree;
pub mod cli;
pub mod config;
pub mod dataplane;
pub mod desired;
pub mod drift_checks;
pub mod fuzz;
pub mod http_servers;
pub mod inspect;
pub mod ip_family;
pub mod kernel_conntrack;
pub mod logging;
pub mod netlink;
pub mod node;
pub mod objects;
pub mod proxy_mode;
pub mod run;
pub mod source;
pub mod sync_runner;
pub mod time_format;
pub mod yaml;
