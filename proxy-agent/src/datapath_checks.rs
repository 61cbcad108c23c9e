//! The datapath's health checks, run with the drift check (on its timer, not per scrape) and
//! recorded for `/healthz` (`http_servers::datapath`).
//!
//! eBPF mode, at each periodic drift check:
//! 1. the self-test (`dataplane::ebpf::self_test`: a synthetic SYN through each external
//!    interface's ingress program, which must come out addressed to a backend) — first, so that
//!    it sees what is broken before anything repairs it (a detached program, a corrupted entry);
//! 2. the attachments: each wanted tc hook is asked whether our program is still in it, and
//!    what went missing is attached again (as a sync does);
//! 3. when the self-test failed, again at once (what the re-attach repaired passes now), and
//!    once more when the drift check's repair is done: only a failure that outlives every
//!    repair makes `/healthz` 503.
//!
//! The self-test costs a hook query and a run or two per external interface (microseconds):
//! it runs in the loop, at most every [`MIN_SELF_TEST_INTERVAL`] for the periodic run.
//! iptables mode records the canary's and the drift check's last results.

use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use crate::{
    dataplane::Dataplane,
    drift_checks::DriftReport,
    http_servers::{
        datapath::{
            Attachments, Canary, DatapathHealth, DriftCheckState, Hook, MAX_REATTACHED_LISTED,
            Maps, Probe, Reattached, SelfTestState,
        },
        health::{ProxyHealth, json_time},
    },
};
use proxy_dataplane_ebpf::{Attachment, ProbeOutcome, SelfTest};
use proxy_model::{desired::IpFamily, time_format::Stamp};

/// The periodic self-test runs at most this often, whatever `--drift-check-period` says; the
/// runs after a repair are not limited (at most two per check).
pub const MIN_SELF_TEST_INTERVAL: Duration = Duration::from_secs(1);

/// The datapath's state as the checks left it, published to the health server after each.
#[derive(Debug)]
pub struct DatapathChecks {
    state: DatapathHealth,
    last_self_test: Option<Instant>,
    /// The failed probes of a self-test that still failed after the re-attach, waiting for
    /// the drift check's repair before they count.
    pending: Option<Vec<Probe>>,
}

impl DatapathChecks {
    /// The state before any check, published at once so `/healthz` shows the mode.
    pub fn new(dataplane: &Dataplane, health: &ProxyHealth) -> Self {
        let mut state = DatapathHealth::new(dataplane.mode_name());
        if matches!(dataplane, Dataplane::Ebpf(_)) {
            state.self_test = Some(None);
        }
        health.set_datapath(state.clone());
        Self {
            state,
            last_self_test: None,
            pending: None,
        }
    }

    fn publish(&mut self, health: &ProxyHealth) {
        let was_healthy = self.state.healthy;
        self.state.evaluate();
        if was_healthy && !self.state.healthy {
            warn!(reasons = ?self.state.reasons, "datapath unhealthy: Service traffic is affected and the agent could not repair it");
        } else if !was_healthy && self.state.healthy {
            info!("datapath healthy again");
        }
        health.set_datapath(self.state.clone());
    }

    /// Before the periodic drift check starts: the self-test, the attachments (repaired), the
    /// self-test again if it failed.
    pub fn before_drift_check(&mut self, dataplane: &mut Dataplane, health: &ProxyHealth) {
        let Dataplane::Ebpf(ebpf) = dataplane else {
            return;
        };
        let now = health.now();
        let due = self
            .last_self_test
            .is_none_or(|last| last.elapsed() >= MIN_SELF_TEST_INTERVAL);
        let started = Instant::now();
        let before = due.then(|| {
            self.last_self_test = Some(Instant::now());
            ebpf.self_test()
        });
        let self_tested = started.elapsed();
        let (attachments, reattached) = ebpf.check_attachments();
        // In the agent's loop: what a change that comes meanwhile waits for.
        debug!(
            self_test_us = u64::try_from(self_tested.as_micros()).unwrap_or(u64::MAX),
            attachments_us =
                u64::try_from((started.elapsed() - self_tested).as_micros()).unwrap_or(u64::MAX),
            "datapath checks before the drift check"
        );
        self.record_attachments(now, &attachments, &reattached);
        let missing = ebpf.missing_map_pins();
        self.state.maps = Some(Maps {
            present: missing.is_empty(),
            missing: missing.into_iter().map(str::to_owned).collect(),
        });
        match before {
            Some(before) if !before.passed() => {
                warn!(
                    failed = ?failures(&before),
                    "datapath self-test failed; testing again after the repairs"
                );
                let failed = failed_probes(&before);
                let after = ebpf.self_test();
                if after.passed() {
                    self.record_self_test(now, &after, failed);
                } else {
                    // Not published yet: the drift check's repair may still fix it, and until
                    // it is done a failure is not one the agent could not repair.
                    self.pending = Some(failed);
                }
            }
            Some(before) => self.record_self_test(now, &before, Vec::new()),
            None => {}
        }
        self.publish(health);
    }

