//! `outpost keygen` and `outpost bundle build|sign|verify|entry|document|command`:
//! making and checking signed OTA bundles and update commands (see docs/ota.md).

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

use crate::ota::{bundle, sign};

#[derive(Debug, clap::Args)]
pub struct KeygenArgs {
    /// Private key file to write (mode 0600; never overwritten); the public key goes to FILE.pub.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
}

#[derive(Debug, clap::Subcommand)]
pub enum BundleCommand {
    /// Build a bundle from a model folder (`--model-dir`) or a daemon binary (`--daemon`).
    Build(BuildArgs),
    /// Sign a bundle: writes BUNDLE.sig.
    Sign {
        /// Private key (from `outpost keygen`).
        #[arg(long, value_name = "FILE")]
        key: PathBuf,
        bundle: PathBuf,
    },
    /// Check a bundle's signature against a public key, print its manifest.
    Verify {
        /// Public key: a .pub file, base64 or hex; repeat for several.
        #[arg(long = "pub", value_name = "KEY", required = true)]
        keys: Vec<String>,
        /// Signature file (default: BUNDLE.sig).
        #[arg(long, value_name = "FILE")]
        sig: Option<PathBuf>,
        bundle: PathBuf,
    },
    /// Print the manifest-document entry for a signed bundle (url, sha256, size, signature).
    Entry {
        /// The URL the device downloads it from (absolute or relative to the manifest's).
        #[arg(long)]
        url: String,
        /// Mark the entry as a rollback (the bundle must be built with --rollback).
        #[arg(long)]
        rollback: bool,
        /// Staged rollout: share of the fleet (0..=100) that takes it (needs --salt).
        #[arg(long, requires = "salt", value_parser = clap::value_parser!(u8).range(0..=100))]
        percent: Option<u8>,
        /// Names the rollout: a device's place in it depends on salt and device name.
        #[arg(long, requires = "percent")]
        salt: Option<String>,
        /// Only devices in this `[device] groups` group take it; repeat for several.
        #[arg(long = "group", value_name = "GROUP")]
        groups: Vec<String>,
        bundle: PathBuf,
    },
    /// Sign a manifest document (`{"bundles": [entries]}`) as a whole, as
    /// staged rollouts need: prints (or writes) the signed document.
    Document {
        /// Private key (from `outpost keygen`).
        #[arg(long, value_name = "FILE")]
        key: PathBuf,
        /// Write the signed document here (atomically) instead of printing it.
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
        /// The plain document (JSON); `-` reads standard input.
        document: PathBuf,
    },
    /// Print a signed update command for a device's MQTT command topic
    /// (`outpost/{device}/cmd`): install BUNDLE (update or --rollback), or --poll.
    Command {
        /// Private key (from `outpost keygen`); the device must trust its public key.
        #[arg(long, value_name = "FILE")]
        key: PathBuf,
        /// The device it is for (`*`: every device).
        #[arg(long)]
        device: String,
        /// The URL the device downloads the bundle from (absolute, or
        /// relative to the device's manifest_url).
        #[arg(long, required_unless_present = "poll")]
        url: Option<String>,
        /// Install a lower version (the bundle must be built with --rollback).
        #[arg(long, conflicts_with = "poll")]
        rollback: bool,
        /// Ask the device to poll its manifest document now.
        #[arg(long, conflicts_with = "bundle")]
        poll: bool,
        /// The command expires this long after now (e.g. `1h`).
        #[arg(long, value_parser = humantime_serde::re::humantime::parse_duration)]
        expires_in: Option<std::time::Duration>,
        /// The signed bundle (BUNDLE.sig beside it).
        #[arg(required_unless_present = "poll")]
        bundle: Option<PathBuf>,
    },
}

