//! The camera's connection, held by outpost rather than by the RTSP
//! client: outpost connects to the camera, and the client (retina, which
//! opens its own connection from a URL) is pointed at a loopback port of
//! the camera's thread where [`relay`] hands it the camera's bytes, each
//! checked by the [`Inspector`] before the client sees it (`guard.rs`).
//! Requests go the other way unchanged.
//!
//! What this costs: one more copy of the camera's bytes over loopback on
//! the camera's own thread (a 4 Mbit/s camera: 500 kB/s). What it changes
//! for the camera: the request line of the DESCRIBE names the loopback
//! address (later requests use the camera's `Content-Base`); cameras serve
//! by path, and the credentials are unchanged.
//!
//! Only the daemon's own client is served. Any local process may connect
//! to a loopback port, and one that holds the other ephemeral ports knows
//! which port the relay will get: before, the relay served whichever
//! connection came first, and such a process took the camera's session
//! (its requests reached the camera) while the daemon's failed. Each
//! connection is checked (`peer.rs`: is the socket at its other end one
//! of this process's?); another process's is closed unanswered, reported
//! to the camera ([`Refused`]: counted and logged), and the relay goes on
//! waiting for its client.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::guard::{Inspector, Oversize};
use super::peer::{self, Owner, PeerError};

/// How long the client may take to connect to the loopback port.
const ACCEPT_WAIT: Duration = Duration::from_secs(10);

/// Bytes read from the camera at a time.
const CHUNK: usize = 64 * 1024;

/// Why the relay cut the camera's stream, for the error the client then
/// reports (its own words would be only "connection closed").
#[derive(Debug, Default)]
pub(super) struct Cut(Mutex<Option<Oversize>>);

impl Cut {
    pub(super) fn reason(&self) -> Option<Oversize> {
        self.0.lock().clone()
    }
}

/// Why the camera could not be connected, or the client not pointed at it.
#[derive(Debug, thiserror::Error)]
pub(super) enum RelayError {
    #[error("the camera url has no host")]
    NoHost,
    /// In the operating system's words (refused, unreachable, ...).
    #[error("connect {target}: {source}")]
    Connect {
        target: String,
        source: std::io::Error,
    },
    #[error("cannot listen on loopback for the RTSP client: {0}")]
    Listen(std::io::Error),
    #[error("camera url: cannot point it at the loopback port")]
    Url,
}

/// A connection to the relay's port that was not the daemon's own
/// client: closed unanswered.
#[derive(Debug, thiserror::Error)]
pub(super) enum Refused {
    #[error(
        "a connection from {from} to the camera's loopback relay port came from another process than the daemon's RTSP client: refused"
    )]
    Foreign { from: std::net::SocketAddr },
    #[error(
        "a connection from {from} to the camera's loopback relay port was refused: cannot tell whether it is the daemon's own ({source})"
    )]
    Unknown {
        from: std::net::SocketAddr,
        source: PeerError,
    },
}

/// What the relay does with a refused connection (the camera counts and
/// logs it).
pub(super) type OnRefused = Box<dyn Fn(&Refused) + Send + Sync>;

/// A camera connected, and where the client is to find it.
pub(super) struct Relayed {
    /// `url` with the loopback address and port in place of the camera's.
    pub(super) url: ::url::Url,
    pub(super) cut: Arc<Cut>,
}

/// Connects to the camera at `url` and starts the relay on the current
/// runtime (the camera's own), bounding what the camera sends by `max`
/// bytes a message or frame; connections from others than this process
/// go to `refused`. The error: why the camera cannot be reached, in the
/// operating system's words.
pub(super) async fn open(
    url: &::url::Url,
    max: u64,
    refused: OnRefused,
) -> Result<Relayed, RelayError> {
    let host = url.host_str().ok_or(RelayError::NoHost)?;
    let port = url.port().unwrap_or(554);
    let target = format!("{host}:{port}");
    let camera = match TcpStream::connect(&target).await {
        Ok(c) => c,
        Err(source) => return Err(RelayError::Connect { target, source }),
    };
    // Requests are small and the client waits for each answer.
    let _ = camera.set_nodelay(true);
    let listener = TcpListener::bind(("127.0.0.1", 0))
        .await
        .map_err(RelayError::Listen)?;
    let local = listener.local_addr().map_err(RelayError::Listen)?;
    let mut client_url = url.clone();
    client_url
        .set_host(Some("127.0.0.1"))
        .map_err(|_| RelayError::Url)?;
    client_url
        .set_port(Some(local.port()))
        .map_err(|()| RelayError::Url)?;
    let cut = Arc::new(Cut::default());
    tokio::spawn(relay(listener, camera, max, cut.clone(), refused));
    Ok(Relayed {
        url: client_url,
        cut,
    })
}