    /// The periodic drift check's result (repaired when it could be); eBPF: the self-test
    /// again when it was failing or the check repaired something.
    pub fn after_drift_check(
        &mut self,
        report: &DriftReport,
        dataplane: &mut Dataplane,
        health: &ProxyHealth,
    ) {
        let now = health.now();
        let result = if !report.checked {
            "notChecked"
        } else if report.drift.is_empty() {
            "ok"
        } else if report.repair_errors > 0 {
            "repairFailed"
        } else {
            "repaired"
        };
        self.state.last_drift_check = Some(DriftCheckState {
            time: json_time(Some(now)),
            result,
            drifted: report.drift.len(),
            note: report.note.clone(),
        });
        if let Dataplane::Ebpf(ebpf) = dataplane {
            let failing = matches!(&self.state.self_test, Some(Some(test)) if !test.passed);
            if self.pending.is_some() || failing || !report.drift.is_empty() {
                let before = self.pending.take().unwrap_or_else(|| self.failed_probes());
                let after = ebpf.self_test();
                self.record_self_test(now, &after, before);
            }
        }
        self.publish(health);
    }

    /// iptables: the canary check's result (`ok`: the chains were there).
    pub fn canary_checked(&mut self, ok: bool, health: &ProxyHealth) {
        self.state.canary = Some(Canary {
            time: json_time(Some(health.now())),
            ok,
        });
        self.publish(health);
    }

    fn record_attachments(
        &mut self,
        now: Stamp,
        attachments: &[Attachment],
        reattached: &[Attachment],
    ) {
        let time = json_time(Some(now));
        let mut listed = self
            .state
            .attachments
            .take()
            .map(|a| a.reattached)
            .unwrap_or_default();
        listed.extend(reattached.iter().map(|found| Reattached {
            time: time.clone(),
            interface: found.interface.clone(),
            hook: found.hook,
            program: found.program,
            repaired: found.attached,
            error: found.error.clone(),
        }));
        let excess = listed.len().saturating_sub(MAX_REATTACHED_LISTED);
        listed.drain(..excess);
        self.state.attachments = Some(Attachments {
            time,
            expected: attachments.len(),
            attached: attachments.iter().filter(|a| a.attached).count(),
            hooks: attachments
                .iter()
                .map(|a| Hook {
                    interface: a.interface.clone(),
                    hook: a.hook,
                    program: a.program,
                    attached: a.attached,
                    program_id: a.program_id,
                    error: a.error.clone(),
                })
                .collect(),
            reattached: listed,
        });
    }

    fn failed_probes(&self) -> Vec<Probe> {
        match &self.state.self_test {
            Some(Some(test)) => test
                .programs
                .iter()
                .filter(|probe| probe.result == "failed")
                .cloned()
                .collect(),
            _ => Vec::new(),
        }
    }

    /// `before`: the failed probes of the run before a repair (empty: no repair in between).
    fn record_self_test(&mut self, now: Stamp, test: &SelfTest, before: Vec<Probe>) {
        if !test.passed() {
            warn!(failed = ?failures(test), "datapath self-test failed");
        }
        self.state.self_test = Some(Some(SelfTestState {
            time: json_time(Some(now)),
            passed: test.passed(),
            after_repair: !before.is_empty(),
            programs: probes(test),
            failed_before_repair: before,
        }));
    }
}

fn failed_probes(test: &SelfTest) -> Vec<Probe> {
    probes(test)
        .into_iter()
        .filter(|probe| probe.result == "failed")
        .collect()
}

fn failures(test: &SelfTest) -> Vec<String> {
    test.probes
        .iter()
        .filter_map(|probe| match &probe.outcome {
            ProbeOutcome::Failed(why) => Some(format!("{}: {why}", probe.interface)),
            _ => None,
        })
        .collect()
}

fn probes(test: &SelfTest) -> Vec<Probe> {
    test.probes
        .iter()
        .map(|probe| {
            let (result, reason) = match &probe.outcome {
                ProbeOutcome::Passed => ("passed", None),
                ProbeOutcome::Failed(why) => ("failed", Some(why.clone())),
                ProbeOutcome::Skipped(why) => ("skipped", Some(why.clone())),
            };
            Probe {
                interface: probe.interface.clone(),
                program: probe.program,
                program_id: probe.program_id,
                family: probe.family.map(IpFamily::as_k8s),
                frontend: probe.frontend.clone(),
                translated_to: probe.translated_to.map(|to| to.to_string()),
                result,
                reason,
            }
        })
        .collect()
}
