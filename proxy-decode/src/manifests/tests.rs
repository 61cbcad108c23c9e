use std::sync::atomic::{AtomicUsize, Ordering};

use std::collections::BTreeSet;

use proxy_model::objects::Update;

use super::*;

/// A scratch folder removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "kpr-manifests-test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).expect("create temp dir");
        Self(path)
    }

    fn write(&self, name: &str, text: &str) {
        std::fs::write(self.0.join(name), text).expect("write manifest");
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const SERVICE: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec:\n  clusterIP: 10.96.0.10\n  ports: [{port: 80}]\n";
const SLICE: &str = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nendpoints: [{addresses: [10.244.1.2]}]\n";

fn key(namespace: &str, name: &str) -> ObjectKey {
    ObjectKey {
        namespace: namespace.into(),
        name: name.into(),
    }
}

#[test]
fn reads_multi_document_files_and_ignores_other_kinds_and_files() {
    let dir = TempDir::new();
    dir.write(
        "app.yaml",
        &format!("{SERVICE}---\n{SLICE}---\napiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: x}}\n---\n"),
    );
    dir.write(".hidden.yaml", "this is: [not valid");
    dir.write("notes.txt", "not a manifest");
    let loaded = load_dir(&dir.0);
    assert!(loaded.services.contains_key(&key("shop", "web")));
    // No namespace in the manifest: like kubectl, "default".
    assert!(
        loaded
            .endpoint_slices
            .contains_key(&key("default", "web-1"))
    );
    // The Deployment is named (a typo in `kind` must not pass silently), and so is the slice,
    // whose Service would be default/web, not shop/web.
    let messages: Vec<String> = loaded.errors.iter().map(ToString::to_string).collect();
    assert_eq!(messages.len(), 2, "{messages:?}");
    assert!(
        messages[0].ends_with(
            "app.yaml: document 3: apps/v1 Deployment x: not a kind the proxy reads (v1 Service, \
             discovery.k8s.io/v1 EndpointSlice, v1 Node, v1 List); skipped"
        ),
        "{messages:?}"
    );
    assert!(
        messages[1].ends_with(
            "app.yaml: document 2: EndpointSlice default/web-1: its Service default/web (label \
             `kubernetes.io/service-name`) is not defined in the folder; its endpoints are unused \
             until it is"
        ),
        "{messages:?}"
    );
}

#[test]
fn a_broken_file_is_reported_and_the_other_files_still_load() {
    let dir = TempDir::new();
    dir.write("a.yaml", SERVICE);
    dir.write(
        "b.yml",
        "kind: Service\napiVersion: v1\nmetadata: [unclosed\n",
    );
    let loaded = load_dir(&dir.0);
    assert_eq!(loaded.services.len(), 1);
    assert_eq!(loaded.errors.len(), 1);
    let message = loaded.errors[0].to_string();
    assert!(
        message.contains("b.yml: document 1: invalid YAML"),
        "{message}"
    );
}

#[test]
fn an_invalid_object_names_its_kind_name_and_document_and_its_neighbours_load() {
    let dir = TempDir::new();
    let bad =
        "apiVersion: v1\nkind: Service\nmetadata: {name: bad}\nspec:\n  ports: [{port: eighty}]\n";
    dir.write("mixed.yaml", &format!("{bad}---\n{SERVICE}"));
    let loaded = load_dir(&dir.0);
    assert_eq!(loaded.services.len(), 1);
    let message = loaded.errors[0].to_string();
    assert!(
        message.contains("mixed.yaml: document 1: Service bad:"),
        "{message}"
    );
}

#[test]
fn missing_kind_is_reported() {
    let dir = TempDir::new();
    dir.write("x.yaml", "apiVersion: v1\nmetadata: {name: x}\n");
    let loaded = load_dir(&dir.0);
    let message = loaded.errors[0].to_string();
    assert!(
        message.contains("missing or non-string field `kind`"),
        "{message}"
    );
}

#[test]
fn a_duplicate_object_names_both_files_and_the_first_wins() {
    let dir = TempDir::new();
    dir.write("1.yaml", SERVICE);
    dir.write("2.yaml", &SERVICE.replace("10.96.0.10", "10.96.0.99"));
    let loaded = load_dir(&dir.0);
    let service = &loaded.services[&key("shop", "web")];
    let cluster_ip = service.cluster_ip.as_deref();
    assert_eq!(cluster_ip, Some("10.96.0.10"));
    let message = loaded.errors[0].to_string();
    assert!(
        message.contains("2.yaml") && message.contains("1.yaml"),
        "{message}"
    );
}

#[test]
fn a_missing_folder_is_an_error_not_a_panic() {
    let loaded = load_dir(Path::new("/nonexistent/kpr-manifests"));
    assert!(loaded.services.is_empty());
    assert!(
        loaded.errors[0]
            .to_string()
            .contains("cannot read manifests folder")
    );
}

#[test]
fn list_objects_are_unpacked() {
    let dir = TempDir::new();
    let indented: String = SERVICE.lines().map(|l| format!("  {l}\n")).collect();
    dir.write(
        "list.yaml",
        &format!("apiVersion: v1\nkind: List\nitems:\n-\n{indented}"),
    );
    let loaded = load_dir(&dir.0);
    assert!(loaded.errors.is_empty(), "{:?}", loaded.errors);
    assert_eq!(loaded.services.len(), 1);
}

fn messages(loaded: &Loaded) -> Vec<String> {
    loaded.errors.iter().map(ToString::to_string).collect()
}

#[test]
fn duplicate_keys_are_named_and_the_next_document_still_loads() {
    let text = format!("{SERVICE}  clusterIP: 10.96.0.11\n---\n{SERVICE}");
    let loaded = load_bytes(Path::new("dup.yaml"), text.as_bytes());
    assert_eq!(loaded.services.len(), 1);
    let messages = messages(&loaded);
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert!(
        messages[0].starts_with(
            "dup.yaml: document 1: invalid YAML: duplicate mapping key `clusterIP` is not allowed \
             here at line 7, column 3"
        ),
        "{messages:?}"
    );
}

#[test]
fn deep_nesting_and_alias_bombs_are_refused_without_blowing_the_stack() {
    let deep = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: deep}}\nspec: {}{}\n---\n{SERVICE}",
        "{a: [".repeat(50_000),
        "]}".repeat(50_000)
    );
    let loaded = load_bytes(Path::new("deep.yaml"), deep.as_bytes());
    assert_eq!(loaded.services.len(), 1, "{:?}", messages(&loaded));
    let messages_deep = messages(&loaded);
    assert_eq!(messages_deep.len(), 1, "{messages_deep:?}");
    assert!(
        messages_deep[0].starts_with("deep.yaml: document 1: invalid YAML: ")
            && messages_deep[0].contains("recursion limit exceeded at line 4"),
        "{messages_deep:?}"
    );
    // Block nesting (indentation) too, and the next document still loads.
    let block: String = (0..200)
        .map(|i| format!("{}a{i}:\n", " ".repeat(i)))
        .collect();
    let text = format!("{block}---\n{SERVICE}");
    let loaded = load_bytes(Path::new("block.yaml"), text.as_bytes());
    assert_eq!(loaded.services.len(), 1, "{:?}", messages(&loaded));
    assert!(
        messages(&loaded)[0].starts_with("block.yaml: document 1: invalid YAML: "),
        "{:?}",
        messages(&loaded)
    );

    let mut bomb = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
    for i in 1..9 {
        let refs = vec![format!("*a{}", i - 1); 10].join(", ");
        bomb.push_str(&format!("a{i}: &a{i} [{refs}]\n"));
    }
    let text = format!("{bomb}---\n{SERVICE}");
    let loaded = load_bytes(Path::new("bomb.yaml"), text.as_bytes());
    assert_eq!(loaded.services.len(), 1, "{:?}", messages(&loaded));
    assert!(
        messages(&loaded)[0].starts_with("bomb.yaml: document 1: invalid YAML: ")
            && messages(&loaded)[0].contains("too complex"),
        "{:?}",
        messages(&loaded)
    );
}

