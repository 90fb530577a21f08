//! Lending a client's connection to the worker that writes a records GET's body: the front
//! writes the head, passes its socket to the worker over a UNIX socket (`SCM_RIGHTS`), and
//! takes the connection back when the router says the body is done. The body then costs one
//! copy, the worker's from its records into the socket, instead of a file on tmpfs written
//! by the worker and `sendfile`d by the front (0.24-0.29 against 0.91-1.15 ms of CPU per MiB
//! in a two-process measurement on loopback; docs/ipc.md, "Lent connections").

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;

/// The one byte sent with the socket: the worker writes the body as HTTP/1.1 chunks.
pub const CHUNKED: u8 = b'c';
/// The one byte sent without a socket: write the body the usual way (files or frames).
pub const REFUSED: u8 = b'n';

/// Send `socket` (or, when `None`, a refusal) to the worker listening at `path`. The
/// worker gets its own descriptor of the connection; ours stays open and ours.
pub fn lend(path: &Path, socket: Option<RawFd>) -> io::Result<()> {
    let peer = UnixStream::connect(path)?;
    let byte = [if socket.is_some() { CHUNKED } else { REFUSED }];
    let mut iov = libc::iovec {
        iov_base: byte.as_ptr() as *mut libc::c_void,
        iov_len: 1,
    };
    // Room for one control message holding one descriptor, aligned for `cmsghdr`.
    let mut control = [0u64; 8];
    // SAFETY: a zeroed msghdr is valid (null pointers, zero lengths); fields set below.
    let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
    message.msg_iov = &mut iov;
    message.msg_iovlen = 1;
    if let Some(fd) = socket {
        let fd_size = std::mem::size_of::<libc::c_int>() as u32;
        // SAFETY: CMSG_SPACE/CMSG_LEN are pure arithmetic.
        let (space, length) = unsafe { (libc::CMSG_SPACE(fd_size), libc::CMSG_LEN(fd_size)) };
        message.msg_control = control.as_mut_ptr().cast();
        message.msg_controllen = space as usize;
        // SAFETY: the control buffer (64 bytes) holds CMSG_SPACE(4) = 24 bytes, so the first
        // header exists and its data has room for one descriptor.
        unsafe {
            let header = libc::CMSG_FIRSTHDR(&message);
            if header.is_null() {
                return Err(io::Error::other("no room for the control message"));
            }
            (*header).cmsg_level = libc::SOL_SOCKET;
            (*header).cmsg_type = libc::SCM_RIGHTS;
            (*header).cmsg_len = length as usize;
            std::ptr::write_unaligned(libc::CMSG_DATA(header).cast::<libc::c_int>(), fd);
        }
    }
    // SAFETY: `message` points at live locals (the byte, the iovec, the control buffer).
    let sent = unsafe { libc::sendmsg(peer.as_raw_fd(), &message, libc::MSG_NOSIGNAL) };
    match sent {
        1 => Ok(()),
        -1 => Err(io::Error::last_os_error()),
        _ => Err(io::Error::other("short send of the lent socket")),
    }
}

/// Cut a connection whose body a worker was writing: a worker still holding its descriptor
/// must not keep the client waiting on a connection the front gave up.
pub fn cut(socket: RawFd) {
    // SAFETY: shutdown on a descriptor the caller keeps open; no memory is touched.
    unsafe {
        libc::shutdown(socket, libc::SHUT_RDWR);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::os::unix::net::UnixListener;

    /// The worker's side: the byte and the descriptor that came with it, if any.
    fn receive(listener: &UnixListener) -> (u8, Option<OwnedFd>) {
        let (peer, _) = listener.accept().expect("accept");
        let mut byte = [0u8; 1];
        let mut iov = libc::iovec {
            iov_base: byte.as_mut_ptr().cast(),
            iov_len: 1,
        };
        let mut control = [0u64; 8];
        // SAFETY: zeroed msghdr pointing at live locals, as in `lend`.
        let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
        message.msg_iov = &mut iov;
        message.msg_iovlen = 1;
        message.msg_control = control.as_mut_ptr().cast();
        message.msg_controllen = std::mem::size_of_val(&control);
        // SAFETY: as above; the kernel writes within the given lengths.
        let n = unsafe { libc::recvmsg(peer.as_raw_fd(), &mut message, 0) };
        assert_eq!(n, 1);
        // SAFETY: the header, if any, lies within `control`, filled by recvmsg.
        let fd = unsafe {
            let header = libc::CMSG_FIRSTHDR(&message);
            (!header.is_null()).then(|| {
                let fd = std::ptr::read_unaligned(libc::CMSG_DATA(header).cast::<libc::c_int>());
                OwnedFd::from_raw_fd(fd)
            })
        };
        (byte[0], fd)
    }

    #[test]
    fn the_worker_gets_the_socket_itself_or_a_refusal() {
        let dir = std::env::temp_dir().join(format!("sg-lend-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("offer.lend");
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).expect("bind");
        let (mut client, front) = UnixStream::pair().expect("pair");

        lend(&path, Some(front.as_raw_fd())).expect("lend");
        let (byte, fd) = receive(&listener);
        assert_eq!(byte, CHUNKED);
        // What the worker writes on its descriptor reaches the client.
        let mut lent = UnixStream::from(fd.expect("a descriptor"));
        lent.write_all(b"1\r\nx\r\n").expect("write");
        drop(lent);
        let mut got = [0u8; 6];
        client.read_exact(&mut got).expect("read");
        assert_eq!(&got, b"1\r\nx\r\n");

        lend(&path, None).expect("refuse");
        let (byte, fd) = receive(&listener);
        assert_eq!(byte, REFUSED);
        assert!(fd.is_none());

        drop(listener);
        std::fs::remove_dir_all(&dir).expect("cleanup");
        assert!(lend(&path, None).is_err()); // nobody listens: an error, not a hang
    }
}
