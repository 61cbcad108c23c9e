//! The datapath self-test: a synthetic TCP SYN to a frontend the map writer wrote, run with
//! `BPF_PROG_TEST_RUN` through the program each external interface's ingress hook runs (the
//! one the kernel lists in the hook, not the object's copy), and checked to come out addressed
//! to one of that frontend's backends. It catches what the drift check cannot see from the
//! maps alone: a program missing from its hook, and a translation that no longer leads to a
//! backend (a corrupted slot or backend entry) whatever the cause.
//!
//! A run of the live program writes the live LRU conntrack maps like a real packet: the probe
//! comes from a documentation address (RFC 5737, RFC 3849) no real client has, from a fixed
//! port, and its entries (forward, and the reply entry that answers it) are deleted before the
//! run (a leftover entry would pin the flow to an old backend and hide a broken translation)
//! and after it. Frontends with session affinity or source ranges are not probed (an affinity
//! entry per probe; a range may refuse the documentation address). The programs do not count
//! the probe in the per-Service traffic counters (`proxy_common::probe`).

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::AsFd as _,
};

use aya::programs::{ProgramFd, SchedClassifier, TcAttachType};
use proxy_common::{
    CtKey,
    conntrack::reverse_key,
    family,
    inet_checksum::{inet_checksum, l4_checksum},
    proto,
};
use tracing::debug;

use crate::{
    attach::tc::Attachment,
    dataplane::EbpfDataplane,
    maps::map_writer::{ProbeTarget, ip4_to_map, ip6_to_map},
    test_run::{TcTestInput, run_tc_fd},
};
use proxy_model::desired::IpFamily;

/// The probe's IPv4 client: TEST-NET-1's last address.
pub const PROBE_CLIENT4: Ipv4Addr = proxy_common::probe::CLIENT4;
/// The probe's IPv6 client, in the documentation prefix.
pub const PROBE_CLIENT6: Ipv6Addr = proxy_common::probe::CLIENT6;
/// The probe's source port (its entries are deleted around each run, so one port serves). The
/// programs leave this client's flows out of the per-Service traffic counters
/// (`proxy_common::probe`): a probe is no client's connection.
pub const PROBE_PORT: u16 = proxy_common::probe::PORT;
/// The most external interfaces one self-test probes: each costs a hook query and one run per
/// family, and a node with more uplinks than this is not one to spend the loop's time on.
pub const MAX_PROBED_INTERFACES: usize = 16;

/// `TC_ACT_SHOT`: dropped. A translated packet leaves with any other action: `TC_ACT_OK`,
/// `TC_ACT_UNSPEC` (TCX's next program, then the stack: the netfilter path) or
/// `TC_ACT_REDIRECT` (the fast path).
const TC_ACT_SHOT: i32 = 2;

/// What one probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeOutcome {
    /// Translated to one of the frontend's backends.
    Passed,
    /// Service traffic through this program is broken: why.
    Failed(String),
    /// Nothing to probe (no frontend fits): why.
    Skipped(String),
}

/// The self-test of one external interface's ingress program for one family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProgramProbe {
    pub interface: String,
    pub program: &'static str,
    /// The kernel id of the program that ran.
    pub program_id: Option<u32>,
    pub family: Option<IpFamily>,
    /// The probed frontend: destination and owner.
    pub frontend: Option<String>,
    /// Where the program sent the probe.
    pub translated_to: Option<SocketAddr>,
    pub outcome: ProbeOutcome,
}

/// Every probe of one self-test.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SelfTest {
    pub probes: Vec<ProgramProbe>,
}

impl SelfTest {
    /// No probe failed (skipped ones do not count: nothing to send traffic to).
    pub fn passed(&self) -> bool {
        !self
            .probes
            .iter()
            .any(|probe| matches!(probe.outcome, ProbeOutcome::Failed(_)))
    }
}

