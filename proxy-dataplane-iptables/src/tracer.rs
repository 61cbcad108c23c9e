//! A packet tracer with upstream's `tracePacket` semantics (packet-flow-tests.yaml header): it
//! walks nat PREROUTING (or OUTPUT, for a node's own connections), then the filter service
//! chains, over generated rules or a live `iptables-save`. Used by the parity tests
//! (`tests/iptables_parity/`) and by `proxy-agent inspect explain` in iptables mode.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use ipnet::IpNet;

#[derive(Debug, Clone, Default)]
struct Match {
    value: String,
    negated: bool,
}

#[derive(Debug, Clone, Default)]
struct Rule {
    source: Option<Match>,
    src_type: Option<Match>,
    protocol: Option<Match>,
    destination: Option<Match>,
    dst_type: Option<Match>,
    dport: Option<Match>,
    jump: Option<String>,
    probability: bool,
    /// `-m recent --rcheck`, `-m mark --mark`, `--ctstate`: state the tracer never has.
    checks_state: bool,
    to_destination: Option<String>,
}

fn parse_rule(words: &[String]) -> Rule {
    let mut rule = Rule::default();
    let mut negate = false;
    let mut i = 0;
    let next = |i: usize| words.get(i + 1).cloned().unwrap_or_default();
    while i < words.len() {
        let word = words[i].as_str();
        let value = |negated| {
            Some(Match {
                value: next(i),
                negated,
            })
        };
        match word {
            "!" => {
                negate = true;
                i += 1;
                continue;
            }
            "-s" => rule.source = value(negate),
            "--src-type" => rule.src_type = value(negate),
            "-p" => rule.protocol = value(negate),
            "-d" => rule.destination = value(negate),
            "--dst-type" => rule.dst_type = value(negate),
            "--dport" => rule.dport = value(negate),
            "-j" => rule.jump = Some(next(i)),
            "--probability" => rule.probability = true,
            "--rcheck" | "--mark" | "--ctstate" => rule.checks_state = true,
            "--to-destination" => rule.to_destination = Some(next(i)),
            _ => {
                negate = false;
                i += 1;
                continue;
            }
        }
        negate = false;
        // Flags without a value (--rcheck) only advance by one.
        i += if word == "--rcheck" { 1 } else { 2 };
    }
    rule
}

/// Parsed rules by (table, chain).
#[derive(Debug, Default)]
pub struct Tracer {
    chains: BTreeMap<(String, String), Vec<Rule>>,
    local_ips: BTreeSet<IpAddr>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trace {
    /// The DNAT destinations (every endpoint a probabilistic jump may pick) or the terminal
    /// target (`ACCEPT`, `REJECT`, `DROP`), comma-separated; empty: nothing matched.
    pub output: String,
    pub masq: bool,
    /// `table/chain` of every chain entered, in order.
    pub chains: Vec<String>,
}

impl Tracer {
    /// `dump`: a restore text; `extra`: (table, `-A …` line) pairs such as the jump rules.
    pub fn new(dump: &str, extra: &[(String, String)], local_ips: &[IpAddr]) -> Self {
        let mut tracer = Tracer {
            local_ips: local_ips.iter().copied().collect(),
            ..Tracer::default()
        };
        let saved = proxy_kernel::iptables::save::parse(dump)
            .into_iter()
            .flat_map(|table| {
                let name = table.name;
                table
                    .rules
                    .into_iter()
                    .map(move |rule| (name.clone(), rule))
            });
        // `-A CHAIN rule…`; an extra line without a chain name is not a rule.
        let extra = extra.iter().filter_map(|(table, line)| {
            Some((table.clone(), proxy_kernel::iptables::save::rule_of(line)?))
        });
        for (table, rule) in saved.chain(extra) {
            tracer
                .chains
                .entry((table, rule.chain))
                .or_default()
                .push(parse_rule(&rule.words));
        }
        tracer
    }

    pub fn trace(&self, src: &str, proto: &str, dst: &str, dport: &str) -> Trace {
        self.trace_from("PREROUTING", src, proto, dst, dport)
    }

    /// Like [`Tracer::trace`], entering nat at `start` (`PREROUTING` for packets that arrive,
    /// `OUTPUT` for the node's own).
    pub fn trace_from(&self, start: &str, src: &str, proto: &str, dst: &str, dport: &str) -> Trace {
        let mut state = State::default();
        let packet = Packet {
            src: src.parse().ok(),
            proto,
            dst: dst.parse().ok(),
            dport,
        };
        self.run("nat", start, &packet, &mut state);
        let mut packet = packet;
        if let Some(first) = state.outputs.first() {
            // The DNAT destination is `ip:port` or `[ip6]:port`.
            packet.dst = first
                .parse::<std::net::SocketAddr>()
                .map(|s| s.ip())
                .ok()
                .or_else(|| first.split(':').next().and_then(|s| s.parse().ok()));
        }
        for chain in [
            "KUBE-SERVICES",
            "KUBE-EXTERNAL-SERVICES",
            "KUBE-NODEPORTS",
            "KUBE-PROXY-FIREWALL",
        ] {
            self.run("filter", chain, &packet, &mut state);
        }
        Trace {
            output: state.outputs.join(", "),
            masq: state.masq,
            chains: state.chains,
        }
    }

