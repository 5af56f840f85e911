//! Per-core speed of each filter of the device chain, on one CPU, without a network:
//! frames of `--frame` bytes of text (the repository's own sources and documents, which
//! compress like most text) and of random bytes (which do not), encoded and decoded through
//! the chain, as the layer does with each frame it sends and receives.
//!
//!     filter-speed [--frame BYTES] [--seconds S] [--text FILE]
//!
//! Prints one JSON object per line: filter, data, encode and decode speed in GB/s of
//! original bytes, and the ratio of coded to original bytes.

use std::time::{Duration, Instant};
use substrate::connection::chain::Chain;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

/// Bytes of a xorshift stream.
fn noise(n: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Runs `f` over the frames of `data` until `secs` pass; bytes per second of input.
fn speed(data: &[u8], frame: usize, secs: f64, mut f: impl FnMut(u64, &[u8])) -> f64 {
    let t0 = Instant::now();
    let mut done = 0u64;
    let until = Duration::from_secs_f64(secs);
    'outer: loop {
        for (k, chunk) in data.chunks(frame).enumerate() {
            f((k * frame) as u64, chunk);
            done += chunk.len() as u64;
            if done % (64 << 20) < frame as u64 && t0.elapsed() >= until {
                break 'outer;
            }
        }
        if t0.elapsed() >= until {
            break;
        }
    }
    done as f64 / t0.elapsed().as_secs_f64()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let frame: usize = arg(&args, "--frame").and_then(|v| v.parse().ok()).unwrap_or(16 * 1024);
    let secs: f64 = arg(&args, "--seconds").and_then(|v| v.parse().ok()).unwrap_or(1.0);
    let text = match arg(&args, "--text") {
        Some(p) => std::fs::read(&p).unwrap_or_else(|e| panic!("{p}: {e}")),
        None => {
            eprintln!("filter-speed: --text FILE is needed (text that compresses like most text)");
            std::process::exit(2)
        }
    };
    let random = noise(text.len().max(8 << 20));
    let specs = [
        "",
        "double",
        "lz4",
        "zstd:1",
        "zstd:3",
        "aead:aes-256-gcm",
        "aead:chacha20-poly1305",
        "lz4,aead:aes-256-gcm",
    ];
    for spec in specs {
        for (what, data) in [("text", &text), ("random", &random)] {
            let mut enc = Chain::build(spec).expect("a filter of this build");
            let mut dec = Chain::build(spec).expect("a filter of this build");
            // (Sealing filters: one key, as both ends of a chain hold after its exchange.)
            enc.set_key(&[0x42; 32]);
            dec.set_key(&[0x42; 32]);
            let frames: Vec<(u64, Vec<u8>)> = data
                .chunks(frame)
                .enumerate()
                .map(|(k, c)| ((k * frame) as u64, enc.encode((k * frame) as u64, c)))
                .collect();
            let coded: usize = frames.iter().map(|(_, c)| c.len()).sum();
            let e = speed(data, frame, secs, |seq, c| {
                std::hint::black_box(enc.encode(seq, c));
            });
            let mut k = 0;
            let d = speed(data, frame, secs, |_, _| {
                let (seq, c) = &frames[k % frames.len()];
                k += 1;
                std::hint::black_box(dec.decode(*seq, c.clone()).expect("decodes"));
            });
            println!(
                "{{\"filter\": \"{}\", \"data\": \"{what}\", \"frame\": {frame}, \"encode_gbs\": {:.3}, \"decode_gbs\": {:.3}, \"ratio\": {:.4}}}",
                if spec.is_empty() { "none" } else { spec },
                e / 1e9,
                d / 1e9,
                coded as f64 / data.len() as f64
            );
        }
    }
}
