//! The matrix as a printed table and as `docs/reachability.md`.

use std::fmt::Write as _;

use super::cells::{CLUSTER_CIDR, Cell, NODEPORT_ADDRESSES, SOURCE_RANGES};
use super::expected::{
    Expectation, SOCKET_LB_HAIRPIN_KEEPS_POD_SOURCE, SOCKET_LB_ITP_LOCAL_UNREACHABLE,
    SOCKET_LB_KEEPS_POD_SOURCE, SOCKET_LB_NO_ENDPOINTS_REFUSED, SOCKET_LB_SOURCE_RANGE_UNREACHABLE,
    UNLISTED_ADDRESSES_UNTOUCHED, expected,
};
use super::runner::Outcome;

/// The command that regenerates `docs/reachability.md`.
pub const REGENERATE: &str = "sudo -E KPR_WRITE_REACHABILITY=1 cargo test -p proxy-tests --test integration -- reachability_matrix --nocapture";

/// One cell with its expectation and what each mode saw (None: that mode did not run).
#[derive(Debug, Clone)]
pub struct Row {
    pub cell: Cell,
    pub expected: Expectation,
    pub ebpf: Option<Outcome>,
    pub iptables: Option<Outcome>,
}

/// How a mode did in one cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// As upstream.
    Match,
    /// As the documented eBPF difference.
    Intended,
    Mismatch,
    NotRun,
}

impl Row {
    pub fn new(cell: Cell, ebpf: Option<Outcome>, iptables: Option<Outcome>) -> Self {
        Self {
            cell,
            expected: expected(cell),
            ebpf,
            iptables,
        }
    }

    pub fn verdict(&self, ebpf: bool) -> Verdict {
        let observed = if ebpf { &self.ebpf } else { &self.iptables };
        let Some(observed) = observed else {
            return Verdict::NotRun;
        };
        if !observed.matches(self.expected.for_mode(ebpf)) {
            Verdict::Mismatch
        } else if ebpf && self.expected.ebpf.is_some() {
            Verdict::Intended
        } else {
            Verdict::Match
        }
    }

    fn expected_text(&self) -> String {
        let mut text = self.expected.upstream.render();
        if let Some(diff) = &self.expected.ebpf {
            let _ = write!(
                text,
                "; eBPF: {} ({})",
                diff.expect.render(),
                difference_number(diff.reason)
            );
        }
        text
    }

    fn result_text(&self) -> String {
        let (e, i) = (self.verdict(true), self.verdict(false));
        let mut fails = Vec::new();
        if e == Verdict::Mismatch {
            fails.push("eBPF");
        }
        if i == Verdict::Mismatch {
            fails.push("iptables");
        }
        if !fails.is_empty() {
            return format!("FAIL {}", fails.join("+"));
        }
        if e == Verdict::NotRun || i == Verdict::NotRun {
            return "ok (one mode run)".into();
        }
        match &self.expected.ebpf {
            Some(diff) => format!("ok, eBPF differs ({})", difference_number(diff.reason)),
            None => "ok".into(),
        }
    }
}

/// The numbered list of deliberate eBPF differences (`d1`, `d2`, ... in the table).
pub const DIFFERENCES: [&str; 6] = [
    SOCKET_LB_KEEPS_POD_SOURCE,
    SOCKET_LB_ITP_LOCAL_UNREACHABLE,
    SOCKET_LB_NO_ENDPOINTS_REFUSED,
    SOCKET_LB_SOURCE_RANGE_UNREACHABLE,
    UNLISTED_ADDRESSES_UNTOUCHED,
    SOCKET_LB_HAIRPIN_KEEPS_POD_SOURCE,
];

fn difference_number(reason: &str) -> String {
    DIFFERENCES
        .iter()
        .position(|r| *r == reason)
        .map_or_else(|| "?".into(), |i| format!("d{}", i + 1))
}

fn observed_text(outcome: &Option<Outcome>) -> String {
    outcome
        .as_ref()
        .map_or_else(|| "(not run)".into(), Outcome::render)
}

/// The whole matrix.
#[derive(Debug, Clone)]
pub struct Report {
    pub rows: Vec<Row>,
}

