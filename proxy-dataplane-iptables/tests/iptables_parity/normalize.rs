//! Upstream's `sortIPTablesRules` (reference §4a): the form the scenario `expected` texts are in.

use std::collections::BTreeMap;

/// One table of a dump: chain declarations and rules in input order.
#[derive(Debug, Default, Clone)]
pub struct Table {
    pub chains: Vec<String>,
    pub rules: Vec<String>,
}

/// Parses restore/dump text into tables (by name).
pub fn parse(text: &str) -> BTreeMap<String, Table> {
    let mut tables: BTreeMap<String, Table> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        let line = line.trim_end();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(name) = line.strip_prefix('*') {
            current = Some(name.to_owned());
            tables.entry(name.to_owned()).or_default();
            continue;
        }
        if line == "COMMIT" {
            current = None;
            continue;
        }
        let table = tables
            .get_mut(
                current
                    .as_ref()
                    .unwrap_or_else(|| panic!("line outside a table: {line}")),
            )
            .unwrap();
        if let Some(decl) = line.strip_prefix(':') {
            let chain = decl.split_whitespace().next().unwrap().to_owned();
            if !table.chains.contains(&chain) {
                table.chains.push(chain);
            }
        } else {
            table.rules.push(line.to_owned());
        }
    }
    tables
}

fn chain_rank(chain: &str) -> (u8, String) {
    match chain {
        "KUBE-NODEPORTS" => (0, String::new()),
        "KUBE-SERVICES" => (1, String::new()),
        c if c.starts_with("KUBE-") => (2, c.to_owned()),
        c => (3, c.to_owned()),
    }
}

fn rule_chain(rule: &str) -> Option<&str> {
    let mut words = rule.split_whitespace();
    match words.next() {
        Some("-A") => words.next(),
        _ => None,
    }
}

/// The `--comment` value of a rule, unquoted.
pub fn comment(rule: &str) -> Option<String> {
    let (_, rest) = rule.split_once("--comment ")?;
    if let Some(quoted) = rest.strip_prefix('"') {
        Some(quoted.split('"').next()?.to_owned())
    } else {
        Some(rest.split_whitespace().next()?.to_owned())
    }
}

fn service_name(rule: &str) -> Option<String> {
    let comment = comment(rule)?;
    Some(
        comment
            .split([' ', ':'])
            .next()
            .unwrap_or_default()
            .to_owned(),
    )
}

/// Stable insertion sort with upstream's partial comparator: rules without a comment are never
/// "less", and (optionally) the "must be the last rule" rule always sorts last.
fn sort_by_service(rules: &mut [String], last_rule_last: bool) {
    let key = |r: &String| -> (bool, Option<String>) {
        (
            last_rule_last && r.contains("must be the last rule"),
            service_name(r),
        )
    };
    let less = |a: &String, b: &String| {
        let (a_last, a_name) = key(a);
        let (b_last, b_name) = key(b);
        if a_last != b_last {
            return !a_last;
        }
        match (a_name, b_name) {
            (Some(a), Some(b)) => a < b,
            _ => false,
        }
    };
    for i in 1..rules.len() {
        let mut j = i;
        while j > 0 && less(&rules[j], &rules[j - 1]) {
            rules.swap(j, j - 1);
            j -= 1;
        }
    }
}

pub fn normalize(text: &str) -> String {
    let mut out = String::new();
    for (name, table) in parse(text) {
        out.push_str(&format!("*{name}\n"));
        let mut chains = table.chains.clone();
        chains.sort_by_key(|c| chain_rank(c));
        for chain in &chains {
            out.push_str(&format!(":{chain} - [0:0]\n"));
        }
        for chain in &chains {
            let mut rules: Vec<String> = table
                .rules
                .iter()
                .filter(|r| rule_chain(r) == Some(chain.as_str()))
                .cloned()
                .collect();
            match (name.as_str(), chain.as_str()) {
                ("filter", "KUBE-NODEPORTS" | "KUBE-SERVICES") | ("nat", "KUBE-NODEPORTS") => {
                    sort_by_service(&mut rules, false);
                }
                ("nat", "KUBE-SERVICES") => sort_by_service(&mut rules, true),
                _ => {}
            }
            for rule in rules {
                out.push_str(&rule);
                out.push('\n');
            }
        }
        // Lines that belong to no declared chain (e.g. -X) keep their order at the end.
        for rule in &table.rules {
            if rule_chain(rule).is_none_or(|c| !chains.iter().any(|d| d == c)) {
                out.push_str(rule);
                out.push('\n');
            }
        }
        out.push_str("COMMIT\n");
    }
    out
}

/// Panics with both texts and the first differing line.
pub fn assert_same(context: &str, expected: &str, actual: &str) {
    let expected = normalize(expected);
    let actual = normalize(actual);
    if expected == actual {
        return;
    }
    let first = expected
        .lines()
        .zip(actual.lines())
        .position(|(e, a)| e != a)
        .unwrap_or_else(|| expected.lines().count().min(actual.lines().count()));
    panic!(
        "{context}: ruleset differs at line {}\n  expected: {:?}\n  actual:   {:?}\n--- expected\n{expected}--- actual\n{actual}",
        first + 1,
        expected.lines().nth(first),
        actual.lines().nth(first),
    );
}
