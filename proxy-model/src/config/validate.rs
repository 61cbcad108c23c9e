//! Validation, ported from pkg/proxy/apis/config/validation/validation.go (the parts that apply
//! to Linux and to the modes we implement), and resolution into the typed [`Config`].
//!
//! Every check runs; each failure becomes a [`Problem`] with the field's source, path and
//! value. Where upstream only logs (ClusterCIDR mode without a cluster CIDR, feature gates we
//! do not know), we return a [`Notice`] instead.

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use ipnet::IpNet;

use super::{
    ClientConnection, Config, Conntrack, DetectLocal, GoDuration, Iptables, NodePortAddresses,
    Notice, Origins, Problem, ProxyMode, file::KubeProxyConfiguration, flags::Extras,
};

const NOT_IMPLEMENTED_MODES: [&str; 3] = ["ipvs", "nftables", "kernelspace"];
const DETECT_LOCAL_MODES: [&str; 4] = [
    "ClusterCIDR",
    "NodeCIDR",
    "BridgeInterface",
    "InterfaceNamePrefix",
];

struct Checker<'a> {
    origins: &'a Origins,
    problems: &'a mut Vec<Problem>,
}

impl Checker<'_> {
    fn invalid(&mut self, field: &str, value: impl ToString, reason: impl Into<String>) {
        self.problems.push(Problem {
            source: self.origins.source(field),
            field: Some(field.to_owned()),
            value: value.to_string(),
            reason: reason.into(),
        });
    }

    fn positive(&mut self, field: &str, value: GoDuration) -> Duration {
        if value.as_nanos() <= 0 {
            self.invalid(field, value, "must be greater than 0");
        }
        value.to_std().unwrap_or_default()
    }

    fn non_negative(&mut self, field: &str, value: GoDuration) -> Duration {
        if value.is_negative() {
            self.invalid(field, value, "must be greater than or equal to 0");
        }
        value.to_std().unwrap_or_default()
    }

    fn non_negative_int(&mut self, field: &str, value: i32) -> u32 {
        u32::try_from(value).unwrap_or_else(|_| {
            self.invalid(field, value, "must be greater than or equal to 0");
            0
        })
    }

    /// validateHostPort; an empty value (only reachable through a flag) disables the server.
    fn host_port(&mut self, field: &str, value: &str) -> Option<SocketAddr> {
        if value.is_empty() {
            return None;
        }
        let Some((host, port)) = split_host_port(value) else {
            self.invalid(field, value, "must be IP:port");
            return None;
        };
        let ip = host.parse::<IpAddr>();
        if ip.is_err() {
            self.invalid(field, host, "must be a valid IP");
        }
        let port = match port.parse::<u16>() {
            Ok(p) if p >= 1 => Some(p),
            _ => {
                self.invalid(field, port, "must be a valid port");
                None
            }
        };
        Some(SocketAddr::new(ip.ok()?, port?))
    }
}

