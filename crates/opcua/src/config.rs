//! `[opcua]`: the server's listen URL, its security, who may log in, and
//! which fields of which pipeline become variables.
//!
//! ```toml
//! [opcua]
//! listen = "opc.tcp://0.0.0.0:4840"
//! security = ["basic256sha256_sign_encrypt"]   # "none" only when written explicitly
//! anonymous = false
//! [[opcua.users]]
//! user = "scada"
//! password_env = "OUTPOST_OPCUA_SCADA"          # or password_file, or certificate
//! [[opcua.variables]]
//! pipeline = "line3"
//! field = "/top/0/index"
//! kind = "int32"
//! ```
//!
//! Passwords are never in the config itself (which `outpost config` may
//! print): a user names the environment variable or the file that holds
//! it, read when the server starts.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpcuaConfig {
    /// `opc.tcp://HOST:PORT[/PATH]`; port 0 takes a free port (logged).
    #[serde(default = "default_listen")]
    pub listen: String,
    /// The endpoints' security: each entry one policy and mode. `none`
    /// (no signing, no encryption) only when listed.
    #[serde(default = "default_security")]
    pub security: Vec<Security>,
    /// Clients may open a session without a user or certificate.
    #[serde(default)]
    pub anonymous: bool,
    /// Who may log in: a user name with a password (from an environment
    /// variable or a file), or a client certificate.
    #[serde(default)]
    pub users: Vec<UserConfig>,
    /// The server's certificate store (`own/`, `private/`, `trusted/`,
    /// `rejected/`); default `<data_dir>/opcua/pki`. The server's own
    /// certificate and key are made here on first start.
    #[serde(default)]
    pub pki_dir: Option<PathBuf>,
    /// A folder of client application certificates (DER `.der`, or PEM
    /// `.pem`/`.crt`) to trust: copied into `<pki_dir>/trusted/` at start.
    /// A client whose certificate is not trusted is refused on a secure
    /// endpoint, and its certificate lands in `<pki_dir>/rejected/`.
    #[serde(default)]
    pub trusted_clients: Option<PathBuf>,
    /// The mapped fields; a pipeline none of them names shows every
    /// top-level number and boolean of its outputs.
    #[serde(default)]
    pub variables: Vec<VariableConfig>,
    /// The shortest publishing interval a client may ask for (and the
    /// server's subscription tick): a data change leaves at most this
    /// long after the record.
    #[serde(default = "default_min_publishing_interval", with = "humantime_serde")]
    pub min_publishing_interval: Duration,
    /// Sessions open at once; one more is refused.
    #[serde(default = "default_max_sessions")]
    pub max_sessions: usize,
}

/// Default `listen`.
pub const DEFAULT_LISTEN: &str = "opc.tcp://0.0.0.0:4840";
/// Default `min_publishing_interval`.
pub const DEFAULT_MIN_PUBLISHING_INTERVAL: Duration = Duration::from_millis(10);
/// Default `max_sessions`.
pub const DEFAULT_MAX_SESSIONS: usize = 32;
/// Variables a pipeline without mapped fields gets at most (its top-level
/// numbers and booleans).
pub const MAX_AUTO_VARIABLES: usize = 64;

fn default_listen() -> String {
    DEFAULT_LISTEN.to_string()
}
fn default_security() -> Vec<Security> {
    vec![Security::Basic256sha256SignEncrypt]
}
fn default_min_publishing_interval() -> Duration {
    DEFAULT_MIN_PUBLISHING_INTERVAL
}
fn default_max_sessions() -> usize {
    DEFAULT_MAX_SESSIONS
}

impl Default for OpcuaConfig {
    fn default() -> Self {
        OpcuaConfig {
            listen: default_listen(),
            security: default_security(),
            anonymous: false,
            users: Vec::new(),
            pki_dir: None,
            trusted_clients: None,
            variables: Vec::new(),
            min_publishing_interval: DEFAULT_MIN_PUBLISHING_INTERVAL,
            max_sessions: DEFAULT_MAX_SESSIONS,
        }
    }
}

