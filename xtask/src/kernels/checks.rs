//! Judging what the smoke suite printed on one kernel.
use std::collections::HashMap;

/// The sites fixture's kept allocations: (function, objects, bytes).
const KEPT_SITES: [(&str, f64, f64); 2] = [
    ("keep_4k", 2000.0, 2000.0 * 4096.0),
    ("keep_1m", 16.0, 16.0 * 1048576.0),
];

/// How far an estimate may be from the truth.
const TOLERANCE: f64 = 0.10;

/// One check's outcome.
pub struct Check {
    pub name: &'static str,
    pub passed: bool,
    pub detail: String,
}

/// What one kernel showed.
pub struct Outcome {
    pub kernel: String,
    /// "uprobe sessions; entry probes: uprobe_multi links", "uretprobes
    /// (kernel has no uprobe sessions); entry probes: ..."...
    pub mode: String,
    pub checks: Vec<Check>,
}

impl Outcome {
    pub fn passed(&self) -> bool {
        !self.checks.is_empty() && self.checks.iter().all(|c| c.passed)
    }
}

/// The "@@ NAME" ... "@@ end" sections of the suite's output. Lines
/// outside them (the kernel's own messages) are ignored.
pub fn sections(output: &str) -> HashMap<String, Vec<String>> {
    let mut sections = HashMap::new();
    let mut current: Option<(String, Vec<String>)> = None;
    for line in output.lines() {
        let line = line.trim_end_matches('\r');
        // A marker may follow the terminal resets the firmware printed.
        let line = line.find("@@ ").map_or(line, |at| &line[at..]);
        match (line.strip_prefix("@@ "), current.take()) {
            (Some("end"), Some((name, lines))) => {
                sections.insert(name, lines);
            }
            (Some(name), _) => current = Some((name.to_owned(), Vec::new())),
            (None, Some((name, mut lines))) => {
                lines.push(line.to_owned());
                current = Some((name, lines));
            }
            (None, None) => {}
        }
    }
    sections
}

pub fn judge(output: &str) -> Outcome {
    let sections = sections(output);
    let lines = |name: &str| sections.get(name).map(Vec::as_slice).unwrap_or(&[]);
    let kernel = lines("kernel").first().cloned().unwrap_or_default();
    let mode = lines("attach")
        .iter()
        .find_map(|l| l.split_once("; return probes: ").map(|(_, m)| m.to_owned()))
        .unwrap_or_else(|| "?".into());
    let mut checks = Vec::new();
    if !sections.contains_key("smoke-done") {
        checks.push(Check {
            name: "suite ran to its end",
            passed: false,
            detail: "no smoke-done section: the VM stopped early or timed out".into(),
        });
    }
    checks.push(run_check("attach (default mode)", lines("attach")));
    checks.push(programs_loaded(lines("attached-programs")));
    checks.push(fallback_said_once(lines("attach"), &mode));
    checks.push(switches_priced(lines("attach")));
    checks.push(estimates(
        "attach: kept sites within 10%",
        &sections,
        "attach",
    ));
    checks.push(exit_mid_run(lines("exit")));
    checks.push(estimates(
        "exit mid-run: kept sites within 10%",
        &sections,
        "exit",
    ));
    checks.push(run_check("sampling in windows", lines("windows")));
    checks.push(large_site_in_windows(&sections));
    checks.push(run_check("launch mode", lines("launch")));
    checks.push(estimates(
        "launch: kept sites within 10%",
        &sections,
        "launch",
    ));
    checks.push(sessions_by_name(lines("sessions"), &mode));
    checks.push(nothing_left(lines("programs-left"), lines("links-left")));
    Outcome {
        kernel,
        mode,
        checks,
    }
}

fn exit_status(lines: &[String]) -> Option<i32> {
    lines.first()?.strip_prefix("exit ")?.trim().parse().ok()
}

