//! `proxy-agent inspect`: what the datapath of a running agent holds, in terms a user
//! recognises — read from the pinned BPF maps in eBPF mode (Service names from the pinned
//! `KPR_SERVICE_NAMES`), from `iptables-save` in iptables mode; `inspect top` (`top.rs`) shows
//! the per-Service traffic counters of either, live.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, bail};
use aya::maps::{Array, HashMap, Map, MapData, PerCpuArray};
use proxy_common::{
    Backend4, Backend6, BackendEntry, BackendSlotKey, Frontend4Key, Frontend6Key, FrontendValue,
    SLOT_BLOCK_SLOTS, SlotBlock, StatAction, StatIndex, frontend_flags, map_names, scope,
};
use proxy_kernel::bpf::map_batch::{BatchReader, read_array};
use serde::Serialize;

use proxy_dataplane_ebpf::{KernelFeatures, PIN_DIR_NAME, ip4_from_map, ip6_from_map};
use proxy_model::{
    cli::{InspectArgs, InspectWhat},
    config::{Config, ebpf_settings::FastPathSetting},
    forward_policy::ForwardPolicy,
};

mod drift;
pub mod explain;
mod http_client;
pub mod interfaces;
pub mod top;

/// One frontend and where it leads.
#[derive(Debug, Clone, Serialize, PartialEq, Eq, PartialOrd, Ord)]
pub struct FrontendRow {
    /// `ns/name:port`, or `#<service id>` when the agent could not be asked.
    pub service: String,
    /// `address:port/PROTOCOL`; NodePorts show `*:port`.
    pub frontend: String,
    /// The frontend's address; `None` for a NodePort (every NodePort address).
    pub address: Option<IpAddr>,
    pub port: u16,
    pub protocol: &'static str,
    /// eBPF mode: the frontend's service id in the maps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service_id: Option<u32>,
    /// `socket` (cgroup hooks) or `external` (tc), or the iptables chain for iptables mode.
    pub path: String,
    pub backends: Vec<String>,
    pub flags: Vec<&'static str>,
}

/// A backend id of the eBPF maps.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct BackendRow {
    pub backend: u32,
    pub address: SocketAddr,
    /// Service ids whose live slots point at it.
    pub used_by: Vec<u32>,
}

/// A session affinity entry.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct AffinityRow {
    /// Socket-level clients: their network namespace cookie; external ones: the address.
    pub client: String,
    pub service_id: u32,
    pub backend: String,
    pub idle_seconds: f64,
}

/// One direction of a flow in the tc programs' conntrack.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ConntrackRow {
    /// `forward` (client → frontend) or `reply` (backend → client or SNAT address).
    pub direction: &'static str,
    /// A FIN or RST was seen: the short close timeout applies.
    pub closing: bool,
    pub protocol: &'static str,
    pub match_source: SocketAddr,
    pub match_destination: SocketAddr,
    pub rewrite_source: SocketAddr,
    pub rewrite_destination: SocketAddr,
    pub idle_seconds: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct CounterRow {
    /// The reason (`StatIndex::name`, the metric's `reason` label).
    pub counter: &'static str,
    /// What the datapath did (`StatAction::name`, the metric's `action` label).
    pub action: &'static str,
    pub value: u64,
}

/// Runs `inspect` and returns what to print.
pub fn run(config: &Config, args: &InspectArgs) -> anyhow::Result<String> {
    let pin_dir = config.ebpf.bpf_root.join(PIN_DIR_NAME);
    let ebpf = pin_dir.join(map_names::FRONTENDS4).exists();
    match (&args.what, ebpf) {
        // Both modes, each from its own counters; it picks the mode itself.
        (InspectWhat::Top, _) => top::run(args, &pin_dir),
        // The agent knows what it wrote; both modes answer.
        (InspectWhat::Drift, _) => drift::run(config.metrics_bind_address, args.json()),
        // The kernel's, whichever mode runs.
        (InspectWhat::Features, _) => render(
            args.json(),
            &features(config, &agent_features(config.metrics_bind_address)),
            feature_table,
        ),
        (InspectWhat::Explain, true) => {
            let names = service_names(&pin_dir, config.metrics_bind_address);
            explain_ebpf(&pin_dir, args, &names)
        }
        (InspectWhat::Explain, false) => explain_iptables(args),
        (InspectWhat::Services, true) => {
            let names = service_names(&pin_dir, config.metrics_bind_address);
            render(
                args.json(),
                &ebpf_frontends(&pin_dir, &names)?,
                frontend_table,
            )
        }
        (InspectWhat::Services, false) => {
            render(args.json(), &iptables_frontends()?, frontend_table)
        }
        (InspectWhat::Interfaces, true) => {
            render(args.json(), &interfaces::rows(&pin_dir)?, interfaces::table)
        }
        (InspectWhat::Counters, true) => {
            render(args.json(), &counters(&pin_dir, args.drops)?, counter_table)
        }
        (InspectWhat::Backends, true) => render(args.json(), &backends(&pin_dir)?, backend_table),
        (InspectWhat::Affinity, true) => render(args.json(), &affinity(&pin_dir)?, affinity_table),
        (InspectWhat::Conntrack, true) => {
            render(args.json(), &conntrack(&pin_dir)?, conntrack_table)
        }
        (what, false) => bail!(
            "no pinned eBPF maps under {}: `inspect {what:?}` reads the eBPF mode's maps (in \
             iptables mode only `services`, `explain`, `drift`, `features` and `top` apply)",
            pin_dir.display()
        ),
    }
}

