//! A disk that turns read-only under a running daemon: the daemon's data
//! directory on ext4 in a loop-mounted image (`errors=remount-ro`), made
//! read-only by ext4's own error path (`/sys/fs/ext4/<dev>/trigger_fs_error`
//! runs the `ext4_error` a media error runs), then unmounted, checked with
//! `e2fsck` and mounted again, as an operator brings such a disk back.
//!
//! Why not `mount -o remount,ro`: Linux refuses to remount a file system
//! read-only while a file on it is open for writing (EBUSY), and sled keeps
//! its log open, so a disk turns read-only under a running daemon only
//! through an error; and ext4 clears an error's read-only state only at
//! unmount (`remount,rw` leaves it read-only).
//!
//! Needs root and loop devices (as `.ci/run` has); skipped with the reason
//! otherwise.

use std::collections::{BTreeSet, HashSet};
use std::net::UdpSocket;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::{Daemon, http, outpost};
use crate::uplink::{Fleet, Mosquitto};

const DEVICE: &str = "gw-ro";
/// `memory_when_read_only` in the test: room for a few dozen records.
const HELD_BOUND: u64 = 8 << 10;
/// Records made while the disk is read-only: more than the bound holds.
const WHILE_READ_ONLY: usize = 60;

/// An ext4 image mounted on a loop device for the test's life.
struct LoopDisk {
    image: PathBuf,
    at: PathBuf,
    mounted: bool,
}

