//! The datapath's own state in `/healthz`'s body (`datapath`, after kube-proxy's fields) and
//! the one rule that lets it turn `/healthz` to 503: Service traffic is affected and the agent
//! could not repair it. A program missing from its hook is repaired (attached again), a
//! drifted map entry too (the drift check); both are reported in `reasons` and stay 200. What
//! stays broken after the repair — an attachment that fails again, a self-test probe that
//! still is not translated to a backend — is 503. Pure: the agent's loop records what its
//! checks found (`crate::datapath_checks`), this decides and serializes.

use serde::Serialize;

/// How many re-attachments the body lists (the latest).
pub const MAX_REATTACHED_LISTED: usize = 8;

/// `datapath` in `/healthz`'s body.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DatapathHealth {
    /// `ebpf` or `iptables`.
    pub mode: &'static str,
    /// False only when Service traffic is affected and could not be repaired.
    pub healthy: bool,
    /// What was found: what makes it unhealthy, and what was found broken and repaired.
    pub reasons: Vec<String>,
    /// eBPF: the tc hooks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attachments: Option<Attachments>,
    /// eBPF: the pinned maps.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub maps: Option<Maps>,
    /// iptables: the canary chains' last check.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub canary: Option<Canary>,
    /// `null` before the first check.
    pub last_drift_check: Option<DriftCheckState>,
    /// eBPF: `null` before the first self-test.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub self_test: Option<Option<SelfTestState>>,
}

