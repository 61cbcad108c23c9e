//! The agent's configuration: kube-proxy's `KubeProxyConfiguration` file and flags, resolved
//! into one typed [`Config`].
//!
//! Order, as kube-proxy without `--config`: read the file (or start from an empty document) →
//! apply kube-proxy's defaults (`defaults`) → apply the flags given on the command line
//! (`flags`) → platform defaults (mode, detectLocalMode) → validate everything and resolve the
//! typed [`Config`] (`validate`). Nothing is touched before all of it succeeds; every problem
//! is reported, each naming its source (file or flag), field and value.

pub mod configz;
pub mod defaults;
pub mod duration;
pub mod ebpf_settings;
pub mod encoding;
pub mod features;
pub mod file;
pub mod flags;
pub mod kernel_features;
pub mod validate;

use std::{
    collections::BTreeMap,
    fmt,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

pub use crate::proxy_mode::ProxyMode;

pub use ipnet::IpNet;
use thiserror::Error;
use tracing::level_filters::LevelFilter;

pub use self::{duration::GoDuration, file::KubeProxyConfiguration};
use crate::cli::Args;

/// The resolved configuration every other module reads. Durations, addresses and CIDRs are
/// parsed; kube-proxy's defaults are filled in.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// `mode` / `--proxy-mode`.
    pub mode: ProxyMode,
    /// The mode was not set anywhere (the platform default): if the eBPF dataplane cannot start,
    /// the agent falls back to iptables instead of failing.
    pub mode_defaulted: bool,
    /// `hostnameOverride` / `--hostname-override`, trimmed and lower-cased as kube-proxy does;
    /// None: use the host name.
    pub hostname_override: Option<String>,
    /// `bindAddress` / `--bind-address`: overrides the node's primary IP (nothing binds it).
    pub bind_address: IpAddr,
    /// `healthzBindAddress`; None when disabled with `--healthz-bind-address ""`.
    pub healthz_bind_address: Option<SocketAddr>,
    /// `metricsBindAddress`; None when disabled with `--metrics-bind-address ""`.
    pub metrics_bind_address: Option<SocketAddr>,
    pub bind_address_hard_fail: bool,
    pub enable_profiling: bool,
    pub client_connection: ClientConnection,
    /// `--master` (flag only): overrides the kubeconfig's server.
    pub master: Option<String>,
    /// `iptables.syncPeriod` / `--iptables-sync-period`: the sync runner's maximum interval
    /// (both modes; upstream's internal config also keeps it mode-independent).
    pub sync_period: Duration,
    /// `iptables.minSyncPeriod` / `--iptables-min-sync-period`: the runner's minimum interval.
    pub min_sync_period: Duration,
    /// `iptables.masqueradeAll` / `--masquerade-all`.
    pub masquerade_all: bool,
    pub iptables: Iptables,
    pub conntrack: Conntrack,
    /// `detectLocalMode` + `detectLocal` (+ `clusterCIDR` for ClusterCIDR mode).
    pub detect_local: DetectLocal,
    /// `clusterCIDR` / `--cluster-cidr`: zero, one, or a dual-stack pair (one per family).
    pub cluster_cidrs: Vec<IpNet>,
    /// `nodePortAddresses` / `--nodeport-addresses`.
    pub node_port_addresses: NodePortAddresses,
    /// `oomScoreAdj` / `--oom-score-adj`, -1000..=1000.
    pub oom_score_adj: i32,
    /// `configSyncPeriod` / `--config-sync-period`: informer resync interval.
    pub config_sync_period: Duration,
    /// `featureGates`: those in [`features::APPLIED`] change behaviour (see
    /// [`features::enabled`]); a warning lists the others.
    pub feature_gates: BTreeMap<String, bool>,
    /// `logging.verbosity` / `-v`: klog verbosity; see [`Config::log_level`].
    pub verbosity: u32,
    /// `--cleanup` (flag only).
    pub cleanup: bool,
    /// `--init-only` (flag only): privileged initialisation, then exit.
    pub init_only: bool,
    /// Our additions (flags only, never in the file).
    pub ebpf: EbpfConfig,
    /// The `/configz` body (the effective configuration in upstream's internal shape).
    pub configz: String,
}

