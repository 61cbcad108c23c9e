//! The bytes the agent reads from outside, decoded into the model's objects: the files of a
//! manifests folder ([`manifests`]) and the API server's protobuf lists, watch frames and
//! error `Status` ([`protobuf`]). Every input is a stranger's: a bad one is an error naming
//! what was wrong, never a panic (the fuzz targets in `tests/fuzz/` hold them to that).

pub mod manifests;
pub mod protobuf;
