//! Reliability and security of the real agent: SIGKILL + restart under load in iptables mode,
//! map capacity with tiny maps, pin permissions, and what `--cleanup` and a mode switch leave
//! behind. Real traffic in namespaces; a decoy on every ClusterIP makes untranslated traffic
//! visible as `untranslated`. Figures go to stderr. Needs root.
//!
//! (Bad input — manifests, configuration files, flags — is in `bad_input.rs`.)

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use proxy_tests::client::{Attempt, tally};
use proxy_tests::http::metric_sum;
use proxy_tests::manifests::Endpoint;
use proxy_tests::scenario::{
    CLUSTER_IP, DATAPATH_TIMEOUT, SERVICE_PORT, Scenario, cluster_addr, http_service, http_slice,
    is_pod, pod_endpoint,
};

const NAMESPACE: &str = "default";

fn setup(pods: usize) -> anyhow::Result<Scenario> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    Ok(Scenario::new(pods)?)
}

/// Writes Service `name` on `ip` with the given pods as endpoints (slice first).
fn write_service(s: &Scenario, name: &str, ip: Ipv4Addr, pods: &[usize]) -> anyhow::Result<()> {
    let endpoints: Vec<_> = pods.iter().map(|&i| pod_endpoint(i)).collect();
    s.manifests.write(
        &format!("{name}-slice.yaml"),
        &http_slice(NAMESPACE, &format!("{name}-1"), name, &endpoints),
    )?;
    s.manifests.write(
        &format!("{name}-svc.yaml"),
        &http_service(NAMESPACE, name, ip),
    )?;
    Ok(())
}

