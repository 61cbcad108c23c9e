//! `cargo deny` over both workspaces (this one and the fuzz workspace in `tests/fuzz`) with the
//! committed `deny.toml`: advisories, licences, sources, bans.
//!
//! The advisory database is RustSec's git repository, which CI cannot fetch (it reaches package
//! registries only, and none of them carries the database), and it is upstream's data, which
//! this repository does not copy. So it is read from beside the repository, where the
//! project's shared material lies: `../shared/rustsec-advisory-db.tar.gz`, a `git archive` of
//! the database. It is unpacked where cargo-deny looks for a checkout of `deny.toml`'s
//! `db-urls` and `cargo deny --offline` reads it without fetching; the checkout's
//! `.git/FETCH_HEAD` carries the archive's commit time (`git archive` gives every file that
//! time), so `maximum-db-staleness` measures the age of the data, not of the unpacking. Without
//! the archive the advisories are not checked, and the run says so; licences, sources and bans
//! always are.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::SystemTime,
};

use anyhow::{Context as _, Result, bail};

use crate::commands::{run_cmd, step, workspace_root};

/// The cargo-deny release `cargo xtask setup` installs (`--locked`; builds with Rust 1.95, its
/// MSRV is 1.88).
pub const CARGO_DENY_VERSION: &str = "0.20.2";

/// Where the advisory database's archive is looked for, relative to the workspace root.
const ADVISORY_DB_ARCHIVE: &str = "../shared/rustsec-advisory-db.tar.gz";
/// `deny.toml`'s `db-urls` and `db-path` (relative to the workspace root, where cargo-deny runs).
const ADVISORY_DB_URL: &str = "https://github.com/rustsec/advisory-db";
const ADVISORY_DB_PATH: &str = "target/advisory-dbs";
/// Beyond this age `cargo xtask test` says the snapshot should be refreshed (deny.toml's
/// `maximum-db-staleness`, 365 days, is where it fails).
const ADVISORY_DB_WARN_DAYS: u64 = 90;

/// The workspaces checked: manifest paths relative to the workspace root.
const MANIFESTS: [&str; 2] = ["Cargo.toml", "tests/fuzz/Cargo.toml"];

pub fn has_cargo_deny() -> bool {
    Command::new("cargo")
        .args(["deny", "--version"])
        .output()
        .is_ok_and(|out| {
            out.status.success()
                && String::from_utf8_lossy(&out.stdout).trim()
                    == format!("cargo-deny {CARGO_DENY_VERSION}")
        })
}

/// `cargo deny check advisories bans licenses sources` on both workspaces.
pub fn check() -> Result<()> {
    step("supply chain: cargo deny (advisories, bans, licences, sources)");
    if !has_cargo_deny() {
        bail!(
            "cargo-deny {CARGO_DENY_VERSION} is not installed: run `cargo xtask setup` (or \
             `cargo install cargo-deny --locked --version {CARGO_DENY_VERSION}`)"
        );
    }
    let root = workspace_root();
    let checks: &[&str] = if unpack_advisory_db(&root)? {
        &["advisories", "bans", "licenses", "sources"]
    } else {
        println!(
            "  advisories: NOT CHECKED — no RustSec database at {ADVISORY_DB_ARCHIVE} (CI reaches \
             package registries only, and none carries it; docs/testing.md, \"Supply chain\")"
        );
        &["bans", "licenses", "sources"]
    };
    for manifest in MANIFESTS {
        // `--offline` keeps cargo-deny from fetching the database, and cargo metadata from the
        // network too: the crates must be here already (the fuzz workspace's are not before
        // its first build).
        run_cmd(Command::new("cargo").current_dir(&root).args([
            "fetch",
            "--locked",
            "--manifest-path",
            manifest,
        ]))?;
        println!("  {manifest}");
        run_cmd(
            Command::new("cargo")
                .current_dir(&root)
                .args(["deny", "--offline", "--locked", "--workspace"])
                .args(["--manifest-path", manifest, "--config", "deny.toml"])
                .args(["check", "--show-stats"])
                .args(checks),
        )?;
    }
    Ok(())
}

