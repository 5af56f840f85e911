//! The agent's settings: built-in defaults, then the configuration file (TOML,
//! `/etc/vmi/agent.toml` unless `--config` names another), then the environment
//! (`VMI_CLUSTER_KEY`, `VMI_LOG`), then the command line, each overriding the one before.
//!
//! Every command-line flag `--NAME VALUE` has a key `NAME = VALUE` in the file; the file
//! knows no other key (a misspelt key is an error, not a silent default). The parsing is
//! pure (no I/O besides [`load`]) so that it can be tested and fuzzed.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// The configuration file read when `--config` is not given (absent: built-in defaults).
pub const DEFAULT_CONFIG: &str = "/etc/vmi/agent.toml";
/// Default heartbeat period on every path, ms.
pub const DEFAULT_PROBE_INTERVAL_MS: u64 = crate::paths::DEFAULT_INTERVAL.as_millis() as u64;
/// Default silence after which a path is dead, ms.
pub const DEFAULT_DEAD_AFTER_MS: u64 = crate::paths::DEFAULT_DEAD_AFTER.as_millis() as u64;
/// Default period of the `/dev/shm` sweep, ms.
pub const DEFAULT_SWEEP_EVERY_MS: u64 = 30_000;
/// Default log filter.
pub const DEFAULT_LOG: &str = "info";
/// Most cluster heads one node pushes to.
pub const MAX_HEADS: usize = 8;
/// Most entries of a grid view.
pub const MAX_GRID: usize = 256;
/// Default number of TCP ports for rebuilt links (the agent port alone).
pub const DEFAULT_RELINK_PORTS: u16 = 1;
/// Most TCP ports for rebuilt links.
pub const MAX_RELINK_PORTS: u16 = 64;
/// Default address the agent listens on for other agents.
pub const DEFAULT_BIND: &str = "0.0.0.0";

/// The keys of the configuration file, each the name of a command-line flag without its
/// `--`, in the order the documentation lists them.
pub const KEYS: [&str; 24] = [
    "key",
    "peers",
    "head",
    "grid",
    "metrics",
    "web",
    "web-token",
    "socket",
    "port",
    "relink-ports",
    "setup-ports",
    "bind",
    "node",
    "probe-interval",
    "dead-after",
    "sweep-every",
    "directory",
    "directory-ttl",
    "directory-ca",
    "directory-cert",
    "directory-key",
    "chain",
    "plugins",
    "log",
];

/// Where device plug-ins are (the layers' `VMI_PLUGINS` default too).
pub const DEFAULT_PLUGINS: &str = "/usr/lib/vmi/plugins";

/// Most etcd endpoints of a directory.
pub const MAX_ENDPOINTS: usize = 16;
/// Longest lease time to live of the directory, seconds.
pub const MAX_DIRECTORY_TTL_S: u64 = 3600;

/// Where the cluster's directory is kept: nowhere (each agent knows what it sees, the
/// default), or in etcd.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum DirectorySpec {
    /// No directory.
    #[default]
    Off,
    /// etcd at these `HOST:PORT` endpoints.
    Etcd(Vec<String>),
}

impl DirectorySpec {
    /// The endpoints as the etcd client takes them (`http://HOST:PORT`).
    pub fn urls(&self) -> Vec<String> {
        self.urls_with("http")
    }

    /// The endpoints with a scheme (`https` when the agent talks TLS to etcd).
    pub fn urls_with(&self, scheme: &str) -> Vec<String> {
        match self {
            DirectorySpec::Off => Vec::new(),
            DirectorySpec::Etcd(e) => e.iter().map(|h| format!("{scheme}://{h}")).collect(),
        }
    }
}

impl FromStr for DirectorySpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let form = "etcd://HOST:PORT[,HOST:PORT..], e.g. etcd://10.0.0.5:2379,10.0.0.6:2379 (or off)";
        if s == "off" {
            return Ok(DirectorySpec::Off);
        }
        let Some(rest) = s.strip_prefix("etcd://") else {
            return Err(format!("{s:?}: not an etcd directory; the form is {form}"));
        };
        let mut out = Vec::new();
        for e in rest.split(',') {
            let e = e.trim();
            let (host, port) = match e.rsplit_once(':') {
                Some((h, p)) if !h.is_empty() => (h, p),
                _ => return Err(format!("{s:?}: endpoint {e:?} has no HOST:PORT ({form})")),
            };
            let port: u16 = port.parse().map_err(|_| {
                format!("{s:?}: endpoint {e:?}: port {port:?} is not a number from 1 to 65535 ({form})")
            })?;
            let bare = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
            let host_ok = bare.parse::<IpAddr>().is_ok()
                || (bare.len() <= 253
                    && bare.split('.').all(|l| {
                        !l.is_empty()
                            && l.len() <= 63
                            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                    }));
            if port == 0 || !host_ok || (bare != host && bare.parse::<std::net::Ipv6Addr>().is_err()) {
                return Err(format!(
                    "{s:?}: endpoint {e:?}: HOST is a name or an address and PORT 1 to 65535 ({form})"
                ));
            }
            out.push(e.to_string());
        }
        if out.len() > MAX_ENDPOINTS {
            return Err(format!("{s:?}: at most {MAX_ENDPOINTS} endpoints"));
        }
        Ok(DirectorySpec::Etcd(out))
    }
}

impl fmt::Display for DirectorySpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DirectorySpec::Off => f.write_str("off"),
            DirectorySpec::Etcd(e) => write!(f, "etcd://{}", e.join(",")),
        }
    }
}

/// The block of source ports the node's layers bind their connections to before `connect`
/// (so that the connection is announced with its source port, and the accepting side finds
/// it at once): none, or `first..=last`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetupPorts {
    /// No block: connections are announced without their source port, which follows.
    Off,
    /// Ports `first` to `last`.
    Range(u16, u16),
}

