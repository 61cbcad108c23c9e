//! The desired state: one pure, deterministic function from the watched objects to what this
//! node must do, per IP family. Dataplanes only apply it.
//!
//! - `services.rs`: a Service → its service ports (kube-proxy's `newBaseServiceInfo`).
//! - `endpoints.rs`: EndpointSlices → the endpoints of each service port (`endpointslicecache`).
//! - `topology.rs`: which endpoints each traffic policy may use (`CategorizeEndpoints`).
//! - `snapshot.rs`: the result, kept up to date incrementally from the store's change set.
//! - `claims.rs`: which Service owns a frontend address, port and protocol that several name.
//! - `frontends.rs`: the socket-level view (address, port, protocol → backends) for eBPF.

mod claims;
mod endpoints;
mod frontends;
mod model;
mod services;
mod snapshot;
mod topology;

pub use frontends::{Backend, Frontend, FrontendKey, Scope, external_frontends, socket_frontends};
pub use model::{Endpoint, IpFamily, NodeContext, Protocol, ServicePort, ServicePortName};
pub use services::ServiceError;
pub use snapshot::{FamilySnapshot, Snapshot, SnapshotUpdate};
