//! Drift between the live ruleset and what the agent writes: the canary chains, and for every
//! chain a full sync would write (filter and nat: KUBE-SERVICES, KUBE-NODEPORTS, the per-Service
//! SVC/SVL/EXT/FW/SEP chains, …) the sequence of its rules, plus Service chains of ours that
//! should not exist.
//!
//! `iptables-save` does not print a rule as it was restored (option order, `/32` suffixes, match
//! modules added, `--or-mark` as `--set-xmark`, the `recent` match's default mask and
//! `--rsource`, REJECT's default `--reject-with`), so rules are compared by a normalised
//! signature of everything the agent writes: protocol, addresses, interfaces, ports, address
//! types, conntrack states, comments, `recent` options, marks, target and its options (DNAT
//! destination, MASQUERADE `--random-fully`), in order.
//! Repair is a full sync: `iptables-restore --noflush` rewrites every chain it declares.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::chains::KUBE_PROXY_CANARY;

/// Tables the agent writes rules into.
pub const TABLES: [&str; 2] = ["filter", "nat"];

/// Per-Service chain prefixes: such a chain in the kernel that the ruleset does not declare is
/// a leftover (or someone else's addition under our names).
const SERVICE_CHAIN_PREFIXES: [&str; 5] = [
    "KUBE-SVC-",
    "KUBE-SVL-",
    "KUBE-EXT-",
    "KUBE-FW-",
    "KUBE-SEP-",
];

/// One difference, for the drift report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChainDrift {
    pub table: &'static str,
    /// `missing` (chain or canary), `changed` (rules differ), `extra` (chain).
    pub kind: &'static str,
    pub chain: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expected: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub found: Option<String>,
}

/// Chains of one table with their rules' signatures, in order.
pub type TableRules = BTreeMap<String, Vec<String>>;

/// Parses `iptables-save` output or `iptables-restore` input: per table, each declared chain
/// with the signatures of its `-A` rules.
pub fn parse(text: &str) -> BTreeMap<String, TableRules> {
    let mut tables: BTreeMap<String, TableRules> = BTreeMap::new();
    for saved in proxy_kernel::iptables::save::parse(text) {
        let table = tables.entry(saved.name).or_default();
        for chain in saved.chains {
            table.entry(chain).or_default();
        }
        for rule in saved.rules {
            let words: Vec<&str> = rule.words.iter().map(String::as_str).collect();
            table.entry(rule.chain).or_default().push(signature(&words));
        }
    }
    tables
}

/// Options with a value that the signature keeps.
const WITH_VALUE: [&str; 18] = [
    "--nfacct-name",
    "-p",
    "-s",
    "-d",
    "-i",
    "-o",
    "--dport",
    "--sport",
    "-j",
    "--to-destination",
    "--probability",
    "--comment",
    "--dst-type",
    "--src-type",
    "--ctstate",
    "--name",
    "--seconds",
    "--mark",
];

/// Options without a value that the signature keeps.
const FLAGS: [&str; 5] = [
    "--rcheck",
    "--set",
    "--reap",
    "--random-fully",
    "--limit-iface-in",
];

/// A rule's signature: its kept options, normalised, sorted (`iptables-save` reorders them).
fn signature(words: &[&str]) -> String {
    let mut parts: Vec<String> = Vec::new();
    for (i, word) in words.iter().enumerate() {
        let negated = i > 0 && words[i - 1] == "!";
        let not = if negated { "! " } else { "" };
        if FLAGS.contains(word) {
            parts.push(format!("{not}{word}"));
            continue;
        }
        let Some(value) = words.get(i + 1) else {
            continue;
        };
        let (word, value) = match *word {
            // iptables-save prints one more decimal of a probability than kube-proxy writes.
            "--probability" => (
                *word,
                value
                    .parse::<f64>()
                    .map_or_else(|_| (*value).to_owned(), |p| format!("{p:.9}")),
            ),
            // It prints networks without host bits, and single addresses with /32 or /128.
            "-s" | "-d" => (*word, normalise_address(value)),
            "--mark" => (*word, normalise_mark(value)),
            // The MARK target's forms, as iptables-save prints them all.
            "--or-mark" => ("--set-xmark", format!("{}/{}", hex(value), hex(value))),
            "--xor-mark" => ("--set-xmark", format!("{}/0x0", hex(value))),
            "--set-xmark" => ("--set-xmark", normalise_mark(value)),
            // REJECT's default is printed; kube-proxy never writes another.
            "--reject-with" if value.ends_with("port-unreachable") => continue,
            "--ctstate" => {
                let mut states: Vec<&str> = value.split(',').collect();
                states.sort_unstable();
                (*word, states.join(","))
            }
            w if WITH_VALUE.contains(&w) || w == "--reject-with" => (w, (*value).to_owned()),
            _ => continue,
        };
        parts.push(format!("{not}{word} {value}"));
    }
    parts.sort();
    parts.join(" ")
}