/// The default block: the top 2,000 ports of Linux's default ephemeral range, which the agent
/// reserves (`ip_local_reserved_ports`) so that the kernel gives them to no other socket.
pub const DEFAULT_SETUP_PORTS: SetupPorts = SetupPorts::Range(59000, 60999);

impl SetupPorts {
    /// First port and count (0: none).
    pub fn block(self) -> (u16, u16) {
        match self {
            SetupPorts::Off => (0, 0),
            SetupPorts::Range(a, b) => (a, b - a + 1),
        }
    }
}

impl FromStr for SetupPorts {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "off" {
            return Ok(SetupPorts::Off);
        }
        let bad = || format!("{s:?}: FIRST-LAST (ports from 1024 to 65535, at most 32768 of them), or off");
        let (a, b) = s.split_once('-').ok_or_else(bad)?;
        let (a, b): (u16, u16) = (a.trim().parse().map_err(|_| bad())?, b.trim().parse().map_err(|_| bad())?);
        if a < 1024 || b < a || b - a >= 32768 {
            return Err(bad());
        }
        Ok(SetupPorts::Range(a, b))
    }
}

impl fmt::Display for SetupPorts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SetupPorts::Off => f.write_str("off"),
            SetupPorts::Range(a, b) => write!(f, "{a}-{b}"),
        }
    }
}

/// Where Prometheus metrics are served: nowhere, or at an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metrics {
    /// No metrics (the default).
    Off,
    /// `http://ADDR:PORT/metrics`.
    At(SocketAddr),
}

impl FromStr for Metrics {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "off" {
            return Ok(Metrics::Off);
        }
        s.parse().map(Metrics::At).map_err(|e| format!("{s:?}: {e} (ADDR:PORT, or off)"))
    }
}

impl fmt::Display for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Metrics::Off => f.write_str("off"),
            Metrics::At(a) => write!(f, "{a}"),
        }
    }
}

/// Where the web view is served: nowhere, or at an address (`PORT` alone: on
/// [`DEFAULT_WEB_ADDR`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Web {
    /// No web view (the default).
    Off,
    /// `http://ADDR:PORT/`.
    At(SocketAddr),
}

/// Address the web view listens on when only a port is given.
pub const DEFAULT_WEB_ADDR: &str = "127.0.0.1";

impl FromStr for Web {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "off" {
            return Ok(Web::Off);
        }
        if let Ok(port) = s.parse::<u16>() {
            let ip: IpAddr = DEFAULT_WEB_ADDR.parse().expect("an address");
            return Ok(Web::At(SocketAddr::new(ip, port)));
        }
        s.parse().map(Web::At).map_err(|e| format!("{s:?}: {e} (ADDR:PORT, PORT, or off)"))
    }
}

impl fmt::Display for Web {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Web::Off => f.write_str("off"),
            Web::At(a) => write!(f, "{a}"),
        }
    }
}

/// One cluster of a grid view: `NAME=HEADADDR@KEYFILE` (`HEADADDR` an address, or
/// `ADDR:PORT` when that cluster's agents use another port; several entries of one name are
/// alternative heads, tried in order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GridMember {
    /// The cluster's name in reports.
    pub name: String,
    /// Its head's address.
    pub head: IpAddr,
    /// Its agents' port (`None`: this agent's port).
    pub port: Option<u16>,
    /// That cluster's key file.
    pub key: PathBuf,
}

impl FromStr for GridMember {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let form = "NAME=HEADADDR@KEYFILE, e.g. \"rack2=10.0.2.1@/etc/vmi/rack2.key\"";
        let (name, rest) = s.split_once('=').ok_or_else(|| format!("{s:?}: {form}"))?;
        let (head, key) = rest.split_once('@').ok_or_else(|| format!("{s:?}: {form}"))?;
        if name.is_empty()
            || name.len() > 64
            || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        {
            return Err(format!("{s:?}: the name is 1 to 64 letters, digits, '.', '_' or '-' ({form})"));
        }
        let (head, port) = match head.parse::<SocketAddr>() {
            Ok(a) if a.port() != 0 => (a.ip(), Some(a.port())),
            Ok(_) => return Err(format!("{s:?}: port 0")),
            Err(_) => {
                (head.parse::<IpAddr>().map_err(|e| format!("{s:?}: head {head:?}: {e} ({form})"))?, None)
            }
        };
        if key.is_empty() || key.contains('\0') {
            return Err(format!("{s:?}: no key file ({form})"));
        }
        Ok(GridMember { name: name.to_string(), head, port, key: key.into() })
    }
}

impl fmt::Display for GridMember {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.port {
            Some(p) => write!(f, "{}={}@{}", self.name, SocketAddr::new(self.head, p), self.key.display()),
            None => write!(f, "{}={}@{}", self.name, self.head, self.key.display()),
        }
    }
}

/// One source of settings, the file or the command line; `None`: not set there.
#[derive(Debug, Default, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Layer {
    /// The cluster key file.
    pub key: Option<PathBuf>,
    /// Other nodes of the cluster, probed from the start.
    pub peers: Option<Vec<IpAddr>>,
    /// Default chains of the node's connections (`CHAIN` or `NET/LEN=CHAIN` rules).
    pub chain: Option<Vec<String>>,
    /// The folder of device plug-ins.
    pub plugins: Option<PathBuf>,
    /// The cluster's heads (nodes push their summary there, queries go there first).
    pub head: Option<Vec<IpAddr>>,
    /// Clusters this agent shows as a grid.
    pub grid: Option<Vec<GridMember>>,
    /// Prometheus metrics.
    pub metrics: Option<Metrics>,
    /// The web view.
    pub web: Option<Web>,
    /// The file holding the web view's token.
    pub web_token: Option<PathBuf>,
    /// Abstract Unix socket the node's layers and `vmictl` use.
    pub socket: Option<String>,
    /// TCP and UDP port for other agents.
    pub port: Option<u16>,
    /// TCP ports for rebuilt links: `port` and the ones after it.
    pub relink_ports: Option<u16>,
    /// Source ports of the node's layers.
    pub setup_ports: Option<SetupPorts>,
    /// Address to listen on for other agents.
    pub bind: Option<IpAddr>,
    /// Name in reports.
    pub node: Option<String>,
    /// Heartbeat period, ms.
    pub probe_interval: Option<u64>,
    /// Silence after which a path is dead, ms.
    pub dead_after: Option<u64>,
    /// Period of the `/dev/shm` sweep, ms.
    pub sweep_every: Option<u64>,
    /// The cluster's directory (etcd).
    pub directory: Option<DirectorySpec>,
    /// The directory lease's time to live, seconds.
    pub directory_ttl: Option<u64>,
    /// CA certificates etcd's server certificate is checked against (TLS to etcd).
    pub directory_ca: Option<PathBuf>,
    /// The agent's client certificate for etcd, and its private key.
    pub directory_cert: Option<PathBuf>,
    pub directory_key: Option<PathBuf>,
    /// Log filter (tracing's `EnvFilter` syntax: `error`, `warn`, `info`, `debug`, ...).
    pub log: Option<String>,
}

