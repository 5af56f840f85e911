//! Agent messages on a stream: length prefix, body, and (on Unix sockets) one passed
//! descriptor riding with a message.

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use substrate::wire::agent::Msg;

/// Reads one message from any stream.
pub fn read_msg(r: &mut impl Read) -> io::Result<Msg> {
    let mut pre = [0u8; 4];
    r.read_exact(&mut pre)?;
    read_msg_after(pre, r)
}

/// Writes one message.
pub fn write_msg(w: &mut impl Write, m: &Msg) -> io::Result<()> {
    w.write_all(&m.encode())
}

/// One `recvmsg` into `buf` (again after EINTR): the bytes read (0 at the end of the stream)
/// and the descriptors that came with them.
fn recv_with_fds(fd: RawFd, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr() as *mut _, iov_len: buf.len() };
    let mut cbuf = [0u64; 8];
    // SAFETY: zeroed msghdr is valid; pointers set to live locals and `buf`.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr() as *mut _;
    msg.msg_controllen = std::mem::size_of_val(&cbuf);
    let r = loop {
        // SAFETY: msg is valid for the call.
        let r = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        break r as usize;
    };
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let n = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / 4;
                for i in 0..n {
                    let pfd = std::ptr::read_unaligned((libc::CMSG_DATA(c) as *const i32).add(i));
                    fds.push(OwnedFd::from_raw_fd(pfd));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok((r, fds))
}

/// Reads one message from a Unix socket, with a descriptor if one came along.
pub fn read_msg_fd(fd: RawFd) -> io::Result<(Msg, Option<OwnedFd>)> {
    let mut pre = [0u8; 4];
    let mut got = 0;
    let mut passed = None;
    while got < 4 {
        let (r, fds) = recv_with_fds(fd, &mut pre[got..])?;
        if r == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        if let Some(f) = fds.into_iter().last() {
            passed = Some(f);
        }
        got += r;
    }
    let n = Msg::body_len(pre).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
    let mut body = vec![0u8; n];
    // SAFETY: the socket stays open for the call; we only read.
    let mut f = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(fd) });
    f.read_exact(&mut body)?;
    let m = Msg::decode(&body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
    Ok((m, passed))
}

/// Reads messages from a Unix socket whose writer sends many in one write (a layer's event
/// channel: holds, releases, ends of streams in batches): one `recvmsg` of up to 64 KiB
/// takes a batch, where [`read_msg_fd`] makes two calls per message. A descriptor that
/// comes along belongs to the message holding the last byte of the read it came with (the
/// kernel ends a read after the data that carried descriptors, and each message with one
/// is written alone).
#[derive(Default)]
pub struct MsgReader {
    buf: Vec<u8>,
    /// Unread bytes are `buf[start..]`.
    start: usize,
    /// A descriptor and the offset in `buf` of the last byte of the read it came with.
    fds: std::collections::VecDeque<(usize, OwnedFd)>,
}

/// Bytes asked for per read.
const READ_CHUNK: usize = 64 << 10;

impl MsgReader {
    /// The next message on `fd`, waiting for it (the socket is blocking), with a descriptor
    /// if one came along.
    pub fn next(&mut self, fd: RawFd) -> io::Result<(Msg, Option<OwnedFd>)> {
        loop {
            if let Some(x) = self.take()? {
                return Ok(x);
            }
            self.fill(fd)?;
        }
    }

    /// A whole message from the buffer, if there is one.
    fn take(&mut self) -> io::Result<Option<(Msg, Option<OwnedFd>)>> {
        let have = &self.buf[self.start..];
        if have.len() < 4 {
            return Ok(None);
        }
        let n = Msg::body_len([have[0], have[1], have[2], have[3]])
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
        if have.len() < 4 + n {
            return Ok(None);
        }
        let m = Msg::decode(&have[4..4 + n])
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
        let end = self.start + 4 + n;
        let mut passed = None;
        while self.fds.front().is_some_and(|(at, _)| *at < end) {
            if let Some((_, f)) = self.fds.pop_front() {
                // (Two with one message: the last is kept, the other closed.)
                passed = Some(f);
            }
        }
        self.start = end;
        Ok(Some((m, passed)))
    }