/// `inspect explain` in iptables mode, over the live ruleset.
fn explain_iptables(args: &InspectArgs) -> anyhow::Result<String> {
    let local_ips = proxy_kernel::iptables::detect::interface_addresses();
    let mut query = explain_query(args)?;
    if query.client.is_unspecified() {
        // A node socket's source is one of the node's addresses; the rules only ask whether
        // it is inside the cluster CIDR, which no node address is.
        if let Some(node) = local_ips
            .iter()
            .find(|ip| ip.is_ipv6() == query.dest.is_ipv6() && !ip.is_loopback())
        {
            query.client = *node;
        }
    }
    let family = proxy_model::desired::IpFamily::of(&query.dest.ip());
    let mut dump = String::new();
    for table in ["nat", "filter"] {
        dump.push_str(&iptables_save(family, table)?);
    }
    let tracer = proxy_dataplane_iptables::tracer::Tracer::new(&dump, &[], &local_ips);
    let mut explanation = explain::explain_iptables(&tracer, &query);
    explain::iptables_affinity(&tracer, &query, &mut explanation, |chain| {
        std::fs::read_to_string(Path::new("/proc/net/xt_recent").join(chain)).ok()
    });
    if args.json() {
        return Ok(serde_json::to_string_pretty(&explanation)?);
    }
    Ok(explain::table(&query, &explanation, None))
}

/// `--from`, `--client`, `--to`, `--sport` as a query.
fn explain_query(args: &InspectArgs) -> anyhow::Result<explain::Query> {
    let from = match args.from.as_str() {
        "node" => explain::From::Node,
        "pod" => explain::From::Pod,
        "external" => explain::From::External,
        other => bail!("--from {other:?}: node, pod or external"),
    };
    let Some(to) = &args.to else {
        bail!("`inspect explain` needs --to IP:PORT/PROTO");
    };
    let (dest, protocol) = explain::parse_destination(to)?;
    let client = match (args.client, from) {
        (Some(client), _) => client,
        (None, explain::From::External) => bail!("--from external needs --client IP"),
        // A local socket's source is chosen by the kernel later; only its family matters here.
        (None, _) if dest.is_ipv6() => IpAddr::from(std::net::Ipv6Addr::UNSPECIFIED),
        (None, _) => IpAddr::from([0, 0, 0, 0]),
    };
    Ok(explain::Query {
        from,
        client,
        dest,
        protocol,
        sport: args.sport,
    })
}

/// `inspect explain` in eBPF mode, over the pinned maps.
fn explain_ebpf(
    pin_dir: &Path,
    args: &InspectArgs,
    names: &BTreeMap<u32, String>,
) -> anyhow::Result<String> {
    let query = explain_query(args)?;
    let maps = explain::PinnedMaps::open(pin_dir)?;
    let explanation = explain::explain(&maps, &query);
    if args.json() {
        return Ok(serde_json::to_string_pretty(&explanation)?);
    }
    let service = explanation.service_id.and_then(|id| names.get(&id));
    Ok(explain::table(
        &query,
        &explanation,
        service.map(String::as_str),
    ))
}

/// One kernel feature: what the kernel has, what an agent with these flags uses, and what the
/// running agent reports using.
#[derive(Debug, Clone, Serialize)]
pub struct FeatureRow {
    pub feature: &'static str,
    pub kernel: bool,
    /// Turned off by `--bpf-disable-feature` (given to `inspect`).
    pub disabled: bool,
    pub used: bool,
    /// `kubeproxy_ebpf_kernel_feature` of the running agent; `None` when it does not answer.
    pub agent: Option<bool>,
    /// What the dataplane does on the chosen path.
    pub path: String,
}

