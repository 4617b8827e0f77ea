//! The tree's shape, checked: no module circles in the agent, storage and
//! transport crates (a module names another with `crate::`, `super::` from
//! a submodule, or a name the crate root re-exports), and function lengths
//! in the migration path. Each check is a ratchet: what exists today is
//! listed here exactly, so a new circle or a new long function fails, and
//! so does one that is gone but still listed (the list only shrinks).
//! Reads the sources; needs nothing else.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module circles that remain, as sets of top-level modules of a crate
/// (none: a new one is refused).
const KNOWN_CIRCLES: &[(&str, &[&str])] = &[];

/// Functions of the migration path longer than [`MAX_LINES`] that remain.
const KNOWN_LONG: &[&str] = &[];

const MAX_LINES: usize = 150;

fn src(krate: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(krate)
        .join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// A file's text up to its `#[cfg(test)]` tail.
fn without_tests(text: &str) -> &str {
    match text.find("#[cfg(test)]") {
        Some(i) => &text[..i],
        None => text,
    }
}

/// A file's code without comments and without its `#[cfg(test)]` tail.
fn code(p: &Path) -> String {
    let text = std::fs::read_to_string(p).unwrap();
    without_tests(&text)
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The top-level module a file belongs to (`migration/settle.rs`: `migration`).
fn top(root: &Path, p: &Path) -> String {
    let rel = p.strip_prefix(root).unwrap();
    let first = rel
        .components()
        .next()
        .unwrap()
        .as_os_str()
        .to_string_lossy();
    first.trim_end_matches(".rs").to_string()
}

/// Top-level module → the top-level modules its code names (`crate::x`,
/// `use crate::{x, y}`, and `super::x` from a submodule).
fn graph(krate: &str) -> BTreeMap<String, BTreeSet<String>> {
    let root = src(krate);
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    let tops: BTreeSet<String> = files.iter().map(|f| top(&root, f)).collect();
    // names the crate root re-exports (`pub use host::Agent;`): `crate::Agent` is `host`
    let mut exported: BTreeMap<String, String> = BTreeMap::new();
    for l in code(&root.join("lib.rs")).lines() {
        let Some(rest) = l.trim().strip_prefix("pub use ") else {
            continue;
        };
        let Some((module, names)) = rest.split_once("::") else {
            continue;
        };
        let names = names
            .trim_end_matches(';')
            .trim_matches(|c| c == '{' || c == '}');
        for n in names.split(',') {
            let n = n.trim();
            let name = n.rsplit(" as ").next().unwrap_or(n).trim();
            exported.insert(ident(name), module.to_string());
        }
    }
    let module_of = |n: String| exported.get(&n).cloned().unwrap_or(n);
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let me = top(&root, f);
        let text = code(f);
        let mut named = BTreeSet::new();
        for (i, _) in text.match_indices("crate::") {
            let rest = &text[i + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                // `use crate::{a::X, b}`
                let end = group.find('}').unwrap_or(group.len());
                for item in group[..end].split(',') {
                    named.insert(ident(item.trim()));
                }
            } else {
                named.insert(ident(rest));
            }
        }
        let nested = f.strip_prefix(&root).unwrap().components().count() > 1;
        if nested {
            for (i, _) in text.match_indices("super::") {
                named.insert(ident(&text[i + "super::".len()..]));
            }
        }
        let e = g.entry(me.clone()).or_default();
        for n in named.into_iter().map(module_of) {
            if n != me && tops.contains(&n) && n != "lib" && n != "main" {
                e.insert(n);
            }
        }
    }
    g
}

fn ident(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

/// Strongly connected components with more than one module.
fn circles(g: &BTreeMap<String, BTreeSet<String>>) -> BTreeSet<BTreeSet<String>> {
    let reach = |from: &str| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_string()];
        while let Some(n) = todo.pop() {
            for m in g.get(&n).into_iter().flatten() {
                if seen.insert(m.clone()) {
                    todo.push(m.clone());
                }
            }
        }
        seen
    };
    let all: BTreeMap<&String, BTreeSet<String>> = g.keys().map(|k| (k, reach(k))).collect();
    let mut out = BTreeSet::new();
    for (a, ra) in &all {
        let comp: BTreeSet<String> = ra
            .iter()
            .filter(|b| all.get(b).is_some_and(|rb| rb.contains(*a)))
            .cloned()
            .chain(std::iter::once((*a).clone()))
            .collect();
        if comp.len() > 1 {
            out.insert(comp);
        }
    }
    out
}

