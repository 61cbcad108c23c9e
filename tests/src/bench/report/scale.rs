//! The report's parts for the scale goals (`bench::scale`): goal rows and the
//! "Scale" section (map memory per size, API-source changes, probe gaps).

use std::fmt::Write as _;
use std::time::Duration;

use super::super::agent_runs::{AgentMemory, ChangeSample, ChangeSplit, StartPhases, payload};
use super::super::scale::{GapRun, ScaleResult};
use super::super::stats::Percentiles;
use super::super::{AgentModeRun, Outcome, ProgrammingSize, Results};
use super::{GOAL_RSS_MIB, agent_runs, dur, outcome_note, size};

const GOAL_SMALL_MAPS_MIB: f64 = 32.0;
const GOAL_MAPS_OVER_NEEDED: f64 = 1.5;
const GOAL_SCALE_COLD_START: Duration = Duration::from_secs(3);
const GOAL_SCALE_RSS_MIB: f64 = 120.0;
const GOAL_API_CHANGE_P99: Duration = Duration::from_millis(5);
const GOAL_MAX_GAP: Duration = Duration::from_millis(20);
/// Restart to ready (the same eBPF object, on the pins the stopped agent left).
const GOAL_RESTART_TO_READY: Duration = Duration::from_millis(300);
/// The slowest API-source changes listed with their parts.
const SLOWEST_CHANGES: usize = 3;

fn mib(bytes: u64) -> f64 {
    bytes as f64 / 1024.0 / 1024.0
}

/// Every size the agent ran at: §5's programming sizes, then the scale size.
pub(super) fn agent_sizes(r: &Results) -> impl Iterator<Item = &ProgrammingSize> {
    r.programming
        .iter()
        .chain(r.scale.as_ref().map(|s| &s.size))
}

fn workload_label(p: &ProgrammingSize) -> String {
    format!(
        "{} Services × {} endpoints",
        size(p.workload.services),
        p.workload.endpoints
    )
}

/// `X MiB for Y MiB needed (Z×)` for the programmed maps, and all maps.
fn maps_cell(m: &AgentMemory) -> String {
    let needed = m.needed_bytes();
    let programmed = m.programmed_memlock();
    format!(
        "programmed maps {:.1} MiB for {:.1} MiB needed ({}); all {} maps {:.1} MiB",
        mib(programmed),
        mib(needed),
        over_needed(m).map_or_else(|| "–".to_owned(), |x| format!("{x:.2}×")),
        m.maps.len(),
        mib(m.map_memlock())
    )
}

/// MiB with two decimals, or KiB below one MiB (a small node's entries need a few KiB).
fn small_bytes(bytes: u64) -> String {
    if bytes < 1 << 20 {
        format!("{:.1} KiB", bytes as f64 / 1024.0)
    } else {
        format!("{:.2} MiB", mib(bytes))
    }
}

fn over_needed(m: &AgentMemory) -> Option<f64> {
    let needed = m.needed_bytes();
    (needed > 0).then(|| m.programmed_memlock() as f64 / needed as f64)
}

/// The map with the most kernel memory: `NAME X MiB`.
fn largest_map(m: &AgentMemory) -> String {
    m.maps.iter().max_by_key(|map| map.memlock).map_or_else(
        || "–".to_owned(),
        |map| format!("{} {:.1} MiB", map.name, mib(map.memlock)),
    )
}

/// The eBPF run's memory at `p` (manifests source, else API server source).
fn ebpf_memory(p: &ProgrammingSize) -> Option<&AgentMemory> {
    p.ebpf
        .done()
        .or_else(|| p.api_ebpf.done())
        .map(|run| &run.memory)
}

fn missed_by(over: String) -> String {
    format!("**missed** by {over} — see §6b")
}

