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