#[test]
fn a_syntax_error_or_unknown_anchor_costs_only_its_document() {
    for bad in [
        "a: *nowhere\n",
        "a: [unclosed\n",
        "a:\n\tb: 1\n",
        "a: \"open\n",
    ] {
        let text = format!(
            "{SERVICE}---\n{bad}---\n{}",
            SERVICE.replace("name: web", "name: web2")
        );
        let loaded = load_bytes(Path::new("x.yaml"), text.as_bytes());
        let messages = messages(&loaded);
        assert_eq!(loaded.services.len(), 2, "{bad:?}: {messages:?}");
        assert_eq!(messages.len(), 1, "{bad:?}: {messages:?}");
        assert!(
            messages[0].starts_with("x.yaml: document 2: invalid YAML: "),
            "{bad:?}: {messages:?}"
        );
    }
}

#[test]
fn oversized_files_non_utf8_and_huge_annotations_are_named() {
    let dir = TempDir::new();
    let big = "#".repeat(MAX_FILE_BYTES as usize + 1);
    dir.write("big.yaml", &big);
    std::fs::write(dir.0.join("latin1.yaml"), b"kind: Service\nname: caf\xe9\n").expect("write");
    let annotated = SERVICE.replace(
        "metadata: {name: web, namespace: shop}",
        &format!(
            "metadata: {{name: noisy, annotations: {{a: {}}}}}",
            "x".repeat(300_000)
        ),
    );
    dir.write("noisy.yaml", &annotated);
    dir.write("ok.yaml", SERVICE);
    let loaded = load_dir(&dir.0);
    assert_eq!(loaded.services.len(), 1);
    let messages = messages(&loaded);
    assert_eq!(messages.len(), 3, "{messages:?}");
    assert!(
        messages[0].ends_with(&format!(
            "big.yaml: file is larger than {MAX_FILE_BYTES} bytes ({}); not read",
            MAX_FILE_BYTES + 1
        )),
        "{messages:?}"
    );
    assert!(
        messages[1].ends_with(
            "latin1.yaml: not UTF-8 text (invalid byte at offset 23); the file is skipped"
        ),
        "{messages:?}"
    );
    assert!(messages[2].ends_with("noisy.yaml: document 1: Service noisy: metadata.annotations: 300001 bytes, more than the API server's limit of 262144; skipped"), "{messages:?}");
}