impl Report {
    /// Cells that do not match in some mode, with what was expected and seen.
    pub fn mismatches(&self) -> Vec<String> {
        self.rows
            .iter()
            .filter(|r| {
                r.verdict(true) == Verdict::Mismatch || r.verdict(false) == Verdict::Mismatch
            })
            .map(|r| {
                format!(
                    "{}: expected {} | eBPF {} | iptables {} | rule: {}",
                    r.cell.id(),
                    r.expected_text(),
                    observed_text(&r.ebpf),
                    observed_text(&r.iptables),
                    r.expected.rule
                )
            })
            .collect()
    }

    /// Counts per mode: (matching incl. intended differences, mismatching, not run).
    pub fn counts(&self, ebpf: bool) -> (usize, usize, usize) {
        let mut c = (0, 0, 0);
        for r in &self.rows {
            match r.verdict(ebpf) {
                Verdict::Match | Verdict::Intended => c.0 += 1,
                Verdict::Mismatch => c.1 += 1,
                Verdict::NotRun => c.2 += 1,
            }
        }
        c
    }

    fn summary(&self) -> String {
        let mut s = String::new();
        for (name, ebpf) in [("eBPF", true), ("iptables", false)] {
            let (ok, bad, not_run) = self.counts(ebpf);
            let _ = writeln!(
                s,
                "{name}: {ok} cells as expected, {bad} not, {not_run} not run (of {})",
                self.rows.len()
            );
        }
        s
    }

    /// A fixed-width table for the test output.
    pub fn text(&self) -> String {
        let header = ["cell", "expected (upstream)", "eBPF", "iptables", "result"];
        let lines: Vec<[String; 5]> = self
            .rows
            .iter()
            .map(|r| {
                [
                    r.cell.id(),
                    r.expected_text(),
                    observed_text(&r.ebpf),
                    observed_text(&r.iptables),
                    r.result_text(),
                ]
            })
            .collect();
        let mut widths = header.map(|h| h.chars().count());
        for line in &lines {
            for (w, col) in widths.iter_mut().zip(line) {
                *w = (*w).max(col.chars().count());
            }
        }
        let mut out = String::new();
        let mut row = |cols: &[String]| {
            let parts: Vec<String> = cols
                .iter()
                .zip(widths)
                .map(|(c, w)| format!("{c:<w$}"))
                .collect();
            let _ = writeln!(out, "{}", parts.join(" | ").trim_end());
        };
        row(&header.map(str::to_owned));
        row(&widths.map(|w| "-".repeat(w)));
        for line in &lines {
            row(line);
        }
        let _ = writeln!(out);
        for (i, reason) in DIFFERENCES.iter().enumerate() {
            let _ = writeln!(out, "d{}: {reason}", i + 1);
        }
        out.push_str(&self.summary());
        out
    }

