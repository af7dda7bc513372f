//! `outpost check` lists every problem of a config in one run, each with
//! its line and key (a typo once hid a missing model, a duplicate name and
//! a bad placeholder), and the printed example passes it as printed.

use std::io::Write;
use std::process::Stdio;

use crate::common::*;

/// Five mistakes: an unknown key, a model that does not exist, a duplicate
/// pipeline name, an unknown placeholder and (in a build without the
/// `camera` feature) a camera source.
const FIVE: &str = r#"# one of each
[[pipelines]]
name = "gate"
model = "no_such_model"
when_ful = "drop_oldest"
source = { type = "camera", url = "rtsp://10.0.0.7:554/stream1", fps = 10 }

[[pipelines]]
name = "gate"
model = "sensor_mlp"
source = { type = "udp", listen = "127.0.0.1:9400" }
outputs = [{ type = "mqtt", topic = "site/{pipline}/{stream}" }]
"#;

/// The problem lines of a failed check (`  - line N: ...`).
fn problems(err: &str) -> Vec<&str> {
    err.lines()
        .filter_map(|l| l.trim_start().strip_prefix("- "))
        .collect()
}

#[test]
fn check_hid_problems_behind_a_typo_and_gave_no_lines() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("outpost.toml");
    std::fs::write(&cfg, FIVE).unwrap();
    let o = run(outpost().arg("check").arg(&cfg));
    let err = stderr(&o);
    // A camera build reads cameras: the fifth mistake is the unit tests'
    // (config::read), which run the check as a build without them.
    let camera = cfg!(feature = "camera");
    let n = if camera { 4 } else { 5 };
    assert_fails(&o, 2, &format!("{n} problem(s)"));
    let got = problems(&err);
    assert_eq!(got.len(), n, "{err}");
    let mut want = vec![
        "line 4: pipeline \"gate\" (line 2), model: model `no_such_model`: not found",
        "line 5: pipeline \"gate\" (line 2), when_ful: unknown key `when_ful` (did you mean `when_full`?)",
        "line 9: pipeline \"gate\" (line 8), name: `gate` is already the name of pipeline \"gate\" (line 2)",
        "line 12: pipeline \"gate\" (line 8), outputs#1.topic: unknown placeholder `{pipline}`",
    ];
    if !camera {
        want.insert(
            2,
            "line 6: pipeline \"gate\" (line 2), source: a camera source needs outpost built with the `camera` feature",
        );
    }
    // In the order of the file.
    for (g, w) in got.iter().zip(&want) {
        assert!(g.starts_with(w), "`{g}` is not `{w}...`:\n{err}");
    }

    // The daemon refuses the same file with the same list, less the model
    // (a model that fails to load stops only its pipeline).
    let o = run(outpost().arg("--config").arg(&cfg).arg("run"));
    assert_fails(&o, 2, &format!("{} problem(s)", n - 1));
    assert!(stderr(&o).contains(want[1]), "{}", stderr(&o));
}

#[test]
fn check_named_the_table_but_not_the_key_of_a_wrong_type() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("outpost.toml");
    std::fs::write(
        &cfg,
        "[[pipelines]]\nname = \"sensors\"\nmodel = \"sensor_mlp\"\nsource = { type = \"http\" }\nqueue = \"many\"\n\n[outbox]\nflush_records = \"lots\"\n",
    )
    .unwrap();
    let o = run(outpost().arg("check").arg(&cfg));
    assert_fails(&o, 2, "2 problem(s)");
    let err = stderr(&o);
    let got = problems(&err);
    assert_eq!(
        got,
        [
            "line 5: pipeline \"sensors\" (line 1), queue: wrong type: string \"many\", expected a whole number (0 or more)",
            "line 8: outbox.flush_records: wrong type: string \"lots\", expected a whole number (0 or more)",
        ],
        "{err}"
    );
}

#[test]
fn config_example_failed_check_unless_camera_password_was_set() {
    for uplink in ["mqtt", "http"] {
        let example = run(outpost()
            .env_clear()
            .args(["config", "example", "--uplink", uplink]));
        assert!(example.status.success(), "{}", stderr(&example));
        // `outpost config example | outpost check --no-files -`, with no
        // environment at all (--no-files: the example's models and replay
        // file are not on this machine).
        let mut check = outpost()
            .env_clear()
            .args(["check", "--no-files", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        check
            .stdin
            .take()
            .unwrap()
            .write_all(&example.stdout)
            .unwrap();
        let o = check.wait_with_output().unwrap();
        assert!(o.status.success(), "{uplink}: {}", stderr(&o));
        assert!(stdout(&o).starts_with("stdin: ok"), "{}", stdout(&o));
    }
}
