//! The node's sink plug-ins (`libvmi_sink_NAME.so` in the plug-in folder): each is probed once
//! at start, in the agent (never in the programs: a layer asks the agent what the node has,
//! so no program loads libibverbs to learn there is no RDMA device). What each said shows in
//! `vmictl status` and answers a layer's `Sink` question.

use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;
use tracing::{info, warn};
use vmi_sinks::plugin::{Devices, SinkPlugin};

/// What one sink plug-in said.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SinkInfo {
    /// Its name.
    pub name: String,
    /// Devices: > 0 usable, 0 none, < 0 the plug-in cannot work here.
    pub devices: i32,
    /// The probe's words (or why the plug-in was refused).
    pub why: String,
}

/// The probes' results (empty until they are done).
#[derive(Default)]
pub struct Sinks(Mutex<Option<Vec<SinkInfo>>>);

/// Longest a plug-in's probe may take before the agent goes on without it.
const PROBE_WAIT: Duration = Duration::from_secs(5);

/// The names of the sink plug-ins in `dir`, sorted.
pub fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| {
                let n = e.ok()?.file_name().into_string().ok()?;
                Some(n.strip_prefix("libvmi_sink_")?.strip_suffix(".so")?.to_string())
            })
            .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn probe_one(dir: &Path, name: &str) -> SinkInfo {
    let (devices, why) = match SinkPlugin::open(dir, name) {
        Err(e) => (-1, e),
        Ok(p) => match p.probe() {
            Devices::Some(n, w) => (n.min(i32::MAX as u32) as i32, w),
            Devices::None(w) => (0, w),
            Devices::Broken(w) => (-1, w),
        },
    };
    SinkInfo { name: name.to_string(), devices, why }
}

impl Sinks {
    /// Probes every sink plug-in of `dir`, each on a thread of its own (a plug-in that hangs
    /// costs the agent at most [`PROBE_WAIT`]), and logs one line for each.
    pub fn probe(&self, dir: &Path) {
        let mut found = Vec::new();
        for name in names(dir) {
            let (tx, rx) = std::sync::mpsc::channel();
            let (d, n) = (dir.to_path_buf(), name.clone());
            let _ = std::thread::Builder::new().name(format!("probe-{name}")).spawn(move || {
                let _ = tx.send(probe_one(&d, &n));
            });
            let s = rx.recv_timeout(PROBE_WAIT).unwrap_or_else(|_| SinkInfo {
                name: name.clone(),
                devices: -1,
                why: format!("the probe did not answer within {} s", PROBE_WAIT.as_secs()),
            });
            match s.devices {
                n if n > 0 => info!("sink {}: {} devices ({})", s.name, n, s.why),
                0 => info!("sink {}: {}; connections use the node's other substrates", s.name, s.why),
                _ => warn!("sink {}: refused: {}", s.name, s.why),
            }
            found.push(s);
        }
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(found);
    }

    /// What sink `name` said (`None`: not installed here, or not probed yet).
    pub fn get(&self, name: &str) -> Option<SinkInfo> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).as_ref()?.iter().find(|s| s.name == name).cloned()
    }

    /// Every sink plug-in's result, for `vmictl status`.
    pub fn all(&self) -> Vec<SinkInfo> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone().unwrap_or_default()
    }
}
