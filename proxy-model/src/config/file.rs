//! The configuration file: kube-proxy's `KubeProxyConfiguration`
//! (`kubeproxy.config.k8s.io/v1alpha1`, staging/src/k8s.io/kube-proxy/config/v1alpha1/types.go),
//! as YAML or JSON.
//!
//! Every upstream field is modelled, including the ones only other modes or Windows read, so any
//! file kube-proxy accepts (e.g. the ConfigMap kubeadm writes, with its `null`s) is accepted
//! here; unknown fields are errors at every level. Field order is alphabetical because that is
//! how kube-proxy's `--write-config-to` writes them. Fields that are pointers in Go are
//! `Option`s (unset and `null` mean "use the default"); the others take `null` as their zero
//! value, as Go's JSON decoder does.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize, de};

use super::duration::GoDuration;

pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
pub const KIND: &str = "KubeProxyConfiguration";

/// `null` → the type's zero value (Go leaves a non-pointer field untouched on `null`).
fn nullable<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// Go's encoding writes a whole float32 without a fraction (`qps: 5`).
fn go_float<S: serde::Serializer>(value: &f32, serializer: S) -> Result<S::Ok, S::Error> {
    #[expect(
        clippy::cast_possible_truncation,
        reason = "only taken when the value is whole and small"
    )]
    if value.fract() == 0.0 && value.abs() < 1e15 {
        serializer.serialize_i64(*value as i64)
    } else {
        serializer.serialize_f32(*value)
    }
}

fn is_false(value: &bool) -> bool {
    !*value
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct KubeProxyConfiguration {
    #[serde(deserialize_with = "nullable")]
    pub api_version: String,
    #[serde(deserialize_with = "nullable")]
    pub bind_address: String,
    #[serde(deserialize_with = "nullable")]
    pub bind_address_hard_fail: bool,
    #[serde(deserialize_with = "nullable")]
    pub client_connection: ClientConnection,
    #[serde(rename = "clusterCIDR", deserialize_with = "nullable")]
    pub cluster_cidr: String,
    #[serde(deserialize_with = "nullable")]
    pub config_sync_period: GoDuration,
    #[serde(deserialize_with = "nullable")]
    pub conntrack: Conntrack,
    #[serde(deserialize_with = "nullable")]
    pub detect_local: DetectLocal,
    #[serde(deserialize_with = "nullable")]
    pub detect_local_mode: String,
    #[serde(deserialize_with = "nullable")]
    pub enable_profiling: bool,
    #[serde(
        deserialize_with = "nullable",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub feature_gates: BTreeMap<String, bool>,
    #[serde(deserialize_with = "nullable")]
    pub healthz_bind_address: String,
    #[serde(deserialize_with = "nullable")]
    pub hostname_override: String,
    #[serde(deserialize_with = "nullable")]
    pub iptables: Iptables,
    #[serde(deserialize_with = "nullable")]
    pub ipvs: Ipvs,
    #[serde(deserialize_with = "nullable")]
    pub kind: String,
    #[serde(deserialize_with = "nullable")]
    pub logging: Logging,
    #[serde(deserialize_with = "nullable")]
    pub metrics_bind_address: String,
    #[serde(deserialize_with = "nullable")]
    pub mode: String,
    #[serde(deserialize_with = "nullable")]
    pub nftables: Nftables,
    pub node_port_addresses: Option<Vec<String>>,
    pub oom_score_adj: Option<i32>,
    #[serde(deserialize_with = "nullable")]
    pub port_range: String,
    #[serde(deserialize_with = "nullable")]
    pub show_hidden_metrics_for_version: String,
    #[serde(deserialize_with = "nullable", skip_serializing_if = "is_false")]
    pub windows_run_as_service: bool,
    #[serde(deserialize_with = "nullable")]
    pub winkernel: Winkernel,
}

/// component-base's ClientConnectionConfiguration.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct ClientConnection {
    #[serde(deserialize_with = "nullable")]
    pub accept_content_types: String,
    #[serde(deserialize_with = "nullable")]
    pub burst: i32,
    #[serde(deserialize_with = "nullable")]
    pub content_type: String,
    #[serde(deserialize_with = "nullable")]
    pub kubeconfig: String,
    #[serde(deserialize_with = "nullable", serialize_with = "go_float")]
    pub qps: f32,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Conntrack {
    pub max_per_core: Option<i32>,
    pub min: Option<i32>,
    #[serde(deserialize_with = "nullable")]
    pub tcp_be_liberal: bool,
    pub tcp_close_wait_timeout: Option<GoDuration>,
    pub tcp_established_timeout: Option<GoDuration>,
    #[serde(deserialize_with = "nullable")]
    pub udp_stream_timeout: GoDuration,
    #[serde(deserialize_with = "nullable")]
    pub udp_timeout: GoDuration,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct DetectLocal {
    #[serde(deserialize_with = "nullable")]
    pub bridge_interface: String,
    #[serde(deserialize_with = "nullable")]
    pub interface_name_prefix: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Iptables {
    pub localhost_node_ports: Option<bool>,
    #[serde(deserialize_with = "nullable")]
    pub masquerade_all: bool,
    pub masquerade_bit: Option<i32>,
    #[serde(deserialize_with = "nullable")]
    pub min_sync_period: GoDuration,
    /// Newest upstream field; written only when set so older kube-proxy versions still read
    /// our files strictly.
    #[serde(rename = "snatNodeInternalIP", skip_serializing_if = "Option::is_none")]
    pub snat_node_internal_ip: Option<bool>,
    #[serde(deserialize_with = "nullable")]
    pub sync_period: GoDuration,
}

/// Read and written back, never used: we do not implement the ipvs mode.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Ipvs {
    #[serde(rename = "excludeCIDRs")]
    pub exclude_cidrs: Option<Vec<String>>,
    #[serde(deserialize_with = "nullable")]
    pub min_sync_period: GoDuration,
    #[serde(deserialize_with = "nullable")]
    pub scheduler: String,
    #[serde(rename = "strictARP", deserialize_with = "nullable")]
    pub strict_arp: bool,
    #[serde(deserialize_with = "nullable")]
    pub sync_period: GoDuration,
    #[serde(deserialize_with = "nullable")]
    pub tcp_fin_timeout: GoDuration,
    #[serde(deserialize_with = "nullable")]
    pub tcp_timeout: GoDuration,
    #[serde(deserialize_with = "nullable")]
    pub udp_timeout: GoDuration,
}

/// Read and written back, never used: we do not implement the nftables mode.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Nftables {
    #[serde(deserialize_with = "nullable")]
    pub masquerade_all: bool,
    pub masquerade_bit: Option<i32>,
    #[serde(deserialize_with = "nullable")]
    pub min_sync_period: GoDuration,
    #[serde(deserialize_with = "nullable")]
    pub sync_period: GoDuration,
}

/// Read and written back, never used (Windows only).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Winkernel {
    #[serde(rename = "enableDSR", deserialize_with = "nullable")]
    pub enable_dsr: bool,
    #[serde(deserialize_with = "nullable")]
    pub forward_health_check_vip: bool,
    #[serde(deserialize_with = "nullable")]
    pub network_name: String,
    #[serde(deserialize_with = "nullable")]
    pub root_hns_endpoint_name: String,
    #[serde(deserialize_with = "nullable")]
    pub source_vip: String,
}

