//! The two address families as types: each names its map keys and values and converts between
//! them and the family-neutral form (addresses as four network-order words, IPv4 in word 0), so
//! that code over both families is written once, generic over [`IpFamily`]. The map types keep
//! their own layouts (pinned maps outlive a program); only the code is shared.

use crate::{
    Backend4, Backend6, BackendEntry, Frontend4Key, Frontend6Key, RevNat4, RevNat4Key, RevNat6,
    RevNat6Key, family,
};

/// An address family and its map types.
pub trait IpFamily {
    /// Whether this is IPv6.
    const V6: bool;
    /// The family byte of [`crate::CtKey`] and [`crate::NodeAddrKey`].
    const FAMILY: u8;
    /// Key of `KPR_FRONTENDS4/6`.
    type FrontendKey: Copy;
    /// Value of `KPR_BACKENDS4/6`.
    type Backend: BackendEntry;
    /// Key of `KPR_REVNAT4/6`.
    type RevNatKey: Copy;
    /// Value of `KPR_REVNAT4/6`.
    type RevNat: Copy;

    /// The frontend key of `addr` (words), `port` (network order), `proto` and `scope`.
    fn frontend_key(addr: &[u32; 4], port: u16, proto: u8, scope: u8) -> Self::FrontendKey;
    /// A backend's address (words) and port (network order).
    fn backend_addr(backend: &Self::Backend) -> ([u32; 4], u16);
    /// The reverse-NAT key of a socket and the backend it was sent to.
    fn revnat_key(cookie: u64, addr: &[u32; 4], port: u16) -> Self::RevNatKey;
    /// The reverse-NAT value: the service address the socket dialled.
    fn revnat(addr: &[u32; 4], port: u16) -> Self::RevNat;
    /// A reverse-NAT value's address (words) and port.
    fn revnat_addr(revnat: &Self::RevNat) -> ([u32; 4], u16);
}

/// IPv4.
#[derive(Clone, Copy, Debug)]
pub struct V4;

/// IPv6.
#[derive(Clone, Copy, Debug)]
pub struct V6;

impl IpFamily for V4 {
    const V6: bool = false;
    const FAMILY: u8 = family::V4;
    type FrontendKey = Frontend4Key;
    type Backend = Backend4;
    type RevNatKey = RevNat4Key;
    type RevNat = RevNat4;

    #[inline(always)]
    fn frontend_key(addr: &[u32; 4], port: u16, proto: u8, scope: u8) -> Frontend4Key {
        Frontend4Key {
            addr: addr[0],
            port,
            proto,
            scope,
        }
    }
    #[inline(always)]
    fn backend_addr(backend: &Backend4) -> ([u32; 4], u16) {
        ([backend.addr, 0, 0, 0], backend.port)
    }
    #[inline(always)]
    fn revnat_key(cookie: u64, addr: &[u32; 4], port: u16) -> RevNat4Key {
        RevNat4Key {
            cookie,
            addr: addr[0],
            port,
            _pad: 0,
        }
    }
    #[inline(always)]
    fn revnat(addr: &[u32; 4], port: u16) -> RevNat4 {
        RevNat4 {
            addr: addr[0],
            port,
            _pad: 0,
        }
    }
    #[inline(always)]
    fn revnat_addr(revnat: &RevNat4) -> ([u32; 4], u16) {
        ([revnat.addr, 0, 0, 0], revnat.port)
    }
}

impl IpFamily for V6 {
    const V6: bool = true;
    const FAMILY: u8 = family::V6;
    type FrontendKey = Frontend6Key;
    type Backend = Backend6;
    type RevNatKey = RevNat6Key;
    type RevNat = RevNat6;

    #[inline(always)]
    fn frontend_key(addr: &[u32; 4], port: u16, proto: u8, scope: u8) -> Frontend6Key {
        Frontend6Key {
            addr: *addr,
            port,
            proto,
            scope,
        }
    }
    #[inline(always)]
    fn backend_addr(backend: &Backend6) -> ([u32; 4], u16) {
        (backend.addr, backend.port)
    }
    #[inline(always)]
    fn revnat_key(cookie: u64, addr: &[u32; 4], port: u16) -> RevNat6Key {
        RevNat6Key {
            cookie,
            addr: *addr,
            port,
            _pad: [0; 3],
        }
    }
    #[inline(always)]
    fn revnat(addr: &[u32; 4], port: u16) -> RevNat6 {
        RevNat6 {
            addr: *addr,
            port,
            _pad: 0,
        }
    }
    #[inline(always)]
    fn revnat_addr(revnat: &RevNat6) -> ([u32; 4], u16) {
        (revnat.addr, revnat.port)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The family-neutral form round-trips through each family's types.
    #[test]
    fn each_family_keeps_its_words() {
        let v4 = [0x0100_000a, 0, 0, 0];
        let key = V4::frontend_key(&v4, 80, 6, 0);
        assert_eq!((key.addr, key.port), (v4[0], 80));
        assert_eq!(V4::revnat_addr(&V4::revnat(&v4, 80)), (v4, 80));
        assert_eq!(V4::revnat_key(3, &v4, 80).addr, v4[0]);
        let v6 = [1, 2, 3, 4];
        assert_eq!(V6::frontend_key(&v6, 80, 6, 0).addr, v6);
        assert_eq!(V6::revnat_addr(&V6::revnat(&v6, 80)), (v6, 80));
        let backend = Backend6 {
            addr: v6,
            port: 8080,
            proto: 6,
            flags: 0,
        };
        assert_eq!(V6::backend_addr(&backend), (v6, 8080));
    }
}
