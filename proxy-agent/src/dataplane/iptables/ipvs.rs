//! IPVS virtual services left by kube-proxy's ipvs mode. Upstream's ipvs `CleanupLeftovers`
//! flushes every virtual service of the namespace (`ipvs.Flush()`, `IPVS_CMD_FLUSH`): the ipvs
//! proxier owns the whole table. Done here over generic netlink (`linux/ip_vs.h`): resolve the
//! `IPVS` family; when the kernel has none (no ip_vs loaded: no `/proc/net/ip_vs`) no virtual
//! service can exist.
//! Services are counted first (a dump) so the log says what was removed.

use std::os::fd::{AsRawFd as _, OwnedFd};

use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, recv, send,
    socket,
};

const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;
const IPVS_GENL_NAME: &str = "IPVS";
const IPVS_GENL_VERSION: u8 = 1;
const IPVS_CMD_GET_SERVICE: u8 = 4;
const IPVS_CMD_FLUSH: u8 = 17;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
/// Bound on the datagrams one answer may take (a dump of many services spans several).
const MAX_DATAGRAMS: usize = 1 << 16;

#[derive(Debug, thiserror::Error)]
pub enum IpvsError {
    #[error("IPVS generic netlink socket: {0}")]
    Socket(nix::Error),
    #[error("IPVS {what}: kernel answered {error}")]
    Kernel {
        what: &'static str,
        error: nix::Error,
    },
    #[error("IPVS {0}: malformed reply from the kernel")]
    Malformed(&'static str),
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

struct Genl {
    fd: OwnedFd,
    seq: u32,
}

impl Genl {
    fn open() -> Result<Self, IpvsError> {
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkGeneric,
        )
        .map_err(IpvsError::Socket)?;
        bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0)).map_err(IpvsError::Socket)?;
        Ok(Self { fd, seq: 1 })
    }

    fn request(
        &mut self,
        family: u16,
        flags: u16,
        cmd: u8,
        version: u8,
        attrs: &[(u16, &[u8])],
    ) -> Result<(), IpvsError> {
        self.seq = self.seq.wrapping_add(1);
        let mut buf = Vec::with_capacity(64);
        buf.extend_from_slice(&0u32.to_ne_bytes());
        buf.extend_from_slice(&family.to_ne_bytes());
        buf.extend_from_slice(&flags.to_ne_bytes());
        buf.extend_from_slice(&self.seq.to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes());
        buf.extend_from_slice(&[cmd, version, 0, 0]);
        for (kind, payload) in attrs {
            let len = 4 + payload.len();
            buf.extend_from_slice(&u16::try_from(len).unwrap_or(u16::MAX).to_ne_bytes());
            buf.extend_from_slice(&kind.to_ne_bytes());
            buf.extend_from_slice(payload);
            buf.resize(align4(buf.len()), 0);
        }
        let total = u32::try_from(buf.len()).unwrap_or(u32::MAX);
        buf[0..4].copy_from_slice(&total.to_ne_bytes());
        send(self.fd.as_raw_fd(), &buf, MsgFlags::empty()).map_err(IpvsError::Socket)?;
        Ok(())
    }

    /// Reads until DONE or the ACK/error; `each` gets every data message's attributes (after
    /// the 4-byte genl header).
    fn answer(&self, what: &'static str, mut each: impl FnMut(&[u8])) -> Result<(), IpvsError> {
        let mut buf = vec![0u8; 32 * 1024];
        for _ in 0..MAX_DATAGRAMS {
            let n = recv(self.fd.as_raw_fd(), &mut buf, MsgFlags::empty())
                .map_err(IpvsError::Socket)?;
            let mut rest = buf.get(..n).ok_or(IpvsError::Malformed(what))?;
            while rest.len() >= 16 {
                let len = usize::try_from(u32::from_ne_bytes(
                    rest[0..4]
                        .try_into()
                        .map_err(|_| IpvsError::Malformed(what))?,
                ))
                .unwrap_or(usize::MAX);
                let kind = u16::from_ne_bytes([rest[4], rest[5]]);
                if len < 16 || len > rest.len() {
                    return Err(IpvsError::Malformed(what));
                }
                let message = &rest[16..len];
                match kind {
                    NLMSG_DONE => return Ok(()),
                    NLMSG_ERROR => {
                        let code = message
                            .get(0..4)
                            .and_then(|b| b.try_into().ok())
                            .map(i32::from_ne_bytes)
                            .ok_or(IpvsError::Malformed(what))?;
                        if code == 0 {
                            return Ok(());
                        }
                        return Err(IpvsError::Kernel {
                            what,
                            error: nix::Error::from_raw(code.saturating_neg()),
                        });
                    }
                    _ => each(message.get(4..).unwrap_or_default()),
                }
                rest = &rest[align4(len).min(rest.len())..];
            }
        }
        Err(IpvsError::Malformed(what))
    }
}

