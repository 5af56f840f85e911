//! What `vmictl profile GID` prints: the `profile` device's figures of one connection end
//! (sent by its layer as JSON, see the preload's `tap.rs`) as a table, and as an SVG plot of
//! bytes per second over time in both directions.

use serde_json::Value;
use std::fmt::Write;

/// A size in bytes, short.
fn size(n: u64) -> String {
    match n {
        n if n >= 1 << 30 => format!("{} GiB", n >> 30),
        n if n >= 1 << 20 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 => format!("{} KiB", n >> 10),
        n => format!("{n} B"),
    }
}

/// A time in microseconds, short.
fn time_us(n: u64) -> String {
    match n {
        n if n >= 1_000_000 => format!("{} s", n / 1_000_000),
        n if n >= 1_000 => format!("{} ms", n / 1_000),
        n => format!("{n} us"),
    }
}

/// `[[low, count], ...]` as (low, count) pairs.
fn pairs(v: &Value) -> Vec<(u64, u64)> {
    v.as_array()
        .map(|a| a.iter().filter_map(|p| Some((p.get(0)?.as_u64()?, p.get(1)?.as_u64()?))).collect())
        .unwrap_or_default()
}

/// One histogram as rows: range, count, share, bar.
fn histogram(out: &mut String, title: &str, h: &[(u64, u64)], fmt: fn(u64) -> String) {
    let total: u64 = h.iter().map(|(_, c)| c).sum();
    let _ = writeln!(out, "  {title}");
    if total == 0 {
        let _ = writeln!(out, "    (none)");
        return;
    }
    for &(low, count) in h {
        let high = if low == 0 { 1 } else { 2 * low };
        let share = count as f64 / total as f64;
        let bar = "#".repeat(((share * 40.0).round() as usize).max(1));
        let _ = writeln!(
            out,
            "    {:>8} - {:<8} {count:>10} {:>6.1}%  {bar}",
            fmt(low),
            fmt(high),
            share * 100.0
        );
    }
}

/// The profile as a table.
pub fn table(v: &Value) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "connection {} (process {}), profiled for {:.1} s",
        v["gid"].as_str().unwrap_or("?"),
        v["pid"].as_u64().unwrap_or(0),
        v["seconds"].as_f64().unwrap_or(0.0)
    );
    for (dir, what) in [("send", "the program's sends"), ("recv", "the program's receives")] {
        let d = &v[dir];
        let calls = d["calls"].as_u64().unwrap_or(0);
        let bytes = d["bytes"].as_u64().unwrap_or(0);
        let secs = v["seconds"].as_f64().unwrap_or(0.0).max(1e-3);
        let _ = writeln!(
            out,
            "\n{what}: {calls} calls, {bytes} bytes ({} per call, {:.1} MB/s on average)",
            size(bytes.checked_div(calls).unwrap_or(0)),
            bytes as f64 / secs / 1e6
        );
        histogram(&mut out, "size of a call", &pairs(&d["sizes"]), size);
        histogram(&mut out, "time since the call before", &pairs(&d["gaps_us"]), time_us);
    }
    out
}

/// Bytes per second of both directions over time, as an SVG document.
pub fn svg(v: &Value) -> String {
    const W: f64 = 800.0;
    const H: f64 = 360.0;
    const L: f64 = 70.0;
    const B: f64 = 40.0;
    let series = [("send", "#1f77b4"), ("recv", "#d62728")];
    let data: Vec<Vec<(u64, u64)>> = series.iter().map(|(d, _)| pairs(&v[*d]["per_second"])).collect();
    let t_max = data.iter().flatten().map(|p| p.0).max().unwrap_or(0).max(1) as f64;
    let t_min = data.iter().flatten().map(|p| p.0).min().unwrap_or(0) as f64;
    let y_max = data.iter().flatten().map(|p| p.1).max().unwrap_or(0).max(1) as f64;
    let x = |t: f64| L + (t - t_min) / (t_max - t_min).max(1.0) * (W - L - 20.0);
    let y = |b: f64| H - B - b / y_max * (H - B - 30.0);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" font-family=\"sans-serif\" font-size=\"12\">"
    );
    let _ = writeln!(s, "<rect width=\"{W}\" height=\"{H}\" fill=\"white\"/>");
    let _ = writeln!(
        s,
        "<text x=\"{L}\" y=\"18\">connection {}: bytes per second (blue: sent, red: received)</text>",
        v["gid"].as_str().unwrap_or("?")
    );
    let _ = writeln!(
        s,
        "<line x1=\"{L}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/><line x1=\"{L}\" y1=\"30\" x2=\"{L}\" y2=\"{}\" stroke=\"black\"/>",
        H - B,
        W - 20.0,
        H - B,
        H - B
    );
    for k in 0..=4 {
        let b = y_max * k as f64 / 4.0;
        let _ = writeln!(
            s,
            "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}/s</text>",
            L - 6.0,
            y(b) + 4.0,
            size(b as u64)
        );
        let t = t_min + (t_max - t_min) * k as f64 / 4.0;
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{t:.0} s</text>",
            x(t),
            H - B + 18.0
        );
    }
    for ((_, color), pts) in series.iter().zip(&data) {
        if pts.is_empty() {
            continue;
        }
        let p: Vec<String> =
            pts.iter().map(|&(t, b)| format!("{:.1},{:.1}", x(t as f64), y(b as f64))).collect();
        let _ = writeln!(
            s,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>",
            p.join(" ")
        );
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_and_plots_show_both_directions() {
        let v: Value = serde_json::from_str(
            r#"{"gid": "ab", "pid": 7, "seconds": 2.0,
                "send": {"calls": 3, "bytes": 5200, "sizes": [[64, 2], [4096, 1]], "gaps_us": [[256, 1]], "per_second": [[0, 200], [1, 5000]]},
                "recv": {"calls": 0, "bytes": 0, "sizes": [], "gaps_us": [], "per_second": []}}"#,
        )
        .unwrap();
        let t = table(&v);
        assert!(t.contains("3 calls, 5200 bytes"), "{t}");
        assert!(t.contains("64 B - 128 B") && t.contains("66.7%"), "{t}");
        assert!(t.contains("4 KiB - 8 KiB"), "{t}");
        assert!(t.contains("(none)"), "{t}");
        let p = svg(&v);
        assert!(p.starts_with("<svg") && p.contains("<polyline") && p.trim_end().ends_with("</svg>"), "{p}");
        assert_eq!(p.matches("<polyline").count(), 1, "no line for a direction with nothing");
    }
}
