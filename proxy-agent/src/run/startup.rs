//! What runs once before the loop: where the objects come from, the source started beside the
//! program load, and the node's HTTP servers for the mode actually running.

use std::path::PathBuf;

use anyhow::bail;
use tokio::{sync::mpsc, task::JoinHandle};

use crate::{
    dataplane::Dataplane,
    http_servers::{HttpServers, HttpServersConfig, rest_client::RestClientMetrics},
    source::{self, kubernetes::ClientOptions},
};
use proxy_model::{
    config::Config,
    desired::IpFamily,
    objects::{Kind, Store, Update},
};

/// Where the objects come from.
pub enum Source {
    Manifests(PathBuf),
    Kubernetes(kube::Client, source::kubernetes::Encoding),
}

impl Source {
    /// Resolved before anything touches the kernel, so a bad flag fails fast. The API
    /// client records its requests in `rest_client`.
    pub async fn resolve(config: &Config, rest_client: &RestClientMetrics) -> anyhow::Result<Self> {
        Ok(match config.ebpf.manifests.clone() {
            Some(manifests) => {
                if !manifests.is_dir() {
                    bail!("--manifests {}: not a directory", manifests.display());
                }
                Self::Manifests(manifests)
            }
            None => Self::Kubernetes(
                source::kubernetes::client(&ClientOptions {
                    kubeconfig: config.client_connection.kubeconfig.clone(),
                    master: config.master.clone(),
                    qps: config.client_connection.qps,
                    burst: config.client_connection.burst,
                    metrics: rest_client.clone(),
                })
                .await?,
                source::kubernetes::Encoding::new(
                    &config.client_connection.content_type,
                    &config.client_connection.accept_content_types,
                )?,
            ),
        })
    }

    pub fn name(&self) -> &'static str {
        match self {
            Self::Manifests(_) => "manifests",
            Self::Kubernetes(..) => "kubernetes",
        }
    }
}

/// A running source: its task, its updates, and (API source) the Service warning events.
pub struct StartedSource {
    pub task: JoinHandle<anyhow::Result<()>>,
    pub updates: mpsc::Receiver<Update>,
    pub service_warnings: Option<source::kubernetes::ServiceWarnings>,
    /// Whether /healthz waits for a Node (the API source watches it; a folder may hold none).
    pub node_required: bool,
}

/// Starts reading `source` into updates. The source reads (a manifests folder, the API
/// server's lists) while the programs load: the kernel's verifier takes seconds for the tc
/// programs, and neither waits for the other (nothing is programmed before the dataplane has
/// started and every kind was listed).
pub fn start_source(source: Source, node_name: &str, store: &mut Store) -> StartedSource {
    let (tx, updates) = mpsc::channel(64);
    match source {
        Source::Manifests(dir) => {
            // A manifests folder may hold no Node: that counts as listed.
            store.mark_synced(Kind::Node);
            StartedSource {
                task: tokio::spawn(source::manifests::run(dir, node_name.to_owned(), tx)),
                updates,
                service_warnings: None,
                node_required: false,
            }
        }
        // The Node is watched like the other kinds: the first sync waits for its list.
        Source::Kubernetes(client, encoding) => {
            let service_warnings = Some(source::kubernetes::service_warnings(
                client.clone(),
                node_name,
            ));
            let (events, event_node) = (client.clone(), node_name.to_owned());
            tokio::spawn(async move {
                source::kubernetes::post_starting_event(events, &event_node).await;
            });
            let name = node_name.to_owned();
            let task = tokio::spawn(async move {
                source::kubernetes::run(client, encoding, name, tx).await;
                Ok(())
            });
            StartedSource {
                task,
                updates,
                service_warnings,
                node_required: true,
            }
        }
    }
}

/// /healthz /livez, health check node ports, /metrics /proxyMode — for the mode actually
/// running (after a fallback, iptables), with what each mode's metrics read from the kernel.
pub fn start_http_servers(
    config: &Config,
    dataplane: &Dataplane,
    node_name: &str,
    node_required: bool,
    rest_client: RestClientMetrics,
) -> HttpServers {
    let http_servers = HttpServers::start(&HttpServersConfig {
        healthz_bind_address: config.healthz_bind_address,
        metrics_bind_address: config.metrics_bind_address,
        node_required,
        rest_client,
        ..HttpServersConfig::new(node_name, dataplane.mode(), config.sync_period)
    });
    http_servers
        .metrics()
        .set_debug(config.configz.clone(), config.enable_profiling);
    if let Some(iptables) = http_servers.metrics().iptables() {
        iptables.read_nfacct_with(Box::new(|name| {
            proxy_kernel::iptables::nfacct::packets(name).map_err(|e| e.to_string())
        }));
    }
    if let (Some(metrics), Dataplane::Ebpf(ebpf)) = (http_servers.metrics().ebpf(), dataplane) {
        let features: Vec<_> = ebpf
            .features()
            .states()
            .iter()
            .map(|state| (state.feature.name(), state.used()))
            .collect();
        metrics.kernel_features(&features);
        metrics.fast_path_active(ebpf.fast_path());
        let pin_dir = config
            .ebpf
            .bpf_root
            .join(proxy_dataplane_ebpf::PIN_DIR_NAME);
        http_servers
            .metrics()
            .read_service_names_with(Box::new(move || {
                proxy_dataplane_ebpf::traffic::service_names(&pin_dir).map_err(|e| e.to_string())
            }));
    }
    for family in IpFamily::ALL {
        http_servers.loop_started(family);
    }
    http_servers
}