fn features(config: &Config, agent: &BTreeMap<String, bool>) -> Vec<FeatureRow> {
    let probed = KernelFeatures::probe(&config.ebpf.disabled_features);
    let mut rows: Vec<FeatureRow> = probed
        .states()
        .iter()
        .map(|state| {
            let (with, without) = state.feature.paths();
            FeatureRow {
                feature: state.feature.name(),
                kernel: state.kernel,
                disabled: state.disabled,
                used: state.used(),
                agent: agent.get(state.feature.name()).copied(),
                path: if state.used() { with } else { without }.to_owned(),
            }
        })
        .collect();
    rows.push(fast_path_row(
        config.ebpf.tc_fast_path,
        &proxy_kernel::forward_policy::read(),
        agent.get(FAST_PATH_FEATURE).copied(),
    ));
    rows
}

/// The fast path's row of `inspect features`: its columns read "the node allows it" (KERNEL:
/// no forwarding policy), "turned off" (DISABLED: `--tc-fast-path=false`), "an agent with
/// these flags takes it now" (USED) and "the running agent takes it" (AGENT,
/// `kubeproxy_ebpf_fast_path_active`); PATH names the mode and the reason.
fn fast_path_row(
    setting: FastPathSetting,
    policy: &ForwardPolicy,
    agent: Option<bool>,
) -> FeatureRow {
    let used = match setting {
        FastPathSetting::Auto => policy.fast_path_safe(),
        FastPathSetting::On => true,
        FastPathSetting::Off => false,
    };
    let path = match (setting, used) {
        (FastPathSetting::Auto, true) => {
            format!("--tc-fast-path=auto: fast path, XDP with --bpf-xdp auto ({policy})")
        }
        (FastPathSetting::Auto, false) => {
            format!("--tc-fast-path=auto: netfilter path ({policy})")
        }
        (_, true) => format!(
            "--tc-fast-path=true: fast path, XDP with --bpf-xdp auto, whatever the node's \
             forward chains hold ({policy})"
        ),
        (_, false) => format!("--tc-fast-path=false: netfilter path ({policy})"),
    };
    FeatureRow {
        feature: FAST_PATH_FEATURE,
        kernel: policy.fast_path_safe(),
        disabled: setting == FastPathSetting::Off,
        used,
        agent,
        path,
    }
}

/// The fast path's name in `inspect features`.
const FAST_PATH_FEATURE: &str = "fast-path";

/// The running agent's `kubeproxy_ebpf_kernel_feature` samples (empty if it does not answer or
/// runs the iptables mode).
fn agent_features(metrics: Option<SocketAddr>) -> BTreeMap<String, bool> {
    let Some(mut addr) = metrics else {
        return BTreeMap::new();
    };
    if addr.ip().is_unspecified() {
        addr.set_ip(IpAddr::from([127, 0, 0, 1]));
    }
    let Ok(body) = http_get(addr, "/metrics") else {
        return BTreeMap::new();
    };
    let mut features: BTreeMap<String, bool> = body
        .lines()
        .filter_map(|line| line.strip_prefix("kubeproxy_ebpf_kernel_feature{feature=\""))
        .filter_map(|rest| {
            let (name, value) = rest.split_once("\"} ")?;
            Some((name.to_owned(), value.trim() == "1"))
        })
        .collect();
    if let Some(value) = body
        .lines()
        .find_map(|line| line.strip_prefix("kubeproxy_ebpf_fast_path_active "))
    {
        features.insert(FAST_PATH_FEATURE.to_owned(), value.trim() == "1");
    }
    features
}

fn feature_table(rows: &[FeatureRow]) -> String {
    let yes = |b: bool| if b { "yes" } else { "no" };
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<16} {:<7} {:<9} {:<5} {:<6} PATH",
        "FEATURE", "KERNEL", "DISABLED", "USED", "AGENT"
    );
    for row in rows {
        let _ = writeln!(
            out,
            "{:<16} {:<7} {:<9} {:<5} {:<6} {}",
            row.feature,
            yes(row.kernel),
            yes(row.disabled),
            yes(row.used),
            row.agent.map_or("-", yes),
            row.path
        );
    }
    out
}

fn render<T: Serialize>(
    json: bool,
    rows: &[T],
    table: fn(&[T]) -> String,
) -> anyhow::Result<String> {
    if json {
        Ok(serde_json::to_string_pretty(rows)?)
    } else {
        Ok(table(rows))
    }
}

fn frontend_table(rows: &[FrontendRow]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<32} {:<28} {:<9} {:<24} BACKENDS",
        "SERVICE", "FRONTEND", "PATH", "FLAGS"
    );
    for row in rows {
        let flags = if row.flags.is_empty() {
            "-".to_owned()
        } else {
            row.flags.join(",")
        };
        let backends = if row.backends.is_empty() {
            "(none: rejected)".to_owned()
        } else {
            row.backends.join(" ")
        };
        let _ = writeln!(
            out,
            "{:<32} {:<28} {:<9} {:<24} {}",
            row.service, row.frontend, row.path, flags, backends
        );
    }
    out
}

