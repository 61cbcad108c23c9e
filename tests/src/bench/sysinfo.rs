//! What the report states about the machine, and the memory figures read from /proc.

use std::collections::BTreeMap;
use std::fs;
use std::process::Command;

/// The machine a report was measured on.
#[derive(Debug, Clone, Default)]
pub struct Machine {
    pub cpus: usize,
    pub cpu_model: String,
    pub kernel: String,
    pub memory_gib: f64,
    pub iptables: String,
    pub load_at_start: String,
}

impl Machine {
    pub fn detect() -> Self {
        let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find_map(|l| {
                l.strip_prefix("model name")?
                    .split_once(':')
                    .map(|(_, v)| v)
            })
            .unwrap_or("unknown")
            .trim()
            .to_owned();
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        let kernel = fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_owned();
        let memory_gib = fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| {
                m.lines()
                    .find_map(|l| l.strip_prefix("MemTotal:"))
                    .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            })
            .map_or(0.0, |kib| kib / 1024.0 / 1024.0);
        let iptables = Command::new("iptables")
            .arg("--version")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_else(|_| "not installed".into());
        let load_at_start = fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ");
        Self {
            cpus,
            cpu_model,
            kernel,
            memory_gib,
            iptables,
            load_at_start,
        }
    }
}

/// The 1-minute load average now (other users of the machine show up here).
pub fn load_now() -> String {
    fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .next()
        .unwrap_or("?")
        .to_owned()
}

/// `VmHWM` (peak resident set) and `VmRSS` of a process, in KiB.
pub fn rss_kib(pid: u32) -> Option<(u64, u64)> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
    };
    Some((field("VmHWM:")?, field("VmRSS:")?))
}

/// One BPF map a process holds, from `/proc/<pid>/fdinfo/<fd>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapMemory {
    pub id: u64,
    pub map_type: u32,
    pub key_size: u64,
    pub value_size: u64,
    pub max_entries: u64,
    pub memlock: u64,
    /// The kernel's name for the map (truncated to 15 bytes); empty if it cannot be read.
    pub name: String,
}

/// The BPF maps a process has open (deduplicated by map id), with the kernel's `memlock`
/// accounting for each — what `bpftool map show` reports, without needing bpftool.
pub fn bpf_maps(pid: u32) -> Vec<MapMemory> {
    let mut maps = BTreeMap::new();
    let Ok(entries) = fs::read_dir(format!("/proc/{pid}/fdinfo")) else {
        return Vec::new();
    };
    for entry in entries.flatten() {
        let Ok(info) = fs::read_to_string(entry.path()) else {
            continue;
        };
        if let Some(mut map) = parse_fdinfo(&info) {
            // fdinfo has no name; the map's info (by id, from this process) has.
            map.name = u32::try_from(map.id)
                .ok()
                .and_then(|id| aya::maps::MapInfo::from_id(id).ok())
                .and_then(|info| info.name_as_str().map(str::to_owned))
                .unwrap_or_default();
            maps.insert(map.id, map);
        }
    }
    maps.into_values().collect()
}

fn parse_fdinfo(info: &str) -> Option<MapMemory> {
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    Some(MapMemory {
        id: field("map_id")?,
        map_type: u32::try_from(field("map_type")?).ok()?,
        key_size: field("key_size").unwrap_or_default(),
        value_size: field("value_size").unwrap_or_default(),
        max_entries: field("max_entries").unwrap_or_default(),
        memlock: field("memlock")?,
        name: String::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_map_fdinfo() {
        let info = "pos:\t0\nflags:\t02000002\nmnt_id:\t15\nino:\t2061\nmap_type:\t1\n\
                    key_size:\t8\nvalue_size:\t16\nmax_entries:\t65536\nmap_flags:\t0x0\n\
                    map_extra:\t0x0\nmemlock:\t5769216\nmap_id:\t42\nfrozen:\t0\n";
        assert_eq!(
            parse_fdinfo(info),
            Some(MapMemory {
                id: 42,
                map_type: 1,
                key_size: 8,
                value_size: 16,
                max_entries: 65536,
                memlock: 5_769_216,
                name: String::new(),
            })
        );
        assert_eq!(parse_fdinfo("pos:\t0\nflags:\t0\n"), None);
    }
}
