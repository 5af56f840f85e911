//! `vmi-migrate PID --to HOST`: moves a process that runs under the vmi layer (and the
//! processes it forked) to another host with CRIU, keeping its virtual connections.
//!
//! Phases, each timed:
//! 1. **freeze**: the source node's agent asks each process of the tree to get ready: it
//!    closes its Unix sockets to the agent (CRIU cannot restore their other end), makes its
//!    physical sockets reset rather than close gracefully when the process is killed, and
//!    waits on its *thaw socket*. Its connections are answered "moved" to dialers meanwhile.
//! 2. **dump**: `criu dump --tcp-close` in the source host's network namespace.
//! 3. **transfer**: the image to the target host (nothing to do between namespace hosts
//!    on one machine: they share the filesystem).
//! 4. **restore**: `criu restore --tcp-close -d` in the target host's network namespace. The
//!    restored sockets are closed; the layer rebuilds every virtual connection from there.
//! 5. **thaw**: each process is told to go on; it registers with the new node's agent, dials
//!    every peer, replays what the peer did not receive, and reports back.
//!
//! Failure is safe: a failed freeze or dump leaves the process running where it was (it is
//! thawed there); a failed restore on the target is retried on the source host.
//!
//! A host is a network namespace as `ip netns list` shows it (`/run/netns/HOST`).

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use substrate::wire::agent::Msg;

const USAGE: &str = "usage: vmi-migrate PID --to HOST [options]

Moves process PID (and its children), running under the vmi layer, to HOST with CRIU.
HOST is a network namespace host (/run/netns/HOST, as `ip netns list` shows it).

options:
  --from HOST        the host PID runs on (default: found from its network namespace)
  --images DIR       where the checkpoint image goes (default /var/tmp/vmi-migrate/PID-TIME)
  --keep-images      keep the image after a successful migration
  --criu PATH        the criu to run (default $VMI_CRIU, /opt/vmi/criu/bin/criu, criu)
  --agent-socket N   the agents' abstract socket name (default $VMI_AGENT_SOCKET or vmi-agent)
  --json             print the report as one JSON object
  --thaw-timeout S   how long to wait for the processes' reports after the restore (30)

Processes to migrate must be started with `nsenter --net=/run/netns/HOST` (not `ip netns
exec`, whose private mount namespace CRIU refuses), in their own session (setsid), with
their standard streams on files or /dev/null.";

fn fail(msg: &str) -> ! {
    eprintln!("vmi-migrate: {msg}");
    std::process::exit(2);
}

struct Opts {
    pid: i32,
    to: String,
    from: Option<String>,
    images: Option<PathBuf>,
    keep: bool,
    criu: String,
    socket: String,
    json: bool,
    thaw_timeout: Duration,
}

fn parse() -> Opts {
    let mut pid = None;
    let mut to = None;
    let mut from = None;
    let mut images = None;
    let mut keep = false;
    let mut criu = None;
    let mut socket = std::env::var("VMI_AGENT_SOCKET").unwrap_or_else(|_| "vmi-agent".into());
    let mut json = false;
    let mut thaw_timeout = Duration::from_secs(30);
    let mut it = std::env::args().skip(1);
    let val = |it: &mut dyn Iterator<Item = String>, name: &str| {
        it.next().unwrap_or_else(|| fail(&format!("{name} needs a value\n{USAGE}")))
    };
    while let Some(a) = it.next() {
        match a.as_str() {
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            "--to" => to = Some(val(&mut it, "--to")),
            "--from" => from = Some(val(&mut it, "--from")),
            "--images" => images = Some(PathBuf::from(val(&mut it, "--images"))),
            "--keep-images" => keep = true,
            "--criu" => criu = Some(val(&mut it, "--criu")),
            "--agent-socket" => socket = val(&mut it, "--agent-socket"),
            "--json" => json = true,
            "--thaw-timeout" => {
                let s = val(&mut it, "--thaw-timeout");
                let secs: f64 = s.parse().unwrap_or_else(|_| fail(&format!("bad --thaw-timeout {s}")));
                thaw_timeout = Duration::from_secs_f64(secs.max(0.1));
            }
            p if pid.is_none() && p.parse::<i32>().is_ok_and(|n| n > 0) => pid = p.parse().ok(),
            other => fail(&format!("unknown argument {other}\n{USAGE}")),
        }
    }
    let criu = criu.or_else(|| std::env::var("VMI_CRIU").ok()).unwrap_or_else(|| {
        if Path::new("/opt/vmi/criu/bin/criu").exists() {
            "/opt/vmi/criu/bin/criu".into()
        } else {
            "criu".into()
        }
    });
    Opts {
        pid: pid.unwrap_or_else(|| fail(&format!("which process?\n{USAGE}"))),
        to: to.unwrap_or_else(|| fail(&format!("--to HOST is required\n{USAGE}"))),
        from,
        images,
        keep,
        criu,
        socket,
        json,
        thaw_timeout,
    }
}

