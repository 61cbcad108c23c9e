//! Conntrack sysctls from `KubeProxyConntrackConfiguration` (kube-proxy's
//! pkg/proxy/conntrack/sysctls.go): table size from maxPerCore × CPUs (at least `min`), TCP and
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

/// The sysctl writes `settings` asks for on a machine with `cpus` CPUs, in order.
pub fn planned_writes(settings: &ConntrackSettings, cpus: u32) -> Vec<(&'static str, String)> {
    let mut writes = Vec::new();
    if settings.max_per_core > 0 {
        let max = settings.max_per_core.saturating_mul(cpus).max(settings.min);
        writes.push(("net/netfilter/nf_conntrack_max", max.to_string()));
        // The hash table follows upstream's 1:4 ratio of buckets to entries.
        writes.push(("net/netfilter/nf_conntrack_buckets", (max / 4).to_string()));
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
    let cpus =
        std::thread::available_parallelism().map_or(1, |n| u32::try_from(n.get()).unwrap_or(1));
    let mut written = 0;
    let mut errors = Vec::new();
    for (name, value) in planned_writes(settings, cpus) {
        let path: PathBuf = proc_sys.join(name);
        if std::fs::read_to_string(&path).is_ok_and(|current| current.trim() == value) {
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
        let (written, errors) = apply_sysctls(&settings, &root);
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(written, 3, "close_wait already had the value");
        let timeout = std::fs::read_to_string(dir.join("nf_conntrack_tcp_timeout_established"))
            .expect("read");
        assert_eq!(timeout, "86400");
        let _ = std::fs::remove_dir_all(&root);
    }
}