/// Validates the effective document and builds the [`Config`]. When `problems` is non-empty
/// afterwards the returned Config holds placeholders and must not be used.
pub fn resolve(
    doc: &KubeProxyConfiguration,
    origins: &Origins,
    extras: Extras,
    problems: &mut Vec<Problem>,
) -> (Config, Vec<Notice>) {
    let mut c = Checker { origins, problems };
    let mut warnings = Vec::new();

    for (name, on) in &doc.feature_gates {
        if let Some(warning) = super::features::deprecation_warning(name, *on) {
            warnings.push(Notice::Warn(warning));
        }
    }
    // Gates that change nothing here are listed once; the ones we apply are logged at info.
    let (applied, ignored): (Vec<_>, Vec<_>) = doc
        .feature_gates
        .iter()
        .map(|(name, on)| (name.as_str(), format!("{name}={on}")))
        .partition(|(name, _)| super::features::APPLIED.contains(name));
    if !applied.is_empty() {
        let gates: Vec<String> = applied.into_iter().map(|(_, g)| g).collect();
        warnings.push(Notice::Info(format!(
            "feature gates applied: {}",
            gates.join(",")
        )));
    }
    if !ignored.is_empty() {
        let gates: Vec<String> = ignored.into_iter().map(|(_, g)| g).collect();
        warnings.push(Notice::Warn(format!(
            "feature gates accepted without effect (kubeproxy-rs has no behaviour they change): {}",
            gates.join(",")
        )));
    }
    if doc.enable_profiling {
        warnings.push(Notice::Warn(
            "enableProfiling (--profiling): kubeproxy-rs serves /debug/flags/v but no /debug/pprof"
                .to_owned(),
        ));
    }
    if !doc.logging.vmodule.is_empty() {
        warnings.push(Notice::Warn(
            "logging.vmodule (--vmodule) is accepted but not applied: its patterns name klog's \
             Go source files"
                .to_owned(),
        ));
    }
    let options = &doc.logging.options;
    // The defaults (no split, buffer "0") are what we do anyway.
    let buffered = |size: &Option<String>| size.as_deref().is_some_and(|s| s != "0");
    if options.text.split_stream
        || options.json.split_stream
        || buffered(&options.text.info_buffer_size)
        || buffered(&options.json.info_buffer_size)
    {
        warnings.push(Notice::Warn(
            "logging.options (--log-*-split-stream, --log-*-info-buffer-size) are accepted but \
             not applied: every log line goes unbuffered to stderr"
                .to_owned(),
        ));
    }
    if let Some(notice) = unused_settings(doc) {
        warnings.push(notice);
    }
    for warning in &extras.warnings {
        warnings.push(Notice::Warn(warning.clone()));
    }

    // validateKubeProxyIPTablesConfiguration.
    let iptables = &doc.iptables;
    let masquerade_bit = iptables
        .masquerade_bit
        .unwrap_or(super::defaults::MASQUERADE_BIT);
    let masquerade_bit = match u8::try_from(masquerade_bit) {
        Ok(bit) if bit <= 31 => bit,
        _ => {
            c.invalid(
                "iptables.masqueradeBit",
                masquerade_bit,
                "must be within the range [0, 31]",
            );
            0
        }
    };
    let sync_period = c.positive("iptables.syncPeriod", iptables.sync_period);
    let min_sync_period = c.non_negative("iptables.minSyncPeriod", iptables.min_sync_period);
    if iptables.min_sync_period > iptables.sync_period && iptables.sync_period.as_nanos() > 0 {
        // Upstream reports this on syncPeriod.
        let reason = format!(
            "must be greater than or equal to iptables.minSyncPeriod ({} from {})",
            iptables.min_sync_period,
            origins.source("iptables.minSyncPeriod")
        );
        c.invalid("iptables.syncPeriod", iptables.sync_period, reason);
    }

    // validateKubeProxyConntrackConfiguration.
    let ct = &doc.conntrack;
    let conntrack = Conntrack {
        max_per_core: c.non_negative_int("conntrack.maxPerCore", ct.max_per_core.unwrap_or(0)),
        min: c.non_negative_int("conntrack.min", ct.min.unwrap_or(0)),
        tcp_established_timeout: c.non_negative(
            "conntrack.tcpEstablishedTimeout",
            ct.tcp_established_timeout.unwrap_or_default(),
        ),
        tcp_close_wait_timeout: c.non_negative(
            "conntrack.tcpCloseWaitTimeout",
            ct.tcp_close_wait_timeout.unwrap_or_default(),
        ),
        tcp_be_liberal: ct.tcp_be_liberal,
        udp_timeout: c.non_negative("conntrack.udpTimeout", ct.udp_timeout),
        udp_stream_timeout: c.non_negative("conntrack.udpStreamTimeout", ct.udp_stream_timeout),
    };

    // validateProxyMode (Linux), narrowed to what we implement.
    let mode = match doc.mode.as_str() {
        "" | "ebpf" => ProxyMode::Ebpf,
        "iptables" => ProxyMode::Iptables,
        other if NOT_IMPLEMENTED_MODES.contains(&other) => {
            c.invalid(
                "mode",
                other,
                format!(
                    "the {other} proxy mode is not implemented by kubeproxy-rs; use ebpf or iptables"
                ),
            );
            ProxyMode::Ebpf
        }
        other => {
            c.invalid(
                "mode",
                other,
                "must be ebpf or iptables (or blank, which means ebpf)",
            );
            ProxyMode::Ebpf
        }
    };

    // validateClientConnectionConfiguration.
    let client = &doc.client_connection;
    if client.burst < 0 {
        c.invalid(
            "clientConnection.burst",
            client.burst,
            "must be greater than or equal to 0",
        );
    }
    // client-go finds no serializer for any other type and cannot build a client.
    if let Err(error) =
        super::encoding::Encoding::new(&client.content_type, &client.accept_content_types)
    {
        let (field, value, reason) = match error {
            super::encoding::EncodingError::ContentType(_) => (
                "clientConnection.contentType",
                &client.content_type,
                "must be application/json or application/vnd.kubernetes.protobuf",
            ),
            super::encoding::EncodingError::Accept(_) => (
                "clientConnection.acceptContentTypes",
                &client.accept_content_types,
                "not a valid HTTP Accept header",
            ),
        };
        c.invalid(field, value, reason);
    }
    let client_connection = ClientConnection {
        kubeconfig: (!client.kubeconfig.is_empty()).then(|| PathBuf::from(&client.kubeconfig)),
        accept_content_types: client.accept_content_types.clone(),
        content_type: client.content_type.clone(),
        qps: client.qps,
        burst: client.burst,
    };

    let oom_score_adj = doc.oom_score_adj.unwrap_or(super::defaults::OOM_SCORE_ADJ);
    if !(-1000..=1000).contains(&oom_score_adj) {
        c.invalid(
            "oomScoreAdj",
            oom_score_adj,
            "must be within the range [-1000, 1000]",
        );
    }

    let config_sync_period = c.positive("configSyncPeriod", doc.config_sync_period);

    let bind_address = doc.bind_address.parse::<IpAddr>().unwrap_or_else(|_| {
        c.invalid(
            "bindAddress",
            &doc.bind_address,
            "must be a valid IP address",
        );
        IpAddr::from([0, 0, 0, 0])
    });
    let healthz_bind_address = c.host_port("healthzBindAddress", &doc.healthz_bind_address);
    let metrics_bind_address = c.host_port("metricsBindAddress", &doc.metrics_bind_address);

    let cluster_cidrs = cluster_cidrs(&mut c, &doc.cluster_cidr);

    if let Err(reason) = check_port_range(&doc.port_range) {
        c.invalid("portRange", &doc.port_range, reason);
    }

    let node_port_addresses = node_port_addresses(&mut c, doc.node_port_addresses.as_deref());

    let version = &doc.show_hidden_metrics_for_version;
    if !version.is_empty() && !is_major_minor(version) {
        c.invalid(
            "showHiddenMetricsForVersion",
            version,
            "must be <major>.<minor>, e.g. 1.33",
        );
    }

    // validateDetectLocalMode + validateInterface.
    let detect_local = match doc.detect_local_mode.as_str() {
        "" | "ClusterCIDR" => {
            if cluster_cidrs.is_empty() {
                // server_linux.go only logs this (at info) and detects nothing.
                warnings.push(Notice::Info(
                    "detectLocalMode is ClusterCIDR but clusterCIDR is not set: \
                     traffic from local pods will not be recognised"
                        .to_owned(),
                ));
            }
            DetectLocal::ClusterCidr
        }
        "NodeCIDR" => DetectLocal::NodeCidr,
        "BridgeInterface" => {
            let name = &doc.detect_local.bridge_interface;
            if name.is_empty() {
                c.invalid(
                    "detectLocal.bridgeInterface",
                    name,
                    "must not be empty when detectLocalMode is BridgeInterface",
                );
            }
            DetectLocal::BridgeInterface(name.clone())
        }
        "InterfaceNamePrefix" => {
            let prefix = &doc.detect_local.interface_name_prefix;
            if prefix.is_empty() {
                c.invalid(
                    "detectLocal.interfaceNamePrefix",
                    prefix,
                    "must not be empty when detectLocalMode is InterfaceNamePrefix",
                );
            }
            DetectLocal::InterfaceNamePrefix(prefix.clone())
        }
        other => {
            c.invalid(
                "detectLocalMode",
                other,
                format!("supported values: {}", DETECT_LOCAL_MODES.join(", ")),
            );
            DetectLocal::ClusterCidr
        }
    };

    // logsapi.Validate: the registered formats.
    match doc.logging.format.as_str() {
        "" | "text" => {}
        // main.rs installs the JSON formatter for it.
        "json" => {}
        other => c.invalid("logging.format", other, "supported values: text, json"),
    }
    if doc.logging.flush_frequency.duration().is_negative() {
        c.invalid(
            "logging.flushFrequency",
            doc.logging.flush_frequency.duration(),
            "must be greater than or equal to 0",
        );
    }

    // nodeutil.GetHostname: a non-empty override is trimmed and lower-cased; blank is an error.
    let hostname_override = if doc.hostname_override.is_empty() {
        None
    } else {
        let trimmed = doc.hostname_override.trim();
        if trimmed.is_empty() {
            c.invalid(
                "hostnameOverride",
                &doc.hostname_override,
                "must not be blank",
            );
        }
        Some(trimmed.to_lowercase())
    };

    let config = Config {
        mode_defaulted: false,
        mode,
        hostname_override,
        bind_address,
        healthz_bind_address,
        metrics_bind_address,
        bind_address_hard_fail: doc.bind_address_hard_fail,
        enable_profiling: doc.enable_profiling,
        client_connection,
        master: extras.master,
        sync_period,
        min_sync_period,
        masquerade_all: iptables.masquerade_all,
        iptables: Iptables {
            masquerade_bit,
            localhost_node_ports: iptables.localhost_node_ports.unwrap_or(true),
        },
        conntrack,
        detect_local,
        cluster_cidrs,
        node_port_addresses,
        oom_score_adj,
        config_sync_period,
        feature_gates: doc.feature_gates.clone(),
        verbosity: doc.logging.verbosity,
        cleanup: extras.cleanup,
        init_only: extras.init_only,
        ebpf: extras.ebpf,
        configz: String::new(),
    };
    (config, warnings)
}