/// component-base's ClientConnectionConfiguration.
#[derive(Debug, Clone, PartialEq)]
pub struct ClientConnection {
    /// `clientConnection.kubeconfig` / `--kubeconfig`; None: in-cluster configuration.
    pub kubeconfig: Option<PathBuf>,
    pub accept_content_types: String,
    pub content_type: String,
    pub qps: f32,
    pub burst: i32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Iptables {
    /// `iptables.masqueradeBit`, 0..=31: the mark is `1 << bit`.
    pub masquerade_bit: u8,
    /// `iptables.localhostNodePorts`.
    pub localhost_node_ports: bool,
}

/// `conntrack.*`. A zero value means "leave the kernel's setting as it is", as upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conntrack {
    pub max_per_core: u32,
    pub min: u32,
    pub tcp_established_timeout: Duration,
    pub tcp_close_wait_timeout: Duration,
    pub tcp_be_liberal: bool,
    pub udp_timeout: Duration,
    pub udp_stream_timeout: Duration,
}

/// How traffic from local pods is recognised (pkg/proxy/util/localdetector.go).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DetectLocal {
    /// Source in [`Config::cluster_cidrs`] (per family; none configured → no detection).
    ClusterCidr,
    /// Source in the Node's `spec.podCIDRs`.
    NodeCidr,
    /// Arriving on this bridge.
    BridgeInterface(String),
    /// Arriving on an interface whose name starts with this prefix.
    InterfaceNamePrefix(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// Unset: every local IP.
    All,
    /// `primary` (kube-proxy 1.37: with other keywords or CIDRs): the Node object's primary
    /// IP(s), and node IPs inside these ranges.
    Primary(Vec<IpNet>),
    /// Node IPs inside these ranges (the keywords `localhost` and `all` are ranges too).
    Cidrs(Vec<IpNet>),
}

/// Our additions for the eBPF dataplane and the standalone source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EbpfConfig {
    /// `--manifests DIR`: standalone mode.
    pub manifests: Option<PathBuf>,
    /// `--cgroup-path`; None: the cgroup2 mount point.
    pub cgroup_path: Option<PathBuf>,
    /// `--bpf-root` (default /sys/fs/bpf).
    pub bpf_root: PathBuf,
    /// `--bpf-map-frontends`.
    pub map_frontends: u32,
    /// `--bpf-map-backends`.
    pub map_backends: u32,
    /// `--bpf-max-frontends-per-service`.
    pub max_frontends_per_service: u32,
    /// `--bpf-max-endpoints-per-service`.
    pub max_endpoints_per_service: u32,
    /// `--bpf-map-conntrack`; `None`: sized with the other LRU maps (`map_dynamic_size_ratio`).
    pub map_conntrack: Option<u32>,
    /// `--bpf-map-dynamic-size-ratio`; `None`: the LRU maps are sized from the conntrack
    /// table size (`conntrack.maxPerCore`, `conntrack.min`), or from the default ratio when
    /// maxPerCore is 0.
    pub map_dynamic_size_ratio: Option<crate::config::ebpf_settings::SizeRatio>,
    /// `--bpf-snat-port-range`.
    pub snat_ports: std::ops::RangeInclusive<u16>,
    /// `--interfaces` (for the tc programs; not used yet).
    pub interfaces: Vec<String>,
    /// `--lb-algorithm`.
    pub lb_algorithm: LbAlgorithm,
    /// `--bpf-maglev-table-size` (a prime).
    pub maglev_table_size: u32,
    /// `--bpf-map-maglev`.
    pub map_maglev: u32,
    /// `--tc-fast-path`: whether translated external traffic skips netfilter
    /// FORWARD/POSTROUTING (auto: while the node has no forwarding policy).
    pub tc_fast_path: ebpf_settings::FastPathSetting,
    /// `--bpf-xdp`: XDP on the external interfaces.
    pub xdp: ebpf_settings::XdpSetting,
    /// `--bpf-socket-lb-host-namespace-only`: pods' Service traffic is load-balanced in tc,
    /// not at their sockets.
    pub socket_lb_host_namespace_only: bool,
    /// `--drift-check-period` (both modes; zero: no check).
    pub drift_check_period: std::time::Duration,
    /// `--service-traffic-max-series` (both modes; 0: no per-Service counters).
    pub service_traffic_max_series: u32,
    /// `--service-traffic-endpoints` (both modes).
    pub service_traffic_endpoints: bool,
    /// `--mode-switch-drain-period`: how long the iptables mode keeps the eBPF mode's programs
    /// for their established flows (zero: removed at the first sync).
    pub mode_switch_drain_period: std::time::Duration,
    /// `--bpf-disable-feature`: kernel features not used even when present.
    pub disabled_features: std::collections::BTreeSet<crate::config::kernel_features::Feature>,
}

