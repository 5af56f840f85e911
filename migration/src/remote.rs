//! Moving to another machine: the image travels as a tar stream through a remote shell
//! (`ssh DEST` unless `--ssh` says otherwise), and the target machine's own `vmi-migrate`
//! restores it (`--restore-here`) and thaws the processes (`--thaw-here`), each printing one
//! JSON line this side reads.
//!
//! ```text
//!  source: criu dump ─► tar -C IMAGES -c . ─► SSH DEST 'mkdir -p D && tar -C D -x'
//!          SSH DEST 'vmi-migrate --restore-here D'   → {"ok":true,"restore_ms":..,"here":[agent addrs]}
//!          old agent: Moved{listeners → here}
//!          SSH DEST 'vmi-migrate --thaw-here PIDS'   → {"pid":..,"conns":..,"rebuilt":..} per process
//! ```
//!
//! The target machine needs CRIU (`scripts/install-criu.sh`), `vmi-migrate` and a running
//! `vmi-agent`; the remote shell must run commands as root there.

use crate::host::Host;
use crate::talk;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use substrate::wire::agent::Msg;

/// How to reach the target machine.
pub struct Remote {
    /// `[USER@]HOST` as the remote shell takes it.
    pub dest: String,
    /// The remote shell command and its options (`ssh` by default).
    pub shell: Vec<String>,
    /// `vmi-migrate` on the target machine.
    pub migrate: String,
    /// Where the image goes there.
    pub images: PathBuf,
}

/// One word for a POSIX shell.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

impl Remote {
    fn command(&self, script: &str) -> Command {
        let mut c = Command::new(&self.shell[0]);
        c.args(&self.shell[1..]).arg(&self.dest).arg(script).env_remove("LD_PRELOAD");
        c
    }

    /// Runs `script` there; its standard output, or why it failed.
    fn run(&self, script: &str, timeout: Duration) -> Result<String, String> {
        let child = self
            .command(script)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", self.shell[0]))?;
        let out = wait_output(child, timeout)?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() || stdout.lines().any(|l| l.starts_with('{')) {
            return Ok(stdout);
        }
        Err(format!(
            "{} {}: {} ({})",
            self.shell.join(" "),
            self.dest,
            String::from_utf8_lossy(&out.stderr).trim(),
            out.status
        ))
    }

    /// Sends the image folder `from` to `self.images` there; the bytes that arrived. The
    /// folder there must not exist or be empty: nothing there is ever overwritten (on a
    /// filesystem both machines share, it could be the image itself).
    pub fn transfer(&self, from: &Path) -> Result<u64, String> {
        let d = quote(&self.images.to_string_lossy());
        let mut tar = Command::new("tar")
            .arg("-C")
            .arg(from)
            .args(["-cf", "-", "."])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot run tar: {e}"))?;
        let stream = tar.stdout.take().ok_or("tar has no output")?;
        let shell = self
            .command(&format!("mkdir -p {d} && rmdir {d} && mkdir {d} && tar -C {d} -xf - && du -sb {d}"))
            .stdin(stream)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", self.shell[0]))?;
        let out = wait_output(shell, Duration::from_secs(3600))?;
        let tar_ok = tar.wait().map(|s| s.success()).unwrap_or(false);
        if !out.status.success() || !tar_ok {
            return Err(format!(
                "the image did not reach {}: {}",
                self.dest,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        Ok(text.split_whitespace().next().and_then(|n| n.parse().ok()).unwrap_or(0))
    }

    /// Restores the image there; the target agent's addresses.
    pub fn restore(&self, shell_job: bool) -> Result<Vec<SocketAddr>, String> {
        let mut script =
            format!("{} --restore-here {}", quote(&self.migrate), quote(&self.images.to_string_lossy()));
        if shell_job {
            script.push_str(" --shell-job");
        }
        let out = self.run(&script, Duration::from_secs(600))?;
        let v = last_json(&out).ok_or_else(|| format!("no report from {}: {out}", self.dest))?;
        if v["ok"] != Value::Bool(true) {
            return Err(v["error"].as_str().unwrap_or("restore failed").to_string());
        }
        Ok(v["here"]
            .as_array()
            .map(|a| a.iter().filter_map(|x| x.as_str()?.parse().ok()).collect())
            .unwrap_or_default())
    }

    /// Thaws the restored processes there; one report per process.
    pub fn thaw(&self, pids: &[i32], socket: &str, timeout: Duration) -> Vec<Result<Msg, String>> {
        let list: Vec<String> = pids.iter().map(|p| p.to_string()).collect();
        let script = format!(
            "{} --thaw-here {} --agent-socket {} --thaw-timeout {}",
            quote(&self.migrate),
            list.join(","),
            quote(socket),
            timeout.as_secs_f64()
        );
        let out = match self.run(&script, timeout * (pids.len() as u32 + 1) + Duration::from_secs(10)) {
            Ok(o) => o,
            Err(e) => return pids.iter().map(|_| Err(e.clone())).collect(),
        };
        let reports: Vec<Value> =
            out.lines().filter(|l| l.starts_with('{')).filter_map(|l| serde_json::from_str(l).ok()).collect();
        pids.iter()
            .map(|&p| {
                let v = reports
                    .iter()
                    .find(|v| v["pid"].as_i64() == Some(p as i64))
                    .ok_or_else(|| format!("process {p}: no thaw report from {}", self.dest))?;
                thawed_from_json(v)
            })
            .collect()
    }

    /// Removes the image there.
    pub fn clean(&self) {
        let _ =
            self.run(&format!("rm -rf {}", quote(&self.images.to_string_lossy())), Duration::from_secs(60));
    }
}

fn wait_output(mut child: std::process::Child, timeout: Duration) -> Result<std::process::Output, String> {
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => return child.wait_with_output().map_err(|e| e.to_string()),
            Ok(None) if Instant::now() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("the remote command did not finish within {} s", timeout.as_secs()));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => return Err(e.to_string()),
        }
    }
}

