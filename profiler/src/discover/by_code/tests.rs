//! jemalloc found by its code in real builds, checked against their symbols.
use std::path::Path;

use super::*;

/// What `find` gives for `path`, each function named by the file's own
/// symbols (all of them, aliases joined by `|`).
fn found_and_named(path: &Path) -> Option<(FoundByCode, Vec<(String, String)>)> {
    let Ok(data) = std::fs::read(path) else {
        eprintln!("skipped: {} is not installed", path.display());
        return None;
    };
    let symbols = FunctionSymbols::parse(&data).unwrap();
    let found = find(&symbols, &data).unwrap();
    let named = found
        .functions
        .iter()
        .map(|(name, _, address)| {
            let mut real: Vec<&str> = symbols
                .names()
                .filter(|n| symbols.function(n).unwrap().address == *address)
                .collect();
            real.sort();
            (name.clone(), real.join("|"))
        })
        .collect();
    Some((found, named))
}

/// Each function found is the one `file`'s symbols name so; `required`
/// are all found. Aliases are joined by `|`; `unnamed` may have no
/// symbol (local ones the file lacks).
fn assert_found_as_named(path: &Path, required: &[&str], unnamed: &[&str]) -> Option<FoundByCode> {
    let (found, named) = found_and_named(path)?;
    for (name, real) in &named {
        let base = name.split('#').next().unwrap();
        let agrees = match base {
            OPERATOR_NEW => real.starts_with("_Znwm"),
            _ if real.is_empty() => unnamed.contains(&base),
            _ => real.split('|').any(|r| r == base),
        };
        assert!(agrees, "{}: {name} is {real:?}: {named:?}", path.display());
    }
    let names: Vec<&str> = named.iter().map(|(n, _)| n.as_str()).collect();
    for expected in required {
        assert!(names.contains(expected), "{expected}: {names:?}");
    }
    Some(found)
}

/// Debian's libjemalloc2 (gcc) exports its entry points; the sized
/// free's second copy, `je_sdallocx_noflags`, is local and unnamed.
#[test]
fn finds_debians_libjemalloc_by_its_code() {
    let path = Path::new("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2");
    let required = [
        "malloc", "free", "sdallocx", "calloc", "realloc", "rallocx", "mallocx",
    ];
    let Some(found) = assert_found_as_named(path, &required, &["sdallocx"]) else {
        return;
    };
    assert_eq!(found.version, "5.3.0");
    assert!(found.functions.iter().any(|f| f.0 == OPERATOR_NEW));
    assert_eq!(found.missing, ["posix_memalign", "aligned_alloc"]);
}

/// rustc's own jemalloc, built by clang (`cmp 4097; jae`, threshold
/// tests the other way round, realloc's resizing inlined, no rallocx
/// or sdallocx kept): the toolchain's binary keeps its symbols.
#[test]
fn finds_a_clang_built_jemalloc_by_its_code() {
    let Ok(output) = std::process::Command::new("rustc")
        .args(["--print", "sysroot"])
        .output()
    else {
        return;
    };
    let sysroot = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    let rustc = Path::new(&sysroot).join("bin/rustc");
    let required = ["malloc", "free", "calloc", "realloc"];
    assert_found_as_named(&rustc, &required, &[]);
}

/// glibc has malloc and free, but not jemalloc's version string.
#[test]
fn glibc_is_not_jemalloc_by_its_code() {
    let path = Path::new("/lib/x86_64-linux-gnu/libc.so.6");
    let Ok(data) = std::fs::read(path) else {
        return;
    };
    let symbols = FunctionSymbols::parse(&data).unwrap();
    assert!(find(&symbols, &data).is_err());
}
