//! The API client from kube-proxy's flags: `--kubeconfig`, `--master`, else inferred (the
//! `KUBECONFIG`/`~/.kube/config` file, then the in-cluster service account).

use std::path::{Path, PathBuf};

use kube::{
    Client, Config,
    client::ClientBuilder,
    config::{InferConfigError, KubeConfigOptions, Kubeconfig, KubeconfigError},
};

use super::request_metrics::RequestMetricsLayer;
use crate::http_servers::rest_client::RestClientMetrics;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("--kubeconfig {path}: {source}")]
    Kubeconfig {
        path: PathBuf,
        source: KubeconfigError,
    },
    #[error("--master {url:?}: not a valid URL: {source}")]
    Master {
        url: String,
        source: http::uri::InvalidUri,
    },
    #[error(
        "no API server configuration: pass --kubeconfig FILE or --master URL, or run in a pod \
         ({source})"
    )]
    Infer { source: InferConfigError },
    #[error("cannot build the API client: {source}")]
    Build { source: kube::Error },
}

/// Where the API server is, how to authenticate, and how fast to ask.
#[derive(Debug, Clone, Default)]
pub struct ClientOptions {
    pub kubeconfig: Option<PathBuf>,
    /// Overrides the kubeconfig's server address (as kube-proxy's `--master` does).
    pub master: Option<String>,
    /// `clientConnection.qps`/`burst`: the client-side token bucket ([`super::rate_limit`]).
    pub qps: f32,
    pub burst: i32,
    /// Where every request is recorded (client-go's `rest_client_*`, [`super::request_metrics`]).
    pub metrics: RestClientMetrics,
}

/// Builds the client; no request is made yet.
pub async fn client(options: &ClientOptions) -> Result<Client, ClientError> {
    let config = config(options).await?;
    let metrics = RequestMetricsLayer::new(options.metrics.clone(), &config.cluster_url);
    let builder =
        ClientBuilder::try_from(config).map_err(|source| ClientError::Build { source })?;
    // The metrics layer outermost: client-go's latency includes the rate limiter's wait.
    Ok(
        match super::rate_limit::limit_layer(options.qps, options.burst) {
            Some(layer) => builder.with_layer(&layer).with_layer(&metrics).build(),
            None => builder.with_layer(&metrics).build(),
        },
    )
}

async fn config(options: &ClientOptions) -> Result<Config, ClientError> {
    let master = options.master.as_deref().map(parse_master).transpose()?;
    match (&options.kubeconfig, master) {
        (Some(path), master) => {
            let mut config = from_file(path).await?;
            if let Some(url) = master {
                config.cluster_url = url;
            }
            Ok(config)
        }
        (None, Some(url)) => Ok(Config::new(url)),
        (None, None) => Config::infer()
            .await
            .map_err(|source| ClientError::Infer { source }),
    }
}

async fn from_file(path: &Path) -> Result<Config, ClientError> {
    let error = |source| ClientError::Kubeconfig {
        path: path.to_owned(),
        source,
    };
    let kubeconfig = Kubeconfig::read_from(path).map_err(error)?;
    Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(error)
}

fn parse_master(url: &str) -> Result<http::Uri, ClientError> {
    url.parse().map_err(|source| ClientError::Master {
        url: url.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn master_overrides_the_kubeconfig_server() {
        let dir = std::env::temp_dir().join(format!("kpr-kubeconfig-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("config");
        std::fs::write(
            &path,
            "apiVersion: v1\nkind: Config\ncurrent-context: c\n\
             clusters: [{name: k, cluster: {server: \"http://127.0.0.1:6443\"}}]\n\
             users: [{name: u, user: {}}]\n\
             contexts: [{name: c, context: {cluster: k, user: u}}]\n",
        )
        .unwrap();
        let from_file = config(&ClientOptions {
            kubeconfig: Some(path.clone()),
            master: None,
            ..ClientOptions::default()
        })
        .await
        .unwrap();
        assert_eq!(from_file.cluster_url.to_string(), "http://127.0.0.1:6443/");
        let overridden = config(&ClientOptions {
            kubeconfig: Some(path),
            master: Some("http://10.0.0.1:8080".into()),
            ..ClientOptions::default()
        })
        .await
        .unwrap();
        assert_eq!(overridden.cluster_url.to_string(), "http://10.0.0.1:8080/");
        let master_only = config(&ClientOptions {
            kubeconfig: None,
            master: Some("https://api.example:6443".into()),
            ..ClientOptions::default()
        })
        .await
        .unwrap();
        assert_eq!(
            master_only.cluster_url.to_string(),
            "https://api.example:6443/"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn missing_kubeconfig_names_the_flag_and_file() {
        let error = config(&ClientOptions {
            kubeconfig: Some("/nonexistent/kubeconfig".into()),
            master: None,
            ..ClientOptions::default()
        })
        .await
        .unwrap_err();
        let message = error.to_string();
        assert!(
            message.starts_with("--kubeconfig /nonexistent/kubeconfig:"),
            "{message}"
        );
        let bad_master = config(&ClientOptions {
            kubeconfig: None,
            master: Some("http://bad host".into()),
            ..ClientOptions::default()
        })
        .await
        .unwrap_err();
        assert!(
            bad_master.to_string().starts_with("--master"),
            "{bad_master}"
        );
    }
}