fn backend_table(rows: &[BackendRow]) -> String {
    let mut out = format!(
        "{:<10} {:<44} USED BY (service ids)\n",
        "BACKEND", "ADDRESS"
    );
    for row in rows {
        let used_by: Vec<String> = row.used_by.iter().map(|id| format!("#{id}")).collect();
        let _ = writeln!(
            out,
            "{:<10} {:<44} {}",
            format!("#{}", row.backend),
            row.address,
            used_by.join(",")
        );
    }
    out
}

fn affinity_table(rows: &[AffinityRow]) -> String {
    let mut out = format!(
        "{:<20} {:<10} {:<44} IDLE\n",
        "CLIENT", "SERVICE", "BACKEND"
    );
    for row in rows {
        let _ = writeln!(
            out,
            "{:<20} {:<10} {:<44} {:.1}s",
            row.client,
            format!("#{}", row.service_id),
            row.backend,
            row.idle_seconds
        );
    }
    out
}

fn conntrack_table(rows: &[ConntrackRow]) -> String {
    let mut out = format!(
        "{:<17} {:<5} {:<50} {:<50} IDLE\n",
        "DIRECTION", "PROTO", "MATCH", "REWRITE"
    );
    for row in rows {
        let direction = if row.closing {
            format!("{} (closing)", row.direction)
        } else {
            row.direction.to_owned()
        };
        let _ = writeln!(
            out,
            "{:<17} {:<5} {:<50} {:<50} {:.1}s",
            direction,
            row.protocol,
            format!("{} -> {}", row.match_source, row.match_destination),
            format!("{} -> {}", row.rewrite_source, row.rewrite_destination),
            row.idle_seconds
        );
    }
    out
}

/// One line per reason (reason first, count last, for `grep` and `awk`), in the order of
/// [`counters`]: drops, rejects and untranslated passes first.
fn counter_table(rows: &[CounterRow]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{:<40} {:<20} COUNT", "REASON", "ACTION");
    for row in rows {
        let _ = writeln!(out, "{:<40} {:<20} {}", row.counter, row.action, row.value);
    }
    out
}

fn open_map(pin_dir: &Path, name: &str) -> anyhow::Result<Map> {
    let path: PathBuf = pin_dir.join(name);
    let data =
        MapData::from_pin(&path).with_context(|| format!("cannot open {}", path.display()))?;
    Ok(Map::from_map_data(data)?)
}

/// Service id → name: from the pinned `KPR_SERVICE_NAMES` the agent keeps, else (pins of an
/// older agent) from the running agent, if it answers.
fn service_names(pin_dir: &Path, metrics: Option<SocketAddr>) -> BTreeMap<u32, String> {
    if let Some(names) = proxy_dataplane_ebpf::traffic::service_names(pin_dir)
        .ok()
        .filter(|names| !names.is_empty())
    {
        return names;
    }
    let Some(mut addr) = metrics else {
        return BTreeMap::new();
    };
    if addr.ip().is_unspecified() {
        addr.set_ip(IpAddr::from([127, 0, 0, 1]));
    }
    http_get(addr, "/debug/ebpf/service-ids")
        .ok()
        .and_then(|body| serde_json::from_str(&body).ok())
        .unwrap_or_default()
}

/// A 200's body; anything else (a 429 included: these paths are not rate limited) is an error.
fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<String> {
    match http_client::get(addr, path, Duration::from_secs(2))? {
        http_client::Answer::Body(body) => Ok(body),
        http_client::Answer::RetryAfter(_) => bail!("{addr}{path}: rate limited"),
    }
}

fn flag_names(value: &FrontendValue) -> Vec<&'static str> {
    [
        (frontend_flags::AFFINITY, "affinity"),
        (frontend_flags::PRESERVE_CLIENT, "local"),
        (frontend_flags::DROP_NO_BACKENDS, "drop-if-empty"),
        (frontend_flags::SOURCE_RANGES, "source-ranges"),
        (frontend_flags::CLUSTER_IP, "cluster-ip"),
    ]
    .into_iter()
    .filter(|(bit, _)| value.flags & bit != 0)
    .map(|(_, name)| name)
    .collect()
}

fn protocol_name(number: u8) -> &'static str {
    match number {
        proxy_common::proto::TCP => "TCP",
        proxy_common::proto::UDP => "UDP",
        proxy_common::proto::SCTP => "SCTP",
        _ => "?",
    }
}

