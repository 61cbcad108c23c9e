//! The programs' port filter (`KPR_PORT_FILTER`, see `proxy_common::PortFilter`), written in
//! place through its memory mapping: a port's bit is set with one atomic store before the
//! frontend or backend that uses it is written, where an update through bpf(2) would copy the
//! whole 16 KiB value for every port of a first sync.

use std::sync::atomic::{AtomicU64, Ordering};

use aya::maps::{Map, MapData};
use proxy_common::{PORT_FILTER_WORDS, PortFilter, port_bit};
use proxy_kernel::bpf::mapped_array::MappedArray;

/// Word offsets of the value's parts (`PortFilter` is `#[repr(C)]` of u64s).
const ARMED: usize = 0;
const DESTINATION: usize = 1;
const SOURCE: usize = 1 + PORT_FILTER_WORDS;
const WORDS: usize = 1 + 2 * PORT_FILTER_WORDS;

/// The mapped filter, and the ports found unused at the last settle.
#[derive(Debug)]
pub(crate) struct PortFilterMap {
    mapped: MappedArray,
    /// Ports no frontend, backend or conntrack entry used at the last [`PortFilterMap::settle`]
    /// (`armed` unused): cleared at the next one if that is still so.
    unused: Box<PortFilter>,
    /// The map's fd, kept open for as long as the mapping is.
    _map: MapData,
}

impl PortFilterMap {
    /// Maps the pinned filter. Its bits stay as the previous agent left them: the conntrack
    /// entries of flows to Services gone meanwhile may still need them.
    pub(crate) fn open(map: Map) -> Result<Self, String> {
        use std::os::fd::AsFd as _;
        let Map::Array(data) = map else {
            return Err("the port filter map is not an array".into());
        };
        let mapped = MappedArray::map(data.fd().as_fd(), WORDS * 8)
            .map_err(|error| format!("cannot map the port filter: {error}"))?;
        if mapped.words().len() < WORDS {
            return Err("the port filter map is too small".into());
        }
        Ok(Self {
            mapped,
            unused: Box::new(PortFilter::EMPTY),
            _map: data,
        })
    }

    fn word(&self, index: usize) -> &AtomicU64 {
        &self.mapped.words()[index]
    }

    fn set(&self, base: usize, port: u16) {
        // Release: the map update that follows (a frontend, a backend) is a syscall, which
        // orders it after this store for the programs too.
        let (index, mask) = port_bit(port);
        self.word(base + index).fetch_or(mask, Ordering::Release);
    }

    pub(crate) fn add(&self, destination: u16, sources: impl Iterator<Item = u16>) {
        self.set(DESTINATION, destination);
        for port in sources {
            self.set(SOURCE, port);
        }
    }

    /// Adds every port in `in_use` and arms the filter: from now on the programs pass on
    /// packets of other ports at once.
    pub(crate) fn arm(&self, in_use: &PortFilter) {
        for (index, (destination, source)) in
            in_use.destination.iter().zip(&in_use.source).enumerate()
        {
            // Most words are empty: no store (a full apply arms again, at every resync).
            if *destination != 0 {
                self.word(DESTINATION + index)
                    .fetch_or(*destination, Ordering::Release);
            }
            if *source != 0 {
                self.word(SOURCE + index)
                    .fetch_or(*source, Ordering::Release);
            }
        }
        self.word(ARMED).store(1, Ordering::Release);
    }

    /// Clears the ports that were unused at the last settle and still are (not in `in_use`:
    /// the records' frontends and backends and the ports of the conntrack entries a whole
    /// garbage collection round found). Two rounds, because a round does not see a flow
    /// whose entries were written behind its walk: the next round does. Returns how many
    /// ports it cleared.
    pub(crate) fn settle(&mut self, in_use: &PortFilter) -> u32 {
        let mut cleared = 0;
        for index in 0..PORT_FILTER_WORDS {
            for (base, used, unused) in [
                (
                    DESTINATION,
                    in_use.destination[index],
                    &mut self.unused.destination[index],
                ),
                (SOURCE, in_use.source[index], &mut self.unused.source[index]),
            ] {
                let word = &self.mapped.words()[base + index];
                let set_now = word.load(Ordering::Acquire);
                let unused_now = set_now & !used;
                let clear = unused_now & *unused;
                if clear != 0 {
                    word.fetch_and(!clear, Ordering::Release);
                    cleared += clear.count_ones();
                }
                *unused = unused_now & !clear;
            }
        }
        cleared
    }

    /// The filter as the programs see it.
    pub(crate) fn value(&self) -> PortFilter {
        let mut value = PortFilter::EMPTY;
        value.armed = self.word(ARMED).load(Ordering::Acquire);
        for index in 0..PORT_FILTER_WORDS {
            value.destination[index] = self.word(DESTINATION + index).load(Ordering::Acquire);
            value.source[index] = self.word(SOURCE + index).load(Ordering::Acquire);
        }
        value
    }
}
