//! `/configz`: component-base's configz handler writes `json.Marshal` of every registered
//! config; kube-proxy registers its *internal* `KubeProxyConfiguration`
//! (pkg/proxy/apis/config/types.go) under `kubeproxy.config.k8s.io`. Internal types have no
//! JSON tags, so the keys are Go's field names (`IPTables.MasqueradeBit`, `Linux.Conntrack`…);
//! `Logging` is component-base's logs API type, which has tags. Durations are metav1.Duration
//! strings, pointers that are unset `null`.
//!
//! The object is built from the effective file document the way upstream's v1alpha1 → internal
//! conversion moves fields (conntrack, oomScoreAdj and masqueradeAll under `Linux`, the sync
//! periods of the mode's section at the top, `clusterCIDR` split into `DetectLocal.ClusterCIDRs`).

use serde_json::{Value, json};

use super::file::KubeProxyConfiguration;

/// The group name kube-proxy registers its configz under.
pub const GROUP: &str = "kubeproxy.config.k8s.io";

fn to_value<T: serde::Serialize>(value: &T) -> Value {
    serde_json::to_value(value).unwrap_or(Value::Null)
}

/// The internal configuration object (without the group wrapper).
pub fn internal(doc: &KubeProxyConfiguration) -> Value {
    let cluster_cidrs = if doc.cluster_cidr.is_empty() {
        Value::Null
    } else {
        to_value(&doc.cluster_cidr.split(',').collect::<Vec<_>>())
    };
    // v1alpha1 → internal: the periods of the section of the mode in use.
    let (sync_period, min_sync_period) = match doc.mode.as_str() {
        "ipvs" => (&doc.ipvs.sync_period, &doc.ipvs.min_sync_period),
        "nftables" => (&doc.nftables.sync_period, &doc.nftables.min_sync_period),
        _ => (&doc.iptables.sync_period, &doc.iptables.min_sync_period),
    };
    let masquerade_all = if doc.mode == "nftables" {
        doc.nftables.masquerade_all
    } else {
        doc.iptables.masquerade_all
    };
    json!({
        "Linux": {
            "Conntrack": {
                "MaxPerCore": doc.conntrack.max_per_core,
                "Min": doc.conntrack.min,
                "TCPEstablishedTimeout": to_value(&doc.conntrack.tcp_established_timeout),
                "TCPCloseWaitTimeout": to_value(&doc.conntrack.tcp_close_wait_timeout),
                "TCPBeLiberal": doc.conntrack.tcp_be_liberal,
                "UDPTimeout": to_value(&doc.conntrack.udp_timeout),
                "UDPStreamTimeout": to_value(&doc.conntrack.udp_stream_timeout),
            },
            "MasqueradeAll": masquerade_all,
            "OOMScoreAdj": doc.oom_score_adj,
        },
        "Windows": { "RunAsService": doc.windows_run_as_service },
        "FeatureGates": to_value(&doc.feature_gates),
        "ClientConnection": {
            "Kubeconfig": doc.client_connection.kubeconfig,
            "AcceptContentTypes": doc.client_connection.accept_content_types,
            "ContentType": doc.client_connection.content_type,
            "QPS": to_value(&doc.client_connection).get("qps").cloned().unwrap_or(Value::Null),
            "Burst": doc.client_connection.burst,
        },
        "Logging": to_value(&doc.logging),
        "HostnameOverride": doc.hostname_override,
        "BindAddress": doc.bind_address,
        "HealthzBindAddress": doc.healthz_bind_address,
        "MetricsBindAddress": doc.metrics_bind_address,
        "BindAddressHardFail": doc.bind_address_hard_fail,
        "EnableProfiling": doc.enable_profiling,
        "ShowHiddenMetricsForVersion": doc.show_hidden_metrics_for_version,
        "Mode": doc.mode,
        "IPTables": {
            "MasqueradeBit": doc.iptables.masquerade_bit,
            "LocalhostNodePorts": doc.iptables.localhost_node_ports,
        },
        "IPVS": {
            "Scheduler": doc.ipvs.scheduler,
            "ExcludeCIDRs": doc.ipvs.exclude_cidrs,
            "StrictARP": doc.ipvs.strict_arp,
            "TCPTimeout": to_value(&doc.ipvs.tcp_timeout),
            "TCPFinTimeout": to_value(&doc.ipvs.tcp_fin_timeout),
            "UDPTimeout": to_value(&doc.ipvs.udp_timeout),
        },
        "Winkernel": {
            "NetworkName": doc.winkernel.network_name,
            "SourceVip": doc.winkernel.source_vip,
            "EnableDSR": doc.winkernel.enable_dsr,
            "RootHnsEndpointName": doc.winkernel.root_hns_endpoint_name,
            "ForwardHealthCheckVip": doc.winkernel.forward_health_check_vip,
        },
        "NFTables": { "MasqueradeBit": doc.nftables.masquerade_bit },
        "DetectLocalMode": doc.detect_local_mode,
        "DetectLocal": {
            "BridgeInterface": doc.detect_local.bridge_interface,
            "ClusterCIDRs": cluster_cidrs,
            "InterfaceNamePrefix": doc.detect_local.interface_name_prefix,
        },
        "NodePortAddresses": doc.node_port_addresses,
        "SyncPeriod": to_value(sync_period),
        "MinSyncPeriod": to_value(min_sync_period),
        "ConfigSyncPeriod": to_value(&doc.config_sync_period),
    })
}

/// The `/configz` body: `{"kubeproxy.config.k8s.io": {…}}`.
pub fn body(doc: &KubeProxyConfiguration) -> String {
    json!({ GROUP: internal(doc) }).to_string()
}
