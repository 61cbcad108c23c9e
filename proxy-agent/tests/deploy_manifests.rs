//! Every manifest in deploy/ parses as the typed Kubernetes object it claims to be, with no field
//! the type does not know (a typo would otherwise be silently dropped by the API server too), and
//! the DaemonSet can bootstrap a node without kube-proxy: its command line and the ConfigMap are
//! accepted by the agent's own flag and configuration parsers, the API server is reached by its
//! real address, and each field the node needs is there (`daemonset_bootstraps_without_kube_proxy`).
#![expect(
    clippy::expect_used,
    reason = "test helpers: a failed expectation is a failed test"
)]

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use clap::Parser as _;
use k8s_openapi::{
    Resource,
    api::{
        apps::v1::DaemonSet,
        core::v1::{ConfigMap, Container, PodSpec, ServiceAccount, Volume},
        rbac::v1::{ClusterRole, ClusterRoleBinding},
    },
    apimachinery::pkg::util::intstr::IntOrString,
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
    let args = proxy_model::cli::Args {
        config: Some(path.clone()),
        ..proxy_model::cli::Args::default()
    };
    let loaded = proxy_model::config::load(&args);
    let _ = std::fs::remove_file(&path);
    match loaded {
        Ok(loaded) => assert_eq!(loaded.config.mode, proxy_model::config::ProxyMode::Ebpf),
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

/// The image `cargo xtask image` builds and tags: the agent's own version, so the DaemonSet
/// always runs the binary this source tree builds.
const IMAGE: &str = concat!(
    "localhost/kubeproxy-rs/proxy-agent:",
    env!("CARGO_PKG_VERSION")
);
/// Where the kubelet mounts the pod's service account token and the cluster CA.
const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount/";

/// The one document of `kind` in deploy/`file`.
fn document<T: DeserializeOwned + Serialize>(file: &str) -> T {
    let path = deploy_dir().join(file);
    let text = std::fs::read_to_string(&path).expect("read");
    let value: serde_yaml::Value = serde_yaml::from_str(&text).expect("one YAML document");
    check_typed(file, &value)
}

fn volume<'a>(spec: &'a PodSpec, name: &str) -> &'a Volume {
    spec.volumes
        .iter()
        .flatten()
        .find(|v| v.name == name)
        .unwrap_or_else(|| panic!("no volume {name}"))
}

/// The volume mounted at `path` in `container`, with the mount.
fn mounted_at<'a>(
    spec: &'a PodSpec,
    container: &'a Container,
    path: &Path,
) -> (&'a Volume, &'a k8s_openapi::api::core::v1::VolumeMount) {
    let mount = container
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| Path::new(&m.mount_path) == path)
        .unwrap_or_else(|| {
            panic!(
                "{}: nothing is mounted at {}",
                container.name,
                path.display()
            )
        });
    (volume(spec, &mount.name), mount)
}

fn host_path(volume: &Volume) -> &str {
    &volume
        .host_path
        .as_ref()
        .unwrap_or_else(|| panic!("volume {} is not a hostPath", volume.name))
        .path
}

/// Kubernetes' `$(VAR)` expansion of a container's command with the variables it defines
/// (values from the downward API get `fields`); an undefined reference would reach the agent
/// literally, so it fails the test.
fn expand(container: &Container, fields: &BTreeMap<&str, &str>) -> Vec<String> {
    let mut vars = BTreeMap::new();
    for var in container.env.iter().flatten() {
        let value = match (&var.value, &var.value_from) {
            (Some(value), _) => value.clone(),
            (None, Some(from)) => {
                let field = &from.field_ref.as_ref().expect("fieldRef").field_path;
                (*fields
                    .get(field.as_str())
                    .unwrap_or_else(|| panic!("env {} from unknown field {field}", var.name)))
                .to_owned()
            }
            (None, None) => String::new(),
        };
        vars.insert(format!("$({})", var.name), value);
    }
    let command = container.command.iter().chain(container.args.iter());
    command
        .flatten()
        .map(|arg| {
            let mut arg = arg.clone();
            for (reference, value) in &vars {
                arg = arg.replace(reference, value);
            }
            assert!(!arg.contains("$("), "undefined variable in {arg}");
            arg
        })
        .collect()
}

