//! `cargo xtask docs`: the book under `docs/` (mdBook, pinned) and the documentation's link check.
//!
//! The link check reads the Markdown sources — `README.md`, `ARCHITECTURE.md` and `docs/*.md` —
//! rather than the built HTML, so that a broken link is reported where it is written
//! (`file:line`) and so that it runs without mdBook (`cargo xtask test` calls it right after
//! `cargo fmt`). It checks:
//! - every relative link and image names a file or folder that exists;
//! - every `#anchor` names a heading of the target Markdown file (or of the same file), by the
//!   slug rules mdBook and GitHub share ([`slug`]), duplicates numbered `-1`, `-2`, …;
//! - a chapter of the book (a file under `docs/`) links only inside `docs/`, since the built
//!   book has nothing else, and only to Markdown files that are chapters (listed in
//!   `docs/SUMMARY.md`); every `docs/*.md` is a chapter.
//!
//! External links (`http:`, `https:`, `mailto:` …) are listed, never fetched (CI has no network
//! beyond package registries).

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    path::{Component, Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use crate::commands::{run_cmd, step, workspace_root};

/// The mdBook release the book is built with (`cargo install mdbook --locked`).
pub const MDBOOK_VERSION: &str = "0.5.4";
/// The book's folder, relative to the workspace root (its `book.toml` has `src = "."`).
const BOOK_DIR: &str = "docs";
/// Where `book.toml` puts the built book, relative to the workspace root.
const BOOK_OUTPUT: &str = "target/book";
/// The Markdown files outside the book whose links are checked too.
const ROOT_FILES: [&str; 2] = ["README.md", "ARCHITECTURE.md"];

/// `cargo xtask docs`: install mdBook if needed, build the book, check the links.
pub fn run() -> Result<()> {
    install_mdbook()?;
    step(&format!(
        "docs: mdbook build {BOOK_DIR} (into {BOOK_OUTPUT}/)"
    ));
    run_cmd(
        Command::new("mdbook")
            .arg("build")
            .arg(BOOK_DIR)
            .current_dir(workspace_root()),
    )?;
    let index = workspace_root().join(BOOK_OUTPUT).join("index.html");
    if !index.is_file() {
        bail!("mdbook succeeded but {} is missing", index.display());
    }
    check_links()?;
    println!("  book: {}", index.display());
    Ok(())
}

pub fn has_mdbook() -> bool {
    Command::new("mdbook")
        .arg("--version")
        .output()
        .is_ok_and(|out| {
            out.status.success()
                && String::from_utf8_lossy(&out.stdout).trim()
                    == format!("mdbook v{MDBOOK_VERSION}")
        })
}

/// mdBook at the pinned release, when `mdbook --version` is missing or names another one.
pub fn install_mdbook() -> Result<()> {
    if has_mdbook() {
        return Ok(());
    }
    step(&format!(
        "setup: cargo install mdbook {MDBOOK_VERSION} (once; a few minutes)"
    ));
    run_cmd(
        Command::new("cargo")
            .args(["install", "mdbook", "--locked", "--no-default-features"])
            .args(["--version", MDBOOK_VERSION])
            .env_remove("RUSTUP_TOOLCHAIN"),
    )?;
    if !has_mdbook() {
        bail!(
            "mdbook {MDBOOK_VERSION} was installed but `mdbook --version` does not say so; is \
             ~/.cargo/bin on PATH (before any other mdbook)?"
        );
    }
    Ok(())
}

/// The link check over the workspace's documentation; fails with every broken link listed.
pub fn check_links() -> Result<()> {
    step("docs: links and anchors of README.md, ARCHITECTURE.md and docs/*.md");
    let root = workspace_root();
    let docs = Docs::read(&root)?;
    let report = check(&docs, &root);
    for link in &report.external {
        println!("  external (not fetched): {link}");
    }
    println!(
        "  {} files, {} relative links checked, {} external links listed",
        docs.files.len(),
        report.checked,
        report.external.len()
    );
    if !report.broken.is_empty() {
        for broken in &report.broken {
            println!("  {broken}");
        }
        bail!(
            "{} broken link(s) in the documentation",
            report.broken.len()
        );
    }
    Ok(())
}

/// The Markdown files checked, by path relative to the workspace root.
#[derive(Debug)]
struct Docs {
    files: BTreeMap<PathBuf, String>,
}

impl Docs {
    fn read(root: &Path) -> Result<Self> {
        let mut paths: Vec<PathBuf> = ROOT_FILES.iter().map(PathBuf::from).collect();
        let book = root.join(BOOK_DIR);
        for entry in
            std::fs::read_dir(&book).with_context(|| format!("cannot list {}", book.display()))?
        {
            let name = PathBuf::from(entry?.file_name());
            if name.extension().is_some_and(|ext| ext == "md") {
                paths.push(Path::new(BOOK_DIR).join(name));
            }
        }
        let mut files = BTreeMap::new();
        for path in paths {
            let full = root.join(&path);
            let text = std::fs::read_to_string(&full)
                .with_context(|| format!("cannot read {}", full.display()))?;
            files.insert(path, text);
        }
        Ok(Self { files })
    }
}

/// One broken link: where it is written and why it does not work.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Broken {
    file: PathBuf,
    line: usize,
    target: String,
    reason: String,
}