/// Every frontend in the pinned maps with the backends of its live slot generation.
pub fn ebpf_frontends(
    pin_dir: &Path,
    names: &BTreeMap<u32, String>,
) -> anyhow::Result<Vec<FrontendRow>> {
    let frontends4: HashMap<MapData, Frontend4Key, FrontendValue> =
        open_map(pin_dir, map_names::FRONTENDS4)?.try_into()?;
    let frontends6: HashMap<MapData, Frontend6Key, FrontendValue> =
        open_map(pin_dir, map_names::FRONTENDS6)?.try_into()?;
    let slots: HashMap<MapData, BackendSlotKey, SlotBlock> =
        open_map(pin_dir, map_names::BACKEND_SLOTS)?.try_into()?;
    let backends4: Array<MapData, Backend4> =
        open_map(pin_dir, map_names::BACKENDS4)?.try_into()?;
    let backends6: Array<MapData, Backend6> =
        open_map(pin_dir, map_names::BACKENDS6)?.try_into()?;

    // Both arrays have every id: the family's is the one whose element holds a backend.
    let backend = |id: u32| -> Option<String> {
        if let Some(b) = backends4.get(&id, 0).ok().filter(BackendEntry::in_use) {
            return Some(
                SocketAddr::new(ip4_from_map(b.addr).into(), u16::from_be(b.port)).to_string(),
            );
        }
        backends6
            .get(&id, 0)
            .ok()
            .filter(BackendEntry::in_use)
            .map(|b| SocketAddr::new(ip6_from_map(b.addr).into(), u16::from_be(b.port)).to_string())
    };
    let row = |addr: IpAddr, port: u16, proto: u8, scope_value: u8, value: FrontendValue| {
        // Each block entry holds `SLOT_BLOCK_SLOTS` slots (read once); a missing block's
        // slots are skipped, as a missing slot was.
        let count = u32::from(value.backend_count);
        let backends = (0..count.div_ceil(SLOT_BLOCK_SLOTS))
            .filter_map(|block| {
                let key = BackendSlotKey {
                    service_id: value.service_id,
                    block: block as u16,
                    generation: value.generation,
                    _pad: 0,
                };
                let used = (count - block * SLOT_BLOCK_SLOTS).min(SLOT_BLOCK_SLOTS) as usize;
                let ids = slots.get(&key, 0).ok()?.backend_ids;
                Some(ids.into_iter().take(used))
            })
            .flatten()
            .filter_map(&backend)
            .collect();
        let host = if addr.is_unspecified() {
            "*".to_owned()
        } else {
            SocketAddr::new(addr, port).ip().to_string()
        };
        let frontend = match addr {
            IpAddr::V6(_) if !addr.is_unspecified() => {
                format!("[{host}]:{port}/{}", protocol_name(proto))
            }
            _ => format!("{host}:{port}/{}", protocol_name(proto)),
        };
        FrontendRow {
            service: names
                .get(&value.service_id)
                .cloned()
                .unwrap_or_else(|| format!("#{}", value.service_id)),
            frontend,
            address: (!addr.is_unspecified()).then_some(addr),
            port,
            protocol: protocol_name(proto),
            service_id: Some(value.service_id),
            path: if scope_value == scope::EXTERNAL {
                "external"
            } else {
                "socket"
            }
            .to_owned(),
            backends,
            flags: flag_names(&value),
        }
    };
    let mut rows = Vec::new();
    for entry in frontends4.iter() {
        let (key, value) = entry?;
        rows.push(row(
            ip4_from_map(key.addr).into(),
            u16::from_be(key.port),
            key.proto,
            key.scope,
            value,
        ));
    }
    for entry in frontends6.iter() {
        let (key, value) = entry?;
        rows.push(row(
            ip6_from_map(key.addr).into(),
            u16::from_be(key.port),
            key.proto,
            key.scope,
            value,
        ));
    }
    rows.sort();
    Ok(rows)
}

fn backend_addr(pin_dir: &Path) -> anyhow::Result<BTreeMap<u32, SocketAddr>> {
    let backends4: Array<MapData, Backend4> =
        open_map(pin_dir, map_names::BACKENDS4)?.try_into()?;
    let backends6: Array<MapData, Backend6> =
        open_map(pin_dir, map_names::BACKENDS6)?.try_into()?;
    let mut out = BTreeMap::new();
    // Arrays indexed by backend id, every index read (in batches: one lookup each would be a
    // syscall per possible id); an element without a backend is an unused id.
    let mut reader = BatchReader::default();
    let mut read4 = Vec::new();
    read_array(
        &backends4,
        &mut reader,
        map_names::BACKENDS4,
        BackendEntry::in_use,
        &mut read4,
    );
    for (id, b) in read4 {
        out.insert(
            id,
            SocketAddr::new(ip4_from_map(b.addr).into(), u16::from_be(b.port)),
        );
    }
    let mut read6 = Vec::new();
    read_array(
        &backends6,
        &mut reader,
        map_names::BACKENDS6,
        BackendEntry::in_use,
        &mut read6,
    );
    for (id, b) in read6 {
        out.insert(
            id,
            SocketAddr::new(ip6_from_map(b.addr).into(), u16::from_be(b.port)),
        );
    }
    Ok(out)
}