/// Runs a command in the node namespace and returns its stdout.
fn in_node(s: &Scenario, program: &str, args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new("nsenter")
        .arg(format!("--net={}", s.topo.node().path().display()))
        .arg("--")
        .arg(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program} in the node namespace"))?;
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Lines of `iptables-save` (both families) in the node namespace that mention `KUBE-`, except
/// KUBE-FIREWALL: kubelet's chain, which the iptables mode also writes (kube-proxy does) and
/// leaves on cleanup like kube-proxy's `CleanupLeftovers` — its DROP closes the hole that
/// `route_localnet=1` opens, and that sysctl stays set.
fn kube_rules(s: &Scenario) -> anyhow::Result<Vec<String>> {
    let mut lines = Vec::new();
    for program in ["iptables-save", "ip6tables-save"] {
        lines.extend(
            in_node(s, program, &[])?
                .lines()
                .filter(|l| l.contains("KUBE-") && !l.contains("KUBE-FIREWALL"))
                .map(str::to_owned),
        );
    }
    Ok(lines)
}

/// The programs attached to the scenario's cgroup once the kernel has detached what it will:
/// it detaches a cgroup program when its link's last reference goes, in deferred work after
/// the unpin. Waits (bounded) for none to be left; returns what is left.
fn programs_once_detached(s: &Scenario) -> anyhow::Result<Vec<String>> {
    let deadline = Instant::now() + DATAPATH_TIMEOUT;
    loop {
        let left = cgroup_programs(s.cgroup.path())?;
        if left.is_empty() || Instant::now() >= deadline {
            return Ok(left);
        }
        thread::sleep(Duration::from_millis(100));
    }
}

/// Programs attached to the scenario's cgroup (`bpftool cgroup show`), one line each.
fn cgroup_programs(cgroup: &Path) -> anyhow::Result<Vec<String>> {
    let output = Command::new("bpftool")
        .args(["cgroup", "show"])
        .arg(cgroup)
        .output()
        .context("running bpftool cgroup show")?;
    anyhow::ensure!(
        output.status.success(),
        "bpftool cgroup show failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8_lossy(&output.stdout)
        .lines()
        .skip_while(|l| l.starts_with("ID"))
        .filter(|l| !l.trim().is_empty())
        .map(str::to_owned)
        .collect())
}

/// What the external client gets for the ClusterIP: translated by the tc program on the
/// node's external link while it is attached, the node's decoy once it is gone.
fn from_outside(s: &Scenario) -> anyhow::Result<std::collections::BTreeMap<String, usize>> {
    let client = s
        .external_client()
        .timeout(std::time::Duration::from_millis(700));
    Ok(tally(&client.run(cluster_addr(), 10)?))
}

/// Entries of the agent's pin directory (`None`: the directory does not exist).
fn pins(bpf_root: &Path) -> anyhow::Result<Option<Vec<String>>> {
    let dir = bpf_root.join(proxy_dataplane_ebpf::PIN_DIR_NAME);
    match std::fs::read_dir(&dir) {
        Ok(entries) => Ok(Some(
            entries
                .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
                .collect::<Result<_, _>>()?,
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("listing {}", dir.display())),
    }
}

/// Waits until the running agent's `/metrics` satisfy `done` (bounded).
fn wait_for_metrics(
    s: &mut Scenario,
    what: &str,
    done: impl Fn(&str) -> bool,
) -> anyhow::Result<()> {
    // The first sync waits for the verifier, which takes long on a loaded machine (several
    // agents starting at once): the datapath's bound, not a shorter one.
    let deadline = Instant::now() + DATAPATH_TIMEOUT;
    while !s.agent()?.metrics().is_ok_and(|m| done(&m)) {
        anyhow::ensure!(
            Instant::now() < deadline,
            s.agent_error(format!("{what} not within {DATAPATH_TIMEOUT:?}"))
        );
        thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// Waits until the (re)started agent reports its first successful sync.
fn wait_for_first_sync(s: &mut Scenario) -> anyhow::Result<()> {
    wait_for_metrics(s, "a successful sync", |m| {
        metric_sum(
            m,
            "kubeproxy_sync_proxy_rules_duration_seconds_count",
            &["ip_family=\"IPv4\""],
        ) >= 1.0
    })
}

#[test]
fn iptables_agent_sigkilled_and_restarted_twice_under_load_fails_no_connection()
-> anyhow::Result<()> {
    let mut s = setup(2)?;
    write_service(&s, "web", CLUSTER_IP, &[1, 2])?;
    s.start_agent_in_mode("iptables")?;
    let client = s.outside_client();
    s.wait_for_datapath_with(&client, cluster_addr(), "answered by a pod", is_pod)?;

    let load = client.interval(Duration::from_millis(5));
    let spawned = Instant::now();
    let load = thread::spawn(move || load.run_timed(cluster_addr(), 900));
    // (killed, restarted) in ms since the client was spawned.
    let mut outages = Vec::new();
    for _ in 0..2 {
        // Pacing: the load runs between the outages, and each outage (no agent for this long)
        // is what the connections must get through.
        thread::sleep(Duration::from_millis(800));
        s.agent()?.kill()?;
        let killed = spawned.elapsed().as_millis() as u64;
        thread::sleep(Duration::from_millis(600));
        s.agent()?.restart()?;
        outages.push((killed, spawned.elapsed().as_millis() as u64));
    }
    let attempts = load
        .join()
        .map_err(|_| anyhow::anyhow!("client thread panicked"))??;
    let while_down = attempts
        .iter()
        .filter(|(_, at)| {
            outages
                .iter()
                .any(|(killed, restarted)| (*killed..restarted + 300).contains(at))
        })
        .count();
    let answers: Vec<Attempt> = attempts.iter().map(|(a, _)| a.clone()).collect();
    let counts = tally(&answers);
    let failures = answers.iter().filter(|a| !is_pod(a)).count();
    eprintln!(
        "iptables mode, 2× SIGKILL + restart under load: {} connections attempted, {failures} \
         failed or untranslated, {while_down} made while an agent was down or starting; \
         outages (killed, restarted) ms: {outages:?}; answers: {counts:?}",
        answers.len()
    );
    s.ensure(while_down > 0, || {
        "the load must overlap the outages".into()
    })?;
    s.ensure(failures == 0, || {
        format!("no connection may fail while the agent restarts: {counts:?}")
    })?;
    // The third agent still applies changes.
    write_service(&s, "web", CLUSTER_IP, &[2])?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let counts = tally(&s.outside_client().run(cluster_addr(), 20)?);
        if counts.keys().map(String::as_str).eq(["pod2"]) {
            break;
        }
        s.ensure(Instant::now() < deadline, || {
            format!("the restarted agent did not apply pod1's removal: {counts:?}")
        })?;
        thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}

/// Services `cap-0`.. on 10.96.1.<i>: with maps of 8 entries and 2 backends each, only some fit.
fn capacity_ip(i: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 96, 1, 10 + i)
}

/// Services `{prefix}-0` … `{prefix}-{count - 1}` (Service i on [`capacity_ip`] with pods
/// `i % 4 + 1` and `(i + 1) % 4 + 1`), each classified by real traffic as served whole by its
/// pods or not at all (its decoy answers): the ones served, and the others, which the agent's
/// log must name. A mix of the two is a half-programmed Service: an error.
fn served_or_named(
    s: &mut Scenario,
    prefix: &str,
    count: u8,
) -> anyhow::Result<(Vec<u8>, Vec<u8>)> {
    let log = s.agent()?.log_contents();
    let (mut fitted, mut unfit) = (Vec::new(), Vec::new());
    for i in 0..count {
        let target: SocketAddr = SocketAddrV4::new(capacity_ip(i), SERVICE_PORT).into();
        let counts = tally(&s.cgroup_client().run(target, 12)?);
        let pods = [i % 4 + 1, (i + 1) % 4 + 1].map(|p| format!("pod{p}"));
        let all_pods = counts.keys().all(|k| pods.contains(k));
        let all_decoy = counts.keys().map(String::as_str).eq(["untranslated"]);
        s.ensure(all_pods || all_decoy, || {
            format!("{prefix}-{i} is half-programmed or inconsistent: {counts:?} (pods {pods:?})")
        })?;
        if all_pods {
            fitted.push(i);
        } else {
            unfit.push(i);
            s.ensure(log.contains(&format!("default/{prefix}-{i}:http")), || {
                format!("the log does not name {prefix}-{i}, which did not fit")
            })?;
        }
    }
    Ok((fitted, unfit))
}

#[test]
fn tiny_maps_report_the_services_that_do_not_fit_and_never_half_program_one() -> anyhow::Result<()>
{
    const SERVICES: u8 = 8;
    let mut s = setup(4)?;
    // Distinct backends per Service (pods × 2 ports would be needed otherwise): Service i uses
    // pods (i % 4) + 1 and ((i + 1) % 4) + 1, so the 8-entry backends map holds 4 backends and
    // the 8-entry slots map (2 generations' worth during an update) is what runs out.
    for i in 0..SERVICES {
        s.topo.add_decoy(capacity_ip(i), SERVICE_PORT)?;
        let pods = [usize::from(i % 4) + 1, usize::from((i + 1) % 4) + 1];
        write_service(&s, &format!("cap-{i}"), capacity_ip(i), &pods)?;
    }
    s.start_agent_with_args(
        "ebpf",
        &["--bpf-map-frontends", "8", "--bpf-map-backends", "8"],
    )?;
    // Wait until the first sync ran (it fails: not everything fits, so the sync histogram stays
    // empty; the map fill levels are reported either way), then classify every Service by
    // real traffic.
    wait_for_metrics(&mut s, "the first sync's map fill levels", |m| {
        metric_sum(
            m,
            "kubeproxy_ebpf_map_capacity",
            &["map=\"KPR_FRONTENDS4\""],
        ) == 8.0
    })?;
    // The warnings naming what did not fit are logged before the fill levels are recorded.
    let (fitted, unfit) = served_or_named(&mut s, "cap", SERVICES)?;
    let log = s.agent()?.log_contents();
    eprintln!(
        "tiny maps (8 frontends, 8 slots/backends), {SERVICES} Services of 2 endpoints: fitted \
         {fitted:?}, did not fit {unfit:?}"
    );
    s.ensure(!fitted.is_empty() && !unfit.is_empty(), || {
        format!("expected some Services to fit and some not: fitted {fitted:?}, unfit {unfit:?}")
    })?;
    s.ensure(
        log.contains("service ports that do not fit in the eBPF maps")
            && log.contains("capacity_errors="),
        || "no capacity warning in the log".into(),
    )?;
    // Removing a Service that fits frees room: a Service that did not fit gets programmed, and
    // the ones that fitted keep working throughout.
    let (gone, kept) = (fitted[0], fitted[fitted.len() - 1]);
    let waiting = unfit[0];
    s.manifests.remove(&format!("cap-{gone}-svc.yaml"))?;
    s.manifests.remove(&format!("cap-{gone}-slice.yaml"))?;
    let target: SocketAddr = SocketAddrV4::new(capacity_ip(waiting), SERVICE_PORT).into();
    s.wait_for_datapath(
        target,
        "a Service that did not fit is programmed once room is freed",
        is_pod,
    )?;
    let kept_target: SocketAddr = SocketAddrV4::new(capacity_ip(kept), SERVICE_PORT).into();
    let counts = tally(&s.cgroup_client().run(kept_target, 12)?);
    s.ensure(counts.keys().all(|k| k.starts_with("pod")), || {
        format!("cap-{kept}, which fitted, must keep working: {counts:?}")
    })?;
    eprintln!("after removing cap-{gone}: cap-{waiting} programmed, cap-{kept} still {counts:?}");
    Ok(())
}

/// One namespace floods a 512-entry frontend map with a Service of 600 ports; another
/// namespace's Service, created afterwards, is still programmed and answers, and the node
/// stays healthy: what did not fit is the flooding tenant's problem, reported in the log
/// naming its Service, and the agent's syncs keep succeeding.
/// Pinned maps keep their size across restarts: an agent started on a node whose pinned
/// frontend map (4 entries, from an earlier run with `--bpf-map-frontends 4` and no Services)
/// is smaller than its own flag says (the default) writes its first fill in large batches,
/// which the kernel refuses past the map's room. The fill is taken out of the maps again and
/// written entry by entry, as every later sync writes: each Service is served whole or
/// reported as not fitting (named in the log), never half-programmed, and the two whose
/// frontends fit are served.
#[test]
fn a_first_fill_a_smaller_pinned_map_refuses_is_written_again_entry_by_entry() -> anyhow::Result<()>
{
    const SERVICES: u8 = 8;
    let mut s = setup(4)?;
    s.start_agent_with_args("ebpf", &["--bpf-map-frontends", "4"])?;
    wait_for_first_sync(&mut s)?;
    s.agent()?.stop()?;
    for i in 0..SERVICES {
        s.topo.add_decoy(capacity_ip(i), SERVICE_PORT)?;
        let pods = [usize::from(i % 4) + 1, usize::from((i + 1) % 4) + 1];
        write_service(&s, &format!("fill-{i}"), capacity_ip(i), &pods)?;
    }
    s.agent()?.restart_with_args(&[])?;
    let deadline = Instant::now() + DATAPATH_TIMEOUT;
    loop {
        let log = s.agent()?.log_contents();
        if log.contains("the first fill's batched map writes failed")
            && log.contains("service ports that do not fit in the eBPF maps")
        {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            s.agent_error(format!(
                "no refused first fill written again within {DATAPATH_TIMEOUT:?}"
            ))
        );
        thread::sleep(Duration::from_millis(50));
    }
    let (fitted, _) = served_or_named(&mut s, "fill", SERVICES)?;
    eprintln!("a 4-entry pinned frontend map under the default flag: fitted {fitted:?}");
    // A ClusterIP takes two of the map's entries (the address as pods reach it, and as the
    // external program sees it), and Services are written in name order.
    s.ensure(fitted == [0, 1], || {
        format!("expected the map's 4 entries to serve fill-0 and fill-1, fitted {fitted:?}")
    })?;
    Ok(())
}

#[test]
fn one_namespace_flooding_the_frontend_map_leaves_room_for_others() -> anyhow::Result<()> {
    let mut s = setup(1)?;
    let mut greedy = http_service("greedy", "flood", Ipv4Addr::new(10, 96, 2, 1));
    let ports_at = greedy.find("  ports:\n").context("the Service's ports")?;
    greedy.truncate(ports_at);
    greedy.push_str("  ports:\n");
    for port in 1..=600 {
        greedy.push_str(&format!(
            "  - {{name: p{port}, port: {port}, protocol: TCP, targetPort: 8080}}\n"
        ));
    }
    s.manifests.write("greedy-svc.yaml", &greedy)?;
    s.start_agent_with_args(
        "ebpf",
        &["--bpf-map-frontends", "512", "--iptables-sync-period", "1s"],
    )?;
    wait_for_metrics(&mut s, "the flood's frontends programmed", |m| {
        metric_sum(m, "kubeproxy_ebpf_map_entries", &["map=\"KPR_FRONTENDS4\""]) >= 448.0
    })?;
    let victim_ip = Ipv4Addr::new(10, 96, 3, 1);
    s.topo.add_decoy(victim_ip, SERVICE_PORT)?;
    s.manifests.write(
        "victim-slice.yaml",
        &http_slice("victim", "web-1", "web", &[pod_endpoint(1)]),
    )?;
    let started = Instant::now();
    s.manifests
        .write("victim-svc.yaml", &http_service("victim", "web", victim_ip))?;
    let target: SocketAddr = SocketAddrV4::new(victim_ip, SERVICE_PORT).into();
    s.wait_for_datapath(target, "the other namespace's Service", is_pod)?;
    eprintln!(
        "the victim's Service answered {:?} after it was written, beside a flood of 600 ports",
        started.elapsed()
    );
    let counts = tally(&s.cgroup_client().run(target, 12)?);
    s.ensure(counts.keys().all(|k| k == "pod1"), || {
        format!("the victim's Service must be answered by its pod only: {counts:?}")
    })?;
    // The node is healthy: the syncs go on succeeding with the flood not fitting.
    let syncs = s.agent()?.syncs();
    wait_for_metrics(&mut s, "two more successful syncs", |m| {
        metric_sum(
            m,
            "kubeproxy_sync_proxy_rules_duration_seconds_count",
            &["ip_family=\"IPv4\""],
        ) >= (syncs + 2) as f64
    })?;
    let healthz = proxy_tests::http::get(
        &s.topo.node().path(),
        "127.0.0.1:10256".parse()?,
        "/healthz",
    )?;
    s.ensure(healthz.status == 200, || {
        format!(
            "/healthz must stay 200: {} {}",
            healthz.status, healthz.body
        )
    })?;
    let log = s.agent()?.log_contents();
    s.ensure(log.contains("greedy/flood:p"), || {
        "the log must name the flooding Service's ports that did not fit".into()
    })?;
    Ok(())
}

/// An EndpointSlice flood: namespace `greedy` has 20 Services of 20 endpoints each, truncated
/// to 16 by `--bpf-max-endpoints-per-service`, so 32 slots each (the ClusterIP's socket and tc
/// frontends) where a 512-entry slot map (`--bpf-map-backends`) holds 16 of them exactly.
/// Greedy gets all but the reserve; namespace `victim`'s Service, created afterwards, is
/// programmed in the reserve and answers from its pod at once; the node stays healthy and the
/// log names the flood's Services that did not fit or were truncated.
#[test]
fn one_namespace_flooding_the_slot_map_with_endpoints_leaves_room_for_others() -> anyhow::Result<()>
{
    const SERVICES: u8 = 20;
    let mut s = setup(1)?;
    for i in 0..SERVICES {
        let name = format!("flood-{i:02}");
        // Addresses of no pod: the flood is never dialled, it only takes entries.
        let endpoints: Vec<_> = (1..=20)
            .map(|j| Endpoint::ready(Ipv4Addr::new(10, 250, i, j)))
            .collect();
        s.manifests.write(
            &format!("greedy-{name}-slice.yaml"),
            &http_slice("greedy", &format!("{name}-1"), &name, &endpoints),
        )?;
        s.manifests.write(
            &format!("greedy-{name}-svc.yaml"),
            &http_service("greedy", &name, Ipv4Addr::new(10, 96, 4, 10 + i)),
        )?;
    }
    s.start_agent_with_args(
        "ebpf",
        &[
            "--bpf-map-backends",
            "512",
            "--bpf-max-endpoints-per-service",
            "16",
            "--iptables-sync-period",
            "1s",
        ],
    )?;
    let slots = |m: &str| {
        metric_sum(
            m,
            "kubeproxy_ebpf_map_entries",
            &["map=\"KPR_BACKEND_SLOTS\""],
        )
    };
    let frontends =
        |m: &str| metric_sum(m, "kubeproxy_ebpf_map_entries", &["map=\"KPR_FRONTENDS4\""]);
    wait_for_metrics(&mut s, "the flood's slots programmed", |m| slots(m) > 0.0)?;
    let flooded = s.agent()?.metrics()?;
    let greedy_slots = slots(&flooded);
    eprintln!("greedy's flood holds {greedy_slots} of 512 slots");
    s.ensure((416.0..=448.0).contains(&greedy_slots), || {
        format!(
            "the flood must hold all of the slot map but its reserve (448 of 512), holds \
             {greedy_slots}"
        )
    })?;

    let victim_ip = Ipv4Addr::new(10, 96, 5, 1);
    s.topo.add_decoy(victim_ip, SERVICE_PORT)?;
    s.manifests.write(
        "victim-slice.yaml",
        &http_slice("victim", "web-1", "web", &[pod_endpoint(1)]),
    )?;
    let started = Instant::now();
    s.manifests
        .write("victim-svc.yaml", &http_service("victim", "web", victim_ip))?;
    // Programmed: its two frontends are in the map. From then on it must answer, first time.
    let before = frontends(&flooded);
    wait_for_metrics(&mut s, "the victim's frontends programmed", |m| {
        frontends(m) >= before + 2.0
    })?;
    let target: SocketAddr = SocketAddrV4::new(victim_ip, SERVICE_PORT).into();
    let counts = tally(&s.cgroup_client().run(target, 12)?);
    eprintln!(
        "the victim's Service answered {counts:?} {:?} after it was written, beside a flood of \
         {greedy_slots} slots",
        started.elapsed()
    );
    s.ensure(counts.keys().all(|k| k == "pod1"), || {
        format!("the victim's Service must be answered by its pod as soon as it is programmed: {counts:?}")
    })?;
    let from_outside = tally(&s.external_client().run(target, 6)?);
    s.ensure(from_outside.keys().all(|k| k == "pod1"), || {
        format!("the victim's ClusterIP must be translated by tc too: {from_outside:?}")
    })?;

    // The node is healthy: the syncs go on succeeding with the flood not fitting.
    let syncs = s.agent()?.syncs();
    wait_for_metrics(&mut s, "two more successful syncs", |m| {
        metric_sum(
            m,
            "kubeproxy_sync_proxy_rules_duration_seconds_count",
            &["ip_family=\"IPv4\""],
        ) >= (syncs + 2) as f64
    })?;
    let healthz = proxy_tests::http::get(
        &s.topo.node().path(),
        "127.0.0.1:10256".parse()?,
        "/healthz",
    )?;
    s.ensure(healthz.status == 200, || {
        format!(
            "/healthz must stay 200: {} {}",
            healthz.status, healthz.body
        )
    })?;
    let log = s.agent()?.log_contents();
    s.ensure(
        log.contains("greedy/flood-19:http")
            && log.contains("the namespace has its share of the backend slot map"),
        || "the log must name the flood's Services that did not fit, and the slot map".into(),
    )?;
    s.ensure(
        log.contains("greedy/flood-00:http: 20 endpoints, programmed with the first 16"),
        || "the log must name the Services truncated to --bpf-max-endpoints-per-service".into(),
    )?;
    Ok(())
}

#[test]
fn pins_are_root_only_and_cleanup_leaves_nothing_of_either_mode() -> anyhow::Result<()> {
    let mut s = setup(1)?;
    write_service(&s, "web", CLUSTER_IP, &[1])?;
    s.start_agent()?;
    s.wait_for_datapath(cluster_addr(), "answered by a pod", is_pod)?;
    let bpf_root = s.agent()?.bpf_root().to_path_buf();
    let dir = bpf_root.join(proxy_dataplane_ebpf::PIN_DIR_NAME);
    let dir_mode = std::fs::metadata(&dir)?.permissions().mode() & 0o7777;
    let names = pins(&bpf_root)?.unwrap_or_default();
    let mut wider = Vec::new();
    for name in &names {
        let mode = std::fs::metadata(dir.join(name))?.permissions().mode() & 0o7777;
        if mode & 0o077 != 0 {
            wider.push(format!("{name} {mode:o}"));
        }
    }
    eprintln!(
        "pin dir mode {dir_mode:o}, {} pins, none wider than 0600: {}",
        names.len(),
        wider.is_empty()
    );
    s.ensure(dir_mode == 0o700, || {
        format!("the pin directory must be 0700, is {dir_mode:o}")
    })?;
    s.ensure(wider.is_empty(), || {
        format!("pins readable or writable by others: {wider:?}")
    })?;
    s.ensure(!cgroup_programs(s.cgroup.path())?.is_empty(), || {
        "no program attached to the cgroup while the agent runs".into()
    })?;
    let tc_while_running = from_outside(&s)?;
    s.ensure(
        tc_while_running.keys().all(|k| k.starts_with("pod")),
        || {
            format!(
                "the tc program must translate the ClusterIP from outside: {tc_while_running:?}"
            )
        },
    )?;

    // eBPF mode: the stopped agent leaves its datapath; --cleanup removes pins and links.
    s.agent()?.stop()?;
    let status = s.agent()?.run_cleanup()?;
    s.ensure(status.success(), || format!("--cleanup exited {status}"))?;
    let residue_pins = pins(&bpf_root)?;
    let residue_programs = programs_once_detached(&s)?;
    let residue_tc = from_outside(&s)?;
    let counts = tally(&s.cgroup_client().run(cluster_addr(), 10)?);
    eprintln!(
        "eBPF mode, after --cleanup: pin dir {residue_pins:?}, cgroup programs {}, answers \
         {counts:?}",
        residue_programs.len()
    );
    s.ensure(residue_pins.is_none(), || {
        format!("pins left: {residue_pins:?}")
    })?;
    s.ensure(residue_programs.is_empty(), || {
        format!("programs still attached: {residue_programs:?}")
    })?;
    eprintln!(
        "from outside (tc): {tc_while_running:?} while running, {residue_tc:?} after --cleanup"
    );
    s.ensure(
        residue_tc.keys().map(String::as_str).eq(["untranslated"]),
        || format!("after --cleanup no tc program may translate any more: {residue_tc:?}"),
    )?;
    s.ensure(
        counts.keys().map(String::as_str).eq(["untranslated"]),
        || format!("after cleanup the decoy must answer: {counts:?}"),
    )?;

    // iptables mode: the stopped agent leaves its rules; --cleanup removes every KUBE- chain.
    s.agent()?.restart_in_mode("iptables")?;
    let client = s.outside_client();
    s.wait_for_datapath_with(&client, cluster_addr(), "answered by a pod", is_pod)?;
    s.agent()?.stop()?;
    let rules_before = kube_rules(&s)?.len();
    let status = s.agent()?.run_cleanup()?;
    s.ensure(status.success(), || format!("--cleanup exited {status}"))?;
    let residue_rules = kube_rules(&s)?;
    let counts = tally(&s.outside_client().run(cluster_addr(), 10)?);
    eprintln!(
        "iptables mode, after --cleanup: KUBE- rules {rules_before} → {}, pin dir {:?}, \
         answers {counts:?}",
        residue_rules.len(),
        pins(&bpf_root)?
    );
    s.ensure(rules_before > 0, || {
        "the iptables agent left no rules to clean up".into()
    })?;
    s.ensure(residue_rules.is_empty(), || {
        format!("KUBE- rules left:\n{}", residue_rules.join("\n"))
    })?;
    s.ensure(
        counts.keys().map(String::as_str).eq(["untranslated"]),
        || format!("after cleanup the decoy must answer: {counts:?}"),
    )?;
    Ok(())
}

#[test]
fn mode_switches_remove_the_other_modes_leftovers_and_traffic_keeps_working() -> anyhow::Result<()>
{
    let mut s = setup(2)?;
    write_service(&s, "web", CLUSTER_IP, &[1, 2])?;
    s.start_agent()?;
    s.wait_for_datapath(cluster_addr(), "answered by a pod", is_pod)?;
    let bpf_root = s.agent()?.bpf_root().to_path_buf();
    let ebpf_pins = pins(&bpf_root)?.map_or(0, |p| p.len());

    // ebpf → iptables: after its first sync no pin, link or cgroup program remains.
    s.agent()?.stop()?;
    s.agent()?.restart_in_mode("iptables")?;
    wait_for_first_sync(&mut s)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while pins(&bpf_root)?.is_some() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(100));
    }
    let left_pins = pins(&bpf_root)?;
    let left_programs = programs_once_detached(&s)?;
    // Both the cgroup client (no longer translated by eBPF) and any node process go through
    // the iptables rules now.
    let cgroup_counts = tally(&s.cgroup_client().run(cluster_addr(), 20)?);
    let node_counts = tally(&s.outside_client().run(cluster_addr(), 20)?);
    eprintln!(
        "ebpf ({ebpf_pins} pins) → iptables: pins left {left_pins:?}, cgroup programs left {}, \
         {} KUBE- rules; answers: cgroup {cgroup_counts:?}, node {node_counts:?}",
        left_programs.len(),
        kube_rules(&s)?.len()
    );
    s.ensure(left_pins.is_none(), || {
        format!("eBPF pins left: {left_pins:?}")
    })?;
    s.ensure(left_programs.is_empty(), || {
        format!("programs still attached: {left_programs:?}")
    })?;
    for counts in [&cgroup_counts, &node_counts] {
        s.ensure(counts.keys().all(|k| k.starts_with("pod")), || {
            format!("iptables mode must carry the traffic: {counts:?}")
        })?;
    }

    // iptables → ebpf: after its first sync no KUBE- rule remains.
    s.agent()?.stop()?;
    s.agent()?.restart_in_mode("ebpf")?;
    wait_for_first_sync(&mut s)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !kube_rules(&s)?.is_empty() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(100));
    }
    let left_rules = kube_rules(&s)?;
    let cgroup_counts = tally(&s.cgroup_client().run(cluster_addr(), 20)?);
    let node_counts = tally(&s.outside_client().run(cluster_addr(), 10)?);
    eprintln!(
        "iptables → ebpf: KUBE- rules left {}, pins {}; answers: cgroup {cgroup_counts:?}, \
         outside the cgroup {node_counts:?}",
        left_rules.len(),
        pins(&bpf_root)?.map_or(0, |p| p.len())
    );
    s.ensure(left_rules.is_empty(), || {
        format!("KUBE- rules left:\n{}", left_rules.join("\n"))
    })?;
    s.ensure(cgroup_counts.keys().all(|k| k.starts_with("pod")), || {
        format!("eBPF mode must carry the cgroup's traffic: {cgroup_counts:?}")
    })?;
    // Outside the cgroup nothing translates any more: proof that the rules are really gone.
    s.ensure(
        node_counts.keys().map(String::as_str).eq(["untranslated"]),
        || format!("outside the cgroup the decoy must answer: {node_counts:?}"),
    )?;
    Ok(())
}
