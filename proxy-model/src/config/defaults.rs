//! kube-proxy's defaults, ported from pkg/proxy/apis/config/v1alpha1/defaults.go
//! (`SetDefaults_KubeProxyConfiguration`) and cmd/kube-proxy/app/server_linux.go
//! (`platformApplyDefaults`). As upstream, a zero value counts as unset for the non-pointer
//! fields: `syncPeriod: 0s` becomes 30s.

use std::net::IpAddr;

use super::{
    duration::GoDuration,
    file::{API_VERSION, FlushFrequency, KIND, KubeProxyConfiguration},
};

/// pkg/cluster/ports: ProxyHealthzPort.
pub const HEALTHZ_PORT: u16 = 10256;
/// pkg/cluster/ports: ProxyStatusPort (metrics).
pub const METRICS_PORT: u16 = 10249;
/// pkg/kubelet/qos: KubeProxyOOMScoreAdj.
pub const OOM_SCORE_ADJ: i32 = -999;
pub const MASQUERADE_BIT: i32 = 14;
pub const SYNC_PERIOD: GoDuration = GoDuration::from_secs(30);
pub const MIN_SYNC_PERIOD: GoDuration = GoDuration::from_secs(1);
pub const CONNTRACK_MAX_PER_CORE: i32 = 32 * 1024;
pub const CONNTRACK_MIN: i32 = 128 * 1024;
pub const TCP_ESTABLISHED_TIMEOUT: GoDuration = GoDuration::from_secs(24 * 3600);
pub const TCP_CLOSE_WAIT_TIMEOUT: GoDuration = GoDuration::from_secs(3600);
pub const CONFIG_SYNC_PERIOD: GoDuration = GoDuration::from_secs(15 * 60);
pub const CONTENT_TYPE: &str = "application/vnd.kubernetes.protobuf";
pub const QPS: f32 = 5.0;
pub const BURST: i32 = 10;
/// component-base logs: LogFlushFreqDefault.
pub const LOG_FLUSH_FREQUENCY: GoDuration = GoDuration::from_secs(5);
/// Ours: kube-proxy defaults to iptables.
pub const MODE: &str = "ebpf";
pub const DETECT_LOCAL_MODE: &str = "ClusterCIDR";

/// SetDefaults_KubeProxyConfiguration: fills everything unset. Runs on the file (or on an
/// empty document when there is no file) before the flags are applied, as upstream.
pub fn apply(doc: &mut KubeProxyConfiguration) {
    doc.api_version = API_VERSION.to_owned();
    doc.kind = KIND.to_owned();
    if doc.bind_address.is_empty() {
        "0.0.0.0".clone_into(&mut doc.bind_address);
    }
    let (healthz_host, metrics_host) = default_hosts(&doc.bind_address);
    doc.healthz_bind_address = if doc.healthz_bind_address.is_empty() {
        format!("{healthz_host}:{HEALTHZ_PORT}")
    } else {
        append_port_if_needed(&doc.healthz_bind_address, HEALTHZ_PORT)
    };
    doc.metrics_bind_address = if doc.metrics_bind_address.is_empty() {
        format!("{metrics_host}:{METRICS_PORT}")
    } else {
        append_port_if_needed(&doc.metrics_bind_address, METRICS_PORT)
    };
    doc.oom_score_adj.get_or_insert(OOM_SCORE_ADJ);

    let iptables = &mut doc.iptables;
    zero_to(&mut iptables.sync_period, SYNC_PERIOD);
    zero_to(&mut iptables.min_sync_period, MIN_SYNC_PERIOD);
    iptables.localhost_node_ports.get_or_insert(true);
    iptables.masquerade_bit.get_or_insert(MASQUERADE_BIT);
    zero_to(&mut doc.ipvs.sync_period, SYNC_PERIOD);
    zero_to(&mut doc.nftables.sync_period, SYNC_PERIOD);
    zero_to(&mut doc.nftables.min_sync_period, MIN_SYNC_PERIOD);
    doc.nftables.masquerade_bit.get_or_insert(MASQUERADE_BIT);

    let conntrack = &mut doc.conntrack;
    conntrack.max_per_core.get_or_insert(CONNTRACK_MAX_PER_CORE);
    conntrack.min.get_or_insert(CONNTRACK_MIN);
    conntrack
        .tcp_established_timeout
        .get_or_insert(TCP_ESTABLISHED_TIMEOUT);
    conntrack
        .tcp_close_wait_timeout
        .get_or_insert(TCP_CLOSE_WAIT_TIMEOUT);
    // udpTimeout and udpStreamTimeout have no default: 0 leaves the kernel's value.

    zero_to(&mut doc.config_sync_period, CONFIG_SYNC_PERIOD);

    let client = &mut doc.client_connection;
    if client.content_type.is_empty() {
        CONTENT_TYPE.clone_into(&mut client.content_type);
    }
    if client.qps == 0.0 {
        client.qps = QPS;
    }
    if client.burst == 0 {
        client.burst = BURST;
    }

    // logsapi.SetRecommendedLoggingConfiguration.
    let logging = &mut doc.logging;
    if logging.format.is_empty() {
        "text".clone_into(&mut logging.format);
    }
    if logging.flush_frequency.duration().is_zero() {
        logging.flush_frequency = FlushFrequency::Text(LOG_FLUSH_FREQUENCY);
    }
    for routing in [&mut logging.options.json, &mut logging.options.text] {
        routing
            .info_buffer_size
            .get_or_insert_with(|| "0".to_owned());
    }
}

