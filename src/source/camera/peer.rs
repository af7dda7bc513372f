//! Whether a loopback TCP connection was opened by this process. The
//! camera relay (`relay.rs`) listens on a loopback port for the daemon's
//! own RTSP client, and any local process can connect to a loopback port:
//! one that does so first would get the camera and leave the daemon's
//! session without it. TCP has no peer credentials (`SO_PEERCRED` is for
//! unix sockets), but the kernel's table of the network namespace's TCP
//! sockets (`/proc/self/net/tcp`) names the socket at the other end of a
//! loopback connection by its inode, and this process's descriptors
//! (`/proc/self/fd`) name the sockets it holds: the connection is this
//! process's when one of them is that socket. Both are read only when a
//! connection comes (once per camera session), never on the frames' path.
//!
//! What it needs: `/proc` with the network files (a systemd unit's
//! `ProcSubset=pid` hides `/proc/self/net`; `ProtectProc=invisible` does
//! not). Where they cannot be read the connection is refused: the relay
//! serves only a client it knows to be its own.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::Path;

/// The kernel's table of IPv4 TCP sockets (the relay listens on IPv4).
const TCP_TABLE: &str = "/proc/self/net/tcp";

/// This process's open descriptors.
const FD_DIR: &str = "/proc/self/fd";

/// Whose end the other end of a connection is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Owner {
    /// A socket this process holds.
    Ours,
    /// Another process's (or a socket no longer there).
    Foreign,
}

/// Why it could not be told (retrying does not help: `/proc` is what it
/// is for this process).
#[derive(Debug, thiserror::Error)]
pub(super) enum PeerError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: &'static str,
        source: std::io::Error,
    },
}

/// Who opened the connection that this process accepted on `local` from
/// `peer`: the socket at the other end has `peer` as its own address and
/// `local` as its remote one.
pub(super) fn owner(local: SocketAddr, peer: SocketAddr) -> Result<Owner, PeerError> {
    let (SocketAddr::V4(local), SocketAddr::V4(peer)) = (local, peer) else {
        // The daemon's client connects to the IPv4 loopback address.
        return Ok(Owner::Foreign);
    };
    let table = std::fs::read_to_string(TCP_TABLE).map_err(|source| PeerError::Read {
        path: TCP_TABLE,
        source,
    })?;
    match inode_of(&table, peer, local) {
        Some(inode) if holds_socket(Path::new(FD_DIR), inode)? => Ok(Owner::Ours),
        _ => Ok(Owner::Foreign),
    }
}

/// The inode of the socket in `table` (the text of `/proc/net/tcp`) whose
/// own address is `local` and remote one `remote`. Inode 0 (a socket
/// closing, held by no descriptor) counts as none.
fn inode_of(table: &str, local: SocketAddrV4, remote: SocketAddrV4) -> Option<u64> {
    table.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (l, r, inode) = (f.get(1)?, f.get(2)?, f.get(9)?);
        if address(l)? != local || address(r)? != remote {
            return None;
        }
        inode.parse::<u64>().ok().filter(|i| *i != 0)
    })
}

/// `0100007F:1F90`: the address as the kernel prints it (the four bytes
/// in memory order, read as one native integer) and the port in hex.
fn address(s: &str) -> Option<SocketAddrV4> {
    let (ip, port) = s.split_once(':')?;
    if ip.len() != 8 {
        return None;
    }
    let ip = u32::from_str_radix(ip, 16).ok()?;
    let port = u16::from_str_radix(port, 16).ok()?;
    Some(SocketAddrV4::new(Ipv4Addr::from(ip.to_ne_bytes()), port))
}

/// Whether one of the descriptors in `fd_dir` is the socket `inode`.
/// Descriptors closed while the folder is read are skipped.
fn holds_socket(fd_dir: &Path, inode: u64) -> Result<bool, PeerError> {
    let want = format!("socket:[{inode}]");
    let entries = std::fs::read_dir(fd_dir).map_err(|source| PeerError::Read {
        path: FD_DIR,
        source,
    })?;
    Ok(entries.flatten().any(|e| {
        std::fs::read_link(e.path()).is_ok_and(|target| target.as_os_str() == want.as_str())
    }))
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader};
    use std::net::{TcpListener, TcpStream};
    use std::process::{Command, Stdio};

    use super::*;

    #[test]
    fn the_kernels_table_is_read_by_address_pair() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:9C41 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1 0000000000000000 100 0 0 10 0
   1: 0100007F:D431 0100007F:9C41 01 00000000:00000000 00:00000000 00000000     0        0 5151 1 0000000000000000 20 4 30 10 -1
   2: 0100007F:9C41 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 6161 1 0000000000000000 20 4 30 10 -1
   3: 0100007F:D432 0100007F:9C41 06 00000000:00000000 03:00000BB8 00000000     0        0 0 3 0000000000000000
";
        let relay = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0x9C41);
        let client = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0xD431);
        // The client's end, not the relay's accepted one.
        assert_eq!(inode_of(table, client, relay), Some(5151));
        assert_eq!(inode_of(table, relay, client), Some(6161));
        // Not there, or closing (inode 0).
        let gone = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0xD432);
        assert_eq!(inode_of(table, gone, relay), None);
        let other = SocketAddrV4::new(Ipv4Addr::new(127, 0, 0, 2), 0xD431);
        assert_eq!(inode_of(table, other, relay), None);
        assert_eq!(address("garbage"), None);
    }

    #[test]
    fn a_connection_of_this_process_is_ours_and_one_of_another_process_is_not() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let local = listener.local_addr().unwrap();
        // Ours: the client socket is a descriptor of this process.
        let _client = TcpStream::connect(local).unwrap();
        let (_conn, from) = listener.accept().unwrap();
        assert_eq!(owner(local, from).unwrap(), Owner::Ours);
        // Another process's: bash connects and says so, then waits for
        // its stdin to close.
        let mut child = Command::new("bash")
            .arg("-c")
            .arg(format!(
                "exec 3<>/dev/tcp/127.0.0.1/{}; echo connected; read -r _",
                local.port()
            ))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "connected");
        let (_conn, from) = listener.accept().unwrap();
        assert_eq!(owner(local, from).unwrap(), Owner::Foreign);
        drop(child.stdin.take());
        child.wait().unwrap();
    }
}
