//! The handshake's cryptography: fresh nonces, and the HMAC-SHA256 proof that a side knows the
//! shared secret. The proof binds the role (client or server), the other side's nonce and the
//! namespace, so a proof cannot be reflected back, replayed on another connection, or reused in
//! another namespace.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::frame::{MAC_BYTES, NONCE_BYTES};

/// Which side of a connection computes a proof.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The side that connected.
    Client,
    /// The side that accepted.
    Server,
}

impl Role {
    fn label(self) -> &'static [u8] {
        match self {
            Role::Client => b"kvtier-p2p v1 client",
            Role::Server => b"kvtier-p2p v1 server",
        }
    }
}

/// A fresh, unpredictable nonce: 32 bytes from the kernel's random source, mixed through SHA-256
/// with per-process random keys, the clock and a counter (so it stays unique if the kernel
/// source cannot be read).
pub fn nonce() -> [u8; NONCE_BYTES] {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = Sha256::new();
    let mut kernel = [0u8; NONCE_BYTES];
    let read = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut kernel));
    if read.is_ok() {
        hasher.update(kernel);
    }
    let mut mix = RandomState::new().build_hasher();
    mix.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    hasher.update(mix.finish().to_le_bytes());
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    hasher.update(now.to_le_bytes());
    hasher.update(std::process::id().to_le_bytes());
    hasher.finalize().into()
}

fn mac(secret: &[u8], role: Role, nonce: &[u8; NONCE_BYTES], namespace: &[u8]) -> Hmac<Sha256> {
    // HMAC accepts keys of any length; the error case cannot happen.
    let mut mac = match Hmac::<Sha256>::new_from_slice(secret) {
        Ok(mac) => mac,
        Err(_) => unreachable_key(),
    };
    mac.update(role.label());
    mac.update(nonce);
    mac.update(namespace);
    mac
}

#[cold]
fn unreachable_key() -> ! {
    panic!("HMAC-SHA256 refused a key; it accepts keys of every length")
}

/// The proof that `role` knows `secret`, answering the other side's `nonce`.
pub fn prove(
    secret: &[u8],
    role: Role,
    nonce: &[u8; NONCE_BYTES],
    namespace: &[u8],
) -> [u8; MAC_BYTES] {
    mac(secret, role, nonce, namespace)
        .finalize()
        .into_bytes()
        .into()
}

/// Whether `proof` is `role`'s proof for our `nonce` (compared in constant time).
pub fn verify(
    secret: &[u8],
    role: Role,
    nonce: &[u8; NONCE_BYTES],
    namespace: &[u8],
    proof: &[u8; MAC_BYTES],
) -> bool {
    mac(secret, role, nonce, namespace)
        .verify_slice(proof)
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nonces_differ() {
        assert_ne!(nonce(), nonce());
    }

    #[test]
    fn proofs_bind_secret_role_nonce_and_namespace() {
        let n = [5; NONCE_BYTES];
        let proof = prove(b"secret-secret-16", Role::Client, &n, b"ns");
        assert!(verify(b"secret-secret-16", Role::Client, &n, b"ns", &proof));
        assert!(!verify(
            b"other-secret-016",
            Role::Client,
            &n,
            b"ns",
            &proof
        ));
        assert!(!verify(
            b"secret-secret-16",
            Role::Server,
            &n,
            b"ns",
            &proof
        ));
        assert!(!verify(
            b"secret-secret-16",
            Role::Client,
            &[6; NONCE_BYTES],
            b"ns",
            &proof
        ));
        assert!(!verify(
            b"secret-secret-16",
            Role::Client,
            &n,
            b"nt",
            &proof
        ));
    }
}