/// A model bundle comes from the folder named by the global `--model-dir`
/// (a folder with manifest.toml), or from `<model-dir>/<--model>`.
#[derive(Debug, clap::Args)]
pub struct BuildArgs {
    /// A model of the model directory (default: --model-dir is the model's own folder).
    #[arg(long, value_name = "NAME", conflicts_with = "daemon")]
    pub model: Option<String>,
    /// A daemon binary.
    #[arg(long, value_name = "BIN", requires_all = ["target", "version"])]
    pub daemon: Option<PathBuf>,
    /// Target triple of the daemon binary.
    #[arg(long)]
    pub target: Option<String>,
    /// Version of the daemon binary.
    #[arg(long)]
    pub version: Option<String>,
    /// Check data: a folder with in/*.npy and out/*.npy (default: the model
    /// folder's check/ or ref/ when present).
    #[arg(long, value_name = "DIR", conflicts_with = "no_check")]
    pub check: Option<PathBuf>,
    /// Bundle no check data.
    #[arg(long)]
    pub no_check: bool,
    /// Signed permission for devices to go down to this version.
    #[arg(long)]
    pub rollback: bool,
    /// Oldest daemon that may install it (default: this one's version).
    #[arg(long, value_name = "VERSION")]
    pub min_daemon_version: Option<String>,
    /// The bundle to write (a tar).
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
}

fn sig_path(bundle: &Path) -> PathBuf {
    let mut p = bundle.as_os_str().to_owned();
    p.push(".sig");
    PathBuf::from(p)
}

pub fn keygen(a: &KeygenArgs) -> anyhow::Result<()> {
    let k = sign::generate()?;
    let pubp = sign::write_keypair(&k, &a.out)?;
    println!(
        "private key: {}\npublic key:  {} ({})",
        a.out.display(),
        pubp.display(),
        sign::key_text(&k.verifying_key())
    );
    Ok(())
}

pub fn run(cli: &super::Cli, cmd: &BundleCommand) -> anyhow::Result<()> {
    match cmd {
        BundleCommand::Build(a) => build(cli, a),
        BundleCommand::Sign { key, bundle } => {
            let k = sign::read_signing_key(key)?;
            let (digest, _) = sign::sha256_file(bundle)?;
            // A bundle that does not read as one is not worth signing.
            bundle::read_manifest(bundle)
                .with_context(|| format!("{} is not a bundle", bundle.display()))?;
            let out = sig_path(bundle);
            std::fs::write(&out, format!("{}\n", sign::sign_digest(&k, &digest)))
                .with_context(|| out.display().to_string())?;
            println!("{}", out.display());
            Ok(())
        }
        BundleCommand::Verify { keys, sig, bundle } => {
            let trusted = keys
                .iter()
                .map(|k| sign::parse_public_key(k))
                .collect::<Result<Vec<_>, _>>()?;
            let sig = sig.clone().unwrap_or_else(|| sig_path(bundle));
            let line = std::fs::read_to_string(&sig).with_context(|| sig.display().to_string())?;
            let (digest, _) = sign::sha256_file(bundle)?;
            let key = sign::verify_digest(&trusted, &digest, &line)
                .with_context(|| format!("{}: verification failed", bundle.display()))?;
            let m = bundle::read_manifest(bundle)?;
            eprintln!("good signature by {}", sign::key_text(&key));
            println!("{}", serde_json::to_string_pretty(&m)?);
            Ok(())
        }
        BundleCommand::Entry {
            url,
            rollback,
            percent,
            salt,
            groups,
            bundle,
        } => {
            let mut entry = entry(bundle, url, *rollback)?;
            if let (Some(percent), Some(salt)) = (percent, salt) {
                entry.rollout = Some(crate::ota::rollout::Rollout {
                    percent: *percent,
                    salt: salt.clone(),
                });
            }
            entry.groups = groups.clone();
            println!("{}", serde_json::to_string(&entry)?);
            Ok(())
        }
        BundleCommand::Document { key, out, document } => {
            let k = sign::read_signing_key(key)?;
            let text = if document.as_os_str() == "-" {
                std::io::read_to_string(std::io::stdin()).context("standard input")?
            } else {
                std::fs::read_to_string(document).with_context(|| document.display().to_string())?
            };
            let plain: crate::ota::document::Document = serde_json::from_str(&text)
                .with_context(|| format!("{}: not a manifest document", document.display()))?;
            let signed = sign_document(&k, plain.bundles)?;
            match out {
                Some(p) => {
                    crate::fsio::write_atomic(p, signed.as_bytes())
                        .with_context(|| p.display().to_string())?;
                    eprintln!("{}", p.display());
                }
                None => println!("{signed}"),
            }
            Ok(())
        }
        BundleCommand::Command {
            key,
            device,
            url,
            rollback,
            poll,
            expires_in,
            bundle,
        } => {
            use crate::ota::command::{self, Action, Command};
            let k = sign::read_signing_key(key)?;
            let offer = match (bundle, url) {
                (Some(b), Some(u)) if !*poll => Some(entry(b, u, false)?),
                _ => None,
            };
            let now = command::unix_ms_now();
            let c = Command {
                device: device.clone(),
                issued_ms: now,
                expires_ms: expires_in.map(|d| now + d.as_millis() as u64),
                action: if *poll {
                    Action::Poll
                } else if *rollback {
                    Action::Rollback
                } else {
                    Action::Update
                },
                bundle: offer,
            };
            let env = command::seal(&k, &c)?;
            println!("{}", serde_json::to_string(&env)?);
            Ok(())
        }
    }
}

