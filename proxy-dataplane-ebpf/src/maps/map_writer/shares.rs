//! Fair shares of the service maps between Services and namespaces.
//!
//! Every tenant's Service takes entries of several fixed-size maps ([`SharedMap`]): frontends
//! (a cluster IP, each external and load-balancer address, each NodePort), backend slots (one
//! per endpoint of each frontend), Maglev table blocks (each external frontend's table with
//! `--lb-algorithm maglev`) and source ranges (each `loadBalancerSourceRanges` entry of each
//! guarded frontend). Taken first come, first served, one namespace with a Service of
//! thousands of ports, an EndpointSlice flood of thousands of endpoints or a thousand Services
//! with Maglev tables fills a map, and a Service created later in another namespace is never
//! programmed. So, in each of these maps alike:
//!
//! - one Service takes at most its cap (`--bpf-max-frontends-per-service` in the frontend
//!   maps; the other maps have none of their own: `--bpf-max-endpoints-per-service` truncates
//!   a frontend's endpoints before it gets here, see `map_writer`);
//! - the last eighth of the map, at most 1024 entries (the reserve), goes only to namespaces
//!   that hold few entries of it: a namespace that holds an eighth of the reserve takes no more
//!   once the map has reached its reserve, and no namespace ever holds more than the rest of
//!   the map.
//!
//! What a Service holds is its frontends' live entries; whether a write reaches into the
//! reserve is judged by what the map holds, retired generations included, plus what the write
//! adds before the old generation goes (a changed frontend's new slots and Maglev table): a
//! namespace cannot use the update protocol's second generation to reach the reserve either.
//!
//! The backend maps need no share of their own: a backend is in them only while a slot refers
//! to it, and they have the slot map's capacity (`--bpf-map-backends` sizes both), so whenever
//! the slot map keeps its reserve free, so do they.
//!
//! What does not fit is not programmed (or, if it changed, keeps its previous backends),
//! reported per service port, and retried whenever entries are freed. Many namespaces flooding
//! together can still exhaust the reserve: a `ResourceQuota` on `services` (and RBAC on
//! EndpointSlices) is the cluster administrator's bound on that.

use std::{collections::HashMap, fmt, ops::Index};

use proxy_model::objects::{Name, ObjectKey};

/// The reserve is an eighth of the map up to this many entries: enough for many namespaces'
/// new Services, and a namespace that holds most of a large cluster's Services (all in
/// `default`, say) still gets all but these.
const MAX_RESERVE: u64 = 1024;

/// A map whose entries tenants' Services take, shared by the rules of this module.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SharedMap {
    /// `KPR_FRONTENDS4` / `KPR_FRONTENDS6` (one capacity, a count per family).
    Frontends,
    /// `KPR_BACKEND_SLOTS`.
    Slots,
    /// `KPR_MAGLEV`.
    Maglev,
    /// `KPR_SOURCE_RANGES`.
    SourceRanges,
}

impl SharedMap {
    pub const ALL: [SharedMap; 4] = [
        SharedMap::Frontends,
        SharedMap::Slots,
        SharedMap::Maglev,
        SharedMap::SourceRanges,
    ];

    fn index(self) -> usize {
        self as usize
    }

    /// What its entries are, for messages.
    pub fn entries(self) -> &'static str {
        match self {
            SharedMap::Frontends => "frontend",
            SharedMap::Slots => "backend slot",
            SharedMap::Maglev => "Maglev table",
            SharedMap::SourceRanges => "source range",
        }
    }
}

/// Entries in each shared map.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Entries([u64; 4]);

impl Entries {
    /// `count` in every map.
    pub const fn splat(count: u64) -> Self {
        Self([count; 4])
    }

    pub fn with(mut self, map: SharedMap, count: u64) -> Self {
        self.0[map.index()] = count;
        self
    }

    fn add(&mut self, other: Entries) {
        for (count, more) in self.0.iter_mut().zip(other.0) {
            *count += more;
        }
    }

    fn sub(&mut self, other: Entries) {
        for (count, less) in self.0.iter_mut().zip(other.0) {
            *count = count.saturating_sub(less);
        }
    }

    fn is_zero(&self) -> bool {
        self.0.iter().all(|&count| count == 0)
    }
}

impl Index<SharedMap> for Entries {
    type Output = u64;
    fn index(&self, map: SharedMap) -> &u64 {
        &self.0[map.index()]
    }
}

