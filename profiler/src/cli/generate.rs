//! `memprobe --generate WHAT`: the man page and shell completions, made
//! from the flags themselves so that they never drift from them (`cargo
//! xtask dist` packs them). Read before the flags are parsed, as no
//! target is asked for; shown in no help.
use std::{ffi::OsString, io::Write};

use clap::{CommandFactory, ValueEnum};

use crate::cli::{Cli, help};

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Generated {
    /// memprobe.1, roff.
    Man,
    Bash,
    Zsh,
    Fish,
}

/// What `args` (the whole command line) asks `--generate` for, if it is
/// that command line.
pub fn generate_request(args: &[OsString]) -> Option<Result<Generated, String>> {
    let [_, flag, what] = args else {
        return None;
    };
    if flag != "--generate" {
        return None;
    }
    let what = what.to_string_lossy();
    Some(
        Generated::from_str(&what, false)
            .map_err(|_| format!("--generate takes man, bash, zsh or fish, not '{what}'")),
    )
}

/// Writes `what` to `out`.
pub fn generate(what: Generated, out: &mut impl Write) -> std::io::Result<()> {
    let mut command = Cli::command();
    let shell = match what {
        Generated::Man => return man_page(command, out),
        Generated::Bash => clap_complete::Shell::Bash,
        Generated::Zsh => clap_complete::Shell::Zsh,
        Generated::Fish => clap_complete::Shell::Fish,
    };
    clap_complete::generate(shell, &mut command, "memprobe", out);
    Ok(())
}

/// clap_mangen's sections for the flags, then the commands, the examples
/// kept as laid out, and the notes (its own "extra" section fills the
/// examples' lines together).
fn man_page(mut command: clap::Command, out: &mut impl Write) -> std::io::Result<()> {
    command.build();
    let man = clap_mangen::Man::new(command.clone());
    man.render_title(out)?;
    man.render_name_section(out)?;
    man.render_synopsis_section(out)?;
    man.render_description_section(out)?;
    man.render_options_section(out)?;
    writeln!(out, ".SH COMMANDS")?;
    for sub in command.get_subcommands_mut() {
        let usage = sub.render_usage().to_string();
        let usage = usage.trim_start_matches("Usage: ");
        let about = sub.get_long_about().or(sub.get_about());
        writeln!(out, ".TP\n{}", roff_line(usage))?;
        if let Some(about) = about {
            writeln!(out, "{}", roff_text(&about.to_string()))?;
        }
    }
    let (examples, notes) = help::EXAMPLES
        .strip_prefix("Examples:\n")
        .and_then(|rest| rest.rsplit_once("\n\nmemprobe attaches"))
        .map(|(examples, notes)| (examples, format!("memprobe attaches{notes}")))
        .unwrap_or((help::EXAMPLES, String::new()));
    writeln!(out, ".SH EXAMPLES\n.nf")?;
    for line in examples.lines() {
        writeln!(out, "{}", roff_line(line))?;
    }
    writeln!(out, ".fi\n.SH NOTES")?;
    for paragraph in notes.split("\n\n") {
        writeln!(out, ".PP\n{}", roff_text(paragraph))?;
    }
    man.render_version_section(out)
}

/// One line of text as roff prints it: backslashes escaped, and a line
/// that would start with a control character kept as text.
fn roff_line(line: &str) -> String {
    let line = line.replace('\\', "\\e").replace('-', "\\-");
    if line.starts_with(['.', '\'']) {
        format!("\\&{line}")
    } else {
        line
    }
}

fn roff_text(text: &str) -> String {
    text.lines().map(roff_line).collect::<Vec<_>>().join("\n")
}
