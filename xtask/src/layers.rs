//! The map the compiler cannot keep: no module cycle at any level of any crate.
//!
//! Cargo already refuses a cycle between crates. Inside a crate, modules may name each other
//! freely, and a cycle between sibling modules (`a` uses `b`, `b` uses `a`) means neither can be
//! read, tested or moved alone. This reads every crate's sources with `syn`, resolves each path
//! a module names (`crate::…`, `super::…`, `self::…`, a child module's name) to the module it
//! points into, and, for every parent module, looks for a cycle among the edges between its
//! children. `#[cfg(test)]` items are left out: a unit test may reach across rooms.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use syn::visit::Visit;

/// A module's path inside its crate: `[]` is the crate root.
type ModulePath = Vec<String>;

/// The children of one module: each child → the siblings it names → the first place naming it.
type Graph = BTreeMap<String, BTreeMap<String, String>>;

/// One crate's modules and the modules each refers to.
#[derive(Debug, Default)]
struct Crate {
    modules: BTreeSet<ModulePath>,
    /// Every path written, with the (possibly inline) module it is written in.
    refs: Vec<(ModulePath, Vec<String>)>,
}

/// A cycle among the children of `parent`, with one path that shows each step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cycle {
    pub krate: String,
    pub parent: String,
    pub members: Vec<String>,
    /// Each edge inside the cycle, with the first place that makes it.
    pub edges: Vec<String>,
}

impl fmt::Display for Cycle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parent = if self.parent.is_empty() {
            "the crate root".to_owned()
        } else {
            format!("`{}`", self.parent)
        };
        write!(
            f,
            "{}: a cycle among the modules of {parent}: {}",
            self.krate,
            self.members.join(" ↔ ")
        )?;
        for edge in &self.edges {
            write!(f, "\n    {edge}")?;
        }
        Ok(())
    }
}

/// The module cycles of the crate whose sources start at `root_file` (`src/lib.rs` or
/// `src/main.rs`).
pub fn cycles(krate: &str, root_file: &Path) -> Result<Vec<Cycle>> {
    let mut c = Crate::default();
    read_module(&mut c, root_file, Vec::new(), true)?;
    Ok(find_cycles(krate, &c))
}

fn read_module(c: &mut Crate, file: &Path, module: ModulePath, is_dir_owner: bool) -> Result<()> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let parsed = syn::parse_file(&text).with_context(|| format!("parsing {}", file.display()))?;
    // Children of this file live in `dir/` (`mod.rs`, `lib.rs`, `main.rs`) or in a folder named
    // after the file (`a.rs` with `a/b.rs`).
    let dir = if is_dir_owner {
        file.parent().map(Path::to_path_buf).unwrap_or_default()
    } else {
        file.with_extension("")
    };
    c.modules.insert(module.clone());
    let mut collector = Collector {
        module: module.clone(),
        inline: Vec::new(),
        paths: Vec::new(),
        children: Vec::new(),
    };
    collector.visit_file(&parsed);
    let Collector {
        paths, children, ..
    } = collector;
    for (name, path_attr) in children {
        let mut child = module.clone();
        child.push(name.clone());
        let (child_file, owns_dir) = match path_attr {
            Some(p) => (dir.join(p), true),
            None => {
                let flat = dir.join(format!("{name}.rs"));
                if flat.is_file() {
                    (flat, false)
                } else {
                    (dir.join(&name).join("mod.rs"), true)
                }
            }
        };
        read_module(c, &child_file, child, owns_dir)?;
    }
    c.refs.extend(paths);
    Ok(())
}

/// Collects, from one file, the paths its code names (made absolute) and its file modules.
struct Collector {
    module: ModulePath,
    /// Inline `mod x { … }` blocks the visitor is inside.
    inline: Vec<String>,
    /// Absolute paths as written, to be resolved once every module is known.
    paths: Vec<(ModulePath, Vec<String>)>,
    /// File modules declared here, with a `#[path]` if given.
    children: Vec<(String, Option<String>)>,
}

impl Collector {
    fn here(&self) -> ModulePath {
        let mut m = self.module.clone();
        m.extend(self.inline.iter().cloned());
        m
    }

    fn record(&mut self, segments: Vec<String>) {
        if segments.is_empty() {
            return;
        }
        let here = self.here();
        self.paths.push((here, segments));
    }
}

fn is_cfg_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg")
            && a.parse_args::<syn::Meta>()
                .is_ok_and(|m| m.path().is_ident("test"))
    })
}

