//! Settings from the environment, read once at start:
//!
//! | variable | meaning | default |
//! | --- | --- | --- |
//! | `VMI_DISABLE` | `1`: the layer does nothing (every call goes straight to libc) | unset |
//! | `VMI_LOG` | `off`, `error`, `warn`, `info`, `debug` | `warn` |
//! | `VMI_WINDOW` | soft window per connection, bytes (`K`/`M` suffixes) | `2M` |
//! | `VMI_RING_FACTOR` | replay ring size as a multiple of the window (1-16) | `4` |
//! | `VMI_AGENT_SOCKET` | abstract Unix socket name of the node agent | `vmi-agent` |
//! | `VMI_SHM` | `1`: connections between two programs on one node go through shared memory; `0`: always TCP | `1` |
//! | `VMI_SUBSTRATE` | the substrate asked for: `tcp` (kernel TCP, no shared memory), `shm` (shared memory on one node, kernel TCP between nodes), or the name of a sink plug-in (`verbs`: `libvmi_sink_verbs.so`, see `plugins/vmi_sink.h`) for connections to other nodes; a sink the node has no device for is left with one log line, and kernel TCP carries the connection | `shm` |
//! | `VMI_SPLICE` | `1`: frames of 32 KiB and more go to the kernel from the replay ring by reference (`vmsplice`/`splice`: the program's bytes are copied once, into the ring); `auto`: only those of a send call of 512 KiB or more that begins with every byte acknowledged (a large message that waits for its answer: MPI's; a stream ahead of its receiver keeps the copy, cheaper for it here on veth: see ARCHITECTURE.md); `0`: always copied into the kernel as well | `auto` |
//! | `VMI_SHM_SPIN_US` | how long a receiver on shared memory (a receive, or an epoll wait that looks at the rings) spins before it sleeps, microseconds | `200` |
//! | `VMI_POLL_LOOK_US` | a `poll` with a zero time-out (a progress engine's busy loop) on connections over shared memory asks the kernel about its other descriptors at most this often, microseconds; between two looks it answers from the rings alone (an event from another thread or process is seen up to this much later; the thread's own writes and closes end the interval); `0`: every such call asks the kernel | `20` |
//! | `VMI_EPOLL_SCAN_MAX` | most shared-memory connections an epoll instance looks at itself before it sleeps (more: bells for all) | `512` |
//! | `VMI_CHAIN` | filters on what the program sends on each new virtual connection, names separated by commas (`lz4`, `zstd:LEVEL`, `double`), or `none`; offered to the peer's layer at set-up; overrides the node's default (the agent's `chain` setting); such connections stay on kernel TCP | the node's default, else none |
//! | `VMI_GRACE` | seconds a connection waits for a working network before it fails with `ETIMEDOUT` | `60` |
//! | `VMI_PLUGINS` | the folder of device plug-ins (`libvmi_dev_NAME.so`, see `plugins/vmi_device.h`) | `/usr/lib/vmi/plugins` |
//! | `VMI_REKEY` | how often a connection under an `aead` filter takes a new key: `SIZE[,SECONDS]` (bytes sealed, seconds), besides after every relink | `1G,600` |
//! | `VMI_TAMPER` | fault injection for tests of the `aead` filters: `flip:N`, `replay:N` or `foreign:N` alters the Nth sealed frame this process sends (a flipped bit, an earlier record, a record under another key); `share:N` the key share of the Nth chain offer | none |

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

static DISABLED: AtomicBool = AtomicBool::new(false);
/// Default soft window (bytes in flight before the sender waits for acknowledgements).
pub const DEFAULT_WINDOW: u64 = 2 << 20;
/// The replay ring is this many times the soft window (room used only when acks are stuck
/// behind unread data).
pub const DEFAULT_RING_FACTOR: u64 = 4;

static WINDOW: AtomicU64 = AtomicU64::new(DEFAULT_WINDOW);
static RING_FACTOR: AtomicU64 = AtomicU64::new(DEFAULT_RING_FACTOR);
static AGENT_SOCKET: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
static GRACE_MS: AtomicU64 = AtomicU64::new(60_000);
static SHM: AtomicBool = AtomicBool::new(true);
static SHM_SPIN_US: AtomicU64 = AtomicU64::new(200);
static POLL_LOOK_US: AtomicU64 = AtomicU64::new(20);
static EPOLL_SCAN_MAX: AtomicU64 = AtomicU64::new(512);
static CHAIN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
/// The sink plug-in `VMI_SUBSTRATE` named, if it named one.
static SINK: std::sync::OnceLock<String> = std::sync::OnceLock::new();
/// Where device plug-ins are looked for (`VMI_PLUGINS`).
pub const DEFAULT_PLUGINS: &str = "/usr/lib/vmi/plugins";
static REKEY_BYTES: AtomicU64 = AtomicU64::new(1 << 30);
static REKEY_MS: AtomicU64 = AtomicU64::new(600_000);