/// `--drift-check-period`'s default: a full check of 30k Services' maps reads ~10^5 entries.
pub const DEFAULT_DRIFT_CHECK_PERIOD: std::time::Duration = std::time::Duration::from_secs(30);

/// `--service-traffic-max-series`'s default: every Service port of a large cluster's busy
/// part, at a few hundred bytes of metrics text per series.
pub const DEFAULT_SERVICE_TRAFFIC_MAX_SERIES: u32 = 5000;

/// `--mode-switch-drain-period`'s default: long enough for request/response connections and
/// most streams to finish, bounded so a switch always completes.
pub const DEFAULT_MODE_SWITCH_DRAIN_PERIOD: std::time::Duration =
    std::time::Duration::from_secs(600);

/// `--lb-algorithm`: how the tc programs choose a backend for a new external flow.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub enum LbAlgorithm {
    #[default]
    Random,
    Maglev,
}

impl Default for EbpfConfig {
    fn default() -> Self {
        EbpfConfig {
            manifests: None,
            cgroup_path: None,
            bpf_root: PathBuf::from("/sys/fs/bpf"),
            map_frontends: proxy_common::default_sizes::FRONTENDS,
            map_backends: proxy_common::default_sizes::BACKENDS,
            max_frontends_per_service: ebpf_settings::DEFAULT_MAX_FRONTENDS_PER_SERVICE,
            max_endpoints_per_service: ebpf_settings::DEFAULT_MAX_ENDPOINTS_PER_SERVICE,
            map_conntrack: None,
            map_dynamic_size_ratio: None,
            snat_ports: ebpf_settings::DEFAULT_SNAT_RANGE,
            interfaces: Vec::new(),
            lb_algorithm: LbAlgorithm::Random,
            maglev_table_size: proxy_common::maglev::DEFAULT_TABLE_SIZE,
            map_maglev: proxy_common::default_sizes::MAGLEV,
            tc_fast_path: ebpf_settings::FastPathSetting::Auto,
            xdp: ebpf_settings::XdpSetting::Auto,
            socket_lb_host_namespace_only: false,
            drift_check_period: DEFAULT_DRIFT_CHECK_PERIOD,
            service_traffic_max_series: DEFAULT_SERVICE_TRAFFIC_MAX_SERIES,
            service_traffic_endpoints: false,
            mode_switch_drain_period: DEFAULT_MODE_SWITCH_DRAIN_PERIOD,
            disabled_features: std::collections::BTreeSet::new(),
        }
    }
}