/// `0x4000` as iptables prints it (lower-case hex without leading zeros).
fn hex(value: &str) -> String {
    let digits = value.trim_start_matches("0x").trim_start_matches("0X");
    u32::from_str_radix(digits, 16)
        .or_else(|_| value.parse::<u32>())
        .map_or_else(|_| value.to_owned(), |v| format!("{v:#x}"))
}

/// `VALUE[/MASK]` with a full mask dropped, as iptables-save prints a mark.
fn normalise_mark(value: &str) -> String {
    match value.split_once('/') {
        Some((v, m)) if hex(m) == "0xffffffff" => hex(v),
        Some((v, m)) => format!("{}/{}", hex(v), hex(m)),
        None => hex(value),
    }
}

fn normalise_address(value: &str) -> String {
    if let Ok(net) = value.parse::<ipnet::IpNet>() {
        let net = net.trunc();
        if net.prefix_len() == net.max_prefix_len() {
            return net.addr().to_string();
        }
        return net.to_string();
    }
    value.to_owned()
}

/// Compares the chains `expected` declares with `live`, table by table; `canary_present` says
/// whether the canary is in mangle.
pub fn diff(
    expected: &BTreeMap<String, TableRules>,
    live: &BTreeMap<String, TableRules>,
    canary_present: bool,
) -> Vec<ChainDrift> {
    let mut out = Vec::new();
    if !canary_present {
        out.push(ChainDrift {
            table: "mangle",
            kind: "missing",
            chain: KUBE_PROXY_CANARY.to_owned(),
            expected: Some("present".to_owned()),
            found: None,
        });
    }
    let empty = TableRules::new();
    for table in TABLES {
        let want = expected.get(table).unwrap_or(&empty);
        let have = live.get(table).unwrap_or(&empty);
        for (chain, rules) in want {
            match have.get(chain) {
                None => out.push(ChainDrift {
                    table,
                    kind: "missing",
                    chain: chain.clone(),
                    expected: Some(format!("{} rules", rules.len())),
                    found: None,
                }),
                Some(found) if found != rules => out.push(ChainDrift {
                    table,
                    kind: "changed",
                    chain: chain.clone(),
                    expected: Some(first_difference(rules, found).0),
                    found: Some(first_difference(rules, found).1),
                }),
                Some(_) => {}
            }
        }
        let declared: BTreeSet<&String> = want.keys().collect();
        for (chain, rules) in have {
            if !declared.contains(chain)
                && SERVICE_CHAIN_PREFIXES.iter().any(|p| chain.starts_with(p))
            {
                out.push(ChainDrift {
                    table,
                    kind: "extra",
                    chain: chain.clone(),
                    expected: None,
                    found: Some(format!("{} rules", rules.len())),
                });
            }
        }
    }
    out
}