/// Backend ids with their address and the service ids whose slots point at them.
pub fn backends(pin_dir: &Path) -> anyhow::Result<Vec<BackendRow>> {
    let addrs = backend_addr(pin_dir)?;
    let slots: HashMap<MapData, BackendSlotKey, SlotBlock> =
        open_map(pin_dir, map_names::BACKEND_SLOTS)?.try_into()?;
    let mut users: BTreeMap<u32, std::collections::BTreeSet<u32>> = BTreeMap::new();
    for entry in slots.iter() {
        let (key, block) = entry?;
        // Entries past the frontend's backend count in its last block are 0, never an id.
        for id in block.backend_ids.into_iter().filter(|&id| id != 0) {
            users.entry(id).or_default().insert(key.service_id);
        }
    }
    Ok(addrs
        .into_iter()
        .map(|(backend, address)| BackendRow {
            backend,
            address,
            used_by: users.get(&backend).into_iter().flatten().copied().collect(),
        })
        .collect())
}

/// Affinity entries: client identity (netns cookie for local clients, the address for external
/// ones), service id, backend and how long ago it was last used.
pub fn affinity(pin_dir: &Path) -> anyhow::Result<Vec<AffinityRow>> {
    let addrs = backend_addr(pin_dir)?;
    let map: HashMap<MapData, proxy_common::AffinityKey, proxy_common::AffinityValue> =
        open_map(pin_dir, map_names::AFFINITY)?.try_into()?;
    let now = monotonic_ns();
    let mut rows = Vec::new();
    for entry in map.iter() {
        let (key, value) = entry?;
        rows.push(AffinityRow {
            client: format!("{:#x}", key.client),
            service_id: key.service_id,
            backend: addrs
                .get(&value.backend_id)
                .map_or_else(|| format!("#{}", value.backend_id), ToString::to_string),
            idle_seconds: seconds_since(now, value.last_used_ns),
        });
    }
    Ok(rows)
}

/// The tc conntrack: each entry's match tuple and the tuple a packet is rewritten to.
pub fn conntrack(pin_dir: &Path) -> anyhow::Result<Vec<ConntrackRow>> {
    let map = proxy_dataplane_ebpf::ConntrackMaps::open_pinned(pin_dir)?;
    let now = monotonic_ns();
    let addr = |family: u8, words: [u32; 4], port: u16| -> SocketAddr {
        let ip: IpAddr = if family == proxy_common::family::V4 {
            ip4_from_map(words[0]).into()
        } else {
            ip6_from_map(words).into()
        };
        SocketAddr::new(ip, u16::from_be(port))
    };
    let mut rows = Vec::new();
    for (key, value) in map.entries() {
        let reply = value.flags & proxy_common::ct_flags::REPLY != 0;
        rows.push(ConntrackRow {
            direction: if reply { "reply" } else { "forward" },
            closing: value.flags & proxy_common::ct_flags::CLOSING != 0,
            protocol: protocol_name(key.proto),
            match_source: addr(key.family, key.src, key.sport),
            match_destination: addr(key.family, key.dst, key.dport),
            rewrite_source: addr(key.family, value.src, value.sport),
            rewrite_destination: addr(key.family, value.dst, value.dport),
            idle_seconds: seconds_since(now, value.last_seen_ns),
        });
    }
    Ok(rows)
}

/// Seconds from a `bpf_ktime_get_ns()` reading to `now`, to a tenth.
fn seconds_since(now: u64, then: u64) -> f64 {
    (now.saturating_sub(then) / 100_000_000) as f64 / 10.0
}

/// `bpf_ktime_get_ns()`'s clock: CLOCK_MONOTONIC.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into the valid, exclusively borrowed `ts`.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) } != 0 {
        return 0;
    }
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

/// The per-CPU datapath counters, summed, grouped by action (dropped, rejected, passed
/// untranslated, translated, other; by index within each); with `drops_only`, only the first
/// three groups.
pub fn counters(pin_dir: &Path, drops_only: bool) -> anyhow::Result<Vec<CounterRow>> {
    let stats: PerCpuArray<MapData, u64> = open_map(pin_dir, map_names::STATS)?.try_into()?;
    let mut rows = Vec::new();
    for action in StatAction::ALL {
        if drops_only && !action.is_drop() {
            continue;
        }
        for index in StatIndex::ALL.into_iter().filter(|i| i.action() == action) {
            rows.push(CounterRow {
                counter: index.name(),
                action: action.name(),
                value: stats.get(&(index as u32), 0)?.iter().sum(),
            });
        }
    }
    Ok(rows)
}

