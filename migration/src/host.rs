//! Hosts, and the process tree that moves.
//!
//! A host is one of:
//! - a **namespace host**: a network namespace as `ip netns list` shows it
//!   (`/run/netns/NAME`); every namespace host shares this machine's filesystem;
//! - **this machine**: the network namespace `vmi-migrate` itself runs in (a process not in
//!   a namespace host, on a real machine);
//! - a **remote machine**, `ssh:DEST`: reached with a remote shell (see `remote.rs`).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// Where a process runs, or will.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Host {
    /// A network namespace under `/run/netns`.
    Netns(String),
    /// The network namespace this command runs in.
    Here,
    /// Another machine, reached with the remote shell (`ssh:DEST`).
    Remote(String),
}

impl Host {
    /// Parses a `--to`/`--from` value.
    pub fn parse(s: &str) -> Result<Host, String> {
        if let Some(dest) = s.strip_prefix("ssh:") {
            if dest.is_empty() || dest.starts_with('-') || dest.contains(char::is_whitespace) {
                return Err(format!("bad remote host {s:?} (ssh:[USER@]HOST)"));
            }
            return Ok(Host::Remote(dest.to_string()));
        }
        if s == "." || s == "here" {
            return Ok(Host::Here);
        }
        if s.is_empty() || s.contains('/') || !netns_path(s).exists() {
            return Err(format!(
                "unknown host {s:?}: not a network namespace in /run/netns (`ip netns list`); \
                 a remote machine is named ssh:HOST"
            ));
        }
        Ok(Host::Netns(s.to_string()))
    }

    /// The namespace file to enter, if not the current one.
    pub fn ns(&self) -> Option<PathBuf> {
        match self {
            Host::Netns(n) => Some(netns_path(n)),
            Host::Here | Host::Remote(_) => None,
        }
    }

    /// The name reports use.
    pub fn name(&self) -> String {
        match self {
            Host::Netns(n) => n.clone(),
            Host::Here => "here".into(),
            Host::Remote(d) => format!("ssh:{d}"),
        }
    }
}

pub fn netns_path(host: &str) -> PathBuf {
    Path::new("/run/netns").join(host)
}

fn inode(p: &Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p).ok().map(|m| m.ino())
}

/// The host process `pid` runs in: a namespace host, or this machine if it shares this
/// command's network namespace.
pub fn host_of(pid: i32) -> Option<Host> {
    let ino = inode(&PathBuf::from(format!("/proc/{pid}/ns/net")))?;
    if inode(Path::new("/proc/self/ns/net")) == Some(ino) {
        return Some(Host::Here);
    }
    std::fs::read_dir("/run/netns")
        .ok()?
        .flatten()
        .find(|e| inode(&e.path()) == Some(ino))
        .map(|e| Host::Netns(e.file_name().to_string_lossy().into_owned()))
}

/// Runs `f` with this thread in the network namespace of `host` (sockets made inside stay
/// there), then comes back. This machine and remote hosts run `f` where it is.
pub fn in_host<T>(host: &Host, f: impl FnOnce() -> T) -> Result<T, String> {
    let Some(path) = host.ns() else { return Ok(f()) };
    let name = host.name();
    let home = File::open("/proc/thread-self/ns/net").map_err(|e| format!("own namespace: {e}"))?;
    let there = File::open(&path).map_err(|e| format!("host {name}: {e} (not in `ip netns list`?)"))?;
    // SAFETY: setns on a namespace file we opened.
    if unsafe { libc::setns(there.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(format!("cannot enter host {name}: {}", std::io::Error::last_os_error()));
    }
    let r = f();
    // SAFETY: as above, back home.
    if unsafe { libc::setns(home.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        crate::fail(&format!("cannot come back from host {name}: {}", std::io::Error::last_os_error()));
    }
    Ok(r)
}

/// PID and every descendant, parents first.
pub fn tree(pid: i32) -> Vec<i32> {
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

pub fn session_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split(' ').nth(3)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_parse() {
        assert_eq!(Host::parse("ssh:root@node7"), Ok(Host::Remote("root@node7".into())));
        assert_eq!(Host::parse("."), Ok(Host::Here));
        assert!(Host::parse("ssh:").is_err());
        assert!(Host::parse("ssh:-oProxyCommand=x").is_err());
        assert!(Host::parse("ssh:a b").is_err());
        assert!(Host::parse("../etc").is_err());
        assert!(Host::parse("no-such-namespace-host").is_err());
    }
}