impl EbpfDataplane {
    /// Runs the self-test (see the module) through every external interface's ingress
    /// program as the last refresh left the attachments. Cheap (a hook query and a run or two
    /// per external interface), so it runs in the caller's thread.
    pub fn self_test(&mut self) -> SelfTest {
        let targets = self.map_writer.probe_targets();
        let node_addrs: Vec<IpAddr> = self
            .tc
            .node_port_addrs()
            .filter(|addr| !addr.is_loopback())
            .collect();
        let external: Vec<Attachment> = self
            .tc
            .attachments()
            .into_iter()
            .filter(|attachment| attachment.external)
            .take(MAX_PROBED_INTERFACES)
            .collect();
        let mut test = SelfTest::default();
        for attachment in external {
            let probe = |outcome, program_id| ProgramProbe {
                interface: attachment.interface.clone(),
                program: attachment.program,
                program_id,
                family: None,
                frontend: None,
                translated_to: None,
                outcome,
            };
            if !attachment.attached {
                let why = attachment
                    .error
                    .clone()
                    .unwrap_or_else(|| "not attached".to_owned());
                test.probes.push(probe(
                    ProbeOutcome::Failed(format!("not attached: {why}")),
                    None,
                ));
                continue;
            }
            let fd = match self.hook_program(&attachment) {
                Ok(fd) => fd,
                Err(why) => {
                    test.probes
                        .push(probe(ProbeOutcome::Failed(why), attachment.program_id));
                    continue;
                }
            };
            let mut probed = false;
            for family in IpFamily::ALL {
                let Some((target, dst)) = pick(&targets, family, &node_addrs) else {
                    continue;
                };
                probed = true;
                let (translated_to, outcome) = self.probe(&fd, &attachment, target, dst);
                debug!(
                    interface = %attachment.interface,
                    frontend = %dst,
                    ?translated_to,
                    ?outcome,
                    "datapath self-test probe"
                );
                test.probes.push(ProgramProbe {
                    family: Some(family),
                    frontend: Some(format!("{dst} ({})", target.service)),
                    translated_to,
                    ..probe(outcome, attachment.program_id)
                });
            }
            if !probed {
                test.probes.push(probe(
                    ProbeOutcome::Skipped(
                        "no external TCP frontend with backends (without affinity or source \
                         ranges) to probe"
                            .to_owned(),
                    ),
                    attachment.program_id,
                ));
            }
        }
        test
    }

    /// The program our link runs in the attachment's hook, as the kernel lists it: a program
    /// missing from the hook is the failure the self-test reports (detached behind our back).
    fn hook_program(&mut self, attachment: &Attachment) -> Result<ProgramFd, String> {
        let Some(id) = attachment.program_id.filter(|_| attachment.tcx) else {
            // A legacy filter (or a link whose program id the kernel did not tell): the
            // program we attached, which the hook runs while the filter is ours.
            let classifier = self
                .tc
                .legacy_program(&mut self.ebpf, attachment.program, &self.pin_dir)
                .map_err(|error| format!("cannot open the program: {error}"))?;
            let fd = classifier
                .fd()
                .map_err(|error| format!("cannot open the program: {error}"))?;
            return fd
                .try_clone()
                .map_err(|error| format!("cannot open the program: {error}"));
        };
        let (_, programs) =
            SchedClassifier::query_tcx(&attachment.interface, TcAttachType::Ingress)
                .map_err(|error| format!("cannot query the ingress hook: {error}"))?;
        let info = programs
            .into_iter()
            .find(|info| info.id() == id)
            .ok_or_else(|| format!("program {id} is not in the ingress hook (detached)"))?;
        info.fd()
            .map_err(|error| format!("cannot open program {id}: {error}"))
    }