/// Goal rows (after the existing agent rows).
pub(super) fn goal_rows(md: &mut String, r: &Results, programming_endpoints: usize) {
    let scale = r.scale.as_ref();
    // Map memory on a small node.
    let (measured, verdict) = match scale.map(|s| &s.small) {
        Some(Outcome::Done(small)) => {
            let total = mib(small.memory.map_memlock());
            (
                format!(
                    "{} Services: {total:.1} MiB over {} maps (largest: {})",
                    small.workload.services,
                    small.memory.maps.len(),
                    largest_map(&small.memory)
                ),
                if total <= GOAL_SMALL_MAPS_MIB {
                    "met".to_owned()
                } else {
                    missed_by(format!("{:.1} MiB", total - GOAL_SMALL_MAPS_MIB))
                },
            )
        }
        Some(other) => ("–".into(), outcome_note(other).unwrap_or_default()),
        None => ("–".into(), "not measured".into()),
    };
    let _ = writeln!(
        md,
        "| BPF map memory (kernel, memlock) ≤ {GOAL_SMALL_MAPS_MIB:.0} MiB on a node with 10 Services (eBPF) | {measured} | {verdict} |"
    );
    // Map memory against what the entries need at 30k × 10 (and 50k × 2, for reference).
    let at_30k = r
        .programming
        .iter()
        .filter(|p| p.workload.endpoints == programming_endpoints)
        .filter_map(|p| ebpf_memory(p).map(|m| (p, m)))
        .max_by_key(|(p, _)| p.workload.services);
    let (measured, verdict) = match at_30k {
        Some((p, m)) => {
            let mut cell = format!("{}: {}", workload_label(p), maps_cell(m));
            if let Some(sc) = scale
                && let Some(m) = ebpf_memory(&sc.size)
            {
                let _ = write!(cell, "; {}: {}", workload_label(&sc.size), maps_cell(m));
            }
            let verdict = match over_needed(m) {
                Some(x) if x <= GOAL_MAPS_OVER_NEEDED => "met".to_owned(),
                Some(x) => missed_by(format!("{:.2}×", x - GOAL_MAPS_OVER_NEEDED)),
                None => "no entries counted".to_owned(),
            };
            (cell, verdict)
        }
        None => ("–".into(), "not measured".into()),
    };
    let _ = writeln!(
        md,
        "| BPF map memory of the programmed maps ≤ {GOAL_MAPS_OVER_NEEDED}× what their entries need (Σ entries × (key + value size), §6b) at 30k Services × 10 endpoints (eBPF) | {measured} | {verdict} |"
    );
    // Cold start and RSS at the scale size, each source.
    type Pick = fn(&ProgrammingSize) -> &Outcome<AgentModeRun>;
    let sources: [(&str, Pick); 2] = [("manifests", |p| &p.ebpf), ("API server", |p| &p.api_ebpf)];
    for (source, pick) in sources {
        let Some(p) = scale.map(|s| &s.size) else {
            let _ = writeln!(
                md,
                "| cold start ≤ {} s and agent RSS ≤ {GOAL_SCALE_RSS_MIB:.0} MB (eBPF) at 50k Services × 2 endpoints ({source} source) | – | not measured |",
                GOAL_SCALE_COLD_START.as_secs()
            );
            continue;
        };
        let label = workload_label(p);
        let run = match pick(p) {
            Outcome::Done(run) => run,
            other => {
                let _ = writeln!(
                    md,
                    "| cold start ≤ {} s and agent RSS ≤ {GOAL_SCALE_RSS_MIB:.0} MB (eBPF) at {label} ({source} source) | – | {} |",
                    GOAL_SCALE_COLD_START.as_secs(),
                    outcome_note(other).unwrap_or_default()
                );
                continue;
            }
        };
        let cold = super::Spread::of(
            run.cold_starts
                .iter()
                .map(|c| c.to_first_connection.as_secs_f64()),
        )
        .median;
        let goal = GOAL_SCALE_COLD_START.as_secs_f64();
        let _ = writeln!(
            md,
            "| cold start ≤ {} s (eBPF) at {label} ({source} source) | {} to the first translated connection (median of {}) | {} |",
            GOAL_SCALE_COLD_START.as_secs(),
            dur(Duration::from_secs_f64(cold)),
            run.cold_starts.len(),
            if cold <= goal {
                "met".to_owned()
            } else {
                format!(
                    "**missed** by {} — see §5",
                    dur(Duration::from_secs_f64(cold - goal))
                )
            }
        );
        let rss = run.memory.vm_hwm_kib as f64 / 1024.0;
        let _ = writeln!(
            md,
            "| agent RSS ≤ {GOAL_SCALE_RSS_MIB:.0} MB (eBPF) at {label} ({source} source) | VmHWM {rss:.0} MiB (+ {:.0} MiB BPF maps, kernel memory) | {} |",
            mib(run.memory.map_memlock()),
            if rss <= GOAL_SCALE_RSS_MIB {
                "met".to_owned()
            } else {
                format!("**missed** by {:.0} MiB — see §6", rss - GOAL_SCALE_RSS_MIB)
            }
        );
    }
    // The iptables mode's RSS at the same sizes, where it ran (no goal: for comparison).
    let mut cells = Vec::new();
    let big = r
        .programming
        .iter()
        .filter(|p| p.workload.endpoints == programming_endpoints)
        .max_by_key(|p| p.workload.services);
    for p in big.into_iter().chain(scale.map(|s| &s.size)) {
        for (source, mode, outcome) in agent_runs(p) {
            if mode != "iptables" {
                continue;
            }
            let value = match outcome {
                Outcome::Done(run) => {
                    format!("VmHWM {:.0} MiB", run.memory.vm_hwm_kib as f64 / 1024.0)
                }
                other => outcome_note(other).unwrap_or_default(),
            };
            cells.push(format!("{} ({source}): {value}", workload_label(p)));
        }
    }
    if !cells.is_empty() {
        let _ = writeln!(
            md,
            "| the iptables mode's agent RSS at the same sizes (for comparison; eBPF goals {GOAL_RSS_MIB:.0} / {GOAL_SCALE_RSS_MIB:.0} MB) | {} | no goal |",
            cells.join("; ")
        );
    }
    // One EndpointSlice change through the API server source.
    let (measured, verdict) = match scale.map(|s| (&s.size, &s.changes)) {
        Some((p, Outcome::Done(changes))) if !changes.is_empty() => {
            let samples: Vec<Duration> = changes.iter().map(|c| c.total).collect();
            let pct = Percentiles::of_durations(&samples);
            let p99 = Duration::from_nanos(pct.p99);
            (
                format!(
                    "{}: p99 {} (p50 {}, max {}; {} changes)",
                    workload_label(p),
                    dur(p99),
                    dur(Duration::from_nanos(pct.p50)),
                    dur(Duration::from_nanos(pct.max)),
                    samples.len()
                ),
                if p99 <= GOAL_API_CHANGE_P99 {
                    "met".to_owned()
                } else {
                    missed_by(dur(p99 - GOAL_API_CHANGE_P99))
                },
            )
        }
        Some((_, other)) => ("–".into(), outcome_note(other).unwrap_or_default()),
        None => ("–".into(), "not measured".into()),
    };
    let _ = writeln!(
        md,
        "| one EndpointSlice change through the API server source to the datapath ≤ {} ms p99 at 50k Services (eBPF; write → first connection to the new endpoints) | {measured} | {verdict} |",
        GOAL_API_CHANGE_P99.as_millis()
    );
    // Probe gaps.
    let (measured, verdict) = match scale {
        Some(s) => {
            let runs = [("restart", &s.restart), ("full resync", &s.resync)];
            let measured: Vec<String> = runs
                .iter()
                .map(|(what, o)| match o {
                    Outcome::Done(g) => format!(
                        "{what}: max gap {}, {} wrong answers",
                        dur(g.gaps.max_gap),
                        g.gaps.wrong
                    ),
                    other => format!("{what}: {}", outcome_note(other).unwrap_or_default()),
                })
                .collect();
            let missed: Vec<String> = runs
                .iter()
                .filter_map(|(what, o)| {
                    let g = o.done()?;
                    let mut m = Vec::new();
                    if g.gaps.max_gap > GOAL_MAX_GAP {
                        m.push(format!("gap by {}", dur(g.gaps.max_gap - GOAL_MAX_GAP)));
                    }
                    if g.gaps.wrong > 0 {
                        m.push(format!("{} wrong answers", g.gaps.wrong));
                    }
                    (!m.is_empty()).then(|| format!("{what}: {}", m.join(", ")))
                })
                .collect();
            let all_done = runs.iter().all(|(_, o)| o.done().is_some());
            let verdict = if !missed.is_empty() {
                format!("**missed**: {} — see §6b", missed.join("; "))
            } else if all_done {
                "met".to_owned()
            } else {
                "not all measured".to_owned()
            };
            (
                format!("{}: {}", workload_label(&s.size), measured.join("; ")),
                verdict,
            )
        }
        None => ("–".into(), "not measured".into()),
    };
    let _ = writeln!(
        md,
        "| a probe connecting every 1 ms (ClusterIP, pod cgroup) sees no gap over {} ms and no wrong answer through an agent restart and a full resync at 50k Services (eBPF, API server source) | {measured} | {verdict} |",
        GOAL_MAX_GAP.as_millis()
    );
    // Restart to ready.
    let (measured, verdict) = match scale.map(|s| (s, &s.restart)) {
        Some((
            s,
            Outcome::Done(GapRun {
                to_ready: Some(ready),
                ..
            }),
        )) => (
            format!("{}: {}", workload_label(&s.size), dur(*ready)),
            if *ready <= GOAL_RESTART_TO_READY {
                "met".to_owned()
            } else {
                missed_by(dur(*ready - GOAL_RESTART_TO_READY))
            },
        ),
        Some((_, other)) => (
            outcome_note(other).unwrap_or_else(|| "–".into()),
            "not measured".into(),
        ),
        None => ("–".into(), "not measured".into()),
    };
    let _ = writeln!(
        md,
        "| restart to ready ≤ {} ms (eBPF, the same object on the stopped agent's pins, API server source; start of the new process → its first `sync applied`) | {measured} | {verdict} |",
        GOAL_RESTART_TO_READY.as_millis()
    );
}