/// Service frontends from kube-proxy-style rules: `KUBE-SERVICES` / `KUBE-NODEPORTS` jumps with
/// their comment, each `KUBE-SVC-*`/`KUBE-EXT-*` chain's endpoint chains, each `KUBE-SEP-*`'s
/// DNAT destination; and from the filter table, the frontends of Services without endpoints,
/// which kube-proxy rejects there (they have no nat rule at all).
pub fn iptables_frontends() -> anyhow::Result<Vec<FrontendRow>> {
    let mut rows = Vec::new();
    for family in proxy_model::desired::IpFamily::ALL {
        // A family without a working ip(6)tables has no rules to show.
        for table in ["nat", "filter"] {
            if let Ok(save) = iptables_save(family, table) {
                rows.extend(parse_iptables_save(&save));
            }
        }
    }
    rows.sort();
    Ok(rows)
}

/// `iptables-save -t <table>` with the backend (nft or legacy) the agent itself picks, as
/// iptables-wrapper does: the one holding kube-proxy's rules.
fn iptables_save(family: proxy_model::desired::IpFamily, table: &str) -> anyhow::Result<String> {
    let iptables = proxy_kernel::iptables::exec::Iptables {
        family,
        backend: proxy_kernel::iptables::detect::detect_backend(),
        version: None,
    };
    Ok(iptables.save(table)?)
}

