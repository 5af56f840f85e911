//! `sink-check`: the conformance tests every sink passes, between two processes (two hosts).
//!
//! ```text
//! sink-check probe --sink NAME [--plugins DIR]
//! sink-check serve --sink NAME [--plugins DIR] --ip IP --ctl IP:PORT
//! sink-check run   --sink NAME [--plugins DIR] --ctl IP:PORT --mode stream|pingpong
//!                  [--bytes N] [--cuts K] [--sizes 1,64,4096] [--reps R]
//! ```
//!
//! `serve` takes one control connection on `--ctl` (kernel TCP), where `run` says which test
//! it runs; `serve` answers with its sink endpoint's address, and the two run the connection
//! core over the sink's links (see `vmi_sinks::check`). Each prints one JSON line: what it
//! sent and read, the first wrong byte if any, whether the connection closed cleanly, and for
//! the ping-pong the median round trip per size. `sink` is `tcp` (kernel TCP, the reference)
//! or a plug-in `libvmi_sink_NAME.so` of `--plugins` (default: `VMI_PLUGINS`, or
//! `/usr/lib/vmi/plugins`).

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::exit;
use std::time::Duration;
use vmi_sinks::check::{run, Ends, Program, Side};
use vmi_sinks::plugin::{Devices, SinkPlugin};

fn usage(why: &str) -> ! {
    eprintln!(
        "sink-check: {why}\nusage: sink-check probe|serve|run --sink NAME [options] (see the source's head)"
    );
    exit(2)
}

struct Args {
    cmd: String,
    kv: std::collections::HashMap<String, String>,
}

impl Args {
    fn parse() -> Args {
        let mut it = std::env::args().skip(1);
        let cmd = it.next().unwrap_or_else(|| usage("no command"));
        let mut kv = std::collections::HashMap::new();
        while let Some(k) = it.next() {
            let Some(k) = k.strip_prefix("--") else { usage(&format!("unexpected {k}")) };
            let v = it.next().unwrap_or_else(|| usage(&format!("--{k} needs a value")));
            kv.insert(k.to_string(), v);
        }
        Args { cmd, kv }
    }

    fn get(&self, k: &str) -> Option<&str> {
        self.kv.get(k).map(String::as_str)
    }

    fn need(&self, k: &str) -> &str {
        self.get(k).unwrap_or_else(|| usage(&format!("--{k} is needed")))
    }

    fn num(&self, k: &str, default: u64) -> u64 {
        self.get(k).map_or(default, |v| v.parse().unwrap_or_else(|_| usage(&format!("--{k}: not a number"))))
    }
}

fn fail(what: &str, e: impl std::fmt::Display) -> ! {
    eprintln!("sink-check: {what}: {e}");
    exit(1)
}

