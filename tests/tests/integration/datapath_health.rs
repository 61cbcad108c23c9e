//! The datapath's health in `/healthz` with the real agent: the self-test (a synthetic SYN
//! through the external interface's ingress program with `BPF_PROG_TEST_RUN`) catches a
//! program detached behind the agent's back and a corrupted backend slot; the drift check's
//! timer attaches the program again and repairs the slot without waiting for a sync, and the
//! status stays 200 with the reasons in the body; a re-attach that cannot succeed (the pin
//! directory hidden under a tmpfs, so the new link cannot be pinned) turns it 503 with the
//! reason, and 200 again once the agent can repair it. With legacy tc filters the self-test
//! runs the attached program too. Needs root.

use std::{
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use aya::maps::{HashMap, Map, MapData};
use proxy_common::{
    BackendSlotKey, Frontend4Key, FrontendValue, SLOT_BLOCK_SLOTS, SlotBlock, map_names, proto,
    scope,
};
use proxy_dataplane_ebpf::{ConntrackMaps, PIN_DIR_NAME, PROBE_CLIENT4, ip4_to_map};
use proxy_tests::{
    client::Client,
    http::{Response, get},
    scenario::{BACKEND_PORT, Scenario, http_slice, is_pod, pod_endpoint},
    topology::Topology,
};
use serde_json::Value;

const NODE_PORT: u16 = 30080;
/// The agent's drift check period here: short, so "within one period" is quick to see.
const PERIOD: Duration = Duration::from_secs(2);
const HEALTHZ: &str = "127.0.0.1:10256";

/// A NodePort Service `default/web` (80 → 8080, NodePort 30080).
fn node_port_service() -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: default\n\
         spec:\n  type: NodePort\n  clusterIP: \"10.96.0.20\"\n  clusterIPs: [\"10.96.0.20\"]\n\
         \x20 ports:\n  - name: http\n    port: 80\n    protocol: TCP\n    targetPort: 8080\n\
         \x20   nodePort: {NODE_PORT}\n"
    )
}

fn node_port_addr() -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Topology::node_ext_ip()), NODE_PORT)
}

/// A node with the NodePort Service on pod 1, the agent serving it from `vext` with a short
/// drift period and no periodic sync within the test (so what repairs is the drift timer).
fn serve() -> anyhow::Result<(Scenario, Client)> {
    serve_with(&[])
}

fn serve_with(extra: &[&str]) -> anyhow::Result<(Scenario, Client)> {
    proxy_tests::require_root();
    proxy_tests::set_helper_binary(env!("CARGO_BIN_EXE_rig-helper"));
    let mut s = Scenario::new(1)?;
    s.manifests.write("svc.yaml", &node_port_service())?;
    s.manifests.write(
        "slice.yaml",
        &http_slice("default", "web-1", "web", &[pod_endpoint(1)]),
    )?;
    let period = format!("{}s", PERIOD.as_secs());
    let mut args = vec![
        "--interfaces",
        "vext",
        "--drift-check-period",
        &period,
        "--iptables-sync-period",
        "1h",
    ];
    args.extend_from_slice(extra);
    s.start_agent_with_args("ebpf", &args)?;
    let client = Client::new(s.topo.ext().path()).timeout(Duration::from_millis(1500));
    s.wait_for_datapath_with(&client, node_port_addr(), "NodePort answered", is_pod)?;
    Ok((s, client))
}

fn healthz(netns: &Path) -> anyhow::Result<(Response, Value)> {
    let response = get(netns, HEALTHZ.parse()?, "/healthz")?;
    let body: Value = serde_json::from_str(&response.body)?;
    Ok((response, body))
}