impl fmt::Display for Broken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}: `{}`: {}",
            self.file.display(),
            self.line,
            self.target,
            self.reason
        )
    }
}

#[derive(Debug, Default)]
struct Report {
    checked: usize,
    broken: Vec<Broken>,
    /// `file:line: url`, in file order.
    external: Vec<String>,
}

/// Checks every link of `docs`; files that are not Markdown are looked up under `root`.
fn check(docs: &Docs, root: &Path) -> Report {
    let anchors: BTreeMap<&Path, BTreeSet<String>> = docs
        .files
        .iter()
        .map(|(path, text)| (path.as_path(), anchors(text)))
        .collect();
    let book = Path::new(BOOK_DIR);
    let summary = book.join("SUMMARY.md");
    let chapters: BTreeSet<PathBuf> = docs
        .files
        .get(&summary)
        .map(|text| {
            links(text)
                .into_iter()
                .filter(|link| !is_external(&link.target))
                .filter_map(|link| resolve(book, split(&link.target).0))
                .collect()
        })
        .unwrap_or_default();
    let mut report = Report::default();
    for (file, text) in &docs.files {
        let in_book = file.starts_with(book);
        if in_book && *file != summary && !chapters.contains(file) {
            report.broken.push(Broken {
                file: file.clone(),
                line: 1,
                target: file.display().to_string(),
                reason: "not a chapter: docs/SUMMARY.md does not list it, so the book leaves it \
                         out"
                .to_owned(),
            });
        }
        let dir = file.parent().unwrap_or(Path::new(""));
        for link in links(text) {
            if is_external(&link.target) {
                report
                    .external
                    .push(format!("{}:{}: {}", file.display(), link.line, link.target));
                continue;
            }
            report.checked += 1;
            let mut broken = |reason: String| {
                report.broken.push(Broken {
                    file: file.clone(),
                    line: link.line,
                    target: link.target.clone(),
                    reason,
                });
            };
            let (path, fragment) = split(&link.target);
            let target = if path.is_empty() {
                file.clone()
            } else {
                match resolve(dir, path) {
                    Some(target) => target,
                    None => {
                        broken("leaves the repository".to_owned());
                        continue;
                    }
                }
            };
            let is_markdown = target.extension().is_some_and(|ext| ext == "md");
            if in_book && !target.starts_with(book) {
                broken(format!(
                    "a chapter links out of {BOOK_DIR}/ ({}), which the built book does not \
                     have: write the path as code instead",
                    target.display()
                ));
                continue;
            }
            if in_book && is_markdown && !chapters.contains(&target) {
                broken(format!(
                    "{} is not a chapter of the book (docs/SUMMARY.md)",
                    target.display()
                ));
                continue;
            }
            let known = anchors.get(target.as_path());
            if known.is_none() && !root.join(&target).exists() {
                broken(format!("{} does not exist", target.display()));
                continue;
            }
            // A file that is not Markdown has no anchors to check.
            if let Some(fragment) = fragment
                && let Some(known) = known
                && !known.contains(fragment)
            {
                broken(format!(
                    "no heading of {} has the anchor #{fragment}",
                    target.display()
                ));
            }
        }
    }
    report
}