#[test]
fn a_bad_list_item_is_named_and_the_other_items_load() {
    let indented = |text: &str| -> String { text.lines().map(|l| format!("  {l}\n")).collect() };
    let bad = SERVICE
        .replace("port: 80", "port: eighty")
        .replace("name: web", "name: bad");
    let text = format!(
        "apiVersion: v1\nkind: List\nitems:\n-\n{}-\n{}",
        indented(&bad),
        indented(SERVICE)
    );
    let loaded = load_bytes(Path::new("list.yaml"), text.as_bytes());
    assert_eq!(loaded.services.len(), 1);
    let messages = messages(&loaded);
    assert!(
        messages[0].starts_with("list.yaml: document 1: items[0]: Service bad: "),
        "{messages:?}"
    );
}

#[test]
fn a_slice_without_a_service_label_is_named() {
    let text = SLICE.replace("labels: {kubernetes.io/service-name: web}", "labels: {}");
    let loaded = load_bytes(Path::new("s.yaml"), text.as_bytes());
    assert!(loaded.endpoint_slices.is_empty());
    assert!(
        messages(&loaded)[0].contains(
            "EndpointSlice default/web-1: metadata.labels: no `kubernetes.io/service-name` label"
        ),
        "{:?}",
        messages(&loaded)
    );
}

#[test]
fn unknown_fields_are_named_and_the_object_is_still_used() {
    let rich = "apiVersion: v1\nkind: Service\nmetadata: {name: rich, namespace: shop, labels: {a: b}, annotations: {c: d}}\nspec:\n  type: NodePort\n  clusterIP: 10.96.0.12\n  clusterIPs: [10.96.0.12]\n  ipFamilies: [IPv4]\n  ipFamilyPolicy: SingleStack\n  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 60}}\n  externalTrafficPolicy: Local\n  internalTrafficPolicy: Cluster\n  selector: {app: rich}\n  ports:\n  - {name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: 30080}\n  - {name: dns, port: 53, targetPort: dns, protocol: UDP, bogus: 1}\n  nope: null\nstatus: {loadBalancer: {}}\n";
    let loaded = load_bytes(Path::new("rich.yaml"), rich.as_bytes());
    assert_eq!(loaded.services.len(), 1);
    assert_eq!(
        messages(&loaded),
        [
            "rich.yaml: document 1: Service rich: unknown field `spec.ports[1].bogus`; ignored",
            // Null or not, as the API server's strict field validation names it.
            "rich.yaml: document 1: Service rich: unknown field `spec.nope`; ignored"
        ]
    );
    let slice = format!("{SLICE}endpoints: [{{addresses: [10.244.1.2], conditions: {{ready: true}}, nodeName: n, zone: z, extra: 1}}]\nports: [{{name: http, port: 8080, protocol: TCP, appProtocol: http}}]\n").replacen("endpoints: [{addresses: [10.244.1.2]}]\n", "", 1);
    let loaded = load_bytes(Path::new("slice.yaml"), slice.as_bytes());
    assert_eq!(loaded.endpoint_slices.len(), 1);
    assert_eq!(
        messages(&loaded),
        [
            "slice.yaml: document 1: EndpointSlice web-1: unknown field `endpoints[0].extra`; ignored"
        ]
    );
}

