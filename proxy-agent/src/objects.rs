//! The objects the proxy watches, keyed by namespace/name. Every source (manifests folder today,
//! the Kubernetes API later) produces this same view.

use std::{collections::BTreeMap, fmt};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectKey {
    pub namespace: String,
    pub name: String,
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Everything the desired-state computation reads.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Objects {
    pub services: BTreeMap<ObjectKey, Service>,
    pub endpoint_slices: BTreeMap<ObjectKey, EndpointSlice>,
}

/// Label that ties an EndpointSlice to its Service.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
