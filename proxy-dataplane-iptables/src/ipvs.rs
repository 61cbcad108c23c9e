//! IPVS virtual services left by kube-proxy's ipvs mode. Upstream's ipvs `CleanupLeftovers`
//! flushes every virtual service of the namespace (`ipvs.Flush()`, `IPVS_CMD_FLUSH`): the ipvs
//! proxier owns the whole table. Done here over generic netlink (`linux/ip_vs.h`): resolve the
//! `IPVS` family; when the kernel has none (no ip_vs loaded: no `/proc/net/ip_vs`) no virtual
//! service can exist.
//! Services are counted first (a dump) so the log says what was removed.

use std::time::Duration;

use bytes::{BufMut as _, BytesMut};
use nix::sys::socket::SockProtocol;

use proxy_kernel::netlink::{
    NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkError, NetlinkSocket, attributes, put_str,
};

const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;
const IPVS_GENL_NAME: &str = "IPVS";
const IPVS_GENL_VERSION: u8 = 1;
const IPVS_CMD_GET_SERVICE: u8 = 4;
const IPVS_CMD_FLUSH: u8 = 17;
/// A kernel that never answers must not hang the agent's start.
const RECV_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
#[error("IPVS {what}: {source}")]
pub struct IpvsError {
    what: &'static str,
    #[source]
    source: NetlinkError,
}

fn failed(what: &'static str) -> impl FnOnce(NetlinkError) -> IpvsError {
    move |source| IpvsError { what, source }
}

/// What the flush found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IpvsOutcome {
    /// The kernel has no IPVS (ip_vs not loaded): nothing can be left.
    Absent,
    /// IPVS is there, without virtual services.
    Empty,
    /// This many virtual services were removed.
    Flushed(usize),
}

/// `struct genlmsghdr`: command, version, reserved.
fn genl_header(cmd: u8, version: u8) -> impl Fn(&mut BytesMut) {
    move |buf| {
        buf.put_u8(cmd);
        buf.put_u8(version);
        buf.put_u16_ne(0);
    }
}

struct Genl {
    socket: NetlinkSocket,
}

impl Genl {
    fn open() -> Result<Self, IpvsError> {
        let socket = NetlinkSocket::open(SockProtocol::NetlinkGeneric, Some(RECV_TIMEOUT))
            .map_err(failed("socket"))?;
        Ok(Self { socket })
    }

    /// The id of a generic netlink family; `None` when the kernel has no such family.
    fn family(&mut self, name: &str) -> Result<Option<u16>, IpvsError> {
        let header = genl_header(CTRL_CMD_GETFAMILY, 1);
        self.socket
            .send(GENL_ID_CTRL, NLM_F_REQUEST | NLM_F_ACK, |buf| {
                header(buf);
                put_str(buf, CTRL_ATTR_FAMILY_NAME, name);
            })
            .map_err(failed("family lookup"))?;
        let mut family = None;
        let answer = self.socket.receive(|_, payload| {
            // Past the 4-byte genl header: the attributes.
            family = family.or(family_id(payload.get(4..).unwrap_or_default()));
            Ok::<(), NetlinkError>(())
        });
        match answer {
            Err(NetlinkError::Kernel(nix::Error::ENOENT)) => Ok(None),
            Err(error) => Err(failed("family lookup")(error)),
            Ok(()) => family
                .ok_or(NetlinkError::Malformed("no family id"))
                .map(Some)
                .map_err(failed("family lookup")),
        }
    }
}

/// The `CTRL_ATTR_FAMILY_ID` of a `CTRL_CMD_NEWFAMILY` answer's attributes.
fn family_id(attrs: &[u8]) -> Option<u16> {
    attributes(attrs)
        .find(|(kind, _)| *kind == CTRL_ATTR_FAMILY_ID)
        .and_then(|(_, payload)| payload.get(0..2))
        .map(|b| u16::from_ne_bytes([b[0], b[1]]))
}

/// Where a kernel with IPVS loaded lists the calling thread's namespace's virtual services.
const PROC_IP_VS: &str = "/proc/thread-self/net/ip_vs";

/// Removes every IPVS virtual service of the calling thread's network namespace.
pub fn flush_virtual_services() -> Result<IpvsOutcome, IpvsError> {
    // Without ip_vs loaded there is nothing to remove, and asking generic netlink for the
    // family would make the kernel load the module just to answer.
    if !std::path::Path::new(PROC_IP_VS).exists() {
        return Ok(IpvsOutcome::Absent);
    }
    let mut genl = Genl::open()?;
    let Some(family) = genl.family(IPVS_GENL_NAME)? else {
        return Ok(IpvsOutcome::Absent);
    };
    genl.socket
        .send(
            family,
            NLM_F_REQUEST | NLM_F_DUMP,
            genl_header(IPVS_CMD_GET_SERVICE, IPVS_GENL_VERSION),
        )
        .map_err(failed("service dump"))?;
    let mut services = 0usize;
    genl.socket
        .receive(|_, _| {
            services += 1;
            Ok::<(), NetlinkError>(())
        })
        .map_err(failed("service dump"))?;
    if services == 0 {
        return Ok(IpvsOutcome::Empty);
    }
    genl.socket
        .request_ack(family, 0, genl_header(IPVS_CMD_FLUSH, IPVS_GENL_VERSION))
        .map_err(failed("flush"))?;
    Ok(IpvsOutcome::Flushed(services))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_family_id_is_found_among_the_attributes() {
        let mut buf = BytesMut::new();
        put_str(&mut buf, CTRL_ATTR_FAMILY_NAME, "IPVS");
        proxy_kernel::netlink::put_attr(&mut buf, CTRL_ATTR_FAMILY_ID, &0x1cu16.to_ne_bytes());
        let attrs = buf.to_vec();
        assert_eq!(family_id(&attrs), Some(0x1c));
        assert_eq!(family_id(&attrs[..12]), None);
        assert_eq!(family_id(&[]), None);
    }

    /// The request and answer encoding against the running kernel: the controller family
    /// itself always exists (id `GENL_ID_CTRL`); an unknown name is "absent", not an error.
    /// Read-only queries.
    #[test]
    fn family_lookup_speaks_to_the_kernel() {
        let mut genl = Genl::open().unwrap();
        assert_eq!(genl.family("nlctrl").unwrap(), Some(GENL_ID_CTRL));
        assert_eq!(genl.family("kpr-nofamily").unwrap(), None);
    }
}
