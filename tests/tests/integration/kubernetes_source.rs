//! The agent's Kubernetes API source end to end: the real agent (`--kubeconfig`) watches the
//! rig's API test server, and connections from the agent's cgroup show what it programmed. A
//! decoy answers on each ClusterIP, so untranslated traffic shows up as `untranslated`. Needs
//! root.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use proxy_tests::apiserver::{ApiServer, Break, Resource};
use proxy_tests::client::{Attempt, Client, tally};
use proxy_tests::manifests::Endpoint;
use proxy_tests::scenario::{
    CLUSTER_IP, HOSTNAME, SERVICE_PORT, Scenario, cluster_addr, http_service, http_slice, is_pod,
    pod_endpoint,
};
use proxy_tests::topology::DECOY_NAME;

const NAMESPACE: &str = "default";
const SERVICE: &str = "web";
const SLICE: &str = "web-1";
const CONNECTIONS: u32 = 40;
/// How long a watch break or an outage may take to converge (the watcher's backoff starts at
/// 0.8 s and doubles).
const CONVERGE_TIMEOUT: Duration = Duration::from_secs(30);

fn service(name: &str, ip: Ipv4Addr) -> anyhow::Result<Service> {
    Ok(serde_yaml::from_str(&http_service(NAMESPACE, name, ip))?)
}

fn slice(name: &str, service: &str, pods: &[usize]) -> anyhow::Result<EndpointSlice> {
    let endpoints: Vec<Endpoint> = pods.iter().map(|&i| pod_endpoint(i)).collect();
    Ok(serde_yaml::from_str(&http_slice(
        NAMESPACE, name, service, &endpoints,
    ))?)
}

fn node() -> anyhow::Result<Node> {
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": HOSTNAME},
    }))?)
}

fn pods(names: &[usize]) -> BTreeSet<String> {
    names.iter().map(|i| format!("pod{i}")).collect()
}

/// A scenario with `pods` pods and an API server in the node namespace holding this node,
/// `web` and its slice over `web_pods`. The agent is not started yet.
fn setup(pods: usize, web_pods: &[usize]) -> anyhow::Result<(Scenario, ApiServer)> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let s = Scenario::new(pods)?;
    let api = ApiServer::start(Some(&s.topo.node().path()))?;
    api.apply(&node()?)?;
    api.apply(&service(SERVICE, CLUSTER_IP)?)?;
    api.apply(&slice(SLICE, SERVICE, web_pods)?)?;
    Ok((s, api))
}

fn start_and_wait_for_pods(s: &mut Scenario, api: &ApiServer) -> anyhow::Result<()> {
    let started = Instant::now();
    s.start_agent_with_kubeconfig(api.kubeconfig())?;
    let first = s.wait_for_datapath(cluster_addr(), "answered by a pod", is_pod)?;
    eprintln!(
        "datapath ready {:?} after the agent started, first answer: {first:?}",
        started.elapsed()
    );
    Ok(())
}

/// Prints the agent's source log lines (lists, relists, watch failures and reconnects).
fn print_source_log(s: &mut Scenario) -> anyhow::Result<()> {
    for line in s.agent()?.log_contents().lines() {
        if ["listing", "listed", "relisting", "watch "]
            .iter()
            .any(|w| line.contains(w))
        {
            eprintln!("  agent: {line}");
        }
    }
    Ok(())
}

/// `CONNECTIONS` attempts from the cgroup; prints the tally and returns the set of answers.
fn answers(s: &Scenario, target: SocketAddr, label: &str) -> anyhow::Result<BTreeSet<String>> {
    let attempts = s.cgroup_client().run(target, CONNECTIONS)?;
    let counts = tally(&attempts);
    eprintln!("{label}: answers: {counts:?}");
    Ok(counts.into_keys().collect())
}

/// Each probe's start time and outcome.
type ProbeLog = Vec<(Instant, Attempt)>;

