//! The command-line overlay: every flag given on the command line replaces the corresponding
//! field of the (already defaulted) document, and is remembered as that field's source.
//!
//! Values are parsed like Go's pflag parses them (ints with Go's base prefixes, Go durations, Go booleans);
//! a value that does not parse is a [`Problem`] naming the flag and the field, and the field
//! keeps its previous value so the other checks still run.

use std::str::FromStr;

use super::{
    EbpfConfig, GoDuration, LbAlgorithm, Origins, Problem, Source,
    defaults::append_port_if_needed,
    defaults::{HEALTHZ_PORT, METRICS_PORT},
    file::{FlushFrequency, KubeProxyConfiguration, VModuleItem},
};
use proxy_common::maglev::{MAX_TABLE_SIZE as MAX_MAGLEV_TABLE_SIZE, is_valid_table_size};

use crate::cli::Args;

/// Settings that only exist as flags.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Extras {
    pub master: Option<String>,
    pub cleanup: bool,
    /// `--init-only`.
    pub init_only: bool,
    /// Accepted flags worth a warning (deprecated, or accepted without effect).
    pub warnings: Vec<String>,
    pub ebpf: EbpfConfig,
}

/// Applies the flags to `doc`, recording in `origins` which field each one set.
pub fn apply(
    args: &Args,
    doc: &mut KubeProxyConfiguration,
    origins: &mut Origins,
    problems: &mut Vec<Problem>,
) -> Extras {
    let mut overlay = Overlay { origins, problems };

    if let Some(mode) = &args.proxy_mode {
        overlay.set("mode", "proxy-mode");
        doc.mode.clone_from(mode);
    }
    // processHostnameOverrideFlag: an empty flag is ignored; blank text is an error.
    if let Some(name) = args.hostname_override.as_deref().filter(|n| !n.is_empty()) {
        overlay.set("hostnameOverride", "hostname-override");
        let trimmed = name.trim();
        if trimmed.is_empty() {
            overlay.invalid("hostnameOverride", name, "must not be blank");
        } else {
            doc.hostname_override = trimmed.to_lowercase();
        }
    }
    if let Some(address) = &args.bind_address {
        overlay.set("bindAddress", "bind-address");
        address.trim().clone_into(&mut doc.bind_address);
    }
    // Without --config upstream appends the default port to a bare IP after the flags
    // (addressFromDeprecatedFlags); we do it with --config too.
    if let Some(address) = &args.healthz_bind_address {
        overlay.set("healthzBindAddress", "healthz-bind-address");
        doc.healthz_bind_address = append_port_if_needed(address.trim(), HEALTHZ_PORT);
    }
    // An empty value keeps the default (127.0.0.1:10249, or [::1] with an IPv6 bind address):
    // upstream's defaulting runs after the flags, so it never disabled the server, whatever its
    // help said before 1.37.
    if let Some(address) = args
        .metrics_bind_address
        .as_ref()
        .filter(|a| !a.trim().is_empty())
    {
        overlay.set("metricsBindAddress", "metrics-bind-address");
        doc.metrics_bind_address = append_port_if_needed(address.trim(), METRICS_PORT);
    }
    if let Some(cidrs) = &args.cluster_cidr {
        overlay.set("clusterCIDR", "cluster-cidr");
        doc.cluster_cidr.clone_from(cidrs);
    }
    if let Some(addresses) = &args.nodeport_addresses {
        overlay.set("nodePortAddresses", "nodeport-addresses");
        // pflag's StringSlice: `--nodeport-addresses ""` is the empty list.
        let list: Vec<String> = addresses
            .iter()
            .map(|a| a.trim().to_owned())
            .filter(|a| !a.is_empty())
            .collect();
        doc.node_port_addresses = (!list.is_empty()).then_some(list);
    }
    let iptables = &mut doc.iptables;
    overlay.parse(
        &args.masquerade_all,
        "iptables.masqueradeAll",
        "masquerade-all",
        parse_bool,
        |v| iptables.masquerade_all = v,
    );
    overlay.parse(
        &args.iptables_masquerade_bit,
        "iptables.masqueradeBit",
        "iptables-masquerade-bit",
        parse_int,
        |v| iptables.masquerade_bit = Some(v),
    );
    overlay.parse(
        &args.iptables_localhost_nodeports,
        "iptables.localhostNodePorts",
        "iptables-localhost-nodeports",
        parse_bool,
        |v| iptables.localhost_node_ports = Some(v),
    );
    overlay.parse(
        &args.iptables_sync_period,
        "iptables.syncPeriod",
        "iptables-sync-period",
        parse_duration,
        |v| iptables.sync_period = v,
    );
    overlay.parse(
        &args.iptables_min_sync_period,
        "iptables.minSyncPeriod",
        "iptables-min-sync-period",
        parse_duration,
        |v| iptables.min_sync_period = v,
    );
    let conntrack = &mut doc.conntrack;
    overlay.parse(
        &args.conntrack_max_per_core,
        "conntrack.maxPerCore",
        "conntrack-max-per-core",
        parse_int,
        |v| conntrack.max_per_core = Some(v),
    );
    overlay.parse(
        &args.conntrack_min,
        "conntrack.min",
        "conntrack-min",
        parse_int,
        |v| conntrack.min = Some(v),
    );
    overlay.parse(
        &args.conntrack_tcp_timeout_established,
        "conntrack.tcpEstablishedTimeout",
        "conntrack-tcp-timeout-established",
        parse_duration,
        |v| conntrack.tcp_established_timeout = Some(v),
    );
    overlay.parse(
        &args.conntrack_tcp_timeout_close_wait,
        "conntrack.tcpCloseWaitTimeout",
        "conntrack-tcp-timeout-close-wait",
        parse_duration,
        |v| conntrack.tcp_close_wait_timeout = Some(v),
    );
    overlay.parse(
        &args.conntrack_tcp_be_liberal,
        "conntrack.tcpBeLiberal",
        "conntrack-tcp-be-liberal",
        parse_bool,
        |v| conntrack.tcp_be_liberal = v,
    );
    overlay.parse(
        &args.conntrack_udp_timeout,
        "conntrack.udpTimeout",
        "conntrack-udp-timeout",
        parse_duration,
        |v| conntrack.udp_timeout = v,
    );
    overlay.parse(
        &args.conntrack_udp_timeout_stream,
        "conntrack.udpStreamTimeout",
        "conntrack-udp-timeout-stream",
        parse_duration,
        |v| conntrack.udp_stream_timeout = v,
    );
    overlay.parse(
        &args.oom_score_adj,
        "oomScoreAdj",
        "oom-score-adj",
        parse_int,
        |v| doc.oom_score_adj = Some(v),
    );
    let client = &mut doc.client_connection;
    if let Some(path) = &args.kubeconfig {
        overlay.set("clientConnection.kubeconfig", "kubeconfig");
        client.kubeconfig.clone_from(path);
    }
    if let Some(content_type) = &args.kube_api_content_type {
        overlay.set("clientConnection.contentType", "kube-api-content-type");
        client.content_type.clone_from(content_type);
    }
    overlay.parse(
        &args.kube_api_qps,
        "clientConnection.qps",
        "kube-api-qps",
        parse_float,
        |v| client.qps = v,
    );
    overlay.parse(
        &args.kube_api_burst,
        "clientConnection.burst",
        "kube-api-burst",
        parse_int,
        |v| client.burst = v,
    );
    overlay.parse(
        &args.config_sync_period,
        "configSyncPeriod",
        "config-sync-period",
        parse_duration,
        |v| doc.config_sync_period = v,
    );
    if let Some(mode) = &args.detect_local_mode {
        overlay.set("detectLocalMode", "detect-local-mode");
        doc.detect_local_mode.clone_from(mode);
    }
    if let Some(name) = &args.pod_bridge_interface {
        overlay.set("detectLocal.bridgeInterface", "pod-bridge-interface");
        doc.detect_local.bridge_interface.clone_from(name);
    }
    if let Some(prefix) = &args.pod_interface_name_prefix {
        overlay.set(
            "detectLocal.interfaceNamePrefix",
            "pod-interface-name-prefix",
        );
        doc.detect_local.interface_name_prefix.clone_from(prefix);
    }
    overlay.parse(
        &args.verbosity,
        "logging.verbosity",
        "v",
        parse_decimal,
        |v| doc.logging.verbosity = v,
    );

    // cliflag.MapStringBool: `k=v,k2=v2`, keys and values trimmed, values Go booleans; the
    // flag replaces the map (the file's gates are not merged in).
    if let Some(text) = &args.feature_gates {
        overlay.set("featureGates", "feature-gates");
        match parse_feature_gates(text) {
            Ok(gates) => doc.feature_gates = gates,
            Err(reason) => overlay.invalid("featureGates", text, &reason),
        }
    }
    overlay.parse(
        &args.profiling,
        "enableProfiling",
        "profiling",
        parse_bool,
        |v| doc.enable_profiling = v,
    );
    overlay.parse(
        &args.bind_address_hard_fail,
        "bindAddressHardFail",
        "bind-address-hard-fail",
        parse_bool,
        |v| doc.bind_address_hard_fail = v,
    );
    if let Some(version) = &args.show_hidden_metrics_for_version {
        overlay.set(
            "showHiddenMetricsForVersion",
            "show-hidden-metrics-for-version",
        );
        version
            .trim()
            .clone_into(&mut doc.show_hidden_metrics_for_version);
    }
    let ipvs = &mut doc.ipvs;
    if let Some(scheduler) = &args.ipvs_scheduler {
        overlay.set("ipvs.scheduler", "ipvs-scheduler");
        scheduler.clone_into(&mut ipvs.scheduler);
    }
    if let Some(cidrs) = &args.ipvs_exclude_cidrs {
        overlay.set("ipvs.excludeCIDRs", "ipvs-exclude-cidrs");
        let list: Vec<String> = cidrs
            .iter()
            .map(|c| c.trim().to_owned())
            .filter(|c| !c.is_empty())
            .collect();
        ipvs.exclude_cidrs = (!list.is_empty()).then_some(list);
    }
    overlay.parse(
        &args.ipvs_strict_arp,
        "ipvs.strictARP",
        "ipvs-strict-arp",
        parse_bool,
        |v| ipvs.strict_arp = v,
    );
    overlay.parse(
        &args.ipvs_tcp_timeout,
        "ipvs.tcpTimeout",
        "ipvs-tcp-timeout",
        parse_duration,
        |v| ipvs.tcp_timeout = v,
    );
    overlay.parse(
        &args.ipvs_tcpfin_timeout,
        "ipvs.tcpFinTimeout",
        "ipvs-tcpfin-timeout",
        parse_duration,
        |v| ipvs.tcp_fin_timeout = v,
    );
    overlay.parse(
        &args.ipvs_udp_timeout,
        "ipvs.udpTimeout",
        "ipvs-udp-timeout",
        parse_duration,
        |v| ipvs.udp_timeout = v,
    );
    // processV1Alpha1Flags: --ipvs-(min-)sync-period only take effect in ipvs mode, which we
    // reject; parsed so a bad value is still an error, as pflag would report it.
    for (text, flag) in [
        (&args.ipvs_sync_period, "ipvs-sync-period"),
        (&args.ipvs_min_sync_period, "ipvs-min-sync-period"),
    ] {
        if let Some(text) = text
            && let Err(reason) = parse_duration(text.trim())
        {
            overlay.flag_only(flag, text, reason);
        }
    }
    let logging = &mut doc.logging;
    overlay.parse(
        &args.log_flush_frequency,
        "logging.flushFrequency",
        "log-flush-frequency",
        parse_duration,
        |v| logging.flush_frequency = FlushFrequency::Text(v),
    );
    if let Some(text) = &args.vmodule {
        overlay.set("logging.vmodule", "vmodule");
        match parse_vmodule(text) {
            Ok(items) => logging.vmodule = items,
            Err(reason) => overlay.invalid("logging.vmodule", text, &reason),
        }
    }
    let options = &mut logging.options;
    overlay.parse(
        &args.log_text_split_stream,
        "logging.options.text.splitStream",
        "log-text-split-stream",
        parse_bool,
        |v| options.text.split_stream = v,
    );
    overlay.parse(
        &args.log_json_split_stream,
        "logging.options.json.splitStream",
        "log-json-split-stream",
        parse_bool,
        |v| options.json.split_stream = v,
    );
    if let Some(size) = &args.log_text_info_buffer_size {
        overlay.set(
            "logging.options.text.infoBufferSize",
            "log-text-info-buffer-size",
        );
        options.text.info_buffer_size = Some(size.trim().to_owned());
    }
    if let Some(size) = &args.log_json_info_buffer_size {
        overlay.set(
            "logging.options.json.infoBufferSize",
            "log-json-info-buffer-size",
        );
        options.json.info_buffer_size = Some(size.trim().to_owned());
    }

    let mut extras = Extras {
        master: args.master.clone().filter(|m| !m.is_empty()),
        ..Extras::default()
    };
    if let Some(text) = &args.init_only {
        match parse_bool(text) {
            Ok(v) => extras.init_only = v,
            Err(reason) => overlay.flag_only("init-only", text, reason),
        }
    }
    // The deprecated --healthz-port / --metrics-port (options.go Complete →
    // addressFromDeprecatedFlags): only without --config and --write-config-to; port 0
    // disables the server, another port replaces a bare IP's default port.
    for (text, flag, address_flag, address, default_port) in [
        (
            &args.healthz_port,
            "healthz-port",
            &args.healthz_bind_address,
            &mut doc.healthz_bind_address,
            HEALTHZ_PORT,
        ),
        (
            &args.metrics_port,
            "metrics-port",
            &args.metrics_bind_address,
            &mut doc.metrics_bind_address,
            METRICS_PORT,
        ),
    ] {
        let Some(text) = text else { continue };
        let replacement = match flag {
            "healthz-port" => "--healthz-bind-address",
            _ => "--metrics-bind-address",
        };
        extras.warnings.push(format!(
            "Flag --{flag} has been deprecated, This flag is deprecated and will be removed in \
             a future release. Please use {replacement} instead."
        ));
        let port = match parse_int::<u16>(text.trim()) {
            Ok(port) => port,
            Err(reason) => {
                overlay.flag_only(flag, text, reason);
                continue;
            }
        };
        if args.config.is_some() || args.write_config_to.is_some() {
            continue;
        }
        if port == 0 {
            address.clear();
        } else if port != default_port
            && let Some(given) = address_flag
        {
            *address = append_port_if_needed(given.trim(), port);
        }
    }
    if let Some(text) = &args.cleanup {
        match parse_bool(text) {
            Ok(v) => extras.cleanup = v,
            Err(reason) => overlay.flag_only("cleanup", text, reason),
        }
    }
    let ebpf = &mut extras.ebpf;
    ebpf.manifests.clone_from(&args.manifests);
    ebpf.cgroup_path.clone_from(&args.cgroup_path);
    if let Some(root) = &args.bpf_root {
        if root.as_os_str().is_empty() {
            overlay.flag_only("bpf-root", "", "must not be empty".to_owned());
        } else {
            ebpf.bpf_root.clone_from(root);
        }
    }
    for (text, flag, slot) in [
        (
            &args.bpf_map_frontends,
            "bpf-map-frontends",
            &mut ebpf.map_frontends,
        ),
        (
            &args.bpf_map_backends,
            "bpf-map-backends",
            &mut ebpf.map_backends,
        ),
        (
            &args.bpf_max_frontends_per_service,
            "bpf-max-frontends-per-service",
            &mut ebpf.max_frontends_per_service,
        ),
    ] {
        let Some(text) = text else { continue };
        match parse_int::<u32>(text) {
            Ok(0) => overlay.flag_only(flag, text, "must be greater than 0".to_owned()),
            Ok(v) => *slot = v,
            Err(reason) => overlay.flag_only(flag, text, reason),
        }
    }
    if let Some(text) = &args.bpf_map_conntrack {
        match parse_int::<u32>(text) {
            Ok(0) => overlay.flag_only(
                "bpf-map-conntrack",
                text,
                "must be greater than 0".to_owned(),
            ),
            Ok(v) => ebpf.map_conntrack = Some(v),
            Err(reason) => overlay.flag_only("bpf-map-conntrack", text, reason),
        }
    }
    if let Some(text) = &args.bpf_map_dynamic_size_ratio {
        use crate::config::ebpf_settings::SizeRatio;
        match text.trim().parse::<f64>().map(SizeRatio::new) {
            Ok(Some(ratio)) => ebpf.map_dynamic_size_ratio = Some(ratio),
            Ok(None) => overlay.flag_only(
                "bpf-map-dynamic-size-ratio",
                text,
                "must be between 0 and 1".to_owned(),
            ),
            Err(error) => overlay.flag_only("bpf-map-dynamic-size-ratio", text, error.to_string()),
        }
    }
    if let Some(text) = &args.bpf_snat_port_range {
        match parse_port_range(text) {
            Ok(range) => ebpf.snat_ports = range,
            Err(reason) => overlay.flag_only("bpf-snat-port-range", text, reason),
        }
    }
    if let Some(text) = &args.bpf_max_endpoints_per_service {
        let most = super::ebpf_settings::DEFAULT_MAX_ENDPOINTS_PER_SERVICE;
        match parse_int::<u32>(text) {
            Ok(v) if (1..=most).contains(&v) => ebpf.max_endpoints_per_service = v,
            Ok(_) => overlay.flag_only(
                "bpf-max-endpoints-per-service",
                text,
                format!("must be between 1 and {most}"),
            ),
            Err(reason) => overlay.flag_only("bpf-max-endpoints-per-service", text, reason),
        }
    }
    if let Some(text) = &args.bpf_map_maglev {
        match parse_int::<u32>(text) {
            Ok(0) => overlay.flag_only("bpf-map-maglev", text, "must be greater than 0".to_owned()),
            Ok(v) => ebpf.map_maglev = v,
            Err(reason) => overlay.flag_only("bpf-map-maglev", text, reason),
        }
    }
    if let Some(text) = &args.drift_check_period {
        match parse_duration(text).map(GoDuration::to_std) {
            Ok(Some(period)) => ebpf.drift_check_period = period,
            Ok(None) => overlay.flag_only(
                "drift-check-period",
                text,
                "must not be negative".to_owned(),
            ),
            Err(reason) => overlay.flag_only("drift-check-period", text, reason),
        }
    }
    if let Some(text) = &args.mode_switch_drain_period {
        match parse_duration(text).map(GoDuration::to_std) {
            Ok(Some(period)) => ebpf.mode_switch_drain_period = period,
            Ok(None) => overlay.flag_only(
                "mode-switch-drain-period",
                text,
                "must not be negative".to_owned(),
            ),
            Err(reason) => overlay.flag_only("mode-switch-drain-period", text, reason),
        }
    }
    if let Some(text) = &args.service_traffic_max_series {
        match parse_int::<u32>(text) {
            Ok(count) => ebpf.service_traffic_max_series = count,
            Err(reason) => overlay.flag_only("service-traffic-max-series", text, reason),
        }
    }
    ebpf.service_traffic_endpoints = args.service_traffic_endpoints;
    if let Some(text) = &args.lb_algorithm {
        match text.as_str() {
            "random" => ebpf.lb_algorithm = LbAlgorithm::Random,
            "maglev" => ebpf.lb_algorithm = LbAlgorithm::Maglev,
            _ => overlay.flag_only("lb-algorithm", text, "must be random or maglev".to_owned()),
        }
    }
    if let Some(text) = &args.bpf_maglev_table_size {
        match parse_int::<u32>(text) {
            Ok(m) if m <= MAX_MAGLEV_TABLE_SIZE && is_valid_table_size(m) => {
                ebpf.maglev_table_size = m;
            }
            Ok(_) => overlay.flag_only(
                "bpf-maglev-table-size",
                text,
                format!(
                    "must be a prime between 3 and {MAX_MAGLEV_TABLE_SIZE} (e.g. 1021, 4093, 16381)"
                ),
            ),
            Err(reason) => overlay.flag_only("bpf-maglev-table-size", text, reason),
        }
    }
    if let Some(text) = &args.tc_fast_path {
        match text.parse() {
            Ok(setting) => ebpf.tc_fast_path = setting,
            Err(reason) => overlay.flag_only("tc-fast-path", text, reason),
        }
    }
    if let Some(text) = &args.bpf_xdp {
        match text.parse() {
            Ok(setting) => ebpf.xdp = setting,
            Err(reason) => overlay.flag_only("bpf-xdp", text, reason),
        }
    }
    ebpf.socket_lb_host_namespace_only = args.bpf_socket_lb_host_namespace_only;
    for name in args.bpf_disable_feature.iter().flatten() {
        let name = name.trim();
        if name.is_empty() {
            continue;
        }
        match name.parse::<crate::config::kernel_features::Feature>() {
            Ok(feature) => {
                ebpf.disabled_features.insert(feature);
            }
            Err(reason) => overlay.flag_only("bpf-disable-feature", name, reason),
        }
    }
    if let Some(names) = &args.interfaces {
        for name in names.iter().map(|n| n.trim()).filter(|n| !n.is_empty()) {
            match interface_name_problem(name) {
                Some(reason) => overlay.flag_only("interfaces", name, reason.to_owned()),
                None => ebpf.interfaces.push(name.to_owned()),
            }
        }
    }
    extras
}

