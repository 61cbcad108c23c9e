//! Who owns a frontend address, port and protocol when several Services name it.
//!
//! The API server keeps cluster IPs unique but not `spec.externalIPs` or
//! `status.loadBalancer.ingress`, so one tenant can name another's address (CVE-2020-8554).
//! kube-proxy then programs both and whichever rule comes first wins, which varies with map
//! order; here the decision is made once, for both dataplanes, and does not change across
//! restarts, resyncs or mode switches:
//!
//! 1. a cluster IP is its Service's alone: no other Service's external or load-balancer
//!    address may name it, on any port (the API server allocated it);
//! 2. of several Services naming one external or load-balancer address, port and protocol, the
//!    older keeps it (`metadata.creationTimestamp`; one without it counts as newest);
//! 3. then the smaller UID (a UUID, compared as the number it spells), then namespace/name, so
//!    the order is total.
//!
//! Only Services with external or load-balancer addresses are indexed by their claims; every
//! Service's cluster IPs are indexed by address alone. At 30k Services that is an entry per
//! cluster IP, not per service port and claimant.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
};

use super::{Protocol, ServicePort};
use crate::objects::{ObjectKey, ServiceInfo};

/// One external or load-balancer frontend that only one Service may own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Claim {
    pub address: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
}

/// A Service naming a claim, ordered oldest first.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Claimant {
    /// Creation time in seconds; `i64::MAX` when unknown (counted as the newest).
    created: i64,
    /// The UID as a number; 0 when it is not a UUID (the name decides then).
    uid: u128,
    service: ObjectKey,
}

impl Claimant {
    fn of(key: &ObjectKey, info: Option<&ServiceInfo>) -> Self {
        Self {
            created: info.and_then(|i| i.created).unwrap_or(i64::MAX),
            uid: info
                .and_then(|i| i.uid.as_deref())
                .and_then(uuid_number)
                .unwrap_or(0),
            service: key.clone(),
        }
    }
}

/// A UUID's 32 hex digits as a number: ordered as the (lower-case) UUID strings are.
fn uuid_number(uid: &str) -> Option<u128> {
    let digits: String = uid.chars().filter(|c| *c != '-').collect();
    (digits.len() == 32)
        .then(|| u128::from_str_radix(&digits, 16).ok())
        .flatten()
}

/// Every current claim and its claimants.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Claims {
    /// Every Service's cluster IPs (the first Service seen keeps a duplicate, which only a
    /// manifests folder can hold).
    cluster_ips: BTreeMap<IpAddr, ObjectKey>,
    /// External and load-balancer claims, each with its claimants sorted oldest first.
    external: BTreeMap<Claim, Vec<Claimant>>,
    /// The external and load-balancer claims of each Service that has any.
    by_service: HashMap<ObjectKey, Box<[Claim]>>,
}

