//! `CleanupLeftovers` for one family: what the iptables mode created, and nothing else.

use bytes::{BufMut as _, BytesMut};

use super::{
    canary,
    chains::{
        KUBE_EXTERNAL_SERVICES, KUBE_FORWARD, KUBE_MARK_MASQ, KUBE_NODEPORTS, KUBE_POSTROUTING,
        KUBE_PROXY_CANARY, KUBE_PROXY_FIREWALL, KUBE_SERVICES, chain_line, is_service_chain_name,
    },
    jumps::JUMP_RULES,
};
use proxy_kernel::iptables::exec::{ExecError, Iptables};

const NAT_CHAINS: [&str; 5] = [
    KUBE_SERVICES,
    KUBE_NODEPORTS,
    KUBE_POSTROUTING,
    KUBE_MARK_MASQ,
    KUBE_PROXY_CANARY,
];
// KUBE-FIREWALL is kubelet's: left alone.
const FILTER_CHAINS: [&str; 6] = [
    KUBE_SERVICES,
    KUBE_EXTERNAL_SERVICES,
    KUBE_FORWARD,
    KUBE_NODEPORTS,
    KUBE_PROXY_FIREWALL,
    KUBE_PROXY_CANARY,
];

/// Best effort: keeps going after errors and returns them.
pub fn family(iptables: &Iptables) -> Vec<ExecError> {
    let mut errors = Vec::new();
    for jump in JUMP_RULES {
        if let Err(error) = iptables.delete_rule(jump.table, jump.source, &jump.args()) {
            errors.push(error);
        }
    }
    for (table, fixed) in [("nat", &NAT_CHAINS[..]), ("filter", &FILTER_CHAINS[..])] {
        let existing = match iptables.save_chains(table) {
            Ok(chains) => chains,
            Err(error) => {
                errors.push(error);
                continue;
            }
        };
        let doomed: Vec<&String> = existing
            .iter()
            .filter(|c| fixed.contains(&c.as_str()) || (table == "nat" && is_service_chain_name(c)))
            .collect();
        if doomed.is_empty() {
            continue;
        }
        // Flush every chain first (chain lines), then delete them: they may jump to each other.
        let mut data = BytesMut::new();
        data.put_slice(format!("*{table}\n").as_bytes());
        for chain in &doomed {
            data.put_slice(chain_line(chain).as_bytes());
            data.put_u8(b'\n');
        }
        for chain in &doomed {
            data.put_slice(format!("-X {chain}\n").as_bytes());
        }
        data.put_slice(b"COMMIT\n");
        if let Err(error) = iptables.restore(&data.freeze(), Some(table)) {
            errors.push(error);
        }
    }
    canary::remove(iptables);
    errors
}
