//! kubeproxy-rs node agent as a library: the binary (`src/main.rs`) only parses flags and sets up
//! logging; benchmarks and tests can drive the same modules. The layers below are crates of
//! their own: `proxy_model` (configuration, objects, desired state), `proxy_kernel` (kernel
//! clients), `proxy_dataplane_ebpf` and `proxy_dataplane_iptables`.

pub mod datapath_checks;
pub mod dataplane;
pub mod drift_checks;
pub mod fast_path;
pub mod fuzz;
pub mod http_servers;
pub mod inspect;
pub mod run;
pub mod source;
pub mod sync_runner;
pub mod traffic_reads;