impl Claims {
    /// Replaces `key`'s claims with those of `ports` (its service ports in both families,
    /// before settling; `old_cluster_ips` are its cluster IPs until now) and returns the other
    /// Services whose share changed: they must be recomputed.
    pub fn replace(
        &mut self,
        key: &ObjectKey,
        info: Option<&ServiceInfo>,
        old_cluster_ips: &[IpAddr],
        ports: &[&ServicePort],
    ) -> BTreeSet<ObjectKey> {
        let new_cluster_ips: BTreeSet<IpAddr> = ports.iter().map(|p| p.cluster_ip).collect();
        let new_claims = external_claims(ports);
        let old_claims = self.by_service.get(key).cloned().unwrap_or_default();
        let cluster_ips_moved: Vec<IpAddr> = old_cluster_ips
            .iter()
            .filter(|ip| !new_cluster_ips.contains(ip))
            .chain(
                new_cluster_ips
                    .iter()
                    .filter(|ip| !old_cluster_ips.contains(ip)),
            )
            .copied()
            .collect();
        let claimant = Claimant::of(key, info);
        let unchanged = cluster_ips_moved.is_empty()
            && *old_claims == *new_claims
            && new_claims.iter().all(|claim| {
                self.external
                    .get(claim)
                    .is_some_and(|claimants| claimants.contains(&claimant))
            });
        if unchanged {
            return BTreeSet::new();
        }
        let touched: BTreeSet<Claim> = old_claims.iter().chain(&new_claims).copied().collect();
        let owners_before: Vec<Option<ObjectKey>> = touched
            .iter()
            .map(|claim| self.owner(claim).cloned())
            .collect();

        for ip in old_cluster_ips {
            if self.cluster_ips.get(ip) == Some(key) {
                self.cluster_ips.remove(ip);
            }
        }
        for ip in &new_cluster_ips {
            self.cluster_ips.entry(*ip).or_insert_with(|| key.clone());
        }
        for claim in old_claims.iter() {
            if let Some(claimants) = self.external.get_mut(claim) {
                claimants.retain(|c| c.service != *key);
                if claimants.is_empty() {
                    self.external.remove(claim);
                }
            }
        }
        for claim in &new_claims {
            let claimants = self.external.entry(*claim).or_default();
            if let Err(at) = claimants.binary_search(&claimant) {
                claimants.insert(at, claimant.clone());
            }
        }
        if new_claims.is_empty() {
            self.by_service.remove(key);
        } else {
            self.by_service.insert(key.clone(), new_claims.into());
        }

        let mut affected = BTreeSet::new();
        for (claim, before) in touched.iter().zip(owners_before) {
            let after = self.owner(claim).cloned();
            if before != after {
                affected.extend(before.into_iter().chain(after));
            }
        }
        // Whoever names a cluster IP that came or went: its share of it changed.
        for ip in cluster_ips_moved {
            affected.extend(
                self.claims_on(ip)
                    .flat_map(|(_, claimants)| claimants.iter().map(|c| c.service.clone())),
            );
        }
        affected.remove(key);
        affected
    }

    /// Every Service's claims from scratch.
    pub fn rebuild<'a>(
        &mut self,
        services: impl Iterator<Item = (&'a ObjectKey, Option<&'a ServiceInfo>, Vec<&'a ServicePort>)>,
    ) {
        *self = Self::default();
        for (key, info, ports) in services {
            for port in &ports {
                self.cluster_ips
                    .entry(port.cluster_ip)
                    .or_insert_with(|| key.clone());
            }
            let claims = external_claims(&ports);
            if claims.is_empty() {
                continue;
            }
            let claimant = Claimant::of(key, info);
            for claim in &claims {
                self.external
                    .entry(*claim)
                    .or_default()
                    .push(claimant.clone());
            }
            self.by_service.insert(key.clone(), claims.into());
        }
        for claimants in self.external.values_mut() {
            claimants.sort_unstable();
        }
    }

    /// The Service that owns `claim`: the Service whose cluster IP it names, else its oldest
    /// claimant.
    pub fn owner(&self, claim: &Claim) -> Option<&ObjectKey> {
        self.cluster_ips.get(&claim.address).or_else(|| {
            self.external
                .get(claim)
                .and_then(|claimants| claimants.first())
                .map(|claimant| &claimant.service)
        })
    }

    /// How many claims some Service holds without owning them.
    pub fn lost(&self) -> usize {
        self.external
            .iter()
            .map(|(claim, claimants)| {
                let owner = self.owner(claim);
                claimants
                    .iter()
                    .filter(|c| Some(&c.service) != owner)
                    .count()
            })
            .sum()
    }

    fn claims_on(&self, address: IpAddr) -> impl Iterator<Item = (&Claim, &Vec<Claimant>)> {
        self.external
            .range(
                Claim {
                    address,
                    port: 0,
                    protocol: Protocol::Tcp,
                }..,
            )
            .take_while(move |(claim, _)| claim.address == address)
    }
}

/// The external and load-balancer claims of a Service's ports, sorted, each once (a Service
/// may list one address as both).
fn external_claims(ports: &[&ServicePort]) -> Vec<Claim> {
    let mut claims: Vec<Claim> = ports
        .iter()
        .flat_map(|port| {
            port.external_ips
                .iter()
                .chain(&port.load_balancer_ips)
                .map(|&address| Claim {
                    address,
                    port: port.port,
                    protocol: port.protocol,
                })
        })
        .collect();
    claims.sort_unstable();
    claims.dedup();
    claims
}
