//! The rule generator: one IP family's snapshot → the `iptables-restore` input kube-proxy's
//! iptables proxier would write (`syncProxyRules`), as a pure function. Rule text, order and
//! comments follow upstream exactly; services are emitted in name order where upstream uses Go
//! map order (which tests normalise away).

use std::collections::BTreeSet;

use bytes::{BufMut as _, Bytes, BytesMut};

use super::{
    chains::{
        KUBE_EXTERNAL_SERVICES, KUBE_FIREWALL, KUBE_FORWARD, KUBE_MARK_MASQ, KUBE_NODEPORTS,
        KUBE_POSTROUTING, KUBE_PROXY_FIREWALL, KUBE_SERVICES, ServiceChains, chain_line,
        endpoint_chain, is_service_chain_name,
    },
    config::{FamilyRules, NodePortAddresses},
};
use proxy_model::{
    desired::{Endpoint, FamilySnapshot, IpFamily, ServicePort},
    objects::ObjectKey,
};

pub use proxy_kernel::iptables::nfacct::{NFACCT_CT_STATE_INVALID, NFACCT_LOCALHOST_NODEPORTS};

const NODEPORTS_LAST_COMMENT: &str =
    "\"kubernetes service nodeports; NOTE: this must be the last rule in this chain\"";

/// What to write this sync.
#[derive(Debug, Clone, Copy)]
pub struct SyncInput<'a> {
    /// `None`: a full sync. `Some(services)`: a partial sync that writes the per-service chains
    /// (SVC/SVL/EXT/FW/SEP) of these Services only; the others keep their kernel contents.
    pub changed_services: Option<&'a BTreeSet<ObjectKey>>,
    /// The nat chains that exist now (from `iptables-save -t nat`); our service chains among
    /// them that nothing uses any more are flushed and deleted. `None`: skip that step.
    pub existing_nat_chains: Option<&'a BTreeSet<String>>,
}

/// A generated ruleset and the numbers kube-proxy reports about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ruleset {
    /// The `iptables-restore --noflush` input: `*filter … COMMIT *nat … COMMIT`.
    pub restore: Bytes,
    /// Every nat service chain the current state uses (written or kept).
    pub active_nat_chains: BTreeSet<String>,
    /// `-A` rules in the filter table.
    pub filter_rules: usize,
    /// `-A` rules the nat table holds after this sync (written + kept − deleted chains), the
    /// `sync_proxy_rules_iptables_total{table="nat"}` value.
    pub nat_rules_total: usize,
    /// nat lines written this sync minus deleted chains (`sync_proxy_rules_iptables_last`).
    pub nat_rules_written: usize,
    pub deleted_chains: Vec<String>,
    /// More endpoints than the large-cluster threshold: comments on endpoint rules dropped.
    pub large_cluster: bool,
    /// Services with Local internal / external policy, endpoints, but none on this node.
    pub no_local_endpoints_internal: usize,
    pub no_local_endpoints_external: usize,
}

/// Restore-format lines; a discarding buffer only counts (partial syncs still need the counts).
#[derive(Debug, Default)]
struct Lines {
    buf: BytesMut,
    count: usize,
    discard: bool,
}

impl Lines {
    fn discarding() -> Self {
        Self {
            discard: true,
            ..Self::default()
        }
    }

    fn write(&mut self, parts: &[&str]) {
        self.count += 1;
        if self.discard {
            return;
        }
        for (i, part) in parts.iter().enumerate() {
            if i > 0 {
                self.buf.put_u8(b' ');
            }
            self.buf.put_slice(part.as_bytes());
        }
        self.buf.put_u8(b'\n');
    }

    /// `-A CHAIN -m comment --comment C -m P -p P -d DEST --dport PORT -j TARGET`: the shape of
    /// every per-address service rule in KUBE-SERVICES / KUBE-EXTERNAL-SERVICES.
    fn write_service_match(
        &mut self,
        chain: &str,
        comment: &str,
        proto: &str,
        dest: &str,
        port: &str,
        target: &str,
    ) {
        self.write(&[
            "-A",
            chain,
            "-m",
            "comment",
            "--comment",
            comment,
            "-m",
            proto,
            "-p",
            proto,
            "-d",
            dest,
            "--dport",
            port,
            "-j",
            target,
        ]);
    }

