//! Where Service, EndpointSlice and Node objects come from.

pub mod kubernetes;
pub mod manifests;