/// clusterCIDR: one CIDR, or two of different families.
fn cluster_cidrs(c: &mut Checker<'_>, text: &str) -> Vec<IpNet> {
    if text.is_empty() {
        return Vec::new();
    }
    let parts: Vec<&str> = text.split(',').collect();
    if parts.len() > 2 {
        c.invalid(
            "clusterCIDR",
            text,
            "only one CIDR allowed or a valid DualStack CIDR (e.g. 10.100.0.0/16,fde4:8dba:82e1::/48)",
        );
        return Vec::new();
    }
    let parsed: Vec<Option<IpNet>> = parts.iter().map(|p| parse_cidr(p)).collect();
    let cidrs: Vec<IpNet> = parsed.iter().flatten().copied().collect();
    if parts.len() == 2 {
        let dual = cidrs.len() == 2
            && matches!(
                (cidrs[0], cidrs[1]),
                (IpNet::V4(_), IpNet::V6(_)) | (IpNet::V6(_), IpNet::V4(_))
            );
        if !dual {
            c.invalid(
                "clusterCIDR",
                text,
                "must be a valid DualStack CIDR (e.g. 10.100.0.0/16,fde4:8dba:82e1::/48)",
            );
            return Vec::new();
        }
    } else if cidrs.is_empty() {
        c.invalid(
            "clusterCIDR",
            text,
            "must be a valid CIDR block (e.g. 10.100.0.0/16 or fde4:8dba:82e1::/48)",
        );
    }
    cidrs
}

