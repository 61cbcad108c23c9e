//! The tracer lives in the library (`proxy-agent inspect explain` walks the live ruleset with
//! it); the parity tests use that very code.
pub use proxy_dataplane_iptables::tracer::Tracer;
