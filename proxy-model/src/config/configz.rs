//! `/configz`: component-base's configz handler writes `json.Marshal` of every registered
//! config; kube-proxy registers its *internal* `KubeProxyConfiguration`
//! (pkg/proxy/apis/config/types.go) under `kubeproxy.config.k8s.io`. Internal types have no
//! JSON tags, so the keys are Go's field names (`IPTables.MasqueradeBit`, `Linux.Conntrack`…);
//! `Logging` is component-base's logs API type, which has tags. Durations are metav1.Duration
//! strings, pointers that are unset `null`.
//!
//! The object is built from the effective file document the way upstream's v1alpha1 → internal
//! conversion moves fields (conntrack, oomScoreAdj and masqueradeAll under `Linux`, the sync
//! periods of the mode's section at the top, `clusterCIDR` split into `DetectLocal.ClusterCIDRs`),
//! keys in Go's struct field order.

use serde::ser::{Serialize, SerializeMap as _, Serializer};
use serde_json::{Value, json};

use super::file::KubeProxyConfiguration;

/// The group name kube-proxy registers its configz under.
pub const GROUP: &str = "kubeproxy.config.k8s.io";

fn to_value<T: serde::Serialize>(value: &T) -> Value {
    serde_json::to_value(value).unwrap_or(Value::Null)
}

/// A JSON object whose keys keep the order given (serde_json's map sorts them).
enum Json {
    Value(Value),
    Object(Vec<(&'static str, Json)>),
}

impl Serialize for Json {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Json::Value(value) => value.serialize(serializer),
            Json::Object(fields) => {
                let mut map = serializer.serialize_map(Some(fields.len()))?;
                for (key, value) in fields {
                    map.serialize_entry(key, value)?;
                }
                map.end()
            }
        }
    }
}

