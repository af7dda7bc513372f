//! Installing what the demo and the tests need (`scripts/deps`), with a
//! stand-in `apt-get` first on the PATH that behaves as apt did on a fresh
//! Debian 12 machine whose package lists were older than its installed
//! packages: every install fails (`libpcre2-dev : Depends: libpcre2-8-0
//! (= 10.42-1) but 10.42-1+deb12u1 is to be installed`) until
//! `apt-get update` has run. The demo used to run without its camera
//! after that, saying only one line among its output.

use std::path::Path;
use std::process::{Command, Output};

use crate::common::root;

/// A stand-in apt-get in `dir` that logs its calls to `dir/calls`; installs
/// succeed only after an update when `update_helps`.
fn fake_apt(dir: &Path, update_helps: bool) {
    let script = format!(
        r#"#!/bin/sh
echo "$*" >> "{dir}/calls"
case "$*" in
  *update*) [ {helps} = 1 ] && touch "{dir}/updated"; exit 0 ;;
  *install*)
    [ -e "{dir}/updated" ] && exit 0
    echo "E: Unable to correct problems, you have held broken packages." >&2
    echo " libpcre2-dev : Depends: libpcre2-8-0 (= 10.42-1) but 10.42-1+deb12u1 is to be installed" >&2
    exit 100 ;;
esac
"#,
        dir = dir.display(),
        helps = u8::from(update_helps),
    );
    let path = dir.join("apt-get");
    std::fs::write(&path, script).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

fn apt_install(dir: &Path, packages: &str) -> Output {
    let path = format!(
        "{}:{}",
        dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    Command::new("bash")
        .arg("-c")
        .arg(format!("source scripts/deps && apt_install {packages}"))
        .current_dir(root())
        .env("PATH", path)
        .output()
        .unwrap()
}

fn calls(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("calls"))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            l.split_whitespace()
                .find(|w| !w.starts_with('-'))
                .unwrap_or("")
                .to_string()
        })
        .collect()
}

#[test]
fn camera_packages_install_after_an_apt_update_when_the_lists_are_stale() {
    let dir = tempfile::tempdir().unwrap();
    fake_apt(dir.path(), true);
    let out = apt_install(dir.path(), "libpcre2-dev gstreamer1.0-plugins-good");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert_eq!(calls(dir.path()), ["install", "update", "install"]);
    assert!(err.contains("apt-get update"), "{err}");
}

#[test]
fn an_install_that_fails_after_the_update_fails_and_shows_apts_words() {
    let dir = tempfile::tempdir().unwrap();
    fake_apt(dir.path(), false);
    let out = apt_install(dir.path(), "libpcre2-dev");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert_eq!(calls(dir.path()), ["install", "update", "install"]);
    assert!(err.contains("libpcre2-8-0"), "{err}");
}

#[test]
fn an_install_that_works_needs_no_update() {
    let dir = tempfile::tempdir().unwrap();
    fake_apt(dir.path(), true);
    std::fs::write(dir.path().join("updated"), "").unwrap();
    let out = apt_install(dir.path(), "espeak-ng");
    assert!(out.status.success());
    assert_eq!(calls(dir.path()), ["install"]);
}