/// Linux interface names: 1..=15 bytes (IFNAMSIZ - 1), no '/', ':' or whitespace.
fn interface_name_problem(name: &str) -> Option<&'static str> {
    if name.len() > 15 {
        return Some("an interface name has at most 15 characters");
    }
    if name
        .chars()
        .any(|c| c == '/' || c == ':' || c.is_whitespace())
    {
        return Some("an interface name cannot contain '/', ':' or whitespace");
    }
    None
}

struct Overlay<'a> {
    origins: &'a mut Origins,
    problems: &'a mut Vec<Problem>,
}

impl Overlay<'_> {
    fn set(&mut self, field: &'static str, flag: &'static str) {
        self.origins.set_by_flag(field, flag);
    }

    fn invalid(&mut self, field: &str, value: &str, reason: &str) {
        self.problems.push(Problem {
            source: self.origins.source(field),
            field: Some(field.to_owned()),
            value: value.to_owned(),
            reason: reason.to_owned(),
        });
    }

    fn flag_only(&mut self, flag: &'static str, value: &str, reason: String) {
        self.problems.push(Problem {
            source: Source::Flag(flag),
            field: None,
            value: value.to_owned(),
            reason,
        });
    }

    /// If the flag was given: parse it and store it, or report it.
    fn parse<T>(
        &mut self,
        text: &Option<String>,
        field: &'static str,
        flag: &'static str,
        parse: impl FnOnce(&str) -> Result<T, String>,
        store: impl FnOnce(T),
    ) {
        let Some(text) = text else { return };
        self.set(field, flag);
        match parse(text.trim()) {
            Ok(value) => store(value),
            Err(reason) => self.invalid(field, text, &reason),
        }
    }
}

