//! Writing the service maps: the map writer and its record, the maps it holds and the keys it
//! touched, their sizes, ids and Maglev tables, the programs' port filter.

pub(super) mod ids;
pub(super) mod maglev;
pub mod map_sizes;
pub(super) mod map_writer;
pub(super) mod port_filter;
pub(super) mod service_maps;
pub(super) mod touched_keys;