/// Parses a size such as `512K` or `4M`.
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last()? {
        (i, 'k' | 'K') => (&s[..i], 1u64 << 10),
        (i, 'm' | 'M') => (&s[..i], 1 << 20),
        (i, 'g' | 'G') => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    num.trim().parse::<u64>().ok()?.checked_mul(mult)
}

fn exe_name() -> String {
    std::fs::read_link("/proc/self/exe")
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_default()
}

/// Reads the environment.
pub fn init() {
    crate::log::init(std::env::var("VMI_LOG").ok().as_deref());
    let exe = exe_name();
    // The layer's own daemons are never under the layer.
    let own = matches!(exe.as_str(), "vmi-agent" | "vmictl");
    if own || std::env::var_os("VMI_DISABLE").is_some_and(|v| v == "1") {
        DISABLED.store(true, Relaxed);
    }
    if let Ok(w) = std::env::var("VMI_WINDOW") {
        match parse_size(&w) {
            Some(n) if (64 << 10..=1 << 30).contains(&n) => WINDOW.store(n, Relaxed),
            _ => crate::log::warn(format_args!(
                "VMI_WINDOW={w} is not a size between 64K and 1G; using the default"
            )),
        }
    }
    if let Ok(f) = std::env::var("VMI_RING_FACTOR") {
        match f.trim().parse::<u64>() {
            Ok(n) if (1..=16).contains(&n) => RING_FACTOR.store(n, Relaxed),
            _ => crate::log::warn(format_args!(
                "VMI_RING_FACTOR={f} is not between 1 and 16; using the default"
            )),
        }
    }
    if let Ok(g) = std::env::var("VMI_GRACE") {
        match g.trim().parse::<f64>() {
            Ok(x) if (0.1..=86400.0).contains(&x) => GRACE_MS.store((x * 1000.0) as u64, Relaxed),
            _ => crate::log::warn(format_args!(
                "VMI_GRACE={g} is not a number of seconds between 0.1 and 86400; using 60"
            )),
        }
    }
    if let Ok(v) = std::env::var("VMI_SHM") {
        match v.trim() {
            "1" => SHM.store(true, Relaxed),
            "0" | "" => SHM.store(false, Relaxed),
            _ => crate::log::warn(format_args!("VMI_SHM={v} is neither 0 nor 1; using 1")),
        }
    }
    if let Ok(v) = std::env::var("VMI_SUBSTRATE") {
        match v.trim() {
            "" | "shm" => {}
            "tcp" => SHM.store(false, Relaxed),
            name if name.len() <= 64
                && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') =>
            {
                let _ = SINK.set(name.to_string());
            }
            _ => crate::log::warn(format_args!(
                "VMI_SUBSTRATE={v} is not tcp, shm or the name of a sink plug-in; using the default"
            )),
        }
    }
    match std::env::var("VMI_SPLICE").as_deref().map(str::trim) {
        Ok("0") => {}
        Ok("1") => crate::sys::splice::turn_on(false),
        Ok("auto") | Ok("") | Err(_) => crate::sys::splice::turn_on(true),
        Ok(v) => {
            crate::log::warn(format_args!("VMI_SPLICE={v} is not 0, 1 or auto; using auto"));
            crate::sys::splice::turn_on(true);
        }
    }
    if let Ok(v) = std::env::var("VMI_SHM_SPIN_US") {
        match v.trim().parse::<u64>() {
            Ok(x) if x <= 1_000_000 => SHM_SPIN_US.store(x, Relaxed),
            _ => crate::log::warn(format_args!(
                "VMI_SHM_SPIN_US={v} is not a number of microseconds up to 1000000; using 200"
            )),
        }
    }
    if let Ok(v) = std::env::var("VMI_POLL_LOOK_US") {
        match v.trim().parse::<u64>() {
            Ok(x) if x <= 1_000_000 => POLL_LOOK_US.store(x, Relaxed),
            _ => crate::log::warn(format_args!(
                "VMI_POLL_LOOK_US={v} is not a number of microseconds up to 1000000; using 20"
            )),
        }
    }
    if let Ok(v) = std::env::var("VMI_EPOLL_SCAN_MAX") {
        match v.trim().parse::<u64>() {
            Ok(x) if x <= 65_536 => EPOLL_SCAN_MAX.store(x, Relaxed),
            _ => crate::log::warn(format_args!(
                "VMI_EPOLL_SCAN_MAX={v} is not a number of connections up to 65536; using 512"
            )),
        }
    }
    crate::sys::plugin::install(
        std::env::var("VMI_PLUGINS").ok().as_deref().filter(|d| !d.is_empty()).unwrap_or(DEFAULT_PLUGINS),
        |refused, m| if refused { crate::log::warn(m) } else { crate::log::info(m) },
    );
    if let Ok(v) = std::env::var("VMI_CHAIN") {
        // (`none`: no chain, whatever the node's default.)
        let spec = if v.trim() == "none" { "" } else { v.as_str() };
        match substrate::connection::Chain::build(spec).filter(|c| c.ids().is_some()) {
            Some(c) => {
                let _ = CHAIN.set(c.spec);
            }
            None => crate::log::warn(format_args!(
                "VMI_CHAIN={v} names a filter this build does not have (it has: {}), or more than {}; \
                 no chain",
                substrate::connection::chain::DEVICE_NAMES.join(", "),
                substrate::connection::chain::MAX_FILTERS
            )),
        }
    }
    if let Ok(v) = std::env::var("VMI_REKEY") {
        let (size, secs) = match v.split_once(',') {
            Some((a, b)) => (a, Some(b)),
            None => (v.as_str(), None),
        };
        let secs = secs.map(|s| s.trim().parse::<u64>().ok().filter(|&s| s > 0));
        match (parse_size(size).filter(|&b| b >= 4096), secs) {
            (Some(b), None) => REKEY_BYTES.store(b, Relaxed),
            (Some(b), Some(Some(s))) => {
                REKEY_BYTES.store(b, Relaxed);
                REKEY_MS.store(s.saturating_mul(1000), Relaxed);
            }
            _ => crate::log::warn(format_args!(
                "VMI_REKEY={v} is not SIZE[,SECONDS] (at least 4K, and a whole number of seconds); using 1G,600"
            )),
        }
    }
    crate::tamper::init(std::env::var("VMI_TAMPER").ok().as_deref());
    let _ = AGENT_SOCKET.set(std::env::var("VMI_AGENT_SOCKET").ok());
}

