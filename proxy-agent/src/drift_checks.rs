//! The agent's drift check: on a timer (`--drift-check-period`) the loop compares the kernel's
//! state with what it wrote and repairs the difference, counting each repaired entry in
//! `kubeproxy_ebpf_drift_repairs_total{map}` with a WARN naming it; `/debug/drift` (for
//! `proxy-agent inspect drift`) runs the same comparison without repairing.
//!
//! eBPF mode compares every entry of the service maps (`dataplane::ebpf::drift`); iptables mode
//! the canary and every chain a full sync writes, rule by rule (`dataplane::iptables::rules_drift`),
//! repaired by a full sync (`kubeproxy_iptables_drift_repairs_total{ip_family,table}`).

use serde::{Deserialize, Serialize};
use tracing::{debug, warn};

use crate::{dataplane::Dataplane, http_servers::metrics::Metrics};
use proxy_dataplane_ebpf::{
    DriftCheck, DriftFound, DriftJob, DriftNotChecked, DriftStart, DriftStep, EbpfDataplane,
};
use proxy_dataplane_iptables::{DriftInput, FamilyDrift, IptablesDataplane};
use proxy_model::desired::Snapshot;

/// One differing entry, as `/debug/drift` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriftEntry {
    pub map: String,
    /// `missing`, `changed` or `extra`.
    pub kind: String,
    pub entry: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub found: Option<String>,
}

/// The answer of `/debug/drift`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriftReport {
    /// `ebpf` or `iptables`.
    pub mode: String,
    /// False when nothing could be compared (before the first sync, or iptables mode).
    pub checked: bool,
    /// Why not, when not checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    pub entries_compared: usize,
    pub drift: Vec<DriftEntry>,
    /// Repairs that failed (a periodic check's; retried at the next one).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub repair_errors: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl DriftReport {
    pub fn not_checked(mode: &str, note: &str) -> Self {
        DriftReport {
            mode: mode.to_owned(),
            checked: false,
            note: Some(note.to_owned()),
            entries_compared: 0,
            drift: Vec::new(),
            repair_errors: 0,
        }
    }
}

/// One check of whichever dataplane runs, in the calling thread; with `repair`, what differs
/// is fixed (iptables: the caller requests the full sync that repairs it). The loop uses it
/// only when a check cannot start ([`DriftChecks::start_periodic`]: eBPF maps that cannot be
/// opened, an iptables thread that cannot start).
pub fn check(
    dataplane: &mut Dataplane,
    repair: bool,
    metrics: &Metrics,
    snapshot: &Snapshot,
) -> DriftReport {
    match dataplane {
        Dataplane::Ebpf(ebpf) => check_ebpf(ebpf, repair, metrics),
        Dataplane::Iptables(iptables) => check_iptables(iptables, snapshot, repair, metrics),
    }
}

/// One check of the eBPF maps; with `repair`, what differs is fixed, logged and counted.
pub fn check_ebpf(ebpf: &mut EbpfDataplane, repair: bool, metrics: &Metrics) -> DriftReport {
    let started = std::time::Instant::now();
    let check = ebpf.check_drift(repair);
    report_ebpf(check, repair, metrics, started)
}

/// Runs `work` on a thread of its own and hands its result to the returned receiver; `None`
/// when the thread cannot start. `background`: at a lower priority.
fn spawn<T: Send + 'static>(
    name: &str,
    background: bool,
    work: impl FnOnce() -> T + Send + 'static,
) -> Option<tokio::sync::oneshot::Receiver<T>> {
    let (done, result) = tokio::sync::oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            if background {
                lower_priority();
            }
            // The receiver is gone only when the agent is shutting down.
            let _ = done.send(work());
        });
    match spawned {
        Ok(_) => Some(result),
        Err(error) => {
            warn!(%error, thread = name, "cannot start the drift check's thread");
            None
        }
    }
}

