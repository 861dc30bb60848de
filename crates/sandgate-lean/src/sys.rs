//! The system calls the lean engine makes, each wrapped once: the only `unsafe` of the crate
//! besides the seccomp filter's installation and the C interface.
#![allow(unsafe_code)] // Raw system calls; each block says what holds.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::ptr;

use crate::child::c_path;

fn check(ret: libc::c_int) -> io::Result<()> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// `unshare(2)`.
pub fn unshare(flags: libc::c_int) -> io::Result<()> {
    // SAFETY: unshare takes an integer and touches no memory of ours.
    check(unsafe { libc::unshare(flags) })
}

/// `setns(2)` on an open namespace descriptor.
pub fn setns(fd: RawFd, nstype: libc::c_int) -> io::Result<()> {
    // SAFETY: setns takes a descriptor and an integer; a bad descriptor is an error, not UB.
    check(unsafe { libc::setns(fd, nstype) })
}

/// `mount(2)`; `None` passes a null pointer.
pub fn mount(
    source: Option<&str>,
    target: &str,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> io::Result<()> {
    let source = source.map(c_path).transpose()?;
    let target = c_path(target)?;
    let fstype = fstype.map(c_path).transpose()?;
    let data = data.map(c_path).transpose()?;
    mount_c(
        source.as_deref(),
        &target,
        fstype.as_deref(),
        flags,
        data.as_deref(),
    )
}

/// [`mount`] with C strings made beforehand: allocates nothing (usable between fork and exec).
pub fn mount_c(
    source: Option<&CStr>,
    target: &CStr,
    fstype: Option<&CStr>,
    flags: libc::c_ulong,
    data: Option<&CStr>,
) -> io::Result<()> {
    let ptr_of = |s: Option<&CStr>| s.map_or(ptr::null(), CStr::as_ptr);
    // SAFETY: every pointer is null or a NUL-terminated string that outlives the call.
    check(unsafe {
        libc::mount(
            ptr_of(source),
            target.as_ptr(),
            ptr_of(fstype),
            flags,
            ptr_of(data).cast(),
        )
    })
}

/// `chdir(root)`, `pivot_root(".", ".")`, the old root detached, `chdir("/")`: the calling
/// process's root becomes `root` and nothing of the old one stays reachable. Allocates nothing.
pub fn pivot_into(root: &CStr) -> io::Result<()> {
    let dot = c".";
    let slash = c"/";
    // SAFETY: the strings are NUL-terminated and outlive the calls; pivot_root has no libc
    // wrapper, so it goes through syscall(2) with two string pointers.
    unsafe {
        check(libc::chdir(root.as_ptr()))?;
        check(libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) as libc::c_int)?;
        check(libc::umount2(dot.as_ptr(), libc::MNT_DETACH))?;
        check(libc::chdir(slash.as_ptr()))
    }
}

/// `sethostname(2)`.
pub fn sethostname(name: &str) -> io::Result<()> {
    // SAFETY: the pointer and length describe `name`'s bytes, which outlive the call.
    check(unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) })
}

/// A character device node with `mode` (the umask does not apply: it is set again with chmod).
pub fn mknod_char(path: &str, major: u32, minor: u32, mode: libc::mode_t) -> io::Result<()> {
    let c = c_path(path)?;
    // SAFETY: `c` is NUL-terminated and outlives both calls.
    unsafe {
        check(libc::mknod(
            c.as_ptr(),
            libc::S_IFCHR | mode,
            libc::makedev(major, minor),
        ))?;
        check(libc::chmod(c.as_ptr(), mode))
    }
}

/// Sets the `IFF_UP` flag of `lo` in the calling process's network namespace.
pub fn loopback_up() -> io::Result<()> {
    // SAFETY: a socket is opened and closed here; `ifreq` is a plain C struct, zeroed, its name
    // filled within bounds, and passed to ioctl for the two requests that read and write it.
    unsafe {
        let sock = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if sock < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut req: libc::ifreq = std::mem::zeroed();
        for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
            *dst = *src as libc::c_char;
        }
        let result = check(libc::ioctl(sock, libc::SIOCGIFFLAGS, &mut req)).and_then(|()| {
            req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
            check(libc::ioctl(sock, libc::SIOCSIFFLAGS, &req))
        });
        libc::close(sock);
        result
    }
}

