use std::sync::atomic::{AtomicUsize, Ordering};

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
    assert!(loaded.errors.is_empty(), "{:?}", loaded.errors);
    assert!(loaded.services.contains_key(&key("shop", "web")));
    // No namespace in the manifest: like kubectl, "default".
    assert!(
        loaded
            .endpoint_slices
            .contains_key(&key("default", "web-1"))
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
    let cluster_ip = service.spec.as_ref().and_then(|s| s.cluster_ip.as_deref());
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