/// platformApplyDefaults (server_linux.go): runs after the flags, so an explicit empty
/// `--proxy-mode ""` still means the default mode.
pub fn apply_platform(doc: &mut KubeProxyConfiguration) {
    if doc.mode.is_empty() {
        MODE.clone_into(&mut doc.mode);
    }
    if doc.detect_local_mode.is_empty() {
        DETECT_LOCAL_MODE.clone_into(&mut doc.detect_local_mode);
    }
}

fn zero_to(value: &mut GoDuration, default: GoDuration) {
    if value.is_zero() {
        *value = default;
    }
}

/// getDefaultAddresses: the healthz and metrics hosts follow bindAddress's family; anything
/// that is not an IPv4 address (including garbage, which validation reports) counts as IPv6.
fn default_hosts(bind_address: &str) -> (&'static str, &'static str) {
    match bind_address.parse::<IpAddr>() {
        Ok(IpAddr::V4(_)) => ("0.0.0.0", "127.0.0.1"),
        Ok(IpAddr::V6(v6)) if v6.to_ipv4_mapped().is_some() => ("0.0.0.0", "127.0.0.1"),
        _ => ("[::]", "[::1]"),
    }
}

/// proxyutil.AppendPortIfNeeded: a bare IP gets the default port; anything else (host:port, or
/// invalid text for validation to report) is kept as is.
pub fn append_port_if_needed(address: &str, port: u16) -> String {
    match address.parse::<IpAddr>() {
        Ok(IpAddr::V4(_)) => format!("{address}:{port}"),
        Ok(IpAddr::V6(_)) => format!("[{address}]:{port}"),
        Err(_) => address.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_ips_get_the_port() {
        assert_eq!(append_port_if_needed("1.2.3.4", 80), "1.2.3.4:80");
        assert_eq!(append_port_if_needed("::1", 80), "[::1]:80");
        assert_eq!(append_port_if_needed("1.2.3.4:90", 80), "1.2.3.4:90");
        assert_eq!(append_port_if_needed("[::1]:90", 80), "[::1]:90");
        assert_eq!(append_port_if_needed("nonsense", 80), "nonsense");
    }

    #[test]
    fn ipv6_bind_address_moves_the_default_listeners() {
        let mut doc = KubeProxyConfiguration {
            bind_address: "fd00::1".to_owned(),
            ..Default::default()
        };
        apply(&mut doc);
        assert_eq!(doc.healthz_bind_address, "[::]:10256");
        assert_eq!(doc.metrics_bind_address, "[::1]:10249");
    }
}