/// The tc attachments as the last check (drift timer or sync) left them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Attachments {
    /// When they were last checked in their hooks.
    pub time: String,
    /// Hooks that should run one of our programs.
    pub expected: usize,
    /// Of those, hooks that do.
    pub attached: usize,
    pub hooks: Vec<Hook>,
    /// The latest programs found detached behind the agent's back, and what became of them.
    pub reattached: Vec<Reattached>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Hook {
    pub interface: String,
    /// `ingress` or `egress`.
    pub hook: &'static str,
    pub program: &'static str,
    pub attached: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub program_id: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Reattached {
    /// When the agent found it detached.
    pub time: String,
    pub interface: String,
    pub hook: &'static str,
    pub program: &'static str,
    /// Attached again.
    pub repaired: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Maps {
    /// Every map the agent pins is pinned.
    pub present: bool,
    pub missing: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Canary {
    pub time: String,
    /// The canary chains were in place (else another tool flushed the rules: a full sync
    /// restores them).
    pub ok: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DriftCheckState {
    pub time: String,
    /// `ok`, `repaired`, `repairFailed` or `notChecked`.
    pub result: &'static str,
    /// Entries (eBPF) or chains (iptables) that differed from what the agent wrote.
    pub drifted: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SelfTestState {
    pub time: String,
    /// No probe failed.
    pub passed: bool,
    /// Run again after a repair (attach, drift) because the run before it failed.
    pub after_repair: bool,
    pub programs: Vec<Probe>,
    /// The failed probes of the run before the repair (with `afterRepair`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub failed_before_repair: Vec<Probe>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Probe {
    pub interface: String,
    pub program: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub program_id: Option<u32>,
    /// `IPv4` or `IPv6`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub family: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frontend: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub translated_to: Option<String>,
    /// `passed`, `failed` or `skipped`.
    pub result: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl Probe {
    fn failed(&self) -> bool {
        self.result == "failed"
    }

    fn describe(&self) -> String {
        let mut text = format!("{} on {}", self.program, self.interface);
        if let Some(frontend) = &self.frontend {
            text.push_str(&format!(" to {frontend}"));
        }
        if let Some(reason) = &self.reason {
            text.push_str(&format!(": {reason}"));
        }
        text
    }
}

impl DatapathHealth {
    /// The state before any check: healthy, nothing known yet.
    pub fn new(mode: &'static str) -> Self {
        Self {
            mode,
            healthy: true,
            ..Self::default()
        }
    }

    /// Decides `healthy` and `reasons` from what the checks recorded.
    pub fn evaluate(&mut self) {
        let mut broken = Vec::new();
        let mut notes = Vec::new();
        if let Some(attachments) = &self.attachments {
            for hook in attachments.hooks.iter().filter(|hook| !hook.attached) {
                broken.push(format!(
                    "{} is not attached to {} {}{}",
                    hook.program,
                    hook.interface,
                    hook.hook,
                    hook.error
                        .as_ref()
                        .map(|error| format!(" and could not be attached again: {error}"))
                        .unwrap_or_default()
                ));
            }
            for found in attachments
                .reattached
                .iter()
                .filter(|found| found.repaired && found.time == attachments.time)
            {
                notes.push(format!(
                    "{} was detached from {} {} behind the agent's back and attached again",
                    found.program, found.interface, found.hook
                ));
            }
        }
        if let Some(Some(test)) = &self.self_test {
            for probe in test.programs.iter().filter(|probe| probe.failed()) {
                let after = if test.after_repair {
                    " (still, after the repair)"
                } else {
                    ""
                };
                broken.push(format!("self-test failed{after}: {}", probe.describe()));
            }
            if test.passed {
                for probe in &test.failed_before_repair {
                    notes.push(format!(
                        "self-test failed before the repair, passes after it: {}",
                        probe.describe()
                    ));
                }
            }
        }
        if let Some(drift) = &self.last_drift_check {
            match drift.result {
                "repaired" => notes.push(format!(
                    "the drift check found {} entries that differed from what the agent wrote \
                     and repaired them",
                    drift.drifted
                )),
                "repairFailed" => notes.push(format!(
                    "the drift check found {} differing entries and could not repair all of \
                     them{}; retried at the next check",
                    drift.drifted,
                    drift
                        .note
                        .as_ref()
                        .map(|note| format!(": {note}"))
                        .unwrap_or_default()
                )),
                _ => {}
            }
        }
        if let Some(maps) = &self.maps
            && !maps.present
        {
            notes.push(format!(
                "pinned maps missing (traffic unaffected; the next start cannot adopt them): {}",
                maps.missing.join(", ")
            ));
        }
        if let Some(canary) = &self.canary
            && !canary.ok
        {
            notes.push(
                "the iptables canary chains were missing (rules flushed by another tool); a \
                 full sync restores them"
                    .to_owned(),
            );
        }
        self.healthy = broken.is_empty();
        broken.extend(notes);
        self.reasons = broken;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: &str = "2026-12-02T18:00:00Z";
    const T1: &str = "2026-12-02T18:00:30Z";

    fn hook(interface: &str, attached: bool, error: Option<&str>) -> Hook {
        Hook {
            interface: interface.to_owned(),
            hook: "ingress",
            program: "kpr_tc_external",
            attached,
            program_id: attached.then_some(42),
            error: error.map(str::to_owned),
        }
    }

    fn probe(result: &'static str, reason: Option<&str>) -> Probe {
        Probe {
            interface: "eth0".to_owned(),
            program: "kpr_tc_external",
            program_id: Some(42),
            family: Some("IPv4"),
            frontend: Some("10.0.0.1:30080 (default/web:http)".to_owned()),
            translated_to: None,
            result,
            reason: reason.map(str::to_owned),
        }
    }

    fn ebpf(hooks: Vec<Hook>, reattached: Vec<Reattached>, test: SelfTestState) -> DatapathHealth {
        let mut health = DatapathHealth::new("ebpf");
        health.attachments = Some(Attachments {
            time: T1.to_owned(),
            expected: hooks.len(),
            attached: hooks.iter().filter(|h| h.attached).count(),
            hooks,
            reattached,
        });
        health.self_test = Some(Some(test));
        health.evaluate();
        health
    }

    fn passed() -> SelfTestState {
        SelfTestState {
            time: T1.to_owned(),
            passed: true,
            after_repair: false,
            programs: vec![probe("passed", None)],
            failed_before_repair: Vec::new(),
        }
    }

    #[test]
    fn a_repaired_detach_is_reported_and_stays_healthy() {
        let reattached = Reattached {
            time: T1.to_owned(),
            interface: "eth0".to_owned(),
            hook: "ingress",
            program: "kpr_tc_external",
            repaired: true,
            error: None,
        };
        let mut test = passed();
        test.after_repair = true;
        test.failed_before_repair = vec![probe(
            "failed",
            Some("program 42 is not in the ingress hook (detached)"),
        )];
        let health = ebpf(vec![hook("eth0", true, None)], vec![reattached], test);
        assert!(health.healthy, "{health:?}");
        assert_eq!(health.reasons.len(), 2, "{:?}", health.reasons);
        assert!(health.reasons[0].contains("detached from eth0 ingress"));
        assert!(health.reasons[1].contains("not in the ingress hook (detached)"));
    }

    #[test]
    fn an_old_reattachment_is_listed_but_no_longer_a_reason() {
        let reattached = Reattached {
            time: T0.to_owned(),
            interface: "eth0".to_owned(),
            hook: "ingress",
            program: "kpr_tc_external",
            repaired: true,
            error: None,
        };
        let health = ebpf(vec![hook("eth0", true, None)], vec![reattached], passed());
        assert!(health.healthy);
        assert!(health.reasons.is_empty(), "{:?}", health.reasons);
    }

    #[test]
    fn a_failed_reattach_is_unhealthy_with_its_error() {
        let health = ebpf(
            vec![hook(
                "eth0",
                false,
                Some("pinning the link: Operation not permitted"),
            )],
            Vec::new(),
            SelfTestState {
                passed: false,
                programs: vec![probe("failed", Some("not attached"))],
                ..passed()
            },
        );
        assert!(!health.healthy);
        assert!(
            health.reasons[0].contains("could not be attached again: pinning the link"),
            "{:?}",
            health.reasons
        );
    }

    #[test]
    fn a_self_test_still_failing_after_the_repair_is_unhealthy() {
        let test = SelfTestState {
            passed: false,
            after_repair: true,
            programs: vec![probe(
                "failed",
                Some("translated to 10.0.0.9:1, not a backend"),
            )],
            ..passed()
        };
        let health = ebpf(vec![hook("eth0", true, None)], Vec::new(), test);
        assert!(!health.healthy);
        assert!(health.reasons[0].starts_with("self-test failed (still, after the repair)"));
    }

    #[test]
    fn skipped_probes_and_repaired_drift_stay_healthy() {
        let mut health = DatapathHealth::new("ebpf");
        health.self_test = Some(Some(SelfTestState {
            programs: vec![probe("skipped", Some("no frontend"))],
            ..passed()
        }));
        health.last_drift_check = Some(DriftCheckState {
            time: T1.to_owned(),
            result: "repaired",
            drifted: 3,
            note: None,
        });
        health.maps = Some(Maps {
            present: false,
            missing: vec!["KPR_STATS".to_owned()],
        });
        health.evaluate();
        assert!(health.healthy);
        assert_eq!(health.reasons.len(), 2, "{:?}", health.reasons);
    }

    #[test]
    fn the_json_shape() {
        let mut health = ebpf(vec![hook("eth0", true, None)], Vec::new(), passed());
        health.maps = Some(Maps {
            present: true,
            missing: Vec::new(),
        });
        health.last_drift_check = Some(DriftCheckState {
            time: T1.to_owned(),
            result: "ok",
            drifted: 0,
            note: None,
        });
        let json = serde_json::to_value(&health).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "mode": "ebpf",
                "healthy": true,
                "reasons": [],
                "attachments": {
                    "time": T1, "expected": 1, "attached": 1,
                    "hooks": [{"interface": "eth0", "hook": "ingress",
                        "program": "kpr_tc_external", "attached": true, "programId": 42}],
                    "reattached": []
                },
                "maps": {"present": true, "missing": []},
                "lastDriftCheck": {"time": T1, "result": "ok", "drifted": 0},
                "selfTest": {
                    "time": T1, "passed": true, "afterRepair": false,
                    "programs": [{"interface": "eth0", "program": "kpr_tc_external",
                        "programId": 42, "family": "IPv4",
                        "frontend": "10.0.0.1:30080 (default/web:http)", "result": "passed"}]
                }
            })
        );
        // Before any check: the mode, healthy, and null for the drift check and self-test.
        let mut fresh = DatapathHealth::new("ebpf");
        fresh.self_test = Some(None);
        assert_eq!(
            serde_json::to_value(&fresh).unwrap(),
            serde_json::json!({"mode": "ebpf", "healthy": true, "reasons": [],
                "lastDriftCheck": null, "selfTest": null})
        );
        let iptables = DatapathHealth {
            canary: Some(Canary {
                time: T0.to_owned(),
                ok: true,
            }),
            ..DatapathHealth::new("iptables")
        };
        assert_eq!(
            serde_json::to_value(&iptables).unwrap(),
            serde_json::json!({"mode": "iptables", "healthy": true, "reasons": [],
                "canary": {"time": T0, "ok": true}, "lastDriftCheck": null})
        );
    }
}
