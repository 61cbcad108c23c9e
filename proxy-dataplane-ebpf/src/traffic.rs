//! Reading the per-Service traffic counters (`KPR_SERVICE_TRAFFIC`, and the per-CPU packets and
//! bytes of `KPR_SERVICE_PACKETS`, summed over the CPUs) with the names and kinds
//! `KPR_SERVICE_NAMES` records for each service id, and the endpoints' new connections of
//! `KPR_ENDPOINT_TRAFFIC` (`--service-traffic-endpoints`), from the pins: the agent's metrics
//! read them on a thread of their own, and `proxy-agent inspect top` without the agent.

use std::{
    collections::{BTreeMap, HashMap as StdHashMap},
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
};

use aya::maps::{HashMap, Map, MapData, PerCpuHashMap};
use proxy_common::{
    EndpointTrafficKey, ServiceName, ServicePackets, ServiceTraffic, TrafficDirection,
    TrafficEvent, addr, family, map_names,
};
use proxy_kernel::bpf::map_batch::BatchReader;
use proxy_model::{
    desired::Protocol,
    traffic::{
        EndpointTrafficSample, FrontendKind, PacketCounts, ServicePortLabels, ServiceTrafficKey,
        TrafficCounts, TrafficReading, TrafficSample,
    },
};

#[derive(Debug, thiserror::Error)]
pub enum TrafficError {
    #[error("cannot open the pinned map {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("the pinned map {0} is not of the expected type")]
    Type(&'static str),
    /// A hash map the programs add entries to (`KPR_SERVICE_PACKETS`, `KPR_ENDPOINT_TRAFFIC`),
    /// walked entry by entry.
    #[error("cannot read {map}: {source}")]
    ReadEntries {
        map: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("cannot read {map}: {source}")]
    Read {
        map: &'static str,
        #[source]
        source: proxy_kernel::bpf::map_batch::BatchError,
    },
}

/// `KPR_SERVICE_NAMES` from its pin in `pin_dir`: service id → `namespace/name:port`, what
/// `proxy-agent inspect` and the metrics server's `/debug/ebpf/service-ids` show. Read when
/// asked from the map the agent keeps current, so that no sync builds a second copy of every
/// name.
pub fn service_names(pin_dir: &Path) -> Result<BTreeMap<u32, String>, TrafficError> {
    let path = pin_dir.join(map_names::SERVICE_NAMES);
    let map = MapData::from_pin(&path).map_err(|source| TrafficError::Open { path, source })?;
    let names: HashMap<MapData, u32, ServiceName> = HashMap::try_from(Map::HashMap(map))
        .map_err(|_| TrafficError::Type(map_names::SERVICE_NAMES))?;
    let mut by_id = BTreeMap::new();
    for entry in names.iter() {
        let (id, name) = entry.map_err(|source| TrafficError::ReadEntries {
            map: map_names::SERVICE_NAMES,
            source,
        })?;
        if let Some(name) = name.as_str() {
            by_id.insert(id, name.to_owned());
        }
    }
    Ok(by_id)
}

/// The pinned counters and names, and what was learnt of each service id.
#[derive(Debug)]
pub struct TrafficReader {
    traffic: MapData,
    /// `KPR_SERVICE_PACKETS` (a per-CPU hash, typed at each read).
    packets: Map,
    names: HashMap<MapData, u32, ServiceName>,
    /// `KPR_ENDPOINT_TRAFFIC`; `None` in the pins of an agent from before it.
    endpoints: Option<HashMap<MapData, EndpointTrafficKey, u64>>,
    /// The unit of each (service id, endpoint) pair seen, for as long as it counts.
    endpoint_units: StdHashMap<EndpointTrafficKey, u64>,
    next_endpoint_unit: u64,
    batch: BatchReader,
    entries: Vec<(u32, ServiceTraffic)>,
    /// Each counting id's key, as long as its name record is the same.
    keys: StdHashMap<u32, (ServiceName, Option<ServiceTrafficKey>)>,
}

impl TrafficReader {
    /// Opens the maps the agent pinned in `pin_dir` (`<bpf-root>/kubeproxy-rs`).
    pub fn open(pin_dir: &Path) -> Result<Self, TrafficError> {
        let open = |name: &'static str| {
            let path = pin_dir.join(name);
            MapData::from_pin(&path).map_err(|source| TrafficError::Open { path, source })
        };
        let traffic = open(map_names::SERVICE_TRAFFIC)?;
        let packets = Map::PerCpuHashMap(open(map_names::SERVICE_PACKETS)?);
        PerCpuHashMap::<&MapData, u32, ServicePackets>::try_from(&packets)
            .map_err(|_| TrafficError::Type(map_names::SERVICE_PACKETS))?;
        // The batch read checks the key and value sizes each time.
        let names = HashMap::try_from(Map::HashMap(open(map_names::SERVICE_NAMES)?))
            .map_err(|_| TrafficError::Type(map_names::SERVICE_NAMES))?;
        let endpoints = match open(map_names::ENDPOINT_TRAFFIC) {
            Ok(map) => Some(
                HashMap::try_from(Map::HashMap(map))
                    .map_err(|_| TrafficError::Type(map_names::ENDPOINT_TRAFFIC))?,
            ),
            Err(_) => None,
        };
        Ok(Self {
            traffic,
            packets,
            names,
            endpoints,
            endpoint_units: StdHashMap::new(),
            next_endpoint_unit: 0,
            batch: BatchReader::default(),
            entries: Vec::new(),
            keys: StdHashMap::new(),
        })
    }

