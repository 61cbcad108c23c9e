//! Command-line flags: kube-proxy's names and value syntax, plus our eBPF additions.
//!
//! Values are taken as text here and parsed in `config::flags`, so that every bad value is
//! reported together (with the flag and the configuration field it sets) instead of clap
//! stopping at the first one. Booleans follow Go's pflag: `--flag` means true, and
//! `--flag=false` (with `=`) sets false.

use std::path::PathBuf;

use clap::Parser;

#[derive(Debug, Default, Clone, Parser)]
#[command(
    name = "proxy-agent",
    version,
    about = "Kubernetes service proxy on eBPF (a kube-proxy replacement)",
    after_help = "A flag given on the command line overrides the same setting in --config \
                  (kube-proxy ignores most flags when --config is given); see README.md."
)]
pub struct Args {
    /// `inspect`: show what the running agent's datapath holds (then exit).
    #[command(subcommand)]
    pub command: Option<Command>,

    // ----- the configuration file -----
    /// The path to a KubeProxyConfiguration file (kubeproxy.config.k8s.io/v1alpha1, YAML or
    /// JSON). Unknown fields are errors.
    #[arg(long, value_name = "FILE", help_heading = "Configuration file")]
    pub config: Option<PathBuf>,

    /// Write the effective configuration (file + flags + defaults) as YAML to FILE and exit.
    #[arg(long, value_name = "FILE", help_heading = "Configuration file")]
    pub write_config_to: Option<PathBuf>,