#[test]
fn daemonset_bootstraps_without_kube_proxy() {
    let ds: DaemonSet = document("daemonset.yaml");
    let cm: ConfigMap = document("configmap.yaml");
    let spec = ds.spec.expect("spec").template.spec.expect("pod spec");

    // Host network and host DNS: the cluster DNS is a Service the agent has not programmed yet.
    assert_eq!(
        spec.host_network,
        Some(true),
        "the agent runs on the node's network"
    );
    assert_eq!(
        spec.dns_policy.as_deref(),
        Some("Default"),
        "the node's resolver, not the cluster DNS Service (ClusterFirstWithHostNet)"
    );
    // The socket destroy reads host PIDs from cgroup.procs and opens /proc/<pid>/ns/net.
    assert_eq!(
        spec.host_pid,
        Some(true),
        "host PIDs for the UDP socket destroy"
    );
    assert_eq!(
        spec.node_selector
            .as_ref()
            .and_then(|s| s.get("kubernetes.io/os"))
            .map(String::as_str),
        Some("linux")
    );
    assert_ne!(spec.automount_service_account_token, Some(false));

    // Every container runs the pinned tag `cargo xtask image` builds.
    let init = spec.init_containers.clone().unwrap_or_default();
    for container in init.iter().chain(&spec.containers) {
        assert_eq!(
            container.image.as_deref(),
            Some(IMAGE),
            "{}",
            container.name
        );
        assert_eq!(
            container.image_pull_policy.as_deref(),
            Some("IfNotPresent"),
            "{}: a loaded image is used as is",
            container.name
        );
    }
    let [agent] = spec.containers.as_slice() else {
        panic!("one container")
    };

    // The command line goes through the agent's own flag parser and configuration loader, with
    // the ConfigMap's files where the pod mounts them.
    let args = expand(agent, &BTreeMap::from([("spec.nodeName", "node-a")]));
    let config_mount = agent
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| {
            volume(&spec, &m.name)
                .config_map
                .as_ref()
                .map(|c| c.name.as_str())
                == Some("kubeproxy-rs")
        })
        .expect("the ConfigMap is mounted");
    let data = cm.data.clone().unwrap_or_default();
    let scratch = std::env::temp_dir().join(format!("kpr-deploy-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).expect("scratch dir");
    for (key, text) in &data {
        std::fs::write(scratch.join(key), text).expect("write ConfigMap file");
    }
    let local_args: Vec<String> = args
        .iter()
        .map(|arg| arg.replace(&config_mount.mount_path, &scratch.display().to_string()))
        .collect();
    let parsed = proxy_model::cli::Args::try_parse_from(&local_args)
        .unwrap_or_else(|e| panic!("the agent rejects {args:?}: {e}"));
    let loaded = proxy_model::config::load(&parsed);
    let _ = std::fs::remove_dir_all(&scratch);
    let config = loaded
        .unwrap_or_else(|e| panic!("the agent rejects its DaemonSet configuration: {e}"))
        .config;
    assert_eq!(config.mode, proxy_model::config::ProxyMode::Ebpf);
    assert_eq!(config.hostname_override.as_deref(), Some("node-a"));

    // The API server by its real address: a kubeconfig from the ConfigMap, as kubeadm gives
    // kube-proxy, never the `kubernetes` Service (only this agent would translate its ClusterIP).
    let kubeconfig_path = config
        .client_connection
        .kubeconfig
        .expect("clientConnection.kubeconfig is set: in-cluster config means the Service");
    let key = kubeconfig_path
        .strip_prefix(&config_mount.mount_path)
        .unwrap_or_else(|_| {
            panic!(
                "{} is not in the ConfigMap's mount",
                kubeconfig_path.display()
            )
        });
    let kubeconfig_text = data
        .get(key.to_str().expect("utf-8"))
        .unwrap_or_else(|| panic!("the ConfigMap has no {}", key.display()));
    let kubeconfig = kube::config::Kubeconfig::from_yaml(kubeconfig_text).expect("a kubeconfig");
    let current = kubeconfig
        .current_context
        .as_deref()
        .expect("current-context");
    let context = kubeconfig
        .contexts
        .iter()
        .find(|c| c.name == current)
        .and_then(|c| c.context.clone())
        .expect("the current context");
    let cluster = kubeconfig
        .clusters
        .iter()
        .find(|c| c.name == context.cluster)
        .and_then(|c| c.cluster.clone())
        .expect("the context's cluster");
    let server = cluster.server.expect("server");
    let host = server
        .strip_prefix("https://")
        .expect("an https server")
        .split([':', '/'])
        .next()
        .unwrap_or_default();
    assert!(
        host != "kubernetes" && !host.starts_with("kubernetes.default"),
        "{server} is the kubernetes Service"
    );
    let ca = cluster
        .certificate_authority
        .expect("certificate-authority");
    assert!(ca.starts_with(SERVICE_ACCOUNT_DIR), "{ca}");
    let user = context.user.expect("user");
    let auth = kubeconfig
        .auth_infos
        .iter()
        .find(|a| a.name == user)
        .and_then(|a| a.auth_info.clone())
        .expect("the context's user");
    let token = auth
        .token_file
        .expect("tokenFile (re-read as the kubelet rotates it)");
    assert!(token.starts_with(SERVICE_ACCOUNT_DIR), "{token}");

    // The host's cgroup2 hierarchy at a path of its own: the container's /sys/fs/cgroup is its
    // own cgroup namespace, and the default (the first cgroup2 mount) would be that one.
    let cgroup = config.ebpf.cgroup_path.expect("--cgroup-path is explicit");
    assert!(
        !cgroup.starts_with("/sys/fs/cgroup"),
        "{}",
        cgroup.display()
    );
    let (cgroup_volume, _) = mounted_at(&spec, agent, &cgroup);
    assert!(host_path(cgroup_volume).starts_with("/sys/fs/cgroup"));
    assert!(
        !agent
            .volume_mounts
            .iter()
            .flatten()
            .any(|m| m.mount_path == "/sys/fs/cgroup"),
        "the container's own /sys/fs/cgroup stays"
    );

    // bpffs: the host's, at the agent's --bpf-root, mounted there by the init container.
    let (bpffs, bpffs_mount) = mounted_at(&spec, agent, &config.ebpf.bpf_root);
    assert_eq!(host_path(bpffs), "/sys/fs/bpf");
    assert_eq!(
        bpffs_mount.mount_propagation.as_deref(),
        Some("HostToContainer"),
        "sees the bpffs the init container mounts"
    );
    let mount_bpffs = init
        .iter()
        .find(|c| c.name == "mount-bpffs")
        .expect("the bpffs init container");
    let (init_bpffs, init_mount) = mounted_at(&spec, mount_bpffs, &config.ebpf.bpf_root);
    assert_eq!(init_bpffs.name, bpffs.name);
    assert_eq!(
        init_mount.mount_propagation.as_deref(),
        Some("Bidirectional")
    );
    let init_security = mount_bpffs
        .security_context
        .as_ref()
        .expect("securityContext");
    assert_eq!(
        init_security.privileged,
        Some(true),
        "Bidirectional needs privileged"
    );

    // Exactly the documented capabilities, and no AppArmor confinement (the runtimes' default
    // profile denies mounts whatever the capabilities).
    let security = agent.security_context.as_ref().expect("securityContext");
    let capabilities = security.capabilities.as_ref().expect("capabilities");
    assert_eq!(capabilities.drop.as_deref(), Some(&["ALL".to_owned()][..]));
    let mut added = capabilities.add.clone().unwrap_or_default();
    added.sort();
    assert_eq!(
        added,
        ["NET_ADMIN", "SYS_ADMIN", "SYS_PTRACE", "SYS_RESOURCE"]
    );
    assert_eq!(
        security
            .app_armor_profile
            .as_ref()
            .map(|p| p.type_.as_str()),
        Some("Unconfined")
    );
    assert_ne!(security.privileged, Some(true));

    // Probes on the health server the configuration opens: startup (generous, the first list
    // of a large cluster), liveness and readiness.
    let healthz = config.healthz_bind_address.expect("healthz server").port();
    for (probe, path) in [
        (&agent.startup_probe, "/livez"),
        (&agent.liveness_probe, "/livez"),
        (&agent.readiness_probe, "/healthz"),
    ] {
        let get = probe
            .as_ref()
            .and_then(|p| p.http_get.as_ref())
            .unwrap_or_else(|| panic!("no HTTP probe on {path}"));
        assert_eq!(get.path.as_deref(), Some(path));
        assert_eq!(get.port, IntOrString::Int(i32::from(healthz)), "{path}");
    }
    let startup = agent.startup_probe.as_ref().expect("startupProbe");
    let window = startup.period_seconds.unwrap_or(10) * startup.failure_threshold.unwrap_or(3);
    assert!(window >= 120, "the startup window is {window} s");
}
