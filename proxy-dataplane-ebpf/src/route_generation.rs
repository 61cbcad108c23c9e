//! The node's route generation (`KPR_ROUTE_GENERATION`; see `proxy_common::NextHop`), bumped
//! by a watch of the routes, policy rules, neighbours and links of the dataplane's network
//! namespace (`proxy_kernel::node::RouteWatch`): the next hops the tc fast path keeps in
//! conntrack entries are valid only under the generation they were resolved in.

use std::path::Path;

use aya::maps::{Array, Map, MapData};
use proxy_common::map_names;
use proxy_kernel::node::RouteWatch;
use tracing::warn;

/// Starts the watch (from the calling thread's network namespace), which bumps the generation
/// at once and on every change until dropped. `None` (logged) when the map or the watch cannot
/// be had: kept next hops then last about a second each (their epoch).
pub fn watch(pin_dir: &Path) -> Option<RouteWatch> {
    let mut generation = match MapData::from_pin(pin_dir.join(map_names::ROUTE_GENERATION))
        .and_then(|data| Array::<MapData, u32>::try_from(Map::Array(data)))
    {
        Ok(map) => map,
        Err(error) => {
            warn!(%error, map = map_names::ROUTE_GENERATION, "cannot open the route generation: \
                the fast path's kept next hops follow route changes only within about a second");
            return None;
        }
    };
    match RouteWatch::start(move || bump(&mut generation)) {
        Ok(watch) => Some(watch),
        Err(error) => {
            warn!(%error, "cannot watch the node's routes: the fast path's kept next hops \
                follow route changes only within about a second");
            None
        }
    }
}

/// The next generation; 0 is skipped, so that it is never the empty map's value again.
fn bump(generation: &mut Array<MapData, u32>) {
    let next = generation.get(&0, 0).unwrap_or(0).wrapping_add(1).max(1);
    if let Err(error) = generation.set(0, next, 0) {
        warn!(%error, map = map_names::ROUTE_GENERATION, "cannot bump the route generation");
    }
}
