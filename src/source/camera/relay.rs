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

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::guard::{Inspector, Oversize};

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

/// A camera connected, and where the client is to find it.
pub(super) struct Relayed {
    /// `url` with the loopback address and port in place of the camera's.
    pub(super) url: ::url::Url,
    pub(super) cut: Arc<Cut>,
}

/// Connects to the camera at `url` and starts the relay on the current
/// runtime (the camera's own), bounding what the camera sends by `max`
/// bytes a message or frame. The error: why the camera cannot be reached,
/// in the operating system's words.
pub(super) async fn open(url: &::url::Url, max: u64) -> Result<Relayed, RelayError> {
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
    tokio::spawn(relay(listener, camera, max, cut.clone()));
    Ok(Relayed {
        url: client_url,
        cut,
    })
}

/// Serves the one client connection until either side ends it or the
/// camera sends what the inspector refuses.
async fn relay(listener: TcpListener, camera: TcpStream, max: u64, cut: Arc<Cut>) {
    let Ok(Ok((client, _))) = tokio::time::timeout(ACCEPT_WAIT, listener.accept()).await else {
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
            let r = open(&url, 1 << 20).await.unwrap();
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
}
