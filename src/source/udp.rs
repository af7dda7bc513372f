//! UDP: one frame per datagram. With `framing = "raw"` the stream is the
//! sender's address; with `named` the datagram names it.
//!
//! Datagrams that arrive while the socket's receive buffer is full are
//! dropped by the kernel (`RcvbufErrors` in `netstat -su`) and never reach
//! the daemon. The socket counts them (the kernel's `sk_drops`); the source
//! reads that count from each datagram (`SO_RXQ_OVFL`: the count when that
//! datagram was queued) and once a second (`SO_MEMINFO`: so the drops of a
//! burst show even when no datagram follows it, or while the pipeline does
//! not read), and counts every new one as a frame dropped with reason
//! `kernel_overflow`. `recv_buffer_bytes` sizes the buffer.

use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;

use super::framing::split_named;
use super::{Frame, Framing, Source, SourceCtx, SourceError};

pub struct UdpSource {
    pub listen: SocketAddr,
    pub framing: Framing,
    /// SO_RCVBUF to ask for; None: the system's default (net.core.rmem_default).
    pub recv_buffer_bytes: Option<usize>,
}

/// Datagrams can be up to 64 KiB.
const MAX_DATAGRAM: usize = 65_536;

/// How often the socket's drop count is read when no datagram brings it.
const DROPS_EVERY: Duration = Duration::from_secs(1);

/// The drop reason of datagrams the kernel dropped (receive buffer full).
pub const KERNEL_OVERFLOW: &str = "kernel_overflow";

/// The last value of the socket's drop count that was counted. The count is
/// a u32 that wraps, and a datagram queued before some drops carries an
/// older value than a later `SO_MEMINFO` read: only a step forward (less
/// than half the range) is new drops.
#[derive(Debug, Default)]
struct KernelDrops {
    counted: AtomicU32,
}

impl KernelDrops {
    /// Takes the count `now`; returns how many drops it adds.
    fn advance(&self, now: u32) -> u32 {
        let mut added = 0;
        let _ = self
            .counted
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |last| {
                let step = now.wrapping_sub(last);
                if step == 0 || step > u32::MAX / 2 {
                    added = 0;
                    None
                } else {
                    added = step;
                    Some(now)
                }
            });
        added
    }
}

fn count_kernel_drops(ctx: &SourceCtx, drops: &KernelDrops, now: u32) {
    let added = drops.advance(now);
    if added > 0 {
        let detail = format!(
            "{added} datagram(s) dropped by the kernel: the receive buffer was full \
             (raise recv_buffer_bytes, or the pipeline is not keeping up)"
        );
        for _ in 0..added {
            ctx.count_drop(KERNEL_OVERFLOW, &detail);
        }
    }
}