/// §6b: map memory per size, the API-source changes and the gap probes.
pub(super) fn section(md: &mut String, r: &Results) {
    let Some(scale) = r.scale.as_ref() else {
        return;
    };
    let _ = writeln!(md, "## 6b. Scale\n");
    let _ = writeln!(
        md,
        "**BPF map memory per size** (eBPF agent; kernel memory: `memlock` of each map fd the \
         agent holds, `/proc/<pid>/fdinfo`, at the end of its §5 runs; the 10-Service node is a \
         separate start on the manifests source). *Needed* is what the programmed entries \
         occupy: Σ over the maps the agent programs (frontends, backends, backend slots, \
         source ranges, Maglev tables) of entries × (key size + value size), with the entry \
         counts from the agent's `kubeproxy_ebpf_map_entries` metric and the sizes from \
         fdinfo; that metric counts the backend slots one per slot (what \
         `--bpf-map-backends` bounds), which the map keeps 8 to an element, so a slot needs \
         its 4-byte backend id and the key. It leaves out the kernel's own per-element header, the hash buckets and the \
         allocator's rounding, which is what the 1.5× allowance covers. *Other maps* are \
         every map that metric does not count: those the datapath fills itself (conntrack, \
         affinity, UDP), fixed-size ones (node config, counters), and the service-name and \
         reverse-NAT maps, which do follow the Services.\n"
    );
    let _ = writeln!(
        md,
        "| Services | endpoints | source | all maps (count, memlock) | programmed maps | needed | programmed ÷ needed | other maps | largest map |\n|---|---|---|---|---|---|---|---|---|"
    );
    let row = |md: &mut String,
               services: usize,
               endpoints: usize,
               source: &str,
               m: &AgentMemory| {
        let programmed = m.programmed_memlock();
        let _ = writeln!(
            md,
            "| {} | {endpoints} | {source} | {} maps, {:.1} MiB | {:.2} MiB | {} | {} | {:.1} MiB | {} |",
            size(services),
            m.maps.len(),
            mib(m.map_memlock()),
            mib(programmed),
            small_bytes(m.needed_bytes()),
            over_needed(m).map_or_else(|| "–".to_owned(), |x| format!("{x:.2}×")),
            mib(m.map_memlock().saturating_sub(programmed)),
            largest_map(m)
        );
    };
    match &scale.small {
        Outcome::Done(small) => row(
            md,
            small.workload.services,
            small.workload.total_endpoints(),
            "manifests",
            &small.memory,
        ),
        other => {
            let _ = writeln!(
                md,
                "| 10 | | manifests | {} | | | | | |",
                outcome_note(other).unwrap_or_default()
            );
        }
    }
    for p in agent_sizes(r) {
        for (source, mode, outcome) in agent_runs(p) {
            if mode != "eBPF" {
                continue;
            }
            if let Outcome::Done(run) = outcome {
                row(
                    md,
                    p.workload.services,
                    p.workload.total_endpoints(),
                    source,
                    &run.memory,
                );
            }
        }
    }
    programmed_profile(md, r);
    if let Outcome::Done(small) = &scale.small {
        let mut maps: Vec<_> = small.memory.maps.iter().collect();
        maps.sort_by_key(|m| std::cmp::Reverse(m.memlock));
        let listed: Vec<String> = maps
            .iter()
            .take_while(|m| m.memlock >= 1 << 20)
            .map(|m| {
                format!(
                    "{} {:.1} MiB ({} entries max)",
                    m.name,
                    mib(m.memlock),
                    m.max_entries
                )
            })
            .collect();
        let _ = writeln!(
            md,
            "
With {} Services, the maps of 1 MiB or more: {}.",
            small.workload.services,
            listed.join(", ")
        );
        small_node_profile(md, small);
    }
    changes_part(md, scale);
    gaps_part(md, scale);
}

