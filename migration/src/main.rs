//! `vmi-migrate PID --to HOST`: moves a process that runs under the vmi layer (and the
//! processes it forked) to another host with CRIU, keeping its virtual connections.
//!
//! Phases, each timed:
//! 1. **freeze**: the source node's agent asks each process of the tree to get ready: it
//!    closes its Unix sockets to the agent (CRIU cannot restore their other end), makes its
//!    physical sockets reset rather than close gracefully when the process is killed, and
//!    waits on its *thaw socket*. Its connections are answered "moved" to dialers meanwhile.
//! 2. **dump**: `criu dump --tcp-close` in the source host's network namespace.
//! 3. **transfer**: the image to the target host: nothing to do between namespace hosts on
//!    one machine (they share the filesystem); a tar stream through `ssh` to another
//!    machine (`remote.rs`).
//! 4. **restore**: `criu restore --tcp-close` in the target host's network namespace. The
//!    restored sockets are closed; the layer rebuilds every virtual connection from there.
//! 5. **thaw**: each process is told to go on; it registers with the new node's agent, dials
//!    every peer, replays what the peer did not receive, and reports back.
//!
//! Failure is safe: a failed freeze or dump leaves the process running where it was (it is
//! thawed there); a failed restore on the target is retried on the source host.
//!
//! Hosts are named in `host.rs`: a namespace host (`ip netns list`), or `ssh:[USER@]HOST`.

mod criu;
mod host;
mod remote;
mod talk;

use host::Host;
use remote::Remote;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use substrate::wire::agent::Msg;
use talk::{ask_agent, thaw};

const USAGE: &str = "usage: vmi-migrate PID --to HOST [options]

Moves process PID (and its children), running under the vmi layer, to HOST with CRIU.
HOST is one of:
  NAME               a namespace host of this machine (/run/netns/NAME, `ip netns list`)
  ssh:[USER@]MACHINE another machine: the image goes there as a tar stream through the
                     remote shell, and that machine's vmi-migrate restores it; it needs
                     CRIU (scripts/install-criu.sh), vmi-migrate and a running vmi-agent

