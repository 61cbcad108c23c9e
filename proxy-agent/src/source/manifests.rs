//! Standalone source: the Service, EndpointSlice and Node objects of a manifests folder
//! (`proxy_decode::manifests`), re-read whenever the folder changes.

use std::{collections::BTreeSet, path::PathBuf, sync::Arc, time::Duration};

use notify::{RecursiveMode, Watcher as _};
use tokio::sync::{Notify, mpsc};
use tracing::{debug, info, warn};

use proxy_decode::manifests::FolderReader;
use proxy_model::objects::Update;

/// How often the folder is re-read even without a change notification, as a safety net for
/// filesystems where inotify misses events.
const RESCAN_INTERVAL: Duration = Duration::from_secs(10);

/// Watches `dir` and sends its objects to the store: the complete sets of Services and
/// EndpointSlices (and the Node named `node_name`, if a manifest defines it) on the first read,
/// then, whenever files change, the objects those files define or defined ([`FolderReader`]).
/// Errors are logged (the whole list again whenever it changes) and never stop the watch.
pub async fn run(dir: PathBuf, node_name: String, tx: mpsc::Sender<Update>) -> anyhow::Result<()> {
    let changed = Arc::new(Notify::new());
    let named: Arc<std::sync::Mutex<BTreeSet<PathBuf>>> = Arc::default();
    let notifier = Arc::clone(&changed);
    let notified_paths = Arc::clone(&named);
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        // Reading the files ourselves raises access events: only changes count.
        let Ok(event) = event else { return };
        if event.kind.is_access() {
            return;
        }
        notified_paths
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend(event.paths);
        notifier.notify_one();
    })?;
    watcher.watch(&dir, RecursiveMode::NonRecursive)?;
    info!(dir = %dir.display(), "watching manifests folder");

    let mut folder = FolderReader::new(dir, &node_name);
    let mut last_errors: Vec<String> = Vec::new();
    let mut first_read = true;
    loop {
        let started = std::time::Instant::now();
        let paths = std::mem::take(
            &mut *named
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        let read;
        (folder, read) = tokio::task::spawn_blocking(move || {
            let read = folder.read(&paths);
            (folder, read)
        })
        .await?;
        if read.errors != last_errors {
            for error in &read.errors {
                warn!("manifests: {error}");
            }
            last_errors = read.errors;
        }
        if first_read {
            // What a cold start waits for (with the programs' load, which it overlaps).
            info!(
                files_parsed = read.files_parsed,
                elapsed_ms = started.elapsed().as_millis() as u64,
                "manifests read"
            );
            first_read = false;
        } else {
            debug!(
                files_parsed = read.files_parsed,
                updates = read.updates.len(),
                "manifests read"
            );
        }
        for update in read.updates {
            if tx.send(update).await.is_err() {
                return Ok(()); // the agent is shutting down
            }
        }
        tokio::select! {
            () = changed.notified() => {
                // Editors and `cp` write in several steps; let them finish before re-reading.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            () = tokio::time::sleep(RESCAN_INTERVAL) => {}
        }
    }
}
