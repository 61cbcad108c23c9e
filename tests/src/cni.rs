//! Pods wired by the CNI reference plugins (Debian's `containernetworking-plugins`), invoked
//! as a container runtime invokes them: the plugin binary is executed with `CNI_COMMAND`,
//! `CNI_CONTAINERID`, `CNI_NETNS`, `CNI_IFNAME` and `CNI_PATH` in its environment and the
//! network configuration on stdin, and its result (JSON on stdout) says which addresses the
//! pod got. The plugins run inside the node's namespace (`ip netns exec`), so the bridge,
//! the host-side veths and their routes are the node's, never the host's.
//!
//! - [`CniPlugin::Bridge`]: `bridge` with `isGateway`, no `ipMasq`, `hairpinMode`, and
//!   `host-local` IPAM over the node's pod CIDR — how flannel (its delegate) and kubenet wire
//!   pods: every pod on one bridge `cni0`, which holds the pods' gateway address. Hairpin
//!   mode on the pods' ports lets a pod's packet DNATed back to itself leave by the port it
//!   came in by (without it the bridge drops it: kubenet's hairpin problem).
//! - [`CniPlugin::Ptp`]: `ptp` with `host-local`: a veth per pod, the gateway address on each
//!   host side and a /32 (/128) route per pod.
//!
//! `host-local` keeps its allocations in a data directory: each [`CniNetwork`] has its own
//! (removed on drop), so runs never see each other's leases. Each [`CniAttachment`] sends
//! `DEL` when dropped, with the `ADD` result as `prevResult`, as a runtime does.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};

use crate::netns::Netns;
use crate::process::{describe, run_bounded_with_input};
use crate::{Result, RigError, unique_name};

/// Where Debian's `containernetworking-plugins` installs the plugins.
pub const CNI_PATH: &str = "/usr/lib/cni";
/// The bridge the `bridge` plugin creates in the node namespace (flannel's name).
pub const BRIDGE_NAME: &str = "cni0";
/// The node's pod CIDRs (its `spec.podCIDRs`), inside the matrix's `--cluster-cidr`.
pub const POD_CIDR4: &str = "10.244.0.0/24";
pub const POD_CIDR6: &str = "fd00:244::/64";
/// The interface name inside each pod.
const IFNAME: &str = "eth0";
/// Bound for one plugin run (it creates a few links and addresses).
const PLUGIN_TIMEOUT: Duration = Duration::from_secs(20);

/// Which reference plugin wires the pods.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CniPlugin {
    /// `bridge` + `host-local` (flannel, kubenet).
    Bridge,
    /// `ptp` + `host-local`.
    Ptp,
}

impl CniPlugin {
    pub fn name(self) -> &'static str {
        match self {
            Self::Bridge => "bridge",
            Self::Ptp => "ptp",
        }
    }
}

/// One CNI network on one node: the plugin, the node namespace it runs in and host-local's
/// data directory (removed on drop, after every attachment is gone).
#[derive(Debug)]
pub struct CniNetwork {
    plugin: CniPlugin,
    node: String,
    data_dir: PathBuf,
}

impl CniNetwork {
    /// A network of `plugin` in the `node` namespace. With the bridge, the node gets
    /// `bridge-nf-call-iptables` / `-ip6tables` on: kube-proxy's requirement for bridged pod
    /// networks (without it, pod-to-pod Service traffic that the bridge forwards at layer 2
    /// never meets the iptables rules).
    pub fn new(plugin: CniPlugin, node: &Netns) -> Result<Self> {
        if !Path::new(CNI_PATH).join(plugin.name()).exists() {
            return Err(RigError::MissingBinary {
                path: Path::new(CNI_PATH).join(plugin.name()),
                hint: "apt-get install containernetworking-plugins (cargo xtask setup)",
            });
        }
        if plugin == CniPlugin::Bridge {
            // The settings exist only with the kernel's `br_netfilter` (loaded or built in).
            // Loading it is the host's business (it turns the same settings on in every
            // namespace, the host's too), so the rig names it instead of loading it.
            if !Path::new("/proc/sys/net/bridge/bridge-nf-call-iptables").exists() {
                return Err(RigError::Other(
                    "the bridge-wired pods need the kernel's br_netfilter (kube-proxy's \
                     requirement for bridged pod networks): `modprobe br_netfilter` on the host"
                        .into(),
                ));
            }
            node.sysctl_all(&[
                ("net.bridge.bridge-nf-call-iptables", "1"),
                ("net.bridge.bridge-nf-call-ip6tables", "1"),
            ])?;
        }
        let data_dir = std::env::temp_dir().join(unique_name("cni-ipam"));
        std::fs::create_dir(&data_dir)
            .map_err(|e| RigError::io(format!("creating {}", data_dir.display()), e))?;
        Ok(Self {
            plugin,
            node: node.name().to_owned(),
            data_dir,
        })
    }

    pub fn plugin(&self) -> CniPlugin {
        self.plugin
    }

    /// The network configuration (CNI spec 1.0.0) the runtime passes on stdin.
    pub fn config(&self) -> Value {
        let ipam = json!({
            "type": "host-local",
            "dataDir": self.data_dir,
            "ranges": [[{"subnet": POD_CIDR4}], [{"subnet": POD_CIDR6}]],
            "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}],
        });
        let name = format!("kpr-{}", self.plugin.name());
        match self.plugin {
            CniPlugin::Bridge => json!({
                "cniVersion": "1.0.0",
                "name": name,
                "type": "bridge",
                "bridge": BRIDGE_NAME,
                "isGateway": true,
                "ipMasq": false,
                "hairpinMode": true,
                "ipam": ipam,
            }),
            CniPlugin::Ptp => json!({
                "cniVersion": "1.0.0",
                "name": name,
                "type": "ptp",
                "ipMasq": false,
                "ipam": ipam,
            }),
        }
    }