/// `BPF_MAP_TYPE_HASH` and the two LRU hash types (include/uapi/linux/bpf.h).
const MAP_TYPE_HASH: u32 = 1;
const MAP_TYPE_LRU_HASH: u32 = 9;
const MAP_TYPE_LRU_PERCPU_HASH: u32 = 10;

/// kube-proxy's default `conntrack.maxPerCore` and `conntrack.min` (KubeProxyConntrackConfiguration).
const DEFAULT_MAX_PER_CORE: u32 = 32_768;
const DEFAULT_CONNTRACK_MIN: u32 = 131_072;

/// The LRU maps' capacity at a conntrack table of `flows`, by the kernel's (truncated) map
/// name; None for a map the agent does not size with them.
fn lru_capacity(name: &str, flows: u32) -> Option<u64> {
    use proxy_dataplane_ebpf::maps::map_sizes::LruSizes;
    let sizes = LruSizes::for_conntrack_table(flows);
    let entries = match name {
        "KPR_CT4" => sizes.conntrack4,
        "KPR_CT6" => sizes.conntrack6,
        "KPR_REVNAT4" => sizes.revnat4,
        "KPR_REVNAT6" => sizes.revnat6,
        "KPR_AFFINITY" => sizes.affinity,
        "KPR_UDP_STICKY" => sizes.udp_sticky,
        _ => return None,
    };
    Some(u64::from(entries))
}