/// The first rule where two chains differ, as (expected, found) texts.
fn first_difference(expected: &[String], found: &[String]) -> (String, String) {
    let at = expected
        .iter()
        .zip(found)
        .position(|(a, b)| a != b)
        .unwrap_or(expected.len().min(found.len()));
    let show = |rules: &[String]| match rules.get(at) {
        Some(rule) => format!("{} rules; #{}: {rule}", rules.len(), at + 1),
        None => format!("{} rules", rules.len()),
    };
    (show(expected), show(found))
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXPECTED: &str = "*filter\n:KUBE-SERVICES - [0:0]\nCOMMIT\n*nat\n\
        :KUBE-SERVICES - [0:0]\n:KUBE-SVC-AAA - [0:0]\n:KUBE-SEP-BBB - [0:0]\n\
        -A KUBE-SERVICES -m comment --comment \"default/web:http cluster IP\" -m tcp -p tcp -d 10.96.0.10 --dport 80 -j KUBE-SVC-AAA\n\
        -A KUBE-SVC-AAA -m comment --comment \"default/web:http -> 10.244.1.2:8080\" -j KUBE-SEP-BBB\n\
        -A KUBE-SEP-BBB -m comment --comment default/web:http -m tcp -p tcp -j DNAT --to-destination 10.244.1.2:8080\n\
        -A KUBE-SEP-BBB -m statistic --mode random --probability 0.5000000000 -j KUBE-SEP-BBB\n\
        -A KUBE-SEP-BBB -s 203.0.113.7/24 -j RETURN\n\
        COMMIT\n";

    /// The same rules as `iptables-save` prints them.
    const SAVED: &str = "*filter\n:KUBE-SERVICES - [0:0]\nCOMMIT\n*nat\n\
        :KUBE-SERVICES - [0:0]\n:KUBE-SVC-AAA - [0:0]\n:KUBE-SEP-BBB - [0:0]\n:KUBE-SEP-OLD - [0:0]\n\
        -A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment \"default/web:http cluster IP\" -m tcp --dport 80 -j KUBE-SVC-AAA\n\
        -A KUBE-SVC-AAA -m comment --comment \"default/web:http -> 10.244.1.2:8080\" -j KUBE-SEP-BBB\n\
        -A KUBE-SEP-BBB -p tcp -m comment --comment default/web:http -m tcp -j DNAT --to-destination 10.244.1.2:8080\n\
        -A KUBE-SEP-BBB -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-BBB\n\
        -A KUBE-SEP-BBB -s 203.0.113.0/24 -j RETURN\n\
        COMMIT\n";

    #[test]
    fn the_saved_form_of_the_restored_rules_is_no_drift_but_a_stray_chain_is() {
        let drift = diff(&parse(EXPECTED), &parse(SAVED), true);
        assert_eq!(
            drift,
            [ChainDrift {
                table: "nat",
                kind: "extra",
                chain: "KUBE-SEP-OLD".into(),
                expected: None,
                found: Some("0 rules".into()),
            }]
        );
    }

    #[test]
    fn a_changed_dnat_a_deleted_rule_and_a_flushed_canary_are_reported() {
        let saved = SAVED
            .replace("--to-destination 10.244.1.2:8080", "--to-destination 192.0.2.1:8080")
            .replace(
                "-A KUBE-SVC-AAA -m comment --comment \"default/web:http -> 10.244.1.2:8080\" -j KUBE-SEP-BBB\n",
                "",
            );
        let drift = diff(&parse(EXPECTED), &parse(&saved), false);
        let kinds: Vec<(&str, &str, &str)> = drift
            .iter()
            .map(|d| (d.table, d.kind, d.chain.as_str()))
            .collect();
        assert_eq!(
            kinds,
            [
                ("mangle", "missing", "KUBE-PROXY-CANARY"),
                ("nat", "changed", "KUBE-SEP-BBB"),
                ("nat", "changed", "KUBE-SVC-AAA"),
                ("nat", "extra", "KUBE-SEP-OLD"),
            ]
        );
        assert!(
            drift[1]
                .found
                .as_deref()
                .is_some_and(|f| f.contains("192.0.2.1:8080")),
            "{drift:?}"
        );
    }

    #[test]
    fn the_saved_forms_of_marks_recent_and_reject_are_no_drift() {
        let restored = "*nat\n:KUBE-POSTROUTING - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n:KUBE-SVC-AAA - [0:0]\n\
            -A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n\
            -A KUBE-POSTROUTING -j MARK --xor-mark 0x4000\n\
            -A KUBE-MARK-MASQ -j MARK --or-mark 0x4000\n\
            -A KUBE-SVC-AAA -m comment --comment \"default/web:http -> 10.244.1.2:8080\" -m recent --name KUBE-SEP-BBB --rcheck --seconds 10800 --reap -j KUBE-SEP-BBB\n\
            COMMIT\n*filter\n:KUBE-SERVICES - [0:0]\n\
            -A KUBE-SERVICES -m comment --comment \"default/none:http has no endpoints\" -m tcp -p tcp -d 10.96.0.30 --dport 80 -j REJECT\n\
            COMMIT\n";
        let saved = "*nat\n:KUBE-POSTROUTING - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n:KUBE-SVC-AAA - [0:0]\n\
            -A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n\
            -A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0\n\
            -A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\n\
            -A KUBE-SVC-AAA -m comment --comment \"default/web:http -> 10.244.1.2:8080\" -m recent --rcheck --seconds 10800 --reap --name KUBE-SEP-BBB --mask 255.255.255.255 --rsource -j KUBE-SEP-BBB\n\
            COMMIT\n*filter\n:KUBE-SERVICES - [0:0]\n\
            -A KUBE-SERVICES -d 10.96.0.30/32 -p tcp -m comment --comment \"default/none:http has no endpoints\" -m tcp --dport 80 -j REJECT --reject-with icmp-port-unreachable\n\
            COMMIT\n";
        assert_eq!(diff(&parse(restored), &parse(saved), true), []);

        // A comment, a mark, a recent timeout changed behind the agent's back: each is drift.
        for (from, to, chain) in [
            ("has no endpoints", "has endpoints", "KUBE-SERVICES"),
            (
                "0x4000/0x4000 -j RETURN",
                "0x8000/0x8000 -j RETURN",
                "KUBE-POSTROUTING",
            ),
            (
                "--set-xmark 0x4000/0x4000",
                "--set-xmark 0x1/0x1",
                "KUBE-MARK-MASQ",
            ),
            ("--seconds 10800", "--seconds 1", "KUBE-SVC-AAA"),
            ("--name KUBE-SEP-BBB", "--name KUBE-SEP-CCC", "KUBE-SVC-AAA"),
        ] {
            let tampered = saved.replace(from, to);
            let drift = diff(&parse(restored), &parse(&tampered), true);
            let chains: Vec<&str> = drift.iter().map(|d| d.chain.as_str()).collect();
            assert_eq!(chains, [chain], "{from} → {to}: {drift:?}");
        }
    }
}