impl Config {
    /// klog verbosity → tracing: 0-1 info (klog's default and "steady state" levels),
    /// 2-3 debug (klog's "extended info" and "debug"), 4 and above trace.
    pub fn log_level(&self) -> LevelFilter {
        crate::logging::level(i64::from(self.verbosity))
    }
}

/// Where a setting came from, for error messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Default,
    File(PathBuf),
    Flag(&'static str),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Default => f.write_str("default"),
            Source::File(path) => write!(f, "{}", path.display()),
            Source::Flag(name) => write!(f, "--{name}"),
        }
    }
}

/// Which flag set which field (by its path in the file, e.g. `iptables.masqueradeBit`).
#[derive(Debug, Clone, Default)]
pub struct Origins {
    file: Option<PathBuf>,
    flags: BTreeMap<&'static str, &'static str>,
}

impl Origins {
    pub fn new(file: Option<PathBuf>) -> Self {
        Origins {
            file,
            flags: BTreeMap::new(),
        }
    }

    pub fn set_by_flag(&mut self, field: &'static str, flag: &'static str) {
        self.flags.insert(field, flag);
    }

    /// The flag that set `field`; else the file when there is one (a value absent from the
    /// file is a default, and defaults are valid on their own); else "default".
    pub fn source(&self, field: &str) -> Source {
        if let Some(flag) = self.flags.get(field) {
            return Source::Flag(flag);
        }
        match &self.file {
            Some(path) => Source::File(path.clone()),
            None => Source::Default,
        }
    }

    /// Flags that overrode a value of the configuration file, for the log.
    pub fn overridden(&self) -> Vec<&'static str> {
        if self.file.is_none() {
            return Vec::new();
        }
        let mut flags: Vec<_> = self.flags.values().copied().collect();
        flags.sort_unstable();
        flags.dedup();
        flags
    }
}

/// One invalid setting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub source: Source,
    /// The field path in the file (`iptables.masqueradeBit`); None for flag-only settings.
    pub field: Option<String>,
    pub value: String,
    pub reason: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.source)?;
        if let Some(field) = &self.field {
            write!(f, "{field}: ")?;
        }
        write!(f, "invalid value {:?}: {}", self.value, self.reason)
    }
}

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("cannot read the configuration file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {message}", path.display())]
    Parse { path: PathBuf, message: String },
    #[error("{}", Problems(.0))]
    Invalid(Vec<Problem>),
    #[error("cannot write the configuration to {}: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot encode the configuration: {0}")]
    Encode(#[from] serde_saphyr::SerializeError),
}

impl ConfigError {
    /// One line per problem (a single line for the other errors).
    pub fn lines(&self) -> Vec<String> {
        match self {
            ConfigError::Invalid(problems) => problems.iter().map(ToString::to_string).collect(),
            other => vec![other.to_string()],
        }
    }
}

struct Problems<'a>(&'a [Problem]);

impl fmt::Display for Problems<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, problem) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{problem}")?;
        }
        Ok(())
    }
}

/// Something accepted but worth logging (upstream logs these too).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    Info(String),
    Warn(String),
    Error(String),
}

/// The outcome of [`load`].
#[derive(Debug, Clone)]
pub struct Loaded {
    pub config: Config,
    /// The effective document (what `--write-config-to` writes).
    pub document: KubeProxyConfiguration,
    /// Accepted but noteworthy settings, for the log once logging is set up.
    pub notices: Vec<Notice>,
    /// Flags that overrode the file.
    pub overridden: Vec<&'static str>,
}

