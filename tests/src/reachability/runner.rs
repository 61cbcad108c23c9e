//! Runs the cells with real connections and summarises what each one saw.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::cells::{Cell, Shape};
use super::expected::{Backends, Expect, FailKind, Source};
use super::rig::MatrixRig;
use crate::client::Attempt;

/// Worker threads: each runs one client process at a time, mostly waiting on the network, so
/// more than the two cores is fine; bounded so the node's conntrack and the echo servers see
/// a modest load.
pub const WORKERS: usize = 8;
/// Attempts made first; a cell whose first attempts all fail stops there (failures cost a
/// timeout each), any answer makes it run its full [`Cell::connections`].
const FIRST_ATTEMPTS: u32 = 2;

/// The source address a backend saw, classified.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Seen {
    /// The client's own address.
    Client,
    /// An address of this node.
    Node(IpAddr),
    /// Anything else.
    Other(IpAddr),
}

/// What one cell saw, summarised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every attempt was answered: backend name → sources it saw.
    Answer(BTreeMap<String, BTreeSet<Seen>>),
    /// Every attempt failed the same way.
    Fail(FailKind),
    /// Anything else (answers and failures mixed, an unknown error, a rig error).
    Mixed(String),
}

impl Outcome {
    /// Compact text: `pod2,rpod2 ← node 10.244.2.1,10.20.0.1`, `timeout`, `mixed: ...`.
    pub fn render(&self) -> String {
        match self {
            Self::Answer(map) => {
                let names: Vec<&str> = map.keys().map(String::as_str).collect();
                let seen: BTreeSet<Seen> = map.values().flatten().copied().collect();
                let mut kinds = Vec::new();
                if seen.contains(&Seen::Client) {
                    kinds.push("client".to_owned());
                }
                let node: Vec<String> = seen
                    .iter()
                    .filter_map(|s| match s {
                        Seen::Node(ip) => Some(ip.to_string()),
                        _ => None,
                    })
                    .collect();
                if !node.is_empty() {
                    kinds.push(format!("node {}", node.join(",")));
                }
                let other: Vec<String> = seen
                    .iter()
                    .filter_map(|s| match s {
                        Seen::Other(ip) => Some(ip.to_string()),
                        _ => None,
                    })
                    .collect();
                if !other.is_empty() {
                    kinds.push(format!("other {}", other.join(",")));
                }
                format!("{} ← {}", names.join(","), kinds.join(" + "))
            }
            Self::Fail(kind) => kind.name().to_owned(),
            Self::Mixed(text) => format!("mixed: {text}"),
        }
    }

    /// Whether this outcome is what `expect` says.
    pub fn matches(&self, expect: &Expect) -> bool {
        match (self, expect) {
            (Self::Fail(seen), Expect::Fail(want)) => seen == want,
            (Self::Answer(map), Expect::Answer { backends, source }) => {
                let sources_ok = map.values().flatten().all(|seen| {
                    matches!(
                        (seen, source),
                        (Seen::Client, Source::Client) | (Seen::Node(_), Source::Node)
                    )
                });
                let names: BTreeSet<&str> = map.keys().map(String::as_str).collect();
                let backends_ok = match backends {
                    Backends::All(want) => names == want.iter().copied().collect(),
                    Backends::OneOf(want) => {
                        names.len() == 1 && names.iter().all(|n| want.contains(n))
                    }
                };
                sources_ok && backends_ok
            }
            _ => false,
        }
    }
}

/// Classifies one failed attempt.
pub fn fail_kind(reason: &str) -> Option<FailKind> {
    match reason {
        "ECONNREFUSED" => Some(FailKind::Refused),
        "EHOSTUNREACH" | "ENETUNREACH" => Some(FailKind::Unreachable),
        "TIMEOUT" => Some(FailKind::Timeout),
        _ => None,
    }
}

/// Summarises the attempts of `cell`; `own` is the client's own address (None: a node
/// address), `node_addresses` are the node's own addresses.
pub fn summarise(own: Option<IpAddr>, attempts: &[Attempt], node_addresses: &[IpAddr]) -> Outcome {
    let mut answers: BTreeMap<String, BTreeSet<Seen>> = BTreeMap::new();
    let mut failures: BTreeMap<String, usize> = BTreeMap::new();
    for attempt in attempts {
        match attempt {
            Attempt::Ok {
                backend, client, ..
            } => {
                let ip = client.ip();
                let seen = if Some(ip) == own {
                    Seen::Client
                } else if node_addresses.contains(&ip) {
                    Seen::Node(ip)
                } else {
                    Seen::Other(ip)
                };
                answers.entry(backend.clone()).or_default().insert(seen);
            }
            Attempt::Err(reason) => *failures.entry(reason.clone()).or_default() += 1,
        }
    }
    if failures.is_empty() && !answers.is_empty() {
        return Outcome::Answer(answers);
    }
    if answers.is_empty()
        && failures.len() == 1
        && let Some(kind) = failures.keys().next().and_then(|r| fail_kind(r))
    {
        return Outcome::Fail(kind);
    }
    let mut parts: Vec<String> = answers
        .iter()
        .map(|(name, seen)| format!("{name}×{}", seen.len()))
        .collect();
    parts.extend(failures.iter().map(|(r, n)| format!("{r}×{n}")));
    Outcome::Mixed(parts.join(" "))
}