    /// Remove everything either mode installed, and kube-proxy's nftables/IPVS leftovers, then exit.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true,
          default_missing_value = "true", help_heading = "Configuration file")]
    pub cleanup: Option<String>,

    // ----- kube-proxy flags -----
    /// Which proxy mode to use: 'ebpf' (default) or 'iptables'. [mode]
    #[arg(long, value_name = "MODE", help_heading = "kube-proxy flags")]
    pub proxy_mode: Option<String>,

    /// The name of this node; defaults to the host name (trimmed, lower-cased). [hostnameOverride]
    #[arg(long, value_name = "NAME", help_heading = "kube-proxy flags")]
    pub hostname_override: Option<String>,

    /// Overrides the node's primary IP (no socket is bound to it). [bindAddress]
    #[arg(long, value_name = "IP", help_heading = "kube-proxy flags")]
    pub bind_address: Option<String>,

    /// The pods' CIDR range(s), comma-separated for a dual-stack pair. [clusterCIDR]
    #[arg(long, value_name = "CIDRS", help_heading = "kube-proxy flags")]
    pub cluster_cidr: Option<String>,

    /// Node IP ranges NodePorts are served on (CIDRs, comma-separated), or 'primary'; default:
    /// all local IPs. [nodePortAddresses]
    #[arg(
        long,
        value_name = "CIDRS",
        value_delimiter = ',',
        help_heading = "kube-proxy flags"
    )]
    pub nodeport_addresses: Option<Vec<String>>,

    /// SNAT all traffic sent to Service cluster IPs. [iptables.masqueradeAll]
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true,
          default_missing_value = "true", help_heading = "kube-proxy flags")]
    pub masquerade_all: Option<String>,

    /// The fwmark bit marking packets that need SNAT, 0..31 (default 14). [iptables.masqueradeBit]
    #[arg(
        long,
        value_name = "BIT",
        allow_hyphen_values = true,
        help_heading = "kube-proxy flags"
    )]
    pub iptables_masquerade_bit: Option<String>,

    /// Allow NodePorts on localhost (iptables mode, IPv4; default true). [iptables.localhostNodePorts]
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true,
          default_missing_value = "true", help_heading = "kube-proxy flags")]
    pub iptables_localhost_nodeports: Option<String>,

    /// Resync interval, e.g. 30s, 1m (default 30s). [iptables.syncPeriod]
    #[arg(
        long,
        value_name = "DURATION",
        allow_hyphen_values = true,
        help_heading = "kube-proxy flags"
    )]
    pub iptables_sync_period: Option<String>,

    /// Minimum time between syncs; 0 syncs on every change (default 1s). [iptables.minSyncPeriod]
    #[arg(
        long,
        value_name = "DURATION",
        allow_hyphen_values = true,
        help_heading = "kube-proxy flags"
    )]
    pub iptables_min_sync_period: Option<String>,

    /// Conntrack entries per CPU core; 0 leaves the limit (default 32768). [conntrack.maxPerCore]
    #[arg(
        long,
        value_name = "N",
        allow_hyphen_values = true,
        help_heading = "kube-proxy flags"
    )]
    pub conntrack_max_per_core: Option<String>,

    /// Minimum conntrack table size (default 131072). [conntrack.min]
    #[arg(
        long,
        value_name = "N",
        allow_hyphen_values = true,
        help_heading = "kube-proxy flags"
    )]
    pub conntrack_min: Option<String>,

    /// Idle timeout of established TCP entries; 0 leaves it (default 24h). [conntrack.tcpEstablishedTimeout]
    #[arg(
        long,
        value_name = "DURATION",
        allow_hyphen_values = true,
        help_heading = "kube-proxy flags"
    )]
    pub conntrack_tcp_timeout_established: Option<String>,

    /// Timeout of TCP entries in CLOSE_WAIT (default 1h). [conntrack.tcpCloseWaitTimeout]
    #[arg(
        long,
        value_name = "DURATION",
        allow_hyphen_values = true,
        help_heading = "kube-proxy flags"
    )]
    pub conntrack_tcp_timeout_close_wait: Option<String>,

    /// Set nf_conntrack_tcp_be_liberal. [conntrack.tcpBeLiberal]
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true,
          default_missing_value = "true", help_heading = "kube-proxy flags")]
    pub conntrack_tcp_be_liberal: Option<String>,

    /// Idle timeout of UNREPLIED UDP entries; 0 leaves it. [conntrack.udpTimeout]
    #[arg(
        long,
        value_name = "DURATION",
        allow_hyphen_values = true,
        help_heading = "kube-proxy flags"
    )]
    pub conntrack_udp_timeout: Option<String>,

    /// Idle timeout of ASSURED UDP entries; 0 leaves it. [conntrack.udpStreamTimeout]
    #[arg(
        long,
        value_name = "DURATION",
        allow_hyphen_values = true,
        help_heading = "kube-proxy flags"
    )]
    pub conntrack_udp_timeout_stream: Option<String>,

    /// Health check server address, IP or IP:port (default 0.0.0.0:10256); empty disables it.
    /// [healthzBindAddress]
    #[arg(long, value_name = "IP:PORT", help_heading = "kube-proxy flags")]
    pub healthz_bind_address: Option<String>,

    /// Metrics server address, IP or IP:port (default 127.0.0.1:10249; empty means the default).
    /// [metricsBindAddress]
    #[arg(long, value_name = "IP:PORT", help_heading = "kube-proxy flags")]
    pub metrics_bind_address: Option<String>,

    /// The process's oom_score_adj, -1000..1000 (default -999). [oomScoreAdj]
    #[arg(
        long,
        value_name = "N",
        allow_hyphen_values = true,
        help_heading = "kube-proxy flags"
    )]
    pub oom_score_adj: Option<String>,

    /// Path to a kubeconfig file. [clientConnection.kubeconfig]
    #[arg(long, value_name = "FILE", help_heading = "kube-proxy flags")]
    pub kubeconfig: Option<String>,

    /// The API server address (overrides the kubeconfig's).
    #[arg(long, value_name = "URL", help_heading = "kube-proxy flags")]
    pub master: Option<String>,

    /// Content type of requests to the API server. [clientConnection.contentType]
    #[arg(long, value_name = "TYPE", help_heading = "kube-proxy flags")]
    pub kube_api_content_type: Option<String>,

    /// QPS towards the API server (default 5). [clientConnection.qps]
    #[arg(
        long,
        value_name = "QPS",
        allow_hyphen_values = true,
        help_heading = "kube-proxy flags"
    )]
    pub kube_api_qps: Option<String>,

    /// Burst towards the API server (default 10). [clientConnection.burst]
    #[arg(
        long,
        value_name = "N",
        allow_hyphen_values = true,
        help_heading = "kube-proxy flags"
    )]
    pub kube_api_burst: Option<String>,

    /// How often the API informers resync (default 15m). [configSyncPeriod]
    #[arg(
        long,
        value_name = "DURATION",
        allow_hyphen_values = true,
        help_heading = "kube-proxy flags"
    )]
    pub config_sync_period: Option<String>,

    /// How to tell pod traffic: ClusterCIDR (default), NodeCIDR, BridgeInterface,
    /// InterfaceNamePrefix. [detectLocalMode]
    #[arg(long, value_name = "MODE", help_heading = "kube-proxy flags")]
    pub detect_local_mode: Option<String>,

    /// The pod bridge, for --detect-local-mode BridgeInterface. [detectLocal.bridgeInterface]
    #[arg(long, value_name = "NAME", help_heading = "kube-proxy flags")]
    pub pod_bridge_interface: Option<String>,

    /// The pod interface name prefix, for --detect-local-mode InterfaceNamePrefix.
    /// [detectLocal.interfaceNamePrefix]
    #[arg(long, value_name = "PREFIX", help_heading = "kube-proxy flags")]
    pub pod_interface_name_prefix: Option<String>,

    /// Log verbosity as klog's -v: 0-1 info, 2-3 debug, 4+ trace; a bare -v means 2.
    /// RUST_LOG overrides it. [logging.verbosity]
    #[arg(short = 'v', long = "v", value_name = "N", num_args = 0..=1,
          default_missing_value = "2", help_heading = "kube-proxy flags")]
    pub verbosity: Option<String>,

    /// Feature gates, `Name=true,Other=false` (kube-proxy's syntax). Gates that change proxy
    /// behaviour are applied; the others are listed in one warning. [featureGates]
    #[arg(long, value_name = "GATES", help_heading = "kube-proxy flags")]
    pub feature_gates: Option<String>,

    /// Serve /debug/pprof (not implemented: accepted with a warning when true). [enableProfiling]
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true,
          default_missing_value = "true", help_heading = "kube-proxy flags")]
    pub profiling: Option<String>,

    /// Exit when the health or metrics server cannot bind its port. [bindAddressHardFail]
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true,
          default_missing_value = "true", help_heading = "kube-proxy flags")]
    pub bind_address_hard_fail: Option<String>,

    /// Do the initialisation that needs full root privileges (oom_score_adj, conntrack and
    /// other sysctls), then exit.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true,
          default_missing_value = "true", help_heading = "kube-proxy flags")]
    pub init_only: Option<String>,

    /// Show metrics hidden since this version (<major>.<minor>; kept in the file, no hidden
    /// metrics exist here). [showHiddenMetricsForVersion]
    #[arg(long, value_name = "VERSION", help_heading = "kube-proxy flags")]
    pub show_hidden_metrics_for_version: Option<String>,

    /// Deprecated: the health server's port; 0 disables it (without --config only).
    #[arg(
        long,
        value_name = "PORT",
        allow_hyphen_values = true,
        help_heading = "kube-proxy flags"
    )]
    pub healthz_port: Option<String>,

    /// Deprecated: the metrics server's port; 0 disables it (without --config only).
    #[arg(
        long,
        value_name = "PORT",
        allow_hyphen_values = true,
        help_heading = "kube-proxy flags"
    )]
    pub metrics_port: Option<String>,

    /// IPVS mode only (parsed, then ignored as upstream does in the other modes). [ipvs.syncPeriod]
    #[arg(
        long,
        value_name = "DURATION",
        allow_hyphen_values = true,
        help_heading = "kube-proxy flags"
    )]
    pub ipvs_sync_period: Option<String>,

    /// IPVS mode only (parsed, then ignored). [ipvs.minSyncPeriod]
    #[arg(
        long,
        value_name = "DURATION",
        allow_hyphen_values = true,
        help_heading = "kube-proxy flags"
    )]
    pub ipvs_min_sync_period: Option<String>,

    /// IPVS mode only (kept in the file). [ipvs.scheduler]
    #[arg(long, value_name = "NAME", help_heading = "kube-proxy flags")]
    pub ipvs_scheduler: Option<String>,

    /// IPVS mode only (kept in the file). [ipvs.excludeCIDRs]
    #[arg(
        long,
        value_name = "CIDRS",
        value_delimiter = ',',
        help_heading = "kube-proxy flags"
    )]
    pub ipvs_exclude_cidrs: Option<Vec<String>>,

    /// IPVS mode only (kept in the file). [ipvs.strictARP]
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true,
          default_missing_value = "true", help_heading = "kube-proxy flags")]
    pub ipvs_strict_arp: Option<String>,

    /// IPVS mode only (kept in the file). [ipvs.tcpTimeout]
    #[arg(
        long,
        value_name = "DURATION",
        allow_hyphen_values = true,
        help_heading = "kube-proxy flags"
    )]
    pub ipvs_tcp_timeout: Option<String>,

    /// IPVS mode only (kept in the file). [ipvs.tcpFinTimeout]
    #[arg(
        long,
        value_name = "DURATION",
        allow_hyphen_values = true,
        help_heading = "kube-proxy flags"
    )]
    pub ipvs_tcpfin_timeout: Option<String>,

    /// IPVS mode only (kept in the file). [ipvs.udpTimeout]
    #[arg(
        long,
        value_name = "DURATION",
        allow_hyphen_values = true,
        help_heading = "kube-proxy flags"
    )]
    pub ipvs_udp_timeout: Option<String>,

    /// Maximum time between log flushes (kept in the file; our logs are not buffered).
    /// [logging.flushFrequency]
    #[arg(
        long,
        value_name = "DURATION",
        allow_hyphen_values = true,
        help_heading = "kube-proxy flags"
    )]
    pub log_flush_frequency: Option<String>,

    /// klog's per-file verbosity, `pattern=N,...` (validated, kept in the file; not applied:
    /// the patterns name Go source files). [logging.vmodule]
    #[arg(long, value_name = "PATTERN=N,...", help_heading = "kube-proxy flags")]
    pub vmodule: Option<String>,

    /// [logging.options.text.splitStream] (accepted with a warning).
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true,
          default_missing_value = "true", help_heading = "kube-proxy flags")]
    pub log_text_split_stream: Option<String>,

    /// [logging.options.text.infoBufferSize] (accepted with a warning).
    #[arg(long, value_name = "QUANTITY", help_heading = "kube-proxy flags")]
    pub log_text_info_buffer_size: Option<String>,

    /// [logging.options.json.splitStream] (accepted with a warning).
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true,
          default_missing_value = "true", help_heading = "kube-proxy flags")]
    pub log_json_split_stream: Option<String>,

    /// [logging.options.json.infoBufferSize] (accepted with a warning).
    #[arg(long, value_name = "QUANTITY", help_heading = "kube-proxy flags")]
    pub log_json_info_buffer_size: Option<String>,

    /// Log format: 'text' (default) or 'json'. [logging.format]
    #[arg(
        long,
        value_enum,
        default_value = "text",
        help_heading = "kube-proxy flags"
    )]
    pub logging_format: LoggingFormat,

    // ----- our additions -----
    /// Standalone mode: read Service, EndpointSlice and Node objects from the multi-document
    /// YAML files (*.yaml, *.yml) in DIR, re-read on change.
    #[arg(long, value_name = "DIR", help_heading = "kubeproxy-rs additions")]
    pub manifests: Option<PathBuf>,

    /// The cgroup2 directory the socket programs attach to (default: the cgroup2 mount point
    /// from /proc/mounts, i.e. every process on the node).
    #[arg(long, value_name = "PATH", help_heading = "kubeproxy-rs additions")]
    pub cgroup_path: Option<PathBuf>,

    /// A bpffs mount (mounted if needed); maps are pinned in <bpf-root>/kubeproxy-rs/
    /// (default /sys/fs/bpf).
    #[arg(long, value_name = "PATH", help_heading = "kubeproxy-rs additions")]
    pub bpf_root: Option<PathBuf>,

    /// Capacity of the frontend map (default 65536).
    #[arg(
        long,
        value_name = "N",
        allow_hyphen_values = true,
        help_heading = "kubeproxy-rs additions"
    )]
    pub bpf_map_frontends: Option<String>,

    /// Most frontend map entries one Service may take (default 32768): a tenant's Service with
    /// thousands of ports or addresses cannot fill the map for everyone.
    #[arg(
        long,
        value_name = "N",
        allow_hyphen_values = true,
        help_heading = "kubeproxy-rs additions"
    )]
    pub bpf_max_frontends_per_service: Option<String>,

    /// Most endpoints one Service port is programmed with, per family (default and most
    /// 65535): a Service with more is programmed with the first N by address and port, the same
    /// on every node, and a WARN names it.
    #[arg(
        long,
        value_name = "N",
        allow_hyphen_values = true,
        help_heading = "kubeproxy-rs additions"
    )]
    pub bpf_max_endpoints_per_service: Option<String>,

    /// Capacity of the backend and backend-slot maps (default 262144).
    #[arg(
        long,
        value_name = "N",
        allow_hyphen_values = true,
        help_heading = "kubeproxy-rs additions"
    )]
    pub bpf_map_backends: Option<String>,

    /// Capacity of the tc conntrack map in entries (two per external flow, four with SNAT on
    /// the netfilter path; default: with the other LRU maps, see --bpf-map-dynamic-size-ratio).
    /// LRU: when full, the least recently used flows are evicted. A size given here that
    /// differs from the pinned map's replaces that map at start (tracked flows are lost).
    #[arg(
        long,
        value_name = "N",
        allow_hyphen_values = true,
        help_heading = "kubeproxy-rs additions"
    )]
    pub bpf_map_conntrack: Option<String>,

    /// Share of the node's memory (MemTotal) given to the preallocated LRU maps: tc conntrack
    /// (60 %), socket reverse NAT (10 % per family), session affinity and per-socket UDP
    /// choice (10 % each), each at least 64k (conntrack) or 16k entries (as Cilium's flag of
    /// the same name; 0: fixed sizes of 262144 conntrack and reverse-NAT entries, 65536
    /// others). Unset, the maps are sized from the conntrack table kube-proxy would set
    /// (conntrack.maxPerCore × CPUs, at least conntrack.min), or with 0.0025 when maxPerCore
    /// is 0. Pinned maps keep their size across restarts.
    #[arg(
        long,
        value_name = "RATIO",
        allow_hyphen_values = true,
        help_heading = "kubeproxy-rs additions"
    )]
    pub bpf_map_dynamic_size_ratio: Option<String>,

    /// Source ports of external Service traffic SNATed to the node address (eTP Cluster),
    /// MIN-MAX (default 49152-65535). The agent reserves them from the node's ephemeral ports
    /// (net.ipv4.ip_local_reserved_ports) at start, so the node's own connections never take
    /// one; --cleanup releases them. A client's own source port is kept when it lies in the
    /// range and is free.
    #[arg(
        long,
        value_name = "MIN-MAX",
        allow_hyphen_values = true,
        help_heading = "kubeproxy-rs additions"
    )]
    pub bpf_snat_port_range: Option<String>,

    /// Capacity of the Maglev table map in blocks of 16 slots (default 65536: 1024 external
    /// frontends with 1021-slot tables). Only allocated with --lb-algorithm maglev.
    #[arg(
        long,
        value_name = "N",
        allow_hyphen_values = true,
        help_heading = "kubeproxy-rs additions"
    )]
    pub bpf_map_maglev: Option<String>,

    /// How often the agent compares the kernel's state with what it wrote and repairs what
    /// differs (eBPF: every entry of the service maps; iptables: the canary and the chains it writes), as a Go
    /// duration (default 30s; 0s turns the check off). `proxy-agent inspect drift` runs the
    /// same check without repairing.
    #[arg(
        long,
        value_name = "DURATION",
        allow_hyphen_values = true,
        help_heading = "kubeproxy-rs additions"
    )]
    pub drift_check_period: Option<String>,

    /// Most per-Service traffic series (`kubeproxy_rs_service_*`: one per Service port,
    /// protocol and frontend kind) the metrics export; Service ports beyond it are counted in
    /// `kubeproxy_rs_service_traffic_series_capped`, not exported (default 5000; 0 turns the
    /// per-Service metrics off).
    #[arg(
        long,
        value_name = "COUNT",
        allow_hyphen_values = true,
        help_heading = "kubeproxy-rs additions"
    )]
    pub service_traffic_max_series: Option<String>,

    /// Also count each endpoint's new connections (`kubeproxy_rs_endpoint_new_connections`),
    /// to see how a Service's load is spread; one series per endpoint, within
    /// --service-traffic-max-series.
    #[arg(long, help_heading = "kubeproxy-rs additions")]
    pub service_traffic_endpoints: bool,

    /// How long an agent in iptables mode that finds the eBPF mode's programs on the node (a
    /// switch from eBPF to iptables) keeps them for the connections they carry: they translate
    /// only their established flows (new connections get the iptables rules) and are removed
    /// as soon as no flow of theirs is live, at the latest after this Go duration (default
    /// 10m; 0s removes them at the first sync, cutting those connections).
    #[arg(
        long,
        value_name = "DURATION",
        allow_hyphen_values = true,
        help_heading = "kubeproxy-rs additions"
    )]
    pub mode_switch_drain_period: Option<String>,

    /// Backend choice for new external flows (tc: NodePort, externalIPs, LoadBalancer IPs,
    /// ClusterIPs from outside): 'random' (default) or 'maglev' (consistent hashing of the
    /// 5-tuple, so a change of backends moves few flows). Socket-level load balancing of local
    /// clients is always random.
    #[arg(
        long,
        value_name = "ALGORITHM",
        allow_hyphen_values = true,
        help_heading = "kubeproxy-rs additions"
    )]
    pub lb_algorithm: Option<String>,

    /// Slots of each external frontend's Maglev table, a prime (default 1021); more slots
    /// spread backends more evenly and move fewer flows, at 4 bytes (plus map overhead) each.
    #[arg(
        long,
        value_name = "PRIME",
        allow_hyphen_values = true,
        help_heading = "kubeproxy-rs additions"
    )]
    pub bpf_maglev_table_size: Option<String>,

    /// Interfaces that get the external tc programs, comma-separated (default: every interface
    /// that is up with a global unicast address, except container bridges, tunnels, TUN/TAP and
    /// dummies).
    #[arg(
        long,
        value_name = "NAMES",
        value_delimiter = ',',
        help_heading = "kubeproxy-rs additions"
    )]
    pub interfaces: Option<Vec<String>>,

    /// Whether external Service traffic (NodePort, LB IPs, externalIPs) to pods skips the
    /// host's netfilter FORWARD and POSTROUTING (translated and redirected in tc, and in XDP
    /// with --bpf-xdp auto): faster, but the host's forwarding rules no longer apply to it.
    /// auto (default): only while the node has no forwarding policy (every FORWARD chain and
    /// nftables forward hook accepts everything, unconditionally); the agent watches the
    /// rulesets and returns to the netfilter path as soon as one appears. true (or the flag
    /// alone): always; false: never.
    #[arg(long, value_name = "auto|BOOL", num_args = 0..=1, require_equals = true,
          default_missing_value = "true", help_heading = "kubeproxy-rs additions")]
    pub tc_fast_path: Option<String>,

    /// XDP on the external interfaces: established fast-path flows (--tc-fast-path) are
    /// translated and redirected in the network driver, before the kernel allocates a packet
    /// buffer; everything else goes on to the tc programs. auto (default): native XDP where
    /// the driver has it, while the fast path is taken (--tc-fast-path); native: also without
    /// it (only flows that bypass netfilter anyway), warning where a driver refuses; off.
    #[arg(
        long,
        value_name = "MODE",
        allow_hyphen_values = true,
        help_heading = "kubeproxy-rs additions"
    )]
    pub bpf_xdp: Option<String>,

    /// Socket-level load balancing only for processes of the node's own network namespace
    /// (Cilium's socketLB.hostNamespaceOnly): pods' sockets keep the Service address they
    /// dialled and their packets are load-balanced per packet by the tc program on the host
    /// side of their interfaces, so a service-mesh sidecar (Istio, Linkerd) that captures by
    /// Service address sees it. Costs per-packet work on pod traffic to Services.
    #[arg(long, help_heading = "kubeproxy-rs additions")]
    pub bpf_socket_lb_host_namespace_only: bool,

    /// Kernel features not to use even when the kernel has them, comma-separated: tcx (tc
    /// programs then attach as legacy clsact filters), set-retval (refused connects fail with
    /// EPERM), socket-destroy (connected UDP sockets of removed backends are not aborted), btf.
    /// For running the degraded paths of older kernels; `proxy-agent inspect features` shows
    /// the choice.
    #[arg(
        long,
        value_name = "FEATURES",
        value_delimiter = ',',
        help_heading = "kubeproxy-rs additions"
    )]
    pub bpf_disable_feature: Option<Vec<String>>,
}