#[test]
fn module_circles_are_only_the_known_ones() {
    for krate in ["agent", "storage", "transport", "net", "api"] {
        let found = circles(&graph(krate));
        let known: BTreeSet<BTreeSet<String>> = KNOWN_CIRCLES
            .iter()
            .filter(|(k, _)| *k == krate)
            .map(|(_, m)| m.iter().map(|s| s.to_string()).collect())
            .collect();
        assert_eq!(
            found, known,
            "crates/{krate}: module circles (left: found, right: known; a new circle is \
             refused, a broken one leaves the list)"
        );
    }
}

#[test]
fn the_circle_finder_finds_a_circle() {
    let g: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b"]),
        ("b", vec!["c"]),
        ("c", vec!["a"]),
        ("d", vec!["a"]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.into_iter().map(String::from).collect()))
    .collect();
    let c = circles(&g);
    assert_eq!(c.len(), 1);
    assert_eq!(
        c.into_iter().next().unwrap(),
        ["a", "b", "c"].map(String::from).into_iter().collect()
    );
}

/// Functions of `dir`'s files longer than `max` lines: `file::name`.
fn long_functions(root: &Path, max: usize) -> BTreeSet<String> {
    let mut files = Vec::new();
    rust_files(root, &mut files);
    let mut out = BTreeSet::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let lines: Vec<&str> = without_tests(&text).lines().collect();
        for (i, l) in lines.iter().enumerate() {
            let t = l.trim_start();
            let indent = &l[..l.len() - t.len()];
            let Some(at) = t.find("fn ") else { continue };
            let head = &t[..at];
            if !head
                .split_whitespace()
                .all(|w| matches!(w, "pub" | "pub(crate)" | "pub(super)" | "async" | "const"))
            {
                continue;
            }
            let name = ident(&t[at + 3..]);
            let close = format!("{indent}}}");
            let Some(len) = lines[i + 1..].iter().position(|x| *x == close) else {
                continue;
            };
            if len + 2 > max {
                let rel = f.strip_prefix(root).unwrap().to_string_lossy().into_owned();
                out.insert(format!("{rel}::{name}"));
            }
        }
    }
    out
}

#[test]
fn no_new_long_function_in_the_migration_path() {
    let root = src("agent");
    let found: BTreeSet<String> = long_functions(&root, MAX_LINES)
        .into_iter()
        .filter(|f| f.starts_with("migration/") || f.starts_with("commit.rs"))
        .collect();
    let known: BTreeSet<String> = KNOWN_LONG.iter().map(|s| s.to_string()).collect();
    assert_eq!(
        found, known,
        "functions over {MAX_LINES} lines in the migration path (left: found, right: known)"
    );
}

/// The `rust-version` a manifest declares.
fn rust_version(manifest: &Path) -> String {
    let text = std::fs::read_to_string(manifest).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("rust-version = \""))
        .and_then(|v| v.strip_suffix('"'))
        .unwrap_or_else(|| panic!("{} declares no rust-version", manifest.display()))
        .to_string()
}

#[test]
fn one_minimum_rust_version_everywhere() {
    let top = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let v = rust_version(&top.join("Cargo.toml"));
    assert_eq!(
        rust_version(&top.join("fuzz/Cargo.toml")),
        v,
        "fuzz/Cargo.toml"
    );
    let readme = std::fs::read_to_string(top.join("README.md")).unwrap();
    assert!(
        readme.contains(&format!("cargo ≥ {v}")),
        "README.md does not ask for cargo ≥ {v}"
    );
    let run = std::fs::read_to_string(top.join("scripts/run")).unwrap();
    assert!(
        run.contains(&format!("Rust >= {v}")),
        "scripts/run does not ask for Rust >= {v}"
    );
    // no locked dependency needs a newer one (read from cargo's sources
    // where they are unpacked, as after any build)
    let lock = std::fs::read_to_string(top.join("Cargo.lock")).unwrap();
    let want: Vec<u32> = v.split('.').map(|x| x.parse().unwrap()).collect();
    let home = std::env::var("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(std::env::var("HOME").unwrap()).join(".cargo"));
    let registries: Vec<PathBuf> = std::fs::read_dir(home.join("registry/src"))
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    let mut checked = 0;
    for block in lock.split("[[package]]") {
        let field = |k: &str| {
            block
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{k} = \"")))
                .and_then(|x| x.strip_suffix('"'))
        };
        let (Some(name), Some(version), Some(_)) =
            (field("name"), field("version"), field("source"))
        else {
            continue;
        };
        for r in &registries {
            let m = r.join(format!("{name}-{version}/Cargo.toml"));
            let Ok(text) = std::fs::read_to_string(&m) else {
                continue;
            };
            checked += 1;
            if let Some(dep) = text
                .lines()
                .find_map(|l| l.strip_prefix("rust-version = \""))
                .and_then(|x| x.strip_suffix('"'))
            {
                let d: Vec<u32> = dep
                    .split('.')
                    .take(2)
                    .map(|x| x.parse().unwrap_or(0))
                    .collect();
                assert!(
                    d[..] <= want[..2],
                    "{name} {version} needs Rust {dep}, above the declared {v}"
                );
            }
            break;
        }
    }
    assert!(checked > 100, "only {checked} locked crates found unpacked");
}