/// The settings the agent runs with.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct Settings {
    /// The cluster key file.
    pub key: PathBuf,
    /// Other nodes of the cluster.
    pub peers: Vec<IpAddr>,
    /// Default chains of the node's connections, as rules (see
    /// `substrate::connection::chain::Policy`).
    pub chain: Vec<String>,
    /// The folder of device plug-ins (`libvmi_dev_NAME.so`): `vmictl device load NAME`
    /// takes NAME when its file is there.
    pub plugins: PathBuf,
    /// The cluster's heads.
    pub head: Vec<IpAddr>,
    /// Clusters of the grid view.
    pub grid: Vec<GridMember>,
    /// Prometheus metrics.
    pub metrics: Metrics,
    /// The web view.
    pub web: Web,
    /// The file holding the web view's token (`None`: no token asked for; only on a
    /// loopback address).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub web_token: Option<PathBuf>,
    /// Abstract Unix socket name.
    pub socket: String,
    /// Agent-to-agent port.
    pub port: u16,
    /// TCP ports `port` to `port + relink_ports - 1` take rebuilt links.
    pub relink_ports: u16,
    /// The block of source ports the node's layers bind their connections to.
    pub setup_ports: SetupPorts,
    /// Agent-to-agent address.
    pub bind: IpAddr,
    /// Name in reports (`None`: the node's first IPv4 address).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// Heartbeat period, ms.
    pub probe_interval: u64,
    /// Silence after which a path is dead, ms.
    pub dead_after: u64,
    /// Period of the `/dev/shm` sweep, ms.
    pub sweep_every: u64,
    /// The cluster's directory.
    pub directory: DirectorySpec,
    /// The directory lease's time to live, seconds.
    pub directory_ttl: u64,
    /// CA certificates of etcd's servers (`None`: plain TCP to etcd).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub directory_ca: Option<PathBuf>,
    /// The agent's client certificate for etcd (`None`: none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub directory_cert: Option<PathBuf>,
    /// Its private key (a file only its owner may read).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub directory_key: Option<PathBuf>,
    /// Log filter.
    pub log: String,
}

/// What the command line asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Run the agent.
    Run,
    /// Make a cluster key and exit (`--init`).
    Init,
    /// Check the settings and the cluster key, print the settings, exit (`--check-config`).
    Check,
    /// Print the usage (`--help`).
    Help,
    /// Print the version (`--version`).
    Version,
}

/// The command line.
#[derive(Debug, Clone, PartialEq)]
pub struct Cli {
    /// What to do.
    pub action: Action,
    /// `--config FILE`.
    pub config: Option<PathBuf>,
    /// Settings given as flags.
    pub layer: Layer,
}

fn value<T: FromStr>(flag: &str, v: &str) -> Result<T, String>
where
    T::Err: fmt::Display,
{
    v.parse().map_err(|e| format!("{flag} {v:?}: {e}"))
}

/// Parses the command line (without the program name). `--flag VALUE` and `--flag=VALUE`
/// are the same; a later flag overrides an earlier one, `--peers` adds up.
pub fn parse_args<I: IntoIterator<Item = String>>(args: I) -> Result<Cli, String> {
    let mut cli = Cli { action: Action::Run, config: None, layer: Layer::default() };
    let l = &mut cli.layer;
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        let takes_value =
            !matches!(flag.as_str(), "--init" | "--check-config" | "-h" | "--help" | "-V" | "--version");
        if !takes_value && inline.is_some() {
            return Err(format!("{flag} takes no value"));
        }
        let mut val = || -> Result<String, String> {
            match &inline {
                Some(v) => Ok(v.clone()),
                None => it.next().ok_or_else(|| format!("{flag} needs a value")),
            }
        };
        match flag.as_str() {
            "--init" => cli.action = Action::Init,
            "--check-config" => cli.action = Action::Check,
            "-h" | "--help" => cli.action = Action::Help,
            "-V" | "--version" => cli.action = Action::Version,
            "--config" => cli.config = Some(val()?.into()),
            "--key" => l.key = Some(val()?.into()),
            "--metrics" => l.metrics = Some(value(&flag, &val()?)?),
            "--web" => l.web = Some(value(&flag, &val()?)?),
            "--web-token" => l.web_token = Some(val()?.into()),
            "--plugins" => l.plugins = Some(val()?.into()),
            "--peers" => {
                let v = val()?;
                let peers = l.peers.get_or_insert_with(Vec::new);
                for p in v.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                    peers.push(value("--peers", p)?);
                }
            }
            "--chain" => {
                // (A chain holds commas: rules are separated by `;`, or given one per flag.)
                let v = val()?;
                let rules = l.chain.get_or_insert_with(Vec::new);
                rules.extend(v.split(';').map(str::trim).filter(|r| !r.is_empty()).map(String::from));
            }
            "--head" => {
                let v = val()?;
                let heads = l.head.get_or_insert_with(Vec::new);
                for h in v.split(',').map(str::trim).filter(|h| !h.is_empty()) {
                    heads.push(value("--head", h)?);
                }
            }
            "--grid" => {
                let v = val()?;
                l.grid.get_or_insert_with(Vec::new).push(value("--grid", &v)?);
            }
            "--socket" => l.socket = Some(val()?),
            "--port" => l.port = Some(value(&flag, &val()?)?),
            "--relink-ports" => l.relink_ports = Some(value(&flag, &val()?)?),
            "--setup-ports" => l.setup_ports = Some(value(&flag, &val()?)?),
            "--bind" => l.bind = Some(value(&flag, &val()?)?),
            "--node" => l.node = Some(val()?),
            "--probe-interval" => l.probe_interval = Some(value(&flag, &val()?)?),
            "--dead-after" => l.dead_after = Some(value(&flag, &val()?)?),
            "--sweep-every" => l.sweep_every = Some(value(&flag, &val()?)?),
            "--directory" => l.directory = Some(value(&flag, &val()?)?),
            "--directory-ttl" => l.directory_ttl = Some(value(&flag, &val()?)?),
            "--directory-ca" => l.directory_ca = Some(val()?.into()),
            "--directory-cert" => l.directory_cert = Some(val()?.into()),
            "--directory-key" => l.directory_key = Some(val()?.into()),
            "--log" => l.log = Some(val()?),
            other => return Err(format!("unknown argument {other:?}")),
        }
        if matches!(cli.action, Action::Help | Action::Version) {
            break;
        }
    }
    Ok(cli)
}