/// Connections made one after another from the cgroup in a background thread, with the time
/// each was made, until stopped.
struct Prober {
    stop: Arc<AtomicBool>,
    /// Probes answered or failed so far.
    made: Arc<AtomicUsize>,
    thread: Option<JoinHandle<anyhow::Result<ProbeLog>>>,
}

impl Prober {
    fn start(client: Client, target: SocketAddr) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let made = Arc::new(AtomicUsize::new(0));
        let (flag, count) = (stop.clone(), made.clone());
        let thread = std::thread::spawn(move || {
            let mut seen = Vec::new();
            while !flag.load(Ordering::Relaxed) {
                let at = Instant::now();
                seen.push((at, client.once(target)?));
                count.fetch_add(1, Ordering::Relaxed);
            }
            Ok(seen)
        });
        Self {
            stop,
            made,
            thread: Some(thread),
        }
    }

    /// Waits (bounded) until `more` probes beyond those made so far are done.
    fn wait_for_more(&self, more: usize) -> anyhow::Result<()> {
        let target = self.made.load(Ordering::Relaxed) + more;
        proxy_tests::wait::wait_until(
            "probes made",
            Duration::from_secs(10),
            Duration::from_millis(20),
            || {
                self.made.load(Ordering::Relaxed) >= target
                    || self.thread.as_ref().is_none_or(JoinHandle::is_finished)
            },
        )?;
        Ok(())
    }

    fn finish(mut self) -> anyhow::Result<ProbeLog> {
        self.stop.store(true, Ordering::Relaxed);
        let thread = self
            .thread
            .take()
            .ok_or_else(|| anyhow::anyhow!("finished twice"))?;
        thread
            .join()
            .map_err(|_| anyhow::anyhow!("the prober thread panicked"))?
    }
}