/// eBPF mode: a drift check begun, its record to be copied in steps between the loop's events
/// ([`DriftChecks::copy_step`]) before it reads and compares on a thread of its own (see
/// `dataplane::ebpf::drift::reader`); `None` in iptables mode or when the maps cannot be opened
/// (logged), so the caller checks in place.
fn begin_ebpf(dataplane: &mut Dataplane) -> Option<EbpfCopying> {
    let Dataplane::Ebpf(ebpf) = dataplane else {
        return None;
    };
    let started = std::time::Instant::now();
    match ebpf.begin_drift_check() {
        Ok(start) => Some(EbpfCopying { started, start }),
        Err(error) => {
            warn!(%error, "cannot start the drift check's reading");
            None
        }
    }
}

/// A copied record's job, read and compared on a thread of its own at a lower priority; in
/// this thread when none can start (rare: the result then waits in the channel as a thread's
/// would, so it is finished, counted and repaired the same way).
fn run_ebpf(job: DriftJob, started: std::time::Instant) -> EbpfTask {
    type Work = Option<(DriftJob, tokio::sync::oneshot::Sender<DriftFound>)>;
    fn take(slot: &std::sync::Mutex<Work>) -> Work {
        slot.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }
    let (done, result) = tokio::sync::oneshot::channel();
    // std's `spawn` drops its closure when no thread starts: the work goes through a slot so
    // that it can still run here.
    let slot = std::sync::Arc::new(std::sync::Mutex::new(Some((job, done))));
    let theirs = std::sync::Arc::clone(&slot);
    let spawned = std::thread::Builder::new()
        .name("drift-check".into())
        .spawn(move || {
            if let Some((job, done)) = take(&theirs) {
                lower_priority();
                // The receiver is gone only when the agent is shutting down.
                let _ = done.send(DriftJob::run(job));
            }
        });
    if let Err(error) = spawned {
        warn!(%error, "cannot start the drift check's thread; checking in the loop");
        if let Some((job, done)) = take(&slot) {
            let _ = done.send(DriftJob::run(job));
        }
    }
    EbpfTask { started, result }
}

/// Nice 10 for the calling thread (Linux: per thread; the `iptables-save` it runs inherits it).
/// The check is background work that reads every entry of every map (hundreds of milliseconds
/// of CPU at 50k Services, mostly in the kernel) and compares them; at the default priority it
/// took half of a two-core node from the loop's syncs.
fn lower_priority() {
    const BACKGROUND_NICE: libc::c_int = 10;
    // SAFETY: a plain syscall without arguments.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) };
    let Ok(tid) = libc::id_t::try_from(tid) else {
        return;
    };
    // SAFETY: no pointers; `tid` is this thread. A failure (no permission) only leaves the
    // priority as it was.
    let set = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, BACKGROUND_NICE) };
    if set != 0 {
        debug!(error = %std::io::Error::last_os_error(), "drift check keeps its priority");
    }
}

/// An eBPF drift check whose record the loop is copying, a step per turn.
#[derive(Debug)]
struct EbpfCopying {
    started: std::time::Instant,
    start: DriftStart,
}

/// An eBPF drift check on its way (on a thread of its own, ended with the check).
#[derive(Debug)]
struct EbpfTask {
    started: std::time::Instant,
    result: tokio::sync::oneshot::Receiver<DriftFound>,
}

/// An iptables check on its way: what it found per family, from inputs taken at the families'
/// generations (see `IptablesDataplane::finish_drift`).
#[derive(Debug)]
struct IptablesTask {
    started: std::time::Instant,
    result: tokio::sync::oneshot::Receiver<Vec<FamilyDrift>>,
    /// A retry of a check that came back stale: if this one does too, the periodic check waits
    /// for the next period and requests are told to ask again.
    retry: bool,
    /// The requests it answers (`None`: the periodic check, which repairs).
    replies: Option<Vec<Reply>>,
}

