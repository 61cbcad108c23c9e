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

/// An `ip:port` to serve on, or nothing when the flag is empty (kube-proxy's bind address
/// flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BindAddress(pub Option<SocketAddr>);

impl std::str::FromStr for BindAddress {
    type Err = std::net::AddrParseError;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        if value.is_empty() {
            return Ok(Self(None));
        }
        value.parse().map(|addr| Self(Some(addr)))
    }
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
    #[arg(long, value_name = "IP:PORT", default_value = "0.0.0.0:10256")]
    pub healthz_bind_address: BindAddress,

    /// Where the metrics server (`/metrics`, `/proxyMode`) listens; empty: disabled.
    #[arg(long, value_name = "IP:PORT", default_value = "127.0.0.1:10249")]
    pub metrics_bind_address: BindAddress,

    /// Log line format: `text` or `json`.
    #[arg(long, value_enum, default_value = "text")]
    pub logging_format: LoggingFormat,

    /// Log more (-v: debug, -vv: trace). RUST_LOG overrides it.
    #[arg(short, long, action = clap::ArgAction::Count)]
    pub verbose: u8,
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    use super::*;

    #[test]
    fn flags_are_consistent() {
        Args::command().debug_assert();
    }

    #[test]
    fn node_service_flags() {
        let args = Args::try_parse_from(["proxy-agent"]).unwrap();
        assert_eq!(
            args.healthz_bind_address.0,
            Some("0.0.0.0:10256".parse().unwrap())
        );
        assert_eq!(
            args.metrics_bind_address.0,
            Some("127.0.0.1:10249".parse().unwrap())
        );
        assert_eq!(args.logging_format, LoggingFormat::Text);
        let args = Args::try_parse_from([
            "proxy-agent",
            "--healthz-bind-address",
            "",
            "--metrics-bind-address",
            "[::1]:9999",
            "--logging-format",
            "json",
        ])
        .unwrap();
        assert_eq!(args.healthz_bind_address.0, None);
        assert_eq!(
            args.metrics_bind_address.0,
            Some("[::1]:9999".parse().unwrap())
        );
        assert_eq!(args.logging_format, LoggingFormat::Json);
        assert!(Args::try_parse_from(["proxy-agent", "--healthz-bind-address", "10256"]).is_err());
    }
}