fn path_attr(attrs: &[syn::Attribute]) -> Option<String> {
    attrs.iter().find_map(|a| match &a.meta {
        syn::Meta::NameValue(nv) if nv.path.is_ident("path") => match &nv.value {
            syn::Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Str(s),
                ..
            }) => Some(s.value()),
            _ => None,
        },
        _ => None,
    })
}

/// Every full path a `use` tree names (`a::{b, c::d}` gives `a::b` and `a::c::d`).
fn use_paths(tree: &syn::UseTree, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    match tree {
        syn::UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            use_paths(&p.tree, prefix, out);
            prefix.pop();
        }
        syn::UseTree::Name(n) => {
            let mut full = prefix.clone();
            if n.ident != "self" {
                full.push(n.ident.to_string());
            }
            out.push(full);
        }
        syn::UseTree::Rename(r) => {
            let mut full = prefix.clone();
            full.push(r.ident.to_string());
            out.push(full);
        }
        syn::UseTree::Glob(_) => out.push(prefix.clone()),
        syn::UseTree::Group(g) => {
            for item in &g.items {
                use_paths(item, prefix, out);
            }
        }
    }
}

impl<'ast> Visit<'ast> for Collector {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        let attrs: &[syn::Attribute] = match item {
            syn::Item::Mod(m) => &m.attrs,
            syn::Item::Use(u) => &u.attrs,
            syn::Item::Fn(f) => &f.attrs,
            syn::Item::Impl(i) => &i.attrs,
            syn::Item::Struct(s) => &s.attrs,
            syn::Item::Enum(e) => &e.attrs,
            syn::Item::Const(c) => &c.attrs,
            syn::Item::Static(s) => &s.attrs,
            syn::Item::Trait(t) => &t.attrs,
            syn::Item::Type(t) => &t.attrs,
            syn::Item::Macro(m) => &m.attrs,
            _ => &[],
        };
        if is_cfg_test(attrs) {
            return;
        }
        match item {
            syn::Item::Mod(m) => {
                let name = m.ident.to_string();
                match &m.content {
                    Some((_, items)) => {
                        self.inline.push(name);
                        for inner in items {
                            self.visit_item(inner);
                        }
                        self.inline.pop();
                    }
                    // Only file modules of the file itself; one declared inside an inline module
                    // would live in a subfolder, which this project does not do.
                    None if self.inline.is_empty() => {
                        self.children.push((name, path_attr(&m.attrs)));
                    }
                    None => {}
                }
            }
            syn::Item::Use(u) => {
                let mut found = Vec::new();
                use_paths(&u.tree, &mut Vec::new(), &mut found);
                for path in found {
                    self.record(path);
                }
            }
            _ => syn::visit::visit_item(self, item),
        }
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
        if segments.len() > 1 {
            self.record(segments);
        }
        syn::visit::visit_path(self, path);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        // Paths inside a macro's tokens (`format!("{}", crate::x::Y)`) are not parsed; the
        // macro's own path is.
        self.visit_path(&mac.path);
    }
}

/// The module a path written in `here` points into, if it is one of this crate's.
fn resolve(c: &Crate, here: &ModulePath, segments: &[String]) -> Option<ModulePath> {
    let (base, rest): (ModulePath, &[String]) = match segments.first().map(String::as_str) {
        Some("crate") => (Vec::new(), &segments[1..]),
        Some("self") => (here.clone(), &segments[1..]),
        Some("super") => {
            let mut base = here.clone();
            let mut rest = segments;
            while rest.first().is_some_and(|s| s == "super") {
                base.pop();
                rest = &rest[1..];
            }
            (base, rest)
        }
        Some(first) => {
            // Edition 2018 paths: a child module's name, else something outside the crate
            // (a dependency, the prelude, a local item).
            let mut child = deepest_module(c, here);
            child.push(first.to_owned());
            if !c.modules.contains(&child) {
                return None;
            }
            (here.clone(), segments)
        }
        None => return None,
    };
    let mut base = deepest_module(c, &base);
    for segment in rest {
        let mut next = base.clone();
        next.push(segment.clone());
        if c.modules.contains(&next) {
            base = next;
        } else {
            break;
        }
    }
    Some(base)
}