/// Starts an iptables check (generate, `iptables-save`, compare) on a thread of its own.
fn start_iptables(
    iptables: &IptablesDataplane,
    snapshot: &Snapshot,
    retry: bool,
    replies: Option<Vec<Reply>>,
) -> Result<IptablesTask, Option<Vec<Reply>>> {
    let inputs = iptables.drift_inputs(snapshot);
    let work = move || inputs.into_iter().map(DriftInput::run).collect();
    // The periodic check in the background; a request at the default priority: someone waits
    // for the answer, and listing the rules is mostly `iptables-save`'s time, not the loop's
    // (the rate limit bounds how often it runs).
    match spawn("drift-check", replies.is_none(), work) {
        Some(result) => Ok(IptablesTask {
            started: std::time::Instant::now(),
            result,
            retry,
            replies,
        }),
        None => Err(replies),
    }
}

/// Where one `/debug/drift` request waits for its JSON answer.
pub type Reply = tokio::sync::oneshot::Sender<String>;

/// The drift checks of the agent's loop: the periodic one (repairs) and those `/debug/drift`
/// asks for (report only). Neither reads nor compares the kernel's state in the loop: both
/// modes read and compare on a thread, and the loop only takes the result — eBPF leaves out the
/// entries it wrote meanwhile and repairs the rest, iptables discards a family whose rules it
/// wrote meanwhile (by generation) and marks the others for a full sync. The requests are rate
/// limited by the metrics server (`/debug/drift`); those that come while a check runs wait for
/// the next one.
#[derive(Debug, Default)]
pub struct DriftChecks {
    /// eBPF: the check whose record is being copied, with the requests it answers (`None`: the
    /// periodic check).
    ebpf_copying: Option<(EbpfCopying, Option<Vec<Reply>>)>,
    /// eBPF: the check in flight, with the requests it answers (`None`: the periodic check).
    ebpf: Option<(EbpfTask, Option<Vec<Reply>>)>,
    /// iptables: the periodic check in flight.
    iptables_periodic: Option<IptablesTask>,
    /// iptables: an on-demand check in flight.
    iptables: Option<IptablesTask>,
    /// Requests for the next on-demand check.
    waiting: Vec<Reply>,
}

/// What [`DriftChecks::done`] returns: a finished check.
#[derive(Debug)]
pub enum Done {
    Ebpf(Result<DriftFound, tokio::sync::oneshot::error::RecvError>),
    IptablesPeriodic(Result<Vec<FamilyDrift>, tokio::sync::oneshot::error::RecvError>),
    Iptables(Result<Vec<FamilyDrift>, tokio::sync::oneshot::error::RecvError>),
}

/// What the loop does after [`DriftChecks::finish`].
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Finished {
    /// iptables drift was found: the families are marked, the full sync that repairs them is
    /// due now.
    pub sync_needed: bool,
    /// A periodic check finished (and repaired what it could): its report, for the health.
    pub periodic: Option<DriftReport>,
}

impl DriftChecks {
    /// No periodic check in flight (nor an eBPF one on demand: both modes' periodic check
    /// waits for it).
    pub fn periodic_idle(&self) -> bool {
        self.ebpf.is_none() && self.ebpf_copying.is_none() && self.iptables_periodic.is_none()
    }

    /// An eBPF check's record is being copied: the loop takes a [`Self::copy_step`] whenever
    /// nothing else is ready.
    pub fn copying(&self) -> bool {
        self.ebpf_copying.is_some()
    }

    /// One step of the eBPF check's record copy; after the last, the check reads and compares
    /// on a thread of its own and [`Self::done`] hands its result back.
    pub fn copy_step(&mut self, dataplane: &mut Dataplane) {
        let Some((copying, replies)) = self.ebpf_copying.take() else {
            return;
        };
        let Dataplane::Ebpf(ebpf) = dataplane else {
            // The mode does not change while the agent runs: nothing to check.
            answer(
                replies.unwrap_or_default(),
                &DriftReport::not_checked("iptables", "an eBPF check in iptables mode"),
            );
            return;
        };
        match ebpf.drift_check_step(copying.start) {
            DriftStep::More(start) => {
                self.ebpf_copying = Some((
                    EbpfCopying {
                        started: copying.started,
                        start,
                    },
                    replies,
                ));
            }
            DriftStep::Ready(job) => {
                self.ebpf = Some((run_ebpf(job, copying.started), replies));
            }
        }
    }