    /// One synthetic SYN from the probe client to `dst` through `fd`: where it went and
    /// whether that is one of `target`'s backends.
    fn probe(
        &mut self,
        fd: &ProgramFd,
        attachment: &Attachment,
        target: &ProbeTarget,
        dst: SocketAddr,
    ) -> (Option<SocketAddr>, ProbeOutcome) {
        let client = SocketAddr::new(probe_client(target.family), PROBE_PORT);
        let packet = tcp_syn(client, dst);
        let key = ct_key(client, dst);
        self.forget_probe(&key, client.ip());
        let input = TcTestInput {
            ifindex: attachment.ifindex,
            ..TcTestInput::default()
        };
        let run = run_tc_fd(fd.as_fd(), attachment.program, &packet, input, 1);
        self.forget_probe(&key, client.ip());
        let run = match run {
            Ok((run, _)) => run,
            Err(error) => {
                return (
                    None,
                    ProbeOutcome::Failed(format!("test run failed: {error}")),
                );
            }
        };
        let translated_to = destination(&run.packet);
        let outcome = match translated_to {
            _ if run.action == TC_ACT_SHOT => ProbeOutcome::Failed(format!(
                "dropped (action {TC_ACT_SHOT}); translated to {}",
                translated_to.map_or_else(|| "nothing".to_owned(), |to| to.to_string())
            )),
            Some(to) if target.backends.contains(&to) => ProbeOutcome::Passed,
            Some(to) if to == dst => ProbeOutcome::Failed(format!(
                "not translated (action {}): the packet still goes to the frontend",
                run.action
            )),
            Some(to) => ProbeOutcome::Failed(format!(
                "translated to {to} (action {}), which is not one of its {} backends",
                run.action,
                target.backends.len()
            )),
            None => ProbeOutcome::Failed(format!(
                "the program returned {} and no IP packet",
                run.action
            )),
        };
        (translated_to, outcome)
    }

    /// Deletes the probe flow's conntrack entries: the forward one under `key`, the entry of
    /// its translated tuple (the netfilter path's egress half: client → backend, which the
    /// egress program source-translates), and the reply entries (backend → client, backend →
    /// SNAT address). Each only if it is the probe client's (its key's source, or its value's
    /// destination): never a real flow's.
    fn forget_probe(&mut self, key: &CtKey, client: IpAddr) {
        let Ok(mut maps) = self.conntrack_map() else {
            return;
        };
        let client = map_addr(client);
        let mut keys = vec![*key];
        if let Some(forward) = maps.get(key) {
            keys.push(reverse_key(key, &forward));
            let translated = CtKey {
                dst: forward.dst,
                dport: forward.dport,
                ..*key
            };
            keys.push(translated);
            // The backend's replies before the egress program's source translation.
            keys.push(CtKey {
                src: translated.dst,
                dst: translated.src,
                sport: translated.dport,
                dport: translated.sport,
                ..translated
            });
            if let Some(egress) = maps.get(&translated) {
                keys.push(reverse_key(&translated, &egress));
            }
        }
        for key in keys {
            if maps
                .get(&key)
                .is_some_and(|value| key.src == client || value.dst == client)
            {
                let _ = maps.remove(&key);
            }
        }
    }
}

/// The first target of `family` the probe can address: a NodePort through a NodePort address
/// of its family, any other frontend at its own address.
fn pick<'a>(
    targets: &'a [ProbeTarget],
    family: IpFamily,
    node_addrs: &[IpAddr],
) -> Option<(&'a ProbeTarget, SocketAddr)> {
    targets
        .iter()
        .filter(|target| target.family == family)
        .find_map(|target| {
            let addr = if target.addr.is_unspecified() {
                *node_addrs
                    .iter()
                    .find(|addr| addr.is_ipv4() == target.addr.is_ipv4())?
            } else {
                target.addr
            };
            Some((target, SocketAddr::new(addr, target.port)))
        })
}

fn probe_client(family: IpFamily) -> IpAddr {
    match family {
        IpFamily::V4 => IpAddr::V4(PROBE_CLIENT4),
        IpFamily::V6 => IpAddr::V6(PROBE_CLIENT6),
    }
}

