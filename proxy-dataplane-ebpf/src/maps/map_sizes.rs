//! Capacities of the LRU maps the datapath writes (tc conntrack, socket reverse NAT, session
//! affinity, per-socket UDP choice).
//!
//! The kernel preallocates every LRU hash map: its whole capacity is kernel memory from the
//! moment it is created, used or not. By default they are sized as kube-proxy sizes the
//! kernel's conntrack table (`conntrack.maxPerCore` × CPUs, at least `conntrack.min`): the
//! flows a node is meant to track, whatever its memory. `--bpf-map-dynamic-size-ratio` (as
//! Cilium's flag) gives them a share of the node's memory instead, which is also what a node
//! with `conntrack.maxPerCore: 0` gets (kube-proxy leaves the kernel's table, sized from
//! memory); `--bpf-map-conntrack` still sets each conntrack map exactly. The hash maps only the
//! agent writes are not preallocated and follow use (see `proxy-ebpf`'s `maps.rs`).

use proxy_common::{
    AffinityKey, AffinityValue, CtKey, CtKey4, CtValue, CtValue4, RevNat4, RevNat4Key, RevNat6,
    RevNat6Key,
};

pub use proxy_model::config::ebpf_settings::{DEFAULT_DYNAMIC_SIZE_RATIO, SizeRatio};

/// Shares of the budget, in percent: the conntrack maps hold two to four entries per external
/// flow (IPv4 gets two thirds of their share, and with its smaller entries 93 % as many
/// entries as the one map of both families had before: most external traffic is IPv4); the
/// other maps one per socket or client. Each conntrack map's share includes its unanswered
/// flows' map, a quarter of its entries (`KPR_CT4_NEW`): four fifths of 40 % and 20 %.
const CONNTRACK4_SHARE: u64 = 32;
const CONNTRACK6_SHARE: u64 = 16;
const REVNAT_SHARE: u64 = 10;
const AFFINITY_SHARE: u64 = 10;

/// Floors, whatever the node's memory: 32k external flows, and 16k sockets or clients.
const CONNTRACK_MIN: u32 = 65_536;
const SOCKET_MIN: u32 = 16_384;
/// Ceilings: the kernel allocates a map's preallocated elements in one vmalloc area.
const CONNTRACK_MAX: u32 = 1 << 24;
const SOCKET_MAX: u32 = 1 << 22;

/// Floor of each conntrack map sized from a conntrack table size: a tiny `maxPerCore` and
/// `min` must still leave room for a few flows of each family.
const TABLE_CONNTRACK_MIN: u32 = 4096;

/// What the LRU maps are sized from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LruBudget {
    /// A share of the node's memory (`--bpf-map-dynamic-size-ratio`; 0: the static sizes).
    MemoryShare(SizeRatio),
    /// The conntrack table size kube-proxy would set (`conntrack.maxPerCore` × CPUs, at least
    /// `conntrack.min`), in flows.
    ConntrackTable(u32),
}

/// Capacities of the preallocated LRU maps, in entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LruSizes {
    pub conntrack4: u32,
    pub conntrack6: u32,
    pub revnat4: u32,
    pub revnat6: u32,
    pub affinity: u32,
    pub udp_sticky: u32,
}

impl LruSizes {
    /// The previous fixed defaults (`--bpf-map-dynamic-size-ratio 0`).
    pub const STATIC: LruSizes = LruSizes {
        conntrack4: proxy_common::default_sizes::CT,
        conntrack6: proxy_common::default_sizes::CT,
        revnat4: proxy_common::default_sizes::REVNAT,
        revnat6: proxy_common::default_sizes::REVNAT,
        affinity: proxy_common::default_sizes::AFFINITY,
        udp_sticky: proxy_common::default_sizes::UDP_STICKY,
    };

