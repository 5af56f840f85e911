//! The cluster in a browser (`vmi-agent --web ADDR:PORT`): one self-contained page
//! (`web/index.html`, its script and style inline) that polls two read-only JSON endpoints
//! of this agent and draws the nodes, networks and paths, the connections with their rates
//! and the cluster's recent events.
//!
//! * `/`: the page.
//! * `/api/cluster`: what `vmictl --cluster status --json` prints, as root would see it (the
//!   view is the node operator's): `{node, nodes: [status report...], unreachable: [...]}`.
//! * `/api/events?since=N`: the cluster's events after number N (the newest [`EVENTS_MAX`]),
//!   `{node, last, via, events: [...]}`: every node's, as `vmictl --cluster events` reads
//!   them (through the cluster head, or from every node), each naming its `node`, numbered
//!   by this view (`seq`; the node's own number is `node_seq`); `last` is the N to ask with
//!   next time, `via` how they were read (head or fan-out).
//!
//! Nothing served changes anything. On a loopback address no token is needed, but requests
//! must name the server by an address or `localhost` (a web site that rebinds its own name to
//! 127.0.0.1 is refused). Anywhere else the agent does not start without a token
//! (`--web-token FILE`, a file only its owner may read); then every request carries it, as
//! `Authorization: Bearer TOKEN` or `?token=TOKEN` (the page keeps it for the browser tab and
//! sends the header). Tokens are compared as SHA-256 digests, in constant time. Refused
//! requests are counted and logged like every other refusal ([`crate::mesh::Refusals`]).

use crate::cluster::Merged;
use crate::local::{Agent, Asker};
use crate::mesh::Refused;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use substrate::wire::agent::Msg;
use subtle::ConstantTimeEq;
use tiny_http::{Header, Method, Request, Response};
use tracing::{info, warn};

/// The page.
pub const PAGE: &str = include_str!("web/index.html");

/// Events sent at most per answer (the newest).
pub const EVENTS_MAX: usize = 200;

/// How long an answer of `/api/cluster` is reused: every node is asked at most this often,
/// however many browsers watch.
const CLUSTER_CACHE: Duration = Duration::from_millis(500);

/// Other nodes' events are asked for at most this often, however many browsers watch.
const EVENTS_CACHE: Duration = Duration::from_millis(500);

/// Events of the cluster the view keeps (the newest).
const EVENTS_KEEP: usize = 2000;

/// The cluster's events as the view numbers them.
#[derive(Default)]
struct Events {
    merged: Merged,
    kept: VecDeque<Value>,
    next: u64,
    at: Option<Instant>,
}

/// Threads answering requests (a cluster status may wait for a slow node).
const WORKERS: usize = 4;

/// Shortest token accepted.
pub const TOKEN_MIN: usize = 16;

/// The web view's token, kept as its SHA-256 digest.
#[derive(Clone)]
pub struct Token {
    digest: [u8; 32],
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(..)")
    }
}

impl Token {
    /// A token from a file's text: 16 to 1024 visible ASCII characters (no spaces), blank
    /// space around them allowed.
    pub fn parse(text: &[u8]) -> Result<Token, String> {
        let t = std::str::from_utf8(text).map_err(|_| "the token file is not text".to_string())?.trim();
        if t.len() < TOKEN_MIN || t.len() > 1024 || !t.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(format!(
                "a web token is {TOKEN_MIN} to 1024 visible ASCII characters, no spaces (e.g. `head -c 32 /dev/urandom | sha256sum | cut -d' ' -f1`)"
            ));
        }
        Ok(Token { digest: Sha256::digest(t.as_bytes()).into() })
    }

    /// Reads the token from `path`, refusing a file others can read or write (as the cluster
    /// key).
    pub fn load(path: &Path) -> Result<Token, String> {
        let text = crate::mesh::read_private(path, "web token", "")?;
        Self::parse(&text).map_err(|e| format!("web token {}: {e}", path.display()))
    }

    /// True if `given` is the token (in constant time: the digests are compared).
    pub fn matches(&self, given: &str) -> bool {
        let d: [u8; 32] = Sha256::digest(given.trim().as_bytes()).into();
        d.ct_eq(&self.digest).into()
    }
}