/// The store's view built only from what a [`FolderReader`] sends.
#[derive(Debug, Default)]
struct StoreModel {
    services: BTreeMap<ObjectKey, ServiceInfo>,
    slices: BTreeMap<ObjectKey, EndpointSliceInfo>,
    node: Option<NodeInfo>,
}

impl StoreModel {
    fn apply(&mut self, updates: Vec<Update>) {
        for update in updates {
            match update {
                Update::ReplaceServices(all) => self.services = all,
                Update::ReplaceEndpointSlices(all) => self.slices = all,
                Update::ReplaceNode(node) => self.node = node,
                Update::ServiceApplied(key, service) => {
                    self.services.insert(key, service);
                }
                Update::ServiceDeleted(key) => {
                    self.services.remove(&key);
                }
                Update::EndpointSliceApplied(key, slice) => {
                    self.slices.insert(key, slice);
                }
                Update::EndpointSliceDeleted(key) => {
                    self.slices.remove(&key);
                }
            }
        }
    }
}

/// One incremental read; then the model must equal a full `load_dir` of the folder, errors
/// included. Returns how many files were parsed and updates sent.
fn read_and_compare(
    dir: &TempDir,
    reader: &mut FolderReader,
    model: &mut StoreModel,
    named: &[&str],
) -> (usize, usize) {
    let named: BTreeSet<PathBuf> = named.iter().map(|n| dir.0.join(n)).collect();
    let read = reader.read(&named);
    let counts = (read.files_parsed, read.updates.len());
    model.apply(read.updates);
    let mut full = load_dir(&dir.0);
    assert_eq!(
        model.services, full.services,
        "Services differ from load_dir"
    );
    assert_eq!(
        model.slices, full.endpoint_slices,
        "slices differ from load_dir"
    );
    assert_eq!(
        model.node,
        full.nodes.remove(&key("", "node1")),
        "node differs"
    );
    let mut expected: Vec<String> = full.errors.iter().map(ToString::to_string).collect();
    let mut errors = read.errors;
    expected.sort();
    errors.sort();
    assert_eq!(errors, expected, "errors differ from load_dir");
    counts
}

/// Renames a new file over `name` (a new inode), as atomic writers do.
fn replace(dir: &TempDir, name: &str, text: &str) {
    let tmp = format!(".{name}.tmp");
    dir.write(&tmp, text);
    std::fs::rename(dir.0.join(&tmp), dir.0.join(name)).expect("rename manifest");
}

fn service_doc(name: &str, ip: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: shop}}\nspec:\n  clusterIP: {ip}\n  ports: [{{port: 80}}]\n"
    )
}

fn slice_doc(name: &str, service: &str, ip: &str) -> String {
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}, namespace: shop, labels: {{kubernetes.io/service-name: {service}}}}}\naddressType: IPv4\nendpoints: [{{addresses: [{ip}]}}]\n"
    )
}

const NODE1: &str = "apiVersion: v1\nkind: Node\nmetadata: {name: node1, labels: {zone: a}}\n";

