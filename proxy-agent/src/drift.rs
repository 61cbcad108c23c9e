//! The agent's drift check: on a timer (`--drift-check-period`) the loop compares the kernel's
//! state with what it wrote and repairs the difference, counting each repaired entry in
//! `kubeproxy_ebpf_drift_repairs_total{map}` with a WARN naming it; `/debug/drift` (for
//! `proxy-agent inspect drift`) runs the same comparison without repairing.
//!
//! eBPF mode compares every entry of the service maps (`dataplane::ebpf::drift`); iptables mode
//! the canary and every chain a full sync writes, rule by rule (`dataplane::iptables::drift`),
//! repaired by a full sync (`kubeproxy_iptables_drift_repairs_total{ip_family,table}`).

use serde::{Deserialize, Serialize};
use tracing::{debug, warn};

use crate::{
    dataplane::{
        Dataplane,
        ebpf::{DriftCheck, DriftReading, EbpfDataplane},
        iptables::IptablesDataplane,
    },
    desired::Snapshot,
    node_services::metrics::Metrics,
};

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
}

impl DriftReport {
    pub fn not_checked(mode: &str, note: &str) -> Self {
        DriftReport {
            mode: mode.to_owned(),
            checked: false,
            note: Some(note.to_owned()),
            entries_compared: 0,
            drift: Vec::new(),
        }
    }
}

/// One check of whichever dataplane runs; with `repair`, what differs is fixed (iptables: the
/// caller requests the full sync that repairs it).
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

/// eBPF mode: the drift check's reading, started on a blocking thread so that the loop keeps
/// syncing meanwhile (see `dataplane::ebpf::drift_reader`); `None` in iptables mode or when
/// the maps cannot be opened (logged), so the caller checks in place.
pub fn start_reading(dataplane: &mut Dataplane) -> Option<ReadingTask> {
    let Dataplane::Ebpf(ebpf) = dataplane else {
        return None;
    };
    let reader = match ebpf.start_drift_read() {
        Ok(reader) => reader,
        Err(error) => {
            warn!(%error, "cannot start the drift check's reading; checking in the loop");
            return None;
        }
    };
    let (done, result) = tokio::sync::oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name("drift-read".into())
        .spawn(move || {
            lower_priority();
            // The receiver is gone only when the agent is shutting down.
            let _ = done.send(reader.read());
        });
    match spawned {
        Ok(_) => Some(ReadingTask {
            started: std::time::Instant::now(),
            result,
        }),
        Err(error) => {
            warn!(%error, "cannot start the drift check's reading; checking in the loop");
            ebpf.abandon_drift_read();
            None
        }
    }
}

/// A reading that failed on its thread: nothing will be compared.
pub fn abandon_reading(dataplane: &mut Dataplane) {
    if let Dataplane::Ebpf(ebpf) = dataplane {
        ebpf.abandon_drift_read();
    }
}

/// Nice 10 for the calling thread (Linux: per thread). The reading is background work that
/// reads every entry of every map (hundreds of milliseconds of CPU at 50k Services, mostly in
/// the kernel); at the default priority it took half of a two-core node from the loop's syncs.
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
        debug!(error = %std::io::Error::last_os_error(), "drift reading keeps its priority");
    }
}

/// A drift reading on its way (on a thread of its own, ended with the reading).
#[derive(Debug)]
pub struct ReadingTask {
    started: std::time::Instant,
    result: tokio::sync::oneshot::Receiver<DriftReading>,
}

/// Compares a finished reading with the agent's state; with `repair`, repairs what differs.
pub fn finish_reading(
    dataplane: &mut Dataplane,
    task: ReadingTask,
    reading: DriftReading,
    repair: bool,
    metrics: &Metrics,
) -> DriftReport {
    let Dataplane::Ebpf(ebpf) = dataplane else {
        return DriftReport::not_checked("iptables", "an eBPF reading in iptables mode");
    };
    let check = ebpf.finish_drift_check(reading, repair);
    report_ebpf(check, repair, metrics, task.started)
}

/// Where one `/debug/drift` request waits for its JSON answer.
pub type Reply = tokio::sync::oneshot::Sender<String>;

/// The drift checks of the agent's loop: the periodic one (repairs) and those `/debug/drift`
/// asks for (report only). Neither reads the kernel's state in the loop: eBPF reads the maps on
/// a thread ([`start_reading`]) and compares in the loop as the periodic check does; iptables
/// generates, lists and compares its rules on a thread. The requests are rate limited by the
/// metrics server (`/debug/drift`); those that come while a check runs wait for the next one.
#[derive(Debug, Default)]
pub struct DriftChecks {
    /// eBPF: the reading in flight, with the requests it answers (`None`: the periodic check).
    reading: Option<(ReadingTask, Option<Vec<Reply>>)>,
    /// iptables: an on-demand check on its thread, with the requests it answers.
    iptables: Option<(tokio::sync::oneshot::Receiver<DriftReport>, Vec<Reply>)>,
    /// Requests for the next on-demand check.
    waiting: Vec<Reply>,
}