impl Drop for Prober {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Checks a probe log across a change from `old` to `new` endpoints: every answer comes from
/// `old ∪ new` (never the decoy, never refused: the datapath is never emptied while the agent
/// catches up), and once an endpoint only in `new` has answered, every later answer is in
/// `new`. Returns the time from `changed_at` to the first new-only answer.
fn check_transition(
    s: &Scenario,
    log: &[(Instant, Attempt)],
    old: &BTreeSet<String>,
    new: &BTreeSet<String>,
    changed_at: Instant,
) -> anyhow::Result<Duration> {
    let allowed: BTreeSet<&String> = old.union(new).collect();
    let mut switched_at = None;
    for (at, attempt) in log {
        let Some(backend) = attempt.backend() else {
            return Err(s
                .agent_error(format!("attempt failed during the change: {attempt:?}"))
                .into());
        };
        s.ensure(allowed.contains(&backend.to_owned()), || {
            format!("answer from {backend}, outside old {old:?} ∪ new {new:?}")
        })?;
        if switched_at.is_some() {
            s.ensure(new.contains(backend), || {
                format!("answer from {backend} after the new endpoints {new:?} were in use")
            })?;
        } else if new.contains(backend) && !old.contains(backend) {
            switched_at = Some(*at);
        }
    }
    let Some(switched_at) = switched_at else {
        return Err(s
            .agent_error(format!(
                "no answer from the new endpoints {new:?} in {} attempts",
                log.len()
            ))
            .into());
    };
    Ok(switched_at.saturating_duration_since(changed_at))
}

/// Probes until an endpoint only in `new` answered (bounded), then a little more.
fn probe_until_switched(
    s: &Scenario,
    old: &BTreeSet<String>,
    new: &BTreeSet<String>,
    change: impl FnOnce() -> anyhow::Result<()>,
) -> anyhow::Result<(ProbeLog, Instant)> {
    let prober = Prober::start(s.cgroup_client(), cluster_addr());
    // Probes of the old state before the change.
    prober.wait_for_more(3)?;
    let changed_at = Instant::now();
    change()?;
    let client = s.cgroup_client();
    let new_only: BTreeSet<&String> = new.difference(old).collect();
    while changed_at.elapsed() < CONVERGE_TIMEOUT {
        if client
            .once(cluster_addr())?
            .backend()
            .is_some_and(|b| new_only.contains(&b.to_owned()))
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // Probes after the switch, each of which must stay on the new endpoints.
    prober.wait_for_more(5)?;
    Ok((prober.finish()?, changed_at))
}

#[test]
fn api_objects_reach_pods_and_follow_updates_and_deletes() -> anyhow::Result<()> {
    let (mut s, api) = setup(3, &[1, 2, 3])?;
    start_and_wait_for_pods(&mut s, &api)?;
    let before = answers(&s, cluster_addr(), "slice pod1..pod3")?;
    s.ensure(before == pods(&[1, 2, 3]), || {
        format!("expected exactly pod1..pod3: {before:?}")
    })?;

    api.apply(&slice(SLICE, SERVICE, &[1, 3])?)?;
    let batch = s.wait_for_batch(
        &s.cgroup_client(),
        cluster_addr(),
        CONNECTIONS,
        "pod2 removed from the slice",
        |a| matches!(a.backend(), Some("pod1" | "pod3")),
    )?;
    let after: BTreeSet<String> = tally(&batch).into_keys().collect();
    eprintln!("after removing pod2 from the slice: answers: {after:?}");
    s.ensure(after == pods(&[1, 3]), || {
        format!("expected exactly pod1 and pod3 after removing pod2: {after:?}")
    })?;

    let deleted_at = Instant::now();
    api.delete::<Service>(NAMESPACE, SERVICE)
        .ok_or_else(|| anyhow::anyhow!("web was not on the server"))?;
    s.wait_for_datapath(cluster_addr(), "untranslated after the delete", |a| {
        a.backend() == Some(DECOY_NAME)
    })?;
    eprintln!(
        "untranslated {:?} after deleting the Service",
        deleted_at.elapsed()
    );
    let gone = answers(&s, cluster_addr(), "after deleting the Service")?;
    s.ensure(gone == BTreeSet::from([DECOY_NAME.to_owned()]), || {
        format!("a deleted Service must not be translated: {gone:?}")
    })?;
    // kube-proxy's default `clientConnection.contentType`: every list and watch was asked
    // for, and answered in, protobuf, so the objects and events above came that way.
    expect_content_types(&s, &api, PROTOBUF, &format!("{PROTOBUF};stream=watch"))?;
    Ok(())
}

const PROTOBUF: &str = "application/vnd.kubernetes.protobuf";

/// Every LIST of every kind was answered with `list` and every WATCH with `watch`, and there
/// was at least one of each.
fn expect_content_types(
    s: &Scenario,
    api: &ApiServer,
    list: &str,
    watch: &str,
) -> anyhow::Result<()> {
    for resource in Resource::ALL {
        let lists = api.list_content_types(resource);
        let watches = api.watch_content_types(resource);
        eprintln!("{resource:?}: lists answered as {lists:?}, watches as {watches:?}");
        s.ensure(!lists.is_empty() && lists.iter().all(|t| t == list), || {
            format!("{resource:?}: every list should be {list}: {lists:?}")
        })?;
        s.ensure(
            !watches.is_empty() && watches.iter().all(|t| t == watch),
            || format!("{resource:?}: every watch should be {watch}: {watches:?}"),
        )?;
    }
    Ok(())
}

/// `--kube-api-content-type application/json` (kube-proxy's flag): the agent asks for JSON,
/// and its lists and watches work as with protobuf.
#[test]
fn json_content_type_is_asked_for_and_followed() -> anyhow::Result<()> {
    let (mut s, api) = setup(3, &[1, 2])?;
    let started = Instant::now();
    s.start_agent_with_kubeconfig_args(
        api.kubeconfig(),
        "ebpf",
        &["--kube-api-content-type", "application/json"],
    )?;
    s.wait_for_datapath(cluster_addr(), "answered by a pod", is_pod)?;
    eprintln!(
        "datapath ready {:?} after the agent started",
        started.elapsed()
    );
    let before = answers(&s, cluster_addr(), "slice pod1, pod2")?;
    s.ensure(before == pods(&[1, 2]), || {
        format!("expected exactly pod1 and pod2: {before:?}")
    })?;
    // A watch event: pod3 replaces pod1.
    api.apply(&slice(SLICE, SERVICE, &[2, 3])?)?;
    let batch = s.wait_for_batch(
        &s.cgroup_client(),
        cluster_addr(),
        CONNECTIONS,
        "pod3 replaced pod1",
        |a| matches!(a.backend(), Some("pod2" | "pod3")),
    )?;
    let after: BTreeSet<String> = tally(&batch).into_keys().collect();
    s.ensure(after == pods(&[2, 3]), || {
        format!("expected exactly pod2 and pod3: {after:?}")
    })?;
    expect_content_types(&s, &api, "application/json", "application/json")?;
    Ok(())
}

#[test]
fn nothing_is_programmed_until_every_kind_was_listed() -> anyhow::Result<()> {
    let (mut s, api) = setup(2, &[1, 2])?;
    api.hold_lists(Resource::Nodes);
    s.start_agent_with_kubeconfig(api.kubeconfig())?;
    // Services and EndpointSlices are listed; the Node list hangs.
    proxy_tests::wait::wait_until(
        "Services and EndpointSlices listed",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || {
            api.lists_served(Resource::Services) > 0
                && api.lists_served(Resource::EndpointSlices) > 0
        },
    )?;
    // The lists are read while the dataplane loads its programs: the agent serves its metrics
    // once that is done, and would sync right after if it did not wait for the Node.
    proxy_tests::wait::wait_until(
        "the agent's metrics served",
        Duration::from_secs(30),
        Duration::from_millis(100),
        || s.agent().and_then(|agent| agent.metrics()).is_ok(),
    )?;
    // Time, not state: nothing may be translated while the Node list is held, which only a
    // wait can show.
    std::thread::sleep(Duration::from_secs(1));
    let held = answers(&s, cluster_addr(), "Node list held back")?;
    s.ensure(held == BTreeSet::from([DECOY_NAME.to_owned()]), || {
        format!("nothing may be translated before the Node was listed: {held:?}")
    })?;
    let syncs = proxy_tests::http::metric_sum(
        &s.agent()?.metrics()?,
        "kubeproxy_sync_proxy_rules_duration_seconds_count",
        &[],
    );
    s.ensure(syncs == 0.0, || {
        format!("the agent synced {syncs} times before the Node was listed")
    })?;

    let released_at = Instant::now();
    api.release_lists(Resource::Nodes);
    s.wait_for_datapath(cluster_addr(), "answered by a pod", is_pod)?;
    eprintln!(
        "pods answer {:?} after the Node list was released",
        released_at.elapsed()
    );
    let after = answers(&s, cluster_addr(), "Node listed")?;
    s.ensure(after == pods(&[1, 2]), || {
        format!("expected pod1 and pod2: {after:?}")
    })?;
    Ok(())
}

#[test]
fn expired_watch_relists_and_converges_without_foreign_endpoints() -> anyhow::Result<()> {
    let (mut s, api) = setup(3, &[1, 2])?;
    let extra_ip = Ipv4Addr::new(10, 96, 0, 11);
    let extra: SocketAddr = SocketAddrV4::new(extra_ip, SERVICE_PORT).into();
    s.topo.add_decoy(extra_ip, SERVICE_PORT)?;
    start_and_wait_for_pods(&mut s, &api)?;
    let lists_before = api.lists_served(Resource::EndpointSlices);

    // In the same step as the 410: web moves to pod3, and a new Service appears. No watch
    // delivers these; only a relist shows them.
    let (old, new) = (pods(&[1, 2]), pods(&[3]));
    let (log, changed_at) = probe_until_switched(&s, &old, &new, || {
        api.break_watches(Break::Expire, |b| -> anyhow::Result<()> {
            b.apply(&slice(SLICE, SERVICE, &[3])?)?;
            b.apply(&service("extra", extra_ip)?)?;
            b.apply(&slice("extra-1", "extra", &[1])?)?;
            Ok(())
        })
    })?;
    let switched = check_transition(&s, &log, &old, &new, changed_at)?;
    eprintln!(
        "410 Expired: {} probes, all from old ∪ new; pod3 answered {switched:?} after the break",
        log.len()
    );
    s.ensure(
        api.lists_served(Resource::EndpointSlices) > lists_before,
        || "the agent did not relist EndpointSlices after the 410".into(),
    )?;
    // The first list and the relist after the 410 are served from the watch cache, as
    // client-go informers ask (resourceVersion=0), not as quorum reads from etcd.
    for resource in [
        Resource::Services,
        Resource::EndpointSlices,
        Resource::Nodes,
    ] {
        let queries = api.list_queries(resource);
        s.ensure(
            !queries.is_empty()
                && queries
                    .iter()
                    .all(|q| q == "resourceVersion=0&resourceVersionMatch=NotOlderThan"),
            || format!("{resource:?} lists must ask for resourceVersion=0: {queries:?}"),
        )?;
    }
    let slice_lists = api.list_queries(Resource::EndpointSlices).len();
    s.ensure(slice_lists >= 2, || {
        format!("EndpointSlices: the initial list and the relist, got {slice_lists} list(s)")
    })?;
    print_source_log(&mut s)?;
    // Each kind's watch reconnects after its own backoff (kube-runtime's, jittered): the
    // Services' may come back a moment after the EndpointSlices'.
    let client = s.cgroup_client();
    let converged = proxy_tests::wait::try_wait_until(
        "the Service created during the break translated",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || {
            Ok(client
                .once(extra)?
                .backend()
                .is_some_and(|b| b.starts_with("pod")))
        },
    );
    converged.map_err(|e| s.agent_error(e.to_string()))?;
    let extra_answers = answers(&s, extra, "the Service created during the break")?;
    s.ensure(extra_answers == pods(&[1]), || {
        format!("the Service created during the break must reach pod1: {extra_answers:?}")
    })?;

    // The watch works again after the relist.
    api.apply(&slice(SLICE, SERVICE, &[2, 3])?)?;
    s.wait_for_datapath(cluster_addr(), "pod2 back via the resumed watch", |a| {
        a.backend() == Some("pod2")
    })?;
    Ok(())
}

#[test]
fn dropped_watch_resumes_and_catches_up() -> anyhow::Result<()> {
    let (mut s, api) = setup(3, &[1, 2])?;
    start_and_wait_for_pods(&mut s, &api)?;
    let lists_before = api.lists_served(Resource::EndpointSlices);
    let (old, new) = (pods(&[1, 2]), pods(&[2, 3]));
    let (log, changed_at) = probe_until_switched(&s, &old, &new, || {
        let slice = slice(SLICE, SERVICE, &[2, 3])?;
        api.break_watches(Break::Disconnect, |b| b.apply(&slice))?;
        Ok(())
    })?;
    let switched = check_transition(&s, &log, &old, &new, changed_at)?;
    eprintln!(
        "disconnect: {} probes, all from old ∪ new; pod3 answered {switched:?} after the break",
        log.len()
    );
    s.ensure(
        api.lists_served(Resource::EndpointSlices) == lists_before,
        || "a dropped watch with its history intact must resume, not relist".into(),
    )?;
    let after = answers(&s, cluster_addr(), "after the disconnect")?;
    s.ensure(after == new, || {
        format!("expected exactly {new:?}: {after:?}")
    })?;
    Ok(())
}

#[test]
fn api_server_outage_keeps_the_datapath_and_catches_up() -> anyhow::Result<()> {
    let (mut s, mut api) = setup(3, &[1, 2])?;
    start_and_wait_for_pods(&mut s, &api)?;

    api.stop();
    let stopped_at = Instant::now();
    // Made while the server is down: the agent can only learn it after the restart.
    api.apply(&slice(SLICE, SERVICE, &[3])?)?;
    let mut during = Vec::new();
    while stopped_at.elapsed() < Duration::from_secs(3) {
        during.extend(s.cgroup_client().run(cluster_addr(), CONNECTIONS)?);
    }
    let counts = tally(&during);
    eprintln!("API server down for 3 s: answers: {counts:?}");
    s.ensure(counts.keys().eq(["pod1", "pod2"].iter()), || {
        format!("during the outage the last state (pod1, pod2) must keep serving: {counts:?}")
    })?;

    let (old, new) = (pods(&[1, 2]), pods(&[3]));
    let (log, restarted_at) = probe_until_switched(&s, &old, &new, || Ok(api.restart()?))?;
    let caught_up = check_transition(&s, &log, &old, &new, restarted_at)?;
    eprintln!(
        "outage of {:?}: {} probes after the restart, all from old ∪ new; pod3 answered \
         {caught_up:?} after the restart",
        restarted_at.duration_since(stopped_at),
        log.len()
    );
    print_source_log(&mut s)?;
    let after = answers(&s, cluster_addr(), "after the restart")?;
    s.ensure(after == new, || {
        format!("expected exactly {new:?}: {after:?}")
    })?;
    Ok(())
}

/// Like kube-proxy, the agent posts a `Starting` event (events.k8s.io/v1) about its Node.
#[test]
fn starting_event_is_posted_for_the_node() -> anyhow::Result<()> {
    let (mut s, api) = setup(1, &[1])?;
    start_and_wait_for_pods(&mut s, &api)?;
    let mut events = Vec::new();
    proxy_tests::wait::try_wait_until(
        "a Starting event",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || {
            events = api.events();
            Ok(!events.is_empty())
        },
    )?;
    eprintln!("events posted: {events:#?}");
    let event = &events[0];
    assert_eq!(event["reason"], "Starting");
    assert_eq!(event["type"], "Normal");
    assert_eq!(event["reportingController"], "kube-proxy");
    assert_eq!(event["regarding"]["kind"], "Node");
    assert_eq!(event["regarding"]["name"], proxy_tests::scenario::HOSTNAME);
    Ok(())
}

/// A load balancer's status naming `0.0.0.0` (a buggy controller, or anyone allowed to write
/// `services/status`): the address is not programmed, the Service's own traffic still flows,
/// and its owner sees why in a Warning Event on the Service (`kubectl describe service`).
#[test]
fn an_unusable_load_balancer_ip_is_reported_on_the_service() -> anyhow::Result<()> {
    let (mut s, api) = setup(1, &[1])?;
    let mut web = service(SERVICE, CLUSTER_IP)?;
    let spec = web.spec.get_or_insert_with(Default::default);
    spec.type_ = Some("LoadBalancer".to_owned());
    web.status = Some(serde_json::from_value(serde_json::json!({
        "loadBalancer": {"ingress": [{"ip": "0.0.0.0"}]}
    }))?);
    api.apply(&web)?;
    start_and_wait_for_pods(&mut s, &api)?;
    let mut warning = None;
    proxy_tests::wait::try_wait_until(
        "a Warning event on the Service",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || {
            warning = api
                .events()
                .into_iter()
                .find(|event| event["reason"] == "IgnoredAddress");
            Ok(warning.is_some())
        },
    )?;
    let event = warning.ok_or_else(|| anyhow::anyhow!("no IgnoredAddress event"))?;
    eprintln!("{event:#}");
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["regarding"]["kind"], "Service");
    assert_eq!(event["regarding"]["namespace"], NAMESPACE);
    assert_eq!(event["regarding"]["name"], SERVICE);
    // The UID the API server gave the Service (the Node's is its name).
    let uid = event["regarding"]["uid"].as_str().unwrap_or_default();
    assert!(
        !uid.is_empty() && uid != HOSTNAME,
        "the Service's UID: {uid:?}"
    );
    let note = event["note"].as_str().unwrap_or_default();
    assert!(
        note.contains("status.loadBalancer.ingress[].ip") && note.contains("0.0.0.0"),
        "the note names the field and the address: {note}"
    );
    let metrics = s.agent()?.metrics()?;
    assert!(
        metrics
            .lines()
            .any(|l| l == "kubeproxy_rs_ignored_addresses{reason=\"unspecified\"} 1"),
        "{metrics}"
    );
    Ok(())
}

/// client-go's `rest_client_*` families, which kube-proxy's dashboards query: once the agent
/// has listed and watched every kind, `/metrics` counts each list among the GETs the API
/// server answered 200 (labelled with its host:port, as client-go labels the server URL's
/// host) and shows the lists' latency.
#[test]
fn rest_client_metrics_count_the_api_requests() -> anyhow::Result<()> {
    let (mut s, api) = setup(1, &[1])?;
    start_and_wait_for_pods(&mut s, &api)?;
    // A kind's watch starts after its list was read to the end.
    proxy_tests::wait::wait_until(
        "every kind watched",
        Duration::from_secs(10),
        Duration::from_millis(100),
        || {
            Resource::ALL
                .iter()
                .all(|&resource| api.watches_started(resource) > 0)
        },
    )?;
    let lists: u64 = Resource::ALL
        .iter()
        .map(|&resource| api.lists_served(resource))
        .sum();
    let metrics = s.agent()?.metrics()?;
    let host = format!("host=\"127.0.0.1:{}\"", api.port());
    let answered = proxy_tests::http::metric_sum(
        &metrics,
        "rest_client_requests_total",
        &["code=\"200\"", &host, "method=\"GET\""],
    );
    let timed = proxy_tests::http::metric_sum(
        &metrics,
        "rest_client_request_duration_seconds_count",
        &[&host, "verb=\"GET\""],
    );
    eprintln!("lists served: {lists}; 200 GETs counted: {answered}; GETs timed: {timed}");
    s.ensure(lists >= 3 && answered >= lists as f64, || {
        format!("{lists} lists served, {answered} GETs answered 200 counted:\n{metrics}")
    })?;
    // One list per kind at least was read to its end before the kind's watch started.
    s.ensure(timed >= 3.0, || {
        format!("{timed} GET latencies observed:\n{metrics}")
    })?;
    for line in [
        "# HELP rest_client_requests_total [ALPHA] Number of HTTP requests, partitioned by status code, method, and host.",
        "# TYPE rest_client_request_duration_seconds histogram",
    ] {
        s.ensure(metrics.lines().any(|l| l == line), || {
            format!("no {line:?} in:\n{metrics}")
        })?;
    }
    Ok(())
}

/// With the manifests source the agent makes no API request, and client-go's families without
/// series are not shown.
#[test]
fn rest_client_metrics_are_not_shown_with_the_manifests_source() -> anyhow::Result<()> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(1)?;
    s.start_agent()?;
    s.wait_for_first_sync()?;
    let metrics = s.agent()?.metrics()?;
    s.ensure(
        metrics.contains("kubeproxy_sync_proxy_rules_duration_seconds")
            && !metrics.contains("rest_client_"),
        || format!("rest_client_* with the manifests source:\n{metrics}"),
    )?;
    Ok(())
}