options:
  --from HOST        the host PID runs on (default: found from its network namespace;
                     a process outside every namespace host runs on this machine)
  --images DIR       where the checkpoint image goes (default /var/tmp/vmi-migrate/PID-TIME)
  --keep-images      keep the image after a successful migration
  --criu PATH        the criu to run (default $VMI_CRIU, /opt/vmi/criu/bin/criu, criu)
  --agent-socket N   the agents' abstract socket name (default $VMI_AGENT_SOCKET or vmi-agent)
  --json             print the report as one JSON object
  --thaw-timeout S   how long to wait for the processes' reports after the restore (30)
  --ssh CMD          the remote shell, split at spaces (default $VMI_SSH or ssh)
  --remote-migrate P vmi-migrate on the other machine (default: this one's path)
  --remote-images D  where the image goes on the other machine, a folder that does not
                     exist yet (default: the --images folder's name with .in appended)

Processes to migrate must be started with `nsenter --net=/run/netns/HOST` (not `ip netns
exec`, whose private mount namespace CRIU refuses), in their own session (setsid), with
their standard streams on files or /dev/null.";

fn fail(msg: &str) -> ! {
    eprintln!("vmi-migrate: {msg}");
    std::process::exit(2);
}

struct Opts {
    pid: i32,
    to: Host,
    from: Option<Host>,
    images: Option<PathBuf>,
    keep: bool,
    criu: String,
    socket: String,
    json: bool,
    thaw_timeout: Duration,
    ssh: Vec<String>,
    remote_migrate: Option<String>,
    remote_images: Option<PathBuf>,
}

/// What the command line asks for.
enum Mode {
    /// Move a process.
    Migrate(Opts),
    /// On the target machine: restore the image in this folder.
    RestoreHere { criu: String, images: PathBuf, shell_job: bool, socket: String },
    /// On the target machine: thaw these restored processes.
    ThawHere { pids: Vec<i32>, socket: String, timeout: Duration },
}

fn default_criu() -> String {
    std::env::var("VMI_CRIU").ok().unwrap_or_else(|| {
        if Path::new("/opt/vmi/criu/bin/criu").exists() {
            "/opt/vmi/criu/bin/criu".into()
        } else {
            "criu".into()
        }
    })
}

fn parse() -> Mode {
    let mut pid = None;
    let (mut to, mut from, mut images, mut keep, mut criu) = (None, None, None, false, None);
    let mut socket = std::env::var("VMI_AGENT_SOCKET").unwrap_or_else(|_| "vmi-agent".into());
    let mut json = false;
    let mut thaw_timeout = Duration::from_secs(30);
    let mut ssh = std::env::var("VMI_SSH").unwrap_or_else(|_| "ssh".into());
    let (mut remote_migrate, mut remote_images) = (None, None);
    let (mut restore_here, mut thaw_here, mut shell_job) = (None, None, false);
    let mut it = std::env::args().skip(1);
    let val = |it: &mut dyn Iterator<Item = String>, name: &str| {
        it.next().unwrap_or_else(|| fail(&format!("{name} needs a value\n{USAGE}")))
    };
    let host = |s: String| Host::parse(&s).unwrap_or_else(|e| fail(&e));
    while let Some(a) = it.next() {
        match a.as_str() {
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            "--to" => to = Some(host(val(&mut it, "--to"))),
            "--from" => from = Some(host(val(&mut it, "--from"))),
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
            "--ssh" => ssh = val(&mut it, "--ssh"),
            "--remote-migrate" => remote_migrate = Some(val(&mut it, "--remote-migrate")),
            "--remote-images" => remote_images = Some(PathBuf::from(val(&mut it, "--remote-images"))),
            "--restore-here" => restore_here = Some(PathBuf::from(val(&mut it, "--restore-here"))),
            "--shell-job" => shell_job = true,
            "--thaw-here" => {
                let s = val(&mut it, "--thaw-here");
                let pids: Option<Vec<i32>> =
                    s.split(',').map(|p| p.parse().ok().filter(|&n| n > 0)).collect();
                thaw_here = Some(pids.unwrap_or_else(|| fail(&format!("bad --thaw-here {s}"))));
            }
            p if pid.is_none() && p.parse::<i32>().is_ok_and(|n| n > 0) => pid = p.parse().ok(),
            other => fail(&format!("unknown argument {other}\n{USAGE}")),
        }
    }
    let criu = criu.unwrap_or_else(default_criu);
    if let Some(images) = restore_here {
        return Mode::RestoreHere { criu, images, shell_job, socket };
    }
    if let Some(pids) = thaw_here {
        return Mode::ThawHere { pids, socket, timeout: thaw_timeout };
    }
    let ssh: Vec<String> = ssh.split_whitespace().map(String::from).collect();
    if ssh.is_empty() {
        fail("--ssh is empty");
    }
    Mode::Migrate(Opts {
        pid: pid.unwrap_or_else(|| fail(&format!("which process?\n{USAGE}"))),
        to: to.unwrap_or_else(|| fail(&format!("--to HOST is required\n{USAGE}"))),
        from,
        images,
        keep,
        criu,
        socket,
        json,
        thaw_timeout,
        ssh,
        remote_migrate,
        remote_images,
    })
}

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
        criu::reap(&args[2]);
    }
    let o = match parse() {
        Mode::Migrate(o) => o,
        Mode::RestoreHere { criu, images, shell_job, socket } => {
            std::process::exit(remote::restore_here(&criu, &images, shell_job, &socket))
        }
        Mode::ThawHere { pids, socket, timeout } => {
            std::process::exit(remote::thaw_here(&pids, &socket, timeout))
        }
    };
    if !Path::new(&format!("/proc/{}", o.pid)).exists() {
        fail(&format!("no process {}", o.pid));
    }
    let pids = host::tree(o.pid);
    let from = o.from.clone().or_else(|| host::host_of(o.pid)).unwrap_or_else(|| {
        fail(&format!(
            "process {} is neither in a namespace host (`ip netns list`) nor in this command's \
             network namespace; use --from",
            o.pid
        ))
    });
    if matches!(from, Host::Remote(_)) {
        fail("--from: vmi-migrate runs on the machine the process runs on");
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
    let remote = match &o.to {
        Host::Remote(dest) => Some(Remote {
            dest: dest.clone(),
            shell: o.ssh.clone(),
            migrate: o.remote_migrate.clone().unwrap_or_else(|| {
                std::env::current_exe()
                    .map(|p| p.to_string_lossy().into_owned())
                    .unwrap_or("vmi-migrate".into())
            }),
            images: o.remote_images.clone().unwrap_or_else(|| {
                let mut there = images.clone().into_os_string();
                there.push(".in");
                PathBuf::from(there)
            }),
        }),
        _ => None,
    };
    if remote.as_ref().is_some_and(|rm| rm.images == images) {
        fail("--remote-images must differ from --images (both machines may share that folder)");
    }
    let mut r = Report {
        phases: Vec::new(),
        outcome: String::new(),
        ok: false,
        host: from.name(),
        details: serde_json::Map::new(),
    };
    r.details.insert("from".into(), from.name().into());
    r.details.insert("to".into(), o.to.name().into());
    r.details.insert("processes".into(), pids.len().into());
    let code = run(&o, &from, remote.as_ref(), &pids, &images, &mut r);
    r.print(&o);
    if code == 0 && !o.keep {
        let _ = std::fs::remove_dir_all(&images);
        if let Some(rm) = &remote {
            rm.clean();
        }
    }
    std::process::exit(code);
}

/// Each process's listeners, as the agent listed them at the freeze.
type Listeners = Vec<(i32, Vec<SocketAddr>)>;

fn freeze(o: &Opts, from: &Host, pids: &[i32]) -> Result<(Vec<i32>, Listeners), String> {
    let mut frozen: Vec<i32> = Vec::new();
    let mut listeners = Vec::new();
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
                    return Err(why);
                }
            }
        }
    }
    Ok((frozen, listeners))
}