/// What the small node's map memory is made of, and what the same maps would take on nodes
/// with more CPUs (the agent's own sizing for kube-proxy's default conntrack table there × the
/// memory per entry measured here).
fn small_node_profile(md: &mut String, small: &super::super::scale::SmallNode) {
    let maps = &small.memory.maps;
    let sum = |keep: &dyn Fn(&&super::super::sysinfo::MapMemory) -> bool| -> u64 {
        maps.iter().filter(keep).map(|m| m.memlock).sum()
    };
    let total = small.memory.map_memlock();
    let lru = sum(&|m| matches!(m.map_type, MAP_TYPE_LRU_HASH | MAP_TYPE_LRU_PERCPU_HASH));
    let hash = sum(&|m| m.map_type == MAP_TYPE_HASH);
    let cpus = proxy_kernel::conntrack::machine_cpus(std::path::Path::new("/sys"));
    let table = |cpus: u32| {
        proxy_kernel::conntrack::table_size(DEFAULT_MAX_PER_CORE, DEFAULT_CONNTRACK_MIN, cpus)
            .unwrap_or(DEFAULT_CONNTRACK_MIN)
    };
    let projected = |cpus: u32| -> u64 {
        maps.iter()
            .map(|m| match lru_capacity(&m.name, table(cpus)) {
                Some(entries) if m.max_entries > 0 => m.memlock / m.max_entries * entries,
                _ => m.memlock,
            })
            .sum()
    };
    let nodes: Vec<String> = [8u32, 16, 32, 64]
        .iter()
        .map(|&n| format!("{n} CPUs: {:.1} MiB", mib(projected(n))))
        .collect();
    let _ = writeln!(
        md,
        "\nOf the {:.1} MiB: the LRU maps (conntrack, socket reverse NAT, affinity, UDP \
         choice), which the kernel preallocates whole, {:.1} MiB: the agent sizes them as \
         kube-proxy sizes the kernel's conntrack table, `conntrack.maxPerCore` × CPUs, at least \
         `conntrack.min` ({} flows with the defaults on this node's {cpus} CPUs; \
         `--bpf-map-dynamic-size-ratio` and `--bpf-map-conntrack` override it). The hash maps \
         that allocate as they fill (frontends, backends, slots, names) hold {:.1} MiB with \
         almost no entries: the kernel's bucket array, 16 bytes per bucket for the capacity \
         rounded up to a power of two, is allocated when the map is created. The rest: {:.1} \
         MiB. The same agent on nodes with more CPUs (the LRU maps at the agent's sizing for \
         kube-proxy's default table there × the memory per entry measured here; every other \
         map as measured): {}.",
        mib(total),
        mib(lru),
        table(cpus),
        mib(hash),
        mib(total.saturating_sub(lru + hash)),
        nodes.join(", ")
    );
}