/// Makes the connections of one cell.
fn observe(rig: &MatrixRig, cell: &Cell) -> Outcome {
    let run = || -> crate::Result<Vec<Attempt>> {
        let client = rig.client(cell)?;
        let target = cell.target();
        let mut attempts = client.run(target, FIRST_ATTEMPTS)?;
        if attempts.iter().any(|a| matches!(a, Attempt::Ok { .. })) {
            let rest = cell.connections().saturating_sub(FIRST_ATTEMPTS);
            attempts.extend(client.run(target, rest)?);
        }
        Ok(attempts)
    };
    match run() {
        Ok(attempts) => summarise(rig.client_address(cell), &attempts, rig.node_addresses()),
        Err(e) => Outcome::Mixed(format!("rig error: {e}")),
    }
}

/// Runs every cell (in parallel, [`WORKERS`] at a time) and returns the outcomes in the
/// order of `cells`. The affinity shape's cells run one after another in one job: parallel
/// first connections of one client to one Service could each record a different backend
/// (kube-proxy's `recent` lists, our affinity map), which is not what a cell tests.
pub fn run_cells(rig: &MatrixRig, cells: &[Cell]) -> Vec<Outcome> {
    let mut jobs: Vec<Vec<usize>> = Vec::new();
    let mut affinity = Vec::new();
    for (i, cell) in cells.iter().enumerate() {
        if cell.shape == Shape::Affinity {
            affinity.push(i);
        } else {
            jobs.push(vec![i]);
        }
    }
    if !affinity.is_empty() {
        // First, so the longest job does not start last.
        jobs.insert(0, affinity);
    }
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Outcome>>> = Mutex::new(vec![None; cells.len()]);
    std::thread::scope(|scope| {
        for _ in 0..WORKERS {
            scope.spawn(|| {
                loop {
                    let job = next.fetch_add(1, Ordering::Relaxed);
                    let Some(indices) = jobs.get(job) else { break };
                    for &i in indices {
                        let Some(cell) = cells.get(i) else { continue };
                        let outcome = observe(rig, cell);
                        if let Ok(mut results) = results.lock()
                            && let Some(slot) = results.get_mut(i)
                        {
                            *slot = Some(outcome);
                        }
                    }
                }
            });
        }
    });
    results
        .into_inner()
        .unwrap_or_default()
        .into_iter()
        .map(|o| o.unwrap_or_else(|| Outcome::Mixed("not run".into())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reachability::cells::{Client, Family};

    fn own(client: Client) -> Option<IpAddr> {
        client.own_address(Family::V4)
    }

    fn ok(backend: &str, client: &str) -> Attempt {
        Attempt::Ok {
            backend: backend.into(),
            client: client.parse().unwrap_or_else(|_| ([0, 0, 0, 0], 0).into()),
            peer: ([10, 96, 1, 1], 80).into(),
        }
    }

    #[test]
    fn summarises_and_matches() {
        let node: Vec<IpAddr> = vec![[10, 244, 2, 1].into()];
        let got = summarise(
            own(Client::Pod),
            &[
                ok("pod2", "10.244.1.2:1000"),
                ok("rpod2", "10.244.1.2:1001"),
            ],
            &node,
        );
        let want = Expect::Answer {
            backends: Backends::All(vec!["pod2", "rpod2"]),
            source: Source::Client,
        };
        assert!(got.matches(&want), "{got:?}");
        assert_eq!(got.render(), "pod2,rpod2 ← client");
        // A missing backend, or a masqueraded source, is a mismatch.
        let got = summarise(own(Client::Pod), &[ok("pod2", "10.244.2.1:1")], &node);
        assert!(!got.matches(&want));
        assert_eq!(got.render(), "pod2 ← node 10.244.2.1");
        let timeouts = [
            Attempt::Err("TIMEOUT".into()),
            Attempt::Err("TIMEOUT".into()),
        ];
        let got = summarise(own(Client::External), &timeouts, &node);
        assert!(got.matches(&Expect::Fail(FailKind::Timeout)));
        assert!(!got.matches(&Expect::Fail(FailKind::Refused)));
        let mixed = [Attempt::Err("TIMEOUT".into()), ok("pod2", "10.10.0.2:5")];
        assert!(matches!(
            summarise(own(Client::External), &mixed, &node),
            Outcome::Mixed(_)
        ));
    }
}