/// One endpoint: a security policy and a message security mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Security {
    /// No signing, no encryption: anyone on the network reads and forges.
    None,
    Basic256sha256Sign,
    Basic256sha256SignEncrypt,
    Aes128sha256rsaoaepSign,
    Aes128sha256rsaoaepSignEncrypt,
    Aes256sha256rsapssSign,
    Aes256sha256rsapssSignEncrypt,
}

impl Security {
    /// The name in the config.
    pub fn name(self) -> &'static str {
        match self {
            Security::None => "none",
            Security::Basic256sha256Sign => "basic256sha256_sign",
            Security::Basic256sha256SignEncrypt => "basic256sha256_sign_encrypt",
            Security::Aes128sha256rsaoaepSign => "aes128sha256rsaoaep_sign",
            Security::Aes128sha256rsaoaepSignEncrypt => "aes128sha256rsaoaep_sign_encrypt",
            Security::Aes256sha256rsapssSign => "aes256sha256rsapss_sign",
            Security::Aes256sha256rsapssSignEncrypt => "aes256sha256rsapss_sign_encrypt",
        }
    }
}

/// One user.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UserConfig {
    /// The user name a client logs in with (for a certificate user, the
    /// name in logs and metrics).
    pub user: String,
    /// The environment variable that holds the password.
    #[serde(default)]
    pub password_env: Option<String>,
    /// The file that holds the password (its first line).
    #[serde(default)]
    pub password_file: Option<PathBuf>,
    /// The user's X.509 certificate (DER or PEM): a client that proves it
    /// holds its key logs in as this user.
    #[serde(default)]
    pub certificate: Option<PathBuf>,
}

/// One mapped field.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VariableConfig {
    /// The pipeline whose records feed it.
    pub pipeline: String,
    /// A JSON pointer into the record's `outputs` (`/top/0/index`); the
    /// variable's NodeId is `<pipeline>/<field without the leading />`.
    pub field: String,
    /// The variable's OPC UA data type.
    #[serde(default)]
    pub kind: Kind,
}

/// The data type of a variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    #[default]
    Double,
    Float,
    Int16,
    Uint16,
    Int32,
    Uint32,
    Int64,
    Uint64,
    Boolean,
    String,
}

/// Where the listen URL points.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenUrl {
    pub host: String,
    pub port: u16,
    /// The endpoints' path (`/` when the URL has none).
    pub path: String,
}

/// Why a `listen` URL is not `opc.tcp://HOST:PORT[/PATH]`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ListenUrlError {
    #[error("`{0}` must start with opc.tcp://")]
    Scheme(String),
    #[error("`{0}`: unterminated `[` in the host")]
    Bracket(String),
    #[error("`{0}` has no port (opc.tcp://HOST:PORT)")]
    NoPort(String),
    #[error("`{0}` has no host")]
    NoHost(String),
    #[error("`{url}`: the port `{port}` is not a number 0 to 65535")]
    Port { url: String, port: String },
}

impl ListenUrl {
    /// `opc.tcp://HOST:PORT[/PATH]` (a bracketed IPv6 host is fine).
    pub fn parse(s: &str) -> Result<ListenUrl, ListenUrlError> {
        let rest = s
            .strip_prefix("opc.tcp://")
            .ok_or_else(|| ListenUrlError::Scheme(s.to_string()))?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let end = v6
                .find(']')
                .ok_or_else(|| ListenUrlError::Bracket(s.to_string()))?;
            let port = v6[end + 1..]
                .strip_prefix(':')
                .ok_or_else(|| ListenUrlError::NoPort(s.to_string()))?;
            (&v6[..end], port)
        } else {
            authority
                .rsplit_once(':')
                .ok_or_else(|| ListenUrlError::NoPort(s.to_string()))?
        };
        if host.is_empty() {
            return Err(ListenUrlError::NoHost(s.to_string()));
        }
        let port = port.parse::<u16>().map_err(|_| ListenUrlError::Port {
            url: s.to_string(),
            port: port.to_string(),
        })?;
        Ok(ListenUrl {
            host: host.to_string(),
            port,
            path: path.to_string(),
        })
    }
}