    /// Sizes for a node with `mem_total` bytes of memory giving `ratio` of it to these maps
    /// (`0`: [`Self::STATIC`]).
    pub fn for_memory(mem_total: u64, ratio: SizeRatio) -> LruSizes {
        let ratio = ratio.get();
        if ratio <= 0.0 {
            return Self::STATIC;
        }
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss,
            reason = "a positive share of a memory size; saturating is what we want"
        )]
        let budget = (mem_total as f64 * ratio) as u64;
        let entries = |share: u64, bytes: u64, min: u32, max: u32| -> u32 {
            let n = budget * share / 100 / bytes.max(1);
            u32::try_from(n).unwrap_or(u32::MAX).clamp(min, max)
        };
        LruSizes {
            conntrack4: entries(
                CONNTRACK4_SHARE,
                entry_bytes::<CtKey4, CtValue4>(),
                CONNTRACK_MIN,
                CONNTRACK_MAX,
            ),
            conntrack6: entries(
                CONNTRACK6_SHARE,
                entry_bytes::<CtKey, CtValue>(),
                CONNTRACK_MIN,
                CONNTRACK_MAX,
            ),
            revnat4: entries(
                REVNAT_SHARE,
                entry_bytes::<RevNat4Key, RevNat4>(),
                SOCKET_MIN,
                SOCKET_MAX,
            ),
            revnat6: entries(
                REVNAT_SHARE,
                entry_bytes::<RevNat6Key, RevNat6>(),
                SOCKET_MIN,
                SOCKET_MAX,
            ),
            affinity: entries(
                AFFINITY_SHARE,
                entry_bytes::<AffinityKey, AffinityValue>(),
                SOCKET_MIN,
                SOCKET_MAX,
            ),
            udp_sticky: entries(
                AFFINITY_SHARE,
                entry_bytes::<AffinityKey, AffinityValue>(),
                SOCKET_MIN,
                SOCKET_MAX,
            ),
        }
    }

    /// Sizes for a conntrack table of `flows` entries, as kube-proxy sizes the kernel's: the
    /// conntrack maps share it two to one between IPv4 and IPv6 (most external traffic is
    /// IPv4), as the memory budget does; a kernel conntrack entry covers both directions of a
    /// flow where these maps hold an entry per direction, but the kernel's table tracks all of
    /// the node's traffic and these maps only Service flows from outside. Each map of sockets or
    /// clients gets an eighth of it (16384 for kube-proxy's default `conntrack.min`).
    pub fn for_conntrack_table(flows: u32) -> LruSizes {
        let conntrack = |share: u32| -> u32 {
            u32::try_from(u64::from(flows) * u64::from(share) / 3)
                .unwrap_or(u32::MAX)
                .clamp(TABLE_CONNTRACK_MIN, CONNTRACK_MAX)
        };
        let sockets = (flows / 8).clamp(SOCKET_MIN, SOCKET_MAX);
        LruSizes {
            conntrack4: conntrack(2),
            conntrack6: conntrack(1),
            revnat4: sockets,
            revnat6: sockets,
            affinity: sockets,
            udp_sticky: sockets,
        }
    }

    /// Sizes for this node from `budget` (a memory share: of `MemTotal` in `/proc/meminfo`;
    /// the static sizes if it cannot be read).
    pub fn for_this_node(budget: LruBudget) -> LruSizes {
        let ratio = match budget {
            LruBudget::ConntrackTable(flows) => return Self::for_conntrack_table(flows),
            LruBudget::MemoryShare(ratio) => ratio,
        };
        match mem_total() {
            Some(bytes) => Self::for_memory(bytes, ratio),
            None => {
                tracing::warn!(
                    "cannot read MemTotal from /proc/meminfo; the LRU maps get their static sizes"
                );
                Self::STATIC
            }
        }
    }

    /// Entries of the IPv4 unanswered flows' map (`KPR_CT4_NEW`): a share of the conntrack's.
    pub fn conntrack4_new(&self) -> u32 {
        (self.conntrack4 / proxy_common::default_sizes::CT_NEW_SHARE).max(1)
    }

    /// Entries of `KPR_CT6_NEW`, as [`Self::conntrack4_new`].
    pub fn conntrack6_new(&self) -> u32 {
        (self.conntrack6 / proxy_common::default_sizes::CT_NEW_SHARE).max(1)
    }

    /// The kernel memory these capacities take (an estimate of its `memlock` accounting).
    pub fn bytes(&self) -> u64 {
        u64::from(self.conntrack4 + self.conntrack4_new()) * entry_bytes::<CtKey4, CtValue4>()
            + u64::from(self.conntrack6 + self.conntrack6_new()) * entry_bytes::<CtKey, CtValue>()
            + u64::from(self.revnat4) * entry_bytes::<RevNat4Key, RevNat4>()
            + u64::from(self.revnat6) * entry_bytes::<RevNat6Key, RevNat6>()
            + u64::from(self.affinity + self.udp_sticky)
                * entry_bytes::<AffinityKey, AffinityValue>()
    }
}

/// Kernel memory per entry of a preallocated LRU hash map: `struct htab_elem` (56 bytes with
/// its LRU node) and the key and value rounded up to 8, plus a 16-byte bucket.
pub fn entry_bytes<K, V>() -> u64 {
    let round8 = |n: usize| (n as u64).div_ceil(8) * 8;
    56 + round8(std::mem::size_of::<K>()) + round8(std::mem::size_of::<V>()) + 16
}