/// component-base's LoggingConfiguration (logs/api/v1). Only `verbosity` is used (it is what
/// kube-proxy's `-v` sets); the rest is accepted and written back.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Logging {
    #[serde(deserialize_with = "nullable")]
    pub flush_frequency: FlushFrequency,
    #[serde(
        deserialize_with = "nullable",
        skip_serializing_if = "String::is_empty"
    )]
    pub format: String,
    #[serde(
        deserialize_with = "nullable",
        skip_serializing_if = "LoggingOptions::is_empty"
    )]
    pub options: LoggingOptions,
    #[serde(deserialize_with = "nullable")]
    pub verbosity: u32,
    #[serde(deserialize_with = "nullable", skip_serializing_if = "Vec::is_empty")]
    pub vmodule: Vec<VModuleItem>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct LoggingOptions {
    #[serde(
        deserialize_with = "nullable",
        skip_serializing_if = "OutputRouting::is_empty"
    )]
    pub json: OutputRouting,
    #[serde(
        deserialize_with = "nullable",
        skip_serializing_if = "OutputRouting::is_empty"
    )]
    pub text: OutputRouting,
}

impl LoggingOptions {
    fn is_empty(&self) -> bool {
        self.json.is_empty() && self.text.is_empty()
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct OutputRouting {
    /// A Kubernetes quantity (`"0"`, `"64Ki"`); numbers are accepted and kept as text.
    #[serde(deserialize_with = "quantity", skip_serializing_if = "Option::is_none")]
    pub info_buffer_size: Option<String>,
    #[serde(deserialize_with = "nullable", skip_serializing_if = "is_false")]
    pub split_stream: bool,
}

impl OutputRouting {
    fn is_empty(&self) -> bool {
        self.info_buffer_size.is_none() && !self.split_stream
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct VModuleItem {
    #[serde(deserialize_with = "nullable")]
    pub file_pattern: String,
    #[serde(deserialize_with = "nullable")]
    pub verbosity: u32,
}

/// component-base's TimeOrMetaDuration: a Go duration string, or an integer number of
/// nanoseconds; written back in the form it was read in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlushFrequency {
    Nanos(i64),
    Text(GoDuration),
}

impl Default for FlushFrequency {
    fn default() -> Self {
        FlushFrequency::Nanos(0)
    }
}

impl FlushFrequency {
    pub fn duration(self) -> GoDuration {
        match self {
            FlushFrequency::Nanos(nanos) => GoDuration::from_nanos(nanos),
            FlushFrequency::Text(duration) => duration,
        }
    }
}

impl Serialize for FlushFrequency {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            FlushFrequency::Nanos(nanos) => serializer.serialize_i64(*nanos),
            FlushFrequency::Text(duration) => duration.serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for FlushFrequency {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl de::Visitor<'_> for Visitor {
            type Value = FlushFrequency;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a duration (e.g. 5s) or an integer number of nanoseconds")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                Ok(FlushFrequency::Nanos(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                i64::try_from(v)
                    .map(FlushFrequency::Nanos)
                    .map_err(|_| E::custom("flushFrequency is out of range"))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                v.parse().map(FlushFrequency::Text).map_err(E::custom)
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

fn quantity<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<String>, D::Error> {
    struct Visitor;
    impl de::Visitor<'_> for Visitor {
        type Value = Option<String>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a quantity such as \"0\" or \"64Ki\"")
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok(Some(v.to_owned()))
        }
    }
    deserializer.deserialize_any(Visitor)
}