/// Soft and hard limit of `resource` set to `value`.
pub fn setrlimit(resource: libc::__rlimit_resource_t, value: u64) -> io::Result<()> {
    let limit = libc::rlimit {
        rlim_cur: value,
        rlim_max: value,
    };
    // SAFETY: `limit` is a valid rlimit that outlives the call.
    check(unsafe { libc::setrlimit(resource, &limit) })
}

/// Closes every descriptor from 3 up except those in `keep`.
pub fn close_other_fds(keep: &[RawFd]) -> io::Result<()> {
    let mut keep: Vec<RawFd> = keep.iter().copied().filter(|fd| *fd > 2).collect();
    keep.sort_unstable();
    keep.dedup();
    let mut from: u32 = 3;
    for fd in keep.iter().map(|fd| *fd as u32).chain([u32::MAX]) {
        if fd > from {
            // SAFETY: close_range takes integers; closing descriptors we do not use is the point.
            let ret = unsafe { libc::syscall(libc::SYS_close_range, from, fd - 1, 0) };
            check(ret as libc::c_int)?;
        }
        from = fd.saturating_add(1);
    }
    Ok(())
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

fn last_cap() -> io::Result<u32> {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")?
        .trim()
        .parse()
        .map_err(io::Error::other)
}

/// The bounding set cut to `keep`, the ambient set cleared, then effective and permitted exactly
/// `keep` and inheritable empty (capset).
pub fn keep_only_capabilities(keep: &[u32]) -> io::Result<()> {
    let last = last_cap()?;
    for cap in 0..=last {
        if keep.contains(&cap) {
            continue;
        }
        // SAFETY: prctl with integer arguments only.
        check(unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) })?;
    }
    // SAFETY: as above.
    check(unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        )
    })?;
    let mut data = [CapData::default(); 2];
    for cap in keep {
        let word = (*cap / 32) as usize;
        let bit = 1u32 << (cap % 32);
        data[word].effective |= bit;
        data[word].permitted |= bit;
    }
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    // SAFETY: capset reads a v3 header and two data words, which is what we pass; both outlive
    // the call.
    let ret = unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) };
    check(ret as libc::c_int)
}

/// `PR_SET_NO_NEW_PRIVS`: nothing this process or its children execute can gain privileges.
pub fn no_new_privs() -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) })
}

/// Number of threads of the calling process (`/proc/self/task`).
pub fn thread_count() -> io::Result<usize> {
    Ok(std::fs::read_dir("/proc/self/task")?.count())
}

/// Clears `FD_CLOEXEC` on `fd` (so an exec keeps it). Allocates nothing.
pub fn inherit(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl with integer arguments only.
    check(unsafe { libc::fcntl(fd, libc::F_SETFD, 0) })
}

/// A new session: the process leaves the node's process group and terminal. Allocates nothing.
pub fn setsid() -> io::Result<()> {
    // SAFETY: setsid takes no arguments.
    check(unsafe { libc::setsid() })
}

/// A connected pair of `SOCK_SEQPACKET` unix sockets (close-on-exec, non-blocking): messages keep
/// their boundaries and can carry descriptors.
pub fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: socketpair writes two descriptors into `fds`, which we own from then on.
    check(unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
            fds.as_mut_ptr(),
        )
    })?;
    // SAFETY: both descriptors were just made and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Most descriptors one message carries.
pub const MAX_FDS: usize = 8;

/// Sends one message with `fds` attached (`SCM_RIGHTS`).
pub fn send_message(sock: BorrowedFd<'_>, data: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    if fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "too many descriptors",
        ));
    }
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let fd_bytes = std::mem::size_of_val(raw.as_slice());
    // SAFETY: CMSG_SPACE is a pure computation on a length.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes as u32) } as usize;
    let mut control = vec![0u8; space.max(1)];
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: msghdr is a plain C struct; zeroed is a valid value before its fields are set.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !raw.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: `control` is CMSG_SPACE(fd_bytes) long, so the first header and its data fit;
        // the descriptors are copied into the header's data, within those bounds.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(fd_bytes as u32) as _;
            std::ptr::copy_nonoverlapping(
                raw.as_ptr().cast::<u8>(),
                libc::CMSG_DATA(cmsg),
                fd_bytes,
            );
        }
    }
    // SAFETY: `msg` points at `iov` and `control`, both alive for the call; sendmsg only reads.
    let sent = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    if sent as usize != data.len() {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            "a message was cut",
        ));
    }
    Ok(())
}