/// Unpacks the advisory database's archive where cargo-deny expects the checkout of
/// [`ADVISORY_DB_URL`] (again when the archive changed). `false` when there is no archive.
fn unpack_advisory_db(root: &Path) -> Result<bool> {
    let archive = root.join(ADVISORY_DB_ARCHIVE);
    if !archive.is_file() {
        return Ok(false);
    }
    let checkout = root
        .join(ADVISORY_DB_PATH)
        .join(db_dir_name(ADVISORY_DB_URL));
    let marker = checkout.join(".git/FETCH_HEAD");
    // `git archive` writes the commit id into the archive.
    let embedded = Command::new("sh")
        .arg("-c")
        .arg("gzip -dc \"$1\" | git get-tar-commit-id")
        .arg("sh")
        .arg(&archive)
        .output()
        .with_context(|| format!("reading the commit id of {}", archive.display()))?;
    let commit = String::from_utf8_lossy(&embedded.stdout).trim().to_owned();
    if commit.len() != 40 {
        bail!(
            "{} is not a `git archive` of the advisory database (no commit id in it)",
            archive.display()
        );
    }
    let unpacked = fs::read_to_string(&marker).is_ok_and(|text| text.starts_with(&commit));
    if !unpacked {
        if checkout.exists() {
            fs::remove_dir_all(&checkout)
                .with_context(|| format!("emptying {}", checkout.display()))?;
        }
        fs::create_dir_all(checkout.join(".git"))
            .with_context(|| format!("creating {}", checkout.display()))?;
        run_cmd(
            Command::new("tar")
                .arg("-xzf")
                .arg(&archive)
                .arg("-C")
                .arg(&checkout),
        )?;
        // Every file of a `git archive` carries the commit's time.
        let commit_time = fs::metadata(checkout.join("crates"))
            .and_then(|m| m.modified())
            .with_context(|| format!("{} holds no crates/ folder", archive.display()))?;
        // cargo-deny takes the time of the last fetch from FETCH_HEAD's modification time.
        let fetch_head =
            fs::File::create(&marker).with_context(|| format!("creating {}", marker.display()))?;
        use std::io::Write as _;
        writeln!(
            &fetch_head,
            "{commit}\t\tbranch 'main' of {ADVISORY_DB_URL} ({ADVISORY_DB_ARCHIVE})"
        )?;
        fetch_head
            .set_modified(commit_time)
            .with_context(|| format!("dating {}", marker.display()))?;
    }
    let commit_time = fs::metadata(&marker)
        .and_then(|m| m.modified())
        .with_context(|| format!("reading {}", marker.display()))?;
    let age_days = SystemTime::now()
        .duration_since(commit_time)
        .unwrap_or_default()
        .as_secs()
        / 86_400;
    let unix = commit_time
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    println!(
        "  advisory database: RustSec {} of {} ({age_days} days old), {ADVISORY_DB_ARCHIVE}",
        &commit[..12],
        civil_date(unix)
    );
    if age_days > ADVISORY_DB_WARN_DAYS {
        println!(
            "  warning: the advisory database is over {ADVISORY_DB_WARN_DAYS} days old; refresh \
             the archive (docs/testing.md, \"Supply chain\")"
        );
    }
    Ok(true)
}