impl Source for UdpSource {
    fn spawn(self: Box<Self>, ctx: SourceCtx) -> Result<tokio::task::JoinHandle<()>, SourceError> {
        let setup = |detail: String| SourceError::Setup {
            pipeline: ctx.pipeline.clone(),
            kind: "udp",
            detail,
        };
        let std_sock = std::net::UdpSocket::bind(self.listen)
            .map_err(|e| setup(format!("bind {}: {e}", self.listen)))?;
        std_sock
            .set_nonblocking(true)
            .map_err(|e| setup(e.to_string()))?;
        if let Some(want) = self.recv_buffer_bytes {
            sys::set_recv_buffer(std_sock.as_fd(), want)
                .map_err(|e| setup(format!("recv_buffer_bytes {want}: {e}")))?;
        }
        // The kernel reports twice the size asked for (half of it is its
        // own bookkeeping), and caps a plain SO_RCVBUF at net.core.rmem_max.
        let granted = sys::recv_buffer(std_sock.as_fd()).unwrap_or(0);
        if let Some(want) = self.recv_buffer_bytes
            && granted < want
        {
            tracing::warn!(
                pipeline = %ctx.pipeline,
                recv_buffer_bytes = want,
                granted,
                "udp source: the kernel granted a smaller receive buffer \
                 (raise net.core.rmem_max, or give the daemon CAP_NET_ADMIN)"
            );
        }
        // Refused by some emulators (qemu-user) and old kernels: the
        // source still serves, and the drops are counted from the timer's
        // SO_MEMINFO alone (or not at all where that is refused too).
        if let Err(e) = sys::enable_drop_count(std_sock.as_fd()) {
            tracing::warn!(
                pipeline = %ctx.pipeline,
                error = %e,
                "udp source: SO_RXQ_OVFL refused; kernel drops are counted once a second only"
            );
        }
        let sock = tokio::net::UdpSocket::from_std(std_sock).map_err(|e| setup(e.to_string()))?;
        tracing::info!(
            pipeline = %ctx.pipeline,
            listen = %self.listen,
            recv_buffer_bytes = granted,
            "udp source listening"
        );
        let sock = Arc::new(sock);
        let drops = Arc::new(KernelDrops::default());
        // The drop count read on a timer, apart from the receive loop: that
        // one waits while the pipeline's queue is full (`block`), which is
        // when the kernel drops.
        {
            let (sock, drops, ctx) = (sock.clone(), drops.clone(), ctx.clone());
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(DROPS_EVERY);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        _ = tick.tick() => {}
                        _ = ctx.stopped() => return,
                    }
                    if let Ok(now) = sys::drop_count(sock.as_fd()) {
                        count_kernel_drops(&ctx, &drops, now);
                    }
                }
            });
        }
        Ok(tokio::spawn(async move {
            let mut buf = vec![0u8; MAX_DATAGRAM];
            loop {
                let received = tokio::select! {
                    r = sock.async_io(tokio::io::Interest::READABLE, || {
                        sys::recv(sock.as_fd(), &mut buf)
                    }) => r,
                    _ = ctx.stopped() => return,
                };
                let (n, peer, kernel_drops) = match received {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::warn!(pipeline = %ctx.pipeline, error = %e, "udp receive failed");
                        continue;
                    }
                };
                if let Some(now) = kernel_drops {
                    count_kernel_drops(&ctx, &drops, now);
                }
                let body = &buf[..n];
                let frame = match self.framing {
                    Framing::Raw => Frame::new(peer.to_string(), Bytes::copy_from_slice(body)),
                    Framing::Named => match split_named(body) {
                        Ok((name, payload)) => {
                            let stream =
                                name.map(str::to_string).unwrap_or_else(|| peer.to_string());
                            Frame::new(stream, Bytes::copy_from_slice(payload))
                        }
                        Err(e) => {
                            ctx.count_drop(e.reason(), &e.to_string());
                            continue;
                        }
                    },
                };
                if !ctx.submit(frame).await {
                    return;
                }
            }
        }))
    }
}

/// The socket calls std and tokio do not offer: SO_RCVBUF(FORCE),
/// SO_RXQ_OVFL with recvmsg, SO_MEMINFO.
mod sys {
    use super::*;
    use std::io;
    use std::mem::{MaybeUninit, size_of, zeroed};
    use std::net::{Ipv4Addr, Ipv6Addr, SocketAddrV4, SocketAddrV6};