    /// The periodic check, started on a thread (`true`); `false` when the caller must check in
    /// place (maps that cannot be opened, a thread that cannot start).
    pub fn start_periodic(&mut self, dataplane: &mut Dataplane, snapshot: &Snapshot) -> bool {
        self.start_periodic_with(dataplane, snapshot, false)
    }

    fn start_periodic_with(
        &mut self,
        dataplane: &mut Dataplane,
        snapshot: &Snapshot,
        retry: bool,
    ) -> bool {
        match dataplane {
            Dataplane::Ebpf(_) => match begin_ebpf(dataplane) {
                Some(copying) => {
                    self.ebpf_copying = Some((copying, None));
                    true
                }
                None => false,
            },
            Dataplane::Iptables(iptables) => {
                match start_iptables(iptables, snapshot, retry, None) {
                    Ok(task) => {
                        self.iptables_periodic = Some(task);
                        true
                    }
                    Err(_) => false,
                }
            }
        }
    }

    /// A `/debug/drift` request: answered by the next on-demand check (started now unless one
    /// of its kind is in flight).
    pub fn request(&mut self, reply: Reply, dataplane: &mut Dataplane, snapshot: &Snapshot) {
        self.waiting.push(reply);
        self.start_waiting(dataplane, snapshot);
    }

    fn start_waiting(&mut self, dataplane: &mut Dataplane, snapshot: &Snapshot) {
        if self.waiting.is_empty() {
            return;
        }
        match dataplane {
            Dataplane::Ebpf(_) => {
                if self.ebpf.is_some() || self.ebpf_copying.is_some() {
                    return;
                }
                let replies = std::mem::take(&mut self.waiting);
                match begin_ebpf(dataplane) {
                    Some(copying) => self.ebpf_copying = Some((copying, Some(replies))),
                    None => answer(
                        replies,
                        &DriftReport::not_checked("ebpf", "the maps cannot be read"),
                    ),
                }
            }
            Dataplane::Iptables(iptables) => {
                if self.iptables.is_some() {
                    return;
                }
                let replies = std::mem::take(&mut self.waiting);
                self.start_iptables_request(iptables, snapshot, false, replies);
            }
        }
    }

    fn start_iptables_request(
        &mut self,
        iptables: &IptablesDataplane,
        snapshot: &Snapshot,
        retry: bool,
        replies: Vec<Reply>,
    ) {
        match start_iptables(iptables, snapshot, retry, Some(replies)) {
            Ok(task) => self.iptables = Some(task),
            Err(replies) => answer(
                replies.unwrap_or_default(),
                &DriftReport::not_checked("iptables", "cannot start the check"),
            ),
        }
    }

    /// Waits for a check to finish (forever without one: for a `select!` branch).
    pub async fn done(&mut self) -> Done {
        let Self {
            ebpf,
            iptables_periodic,
            iptables,
            ..
        } = self;
        tokio::select! {
            found = async {
                match ebpf {
                    Some((task, _)) => (&mut task.result).await,
                    None => std::future::pending().await,
                }
            } => Done::Ebpf(found),
            found = async {
                match iptables_periodic {
                    Some(task) => (&mut task.result).await,
                    None => std::future::pending().await,
                }
            } => Done::IptablesPeriodic(found),
            found = async {
                match iptables {
                    Some(task) => (&mut task.result).await,
                    None => std::future::pending().await,
                }
            } => Done::Iptables(found),
        }
    }