fn is_external(target: &str) -> bool {
    // A URL scheme: letters, digits, `+-.`, then a colon, before any `/` or `#`.
    target.split_once(':').is_some_and(|(scheme, _)| {
        scheme.len() > 1
            && scheme.starts_with(|c: char| c.is_ascii_alphabetic())
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
    })
}

/// `path#fragment` → (path, fragment).
fn split(target: &str) -> (&str, Option<&str>) {
    match target.split_once('#') {
        Some((path, fragment)) => (path, Some(fragment)),
        None => (target, None),
    }
}

/// `path` relative to `dir`, both relative to the workspace root, without `.`/`..`; `None` when
/// it climbs out of the root.
fn resolve(dir: &Path, path: &str) -> Option<PathBuf> {
    let path = path.replace("%20", " ");
    let mut parts: Vec<Component<'_>> = Vec::new();
    let joined = dir.join(&path);
    for component in joined.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                parts.pop()?;
            }
            Component::Normal(_) => parts.push(component),
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    Some(parts.iter().collect())
}

/// A link as written: its target and the line it is on (1-based).
#[derive(Debug, PartialEq, Eq)]
struct Link {
    target: String,
    line: usize,
}

/// The links and images of a Markdown text: inline `[text](target "title")`, `<url>`
/// autolinks and reference definitions `[label]: target`, outside code spans and fenced code.
fn links(text: &str) -> Vec<Link> {
    let prose = mask_code(text);
    let bytes = prose.as_bytes();
    let line_of = |at: usize| prose[..at].matches('\n').count() + 1;
    // (byte offset, link): sorted by where they are written.
    let mut found: Vec<(usize, Link)> = Vec::new();
    let mut at = 0;
    while let Some(offset) = prose[at..].find("](") {
        let start = at + offset + 2;
        at = start;
        let Some(target) = inline_target(&prose[start..]) else {
            continue;
        };
        found.push((
            start,
            Link {
                target,
                line: line_of(start),
            },
        ));
    }
    let mut line_start = 0;
    for (index, line) in prose.split_inclusive('\n').enumerate() {
        let offset = line_start;
        line_start += line.len();
        // Reference definitions: up to three spaces, `[label]:`, the target.
        let trimmed = line.trim_start_matches(' ');
        if line.len() - trimmed.len() <= 3
            && trimmed.starts_with('[')
            && !trimmed.starts_with("[^")
            && let Some(close) = trimmed.find("]:")
            && !trimmed[1..close].contains(']')
            && let Some(target) = trimmed[close + 2..].split_whitespace().next()
        {
            found.push((
                offset,
                Link {
                    target: target.trim_matches(['<', '>']).to_owned(),
                    line: index + 1,
                },
            ));
        }
    }
    let mut at = 0;
    while let Some(offset) = prose[at..].find('<') {
        let start = at + offset + 1;
        at = start;
        let end = prose[start..]
            .find(|c: char| c == '>' || c.is_whitespace() || c == '<')
            .map_or(prose.len(), |end| start + end);
        if bytes.get(end) == Some(&b'>') && is_external(&prose[start..end]) {
            found.push((
                start,
                Link {
                    target: prose[start..end].to_owned(),
                    line: line_of(start),
                },
            ));
        }
    }
    found.sort_by_key(|(offset, _)| *offset);
    found.into_iter().map(|(_, link)| link).collect()
}

