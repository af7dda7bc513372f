//! UDP output: one datagram per record, sent from the inference thread on a
//! connected non-blocking socket. A peer that is gone shows as refused sends
//! (ICMP port unreachable), counted; it gets the next datagram once back.

use std::io::ErrorKind;
use std::net::{SocketAddr, UdpSocket};

use super::{MAX_DATAGRAM, Sent};

pub struct UdpSink {
    socket: UdpSocket,
}

impl UdpSink {
    pub fn open(to: SocketAddr) -> std::io::Result<UdpSink> {
        let local: SocketAddr = if to.is_ipv4() {
            ([0, 0, 0, 0], 0).into()
        } else {
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
        };
        let socket = UdpSocket::bind(local)?;
        socket.connect(to)?;
        socket.set_nonblocking(true)?;
        Ok(UdpSink { socket })
    }

    pub(super) fn send(&self, payload: &[u8]) -> Sent {
        if payload.len() > MAX_DATAGRAM {
            return Sent::Dropped("too_large");
        }
        match self.socket.send(payload) {
            Ok(_) => Sent::Ok,
            Err(e) => Sent::Dropped(match e.kind() {
                ErrorKind::WouldBlock => "full",
                ErrorKind::ConnectionRefused => "refused",
                _ => "error",
            }),
        }
    }
}