// ---------------------------------------------------------------------------------------------
// Hosts (network namespaces)

fn netns_path(host: &str) -> PathBuf {
    Path::new("/run/netns").join(host)
}

fn inode(p: &Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p).ok().map(|m| m.ino())
}

/// The namespace host process `pid` runs in.
fn host_of(pid: i32) -> Option<String> {
    let ino = inode(&PathBuf::from(format!("/proc/{pid}/ns/net")))?;
    std::fs::read_dir("/run/netns")
        .ok()?
        .flatten()
        .find(|e| inode(&e.path()) == Some(ino))
        .map(|e| e.file_name().to_string_lossy().into_owned())
}

/// Runs `f` with this thread in the network namespace of `host` (sockets made inside stay
/// there), then comes back.
fn in_host<T>(host: &str, f: impl FnOnce() -> T) -> Result<T, String> {
    let home = std::fs::File::open("/proc/thread-self/ns/net").map_err(|e| format!("own namespace: {e}"))?;
    let there = std::fs::File::open(netns_path(host))
        .map_err(|e| format!("host {host}: {e} (not in `ip netns list`?)"))?;
    // SAFETY: setns on a namespace file we opened.
    if unsafe { libc::setns(there.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(format!("cannot enter host {host}: {}", std::io::Error::last_os_error()));
    }
    let r = f();
    // SAFETY: as above, back home.
    if unsafe { libc::setns(home.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        fail(&format!("cannot come back from host {host}: {}", std::io::Error::last_os_error()));
    }
    Ok(r)
}

/// PID and every descendant, parents first.
fn tree(pid: i32) -> Vec<i32> {
    let mut parent_of = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else { continue };
            // After the command name (which may hold spaces) in parentheses: state, ppid.
            let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else { continue };
            if let Some(pp) = rest.split(' ').nth(1).and_then(|x| x.parse::<i32>().ok()) {
                parent_of.push((p, pp));
            }
        }
    }
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        let cur = out[i];
        out.extend(parent_of.iter().filter(|(_, pp)| *pp == cur).map(|(p, _)| *p));
        i += 1;
    }
    out
}

fn session_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split(' ').nth(3)?.parse().ok()
}

// ---------------------------------------------------------------------------------------------
// Talking to agents and thaw sockets

fn connect_abstract(name: &str) -> std::io::Result<UnixStream> {
    use std::os::linux::net::SocketAddrExt;
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
    let s = UnixStream::connect_addr(&addr)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.set_write_timeout(Some(Duration::from_secs(10)))?;
    Ok(s)
}

fn send(s: &mut UnixStream, m: &Msg) -> std::io::Result<()> {
    s.write_all(&m.encode())
}

