//! The snapshot: every service port per IP family, kept up to date incrementally. Recomputing a
//! Service touches only that Service and its slices, so a sync costs O(changed Services).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use super::{
    IpFamily, NodeContext, ServicePort, ServicePortName,
    claims::{Claim, Claims},
    endpoints::endpoints_by_port,
    services::{ServiceError, service_ports},
    topology::{Usage, categorize},
};
use crate::objects::{ObjectKey, Objects, ServiceInfo};

/// The service ports of one IP family.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FamilySnapshot {
    pub service_ports: BTreeMap<ServicePortName, ServicePort>,
}

impl FamilySnapshot {
    /// The service ports of one Service.
    pub fn of_service<'a>(&'a self, service: &ObjectKey) -> impl Iterator<Item = &'a ServicePort> {
        let start = ServicePortName {
            service: service.clone(),
            port: "".into(),
            protocol: super::Protocol::Tcp,
        };
        let service = service.clone();
        self.service_ports
            .range(start..)
            .take_while(move |(name, _)| name.service == service)
            .map(|(_, port)| port)
    }
}

/// What this node must do, for both IP families.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub v4: FamilySnapshot,
    pub v6: FamilySnapshot,
    /// Current problems per Service (invalid fields, bad slices).
    errors: BTreeMap<ObjectKey, Vec<ServiceError>>,
    /// Which Service owns each frontend address, port and protocol.
    claims: Claims,
}

/// What one [`Snapshot::update`] changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SnapshotUpdate {
    /// Service ports added, removed or modified, in either family.
    pub changed: BTreeSet<ServicePortName>,
    /// Problems that were not reported before.
    pub new_errors: Vec<ServiceError>,
}

impl Snapshot {
    /// The snapshot of `objects` from scratch.
    pub fn compute(objects: &Objects, node_name: &str) -> Self {
        let mut snapshot = Self::default();
        snapshot.update(objects, node_name, None);
        snapshot
    }

    pub fn family(&self, family: IpFamily) -> &FamilySnapshot {
        match family {
            IpFamily::V4 => &self.v4,
            IpFamily::V6 => &self.v6,
        }
    }

    fn family_mut(&mut self, family: IpFamily) -> &mut FamilySnapshot {
        match family {
            IpFamily::V4 => &mut self.v4,
            IpFamily::V6 => &mut self.v6,
        }
    }

    pub fn errors(&self) -> impl Iterator<Item = &ServiceError> {
        self.errors.values().flatten()
    }

    /// How many frontends some Service names but an older one owns.
    pub fn conflicts(&self) -> usize {
        self.claims.lost()
    }

    /// Recomputes the given Services (`None`: all of them, e.g. after a node change) and returns
    /// what changed.
    pub fn update(
        &mut self,
        objects: &Objects,
        node_name: &str,
        services: Option<&BTreeSet<ObjectKey>>,
    ) -> SnapshotUpdate {
        let node = NodeContext::new(node_name, objects.node.as_ref());
        let Some(keys) = services else {
            return self.recompute_all(objects, &node);
        };
        let mut update = SnapshotUpdate::default();
        for key in keys {
            self.update_service(objects, &node, key, &mut update);
        }
        update
    }