fn run_check(name: &'static str, lines: &[String]) -> Check {
    let status = exit_status(lines);
    let attached = lines.iter().any(|l| l.starts_with("memprobe: attached "));
    let wrote = lines
        .iter()
        .any(|l| l.contains(".heap") || l.contains("; wrote "));
    Check {
        name,
        passed: status == Some(0) && attached && wrote,
        detail: format!(
            "exit {status:?}, attached: {attached}, wrote a .heap: {wrote}; {}",
            lines.iter().find(|l| l.contains("error")).map_or("", |l| l)
        ),
    }
}

/// Where the kernel has no sessions, `--verbose` says so in one line.
fn fallback_said_once(lines: &[String], mode: &str) -> Check {
    let said = lines
        .iter()
        .filter(|l| l.starts_with("memprobe: return probes: uretprobes"))
        .count();
    let expected = usize::from(!mode.starts_with("uprobe sessions"));
    Check {
        name: "fallback said once in --verbose",
        passed: said == expected,
        detail: format!("said {said} times, expected {expected}"),
    }
}

/// Where the probes are perf events on the main thread (before 6.10), the
/// cost line prices that thread's context switches; elsewhere it has none
/// to price.
fn switches_priced(lines: &[String]) -> Check {
    let cost = lines.iter().find(|l| l.starts_with("memprobe: cost: "));
    let how = lines
        .iter()
        .find(|l| l.starts_with("memprobe: cost per hit"));
    let perf_events = how.is_some_and(|l| l.contains("entry probes: perf-event uprobes"));
    let priced = cost.is_some_and(|l| l.contains(" context switches of threads carrying "));
    Check {
        name: "context switches priced where probes are perf events",
        passed: cost.is_some() && priced == perf_events,
        detail: format!("perf-event probes: {perf_events}, switches priced: {priced}"),
    }
}

/// memprobe's programs are loaded, those in each process's libc too (its
/// `_exit` probe's loop, and the mapping probes with it, verified here).
fn programs_loaded(lines: &[String]) -> Check {
    let exit_probe = ["name process_exit", "name thread_exit"]
        .iter()
        .all(|name| lines.iter().any(|l| l.contains(name)));
    Check {
        name: "programs loaded while attached",
        passed: !lines.is_empty() && exit_probe,
        detail: format!(
            "{} of memprobe's programs listed by bpftool; libc's _exit and \
             __call_tls_dtors probes among them: {exit_probe}",
            lines.len()
        ),
    }
}

/// The process exits while memprobe runs with `--duration 10m`: memprobe
/// writes the profile and ends within a few seconds.
fn exit_mid_run(lines: &[String]) -> Check {
    let mut check = run_check("process exiting mid-run", lines);
    let tenths: Option<u32> = lines.iter().find_map(|l| {
        l.strip_prefix("tenths-after-target-exit ")?
            .trim()
            .parse()
            .ok()
    });
    let said_exited = lines.iter().any(|l| l.contains(" exited"));
    check.passed &= said_exited && tenths.is_some_and(|t| t < 300);
    check.detail = format!(
        "ended {:.1} s after the process; said exited: {said_exited}; {}",
        tenths.unwrap_or(u32::MAX) as f64 / 10.0,
        check.detail
    );
    check
}

/// jeprof-style report lines: "  flat  flat%  sum%  cum  cum%  name".
fn flat_values(lines: &[String]) -> HashMap<String, f64> {
    lines
        .iter()
        .filter_map(|l| {
            let fields: Vec<&str> = l.split_whitespace().collect();
            let value = fields.first()?.parse().ok()?;
            Some((fields.get(5..)?.join(" "), value))
        })
        .collect()
}