/// `--logging-format`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LoggingFormat {
    #[default]
    Text,
    Json,
}

impl Args {
    /// For `inspect` when the configuration does not load: only what `inspect` reads (where
    /// the pins are, where the agent's metrics server listens), everything else at its
    /// default. A broken configuration is when one needs `inspect` most.
    pub fn inspect_fallback(&self) -> Self {
        Self {
            bpf_root: self.bpf_root.clone(),
            metrics_bind_address: self.metrics_bind_address.clone(),
            command: self.command.clone(),
            ..Self::default()
        }
    }
}

#[derive(Debug, Clone, clap::Subcommand)]
pub enum Command {
    /// Show the datapath of the agent running on this node: the pinned BPF maps in eBPF mode,
    /// the nat table in iptables mode. Uses --bpf-root and --metrics-bind-address (for names).
    Inspect(InspectArgs),
}

#[derive(Debug, Clone, clap::Args)]
pub struct InspectArgs {
    #[arg(value_enum, default_value = "services")]
    pub what: InspectWhat,
    /// Output format: `table` for people, `json` (typed values) for machines.
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    pub output: InspectOutput,
    /// Same as `-o json`.
    #[arg(long)]
    pub json: bool,
    /// `explain`: where the client is (node, pod or external).
    #[arg(long, value_name = "WHERE", default_value = "node")]
    pub from: String,
    /// `explain`: the client's address (default: none for node/pod, required for external).
    #[arg(long, value_name = "IP")]
    pub client: Option<std::net::IpAddr>,
    /// `explain`: the destination, `IP:PORT/PROTO` (PROTO tcp, udp or sctp; IPv6 as [IP]:PORT).
    #[arg(long, value_name = "IP:PORT/PROTO")]
    pub to: Option<String>,
    /// `explain`: the client's source port (completes the tuple: conntrack, Maglev).
    #[arg(long, value_name = "PORT")]
    pub sport: Option<u16>,
    /// `top`: time between readings, in seconds (`2`, `0.5`) or with a unit (`2s`, `500ms`).
    #[arg(long, value_name = "DURATION", default_value = "2s")]
    pub interval: String,
    /// `top`: the order of the rows (interactive keys change it).
    #[arg(long, value_enum, default_value = "new")]
    pub sort: TopSort,
    /// `top`: print frames as plain text to stdout, no keys (like `top -b`); also taken when
    /// stdout or stdin is not a terminal.
    #[arg(long)]
    pub batch: bool,
    /// `top`: stop after this many frames (the first one is the baseline, without rates).
    #[arg(long, value_name = "N")]
    pub iterations: Option<u64>,
    /// `counters`: only the reasons for which packets were dropped, rejected or passed on
    /// untranslated (action `dropped`, `rejected`, `passed_untranslated`).
    #[arg(long)]
    pub drops: bool,
}

