//! The ClusterIP scenario shared by the integration tests and the demo: a node with pods
//! running `pod<i>` echo servers, a decoy for untranslated traffic, a child cgroup for
//! clients, a manifests directory and (once started) the agent.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::agent::{Agent, AgentConfig, AgentSource};
use crate::cgroup::ChildCgroup;
use crate::client::{Attempt, Client};
use crate::manifests::{
    Endpoint, ManifestsDir, Protocol, ServicePort, SlicePort, endpoint_slice_yaml, service_yaml,
};
use crate::topology::Topology;
use crate::{Result, RigError};

pub const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
/// The IPv6 ClusterIP of dual-stack scenarios.
pub const CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x10);
pub const SERVICE_PORT: u16 = 80;
pub const BACKEND_PORT: u16 = 8080;
pub const PORT_NAME: &str = "http";
pub const HOSTNAME: &str = "kpr-node";
/// Bound for the agent to program (or reprogram) the datapath: an eBPF agent's start (the
/// verifier) takes several seconds on a loaded machine.
pub const DATAPATH_TIMEOUT: Duration = Duration::from_secs(20);

/// `CLUSTER_IP:SERVICE_PORT`.
pub fn cluster_addr() -> SocketAddr {
    SocketAddrV4::new(CLUSTER_IP, SERVICE_PORT).into()
}

/// `CLUSTER_IP6:SERVICE_PORT`.
pub fn cluster_addr6() -> SocketAddr {
    SocketAddr::new(CLUSTER_IP6.into(), SERVICE_PORT)
}

/// A ready endpoint for pod `i` on this node, of the given family.
pub fn pod_endpoint_family(i: usize, ipv6: bool) -> Endpoint {
    Endpoint {
        node_name: Some(HOSTNAME.into()),
        ..Endpoint::ready(Topology::pod_addr(i, ipv6))
    }
}

/// A ClusterIP Service with one TCP port `http` (80).
pub fn http_service(namespace: &str, name: &str, cluster_ip: Ipv4Addr) -> String {
    service_yaml(
        namespace,
        name,
        cluster_ip,
        &[ServicePort {
            name: PORT_NAME.into(),
            port: SERVICE_PORT,
            protocol: Protocol::Tcp,
        }],
    )
}

/// An EndpointSlice for `service` with port `http` (8080) and the given endpoints.
pub fn http_slice(namespace: &str, slice: &str, service: &str, endpoints: &[Endpoint]) -> String {
    endpoint_slice_yaml(
        namespace,
        slice,
        service,
        &[SlicePort {
            name: PORT_NAME.into(),
            port: BACKEND_PORT,
            protocol: Protocol::Tcp,
        }],
        endpoints,
    )
}

/// The slice ports of a Service with TCP `http` and UDP `dns`, both served on 8080.
pub fn http_and_dns_slice_ports() -> [SlicePort; 2] {
    [
        SlicePort {
            name: PORT_NAME.into(),
            port: BACKEND_PORT,
            protocol: Protocol::Tcp,
        },
        SlicePort {
            name: "dns".into(),
            port: BACKEND_PORT,
            protocol: Protocol::Udp,
        },
    ]
}

/// Whether an answer came from one of the pods (not the decoy, not an error).
pub fn is_pod(attempt: &Attempt) -> bool {
    attempt.backend().is_some_and(|b| b.starts_with("pod"))
}

/// A ready endpoint for pod `i` on this node.
pub fn pod_endpoint(i: usize) -> Endpoint {
    Endpoint {
        node_name: Some(HOSTNAME.into()),
        ..Endpoint::ready(Topology::pod_ip(i))
    }
}

/// Everything a ClusterIP test needs. Fields drop in order: agent, manifests, cgroup,
/// topology — the agent detaches before its cgroup and namespaces go away.
#[derive(Debug)]
pub struct Scenario {
    agent: Option<Agent>,
    /// Runs this instead of the agent binary (a wrapper with fewer capabilities, say).
    agent_binary: Option<PathBuf>,
    pub manifests: ManifestsDir,
    pub cgroup: ChildCgroup,
    pub topo: Topology,
}

impl Scenario {
    /// Builds `pods` pods with echo servers `pod<i>` on `10.244.<i>.2:8080` and the decoy
    /// `untranslated` on `CLUSTER_IP:80` in the node namespace. The agent is not started yet.
    pub fn new(pods: usize) -> Result<Self> {
        Self::with_families(pods, false)
    }

