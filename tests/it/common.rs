//! Paths and helpers shared by the integration tests.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn model_dir() -> PathBuf {
    root().join("models")
}

/// The ONNX Runtime library `models/fetch` puts in place for this machine.
pub fn ort_lib() -> PathBuf {
    let arch = std::env::consts::ARCH;
    let p = root()
        .join("models/lib")
        .join(arch)
        .join("libonnxruntime.so");
    assert!(
        p.exists(),
        "{} missing: run models/fetch && models/build first",
        p.display()
    );
    p
}

/// The model file of a model folder, checked present.
pub fn model_file(name: &str, file: &str) -> PathBuf {
    let p = model_dir().join(name).join(file);
    assert!(
        p.exists(),
        "{} missing: run models/fetch && models/build first",
        p.display()
    );
    p
}

/// `outpost` with the fetched runtime and the checkout's model dir.
pub fn outpost() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_outpost"));
    c.env("ORT_DYLIB_PATH", ort_lib())
        .env("OUTPOST_MODEL_DIR", model_dir())
        .env_remove("OUTPOST_CONFIG")
        .env_remove("RUST_LOG")
        .current_dir(root());
    c
}

pub fn run(c: &mut Command) -> Output {
    c.output().expect("spawn outpost")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts a clean failure: the exit code, a message, and no panic.
pub fn assert_fails(o: &Output, code: i32, needle: &str) {
    let err = stderr(o);
    assert_eq!(
        o.status.code(),
        Some(code),
        "exit status; stderr:\n{err}\nstdout:\n{}",
        stdout(o)
    );
    assert!(err.contains(needle), "stderr lacks `{needle}`:\n{err}");
    assert!(!err.contains("panicked"), "panic:\n{err}");
}

pub fn json(o: &Output) -> serde_json::Value {
    assert!(
        o.status.success(),
        "outpost failed: {}\n{}",
        o.status,
        stderr(o)
    );
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("bad JSON ({e}): {}", stdout(o)))
}

/// Copies a model folder (manifest and model file) into `dst/<name>`.
pub fn copy_model(name: &str, dst: &Path) -> PathBuf {
    let src = model_dir().join(name);
    let to = dst.join(name);
    std::fs::create_dir_all(&to).unwrap();
    for e in std::fs::read_dir(&src).unwrap().flatten() {
        if e.path().is_file() {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
    to
}

/// A free TCP port on loopback (bound, then released for the daemon).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A loopback TCP port that refuses connections for as long as the guard
/// lives: a socket bound to it that never listens, so no other test can
/// take the port in the meantime (as one may a port `free_port` let go).
pub struct RefusedPort {
    fd: std::os::fd::OwnedFd,
    pub port: u16,
}

impl RefusedPort {
    pub fn new() -> RefusedPort {
        use std::os::fd::FromRawFd;
        // SAFETY: plain socket calls on a descriptor this function owns;
        // the address structure is fully initialised before use.
        unsafe {
            let raw = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            assert!(raw >= 0, "socket: {}", std::io::Error::last_os_error());
            let fd = std::os::fd::OwnedFd::from_raw_fd(raw);
            let mut addr: libc::sockaddr_in = std::mem::zeroed();
            addr.sin_family = libc::AF_INET as libc::sa_family_t;
            addr.sin_addr.s_addr = u32::from(std::net::Ipv4Addr::LOCALHOST).to_be();
            let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            let p = &raw mut addr as *mut libc::sockaddr;
            assert_eq!(
                libc::bind(raw, p, len),
                0,
                "bind: {}",
                std::io::Error::last_os_error()
            );
            let mut got = len;
            assert_eq!(libc::getsockname(raw, p, &mut got), 0);
            RefusedPort {
                fd,
                port: u16::from_be(addr.sin_port),
            }
        }
    }
}

impl std::fmt::Debug for RefusedPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use std::os::fd::AsRawFd;
        write!(
            f,
            "RefusedPort({} on fd {})",
            self.port,
            self.fd.as_raw_fd()
        )
    }
}