fn node_port_addresses(c: &mut Checker<'_>, list: Option<&[String]>) -> NodePortAddresses {
    let Some(list) = list.filter(|list| !list.is_empty()) else {
        return NodePortAddresses::All;
    };
    // kube-proxy 1.37: the keywords combine with each other and with CIDRs; `localhost` is
    // the loopback ranges and `all` the zero ranges, `primary` is resolved from the Node.
    let mut primary = false;
    let mut cidrs = Vec::new();
    for (i, text) in list.iter().enumerate() {
        match text.trim() {
            "primary" => primary = true,
            "localhost" => cidrs.extend(LOCALHOST_CIDRS.iter().filter_map(|c| parse_cidr(c))),
            "all" => cidrs.extend(ALL_CIDRS.iter().filter_map(|c| parse_cidr(c))),
            _ => match parse_cidr(text) {
                Some(cidr) => cidrs.push(cidr),
                None => {
                    // The flag and the file set the whole list, so the source is the same.
                    let source = c.origins.source("nodePortAddresses");
                    c.problems.push(Problem {
                        source,
                        field: Some(format!("nodePortAddresses[{i}]")),
                        value: text.clone(),
                        reason: "must be a valid CIDR (e.g. 10.0.0.0/8) or one of the keywords \
                                 'primary', 'localhost' and 'all'"
                            .to_owned(),
                    });
                }
            },
        }
    }
    if primary {
        NodePortAddresses::Primary(cidrs)
    } else {
        NodePortAddresses::Cidrs(cidrs)
    }
}