    fn chain(&mut self, chain: &str) {
        self.write(&[&chain_line(chain)]);
    }
}

/// The four buffers of one sync plus the partial-sync discard pair.
#[derive(Debug, Default)]
struct Tables {
    filter_chains: Lines,
    filter_rules: Lines,
    nat_chains: Lines,
    nat_rules: Lines,
    skipped_nat_chains: Lines,
    skipped_nat_rules: Lines,
}

/// Generates the restore input for one family.
pub fn generate(ctx: &FamilyRules, snapshot: &FamilySnapshot, input: SyncInput<'_>) -> Ruleset {
    let mut t = Tables {
        skipped_nat_chains: Lines::discarding(),
        skipped_nat_rules: Lines::discarding(),
        ..Tables::default()
    };
    let mark = ctx.mark.as_str();
    let mark_match = format!("{mark}/{mark}");

    for chain in [
        KUBE_SERVICES,
        KUBE_EXTERNAL_SERVICES,
        KUBE_FORWARD,
        KUBE_NODEPORTS,
        KUBE_PROXY_FIREWALL,
    ] {
        t.filter_chains.chain(chain);
    }
    for chain in [
        KUBE_SERVICES,
        KUBE_NODEPORTS,
        KUBE_POSTROUTING,
        KUBE_MARK_MASQ,
    ] {
        t.nat_chains.chain(chain);
    }

    t.nat_rules.write(&[
        "-A",
        KUBE_POSTROUTING,
        "-m",
        "mark",
        "!",
        "--mark",
        &mark_match,
        "-j",
        "RETURN",
    ]);
    // Clearing the bit keeps a packet that traverses the stack again from being re-masqueraded.
    t.nat_rules
        .write(&["-A", KUBE_POSTROUTING, "-j", "MARK", "--xor-mark", mark]);
    let mut masquerade = vec![
        "-A",
        KUBE_POSTROUTING,
        "-m",
        "comment",
        "--comment",
        "\"kubernetes service traffic requiring SNAT\"",
        "-j",
        "MASQUERADE",
    ];
    if ctx.random_fully {
        masquerade.push("--random-fully");
    }
    t.nat_rules.write(&masquerade);
    t.nat_rules
        .write(&["-A", KUBE_MARK_MASQ, "-j", "MARK", "--or-mark", mark]);

    let is_v6 = ctx.family == IpFamily::V6;
    if !is_v6 && ctx.localhost_node_ports {
        // route_localnet (needed for localhost NodePorts) opens a hole (kubernetes#90259); this
        // is the same rule kubelet installs to close it.
        t.filter_chains.chain(KUBE_FIREWALL);
        t.filter_rules.write(&[
            "-A",
            KUBE_FIREWALL,
            "-m",
            "comment",
            "--comment",
            "\"block incoming localnet connections\"",
            "-d",
            "127.0.0.0/8",
            "!",
            "-s",
            "127.0.0.0/8",
            "-m",
            "conntrack",
            "!",
            "--ctstate",
            "RELATED,ESTABLISHED,DNAT",
            "-j",
            "DROP",
        ]);
    }

    let large_cluster = is_large_cluster(ctx, snapshot);
    let mut state = SyncState {
        active_nat_chains: BTreeSet::new(),
        no_local_internal: 0,
        no_local_external: 0,
        large_cluster,
    };

    for port in snapshot.service_ports.values() {
        let skip_chains = input
            .changed_services
            .is_some_and(|changed| !changed.contains(&port.name.service));
        write_service_port(ctx, port, skip_chains, &mut t, &mut state);
    }

    let mut deleted_chains = Vec::new();
    if let Some(existing) = input.existing_nat_chains {
        for chain in existing {
            if is_service_chain_name(chain) && !state.active_nat_chains.contains(chain) {
                // A chain line flushes the chain, so the -X that follows can delete it.
                t.nat_chains.chain(chain);
                t.nat_rules.write(&["-X", chain]);
                deleted_chains.push(chain.clone());
            }
        }
    }

    // The jump to KUBE-NODEPORTS must be the last rule of KUBE-SERVICES.
    match &ctx.node_ports {
        NodePortAddresses::All => {
            let mut rule = vec![
                "-A",
                KUBE_SERVICES,
                "-m",
                "comment",
                "--comment",
                NODEPORTS_LAST_COMMENT,
                "-m",
                "addrtype",
                "--dst-type",
                "LOCAL",
            ];
            // Localhost NodePorts never work on IPv6, and on IPv4 only with route_localnet.
            if is_v6 {
                rule.extend(["!", "-d", "::1/128"]);
            } else if !ctx.localhost_node_ports {
                rule.extend(["!", "-d", "127.0.0.0/8"]);
            }
            rule.extend(["-j", KUBE_NODEPORTS]);
            t.nat_rules.write(&rule);
        }
        NodePortAddresses::Ips(ips) => {
            for ip in ips {
                if ip.is_loopback() && (is_v6 || !ctx.localhost_node_ports) {
                    tracing::error!(
                        address = %ip,
                        "--nodeport-addresses includes localhost, but localhost NodePorts are not \
                         supported here (IPv6, or --iptables-localhost-nodeports=false)"
                    );
                    continue;
                }
                let ip = ip.to_string();
                t.nat_rules.write(&[
                    "-A",
                    KUBE_SERVICES,
                    "-m",
                    "comment",
                    "--comment",
                    NODEPORTS_LAST_COMMENT,
                    "-d",
                    &ip,
                    "-j",
                    KUBE_NODEPORTS,
                ]);
            }
        }
    }

    // Without tcp_be_liberal, out-of-window packets are INVALID and would otherwise reach the
    // pod un-NATed and be answered with RSTs (kubernetes#74839).
    if !ctx.conntrack_tcp_liberal {
        let mut rule = vec![
            "-A",
            KUBE_FORWARD,
            "-m",
            "conntrack",
            "--ctstate",
            "INVALID",
        ];
        if ctx.nfacct_invalid {
            rule.extend(["-m", "nfacct", "--nfacct-name", NFACCT_CT_STATE_INVALID]);
        }
        rule.extend(["-j", "DROP"]);
        t.filter_rules.write(&rule);
    }
    // Marked traffic is forwarded even when the FORWARD policy is DROP.
    t.filter_rules.write(&[
        "-A",
        KUBE_FORWARD,
        "-m",
        "comment",
        "--comment",
        "\"kubernetes forwarding rules\"",
        "-m",
        "mark",
        "--mark",
        &mark_match,
        "-j",
        "ACCEPT",
    ]);
    t.filter_rules.write(&[
        "-A",
        KUBE_FORWARD,
        "-m",
        "comment",
        "--comment",
        "\"kubernetes forwarding conntrack rule\"",
        "-m",
        "conntrack",
        "--ctstate",
        "RELATED,ESTABLISHED",
        "-j",
        "ACCEPT",
    ]);

    let deleted = deleted_chains.len();
    let nat_written = t.nat_rules.count;
    let mut out = BytesMut::with_capacity(
        t.filter_chains.buf.len()
            + t.filter_rules.buf.len()
            + t.nat_chains.buf.len()
            + t.nat_rules.buf.len()
            + 32,
    );
    out.put_slice(b"*filter\n");
    out.put_slice(&t.filter_chains.buf);
    out.put_slice(&t.filter_rules.buf);
    out.put_slice(b"COMMIT\n*nat\n");
    out.put_slice(&t.nat_chains.buf);
    out.put_slice(&t.nat_rules.buf);
    out.put_slice(b"COMMIT\n");

    Ruleset {
        restore: out.freeze(),
        active_nat_chains: state.active_nat_chains,
        filter_rules: t.filter_rules.count,
        nat_rules_total: (nat_written + t.skipped_nat_rules.count).saturating_sub(deleted),
        nat_rules_written: nat_written.saturating_sub(deleted),
        deleted_chains,
        large_cluster,
        no_local_endpoints_internal: state.no_local_internal,
        no_local_endpoints_external: state.no_local_external,
    }
}

