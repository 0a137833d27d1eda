//! Flame graphs of bytes (inferno): plain, and differential against a base.
use std::io::{self, BufReader, Write};

use inferno::{
    differential,
    flamegraph::{self, Options, Palette, color::BasicPalette},
};

fn options(title: &str) -> Options<'static> {
    let mut options = Options::default();
    options.colors = Palette::Basic(BasicPalette::Mem);
    options.count_name = "bytes".to_owned();
    options.title = title.to_owned();
    options
}

fn to_io(error: impl std::fmt::Display) -> io::Error {
    io::Error::other(error.to_string())
}

/// An SVG that says there is nothing to draw (inferno refuses no stacks).
fn write_empty<W: Write>(title: &str, mut out: W) -> io::Result<()> {
    let title = title.replace('&', "&amp;").replace('<', "&lt;");
    write!(
        out,
        "<?xml version=\"1.0\" standalone=\"no\"?>\n\
         <svg version=\"1.1\" width=\"1200\" height=\"60\" xmlns=\"http://www.w3.org/2000/svg\">\n\
         <text x=\"600\" y=\"24\" text-anchor=\"middle\">{title}</text>\n\
         <text x=\"600\" y=\"48\" text-anchor=\"middle\">no sampled bytes</text>\n</svg>\n"
    )
}

/// An SVG flame graph of folded lines (`root;...;leaf BYTES`).
pub fn write<W: Write>(folded: &[String], title: &str, out: W) -> io::Result<()> {
    if folded.is_empty() {
        return write_empty(title, out);
    }
    let mut options = options(title);
    flamegraph::from_lines(&mut options, folded.iter().map(String::as_str), out).map_err(to_io)
}

/// A differential flame graph: widths from `after`, red where a stack grew
/// since `before`, blue where it shrank.
pub fn write_differential<W: Write>(
    before: &[String],
    after: &[String],
    title: &str,
    out: W,
) -> io::Result<()> {
    if after.is_empty() {
        return write_empty(title, out);
    }
    let joined = |lines: &[String]| lines.join("\n").into_bytes();
    let (before, after) = (joined(before), joined(after));
    let mut diffed = Vec::new();
    differential::from_readers(
        differential::Options::default(),
        BufReader::new(&before[..]),
        BufReader::new(&after[..]),
        &mut diffed,
    )?;
    let text = String::from_utf8_lossy(&diffed);
    let mut options = options(title);
    flamegraph::from_lines(&mut options, text.lines(), out).map_err(to_io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_sampled_is_still_an_svg() {
        let mut svg = Vec::new();
        write(&[], "in use", &mut svg).unwrap();
        let svg = String::from_utf8(svg).unwrap();
        assert!(svg.contains("<svg") && svg.contains("no sampled bytes"));
    }

    #[test]
    fn svg_names_the_frames() {
        let mut svg = Vec::new();
        write(&["main;keep_1m 16777216".to_owned()], "in use", &mut svg).unwrap();
        let svg = String::from_utf8(svg).unwrap();
        assert!(svg.starts_with("<?xml"));
        assert!(svg.contains("keep_1m") && svg.contains("bytes"));
        let mut diff = Vec::new();
        write_differential(
            &["main;a 100".to_owned()],
            &["main;a 300".to_owned()],
            "growth",
            &mut diff,
        )
        .unwrap();
        let diff = String::from_utf8(diff).unwrap();
        // Grown: drawn in red (inferno writes rgb(255,...) for growth).
        assert!(diff.contains("a (300 bytes"), "{diff}");
        assert!(diff.contains("rgb(255,"), "{diff}");
    }
}