/// What the `localhost` keyword of `nodePortAddresses` stands for: the loopback ranges.
const LOCALHOST_CIDRS: [&str; 2] = ["127.0.0.0/8", "::1/128"];
/// What the `all` keyword stands for: every address of both families.
const ALL_CIDRS: [&str; 2] = ["0.0.0.0/0", "::/0"];

/// A CIDR like Go's net.ParseCIDR: address/prefix, host bits allowed (the address is kept).
pub fn parse_cidr(text: &str) -> Option<IpNet> {
    text.trim().parse::<IpNet>().ok()
}

/// Go's net.SplitHostPort for the forms kube-proxy accepts: `host:port` (host without ':') or
/// `[host]:port`.
fn split_host_port(text: &str) -> Option<(&str, &str)> {
    if let Some(rest) = text.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        let port = after.strip_prefix(':')?;
        if port.contains([':', '[', ']']) {
            return None;
        }
        return Some((host, port));
    }
    let (host, port) = text.rsplit_once(':')?;
    if host.contains(':') || host.contains(['[', ']']) {
        return None;
    }
    Some((host, port))
}

/// utilnet.ParsePortRange: empty, `N`, `A-B` (A <= B) or `A+N`, all within 0..=65535.
fn check_port_range(text: &str) -> Result<(), &'static str> {
    const REASON: &str = "must be a valid port range (e.g. 300-2000)";
    let text = text.trim();
    if text.is_empty() {
        return Ok(());
    }
    let port = |s: &str| s.parse::<u16>().map_err(|_| REASON);
    if let Some((low, high)) = text.split_once('-') {
        if port(low)? > port(high)? {
            return Err(REASON);
        }
    } else if let Some((base, size)) = text.split_once('+') {
        let base = u32::from(port(base)?);
        let size = size.parse::<u32>().map_err(|_| REASON)?;
        if base + size > 65536 {
            return Err(REASON);
        }
    } else {
        port(text)?;
    }
    Ok(())
}

fn is_major_minor(text: &str) -> bool {
    let Some((major, minor)) = text.split_once('.') else {
        return false;
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    digits(major) && digits(minor)
}

/// Settings kube-proxy uses that have no counterpart here, when they differ from upstream's
/// defaults: named in one warning instead of silently doing nothing.
fn unused_settings(doc: &KubeProxyConfiguration) -> Option<Notice> {
    use super::defaults::CONFIG_SYNC_PERIOD;
    let unused: Vec<String> = [
        // kube-rs watches have no informer resync: the periodic sync reconciles instead.
        (doc.config_sync_period != CONFIG_SYNC_PERIOD)
            .then(|| format!("configSyncPeriod={}", doc.config_sync_period)),
        // Only kube-proxy's removed userspace mode read it.
        (!doc.port_range.is_empty()).then(|| format!("portRange={}", doc.port_range)),
        (!doc.show_hidden_metrics_for_version.is_empty()).then(|| {
            format!(
                "showHiddenMetricsForVersion={}",
                doc.show_hidden_metrics_for_version
            )
        }),
    ]
    .into_iter()
    .flatten()
    .collect();
    (!unused.is_empty()).then(|| {
        Notice::Warn(format!(
            "settings accepted without effect in kubeproxy-rs: {}",
            unused.join(", ")
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_port_forms() {
        assert_eq!(split_host_port("1.2.3.4:80"), Some(("1.2.3.4", "80")));
        assert_eq!(split_host_port("[::1]:80"), Some(("::1", "80")));
        assert_eq!(split_host_port("::1:80"), None);
        assert_eq!(split_host_port("1.2.3.4"), None);
        assert_eq!(split_host_port("[::1]80"), None);
    }

    #[test]
    fn port_ranges() {
        for ok in ["", "80", "300-2000", "300+10", "0-0"] {
            assert!(check_port_range(ok).is_ok(), "{ok}");
        }
        for bad in ["x", "2000-300", "70000", "1-70000", "65535+2", "-"] {
            assert!(check_port_range(bad).is_err(), "{bad}");
        }
    }
}