/// kube-proxy's `largeClusterMode`: more endpoints (of any state) than the threshold.
pub fn is_large_cluster(ctx: &FamilyRules, snapshot: &FamilySnapshot) -> bool {
    let total: usize = snapshot
        .service_ports
        .values()
        .map(|p| p.endpoints.len())
        .sum();
    total > ctx.large_cluster_threshold
}

struct SyncState {
    active_nat_chains: BTreeSet<String>,
    no_local_internal: usize,
    no_local_external: usize,
    large_cluster: bool,
}

/// All rules of one service port (kube-proxy's per-service loop body).
fn write_service_port(
    ctx: &FamilyRules,
    port: &ServicePort,
    skip_chains: bool,
    t: &mut Tables,
    state: &mut SyncState,
) {
    let name = port.name.to_string();
    let proto = port.protocol.as_lower();
    let chains = ServiceChains::of(port);
    let cluster_ip = port.cluster_ip.to_string();
    let svc_port = port.port.to_string();

    // Every endpoint this node may send to, with its SEP chain.
    let reachable: Vec<(&Endpoint, String)> = port
        .reachable_endpoints()
        .map(|e| (e, endpoint_chain(port, e)))
        .collect();
    let cluster_endpoints: Vec<(&Endpoint, &str)> = reachable
        .iter()
        .filter(|(e, _)| e.cluster)
        .map(|(e, c)| (*e, c.as_str()))
        .collect();
    let local_endpoints: Vec<(&Endpoint, &str)> = reachable
        .iter()
        .filter(|(e, _)| e.local)
        .map(|(e, c)| (*e, c.as_str()))
        .collect();
    for (_, chain) in &reachable {
        state.active_nat_chains.insert(chain.clone());
    }

    let has_endpoints = port.has_any_endpoints;
    let uses_cluster_chain = !cluster_endpoints.is_empty() && port.uses_cluster_endpoints();
    let uses_local_chain = !local_endpoints.is_empty() && port.uses_local_endpoints();

    let (internal_chain, has_internal) = if port.internal_policy_local {
        (&chains.local, has_endpoints && !local_endpoints.is_empty())
    } else {
        (&chains.cluster, has_endpoints)
    };
    let (external_policy_chain, has_external) = if port.external_policy_local {
        (&chains.local, has_endpoints && !local_endpoints.is_empty())
    } else {
        (&chains.cluster, has_endpoints)
    };
    let external_chain = &chains.external;
    // Even without externally usable endpoints the EXT chain carries the short-circuit rules
    // for traffic from pods and from the node itself.
    let uses_external_chain = has_endpoints && port.externally_accessible();
    let uses_fw_chain =
        has_endpoints && !port.load_balancer_ips.is_empty() && !port.source_ranges.is_empty();
    let load_balancer_chain = if uses_fw_chain {
        &chains.firewall
    } else {
        external_chain
    };

    let (internal_filter, external_filter) = if !has_endpoints {
        let comment = format!("\"{name} has no endpoints\"");
        (Some(("REJECT", comment.clone())), Some(("REJECT", comment)))
    } else {
        let no_local = format!("\"{name} has no local endpoints\"");
        let internal = (!has_internal).then(|| ("DROP", no_local.clone()));
        let external = (!has_external).then_some(("DROP", no_local));
        state.no_local_internal += usize::from(internal.is_some());
        state.no_local_external += usize::from(external.is_some());
        (internal, external)
    };

    // ClusterIP.
    if has_internal {
        let comment = format!("\"{name} cluster IP\"");
        t.nat_rules.write_service_match(
            KUBE_SERVICES,
            &comment,
            proto,
            &cluster_ip,
            &svc_port,
            internal_chain,
        );
    } else if let Some((target, comment)) = &internal_filter {
        t.filter_rules.write_service_match(
            KUBE_SERVICES,
            comment,
            proto,
            &cluster_ip,
            &svc_port,
            target,
        );
    }

    // External IPs.
    for ip in &port.external_ips {
        let ip = ip.to_string();
        if has_endpoints {
            let comment = format!("\"{name} external IP\"");
            t.nat_rules.write_service_match(
                KUBE_SERVICES,
                &comment,
                proto,
                &ip,
                &svc_port,
                external_chain,
            );
        }
        if let Some((target, comment)) = &external_filter {
            t.filter_rules.write_service_match(
                KUBE_EXTERNAL_SERVICES,
                comment,
                proto,
                &ip,
                &svc_port,
                target,
            );
        }
    }

    // Load-balancer IPs.
    for ip in &port.load_balancer_ips {
        let ip = ip.to_string();
        if has_endpoints {
            let comment = format!("\"{name} loadbalancer IP\"");
            t.nat_rules.write_service_match(
                KUBE_SERVICES,
                &comment,
                proto,
                &ip,
                &svc_port,
                load_balancer_chain,
            );
        }
        if uses_fw_chain {
            let comment = format!("\"{name} traffic not accepted by {}\"", chains.firewall);
            t.filter_rules.write_service_match(
                KUBE_PROXY_FIREWALL,
                &comment,
                proto,
                &ip,
                &svc_port,
                "DROP",
            );
        }
    }
    if let Some((target, comment)) = &external_filter {
        for ip in &port.load_balancer_ips {
            let ip = ip.to_string();
            t.filter_rules.write_service_match(
                KUBE_EXTERNAL_SERVICES,
                comment,
                proto,
                &ip,
                &svc_port,
                target,
            );
        }
    }

    // NodePort (not subject to loadBalancerSourceRanges, as upstream).
    if let Some(node_port) = port.node_port {
        let node_port = node_port.to_string();
        if has_endpoints {
            if ctx.localhost_node_ports && ctx.family == IpFamily::V4 && ctx.nfacct_localhost {
                t.nat_rules.write(&[
                    "-A",
                    KUBE_NODEPORTS,
                    "-m",
                    "comment",
                    "--comment",
                    &name,
                    "-m",
                    proto,
                    "-p",
                    proto,
                    "-d",
                    "127.0.0.0/8",
                    "--dport",
                    &node_port,
                    "-m",
                    "nfacct",
                    "--nfacct-name",
                    NFACCT_LOCALHOST_NODEPORTS,
                    "-j",
                    external_chain,
                ]);
            }
            t.nat_rules.write(&[
                "-A",
                KUBE_NODEPORTS,
                "-m",
                "comment",
                "--comment",
                &name,
                "-m",
                proto,
                "-p",
                proto,
                "--dport",
                &node_port,
                "-j",
                external_chain,
            ]);
        }
        if let Some((target, comment)) = &external_filter {
            t.filter_rules.write(&[
                "-A",
                KUBE_EXTERNAL_SERVICES,
                "-m",
                "comment",
                "--comment",
                comment,
                "-m",
                "addrtype",
                "--dst-type",
                "LOCAL",
                "-m",
                proto,
                "-p",
                proto,
                "--dport",
                &node_port,
                "-j",
                target,
            ]);
        }
    }

    // Health check node port: open in the host firewall whatever the endpoints.
    if let Some(hc) = port.health_check_node_port {
        let hc = hc.to_string();
        let comment = format!("\"{name} health check node port\"");
        t.filter_rules.write(&[
            "-A",
            KUBE_NODEPORTS,
            "-m",
            "comment",
            "--comment",
            &comment,
            "-m",
            "tcp",
            "-p",
            "tcp",
            "--dport",
            &hc,
            "-j",
            "ACCEPT",
        ]);
    }

    // From here on only per-service chains: a partial sync leaves unchanged ones alone.
    let (nat_chains, nat_rules) = if skip_chains {
        (&mut t.skipped_nat_chains, &mut t.skipped_nat_rules)
    } else {
        (&mut t.nat_chains, &mut t.nat_rules)
    };

    if has_internal {
        let comment = format!("\"{name} cluster IP\"");
        let mut rule = vec![
            "-A",
            internal_chain.as_str(),
            "-m",
            "comment",
            "--comment",
            &comment,
            "-m",
            proto,
            "-p",
            proto,
            "-d",
            &cluster_ip,
            "--dport",
            &svc_port,
        ];
        if ctx.masquerade_all {
            rule.extend(["-j", KUBE_MARK_MASQ]);
            nat_rules.write(&rule);
        } else if ctx.local_detector.is_implemented() {
            // Off-cluster traffic to a ClusterIP (e.g. via a static route to any node) may be
            // forwarded to another node, so it is masqueraded.
            rule.extend(ctx.local_detector.if_not_local().iter().map(String::as_str));
            rule.extend(["-j", KUBE_MARK_MASQ]);
            nat_rules.write(&rule);
        }
    }

    if uses_external_chain {
        nat_chains.chain(external_chain);
        state.active_nat_chains.insert(external_chain.clone());
        if !port.external_policy_local {
            // Endpoints may be on other nodes: masquerade so replies come back through us.
            let comment = format!("\"masquerade traffic for {name} external destinations\"");
            nat_rules.write(&[
                "-A",
                external_chain,
                "-m",
                "comment",
                "--comment",
                &comment,
                "-j",
                KUBE_MARK_MASQ,
            ]);
        } else {
            if ctx.local_detector.is_implemented() {
                // Pod → external destination is subject to neither policy: as if it went out to
                // the load balancer and came back.
                let comment = format!("\"pod traffic for {name} external destinations\"");
                let mut rule = vec![
                    "-A",
                    external_chain.as_str(),
                    "-m",
                    "comment",
                    "--comment",
                    &comment,
                ];
                rule.extend(ctx.local_detector.if_local().iter().map(String::as_str));
                rule.extend(["-j", chains.cluster.as_str()]);
                nat_rules.write(&rule);
            }
            // From the node itself the source would be a local address (the VIP may be local),
            // so it is masqueraded and sent with Cluster policy.
            let comment = format!("\"masquerade LOCAL traffic for {name} external destinations\"");
            nat_rules.write(&[
                "-A",
                external_chain,
                "-m",
                "comment",
                "--comment",
                &comment,
                "-m",
                "addrtype",
                "--src-type",
                "LOCAL",
                "-j",
                KUBE_MARK_MASQ,
            ]);
            let comment = format!("\"route LOCAL traffic for {name} external destinations\"");
            nat_rules.write(&[
                "-A",
                external_chain,
                "-m",
                "comment",
                "--comment",
                &comment,
                "-m",
                "addrtype",
                "--src-type",
                "LOCAL",
                "-j",
                &chains.cluster,
            ]);
        }
        if has_external {
            nat_rules.write(&["-A", external_chain, "-j", external_policy_chain]);
        }
    }

    if uses_fw_chain {
        let fw = chains.firewall.as_str();
        nat_chains.chain(fw);
        state.active_nat_chains.insert(chains.firewall.clone());
        let comment = format!("\"{name} loadbalancer IP\"");
        let mut allow_from_node = false;
        for cidr in &port.source_ranges {
            let cidr_text = cidr.to_string();
            nat_rules.write(&[
                "-A",
                fw,
                "-m",
                "comment",
                "--comment",
                &comment,
                "-s",
                &cidr_text,
                "-j",
                external_chain,
            ]);
            allow_from_node |= ctx.node_ip.is_some_and(|ip| cidr.contains(&ip));
        }
        // A VIP bound locally makes node → VIP traffic arrive with the VIP as source.
        if allow_from_node {
            for ip in &port.load_balancer_ips {
                let ip = ip.to_string();
                nat_rules.write(&[
                    "-A",
                    fw,
                    "-m",
                    "comment",
                    "--comment",
                    &comment,
                    "-s",
                    &ip,
                    "-j",
                    external_chain,
                ]);
            }
        }
        // Falling off the end means no DNAT: filter KUBE-PROXY-FIREWALL then drops it.
        let comment = format!("\"other traffic to {name} will be dropped by KUBE-PROXY-FIREWALL\"");
        nat_rules.write(&["-A", fw, "-m", "comment", "--comment", &comment]);
    }

    if uses_cluster_chain {
        nat_chains.chain(&chains.cluster);
        state.active_nat_chains.insert(chains.cluster.clone());
        let jumps = EndpointJumps {
            name: &name,
            port,
            chain: &chains.cluster,
            large_cluster: state.large_cluster,
        };
        jumps.write(nat_rules, &cluster_endpoints);
    }
    if uses_local_chain {
        nat_chains.chain(&chains.local);
        state.active_nat_chains.insert(chains.local.clone());
        let jumps = EndpointJumps {
            name: &name,
            port,
            chain: &chains.local,
            large_cluster: state.large_cluster,
        };
        jumps.write(nat_rules, &local_endpoints);
    }

    for (endpoint, chain) in &reachable {
        nat_chains.chain(chain);
        let mut rule = vec!["-A", chain.as_str()];
        if !state.large_cluster {
            rule.extend(["-m", "comment", "--comment", &name]);
        }
        let addr = endpoint.addr.to_string();
        let base = rule.len();
        // Hairpin: a pod reaching itself through the service must be SNATed.
        rule.extend(["-s", &addr, "-j", KUBE_MARK_MASQ]);
        nat_rules.write(&rule);
        rule.truncate(base);
        if port.affinity_timeout.is_some() {
            rule.extend(["-m", "recent", "--name", chain, "--set"]);
        }
        let destination = endpoint.to_endpoint_string();
        rule.extend([
            "-m",
            proto,
            "-p",
            proto,
            "-j",
            "DNAT",
            "--to-destination",
            &destination,
        ]);
        nat_rules.write(&rule);
    }
}