impl OpcuaConfig {
    /// Every problem, each naming its key under `opcua.`; `pipelines` are
    /// the names of the config's pipelines.
    pub fn validate(&self, pipelines: &[&str]) -> Vec<String> {
        let mut p = Vec::new();
        if let Err(e) = ListenUrl::parse(&self.listen) {
            p.push(format!("opcua.listen: {e}"));
        }
        if self.security.is_empty() {
            p.push("opcua.security: empty (e.g. [\"basic256sha256_sign_encrypt\"])".into());
        }
        for (i, s) in self.security.iter().enumerate() {
            if self.security[..i].contains(s) {
                p.push(format!("opcua.security: `{}` listed twice", s.name()));
            }
        }
        if !self.anonymous && self.users.is_empty() {
            p.push(
                "opcua.users: no user and `anonymous = false`: no client could log in (add [[opcua.users]] or set anonymous = true)"
                    .into(),
            );
        }
        let only_none = self.security.iter().all(|s| *s == Security::None);
        for (i, u) in self.users.iter().enumerate() {
            let at = format!("opcua.users[{i}]");
            if u.user.trim().is_empty() {
                p.push(format!("{at}.user: empty"));
            }
            if let Some(j) = self.users[..i].iter().position(|o| o.user == u.user) {
                p.push(format!(
                    "{at}.user: `{}` is already opcua.users[{j}]",
                    u.user
                ));
            }
            let ways = [
                u.password_env.is_some(),
                u.password_file.is_some(),
                u.certificate.is_some(),
            ]
            .iter()
            .filter(|w| **w)
            .count();
            if ways != 1 {
                p.push(format!(
                    "{at}: set one of password_env, password_file or certificate"
                ));
            }
            if let Some(e) = &u.password_env {
                match std::env::var_os(e) {
                    None => p.push(format!(
                        "{at}.password_env: the environment variable `{e}` is not set"
                    )),
                    Some(v) if v.is_empty() => p.push(format!(
                        "{at}.password_env: the environment variable `{e}` is empty"
                    )),
                    Some(_) => {}
                }
            }
            if let Some(f) = &u.password_file
                && let Err(e) = read_password_file(f)
            {
                p.push(format!("{at}.password_file: {e}"));
            }
            if let Some(c) = &u.certificate {
                if !c.is_file() {
                    p.push(format!("{at}.certificate: {} does not exist", c.display()));
                }
                if only_none {
                    p.push(format!(
                        "{at}.certificate: a certificate user needs a secure endpoint (opcua.security has only \"none\")"
                    ));
                }
            }
            if (u.password_env.is_some() || u.password_file.is_some()) && only_none {
                p.push(format!(
                    "{at}: a password over security \"none\" would cross the network readable; list a secure policy in opcua.security"
                ));
            }
        }
        if let Some(t) = &self.trusted_clients
            && !t.is_dir()
        {
            p.push(format!(
                "opcua.trusted_clients: {} is not a folder",
                t.display()
            ));
        }
        if self.min_publishing_interval < Duration::from_millis(1)
            || self.min_publishing_interval > Duration::from_secs(60)
        {
            p.push(format!(
                "opcua.min_publishing_interval: {} is out of range 1ms..=60s",
                humantime::format_duration(self.min_publishing_interval)
            ));
        }
        if self.max_sessions == 0 {
            p.push("opcua.max_sessions: must be at least 1".into());
        }
        for (i, v) in self.variables.iter().enumerate() {
            let at = format!("opcua.variables[{i}]");
            if !pipelines.contains(&v.pipeline.as_str()) {
                p.push(format!(
                    "{at}.pipeline: no pipeline is named `{}`",
                    v.pipeline
                ));
            }
            if let Err(e) = check_pointer(&v.field) {
                p.push(format!("{at}.field: {e}"));
            }
            if let Some(j) = self.variables[..i]
                .iter()
                .position(|o| o.pipeline == v.pipeline && o.field == v.field)
            {
                p.push(format!(
                    "{at}.field: `{}` of `{}` is already opcua.variables[{j}]",
                    v.field, v.pipeline
                ));
            }
        }
        p
    }

    /// The variables mapped for `pipeline`.
    pub fn variables_of<'a>(
        &'a self,
        pipeline: &'a str,
    ) -> impl Iterator<Item = &'a VariableConfig> + 'a {
        self.variables
            .iter()
            .filter(move |v| v.pipeline == pipeline)
    }
}

