//! The `outpost` binary: parse the command line, run, map errors to exit codes.

use std::process::ExitCode;

use clap::Parser;
use outpost::backend::ort::RuntimeError;
use outpost::cli::{self, Cli, infer::BadInput};
use outpost::config::ConfigError;
use outpost::daemon::DaemonError;
use outpost::model::import::ImportRefused;
use outpost::model::registry::ModelError;

/// Exit codes scripts can rely on.
const EXIT_ERROR: u8 = 1;
const EXIT_CONFIG: u8 = 2;
const EXIT_RUNTIME: u8 = 3;
const EXIT_MODEL: u8 = 4;
const EXIT_INPUT: u8 = 5;

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The daemon logs at info by default; one-shot commands only warn.
    if matches!(cli.command, cli::Command::Run(_)) && cli.verbose == 0 {
        outpost::telemetry::logging::init_with_default(cli.log_format, "info,ort=warn");
    } else {
        outpost::telemetry::logging::init(cli.log_format, cli.verbose);
    }
    match cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            let runtime = matches!(
                e.downcast_ref::<DaemonError>(),
                Some(DaemonError::Runtime(_))
            );
            let code = if e.is::<RuntimeError>() || runtime {
                EXIT_RUNTIME
            } else if e.is::<ModelError>() {
                EXIT_MODEL
            } else if e.is::<BadInput>() {
                EXIT_INPUT
            } else if e.is::<ConfigError>() || e.is::<ImportRefused>() {
                EXIT_CONFIG
            } else {
                EXIT_ERROR
            };
            ExitCode::from(code)
        }
    }
}