/// Who has its share already.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    /// The Service holds its cap.
    Service,
    /// The namespace holds its share and the rest is kept for others.
    Namespace,
}

/// Why a frontend was not given its entries although the map had room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShareLimit {
    pub map: SharedMap,
    pub holder: Holder,
}

impl fmt::Display for ShareLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.holder, self.map) {
            (Holder::Service, SharedMap::Frontends) => f.write_str(
                "the Service has its maximum of frontends (--bpf-max-frontends-per-service)",
            ),
            (Holder::Service, map) => {
                write!(
                    f,
                    "the Service has its maximum of {} entries",
                    map.entries()
                )
            }
            (Holder::Namespace, map) => write!(
                f,
                "the namespace has its share of the {} map; the rest is kept for other namespaces",
                map.entries()
            ),
        }
    }
}

/// One map's limits.
#[derive(Debug, Clone, Copy)]
struct Limits {
    per_service: u64,
    /// The most a namespace holds: the map less its reserve.
    most: u64,
    /// What a namespace may hold and still take from the reserve.
    small: u64,
}

impl Limits {
    /// `unit`: the most one frontend takes of the map at once (a Maglev table's blocks): the
    /// reserve holds at least that much, and a small namespace may take that much of it, or a
    /// map of large tables would keep its last tables from everyone.
    fn new(capacity: u64, per_service: u64, unit: u64) -> Self {
        let reserve = (capacity / 8).min(MAX_RESERVE).max(unit).min(capacity);
        Self {
            per_service,
            most: capacity - reserve,
            small: (reserve / 8).max(unit).max(1),
        }
    }
}

/// The limits of every shared map and what each Service and namespace holds of each. The
/// counts follow the map writer's record of live frontends (`usage::FrontendTable` adjusts them
/// on every change), so they are always current, also in the middle of an apply.
#[derive(Debug, Clone, Default)]
pub struct Shares {
    /// Per map; `None`: no limits (maps whose capacity is unknown, and unit tests of the writer
    /// that are about something else).
    limits: [Option<Limits>; 4],
    /// Hashed, not ordered: every frontend a full apply writes or keeps looks its Service up
    /// here (count and check), and a tree of 50k Services compared names down a dozen levels
    /// each time, a third of a restart's first comparison. Nothing walks them in order. The
    /// standard library's keyed hasher, as tenants choose the names.
    by_service: HashMap<ObjectKey, Entries>,
    by_namespace: HashMap<Name, Entries>,
}

impl Shares {
    /// Limits for maps of `capacity` entries, with `per_service` the most one Service holds
    /// of each and `unit` the most one frontend takes of each at once. Counts stay as they are.
    pub fn set_limits(&mut self, capacity: Entries, per_service: Entries, unit: Entries) {
        for map in SharedMap::ALL {
            self.limits[map.index()] =
                Some(Limits::new(capacity[map], per_service[map], unit[map]));
        }
    }

    /// `service` holds `entries` more.
    pub fn add(&mut self, service: &ObjectKey, entries: Entries) {
        if entries.is_zero() {
            return;
        }
        // Looked up before inserting: an entry would clone the key for every call.
        match self.by_service.get_mut(service) {
            Some(count) => count.add(entries),
            None => {
                self.by_service.insert(service.clone(), entries);
            }
        }
        match self.by_namespace.get_mut(&service.namespace) {
            Some(count) => count.add(entries),
            None => {
                self.by_namespace.insert(service.namespace.clone(), entries);
            }
        }
    }

    /// `service` holds `entries` fewer.
    pub fn sub(&mut self, service: &ObjectKey, entries: Entries) {
        if entries.is_zero() {
            return;
        }
        if let Some(count) = self.by_service.get_mut(service) {
            count.sub(entries);
            if count.is_zero() {
                self.by_service.remove(service);
            }
        }
        if let Some(count) = self.by_namespace.get_mut(&service.namespace) {
            count.sub(entries);
            if count.is_zero() {
                self.by_namespace.remove(&service.namespace);
            }
        }
    }

