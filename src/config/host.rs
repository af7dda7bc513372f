//! `host[:port]` and `[v6][:port]`, as HTTP's `Host` header and the
//! `api.allowed_hosts` entries write them.

use std::net::IpAddr;

/// A host name (lower case, without a trailing dot) or an IP address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostName {
    Ip(IpAddr),
    Name(String),
}

/// Splits `host[:port]` / `[v6][:port]` (as `Host` and `allowed_hosts`
/// hold them) and returns the host; None when it is not of that form.
pub fn parse_host(text: &str) -> Option<HostName> {
    let text = text.trim();
    let (host, port) = if let Some(rest) = text.strip_prefix('[') {
        let (v6, after) = rest.split_once(']')?;
        let ip: std::net::Ipv6Addr = v6.parse().ok()?;
        return match after {
            "" => Some(HostName::Ip(IpAddr::V6(ip))),
            p => {
                let p = p.strip_prefix(':')?;
                (!p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
                    .then_some(HostName::Ip(IpAddr::V6(ip)))
            }
        };
    } else {
        match text.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (text, None),
        }
    };
    if let Some(p) = port
        && (p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()))
    {
        return None;
    }
    let host = host.strip_suffix('.').unwrap_or(host);
    if host.is_empty()
        || !host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_')
    {
        return None;
    }
    if let Ok(ip) = host.parse::<std::net::Ipv4Addr>() {
        return Some(HostName::Ip(IpAddr::V4(ip)));
    }
    Some(HostName::Name(host.to_ascii_lowercase()))
}

/// An `api.allowed_hosts` entry that is not a host.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a host name or address (with an optional :port; no scheme, no path)")]
pub struct NotAHost(pub String);

/// Checks one `api.allowed_hosts` entry.
pub fn check_entry(entry: &str) -> Result<(), NotAHost> {
    match parse_host(entry) {
        Some(_) => Ok(()),
        None => Err(NotAHost(entry.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_checked() {
        assert!(check_entry("gw-1.local").is_ok());
        assert!(check_entry("gw-1.local:8780").is_ok());
        assert!(check_entry("[fd00::1]").is_ok());
        assert!(check_entry("http://gw-1.local").is_err());
        assert!(check_entry("gw-1.local/x").is_err());
        assert!(check_entry("").is_err());
        assert_eq!(
            parse_host("GW-1.Local.:80"),
            Some(HostName::Name("gw-1.local".into()))
        );
        assert_eq!(
            parse_host("[::1]:8780"),
            Some(HostName::Ip("::1".parse().unwrap()))
        );
    }
}