    /// One sample per service id that counted anything and whose name is known; `unit` is the
    /// service id. An id the agent hands to a new frontend starts again from 0 (the map writer
    /// zeroes it), and its name record changes with it.
    pub fn read(&mut self) -> Result<TrafficReading, TrafficError> {
        self.batch
            .read(&self.traffic, &mut self.entries)
            .map_err(|source| TrafficError::Read {
                map: map_names::SERVICE_TRAFFIC,
                source,
            })?;
        // Only the frontends reached through tc have an entry: a few next to the ids.
        let per_cpu = PerCpuHashMap::<&MapData, u32, ServicePackets>::try_from(&self.packets)
            .map_err(|_| TrafficError::Type(map_names::SERVICE_PACKETS))?;
        let mut packets = StdHashMap::new();
        for entry in per_cpu.iter() {
            let (id, per_cpu) = entry.map_err(|source| TrafficError::ReadEntries {
                map: map_names::SERVICE_PACKETS,
                source,
            })?;
            packets.insert(id, packet_counts(per_cpu.iter()));
        }
        let mut reading = TrafficReading::default();
        let mut live = Vec::with_capacity(self.entries.len().min(1024));
        for &(id, traffic) in &self.entries {
            let packets = packets.get(&id).copied();
            if traffic.counts.iter().all(|&count| count == 0) && packets.is_none() {
                continue;
            }
            live.push(id);
            let Ok(name) = self.names.get(&id, 0) else {
                continue;
            };
            let key = match self.keys.get(&id) {
                Some((known, key)) if *known == name => key.clone(),
                _ => {
                    let key = key_of(&name);
                    self.keys.insert(id, (name, key.clone()));
                    key
                }
            };
            let Some(key) = key else {
                continue;
            };
            reading.services.push(TrafficSample {
                unit: u64::from(id),
                key,
                counts: TrafficCounts {
                    packets,
                    ..counts_of(&traffic)
                },
            });
        }
        self.read_endpoints(&mut reading)?;
        if self.keys.len() > live.len() {
            let live: std::collections::HashSet<u32> = live.into_iter().collect();
            self.keys.retain(|id, _| live.contains(id));
        }
        Ok(reading)
    }

    /// One endpoint sample per (service id, endpoint) pair that counted, labelled with the
    /// id's Service port (known from its new connections, which every pair's count follows).
    fn read_endpoints(&mut self, reading: &mut TrafficReading) -> Result<(), TrafficError> {
        let Some(endpoints) = &self.endpoints else {
            return Ok(());
        };
        let mut seen = std::collections::HashSet::new();
        for entry in endpoints.iter() {
            let (key, count) = entry.map_err(|source| TrafficError::ReadEntries {
                map: map_names::ENDPOINT_TRAFFIC,
                source,
            })?;
            let Some((_, Some(service))) = self.keys.get(&key.service_id) else {
                continue;
            };
            let Some(endpoint) = endpoint_of(&key) else {
                continue;
            };
            seen.insert(key);
            let unit = *self.endpoint_units.entry(key).or_insert_with(|| {
                self.next_endpoint_unit += 1;
                self.next_endpoint_unit
            });
            reading.endpoints.push(EndpointTrafficSample {
                unit,
                service: service.service.clone(),
                endpoint,
                new_connections: count,
            });
        }
        self.endpoint_units.retain(|key, _| seen.contains(key));
        Ok(())
    }
}

