//! Where Service and EndpointSlice objects come from.

pub mod manifests;
