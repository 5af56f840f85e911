//! Moving a process of this node to another host on an operator's command (`vmictl
//! [--node NODE] migrate PID --to HOST`): the agent checks who asks and what, runs
//! vmi-migrate (CRIU) for it, records the outcome as an event and answers with vmi-migrate's
//! report.

use crate::local::{Agent, Asker};
use crate::mesh::Refused;
use serde_json::{json, Value};
use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use substrate::wire::agent::Msg;
use tracing::{info, warn};

/// Longest migration waited for (vmi-migrate is stopped after it).
pub const TIMEOUT: Duration = Duration::from_secs(300);

/// Why `to` cannot be a target: a namespace host's name, or `ssh:[USER@]MACHINE`, in a
/// small alphabet (it becomes one argument of vmi-migrate, never a shell word).
pub fn bad_target(to: &str) -> Option<String> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || "._-@:[]".contains(c);
    if to.is_empty() || to.len() > 255 {
        Some("the target must have 1 to 255 characters".into())
    } else if to.starts_with('-') {
        Some(format!("{to:?} is not a host (it starts with '-')"))
    } else {
        to.chars().find(|c| !ok_char(*c)).map(|c| format!("{to:?} is not a host (character {c:?})"))
    }
}

/// vmi-migrate: `$VMI_MIGRATE`, else beside this agent's executable.
fn program() -> PathBuf {
    std::env::var_os("VMI_MIGRATE").map(PathBuf::from).unwrap_or_else(|| {
        std::env::current_exe()
            .map(|p| p.with_file_name("vmi-migrate"))
            .unwrap_or_else(|_| PathBuf::from("vmi-migrate"))
    })
}

/// Runs the migration of `pid` to `to` for `asker`.
pub fn run(agent: &Agent, asker: Asker, pid: u32, to: &str) -> Msg {
    if !asker.may_manage(pid) || (asker.remote && !asker.may_run_node()) {
        agent.refusals.note(Refused::Local, || {
            format!("{} asked to migrate process {pid}; only root or its owner may", asker.describe())
        });
        return Msg::Error { reason: format!("not allowed to migrate process {pid}") };
    }
    if let Some(why) = bad_target(to) {
        return Msg::Error { reason: why };
    }
    if agent.procs.lock().unwrap_or_else(|e| e.into_inner()).clients_of(pid).is_empty() {
        return Msg::Error { reason: format!("process {pid} is not under the layer on this node") };
    }
    let prog = program();
    info!("{} asks to migrate process {pid} to {to} ({})", asker.describe(), prog.display());
    agent.journal.record("migration", Some(pid), json!({ "phase": "asked", "to": to }));
    let started = Instant::now();
    let child = Command::new(&prog)
        .arg(pid.to_string())
        .args(["--to", to, "--json"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            let reason = format!(
                "cannot run {}: {e} (set VMI_MIGRATE, or install it beside vmi-agent)",
                prog.display()
            );
            warn!("{reason}");
            return Msg::Error { reason };
        }
    };
    // Its output is read by threads, so that a full pipe never stops it.
    let mut out = child.stdout.take().expect("piped");
    let mut err = child.stderr.take().expect("piped");
    let out_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break Some(st),
            Ok(None) if started.elapsed() < TIMEOUT => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
        }
    };
    let stdout = out_t.join().unwrap_or_default();
    let stderr = err_t.join().unwrap_or_default();
    let report: Option<Value> =
        stdout.lines().rev().find(|l| l.starts_with('{')).and_then(|l| serde_json::from_str(l).ok());
    let ok = status.is_some_and(|s| s.success()) && report.as_ref().is_some_and(|r| r["ok"] == json!(true));
    let ms = started.elapsed().as_millis() as u64;
    agent.journal.record(
        "migration",
        Some(pid),
        json!({ "phase": if ok { "done" } else { "failed" }, "to": to, "ms": ms }),
    );
    match (report, status) {
        (Some(r), _) => {
            info!("migration of process {pid} to {to}: {} after {ms} ms", if ok { "done" } else { "failed" });
            Msg::StatusReply { json: r.to_string() }
        }
        (None, None) => {
            Msg::Error { reason: format!("vmi-migrate did not finish within {} s", TIMEOUT.as_secs()) }
        }
        (None, Some(st)) => {
            let tail: String = stderr
                .lines()
                .rev()
                .take(5)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("; ");
            Msg::Error { reason: format!("vmi-migrate gave no report ({st}): {tail}") }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_one_plain_word() {
        for good in ["vmit3", "ssh:root@node7", "ssh:node-7.cluster", "ssh:root@[fe80::1]"] {
            assert_eq!(bad_target(good), None, "{good}");
        }
        for bad in ["", "-x", "--criu=/bin/sh", "a b", "host;reboot", "$(id)", "h\n"] {
            assert!(bad_target(bad).is_some(), "{bad:?}");
        }
        assert!(bad_target(&"h".repeat(256)).is_some());
    }
}