    /// Whether one frontend of `service` may go from holding `before` to holding `after`,
    /// its write adding `adds` entries to maps that hold `in_map` (live and retired).
    pub fn check(
        &self,
        service: &ObjectKey,
        before: Entries,
        after: Entries,
        adds: Entries,
        in_map: Entries,
    ) -> Result<(), ShareLimit> {
        let held = |count: Option<&Entries>| count.copied().unwrap_or_default();
        let by_service = held(self.by_service.get(service));
        let by_namespace = held(self.by_namespace.get(&service.namespace));
        for map in SharedMap::ALL {
            let Some(limits) = self.limits[map.index()] else {
                continue;
            };
            let limit = |holder| ShareLimit { map, holder };
            let then = |count: Entries| count[map].saturating_sub(before[map]) + after[map];
            let grows = after[map] > before[map];
            if grows && then(by_service) > limits.per_service {
                return Err(limit(Holder::Service));
            }
            let namespace = then(by_namespace);
            if grows && namespace > limits.most {
                return Err(limit(Holder::Namespace));
            }
            let into_reserve = adds[map] > 0 && in_map[map] + adds[map] > limits.most;
            if into_reserve && namespace > limits.small {
                return Err(limit(Holder::Namespace));
            }
        }
        Ok(())
    }

    /// What `service` holds (unit tests).
    #[cfg(test)]
    pub fn of_service(&self, service: &ObjectKey) -> Entries {
        self.by_service.get(service).copied().unwrap_or_default()
    }