/// The host part of a `Host` header (`[::1]:80` is `::1`, `a:80` is `a`).
fn host_of(h: &str) -> &str {
    let h = h.trim();
    if let Some(rest) = h.strip_prefix('[') {
        return rest.split(']').next().unwrap_or("");
    }
    match h.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') && port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => h,
    }
}

/// True if a request naming the server `host` (its `Host` header) may be answered without a
/// token: by address or as localhost, never by another name (DNS rebinding).
pub fn plain_host_ok(host: Option<&str>) -> bool {
    host.map(host_of).is_none_or(|h| h.parse::<IpAddr>().is_ok() || h.eq_ignore_ascii_case("localhost"))
}

/// The token a request carries: `Authorization: Bearer TOKEN`, else `?token=TOKEN`.
pub fn token_of(authorization: Option<&str>, query: &str) -> Option<String> {
    if let Some(a) = authorization {
        let a = a.trim();
        if let Some((scheme, t)) = a.split_once(' ') {
            if scheme.eq_ignore_ascii_case("bearer") {
                return Some(t.trim().to_string());
            }
        }
    }
    form_urlencoded::parse(query.as_bytes()).find(|(k, _)| k == "token").map(|(_, v)| v.into_owned())
}

struct View {
    agent: Arc<Agent>,
    token: Option<Token>,
    cluster: Mutex<Option<(Instant, String)>>,
    events: Mutex<Events>,
}

fn header(name: &str, value: &str) -> Header {
    Header::from_bytes(name.as_bytes(), value.as_bytes()).expect("a valid header")
}

/// Headers of every answer: nothing is cached, framed, sniffed, or sent on as a referrer.
fn common<R: std::io::Read>(r: Response<R>, content_type: &str) -> Response<R> {
    r.with_header(header("Content-Type", content_type))
        .with_header(header("Cache-Control", "no-store"))
        .with_header(header("X-Content-Type-Options", "nosniff"))
        .with_header(header("X-Frame-Options", "DENY"))
        .with_header(header("Referrer-Policy", "no-referrer"))
}

fn json_response(v: &str, code: u16) -> Response<std::io::Cursor<Vec<u8>>> {
    common(Response::from_string(v).with_status_code(code), "application/json")
}