/// `inspect top`'s orders: by the rate of one count (then its total), or by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TopSort {
    /// New connections per second.
    New,
    /// Rejected connections per second (Services without endpoints).
    Rejected,
    /// Dropped connections per second (source ranges, no local endpoint).
    Dropped,
    /// Namespace, name, port, protocol, frontend.
    Name,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum InspectOutput {
    Table,
    Json,
}

impl InspectArgs {
    /// Whether JSON was asked for (`-o json` or `--json`).
    pub fn json(&self) -> bool {
        self.json || self.output == InspectOutput::Json
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum InspectWhat {
    /// Frontends (service address, NodePort, …) with their Service and backends.
    Services,
    /// Datapath counters by reason, with what the datapath did (dropped, rejected, passed
    /// untranslated, translated, other), drops first (--drops: only those).
    Counters,
    /// Backend ids and addresses, with the service ids whose live slots use them.
    Backends,
    /// Session affinity entries (client, service, backend, idle time).
    Affinity,
    /// The tc programs' BPF conntrack (one entry per direction: match → rewrite).
    Conntrack,
    /// The decision the datapath would take for one client and destination, and why
    /// (--from, --client, --to, --sport).
    Explain,
    /// What differs between the kernel's state and what the agent wrote (asks the running
    /// agent over --metrics-bind-address; nothing is repaired).
    Drift,
    /// Which interface runs which program: XDP, tc ingress, tc egress (from the agent's
    /// link pins).
    Interfaces,
    /// The kernel features the eBPF dataplane can use, which it uses with these flags
    /// (--bpf-disable-feature), and which the running agent reports using.
    Features,
    /// A live view of the busiest Service ports, refreshed every --interval: new, rejected and
    /// dropped connections per second and since the view started (--sort, --batch,
    /// --iterations; keys n, r, d, s, q).
    Top,
}