impl Genl {
    /// The id of a generic netlink family; `None` when the kernel has no such family.
    fn family(&mut self, name: &str) -> Result<Option<u16>, IpvsError> {
        let name = format!("{name}\0");
        self.request(
            GENL_ID_CTRL,
            NLM_F_REQUEST | NLM_F_ACK,
            CTRL_CMD_GETFAMILY,
            1,
            &[(CTRL_ATTR_FAMILY_NAME, name.as_bytes())],
        )?;
        let mut family = None;
        match self.answer("family lookup", |attrs| {
            family = family.or(family_id(attrs))
        }) {
            Err(IpvsError::Kernel {
                error: nix::Error::ENOENT,
                ..
            }) => Ok(None),
            Err(error) => Err(error),
            Ok(()) => family
                .ok_or(IpvsError::Malformed("family lookup"))
                .map(Some),
        }
    }
}

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// The `CTRL_ATTR_FAMILY_ID` of a `CTRL_CMD_NEWFAMILY` answer's attributes.
fn family_id(mut attrs: &[u8]) -> Option<u16> {
    while attrs.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([attrs[0], attrs[1]]));
        let kind = u16::from_ne_bytes([attrs[2], attrs[3]]) & 0x3fff;
        if len < 4 || len > attrs.len() {
            return None;
        }
        if kind == CTRL_ATTR_FAMILY_ID {
            return attrs.get(4..6).map(|b| u16::from_ne_bytes([b[0], b[1]]));
        }
        attrs = &attrs[align4(len).min(attrs.len())..];
    }
    None
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
    genl.request(
        family,
        NLM_F_REQUEST | NLM_F_DUMP,
        IPVS_CMD_GET_SERVICE,
        IPVS_GENL_VERSION,
        &[],
    )?;
    let mut services = 0usize;
    genl.answer("service dump", |_| services += 1)?;
    if services == 0 {
        return Ok(IpvsOutcome::Empty);
    }
    genl.request(
        family,
        NLM_F_REQUEST | NLM_F_ACK,
        IPVS_CMD_FLUSH,
        IPVS_GENL_VERSION,
        &[],
    )?;
    genl.answer("flush", |_| {})?;
    Ok(IpvsOutcome::Flushed(services))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_family_id_is_found_among_the_attributes() {
        let mut attrs = Vec::new();
        for (kind, payload) in [
            (CTRL_ATTR_FAMILY_NAME, b"IPVS\0".to_vec()),
            (CTRL_ATTR_FAMILY_ID, 0x1cu16.to_ne_bytes().to_vec()),
        ] {
            let len = 4 + payload.len();
            attrs.extend_from_slice(&u16::try_from(len).unwrap().to_ne_bytes());
            attrs.extend_from_slice(&kind.to_ne_bytes());
            attrs.extend_from_slice(&payload);
            attrs.resize(align4(attrs.len()), 0);
        }
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