/// `YYYY-MM-DD` (UTC) of a Unix time (Howard Hinnant's civil-from-days).
fn civil_date(unix: u64) -> String {
    let days = i64::try_from(unix / 86_400).unwrap_or_default() + 719_468;
    let era = days.div_euclid(146_097);
    let day_of_era = days.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let mp = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

/// The directory cargo-deny (0.20) clones a database URL into under `db-path`: the URL's last
/// path segment and its XXH64 (seed `0xca80de71`), as `url_to_db_path` in its
/// `advisories/helpers/db.rs`.
fn db_dir_name(url: &str) -> PathBuf {
    let url = url.to_lowercase();
    let name = url.rsplit('/').next().unwrap_or("empty_");
    PathBuf::from(format!(
        "{name}-{:016x}",
        xxh64(url.as_bytes(), 0xca80_de71)
    ))
}

/// XXH64, the reference algorithm (no dependency for one hash of one URL).
fn xxh64(input: &[u8], seed: u64) -> u64 {
    const P1: u64 = 0x9E37_79B1_85EB_CA87;
    const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
    const P3: u64 = 0x1656_67B1_9E37_79F9;
    const P4: u64 = 0x85EB_CA77_C2B2_AE63;
    const P5: u64 = 0x27D4_EB2F_1656_67C5;
    fn round(acc: u64, lane: u64) -> u64 {
        acc.wrapping_add(lane.wrapping_mul(P2))
            .rotate_left(31)
            .wrapping_mul(P1)
    }
    fn merge(acc: u64, lane: u64) -> u64 {
        (acc ^ round(0, lane)).wrapping_mul(P1).wrapping_add(P4)
    }
    let u64_at = |bytes: &[u8]| u64::from_le_bytes(bytes[..8].try_into().unwrap_or_default());
    let mut rest = input;
    let mut hash = if input.len() >= 32 {
        let mut lanes = [
            seed.wrapping_add(P1).wrapping_add(P2),
            seed.wrapping_add(P2),
            seed,
            seed.wrapping_sub(P1),
        ];
        while rest.len() >= 32 {
            for (i, lane) in lanes.iter_mut().enumerate() {
                *lane = round(*lane, u64_at(&rest[i * 8..]));
            }
            rest = &rest[32..];
        }
        let mut hash = lanes[0]
            .rotate_left(1)
            .wrapping_add(lanes[1].rotate_left(7))
            .wrapping_add(lanes[2].rotate_left(12))
            .wrapping_add(lanes[3].rotate_left(18));
        for lane in lanes {
            hash = merge(hash, lane);
        }
        hash
    } else {
        seed.wrapping_add(P5)
    };
    hash = hash.wrapping_add(input.len() as u64);
    while rest.len() >= 8 {
        hash ^= round(0, u64_at(rest));
        hash = hash.rotate_left(27).wrapping_mul(P1).wrapping_add(P4);
        rest = &rest[8..];
    }
    if rest.len() >= 4 {
        let word = u32::from_le_bytes(rest[..4].try_into().unwrap_or_default());
        hash ^= u64::from(word).wrapping_mul(P1);
        hash = hash.rotate_left(23).wrapping_mul(P2).wrapping_add(P3);
        rest = &rest[4..];
    }
    for &byte in rest {
        hash ^= u64::from(byte).wrapping_mul(P5);
        hash = hash.rotate_left(11).wrapping_mul(P1);
    }
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(P2);
    hash ^= hash >> 29;
    hash = hash.wrapping_mul(P3);
    hash ^ (hash >> 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xxh64_reference_vectors() {
        // From the xxHash reference implementation's sanity checks and its documentation.
        assert_eq!(xxh64(b"", 0), 0xEF46_DB37_51D8_E999);
        assert_eq!(xxh64(b"a", 0), 0xD24E_C4F1_A98C_6E5B);
        assert_eq!(xxh64(b"abc", 0), 0x44BC_2CF5_AD77_0999);
    }

    #[test]
    fn civil_dates() {
        assert_eq!(civil_date(0), "1970-01-01");
        assert_eq!(civil_date(951_782_400), "2000-02-29");
    }

    #[test]
    fn the_database_directory_is_named_as_cargo_deny_names_it() {
        let name = db_dir_name(ADVISORY_DB_URL);
        let name = name.to_string_lossy();
        assert!(name.starts_with("advisory-db-"), "{name}");
        assert_eq!(name.len(), "advisory-db-".len() + 16);
    }

    /// deny.toml names the same database and directory as this file.
    #[test]
    fn deny_toml_agrees() {
        let text = fs::read_to_string(workspace_root().join("deny.toml")).unwrap_or_default();
        assert!(text.contains(&format!("db-path = \"{ADVISORY_DB_PATH}\"")));
        assert!(text.contains(&format!("db-urls = [\"{ADVISORY_DB_URL}\"]")));
    }
}
