//! The build time, compiled in as the clock's floor (`src/clock`): no
//! device running this binary can be earlier (the time this crate was
//! built: a package, built from a clean tree, has it from the same build). `SOURCE_DATE_EPOCH` when set
//! (cross/build sets it, so a package is the same bytes every time), else
//! the time of this build.

use std::time::{SystemTime, UNIX_EPOCH};

fn main() {
    println!("cargo:rerun-if-env-changed=SOURCE_DATE_EPOCH");
    println!("cargo:rerun-if-changed=build.rs");
    // Rerun with this crate's sources: a change above it leaves the floor
    // as it was (earlier, so still true) and rebuilds nothing below.
    println!("cargo:rerun-if-changed=src");
    let t = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0)
        });
    println!("cargo:rustc-env=OUTPOST_BUILD_UNIX={t}");
}