    /// Every Service from scratch: each family's table is built anew from the sorted service
    /// ports (a B-tree filled one insert at a time in key order keeps its nodes half full, and
    /// at 30k Services its values are most of the snapshot), then compared with the old one.
    /// Every Service's claims are known before any is settled.
    fn recompute_all(&mut self, objects: &Objects, node: &NodeContext) -> SnapshotUpdate {
        let mut update = SnapshotUpdate::default();
        // Walked in key order beside the Services, not looked up by key: a lookup per Service
        // and family compared namespace and name strings down a tree each time, most of a
        // full recompute at 50k Services.
        type Raw<'a> = (
            &'a ObjectKey,
            &'a ServiceInfo,
            [Vec<ServicePort>; 2],
            Vec<ServiceError>,
        );
        let mut raw: Vec<Raw<'_>> = objects
            .services
            .iter()
            .map(|(key, service)| {
                let mut errors = Vec::new();
                let ports =
                    IpFamily::ALL.map(|family| service_ports(key, service, family, &mut errors));
                (key, service, ports, errors)
            })
            .collect();
        self.claims
            .rebuild(raw.iter().map(|(key, service, ports, _)| {
                (*key, Some(*service), ports.iter().flatten().collect())
            }));
        let mut changed = Vec::new();
        for (index, family) in IpFamily::ALL.into_iter().enumerate() {
            let mut ports = Vec::new();
            for (key, _, family_ports, service_errors) in &mut raw {
                let family_ports = std::mem::take(&mut family_ports[index]);
                ports.extend(finish_service(
                    objects,
                    node,
                    &self.claims,
                    key,
                    family,
                    family_ports,
                    service_errors,
                ));
            }
            // Sorted already (Services in key order, each one's ports in name order).
            let new = crate::btree::packed(ports);
            let old = std::mem::replace(&mut self.family_mut(family).service_ports, new);
            changed_between(&old, &self.family(family).service_ports, &mut changed);
        }
        // Built in bulk: inserted one by one, each name was compared down the tree again.
        update.changed = changed.into_iter().collect();
        let previous = std::mem::take(&mut self.errors);
        for (key, _, _, mut service_errors) in raw {
            service_errors.dedup();
            if service_errors.is_empty() {
                continue;
            }
            let before = previous.get(key);
            update.new_errors.extend(
                service_errors
                    .iter()
                    .filter(|e| before.is_none_or(|before| !before.contains(e)))
                    .cloned(),
            );
            self.errors.insert(key.clone(), service_errors);
        }
        update
    }

    fn update_service(
        &mut self,
        objects: &Objects,
        node: &NodeContext,
        key: &ObjectKey,
        update: &mut SnapshotUpdate,
    ) {
        let mut errors = Vec::new();
        let raw = IpFamily::ALL.map(|family| raw_ports(objects, key, family, &mut errors));
        // Services whose share of a contested frontend moved with this one's change.
        // Every service port of a family carries the Service's cluster IP of that family.
        let old_cluster_ips: Vec<IpAddr> = IpFamily::ALL
            .iter()
            .filter_map(|&family| self.family(family).of_service(key).next())
            .map(|port| port.cluster_ip)
            .collect();
        let affected = self.claims.replace(
            key,
            objects.services.get(key),
            &old_cluster_ips,
            &raw.iter().flatten().collect::<Vec<_>>(),
        );
        for (family, family_ports) in IpFamily::ALL.into_iter().zip(raw) {
            let new = finish_service(
                objects,
                node,
                &self.claims,
                key,
                family,
                family_ports,
                &mut errors,
            );
            let table = &mut self.family_mut(family).service_ports;
            let old: Vec<ServicePortName> = table
                .range(
                    ServicePortName {
                        service: key.clone(),
                        port: "".into(),
                        protocol: super::Protocol::Tcp,
                    }..,
                )
                .take_while(|(name, _)| &name.service == key)
                .map(|(name, _)| name.clone())
                .collect();
            for name in old {
                if !new.contains_key(&name)
                    && let Some(removed) = table.remove(&name)
                {
                    update.changed.insert(removed.name);
                }
            }
            for (name, port) in new {
                if table.get(&name) != Some(&port) {
                    update.changed.insert(name.clone());
                    table.insert(name, port);
                }
            }
        }
        errors.dedup();
        let previous = self.errors.remove(key).unwrap_or_default();
        update
            .new_errors
            .extend(errors.iter().filter(|e| !previous.contains(e)).cloned());
        if !errors.is_empty() {
            self.errors.insert(key.clone(), errors);
        }
        // Their own claims are unchanged, so this recursion ends with them.
        for other in affected {
            self.update_service(objects, node, &other, update);
        }
    }
}

/// One Service's service ports in one family as its fields name them, before claims are
/// settled and endpoints selected.
fn raw_ports(
    objects: &Objects,
    key: &ObjectKey,
    family: IpFamily,
    errors: &mut Vec<ServiceError>,
) -> Vec<ServicePort> {
    match objects.services.get(key) {
        Some(service) => service_ports(key, service, family, errors),
        None => Vec::new(),
    }
}

