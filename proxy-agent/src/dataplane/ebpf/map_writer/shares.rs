//! Fair shares of the frontend maps between Services and namespaces.
//!
//! Every tenant's Service takes frontend entries (a cluster IP, each external and load-balancer
//! address, each NodePort) from one map per family. Taken first come, first served, one
//! namespace with a Service of thousands of ports fills the map and a Service created later in
//! another namespace is never programmed. So:
//!
//! - one Service takes at most `per_service` entries (`--bpf-max-frontends-per-service`);
//! - the last eighth of each map, at most 1024 entries (the reserve), goes only to namespaces
//!   that hold few entries: a namespace that already holds an eighth of the reserve takes no
//!   more once the map has reached its reserve, and no namespace ever holds more than the
//!   rest of the map.
//!
//! What does not fit is not programmed, reported per service port, and retried whenever
//! entries are freed. Many namespaces flooding together can still exhaust the reserve: a
//! `ResourceQuota` on `services` is the cluster administrator's bound on that.

use std::collections::BTreeMap;

use crate::{
    desired::ServicePortName,
    objects::{Name, ObjectKey},
};

pub use crate::config::ebpf_settings::DEFAULT_MAX_FRONTENDS_PER_SERVICE as DEFAULT_PER_SERVICE;

/// The reserve is an eighth of the map up to this many entries: enough for many namespaces'
/// new Services, and a namespace that holds most of a large cluster's Services (all in
/// `default`, say) still gets all but these.
const MAX_RESERVE: usize = 1024;

/// Why a frontend was not given an entry although the map had room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShareLimit {
    /// The Service holds `per_service` entries already.
    Service,
    /// The namespace holds its share and the rest is kept for others.
    Namespace,
}

impl ShareLimit {
    pub fn describe(self) -> &'static str {
        match self {
            Self::Service => {
                "the Service has its maximum of frontends (--bpf-max-frontends-per-service)"
            }
            Self::Namespace => {
                "the namespace has its share of the frontend map; the rest is kept for other namespaces"
            }
        }
    }
}

/// The limits and what each Service and namespace holds.
#[derive(Debug, Clone, Default)]
pub struct Shares {
    /// `None`: no limits (unit tests of the writer that are about something else).
    limits: Option<Limits>,
    by_service: BTreeMap<ObjectKey, usize>,
    by_namespace: BTreeMap<Name, usize>,
}

#[derive(Debug, Clone, Copy)]
struct Limits {
    per_service: usize,
    capacity: usize,
    reserve: usize,
    /// What a namespace may hold and still take from the reserve.
    small: usize,
}

impl Shares {
    pub fn new(capacity: u32, per_service: u32) -> Self {
        let capacity = capacity as usize;
        let reserve = (capacity / 8).min(MAX_RESERVE);
        Self {
            limits: Some(Limits {
                per_service: per_service as usize,
                capacity,
                reserve,
                small: (reserve / 8).max(1),
            }),
            ..Self::default()
        }
    }

    /// A service port's entries went from `before` to `after`.
    pub fn update(&mut self, name: &ServicePortName, before: usize, after: usize) {
        if before == after {
            return;
        }
        for count in [
            self.by_service.entry(name.service.clone()).or_default(),
            self.by_namespace
                .entry(name.service.namespace.clone())
                .or_default(),
        ] {
            *count = (*count + after).saturating_sub(before);
        }
        if self.by_service.get(&name.service) == Some(&0) {
            self.by_service.remove(&name.service);
        }
        if self.by_namespace.get(&name.service.namespace) == Some(&0) {
            self.by_namespace.remove(&name.service.namespace);
        }
    }

    /// Whether `name` may take one more entry: before this apply it held `previous` entries, in
    /// this apply it has `held` so far. `in_map`: the entries of the map when the entry takes
    /// new room, `None` for one already in the map (adopted after a restart).
    pub fn check(
        &self,
        name: &ServicePortName,
        previous: usize,
        held: usize,
        in_map: Option<u64>,
    ) -> Result<(), ShareLimit> {
        let Some(limits) = self.limits else {
            return Ok(());
        };
        // The counts include this service port's entries from before the apply, which `held`
        // replaces.
        let now =
            |count: Option<&usize>| count.copied().unwrap_or(0).saturating_sub(previous) + held;
        if now(self.by_service.get(&name.service)) >= limits.per_service {
            return Err(ShareLimit::Service);
        }
        let namespace = now(self.by_namespace.get(&name.service.namespace));
        let most = limits.capacity.saturating_sub(limits.reserve);
        let in_reserve =
            in_map.is_some_and(|in_map| usize::try_from(in_map).unwrap_or(usize::MAX) >= most);
        if namespace >= most || (in_reserve && namespace >= limits.small) {
            return Err(ShareLimit::Namespace);
        }
        Ok(())
    }
}