fn last_json(out: &str) -> Option<Value> {
    out.lines().rev().filter(|l| l.starts_with('{')).find_map(|l| serde_json::from_str(l).ok())
}

fn thawed_to_json(pid: i32, r: &Result<Msg, String>) -> Value {
    match r {
        Ok(Msg::Thawed { moved, conns, rebuilt, waiting, replayed, ms }) => json!({
            "pid": pid, "moved": moved, "conns": conns, "rebuilt": rebuilt,
            "waiting": waiting, "replayed": replayed, "ms": ms,
        }),
        Ok(other) => json!({ "pid": pid, "error": format!("unexpected report {other:?}") }),
        Err(e) => json!({ "pid": pid, "error": e }),
    }
}

fn thawed_from_json(v: &Value) -> Result<Msg, String> {
    if let Some(e) = v["error"].as_str() {
        return Err(e.to_string());
    }
    let n = |k: &str| v[k].as_u64().ok_or_else(|| format!("bad thaw report {v}"));
    Ok(Msg::Thawed {
        moved: v["moved"].as_bool().unwrap_or(false),
        conns: n("conns")? as u32,
        rebuilt: n("rebuilt")? as u32,
        waiting: n("waiting")? as u32,
        replayed: n("replayed")?,
        ms: n("ms")? as u32,
    })
}

/// `vmi-migrate --restore-here DIR [--shell-job]` on the target machine: restores the
/// image into this machine's network namespace and prints one JSON line.
pub fn restore_here(criu: &str, images: &Path, shell_job: bool, socket: &str) -> i32 {
    let t = Instant::now();
    let r = crate::criu::restore(criu, &Host::Here, shell_job, "restore.log", images);
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    match r {
        Ok(()) => {
            let here = match talk::ask_agent(&Host::Here, socket, &Msg::WhereAmI, Duration::from_secs(2)) {
                Ok(Msg::Here { addrs }) => addrs,
                _ => Vec::new(),
            };
            let here: Vec<String> = here.iter().map(|a| a.to_string()).collect();
            println!("{}", json!({ "ok": true, "restore_ms": ms, "here": here }));
            0
        }
        Err(e) => {
            println!("{}", json!({ "ok": false, "restore_ms": ms, "error": e }));
            1
        }
    }
}

/// `vmi-migrate --thaw-here PID,PID...`: thaws restored processes on this machine; prints
/// one JSON line per process.
pub fn thaw_here(pids: &[i32], socket: &str, timeout: Duration) -> i32 {
    for &p in pids {
        let r = talk::thaw(&Host::Here, socket, p, timeout);
        println!("{}", thawed_to_json(p, &r));
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_survives_quotes() {
        assert_eq!(quote("/var/tmp/a b"), "'/var/tmp/a b'");
        assert_eq!(quote("it's"), r"'it'\''s'");
    }

    #[test]
    fn thaw_reports_round_trip() {
        let m = Msg::Thawed { moved: true, conns: 3, rebuilt: 2, waiting: 1, replayed: 77, ms: 9 };
        let v = thawed_to_json(5, &Ok(m.clone()));
        assert_eq!(thawed_from_json(&v), Ok(m));
        let v = thawed_to_json(5, &Err("gone".into()));
        assert_eq!(thawed_from_json(&v), Err("gone".into()));
        assert!(thawed_from_json(&json!({"pid": 5, "conns": "x"})).is_err());
    }
}
