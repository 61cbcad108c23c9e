//! The configuration → each dataplane's options, in one place.

use proxy_dataplane_ebpf::maps::map_sizes::{self, LruBudget};
use proxy_dataplane_ebpf::{EbpfOptions, LbOptions, TcOptions};
use proxy_dataplane_iptables::{DetectLocalMode, IptablesConfig};
use proxy_model::config::{Config, DetectLocal, LbAlgorithm, NodePortAddresses};

/// The NodePort addresses known from the configuration alone. `primary` is resolved from the
/// Node object by the node settings, which replace these before the first sync.
fn node_port_cidrs(config: &Config) -> Vec<ipnet::IpNet> {
    match &config.node_port_addresses {
        NodePortAddresses::Cidrs(cidrs) => cidrs.clone(),
        NodePortAddresses::All | NodePortAddresses::Primary(_) => Vec::new(),
    }
}

/// What the LRU maps are sized from: an explicit `--bpf-map-dynamic-size-ratio`, else the
/// conntrack table kube-proxy would size (so a node gets the flow capacity its conntrack
/// settings ask for, whatever its memory), else (maxPerCore 0: kube-proxy leaves the
/// kernel's table, which the kernel sizes from memory) the default share of memory.
fn lru_budget(config: &Config) -> LruBudget {
    if let Some(ratio) = config.ebpf.map_dynamic_size_ratio {
        return LruBudget::MemoryShare(ratio);
    }
    let cpus = proxy_kernel::conntrack::machine_cpus(std::path::Path::new("/sys"));
    match proxy_kernel::conntrack::table_size(
        config.conntrack.max_per_core,
        config.conntrack.min,
        cpus,
    ) {
        Some(flows) => LruBudget::ConntrackTable(flows),
        None => LruBudget::MemoryShare(map_sizes::DEFAULT_DYNAMIC_SIZE_RATIO),
    }
}

pub fn ebpf_options(config: &Config) -> EbpfOptions {
    EbpfOptions {
        cgroup_path: config.ebpf.cgroup_path.clone(),
        bpf_root: config.ebpf.bpf_root.clone(),
        frontends_capacity: config.ebpf.map_frontends,
        max_frontends_per_service: config.ebpf.max_frontends_per_service,
        max_endpoints_per_service: config.ebpf.max_endpoints_per_service,
        backends_capacity: config.ebpf.map_backends,
        conntrack_capacity: config.ebpf.map_conntrack,
        lru_budget: lru_budget(config),
        lb: LbOptions {
            maglev: config.ebpf.lb_algorithm == LbAlgorithm::Maglev,
            maglev_table_size: config.ebpf.maglev_table_size,
            maglev_capacity: config.ebpf.map_maglev,
        },
        tc: TcOptions {
            interfaces: config.ebpf.interfaces.clone(),
            node_port_cidrs: node_port_cidrs(config),
            cluster_cidrs: config.cluster_cidrs.clone(),
            masquerade_all: config.masquerade_all,
            localhost_node_ports: config.iptables.localhost_node_ports,
            // `auto` is decided from the node's rulesets (`crate::fast_path::start`), which
            // replaces this before the dataplane starts.
            fast_path: config.ebpf.tc_fast_path
                == proxy_model::config::ebpf_settings::FastPathSetting::On,
            xdp: config.ebpf.xdp,
            host_namespace_only: config.ebpf.socket_lb_host_namespace_only,
            // The per-Service metrics are off: no packet is counted for them.
            packet_counts_off: config.ebpf.service_traffic_max_series == 0,
            endpoint_counts: config.ebpf.service_traffic_endpoints
                && config.ebpf.service_traffic_max_series > 0,
            // The probe decides (`EbpfDataplane::start`).
            tcx: true,
        },
        disabled_features: config.ebpf.disabled_features.clone(),
        icmp_ratelimit: None,
        snat_ports: config.ebpf.snat_ports.clone(),
    }
}

pub fn iptables_config(config: &Config) -> IptablesConfig {
    IptablesConfig {
        masquerade_bit: config.iptables.masquerade_bit,
        masquerade_all: config.masquerade_all,
        detect_local: match &config.detect_local {
            DetectLocal::ClusterCidr => DetectLocalMode::ClusterCidr(config.cluster_cidrs.clone()),
            // The Node's podCIDRs come with the node settings, before the first sync.
            DetectLocal::NodeCidr => DetectLocalMode::NodeCidr(Vec::new()),
            DetectLocal::BridgeInterface(name) => DetectLocalMode::BridgeInterface(name.clone()),
            DetectLocal::InterfaceNamePrefix(prefix) => {
                DetectLocalMode::InterfaceNamePrefix(prefix.clone())
            }
        },
        node_port_addresses: node_port_cidrs(config),
        localhost_node_ports: config.iptables.localhost_node_ports,
        sync_period: config.sync_period,
        min_sync_period: config.min_sync_period,
        ..IptablesConfig::default()
    }
}
