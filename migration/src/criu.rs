//! Running CRIU: dump and restore inside a host's network namespace, and the reaper that
//! becomes a restored tree's parent.

use crate::host::Host;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// `criu` run inside `host`'s network namespace (through `nsenter`), with the layer kept out
/// of it.
fn in_ns(host: &Host, criu: &str) -> Command {
    let mut cmd = match host.ns() {
        Some(ns) => {
            let mut c = Command::new("nsenter");
            c.arg(format!("--net={}", ns.display())).arg(criu);
            c
        }
        None => Command::new(criu),
    };
    cmd.env_remove("LD_PRELOAD");
    cmd
}

pub fn criu(criu: &str, host: &Host, args: &[String], log: &str, images: &Path) -> Result<(), String> {
    let out = in_ns(host, criu)
        .args(args)
        .arg("-D")
        .arg(images)
        .arg("-o")
        .arg(log)
        .arg("-v2")
        .env_remove("LD_PRELOAD")
        .output()
        .map_err(|e| format!("cannot run {criu}: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    let tail = criu_errors(images, log);
    Err(format!(
        "criu {} in {} failed ({}):\n    {}",
        args.first().map(String::as_str).unwrap_or(""),
        host.name(),
        out.status,
        if tail.is_empty() { String::from_utf8_lossy(&out.stderr).trim().to_string() } else { tail }
    ))
}

/// `criu restore` in `host`. On success criu execs `vmi-migrate --reap READY`, which
/// becomes the restored tree's parent: it reaps the process when it exits, so that its pid
/// is free again for a later restore (a parent that never reaps leaves a zombie holding
/// the pid), and it says the restore is done by creating the file READY.
pub fn restore(criu: &str, host: &Host, shell_job: bool, log: &str, images: &Path) -> Result<(), String> {
    use std::os::unix::process::CommandExt;
    let ready = images.join(format!("{log}.ready"));
    let _ = std::fs::remove_file(&ready);
    let me = std::env::current_exe().map_err(|e| format!("own path: {e}"))?;
    let mut cmd = in_ns(host, criu);
    cmd.args(["restore", "--tcp-close", "-o", log, "-v2", "-D"])
        .arg(images)
        .env_remove("LD_PRELOAD")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    if shell_job {
        cmd.arg("--shell-job");
    }
    cmd.arg("--exec-cmd").arg("--").arg(&me).arg("--reap").arg(&ready);
    // SAFETY: only an async-signal-safe call between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(|e| format!("cannot run {criu}: {e}"))?;
    loop {
        if ready.exists() {
            // Restored; the reaper is not ours to wait for.
            std::mem::forget(child);
            return Ok(());
        }
        match child.try_wait() {
            Ok(Some(status)) => {
                return Err(format!(
                    "criu restore in {} failed ({status}):\n    {}",
                    host.name(),
                    criu_errors(images, log)
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(2)),
            Err(e) => return Err(format!("waiting for criu: {e}")),
        }
    }
}

/// `vmi-migrate --reap READY`: what criu execs after a restore (the restored process's
/// parent from then on). Says the restore is done, then reaps children until none is left.
pub fn reap(ready: &str) -> ! {
    let _ = std::fs::write(ready, b"");
    loop {
        let mut st = 0;
        // SAFETY: waits for any child.
        let r = unsafe { libc::waitpid(-1, &mut st, 0) };
        if r < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            std::process::exit(0);
        }
    }
}

/// The last few error lines of a CRIU log in the image folder (the RLIMIT_NOFILE one is
/// harmless and on every run).
fn criu_errors(images: &Path, log: &str) -> String {
    let text = std::fs::read_to_string(images.join(log)).unwrap_or_default();
    let errs: Vec<&str> =
        text.lines().filter(|l| l.contains("Error") && !l.contains("RLIMIT_NOFILE")).collect();
    errs[errs.len().saturating_sub(4)..].join("\n    ")
}

pub fn dir_bytes(p: &Path) -> u64 {
    std::fs::read_dir(p)
        .map(|rd| {
            rd.flatten().filter_map(|e| e.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum()
        })
        .unwrap_or(0)
}
