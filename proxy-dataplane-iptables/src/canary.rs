//! The KUBE-PROXY-CANARY monitor (kube-proxy's `iptables.Monitor`): empty chains in mangle, nat
//! and filter; when the one in mangle (a small table, cheap to list) disappears, something
//! flushed the tables and everything must be rewritten with a full sync.

use std::time::{Duration, Instant};

use super::chains::KUBE_PROXY_CANARY;
use proxy_kernel::iptables::exec::{ExecError, Iptables};

/// Checked first; the others are expected to vanish with it.
const TABLES: [&str; 3] = ["mangle", "nat", "filter"];

/// How long a flush of the other tables may lag behind mangle's (upstream's values).
const SETTLE_POLL: Duration = Duration::from_millis(100);
const SETTLE_TIMEOUT: Duration = Duration::from_secs(5);

pub fn ensure(iptables: &Iptables) -> Result<(), ExecError> {
    for table in TABLES {
        iptables.ensure_chain(table, KUBE_PROXY_CANARY)?;
    }
    Ok(())
}

/// Whether the tables were flushed since the canaries were created. When they were, waits
/// (bounded) for the flush to reach every table before the caller rewrites them.
pub fn flushed(iptables: &Iptables) -> bool {
    if iptables.chain_exists(TABLES[0], KUBE_PROXY_CANARY) {
        return false;
    }
    let started = Instant::now();
    while TABLES[1..]
        .iter()
        .any(|table| iptables.chain_exists(table, KUBE_PROXY_CANARY))
    {
        if started.elapsed() > SETTLE_TIMEOUT {
            tracing::warn!(
                family = iptables.family.as_k8s(),
                "Inconsistent iptables state detected: the canary is gone from mangle but not \
                 from nat/filter"
            );
            break;
        }
        std::thread::sleep(SETTLE_POLL);
    }
    true
}

/// Removes the canaries (cleanup only).
pub fn remove(iptables: &Iptables) {
    for table in TABLES {
        // Absent already is fine: cleanup is best effort.
        let _ = iptables.delete_chain(table, KUBE_PROXY_CANARY);
    }
}