    /// Whether the counts are those of `other` (unit tests: kept as the writer goes vs
    /// recounted).
    #[cfg(test)]
    pub fn same_counts(&self, other: &Shares) -> bool {
        self.by_service == other.by_service && self.by_namespace == other.by_namespace
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(namespace: &str, name: &str) -> ObjectKey {
        ObjectKey {
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    fn slots(count: u64) -> Entries {
        Entries::default().with(SharedMap::Slots, count)
    }

    /// Maps of 512 entries: a reserve of 64, a namespace is small below 8.
    fn shares_of_512(per_service: u64) -> Shares {
        let mut shares = Shares::default();
        shares.set_limits(
            Entries::splat(512),
            Entries::splat(u64::MAX).with(SharedMap::Frontends, per_service),
            Entries::splat(1),
        );
        shares
    }

    #[test]
    fn every_map_keeps_its_reserve_from_a_namespace_that_holds_the_rest() {
        for map in SharedMap::ALL {
            let mut shares = shares_of_512(u64::MAX);
            let greedy = service("greedy", "flood");
            let one = Entries::default().with(map, 1);
            let mut taken = 0;
            while shares
                .check(
                    &greedy,
                    Entries::default(),
                    one,
                    one,
                    Entries::default().with(map, taken),
                )
                .is_ok()
            {
                shares.add(&greedy, one);
                taken += 1;
            }
            assert_eq!(taken, 448, "{map:?}: 512 less the reserve");
            // Another namespace still takes from the reserve, a little.
            let victim = service("victim", "web");
            for held in 0..8 {
                assert_eq!(
                    shares.check(
                        &victim,
                        Entries::default(),
                        one,
                        one,
                        Entries::default().with(map, taken + held)
                    ),
                    Ok(()),
                    "{map:?}"
                );
                shares.add(&victim, one);
            }
            assert_eq!(
                shares.check(
                    &victim,
                    Entries::default(),
                    one,
                    one,
                    Entries::default().with(map, taken + 8)
                ),
                Err(ShareLimit {
                    map,
                    holder: Holder::Namespace
                }),
                "{map:?}: small namespaces only"
            );
        }
    }

    /// A frontend takes many entries at once (its endpoints' slots): all or nothing.
    #[test]
    fn a_write_of_many_entries_fits_whole_or_not_at_all() {
        let shares = shares_of_512(u64::MAX);
        let greedy = service("greedy", "flood");
        assert!(
            shares
                .check(&greedy, slots(0), slots(448), slots(448), slots(0))
                .is_ok()
        );
        assert_eq!(
            shares.check(&greedy, slots(0), slots(449), slots(449), slots(0)),
            Err(ShareLimit {
                map: SharedMap::Slots,
                holder: Holder::Namespace
            })
        );
        // Small namespaces may reach into the reserve, up to a few entries in all.
        let victim = service("victim", "web");
        assert!(
            shares
                .check(&victim, slots(0), slots(8), slots(8), slots(500))
                .is_ok()
        );
        assert!(
            shares
                .check(&victim, slots(0), slots(9), slots(9), slots(500))
                .is_err()
        );
    }

    /// A changed frontend writes its new generation before the old one goes: a namespace at
    /// its share cannot use that second generation to take the reserve, and one that does not
    /// grow is never refused for its own share.
    #[test]
    fn an_update_is_judged_by_what_it_adds_to_the_map() {
        let mut shares = shares_of_512(u64::MAX);
        let greedy = service("greedy", "flood");
        shares.add(&greedy, slots(440));
        // The same 40 slots again, in a map that holds 440: 480 would reach the reserve.
        assert!(
            shares
                .check(&greedy, slots(40), slots(40), slots(40), slots(440))
                .is_err()
        );
        // Fewer than the reserve's edge: fine, though the namespace is not small.
        assert!(
            shares
                .check(&greedy, slots(40), slots(40), slots(8), slots(440))
                .is_ok()
        );
        // Shrinking never hits the namespace's share, only the reserve.
        assert!(
            shares
                .check(&greedy, slots(40), slots(30), slots(0), slots(440))
                .is_ok()
        );
    }

    #[test]
    fn a_service_has_a_cap_in_the_maps_that_have_one() {
        let mut shares = shares_of_512(100);
        let many = service("a", "many");
        let frontend = Entries::default()
            .with(SharedMap::Frontends, 1)
            .with(SharedMap::Slots, 3);
        for _ in 0..100 {
            assert!(
                shares
                    .check(
                        &many,
                        Entries::default(),
                        frontend,
                        frontend,
                        Entries::default()
                    )
                    .is_ok()
            );
            shares.add(&many, frontend);
        }
        assert_eq!(
            shares.check(
                &many,
                Entries::default(),
                frontend,
                frontend,
                Entries::default()
            ),
            Err(ShareLimit {
                map: SharedMap::Frontends,
                holder: Holder::Service
            })
        );
        // Another Service of the namespace is not held to the first one's cap.
        assert!(
            shares
                .check(
                    &service("a", "other"),
                    Entries::default(),
                    frontend,
                    frontend,
                    Entries::default()
                )
                .is_ok()
        );
        // Counts go back to nothing.
        for _ in 0..100 {
            shares.sub(&many, frontend);
        }
        assert_eq!(shares.of_service(&many), Entries::default());
        assert!(shares.same_counts(&shares_of_512(100)));
    }

    /// Maglev tables of 8192 blocks (131071 slots) in a map of 65536: the reserve of 1024
    /// blocks would hold no table, and the last table would go to no one.
    #[test]
    fn the_reserve_holds_at_least_one_frontend_of_a_map() {
        let table = Entries::default().with(SharedMap::Maglev, 8192);
        let mut shares = Shares::default();
        shares.set_limits(
            Entries::splat(65_536),
            Entries::splat(u64::MAX),
            Entries::splat(1).with(SharedMap::Maglev, 8192),
        );
        let greedy = service("greedy", "flood");
        let mut tables = 0;
        while shares
            .check(
                &greedy,
                Entries::default(),
                table,
                table,
                Entries::default().with(SharedMap::Maglev, tables * 8192),
            )
            .is_ok()
        {
            shares.add(&greedy, table);
            tables += 1;
        }
        assert_eq!(tables, 7, "all tables but the reserve's one");
        let victim = service("victim", "web");
        let in_map = Entries::default().with(SharedMap::Maglev, 7 * 8192);
        assert_eq!(
            shares.check(&victim, Entries::default(), table, table, in_map),
            Ok(())
        );
        shares.add(&victim, table);
        let in_map = Entries::default().with(SharedMap::Maglev, 8 * 8192);
        assert!(
            shares
                .check(&victim, Entries::default(), table, table, in_map)
                .is_err()
        );
    }

    #[test]
    fn messages_name_the_map_and_the_flag() {
        let service_cap = ShareLimit {
            map: SharedMap::Frontends,
            holder: Holder::Service,
        };
        assert!(
            service_cap
                .to_string()
                .contains("--bpf-max-frontends-per-service")
        );
        let namespace = ShareLimit {
            map: SharedMap::Slots,
            holder: Holder::Namespace,
        };
        assert_eq!(
            namespace.to_string(),
            "the namespace has its share of the backend slot map; the rest is kept for other \
             namespaces"
        );
    }
}
