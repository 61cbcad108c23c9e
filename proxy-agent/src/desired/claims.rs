//! Who owns a frontend address, port and protocol when several Services name it.
//!
//! The API server keeps cluster IPs unique but not `spec.externalIPs` or
//! `status.loadBalancer.ingress`, so one tenant can name another's address (CVE-2020-8554).
//! kube-proxy then programs both and whichever rule comes first wins, which varies with map
//! order; here the decision is made once, for both dataplanes, and does not change across
//! restarts, resyncs or mode switches:
//!
//! 1. a cluster IP beats an external or load-balancer address (the API server allocated it);
//! 2. then the older Service (`metadata.creationTimestamp`; one without it counts as newest);
//! 3. then the smaller UID, then namespace/name, so the order is total.
//!
//! A Service's own addresses never conflict with each other.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use super::{Protocol, ServicePort};
use crate::objects::{ObjectKey, ServiceInfo};

/// One frontend that only one Service may own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Claim {
    pub address: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
}

/// How a Service holds a claim: the smallest claimant owns it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Claimant {
    /// 0: the claim is the Service's cluster IP; 1: an external or load-balancer address.
    rank: u8,
    /// Creation time in seconds; `i64::MAX` when unknown (counted as the newest).
    created: i64,
    uid: Box<str>,
    pub service: ObjectKey,
}

/// Every current claim and its claimants.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Claims {
    claimants: BTreeMap<Claim, BTreeSet<Claimant>>,
    /// Each Service's claims, so they can be withdrawn when it changes or goes.
    by_service: BTreeMap<ObjectKey, Vec<(Claim, Claimant)>>,
}

impl Claims {
    /// Replaces `service`'s claims with those of `ports` (its service ports in both families,
    /// before settling) and returns the other Services whose share changed: they must be
    /// recomputed.
    pub fn replace(
        &mut self,
        key: &ObjectKey,
        info: Option<&ServiceInfo>,
        ports: &[&ServicePort],
    ) -> BTreeSet<ObjectKey> {
        let new = claims_of(key, info, ports);
        let old = self.by_service.remove(key).unwrap_or_default();
        if old == new {
            if !new.is_empty() {
                self.by_service.insert(key.clone(), new);
            }
            return BTreeSet::new();
        }
        let touched: BTreeSet<Claim> = old.iter().chain(&new).map(|(claim, _)| *claim).collect();
        let owners_before: Vec<Option<ObjectKey>> = touched
            .iter()
            .map(|claim| self.owner(claim).cloned())
            .collect();
        for (claim, claimant) in &old {
            if let Some(set) = self.claimants.get_mut(claim) {
                set.remove(claimant);
                if set.is_empty() {
                    self.claimants.remove(claim);
                }
            }
        }
        for (claim, claimant) in &new {
            self.claimants
                .entry(*claim)
                .or_default()
                .insert(claimant.clone());
        }
        if !new.is_empty() {
            self.by_service.insert(key.clone(), new);
        }
        let mut affected = BTreeSet::new();
        for (claim, before) in touched.iter().zip(owners_before) {
            let after = self.owner(claim).cloned();
            if before != after {
                affected.extend(before.into_iter().chain(after).filter(|k| k != key));
            }
        }
        affected
    }

    /// Every Service's claims from scratch.
    pub fn rebuild<'a>(
        &mut self,
        services: impl Iterator<Item = (&'a ObjectKey, Option<&'a ServiceInfo>, Vec<&'a ServicePort>)>,
    ) {
        *self = Self::default();
        for (key, info, ports) in services {
            let claims = claims_of(key, info, &ports);
            for (claim, claimant) in &claims {
                self.claimants
                    .entry(*claim)
                    .or_default()
                    .insert(claimant.clone());
            }
            if !claims.is_empty() {
                self.by_service.insert(key.clone(), claims);
            }
        }
    }

    /// The Service that owns `claim`, if anyone claims it.
    pub fn owner(&self, claim: &Claim) -> Option<&ObjectKey> {
        self.claimants
            .get(claim)
            .and_then(|set| set.first())
            .map(|claimant| &claimant.service)
    }

    /// How many claims some Service holds without owning them.
    pub fn lost(&self) -> usize {
        self.claimants
            .values()
            .map(|set| {
                let owner = set.first().map(|c| &c.service);
                set.iter()
                    .map(|c| &c.service)
                    .filter(|s| Some(*s) != owner)
                    .collect::<BTreeSet<_>>()
                    .len()
            })
            .sum()
    }
}

fn claims_of(
    key: &ObjectKey,
    info: Option<&ServiceInfo>,
    ports: &[&ServicePort],
) -> Vec<(Claim, Claimant)> {
    let claimant = |rank| Claimant {
        rank,
        created: info.and_then(|i| i.created).unwrap_or(i64::MAX),
        uid: info.and_then(|i| i.uid.clone()).unwrap_or_default(),
        service: key.clone(),
    };
    // Per claim the Service's best rank: its cluster IP may also be listed as external.
    let mut best: BTreeMap<Claim, u8> = BTreeMap::new();
    for port in ports {
        let claim = |address| Claim {
            address,
            port: port.port,
            protocol: port.protocol,
        };
        best.insert(claim(port.cluster_ip), 0);
        for &address in port.external_ips.iter().chain(&port.load_balancer_ips) {
            best.entry(claim(address)).or_insert(1);
        }
    }
    best.into_iter()
        .map(|(claim, rank)| (claim, claimant(rank)))
        .collect()
}