#[test]
fn incremental_reads_equal_full_reads_and_parse_only_changed_files() {
    let dir = TempDir::new();
    dir.write(
        "a.yaml",
        &format!(
            "{}---\n{}",
            service_doc("web", "10.96.0.10"),
            slice_doc("web-1", "web", "10.244.1.2")
        ),
    );
    dir.write("b.yaml", &service_doc("api", "10.96.0.11"));
    dir.write(
        "c.yaml",
        &format!(
            "{NODE1}---\n{}",
            slice_doc("ghost-1", "ghost", "10.244.9.9")
        ),
    );
    let mut reader = FolderReader::new(dir.0.clone(), "node1");
    let mut model = StoreModel::default();

    let first = read_and_compare(&dir, &mut reader, &mut model, &[]);
    assert_eq!(
        first,
        (3, 3),
        "first read: every file, three Replace updates"
    );
    assert_eq!(model.services.len(), 2);
    assert!(model.node.is_some());

    assert_eq!(
        read_and_compare(&dir, &mut reader, &mut model, &[]),
        (0, 0),
        "a rescan without changes parses nothing and sends nothing"
    );

    // One file edited: only it is parsed, only its objects are sent.
    replace(
        &dir,
        "a.yaml",
        &format!(
            "{}---\n{}",
            service_doc("web", "10.96.0.10"),
            slice_doc("web-1", "web", "10.244.1.3")
        ),
    );
    assert_eq!(read_and_compare(&dir, &mut reader, &mut model, &[]), (1, 2));

    // A duplicate in a new file: the first file (b) keeps the object; both are read.
    dir.write("d.yaml", &service_doc("api", "10.96.0.99"));
    read_and_compare(&dir, &mut reader, &mut model, &[]);
    // The first copy goes away: the duplicate takes over.
    std::fs::remove_file(dir.0.join("b.yaml")).expect("remove b.yaml");
    read_and_compare(&dir, &mut reader, &mut model, &[]);
    assert_eq!(
        model.services[&key("shop", "api")].cluster_ip.as_deref(),
        Some("10.96.0.99")
    );

    // The orphan slice's Service appears: the error goes away.
    dir.write("e.yaml", &service_doc("ghost", "10.96.0.12"));
    read_and_compare(&dir, &mut reader, &mut model, &[]);

    // A syntax error half-way: what `load_dir` keeps of the file, and nothing more.
    replace(
        &dir,
        "a.yaml",
        &format!("{}---\nkind: [unclosed\n", service_doc("web", "10.96.0.10")),
    );
    read_and_compare(&dir, &mut reader, &mut model, &[]);
    assert!(!model.slices.contains_key(&key("shop", "web-1")));

    // An in-place write that keeps the length, named by a notification.
    let same_length = service_doc("ghost", "10.96.0.13");
    std::fs::write(dir.0.join("e.yaml"), &same_length).expect("rewrite e.yaml");
    read_and_compare(&dir, &mut reader, &mut model, &["e.yaml"]);

    // The node's file loses it.
    replace(&dir, "c.yaml", &slice_doc("ghost-1", "ghost", "10.244.9.9"));
    read_and_compare(&dir, &mut reader, &mut model, &[]);
    assert!(model.node.is_none());

    // The folder disappears: nothing is left, and that is reported.
    std::fs::remove_dir_all(&dir.0).expect("remove folder");
    read_and_compare(&dir, &mut reader, &mut model, &[]);
    assert!(model.services.is_empty() && model.slices.is_empty());
}

/// Found by the manifests fuzz target: an alias to an undefined anchor inside a flow sequence
/// of a flow mapping made serde_yaml panic ("unexpected end of sequence"); now the document is
/// reported as invalid.
#[test]
fn an_alias_without_anchor_is_named_instead_of_panicking() {
    let input =
        include_bytes!("../../../tests/fuzz/seeds/manifests/unknown-alias-in-flow-sequence");
    let loaded = load_bytes(Path::new("fuzz.yaml"), input);
    let messages = messages(&loaded);
    assert!(
        messages
            .iter()
            .any(|m| m.starts_with("fuzz.yaml: document 1: invalid YAML: ")),
        "{messages:?}"
    );
}

/// A document decoded straight into its type skips an unknown field however deep it nests
/// (up to the depth limit), on a test thread's 2 MiB stack in a debug build.
#[test]
fn a_deep_unknown_field_on_the_direct_path_is_named() {
    let deep_flow = |open: &str, close: &str| {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: deep, namespace: x}}\nspec:\n  \
             clusterIP: 10.96.0.1\n  extra: {}1{}\n",
            open.repeat(62),
            close.repeat(62)
        )
    };
    let block: String = (0..62)
        .map(|i| format!("{}extra{i}:\n", " ".repeat(i + 2)))
        .collect();
    let deep_block = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: deep, namespace: x}}\nspec:\n{block}"
    );
    for (text, field) in [
        (deep_flow("[", "]"), "spec.extra"),
        (deep_flow("{a: ", "}"), "spec.extra"),
        (deep_block, "spec.extra0"),
    ] {
        let loaded = load_bytes(Path::new("d.yaml"), text.as_bytes());
        assert_eq!(loaded.services.len(), 1, "{:?}", messages(&loaded));
        assert_eq!(
            messages(&loaded),
            [format!(
                "d.yaml: document 1: Service deep: unknown field `{field}`; ignored"
            )]
        );
    }
}