/// The endpoint a `KPR_ENDPOINT_TRAFFIC` key names; `None` for an unknown family.
pub fn endpoint_of(key: &EndpointTrafficKey) -> Option<SocketAddr> {
    let ip = match key.family {
        family::V4 => IpAddr::V4(addr::ip4_from_map(key.addr[0])),
        family::V6 => IpAddr::V6(addr::ip6_from_map(key.addr)),
        _ => return None,
    };
    Some(SocketAddr::new(ip, u16::from_be(key.port)))
}

/// A service id's packets and bytes: its per-CPU values summed (wrapping, as the counters
/// do).
pub fn packet_counts<'a>(per_cpu: impl Iterator<Item = &'a ServicePackets>) -> PacketCounts {
    let (forward, reply) = (
        TrafficDirection::Forward as usize,
        TrafficDirection::Reply as usize,
    );
    per_cpu.fold(PacketCounts::default(), |sum, cpu| PacketCounts {
        forward_packets: sum.forward_packets.wrapping_add(cpu.packets[forward]),
        forward_bytes: sum.forward_bytes.wrapping_add(cpu.bytes[forward]),
        reply_packets: sum.reply_packets.wrapping_add(cpu.packets[reply]),
        reply_bytes: sum.reply_bytes.wrapping_add(cpu.bytes[reply]),
    })
}

/// The connection counts as the model names them (the packets are `KPR_SERVICE_PACKETS`').
pub fn counts_of(traffic: &ServiceTraffic) -> TrafficCounts {
    let count = |event: TrafficEvent| traffic.counts[event as usize];
    TrafficCounts {
        new_connections: count(TrafficEvent::NewConnection),
        packets: None,
        rejected: count(TrafficEvent::Rejected),
        dropped_source_range: count(TrafficEvent::DroppedSourceRange),
        dropped_no_local: count(TrafficEvent::DroppedNoLocal),
    }
}

/// The labels a name record stands for; `None` for a record without its kind and protocol
/// (written by an agent from before they were recorded, until the next sync rewrites it).
pub fn key_of(name: &ServiceName) -> Option<ServiceTrafficKey> {
    let frontend = FrontendKind::from_code(name.kind)?;
    let protocol = Protocol::from_number(name.proto)?;
    let service = ServicePortLabels::parse(name.as_str()?, protocol)?;
    Some(ServiceTrafficKey { service, frontend })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_record_gives_the_labels_of_its_frontend() {
        let name = ServiceName::new("shop/web:https", proxy_common::frontend_kind::NODE_PORT, 6)
            .expect("fits");
        let key = key_of(&name).expect("complete record");
        assert_eq!(key.service.namespace, "shop");
        assert_eq!(key.service.name, "web");
        assert_eq!(key.service.port, "https");
        assert_eq!(key.service.protocol, Protocol::Tcp);
        assert_eq!(key.frontend, FrontendKind::NodePort);
        let unnamed = ServiceName::new("shop/dns", proxy_common::frontend_kind::CLUSTER_IP, 17)
            .expect("fits");
        let key = key_of(&unnamed).expect("complete record");
        assert_eq!(
            (key.service.port.as_str(), key.service.protocol),
            ("", Protocol::Udp)
        );
    }

    #[test]
    fn an_endpoint_key_gives_the_address_and_port_the_backend_maps_hold() {
        let v4 = EndpointTrafficKey {
            service_id: 3,
            addr: [addr::ip4_to_map("10.244.1.2".parse().expect("ip")), 0, 0, 0],
            port: 8080u16.to_be(),
            family: family::V4,
            _pad: 0,
        };
        assert_eq!(endpoint_of(&v4), "10.244.1.2:8080".parse().ok());
        let v6 = EndpointTrafficKey {
            addr: addr::ip6_to_map("fd00:244::2".parse().expect("ip")),
            family: family::V6,
            ..v4
        };
        assert_eq!(endpoint_of(&v6), "[fd00:244::2]:8080".parse().ok());
        assert_eq!(endpoint_of(&EndpointTrafficKey { family: 0, ..v4 }), None);
    }

    #[test]
    fn a_record_without_kind_or_protocol_has_no_labels() {
        let old = ServiceName::new("shop/web:https", 0, 0).expect("fits");
        assert_eq!(key_of(&old), None);
        let unknown_proto =
            ServiceName::new("shop/web", proxy_common::frontend_kind::CLUSTER_IP, 1).expect("fits");
        assert_eq!(key_of(&unknown_proto), None);
    }
}
