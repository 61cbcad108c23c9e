//! Re-reading the folder incrementally: only the files whose stamp changed (or that a change
//! notification named) are parsed again, and only the objects those files define or defined
//! go to the store. At 30k Services the folder is ~50 MB of YAML that takes seconds to parse;
//! re-parsing all of it for every edit — and for every periodic rescan — made a one-line
//! change cost seconds and kept a core busy.
//!
//! The result is the same as [`super::load_dir`] of the whole folder (same objects, same
//! errors): checked by the tests against it after every step of a sequence of edits.

use std::{
    collections::{BTreeMap, BTreeSet},
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    sync::Arc,
};

use super::{Loaded, Location, ManifestError, Origins, load_file, manifest_files, read_bounded};
use proxy_model::objects::{NodeInfo, ObjectKey, Update};

/// What tells a file changed without reading it. The inode catches atomic replacements
/// (rename over), the change time and length catch in-place writes; a write within the same
/// coarse kernel tick that keeps the length is caught by the change notification instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    fn of(path: &Path) -> Option<Self> {
        let meta = std::fs::metadata(path).ok()?;
        Some(Self {
            ino: meta.ino(),
            len: meta.len(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        })
    }
}

/// What is kept of a file between reads: which objects it defines and where, not the objects
/// themselves (the store has those).
#[derive(Debug)]
struct FileState {
    stamp: Option<Stamp>,
    /// Each object the file defines, at its first definition in the file.
    origins: Origins,
    /// The Service each EndpointSlice of the file belongs to.
    slice_services: BTreeMap<ObjectKey, ObjectKey>,
    /// The file's own problems (syntax, invalid objects, duplicates inside the file).
    errors: Vec<String>,
}

/// One file parsed now.
struct Parsed {
    state: FileState,
    loaded: Loaded,
}

fn parse(path: &Path) -> Option<Parsed> {
    let stamp = Stamp::of(path);
    let mut loaded = Loaded::default();
    let mut origins = Origins::new();
    match read_bounded(path) {
        Ok(bytes) => load_file(path, &bytes, &mut loaded, &mut origins),
        // Renamed away between listing and reading: as if it had not been listed.
        Err(ManifestError::ReadFile { source, .. })
            if source.kind() == std::io::ErrorKind::NotFound =>
        {
            return None;
        }
        Err(error) => loaded.errors.push(error),
    }
    let slice_services = loaded
        .endpoint_slices
        .iter()
        .filter_map(|(key, slice)| {
            proxy_model::objects::slice_service(key, slice).map(|service| (key.clone(), service))
        })
        .collect();
    let errors = loaded.errors.drain(..).map(|e| e.to_string()).collect();
    Some(Parsed {
        state: FileState {
            stamp,
            origins,
            slice_services,
            errors,
        },
        loaded,
    })
}

/// Parses `paths` on up to as many threads as there are cores: files are independent, and a
/// cold start reads them all.
fn parse_all(paths: Vec<PathBuf>) -> BTreeMap<PathBuf, Option<Parsed>> {
    let threads = std::thread::available_parallelism()
        .map_or(1, std::num::NonZeroUsize::get)
        .min(paths.len())
        .max(1);
    if threads == 1 {
        return paths
            .into_iter()
            .map(|p| {
                let parsed = parse(&p);
                (p, parsed)
            })
            .collect();
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let paths = &paths;
    let next = &next;
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(move || {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(path) = paths.get(i) else { break };
                        out.push((path.clone(), parse(path)));
                    }
                    out
                })
            })
            .collect();
        let mut all = BTreeMap::new();
        for worker in workers {
            // A panic inside the YAML library is caught per file by `load_file`; anything
            // else is a bug of ours, and the files are read again on the next pass.
            if let Ok(out) = worker.join() {
                all.extend(out);
            }
        }
        all
    })
}

/// What one read of the folder produced.
#[derive(Debug, Default)]
pub struct Read {
    /// For the store: `Replace*` on the first read, then only what changed.
    pub updates: Vec<Update>,
    /// Every problem in the folder now (not only the new ones).
    pub errors: Vec<String>,
    /// Files parsed in this read.
    pub files_parsed: usize,
}

/// The folder as last read.
#[derive(Debug)]
pub struct FolderReader {
    dir: PathBuf,
    node: ObjectKey,
    files: BTreeMap<PathBuf, FileState>,
    read_once: bool,
    dir_error: Option<String>,
}

type Kind = &'static str;
const SERVICE: Kind = "Service";
const SLICE: Kind = "EndpointSlice";
const NODE: Kind = "Node";

impl FolderReader {
    /// A reader of `dir` that reports the Node named `node_name`.
    pub fn new(dir: PathBuf, node_name: &str) -> Self {
        Self {
            dir,
            node: ObjectKey {
                namespace: "".into(),
                name: node_name.into(),
            },
            files: BTreeMap::new(),
            read_once: false,
            dir_error: None,
        }
    }