/// Where the programmed maps' memory goes at the eBPF run with the highest programmed ÷ needed
/// ratio: per map, the bucket array (fixed by the capacity) and the elements (the rest of its
/// memlock, per entry next to the entry's key + value).
fn programmed_profile(md: &mut String, r: &Results) {
    let worst = agent_sizes(r)
        .flat_map(|p| {
            agent_runs(p)
                .into_iter()
                .filter(|(_, mode, _)| *mode == "eBPF")
                .filter_map(move |(source, _, outcome)| match outcome {
                    Outcome::Done(run) => Some((p, source, &run.memory)),
                    _ => None,
                })
        })
        .filter_map(|(p, source, m)| Some((over_needed(m)?, p, source, m)))
        .max_by(|a, b| a.0.total_cmp(&b.0));
    let Some((ratio, p, source, m)) = worst else {
        return;
    };
    let mut maps = m.programmed_maps();
    maps.sort_by_key(|(m, _)| std::cmp::Reverse(m.memlock));
    let listed: Vec<String> = maps
        .iter()
        .map(|(map, entries)| {
            let payload = payload(map);
            if map.map_type != MAP_TYPE_HASH {
                return format!(
                    "{} {:.1} MiB for {entries} entries of {payload} B",
                    map.name,
                    mib(map.memlock)
                );
            }
            let buckets = map.max_entries.next_power_of_two() * HASH_BUCKET_BYTES;
            let elements = map.memlock.saturating_sub(buckets);
            let per_entry = if *entries > 0 {
                format!("{} B per entry", elements / entries)
            } else {
                "no entries".to_owned()
            };
            format!(
                "{} {:.1} MiB = buckets {:.1} MiB + elements {:.1} MiB ({entries} entries of \
                 {payload} B: {per_entry})",
                map.name,
                mib(map.memlock),
                mib(buckets),
                mib(elements)
            )
        })
        .collect();
    let _ = writeln!(
        md,
        "\n**What the programmed maps hold** at {} ({source}, the highest ratio, {ratio:.2}×): \
         {}. A hash map's memlock is its bucket array ({HASH_BUCKET_BYTES} B per bucket, the \
         capacity rounded up to a power of two, allocated with the map) plus one kernel \
         element per entry: the element header (`struct htab_elem`, with its list node and \
         hash) and the key and value each rounded up to 8 bytes, from the kernel's per-CPU \
         allocator caches; so an entry of 8–16 bytes of payload costs several times that \
         whatever the agent does, and sizing the capacity to the entries only trims the \
         bucket part.",
        workload_label(p),
        listed.join("; ")
    );
}