fn find_cycles(krate: &str, c: &Crate) -> Vec<Cycle> {
    // parent -> child -> children of the same parent it names, each with the first place that
    // names it
    let mut edges: BTreeMap<ModulePath, Graph> = BTreeMap::new();
    for (here, segments) in &c.refs {
        let Some(to) = resolve(c, here, segments) else {
            continue;
        };
        let from = deepest_module(c, here);
        let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
        // Into its own ancestor or descendant: a parent and its children are one room.
        if common == from.len() || common == to.len() {
            continue;
        }
        edges
            .entry(from[..common].to_vec())
            .or_default()
            .entry(from[common].clone())
            .or_default()
            .entry(to[common].clone())
            .or_insert_with(|| format!("{} names {}", from.join("::"), segments.join("::")));
    }
    // `XTASK_LAYERS_SHOW=dataplane::ebpf` prints that module's children and whom each names,
    // to read a room's layering (the check itself needs no such list).
    if let Ok(show) = std::env::var("XTASK_LAYERS_SHOW") {
        let wanted: ModulePath = show
            .split("::")
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        if let Some(graph) = edges.get(&wanted) {
            for (from, to) in graph {
                let names: Vec<&str> = to.keys().map(String::as_str).collect();
                println!("{krate} {show}: {from} → {}", names.join(", "));
            }
        }
    }
    let mut found = Vec::new();
    for (parent, graph) in &edges {
        for component in strongly_connected(graph) {
            if component.len() > 1 {
                let mut shown = Vec::new();
                for from in &component {
                    for (to, why) in graph.get(from).into_iter().flatten() {
                        if component.contains(to) {
                            shown.push(format!("{from} → {to}: {why}"));
                        }
                    }
                }
                found.push(Cycle {
                    krate: krate.to_owned(),
                    parent: parent.join("::"),
                    members: component,
                    edges: shown,
                });
            }
        }
    }
    found
}

/// `here` may be inside an inline module that is not a file module: its file module.
fn deepest_module(c: &Crate, here: &ModulePath) -> ModulePath {
    let mut m = here.clone();
    while !m.is_empty() && !c.modules.contains(&m) {
        m.pop();
    }
    m
}

/// Tarjan's strongly connected components, each sorted, in a stable order.
fn strongly_connected(graph: &Graph) -> Vec<Vec<String>> {
    struct State<'g> {
        graph: &'g Graph,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        on_stack: BTreeSet<&'g str>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    fn visit<'g>(s: &mut State<'g>, v: &'g str) {
        s.index.insert(v, s.next);
        s.low.insert(v, s.next);
        s.next += 1;
        s.stack.push(v);
        s.on_stack.insert(v);
        if let Some(targets) = s.graph.get(v) {
            for w in targets.keys() {
                let w = w.as_str();
                if !s.index.contains_key(w) {
                    visit(s, w);
                    let low = s.low[v].min(s.low[w]);
                    s.low.insert(v, low);
                } else if s.on_stack.contains(w) {
                    let low = s.low[v].min(s.index[w]);
                    s.low.insert(v, low);
                }
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.push(w.to_owned());
                if w == v {
                    break;
                }
            }
            component.sort();
            s.out.push(component);
        }
    }
    let mut s = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// The workspace's crates, bottom layer first. A crate's dependencies on workspace crates lie in
/// lower layers only: the model below the kernel clients, the kernel clients below the
/// dataplanes, the dataplanes below the agent. Cargo refuses a cycle between crates; this keeps
/// the order, so that no crate slides down a layer by naming one beside or above it.
pub const CRATE_LAYERS: &[&[&str]] = &[
    &["proxy-common"],
    &["proxy-model", "proxy-ebpf"],
    &["proxy-kernel", "proxy-decode"],
    &["proxy-dataplane-ebpf", "proxy-dataplane-iptables"],
    &["proxy-agent"],
    &["proxy-tests", "xtask"],
];

/// What the model may not depend on, even through a dev-dependency: a kernel client, an async
/// runtime, a network server or client. The model is the part every layer reads and every test
/// can run without root; these would make it neither.
pub const NOT_IN_MODEL: &[&str] = &[
    "aya",
    "aya-log",
    "tokio",
    "nix",
    "libc",
    "socket2",
    "kube",
    "hyper",
    "hyper-util",
    "axum",
    "notify",
    "futures",
];

