//! Conntrack sysctls from `KubeProxyConntrackConfiguration` (kube-proxy's
//! pkg/proxy/conntrack/sysctls.go): table size from maxPerCore × CPUs (capped at
//! [`SCALED_MAX_CAP`], else at least `min`), TCP and
//! UDP timeouts, and tcp_be_liberal.

use std::{path::PathBuf, time::Duration};

use tracing::info;

/// The conntrack block of the configuration, resolved. `None`/0 leaves a setting alone, as in
/// kube-proxy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConntrackSettings {
    pub max_per_core: u32,
    pub min: u32,
    pub tcp_established_timeout: Option<Duration>,
    pub tcp_close_wait_timeout: Option<Duration>,
    pub tcp_be_liberal: bool,
    pub udp_timeout: Option<Duration>,
    pub udp_stream_timeout: Option<Duration>,
}

#[derive(Debug, thiserror::Error)]
pub enum SysctlError {
    #[error(
        "cannot set {name} to {value}: it is read-only here (a read-only /proc/sys, or a \
         sysctl only the host's network namespace may change); set conntrack.maxPerCore to 0 \
         and the timeouts to 0s to leave conntrack sysctls alone"
    )]
    ReadOnly { name: String, value: String },
    #[error("cannot set {name} to {value}: {source}")]
    Write {
        name: String,
        value: String,
        source: std::io::Error,
    },
}

const BUCKETS: &str = "net/netfilter/nf_conntrack_buckets";

/// The machine's CPU count, as kube-proxy's detectNumCPU (server_linux.go): cadvisor's topology
/// from sysfs, i.e. the CPUs the machine has online — not the container's CPU quota nor its
/// affinity, which would shrink the node-wide table. Falls back to the online count sysconf
/// reports.
pub fn machine_cpus(sys: &std::path::Path) -> u32 {
    std::fs::read_to_string(sys.join("devices/system/cpu/online"))
        .ok()
        .and_then(|list| count_cpu_list(list.trim()))
        .filter(|&n| n > 0)
        .unwrap_or_else(|| {
            // SAFETY: sysconf has no memory-safety preconditions.
            let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
            u32::try_from(n).ok().filter(|&n| n > 0).unwrap_or(1)
        })
}

/// A kernel CPU list (`0-3,6,8-9`) → how many CPUs it names.
fn count_cpu_list(list: &str) -> Option<u32> {
    let mut count = 0u32;
    for part in list.split(',').filter(|p| !p.is_empty()) {
        let (first, last) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<u32>().ok()?, b.parse::<u32>().ok()?),
            None => {
                let cpu = part.parse::<u32>().ok()?;
                (cpu, cpu)
            }
        };
        count = count.checked_add(last.checked_sub(first)?.checked_add(1)?)?;
    }
    Some(count)
}

/// kube-proxy's ceiling (since 1.36) on a table size computed from maxPerCore: many-core
/// machines otherwise reserved kernel memory for millions of entries nobody tracks.
pub const SCALED_MAX_CAP: u32 = 1_048_576;

/// The conntrack table size kube-proxy sets (`nf_conntrack_max`, its getConntrackMax) on a
/// machine with `cpus` CPUs: maxPerCore × CPUs, at least `min`, capped at [`SCALED_MAX_CAP`];
/// `None` when maxPerCore is 0 (the table is left as the kernel sized it).
pub fn table_size(max_per_core: u32, min: u32, cpus: u32) -> Option<u32> {
    if max_per_core == 0 {
        return None;
    }
    let scaled = max_per_core.saturating_mul(cpus);
    // Upstream caps the scaled size before it compares it with the floor, so a `min` above
    // the cap counts only while maxPerCore × CPUs stays below the cap.
    Some(if scaled > SCALED_MAX_CAP {
        SCALED_MAX_CAP
    } else {
        scaled.max(min)
    })
}