/// The kernel's hash bucket (`struct bucket`: a list head and a spinlock).
const HASH_BUCKET_BYTES: u64 = 16;

fn changes_part(md: &mut String, scale: &ScaleResult) {
    let _ = writeln!(
        md,
        "\n**EndpointSlice changes through the API server source** at {} (eBPF agent \
         started fresh on the API test server after the §5 runs): each change is one update of \
         the live Service's EndpointSlice in the API server (sent to the agent as a watch \
         event), flipping between two endpoint sets, timed from just before the write to the \
         start of the first connection of a probe (connecting in a tight loop from the pod \
         cgroup) answered by the new set; {} between one change's first answer and the next \
         change, as the agent defers a frontend's second switch within its 1 s generation \
         grace (a change within it would measure that deferral). *Where a change's time goes*: \
         the sync that programmed it is the first `sync applied` line of the agent's log \
         that started after the write (the line's time minus its `elapsed_us`; the agent \
         logs on the same system clock), which splits the change into *write → sync starts* \
         (the API test server's update and watch event, the agent's decoding, event loop \
         and sync runner), *the sync* (snapshot and map writes) and *sync logged → answer* \
         (the probe's next connection; negative when the probe got through before the line \
         was written, which counts as 0).\n",
        workload_label(&scale.size),
        dur(super::super::agent_runs::CHANGE_SPACING)
    );
    match &scale.changes {
        Outcome::Done(changes) if !changes.is_empty() => {
            let row = |what: &str, samples: &[Duration]| {
                if samples.is_empty() {
                    return format!("| {what} | – | – | – | – | – |\n");
                }
                let pct = Percentiles::of_durations(samples);
                format!(
                    "| {what} | {} | {} | {} | {} | {} |\n",
                    samples.len(),
                    dur(Duration::from_nanos(pct.p50)),
                    dur(Duration::from_nanos(pct.p99)),
                    dur(Duration::from_nanos(pct.max)),
                    dur(Duration::from_nanos(pct.mean as u64)),
                )
            };
            let splits: Vec<ChangeSplit> = changes.iter().filter_map(|c| c.split).collect();
            let part = |f: fn(&ChangeSplit) -> Duration| splits.iter().map(f).collect::<Vec<_>>();
            let totals: Vec<Duration> = changes.iter().map(|c| c.total).collect();
            let _ = writeln!(
                md,
                "| part | changes | p50 | p99 | max | mean |\n|---|---|---|---|---|---|\n{}{}{}{}",
                row("write → first connection to the new set", &totals),
                row("of it: write → sync starts", &part(|s| s.to_sync)),
                row("of it: the sync", &part(|s| s.sync)),
                row("of it: sync logged → answer", &part(|s| s.to_answer)),
            );
            let mut slowest: Vec<&ChangeSample> = changes.iter().collect();
            slowest.sort_by_key(|c| std::cmp::Reverse(c.total));
            let listed: Vec<String> = slowest
                .iter()
                .take(SLOWEST_CHANGES)
                .map(|c| match c.split {
                    Some(split) => format!(
                        "{} ({} to the sync, {} sync, {} to the answer)",
                        dur(c.total),
                        dur(split.to_sync),
                        dur(split.sync),
                        dur(split.to_answer)
                    ),
                    None => format!("{} (no sync line found)", dur(c.total)),
                })
                .collect();
            let _ = writeln!(
                md,
                "The {} slowest changes: {}.\n",
                listed.len(),
                listed.join("; ")
            );
        }
        other => {
            let _ = writeln!(md, "{}\n", outcome_note(other).unwrap_or_default());
        }
    }
}