/// `MemTotal` in bytes.
pub fn mem_total() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_total(&text)
}

fn parse_mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn sizes_follow_kube_proxys_conntrack_table_between_their_bounds() {
        // kube-proxy's defaults on 2 CPUs: max(32768 × 2, 131072).
        let default = LruSizes::for_conntrack_table(131_072);
        assert_eq!(default.conntrack4, 87_381);
        assert_eq!(default.conntrack4_new(), 21_845);
        assert_eq!(default.conntrack6, 43_690);
        assert_eq!(default.revnat4, SOCKET_MIN);
        assert_eq!(default.udp_sticky, SOCKET_MIN);
        // The 32 MiB a small node's maps should take in all, and then some: the next hop each
        // conntrack entry keeps (24 bytes) took these past it (docs/benchmarks.md §6b).
        assert!(default.bytes() < 34 << 20, "{}", default.bytes());
        let tiny = LruSizes::for_conntrack_table(2);
        assert_eq!(tiny.conntrack6, TABLE_CONNTRACK_MIN);
        assert_eq!(tiny.affinity, SOCKET_MIN);
        // kube-proxy's cap (1048576) on 64 cores: the socket maps grow with it.
        let large = LruSizes::for_conntrack_table(1 << 20);
        assert_eq!(large.conntrack4, 699_050);
        assert_eq!(large.revnat6, 1 << 17);
        assert_eq!(
            LruSizes::for_conntrack_table(u32::MAX).conntrack4,
            CONNTRACK_MAX
        );
        assert_eq!(
            LruSizes::for_this_node(LruBudget::ConntrackTable(131_072)),
            default
        );
    }

    #[test]
    fn sizes_follow_the_nodes_memory_between_their_bounds() {
        let small = LruSizes::for_memory(GIB, DEFAULT_DYNAMIC_SIZE_RATIO);
        let mid = LruSizes::for_memory(24 * GIB, DEFAULT_DYNAMIC_SIZE_RATIO);
        let large = LruSizes::for_memory(512 * GIB, DEFAULT_DYNAMIC_SIZE_RATIO);
        // 1 GiB × 0.25 % is 2.6 MB: every map at its floor.
        assert_eq!(small.conntrack4, CONNTRACK_MIN);
        assert_eq!(small.conntrack6, CONNTRACK_MIN);
        assert_eq!(small.revnat4, SOCKET_MIN);
        assert_eq!(small.udp_sticky, SOCKET_MIN);
        // 24 GiB: 61 MiB, 40 % of it in 152-byte IPv4 conntrack entries, four fifths of them
        // established flows' and one fifth unanswered ones', 20 % in 200-byte IPv6 ones (at
        // the floor).
        assert_eq!(entry_bytes::<CtKey4, CtValue4>(), 152);
        assert_eq!(entry_bytes::<CtKey, CtValue>(), 200);
        assert_eq!(mid.conntrack4, 135_630);
        assert_eq!(mid.conntrack4_new(), 33_907);
        assert_eq!(mid.conntrack6, CONNTRACK_MIN);
        assert_eq!(mid.conntrack6_new(), CONNTRACK_MIN / 4);
        // Within the budget but for what the IPv6 map's floor takes past its fifth of it.
        let budget = (24 * GIB) / 400;
        let ipv6_floor = u64::from(CONNTRACK_MIN + CONNTRACK_MIN / 4)
            * entry_bytes::<CtKey, CtValue>()
            - budget / 5;
        assert!(
            mid.bytes() <= budget + ipv6_floor,
            "{} > {budget} + {ipv6_floor}",
            mid.bytes()
        );
        assert!(
            mid.bytes() > budget + ipv6_floor - (1 << 10),
            "{}",
            mid.bytes()
        );
        assert!(large.conntrack4 > mid.conntrack4 && large.revnat6 > mid.revnat6);
        assert!(large.conntrack4 <= CONNTRACK_MAX);
    }

    #[test]
    fn a_zero_ratio_keeps_the_static_sizes() {
        let zero = SizeRatio::new(0.0).expect("in range");
        assert_eq!(LruSizes::for_memory(24 * GIB, zero), LruSizes::STATIC);
        assert_eq!(SizeRatio::new(f64::NAN), None);
        assert_eq!(SizeRatio::new(1.5), None);
    }

    #[test]
    fn mem_total_is_read_in_kib() {
        let text = "MemTotal:       24571524 kB\nMemFree:         1000 kB\n";
        assert_eq!(parse_mem_total(text), Some(24_571_524 * 1024));
        assert_eq!(parse_mem_total("MemFree: 3 kB\n"), None);
    }
}
