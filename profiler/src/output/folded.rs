//! Folded stacks (`root;caller;leaf COUNT`), as flamegraph.pl and inferno
//! read them.
use std::io::{self, Write};

/// One stack: names leaf first, and its count (bytes).
pub type NamedStack = (Vec<String>, u64);

/// `;` separates frames: replace it inside names (Rust types like `[u8; 8]`).
fn clean(name: &str) -> String {
    name.replace(';', ":").replace('\n', " ")
}

/// Folded lines of `stacks`, root first; empty counts are left out.
pub fn lines(stacks: &[NamedStack]) -> Vec<String> {
    stacks
        .iter()
        .filter(|(names, count)| *count > 0 && !names.is_empty())
        .map(|(names, count)| {
            let path: Vec<String> = names.iter().rev().map(|n| clean(n)).collect();
            format!("{} {count}", path.join(";"))
        })
        .collect()
}

pub fn write<W: Write>(stacks: &[NamedStack], mut out: W) -> io::Result<()> {
    for line in lines(stacks) {
        writeln!(out, "{line}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_first_and_semicolons_replaced() {
        let stacks = vec![
            (
                vec!["alloc_vec<[u8; 8]>".to_owned(), "main".to_owned()],
                4096,
            ),
            (vec!["never".to_owned()], 0),
        ];
        assert_eq!(lines(&stacks), ["main;alloc_vec<[u8: 8]> 4096"]);
    }
}