/// kube-proxy's `writeServiceToEndpointRules` for one SVC/SVL chain.
struct EndpointJumps<'a> {
    name: &'a str,
    port: &'a ServicePort,
    chain: &'a str,
    large_cluster: bool,
}

impl EndpointJumps<'_> {
    /// Affinity checks first, then one probabilistic jump per endpoint, the last unconditional.
    fn write(&self, rules: &mut Lines, endpoints: &[(&Endpoint, &str)]) {
        let comment_of = |e: &Endpoint| format!("\"{} -> {}\"", self.name, e.to_endpoint_string());
        if let Some(timeout) = self.port.affinity_timeout {
            let timeout = timeout.to_string();
            for (endpoint, sep) in endpoints {
                let comment = comment_of(endpoint);
                let mut rule = vec!["-A", self.chain];
                if !self.large_cluster {
                    rule.extend(["-m", "comment", "--comment", &comment]);
                }
                rule.extend([
                    "-m",
                    "recent",
                    "--name",
                    sep,
                    "--rcheck",
                    "--seconds",
                    &timeout,
                    "--reap",
                    "-j",
                    sep,
                ]);
                rules.write(&rule);
            }
        }
        let n = endpoints.len();
        for (i, (endpoint, sep)) in endpoints.iter().enumerate() {
            let comment = comment_of(endpoint);
            let probability = probability(n - i);
            let mut rule = vec!["-A", self.chain];
            if !self.large_cluster {
                rule.extend(["-m", "comment", "--comment", &comment]);
            }
            if i + 1 < n {
                rule.extend([
                    "-m",
                    "statistic",
                    "--mode",
                    "random",
                    "--probability",
                    &probability,
                ]);
            }
            rule.extend(["-j", sep]);
            rules.write(&rule);
        }
    }
}

/// kube-proxy's `computeProbability`: Go's `%0.10f` of 1/n. Rust's `{:.10}` rounds the exact
/// binary value half-to-even like Go's strconv, so the digits match.
pub fn probability(n: usize) -> String {
    #[expect(
        clippy::cast_precision_loss,
        reason = "endpoint counts are far below 2^52"
    )]
    let value = 1.0 / n as f64;
    format!("{value:.10}")
}

#[cfg(test)]
mod tests;
