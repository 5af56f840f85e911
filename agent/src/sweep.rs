//! Shared-memory offers nobody will take. A connecting layer creates its offer
//! (`/dev/shm/vmi-<hash>`) before its SYN leaves, and the accepting layer unlinks it when it
//! takes it; if the connecting process is killed in between, the file would stay. The agent
//! looks now and then and removes offers still unanswered whose maker is gone (namespace
//! hosts share `/dev/shm`, so several agents may look at one file: removing it twice is
//! harmless).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};
use substrate::shmring::abandoned_offer;
use tracing::{debug, info};

/// An offer younger than this is left alone (its maker may be starting).
const MIN_AGE: Duration = Duration::from_secs(5);

fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 || *libc::__errno_location() == libc::EPERM }
}

/// Removes the abandoned offers in `dir` (file names `vmi-*`); returns how many.
pub fn sweep_once(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let mut removed = 0;
    for e in entries.flatten() {
        if !e.file_name().to_string_lossy().starts_with("vmi-") {
            continue;
        }
        let Ok(meta) = e.metadata() else { continue };
        let young = meta
            .modified()
            .ok()
            .and_then(|m| SystemTime::now().duration_since(m).ok())
            .is_none_or(|age| age < MIN_AGE);
        if !meta.is_file() || young {
            continue;
        }
        let mut head = [0u8; 24];
        let read = std::fs::File::open(e.path()).and_then(|mut f| f.read_exact(&mut head));
        if read.is_ok() && abandoned_offer(&head, alive) && std::fs::remove_file(e.path()).is_ok() {
            info!(
                "removed {}: a shared-memory offer whose process died before it was taken",
                e.path().display()
            );
            removed += 1;
        }
    }
    removed
}

/// Sweeps `dir` every `every`, in a thread of its own.
pub fn run(dir: PathBuf, every: Duration) {
    std::thread::spawn(move || loop {
        let n = sweep_once(&dir);
        if n > 0 {
            debug!("{n} abandoned offers removed from {}", dir.display());
        }
        std::thread::sleep(every);
    });
}
