//! Relative links and `#anchors` in the workspace's Markdown resolve.
//!
//! Covers `README.md`, `CONTRIBUTING.md`, `docs/*.md` and
//! `docs/benchmarks/history/*.md`. A link to another file must name one that
//! exists; a link with an anchor must name a heading of its target (GitHub's
//! slugs: lower case, punctuation dropped, spaces to `-`, `-1`, `-2` for
//! repeats) or an `<a id>`. Links with a scheme (`https:`) are not followed.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask sits in the workspace root")
        .to_path_buf()
}

fn markdown_files() -> Vec<PathBuf> {
    let root = root();
    let mut files = vec![root.join("README.md"), root.join("CONTRIBUTING.md")];
    for dir in ["docs", "docs/benchmarks/history"] {
        let mut found: Vec<PathBuf> = fs::read_dir(root.join(dir))
            .expect("read a docs directory")
            .map(|entry| entry.expect("read a directory entry").path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
            .collect();
        found.sort();
        files.extend(found);
    }
    files
}

/// The lines of `text` outside fenced code blocks, numbered from 1.
fn lines_outside_fences(text: &str) -> Vec<(usize, &str)> {
    let mut in_fence = false;
    let mut lines = Vec::new();
    for (index, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
        } else if !in_fence {
            lines.push((index + 1, line));
        }
    }
    lines
}

/// The lines of `text` outside fenced code blocks, with inline code removed.
fn prose_lines(text: &str) -> Vec<(usize, String)> {
    lines_outside_fences(text)
        .into_iter()
        .map(|(number, line)| (number, line.split('`').step_by(2).collect()))
        .collect()
}

/// The anchors a Markdown file offers: its headings' slugs and `<a id>`s.
fn anchors(text: &str) -> HashSet<String> {
    let mut seen: HashSet<String> = HashSet::new();
    for (_, line) in lines_outside_fences(text) {
        let line = line.replace('`', "");
        for marker in ["<a id=\"", "<a name=\""] {
            if let Some(start) = line.find(marker) {
                let rest = &line[start + marker.len()..];
                if let Some(end) = rest.find('"') {
                    seen.insert(rest[..end].to_owned());
                }
            }
        }
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let heading = without_link_targets(line[hashes..].trim());
        let slug: String = heading
            .to_lowercase()
            .chars()
            .filter(|&c| c.is_alphanumeric() || c == '-' || c == '_' || c == ' ')
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let mut candidate = slug.clone();
        let mut repeat = 0;
        while !seen.insert(candidate.clone()) {
            repeat += 1;
            candidate = format!("{slug}-{repeat}");
        }
    }
    seen
}

/// `[text](target)` reduced to `text`.
fn without_link_targets(line: &str) -> String {
    let mut out = String::new();
    let mut rest = line;
    while let Some(start) = rest.find("](") {
        out.push_str(&rest[..start]);
        match rest[start..].find(')') {
            Some(end) => rest = &rest[start + end + 1..],
            None => return out,
        }
    }
    out.push_str(rest);
    out.replace('[', "")
}

/// The link targets on one line of prose.
fn link_targets(line: &str) -> Vec<&str> {
    line.match_indices("](")
        .filter_map(|(at, _)| {
            let rest = &line[at + 2..];
            let end = rest.find([')', ' '])?;
            Some(&rest[..end])
        })
        .collect()
}

/// Every relative link in the docs names a file that exists and, with an
/// anchor, a heading of that file.
#[test]
fn relative_links_and_anchors_in_the_docs_resolve() {
    let mut broken = Vec::new();
    for file in markdown_files() {
        let text = fs::read_to_string(&file).expect("read a Markdown file");
        for (line_no, line) in prose_lines(&text) {
            for target in link_targets(&line) {
                if target.contains(':') {
                    continue;
                }
                let (path, anchor) = target.split_once('#').unwrap_or((target, ""));
                let dest = if path.is_empty() {
                    file.clone()
                } else {
                    file.parent().expect("a file has a directory").join(path)
                };
                let shown = format!("{}:{line_no}: {target}", file.display());
                if !dest.exists() {
                    broken.push(format!("{shown} (no such file)"));
                } else if !anchor.is_empty() && dest.extension().is_some_and(|ext| ext == "md") {
                    let dest_text = fs::read_to_string(&dest).expect("read a link's target");
                    if !anchors(&dest_text).contains(anchor) {
                        broken.push(format!("{shown} (no such anchor)"));
                    }
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// Headings give GitHub's slugs, repeats numbered, and a `#` line inside a
/// fenced block is no heading.
#[test]
fn slugs_follow_githubs_rules() {
    let text = "# The trust domain, lane by lane\n## Open files (`RLIMIT_NOFILE`)\n\
                ## Open files (`RLIMIT_NOFILE`)\n```\n# not a heading\n```\n";
    let found = anchors(text);
    for slug in [
        "the-trust-domain-lane-by-lane",
        "open-files-rlimit_nofile",
        "open-files-rlimit_nofile-1",
    ] {
        assert!(found.contains(slug), "{slug} missing from {found:?}");
    }
    assert!(!found.contains("not-a-heading"));
}

/// An anchor no heading gives is not offered.
#[test]
fn an_anchor_no_heading_gives_is_missing() {
    let found = anchors("# Which UCX\n");
    assert!(found.contains("which-ucx"));
    assert!(!found.contains("which-ucx-version"));
}

/// A link's target is what lies between `](` and the closing parenthesis.
#[test]
fn link_targets_end_at_the_closing_parenthesis() {
    assert_eq!(
        link_targets("see [a](b.md#c) and [d](#e)"),
        ["b.md#c", "#e"]
    );
}