#[test]
fn the_types_crate_carries_no_http_or_tls_stack() {
    let top = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let deps = |krate: &str| -> Vec<String> {
        let text = std::fs::read_to_string(top.join(krate).join("Cargo.toml")).unwrap();
        let section = text.split("[dependencies]").nth(1).unwrap_or("");
        let section = section.split("\n[").next().unwrap_or("");
        section
            .lines()
            .filter_map(|l| l.split(['=', '.']).next())
            .map(|n| n.trim().to_string())
            .filter(|n| !n.is_empty() && !n.starts_with('#'))
            .collect()
    };
    let stack = [
        "axum",
        "reqwest",
        "hyper",
        "hyper-util",
        "rustls",
        "tokio-rustls",
        "rcgen",
        "x509-parser",
        "tower",
    ];
    for krate in ["crates/api", "crates/transport"] {
        let d = deps(krate);
        assert!(!d.is_empty(), "{krate}: no dependencies read");
        for s in stack {
            assert!(!d.iter().any(|x| x == s), "{krate} depends on {s}");
        }
    }
    // the stack is ferry-net's
    assert!(deps("crates/net").iter().any(|x| x == "axum"));
}

/// The agent is split into rooms with one job each: the VM registry
/// (`vms.rs`), host facts (`facts.rs` below everything, the measured ones in
/// `Agent::facts`), migrations (`migration/`, their state in `Agent::moves`),
/// storage resilience (`resilience.rs`, `vm_disks.rs`), bandwidth classes
/// (`classes.rs`, `bandwidth.rs`) and peers' NIC pairs (`peers.rs`). `host.rs`
/// keeps the `Agent` itself and a few host-wide methods.
#[test]
fn the_agent_is_split_into_rooms() {
    let root = src("agent");
    let host = std::fs::read_to_string(root.join("host.rs")).unwrap();
    let host = without_tests(&host);
    let methods = impl_agent_methods(host);
    assert!(
        methods.len() <= 6,
        "host.rs holds {} Agent methods ({methods:?}); each belongs in its room",
        methods.len()
    );
    for field in ["pub moves: Migrations", "pub facts: Facts"] {
        assert!(host.contains(field), "Agent lacks its room field `{field}`");
    }
    for room in [
        "vms.rs",
        "peers.rs",
        "vm_disks.rs",
        "bandwidth.rs",
        "resilience.rs",
        "migration/mod.rs",
        "migration/source.rs",
    ] {
        let text = std::fs::read_to_string(root.join(room)).unwrap();
        assert!(
            !impl_agent_methods(without_tests(&text)).is_empty()
                || text.contains("impl<'a> Move<'a>"),
            "room {room} has no methods"
        );
    }
}

/// The names of the methods in `text`'s `impl Agent` blocks.
fn impl_agent_methods(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut inside = false;
    for l in text.lines() {
        if l.starts_with("impl Agent {") {
            inside = true;
        } else if l == "}" {
            inside = false;
        } else if inside {
            let t = l.trim_start();
            if l.len() - t.len() != 4 {
                continue;
            }
            if let Some(at) = t.find("fn ") {
                let head = &t[..at];
                if head
                    .split_whitespace()
                    .all(|w| matches!(w, "pub" | "pub(crate)" | "pub(super)" | "async"))
                {
                    out.push(ident(&t[at + 3..]));
                }
            }
        }
    }
    out
}
