//! The library's stages import only earlier ones (the order the crate's
//! docs give): a module that reached into a later stage would tie the two
//! in a circle. Read from the sources, as a newcomer would read them.
use std::{collections::BTreeSet, fs, path::Path};

/// Earliest first; `error` gathers every area's errors for the run.
const STAGES: [&str; 18] = [
    "units",
    "clock",
    "proc",
    "binary",
    "profile",
    "discover",
    "kernel",
    "stacks",
    "python",
    "collect",
    "symbolize",
    "account",
    "output",
    "offline",
    "serve",
    "error",
    "run",
    "cli",
];

/// The top-level modules `source` names through `crate::` outside its
/// tests.
fn imported(source: &str) -> BTreeSet<String> {
    let code = source.split("#[cfg(test)]").next().unwrap_or(source);
    let mut names = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + "crate::".len()..];
        if let Some(block) = rest.strip_prefix('{') {
            // `use crate::{a::x, b, c::{..}}`: each top-level name.
            let mut depth = 0;
            let mut start = 0;
            for (i, c) in block.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        names.extend(first_name(&block[start..i]));
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        names.extend(first_name(&block[start..i]));
                        start = i + 1;
                    }
                    _ => {}
                }
            }
        } else {
            names.extend(first_name(rest));
        }
    }
    names
}

fn first_name(path: &str) -> Option<String> {
    let name: String = path
        .trim_start()
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    (!name.is_empty()).then_some(name)
}

fn rank(name: &str) -> Option<usize> {
    STAGES.iter().position(|s| *s == name)
}

fn visit(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            visit(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_stage_imports_a_later_one() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    visit(&src, &mut files);
    let mut found = Vec::new();
    for file in files {
        let relative = file.strip_prefix(&src).unwrap();
        let top = relative.iter().next().unwrap().to_string_lossy();
        let top = top.trim_end_matches(".rs");
        let Some(own) = rank(top) else {
            continue;
        };
        let source = fs::read_to_string(&file).unwrap();
        for name in imported(&source) {
            if rank(&name).is_some_and(|r| r > own) {
                found.push(format!("{} imports {name}", relative.display()));
            }
        }
    }
    assert!(found.is_empty(), "{found:#?}");
}

#[test]
fn imports_are_read_from_use_blocks_and_paths() {
    let source = "use crate::{a::x, b, c::{d, e::f}};\nfn g() { crate::h::i(); }\n\
                  #[cfg(test)]\nmod tests { use crate::z; }";
    let names: Vec<String> = imported(source).into_iter().collect();
    assert_eq!(names, ["a", "b", "c", "h"]);
}
