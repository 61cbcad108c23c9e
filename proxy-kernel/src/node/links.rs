//! Link facts `getifaddrs` does not give: the link kind (`IFLA_INFO_KIND`: bridge, veth,
//! vxlan...), the hardware type (`ARPHRD_*`: whether frames carry an Ethernet header) and the
//! bridge or bond a port belongs to, from one `RTM_GETLINK` dump over `NETLINK_ROUTE` in the
//! caller's network namespace. Which interfaces get which tc program depends on them
//! (`node::ebpf::tc_role`).

use std::{collections::BTreeMap, time::Duration};

use bytes::BufMut as _;
use nix::sys::socket::SockProtocol;

use crate::netlink::{
    NLM_F_DUMP, NLM_F_REQUEST, NetlinkError, NetlinkSocket, attributes, read2, read4,
};

/// `ARPHRD_ETHER`: frames start with an Ethernet header (veths, NICs, bridges, VXLAN, taps).
pub const ARPHRD_ETHER: u16 = 1;

/// One link as the kernel reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    /// Administratively up (`IFF_UP`) and operationally running (`IFF_RUNNING`: carrier, or a
    /// device without carrier state such as a dummy).
    pub up: bool,
    /// `IFLA_INFO_KIND` (`bridge`, `veth`, `vxlan`, `wireguard`, `tun`...); `None` for a
    /// physical device.
    pub kind: Option<String>,
    /// `ifi_type` (`ARPHRD_*`).
    pub hardware_type: u16,
    /// The ifindex of the bridge, bond or VRF this link is a port of.
    pub master: Option<u32>,
    /// `IFLA_ADDRESS` of an Ethernet link (its MAC); `None` for other link types.
    pub mac: Option<[u8; 6]>,
}

impl Link {
    /// Whether packets here start with an Ethernet header, as the tc programs' parser assumes.
    pub fn ethernet(&self) -> bool {
        self.hardware_type == ARPHRD_ETHER
    }
}

const IFINFOMSG_LEN: usize = 16;
const RTM_NEWLINK: u16 = 16;
const RTM_GETLINK: u16 = 18;
const IFLA_ADDRESS: u16 = 1;
const IFLA_IFNAME: u16 = 3;
const IFLA_MASTER: u16 = 10;
const IFLA_LINKINFO: u16 = 18;
const IFLA_INFO_KIND: u16 = 1;
const IFF_UP: u32 = 0x1;
const IFF_RUNNING: u32 = 0x40;
/// Bounds each receive of the dump: the kernel answers at once, or something is wrong.
const RECV_TIMEOUT: Duration = Duration::from_secs(5);

/// Every link of the caller's network namespace, by name.
pub fn host_links() -> Result<BTreeMap<String, Link>, NetlinkError> {
    let mut socket = NetlinkSocket::open(SockProtocol::NetlinkRoute, Some(RECV_TIMEOUT))?;
    // ifinfomsg: all zero (AF_UNSPEC, every link).
    socket.send(RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, |body| {
        body.put_bytes(0, IFINFOMSG_LEN);
    })?;
    let mut links = BTreeMap::new();
    socket.receive(|kind, payload| {
        add_link(kind, payload, &mut links);
        Ok::<(), NetlinkError>(())
    })?;
    Ok(links)
}

/// Records one dump message's link, if it is one.
fn add_link(kind: u16, payload: &[u8], links: &mut BTreeMap<String, Link>) {
    if kind == RTM_NEWLINK
        && let Some((name, link)) = parse_link(payload)
    {
        links.insert(name, link);
    }
}

/// One `RTM_NEWLINK` body: `ifinfomsg` then attributes.
fn parse_link(body: &[u8]) -> Option<(String, Link)> {
    let hardware_type = u16_at(body, 2)?;
    let index = u32_at(body, 4)?;
    let flags = u32_at(body, 8)?;
    let mut link = Link {
        index,
        up: flags & IFF_UP != 0 && flags & IFF_RUNNING != 0,
        kind: None,
        hardware_type,
        master: None,
        mac: None,
    };
    let mut name = None;
    for (kind, value) in attributes(body.get(IFINFOMSG_LEN..)?) {
        match kind {
            IFLA_IFNAME => name = Some(c_string(value)),
            IFLA_MASTER => link.master = u32_at(value, 0).filter(|m| *m != 0),
            IFLA_ADDRESS if link.ethernet() => link.mac = value.try_into().ok(),
            IFLA_LINKINFO => {
                link.kind = attributes(value)
                    .find(|(kind, _)| *kind == IFLA_INFO_KIND)
                    .map(|(_, value)| c_string(value));
            }
            _ => {}
        }
    }
    Some((name?, link))
}

fn c_string(value: &[u8]) -> String {
    let end = value.iter().position(|b| *b == 0).unwrap_or(value.len());
    String::from_utf8_lossy(&value[..end]).into_owned()
}

