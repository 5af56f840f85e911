//! `irb-cost`: what one IRB costs per device on a chain (VMI 2.0 reported ~0.15 us per IRB).
//!
//! Builds chains of 0, 1, 2, 4 and 8 filters in front of a sink that completes at once, pushes
//! send and receive IRBs through them, and prints JSON: the time per IRB for each chain and,
//! per kind of filter, the slope (added nanoseconds per device).

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;
use substrate::devices::{CounterFilter, Counters, FaultInjector};
use substrate::irb::{Buf, Chain, Device, Dispatch, Disposition, Irb, Outcome};

/// Completes every send and receive with its full length.
struct NullSink;

impl Device for NullSink {
    fn name(&self) -> &'static str {
        "null"
    }
    fn dispatch<'a>(&mut self, irb: Irb<'a>, _cx: &mut Dispatch<'_>) -> Disposition<'a> {
        let n = match &irb.buf {
            Buf::Out(b) => b.len(),
            Buf::In(b) => b.len(),
            Buf::None => 0,
        };
        irb.complete(Ok(n))
    }
}

/// A filter that only passes IRBs on (the cheapest device possible).
struct PassThrough;

impl Device for PassThrough {
    fn name(&self) -> &'static str {
        "pass"
    }
}

/// Makes one filter of a kind.
type MakeDevice = Box<dyn Fn() -> Box<dyn Device>>;

fn chain(filters: usize, make: &dyn Fn() -> Box<dyn Device>) -> Chain {
    let mut c = Chain::new();
    for _ in 0..filters {
        let _ = c.attach(usize::MAX, make());
    }
    let _ = c.attach(usize::MAX, Box::new(NullSink));
    c
}

fn ns_per_irb(c: &mut Chain, iters: u64) -> f64 {
    let out = [7u8; 64];
    let mut inb = [0u8; 64];
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        for i in 0..iters {
            let irb = if i & 1 == 0 { Irb::send(&out, 0) } else { Irb::receive(&mut inb, 0) };
            match c.submit(black_box(irb)) {
                Outcome::Complete(done) => {
                    black_box(done.result().ok());
                }
                Outcome::Pending(_) => unreachable!(),
            }
        }
        best = best.min(t.elapsed().as_nanos() as f64 / iters as f64);
    }
    best
}

fn main() {
    let iters: u64 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(2_000_000);
    let counters = Arc::new(Counters::default());
    let kinds: Vec<(&str, MakeDevice)> = vec![
        ("pass", Box::new(|| Box::new(PassThrough) as Box<dyn Device>)),
        ("counter", {
            let c = counters.clone();
            Box::new(move || Box::new(CounterFilter::new(c.clone())) as Box<dyn Device>)
        }),
        ("fault (0%)", Box::new(|| Box::new(FaultInjector::new(1, 0, 0)) as Box<dyn Device>)),
    ];
    let sizes = [0usize, 1, 2, 4, 8];
    let mut devices = Vec::new();
    let mut chains = Vec::new();
    for (name, make) in &kinds {
        let mut pts = Vec::new();
        for &n in &sizes {
            let mut c = chain(n, make.as_ref());
            let t = ns_per_irb(&mut c, iters);
            pts.push((n as f64, t));
            chains.push(format!("{{\"filter\":\"{name}\",\"filters\":{n},\"ns_per_irb\":{t:.2}}}"));
        }
        // Least-squares slope: nanoseconds added per device.
        let k = pts.len() as f64;
        let (sx, sy) = pts.iter().fold((0.0, 0.0), |a, p| (a.0 + p.0, a.1 + p.1));
        let (sxx, sxy) = pts.iter().fold((0.0, 0.0), |a, p| (a.0 + p.0 * p.0, a.1 + p.0 * p.1));
        let slope = (k * sxy - sx * sy) / (k * sxx - sx * sx);
        devices.push(format!("{{\"name\":\"{name}\",\"ns_per_irb\":{slope:.2}}}"));
    }
    let sink_only = ns_per_irb(&mut chain(0, kinds[0].1.as_ref()), iters);
    println!(
        "{{\"iterations\":{iters},\"sink_only_ns\":{sink_only:.2},\"devices\":[{}],\"chains\":[{}]}}",
        devices.join(","),
        chains.join(",")
    );
}