/// File (if `--config`) → defaults → flags → validation. Touches nothing but the file read.
pub fn load(args: &Args) -> Result<Loaded, ConfigError> {
    let (mut document, lenient) = match &args.config {
        Some(path) => read_file(path)?,
        None => (KubeProxyConfiguration::default(), None),
    };
    defaults::apply(&mut document);
    let mut origins = Origins::new(args.config.clone());
    let mut problems = Vec::new();
    let extras = flags::apply(args, &mut document, &mut origins, &mut problems);
    let mode_defaulted = document.mode.is_empty();
    defaults::apply_platform(&mut document);
    let (mut config, mut notices) = validate::resolve(&document, &origins, extras, &mut problems);
    if let (Some(strict), Some(path)) = (lenient, &args.config) {
        // Upstream logs this and goes on with the leniently decoded file.
        notices.insert(
            0,
            Notice::Error(format!(
                "Using lenient decoding as strict decoding failed: {}: {strict}",
                path.display()
            )),
        );
    }
    config.mode_defaulted = mode_defaulted;
    config.configz = configz::body(&document);
    if !problems.is_empty() {
        return Err(ConfigError::Invalid(problems));
    }
    Ok(Loaded {
        config,
        document,
        notices,
        overridden: origins.overridden(),
    })
}

/// Largest configuration file read (a real one is a few KiB): bounds the memory a parse takes.
pub const MAX_FILE_BYTES: u64 = 1 << 20;

/// Reads and decodes a KubeProxyConfiguration file (YAML, or JSON which is YAML too). A file
/// that only decodes leniently comes with the strict error, to be logged.
pub fn read_file(path: &Path) -> Result<(KubeProxyConfiguration, Option<String>), ConfigError> {
    use std::io::Read as _;
    let read_error = |source| ConfigError::Read {
        path: path.to_owned(),
        source,
    };
    let parse_error = |message| ConfigError::Parse {
        path: path.to_owned(),
        message,
    };
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|file| file.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes))
        .map_err(read_error)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(parse_error(format!(
            "larger than {MAX_FILE_BYTES} bytes; not a KubeProxyConfiguration"
        )));
    }
    let text = String::from_utf8(bytes).map_err(|error| {
        parse_error(format!(
            "not UTF-8 text (invalid byte at offset {})",
            error.utf8_error().valid_up_to()
        ))
    })?;
    parse_lenient(&text).map_err(|message| ConfigError::Parse {
        path: path.to_owned(),
        message,
    })
}

/// Decodes a document as kube-proxy's loadConfig does: strictly; if that fails only because of
/// unknown fields, again leniently (the unknown fields dropped), returning the strict error
/// for the log. A wrong apiVersion or kind is always an error.
pub fn parse(text: &str) -> Result<KubeProxyConfiguration, String> {
    parse_lenient(text).map(|(document, _)| document)
}

/// [`parse`], with the strict decoding error when the document was decoded leniently.
pub fn parse_lenient(text: &str) -> Result<(KubeProxyConfiguration, Option<String>), String> {
    let mut value = crate::yaml::parse(text, 1)
        .map_err(|message| format!("invalid YAML: {message}"))?
        // An empty file is an empty document (then refused for its missing apiVersion).
        .unwrap_or_else(|| serde_json::Value::Object(serde_json::Map::new()));
    // serde's derived structs also take a sequence (fields by position); a document is a
    // mapping.
    let kind = match &value {
        serde_json::Value::Object(_) => None,
        serde_json::Value::Array(_) => Some("sequence"),
        serde_json::Value::String(_) => Some("string"),
        serde_json::Value::Number(_) => Some("number"),
        serde_json::Value::Bool(_) => Some("boolean"),
        serde_json::Value::Null => Some("null"),
    };
    if let Some(kind) = kind {
        return Err(format!(
            "invalid type: {kind}, expected a KubeProxyConfiguration mapping"
        ));
    }
    let strict = match decode_strict(&value) {
        Ok(document) => return Ok((document, None)),
        Err(error) => error,
    };
    // runtime.IsStrictDecodingError: only unknown fields send upstream to the lenient decoder.
    let lenient_failed = || format!("failed lenient decoding: {strict}");
    let mut error = strict.clone();
    // Like upstream's strict decoding error, the logged message names every unknown field.
    let mut dropped = Vec::new();
    // Each round drops the unknown field serde reported (at its path); a document has few.
    for _ in 0..MAX_LENIENT_ROUNDS {
        let Some((path, field)) = unknown_field(&error) else {
            return Err(if dropped.is_empty() {
                strict
            } else {
                lenient_failed()
            });
        };
        if !remove_field(&mut value, &path, &field) {
            return Err(lenient_failed());
        }
        dropped.push(if path.is_empty() {
            format!("unknown field `{field}`")
        } else {
            format!("{path}: unknown field `{field}`")
        });
        match decode_strict(&value) {
            Ok(document) => {
                let message = format!("strict decoding error: {}", dropped.join(", "));
                return Ok((document, Some(message)));
            }
            Err(next) => error = next,
        }
    }
    Err(lenient_failed())
}

