//! Every manifest in deploy/ parses as the typed Kubernetes object it claims to be, with no field
//! the type does not know (a typo would otherwise be silently dropped by the API server too).
#![expect(
    clippy::expect_used,
    reason = "test helpers: a failed expectation is a failed test"
)]

use std::path::{Path, PathBuf};

use k8s_openapi::{
    Resource,
    api::{
        apps::v1::DaemonSet,
        core::v1::{ConfigMap, ServiceAccount},
        rbac::v1::{ClusterRole, ClusterRoleBinding},
    },
};
use serde::{Serialize, de::DeserializeOwned};

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// Parses `value` as `T` and checks that serializing it back loses nothing.
fn check_typed<T: DeserializeOwned + Serialize>(file: &str, value: &serde_yaml::Value) -> T {
    let typed: T = serde_yaml::from_value(value.clone())
        .unwrap_or_else(|e| panic!("{file}: not a valid {}: {e}", std::any::type_name::<T>()));
    let back = serde_yaml::to_value(&typed).expect("serialize");
    assert_eq!(
        normalize(value.clone()),
        normalize(back),
        "{file}: fields were lost in the round trip (unknown or misspelled fields?)"
    );
    typed
}

/// YAML allows `80` and `"80"` alike for int-or-string; compare via JSON text of sorted maps.
fn normalize(value: serde_yaml::Value) -> serde_json_like::Value {
    serde_json_like::from_yaml(value)
}

/// A tiny canonical form: maps sorted, numbers as strings, so equality means "same content".
mod serde_json_like {
    use std::collections::BTreeMap;

    #[derive(Debug, PartialEq)]
    pub enum Value {
        Null,
        Scalar(String),
        List(Vec<Value>),
        Map(BTreeMap<String, Value>),
    }

    pub fn from_yaml(value: serde_yaml::Value) -> Value {
        match value {
            serde_yaml::Value::Null => Value::Null,
            serde_yaml::Value::Bool(b) => Value::Scalar(b.to_string()),
            serde_yaml::Value::Number(n) => Value::Scalar(n.to_string()),
            serde_yaml::Value::String(s) => Value::Scalar(s),
            serde_yaml::Value::Sequence(items) => {
                Value::List(items.into_iter().map(from_yaml).collect())
            }
            serde_yaml::Value::Mapping(map) => Value::Map(
                map.into_iter()
                    .filter(|(_, v)| !v.is_null())
                    .map(|(k, v)| (k.as_str().unwrap_or_default().to_owned(), from_yaml(v)))
                    .collect(),
            ),
            serde_yaml::Value::Tagged(tagged) => from_yaml(tagged.value),
        }
    }
}

/// The agent's own loader (strict decoding, defaults, validation) accepts the shipped
/// configuration.
fn check_agent_accepts(config: &str) {
    let path = std::env::temp_dir().join(format!("kpr-deploy-config-{}.yaml", std::process::id()));
    std::fs::write(&path, config).expect("write config");
    let args = proxy_agent::cli::Args {
        config: Some(path.clone()),
        ..proxy_agent::cli::Args::default()
    };
    let loaded = proxy_agent::config::load(&args);
    let _ = std::fs::remove_file(&path);
    match loaded {
        Ok(loaded) => assert_eq!(loaded.config.mode, proxy_agent::config::ProxyMode::Ebpf),
        Err(error) => panic!("the ConfigMap's configuration is rejected: {error}"),
    }
}

#[test]
fn every_deploy_manifest_is_a_valid_typed_object() {
    let mut kinds = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(deploy_dir())
        .expect("deploy/ exists")
        .map(|entry| entry.expect("entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    for path in files {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(&path).expect("read");
        for document in serde_yaml::Deserializer::from_str(&text) {
            let value: serde_yaml::Value = serde::Deserialize::deserialize(document).expect("yaml");
            let kind = value["kind"].as_str().expect("kind").to_owned();
            match kind.as_str() {
                k if k == DaemonSet::KIND => {
                    let ds: DaemonSet = check_typed(&file, &value);
                    let spec = ds.spec.expect("spec").template.spec.expect("pod spec");
                    assert_eq!(
                        spec.host_network,
                        Some(true),
                        "the agent runs on the host network"
                    );
                }
                k if k == ServiceAccount::KIND => {
                    drop(check_typed::<ServiceAccount>(&file, &value))
                }
                k if k == ClusterRole::KIND => {
                    let role: ClusterRole = check_typed(&file, &value);
                    let rules = role.rules.unwrap_or_default();
                    for resource in ["services", "nodes", "endpointslices", "events"] {
                        assert!(
                            rules.iter().any(|r| r
                                .resources
                                .iter()
                                .flatten()
                                .any(|x| x == resource)),
                            "ClusterRole grants nothing on {resource}"
                        );
                    }
                }
                k if k == ClusterRoleBinding::KIND => {
                    drop(check_typed::<ClusterRoleBinding>(&file, &value))
                }
                k if k == ConfigMap::KIND => {
                    let cm: ConfigMap = check_typed(&file, &value);
                    let data = cm.data.unwrap_or_default();
                    let config = data
                        .get("config.yaml")
                        .expect("config.yaml in the ConfigMap");
                    check_agent_accepts(config);
                }
                other => panic!("{file}: unexpected kind {other}"),
            }
            kinds.push(kind);
        }
    }
    kinds.sort();
    assert_eq!(
        kinds,
        [
            "ClusterRole",
            "ClusterRoleBinding",
            "ConfigMap",
            "DaemonSet",
            "ServiceAccount"
        ]
    );
}