    /// What finished: settled against what the loop wrote meanwhile (eBPF: entries left out;
    /// iptables: stale families discarded, a stale periodic check retried once), repaired when
    /// periodic, answered to the requests it was for; then the next on-demand check starts if
    /// requests wait — unless the periodic check is due (`periodic_due`): in eBPF mode both
    /// take turns on the same record, and a stream of requests must not keep it from running.
    pub fn finish(
        &mut self,
        done: Done,
        dataplane: &mut Dataplane,
        snapshot: &Snapshot,
        metrics: &Metrics,
        periodic_due: bool,
    ) -> Finished {
        let mut finished = Finished::default();
        match done {
            Done::Ebpf(found) => {
                if let Some((task, replies)) = self.ebpf.take() {
                    let report = match (found, &mut *dataplane) {
                        (Ok(found), Dataplane::Ebpf(ebpf)) => {
                            let repair = replies.is_none();
                            let check = ebpf.finish_drift_check(found, repair);
                            report_ebpf(check, repair, metrics, task.started)
                        }
                        (Ok(_), Dataplane::Iptables(_)) => {
                            DriftReport::not_checked("iptables", "an eBPF check in iptables mode")
                        }
                        (Err(error), dataplane) => {
                            warn!(%error, "the drift check failed");
                            if let Dataplane::Ebpf(ebpf) = dataplane {
                                ebpf.abandon_drift_check();
                            }
                            DriftReport::not_checked(dataplane.mode_name(), "the check failed")
                        }
                    };
                    match replies {
                        Some(replies) => answer(replies, &report),
                        None => finished.periodic = Some(report),
                    }
                }
            }
            Done::IptablesPeriodic(found) => {
                if let Some(task) = self.iptables_periodic.take() {
                    match (found, &mut *dataplane) {
                        (Ok(found), Dataplane::Iptables(iptables)) => {
                            let settled = iptables.finish_drift(found, true);
                            finished.sync_needed = !settled.drift.is_empty();
                            report_iptables_repair(&settled.drift, metrics);
                            let stale = !settled.stale.is_empty();
                            log_stale(&settled.stale, task.retry);
                            finished.periodic = Some(iptables_report(settled.drift, task.started));
                            if stale && !task.retry {
                                self.start_periodic_with(dataplane, snapshot, true);
                            }
                        }
                        (Ok(_), Dataplane::Ebpf(_)) => {}
                        (Err(error), _) => warn!(%error, "the iptables drift check failed"),
                    }
                }
            }
            Done::Iptables(found) => {
                if let Some(task) = self.iptables.take() {
                    let replies = task.replies.unwrap_or_default();
                    match (found, &mut *dataplane) {
                        (Ok(found), Dataplane::Iptables(iptables)) => {
                            let settled = iptables.finish_drift(found, false);
                            log_stale(&settled.stale, task.retry);
                            if settled.stale.is_empty() {
                                answer(replies, &iptables_report(settled.drift, task.started));
                            } else if !task.retry {
                                self.start_iptables_request(iptables, snapshot, true, replies);
                            } else {
                                answer(
                                    replies,
                                    &DriftReport::not_checked(
                                        "iptables",
                                        "the rules were written during the check; ask again",
                                    ),
                                );
                            }
                        }
                        (found, dataplane) => {
                            if let Err(error) = found {
                                warn!(%error, "the iptables drift check failed");
                            }
                            answer(
                                replies,
                                &DriftReport::not_checked(
                                    dataplane.mode_name(),
                                    "the check failed",
                                ),
                            );
                        }
                    }
                }
            }
        }
        if !(periodic_due && self.periodic_idle()) {
            self.start_waiting(dataplane, snapshot);
        }
        finished
    }
}

/// Sends `report` to every request (those that gave up are skipped).
fn answer(replies: Vec<Reply>, report: &DriftReport) {
    let json = serde_json::to_string(report).unwrap_or_default();
    for reply in replies {
        let _ = reply.send(json.clone());
    }
}

/// Families whose rules the loop wrote while their check listed them: their result is stale.
fn log_stale(stale: &[proxy_model::desired::IpFamily], retried: bool) {
    if !stale.is_empty() {
        debug!(
            families = ?stale,
            retried,
            "iptables rules were written during the drift check; its result for them is stale"
        );
    }
}

