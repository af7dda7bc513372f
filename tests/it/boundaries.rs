//! What comes in from outside stays inside its bounds: a camera URL is only
//! data, stalled unix-socket writers cannot starve the others, unix output
//! readers cannot take the descriptors storage needs, and camera
//! credentials never reach status, events or the log. Each with the real
//! daemon and real peers.

use std::io::Read;
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::common::*;

// ---- camera URLs -------------------------------------------------------------

/// The device text of a `v4l2://` URL was pasted into a launch string: this
/// URL passed `check`, and the daemon ran the pipeline it spelled, whose
/// filesink truncated VICTIM to 0 bytes. Now `check` refuses it, naming the
/// key, and `run` refuses the config; VICTIM keeps its bytes.
#[test]
fn v4l2_url_with_pipeline_syntax_is_refused_and_runs_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let victim = dir.path().join("VICTIM");
    std::fs::write(&victim, b"precious").unwrap();
    let cfg = dir.path().join("outpost.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"
data_dir = "{data}"
[api]
listen = "127.0.0.1:0"
[[pipelines]]
name = "cam"
model = "classifier"
source = {{ type = "camera", url = "v4l2:///dev/null ! fakesink videotestsrc num-buffers=3 ! tee name=t ! queue ! filesink location={victim} t. ! queue" }}
"#,
            data = dir.path().join("data").display(),
            victim = victim.display()
        ),
    )
    .unwrap();
    let o = run(outpost().arg("check").arg(&cfg));
    assert_fails(&o, 2, "source.url");
    assert!(
        stderr(&o).contains("device path holds a space"),
        "{}",
        stderr(&o)
    );

    let mut child = outpost()
        .arg("--config")
        .arg(&cfg)
        .arg("run")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t0.elapsed() > Duration::from_secs(30) || std::fs::read(&victim).unwrap() != b"precious"
        {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the daemon ran the URL's pipeline (VICTIM now {:?})",
                std::fs::read(&victim).unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(!status.success(), "{err}");
    assert!(err.contains("source.url"), "{err}");
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
}
