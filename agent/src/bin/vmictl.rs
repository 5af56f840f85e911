//! `vmictl`: look at the node through its agent.
//!
//! ```text
//! vmictl [--socket NAME] status [--json]
//! ```

use agent::wire::{read_msg, write_msg};
use agent::DEFAULT_SOCKET;
use serde_json::Value;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixStream};
use std::time::Duration;
use substrate::wire::agent::Msg;

const USAGE: &str = "usage: vmictl [--socket NAME] status [--json]

  status         the node's processes under the layer and every virtual connection
  --json         the same as one JSON object: {node, processes[], listeners[], connections[]}
                 each connection has gid, pid, local, peer, substrate, direction, bytes_sent,
                 bytes_received, msgs_sent, msgs_received, unacked_bytes, window, age_ms, error
  --socket NAME  the agent's abstract socket (default vmi-agent, or VMI_AGENT_SOCKET)";

fn fail(msg: &str) -> ! {
    eprintln!("vmictl: {msg}");
    std::process::exit(1)
}

fn human(n: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

fn print_table(v: &Value) {
    println!("node {}", v["node"].as_str().unwrap_or("?"));
    let procs = v["processes"].as_array().cloned().unwrap_or_default();
    println!("\nprocesses under the layer: {}", procs.len());
    for p in &procs {
        println!(
            "  {:>7}  {:<20} {} virtual connections",
            p["pid"],
            p["name"].as_str().unwrap_or(""),
            p["connections"]
        );
    }
    let ls = v["listeners"].as_array().cloned().unwrap_or_default();
    println!("\nlisteners: {}", ls.len());
    for l in &ls {
        println!("  {}", l["addr"].as_str().unwrap_or(""));
    }
    let cs = v["connections"].as_array().cloned().unwrap_or_default();
    println!("\nvirtual connections: {}", cs.len());
    if !cs.is_empty() {
        println!(
            "  {:<32}  {:>7}  {:<22} {:<3} {:<22} {:<5} {:>10} {:>10} {:>10}",
            "GID", "PID", "LOCAL", "", "PEER", "SUBST", "SENT", "RECEIVED", "UNACKED"
        );
    }
    for c in &cs {
        let arrow = if c["direction"] == "out" { "->" } else { "<-" };
        println!(
            "  {:<32}  {:>7}  {:<22} {:<3} {:<22} {:<5} {:>10} {:>10} {:>10}{}",
            c["gid"].as_str().unwrap_or(""),
            c["pid"],
            c["local"].as_str().unwrap_or(""),
            arrow,
            c["peer"].as_str().unwrap_or(""),
            c["substrate"].as_str().unwrap_or(""),
            human(c["bytes_sent"].as_u64().unwrap_or(0)),
            human(c["bytes_received"].as_u64().unwrap_or(0)),
            human(c["unacked_bytes"].as_u64().unwrap_or(0)),
            if c["error"].as_u64().unwrap_or(0) != 0 { "  BROKEN" } else { "" },
        );
    }
}

fn main() {
    let mut socket = std::env::var("VMI_AGENT_SOCKET").unwrap_or_else(|_| DEFAULT_SOCKET.into());
    let mut json = false;
    let mut cmd = None;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--socket" => socket = it.next().unwrap_or_else(|| fail("--socket needs a value")),
            "--json" => json = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return;
            }
            "status" => cmd = Some(a),
            other => fail(&format!("unknown argument {other}\n{USAGE}")),
        }
    }
    if cmd.is_none() {
        fail(USAGE);
    }
    let addr = UnixAddr::from_abstract_name(socket.as_bytes()).unwrap_or_else(|e| fail(&e.to_string()));
    let mut s = UnixStream::connect_addr(&addr)
        .unwrap_or_else(|e| fail(&format!("no agent on @{socket} in this network namespace: {e}")));
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    write_msg(&mut s, &Msg::Status).unwrap_or_else(|e| fail(&e.to_string()));
    let json_text = match read_msg(&mut s) {
        Ok(Msg::StatusReply { json }) => json,
        Ok(other) => fail(&format!("unexpected answer {other:?}")),
        Err(e) => fail(&e.to_string()),
    };
    if json {
        println!("{json_text}");
    } else {
        let v: Value = serde_json::from_str(&json_text).unwrap_or_else(|e| fail(&format!("bad report: {e}")));
        print_table(&v);
    }
}