fn sh(cmd: &mut Command) -> Result<String, String> {
    let out = cmd
        .output()
        .map_err(|e| format!("{:?}: {e}", cmd.get_program()))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    } else {
        Err(format!(
            "{cmd:?}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl LoopDisk {
    /// A fresh 64 MiB ext4 image at `image`, mounted at `at`; Err: why the
    /// test cannot run here.
    fn make(image: &Path, at: &Path) -> Result<LoopDisk, String> {
        if sh(Command::new("id").arg("-u"))? != "0" {
            return Err("needs root to mount a loop device (CI runs as root)".into());
        }
        sh(Command::new("losetup").arg("-f")).map_err(|e| format!("no free loop device: {e}"))?;
        sh(Command::new("truncate").args(["-s", "64M"]).arg(image))?;
        sh(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(image))
            .map_err(|e| format!("mkfs.ext4 (Debian package e2fsprogs): {e}"))?;
        std::fs::create_dir_all(at).map_err(|e| e.to_string())?;
        let mut d = LoopDisk {
            image: image.to_path_buf(),
            at: at.to_path_buf(),
            mounted: false,
        };
        d.mount()
            .map_err(|e| format!("mounting a loop device: {e}"))?;
        if !d.trigger().exists() {
            return Err(format!(
                "this kernel has no {} (ext4's error trigger)",
                d.trigger().display()
            ));
        }
        Ok(d)
    }

    fn mount(&mut self) -> Result<(), String> {
        sh(Command::new("mount")
            .args(["-o", "loop,errors=remount-ro"])
            .arg(&self.image)
            .arg(&self.at))?;
        self.mounted = true;
        Ok(())
    }

    /// The error trigger of the mounted file system (its loop device).
    fn trigger(&self) -> PathBuf {
        let src = sh(Command::new("findmnt")
            .args(["-no", "SOURCE"])
            .arg(&self.at))
        .unwrap_or_default();
        let dev = Path::new(&src)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        PathBuf::from(format!("/sys/fs/ext4/{dev}/trigger_fs_error"))
    }

    /// What a media error does: ext4 reports an error and, with
    /// `errors=remount-ro`, takes writes no more.
    fn fail(&self) {
        std::fs::write(self.trigger(), "outpost test: the flash failed\n")
            .expect("write ext4's error trigger");
    }

    /// Unmounts (retrying while something holds it, up to `limit`), checks
    /// and repairs the file system, mounts it again.
    fn bring_back(&mut self, limit: Duration) -> Result<(), String> {
        let t0 = Instant::now();
        loop {
            match sh(Command::new("umount").arg(&self.at)) {
                Ok(_) => break,
                Err(e) if t0.elapsed() > limit => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
        self.mounted = false;
        // 0: clean, 1: errors corrected (the error the trigger recorded).
        let st = Command::new("e2fsck")
            .arg("-fy")
            .arg(&self.image)
            .output()
            .map_err(|e| e.to_string())?;
        if !matches!(st.status.code(), Some(0 | 1)) {
            return Err(format!(
                "e2fsck: {}: {}",
                st.status,
                String::from_utf8_lossy(&st.stdout)
            ));
        }
        self.mount()
    }
}

impl Drop for LoopDisk {
    fn drop(&mut self) {
        if self.mounted {
            let _ = Command::new("umount").arg("-l").arg(&self.at).status();
        }
    }
}

/// 16 values the sensors pipeline takes.
fn frame(k: usize) -> String {
    format!(
        "[{}]",
        (0..16)
            .map(|i| format!("{}", ((i + k) % 23) as f32 / 7.0))
            .collect::<Vec<_>>()
            .join(",")
    )
}

/// One frame through the HTTP source; its record (the status code must be 200).
fn infer(d: &Daemon, k: usize) -> Value {
    let (code, out) = http(
        "POST",
        &d.api,
        "/v1/pipelines/sensors/infer?stream=s1",
        frame(k).as_bytes(),
    )
    .unwrap();
    assert_eq!(
        code,
        200,
        "frame {k}: {}\n{}",
        String::from_utf8_lossy(&out),
        d.log()
    );
    let v: Value = serde_json::from_slice(&out).unwrap();
    v["records"][0].clone()
}

fn id(v: &Value) -> String {
    v["id"].as_str().expect("a record id").to_string()
}

/// The ids of `n` datagrams from the UDP output.
fn datagrams(s: &UdpSocket, n: usize) -> Vec<String> {
    let mut buf = vec![0u8; 65536];
    (0..n)
        .map(|_| {
            let len = s.recv(&mut buf).expect("a datagram from the udp output");
            id(&serde_json::from_slice(&buf[..len]).unwrap())
        })
        .collect()
}

fn metric(d: &Daemon, line_start: &str) -> f64 {
    let (_, body) = http("GET", &d.api, "/metrics", b"").unwrap();
    String::from_utf8_lossy(&body)
        .lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {line_start} in /metrics"))
}

fn wait_for(d: &Daemon, limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(
            t0.elapsed() < limit,
            "{what}: not within {limit:?}\noutbox: {}\nuplink: {}\n{}",
            d.status()["outbox"],
            d.status()["uplink"],
            d.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Ids the fleet received (each once at least), in arrival order of first copies.
fn delivered(fleet: &Fleet) -> Vec<String> {
    let mut seen = HashSet::new();
    fleet
        .records()
        .iter()
        .map(|(_, v)| id(v))
        .filter(|i| seen.insert(i.clone()))
        .collect()
}

fn seq(id: &str) -> u64 {
    id.rsplit('/').next().unwrap().parse().unwrap()
}

fn config(data: &Path, broker: u16, udp: u16) -> String {
    format!(
        r#"
device = "{DEVICE}"
data_dir = "{data}"
[api]
listen = "{{API}}"
[outbox]
memory_when_read_only = {HELD_BOUND}
[[pipelines]]
name = "sensors"
model = "sensor_mlp"
source = {{ type = "http" }}
outputs = [ {{ type = "udp", to = "127.0.0.1:{udp}" }} ]
[pipelines.preprocess]
type = "sensor"
format = "json"
length = 16
[uplink]
type = "mqtt"
host = "127.0.0.1"
port = {broker}
backoff_min = "100ms"
backoff_max = "1s"
keep_alive = "5s"
connect_timeout = "2s"
"#,
        data = data.display()
    )
}

/// Regression: when the disk turned read-only the outbox refused every
/// result (503 on the HTTP source, dropped by the pipelines) and, reopening
/// sled on a file system it cannot open, stopped reading the records it
/// had stored, so the uplink sent nothing until the disk came back. Now the
/// results are held in memory up to `memory_when_read_only` and counted
/// beyond it, the stored records are sent, `/readyz` and the status say
/// read-only, and once the disk is mounted again the daemon stores the held
/// records and goes on by itself, nothing committed lost.
#[test]
fn a_disk_turned_read_only_holds_results_sends_stored_ones_and_resumes_when_mounted_again() {
    let work = tempfile::tempdir().unwrap();
    let mut disk = match LoopDisk::make(&work.path().join("disk.img"), &work.path().join("mnt")) {
        Ok(d) => d,
        Err(why) => {
            eprintln!("skipped: {why}");
            return;
        }
    };
    let data = work.path().join("mnt/data");
    let mut broker = Mosquitto::start(&work.path().join("broker"));
    let fleet = Fleet::start(broker.port, "fleet-ro");
    let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
    udp.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let udp_port = udp.local_addr().unwrap().port();
    let mut d = Daemon::start_in(
        &config(&data, broker.port, udp_port),
        tempfile::tempdir().unwrap(),
    );
    let long = Duration::from_secs(30);
    let status = |d: &Daemon| d.status()["outbox"].clone();

    // 1. The fleet's broker is away: records are committed and stay.
    wait_for(&d, long, "uplink connects", || {
        d.status()["uplink"]["connected"] == true
    });
    broker.stop();
    wait_for(&d, long, "uplink notices the broker left", || {
        d.status()["uplink"]["connected"] == false
    });
    let flushes_before = metric(&d, "outpost_outbox_flushes_total");
    let committed: Vec<String> = (0..20).map(|k| id(&infer(&d, k))).collect();
    assert_eq!(datagrams(&udp, committed.len()), committed);
    // Committed: a flush came after them and the flusher went idle (an
    // idle flusher has made everything durable).
    let mut last = -1.0;
    wait_for(&d, long, "the group commit covers them", || {
        let now = metric(&d, "outpost_outbox_flushes_total");
        let idle = now == last && now > flushes_before;
        last = now;
        std::thread::sleep(Duration::from_millis(200));
        idle
    });
    assert_eq!(status(&d)["records"], 20);

    // 2. The disk fails and turns read-only under the daemon.
    disk.fail();
    let probe = std::fs::write(data.join("outbox/test-probe"), b"x").unwrap_err();
    assert_eq!(probe.raw_os_error(), Some(30), "EROFS: {probe}");

    // Local outputs keep flowing and the HTTP source keeps answering.
    let during: Vec<String> = (100..100 + WHILE_READ_ONLY)
        .map(|k| id(&infer(&d, k)))
        .collect();
    assert_eq!(datagrams(&udp, during.len()), during);
    wait_for(&d, long, "the outbox says read-only", || {
        status(&d)["read_only"] == true
    });
    let o = status(&d);
    let held = o["held_records"].as_u64().unwrap() as usize;
    let dropped = o["held_dropped_total"].as_u64().unwrap() as usize;
    // Appended before a commit met the error: in the store, not held.
    let stored_extra = o["records"].as_u64().unwrap() as usize - committed.len();
    assert!(held > 0 && dropped > 0, "{o}");
    assert!(o["held_bytes"].as_u64().unwrap() <= HELD_BOUND, "{o}");
    assert_eq!(stored_extra + held + dropped, WHILE_READ_ONLY, "{o}");
    assert_eq!(
        metric(&d, "outpost_outbox_dropped_total{reason=\"read_only\"}"),
        dropped as f64
    );
    assert_eq!(metric(&d, "outpost_outbox_read_only"), 1.0);
    let (code, body) = http("GET", &d.api, "/readyz", b"").unwrap();
    let why = String::from_utf8_lossy(&body).into_owned();
    assert_eq!(code, 503, "{why}");
    assert!(
        why.contains("read-only") && why.contains(&format!("{held} records held in memory")),
        "{why}"
    );

    // 3. The broker is back: the stored records and the held ones go out,
    // though the disk takes no write (acknowledgements wait in memory).
    broker.restart();
    let want: BTreeSet<String> = committed
        .iter()
        .chain(&during[..stored_extra])
        .chain(&during[WHILE_READ_ONLY - held..])
        .cloned()
        .collect();
    // sled may need a write to read a page (it merges a page's updates on
    // the way): once its log refused a write, such reads fail too, and the
    // stored records wait for the disk (nothing is lost or reordered; the
    // daemon keeps serving). Which pages need it depends on the history of
    // writes, so the test accepts that outcome and says so.
    let t0 = Instant::now();
    loop {
        let got: BTreeSet<String> = delivered(&fleet).into_iter().collect();
        if want.is_subset(&got) {
            break;
        }
        if d.log().contains("outbox read pending: IO error")
            && t0.elapsed() > Duration::from_secs(5)
        {
            assert!(
                got.is_empty(),
                "records sent out of order while the store refused reads: {got:?}"
            );
            assert_eq!(d.status()["outbox"]["read_only"], true);
            eprintln!(
                "the read-only store refused reads (sled needed a write): the rest of the drill needs a readable store"
            );
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(40),
            "stored and held records delivered: not within 40s\noutbox: {}\n{}",
            d.status()["outbox"],
            d.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let got = delivered(&fleet);
    // Nothing else: the dropped ones are the oldest held, counted above.
    assert_eq!(got.len(), want.len(), "{got:?}");
    let seqs: Vec<u64> = got.iter().map(|i| seq(i)).collect();
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]),
        "out of order: {seqs:?}"
    );
    // With every stored record sent, the daemon closes the database so the
    // disk can be unmounted.
    wait_for(&d, long, "the read-only store is closed", || {
        let o = status(&d);
        o["store_closed"] == true && o["records"] == 0 && o["held_records"] == 0
    });

    // 4. More results while read-only and the broker away again: held.
    broker.stop();
    wait_for(&d, long, "uplink notices the broker left", || {
        d.status()["uplink"]["connected"] == false
    });
    let later: Vec<String> = (200..205).map(|k| id(&infer(&d, k))).collect();
    assert_eq!(datagrams(&udp, later.len()), later);
    assert_eq!(status(&d)["held_records"], 5);

    // 5. The operator brings the disk back; the daemon goes on by itself
    // and stores what it held.
    disk.bring_back(Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    wait_for(&d, long, "ready again", || {
        http("GET", &d.api, "/readyz", b"").is_ok_and(|(c, _)| c == 200)
    });
    let o = status(&d);
    assert_eq!(o["read_only"], false, "{o}");
    assert_eq!(o["held_records"], 0, "{o}");
    assert_eq!(o["records"], 5, "{o}");
    assert!(metric(&d, "outpost_outbox_reopens_total") >= 1.0);
    assert_eq!(metric(&d, "outpost_outbox_read_only"), 0.0);
    let after: Vec<String> = (300..303).map(|k| id(&infer(&d, k))).collect();
    assert_eq!(datagrams(&udp, after.len()), after);

    // 6. The broker is back: the held-then-stored records and the new ones go out.
    broker.restart();
    let all: BTreeSet<String> = want.iter().chain(&later).chain(&after).cloned().collect();
    wait_for(
        &d,
        Duration::from_secs(40),
        "every record delivered",
        || {
            let got: BTreeSet<String> = delivered(&fleet).into_iter().collect();
            all.is_subset(&got)
        },
    );
    wait_for(&d, long, "acknowledged", || status(&d)["records"] == 0);
    let got = delivered(&fleet);
    assert_eq!(got.len(), all.len());
    let seqs: Vec<u64> = got.iter().map(|i| seq(i)).collect();
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]),
        "out of order: {seqs:?}"
    );
    d.terminate();

    // On the disk: nothing left to send.
    let out = outpost()
        .args(["outbox", "stats", "--json", "--data-dir"])
        .arg(&data)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(s["records"], 0, "{s}");
}
