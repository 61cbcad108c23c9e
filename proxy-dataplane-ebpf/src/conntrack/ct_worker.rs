//! The tc conntrack's garbage collection and purges on a thread of their own, off the sync
//! loop: a purge walks the whole map (about 0.5 s at the default size) and must never hold up
//! a sync. The worker opens the pinned map itself; jobs come over a channel and run in order,
//! each a round of resumable batches (`tc_conntrack::CtWalk`). Reports are kept for the metrics and
//! logged.

use std::{
    path::Path,
    sync::{
        Arc, Mutex, PoisonError,
        mpsc::{self, Receiver, Sender},
    },
    thread::JoinHandle,
};

use aya::maps::{Map, MapData};
use proxy_common::{PortFilter, map_names};
use tracing::{debug, info, warn};

use crate::{
    conntrack::tc_conntrack::{self, ConntrackPair, GcReport},
    maps::map_writer::RemovedBackend,
};

/// Entries per batch: one batch holds the map's lock of a bucket range only briefly, and the
/// rest of the datapath's work goes on between batches.
const BATCH: usize = 4096;

enum Job {
    Gc,
    Purge(Vec<RemovedBackend>),
}

/// What the worker did so far.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct WorkerReports {
    /// The last finished garbage collection round.
    pub last_gc: Option<GcReport>,
    /// Garbage collection rounds finished.
    pub gc_rounds: u64,
    /// Entries deleted by purges, in total.
    pub purged: u64,
}

/// Handle of the worker thread; dropping it ends the thread after its current job.
#[derive(Debug)]
pub struct CtWorker {
    jobs: Option<Sender<Job>>,
    reports: Arc<Mutex<WorkerReports>>,
    /// The ports of the entries the last finished garbage collection round kept, until taken.
    ports: Arc<Mutex<Option<Box<PortFilter>>>>,
    thread: Option<JoinHandle<()>>,
}

impl CtWorker {
    /// Starts the worker on the conntrack maps pinned in `pin_dir`.
    pub fn start(pin_dir: &Path) -> std::io::Result<Self> {
        let open = |name: &str| {
            MapData::from_pin(pin_dir.join(name))
                .and_then(Map::from_map_data)
                .map_err(std::io::Error::other)
        };
        let maps = [
            open(map_names::CT4)?,
            open(map_names::CT6)?,
            open(map_names::CT4_NEW)?,
            open(map_names::CT6_NEW)?,
        ];
        let (jobs, queue) = mpsc::channel();
        let reports = Arc::new(Mutex::new(WorkerReports::default()));
        let ports = Arc::new(Mutex::new(None));
        let shared = (Arc::clone(&reports), Arc::clone(&ports));
        let thread = std::thread::Builder::new()
            .name("kpr-conntrack".into())
            .spawn(move || run(maps, &queue, &shared.0, &shared.1))?;
        Ok(Self {
            jobs: Some(jobs),
            reports,
            ports,
            thread: Some(thread),
        })
    }

    /// Queues a garbage collection round.
    pub fn gc(&self) {
        self.send(Job::Gc);
    }

    /// Queues a purge of the entries of `removed` backends.
    pub fn purge(&self, removed: Vec<RemovedBackend>) {
        self.send(Job::Purge(removed));
    }

    fn send(&self, job: Job) {
        if let Some(jobs) = &self.jobs
            && jobs.send(job).is_err()
        {
            warn!("the conntrack worker is gone; garbage collection and purges stopped");
        }
    }

    /// The ports of the conntrack entries the last finished garbage collection round kept,
    /// once per round.
    pub fn take_ports(&self) -> Option<Box<PortFilter>> {
        self.ports
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    pub fn reports(&self) -> WorkerReports {
        *self.reports.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for CtWorker {
    fn drop(&mut self) {
        // Closing the channel ends the thread's loop.
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn run(
    maps: [Map; 4],
    queue: &Receiver<Job>,
    reports: &Mutex<WorkerReports>,
    ports: &Mutex<Option<Box<PortFilter>>>,
) {
    let [mut v4, mut v6, mut new4, mut new6] = maps;
    let mut map = ConntrackPair {
        v4: &mut v4,
        v6: &mut v6,
        new4: &mut new4,
        new6: &mut new6,
    };
    while let Ok(job) = queue.recv() {
        let started = std::time::Instant::now();
        match job {
            Job::Gc => {
                let now = match tc_conntrack::monotonic_ns() {
                    Ok(now) => now,
                    Err(error) => {
                        warn!(%error, "reading the monotonic clock; conntrack GC skipped");
                        continue;
                    }
                };
                let mut kept_ports = Box::new(PortFilter::EMPTY);
                match tc_conntrack::gc_round(&mut map, now, BATCH, &mut kept_ports) {
                    Ok(report) => {
                        *ports.lock().unwrap_or_else(PoisonError::into_inner) = Some(kept_ports);
                        let deleted = report.deleted_forward + report.deleted_reply;
                        let elapsed_ms = started.elapsed().as_millis();
                        if deleted > 0 {
                            info!(
                                scanned = report.scanned,
                                deleted_forward = report.deleted_forward,
                                deleted_reply = report.deleted_reply,
                                remaining = report.remaining,
                                elapsed_ms,
                                "tc conntrack garbage collected"
                            );
                        } else {
                            debug!(
                                scanned = report.scanned,
                                elapsed_ms, "tc conntrack garbage collection: nothing expired"
                            );
                        }
                        let mut shared = reports.lock().unwrap_or_else(PoisonError::into_inner);
                        shared.last_gc = Some(report);
                        shared.gc_rounds += 1;
                    }
                    Err(error) => warn!(%error, "tc conntrack garbage collection failed"),
                }
            }
            Job::Purge(removed) => match tc_conntrack::purge_round(&mut map, &removed, BATCH) {
                Ok(report) => {
                    info!(
                        removed_backends = removed.len(),
                        scanned = report.scanned,
                        deleted = report.deleted,
                        elapsed_ms = started.elapsed().as_millis(),
                        "tc conntrack entries of removed backends purged"
                    );
                    reports
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .purged += report.deleted as u64;
                }
                Err(error) => {
                    warn!(%error, "cannot purge the tc conntrack; stale entries age out instead");
                }
            },
        }
    }
}