/// An address as the conntrack maps hold it (IPv4 in word 0).
fn map_addr(addr: IpAddr) -> [u32; 4] {
    match addr {
        IpAddr::V4(addr) => [ip4_to_map(addr), 0, 0, 0],
        IpAddr::V6(addr) => ip6_to_map(addr),
    }
}

/// The probe flow's forward conntrack key.
fn ct_key(client: SocketAddr, dst: SocketAddr) -> CtKey {
    CtKey {
        src: map_addr(client.ip()),
        dst: map_addr(dst.ip()),
        sport: client.port().to_be(),
        dport: dst.port().to_be(),
        proto: proto::TCP,
        family: if client.is_ipv4() {
            family::V4
        } else {
            family::V6
        },
        _pad: 0,
    }
}

const ETH_HLEN: usize = 14;
const TCP_HLEN: usize = 20;
/// Locally administered MAC addresses: the programs read neither.
const PROBE_SRC_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];
const PROBE_DST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];

/// An Ethernet frame with a TCP SYN from `src` to `dst` (same family), checksums correct.
pub fn tcp_syn(src: SocketAddr, dst: SocketAddr) -> Vec<u8> {
    let mut tcp = [0u8; TCP_HLEN];
    tcp[0..2].copy_from_slice(&src.port().to_be_bytes());
    tcp[2..4].copy_from_slice(&dst.port().to_be_bytes());
    tcp[4..8].copy_from_slice(&0x4b50_5253_u32.to_be_bytes());
    tcp[12] = (TCP_HLEN as u8 / 4) << 4;
    tcp[13] = 0x02; // SYN
    tcp[14..16].copy_from_slice(&64_240_u16.to_be_bytes());
    let mut frame = Vec::with_capacity(ETH_HLEN + 40 + TCP_HLEN);
    frame.extend_from_slice(&PROBE_DST_MAC);
    frame.extend_from_slice(&PROBE_SRC_MAC);
    match (src.ip(), dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            frame.extend_from_slice(&0x0800_u16.to_be_bytes());
            let mut ip = [0u8; 20];
            ip[0] = 0x45;
            ip[2..4].copy_from_slice(&(20 + TCP_HLEN as u16).to_be_bytes());
            ip[6] = 0x40; // DF
            ip[8] = 64;
            ip[9] = proto::TCP;
            ip[12..16].copy_from_slice(&s.octets());
            ip[16..20].copy_from_slice(&d.octets());
            let check = inet_checksum(&ip);
            ip[10..12].copy_from_slice(&check.to_be_bytes());
            let check = l4_checksum(IpAddr::V4(s), IpAddr::V4(d), proto::TCP, &tcp);
            tcp[16..18].copy_from_slice(&check.to_be_bytes());
            frame.extend_from_slice(&ip);
        }
        (s, d) => {
            let to6 = |addr: IpAddr| match addr {
                IpAddr::V4(a) => a.to_ipv6_mapped(),
                IpAddr::V6(a) => a,
            };
            let (s, d) = (to6(s), to6(d));
            frame.extend_from_slice(&0x86dd_u16.to_be_bytes());
            let mut ip = [0u8; 40];
            ip[0] = 0x60;
            ip[4..6].copy_from_slice(&(TCP_HLEN as u16).to_be_bytes());
            ip[6] = proto::TCP;
            ip[7] = 64;
            ip[8..24].copy_from_slice(&s.octets());
            ip[24..40].copy_from_slice(&d.octets());
            let check = l4_checksum(IpAddr::V6(s), IpAddr::V6(d), proto::TCP, &tcp);
            tcp[16..18].copy_from_slice(&check.to_be_bytes());
            frame.extend_from_slice(&ip);
        }
    }
    frame.extend_from_slice(&tcp);
    frame
}