/// The sysctl writes `settings` asks for on a machine with `cpus` CPUs, in order.
pub fn planned_writes(settings: &ConntrackSettings, cpus: u32) -> Vec<(&'static str, String)> {
    let mut writes = Vec::new();
    if let Some(max) = table_size(settings.max_per_core, settings.min, cpus) {
        writes.push(("net/netfilter/nf_conntrack_max", max.to_string()));
        // The hash table follows upstream's 1:4 ratio of buckets to entries.
        writes.push((BUCKETS, (max / 4).to_string()));
    }
    let seconds = |d: Duration| d.as_secs().to_string();
    if let Some(timeout) = settings.tcp_established_timeout.filter(|d| !d.is_zero()) {
        writes.push((
            "net/netfilter/nf_conntrack_tcp_timeout_established",
            seconds(timeout),
        ));
    }
    if let Some(timeout) = settings.tcp_close_wait_timeout.filter(|d| !d.is_zero()) {
        writes.push((
            "net/netfilter/nf_conntrack_tcp_timeout_close_wait",
            seconds(timeout),
        ));
    }
    if settings.tcp_be_liberal {
        writes.push(("net/netfilter/nf_conntrack_tcp_be_liberal", "1".to_owned()));
    }
    if let Some(timeout) = settings.udp_timeout.filter(|d| !d.is_zero()) {
        writes.push(("net/netfilter/nf_conntrack_udp_timeout", seconds(timeout)));
    }
    if let Some(timeout) = settings.udp_stream_timeout.filter(|d| !d.is_zero()) {
        writes.push((
            "net/netfilter/nf_conntrack_udp_timeout_stream",
            seconds(timeout),
        ));
    }
    writes
}

/// Applies the settings under `proc_sys` (normally `/proc/sys`), skipping values already set.
/// Every write is tried; returns how many were written and the ones that failed.
pub fn apply_sysctls(
    settings: &ConntrackSettings,
    proc_sys: &std::path::Path,
) -> (usize, Vec<SysctlError>) {
    apply_sysctls_with_cpus(
        settings,
        proc_sys,
        machine_cpus(std::path::Path::new("/sys")),
    )
}