    /// Reads what changed since the last call. `named`: files a change notification named,
    /// parsed again whatever their stamp says.
    pub fn read(&mut self, named: &BTreeSet<PathBuf>) -> Read {
        let listed = match manifest_files(&self.dir) {
            Ok(mut files) => {
                self.dir_error = None;
                files.sort();
                files
            }
            Err(source) => {
                // As `load_dir`: an unreadable folder has no objects.
                self.dir_error = Some(
                    ManifestError::ReadDir {
                        path: self.dir.clone(),
                        source,
                    }
                    .to_string(),
                );
                Vec::new()
            }
        };
        let listed_set: BTreeSet<&PathBuf> = listed.iter().collect();
        let removed: Vec<PathBuf> = self
            .files
            .keys()
            .filter(|p| !listed_set.contains(p))
            .cloned()
            .collect();
        let changed: Vec<PathBuf> = listed
            .iter()
            .filter(|p| {
                !self.read_once
                    || named.contains(*p)
                    || self
                        .files
                        .get(*p)
                        .is_none_or(|state| state.stamp != Stamp::of(p))
            })
            .cloned()
            .collect();
        let mut parsed = parse_all(changed);

        // Every object a changed or removed file defines, or defined before.
        let mut affected: BTreeSet<(Kind, ObjectKey)> = BTreeSet::new();
        for path in parsed.keys().chain(&removed) {
            if let Some(old) = self.files.get(path) {
                affected.extend(old.origins.keys().cloned());
            }
        }
        for p in parsed.values().flatten() {
            affected.extend(p.state.origins.keys().cloned());
        }
        // Unchanged files defining an affected object too (duplicates across files) decide
        // which copy wins, so they are read again as well — rare, a mistake in the folder.
        let also: Vec<PathBuf> = self
            .files
            .iter()
            .filter(|(path, state)| {
                !parsed.contains_key(*path)
                    && !removed.contains(*path)
                    && state.origins.keys().any(|k| affected.contains(k))
            })
            .map(|(path, _)| path.clone())
            .collect();
        parsed.extend(parse_all(also));

        for path in &removed {
            self.files.remove(path);
        }
        let files_parsed = parsed.len();
        let mut objects: BTreeMap<PathBuf, Loaded> = BTreeMap::new();
        for (path, p) in parsed {
            match p {
                Some(p) => {
                    self.files.insert(path.clone(), p.state);
                    objects.insert(path, p.loaded);
                }
                None => {
                    self.files.remove(&path);
                }
            }
        }

        let updates = if self.read_once {
            self.changes(&affected, &mut objects)
        } else {
            self.read_once = true;
            self.everything(objects)
        };
        Read {
            updates,
            errors: self.errors(),
            files_parsed,
        }
    }

    /// The first read: the complete sets, the first definition of each object winning.
    fn everything(&self, objects: BTreeMap<PathBuf, Loaded>) -> Vec<Update> {
        let mut services = BTreeMap::new();
        let mut slices = BTreeMap::new();
        let mut node: Option<NodeInfo> = None;
        for (_, loaded) in objects {
            for (key, service) in loaded.services {
                services.entry(key).or_insert(service);
            }
            for (key, slice) in loaded.endpoint_slices {
                slices.entry(key).or_insert(slice);
            }
            for (key, found) in loaded.nodes {
                if key == self.node && node.is_none() {
                    node = Some(found);
                }
            }
        }
        vec![
            Update::ReplaceNode(node),
            Update::ReplaceServices(proxy_model::btree::packed(services)),
            Update::ReplaceEndpointSlices(proxy_model::btree::packed(slices)),
        ]
    }

    /// Later reads: for each affected object, its first definition now (applied) or none
    /// (deleted). Only files parsed in this read can define an affected object.
    fn changes(
        &self,
        affected: &BTreeSet<(Kind, ObjectKey)>,
        objects: &mut BTreeMap<PathBuf, Loaded>,
    ) -> Vec<Update> {
        let mut updates = Vec::new();
        for (kind, key) in affected {
            let origin = (*kind, key.clone());
            let winner = self
                .files
                .iter()
                .find(|(_, state)| state.origins.contains_key(&origin))
                .and_then(|(path, _)| objects.get_mut(path));
            match *kind {
                SERVICE => updates.push(match winner.and_then(|l| l.services.remove(key)) {
                    Some(service) => Update::ServiceApplied(key.clone(), service),
                    None => Update::ServiceDeleted(key.clone()),
                }),
                SLICE => updates.push(match winner.and_then(|l| l.endpoint_slices.remove(key)) {
                    Some(slice) => Update::EndpointSliceApplied(key.clone(), slice),
                    None => Update::EndpointSliceDeleted(key.clone()),
                }),
                NODE if *key == self.node => {
                    updates.push(Update::ReplaceNode(
                        winner.and_then(|l| l.nodes.remove(key)),
                    ));
                }
                _ => {}
            }
        }
        updates
    }

    /// Every problem in the folder: each file's own, then those across files (duplicates,
    /// slices whose Service no file defines), as `load_dir` reports them.
    fn errors(&self) -> Vec<String> {
        let mut errors: Vec<String> = self.dir_error.iter().cloned().collect();
        // Borrowed keys: this runs on every rescan, over every object of the folder.
        let mut first: BTreeMap<(Kind, &ObjectKey), &Location> = BTreeMap::new();
        for state in self.files.values() {
            errors.extend(state.errors.iter().cloned());
            for (origin, at) in &state.origins {
                match first.get(&(origin.0, &origin.1)) {
                    Some(first) => errors.push(
                        ManifestError::Duplicate {
                            at: at.clone(),
                            kind: origin.0,
                            key: origin.1.clone(),
                            first: Arc::clone(&first.path),
                        }
                        .to_string(),
                    ),
                    None => {
                        first.insert((origin.0, &origin.1), at);
                    }
                }
            }
        }
        for (&(kind, key), at) in &first {
            if kind != SLICE {
                continue;
            }
            let Some(service) = self
                .files
                .get(&*at.path)
                .and_then(|state| state.slice_services.get(key))
            else {
                continue;
            };
            if !first.contains_key(&(SERVICE, service)) {
                errors.push(
                    ManifestError::SliceWithoutService {
                        at: (*at).clone(),
                        key: key.clone(),
                        service: service.name.clone(),
                    }
                    .to_string(),
                );
            }
        }
        errors
    }
}