/// What [`DriftChecks::done`] returns: a finished eBPF reading or iptables check.
#[derive(Debug)]
pub enum Done {
    Reading(Result<DriftReading, tokio::sync::oneshot::error::RecvError>),
    Iptables(Result<DriftReport, tokio::sync::oneshot::error::RecvError>),
}

impl DriftChecks {
    /// No eBPF reading in flight: the periodic check may start one.
    pub fn reading_idle(&self) -> bool {
        self.reading.is_none()
    }

    /// The periodic check: eBPF starts a reading (`true`); `false` when the caller must check
    /// in place (iptables, or maps that cannot be opened).
    pub fn start_periodic(&mut self, dataplane: &mut Dataplane) -> bool {
        match start_reading(dataplane) {
            Some(task) => {
                self.reading = Some((task, None));
                true
            }
            None => false,
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
                if self.reading.is_some() {
                    return;
                }
                let replies = std::mem::take(&mut self.waiting);
                match start_reading(dataplane) {
                    Some(task) => self.reading = Some((task, Some(replies))),
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
                let inputs = iptables.drift_inputs(snapshot);
                let (done, result) = tokio::sync::oneshot::channel();
                let spawned = std::thread::Builder::new()
                    .name("drift-check".into())
                    // At the default priority: someone waits for the answer (the rate
                    // limit bounds what it costs).
                    .spawn(move || {
                        let _ = done.send(compare_iptables(&inputs));
                    });
                match spawned {
                    Ok(_) => self.iptables = Some((result, replies)),
                    Err(error) => answer(
                        replies,
                        &DriftReport::not_checked(
                            "iptables",
                            &format!("cannot start the check: {error}"),
                        ),
                    ),
                }
            }
        }
    }

    /// Waits for a reading or an on-demand check to finish (forever without one: for a
    /// `select!` branch).
    pub async fn done(&mut self) -> Done {
        let Self {
            reading, iptables, ..
        } = self;
        tokio::select! {
            reading = async {
                match reading {
                    Some((task, _)) => (&mut task.result).await,
                    None => std::future::pending().await,
                }
            } => Done::Reading(reading),
            report = async {
                match iptables {
                    Some((result, _)) => result.await,
                    None => std::future::pending().await,
                }
            } => Done::Iptables(report),
        }
    }

    /// What finished: compared (eBPF; repaired when periodic), answered to the requests it
    /// was for; then the next on-demand check starts if requests wait.
    pub fn finish(
        &mut self,
        done: Done,
        dataplane: &mut Dataplane,
        snapshot: &Snapshot,
        metrics: &Metrics,
    ) {
        match done {
            Done::Reading(reading) => {
                if let Some((task, replies)) = self.reading.take() {
                    let report = match reading {
                        Ok(reading) => {
                            finish_reading(dataplane, task, reading, replies.is_none(), metrics)
                        }
                        Err(error) => {
                            warn!(%error, "the drift check's reading failed");
                            abandon_reading(dataplane);
                            DriftReport::not_checked(dataplane.mode_name(), "the reading failed")
                        }
                    };
                    if let Some(replies) = replies {
                        answer(replies, &report);
                    }
                }
            }
            Done::Iptables(report) => {
                if let Some((_, replies)) = self.iptables.take() {
                    let report = report.unwrap_or_else(|_| {
                        DriftReport::not_checked("iptables", "the check failed")
                    });
                    answer(replies, &report);
                }
            }
        }
        self.start_waiting(dataplane, snapshot);
    }
}

/// Sends `report` to every request (those that gave up are skipped).
fn answer(replies: Vec<Reply>, report: &DriftReport) {
    let json = serde_json::to_string(report).unwrap_or_default();
    for reply in replies {
        let _ = reply.send(json.clone());
    }
}

/// An on-demand iptables check, on its own thread: nothing is repaired.
fn compare_iptables(inputs: &[crate::dataplane::iptables::DriftInput]) -> DriftReport {
    let started = std::time::Instant::now();
    let mut drift = Vec::new();
    for input in inputs {
        if let Some((found, _)) = input.compare() {
            drift.extend(found.into_iter().map(|chain| (input.family(), chain)));
        }
    }
    iptables_report(drift, started)
}

fn report_ebpf(
    check: Option<DriftCheck>,
    repair: bool,
    metrics: &Metrics,
    started: std::time::Instant,
) -> DriftReport {
    let Some(check) = check else {
        return DriftReport::not_checked(
            "ebpf",
            "an adopted frontend is damaged; the next full sync rewrites it",
        );
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

/// One check of the iptables rules; with `repair`, the families that differ get a full sync
/// next (the caller requests one when the report has drift).
pub fn check_iptables(
    iptables: &mut IptablesDataplane,
    snapshot: &Snapshot,
    repair: bool,
    metrics: &Metrics,
) -> DriftReport {
    let started = std::time::Instant::now();
    let drift = iptables.check_drift(snapshot, repair);
    if repair {
        for (family, chain) in &drift {
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
    iptables_report(drift, started)
}

fn iptables_report(
    drift: Vec<(
        crate::desired::IpFamily,
        crate::dataplane::iptables::drift::ChainDrift,
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
