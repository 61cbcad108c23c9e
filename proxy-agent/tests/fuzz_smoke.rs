//! A bounded, deterministic mutation loop over the agent's parsers of untrusted bytes (the
//! same entry points as the cargo-fuzz targets in `tests/fuzz/`): seeds are valid inputs,
//! mutations flip, insert, delete, duplicate and splice bytes and YAML tokens. A panic fails
//! the test and prints the input. Cheap (a few seconds) so `cargo xtask test` runs it; the
//! coverage-guided runs are `cargo xtask fuzz`.

use std::time::{Duration, Instant};

/// Per target: at most this many inputs, and at most this long.
const ITERATIONS: usize = 40_000;
const TIME_BUDGET: Duration = Duration::from_secs(5);

/// xorshift64*: deterministic, so a failure reproduces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

const TOKENS: &[&[u8]] = &[
    b"[",
    b"]",
    b"{",
    b"}",
    b": ",
    b"- ",
    b"\n---\n",
    b"&a ",
    b"*a",
    b"!!binary ",
    b"\"",
    b"'",
    b"\t",
    b"\xff",
    b"\x00",
    b"~",
    b"null",
    b"-1",
    b"99999999999999999999",
    b"1e999",
    b"<<: ",
    b"? ",
    b"|\n",
    b">-\n",
    b"%YAML 1.2\n",
    b"#",
    b"\r\n",
    b"kind: List\nitems:\n- ",
];

fn mutate(rng: &mut Rng, seeds: &[Vec<u8>], input: &mut Vec<u8>) {
    for _ in 0..=rng.below(4) {
        let len = input.len();
        match rng.below(7) {
            0 if len > 0 => {
                let at = rng.below(len);
                input[at] ^= 1 << rng.below(8);
            }
            1 => {
                let at = rng.below(len + 1);
                input.insert(at, rng.next() as u8);
            }
            2 if len > 0 => {
                let at = rng.below(len);
                let n = rng.below(16).min(len - at);
                input.drain(at..at + n);
            }
            3 => {
                let token = TOKENS[rng.below(TOKENS.len())];
                let at = rng.below(len + 1);
                input.splice(at..at, token.iter().copied());
            }
            4 if len > 0 => {
                let at = rng.below(len);
                let n = rng.below(64).min(len - at);
                let chunk = input[at..at + n].to_vec();
                let to = rng.below(len + 1);
                input.splice(to..to, chunk);
            }
            5 => {
                let other = &seeds[rng.below(seeds.len())];
                if !other.is_empty() {
                    let at = rng.below(other.len());
                    let n = rng.below(128).min(other.len() - at);
                    let to = rng.below(len + 1);
                    input.splice(to..to, other[at..at + n].iter().copied());
                }
            }
            _ if len >= 4 => {
                // A length or type field of a binary format: overwrite with an edge value.
                let at = rng.below(len - 3);
                let value: [u8; 4] = match rng.below(4) {
                    0 => [0; 4],
                    1 => [0xff; 4],
                    2 => (rng.next() as u32).to_ne_bytes(),
                    _ => [4, 0, 0x80, 0],
                };
                input[at..at + 4].copy_from_slice(&value);
            }
            _ => {}
        }
    }
}

/// Runs `target` over the seeds and their mutations; returns how many inputs it tried.
fn run(name: &str, seed: u64, seeds: &[Vec<u8>], target: fn(&[u8])) -> usize {
    let mut rng = Rng(seed);
    let started = Instant::now();
    let mut tried = 0;
    for seed in seeds {
        target(seed);
        tried += 1;
    }
    while tried < ITERATIONS && started.elapsed() < TIME_BUDGET {
        let mut input = seeds[rng.below(seeds.len())].clone();
        mutate(&mut rng, seeds, &mut input);
        let outcome = std::panic::catch_unwind(|| target(&input));
        assert!(
            outcome.is_ok(),
            "{name}: input #{tried} panicked: {:?}",
            String::from_utf8_lossy(&input)
        );
        tried += 1;
    }
    eprintln!(
        "fuzz smoke {name}: {tried} inputs in {:?}, no panic",
        started.elapsed()
    );
    tried
}