/// The target of an inline link whose `(` was just passed: `<target>` or up to whitespace, with
/// balanced parentheses.
fn inline_target(rest: &str) -> Option<String> {
    let rest = rest.trim_start_matches([' ', '\t']);
    if let Some(inner) = rest.strip_prefix('<') {
        let end = inner.find('>')?;
        return Some(inner[..end].to_owned());
    }
    let mut depth = 0usize;
    for (index, c) in rest.char_indices() {
        match c {
            '(' => depth += 1,
            ')' if depth == 0 => return Some(rest[..index].to_owned()).filter(|t| !t.is_empty()),
            ')' => depth -= 1,
            c if c.is_whitespace() => {
                return Some(rest[..index].to_owned()).filter(|t| !t.is_empty());
            }
            _ => {}
        }
    }
    None
}

/// The text with fenced code blocks and code spans replaced by spaces (newlines kept, so byte
/// offsets and line numbers stay those of the original).
fn mask_code(text: &str) -> String {
    mask_code_spans(&mask_fences(text))
}

/// Code spans: a run of N backticks up to the next run of exactly N; unmatched runs are text.
fn mask_code_spans(text: &str) -> String {
    let bytes = text.as_bytes();
    let run_at = |at: usize| bytes[at..].iter().take_while(|&&b| b == b'`').count();
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    while at < bytes.len() {
        if bytes[at] != b'`' {
            let next = text[at..].find('`').map_or(text.len(), |n| at + n);
            out.push_str(&text[at..next]);
            at = next;
            continue;
        }
        let length = run_at(at);
        let mut search = at + length;
        let mut close = None;
        while let Some(n) = text[search..].find('`') {
            let start = search + n;
            let run = run_at(start);
            if run == length {
                close = Some(start);
                break;
            }
            search = start + run;
        }
        match close {
            Some(close) => {
                out.push_str(&blank(&text[at..close + length]));
                at = close + length;
            }
            None => {
                out.push_str(&text[at..at + length]);
                at += length;
            }
        }
    }
    out
}

/// Spaces for every character but newlines (byte lengths kept for ASCII; other characters
/// become as many spaces as their UTF-8 bytes).
fn blank(text: &str) -> String {
    text.bytes()
        .map(|b| if b == b'\n' { '\n' } else { ' ' })
        .collect()
}

/// The anchors of a Markdown file: one per ATX heading (`#` … `######`) outside fenced code,
/// by [`slug`], repeated slugs numbered `-1`, `-2`, … as mdBook and GitHub number them; a
/// heading's `{#custom-id}` is its anchor instead (mdBook).
fn anchors(text: &str) -> BTreeSet<String> {
    let prose = mask_fences(text);
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut anchors = BTreeSet::new();
    for line in prose.lines() {
        let trimmed = line.trim_start_matches(' ');
        if line.len() - trimmed.len() > 3 {
            continue;
        }
        let level = trimmed.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&level) {
            continue;
        }
        let rest = &trimmed[level..];
        if !(rest.is_empty() || rest.starts_with([' ', '\t'])) {
            continue;
        }
        let title = rest.trim().trim_end_matches('#').trim_end();
        if let Some(open) = title.rfind("{#")
            && title.ends_with('}')
        {
            anchors.insert(title[open + 2..title.len() - 1].to_owned());
            continue;
        }
        let base = slug(title);
        let count = seen.entry(base.clone()).or_default();
        let anchor = if *count == 0 {
            base.clone()
        } else {
            format!("{base}-{count}")
        };
        *count += 1;
        anchors.insert(anchor);
    }
    anchors
}

/// Fenced code blocks replaced by spaces (newlines kept), code spans kept: a heading's code
/// span is part of its text.
fn mask_fences(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut fence: Option<(char, usize)> = None;
    for line in text.split_inclusive('\n') {
        let trimmed = line.trim_start_matches(' ');
        let indent = line.len() - trimmed.len();
        let run = |c: char| trimmed.chars().take_while(|&x| x == c).count();
        match fence {
            Some((c, length)) => {
                if indent <= 3 && run(c) >= length && trimmed[run(c)..].trim().is_empty() {
                    fence = None;
                }
                out.push_str(&blank(line));
            }
            None => match ['`', '~'].into_iter().find(|&c| indent <= 3 && run(c) >= 3) {
                Some(c) => {
                    fence = Some((c, run(c)));
                    out.push_str(&blank(line));
                }
                None => out.push_str(line),
            },
        }
    }
    out
}