/// A plain HTTP/1.1 request on loopback; returns (status, body).
pub fn http(method: &str, addr: &str, path: &str, body: &[u8]) -> std::io::Result<(u16, Vec<u8>)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(30)))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    s.write_all(body)?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    let split = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| std::io::Error::other("no header end"))?;
    let head = String::from_utf8_lossy(&buf[..split]).into_owned();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let mut body = buf[split + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body);
    }
    Ok((status, body))
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = b.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let n = usize::from_str_radix(String::from_utf8_lossy(&b[..eol]).trim(), 16).unwrap_or(0);
        if n == 0 {
            return out;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + n]);
        b = &b[eol + 2 + n + 2..];
    }
}

/// The API address in the daemon's "outpost ready" log line (`api=ADDR`).
pub fn ready_api(log: &str) -> Option<String> {
    let line = log.lines().find(|l| l.contains("outpost ready"))?;
    let at = line.find(" api=")? + " api=".len();
    let addr = line[at..].split_whitespace().next()?;
    Some(addr.trim_matches('"').to_string())
}

/// A real `outpost run` process; killed on drop.
pub struct Daemon {
    pub child: std::process::Child,
    pub api: String,
    pub dir: tempfile::TempDir,
    records: std::sync::mpsc::Receiver<serde_json::Value>,
    pub seen: Vec<serde_json::Value>,
}

impl Daemon {
    /// Writes `config` (with `{API}` and `{DATA}` replaced) and starts the
    /// daemon with --print-records; waits for /readyz. `{API}` is port 0 on
    /// loopback: the daemon binds a free port and logs it when ready.
    pub fn start(config: &str) -> Daemon {
        let dir = tempfile::tempdir().unwrap();
        Self::start_in(config, dir)
    }

    pub fn start_in(config: &str, dir: tempfile::TempDir) -> Daemon {
        Self::start_full(config, dir, &[], true)
    }