fn estimates(name: &'static str, sections: &HashMap<String, Vec<String>>, run: &str) -> Check {
    let get = |kind: &str| {
        sections
            .get(&format!("{run}-report-{kind}"))
            .map(|l| flat_values(l))
            .unwrap_or_default()
    };
    let (space, objects) = (get("space"), get("objects"));
    let mut passed = true;
    let mut detail = Vec::new();
    for (site, true_objects, true_bytes) in KEPT_SITES {
        // The report gives bytes in MiB with one decimal.
        let mib = space.get(site).copied().unwrap_or(0.0);
        let count = objects.get(site).copied().unwrap_or(0.0);
        let space_error = mib * 1048576.0 / true_bytes - 1.0;
        let objects_error = count / true_objects - 1.0;
        passed &= space_error.abs() <= TOLERANCE && objects_error.abs() <= TOLERANCE;
        detail.push(format!(
            "{site} {mib:.1} MiB ({:+.1}%), {count:.0} objects ({:+.1}%)",
            space_error * 100.0,
            objects_error * 100.0
        ));
    }
    Check {
        name,
        passed,
        detail: detail.join("; "),
    }
}

/// `--sampling windows`: the 1 MiB requests, which reach jemalloc's slow
/// path whether a window is open or not, all seen: the profile's total is
/// at least their 16 MiB (less 10%). Where they were placed is shown, not
/// judged yet: in the 6.1 and 6.12 guests most of those sampled inside a
/// window lost their immediate caller, `keep_1m`, to `main`, until links
/// were closed return half first (docs/overhead.md, "Sampling in windows"); one run
/// since placed them all.
fn large_site_in_windows(sections: &HashMap<String, Vec<String>>) -> Check {
    let lines = sections
        .get("windows-report-space")
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    let total_mib: f64 = lines
        .iter()
        .find_map(|l| {
            l.strip_prefix("Total: ")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or(0.0);
    let space = flat_values(lines);
    let (site, _, true_bytes) = KEPT_SITES[1];
    let true_mib = true_bytes / 1048576.0;
    let placed = space.get(site).copied().unwrap_or(0.0);
    Check {
        name: "windows: the 1 MiB requests all seen",
        passed: total_mib >= true_mib * (1.0 - TOLERANCE),
        detail: format!(
            "{total_mib:.1} MB in all for {true_mib:.0} MiB of them; {placed:.1} MiB placed at {site}"
        ),
    }
}

/// `--return-probes sessions`: runs where the default mode used sessions;
/// elsewhere one line naming the feature and its first kernel, non-zero.
fn sessions_by_name(lines: &[String], mode: &str) -> Check {
    let status = exit_status(lines);
    let messages = &lines[1.min(lines.len())..];
    let passed = if mode.starts_with("uprobe sessions") {
        status == Some(0)
    } else {
        status.is_some_and(|s| s != 0)
            && messages.len() == 1
            && messages[0].contains("uprobe sessions (Linux 6.13+)")
    };
    Check {
        name: "--return-probes sessions",
        passed,
        detail: format!("exit {status:?}: {}", messages.join(" | ")),
    }
}

fn nothing_left(programs: &[String], links: &[String]) -> Check {
    Check {
        name: "no program or link left",
        passed: programs.is_empty()
            && !links
                .iter()
                .any(|l| l.contains("perf_event") || l.contains("uprobe_multi")),
        detail: format!(
            "{} programs, {} link lines left",
            programs.len(),
            links.len()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_skip_kernel_messages_and_estimates_read_the_report() {
        let output = "[    1.0] random: crng init done\n@@ attach-report-space\nTotal: 23.7 MB\n    \
                      16.0  67.7%  67.7%     16.0  67.7% keep_1m\n     7.7  32.3% 100.0%      \
                      7.7  32.3% keep_4k\n@@ end\n@@ attach-report-objects\n  1958.5  99.2%  \
                      99.2%   1958.5  99.2% keep_4k\n    16.0   0.8% 100.0%     16.0   0.8% \
                      keep_1m\n@@ end\n";
        let sections = sections(output);
        assert_eq!(sections.len(), 2);
        let check = estimates("e", &sections, "attach");
        assert!(check.passed, "{}", check.detail);
        let sections = super::sections(&output.replace("1958.5", "1700.0"));
        assert!(!estimates("e", &sections, "attach").passed);
    }
}