fn gaps_part(md: &mut String, scale: &ScaleResult) {
    let _ = writeln!(
        md,
        "**Probe gaps** at {}, API server source: `rig-helper bench-gaps` starts a new \
         connection to the ClusterIP every millisecond from the pod cgroup (1 s connect \
         timeout) and records the longest time between two consecutive correct answers \
         (from the live endpoint set; counted from its start and to its end too) and every \
         wrong answer (any other backend, or the decoy behind the untranslated ClusterIP). \
         *Restart*: a second of steady state, then the agent is stopped (SIGINT: programs and \
         maps stay pinned) and started again on the same pins; the probe ends a second after \
         the new process's first `sync applied`. *Full resync*: the agent has no external \
         trigger for one; its eBPF periodic sync (`--iptables-sync-period`, which the eBPF \
         mode uses as its resync interval) reconciles every map entry, so the restarted agent \
         runs with a {} period and the probe runs through {} of those resyncs.\n",
        workload_label(&scale.size),
        super::super::scale::RESYNC_PERIOD,
        super::super::scale::RESYNCS,
    );
    let _ = writeln!(
        md,
        "| through | probe ran | attempts | correct | wrong | errors | max gap | syncs meanwhile | restart → first sync |\n|---|---|---|---|---|---|---|---|---|"
    );
    for (what, outcome) in [("restart", &scale.restart), ("full resync", &scale.resync)] {
        match outcome {
            Outcome::Done(GapRun {
                gaps,
                duration,
                syncs,
                to_ready,
                ..
            }) => {
                let _ = writeln!(
                    md,
                    "| {what} | {} | {} | {} | {} | {} | {} | {syncs} | {} |",
                    dur(*duration),
                    gaps.attempts,
                    gaps.ok,
                    gaps.wrong,
                    gaps.errors,
                    dur(gaps.max_gap),
                    to_ready.map(dur).unwrap_or_default(),
                );
            }
            other => {
                let _ = writeln!(
                    md,
                    "| {what} | {} | | | | | | | |",
                    outcome_note(other).unwrap_or_default()
                );
            }
        }
    }
    let _ = writeln!(md);
    if let Outcome::Done(GapRun {
        to_ready: Some(ready),
        phases: Some(phases),
        ..
    }) = &scale.restart
    {
        restart_phases(md, *ready, phases);
    }
}

/// Where the restart's time went, from the new process's log (as §5's cold starts).
fn restart_phases(md: &mut String, ready: Duration, p: &StartPhases) {
    let at = |d: Option<Duration>| d.map_or_else(|| "–".to_owned(), dur);
    let _ = writeln!(
        md,
        "*Where the restart goes* (from the new process's log lines, counted from its \
         `starting proxy-agent` line; the API server source is listed while the dataplane \
         starts, and the first sync waits for both): dataplane ready (the pinned programs and \
         links reused with no verifier run, the service maps adopted) at {}; source read (the \
         last kind listed) at {}; then the first sync, a full one, {} to compute the snapshot \
         and {} to compare every map entry with it (and write what differs); {} from the \
         process's start to its `sync applied` in all. What is left is work on the whole \
         cluster that a restart repeats: the list of every object and a full snapshot and \
         map comparison; a restart that kept the last snapshot and the list's \
         resourceVersion beside the pins could watch from there and compare only what \
         changed.\n",
        at(p.dataplane_ready),
        at(p.source_read),
        at(p.first_snapshot),
        at(p.first_sync),
        dur(ready),
    );
}
