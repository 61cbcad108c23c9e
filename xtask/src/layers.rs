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

/// `cargo xtask test`'s step: fails naming every cycle and the edges that make it.
pub fn check() -> Result<()> {
    crate::commands::step("layers: no module cycle in any crate");
    let mut shown = Vec::new();
    for (name, file) in workspace_crates(&crate::commands::workspace_root()) {
        shown.extend(cycles(&name, &file)?.iter().map(ToString::to_string));
    }
    if !shown.is_empty() {
        anyhow::bail!("module cycles:\n{}", shown.join("\n"));
    }
    Ok(())
}

/// The workspace's crates: name and root source file.
pub fn workspace_crates(root: &Path) -> Vec<(String, PathBuf)> {
    let mut crates = Vec::new();
    for (name, dir) in [
        ("proxy-common", "proxy-common"),
        ("proxy-ebpf", "proxy-ebpf"),
        ("proxy-agent", "proxy-agent"),
        ("xtask", "xtask"),
        ("proxy-tests", "tests"),
    ] {
        for file in ["src/lib.rs", "src/main.rs"] {
            let path = root.join(dir).join(file);
            if path.is_file() {
                crates.push((format!("{name} ({file})"), path));
            }
        }
    }
    crates
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

    #[test]
    fn the_workspace_has_no_module_cycle() {
        if let Err(e) = check() {
            panic!("{e:#}");
        }
    }
}