fn run(o: &Opts, from: &Host, remote: Option<&Remote>, pids: &[i32], images: &Path, r: &mut Report) -> i32 {
    let fname = from.name();
    // 1. Freeze.
    let t = Instant::now();
    let (frozen, listeners) = match freeze(o, from, pids) {
        Ok(f) => f,
        Err(why) => {
            r.outcome = format!("not migrated, still running on {fname}: freeze failed: {why}");
            return 1;
        }
    };
    r.details.insert("under_layer".into(), frozen.len().into());
    let t = r.phase("freeze", t);

    // 2. Dump.
    let shell_job = host::session_of(o.pid) != Some(o.pid);
    let mut dump: Vec<String> = ["dump", "-t", &o.pid.to_string(), "--tcp-close", "--skip-in-flight"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    if shell_job {
        dump.push("--shell-job".into());
    }
    if let Err(e) = criu::criu(&o.criu, from, &dump, "dump.log", images) {
        undo_freeze(o, from, &frozen);
        r.outcome = format!("not migrated, still running on {fname}: {e}");
        return 1;
    }
    r.details.insert("image_bytes".into(), criu::dir_bytes(images).into());
    let t = r.phase("dump", t);

    // 3. Transfer: namespace hosts share the filesystem; another machine gets a tar stream.
    let mut failed_there = None;
    if let Some(rm) = remote {
        match rm.transfer(images) {
            Ok(n) => {
                r.details.insert("transferred_bytes".into(), n.into());
            }
            Err(e) => failed_there = Some(e),
        }
    }
    let t = r.phase("transfer", t);

    // 4. Restore, on the target, else back on the source.
    let mut here = None;
    if failed_there.is_none() {
        let res = match remote {
            Some(rm) => rm.restore(shell_job).map(Some),
            None => criu::restore(&o.criu, &o.to, shell_job, "restore.log", images).map(|_| None),
        };
        match res {
            Ok(addrs) => here = addrs,
            Err(e) => failed_there = Some(e),
        }
    }
    let mut host = o.to.clone();
    if let Some(e) = &failed_there {
        eprintln!("vmi-migrate: restore on {} failed; restoring on {fname}:\n  {e}", o.to.name());
        // A restore that failed half-way may have made the processes already: their pids
        // must be free again before the image can be restored here.
        wait_pids_free(pids, Duration::from_secs(10));
        if let Err(e2) = criu::restore(&o.criu, from, shell_job, "restore-back.log", images) {
            r.outcome = format!(
                "LOST: the restore failed on {} and on {fname}; the image is kept in {}:\n  {e}\n  {e2}",
                o.to.name(),
                images.display()
            );
            return 3;
        }
        host = from.clone();
    }
    r.host = host.name();
    let t = r.phase("restore", t);

    // The listeners now live at the new node: its old node forwards new connections there.
    if host != *from {
        let to = here.unwrap_or_else(|| {
            match ask_agent(&host, &o.socket, &Msg::WhereAmI, Duration::from_secs(2)) {
                Ok(Msg::Here { addrs }) => addrs,
                _ => Vec::new(),
            }
        });
        for (p, l) in &listeners {
            if l.is_empty() {
                continue;
            }
            let m = Msg::Moved { pid: *p as u32, listeners: l.clone(), to: to.clone() };
            if let Err(e) = ask_agent(from, &o.socket, &m, Duration::from_secs(2)) {
                eprintln!("vmi-migrate: the agent of {fname} cannot forward the listeners of {p}: {e}");
            }
        }
    } else {
        for &p in &frozen {
            let _ = ask_agent(from, &o.socket, &Msg::Unfreeze { pid: p as u32 }, Duration::from_secs(2));
        }
    }

    // 5. Thaw; each process reports once its connections are rebuilt.
    let reports: Vec<Result<Msg, String>> = match (remote, host == o.to) {
        (Some(rm), true) => rm.thaw(&frozen, &o.socket, o.thaw_timeout),
        _ => frozen.iter().map(|&p| thaw(&host, &o.socket, p, o.thaw_timeout)).collect(),
    };
    let (mut conns, mut rebuilt, mut waiting, mut replayed, mut slowest) = (0u64, 0u64, 0u64, 0u64, 0u64);
    let mut problems = Vec::new();
    for (&p, rep) in frozen.iter().zip(reports) {
        match rep {
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
        r.outcome = format!(
            "not migrated: the restore on {} failed ({}); running again on {}",
            o.to.name(),
            failed_there.unwrap_or_default().lines().next().unwrap_or(""),
            host.name()
        );
        return 1;
    }
    if !problems.is_empty() || waiting > 0 {
        r.outcome = format!(
            "migrated to {}, but {waiting} connection(s) not rebuilt yet{}{}",
            host.name(),
            if problems.is_empty() { "" } else { "; " },
            problems.join("; ")
        );
        r.ok = false;
        return 4;
    }
    r.ok = true;
    r.outcome = format!("migrated from {fname} to {}", host.name());
    0
}

/// Waits until no process has any of `pids` (or the time is up).
fn wait_pids_free(pids: &[i32], limit: Duration) {
    let deadline = Instant::now() + limit;
    while pids.iter().any(|p| Path::new(&format!("/proc/{p}")).exists()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The checkpoint did not happen: the processes go on where they are.
fn undo_freeze(o: &Opts, host: &Host, frozen: &[i32]) {
    for &p in frozen {
        let _ = ask_agent(host, &o.socket, &Msg::Unfreeze { pid: p as u32 }, Duration::from_secs(2));
        if let Err(e) = thaw(host, &o.socket, p, Duration::from_secs(5)) {
            eprintln!("vmi-migrate: {e}");
        }
    }
}
