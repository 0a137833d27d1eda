//! The README and the topic docs under `docs/`: the README short, with its
//! two set-up commands and links that lead somewhere, and every command in
//! a `sh` block of any of them run, as a reader would run it, against a
//! server-shaped process (a JVM for the JVM page): its pid for 1234, its
//! binary for `./server` and `/path/to/binary`, a fresh folder for
//! `/tmp/prof`, short durations, and no `sudo` (the tests run as root).
use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use tests::*;

/// Commands the docs show that other parts of the suite run, or that are
/// no test's to run: the lines starting so are left out, and said.
const RUN_ELSEWHERE: [(&str, &str); 7] = [
    ("cargo xtask test", "it is the suite itself (.ci/run)"),
    ("cargo xtask bench", "two hours of measurements"),
    ("cargo xtask kernels", "run by cargo xtask test"),
    ("cargo xtask soak", "a ten-minute run"),
    (
        "cargo xtask dist",
        "run by cargo xtask test before the tests",
    ),
    (
        "sudo dpkg -i",
        "package::the_deb_installs_runs_and_reads_with_man",
    ),
    (
        "man memprobe",
        "package::the_deb_installs_runs_and_reads_with_man",
    ),
];

/// The most a block may take.
const BLOCK_TIMEOUT: Duration = Duration::from_secs(240);

fn pages() -> Vec<PathBuf> {
    let root = workspace_root();
    let mut pages = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// The fenced blocks of `text` whose language is `language`.
fn blocks(text: &str, language: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        match (&mut current, line.strip_prefix("```")) {
            (None, Some(lang)) if lang.trim() == language => current = Some(String::new()),
            (Some(block), Some(_)) => {
                found.push(std::mem::take(block));
                current = None;
            }
            (Some(block), None) => {
                block.push_str(line);
                block.push('\n');
            }
            (None, _) => {}
        }
    }
    found
}

#[test]
fn the_readme_is_short_with_its_two_commands_and_links_that_lead_somewhere() {
    let root = workspace_root();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(lines <= 200, "the README has {lines} lines");
    let commands = blocks(&readme, "sh");
    assert!(commands.contains(&"cargo xtask demo\n".to_owned()));
    assert!(commands.contains(&"cargo xtask test\n".to_owned()));
    let ci = std::fs::read_to_string(root.join(".ci/run")).unwrap();
    assert!(ci.lines().any(|l| l == "cargo xtask test"), "{ci}");
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for link in text.split("](").skip(1) {
            let target = link.split(')').next().unwrap();
            if target.starts_with("http") || target.starts_with('#') {
                continue;
            }
            let target = target.split('#').next().unwrap();
            let path = page.parent().unwrap().join(target);
            assert!(path.exists(), "{}: {target} leads nowhere", page.display());
        }
    }
}

/// A process the docs' commands profile, killed at the end.
struct Target(Child);

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The Python fixture, waiting (its stdin kept open by its `Child`).
fn python_target() -> Target {
    let python = python_fixture()
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    Target(python)
}

/// The server fixture and a JVM running one like it, each for ten minutes.
fn targets() -> (Target, Target) {
    let server = Command::new(server_fixture())
        .env("FIXTURE_SECONDS", "600")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut jvm = java_command("Server");
    let jvm = jvm
        .env("FIXTURE_SECONDS", "600")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    // The JVM's libraries mapped and its allocations under way.
    std::thread::sleep(Duration::from_secs(2));
    (Target(server), Target(jvm))
}

/// A block as the test runs it: each line of `block` with the test's
/// process, binary, folder and durations, the lines run elsewhere left
/// out; and the lines left out.
fn as_run(block: &str, pid: u32, folder: &Path) -> (String, Vec<String>) {
    let server = server_fixture();
    let mut script = String::from("set -euo pipefail\n");
    let mut left_out = Vec::new();
    for line in block.lines() {
        if let Some((_, why)) = RUN_ELSEWHERE.iter().find(|(p, _)| line.starts_with(p)) {
            left_out.push(format!("{line} ({why})"));
            continue;
        }
        // In the background, the commands after it need it a while.
        let duration = if line.ends_with('&') { "60s" } else { "3s" };
        let mut previous = "";
        let words: Vec<String> = line
            .split(' ')
            .map(|word| {
                let replaced = match previous {
                    "--duration" => duration.to_owned(),
                    "--interval" => "1s".to_owned(),
                    _ => word
                        .replace("/tmp/prof", folder.to_str().unwrap())
                        .replace("1234", &pid.to_string())
                        .replace("./server", server.to_str().unwrap())
                        .replace("/path/to/binary", server.to_str().unwrap()),
                };
                previous = word;
                replaced
            })
            .collect();
        let line = words.join(" ");
        script.push_str(line.strip_prefix("sudo ").unwrap_or(&line));
        script.push('\n');
    }
    (script, left_out)
}

/// Runs `script` in bash from the workspace, with the release binary
/// first on the PATH; its status and output.
fn run_script(script: &str) -> (bool, String) {
    let bin_dir = memprobe_bin().parent().unwrap().to_owned();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut child = Command::new("bash")
        .arg("-c")
        .arg(script)
        .current_dir(workspace_root())
        .env("PATH", path)
        // A command launched under memprobe ends on its own.
        .env("FIXTURE_SECONDS", "3")
        .env("MANPAGER", "cat")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > BLOCK_TIMEOUT {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn every_command_in_the_docs_runs() {
    // `--all` on the fleet page, and a port of its own.
    let _guard = exclusive();
    let (server, jvm) = targets();
    let python = python_target();
    let mut ran = 0;
    let mut left_out = Vec::new();
    for page in pages() {
        let name = page.file_name().unwrap().to_string_lossy().into_owned();
        let pid = match name.as_str() {
            "jvm.md" => jvm.0.id(),
            "python.md" => python.0.id(),
            _ => server.0.id(),
        };
        let folder = output_dir(&format!("docs_{}", name.trim_end_matches(".md")));
        let text = std::fs::read_to_string(&page).unwrap();
        for block in blocks(&text, "sh") {
            let (script, skipped) = as_run(&block, pid, &folder);
            left_out.extend(skipped.into_iter().map(|l| format!("{name}: {l}")));
            let (ok, output) = run_script(&script);
            assert!(ok, "{name}: this block failed:\n{script}\n{output}");
            ran += script.lines().count() - 1;
        }
    }
    eprintln!("{ran} commands run; left out:\n{}", left_out.join("\n"));
    assert!(ran >= 30, "{ran} commands run");
}
