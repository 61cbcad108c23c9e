//! The process around the loop: `--cleanup`, `--init-only`, process settings, the node name.

use anyhow::{Context as _, bail};
use tracing::{debug, info, warn};

use proxy_dataplane_ebpf as ebpf;
use proxy_dataplane_iptables as iptables;
use proxy_kernel::conntrack::{self, ConntrackSettings};
use proxy_model::config::Config;

/// One glibc malloc arena for the whole process, set before any thread exists. glibc gives
/// each thread that allocates while another holds the lock an arena of its own (up to 8 per
/// core), and memory freed in one arena serves only that arena's threads: the objects the
/// sources convert on one thread and the snapshot and map bookkeeping built on another each
/// kept their own free pages, which the agent's peak resident set paid for (30k Services x 10
/// endpoints, manifests source: 207 -> 177 MiB). The agent's threads rarely allocate at the
/// same time (its cold start at that size was no slower). An operator's `MALLOC_ARENA_MAX` or
/// `GLIBC_TUNABLES` is left to decide. (jemalloc 5.3 and mimalloc 2.0, preloaded in its place
/// with their defaults, peaked higher than this.)
pub fn limit_malloc_arenas() {
    #[cfg(target_env = "gnu")]
    {
        if std::env::var_os("MALLOC_ARENA_MAX").is_some()
            || std::env::var_os("GLIBC_TUNABLES").is_some()
        {
            return;
        }
        // SAFETY: mallopt only sets an allocator parameter; it is called before the runtime
        // starts any thread, as glibc asks for M_ARENA_MAX to take full effect.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 1);
        }
    }
}

/// `--cleanup`: removes everything either mode installed (pinned maps and links, which detaches
/// the programs; our iptables chains and jump rules), then returns.
pub fn cleanup(config: &Config) -> anyhow::Result<()> {
    let removed = ebpf::cleanup(&config.ebpf.bpf_root).context("--cleanup failed")?;
    info!(removed, "eBPF cleanup done");
    ebpf::conntrack::reserved_ports::release(&config.ebpf.snat_ports);
    let problems = iptables::cleanup();
    for problem in &problems {
        warn!(%problem, "iptables cleanup");
    }
    info!(problems = problems.len(), "iptables cleanup done");
    remove_kube_proxy_modes(None);
    Ok(())
}

/// `--init-only`: the steps that need full root privileges, then return (upstream:
/// newProxyServer's platformSetup applies the conntrack sysctls, the proxier logs "System
/// initialized and --init-only specified" and returns before any rule is written). No API
/// server and no dataplane are touched.
pub fn init_only(config: &Config) {
    apply_process_settings(config);
    info!("System initialized and --init-only specified");
}

/// `--bind-address-hard-fail`: kube-proxy exits when its health or metrics server cannot bind
/// (server.go: the serve error goes to errCh instead of a retry loop). Checked before anything
/// is touched, by binding each address once; the servers bind again right after.
pub fn check_server_ports(config: &Config) -> anyhow::Result<()> {
    for (flag, address) in [
        ("--healthz-bind-address", config.healthz_bind_address),
        ("--metrics-bind-address", config.metrics_bind_address),
    ] {
        if let Some(address) = address {
            std::net::TcpListener::bind(address).with_context(|| {
                format!("{flag} {address}: cannot bind, and --bind-address-hard-fail is set")
            })?;
        }
    }
    Ok(())
}

/// kube-proxy's nftables tables and IPVS device; failures are logged, never fatal (upstream's
/// cleanup is best effort too). `drain`: the eBPF mode's `--mode-switch-drain-period`, during
/// which the nftables tables stay empty so the kernel keeps the NAT of kube-proxy's
/// connections (`kube_proxy_modes::remove_draining`); `None` removes them at once.
pub fn remove_kube_proxy_modes(drain: Option<std::time::Duration>) {
    let (_, errors) = match drain {
        Some(period) if !period.is_zero() => iptables::kube_proxy_modes::remove_draining(period),
        _ => iptables::kube_proxy_modes::remove(),
    };
    for error in errors {
        warn!(%error, "removing kube-proxy leftovers");
    }
}

/// Process settings from the configuration: the OOM score adjustment and the conntrack sysctls.
/// Neither is fatal: a container may not be allowed to change them (kube-proxy, too, only logs
/// a read-only /sys).
pub fn apply_process_settings(config: &Config) {
    if let Err(error) = std::fs::write("/proc/self/oom_score_adj", config.oom_score_adj.to_string())
    {
        warn!(value = config.oom_score_adj, %error, "cannot apply --oom-score-adj");
    }
    let settings = ConntrackSettings {
        max_per_core: config.conntrack.max_per_core,
        min: config.conntrack.min,
        tcp_established_timeout: Some(config.conntrack.tcp_established_timeout),
        tcp_close_wait_timeout: Some(config.conntrack.tcp_close_wait_timeout),
        tcp_be_liberal: config.conntrack.tcp_be_liberal,
        udp_timeout: Some(config.conntrack.udp_timeout),
        udp_stream_timeout: Some(config.conntrack.udp_stream_timeout),
    };
    let (written, errors) = conntrack::apply_sysctls(&settings, std::path::Path::new("/proc/sys"));
    debug!(written, "conntrack sysctls applied");
    for error in errors {
        warn!(%error, "conntrack sysctl not applied");
    }
}

/// The node's name as kube-proxy derives it.
pub fn node_name(hostname_override: Option<&str>) -> anyhow::Result<String> {
    let name = match hostname_override {
        Some(name) => name.trim().to_owned(),
        None => nix::unistd::gethostname()
            .context("cannot read the host name; pass --hostname-override")?
            .to_string_lossy()
            .into_owned(),
    };
    if name.is_empty() {
        bail!("--hostname-override: the node name must not be empty");
    }
    // kube-proxy lower-cases the node name (nodeutil.GetHostname).
    Ok(name.to_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names_are_trimmed_and_lower_cased() {
        assert_eq!(node_name(Some(" Node-A ")).expect("name"), "node-a");
        assert!(node_name(Some("  ")).is_err());
    }
}