fn manifest_seeds() -> Vec<Vec<u8>> {
    [
        "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop, annotations: {a: b}}\nspec:\n  type: LoadBalancer\n  clusterIP: 10.96.0.10\n  clusterIPs: [10.96.0.10, fd00::10]\n  loadBalancerSourceRanges: [10.0.0.0/8]\n  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\n  ports:\n  - {name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30080}\n  - {name: dns, port: 53, protocol: UDP}\nstatus: {loadBalancer: {ingress: [{ip: 1.2.3.4, ipMode: VIP}]}}\n",
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nendpoints:\n- addresses: [10.244.1.2]\n  conditions: {ready: true, serving: true, terminating: false}\n  nodeName: node-a\n  zone: z1\n  hints: {forZones: [{name: z1}]}\nports: [{name: http, port: 8080, protocol: TCP}]\n",
        "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Node\n  metadata: {name: node-a, labels: {topology.kubernetes.io/zone: z1}}\n  spec: {podCIDRs: [10.244.1.0/24]}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {clusterIP: None}\n",
        "a: &x [1, 2]\nb: *x\nc: {<<: {d: 1}}\n",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect()
}

fn config_seeds() -> Vec<Vec<u8>> {
    let mut document = proxy_model::config::KubeProxyConfiguration::default();
    proxy_model::config::defaults::apply(&mut document);
    document.api_version = proxy_model::config::file::API_VERSION.into();
    document.kind = proxy_model::config::file::KIND.into();
    let full = proxy_model::config::to_yaml(&document).unwrap_or_default();
    vec![
        full.into_bytes(),
        b"apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: iptables\niptables: {syncPeriod: 1m0s, masqueradeBit: 14}\nclusterCIDR: 10.244.0.0/16,fd00::/48\nnodePortAddresses: [primary]\nfeatureGates: {A: true}\nipvs: null\n".to_vec(),
        br#"{"apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration", "conntrack": {"maxPerCore": 0}}"#.to_vec(),
    ]
}

fn attr(kind: u16, payload: &[u8]) -> Vec<u8> {
    let len = 4 + payload.len();
    let mut out = Vec::new();
    out.extend((len as u16).to_ne_bytes());
    out.extend(kind.to_ne_bytes());
    out.extend(payload);
    out.resize((len + 3) & !3, 0);
    out
}

fn netlink(kind: u16, payload: &[u8]) -> Vec<u8> {
    let len = 16 + payload.len();
    let mut out = Vec::new();
    out.extend((len as u32).to_ne_bytes());
    out.extend(kind.to_ne_bytes());
    out.extend([0u8; 10]);
    out.extend(payload);
    out.resize((len + 3) & !3, 0);
    out
}

fn ctnetlink_seeds() -> Vec<Vec<u8>> {
    let tuple = |src: [u8; 4], dst: [u8; 4]| {
        let ip = [attr(1, &src), attr(2, &dst)].concat();
        let proto = [
            attr(1, &[17]),
            attr(2, &1234u16.to_be_bytes()),
            attr(3, &53u16.to_be_bytes()),
        ]
        .concat();
        [attr(0x8001, &ip), attr(0x8002, &proto)].concat()
    };
    let entry = [
        vec![2, 0, 0, 0], // nfgenmsg
        attr(0x8001, &tuple([10, 0, 0, 1], [10, 96, 0, 10])),
        attr(0x8002, &tuple([10, 244, 1, 2], [10, 0, 0, 1])),
    ]
    .concat();
    let v6 = [
        vec![10, 0, 0, 0],
        attr(
            0x8001,
            &attr(0x8001, &[attr(3, &[0xfd; 16]), attr(4, &[1; 16])].concat()),
        ),
    ]
    .concat();
    vec![
        [
            netlink(0x100, &entry),
            netlink(0x100, &entry),
            netlink(3, &[0; 4]),
        ]
        .concat(),
        [netlink(0x100, &v6), netlink(2, &(-2i32).to_ne_bytes())].concat(),
    ]
}

fn sockdiag_seeds() -> Vec<Vec<u8>> {
    // struct inet_diag_msg: family, state, timer, retrans, sockid (48), expires, rqueue,
    // wqueue, uid, inode.
    let mut msg = vec![2u8, 1, 0, 0];
    let mut sockid = [0u8; 48];
    sockid[0..2].copy_from_slice(&40000u16.to_be_bytes());
    sockid[2..4].copy_from_slice(&8080u16.to_be_bytes());
    sockid[4..8].copy_from_slice(&[10, 0, 0, 1]);
    sockid[20..24].copy_from_slice(&[10, 244, 1, 2]);
    sockid[40..48].copy_from_slice(&0x1234_5678_9abc_def0u64.to_ne_bytes());
    msg.extend(sockid);
    msg.extend([0u8; 20]);
    let mut msg6 = msg.clone();
    msg6[0] = 10;
    vec![[netlink(20, &msg), netlink(20, &msg6), netlink(3, &[0; 4])].concat()]
}

/// The cargo-fuzz target's seeds: its committed seed folder (a ServiceList and an
/// EndpointSliceList body and a watch stream — ADDED, MODIFIED, BOOKMARK, a 410 ERROR — as the
/// API server encodes them), and the Kubernetes API's own protobuf fixtures from
/// `../shared/k8s-api-testdata/<release>/*.pb`, which `cargo xtask fuzz` adds to the seeds too.
fn api_protobuf_seeds() -> Vec<Vec<u8>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let failed = |what: &std::path::Path, error: std::io::Error| -> ! {
        panic!("reading {}: {error}", what.display())
    };
    let files = |dir: &std::path::Path| -> Vec<std::path::PathBuf> {
        let mut paths: Vec<_> = std::fs::read_dir(dir)
            .unwrap_or_else(|error| failed(dir, error))
            .map(|entry| entry.unwrap_or_else(|error| failed(dir, error)).path())
            .collect();
        paths.sort();
        paths
    };
    let mut paths = files(&root.join("tests/fuzz/seeds/api_protobuf"));
    let fixtures = root.join("../shared/k8s-api-testdata");
    for release in files(&fixtures).into_iter().filter(|path| path.is_dir()) {
        paths.extend(
            files(&release)
                .into_iter()
                .filter(|path| path.extension().is_some_and(|ext| ext == "pb")),
        );
    }
    let seeds: Vec<Vec<u8>> = paths
        .iter()
        .map(|path| std::fs::read(path).unwrap_or_else(|error| failed(path, error)))
        .collect();
    assert!(
        seeds.len() > 3,
        "{}: no fixtures among {} seeds",
        fixtures.display(),
        seeds.len()
    );
    seeds
}

#[test]
fn parsers_of_untrusted_bytes_never_panic_on_mutated_input() {
    let tried = [
        run(
            "manifests",
            1,
            &manifest_seeds(),
            proxy_agent::fuzz::manifests,
        ),
        run("config", 2, &config_seeds(), proxy_agent::fuzz::config),
        run(
            "ctnetlink",
            3,
            &ctnetlink_seeds(),
            proxy_agent::fuzz::ctnetlink,
        ),
        run(
            "sockdiag",
            4,
            &sockdiag_seeds(),
            proxy_agent::fuzz::sockdiag,
        ),
        run(
            "api_protobuf",
            5,
            &api_protobuf_seeds(),
            proxy_agent::fuzz::api_protobuf,
        ),
    ];
    eprintln!(
        "fuzz smoke: {} inputs over 5 parsers",
        tried.iter().sum::<usize>()
    );
}