/// [`apply_sysctls`] for a given CPU count.
pub fn apply_sysctls_with_cpus(
    settings: &ConntrackSettings,
    proc_sys: &std::path::Path,
    cpus: u32,
) -> (usize, Vec<SysctlError>) {
    let mut written = 0;
    let mut errors = Vec::new();
    for (name, value) in planned_writes(settings, cpus) {
        let path: PathBuf = proc_sys.join(name);
        let current = std::fs::read_to_string(&path).ok();
        if current.as_deref().is_some_and(|c| c.trim() == value) {
            continue;
        }
        // realConntracker.SetMax: the hash table is only ever grown ("hashsize >= max/4:
        // nothing to do"); a larger one set by the admin stays.
        if name == BUCKETS
            && let (Some(current), Ok(wanted)) = (current.as_deref(), value.parse::<u64>())
            && current.trim().parse::<u64>().is_ok_and(|c| c >= wanted)
        {
            continue;
        }
        match std::fs::write(&path, &value) {
            Ok(()) => {
                info!(sysctl = name, %value, "set conntrack sysctl");
                written += 1;
            }
            // A read-only /proc/sys (container) or a sysctl that is global-only and so read-only
            // in this network namespace.
            Err(source)
                if matches!(
                    source.raw_os_error(),
                    Some(libc::EROFS | libc::EACCES | libc::EPERM)
                ) =>
            {
                errors.push(SysctlError::ReadOnly {
                    name: name.to_owned(),
                    value,
                });
            }
            Err(source) => {
                errors.push(SysctlError::Write {
                    name: name.to_owned(),
                    value,
                    source,
                });
            }
        }
    }
    (written, errors)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kube_proxy_defaults() -> ConntrackSettings {
        ConntrackSettings {
            max_per_core: 32_768,
            min: 131_072,
            tcp_established_timeout: Some(Duration::from_secs(86_400)),
            tcp_close_wait_timeout: Some(Duration::from_secs(3_600)),
            tcp_be_liberal: false,
            udp_timeout: None,
            udp_stream_timeout: None,
        }
    }

    #[test]
    fn table_size_is_per_core_with_a_floor() {
        let writes = planned_writes(&kube_proxy_defaults(), 2);
        assert_eq!(
            writes[0],
            ("net/netfilter/nf_conntrack_max", "131072".to_owned())
        );
        let writes = planned_writes(&kube_proxy_defaults(), 8);
        assert_eq!(
            writes[0],
            ("net/netfilter/nf_conntrack_max", "262144".to_owned())
        );
        assert_eq!(
            writes[1],
            ("net/netfilter/nf_conntrack_buckets", "65536".to_owned())
        );
    }

    /// kube-proxy 1.36's getConntrackMax: the scaled size is capped before the floor is
    /// compared with it.
    #[test]
    fn a_scaled_table_size_is_capped_at_a_million_entries() {
        let size = |settings: &ConntrackSettings, cpus| planned_writes(settings, cpus)[0].1.clone();
        // 64 CPUs × 32 768 = 2 097 152: capped.
        assert_eq!(size(&kube_proxy_defaults(), 64), "1048576");
        // 32 × 32 768 = 1 048 576 exactly: not above the cap.
        assert_eq!(size(&kube_proxy_defaults(), 32), "1048576");
        let big_floor = ConntrackSettings {
            min: 2_000_000,
            ..kube_proxy_defaults()
        };
        // Below the cap, a larger floor wins as before; above it, the cap wins over the floor.
        assert_eq!(size(&big_floor, 2), "2000000");
        assert_eq!(size(&big_floor, 64), "1048576");
        assert_eq!(
            planned_writes(&kube_proxy_defaults(), 64)[1],
            ("net/netfilter/nf_conntrack_buckets", "262144".to_owned())
        );
    }

    /// detectNumCPU counts the machine's CPUs (sysfs), not the cgroup's quota.
    #[test]
    fn cpu_count_is_the_machines() {
        assert_eq!(count_cpu_list("0-3,6,8-9"), Some(7));
        assert_eq!(count_cpu_list("0"), Some(1));
        assert_eq!(count_cpu_list("x"), None);
        let sys = std::env::temp_dir().join(format!("kpr-sys-{}", std::process::id()));
        std::fs::create_dir_all(sys.join("devices/system/cpu")).expect("mkdir");
        std::fs::write(sys.join("devices/system/cpu/online"), "0-63\n").expect("write");
        assert_eq!(machine_cpus(&sys), 64);
        let _ = std::fs::remove_dir_all(&sys);
        // The real machine: at least what this process may use.
        let usable = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
        assert!(machine_cpus(std::path::Path::new("/sys")) >= usable);
    }

    /// realConntracker.SetMax only ever raises the hash size.
    #[test]
    fn hash_size_is_only_raised() {
        let root = std::env::temp_dir().join(format!("kpr-hash-{}", std::process::id()));
        let dir = root.join("net/netfilter");
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("nf_conntrack_max"), "0\n").expect("seed");
        std::fs::write(dir.join("nf_conntrack_buckets"), "1048576\n").expect("seed");
        let settings = ConntrackSettings {
            max_per_core: 32_768,
            min: 131_072,
            ..ConntrackSettings::default()
        };
        let (written, errors) = apply_sysctls_with_cpus(&settings, &root, 8);
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(written, 1, "only nf_conntrack_max");
        let buckets = std::fs::read_to_string(dir.join("nf_conntrack_buckets")).expect("read");
        assert_eq!(buckets.trim(), "1048576");
        // A smaller table is grown.
        std::fs::write(dir.join("nf_conntrack_buckets"), "16384\n").expect("seed");
        let (written, _) = apply_sysctls_with_cpus(&settings, &root, 8);
        assert_eq!(written, 1);
        let buckets = std::fs::read_to_string(dir.join("nf_conntrack_buckets")).expect("read");
        assert_eq!(buckets.trim(), "65536");
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn zero_values_leave_settings_alone() {
        assert!(planned_writes(&ConntrackSettings::default(), 4).is_empty());
    }

    #[test]
    fn applies_to_a_sysctl_tree_and_skips_equal_values() {
        let root = std::env::temp_dir().join(format!("kpr-sysctl-{}", std::process::id()));
        let dir = root.join("net/netfilter");
        std::fs::create_dir_all(&dir).expect("mkdir");
        for name in [
            "nf_conntrack_max",
            "nf_conntrack_buckets",
            "nf_conntrack_tcp_timeout_established",
            "nf_conntrack_tcp_timeout_close_wait",
        ] {
            std::fs::write(dir.join(name), "0\n").expect("seed");
        }
        std::fs::write(dir.join("nf_conntrack_tcp_timeout_close_wait"), "3600\n").expect("seed");
        let settings = kube_proxy_defaults();
        let (written, errors) = apply_sysctls_with_cpus(&settings, &root, 2);
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(written, 3, "close_wait already had the value");
        let timeout = std::fs::read_to_string(dir.join("nf_conntrack_tcp_timeout_established"))
            .expect("read");
        assert_eq!(timeout, "86400");
        let _ = std::fs::remove_dir_all(&root);
    }
}