/// A manifest document signed as a whole, issued now (JSON text).
pub fn sign_document(
    key: &ed25519_dalek::SigningKey,
    bundles: Vec<crate::ota::machine::Offer>,
) -> anyhow::Result<String> {
    use crate::ota::{command::unix_ms_now, document, rollout};
    for o in &bundles {
        let p = rollout::validate(o);
        if !p.is_empty() {
            bail!("entry {}: {}", o.id(), p.join("; "));
        }
    }
    let env = document::seal(
        key,
        &document::SignedDocument {
            issued_ms: unix_ms_now(),
            bundles,
        },
    )?;
    Ok(serde_json::to_string(&env)?)
}

/// The manifest-document entry of a signed bundle.
pub fn entry(
    bundle: &Path,
    url: &str,
    rollback: bool,
) -> anyhow::Result<crate::ota::machine::Offer> {
    let m = bundle::read_manifest(bundle)?;
    let sig = sig_path(bundle);
    let line = std::fs::read_to_string(&sig)
        .with_context(|| format!("{} (sign the bundle first)", sig.display()))?;
    let (digest, size) = sign::sha256_file(bundle)?;
    Ok(crate::ota::machine::Offer {
        kind: m.kind,
        name: m.name,
        version: m.version,
        url: url.to_string(),
        sha256: hex::encode(digest),
        size,
        signature: line.trim().to_string(),
        rollback,
        rollout: None,
        groups: Vec::new(),
    })
}

fn build(cli: &super::Cli, a: &BuildArgs) -> anyhow::Result<()> {
    let min = a
        .min_daemon_version
        .clone()
        .unwrap_or_else(|| env!("CARGO_PKG_VERSION").to_string());
    let folder = match (&cli.model_dir, &a.model) {
        (Some(d), Some(m)) => Some(d.join(m)),
        (None, Some(m)) => Some(PathBuf::from("models").join(m)),
        (d, None) => d.clone(),
    };
    let m = match (folder, &a.daemon) {
        (_, Some(bin)) => {
            let (Some(t), Some(v)) = (&a.target, &a.version) else {
                bail!("--daemon needs --target and --version");
            };
            bundle::build_daemon(bin, t, v, &min, &a.out)?
        }
        (Some(dir), None) => {
            if !dir.join("manifest.toml").is_file() {
                bail!(
                    "{}: no manifest.toml (give the model's folder as --model-dir, or --model NAME)",
                    dir.display()
                );
            }
            let dir = &dir;
            let check = if a.no_check {
                None
            } else {
                a.check.clone().or_else(|| bundle::default_check_dir(dir))
            };
            bundle::build_model(dir, check.as_deref(), a.rollback, &min, &a.out)?
        }
        (None, None) => {
            bail!("give --model-dir DIR (a model's folder), --model NAME or --daemon BIN")
        }
    };
    eprintln!(
        "{}: {:?} {}@{}, {} file(s)",
        a.out.display(),
        m.kind,
        m.name,
        m.version,
        m.files.len()
    );
    Ok(())
}