fn main() {
    let a = Args::parse();
    let name = a.need("sink").to_string();
    let dir = PathBuf::from(
        a.get("plugins")
            .map(str::to_string)
            .or_else(|| std::env::var("VMI_PLUGINS").ok())
            .unwrap_or_else(|| "/usr/lib/vmi/plugins".into()),
    );
    if a.cmd == "probe" {
        if name == "tcp" {
            println!("{{\"sink\": \"tcp\", \"devices\": 1, \"why\": \"kernel TCP\"}}");
            return;
        }
        let p = SinkPlugin::open(&dir, &name).unwrap_or_else(|e| fail("open", e));
        let (n, why) = match p.probe() {
            Devices::Some(n, w) => (n as i64, w),
            Devices::None(w) => (0, w),
            Devices::Broken(w) => (-1, w),
        };
        println!("{{\"sink\": \"{name}\", \"devices\": {n}, \"why\": {:?}}}", why);
        return;
    }
    let sink = vmi_sinks::open(&name, &dir).unwrap_or_else(|e| fail("open", e));
    match a.cmd.as_str() {
        "serve" => {
            let ctl = TcpListener::bind(a.need("ctl")).unwrap_or_else(|e| fail("control port", e));
            println!("{{\"listening\": true}}");
            std::io::stdout().flush().ok();
            let (c, _) = ctl.accept().unwrap_or_else(|e| fail("control connection", e));
            let mut line = String::new();
            BufReader::new(&c).read_line(&mut line).unwrap_or_else(|e| fail("control", e));
            let words: Vec<&str> = line.split_whitespace().collect();
            let (listener, addr) = sink.listen(a.need("ip")).unwrap_or_else(|e| fail("listen", e));
            let hex: String = addr.iter().map(|b| format!("{b:02x}")).collect();
            (&c).write_all(format!("{hex}\n").as_bytes()).unwrap_or_else(|e| fail("control", e));
            let mut side =
                Side::new(sink.as_ref(), Ends::Take(listener)).unwrap_or_else(|e| fail("first link", e));
            let (mode, prog, total) = match words.as_slice() {
                ["stream", bytes, seed, peer_seed] => {
                    let n = |s: &str| s.parse::<u64>().unwrap_or_else(|_| fail("control", "a bad number"));
                    (
                        "stream",
                        Program::Stream { bytes: n(bytes), seed: n(seed), peer_seed: n(peer_seed) },
                        n(bytes),
                    )
                }
                ["pingpong"] => ("pingpong", Program::Echo, 0),
                _ => fail("control", format!("unknown test {line:?}")),
            };
            let r = run(&mut side, prog, 0, total).unwrap_or_else(|e| fail(mode, e));
            println!("{}", r.json(&name, "server", mode));
        }
        "run" => {
            let mut c = TcpStream::connect(a.need("ctl")).unwrap_or_else(|e| fail("control connection", e));
            let mode = a.need("mode").to_string();
            let bytes = a.num("bytes", 16 << 20);
            let cuts = a.num("cuts", 0) as u32;
            let seed = a.num("seed", 7);
            let sizes: Vec<usize> = a
                .get("sizes")
                .unwrap_or("1,64,1024,4096,65536")
                .split(',')
                .map(|s| s.parse().unwrap_or_else(|_| usage("--sizes: numbers separated by commas")))
                .collect();
            let reps = a.num("reps", 200) as usize;
            let ask = match mode.as_str() {
                "stream" => format!("stream {bytes} {seed} {}\n", seed + 1),
                "pingpong" => "pingpong\n".into(),
                _ => usage("--mode: stream or pingpong"),
            };
            c.write_all(ask.as_bytes()).unwrap_or_else(|e| fail("control", e));
            let mut line = String::new();
            BufReader::new(&c).read_line(&mut line).unwrap_or_else(|e| fail("control", e));
            let hex = line.trim();
            let addr: Vec<u8> = (0..hex.len() / 2)
                .map(|i| {
                    u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
                        .unwrap_or_else(|_| fail("control", "bad address"))
                })
                .collect();
            // A sink must refuse what is not an endpoint address, and an endpoint where
            // nothing listens, with an error (never a crash or a hang).
            for bad in [&b"\x01"[..], &[0xffu8; 300][..]] {
                if sink.connect(bad, Duration::from_secs(2)).is_ok() {
                    fail(
                        "conformance",
                        format!("a link to a {}-byte address that is no endpoint", bad.len()),
                    );
                }
            }
            let mut side =
                Side::new(sink.as_ref(), Ends::Dial { addr }).unwrap_or_else(|e| fail("first link", e));
            let (prog, total) = match mode.as_str() {
                "stream" => (Program::Stream { bytes, seed: seed + 1, peer_seed: seed }, bytes),
                _ => {
                    let total = sizes.iter().map(|&s| (s * reps) as u64).sum();
                    (Program::PingPong { sizes, reps, seed }, total)
                }
            };
            let r = run(&mut side, prog, cuts, total).unwrap_or_else(|e| fail(&mode, e));
            println!("{}", r.json(&name, "client", &mode));
        }
        other => usage(&format!("unknown command {other}")),
    }
}