/// A configuration file that could not be read: where and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// 1-based line of the problem, when known.
    pub line: Option<usize>,
    /// The key it concerns, when known.
    pub key: Option<String>,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(l) = self.line {
            write!(f, "line {l}")?;
            if let Some(k) = &self.key {
                write!(f, ", key {k:?}")?;
            }
            f.write_str(": ")?;
        }
        f.write_str(&self.message)
    }
}

/// The key of the `key = value` line that holds byte `at` of `text` (a value may span
/// lines, an array of peers does): the nearest such line at or before it.
fn key_at(text: &str, at: usize) -> Option<String> {
    let at = at.min(text.len());
    let head = text.get(..at)?;
    let line_start = head.rfind('\n').map_or(0, |i| i + 1);
    let whole = &text[line_start..];
    let whole = whole[..whole.find('\n').unwrap_or(whole.len())].trim();
    if let Some(table) = whole.strip_prefix('[') {
        // A table: the agent's file has none, its name is the unknown key.
        let name = table.trim_start_matches('[').split(']').next().unwrap_or("").trim().trim_matches('"');
        return (!name.is_empty()).then(|| name.to_string());
    }
    if head[line_start..].trim().is_empty() {
        // The span starts the line: it is the key itself (an unknown or repeated key).
        let rest = &text[at..];
        let line = &rest[..rest.find('\n').unwrap_or(rest.len())];
        if let Some((k, _)) = line.split_once('=') {
            let k = k.trim().trim_matches('"');
            if !k.is_empty() && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
                return Some(k.to_string());
            }
        }
    }
    for line in text[..line_start.max(at)].lines().rev() {
        let line = line.trim_start();
        if line.starts_with('#') || line.starts_with('[') {
            continue;
        }
        if let Some((k, _)) = line.split_once('=') {
            let k = k.trim().trim_matches('"');
            if !k.is_empty() && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
                return Some(k.to_string());
            }
        }
    }
    None
}

/// Settings written as text (`FromStr` and `Display`) in the file and on the command line.
macro_rules! serde_as_text {
    ($($t:ty),*) => {$(
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }

        impl Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
    )*};
}

serde_as_text!(DirectorySpec, SetupPorts, Metrics, Web, GridMember);

/// The 1-based line of byte `at` of `text`.
fn line_of(text: &str, at: usize) -> usize {
    text.as_bytes()[..at.min(text.len())].iter().filter(|&&b| b == b'\n').count() + 1
}

/// Parses the text of a configuration file. Unknown keys, keys of the wrong type and
/// values out of range are errors that name their line and key.
pub fn parse(text: &str) -> Result<Layer, ConfigError> {
    toml::from_str::<Layer>(text).map_err(|e| {
        let span = e.span();
        ConfigError {
            line: span.as_ref().map(|s| line_of(text, s.start)),
            key: span.and_then(|s| key_at(text, s.start)),
            message: e.message().trim().to_string(),
        }
    })
}

/// A configuration file as read.
#[derive(Debug, Clone, Default)]
pub struct File {
    /// Its path (`None`: no file, built-in defaults).
    pub path: Option<PathBuf>,
    /// Its text.
    pub text: String,
    /// Its settings.
    pub layer: Layer,
}

impl File {
    /// Where `key` is set in this file, for messages: `FILE line N`.
    fn place(&self, key: &str) -> String {
        let path =
            self.path.as_deref().map_or_else(|| "the configuration file".into(), |p| p.display().to_string());
        let mut off = 0;
        for (i, line) in self.text.split_inclusive('\n').enumerate() {
            if key_at(&self.text, off + line.len() - line.trim_start().len()).as_deref() == Some(key)
                && line.contains('=')
            {
                return format!("{path} line {}", i + 1);
            }
            off += line.len();
        }
        path
    }
}

/// Reads the configuration file: `explicit` (`--config`), which must exist, or else
/// [`DEFAULT_CONFIG`] if it exists. An error names the file, and the line and key when the
/// problem is in its text.
pub fn load(explicit: Option<&Path>) -> Result<File, String> {
    let path = match explicit {
        Some(p) => p.to_path_buf(),
        None => {
            let p = PathBuf::from(DEFAULT_CONFIG);
            match std::fs::metadata(&p) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(File::default()),
                _ => p,
            }
        }
    };
    let text =
        std::fs::read_to_string(&path).map_err(|e| format!("configuration file {}: {e}", path.display()))?;
    let layer = parse(&text).map_err(|e| {
        format!("configuration file {}: {e} (see vmi-agent(8) or `vmi-agent --help`)", path.display())
    })?;
    Ok(File { path: Some(path), text, layer })
}