fn u16_at(bytes: &[u8], at: usize) -> Option<u16> {
    read2(bytes, at).ok().map(u16::from_ne_bytes)
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    read4(bytes, at).ok().map(u32::from_ne_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::{NLMSG_DONE, NLMSG_ERROR, NLMSG_HDRLEN, align4, walk_datagram};

    /// One received datagram through the shared framing, as `host_links` reads it.
    fn parse_batch(bytes: &[u8], links: &mut BTreeMap<String, Link>) -> Result<bool, NetlinkError> {
        walk_datagram(bytes, &mut |kind, payload| {
            add_link(kind, payload, links);
            Ok::<(), NetlinkError>(())
        })
    }

    fn attr(kind: u16, value: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&((4 + value.len()) as u16).to_ne_bytes());
        out.extend_from_slice(&kind.to_ne_bytes());
        out.extend_from_slice(value);
        out.resize(align4(out.len()), 0);
        out
    }

    fn message(kind: u16, seq: u32, body: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&((NLMSG_HDRLEN + body.len()) as u32).to_ne_bytes());
        out.extend_from_slice(&kind.to_ne_bytes());
        out.extend_from_slice(&NLM_F_REQUEST.to_ne_bytes());
        out.extend_from_slice(&seq.to_ne_bytes());
        out.extend_from_slice(&0u32.to_ne_bytes());
        out.extend_from_slice(body);
        out.resize(align4(out.len()), 0);
        out
    }

    fn new_link(name: &str, hw: u16, index: u32, flags: u32, extra: &[Vec<u8>]) -> Vec<u8> {
        let mut body = vec![0u8, 0];
        body.extend_from_slice(&hw.to_ne_bytes());
        body.extend_from_slice(&index.to_ne_bytes());
        body.extend_from_slice(&flags.to_ne_bytes());
        body.extend_from_slice(&0u32.to_ne_bytes());
        body.extend(attr(IFLA_IFNAME, format!("{name}\0").as_bytes()));
        for a in extra {
            body.extend_from_slice(a);
        }
        message(RTM_NEWLINK, 1, &body)
    }

    #[test]
    fn a_dump_gives_kind_type_state_master_and_mac() {
        // IFLA_LINKINFO is sent with the nested flag (0x8000), which the mask drops.
        let info = attr(IFLA_LINKINFO | 0x8000, &attr(IFLA_INFO_KIND, b"bridge\0"));
        let mut batch = new_link("docker0", ARPHRD_ETHER, 3, IFF_UP, &[info]);
        batch.extend(new_link(
            "eth0",
            ARPHRD_ETHER,
            2,
            IFF_UP | IFF_RUNNING,
            &[
                attr(IFLA_MASTER, &7u32.to_ne_bytes()),
                attr(IFLA_ADDRESS, &[2, 0, 0, 0, 0, 9]),
            ],
        ));
        batch.extend(new_link(
            "wg0",
            65534,
            4,
            IFF_UP | IFF_RUNNING,
            &[attr(IFLA_ADDRESS, &[10, 0, 0, 1, 0, 0])],
        ));
        let mut links = BTreeMap::new();
        assert!(!parse_batch(&batch, &mut links).expect("parse"));
        assert!(parse_batch(&message(NLMSG_DONE, 1, &[0; 4]), &mut links).expect("done"));
        let docker = &links["docker0"];
        assert_eq!(docker.kind.as_deref(), Some("bridge"));
        assert!(!docker.up, "no carrier: not running");
        assert_eq!((docker.index, docker.master), (3, None));
        let eth = &links["eth0"];
        assert!(eth.up && eth.ethernet() && eth.kind.is_none());
        assert_eq!(eth.master, Some(7));
        assert_eq!(eth.mac, Some([2, 0, 0, 0, 0, 9]));
        assert_eq!(docker.mac, None);
        assert!(!links["wg0"].ethernet());
        assert_eq!(links["wg0"].mac, None, "not an Ethernet link");
    }

    #[test]
    fn an_error_or_a_truncated_message_is_an_error() {
        let mut links = BTreeMap::new();
        let error = message(NLMSG_ERROR, 1, &(-libc::EPERM).to_ne_bytes());
        let err = parse_batch(&error, &mut links).expect_err("error");
        assert!(
            matches!(err, NetlinkError::Kernel(nix::Error::EPERM)),
            "{err:?}"
        );
        let mut truncated = new_link("eth0", ARPHRD_ETHER, 2, IFF_UP, &[]);
        truncated[0] = 200;
        assert!(parse_batch(&truncated, &mut links).is_err());
    }

    #[test]
    fn the_real_dump_lists_loopback() {
        let links = host_links().expect("dump");
        let lo = links.get("lo").expect("lo");
        assert_eq!(lo.index, 1);
        assert_eq!(lo.hardware_type, 772, "ARPHRD_LOOPBACK");
    }
}