/// Go's strconv.ParseBool, which pflag uses.
pub fn parse_bool(text: &str) -> Result<bool, String> {
    match text {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Ok(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Ok(false),
        _ => Err("must be a boolean (true or false)".to_owned()),
    }
}

/// pflag's integer flags: `strconv.ParseInt(text, 0, bits)`, so a sign, then `0x`/`0o`/`0b`
/// prefixes, a leading `0` for octal, and `_` between digits are all Go syntax.
fn parse_int<T: TryFrom<i128>>(text: &str) -> Result<T, String> {
    go_base0_int(text)
        .and_then(|v| T::try_from(v).ok())
        .ok_or_else(|| "must be an integer in range".to_owned())
}

/// klog's `-v`: `strconv.ParseInt(text, 10, 32)`, decimal only.
fn parse_decimal<T: FromStr>(text: &str) -> Result<T, String> {
    text.parse()
        .map_err(|_| "must be an integer in range".to_owned())
}

/// Go's `strconv.ParseInt(s, 0, 128)` (the range check is the caller's).
fn go_base0_int(text: &str) -> Option<i128> {
    let (negative, rest) = match text.as_bytes().first()? {
        b'-' => (true, &text[1..]),
        b'+' => (false, &text[1..]),
        _ => (false, text),
    };
    let lower = rest.to_ascii_lowercase();
    let (radix, digits, prefixed) = if let Some(d) = lower.strip_prefix("0x") {
        (16, d, true)
    } else if let Some(d) = lower.strip_prefix("0o") {
        (8, d, true)
    } else if let Some(d) = lower.strip_prefix("0b") {
        (2, d, true)
    } else if lower.len() > 1 && lower.starts_with('0') {
        (8, &lower[1..], true)
    } else {
        (10, lower.as_str(), false)
    };
    // underscoreOK: `_` only between digits, or right after a base prefix.
    let bytes = digits.as_bytes();
    let misplaced = bytes.windows(2).any(|w| w == b"__")
        || bytes.last() == Some(&b'_')
        || (!prefixed && bytes.first() == Some(&b'_'));
    if digits.is_empty() || digits == "_" || misplaced {
        return None;
    }
    let value = i128::from_str_radix(&digits.replace('_', ""), radix).ok()?;
    Some(if negative { -value } else { value })
}

fn parse_float(text: &str) -> Result<f32, String> {
    match text.parse::<f32>() {
        Ok(v) if v.is_finite() => Ok(v),
        _ => Err("must be a number".to_owned()),
    }
}

/// cliflag.MapStringBool's Set: comma-separated `key=value`, both trimmed; an empty text is
/// the empty map.
pub fn parse_feature_gates(text: &str) -> Result<std::collections::BTreeMap<String, bool>, String> {
    let mut gates = std::collections::BTreeMap::new();
    for item in text.split(',') {
        if item.trim().is_empty() {
            continue;
        }
        let Some((key, value)) = item.split_once('=') else {
            return Err(format!("missing bool value for {item}"));
        };
        let value = parse_bool(value.trim())
            .map_err(|_| format!("invalid value of {}: {}", key.trim(), value.trim()))?;
        gates.insert(key.trim().to_owned(), value);
    }
    Ok(gates)
}

/// klog's `-vmodule`: comma-separated `pattern=N`.
fn parse_vmodule(text: &str) -> Result<Vec<VModuleItem>, String> {
    let mut items = Vec::new();
    for item in text.split(',').filter(|i| !i.is_empty()) {
        let (pattern, level) = item
            .split_once('=')
            .ok_or_else(|| format!("{item:?} does not have the pattern=N format"))?;
        let verbosity = level
            .parse::<u32>()
            .map_err(|_| format!("{item:?} does not have the pattern=N format"))?;
        items.push(VModuleItem {
            file_pattern: pattern.to_owned(),
            verbosity,
        });
    }
    Ok(items)
}

fn parse_duration(text: &str) -> Result<GoDuration, String> {
    text.parse::<GoDuration>().map_err(|e| e.to_string())
}

/// `--bpf-snat-port-range`: `MIN-MAX`, 1024 ≤ MIN ≤ MAX ≤ 65535 (ports below 1024 are the
/// node's services').
fn parse_port_range(text: &str) -> Result<std::ops::RangeInclusive<u16>, String> {
    let shape = || "must be MIN-MAX with 1024 <= MIN <= MAX <= 65535".to_owned();
    let (min, max) = text.trim().split_once('-').ok_or_else(shape)?;
    let min: u16 = min.trim().parse().map_err(|_| shape())?;
    let max: u16 = max.trim().parse().map_err(|_| shape())?;
    if min < 1024 || min > max {
        return Err(shape());
    }
    Ok(min..=max)
}