/// Chooses the first value set, and says where it came from.
fn pick<T: Clone>(
    key: &str,
    cli: &Option<T>,
    env: Option<(T, &str)>,
    file: &File,
    file_v: &Option<T>,
    default: T,
) -> (T, String) {
    if let Some(v) = cli {
        return (v.clone(), format!("--{key}"));
    }
    if let Some((v, name)) = env {
        return (v, format!("${name}"));
    }
    if let Some(v) = file_v {
        return (v.clone(), file.place(key));
    }
    (default, "default".into())
}

/// The settings from the command line `cli`, the environment (`env(NAME)`) and `file`, in
/// that order of precedence, checked.
pub fn resolve(cli: &Layer, env: impl Fn(&str) -> Option<String>, file: &File) -> Result<Settings, String> {
    let f = &file.layer;
    let env_key =
        env("VMI_CLUSTER_KEY").filter(|v| !v.is_empty()).map(|v| (PathBuf::from(v), "VMI_CLUSTER_KEY"));
    let env_log = env("VMI_LOG").filter(|v| !v.is_empty()).map(|v| (v, "VMI_LOG"));
    let (key, _) = pick("key", &cli.key, env_key, file, &f.key, PathBuf::from(crate::mesh::DEFAULT_KEY_PATH));
    let (peers, _) = pick("peers", &cli.peers, None, file, &f.peers, Vec::new());
    let (chain, chain_from) = pick("chain", &cli.chain, None, file, &f.chain, Vec::new());
    if let Err(e) = substrate::connection::chain::Policy::parse(chain.iter().map(String::as_str)) {
        return Err(format!("chain ({chain_from}): {e}"));
    }
    let (plugins, _) = pick("plugins", &cli.plugins, None, file, &f.plugins, PathBuf::from(DEFAULT_PLUGINS));
    let (head, head_from) = pick("head", &cli.head, None, file, &f.head, Vec::new());
    let (grid, grid_from) = pick("grid", &cli.grid, None, file, &f.grid, Vec::new());
    let (metrics, _) = pick("metrics", &cli.metrics, None, file, &f.metrics, Metrics::Off);
    let (web, web_from) = pick("web", &cli.web, None, file, &f.web, Web::Off);
    let web_token = cli.web_token.clone().or_else(|| f.web_token.clone());
    let (socket, socket_from) =
        pick("socket", &cli.socket, None, file, &f.socket, crate::DEFAULT_SOCKET.into());
    let (port, _) = pick("port", &cli.port, None, file, &f.port, crate::DEFAULT_PORT);
    let (relink_ports, rp_from) =
        pick("relink-ports", &cli.relink_ports, None, file, &f.relink_ports, DEFAULT_RELINK_PORTS);
    let (setup_ports, _) =
        pick("setup-ports", &cli.setup_ports, None, file, &f.setup_ports, DEFAULT_SETUP_PORTS);
    let (bind, _) = pick("bind", &cli.bind, None, file, &f.bind, DEFAULT_BIND.parse().expect("an address"));
    let node = cli.node.clone().or_else(|| f.node.clone());
    let (probe_interval, pi_from) =
        pick("probe-interval", &cli.probe_interval, None, file, &f.probe_interval, DEFAULT_PROBE_INTERVAL_MS);
    let (dead_after, da_from) =
        pick("dead-after", &cli.dead_after, None, file, &f.dead_after, DEFAULT_DEAD_AFTER_MS);
    let (sweep_every, sw_from) =
        pick("sweep-every", &cli.sweep_every, None, file, &f.sweep_every, DEFAULT_SWEEP_EVERY_MS);
    let (directory, _) = pick("directory", &cli.directory, None, file, &f.directory, DirectorySpec::Off);
    let (directory_ttl, ttl_from) = pick(
        "directory-ttl",
        &cli.directory_ttl,
        None,
        file,
        &f.directory_ttl,
        crate::registry::DEFAULT_TTL_S,
    );
    let (log, log_from) = pick("log", &cli.log, env_log, file, &f.log, DEFAULT_LOG.into());
    if key.as_os_str().is_empty() {
        return Err("key: an empty path".into());
    }
    if socket.is_empty() || socket.len() > 100 {
        return Err(format!("socket {socket:?} ({socket_from}): 1 to 100 bytes"));
    }
    if port == 0 {
        return Err("port 0: other agents must know the port, choose one (default 7787)".into());
    }
    if !(1..=MAX_RELINK_PORTS).contains(&relink_ports)
        || u32::from(port) + u32::from(relink_ports) - 1 > 65535
    {
        return Err(format!(
            "relink-ports {relink_ports} ({rp_from}): from 1 to {MAX_RELINK_PORTS}, and port {port} plus them must stay below 65536"
        ));
    }
    if node.as_deref() == Some("") {
        return Err("node: an empty name".into());
    }
    if probe_interval == 0 {
        return Err(format!("probe-interval 0 ({pi_from}): must be at least 1 ms"));
    }
    if dead_after <= probe_interval {
        return Err(format!(
            "dead-after {dead_after} ms ({da_from}) must be above probe-interval {probe_interval} ms ({pi_from}): a path is dead after missing several heartbeats"
        ));
    }
    if web_token.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
        return Err("web-token: an empty path".into());
    }
    if let Web::At(a) = web {
        if !a.ip().is_loopback() && web_token.is_none() {
            return Err(format!(
                "web {a} ({web_from}) is not a loopback address: anyone who reaches it could read the cluster's status, so it needs a token (web-token FILE, a file only its owner may read); or serve it on 127.0.0.1"
            ));
        }
    }
    if head.len() > MAX_HEADS {
        return Err(format!("head ({head_from}): at most {MAX_HEADS} heads"));
    }
    if grid.len() > MAX_GRID {
        return Err(format!("grid ({grid_from}): at most {MAX_GRID} entries"));
    }
    let directory_ca = cli.directory_ca.clone().or_else(|| f.directory_ca.clone());
    let directory_cert = cli.directory_cert.clone().or_else(|| f.directory_cert.clone());
    let directory_key = cli.directory_key.clone().or_else(|| f.directory_key.clone());
    for (k, v) in [
        ("directory-ca", &directory_ca),
        ("directory-cert", &directory_cert),
        ("directory-key", &directory_key),
    ] {
        if v.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
            return Err(format!("{k}: an empty path"));
        }
    }
    if directory_cert.is_some() != directory_key.is_some() {
        return Err("directory-cert and directory-key go together: the agent's client certificate for etcd and its private key".into());
    }
    if directory_cert.is_some() && directory_ca.is_none() {
        return Err("directory-cert needs directory-ca: the CA etcd's server certificate is checked against (a client certificate is only sent over TLS)".into());
    }
    if !(2..=MAX_DIRECTORY_TTL_S).contains(&directory_ttl) {
        return Err(format!(
            "directory-ttl {directory_ttl} ({ttl_from}): from 2 to {MAX_DIRECTORY_TTL_S} seconds (the agent renews its lease every third of it)"
        ));
    }
    if sweep_every == 0 {
        return Err(format!("sweep-every 0 ({sw_from}): must be at least 1 ms"));
    }
    // Targets and levels only: span and field filters compile patterns whose cost a crafted
    // value can make unbounded (a configuration of a few hundred bytes took gigabytes).
    if log.len() > 512 || !log.chars().all(|c| c.is_ascii_alphanumeric() || "_:=,-. ".contains(c)) {
        return Err(format!(
            "log {log:?} ({log_from}): a level (error, warn, info, debug, trace) or a list of target=level, at most 512 characters"
        ));
    }
    if let Err(e) = tracing_subscriber::EnvFilter::try_new(&log) {
        return Err(format!("log {log:?} ({log_from}): {e} (error, warn, info, debug, or a tracing filter)"));
    }
    Ok(Settings {
        key,
        peers,
        chain,
        plugins,
        head,
        grid,
        metrics,
        web,
        web_token,
        socket,
        port,
        relink_ports,
        setup_ports,
        bind,
        node,
        probe_interval,
        dead_after,
        sweep_every,
        directory,
        directory_ttl,
        directory_ca,
        directory_cert,
        directory_key,
        log,
    })
}