    /// Like [`Tracer::trace_from`], with the filter chains of the hook the packet really
    /// meets (kube-proxy's jump rules, `jumps.rs`) instead of all of them, and stopping at the
    /// first chain that decides: a node's own packet (`OUTPUT`) meets filter OUTPUT
    /// (KUBE-PROXY-FIREWALL, KUBE-SERVICES); an arriving one whose destination after DNAT is a
    /// node address meets INPUT (KUBE-PROXY-FIREWALL, KUBE-NODEPORTS, KUBE-EXTERNAL-SERVICES),
    /// any other FORWARD (KUBE-PROXY-FIREWALL, KUBE-FORWARD, KUBE-SERVICES,
    /// KUBE-EXTERNAL-SERVICES). So a node's connection to an externalIP without endpoints is
    /// not REJECTed (that rule is in KUBE-EXTERNAL-SERVICES, which OUTPUT never jumps to).
    pub fn trace_hooked(
        &self,
        start: &str,
        src: &str,
        proto: &str,
        dst: &str,
        dport: &str,
    ) -> Trace {
        let mut state = State::default();
        let mut packet = Packet {
            src: src.parse().ok(),
            proto,
            dst: dst.parse().ok(),
            dport,
        };
        self.run("nat", start, &packet, &mut state);
        if let Some(first) = state.outputs.first() {
            packet.dst = first
                .parse::<std::net::SocketAddr>()
                .map(|s| s.ip())
                .ok()
                .or_else(|| first.split(':').next().and_then(|s| s.parse().ok()));
        }
        let local = packet.dst.is_some_and(|ip| self.local_ips.contains(&ip));
        let chains: &[&str] = match (start, local) {
            ("OUTPUT", _) => &["KUBE-PROXY-FIREWALL", "KUBE-SERVICES"],
            (_, true) => &[
                "KUBE-PROXY-FIREWALL",
                "KUBE-NODEPORTS",
                "KUBE-EXTERNAL-SERVICES",
            ],
            (_, false) => &[
                "KUBE-PROXY-FIREWALL",
                "KUBE-FORWARD",
                "KUBE-SERVICES",
                "KUBE-EXTERNAL-SERVICES",
            ],
        };
        for chain in chains {
            if self.run("filter", chain, &packet, &mut state) {
                break;
            }
        }
        Trace {
            output: state.outputs.join(", "),
            masq: state.masq,
            chains: state.chains,
        }
    }

    /// The `--to-destination` of `chain`'s DNAT rule (a `KUBE-SEP-` chain's endpoint).
    pub fn dnat_of(&self, table: &str, chain: &str) -> Option<String> {
        self.chains
            .get(&(table.to_owned(), chain.to_owned()))?
            .iter()
            .find_map(|rule| rule.to_destination.clone())
    }

    fn run(&self, table: &str, chain: &str, packet: &Packet<'_>, state: &mut State) -> bool {
        let Some(rules) = self.chains.get(&(table.to_owned(), chain.to_owned())) else {
            return false;
        };
        state.chains.push(format!("{table}/{chain}"));
        for rule in rules {
            let Some(jump) = &rule.jump else { continue };
            if !self.matches(rule, packet) {
                continue;
            }
            match jump.as_str() {
                "KUBE-MARK-MASQ" => state.masq = true,
                "ACCEPT" | "REJECT" | "DROP" => {
                    state.outputs.push(jump.clone());
                    return true;
                }
                "DNAT" => {
                    state
                        .outputs
                        .push(rule.to_destination.clone().unwrap_or_default());
                    return true;
                }
                other => {
                    let terminated = self.run(table, other, packet, state);
                    // A probabilistic jump keeps collecting: every endpoint shows in the output.
                    if terminated && !rule.probability {
                        return true;
                    }
                }
            }
        }
        false
    }

    fn matches(&self, rule: &Rule, p: &Packet<'_>) -> bool {
        let addr = |m: &Option<Match>, ip: Option<IpAddr>| {
            m.as_ref().is_none_or(|m| {
                let hit = ip.is_some_and(|ip| {
                    if m.value == "LOCAL" {
                        self.local_ips.contains(&ip)
                    } else if let Ok(net) = m.value.parse::<IpNet>() {
                        net.contains(&ip)
                    } else {
                        m.value.parse::<IpAddr>().is_ok_and(|v| v == ip)
                    }
                });
                hit != m.negated
            })
        };
        let text =
            |m: &Option<Match>, v: &str| m.as_ref().is_none_or(|m| (m.value == v) != m.negated);
        addr(&rule.source, p.src)
            && addr(&rule.src_type, p.src)
            && text(&rule.protocol, p.proto)
            && addr(&rule.destination, p.dst)
            && addr(&rule.dst_type, p.dst)
            && text(&rule.dport, p.dport)
            && !rule.checks_state
    }
}

struct Packet<'a> {
    src: Option<IpAddr>,
    proto: &'a str,
    dst: Option<IpAddr>,
    dport: &'a str,
}

#[derive(Default)]
struct State {
    outputs: Vec<String>,
    masq: bool,
    chains: Vec<String>,
}
