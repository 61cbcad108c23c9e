//! `inspect interfaces`: which interface runs which program, read from the link pins the agent
//! keeps (`<program>_if<ifindex>_link`: the tc programs' TCX links and the XDP links). Legacy
//! clsact filters (kernels without TCX, `--bpf-disable-feature tcx`) have no pin: `tc filter
//! show dev <interface> ingress` lists those.

use std::{fmt::Write as _, path::Path};

use anyhow::Context as _;
use proxy_common::program_names;
use serde::Serialize;

/// One attached program.
#[derive(Debug, Clone, Serialize, PartialEq, Eq, PartialOrd, Ord)]
pub struct InterfaceRow {
    /// The interface's name in the agent's namespace; `#<ifindex>` if it is gone.
    pub interface: String,
    pub ifindex: u32,
    /// `xdp`, `tc ingress` or `tc egress`.
    pub hook: &'static str,
    pub program: &'static str,
}

/// The hook each program with per-interface links runs at.
const PROGRAMS: [(&str, &str); 4] = [
    (program_names::XDP_EXTERNAL, "xdp"),
    (program_names::TC_EXTERNAL, "tc ingress"),
    (program_names::TC_REPLY, "tc ingress"),
    (program_names::TC_EGRESS, "tc egress"),
];

/// The rows of every per-interface link pinned under `pin_dir`, by interface then hook order
/// (XDP, then tc ingress, then tc egress: the order a received packet meets them).
pub fn rows(pin_dir: &Path) -> anyhow::Result<Vec<InterfaceRow>> {
    let entries =
        std::fs::read_dir(pin_dir).with_context(|| format!("cannot list {}", pin_dir.display()))?;
    let mut rows: Vec<InterfaceRow> = entries
        .flatten()
        .filter_map(|entry| parse_pin(&entry.file_name().to_string_lossy()))
        .map(|(program, hook, ifindex)| InterfaceRow {
            interface: nix::net::if_::if_indextoname(ifindex)
                .ok()
                .and_then(|name| name.into_string().ok())
                .unwrap_or_else(|| format!("#{ifindex}")),
            ifindex,
            hook,
            program,
        })
        .collect();
    rows.sort_by(|a, b| {
        let order = |row: &InterfaceRow| PROGRAMS.iter().position(|(p, _)| *p == row.program);
        (a.ifindex, order(a)).cmp(&(b.ifindex, order(b)))
    });
    Ok(rows)
}

/// `<program>_if<ifindex>_link` → (program, hook, ifindex); `None` for other pins.
fn parse_pin(name: &str) -> Option<(&'static str, &'static str, u32)> {
    let rest = name.strip_suffix("_link")?;
    let (program, index) = rest.rsplit_once("_if")?;
    let ifindex = index.parse().ok()?;
    PROGRAMS
        .iter()
        .find(|(p, _)| *p == program)
        .map(|(p, hook)| (*p, *hook, ifindex))
}

pub fn table(rows: &[InterfaceRow]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<16} {:>7} {:<11} PROGRAM",
        "INTERFACE", "IFINDEX", "HOOK"
    );
    for row in rows {
        let _ = writeln!(
            out,
            "{:<16} {:>7} {:<11} {}",
            row.interface, row.ifindex, row.hook, row.program
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_pins_name_program_hook_and_interface() {
        assert_eq!(
            parse_pin("kpr_xdp_external_if7_link"),
            Some(("kpr_xdp_external", "xdp", 7))
        );
        assert_eq!(
            parse_pin("kpr_tc_egress_if12_link"),
            Some(("kpr_tc_egress", "tc egress", 12))
        );
        assert_eq!(
            parse_pin("kpr_connect4_link"),
            None,
            "cgroup links are not per interface"
        );
        assert_eq!(parse_pin("KPR_CT4"), None);
        assert_eq!(parse_pin("kpr_tc_external_if7_link_new"), None);
    }
}