    fn setsockopt_int(fd: BorrowedFd<'_>, name: libc::c_int, value: libc::c_int) -> io::Result<()> {
        // SAFETY: the option value is a live c_int of the length given.
        let r = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                name,
                (&value as *const libc::c_int).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// Asks for `bytes` of receive buffer: SO_RCVBUF, then, where that was
    /// capped by net.core.rmem_max, SO_RCVBUFFORCE (allowed with
    /// CAP_NET_ADMIN; without it the capped size stays).
    pub fn set_recv_buffer(fd: BorrowedFd<'_>, bytes: usize) -> io::Result<()> {
        let v = libc::c_int::try_from(bytes)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "too large"))?;
        setsockopt_int(fd, libc::SO_RCVBUF, v)?;
        if recv_buffer(fd)? < bytes {
            let _ = setsockopt_int(fd, libc::SO_RCVBUFFORCE, v);
        }
        Ok(())
    }

    /// The receive buffer the kernel granted (SO_RCVBUF as it reads back).
    pub fn recv_buffer(fd: BorrowedFd<'_>) -> io::Result<usize> {
        let mut v: libc::c_int = 0;
        let mut len = size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: v and len are live and len is v's size.
        let r = unsafe {
            libc::getsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                (&mut v as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        if r == 0 {
            Ok(usize::try_from(v).unwrap_or(0))
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// Each received datagram then carries the socket's drop count.
    pub fn enable_drop_count(fd: BorrowedFd<'_>) -> io::Result<()> {
        setsockopt_int(fd, libc::SO_RXQ_OVFL, 1)
    }

    /// The socket's drop count now (SO_MEMINFO, Linux 4.6+).
    pub fn drop_count(fd: BorrowedFd<'_>) -> io::Result<u32> {
        // SK_MEMINFO_VARS is 9 (SK_MEMINFO_DROPS is the last).
        let mut info = [0u32; 9];
        let mut len = size_of::<[u32; 9]>() as libc::socklen_t;
        // SAFETY: info and len are live and len is info's size; the kernel
        // writes at most len bytes.
        let r = unsafe {
            libc::getsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_MEMINFO,
                info.as_mut_ptr().cast(),
                &mut len,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        let i = libc::SK_MEMINFO_DROPS as usize;
        if (len as usize) < (i + 1) * size_of::<u32>() {
            return Err(io::Error::other("SO_MEMINFO without the drop count"));
        }
        Ok(info[i])
    }

    /// One datagram (non-blocking): its length, its sender, and the
    /// socket's drop count when it was queued (None: not reported).
    pub fn recv(
        fd: BorrowedFd<'_>,
        buf: &mut [u8],
    ) -> io::Result<(usize, SocketAddr, Option<u32>)> {
        // SAFETY: all-zero is a valid sockaddr_storage and msghdr.
        let mut addr: libc::sockaddr_storage = unsafe { zeroed() };
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // Room for one u32 control message, aligned as cmsghdr wants.
        let mut control = [MaybeUninit::<u64>::uninit(); 8];
        // SAFETY: msghdr is a plain C struct; all zeros is its empty value.
        let mut msg: libc::msghdr = unsafe { zeroed() };
        msg.msg_name = (&mut addr as *mut libc::sockaddr_storage).cast();
        msg.msg_namelen = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = size_of::<[u64; 8]>() as _;
        // SAFETY: msg points at live buffers of the lengths it states, for
        // the duration of the call.
        let n = unsafe { libc::recvmsg(fd.as_raw_fd(), &mut msg, libc::MSG_DONTWAIT) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut drops = None;
        // SAFETY: the CMSG_* walk stays within msg_controllen, which the
        // kernel set to the bytes it wrote.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET
                    && (*c).cmsg_type == libc::SO_RXQ_OVFL
                    && (*c).cmsg_len as usize >= libc::CMSG_LEN(size_of::<u32>() as u32) as usize
                {
                    drops = Some(std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<u32>()));
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        let peer = match libc::c_int::from(addr.ss_family) {
            libc::AF_INET => {
                // SAFETY: the family says the storage holds a sockaddr_in.
                let a = unsafe {
                    *(&addr as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>()
                };
                SocketAddr::V4(SocketAddrV4::new(
                    Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
                    u16::from_be(a.sin_port),
                ))
            }
            libc::AF_INET6 => {
                // SAFETY: the family says the storage holds a sockaddr_in6.
                let a = unsafe {
                    *(&addr as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>()
                };
                SocketAddr::V6(SocketAddrV6::new(
                    Ipv6Addr::from(a.sin6_addr.s6_addr),
                    u16::from_be(a.sin6_port),
                    a.sin6_flowinfo,
                    a.sin6_scope_id,
                ))
            }
            f => {
                return Err(io::Error::other(format!(
                    "datagram from address family {f}"
                )));
            }
        };
        Ok((n as usize, peer, drops))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_steps_forward_are_new_drops() {
        let d = KernelDrops::default();
        assert_eq!(d.advance(0), 0);
        assert_eq!(d.advance(5), 5);
        assert_eq!(d.advance(5), 0);
        // A datagram queued before the last read carries an older count.
        assert_eq!(d.advance(3), 0);
        assert_eq!(d.advance(9), 4);
        // The u32 wraps.
        let w = KernelDrops::default();
        assert_eq!(w.advance(0x7000_0000), 0x7000_0000);
        assert_eq!(w.advance(0xE000_0000), 0x7000_0000);
        assert_eq!(w.advance(u32::MAX - 1), 0x1FFF_FFFE);
        assert_eq!(w.advance(2), 4);
    }

    #[test]
    fn a_datagram_dropped_by_a_full_buffer_is_counted_by_the_socket() {
        let rx = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        rx.set_nonblocking(true).unwrap();
        sys::set_recv_buffer(rx.as_fd(), 1).unwrap();
        sys::enable_drop_count(rx.as_fd()).unwrap();
        let tx = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let at = rx.local_addr().unwrap();
        let sent = 2_000u32;
        for _ in 0..sent {
            tx.send_to(&[7u8; 1000], at).unwrap();
        }
        let dropped = sys::drop_count(rx.as_fd()).unwrap();
        assert!(dropped > 0, "a minimal buffer took {sent} datagrams");
        let mut buf = vec![0u8; MAX_DATAGRAM];
        let mut got = 0u32;
        while let Ok((n, peer, _)) = sys::recv(rx.as_fd(), &mut buf) {
            assert_eq!((n, peer), (1000, tx.local_addr().unwrap()));
            got += 1;
        }
        assert_eq!(got + dropped, sent);
        // The next datagram, queued after the drops, carries their count.
        tx.send_to(b"x", at).unwrap();
        let (_, _, carried) = sys::recv(rx.as_fd(), &mut buf).unwrap();
        assert_eq!(carried, Some(dropped));
    }
}