fn report_ebpf(
    check: Result<DriftCheck, DriftNotChecked>,
    repair: bool,
    metrics: &Metrics,
    started: std::time::Instant,
) -> DriftReport {
    let check = match check {
        Ok(check) => check,
        Err(why) => {
            debug!(%why, "eBPF drift check not compared");
            return DriftReport::not_checked("ebpf", &why.to_string());
        }
    };
    if repair {
        for drift in &check.drift {
            warn!(
                map = drift.map,
                kind = %drift.kind,
                entry = %drift.entry,
                expected = drift.expected.as_deref().unwrap_or("-"),
                found = drift.found.as_deref().unwrap_or("-"),
                "BPF map entry drifted from what the agent wrote; repairing it"
            );
        }
        for (map, error) in &check.repair.errors {
            warn!(map, %error, "repairing a drifted BPF map entry failed; retrying next check");
        }
        if let Some(ebpf_metrics) = metrics.ebpf() {
            for (map, repaired) in &check.repair.repaired {
                ebpf_metrics.drift_repaired(map, *repaired);
            }
        }
    }
    debug!(
        entries = check.entries_compared,
        drifted = check.drift.len(),
        elapsed_us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX),
        "drift check done"
    );
    DriftReport {
        mode: "ebpf".to_owned(),
        checked: true,
        note: None,
        repair_errors: check.repair.errors.len(),
        entries_compared: check.entries_compared,
        drift: check
            .drift
            .into_iter()
            .map(|drift| DriftEntry {
                map: drift.map.to_owned(),
                kind: drift.kind.to_string(),
                entry: drift.entry,
                expected: drift.expected,
                found: drift.found,
            })
            .collect(),
    }
}

/// One check of the iptables rules, in the calling thread; with `repair`, the families that
/// differ get a full sync next (the caller requests one when the report has drift).
pub fn check_iptables(
    iptables: &mut IptablesDataplane,
    snapshot: &Snapshot,
    repair: bool,
    metrics: &Metrics,
) -> DriftReport {
    let started = std::time::Instant::now();
    let drift = iptables.check_drift(snapshot, repair);
    if repair {
        report_iptables_repair(&drift, metrics);
    }
    iptables_report(drift, started)
}

/// The iptables drift a periodic check repairs (with a full sync): logged and counted.
fn report_iptables_repair(
    drift: &[(
        proxy_model::desired::IpFamily,
        proxy_dataplane_iptables::rules_drift::ChainDrift,
    )],
    metrics: &Metrics,
) {
    for (family, chain) in drift {
        warn!(
            family = family.as_k8s(),
            table = chain.table,
            kind = chain.kind,
            chain = %chain.chain,
            expected = chain.expected.as_deref().unwrap_or("-"),
            found = chain.found.as_deref().unwrap_or("-"),
            "iptables chain drifted from what the agent writes; repairing it with a full sync"
        );
        if let Some(iptables_metrics) = metrics.iptables() {
            iptables_metrics.drift_repaired(*family, chain.table, 1);
        }
    }
}

fn iptables_report(
    drift: Vec<(
        proxy_model::desired::IpFamily,
        proxy_dataplane_iptables::rules_drift::ChainDrift,
    )>,
    started: std::time::Instant,
) -> DriftReport {
    debug!(
        drifted = drift.len(),
        elapsed_us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX),
        "iptables drift check done"
    );
    DriftReport {
        mode: "iptables".to_owned(),
        checked: true,
        note: None,
        repair_errors: 0,
        entries_compared: 0,
        drift: drift
            .into_iter()
            .map(|(family, chain)| DriftEntry {
                map: format!("{} {}", family.as_k8s(), chain.table),
                kind: chain.kind.to_owned(),
                entry: chain.chain,
                expected: chain.expected,
                found: chain.found,
            })
            .collect(),
    }
}