/// A heading's anchor, as mdBook (`normalize_id`) and GitHub make it from the heading's text:
/// the text as rendered (code-span backticks, emphasis markers and link targets dropped), then
/// letters and digits lowercased, `-` and `_` kept, whitespace to `-`, everything else dropped.
pub fn slug(heading: &str) -> String {
    rendered_text(heading)
        .chars()
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '-' || c == '_' {
                Some(c.to_lowercase().next().unwrap_or(c))
            } else if c.is_whitespace() {
                Some('-')
            } else {
                None
            }
        })
        .collect()
}

/// A heading's text as rendered: `[text](target)` → `text`, backticks and `*` dropped.
fn rendered_text(heading: &str) -> String {
    let mut out = String::with_capacity(heading.len());
    let mut rest = heading;
    while let Some(open) = rest.find("](") {
        let after = &rest[open + 2..];
        let Some(close) = after.find(')') else { break };
        out.push_str(&rest[..open]);
        rest = &after[close + 1..];
    }
    out.push_str(rest);
    out.chars()
        .filter(|&c| !matches!(c, '`' | '*' | '['))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slugs_follow_mdbook_and_github() {
        for (heading, expected) in [
            ("Supply chain", "supply-chain"),
            (
                "4b. Packet rate on one core: XDP, tc, iptables, routing",
                "4b-packet-rate-on-one-core-xdp-tc-iptables-routing",
            ),
            (
                "7. SNAT under load: new connections per backend",
                "7-snat-under-load-new-connections-per-backend",
            ),
            (
                "2. Request/response over an established connection",
                "2-requestresponse-over-an-established-connection",
            ),
            (
                "`inspect explain`: the decision for one client and destination",
                "inspect-explain-the-decision-for-one-client-and-destination",
            ),
            (
                "Upgrades that change a pinned map's layout",
                "upgrades-that-change-a-pinned-maps-layout",
            ),
            (
                "The image: `cargo xtask image`",
                "the-image-cargo-xtask-image",
            ),
            (
                "`--lb-algorithm random|maglev`",
                "--lb-algorithm-randommaglev",
            ),
            ("snake_case and-dash", "snake_case-and-dash"),
            (
                "A shared client ↔ backend tuple",
                "a-shared-client--backend-tuple",
            ),
            ("**Bold** and [a link](x.md#y)", "bold-and-a-link"),
            ("Security: the threat model", "security-the-threat-model"),
        ] {
            assert_eq!(slug(heading), expected, "{heading}");
        }
    }

    #[test]
    fn repeated_headings_are_numbered_and_code_blocks_have_none() {
        let text = "# Title\n## Tests\n```\n# not a heading\n```\n## Tests\n### Tests {#own}\n";
        let found = anchors(text);
        let expected: BTreeSet<String> = ["title", "tests", "tests-1", "own"]
            .into_iter()
            .map(str::to_owned)
            .collect();
        assert_eq!(found, expected);
    }

    #[test]
    fn links_are_found_outside_code_with_their_lines() {
        let text = "See [a](a.md#x) and `[not](code.md)`.\n\
                    ```sh\n[nor](fenced.md)\n```\n\
                    Wrapped [text\nacross lines](b.md \"title\") and ![img](p.svg),\n\
                    <https://example.org/x> and (parens [p](c.md)).\n\
                    [ref]: d.md#y\n";
        let found: Vec<(String, usize)> = links(text)
            .into_iter()
            .map(|link| (link.target, link.line))
            .collect();
        let expected: Vec<(String, usize)> = [
            ("a.md#x", 1),
            ("b.md", 6),
            ("p.svg", 6),
            ("https://example.org/x", 7),
            ("c.md", 7),
            ("d.md#y", 8),
        ]
        .into_iter()
        .map(|(t, l)| (t.to_owned(), l))
        .collect();
        assert_eq!(found, expected);
    }

    /// A scratch workspace with `files` written, removed when dropped.
    #[derive(Debug)]
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str, files: &[(&str, &str)]) -> (Self, Docs) {
            let root =
                std::env::temp_dir().join(format!("xtask-docs-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            let mut docs = BTreeMap::new();
            for (path, text) in files {
                let full = root.join(path);
                std::fs::create_dir_all(full.parent().unwrap()).unwrap();
                std::fs::write(&full, text).unwrap();
                // As `Docs::read`: the root's files and `docs/*.md`, not deeper.
                let depth = path.matches('/').count();
                if path.ends_with(".md")
                    && (depth == 0 || (path.starts_with("docs/") && depth == 1))
                {
                    docs.insert(PathBuf::from(path), (*text).to_owned());
                }
            }
            (Self(root), Docs { files: docs })
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn a_broken_link_is_reported_with_file_and_line() {
        let (scratch, docs) = Scratch::new(
            "broken",
            &[
                (
                    "README.md",
                    "# Project\n\nRead [the book](docs/intro.md#start), [code](src/lib.rs),\n\
                     [gone](docs/missing.md) and [bad anchor](docs/intro.md#nowhere).\n\
                     Also [here](#project), [there](#elsewhere), <https://example.org>.\n",
                ),
                ("src/lib.rs", "\n"),
                ("docs/SUMMARY.md", "# Summary\n\n- [Intro](intro.md)\n"),
                (
                    "docs/intro.md",
                    "# Intro\n\n## Start\n\nSee [the code](../src/lib.rs) and [the project](../README.md).\n",
                ),
                ("docs/stray.md", "# Stray\n"),
            ],
        );
        let report = check(&docs, &scratch.0);
        let broken: Vec<String> = report.broken.iter().map(ToString::to_string).collect();
        assert_eq!(
            broken,
            [
                "README.md:4: `docs/missing.md`: docs/missing.md does not exist",
                "README.md:4: `docs/intro.md#nowhere`: no heading of docs/intro.md has the anchor #nowhere",
                "README.md:5: `#elsewhere`: no heading of README.md has the anchor #elsewhere",
                "docs/intro.md:5: `../src/lib.rs`: a chapter links out of docs/ (src/lib.rs), which the built book does not have: write the path as code instead",
                "docs/intro.md:5: `../README.md`: a chapter links out of docs/ (README.md), which the built book does not have: write the path as code instead",
                "docs/stray.md:1: `docs/stray.md`: not a chapter: docs/SUMMARY.md does not list it, so the book leaves it out",
            ],
        );
        assert_eq!(report.external, ["README.md:5: https://example.org"]);
        // intro.md#start, src/lib.rs, missing, nowhere, #project, #elsewhere; Intro; two in intro.
        assert_eq!(report.checked, 9);
    }

    #[test]
    fn a_link_to_a_markdown_file_that_is_not_a_chapter_is_reported() {
        let (scratch, docs) = Scratch::new(
            "chapter",
            &[
                ("docs/SUMMARY.md", "- [A](a.md)\n"),
                ("docs/a.md", "# A\n\n[notes](notes/b.md)\n"),
                ("docs/notes/b.md", "# B\n"),
            ],
        );
        let report = check(&docs, &scratch.0);
        let broken: Vec<String> = report.broken.iter().map(ToString::to_string).collect();
        assert_eq!(
            broken,
            [
                "docs/a.md:3: `notes/b.md`: docs/notes/b.md is not a chapter of the book (docs/SUMMARY.md)"
            ]
        );
    }

    #[test]
    fn paths_resolve_lexically_and_never_above_the_root() {
        assert_eq!(
            resolve(Path::new("docs"), "../README.md"),
            Some(PathBuf::from("README.md"))
        );
        assert_eq!(
            resolve(Path::new("docs"), "./a%20b.md"),
            Some(PathBuf::from("docs/a b.md"))
        );
        assert_eq!(resolve(Path::new(""), "../outside.md"), None);
        assert!(is_external("https://example.org"));
        assert!(is_external("mailto:someone@example.org"));
        assert!(!is_external("docs/a.md#b:c"));
        assert!(!is_external("#anchor"));
    }
}