    /// Like [`Scenario::new`]; with `ipv6` the pods also serve on `[fd00:244:<i>::2]:8080`
    /// and a decoy answers on `[CLUSTER_IP6]:80`.
    pub fn with_families(pods: usize, ipv6: bool) -> Result<Self> {
        let mut topo = Topology::new(pods)?;
        topo.start_pod_echoes(BACKEND_PORT)?;
        topo.add_decoy(CLUSTER_IP, SERVICE_PORT)?;
        if ipv6 {
            topo.start_pod_echoes6(BACKEND_PORT)?;
            topo.add_decoy(IpAddr::from(CLUSTER_IP6), SERVICE_PORT)?;
        }
        Ok(Self {
            agent: None,
            agent_binary: None,
            manifests: ManifestsDir::new()?,
            cgroup: ChildCgroup::new()?,
            topo,
        })
    }

    /// Starts the agent in the node namespace on the scenario's manifests directory, attached
    /// to the scenario's cgroup.
    pub fn start_agent(&mut self) -> Result<&mut Agent> {
        self.start_agent_in_mode("ebpf")
    }

    /// Starts the agent in the node namespace with `--proxy-mode <mode>`. In `iptables` mode
    /// the rules live in the node namespace only (iptables state is per network namespace).
    pub fn start_agent_in_mode(&mut self, mode: &str) -> Result<&mut Agent> {
        let source = AgentSource::Manifests(self.manifests.path().to_path_buf());
        self.start_agent_with(source, mode)
    }

    /// Waits (at most a minute) until the running agent has synced once, as its metrics show
    /// (at the default metrics address): the bounds of later waits then count from the first
    /// sync, not from the spawn — loading the eBPF programs alone took 16 s on a loaded
    /// machine, the verifier checking each of them.
    pub fn wait_for_first_sync(&self) -> Result<()> {
        let agent = self
            .agent
            .as_ref()
            .ok_or_else(|| RigError::Other("no agent started".into()))?;
        crate::wait::try_wait_until(
            "the agent's first sync",
            Duration::from_secs(60),
            Duration::from_millis(100),
            || Ok(agent.syncs() >= 1),
        )
        .map_err(|e| self.agent_error(e.to_string()))
    }

    /// Like [`Scenario::wait_for_first_sync`], for the waits on the datapath: an agent that
    /// does not sync within the minute (one a test keeps from syncing, one that exited) is
    /// left to the caller's own bound.
    fn wait_for_first_sync_if_any(&mut self) {
        let Some(agent) = self.agent.as_mut() else {
            return;
        };
        let _ = crate::wait::try_wait_until(
            "the agent's first sync",
            Duration::from_secs(60),
            Duration::from_millis(100),
            || Ok(!agent.is_running() || agent.syncs() >= 1),
        );
    }

    /// Like [`Scenario::start_agent`], with the Kubernetes API source (`--kubeconfig FILE`).
    pub fn start_agent_with_kubeconfig(&mut self, kubeconfig: &Path) -> Result<&mut Agent> {
        self.start_agent_with(AgentSource::Kubeconfig(kubeconfig.to_path_buf()), "ebpf")
    }

    /// Like [`Scenario::start_agent_with_kubeconfig`] in `mode` with extra command-line
    /// arguments.
    pub fn start_agent_with_kubeconfig_args(
        &mut self,
        kubeconfig: &Path,
        mode: &str,
        args: &[&str],
    ) -> Result<&mut Agent> {
        let source = AgentSource::Kubeconfig(kubeconfig.to_path_buf());
        let extra = args.iter().map(|a| (*a).to_owned()).collect();
        self.start_agent_full(source, mode, extra)
    }

    /// Like [`Scenario::start_agent_in_mode`] with extra command-line arguments.
    pub fn start_agent_with_args(&mut self, mode: &str, args: &[&str]) -> Result<&mut Agent> {
        let source = AgentSource::Manifests(self.manifests.path().to_path_buf());
        let extra = args.iter().map(|a| (*a).to_owned()).collect();
        self.start_agent_full(source, mode, extra)
    }

    fn start_agent_with(&mut self, source: AgentSource, mode: &str) -> Result<&mut Agent> {
        self.start_agent_full(source, mode, Vec::new())
    }

    fn start_agent_full(
        &mut self,
        source: AgentSource,
        mode: &str,
        extra_args: Vec<String>,
    ) -> Result<&mut Agent> {
        let config = AgentConfig {
            source,
            proxy_mode: Some(mode.to_owned()),
            cgroup_path: self.cgroup.path().to_path_buf(),
            hostname: HOSTNAME.into(),
            netns: Some(self.topo.node().path()),
            extra_args,
            binary: self.agent_binary.clone(),
        };
        Ok(self.agent.insert(Agent::start(&config)?))
    }

