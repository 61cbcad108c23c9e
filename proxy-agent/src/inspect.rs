//! `proxy-agent inspect`: what the datapath of a running agent holds, in terms a user
//! recognises — read from the pinned BPF maps in eBPF mode (names from the agent's
//! `/debug/ebpf/service-ids`), from `iptables-save` in iptables mode.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    io::{Read as _, Write as _},
    net::{IpAddr, SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::{Context as _, bail};
use aya::maps::{HashMap, Map, MapData, PerCpuArray};
use proxy_common::{
    Backend4, Backend6, BackendSlotKey, Frontend4Key, Frontend6Key, FrontendValue, StatIndex,
    frontend_flags, map_names, scope,
};
use serde::Serialize;

use crate::{
    cli::{InspectArgs, InspectWhat},
    config::Config,
    dataplane::ebpf::{PIN_DIR_NAME, ip4_from_map, ip6_from_map},
};

mod drift;
pub mod explain;

/// One frontend and where it leads.
#[derive(Debug, Clone, Serialize, PartialEq, Eq, PartialOrd, Ord)]
pub struct FrontendRow {
    /// `ns/name:port`, or `#<service id>` when the agent could not be asked.
    pub service: String,
    /// `address:port/PROTOCOL`; NodePorts show `*:port`.
    pub frontend: String,
    /// `socket` (cgroup hooks) or `external` (tc), or the iptables chain for iptables mode.
    pub path: String,
    pub backends: Vec<String>,
    pub flags: Vec<&'static str>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CounterRow {
    pub counter: &'static str,
    pub value: u64,
}

/// Runs `inspect` and returns what to print.
pub fn run(config: &Config, args: &InspectArgs) -> anyhow::Result<String> {
    let pin_dir = config.ebpf.bpf_root.join(PIN_DIR_NAME);
    let ebpf = pin_dir.join(map_names::FRONTENDS4).exists();
    match (&args.what, ebpf) {
        // The agent knows what it wrote; both modes answer.
        (InspectWhat::Drift, _) => drift::run(config.metrics_bind_address, args.json),
        (InspectWhat::Explain, true) => {
            let names = service_names(config.metrics_bind_address);
            explain_ebpf(&pin_dir, args, &names)
        }
        (InspectWhat::Explain, false) => explain_iptables(args),
        (InspectWhat::Services, true) => {
            let names = service_names(config.metrics_bind_address);
            render(
                args.json,
                &ebpf_frontends(&pin_dir, &names)?,
                frontend_table,
            )
        }
        (InspectWhat::Services, false) => render(args.json, &iptables_frontends()?, frontend_table),
        (InspectWhat::Counters, true) => render(args.json, &counters(&pin_dir)?, counter_table),
        (InspectWhat::Backends, true) => render(args.json, &backends(&pin_dir)?, generic_table),
        (InspectWhat::Affinity, true) => render(args.json, &affinity(&pin_dir)?, generic_table),
        (InspectWhat::Conntrack, true) => render(args.json, &conntrack(&pin_dir)?, generic_table),
        (what, false) => bail!(
            "no pinned eBPF maps under {}: `inspect {what:?}` reads the eBPF mode's maps (in \
             iptables mode only `services`, `explain` and `drift` apply)",
            pin_dir.display()
        ),
    }
}

/// `inspect explain` in iptables mode, over the live ruleset.
fn explain_iptables(args: &InspectArgs) -> anyhow::Result<String> {
    let local_ips = crate::dataplane::iptables::detect::interface_addresses();
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
    let tool = if query.dest.is_ipv6() {
        "ip6tables-save"
    } else {
        "iptables-save"
    };
    let mut dump = String::new();
    for table in ["nat", "filter"] {
        let output = Command::new(tool)
            .args(["-t", table])
            .output()
            .with_context(|| format!("running {tool}"))?;
        if !output.status.success() {
            bail!(
                "{tool} -t {table}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        dump.push_str(&String::from_utf8_lossy(&output.stdout));
    }
    let tracer = crate::dataplane::iptables::tracer::Tracer::new(&dump, &[], &local_ips);
    let mut explanation = explain::explain_iptables(&tracer, &query);
    explain::iptables_affinity(&tracer, &query, &mut explanation, |chain| {
        std::fs::read_to_string(Path::new("/proc/net/xt_recent").join(chain)).ok()
    });
    if args.json {
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
    if args.json {
        return Ok(serde_json::to_string_pretty(&explanation)?);
    }
    let service = explanation.service_id.and_then(|id| names.get(&id));
    Ok(explain::table(
        &query,
        &explanation,
        service.map(String::as_str),
    ))
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

/// Rows of `key: value` pairs, one line each.
fn generic_table(rows: &[BTreeMap<&'static str, String>]) -> String {
    let mut out = String::new();
    for row in rows {
        let line: Vec<String> = row.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let _ = writeln!(out, "{}", line.join("  "));
    }
    out
}

fn counter_table(rows: &[CounterRow]) -> String {
    let mut out = String::new();
    for row in rows {
        let _ = writeln!(out, "{:<40} {}", row.counter, row.value);
    }
    out
}

fn open_map(pin_dir: &Path, name: &str) -> anyhow::Result<Map> {
    let path: PathBuf = pin_dir.join(name);
    let data =
        MapData::from_pin(&path).with_context(|| format!("cannot open {}", path.display()))?;
    Ok(Map::from_map_data(data)?)
}

/// Service id → name from the running agent, if it answers.
fn service_names(metrics: Option<SocketAddr>) -> BTreeMap<u32, String> {
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

fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<String> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    if !head.starts_with("HTTP/1.1 200") {
        bail!("{addr}{path}: {}", head.lines().next().unwrap_or_default());
    }
    Ok(body.to_owned())
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
    let slots: HashMap<MapData, BackendSlotKey, u32> =
        open_map(pin_dir, map_names::BACKEND_SLOTS)?.try_into()?;
    let backends4: HashMap<MapData, u32, Backend4> =
        open_map(pin_dir, map_names::BACKENDS4)?.try_into()?;
    let backends6: HashMap<MapData, u32, Backend6> =
        open_map(pin_dir, map_names::BACKENDS6)?.try_into()?;

    let backend = |id: u32| -> Option<String> {
        if let Ok(b) = backends4.get(&id, 0) {
            return Some(
                SocketAddr::new(ip4_from_map(b.addr).into(), u16::from_be(b.port)).to_string(),
            );
        }
        backends6
            .get(&id, 0)
            .ok()
            .map(|b| SocketAddr::new(ip6_from_map(b.addr).into(), u16::from_be(b.port)).to_string())
    };
    let row = |addr: IpAddr, port: u16, proto: u8, scope_value: u8, value: FrontendValue| {
        let backends = (0..value.backend_count)
            .filter_map(|slot| {
                let key = BackendSlotKey {
                    service_id: value.service_id,
                    slot,
                    generation: value.generation,
                    _pad: 0,
                };
                slots.get(&key, 0).ok().and_then(&backend)
            })
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

fn backend_addr(pin_dir: &Path) -> anyhow::Result<BTreeMap<u32, String>> {
    let backends4: HashMap<MapData, u32, Backend4> =
        open_map(pin_dir, map_names::BACKENDS4)?.try_into()?;
    let backends6: HashMap<MapData, u32, Backend6> =
        open_map(pin_dir, map_names::BACKENDS6)?.try_into()?;
    let mut out = BTreeMap::new();
    for entry in backends4.iter() {
        let (id, b) = entry?;
        out.insert(
            id,
            SocketAddr::new(ip4_from_map(b.addr).into(), u16::from_be(b.port)).to_string(),
        );
    }
    for entry in backends6.iter() {
        let (id, b) = entry?;
        out.insert(
            id,
            SocketAddr::new(ip6_from_map(b.addr).into(), u16::from_be(b.port)).to_string(),
        );
    }
    Ok(out)
}

/// Backend ids with their address and the service ids whose slots point at them.
pub fn backends(pin_dir: &Path) -> anyhow::Result<Vec<BTreeMap<&'static str, String>>> {
    let addrs = backend_addr(pin_dir)?;
    let slots: HashMap<MapData, BackendSlotKey, u32> =
        open_map(pin_dir, map_names::BACKEND_SLOTS)?.try_into()?;
    let mut users: BTreeMap<u32, std::collections::BTreeSet<u32>> = BTreeMap::new();
    for entry in slots.iter() {
        let (key, id) = entry?;
        users.entry(id).or_default().insert(key.service_id);
    }
    Ok(addrs
        .into_iter()
        .map(|(id, addr)| {
            let services: Vec<String> = users
                .get(&id)
                .into_iter()
                .flatten()
                .map(|s| format!("#{s}"))
                .collect();
            BTreeMap::from([
                ("backend", format!("#{id}")),
                ("address", addr),
                ("used_by", services.join(",")),
            ])
        })
        .collect())
}

/// Affinity entries: client identity (netns cookie for local clients, the address for external
/// ones), service id, backend and how long ago it was last used.
pub fn affinity(pin_dir: &Path) -> anyhow::Result<Vec<BTreeMap<&'static str, String>>> {
    let addrs = backend_addr(pin_dir)?;
    let map: HashMap<MapData, proxy_common::AffinityKey, proxy_common::AffinityValue> =
        open_map(pin_dir, map_names::AFFINITY)?.try_into()?;
    let now = monotonic_ns();
    let mut rows = Vec::new();
    for entry in map.iter() {
        let (key, value) = entry?;
        rows.push(BTreeMap::from([
            ("client", format!("{:#x}", key.client)),
            ("service", format!("#{}", key.service_id)),
            (
                "backend",
                addrs
                    .get(&value.backend_id)
                    .cloned()
                    .unwrap_or_else(|| format!("#{}", value.backend_id)),
            ),
            (
                "idle_s",
                format!("{:.1}", now.saturating_sub(value.last_used_ns) as f64 / 1e9),
            ),
        ]));
    }
    Ok(rows)
}

/// The tc conntrack: each entry's match tuple and the tuple a packet is rewritten to.
pub fn conntrack(pin_dir: &Path) -> anyhow::Result<Vec<BTreeMap<&'static str, String>>> {
    let map: HashMap<MapData, proxy_common::CtKey, proxy_common::CtValue> =
        open_map(pin_dir, map_names::CT)?.try_into()?;
    let now = monotonic_ns();
    let addr = |family: u8, words: [u32; 4], port: u16| -> String {
        let ip: IpAddr = if family == proxy_common::family::V4 {
            ip4_from_map(words[0]).into()
        } else {
            ip6_from_map(words).into()
        };
        SocketAddr::new(ip, u16::from_be(port)).to_string()
    };
    let mut rows = Vec::new();
    for entry in map.iter() {
        let (key, value) = entry?;
        let direction = if value.flags & proxy_common::ct_flags::REPLY != 0 {
            "reply"
        } else if value.flags & proxy_common::ct_flags::CLOSING != 0 {
            // A FIN or RST was seen: the short close timeout applies.
            "forward (closing)"
        } else {
            "forward"
        };
        rows.push(BTreeMap::from([
            ("direction", direction.to_owned()),
            ("protocol", protocol_name(key.proto).to_owned()),
            (
                "match",
                format!(
                    "{} -> {}",
                    addr(key.family, key.src, key.sport),
                    addr(key.family, key.dst, key.dport)
                ),
            ),
            (
                "rewrite",
                format!(
                    "{} -> {}",
                    addr(key.family, value.src, value.sport),
                    addr(key.family, value.dst, value.dport)
                ),
            ),
            (
                "idle_s",
                format!("{:.1}", now.saturating_sub(value.last_seen_ns) as f64 / 1e9),
            ),
        ]));
    }
    Ok(rows)
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

/// The per-CPU datapath counters, summed.
pub fn counters(pin_dir: &Path) -> anyhow::Result<Vec<CounterRow>> {
    let stats: PerCpuArray<MapData, u64> = open_map(pin_dir, map_names::STATS)?.try_into()?;
    StatIndex::ALL
        .iter()
        .map(|&index| {
            let value = stats.get(&(index as u32), 0)?.iter().sum();
            Ok(CounterRow {
                counter: index.name(),
                value,
            })
        })
        .collect()
}

/// Service frontends from kube-proxy-style rules: `KUBE-SERVICES` / `KUBE-NODEPORTS` jumps with
/// their comment, each `KUBE-SVC-*`/`KUBE-EXT-*` chain's endpoint chains, each `KUBE-SEP-*`'s
/// DNAT destination.
pub fn iptables_frontends() -> anyhow::Result<Vec<FrontendRow>> {
    let mut rows = Vec::new();
    for save in ["iptables-save", "ip6tables-save"] {
        let output = Command::new(save).args(["-t", "nat"]).output();
        let Ok(output) = output else { continue };
        if !output.status.success() {
            continue;
        }
        rows.extend(parse_iptables_save(&String::from_utf8_lossy(
            &output.stdout,
        )));
    }
    rows.sort();
    Ok(rows)
}

/// The value following `flag` in a rule (`-d 10.96.0.10/32` → `10.96.0.10/32`).
fn arg<'a>(words: &[&'a str], flag: &str) -> Option<&'a str> {
    words
        .iter()
        .position(|w| *w == flag)
        .and_then(|i| words.get(i + 1))
        .copied()
}

fn comment(rule: &str) -> Option<&str> {
    let start = rule.find("--comment \"")? + "--comment \"".len();
    let end = rule[start..].find('"')?;
    Some(&rule[start..start + end])
}

pub fn parse_iptables_save(text: &str) -> Vec<FrontendRow> {
    let mut chain_jumps: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    let mut dnat: BTreeMap<&str, String> = BTreeMap::new();
    let mut entries = Vec::new();
    for rule in text.lines().filter(|l| l.starts_with("-A ")) {
        let words: Vec<&str> = rule.split_whitespace().collect();
        let (Some(chain), Some(target)) = (words.get(1).copied(), arg(&words, "-j")) else {
            continue;
        };
        if chain.starts_with("KUBE-SEP-") && target == "DNAT" {
            if let Some(to) = arg(&words, "--to-destination") {
                dnat.insert(chain, to.to_owned());
            }
        } else if chain.starts_with("KUBE-SVC-")
            || chain.starts_with("KUBE-SVL-")
            || chain.starts_with("KUBE-EXT-")
        {
            chain_jumps.entry(chain).or_default().push(target);
        } else if (chain == "KUBE-SERVICES" || chain == "KUBE-NODEPORTS")
            && target.starts_with("KUBE-")
            && let Some(name) = comment(rule)
        {
            let dest = arg(&words, "-d")
                .map(|d| d.trim_end_matches("/32").trim_end_matches("/128"))
                .unwrap_or("*");
            let port = arg(&words, "--dport").unwrap_or("?");
            let proto = arg(&words, "-p").unwrap_or("tcp").to_uppercase();
            let service = name.split(' ').next().unwrap_or(name).to_owned();
            entries.push((service, format!("{dest}:{port}/{proto}"), target));
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
        .map(|(service, frontend, chain)| {
            let mut backends = Vec::new();
            resolve(chain, &chain_jumps, &dnat, 0, &mut backends);
            FrontendRow {
                service,
                frontend,
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
}