    /// `ADD`s the pod whose namespace is `pod`: returns the attachment (which `DEL`s on drop)
    /// with the addresses the plugin's result names.
    pub fn add(&self, pod: &Netns) -> Result<CniAttachment> {
        let container_id = unique_name("ctr");
        let config = self.config();
        let result = self.exec("ADD", &container_id, &pod.path(), &config)?;
        let addrs = result_addresses(&result)?;
        let mut del_config = config;
        if let Some(obj) = del_config.as_object_mut() {
            obj.insert("prevResult".into(), result);
        }
        Ok(CniAttachment {
            plugin: self.plugin,
            node: self.node.clone(),
            container_id,
            netns: pod.path(),
            del_config,
            addrs,
        })
    }

    fn exec(
        &self,
        command: &str,
        container_id: &str,
        netns: &Path,
        config: &Value,
    ) -> Result<Value> {
        exec_plugin(
            self.plugin,
            &self.node,
            command,
            container_id,
            netns,
            config,
        )
    }
}

impl Drop for CniNetwork {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.data_dir) {
            eprintln!("rig: removing {} failed: {e}", self.data_dir.display());
        }
    }
}

/// One pod attached to a [`CniNetwork`]; `DEL`ed on drop (before its namespace goes).
#[derive(Debug)]
pub struct CniAttachment {
    plugin: CniPlugin,
    node: String,
    container_id: String,
    netns: PathBuf,
    del_config: Value,
    addrs: (Ipv4Addr, Ipv6Addr),
}

impl CniAttachment {
    /// The pod's address of the family, from the plugin's result.
    pub fn address(&self, ipv6: bool) -> IpAddr {
        if ipv6 {
            self.addrs.1.into()
        } else {
            self.addrs.0.into()
        }
    }

    pub fn addresses(&self) -> (Ipv4Addr, Ipv6Addr) {
        self.addrs
    }
}

impl Drop for CniAttachment {
    fn drop(&mut self) {
        if let Err(e) = exec_plugin(
            self.plugin,
            &self.node,
            "DEL",
            &self.container_id,
            &self.netns,
            &self.del_config,
        ) {
            eprintln!("rig: CNI DEL of {} failed: {e}", self.container_id);
        }
    }
}

/// Runs the plugin in the node namespace as a runtime does; the result JSON (`DEL` prints
/// none). A failing plugin's error is the JSON it prints on stdout.
fn exec_plugin(
    plugin: CniPlugin,
    node: &str,
    command: &str,
    container_id: &str,
    netns: &Path,
    config: &Value,
) -> Result<Value> {
    let binary = Path::new(CNI_PATH).join(plugin.name());
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", node])
        .arg(&binary)
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", container_id)
        .env("CNI_NETNS", netns)
        .env("CNI_IFNAME", IFNAME)
        .env("CNI_PATH", CNI_PATH);
    let input = serde_json::to_vec(config)
        .map_err(|e| RigError::Other(format!("CNI config as JSON: {e}")))?;
    let out = run_bounded_with_input(&mut cmd, Some(&input), PLUGIN_TIMEOUT)?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(RigError::Command {
            command: format!("CNI_COMMAND={command} {}", describe(&cmd)),
            status: out.status.to_string(),
            stderr: format!(
                "{} {}",
                stdout.trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    if stdout.trim().is_empty() {
        return Ok(Value::Null);
    }
    serde_json::from_str(&stdout).map_err(|_| RigError::Parse {
        what: "a CNI plugin's result",
        line: stdout.into_owned(),
    })
}

/// The pod's IPv4 and IPv6 address in a CNI result (`ips[].address`, CIDR notation).
pub fn result_addresses(result: &Value) -> Result<(Ipv4Addr, Ipv6Addr)> {
    let bad = || RigError::Parse {
        what: "a CNI result's ips (one IPv4 and one IPv6 address)",
        line: result.to_string(),
    };
    let mut v4 = None;
    let mut v6 = None;
    for ip in result["ips"].as_array().ok_or_else(bad)? {
        let address = ip["address"].as_str().ok_or_else(bad)?;
        let host = address.split('/').next().unwrap_or(address);
        match host.parse::<IpAddr>().map_err(|_| bad())? {
            IpAddr::V4(a) => v4 = v4.or(Some(a)),
            IpAddr::V6(a) => v6 = v6.or(Some(a)),
        }
    }
    Ok((v4.ok_or_else(bad)?, v6.ok_or_else(bad)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_both_families_from_a_result() {
        let result = json!({
            "cniVersion": "1.0.0",
            "interfaces": [{"name": "cni0"}, {"name": "eth0", "sandbox": "/run/netns/x"}],
            "ips": [
                {"address": "10.244.0.2/24", "gateway": "10.244.0.1", "interface": 1},
                {"address": "fd00:244::2/64", "gateway": "fd00:244::1", "interface": 1}
            ]
        });
        let got = result_addresses(&result).ok();
        assert_eq!(
            got,
            Some((
                Ipv4Addr::new(10, 244, 0, 2),
                Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, 2)
            ))
        );
        // One family missing, or no ips at all, is an error, not a guess.
        assert!(result_addresses(&json!({"ips": [{"address": "10.244.0.2/24"}]})).is_err());
        assert!(result_addresses(&json!({"cniVersion": "1.0.0"})).is_err());
    }
}
