//! The capabilities README.md documents are enough: the real agent runs with its bounding set
//! cut down to them (via `setpriv`, so even root has nothing else) and still serves Services.
//! eBPF mode: CAP_SYS_ADMIN (bpffs mount, cgroup attach, entering pod network namespaces),
//! CAP_NET_ADMIN (tc, SOCK_DESTROY, netlink, sysctls), CAP_SYS_PTRACE (opening other processes'
//! network namespaces to destroy their stale UDP sockets). iptables mode: CAP_NET_ADMIN.
//! (CAP_SYS_RESOURCE only lets a negative --oom-score-adj apply; without it that is a warning.)
//! Needs root. The rig runs a wrapper script in place of the agent binary.

use std::{os::unix::fs::PermissionsExt as _, path::PathBuf};

use proxy_tests::scenario::{Scenario, cluster_addr, is_pod};

/// A script that runs the real agent with only `caps` in its bounding set.
fn wrapper(
    dir: &std::path::Path,
    name: &str,
    caps: &str,
    agent: &std::path::Path,
) -> anyhow::Result<PathBuf> {
    let path = dir.join(name);
    std::fs::write(
        &path,
        format!(
            "#!/bin/sh\nexec setpriv --bounding-set -all,{caps} -- {} \"$@\"\n",
            agent.display()
        ),
    )?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
    Ok(path)
}

fn serves(mode: &str, agent: &std::path::Path) -> anyhow::Result<()> {
    let mut s = Scenario::new(2)?;
    s.use_agent_binary(agent);
    s.write_web_service(2)?;
    let client = s.start_serving(mode, &[])?;
    let attempts = client.run(cluster_addr(), 20)?;
    eprintln!(
        "[{mode}] with reduced capabilities: {:?}",
        proxy_tests::client::tally(&attempts)
    );
    anyhow::ensure!(attempts.iter().all(is_pod), "{attempts:?}");
    Ok(())
}

#[test]
fn the_documented_capabilities_are_enough() -> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let agent = proxy_tests::agent::agent_binary()?;
    let dir = std::env::temp_dir().join(format!("kpr-caps-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let ebpf = wrapper(
        &dir,
        "agent-ebpf",
        "+sys_admin,+net_admin,+sys_ptrace",
        &agent,
    )?;
    let iptables = wrapper(&dir, "agent-iptables", "+net_admin", &agent)?;
    let result = (|| -> anyhow::Result<()> {
        for (mode, bin) in [("ebpf", &ebpf), ("iptables", &iptables)] {
            serves(mode, bin)?;
        }
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}