/// The names of the service ports added, removed or changed from `old` to `new`, into
/// `changed`: one walk of both tables in key order, not a lookup per name.
fn changed_between(
    old: &BTreeMap<ServicePortName, ServicePort>,
    new: &BTreeMap<ServicePortName, ServicePort>,
    changed: &mut Vec<ServicePortName>,
) {
    let mut old = old.iter().peekable();
    let mut new = new.iter().peekable();
    loop {
        let name = match (old.peek(), new.peek()) {
            (None, None) => return,
            (Some((name, _)), None) => {
                let name = (*name).clone();
                old.next();
                name
            }
            (None, Some((name, _))) => {
                let name = (*name).clone();
                new.next();
                name
            }
            (Some((old_name, old_port)), Some((new_name, new_port))) => {
                match old_name.cmp(new_name) {
                    std::cmp::Ordering::Less => {
                        let name = (*old_name).clone();
                        old.next();
                        name
                    }
                    std::cmp::Ordering::Greater => {
                        let name = (*new_name).clone();
                        new.next();
                        name
                    }
                    std::cmp::Ordering::Equal => {
                        let differs = old_port != new_port;
                        let name = (*new_name).clone();
                        old.next();
                        new.next();
                        if !differs {
                            continue;
                        }
                        name
                    }
                }
            }
        };
        changed.push(name);
    }
}

/// Takes away the external and load-balancer addresses another Service owns (see
/// [`super::claims`]); the service port keeps its cluster IP and its other addresses.
fn settle(
    claims: &Claims,
    key: &ObjectKey,
    ports: &mut [ServicePort],
    errors: &mut Vec<ServiceError>,
) {
    for port in ports {
        let (number, protocol) = (port.port, port.protocol);
        let mut lost = |field: &'static str, address: IpAddr| {
            let claim = Claim {
                address,
                port: number,
                protocol,
            };
            match claims.owner(&claim) {
                Some(owner) if owner != key => {
                    errors.push(ServiceError::Conflict {
                        service: key.clone(),
                        field,
                        address,
                        port: number,
                        protocol,
                        owner: owner.clone(),
                    });
                    true
                }
                _ => false,
            }
        };
        port.external_ips
            .retain(|&address| !lost("spec.externalIPs", address));
        port.load_balancer_ips
            .retain(|&address| !lost("status.loadBalancer.ingress[].ip", address));
    }
}

/// The service ports of one Service in one family, settled against the other Services'
/// claims and with their endpoints selected.
fn finish_service(
    objects: &Objects,
    node: &NodeContext,
    claims: &Claims,
    key: &ObjectKey,
    family: IpFamily,
    mut ports: Vec<ServicePort>,
    errors: &mut Vec<ServiceError>,
) -> BTreeMap<ServicePortName, ServicePort> {
    settle(claims, key, &mut ports, errors);
    if ports.is_empty() {
        return BTreeMap::new();
    }
    let mut warnings = Vec::new();
    // Few ports a Service: searched in a list, which needs no owned key per lookup.
    let mut by_port: Vec<_> =
        endpoints_by_port(&objects.slices_of(key), family, &node.name, &mut warnings)
            .into_iter()
            .collect();
    for warning in warnings {
        let error = ServiceError::from(warning);
        if !errors.contains(&error) {
            errors.push(error);
        }
    }
    ports
        .into_iter()
        .map(|mut port| {
            let raw = by_port
                .iter()
                .position(|((name, protocol), _)| {
                    **name == *port.name.port && *protocol == port.protocol
                })
                .map(|at| by_port.swap_remove(at).1)
                .unwrap_or_default();
            let usage = Usage {
                cluster: port.uses_cluster_endpoints(),
                local: port.uses_local_endpoints(),
            };
            let (endpoints, has_any) = categorize(raw, usage, node);
            port.endpoints = endpoints;
            port.has_any_endpoints = has_any;
            (port.name.clone(), port)
        })
        .collect()
}

#[cfg(test)]
mod tests;