fn recv(s: &mut UnixStream) -> std::io::Result<Msg> {
    let mut pre = [0u8; 4];
    s.read_exact(&mut pre)?;
    let n = Msg::body_len(pre).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    let mut body = vec![0u8; n];
    s.read_exact(&mut body)?;
    Msg::decode(&body).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// One request to the agent of `host`.
fn ask_agent(host: &str, socket: &str, m: &Msg, timeout: Duration) -> Result<Msg, String> {
    let mut s = in_host(host, || connect_abstract(socket))?
        .map_err(|e| format!("no agent on @{socket} in host {host}: {e}"))?;
    let _ = s.set_read_timeout(Some(timeout));
    send(&mut s, m).and_then(|_| recv(&mut s)).map_err(|e| format!("agent of {host}: {e}"))
}

/// Tells process `pid` (frozen, now in `host`) to go on; its report.
fn thaw(host: &str, socket: &str, pid: i32, timeout: Duration) -> Result<Msg, String> {
    let name = format!("{socket}-thaw-{pid}");
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut s = loop {
        match in_host(host, || connect_abstract(&name))? {
            Ok(s) => break s,
            Err(e) if Instant::now() > deadline => {
                return Err(format!("process {pid} does not wait for a thaw in {host}: {e}"))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    let _ = s.set_read_timeout(Some(timeout));
    send(&mut s, &Msg::Thaw { pid: pid as u32 }).map_err(|e| format!("thaw {pid}: {e}"))?;
    recv(&mut s).map_err(|e| format!("process {pid} did not report after its thaw: {e}"))
}

// ---------------------------------------------------------------------------------------------
// CRIU

fn criu(o: &Opts, host: &str, args: &[String], log: &str, images: &Path) -> Result<(), String> {
    let out = Command::new("nsenter")
        .arg(format!("--net={}", netns_path(host).display()))
        .arg(&o.criu)
        .args(args)
        .arg("-D")
        .arg(images)
        .arg("-o")
        .arg(log)
        .arg("-v2")
        .env_remove("LD_PRELOAD")
        .output()
        .map_err(|e| format!("cannot run {}: {e}", o.criu))?;
    if out.status.success() {
        return Ok(());
    }
    let tail = criu_errors(images, log);
    Err(format!(
        "criu {} in {host} failed ({}):\n    {}",
        args.first().map(String::as_str).unwrap_or(""),
        out.status,
        if tail.is_empty() { String::from_utf8_lossy(&out.stderr).trim().to_string() } else { tail }
    ))
}

/// `criu restore` in `host`. On success criu execs `vmi-migrate --reap READY`, which
/// becomes the restored tree's parent: it reaps the process when it exits, so that its pid
/// is free again for a later restore (a parent that never reaps leaves a zombie holding
/// the pid), and it says the restore is done by creating the file READY.
fn criu_restore(o: &Opts, host: &str, shell_job: bool, log: &str, images: &Path) -> Result<(), String> {
    use std::os::unix::process::CommandExt;
    let ready = images.join(format!("{log}.ready"));
    let _ = std::fs::remove_file(&ready);
    let me = std::env::current_exe().map_err(|e| format!("own path: {e}"))?;
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net={}", netns_path(host).display()))
        .arg(&o.criu)
        .args(["restore", "--tcp-close", "-o", log, "-v2", "-D"])
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
    let mut child = cmd.spawn().map_err(|e| format!("cannot run {}: {e}", o.criu))?;
    loop {
        if ready.exists() {
            // Restored; the reaper is not ours to wait for.
            std::mem::forget(child);
            return Ok(());
        }
        match child.try_wait() {
            Ok(Some(status)) => {
                return Err(format!(
                    "criu restore in {host} failed ({status}):\n    {}",
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
fn reap(ready: &str) -> ! {
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

fn dir_bytes(p: &Path) -> u64 {
    std::fs::read_dir(p)
        .map(|rd| {
            rd.flatten().filter_map(|e| e.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum()
        })
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------

struct Report {
    phases: Vec<(&'static str, f64)>,
    outcome: String,
    ok: bool,
    host: String,
    details: serde_json::Map<String, serde_json::Value>,
}

impl Report {
    fn phase(&mut self, name: &'static str, since: Instant) -> Instant {
        self.phases.push((name, since.elapsed().as_secs_f64() * 1000.0));
        Instant::now()
    }

    fn print(&self, o: &Opts) {
        if o.json {
            let mut m = self.details.clone();
            m.insert("pid".into(), o.pid.into());
            m.insert("ok".into(), self.ok.into());
            m.insert("outcome".into(), self.outcome.clone().into());
            m.insert("host".into(), self.host.clone().into());
            for (n, ms) in &self.phases {
                m.insert(format!("{n}_ms"), (((ms * 10.0).round()) / 10.0).into());
            }
            println!("{}", serde_json::Value::Object(m));
            return;
        }
        println!("vmi-migrate: process {}: {}", o.pid, self.outcome);
        for (n, ms) in &self.phases {
            println!("  {n:<10} {ms:>9.1} ms");
        }
        for (k, v) in &self.details {
            println!("  {k:<22} {v}");
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() == 3 && args[1] == "--reap" {
        reap(&args[2]);
    }
    let o = parse();
    let pids = tree(o.pid);
    if !Path::new(&format!("/proc/{}", o.pid)).exists() {
        fail(&format!("no process {}", o.pid));
    }
    let from = o.from.clone().or_else(|| host_of(o.pid)).unwrap_or_else(|| {
        fail(&format!("process {} is not in a namespace host (see `ip netns list`); use --from", o.pid))
    });
    if !netns_path(&o.to).exists() {
        fail(&format!("unknown host {} (not in /run/netns)", o.to));
    }
    let images = o.images.clone().unwrap_or_else(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0);
        PathBuf::from(format!("/var/tmp/vmi-migrate/{}-{t}", o.pid))
    });
    let _ = std::fs::remove_dir_all(&images);
    if let Err(e) = std::fs::create_dir_all(&images) {
        fail(&format!("cannot make {}: {e}", images.display()));
    }
    let mut r = Report {
        phases: Vec::new(),
        outcome: String::new(),
        ok: false,
        host: from.clone(),
        details: serde_json::Map::new(),
    };
    r.details.insert("from".into(), from.clone().into());
    r.details.insert("to".into(), o.to.clone().into());
    r.details.insert("processes".into(), pids.len().into());
    let code = run(&o, &from, &pids, &images, &mut r);
    r.print(&o);
    if code == 0 && !o.keep {
        let _ = std::fs::remove_dir_all(&images);
    }
    std::process::exit(code);
}

fn run(o: &Opts, from: &str, pids: &[i32], images: &Path, r: &mut Report) -> i32 {
    // 1. Freeze.
    let t = Instant::now();
    let mut frozen: Vec<i32> = Vec::new();
    let mut listeners: Vec<(i32, Vec<SocketAddr>)> = Vec::new();
    for &p in pids {
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            match ask_agent(from, &o.socket, &Msg::Freeze { pid: p as u32 }, Duration::from_secs(10)) {
                Ok(Msg::Frozen { listeners: l }) => {
                    frozen.push(p);
                    listeners.push((p, l));
                    break;
                }
                Ok(Msg::Error { reason }) if reason.starts_with("not under the layer") => break,
                Ok(Msg::Error { reason })
                    if reason.contains("not ready yet") && Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(50));
                }
                other => {
                    let why = match other {
                        Ok(Msg::Error { reason }) => reason,
                        Ok(m) => format!("unexpected answer {m:?}"),
                        Err(e) => e,
                    };
                    undo_freeze(o, from, &frozen);
                    r.outcome = format!("not migrated, still running on {from}: freeze failed: {why}");
                    return 1;
                }
            }
        }
    }
    r.details.insert("under_layer".into(), frozen.len().into());
    let t = r.phase("freeze", t);

    // 2. Dump.
    let shell_job = session_of(o.pid) != Some(o.pid);
    let mut dump: Vec<String> = ["dump", "-t", &o.pid.to_string(), "--tcp-close", "--skip-in-flight"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    if shell_job {
        dump.push("--shell-job".into());
    }
    if let Err(e) = criu(o, from, &dump, "dump.log", images) {
        undo_freeze(o, from, &frozen);
        r.outcome = format!("not migrated, still running on {from}: {e}");
        return 1;
    }
    r.details.insert("image_bytes".into(), dir_bytes(images).into());
    let t = r.phase("dump", t);

    // 3. Transfer: namespace hosts share the filesystem.
    let t = r.phase("transfer", t);

    // 4. Restore, on the target, else back on the source.
    let mut host = o.to.clone();
    if let Err(e) = criu_restore(o, &o.to, shell_job, "restore.log", images) {
        eprintln!("vmi-migrate: restore on {} failed; restoring on {from}:\n  {e}", o.to);
        if let Err(e2) = criu_restore(o, from, shell_job, "restore-back.log", images) {
            r.outcome = format!(
                "LOST: the restore failed on {} and on {from}; the image is kept in {}:\n  {e}\n  {e2}",
                o.to,
                images.display()
            );
            return 3;
        }
        host = from.to_string();
    }
    r.host = host.clone();
    let t = r.phase("restore", t);

    // The listeners now live at the new node: its old node forwards new connections there.
    if host != from {
        let to = match ask_agent(&host, &o.socket, &Msg::WhereAmI, Duration::from_secs(2)) {
            Ok(Msg::Here { addrs }) => addrs,
            _ => Vec::new(),
        };
        for (p, l) in &listeners {
            if l.is_empty() {
                continue;
            }
            let m = Msg::Moved { pid: *p as u32, listeners: l.clone(), to: to.clone() };
            if let Err(e) = ask_agent(from, &o.socket, &m, Duration::from_secs(2)) {
                eprintln!("vmi-migrate: the agent of {from} cannot forward the listeners of {p}: {e}");
            }
        }
    } else {
        for &p in &frozen {
            let _ = ask_agent(from, &o.socket, &Msg::Unfreeze { pid: p as u32 }, Duration::from_secs(2));
        }
    }

    // 5. Thaw; each process reports once its connections are rebuilt.
    let (mut conns, mut rebuilt, mut waiting, mut replayed, mut slowest) = (0u64, 0u64, 0u64, 0u64, 0u64);
    let mut problems = Vec::new();
    for &p in &frozen {
        match thaw(&host, &o.socket, p, o.thaw_timeout) {
            Ok(Msg::Thawed { conns: c, rebuilt: b, waiting: w, replayed: x, ms, .. }) => {
                conns += c as u64;
                rebuilt += b as u64;
                waiting += w as u64;
                replayed += x;
                slowest = slowest.max(ms as u64);
            }
            Ok(other) => problems.push(format!("process {p}: unexpected report {other:?}")),
            Err(e) => problems.push(e),
        }
    }
    r.phase("thaw", t);
    r.details.insert("connections".into(), conns.into());
    r.details.insert("rebuilt".into(), rebuilt.into());
    r.details.insert("waiting".into(), waiting.into());
    r.details.insert("bytes_replayed".into(), replayed.into());
    r.details.insert("reconnect_ms".into(), slowest.into());
    if host != o.to {
        r.outcome = format!("not migrated: the restore on {} failed; running again on {host}", o.to);
        return 1;
    }
    if !problems.is_empty() || waiting > 0 {
        r.outcome = format!(
            "migrated to {host}, but {waiting} connection(s) not rebuilt yet{}{}",
            if problems.is_empty() { "" } else { "; " },
            problems.join("; ")
        );
        r.ok = false;
        return 4;
    }
    r.ok = true;
    r.outcome = format!("migrated from {from} to {host}");
    0
}

/// The checkpoint did not happen: the processes go on where they are.
fn undo_freeze(o: &Opts, host: &str, frozen: &[i32]) {
    for &p in frozen {
        let _ = ask_agent(host, &o.socket, &Msg::Unfreeze { pid: p as u32 }, Duration::from_secs(2));
        if let Err(e) = thaw(host, &o.socket, p, Duration::from_secs(5)) {
            eprintln!("vmi-migrate: {e}");
        }
    }
}