/// One workspace crate as `cargo metadata` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Package {
    pub name: String,
    /// The crate roots (`src/lib.rs`, `src/main.rs`); other binaries are not separate layers.
    pub roots: Vec<(String, PathBuf)>,
    /// Every dependency: name and whether it is a dev-dependency.
    pub dependencies: Vec<(String, bool)>,
    /// The features this crate turns on in each dependency that it names with some.
    pub features: Vec<(String, Vec<String>)>,
}

/// `cargo xtask test`'s step: fails naming every crate out of its layer and every module cycle
/// with the edges that make it.
pub fn check() -> Result<()> {
    crate::commands::step("layers: crates in their layers, no module cycle in any crate");
    let packages = workspace_packages(&crate::commands::workspace_root())?;
    let mut shown = crate_layer_violations(&packages);
    for package in &packages {
        for (root, file) in &package.roots {
            let name = format!("{} ({root})", package.name);
            shown.extend(cycles(&name, file)?.iter().map(ToString::to_string));
        }
    }
    if !shown.is_empty() {
        anyhow::bail!("layers:\n{}", shown.join("\n"));
    }
    Ok(())
}

/// Each crate that names a workspace crate of its own or a higher layer, that is in no layer,
/// or (the model) that depends on a kernel client or runtime.
pub fn crate_layer_violations(packages: &[Package]) -> Vec<String> {
    let layer_of = |name: &str| CRATE_LAYERS.iter().position(|layer| layer.contains(&name));
    let workspace: BTreeSet<&str> = packages.iter().map(|p| p.name.as_str()).collect();
    let mut found = Vec::new();
    for package in packages {
        let Some(layer) = layer_of(&package.name) else {
            found.push(format!(
                "{}: in no layer of xtask/src/layers.rs CRATE_LAYERS",
                package.name
            ));
            continue;
        };
        if package.name == "proxy-model" {
            // proxy-common's `user` feature implements aya's traits: it would bring aya in.
            for (dependency, features) in &package.features {
                if dependency == "proxy-common" && !features.is_empty() {
                    found.push(format!(
                        "proxy-model turns on proxy-common's {features:?}: the model has no kernel client"
                    ));
                }
            }
        }
        for (dependency, dev) in &package.dependencies {
            if package.name == "proxy-model" && NOT_IN_MODEL.contains(&dependency.as_str()) {
                found.push(format!(
                    "proxy-model depends on {dependency}: the model has no kernel client or runtime"
                ));
            }
            // A dev-dependency may reach sideways or up (a test of a lower crate driving a
            // higher one's API would be one), but not on the model, checked above.
            if *dev || !workspace.contains(dependency.as_str()) {
                continue;
            }
            match layer_of(dependency) {
                Some(below) if below < layer => {}
                _ => found.push(format!(
                    "{} depends on {dependency}, which is not in a lower layer",
                    package.name
                )),
            }
        }
    }
    found
}