/// When a keyed chain takes a new key: after this many bytes sealed, or this many
/// milliseconds (`VMI_REKEY`).
pub fn rekey() -> (u64, u64) {
    (REKEY_BYTES.load(Relaxed), REKEY_MS.load(Relaxed))
}

/// The chain of filters `VMI_CHAIN` gives for what the program sends on each new virtual
/// connection (`Some("")` for `none`); `None` when it gives none (the node's default
/// applies, see `setup::chain_for`).
pub fn chain_env() -> Option<&'static str> {
    CHAIN.get().map(String::as_str)
}

/// The node agent's socket name, if `VMI_AGENT_SOCKET` gives one.
pub fn agent_socket() -> Option<String> {
    AGENT_SOCKET.get().cloned().flatten()
}

/// Most shared-memory connections an epoll instance scans (see the readiness module).
pub fn epoll_scan_max() -> usize {
    EPOLL_SCAN_MAX.load(Relaxed) as usize
}

/// The sink plug-in `VMI_SUBSTRATE` asked for, if any.
pub fn sink() -> Option<&'static str> {
    SINK.get().map(String::as_str)
}

/// True when same-node connections may use shared memory.
pub fn shm() -> bool {
    SHM.load(Relaxed)
}

/// How long a shared-memory receiver spins before it sleeps.
pub fn shm_spin_us() -> u64 {
    SHM_SPIN_US.load(Relaxed)
}

/// How often a zero-time-out `poll` on shared-memory connections asks the kernel.
pub fn poll_look_us() -> u64 {
    POLL_LOOK_US.load(Relaxed)
}

/// How long a connection waits for a working network, in milliseconds.
pub fn grace_ms() -> u64 {
    GRACE_MS.load(Relaxed)
}

/// True if the layer is switched off.
#[inline]
pub fn disabled() -> bool {
    DISABLED.load(Relaxed)
}

/// Replay ring size as a multiple of the window.
pub fn ring_factor() -> u64 {
    RING_FACTOR.load(Relaxed)
}

/// The soft window for new connections.
pub fn window() -> u64 {
    WINDOW.load(Relaxed)
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes() {
        assert_eq!(super::parse_size("4M"), Some(4 << 20));
        assert_eq!(super::parse_size("512k"), Some(512 << 10));
        assert_eq!(super::parse_size("1000"), Some(1000));
        assert_eq!(super::parse_size("x"), None);
    }
}
