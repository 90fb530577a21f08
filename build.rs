//! Records what the Rust core was built for, so a running gateway can say which build
//! answered (`_core.build_info()`, `sessiongate --version`, `sessiongate_build_info`).

use std::env;
use std::process::Command;

fn main() {
    let target = env::var("TARGET").unwrap_or_else(|_| "unknown".into());
    let profile = env::var("PROFILE").unwrap_or_else(|_| "unknown".into());
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let rustc_version = Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .map(|text| text.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=SESSIONGATE_BUILD_TARGET={target}");
    println!("cargo:rustc-env=SESSIONGATE_BUILD_PROFILE={profile}");
    println!("cargo:rustc-env=SESSIONGATE_BUILD_RUSTC={rustc_version}");
    println!("cargo:rerun-if-changed=build.rs");
}