/// The destination address and port of an Ethernet frame with an IPv4 or IPv6 TCP/UDP packet.
pub fn destination(frame: &[u8]) -> Option<SocketAddr> {
    let ethertype = u16::from_be_bytes([*frame.get(12)?, *frame.get(13)?]);
    let ip = frame.get(ETH_HLEN..)?;
    let (addr, l4) = match ethertype {
        0x0800 => {
            let ihl = usize::from(ip.first()? & 0x0f) * 4;
            let octets: [u8; 4] = ip.get(16..20)?.try_into().ok()?;
            (IpAddr::V4(Ipv4Addr::from(octets)), ip.get(ihl..)?)
        }
        0x86dd => {
            let octets: [u8; 16] = ip.get(24..40)?.try_into().ok()?;
            (IpAddr::V6(Ipv6Addr::from(octets)), ip.get(40..)?)
        }
        _ => return None,
    };
    let port = u16::from_be_bytes([*l4.get(2)?, *l4.get(3)?]);
    Some(SocketAddr::new(addr, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(addr: &str, backends: &[&str]) -> ProbeTarget {
        let addr: IpAddr = addr.parse().unwrap();
        ProbeTarget {
            family: if addr.is_ipv4() {
                IpFamily::V4
            } else {
                IpFamily::V6
            },
            addr,
            port: 30080,
            service: "default/web:http".to_owned(),
            backends: backends.iter().map(|b| b.parse().unwrap()).collect(),
        }
    }

    #[test]
    fn a_syn_carries_its_destination_and_valid_checksums() {
        for (src, dst) in [
            ("192.0.2.254:40999", "10.0.0.1:30080"),
            ("[2001:db8::dead:beef]:40999", "[fd00::1]:30080"),
        ] {
            let (src, dst): (SocketAddr, SocketAddr) = (src.parse().unwrap(), dst.parse().unwrap());
            let frame = tcp_syn(src, dst);
            assert_eq!(destination(&frame), Some(dst));
            let l4 = if dst.is_ipv4() {
                let ip = &frame[ETH_HLEN..ETH_HLEN + 20];
                assert_eq!(inet_checksum(ip), 0, "IPv4 header checksum");
                &frame[ETH_HLEN + 20..]
            } else {
                &frame[ETH_HLEN + 40..]
            };
            assert_eq!(
                l4_checksum(src.ip(), dst.ip(), proto::TCP, l4),
                0,
                "TCP checksum of {dst}"
            );
            assert_eq!(l4[13], 0x02, "a SYN");
        }
    }

    #[test]
    fn a_node_port_is_probed_at_a_node_port_address_of_its_family() {
        let targets = [
            target("0.0.0.0", &["10.244.0.5:8080"]),
            target("192.0.2.10", &["10.244.0.5:8080"]),
            target("::", &["[fd00::5]:8080"]),
        ];
        let v4: IpAddr = "10.0.0.1".parse().unwrap();
        let picked = pick(&targets, IpFamily::V4, &[v4]).map(|(_, dst)| dst);
        assert_eq!(picked, Some(SocketAddr::new(v4, 30080)));
        // Without a NodePort address of the family the next candidate is taken.
        let picked = pick(&targets, IpFamily::V4, &[]).map(|(_, dst)| dst);
        assert_eq!(picked, Some("192.0.2.10:30080".parse().unwrap()));
        assert_eq!(pick(&targets, IpFamily::V6, &[v4]), None);
    }

    #[test]
    fn the_probe_key_is_the_forward_tuple_in_network_order() {
        let key = ct_key(
            "192.0.2.254:40999".parse().unwrap(),
            "10.0.0.1:30080".parse().unwrap(),
        );
        assert_eq!(key.sport, 40999u16.to_be());
        assert_eq!(key.dport, 30080u16.to_be());
        assert_eq!(key.src[0], ip4_to_map(PROBE_CLIENT4));
        assert_eq!(key.family, family::V4);
    }
}