/// An object's fields in the order of `keys` (fields not listed are dropped: `internal` builds
/// exactly these); anything else is kept as it is.
fn order(value: Value, keys: &[&'static str]) -> Json {
    let Value::Object(mut map) = value else {
        return Json::Value(value);
    };
    Json::Object(
        keys.iter()
            .filter_map(|key| map.remove(*key).map(|child| (*key, Json::Value(child))))
            .collect(),
    )
}

/// Go's field order of the internal types (pkg/proxy/apis/config/types.go, component-base's
/// ClientConnectionConfiguration and logs API): the top level first, then per nested object.
const ORDER: &[(&str, &[&str])] = &[
    (
        "",
        &[
            "Linux",
            "Windows",
            "FeatureGates",
            "ClientConnection",
            "Logging",
            "HostnameOverride",
            "BindAddress",
            "HealthzBindAddress",
            "MetricsBindAddress",
            "BindAddressHardFail",
            "EnableProfiling",
            "ShowHiddenMetricsForVersion",
            "Mode",
            "IPTables",
            "IPVS",
            "Winkernel",
            "NFTables",
            "DetectLocalMode",
            "DetectLocal",
            "NodePortAddresses",
            "SyncPeriod",
            "MinSyncPeriod",
            "ConfigSyncPeriod",
        ],
    ),
    ("Linux", &["Conntrack", "MasqueradeAll", "OOMScoreAdj"]),
    ("Windows", &["RunAsService"]),
    (
        "ClientConnection",
        &[
            "Kubeconfig",
            "AcceptContentTypes",
            "ContentType",
            "QPS",
            "Burst",
        ],
    ),
    (
        "Logging",
        &[
            "format",
            "flushFrequency",
            "verbosity",
            "vmodule",
            "options",
        ],
    ),
    ("IPTables", &["MasqueradeBit", "LocalhostNodePorts"]),
    (
        "IPVS",
        &[
            "Scheduler",
            "ExcludeCIDRs",
            "StrictARP",
            "TCPTimeout",
            "TCPFinTimeout",
            "UDPTimeout",
        ],
    ),
    (
        "Winkernel",
        &[
            "NetworkName",
            "SourceVip",
            "EnableDSR",
            "RootHnsEndpointName",
            "ForwardHealthCheckVip",
        ],
    ),
    ("NFTables", &["MasqueradeBit"]),
    (
        "DetectLocal",
        &["BridgeInterface", "ClusterCIDRs", "InterfaceNamePrefix"],
    ),
];

/// Objects two levels down: (parent, field, its keys in Go's order).
const NESTED: &[(&str, &str, &[&str])] = &[
    (
        "Linux",
        "Conntrack",
        &[
            "MaxPerCore",
            "Min",
            "TCPEstablishedTimeout",
            "TCPCloseWaitTimeout",
            "TCPBeLiberal",
            "UDPTimeout",
            "UDPStreamTimeout",
        ],
    ),
    ("Logging", "options", &["text", "json"]),
];

/// Orders the top level and each nested object of [`internal`]'s value.
fn in_go_order(value: Value) -> Json {
    let (_, top_keys) = ORDER[0];
    let Json::Object(mut fields) = order(value, top_keys) else {
        return Json::Object(Vec::new());
    };
    for (key, child) in &mut fields {
        let Some(&(_, keys)) = ORDER.iter().skip(1).find(|(name, _)| name == key) else {
            continue;
        };
        let Json::Value(value) = child else {
            continue;
        };
        let mut nested = order(value.take(), keys);
        if let Json::Object(inner) = &mut nested {
            for (field, grandchild) in inner.iter_mut() {
                let grand_keys = NESTED
                    .iter()
                    .find(|(parent, name, _)| parent == key && name == field)
                    .map(|(_, _, keys)| *keys);
                if let (Some(grand_keys), Json::Value(value)) = (grand_keys, &mut *grandchild) {
                    *grandchild = order(value.take(), grand_keys);
                }
            }
        }
        *child = nested;
    }
    Json::Object(fields)
}

/// component-base's logs API object as Go marshals it: `format` and `vmodule` omitted when
/// empty, `options` always there with both formats (`infoBufferSize` is a quantity, "0" unset;
/// `splitStream` only when true).
fn logging(logging: &super::file::Logging) -> Value {
    let mut value = to_value(logging);
    let routing = |routing: &super::file::OutputRouting| {
        let mut out = serde_json::Map::new();
        if routing.split_stream {
            out.insert("splitStream".to_owned(), Value::Bool(true));
        }
        out.insert(
            "infoBufferSize".to_owned(),
            Value::String(
                routing
                    .info_buffer_size
                    .clone()
                    .unwrap_or_else(|| "0".to_owned()),
            ),
        );
        Value::Object(out)
    };
    if let Value::Object(map) = &mut value {
        map.insert(
            "options".to_owned(),
            json!({ "text": routing(&logging.options.text), "json": routing(&logging.options.json) }),
        );
    }
    value
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
        "Logging": logging(&doc.logging),
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

/// The `/configz` body: `{"kubeproxy.config.k8s.io": {…}}`, keys in Go's order.
pub fn body(doc: &KubeProxyConfiguration) -> String {
    let wrapped = Json::Object(vec![(GROUP, in_go_order(internal(doc)))]);
    serde_json::to_string(&wrapped).unwrap_or_else(|_| "{}".to_owned())
}

#[cfg(test)]
mod tests {
    use crate::cli::Args;
    use clap::Parser as _;

    #[test]
    fn defaults_in_upstreams_internal_shape_and_field_order() {
        let loaded = crate::config::load(&Args::parse_from([
            "proxy-agent",
            "--proxy-mode",
            "iptables",
        ]))
        .unwrap();
        let body = &loaded.config.configz;
        let expected = concat!(
            r#"{"kubeproxy.config.k8s.io":{"Linux":{"Conntrack":{"MaxPerCore":32768,"Min":131072,"#,
            r#""TCPEstablishedTimeout":"24h0m0s","TCPCloseWaitTimeout":"1h0m0s","TCPBeLiberal":false,"#,
            r#""UDPTimeout":"0s","UDPStreamTimeout":"0s"},"MasqueradeAll":false,"OOMScoreAdj":-999},"#,
            r#""Windows":{"RunAsService":false},"FeatureGates":{},"#,
            r#""ClientConnection":{"Kubeconfig":"","AcceptContentTypes":"","#,
            r#""ContentType":"application/vnd.kubernetes.protobuf","QPS":5,"Burst":10},"#,
            r#""Logging":{"format":"text","flushFrequency":"5s","verbosity":0,"#,
            r#""options":{"text":{"infoBufferSize":"0"},"json":{"infoBufferSize":"0"}}},"#,
            r#""HostnameOverride":"","BindAddress":"0.0.0.0","HealthzBindAddress":"0.0.0.0:10256","#,
            r#""MetricsBindAddress":"127.0.0.1:10249","BindAddressHardFail":false,"EnableProfiling":false,"#,
            r#""ShowHiddenMetricsForVersion":"","Mode":"iptables","#,
            r#""IPTables":{"MasqueradeBit":14,"LocalhostNodePorts":true},"#,
            r#""IPVS":{"Scheduler":"","ExcludeCIDRs":null,"StrictARP":false,"TCPTimeout":"0s","#,
            r#""TCPFinTimeout":"0s","UDPTimeout":"0s"},"#,
            r#""Winkernel":{"NetworkName":"","SourceVip":"","EnableDSR":false,"RootHnsEndpointName":"","#,
            r#""ForwardHealthCheckVip":false},"NFTables":{"MasqueradeBit":14},"#,
            r#""DetectLocalMode":"ClusterCIDR","#,
            r#""DetectLocal":{"BridgeInterface":"","ClusterCIDRs":null,"InterfaceNamePrefix":""},"#,
            r#""NodePortAddresses":null,"SyncPeriod":"30s","MinSyncPeriod":"1s","ConfigSyncPeriod":"15m0s"}}"#,
        );
        assert_eq!(body, expected);
    }
}