/// What a browser gets instead of the page without the token: a form asking for it (the
/// page's own script, on a reload, asks with the token it kept).
const ASK_TOKEN: &str = r#"<!doctype html><html><head><meta charset="utf-8"><title>vmi: token needed</title>
<style>body{font:15px system-ui,sans-serif;margin:3em;color:#223}input{font:inherit;padding:.3em;width:28em}</style></head>
<body><h1>This view needs its token</h1><p>The agent serves its web view to holders of the token in its <code>web-token</code> file.</p>
<form method="get" action="/"><input type="password" name="token" placeholder="token" autofocus> <button>Open</button></form>
<script>try{var t=sessionStorage.getItem("vmi-token");if(t&&!sessionStorage.getItem("vmi-token-tried")){sessionStorage.setItem("vmi-token-tried","1");location.replace("/?token="+encodeURIComponent(t));}else{sessionStorage.removeItem("vmi-token-tried");}}catch(e){}</script>
</body></html>"#;

impl View {
    fn cluster(&self) -> String {
        let mut c = self.cluster.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((at, text)) = c.as_ref() {
            if at.elapsed() < CLUSTER_CACHE {
                return text.clone();
            }
        }
        // As `vmictl --cluster status` run by root on this node.
        let root = Asker { uid: Some(0), remote: false };
        let text = match crate::cluster::status(&self.agent, root) {
            Msg::StatusReply { json } => json,
            Msg::Error { reason } => json!({ "error": reason }).to_string(),
            other => json!({ "error": format!("answered {}", other.name()) }).to_string(),
        };
        *c = Some((Instant::now(), text.clone()));
        text
    }

    fn events(&self, query: &str) -> String {
        let since = form_urlencoded::parse(query.as_bytes())
            .find(|(k, _)| k == "since")
            .and_then(|(_, v)| v.parse::<u64>().ok())
            .unwrap_or(0);
        let mut ev = self.events.lock().unwrap_or_else(|e| e.into_inner());
        if ev.at.is_none_or(|t| t.elapsed() >= EVENTS_CACHE) {
            // As `vmictl --cluster events` run by root on this node.
            let root = Asker { uid: Some(0), remote: false };
            let new = ev.merged.pull(&self.agent, root, None);
            for mut e in new {
                ev.next += 1;
                let seq = ev.next;
                if let Some(o) = e.as_object_mut() {
                    let own = o.remove("seq").unwrap_or(Value::Null);
                    o.insert("node_seq".into(), own);
                    o.insert("seq".into(), seq.into());
                }
                ev.kept.push_back(e);
            }
            while ev.kept.len() > EVENTS_KEEP {
                ev.kept.pop_front();
            }
            ev.at = Some(Instant::now());
        }
        let newer: Vec<&Value> =
            ev.kept.iter().filter(|e| e["seq"].as_u64().is_some_and(|n| n > since)).collect();
        let skip = newer.len().saturating_sub(EVENTS_MAX);
        let events: Vec<Value> = newer.into_iter().skip(skip).cloned().collect();
        json!({ "node": self.agent.node, "last": ev.next, "via": ev.merged.via, "events": events })
            .to_string()
    }

    fn refuse(&self, req: &Request, what: &str) {
        let from = req.remote_addr().map_or_else(|| "?".into(), |a| a.to_string());
        let path = req.url().split('?').next().unwrap_or("").to_string();
        self.agent.refusals.note(Refused::Web, || format!("web view: {what} from {from} ({path})"));
    }

    fn answer(&self, req: Request) {
        let url = req.url().to_string();
        let (path, query) = url.split_once('?').unwrap_or((url.as_str(), ""));
        let wants_page = path == "/" || path == "/index.html";
        let get = |n: &'static str| {
            req.headers().iter().find(|h| h.field.equiv(n)).map(|h| h.value.as_str().to_string())
        };
        match &self.token {
            Some(t) => {
                let given = token_of(get("Authorization").as_deref(), query);
                if !given.is_some_and(|g| t.matches(&g)) {
                    self.refuse(&req, "a request without the token");
                    let r = if wants_page {
                        common(
                            Response::from_string(ASK_TOKEN).with_status_code(401),
                            "text/html; charset=utf-8",
                        )
                    } else {
                        json_response(
                            r#"{"error":"this view needs its token (Authorization: Bearer TOKEN)"}"#,
                            401,
                        )
                    };
                    let _ = req.respond(r.with_header(header("WWW-Authenticate", "Bearer realm=\"vmi\"")));
                    return;
                }
            }
            None => {
                if !plain_host_ok(get("Host").as_deref()) {
                    self.refuse(&req, "a request naming the server by another name than its address");
                    let _ = req.respond(json_response(
                        r#"{"error":"name the server by its address or as localhost"}"#,
                        421,
                    ));
                    return;
                }
            }
        }
        if !matches!(req.method(), Method::Get | Method::Head) {
            let _ = req.respond(
                json_response(r#"{"error":"read-only: GET only"}"#, 405)
                    .with_header(header("Allow", "GET, HEAD")),
            );
            return;
        }
        let r = match path {
            "/" | "/index.html" => common(Response::from_string(PAGE), "text/html; charset=utf-8").with_header(
                header(
                    "Content-Security-Policy",
                    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
                ),
            ),
            "/api/cluster" => json_response(&self.cluster(), 200),
            "/api/events" => json_response(&self.events(query), 200),
            _ => json_response(r#"{"error":"not here: /, /api/cluster, /api/events"}"#, 404),
        };
        let _ = req.respond(r);
    }
}

/// The address a browser on this node reaches the view at, for `vmictl web`.
pub fn url_of(addr: SocketAddr) -> String {
    let ip = match addr.ip() {
        IpAddr::V4(a) if a.is_unspecified() => IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
        IpAddr::V6(a) if a.is_unspecified() => IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    format!("http://{}/", SocketAddr::new(ip, addr.port()))
}

/// Serves the web view on `addr` from threads of their own; with `token`, only to requests
/// that carry it.
pub fn serve(agent: Arc<Agent>, addr: SocketAddr, token: Option<Token>) -> Result<(), String> {
    let server = Arc::new(tiny_http::Server::http(addr).map_err(|e| format!("web view on {addr}: {e}"))?);
    let url = url_of(addr);
    let _ = agent.web.set(json!({ "addr": addr.to_string(), "url": url, "token": token.is_some() }));
    info!(
        "web view at {url}{}",
        if token.is_some() {
            " (requests carry the token of web-token)"
        } else {
            " (no token: loopback only)"
        }
    );
    let view = Arc::new(View { agent, token, cluster: Mutex::new(None), events: Mutex::default() });
    for i in 0..WORKERS {
        let (server, view) = (server.clone(), view.clone());
        std::thread::Builder::new()
            .name(format!("web-{i}"))
            .spawn(move || loop {
                match server.recv() {
                    Ok(req) => view.answer(req),
                    Err(e) => {
                        warn!("web view: {e}");
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            })
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_checked_whole() {
        assert!(Token::parse(b"short").is_err());
        assert!(Token::parse(b"with a space in the middle").is_err());
        let t = Token::parse(b"  0123456789abcdef0123\n").unwrap();
        assert!(t.matches("0123456789abcdef0123"));
        assert!(!t.matches("0123456789abcdef012"));
        assert!(!t.matches("0123456789abcdef01234"));
        assert!(!t.matches(""));
    }

    #[test]
    fn the_token_comes_from_the_header_or_the_query() {
        assert_eq!(token_of(Some("Bearer abc"), ""), Some("abc".into()));
        assert_eq!(token_of(Some("bearer  abc "), "token=x"), Some("abc".into()));
        assert_eq!(token_of(None, "since=3&token=a%2Bb"), Some("a+b".into()));
        assert_eq!(token_of(Some("Basic xyz"), ""), None);
        assert_eq!(token_of(None, "since=3"), None);
    }

    #[test]
    fn without_a_token_the_server_is_named_by_its_address() {
        for ok in ["127.0.0.1:8080", "[::1]:8080", "localhost:1", "LOCALHOST", "127.0.0.1", "::1"] {
            assert!(plain_host_ok(Some(ok)), "{ok}");
        }
        assert!(plain_host_ok(None));
        for bad in ["evil.example:8080", "evil.example", "127.0.0.1.nip.io:80", ""] {
            assert!(!plain_host_ok(Some(bad)), "{bad}");
        }
    }

    #[test]
    fn the_page_is_self_contained() {
        assert!(PAGE.starts_with("<!doctype html>"));
        for outside in ["src=\"http", "href=\"http", "@import", "//cdn"] {
            assert!(!PAGE.contains(outside), "{outside}");
        }
        assert!(PAGE.contains("/api/cluster") && PAGE.contains("/api/events"));
    }

    #[test]
    fn urls_name_a_reachable_address() {
        assert_eq!(url_of("0.0.0.0:80".parse().unwrap()), "http://127.0.0.1:80/");
        assert_eq!(url_of("[::]:80".parse().unwrap()), "http://[::1]:80/");
        assert_eq!(url_of("10.0.0.1:8080".parse().unwrap()), "http://10.0.0.1:8080/");
    }
}