/// The workspace's crates from `cargo metadata` (no network, no dependency resolution needed).
pub fn workspace_packages(root: &Path) -> Result<Vec<Package>> {
    let output =
        std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args([
                "metadata",
                "--format-version",
                "1",
                "--no-deps",
                "--offline",
            ])
            .current_dir(root)
            .output()
            .context("running cargo metadata")?;
    if !output.status.success() {
        anyhow::bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let metadata: serde_json::Value =
        serde_json::from_slice(&output.stdout).context("reading cargo metadata")?;
    let mut packages = Vec::new();
    for package in metadata["packages"].as_array().into_iter().flatten() {
        let name = package["name"].as_str().unwrap_or_default().to_owned();
        let mut roots = Vec::new();
        for target in package["targets"].as_array().into_iter().flatten() {
            let path = PathBuf::from(target["src_path"].as_str().unwrap_or_default());
            let file = path
                .file_name()
                .and_then(|f| f.to_str())
                .unwrap_or_default();
            let in_src = path
                .parent()
                .and_then(Path::file_name)
                .is_some_and(|d| d == "src");
            if in_src && (file == "lib.rs" || file == "main.rs") {
                roots.push((format!("src/{file}"), path));
            }
        }
        roots.sort();
        roots.dedup();
        let dependencies = package["dependencies"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|d| {
                (
                    d["name"].as_str().unwrap_or_default().to_owned(),
                    d["kind"].as_str() == Some("dev"),
                )
            })
            .collect();
        let features = package["dependencies"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|d| {
                let features: Vec<String> = d["features"]
                    .as_array()?
                    .iter()
                    .filter_map(|f| f.as_str().map(str::to_owned))
                    .collect();
                (!features.is_empty())
                    .then(|| (d["name"].as_str().unwrap_or_default().to_owned(), features))
            })
            .collect();
        packages.push(Package {
            name,
            roots,
            dependencies,
            features,
        });
    }
    packages.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(packages)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, file: &str, text: &str) {
        let path = dir.join(file);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).expect("test folder");
        }
        std::fs::write(path, text).expect("test file");
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("xtask-layers-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn a_cycle_between_siblings_is_found_at_their_parent() {
        let dir = scratch("cycle");
        write(&dir, "lib.rs", "mod room;\nmod other;\n");
        write(&dir, "room/mod.rs", "mod a;\nmod b;\n");
        write(&dir, "room/a.rs", "use super::b::Thing;\n");
        write(&dir, "room/b.rs", "pub fn f() { crate::room::a::g(); }\n");
        write(&dir, "other.rs", "use crate::room::a;\n");
        let found = cycles("demo", &dir.join("lib.rs")).expect("reads");
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(
            found,
            vec![Cycle {
                krate: "demo".into(),
                parent: "room".into(),
                members: vec!["a".into(), "b".into()],
                edges: vec![
                    "a → b: room::a names super::b::Thing".into(),
                    "b → a: room::b names crate::room::a::g".into(),
                ],
            }]
        );
    }

    #[test]
    fn layers_that_point_one_way_and_test_modules_are_no_cycle() {
        let dir = scratch("layers");
        write(
            &dir,
            "lib.rs",
            "mod model;\nmod plane;\nuse plane::apply;\n",
        );
        write(
            &dir,
            "model.rs",
            "pub struct S;\n#[cfg(test)]\nmod tests { use crate::plane::apply; }\n",
        );
        write(
            &dir,
            "plane.rs",
            "use crate::{model::{self, S}};\npub fn apply() {}\n",
        );
        let found = cycles("demo", &dir.join("lib.rs")).expect("reads");
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(found, Vec::new());
    }

    fn package(name: &str, dependencies: &[(&str, bool)]) -> Package {
        Package {
            name: name.into(),
            roots: Vec::new(),
            features: if name == "proxy-model" {
                vec![("proxy-common".into(), vec!["user".into()])]
            } else {
                Vec::new()
            },
            dependencies: dependencies
                .iter()
                .map(|(d, dev)| ((*d).into(), *dev))
                .collect(),
        }
    }

    #[test]
    fn a_crate_naming_its_own_or_a_higher_layer_or_the_model_a_runtime_is_refused() {
        let packages = [
            package("proxy-common", &[]),
            package("proxy-model", &[("proxy-common", false), ("tokio", true)]),
            package(
                "proxy-kernel",
                &[("proxy-model", false), ("proxy-dataplane-ebpf", false)],
            ),
            package("proxy-dataplane-ebpf", &[("proxy-kernel", false)]),
            package(
                "proxy-dataplane-iptables",
                &[("proxy-dataplane-ebpf", false), ("proxy-agent", true)],
            ),
            package(
                "proxy-agent",
                &[("proxy-dataplane-ebpf", false), ("tokio", false)],
            ),
            package("stray", &[]),
        ];
        assert_eq!(
            crate_layer_violations(&packages),
            vec![
                "proxy-model turns on proxy-common's [\"user\"]: the model has no kernel client"
                    .to_owned(),
                "proxy-model depends on tokio: the model has no kernel client or runtime".into(),
                "proxy-kernel depends on proxy-dataplane-ebpf, which is not in a lower layer".into(),
                "proxy-dataplane-iptables depends on proxy-dataplane-ebpf, which is not in a lower layer".into(),
                "stray: in no layer of xtask/src/layers.rs CRATE_LAYERS".into(),
            ]
        );
    }

    #[test]
    fn the_workspace_crates_are_the_layers_and_the_model_is_pure() {
        let packages = workspace_packages(&crate::commands::workspace_root()).expect("metadata");
        let names: Vec<&str> = packages.iter().map(|p| p.name.as_str()).collect();
        for layer in CRATE_LAYERS {
            for name in *layer {
                assert!(
                    names.contains(name),
                    "{name} is not a workspace crate: {names:?}"
                );
            }
        }
        assert_eq!(crate_layer_violations(&packages), Vec::<String>::new());
    }

    #[test]
    fn the_workspace_has_no_module_cycle() {
        if let Err(e) = check() {
            panic!("{e:#}");
        }
    }
}