    /// Stops the agent (if any) and forgets it, so another can be started on the same node.
    pub fn stop_agent(&mut self) -> Result<()> {
        match self.agent.take() {
            Some(mut agent) => agent.stop().map(drop),
            None => Ok(()),
        }
    }

    /// Writes `default/web` (ClusterIP [`CLUSTER_IP`]:80 → 8080) with pods `1..=pods` as its
    /// ready endpoints.
    pub fn write_web_service(&self, pods: usize) -> Result<()> {
        let endpoints: Vec<Endpoint> = (1..=pods).map(pod_endpoint).collect();
        self.write_web(&endpoints)
    }

    /// Writes `default/web` (ClusterIP [`CLUSTER_IP`]:80 → 8080) with the given endpoints.
    pub fn write_web(&self, endpoints: &[Endpoint]) -> Result<()> {
        self.manifests
            .write("web-svc.yaml", &http_service("default", "web", CLUSTER_IP))?;
        self.manifests.write(
            "web-slice.yaml",
            &http_slice("default", "web-1", "web", endpoints),
        )
    }

    /// Writes `default/web` as `spec` describes it (type, policies, extra YAML) with the given
    /// endpoints in the slice `web-1`.
    pub fn write_web_spec(&self, spec: &ServiceSpec, endpoints: &[Endpoint]) -> Result<()> {
        self.manifests
            .write("web-svc.yaml", &web_service_yaml(spec))?;
        self.manifests.write(
            "web-slice.yaml",
            &http_slice("default", "web-1", "web", endpoints),
        )
    }

    /// Starts the agent in `mode` with `args` and waits until the ClusterIP is answered by a
    /// pod; returns the client that mode translates: in eBPF mode a process in the cgroup (with
    /// the tc programs on the node's external link only — the rig's pod veths carry addresses
    /// auto-detection would also take), in iptables mode any process in the node namespace.
    pub fn start_serving(&mut self, mode: &str, args: &[&str]) -> Result<Client> {
        let mut all: Vec<&str> = args.to_vec();
        if mode == "ebpf" {
            all.extend(["--interfaces", "vext"]);
        }
        self.start_agent_with_args(mode, &all)?;
        let client = if mode == "ebpf" {
            self.cgroup_client()
        } else {
            self.outside_client()
        };
        self.wait_for_datapath_with(&client, cluster_addr(), "answered by a pod", is_pod)?;
        Ok(client)
    }

    /// Agents this scenario starts from now on run `binary` (per scenario, not through the
    /// process environment, which every test thread of the binary shares).
    pub fn use_agent_binary(&mut self, binary: impl Into<PathBuf>) {
        self.agent_binary = Some(binary.into());
    }

    /// The running agent, if any, for reading.
    pub fn agent_ref(&self) -> Option<&Agent> {
        self.agent.as_ref()
    }

    pub fn agent(&mut self) -> Result<&mut Agent> {
        self.agent
            .as_mut()
            .ok_or_else(|| RigError::Other("agent not started".into()))
    }

    /// `proxy-agent inspect <args>` (with `--json` among them) run in the node namespace on the
    /// running agent's pins, its output parsed.
    pub fn inspect_json(&mut self, args: &[&str]) -> Result<serde_json::Value> {
        let bpf_root = self.agent()?.bpf_root().to_path_buf();
        let output = std::process::Command::new("nsenter")
            .arg(format!("--net={}", self.topo.node().path().display()))
            .arg(crate::agent::agent_binary()?)
            .arg("--bpf-root")
            .arg(bpf_root)
            .arg("inspect")
            .args(args)
            .output()
            .map_err(|e| RigError::io("running proxy-agent inspect", e))?;
        if !output.status.success() {
            return Err(RigError::Other(format!(
                "inspect {args:?}: {}",
                String::from_utf8_lossy(&output.stderr)
            )));
        }
        serde_json::from_slice(&output.stdout)
            .map_err(|e| RigError::Other(format!("inspect {args:?}: not JSON: {e}")))
    }

    /// A client in the node namespace inside the agent's cgroup (subject to socket LB).
    pub fn cgroup_client(&self) -> Client {
        Client::new(self.topo.node().path()).in_cgroup(self.cgroup.path())
    }

    /// A client in the external client's namespace (traffic that enters the node from outside).
    pub fn external_client(&self) -> Client {
        Client::new(self.topo.ext().path())
    }