    /// With extra environment; `wait` = wait for /readyz.
    pub fn start_full(
        config: &str,
        dir: tempfile::TempDir,
        envs: &[(&str, String)],
        wait: bool,
    ) -> Daemon {
        let data = dir.path().join("data");
        let text = config
            .replace("{API}", "127.0.0.1:0")
            .replace("{DATA}", &data.display().to_string())
            .replace("{DIR}", &dir.path().display().to_string());
        let cfg = dir.path().join("outpost.toml");
        std::fs::write(&cfg, text).unwrap();
        let mut cmd = outpost();
        if let Some(prefix) = WRAP.with(|w| w.borrow_mut().take()) {
            // Run it under a wrapper (e.g. `prlimit --nofile=256:256 --`).
            let program = cmd.get_program().to_owned();
            let mut wrapped = Command::new(&prefix[0]);
            wrapped.args(&prefix[1..]).arg(program);
            for (k, v) in cmd.get_envs() {
                match v {
                    Some(v) => wrapped.env(k, v),
                    None => wrapped.env_remove(k),
                };
            }
            wrapped.current_dir(root());
            cmd = wrapped;
        }
        let mut child = cmd
            .arg("--config")
            .arg(&cfg)
            .args(["run", "--print-records"])
            .env("RUST_LOG", "info,ort=warn")
            .envs(envs.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(std::process::Stdio::piped())
            .stderr(std::fs::File::create(dir.path().join("daemon.log")).unwrap())
            .spawn()
            .expect("spawn outpost run");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str(&line) {
                    let _ = tx.send(v);
                }
            }
        });
        let mut d = Daemon {
            child,
            api: String::new(),
            dir,
            records: rx,
            seen: Vec::new(),
        };
        if wait {
            d.wait_ready();
        }
        d
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("daemon.log")).unwrap_or_default()
    }

    /// The API address from the "outpost ready" log line, once it is there.
    pub fn learn_api(&mut self) -> bool {
        if self.api.is_empty()
            && let Some(addr) = ready_api(&self.log())
        {
            self.api = addr;
        }
        !self.api.is_empty()
    }

    /// Waits for the "outpost ready" log line, learns the API address from
    /// it, then for /readyz.
    pub fn wait_ready(&mut self) {
        let t0 = std::time::Instant::now();
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!("daemon exited early ({st}):\n{}", self.log());
            }
            self.learn_api();
            if !self.api.is_empty()
                && let Ok((200, _)) = http("GET", &self.api, "/readyz", b"")
            {
                return;
            }
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(60),
                "daemon not ready in 60 s:\n{}",
                self.log()
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    pub fn status(&self) -> serde_json::Value {
        let (code, body) = http("GET", &self.api, "/v1/status", b"").expect("status");
        assert_eq!(code, 200);
        serde_json::from_slice(&body).unwrap()
    }

    /// Collects printed records until `pred(records)` or the timeout.
    pub fn records_until(
        &mut self,
        timeout: std::time::Duration,
        pred: impl Fn(&[serde_json::Value]) -> bool,
    ) -> &[serde_json::Value] {
        let t0 = std::time::Instant::now();
        while !pred(&self.seen) && t0.elapsed() < timeout {
            if let Ok(v) = self
                .records
                .recv_timeout(std::time::Duration::from_millis(50))
            {
                self.seen.push(v);
            }
        }
        while let Ok(v) = self.records.try_recv() {
            self.seen.push(v);
        }
        &self.seen
    }

    /// SIGTERM, then wait for the exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let t0 = std::time::Instant::now();
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                // Drain what was printed before the exit.
                std::thread::sleep(std::time::Duration::from_millis(100));
                while let Ok(v) = self.records.try_recv() {
                    self.seen.push(v);
                }
                return st;
            }
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(30),
                "daemon did not stop on SIGTERM:\n{}",
                self.log()
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// Stops it (SIGTERM) and hands back its folder, to start again on the same data.
    pub fn stop_keep_dir(mut self) -> tempfile::TempDir {
        self.terminate();
        std::mem::replace(&mut self.dir, tempfile::tempdir().unwrap())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A daemon config with one `sensors` pipeline (sensor_mlp, JSON vectors of
/// 16) fed over HTTP; `api_extra` goes into the `[api]` table.
pub fn sensors_over_http(api_extra: &str) -> String {
    format!(
        r#"
data_dir = "{{DATA}}"
[api]
listen = "{{API}}"
{api_extra}
[[pipelines]]
name = "sensors"
model = "sensor_mlp"
source = {{ type = "http" }}
[pipelines.preprocess]
type = "sensor"
format = "json"
length = 16
"#
    )
}

thread_local! {
    /// A wrapper command for the next daemon this thread starts.
    static WRAP: std::cell::RefCell<Option<Vec<String>>> = const { std::cell::RefCell::new(None) };
}

/// The next `Daemon::start*` on this thread runs `prefix... outpost ...`.
pub fn wrap_next_daemon(prefix: &[&str]) {
    WRAP.with(|w| *w.borrow_mut() = Some(prefix.iter().map(|s| s.to_string()).collect()));
}

/// POST with `Authorization: Bearer TOKEN` and no body (pause, resume,
/// reload); returns the status code.
pub fn post_with_token(api: &str, path: &str, token: &str) -> u16 {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(api).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {api}\r\nAuthorization: Bearer {token}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).unwrap();
    buf.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// Random moments for crash tests (when to SIGKILL). The seed comes from
/// `OUTPOST_TEST_SEED` (to replay a failed run) or the clock, and is printed.
pub struct KillTimes(u64);

impl KillTimes {
    pub fn new(test: &str) -> KillTimes {
        let seed = match std::env::var("OUTPOST_TEST_SEED") {
            Ok(s) => s.parse().expect("OUTPOST_TEST_SEED is a u64"),
            Err(_) => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos() as u64,
        };
        eprintln!("{test}: random kill times from seed {seed} (replay: OUTPOST_TEST_SEED={seed})");
        KillTimes(seed | 1)
    }

    /// A number of milliseconds in `lo..hi` (xorshift64).
    pub fn millis(&mut self, lo: u64, hi: u64) -> std::time::Duration {
        let x = &mut self.0;
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        std::time::Duration::from_millis(lo + *x % (hi - lo).max(1))
    }
}
