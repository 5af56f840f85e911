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

/// Reads one message from a Unix socket, with a descriptor if one came along.
pub fn read_msg_fd(fd: RawFd) -> io::Result<(Msg, Option<OwnedFd>)> {
    let mut pre = [0u8; 4];
    let mut got = 0;
    let mut passed = None;
    while got < 4 {
        let mut iov = libc::iovec { iov_base: pre[got..].as_mut_ptr() as *mut _, iov_len: 4 - got };
        let mut cbuf = [0u64; 8];
        // SAFETY: zeroed msghdr is valid; pointers set to live locals.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr() as *mut _;
        msg.msg_controllen = std::mem::size_of_val(&cbuf);
        // SAFETY: msg is valid for the call.
        let r = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if r == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        // SAFETY: walking the control messages the kernel wrote.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let pfd = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const i32);
                    passed = Some(OwnedFd::from_raw_fd(pfd));
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        got += r as usize;
    }
    let n = Msg::body_len(pre).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
    let mut body = vec![0u8; n];
    // SAFETY: the socket stays open for the call; we only read.
    let mut f = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(fd) });
    f.read_exact(&mut body)?;
    let m = Msg::decode(&body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
    Ok((m, passed))
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
