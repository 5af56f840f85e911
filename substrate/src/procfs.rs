//! Parsers of the `/proc` text the layer reads about its own process (outside input: the
//! kernel writes it, but its format is only a convention, so nothing here trusts it).

/// What `/proc/<pid>/status` says about the process's sandbox and threads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Status {
    /// `Seccomp:` 0 (none), 1 (strict), 2 (filter).
    pub seccomp: Option<u8>,
    /// `Seccomp_filters:` how many filters are stacked on the thread that read the file.
    pub seccomp_filters: Option<u32>,
    /// `NoNewPrivs:` set.
    pub no_new_privs: Option<bool>,
    /// `Threads:` threads of the process (a main thread that ended while others run is still
    /// counted, as a zombie).
    pub threads: Option<u32>,
}

/// Reads the fields of [`Status`] out of the text of a status file. Unknown lines, lines
/// without a value and values that do not parse are skipped.
pub fn parse_status(text: &[u8]) -> Status {
    let mut s = Status::default();
    for line in text.split(|&b| b == b'\n') {
        let Some(colon) = line.iter().position(|&b| b == b':') else { continue };
        let (key, rest) = (&line[..colon], &line[colon + 1..]);
        let value = std::str::from_utf8(rest).ok().map(str::trim).unwrap_or("");
        match key {
            b"Seccomp" => s.seccomp = value.parse().ok().filter(|&v: &u8| v <= 2),
            b"Seccomp_filters" => s.seccomp_filters = value.parse().ok(),
            b"NoNewPrivs" => s.no_new_privs = value.parse::<u8>().ok().map(|v| v != 0),
            b"Threads" => s.threads = value.parse().ok(),
            _ => {}
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_fields_of_a_real_status_file() {
        let text = b"Name:\tsshd\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t3224\nThreads:\t2\n\
NoNewPrivs:\t1\nSeccomp:\t2\nSeccomp_filters:\t1\nSpeculation_Store_Bypass:\tthread vulnerable\n";
        let s = parse_status(text);
        assert_eq!(s.seccomp, Some(2));
        assert_eq!(s.seccomp_filters, Some(1));
        assert_eq!(s.no_new_privs, Some(true));
        assert_eq!(s.threads, Some(2));
    }

    #[test]
    fn skips_what_does_not_parse() {
        let s = parse_status(b"Seccomp:\t7\nThreads:\tmany\nNoNewPrivs\n\xff\xfe:\x00\nSeccomp_filters:");
        assert_eq!(s, Status::default());
        assert_eq!(parse_status(b"Seccomp: 0").seccomp, Some(0));
    }
}

/// One target of an epoll instance, as `/proc/<pid>/fdinfo/<epfd>` lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EpollTarget {
    /// The registered descriptor (`tfd:`).
    pub fd: i32,
    /// Its events (`events:`, hexadecimal).
    pub events: u32,
    /// The program's data (`data:`, hexadecimal).
    pub data: u64,
    /// The inode of the file it was registered as (`ino:`, hexadecimal; missing in old
    /// kernels).
    pub ino: Option<u64>,
}

/// The targets listed in the fdinfo text of an epoll instance (lines such as
/// `tfd:        5 events:       19 data:                5  pos:0 ino:2f8a sdev:8`). Lines
/// that are not targets, or whose descriptor, events or data do not parse, are skipped.
pub fn parse_epoll_fdinfo(text: &str) -> Vec<EpollTarget> {
    let mut out = Vec::new();
    for line in text.lines().filter(|l| l.starts_with("tfd:")) {
        let mut it = line.split_whitespace();
        let mut field = |name: &str| -> Option<String> {
            while let Some(k) = it.next() {
                if k == name {
                    return it.next().map(str::to_string);
                }
                if let Some(v) = k.strip_prefix(name) {
                    return Some(v.to_string());
                }
            }
            None
        };
        let fd = field("tfd:").and_then(|v| v.parse::<i32>().ok());
        let events = field("events:").and_then(|v| u32::from_str_radix(&v, 16).ok());
        let data = field("data:").and_then(|v| u64::from_str_radix(&v, 16).ok());
        let ino = field("ino:").and_then(|v| u64::from_str_radix(&v, 16).ok());
        if let (Some(fd), Some(events), Some(data)) = (fd, events, data) {
            out.push(EpollTarget { fd, events, data, ino });
        }
    }
    out
}

#[cfg(test)]
mod fdinfo_tests {
    use super::*;

    #[test]
    fn targets_of_an_epoll_instance() {
        let text = "pos:\t0\nflags:\t02000002\nmnt_id:\t15\nino:\t1057\n\
                    tfd:        5 events:       19 data:                5  pos:0 ino:2f8a sdev:8\n\
                    tfd:       12 events: 80000019 data: ffffffffffffffff  pos:0 ino:2f9b sdev:8\n";
        let t = parse_epoll_fdinfo(text);
        assert_eq!(
            t,
            vec![
                EpollTarget { fd: 5, events: 0x19, data: 5, ino: Some(0x2f8a) },
                EpollTarget { fd: 12, events: 0x8000_0019, data: u64::MAX, ino: Some(0x2f9b) },
            ]
        );
    }

    #[test]
    fn old_kernels_and_garbage() {
        assert_eq!(
            parse_epoll_fdinfo("tfd: 7 events: 1 data: 0\n"),
            vec![EpollTarget { fd: 7, events: 1, data: 0, ino: None }]
        );
        assert!(parse_epoll_fdinfo("tfd: x events: 1 data: 0\ntfd: 3 events: zz data: 0\ntfd:\n").is_empty());
    }
}