/// Unknown fields dropped at most, when decoding leniently (bounds the work on hostile input).
const MAX_LENIENT_ROUNDS: usize = 256;

fn decode_strict(value: &serde_json::Value) -> Result<KubeProxyConfiguration, String> {
    let document: KubeProxyConfiguration = crate::yaml::decode(value).map_err(|error| {
        let message = error.to_string();
        // The path of an unknown field ends with the field; name the mapping that has it, as
        // upstream does (`iptables: unknown field `bogus``).
        match unknown_field(&message) {
            Some((parent, _)) if parent.is_empty() => error.inner().to_string(),
            Some((parent, _)) => format!("{parent}: {}", error.inner()),
            None => message,
        }
    })?;
    if document.api_version != file::API_VERSION || document.kind != file::KIND {
        return Err(format!(
            "apiVersion {:?}, kind {:?}: expected apiVersion {:?} and kind {:?}",
            document.api_version,
            document.kind,
            file::API_VERSION,
            file::KIND
        ));
    }
    Ok(document)
}

/// serde's "`<path>: `unknown field `name`, expected …", the path as `serde_path_to_error`
/// writes it (ending with the field's own name): the mapping's path and the field's name.
fn unknown_field(error: &str) -> Option<(String, String)> {
    const MARK: &str = "unknown field `";
    let at = error.find(MARK)?;
    let rest = &error[at + MARK.len()..];
    let name = &rest[..rest.find('`')?];
    let path = error[..at].strip_suffix(": ").unwrap_or_default();
    let parent = if path == name {
        ""
    } else {
        path.strip_suffix(name)
            .and_then(|p| p.strip_suffix('.'))
            .unwrap_or(path)
    };
    Some((parent.to_owned(), name.to_owned()))
}

/// Removes `field` from the mapping at `path` (`a.b[2].c`).
fn remove_field(value: &mut serde_json::Value, path: &str, field: &str) -> bool {
    let mut node = value;
    for segment in path.split('.').filter(|s| !s.is_empty()) {
        let (key, indexes) = match segment.find('[') {
            Some(i) => (&segment[..i], &segment[i..]),
            None => (segment, ""),
        };
        if !key.is_empty() {
            let Some(next) = node.get_mut(key) else {
                return false;
            };
            node = next;
        }
        for index in indexes
            .split(['[', ']'])
            .filter(|s| !s.is_empty())
            .map(str::parse::<usize>)
        {
            let Some(next) = index.ok().and_then(|i| node.get_mut(i)) else {
                return false;
            };
            node = next;
        }
    }
    node.as_object_mut()
        .and_then(|mapping| mapping.remove(field))
        .is_some()
}

/// The document as YAML, fields in alphabetical order like kube-proxy's `--write-config-to`.
pub fn to_yaml(document: &KubeProxyConfiguration) -> Result<String, ConfigError> {
    Ok(serde_saphyr::to_string(document)?)
}

/// `--write-config-to`.
pub fn write_file(document: &KubeProxyConfiguration, path: &Path) -> Result<(), ConfigError> {
    let text = to_yaml(document)?;
    std::fs::write(path, text).map_err(|source| ConfigError::Write {
        path: path.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests;