    /// A client in the node namespace outside the agent's cgroup.
    pub fn outside_client(&self) -> Client {
        Client::new(self.topo.node().path())
    }

    /// A client in pod `i`'s namespace inside the agent's cgroup (a pod process).
    pub fn pod_client(&self, i: usize) -> Result<Client> {
        Ok(Client::new(self.topo.pod(i)?.path()).in_cgroup(self.cgroup.path()))
    }

    /// Polls `target` with single attempts from the cgroup until one satisfies `ready`
    /// (bounded by [`DATAPATH_TIMEOUT`]); returns it. The error carries the agent log.
    pub fn wait_for_datapath(
        &mut self,
        target: SocketAddr,
        what: &str,
        ready: impl Fn(&Attempt) -> bool,
    ) -> Result<Attempt> {
        let client = self.cgroup_client();
        self.wait_for_datapath_with(&client, target, what, ready)
    }

    /// [`Scenario::wait_for_datapath`] bounded by `bound` instead of [`DATAPATH_TIMEOUT`]: for a
    /// change whose sync is large (thousands of Services), which a CI machine's other work can
    /// slow well past the bound of a small one.
    pub fn wait_for_datapath_within(
        &mut self,
        target: SocketAddr,
        what: &str,
        bound: Duration,
        ready: impl Fn(&Attempt) -> bool,
    ) -> Result<Attempt> {
        let client = self.cgroup_client();
        self.wait_for_datapath_bounded(&client, target, what, bound, ready)
    }

    /// [`Scenario::wait_for_datapath`] with a given client (protocol, mode, namespace).
    pub fn wait_for_datapath_with(
        &mut self,
        client: &Client,
        target: SocketAddr,
        what: &str,
        ready: impl Fn(&Attempt) -> bool,
    ) -> Result<Attempt> {
        self.wait_for_datapath_bounded(client, target, what, DATAPATH_TIMEOUT, ready)
    }

