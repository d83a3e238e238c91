//! How a peer is named ([`PeerAddr`]): an IP socket address, or a DNS name and a port that is
//! resolved each time a connection is made (so a peer that moved is found again), with the
//! resolution bounded in time.

use std::fmt;
use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::str::FromStr;
use std::sync::mpsc;
use std::time::Duration;

/// Longest host name accepted (RFC 1035: 253 characters in text form).
const HOST_BYTES_MAX: usize = 253;
/// Longest label of a host name.
const LABEL_BYTES_MAX: usize = 63;

/// A peer's address as configured: `1.2.3.4:7071`, `[::1]:7071`, or `node-3.example:7071`.
///
/// A name is resolved at connect time, every time, never when the configuration is read: a name
/// that does not resolve makes that peer down (retried with backoff), not the configuration
/// invalid.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PeerAddr {
    /// An IP address and port.
    Ip(SocketAddr),
    /// A DNS name (lower case, without a trailing dot) and port.
    Name {
        /// The host name.
        host: String,
        /// The port.
        port: u16,
    },
}

/// Why a string is not a peer address.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{value:?} is not host:port ({reason})")]
pub struct ParsePeerAddrError {
    /// The string given.
    pub value: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl PeerAddr {
    /// The port.
    pub fn port(&self) -> u16 {
        match self {
            PeerAddr::Ip(addr) => addr.port(),
            PeerAddr::Name { port, .. } => *port,
        }
    }

    /// The IP address, if it is one (no resolution).
    pub fn ip(&self) -> Option<SocketAddr> {
        match self {
            PeerAddr::Ip(addr) => Some(*addr),
            PeerAddr::Name { .. } => None,
        }
    }

    /// Whether it is certainly a loopback peer (no resolution): a loopback IP literal, or the
    /// name `localhost`. Any other name may resolve beyond loopback.
    pub fn is_loopback(&self) -> bool {
        match self {
            PeerAddr::Ip(addr) => addr.ip().is_loopback(),
            PeerAddr::Name { host, .. } => host == "localhost",
        }
    }

    /// Every address the name resolves to now (an IP address is itself), waiting at most
    /// `timeout` for the resolver. A resolver that takes longer is left to finish on its own
    /// thread, and this answers `TimedOut`.
    pub fn resolve(&self, timeout: Duration) -> io::Result<Vec<SocketAddr>> {
        let (host, port) = match self {
            PeerAddr::Ip(addr) => return Ok(vec![*addr]),
            PeerAddr::Name { host, port } => (host.clone(), *port),
        };
        let (tx, rx) = mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name("p2p-resolve".to_owned())
            .spawn(move || {
                let result = (host.as_str(), port)
                    .to_socket_addrs()
                    .map(Iterator::collect::<Vec<_>>);
                // The asker may have given up; that is fine.
                let _ = tx.send(result);
            })?;
        match rx.recv_timeout(timeout) {
            Ok(Ok(addrs)) if addrs.is_empty() => Err(io::Error::new(
                io::ErrorKind::NotFound,
                "name resolved to no address",
            )),
            Ok(result) => result,
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("name not resolved within {timeout:?}"),
            )),
        }
    }
}

impl From<SocketAddr> for PeerAddr {
    fn from(addr: SocketAddr) -> Self {
        PeerAddr::Ip(addr)
    }
}

impl fmt::Display for PeerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeerAddr::Ip(addr) => write!(f, "{addr}"),
            PeerAddr::Name { host, port } => write!(f, "{host}:{port}"),
        }
    }
}

impl FromStr for PeerAddr {
    type Err = ParsePeerAddrError;

    /// Parses `host:port`: an IPv4 literal, a bracketed IPv6 literal (`[::1]:7071`) or a DNS
    /// name (letters, digits, `-`, `_`, dot-separated labels of 1 to 63 characters).
    fn from_str(value: &str) -> Result<Self, Self::Err> {
        if let Ok(addr) = value.parse::<SocketAddr>() {
            return Ok(PeerAddr::Ip(addr));
        }
        let error = |reason| ParsePeerAddrError {
            value: value.to_owned(),
            reason,
        };
        let Some((host, port)) = value.rsplit_once(':') else {
            return Err(error("no `:port`"));
        };
        let port: u16 = port.parse().map_err(|_| error("port is not 0..=65535"))?;
        if host.starts_with('[') || host.contains(':') {
            return Err(error("not an IPv6 literal; write [address]:port"));
        }
        let host = host.strip_suffix('.').unwrap_or(host);
        if host.is_empty() {
            return Err(error("empty host"));
        }
        if host.len() > HOST_BYTES_MAX {
            return Err(error("host name longer than 253 characters"));
        }
        let label_ok = |label: &str| {
            (1..=LABEL_BYTES_MAX).contains(&label.len())
                && !label.starts_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        };
        if !host.split('.').all(label_ok) {
            return Err(error("host is neither an IP address nor a DNS name"));
        }
        Ok(PeerAddr::Name {
            host: host.to_ascii_lowercase(),
            port,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ip_literals_names_and_bracketed_v6() {
        let v4: PeerAddr = "127.0.0.1:7071".parse().expect("v4");
        assert_eq!(v4, PeerAddr::Ip(SocketAddr::from(([127, 0, 0, 1], 7071))));
        let v6: PeerAddr = "[::1]:7071".parse().expect("v6");
        assert_eq!(v6.ip().map(|a| a.is_ipv6()), Some(true));
        let name: PeerAddr = "Node-3.Example.:7071".parse().expect("name");
        assert_eq!(
            name,
            PeerAddr::Name {
                host: "node-3.example".to_owned(),
                port: 7071
            }
        );
        assert_eq!(name.to_string(), "node-3.example:7071");
        assert_eq!(v6.to_string(), "[::1]:7071");
    }

    #[test]
    fn refuses_what_is_not_host_port() {
        for bad in [
            "nope",
            "localhost",
            ":7071",
            "host:",
            "host:70710",
            "::1:7071",
            "[::1:7071",
            "bad host:1",
            "a..b:1",
            "-a:1",
        ] {
            let error = bad.parse::<PeerAddr>().expect_err(bad);
            assert!(error.to_string().contains(bad), "{error}");
        }
    }

    #[test]
    fn resolves_localhost_and_fails_an_unknown_name() {
        let localhost: PeerAddr = "localhost:7071".parse().expect("name");
        let addrs = localhost
            .resolve(Duration::from_secs(5))
            .expect("localhost resolves");
        assert!(addrs
            .iter()
            .all(|a| a.ip().is_loopback() && a.port() == 7071));
        let unknown: PeerAddr = "no-such-peer.invalid:7071".parse().expect("name");
        unknown
            .resolve(Duration::from_secs(5))
            .expect_err("an .invalid name never resolves");
    }
}