/// Serves the one client connection until either side ends it or the
/// camera sends what the inspector refuses.
async fn relay(
    listener: TcpListener,
    camera: TcpStream,
    max: u64,
    cut: Arc<Cut>,
    refused: OnRefused,
) {
    let Some(client) = own_client(&listener, &refused).await else {
        return;
    };
    drop(listener);
    let _ = client.set_nodelay(true);
    let (mut from_camera, mut to_camera) = camera.into_split();
    let (mut from_client, mut to_client) = client.into_split();
    let requests = async {
        let _ = tokio::io::copy(&mut from_client, &mut to_camera).await;
    };
    let answers = async {
        let mut inspector = Inspector::new(max);
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = match from_camera.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if let Err(e) = inspector.feed(&buf[..n]) {
                *cut.0.lock() = Some(e);
                return;
            }
            if to_client.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    // Either side's end closes both connections.
    tokio::select! {
        () = requests => {}
        () = answers => {}
    }
}

/// The first connection of this process's own within [`ACCEPT_WAIT`];
/// every other one before it is closed and reported.
async fn own_client(listener: &TcpListener, refused: &OnRefused) -> Option<TcpStream> {
    let local = listener.local_addr().ok()?;
    let deadline = tokio::time::Instant::now() + ACCEPT_WAIT;
    loop {
        let (conn, from) = tokio::time::timeout_at(deadline, listener.accept())
            .await
            .ok()?
            .ok()?;
        let why = match peer::owner(local, from) {
            Ok(Owner::Ours) => return Some(conn),
            Ok(Owner::Foreign) => Refused::Foreign { from },
            Err(source) => Refused::Unknown { from, source },
        };
        drop(conn);
        refused(&why);
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .unwrap()
    }

    #[test]
    fn the_client_gets_the_cameras_answers_and_an_oversize_one_closes_it() {
        let camera = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = ::url::Url::parse(&format!(
            "rtsp://127.0.0.1:{}/cam?x=1",
            camera.local_addr().unwrap().port()
        ))
        .unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = camera.accept().unwrap();
            let mut req = [0u8; 64];
            let n = s.read(&mut req).unwrap();
            assert_eq!(&req[..n], b"OPTIONS\r\n\r\n");
            s.write_all(b"RTSP/1.0 200 OK\r\nCSeq: 1\r\n\r\n").unwrap();
            let n = s.read(&mut req).unwrap();
            assert_eq!(&req[..n], b"DESCRIBE\r\n\r\n");
            let _ = s.write_all(b"RTSP/1.0 200 OK\r\nContent-Length: 100000000000\r\n\r\nv=0");
        });
        let rt = runtime();
        rt.block_on(async {
            let r = open(&url, 1 << 20, Box::new(|_| {})).await.unwrap();
            assert_eq!(r.url.host_str(), Some("127.0.0.1"));
            assert_eq!(r.url.path(), "/cam");
            assert_eq!(r.url.query(), Some("x=1"));
            let port = r.url.port().unwrap();
            let mut c = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
            c.write_all(b"OPTIONS\r\n\r\n").await.unwrap();
            let mut got = vec![0u8; 256];
            let n = c.read(&mut got).await.unwrap();
            assert_eq!(&got[..n], b"RTSP/1.0 200 OK\r\nCSeq: 1\r\n\r\n");
            c.write_all(b"DESCRIBE\r\n\r\n").await.unwrap();
            let mut rest = Vec::new();
            let _ = c.read_to_end(&mut rest).await;
            assert!(rest.is_empty(), "the oversize answer reached the client");
            assert!(matches!(r.cut.reason(), Some(Oversize::Message { .. })));
        });
        server.join().unwrap();
    }

    /// Another local process that connected to the relay's port before the
    /// daemon's client got the camera's answers, and the daemon's session
    /// failed.
    #[test]
    fn a_connection_from_another_process_is_refused_and_the_own_client_still_served() {
        use std::io::BufRead;
        use std::process::{Command, Stdio};

        let camera = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = ::url::Url::parse(&format!(
            "rtsp://127.0.0.1:{}/cam",
            camera.local_addr().unwrap().port()
        ))
        .unwrap();
        // The camera answers each request with the request it got.
        let server = std::thread::spawn(move || {
            let (mut s, _) = camera.accept().unwrap();
            let mut req = [0u8; 64];
            let n = s.read(&mut req).unwrap();
            let req = String::from_utf8_lossy(&req[..n]).trim().to_string();
            s.write_all(format!("RTSP/1.0 200 OK\r\nX-Got: {req}\r\n\r\n").as_bytes())
                .unwrap();
        });
        let seen = Arc::new(Mutex::new(Vec::<String>::new()));
        let s2 = seen.clone();
        let rt = runtime();
        let foreign = rt.block_on(async {
            let r = open(
                &url,
                1 << 20,
                Box::new(move |why| s2.lock().push(why.to_string())),
            )
            .await
            .unwrap();
            let port = r.url.port().unwrap();
            // Another process connects first, sends a request and prints
            // whatever comes back until the connection closes. Its request
            // may meet a connection already closed: SIGPIPE is ignored, so
            // it still says `closed`.
            let mut foreign = Command::new("bash")
                .arg("-c")
                .arg(format!(
                    "trap '' PIPE; exec 3<>/dev/tcp/127.0.0.1/{port}; echo connected; \
                     printf 'OPTIONS foreign\\r\\n\\r\\n' >&3 2>/dev/null; cat <&3 2>/dev/null; echo closed"
                ))
                .stdout(Stdio::piped())
                .spawn()
                .unwrap();
            let mut out = std::io::BufReader::new(foreign.stdout.take().unwrap());
            let mut line = String::new();
            out.read_line(&mut line).unwrap();
            assert_eq!(line.trim(), "connected");
            // Then the daemon's client.
            let mut c = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
            c.write_all(b"OPTIONS own\r\n\r\n").await.unwrap();
            let mut got = vec![0u8; 256];
            let n = c.read(&mut got).await.unwrap();
            assert_eq!(
                String::from_utf8_lossy(&got[..n]),
                "RTSP/1.0 200 OK\r\nX-Got: OPTIONS own\r\n\r\n"
            );
            let mut rest = String::new();
            out.read_to_string(&mut rest).unwrap();
            foreign.wait().unwrap();
            rest
        });
        assert_eq!(foreign, "closed\n", "the other process got an answer");
        let seen = seen.lock();
        assert_eq!(seen.len(), 1, "{seen:?}");
        assert!(seen[0].contains("another process"), "{seen:?}");
        server.join().unwrap();
    }
}