    /// `docs/reachability.md`.
    pub fn markdown(&self) -> String {
        let mut md = String::new();
        let _ = writeln!(
            md,
            "# Reachability matrix\n\n\
             Generated by `tests/tests/integration/reachability_matrix.rs` (code in `tests/src/reachability/`); \
             regenerate with\n\n```\n{REGENERATE}\n```\n\n\
             (root, after `cargo xtask build-ebpf` and `cargo build -p proxy-agent -p proxy-tests --bins`). \
             Every cell is real TCP traffic in network namespaces: a node running the agent, a \
             second node `node2` without an agent, and an external namespace that is also the \
             node's default router. Both modes run the same cells with the same configuration: \
             `--cluster-cidr {CLUSTER_CIDR} --nodeport-addresses {NODEPORT_ADDRESSES}` \
             (eBPF mode adds `--interfaces vext,vnode2`).\n"
        );
        md.push_str(
            "## Legend\n\n\
             - **cell**: `shape/frontend/client/family`.\n\
             - **Shapes** (one dual-stack Service each, port 80 → 8080): `etp-cluster` \
             (LoadBalancer, eTP Cluster, endpoints pod2 here + rpod2 on node2), `etp-local` \
             (eTP Local, pod2 + rpod2), `etp-local-none` (eTP Local, only rpod2), `itp-local` \
             (NodePort, iTP Local, pod2 + rpod2), `itp-local-none` (iTP Local, only rpod2), \
             `no-endpoints` (LoadBalancer, none), `terminating` (NodePort, eTP Local, only \
             serving+terminating pod3 + rpod3), `affinity` (NodePort, ClientIP, pod2 pod3 rpod2 \
             rpod3; 15 connections), `lb-ipmode-proxy` (LB ingress with `ipMode: Proxy`, \
             served by a decoy `lb-proxy` standing in for the cloud load balancer), \
             `lb-source-ranges` (LB, `loadBalancerSourceRanges` ",
        );
        let _ = writeln!(
            md,
            "{}).",
            SOURCE_RANGES.map(|r| format!("`{r}`")).join(", ")
        );
        md.push_str(
            "- **Frontends**: ClusterIP; NodePort on the external address 10.10.0.1 / fd00:10::1, \
             on another listed address 10.20.0.1 / fd00:20::1 (the link to node2), on loopback \
             127.0.0.1 / ::1, and on 10.30.0.1 / fd00:30::1 (a local address outside \
             `--nodeport-addresses`); externalIP; LB ingress IP.\n\
             - **Clients**: `pod` (pod1 on this node, in the agent's cgroup), `node2 pod` \
             (rpod1: node2 does not translate, so its traffic enters this node from outside), \
             `host` (host-network process), `localhost`, `external` (10.10.0.2 / fd00:10::2), \
             `external, outside ranges` (10.11.0.2 / fd00:11::2).\n\
             - **Outcomes**: `a,b ← client` — backends a and b answered (over 16 connections; \
             `one of` for affinity: one backend answered all) and saw the client's own address; \
             `← node X` — they saw address X of this node (masqueraded; host clients always use \
             a node address); `refused` ECONNREFUSED (RST or REJECT), `unreachable` \
             EHOSTUNREACH/ENETUNREACH, `timeout` no answer within 1.5 s (dropped; longer than TCP's 1 s SYN retransmission, \
             because Linux fails an IPv6 connect on a REJECT only when the retransmitted SYN is \
             rejected again).\n\
             - **expected** is upstream kube-proxy's behaviour, derived from its iptables rules \
             (the last column cites the rule; `shared/reference/kube-proxy.md`); `eBPF: …` marks a \
             deliberate difference of the eBPF mode.\n\n## Deliberate eBPF differences\n\n",
        );
        for (i, reason) in DIFFERENCES.iter().enumerate() {
            let _ = writeln!(md, "- **d{}**: {reason}.", i + 1);
        }
        let _ = writeln!(md, "\n## Summary\n\n```\n{}```\n", self.summary());
        md.push_str(
            "## Matrix\n\n| cell | expected (upstream) | eBPF | iptables | result | upstream rule |\n\
             |---|---|---|---|---|---|\n",
        );
        for r in &self.rows {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} |",
                r.cell.id(),
                r.expected_text(),
                observed_text(&r.ebpf),
                observed_text(&r.iptables),
                r.result_text(),
                markdown_text(&r.expected.rule)
            );
        }
        md
    }
}

/// A table cell's text as Markdown shows it: `|` would end the cell, and `<ip>` outside a code
/// span would be taken for an HTML tag and vanish from the rendered book.
fn markdown_text(text: &str) -> String {
    text.split('`')
        .enumerate()
        .map(|(i, part)| {
            if i % 2 == 1 {
                part.to_owned()
            } else {
                part.replace('<', "&lt;").replace('>', "&gt;")
            }
        })
        .collect::<Vec<_>>()
        .join("`")
        .replace('|', "\\|")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markdown_text_escapes_tags_outside_code_spans_only() {
        assert_eq!(
            markdown_text("filter `<svc> has no endpoints` -d <ip> -j REJECT | x"),
            "filter `<svc> has no endpoints` -d &lt;ip&gt; -j REJECT \\| x"
        );
    }

    /// Every difference a cell can carry is numbered in the report (and so in README's list).
    #[test]
    fn every_difference_is_numbered() {
        let cells = super::super::cells::all_cells();
        for cell in cells
            .into_iter()
            .chain(super::super::cells::hairpin_cells())
        {
            if let Some(diff) = expected(cell).ebpf {
                assert_ne!(difference_number(diff.reason), "?", "{cell:?}");
            }
        }
    }
}