    /// One read into the buffer (compacted first).
    fn fill(&mut self, fd: RawFd) -> io::Result<()> {
        if self.start > 0 {
            self.buf.drain(..self.start);
            for (at, _) in self.fds.iter_mut() {
                *at -= self.start;
            }
            self.start = 0;
        }
        let old = self.buf.len();
        self.buf.resize(old + READ_CHUNK, 0);
        let (r, fds) = match recv_with_fds(fd, &mut self.buf[old..]) {
            Ok((0, _)) => Err(io::ErrorKind::UnexpectedEof.into()),
            x => x,
        }
        .inspect_err(|_| self.buf.truncate(old))?;
        self.buf.truncate(old + r);
        let last = old + r - 1;
        self.fds.extend(fds.into_iter().map(|f| (last, f)));
        Ok(())
    }
}

/// Reads the rest of one message whose 4-byte length prefix was read already.
pub fn read_msg_after(pre: [u8; 4], r: &mut impl Read) -> io::Result<Msg> {
    read_msg_limited(pre, r, usize::MAX)
}

/// Reads the rest of one message whose 4-byte length prefix was read already, refusing a
/// body over `max` bytes before reading it.
pub fn read_msg_limited(pre: [u8; 4], r: &mut impl Read, max: usize) -> io::Result<Msg> {
    let n = Msg::body_len(pre).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
    if n > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a {n}-byte message where at most {max} are taken"),
        ));
    }
    let mut body = vec![0u8; n];
    r.read_exact(&mut body)?;
    Msg::decode(&body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))
}

/// Writes one encoded message `body` on a Unix socket, with descriptor `fd` riding along.
pub fn send_with_fd(s: &UnixStream, body: &[u8], fd: Option<RawFd>) -> io::Result<()> {
    let mut iov = libc::iovec { iov_base: body.as_ptr() as *mut _, iov_len: body.len() };
    // SAFETY: zeroed msghdr is valid; pointers set to live locals below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    let mut cbuf = [0u64; 4];
    if let Some(pfd) = fd {
        msg.msg_control = cbuf.as_mut_ptr() as *mut _;
        // SAFETY: CMSG_SPACE is a pure computation.
        msg.msg_controllen = unsafe { libc::CMSG_SPACE(4) } as _;
        // SAFETY: the control buffer holds one int.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(4) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut i32, pfd);
        }
    }
    // SAFETY: msg is fully initialised.
    let r = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // The rest (rare: a full socket buffer) without the descriptor.
    let mut w = s;
    w.write_all(&body[r as usize..])
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_batch_is_read_whole_and_a_passed_descriptor_goes_with_its_message() {
        let (a, b) = UnixStream::pair().unwrap();
        let batch: Vec<u8> =
            (1..=300u128).flat_map(|g| Msg::ReleaseSide { gid: g, active: g % 2 == 0 }.encode()).collect();
        (&a).write_all(&batch).unwrap();
        let file = std::fs::File::open("/dev/null").unwrap();
        send_with_fd(&a, &Msg::Linger { gid: 7 }.encode(), Some(file.as_fd().as_raw_fd())).unwrap();
        (&a).write_all(&Msg::Release { gid: 8 }.encode()).unwrap();
        drop(a);
        let mut r = MsgReader::default();
        for g in 1..=300u128 {
            let (m, f) = r.next(b.as_raw_fd()).unwrap();
            assert_eq!(m, Msg::ReleaseSide { gid: g, active: g % 2 == 0 });
            assert!(f.is_none(), "no descriptor with message {g}");
        }
        let (m, f) = r.next(b.as_raw_fd()).unwrap();
        assert_eq!(m, Msg::Linger { gid: 7 });
        assert!(f.is_some(), "the descriptor rides with its message");
        let (m, f) = r.next(b.as_raw_fd()).unwrap();
        assert_eq!((m, f.is_none()), (Msg::Release { gid: 8 }, true));
        assert_eq!(r.next(b.as_raw_fd()).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn a_malformed_message_is_an_error() {
        let (a, b) = UnixStream::pair().unwrap();
        (&a).write_all(&[1, 0, 0, 0, 99]).unwrap();
        drop(a);
        assert_eq!(MsgReader::default().next(b.as_raw_fd()).unwrap_err().kind(), io::ErrorKind::InvalidData);
    }
}