/// The value following `flag` in a rule (`-d 10.96.0.10/32` → `10.96.0.10/32`).
pub fn parse_iptables_save(text: &str) -> Vec<FrontendRow> {
    let tables = proxy_kernel::iptables::save::parse(text);
    let mut chain_jumps: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    let mut dnat: BTreeMap<&str, String> = BTreeMap::new();
    let mut entries = Vec::new();
    let rules = tables.iter().flat_map(|table| {
        table
            .rules
            .iter()
            .map(move |rule| (table.name.as_str(), rule))
    });
    for (table, rule) in rules {
        let chain = rule.chain.as_str();
        let Some(target) = rule.arg("-j") else {
            continue;
        };
        // A Service port's comment starts with `namespace/name:port`; the jump to
        // KUBE-NODEPORTS ("kubernetes service nodeports; …") and other rules are no Service.
        let service = rule
            .arg("--comment")
            .map(|comment| comment.split(' ').next().unwrap_or(comment))
            .filter(|name| name.contains('/'));
        let rejecting = table == "filter"
            && matches!(target, "REJECT" | "DROP")
            && matches!(
                chain,
                "KUBE-SERVICES" | "KUBE-EXTERNAL-SERVICES" | "KUBE-NODEPORTS"
            );
        if table == "filter" && !rejecting {
            continue;
        }
        if chain.starts_with("KUBE-SEP-") && target == "DNAT" {
            if let Some(to) = rule.arg("--to-destination") {
                dnat.insert(chain, to.to_owned());
            }
        } else if chain.starts_with("KUBE-SVC-")
            || chain.starts_with("KUBE-SVL-")
            || chain.starts_with("KUBE-EXT-")
        {
            chain_jumps.entry(chain).or_default().push(target);
        } else if (chain == "KUBE-SERVICES" || chain == "KUBE-NODEPORTS" || rejecting)
            && (target.starts_with("KUBE-") || rejecting)
            && target != "KUBE-NODEPORTS"
            && let Some(name) = service
        {
            let dest = rule
                .arg("-d")
                .map(|d| d.trim_end_matches("/32").trim_end_matches("/128"))
                .unwrap_or("*");
            let port_text = rule.arg("--dport").unwrap_or("?");
            let proto = rule.arg("-p").unwrap_or("tcp").to_uppercase();
            let service = name.to_owned();
            let protocol = match proto.as_str() {
                "UDP" => "UDP",
                "SCTP" => "SCTP",
                _ => "TCP",
            };
            entries.push((
                service,
                format!("{dest}:{port_text}/{proto}"),
                dest.parse::<IpAddr>().ok(),
                port_text.parse::<u16>().unwrap_or(0),
                protocol,
                target,
            ));
        }
    }
    // Follow SVC/EXT chains (EXT → SVC → SEP) to the DNAT destinations.
    fn resolve<'a>(
        chain: &'a str,
        jumps: &BTreeMap<&'a str, Vec<&'a str>>,
        dnat: &BTreeMap<&str, String>,
        depth: usize,
        out: &mut Vec<String>,
    ) {
        if let Some(to) = dnat.get(chain) {
            if !out.contains(to) {
                out.push(to.clone());
            }
            return;
        }
        if depth > 4 {
            return;
        }
        for next in jumps.get(chain).into_iter().flatten() {
            resolve(next, jumps, dnat, depth + 1, out);
        }
    }
    entries
        .into_iter()
        .map(|(service, frontend, address, port, protocol, chain)| {
            let mut backends = Vec::new();
            resolve(chain, &chain_jumps, &dnat, 0, &mut backends);
            FrontendRow {
                service,
                frontend,
                address,
                port,
                protocol,
                service_id: None,
                path: chain.to_owned(),
                backends,
                flags: Vec::new(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fast_path_row_names_the_mode_the_choice_and_the_policy() {
        let found = ForwardPolicy::Found("x chain FORWARD: policy DROP".into());
        let row = fast_path_row(FastPathSetting::Auto, &found, Some(false));
        assert!(!row.kernel && !row.used && !row.disabled);
        assert_eq!(row.agent, Some(false));
        assert_eq!(
            row.path,
            "--tc-fast-path=auto: netfilter path (forwarding policy: x chain FORWARD: policy DROP)"
        );
        let row = fast_path_row(FastPathSetting::Auto, &ForwardPolicy::None, None);
        assert!(row.kernel && row.used && row.path.contains("fast path"));
        // Forced, the policy is shown but does not decide.
        assert!(fast_path_row(FastPathSetting::On, &found, None).used);
        let off = fast_path_row(FastPathSetting::Off, &ForwardPolicy::None, None);
        assert!(off.disabled && !off.used && off.kernel);
    }

    #[test]
    fn iptables_save_is_followed_to_the_endpoints() {
        let save = r#"*nat
-A KUBE-SERVICES -m comment --comment "default/web:http cluster IP" -m tcp -p tcp -d 10.96.0.10/32 --dport 80 -j KUBE-SVC-AAA
-A KUBE-SVC-AAA -m comment --comment "default/web:http -> 10.244.1.2:8080" -m statistic --mode random --probability 0.5000000000 -j KUBE-SEP-ONE
-A KUBE-SVC-AAA -m comment --comment "default/web:http -> 10.244.2.2:8080" -j KUBE-SEP-TWO
-A KUBE-SEP-ONE -m comment --comment default/web:http -m tcp -p tcp -j DNAT --to-destination 10.244.1.2:8080
-A KUBE-SEP-TWO -m comment --comment default/web:http -m tcp -p tcp -j DNAT --to-destination 10.244.2.2:8080
COMMIT
"#;
        let rows = parse_iptables_save(save);
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].service, "default/web:http");
        assert_eq!(rows[0].frontend, "10.96.0.10:80/TCP");
        assert_eq!(rows[0].backends, ["10.244.1.2:8080", "10.244.2.2:8080"]);
    }

    /// The generator's own output: the jumps to KUBE-NODEPORTS are no Service (they showed as
    /// `kubernetes *:?/TCP` and `kubernetes ::1:?/TCP`), and a Service without endpoints, which
    /// only has REJECT rules in the filter table, is listed with no backend.
    #[test]
    fn the_node_port_jump_is_no_service_and_a_service_without_endpoints_is_listed() {
        let save = r#"*filter
:KUBE-SERVICES - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
-A KUBE-SERVICES -m comment --comment "default/empty:http has no endpoints" -m tcp -p tcp -d 10.96.0.20/32 --dport 80 -j REJECT
-A KUBE-EXTERNAL-SERVICES -m comment --comment "default/empty:http has no endpoints" -m addrtype --dst-type LOCAL -m tcp -p tcp --dport 30020 -j REJECT
-A KUBE-FORWARD -m conntrack --ctstate INVALID -m nfacct --nfacct-name ct_state_invalid_dropped_pkts -j DROP
COMMIT
*nat
-A KUBE-SERVICES -m comment --comment "default/web:http cluster IP" -m tcp -p tcp -d 10.96.0.10/32 --dport 80 -j KUBE-SVC-AAA
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -d ::1/128 -j KUBE-NODEPORTS
-A KUBE-SVC-AAA -m comment --comment "default/web:http -> 10.244.1.2:8080" -j KUBE-SEP-ONE
-A KUBE-SEP-ONE -m comment --comment default/web:http -m tcp -p tcp -j DNAT --to-destination 10.244.1.2:8080
COMMIT
"#;
        let mut rows = parse_iptables_save(save);
        rows.sort();
        let listed: Vec<(&str, &str, &str, usize)> = rows
            .iter()
            .map(|r| {
                (
                    r.service.as_str(),
                    r.frontend.as_str(),
                    r.path.as_str(),
                    r.backends.len(),
                )
            })
            .collect();
        assert_eq!(
            listed,
            [
                ("default/empty:http", "*:30020/TCP", "REJECT", 0),
                ("default/empty:http", "10.96.0.20:80/TCP", "REJECT", 0),
                ("default/web:http", "10.96.0.10:80/TCP", "KUBE-SVC-AAA", 1),
            ]
        );
    }
}