    fn wait_for_datapath_bounded(
        &mut self,
        client: &Client,
        target: SocketAddr,
        what: &str,
        bound: Duration,
        ready: impl Fn(&Attempt) -> bool,
    ) -> Result<Attempt> {
        self.wait_for_first_sync_if_any();
        let start = Instant::now();
        let mut last = None;
        while start.elapsed() < bound {
            let attempt = client.once(target)?;
            if ready(&attempt) {
                return Ok(attempt);
            }
            last = Some(attempt);
            if !self.agent()?.is_running() {
                // No point waiting for a dead agent.
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        let message = match self.agent()?.exit_status() {
            Some(status) => format!(
                "agent exited ({status}) before the datapath for {target} was ready ({what}); \
                 last attempt: {last:?}"
            ),
            None => format!(
                "datapath for {target} not ready ({what}) within {bound:?}; \
                 last attempt: {last:?}"
            ),
        };
        Err(self.agent_error(message))
    }

    /// Like [`Scenario::wait_for_datapath_with`], for a change one answer cannot prove (the
    /// old state may give the same answer by chance): polls batches of `batch` attempts until
    /// every attempt of one satisfies `ready` (bounded by [`DATAPATH_TIMEOUT`]); returns it.
    pub fn wait_for_batch(
        &self,
        client: &Client,
        target: SocketAddr,
        batch: u32,
        what: &str,
        ready: impl Fn(&Attempt) -> bool,
    ) -> Result<Vec<Attempt>> {
        let start = Instant::now();
        loop {
            let attempts = client.run(target, batch)?;
            if attempts.iter().all(&ready) {
                return Ok(attempts);
            }
            if start.elapsed() > DATAPATH_TIMEOUT {
                let tally = crate::client::tally(&attempts);
                return Err(self.agent_error(format!(
                    "{what} not applied within {DATAPATH_TIMEOUT:?}; last batch: {tally:?}"
                )));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Waits (bounded by [`DATAPATH_TIMEOUT`]) until the pods' echo servers hold at least `n`
    /// TCP connections, each established across two looks 100 ms apart: stream clients'
    /// connections, made under the rules in place now, and not a passing single attempt's.
    pub fn wait_for_tcp_streams(&self, n: usize) -> Result<()> {
        let filter = format!("( sport = :{BACKEND_PORT} )");
        crate::wait::wait_for_held(
            "TCP streams established to the pods",
            n,
            DATAPATH_TIMEOUT,
            Duration::from_millis(100),
            || {
                let mut held = std::collections::BTreeSet::new();
                for i in 1..=self.topo.pod_count() {
                    for socket in self.topo.pod(i)?.established(false, &filter)? {
                        held.insert(format!("pod{i} {socket}"));
                    }
                }
                Ok(held)
            },
        )
        .map_err(|e| self.agent_error(e.to_string()))
    }

    /// Waits (bounded by [`DATAPATH_TIMEOUT`]) until the clients in `places` hold at least
    /// `n` connected UDP sockets, each connected across two looks 100 ms apart: a flow's
    /// client sends its first datagram right after connecting, so each such flow has
    /// started under the rules in place now.
    pub fn wait_for_udp_flows(&self, places: &[crate::topology::Place], n: usize) -> Result<()> {
        crate::wait::wait_for_held(
            "UDP flows started",
            n,
            DATAPATH_TIMEOUT,
            Duration::from_millis(100),
            || {
                let mut held = std::collections::BTreeSet::new();
                for place in places {
                    for socket in self.topo.netns(*place)?.established(true, "")? {
                        held.insert(format!("{place:?} {socket}"));
                    }
                }
                Ok(held)
            },
        )
        .map_err(|e| self.agent_error(e.to_string()))
    }

    /// An error carrying the agent log tail (or just the message without an agent).
    pub fn agent_error(&self, message: String) -> RigError {
        match &self.agent {
            Some(agent) => agent.error(message),
            None => RigError::Other(message),
        }
    }

    /// Fails with the agent log tail attached unless `cond` holds.
    pub fn ensure(&self, cond: bool, message: impl FnOnce() -> String) -> Result<()> {
        if cond {
            Ok(())
        } else {
            Err(self.agent_error(message()))
        }
    }
}

/// The NodePort of `default/web` when [`ServiceSpec::type_`] asks for one.
pub const NODE_PORT: u16 = 30080;

/// Options of the Service under test.
#[derive(Debug, Clone, Default)]
pub struct ServiceSpec {
    pub type_: &'static str,
    pub external_traffic_policy_local: bool,
    pub internal_traffic_policy_local: bool,
    pub affinity_timeout: Option<u32>,
    pub external_ips: Vec<Ipv4Addr>,
    pub load_balancer_ip: Option<Ipv4Addr>,
    pub source_ranges: Vec<&'static str>,
}

/// `default/web` as a LoadBalancer with `externalTrafficPolicy: Local` and health check node
/// port `port` (only that kind of Service has one).
pub fn health_checked_web_service_yaml(port: u16) -> String {
    let spec = ServiceSpec {
        type_: "LoadBalancer",
        external_traffic_policy_local: true,
        ..ServiceSpec::default()
    };
    web_service_yaml(&spec).replace(
        "  externalTrafficPolicy: Local\n",
        &format!("  externalTrafficPolicy: Local\n  healthCheckNodePort: {port}\n"),
    )
}

/// The Service `default/web` with one TCP port 80 → 8080 (`http`) and NodePort 30080.
pub fn web_service_yaml(spec: &ServiceSpec) -> String {
    let mut yaml = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: default}}\nspec:\n  \
         type: {}\n  clusterIP: {CLUSTER_IP}\n  ports:\n  - {{name: {PORT_NAME}, port: {SERVICE_PORT}, \
         targetPort: {BACKEND_PORT}, protocol: TCP{}}}\n",
        if spec.type_.is_empty() {
            "ClusterIP"
        } else {
            spec.type_
        },
        if spec.type_ == "NodePort" || spec.type_ == "LoadBalancer" {
            format!(", nodePort: {NODE_PORT}")
        } else {
            String::new()
        }
    );
    if spec.external_traffic_policy_local {
        yaml.push_str("  externalTrafficPolicy: Local\n");
    }
    if spec.internal_traffic_policy_local {
        yaml.push_str("  internalTrafficPolicy: Local\n");
    }
    if let Some(timeout) = spec.affinity_timeout {
        yaml.push_str(&format!(
            "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {{clientIP: {{timeoutSeconds: {timeout}}}}}\n"
        ));
    }
    if !spec.external_ips.is_empty() {
        let ips: Vec<String> = spec.external_ips.iter().map(ToString::to_string).collect();
        yaml.push_str(&format!("  externalIPs: [{}]\n", ips.join(", ")));
    }
    if !spec.source_ranges.is_empty() {
        yaml.push_str(&format!(
            "  loadBalancerSourceRanges: [{}]\n",
            spec.source_ranges.join(", ")
        ));
    }
    if let Some(ip) = spec.load_balancer_ip {
        yaml.push_str(&format!(
            "status:\n  loadBalancer:\n    ingress: [{{ip: {ip}}}]\n"
        ));
    }
    yaml
}