impl Settings {
    /// The settings as a configuration file (what `--check-config` prints).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_else(|e| format!("# cannot print the settings: {e}\n"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directory_values() {
        let d: DirectorySpec = "etcd://10.0.0.1:2379,etcd1:2379,[::1]:2379".parse().unwrap();
        assert_eq!(d.urls(), vec!["http://10.0.0.1:2379", "http://etcd1:2379", "http://[::1]:2379"]);
        assert_eq!(d.to_string(), "etcd://10.0.0.1:2379,etcd1:2379,[::1]:2379");
        assert_eq!("off".parse::<DirectorySpec>().unwrap(), DirectorySpec::Off);
        for bad in [
            "etcd:/x:1",
            "http://10.0.0.1:2379",
            "etcd://",
            "etcd://h",
            "etcd://h:0",
            "etcd://h:99999",
            "etcd://a b:1",
            "etcd://h:1,",
            "etcd://[zz]:1",
        ] {
            assert!(bad.parse::<DirectorySpec>().is_err(), "{bad}");
        }
        assert!(resolve(&args(&["--directory-ttl", "1"]).unwrap().layer, no_env, &File::default()).is_err());
        let s =
            resolve(&args(&["--directory", "etcd://h:1"]).unwrap().layer, no_env, &File::default()).unwrap();
        assert_eq!(
            (s.directory_ttl, s.directory.urls()),
            (crate::registry::DEFAULT_TTL_S, vec!["http://h:1".to_string()])
        );
        assert_eq!(s.directory.urls_with("https"), vec!["https://h:1".to_string()]);
        // TLS to etcd: a CA alone, or a CA with a client certificate and its key.
        let tls = |a: &[&str]| resolve(&args(a).unwrap().layer, no_env, &File::default());
        assert_eq!(tls(&["--directory-ca", "/ca"]).unwrap().directory_ca, Some("/ca".into()));
        let s = tls(&["--directory-ca", "/ca", "--directory-cert", "/c", "--directory-key", "/k"]).unwrap();
        assert_eq!((s.directory_cert, s.directory_key), (Some("/c".into()), Some("/k".into())));
        assert!(tls(&["--directory-ca", "/ca", "--directory-cert", "/c"])
            .unwrap_err()
            .contains("go together"));
        assert!(tls(&["--directory-ca", "/ca", "--directory-key", "/k"])
            .unwrap_err()
            .contains("go together"));
        assert!(tls(&["--directory-cert", "/c", "--directory-key", "/k"])
            .unwrap_err()
            .contains("needs directory-ca"));
        assert!(tls(&["--directory-ca", ""]).unwrap_err().contains("empty path"));
    }

    fn args(a: &[&str]) -> Result<Cli, String> {
        parse_args(a.iter().map(|s| s.to_string()))
    }

    fn file(text: &str) -> File {
        File {
            path: Some("/etc/vmi/agent.toml".into()),
            text: text.into(),
            layer: parse(text).expect("parses"),
        }
    }

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn an_empty_file_gives_the_defaults() {
        let s = resolve(&Layer::default(), no_env, &file("")).unwrap();
        assert_eq!(s.socket, "vmi-agent");
        assert_eq!(s.port, 7787);
        assert_eq!(s.probe_interval, 10);
        assert_eq!(s.dead_after, 50);
        assert_eq!(s.sweep_every, 30_000);
        assert_eq!(s.metrics, Metrics::Off);
        assert_eq!((s.web, s.web_token.as_ref()), (Web::Off, None));
        assert_eq!(s.key, PathBuf::from("/etc/vmi/cluster.key"));
        assert_eq!(s.log, "info");
        assert!(s.peers.is_empty() && s.node.is_none());
    }

    #[test]
    fn every_key_is_read_and_flags_override_it() {
        let text = r#"
key = "/k"
peers = ["10.0.0.2",
         "10.0.0.3"]
head = ["10.0.0.9"]
grid = ["a=10.0.1.1@/a.key", "b=[::1]:7000@/b.key"]
metrics = "127.0.0.1:9187"
web = "10.0.0.1:8080"
web-token = "/t"
socket = "s"
port = 7000
bind = "10.0.0.1"
node = "n1"
probe-interval = 20
dead-after = 100
sweep-every = 5000
log = "debug"
"#;
        let f = file(text);
        let s = resolve(&Layer::default(), no_env, &f).unwrap();
        assert_eq!(s.key, PathBuf::from("/k"));
        assert_eq!(s.peers.len(), 2);
        assert_eq!(s.head, vec!["10.0.0.9".parse::<IpAddr>().unwrap()]);
        assert_eq!(s.grid.len(), 2);
        assert_eq!((s.grid[0].name.as_str(), s.grid[0].port), ("a", None));
        assert_eq!((s.grid[1].head.to_string().as_str(), s.grid[1].port), ("::1", Some(7000)));
        assert_eq!(s.grid[1].key, PathBuf::from("/b.key"));
        assert_eq!(s.metrics, Metrics::At("127.0.0.1:9187".parse().unwrap()));
        assert_eq!(s.web, Web::At("10.0.0.1:8080".parse().unwrap()));
        assert_eq!(s.web_token, Some(PathBuf::from("/t")));
        assert_eq!((s.socket.as_str(), s.port, s.node.as_deref()), ("s", 7000, Some("n1")));
        assert_eq!((s.probe_interval, s.dead_after, s.sweep_every), (20, 100, 5000));
        let cli = args(&["--port=7001", "--socket", "t", "--metrics", "off", "--peers", "10.0.0.9"]).unwrap();
        let s = resolve(&cli.layer, no_env, &f).unwrap();
        assert_eq!((s.socket.as_str(), s.port, s.metrics), ("t", 7001, Metrics::Off));
        assert_eq!(s.peers, vec!["10.0.0.9".parse::<IpAddr>().unwrap()]);
        // The environment sits between the file and the flags.
        let env = |k: &str| (k == "VMI_CLUSTER_KEY").then(|| "/env.key".to_string());
        assert_eq!(resolve(&Layer::default(), env, &f).unwrap().key, PathBuf::from("/env.key"));
        let cli = args(&["--key", "/flag.key"]).unwrap();
        assert_eq!(resolve(&cli.layer, env, &f).unwrap().key, PathBuf::from("/flag.key"));
        // What --check-config prints reads back as the same settings.
        let again = file(&s.to_toml());
        assert_eq!(resolve(&Layer::default(), no_env, &again).unwrap(), s);
        // Source ports of layered connections: a block by default, off, or FIRST-LAST.
        assert_eq!(s.setup_ports, DEFAULT_SETUP_PORTS);
        assert_eq!(s.setup_ports.block(), (59000, 2000));
        let off = args(&["--setup-ports", "off"]).unwrap();
        assert_eq!(resolve(&off.layer, no_env, &f).unwrap().setup_ports.block(), (0, 0));
        let r = resolve(&Layer::default(), no_env, &file("setup-ports = \"40000-40099\"\n")).unwrap();
        assert_eq!(r.setup_ports.block(), (40000, 100));
        for bad in ["1-2", "5000-4000", "x", "4000-", "1024-65535", "60000"] {
            assert!(args(&["--setup-ports", bad]).is_err(), "{bad}");
        }
        // Relink ports: 1 by default, 1 to 64, and never past port 65535.
        assert_eq!(s.relink_ports, 1);
        let ok = args(&["--relink-ports", "4"]).unwrap();
        assert_eq!(resolve(&ok.layer, no_env, &f).unwrap().relink_ports, 4);
        for bad in [
            &["--relink-ports", "0"][..],
            &["--relink-ports", "65"],
            &["--port", "65534", "--relink-ports", "3"],
        ] {
            let e = resolve(&args(bad).unwrap().layer, no_env, &f).unwrap_err();
            assert!(e.contains("relink-ports"), "{bad:?}: {e}");
        }
        let last = args(&["--port", "65533", "--relink-ports", "3"]).unwrap();
        assert_eq!(resolve(&last.layer, no_env, &f).unwrap().relink_ports, 3);
    }

    #[test]
    fn a_bad_file_names_its_line_and_key() {
        let e = parse("port = 7787\nprot = 1\n").unwrap_err();
        assert_eq!((e.line, e.key.as_deref()), (Some(2), Some("prot")), "{e}");
        assert!(e.message.contains("unknown field"), "{e}");
        let e = parse("# c\n\nport = \"x\"\n").unwrap_err();
        assert_eq!((e.line, e.key.as_deref()), (Some(3), Some("port")), "{e}");
        let e = parse("port = 70000\n").unwrap_err();
        assert_eq!(e.key.as_deref(), Some("port"), "{e}");
        let e = parse("peers = [\n  \"10.0.0.1\",\n  \"nonsense\",\n]\n").unwrap_err();
        assert_eq!((e.line, e.key.as_deref()), (Some(3), Some("peers")), "{e}");
        let e = parse("metrics = \"localhost\"\n").unwrap_err();
        assert!(e.message.contains("ADDR:PORT"), "{e}");
        let e = parse("port = 1\nport = 2\n").unwrap_err();
        assert_eq!(e.line, Some(2), "{e}");
        let e = parse("[agent]\nport = 1\n").unwrap_err();
        assert_eq!((e.line, e.key.as_deref()), (Some(1), Some("agent")), "{e}");
        assert!(parse("port = ").is_err());
        for bad in [
            "x",
            "a=10.0.0.1",
            "a=nowhere@/k",
            "=10.0.0.1@/k",
            "a b=10.0.0.1@/k",
            "a=10.0.0.1@",
            "a=1.2.3.4:0@/k",
        ] {
            let e = parse(&format!("grid = [{bad:?}]\n")).unwrap_err();
            assert_eq!(e.key.as_deref(), Some("grid"), "{bad}: {e}");
        }
        let e = parse("head = [\"somewhere\"]\n").unwrap_err();
        assert_eq!(e.key.as_deref(), Some("head"), "{e}");
    }

    #[test]
    fn values_that_do_not_fit_together_are_refused_with_their_origin() {
        let f = file("# x\ndead-after = 5\n");
        let e = resolve(&Layer::default(), no_env, &f).unwrap_err();
        assert!(e.contains("/etc/vmi/agent.toml line 2") && e.contains("(default)"), "{e}");
        let cli = args(&["--probe-interval", "1"]).unwrap();
        assert!(resolve(&cli.layer, no_env, &f).is_ok());
        let e = resolve(&Layer::default(), no_env, &file("sweep-every = 0")).unwrap_err();
        assert!(e.contains("sweep-every 0"), "{e}");
        let e = resolve(&Layer::default(), no_env, &file("log = \"info,[\"")).unwrap_err();
        assert!(e.starts_with("log "), "{e}");
        assert!(resolve(&Layer::default(), no_env, &file("port = 0")).is_err());
        assert!(resolve(&Layer::default(), no_env, &file("socket = \"\"")).is_err());
    }

    #[test]
    fn the_web_view_beyond_loopback_needs_a_token() {
        let s = resolve(&Layer::default(), no_env, &file("web = \"8080\"")).unwrap();
        assert_eq!(s.web, Web::At("127.0.0.1:8080".parse().unwrap()));
        let s = resolve(&Layer::default(), no_env, &file("web = \"[::1]:8080\"")).unwrap();
        assert_eq!(s.web, Web::At("[::1]:8080".parse().unwrap()));
        let e = resolve(&Layer::default(), no_env, &file("web = \"0.0.0.0:8080\"\n")).unwrap_err();
        assert!(e.contains("needs a token") && e.contains("line 1"), "{e}");
        let cli = args(&["--web", "10.0.0.1:8080"]).unwrap();
        let e = resolve(&cli.layer, no_env, &file("")).unwrap_err();
        assert!(e.contains("(--web)"), "{e}");
        let cli = args(&["--web", "10.0.0.1:8080", "--web-token", "/t"]).unwrap();
        assert!(resolve(&cli.layer, no_env, &file("")).is_ok());
        assert!(args(&["--web", "localhost:80"]).is_err());
        assert!(parse("web = \"nowhere\"").unwrap_err().message.contains("ADDR:PORT"));
    }

    #[test]
    fn the_command_line() {
        assert_eq!(args(&["--help", "--bogus"]).unwrap().action, Action::Help);
        assert_eq!(args(&["--init", "--key", "/k"]).unwrap().action, Action::Init);
        assert_eq!(args(&["--check-config"]).unwrap().action, Action::Check);
        assert!(args(&["--bogus"]).unwrap_err().contains("unknown argument"));
        assert!(args(&["--port"]).unwrap_err().contains("needs a value"));
        assert!(args(&["--port", "x"]).is_err());
        assert!(args(&["--init=yes"]).is_err());
        let c = args(&["--config=/c", "--peers", "10.0.0.1,10.0.0.2", "--peers", "10.0.0.3"]).unwrap();
        assert_eq!(c.config, Some("/c".into()));
        assert_eq!(c.layer.peers.unwrap().len(), 3);
    }

    /// What the fuzz target `agent_config` checks, on a few texts.
    #[test]
    fn any_text_is_refused_on_one_of_its_lines_or_reads_back() {
        for text in [
            "",
            "port = 1\n",
            "a\n\n\n",
            "peers = [\"::1\", \"10.0.0.1\"]\nmetrics = \"[::1]:9\"\n",
            "node = \"n\\u0000\\n\"\n",
            "x = [",
            "log = 'debug'\nkey = '/k'",
        ] {
            match parse(text) {
                Err(e) => assert!(e.line.is_none_or(|l| l >= 1 && l <= text.lines().count() + 1), "{e}"),
                Ok(layer) => {
                    let file = File { path: None, text: text.to_string(), layer };
                    if let Ok(s) = resolve(&Layer::default(), |_| None, &file) {
                        let printed = s.to_toml();
                        let file =
                            File { path: None, layer: parse(&printed).expect("parses"), text: printed };
                        assert_eq!(resolve(&Layer::default(), |_| None, &file).expect("passes"), s);
                    }
                }
            }
        }
    }

    #[test]
    fn every_key_is_a_flag_and_a_field() {
        for k in KEYS {
            let v = match k {
                "peers" | "head" | "grid" | "chain" => format!("{k} = []"),
                "port" | "relink-ports" | "probe-interval" | "dead-after" | "sweep-every"
                | "directory-ttl" => {
                    format!("{k} = 1")
                }
                "directory" => format!("{k} = \"etcd://10.0.0.1:2379\""),
                "bind" => format!("{k} = \"127.0.0.1\""),
                "setup-ports" => format!("{k} = \"60000-60099\""),
                "metrics" | "web" => format!("{k} = \"off\""),
                _ => format!("{k} = \"x\""),
            };
            assert!(parse(&v).is_ok(), "{v}");
            let v1 = if k == "peers" || k == "head" {
                "10.0.0.1".to_string()
            } else if k == "grid" {
                "c=10.0.0.1@/k".to_string()
            } else if k == "chain" {
                "lz4;10.0.0.0/8=zstd:1".to_string()
            } else {
                v.split(" = ").nth(1).unwrap().trim_matches('"').to_string()
            };
            let c = args(&[&format!("--{k}"), &v1]).unwrap_or_else(|e| panic!("--{k}: {e}"));
            assert_ne!(c.layer, Layer::default(), "--{k}");
        }
    }
}
