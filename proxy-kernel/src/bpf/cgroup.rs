//! Finding the cgroup2 hierarchy.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("cannot read /proc/mounts: {0}")]
    ReadMounts(std::io::Error),
    #[error("no cgroup2 filesystem is mounted (see /proc/mounts); pass --cgroup-path")]
    NoCgroup2,
}

/// The first cgroup2 mount point in /proc/mounts. On hybrid layouts it is not /sys/fs/cgroup
/// (e.g. /sys/fs/cgroup/unified), so it must be looked up, never assumed.
pub fn cgroup2_mount() -> Result<PathBuf, CgroupError> {
    let mounts = std::fs::read_to_string("/proc/mounts").map_err(CgroupError::ReadMounts)?;
    find_cgroup2(&mounts).ok_or(CgroupError::NoCgroup2)
}

fn find_cgroup2(mounts: &str) -> Option<PathBuf> {
    mounts.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (_source, target, fstype) = (fields.next()?, fields.next()?, fields.next()?);
        (fstype == "cgroup2").then(|| PathBuf::from(unescape_mount_path(target)))
    })
}

/// /proc/mounts escapes blanks and backslashes in paths as octal (`\040`).
fn unescape_mount_path(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    let mut rest = path;
    while let Some(pos) = rest.find('\\') {
        out.push_str(&rest[..pos]);
        let code = rest
            .get(pos + 1..pos + 4)
            .and_then(|o| u8::from_str_radix(o, 8).ok());
        match code {
            Some(byte) => {
                out.push(char::from(byte));
                rest = &rest[pos + 4..];
            }
            None => {
                out.push('\\');
                rest = &rest[pos + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_hybrid_cgroup2_mount() {
        let mounts = "cgroup /sys/fs/cgroup/cpu cgroup rw 0 0\n\
                      cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n";
        assert_eq!(
            find_cgroup2(mounts),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
    }

    #[test]
    fn unescapes_octal_blanks() {
        let mounts = "cgroup2 /mnt/my\\040cgroup cgroup2 rw 0 0\n";
        assert_eq!(find_cgroup2(mounts), Some(PathBuf::from("/mnt/my cgroup")));
    }

    #[test]
    fn none_without_cgroup2() {
        assert_eq!(find_cgroup2("proc /proc proc rw 0 0\n"), None);
    }
}