/// Why a variable's field is not a JSON pointer below `outputs`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum PointerError {
    #[error("`{0}` must be a JSON pointer into the record's outputs, like \"/top/0/index\"")]
    NotAPointer(String),
    #[error("`/record` is the name of the record's own variable")]
    Record,
    #[error("`{0}`: `~` must be followed by 0 or 1 (JSON pointer escapes)")]
    Escape(String),
}

/// A field is a JSON pointer (RFC 6901) below `outputs`, not `outputs` itself.
fn check_pointer(f: &str) -> Result<(), PointerError> {
    if !f.starts_with('/') || f.len() < 2 {
        return Err(PointerError::NotAPointer(f.to_string()));
    }
    if f == "/record" {
        return Err(PointerError::Record);
    }
    let mut rest = f;
    while let Some(i) = rest.find('~') {
        if !matches!(rest.as_bytes().get(i + 1), Some(b'0' | b'1')) {
            return Err(PointerError::Escape(f.to_string()));
        }
        rest = &rest[i + 2..];
    }
    Ok(())
}

/// Why a password file gives no password.
#[derive(Debug, thiserror::Error)]
pub enum PasswordFileError {
    #[error("{path}: cannot read: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{0}: empty")]
    Empty(String),
}

/// The first line of a password file, without its line end.
pub fn read_password_file(f: &std::path::Path) -> Result<String, PasswordFileError> {
    let text = std::fs::read_to_string(f).map_err(|source| PasswordFileError::Read {
        path: f.display().to_string(),
        source,
    })?;
    let line = text.lines().next().unwrap_or("").to_string();
    if line.is_empty() {
        return Err(PasswordFileError::Empty(f.display().to_string()));
    }
    Ok(line)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_issue_snippet_is_read_with_its_defaults() {
        let c: OpcuaConfig = toml::from_str(
            r#"
listen = "opc.tcp://0.0.0.0:4840"
security = ["basic256sha256_sign_encrypt"]
anonymous = false
"#,
        )
        .unwrap();
        assert_eq!(c, OpcuaConfig::default());
        let p = c.validate(&[]);
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].starts_with("opcua.users: no user"), "{p:?}");
    }

    #[test]
    fn listen_urls_parse() {
        let u = ListenUrl::parse("opc.tcp://127.0.0.1:0").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.path.as_str()),
            ("127.0.0.1", 0, "/")
        );
        let u = ListenUrl::parse("opc.tcp://[::1]:4840/outpost").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.path.as_str()),
            ("::1", 4840, "/outpost")
        );
        assert!(ListenUrl::parse("tcp://h:1").is_err());
        assert!(ListenUrl::parse("opc.tcp://h").is_err());
        assert!(ListenUrl::parse("opc.tcp://h:99999").is_err());
    }

    #[test]
    fn bad_entries_name_their_key() {
        let c: OpcuaConfig = toml::from_str(
            r#"
security = ["none", "none"]
anonymous = true
min_publishing_interval = "0s"
[[users]]
user = "a"
password_env = "OUTPOST_TEST_SURELY_UNSET_VARIABLE"
certificate = "/nonexistent.der"
[[variables]]
pipeline = "nope"
field = "top/0"
"#,
        )
        .unwrap();
        let p = c.validate(&["line3"]);
        for want in [
            "opcua.security: `none` listed twice",
            "opcua.users[0]: set one of",
            "opcua.users[0].password_env: the environment variable",
            "opcua.users[0].certificate: /nonexistent.der does not exist",
            "opcua.min_publishing_interval: 0s is out of range",
            "opcua.variables[0].pipeline: no pipeline is named `nope`",
            "opcua.variables[0].field: `top/0` must be a JSON pointer",
        ] {
            assert!(p.iter().any(|x| x.starts_with(want)), "no {want} in {p:#?}");
        }
        assert!(toml::from_str::<OpcuaConfig>("securty = []").is_err());
        assert!(toml::from_str::<OpcuaConfig>("security = [\"basic128\"]").is_err());
    }
}