/// Polls `/healthz` until `done` holds for its status and body; returns the last answer.
fn wait_healthz(
    s: &Scenario,
    what: &str,
    timeout: Duration,
    done: impl Fn(u16, &Value) -> bool,
) -> anyhow::Result<(u16, Value)> {
    let netns = s.topo.node().path();
    let deadline = Instant::now() + timeout;
    let mut last = None;
    // Bounded by the deadline.
    while Instant::now() < deadline {
        if let Ok((response, body)) = healthz(&netns) {
            if done(response.status, &body) {
                return Ok((response.status, body));
            }
            last = Some((response.status, body));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(s
        .agent_error(format!(
            "/healthz: {what} within {timeout:?}; last: {last:#?}"
        ))
        .into())
}

fn self_test_passed(body: &Value) -> bool {
    body["datapath"]["selfTest"]["passed"] == true
        && body["datapath"]["selfTest"]["programs"]
            .as_array()
            .is_some_and(|p| p.iter().any(|p| p["result"] == "passed"))
}

fn vext_ingress_pin(s: &mut Scenario) -> anyhow::Result<PathBuf> {
    let ifindex = s
        .topo
        .node()
        .exec("cat", &["/sys/class/net/vext/ifindex"])?;
    Ok(s.agent()?
        .bpf_root()
        .join(PIN_DIR_NAME)
        .join(format!("kpr_tc_external_if{}_link", ifindex.trim())))
}

/// The probes ran through the live program, which wrote conntrack entries for them: none is
/// left behind (read twice: a read may fall between a probe's run and its cleanup).
fn assert_no_probe_entries_left(s: &mut Scenario) -> anyhow::Result<()> {
    let pin_dir = s.agent()?.bpf_root().join(PIN_DIR_NAME);
    let leftovers = || -> anyhow::Result<Vec<String>> {
        let client = [ip4_to_map(PROBE_CLIENT4), 0, 0, 0];
        Ok(ConntrackMaps::open_pinned(&pin_dir)?
            .entries()
            .into_iter()
            .filter(|(key, value)| key.src == client || value.dst == client)
            .map(|entry| format!("{entry:?}"))
            .collect())
    };
    if !leftovers()?.is_empty() {
        std::thread::sleep(Duration::from_millis(300));
        let left = leftovers()?;
        assert!(left.is_empty(), "probe conntrack entries left: {left:#?}");
    }
    Ok(())
}

#[test]
fn a_detached_program_is_caught_by_the_self_test_and_attached_again_by_the_drift_timer()
-> anyhow::Result<()> {
    let (mut s, client) = serve()?;
    let (status, body) = wait_healthz(&s, "a passing self-test", PERIOD * 5, |status, body| {
        status == 200 && self_test_passed(body)
    })?;
    eprintln!("/healthz before: {status} {body:#}");
    assert_eq!(body["datapath"]["mode"], "ebpf", "{body:#}");
    assert_eq!(
        body["nodeEligible"], true,
        "upstream's fields stay: {body:#}"
    );
    let hooks = body["datapath"]["attachments"]["hooks"].as_array().cloned();
    assert!(
        hooks.into_iter().flatten().any(|h| h["interface"] == "vext"
            && h["hook"] == "ingress"
            && h["program"] == "kpr_tc_external"
            && h["attached"] == true),
        "{body:#}"
    );
    assert_no_probe_entries_left(&mut s)?;
    let syncs = s.agent()?.syncs();
    let pin = vext_ingress_pin(&mut s)?;
    s.topo.node().exec(
        "bpftool",
        &["link", "detach", "pinned", &pin.to_string_lossy()],
    )?;
    let detached_at = Instant::now();
    let (status, body) = wait_healthz(
        &s,
        "the detach reported as caught and repaired",
        PERIOD * 5,
        |_, body| {
            let datapath = &body["datapath"];
            let caught = datapath["selfTest"]["failedBeforeRepair"]
                .as_array()
                .is_some_and(|failed| {
                    failed.iter().any(|p| {
                        p["interface"] == "vext"
                            && p["reason"]
                                .as_str()
                                .is_some_and(|r| r.contains("not in the ingress hook"))
                    })
                });
            let reattached = datapath["attachments"]["reattached"]
                .as_array()
                .is_some_and(|r| {
                    r.iter().any(|r| {
                        r["interface"] == "vext"
                            && r["program"] == "kpr_tc_external"
                            && r["repaired"] == true
                    })
                });
            caught && reattached && self_test_passed(body)
        },
    )?;
    eprintln!(
        "/healthz after {:?}: {status} {body:#}",
        detached_at.elapsed()
    );
    // Repaired: reported, and still healthy.
    assert_eq!(status, 200, "{body:#}");
    assert_eq!(body["datapath"]["healthy"], true, "{body:#}");
    let reasons = body["datapath"]["reasons"].to_string();
    assert!(reasons.contains("detached from vext ingress"), "{reasons}");
    let answered = client.run(node_port_addr(), 6)?;
    s.ensure(answered.iter().all(is_pod), || {
        format!("after the drift timer's re-attach the NodePort reaches the pod: {answered:?}")
    })?;
    let after = s.agent()?.syncs();
    s.ensure(after == syncs, || {
        format!(
            "the re-attach came from the drift timer, not a sync: {syncs} syncs before, {after} after"
        )
    })?;
    Ok(())
}

fn open<K: aya::Pod, V: aya::Pod>(
    pin_dir: &Path,
    name: &str,
) -> anyhow::Result<HashMap<MapData, K, V>> {
    let data = MapData::from_pin(pin_dir.join(name))?;
    Ok(HashMap::try_from(Map::from_map_data(data)?)?)
}

/// Points every live slot of the NodePort frontend at a backend id nobody allocated.
fn corrupt_node_port_slots(pin_dir: &Path) -> anyhow::Result<()> {
    let frontends: HashMap<_, Frontend4Key, FrontendValue> = open(pin_dir, map_names::FRONTENDS4)?;
    let key = Frontend4Key {
        addr: 0,
        port: NODE_PORT.to_be(),
        proto: proto::TCP,
        scope: scope::EXTERNAL,
    };
    let web = frontends.get(&key, 0)?;
    anyhow::ensure!(web.backend_count == 1, "web's NodePort: {web:?}");
    let mut slots: HashMap<_, BackendSlotKey, SlotBlock> = open(pin_dir, map_names::BACKEND_SLOTS)?;
    let count = u32::from(web.backend_count);
    for block in 0..count.div_ceil(SLOT_BLOCK_SLOTS) {
        let key = BackendSlotKey {
            service_id: web.service_id,
            block: block as u16,
            generation: web.generation,
            _pad: 0,
        };
        let mut ids = slots.get(&key, 0)?;
        // The block's live slots; past `backend_count` the entries are never read.
        let first = block * SLOT_BLOCK_SLOTS;
        let live = (count - first).min(SLOT_BLOCK_SLOTS) as usize;
        ids.backend_ids[..live].fill(0x00ff_fff0);
        slots.insert(key, ids, 0)?;
    }
    Ok(())
}

#[test]
fn a_corrupted_backend_slot_fails_the_self_test_and_the_drift_repair_fixes_it() -> anyhow::Result<()>
{
    let (mut s, client) = serve()?;
    wait_healthz(&s, "a passing self-test", PERIOD * 5, |status, body| {
        status == 200 && self_test_passed(body)
    })?;
    let pin_dir = s.agent()?.bpf_root().join(PIN_DIR_NAME);
    // The agent's check may run between the corruption and the next one and repair it before
    // a self-test saw it only if it raced the drift reading: try again, a bounded number of
    // times.
    let mut caught = None;
    for _ in 0..3 {
        corrupt_node_port_slots(&pin_dir)?;
        let found = wait_healthz(
            &s,
            "the corruption reported and repaired",
            PERIOD * 4,
            |_, body| {
                let datapath = &body["datapath"];
                datapath["selfTest"]["failedBeforeRepair"]
                    .as_array()
                    .is_some_and(|failed| failed.iter().any(|p| p["interface"] == "vext"))
                    && self_test_passed(body)
                    && datapath["lastDriftCheck"]["result"] == "repaired"
            },
        );
        if let Ok(found) = found {
            caught = Some(found);
            break;
        }
    }
    let Some((status, body)) = caught else {
        return Err(s
            .agent_error("the self-test never reported the corrupted slot".into())
            .into());
    };
    eprintln!("/healthz after the repair: {status} {body:#}");
    assert_eq!(status, 200, "repaired: still healthy: {body:#}");
    let failure = body["datapath"]["selfTest"]["failedBeforeRepair"][0]["reason"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    // A slot naming no backend: the program finds none and drops the SYN.
    assert!(failure.starts_with("dropped"), "{failure}");
    let reasons = body["datapath"]["reasons"].to_string();
    assert!(reasons.contains("passes after it"), "{reasons}");
    let answered = client.run(node_port_addr(), 6)?;
    s.ensure(answered.iter().all(is_pod), || {
        format!("after the repair the NodePort reaches the pod: {answered:?}")
    })?;
    Ok(())
}

/// A tmpfs over the pin directory: bpffs pins cannot be made there, so a re-attach (which
/// pins its new link) fails. Drop unmounts it.
struct HiddenPins(PathBuf);

impl HiddenPins {
    fn mount(dir: &Path) -> anyhow::Result<Self> {
        nix::mount::mount(
            Some("tmpfs"),
            dir,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some("size=64k"),
        )?;
        Ok(Self(dir.to_path_buf()))
    }
}

impl Drop for HiddenPins {
    fn drop(&mut self) {
        if let Err(e) = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH) {
            eprintln!("unmounting the tmpfs over {} failed: {e}", self.0.display());
        }
    }
}

#[test]
fn a_program_that_cannot_be_attached_again_turns_healthz_503_with_the_reason() -> anyhow::Result<()>
{
    let (mut s, client) = serve()?;
    wait_healthz(&s, "a passing self-test", PERIOD * 5, |status, body| {
        status == 200 && self_test_passed(body)
    })?;
    let pin = vext_ingress_pin(&mut s)?;
    let link: Value = serde_json::from_str(&s.topo.node().exec(
        "bpftool",
        &["-j", "link", "show", "pinned", &pin.to_string_lossy()],
    )?)?;
    let id = link["id"]
        .as_u64()
        .ok_or_else(|| anyhow::anyhow!("no link id: {link}"))?
        .to_string();
    let pin_dir = s.agent()?.bpf_root().join(PIN_DIR_NAME);
    let hidden = HiddenPins::mount(&pin_dir)?;
    s.topo
        .node()
        .exec("bpftool", &["link", "detach", "id", &id])?;
    let (status, body) = wait_healthz(&s, "503", PERIOD * 5, |status, _| status == 503)?;
    eprintln!("/healthz while the re-attach fails: {status} {body:#}");
    assert_eq!(body["datapath"]["healthy"], false, "{body:#}");
    // Upstream's own verdict is unchanged: the syncs are fine.
    assert_eq!(body["healthy"], true, "{body:#}");
    let reasons = body["datapath"]["reasons"].to_string();
    assert!(
        reasons.contains(
            "kpr_tc_external is not attached to vext ingress and could not be attached again"
        ),
        "{reasons}"
    );
    // /livez keeps upstream's meaning: the agent is alive.
    let live = get(&s.topo.node().path(), HEALTHZ.parse()?, "/livez")?;
    assert_eq!(live.status, 200, "{}", live.body);
    drop(hidden);
    let (status, body) = wait_healthz(&s, "healthy again", PERIOD * 5, |status, body| {
        status == 200 && self_test_passed(body)
    })?;
    eprintln!("/healthz once repairable: {status} {body:#}");
    let answered = client.run(node_port_addr(), 6)?;
    s.ensure(answered.iter().all(is_pod), || {
        format!("once attached again the NodePort reaches the pod: {answered:?}")
    })?;
    Ok(())
}

/// Without TCX the programs are legacy clsact filters, whose program ids the agent does not
/// keep: the self-test runs the program it attached, and passes.
#[test]
fn the_self_test_runs_through_a_legacy_tc_filter_too() -> anyhow::Result<()> {
    let (s, _client) = serve_with(&["--bpf-disable-feature", "tcx"])?;
    let (status, body) = wait_healthz(&s, "a passing self-test", PERIOD * 5, |status, body| {
        status == 200 && self_test_passed(body)
    })?;
    eprintln!("/healthz with legacy tc: {status} {body:#}");
    let probe = &body["datapath"]["selfTest"]["programs"][0];
    assert_eq!(probe["interface"], "vext", "{body:#}");
    let pod1 = format!("{}:{BACKEND_PORT}", Topology::pod_ip(1));
    assert_eq!(probe["translatedTo"], pod1.as_str(), "{body:#}");
    Ok(())
}

/// On the fast path the ingress program translates fully (SNAT too) and redirects: the probe
/// passes and leaves no conntrack entry either.
#[test]
fn the_self_test_passes_on_the_fast_path_and_leaves_no_entries() -> anyhow::Result<()> {
    let (mut s, _client) = serve_with(&["--tc-fast-path"])?;
    let (status, body) = wait_healthz(&s, "a passing self-test", PERIOD * 5, |status, body| {
        status == 200 && self_test_passed(body)
    })?;
    eprintln!("/healthz on the fast path: {status} {body:#}");
    assert_no_probe_entries_left(&mut s)?;
    Ok(())
}
