//! Command-line flags. Names follow kube-proxy's where a kube-proxy flag exists.

use std::{net::SocketAddr, path::PathBuf};

use clap::{Parser, ValueEnum};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ProxyMode {
    /// Socket-level load balancing with eBPF programs on the cgroup2 hierarchy.
    Ebpf,
    /// kube-proxy's iptables rules (not implemented yet).
    Iptables,
}

/// `--logging-format` (kube-proxy's flag): how log lines are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LoggingFormat {
    Text,
    Json,
}

/// An `ip:port` to serve on, or empty to serve nothing (kube-proxy's bind address flags).
fn bind_address(value: &str) -> Result<Option<SocketAddr>, std::net::AddrParseError> {
    if value.is_empty() {
        return Ok(None);
    }
    value.parse().map(Some)
}

#[derive(Debug, Parser)]
#[command(
    name = "proxy-agent",
    version,
    about = "Kubernetes service proxy on eBPF"
)]
pub struct Args {
    /// Which dataplane programs the node.
    #[arg(long, value_enum, default_value = "ebpf")]
    pub proxy_mode: ProxyMode,

    /// Standalone mode: read Service and EndpointSlice objects from the multi-document YAML
    /// files (*.yaml, *.yml) in this folder, and re-read them when they change.
    #[arg(long, value_name = "DIR")]
    pub manifests: Option<PathBuf>,

    /// The name of this node (kube-proxy's flag); defaults to the host name.
    #[arg(long, value_name = "NAME")]
    pub hostname_override: Option<String>,

    /// The cgroup2 directory the socket programs attach to; defaults to the cgroup2 mount point
    /// found in /proc/mounts, so every process on the node is covered.
    #[arg(long, value_name = "PATH")]
    pub cgroup_path: Option<PathBuf>,

    /// A bpffs mount (mounted there if it is not one yet); maps are pinned in
    /// `<bpf-root>/kubeproxy-rs/`.
    #[arg(long, value_name = "PATH", default_value = "/sys/fs/bpf")]
    pub bpf_root: PathBuf,

    /// Capacity of the frontend map (service address, port, protocol).
    #[arg(long, default_value_t = proxy_common::default_sizes::FRONTENDS)]
    pub bpf_map_frontends: u32,

    /// Capacity of the backend and backend-slot maps.
    #[arg(long, default_value_t = proxy_common::default_sizes::BACKENDS)]
    pub bpf_map_backends: u32,

    /// Where the proxy health server (`/healthz`, `/livez`) listens; empty: disabled.
    // node-services: added here until the config rework lands (then read from there).
    #[arg(long, value_name = "IP:PORT", default_value = "0.0.0.0:10256", value_parser = bind_address)]
    pub healthz_bind_address: Option<SocketAddr>,

    /// Where the metrics server (`/metrics`, `/proxyMode`) listens; empty: disabled.
    #[arg(long, value_name = "IP:PORT", default_value = "127.0.0.1:10249", value_parser = bind_address)]
    pub metrics_bind_address: Option<SocketAddr>,

    /// Log line format: `text` or `json`.
    #[arg(long, value_enum, default_value = "text")]
    pub logging_format: LoggingFormat,

    /// Log more (-v: debug, -vv: trace). RUST_LOG overrides it.
    #[arg(short, long, action = clap::ArgAction::Count)]
    pub verbose: u8,
}