/// Receives one message into `buf`; the descriptors it carried become ours (close-on-exec).
/// `Ok((0, _))` is the end of the stream. A message longer than `buf` is an error.
pub fn recv_message(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    // SAFETY: CMSG_SPACE is a pure computation on a length.
    let space = unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) };
    let mut control = vec![0u8; space as usize];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: as in send_message.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len() as _;
    // SAFETY: `msg` points at `iov` (over `buf`) and `control`, both alive and writable for the
    // call.
    let got = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `control` with well-formed headers up to msg_controllen; the
    // CMSG_* walk stays within it, and each SCM_RIGHTS descriptor is new and ours alone.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg);
                let len = (*cmsg).cmsg_len as usize - (data as usize - cmsg as usize);
                for i in 0..len / std::mem::size_of::<RawFd>() {
                    let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a message was too long",
        ));
    }
    Ok((got as usize, fds))
}

/// An anonymous memory file holding `bytes`, sealed against any change.
pub fn sealed_memfd(name: &CStr, bytes: &[u8]) -> io::Result<OwnedFd> {
    // SAFETY: memfd_create takes a NUL-terminated name and flags and returns a new descriptor.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the descriptor was just made and is ours alone.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut file = std::fs::File::from(fd);
    std::io::Write::write_all(&mut file, bytes)?;
    let fd = OwnedFd::from(file);
    let seals = libc::F_SEAL_WRITE | libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
    // SAFETY: fcntl with integer arguments only.
    check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) })?;
    Ok(fd)
}

/// Sends `signal` to `pid`.
pub fn kill(pid: i32, signal: i32) -> io::Result<()> {
    // SAFETY: kill takes integers only.
    check(unsafe { libc::kill(pid, signal) })
}

fn unix_address(path: &std::path::Path) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    use std::os::unix::ffi::OsStrExt as _;
    // SAFETY: sockaddr_un is a plain C struct; zeroed is valid before its fields are set.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket path too long",
        ));
    }
    for (dst, src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    Ok((addr, len as libc::socklen_t))
}

fn seqpacket_socket() -> io::Result<OwnedFd> {
    // SAFETY: socket returns a new descriptor or -1.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the descriptor was just made and is ours alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A listening `SOCK_SEQPACKET` socket bound at `path` (blocking).
pub fn seqpacket_listen(path: &std::path::Path) -> io::Result<OwnedFd> {
    let fd = seqpacket_socket()?;
    let (addr, len) = unix_address(path)?;
    // SAFETY: `addr` is a valid sockaddr_un of `len` bytes that outlives the calls.
    unsafe {
        check(libc::bind(fd.as_raw_fd(), (&raw const addr).cast(), len))?;
        check(libc::listen(fd.as_raw_fd(), 16))?;
    }
    Ok(fd)
}

/// Accepts one connection on a listening socket (blocking).
pub fn seqpacket_accept(listener: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    // SAFETY: accept4 with null address pointers returns a new descriptor or -1.
    let fd = unsafe {
        libc::accept4(
            listener.as_raw_fd(),
            ptr::null_mut(),
            ptr::null_mut(),
            libc::SOCK_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the descriptor was just made and is ours alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Connects a `SOCK_SEQPACKET` socket to `path` (blocking).
pub fn seqpacket_connect(path: &std::path::Path) -> io::Result<OwnedFd> {
    let fd = seqpacket_socket()?;
    let (addr, len) = unix_address(path)?;
    // SAFETY: `addr` is a valid sockaddr_un of `len` bytes that outlives the call.
    check(unsafe { libc::connect(fd.as_raw_fd(), (&raw const addr).cast(), len) })?;
    Ok(fd)
}

/// The uid of the process at the other end of a connected unix socket (`SO_PEERCRED`).
pub fn peer_uid(sock: BorrowedFd<'_>) -> io::Result<u32> {
    // SAFETY: ucred is a plain C struct; zeroed is valid before getsockopt fills it.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes and outlive the call.
    check(unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &mut len,
        )
    })?;
    Ok(cred.uid)
}
