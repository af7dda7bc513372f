//! tracing to stderr: plain text for terminals, journald-friendly lines under
//! systemd (no timestamps, journald adds its own), or JSON for collectors.

use tracing_subscriber::EnvFilter;

use crate::cli::LogFormat;

/// Installs the global subscriber. `RUST_LOG` overrides the verbosity.
pub fn init(format: LogFormat, verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "info,ort=warn",
        _ => "debug,ort=info",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let under_journald = std::env::var_os("JOURNAL_STREAM").is_some();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text if under_journald => builder.without_time().with_ansi(false).try_init(),
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
    };
}
