//! The handshake, both sides. The client sends HELLO; the server checks the version, the
//! namespace and whether both sides have a secret, then answers HELLO (or ERROR and closes).
//! With a shared secret, the client then proves it knows the secret by answering the server's
//! nonce (AUTH); only after checking that proof does the server answer the client's nonce, which
//! the client checks in turn. Any mismatch refuses the connection with a clear reason, sent to
//! the other side in an ERROR frame and returned as [`P2pError::Refused`].
//!
//! With a secret, HELLO carries no namespace (nothing of it goes out before the other side has
//! proven the secret): the namespace is bound into both proofs instead, so a namespace mismatch
//! shows as a proof that does not verify. Once both proofs verified, both sides tag every chunk
//! payload with the session key ([`auth::session_key`], [`crate::auth::ChunkAuth`]).

use std::time::Duration;

use crate::auth::{self, ChunkAuth, Role};
use crate::conn::Conn;
use crate::error::P2pError;
use crate::frame::{Frame, FrameError, Hello};
use crate::polyval::PolyvalKey;

/// What a side proves and checks: its namespace and, if configured, the shared secret.
#[derive(Clone)]
pub(crate) struct Identity {
    /// The namespace bytes.
    pub(crate) namespace: Vec<u8>,
    /// The shared secret.
    pub(crate) secret: Option<Vec<u8>>,
    /// With a secret, its hash key for chunk digests ([`auth::hash_key`]), derived once.
    pub(crate) hash_key: Option<PolyvalKey>,
}

impl Identity {
    /// The identity of `namespace`, with `secret` if any.
    pub(crate) fn new(namespace: Vec<u8>, secret: Option<Vec<u8>>) -> Self {
        let hash_key = secret.as_deref().map(|s| auth::hash_key(s, &namespace));
        Self {
            namespace,
            secret,
            hash_key,
        }
    }

    /// Keyed chunk tags under `session` (`secret` is ours: the hash key is derived once).
    fn chunk_auth(&self, session: [u8; 32], secret: &[u8]) -> ChunkAuth {
        match &self.hash_key {
            Some(hash_key) => ChunkAuth::Keyed {
                session,
                hash_key: hash_key.clone(),
            },
            None => ChunkAuth::keyed(session, secret, &self.namespace),
        }
    }
}

/// Sends a best-effort ERROR explaining the refusal, and returns the refusal.
fn refuse(conn: &mut Conn, reason: String) -> P2pError {
    // The peer may already be gone; the refusal stands either way.
    let _ = conn.send(&Frame::Error(format!("refused: {reason}")), "send refusal");
    P2pError::Refused {
        peer: conn.peer(),
        reason: format!("we refused it: {reason}"),
    }
}

/// The refusal for a frame that arrived where a handshake frame was expected.
fn unexpected(conn: &mut Conn, frame: Frame<'_>, expected: &'static str) -> P2pError {
    match frame {
        Frame::Error(message) => P2pError::Refused {
            peer: conn.peer(),
            reason: format!("it refused us: {message}"),
        },
        other => {
            let found = other.kind();
            refuse(conn, FrameError::Unexpected { expected, found }.to_string())
        }
    }
}

/// A version mismatch read as a frame error becomes a refusal (told to the peer).
fn version_refusal(conn: &mut Conn, error: P2pError) -> P2pError {
    match error {
        P2pError::Frame {
            source: FrameError::Version { found, expected },
            ..
        } => refuse(
            conn,
            format!(
                "protocol version mismatch: peer speaks {found}, we speak {expected}{}",
                match found {
                    0..=4 => " (versions before 5 have 64-bit chunk keys; upgrade the peer)",
                    5 => " (version 5 keys chunk tags over another digest; upgrade the peer)",
                    _ => "",
                }
            ),
        ),
        other => other,
    }
}

/// Checks a peer's HELLO against our identity; the reason for a refusal, if any, worded with
/// the sides named (it is read on both).
fn mismatch(ours: &Identity, role: Role, hello: &Hello) -> Option<String> {
    let (we, they) = match role {
        Role::Client => ("client", "server"),
        Role::Server => ("server", "client"),
    };
    match (ours.secret.is_some(), hello.secret_required) {
        (true, false) => Some(format!(
            "the {we} requires a shared secret and the {they} has none"
        )),
        (false, true) => Some(format!(
            "the {they} requires a shared secret and the {we} has none"
        )),
        // With a secret the namespace is checked by the proofs (HELLO does not carry it).
        (true, true) => None,
        (false, false) if hello.namespace != ours.namespace => Some(format!(
            "namespace mismatch: the {we}'s is {}, the {they}'s is {}",
            String::from_utf8_lossy(&ours.namespace),
            String::from_utf8_lossy(&hello.namespace)
        )),
        (false, false) => None,
    }
}

/// Our HELLO: with a secret, without the namespace (it is proven, not announced).
fn hello(ours: &Identity, nonce: [u8; 32]) -> Frame<'static> {
    let namespace = match ours.secret {
        Some(_) => Vec::new(),
        None => ours.namespace.clone(),
    };
    Frame::Hello(Hello {
        secret_required: ours.secret.is_some(),
        nonce,
        namespace,
    })
}

/// Receives the peer's HELLO (or its refusal).
fn recv_hello(conn: &mut Conn, op: &'static str) -> Result<Hello, P2pError> {
    let frame = match conn.recv(op) {
        Ok(frame) => other_owned(frame),
        Err(error) => return Err(version_refusal(conn, error)),
    };
    match frame {
        Frame::Hello(hello) => Ok(hello),
        other => Err(unexpected(conn, other, "HELLO")),
    }
}

/// Receives the peer's AUTH proof (or its refusal).
fn recv_auth(conn: &mut Conn, op: &'static str) -> Result<[u8; 32], P2pError> {
    let frame = other_owned(conn.recv(op)?);
    match frame {
        Frame::Auth(proof) => Ok(proof),
        other => Err(unexpected(conn, other, "AUTH")),
    }
}

/// A frame detached from the connection's buffer (DATA loses its payload, which is not needed
/// to explain a refusal).
fn other_owned(frame: Frame<'_>) -> Frame<'static> {
    match frame {
        Frame::Hello(h) => Frame::Hello(h),
        Frame::Auth(a) => Frame::Auth(a),
        Frame::Have(k) => Frame::Have(k),
        Frame::HaveReply(f) => Frame::HaveReply(f),
        Frame::Get(k) => Frame::Get(k),
        Frame::Data { key, checksum, .. } => Frame::Data {
            key,
            checksum,
            payload: &[],
        },
        Frame::End { sent } => Frame::End { sent },
        Frame::Error(m) => Frame::Error(m),
        Frame::NixlGet(k) => Frame::NixlGet(k),
        Frame::NixlOffer { chunks, .. } => Frame::NixlOffer {
            connection: &[],
            metadata: &[],
            chunks,
        },
        Frame::NixlDone => Frame::NixlDone,
        Frame::Put { key, checksum, .. } => Frame::Put {
            key,
            checksum,
            payload: &[],
        },
    }
}

/// The connecting side's handshake, within `timeout`.
pub(crate) fn client(conn: &mut Conn, ours: &Identity, timeout: Duration) -> Result<(), P2pError> {
    conn.set_timeout(timeout);
    let our_nonce = auth::nonce();
    conn.send(&hello(ours, our_nonce), "send HELLO")?;
    let theirs = recv_hello(conn, "receive HELLO")?;
    if let Some(reason) = mismatch(ours, Role::Client, &theirs) {
        return Err(refuse(conn, reason));
    }
    let Some(secret) = ours.secret.as_deref() else {
        return Ok(());
    };
    let proof = auth::prove(secret, Role::Client, &theirs.nonce, &ours.namespace);
    conn.send(&Frame::Auth(proof), "send AUTH")?;
    let server_proof = recv_auth(conn, "receive AUTH")?;
    if !auth::verify(
        secret,
        Role::Server,
        &our_nonce,
        &ours.namespace,
        &server_proof,
    ) {
        return Err(refuse(
            conn,
            "the server's HMAC proof does not verify (wrong shared secret or namespace?)"
                .to_owned(),
        ));
    }
    let session = auth::session_key(secret, &our_nonce, &theirs.nonce, &ours.namespace);
    conn.set_chunk_auth(ours.chunk_auth(session, secret));
    Ok(())
}

/// The accepting side's handshake, within `timeout`.
pub(crate) fn server(conn: &mut Conn, ours: &Identity, timeout: Duration) -> Result<(), P2pError> {
    conn.set_timeout(timeout);
    let theirs = recv_hello(conn, "receive HELLO")?;
    if let Some(reason) = mismatch(ours, Role::Server, &theirs) {
        return Err(refuse(conn, reason));
    }
    let our_nonce = auth::nonce();
    conn.send(&hello(ours, our_nonce), "send HELLO")?;
    let Some(secret) = ours.secret.as_deref() else {
        return Ok(());
    };
    let client_proof = recv_auth(conn, "receive AUTH")?;
    if !auth::verify(
        secret,
        Role::Client,
        &our_nonce,
        &ours.namespace,
        &client_proof,
    ) {
        return Err(refuse(
            conn,
            "the client's HMAC proof does not verify (wrong shared secret or namespace?)"
                .to_owned(),
        ));
    }
    let proof = auth::prove(secret, Role::Server, &theirs.nonce, &ours.namespace);
    conn.send(&Frame::Auth(proof), "send AUTH")?;
    let session = auth::session_key(secret, &theirs.nonce, &our_nonce, &ours.namespace);
    conn.set_chunk_auth(ours.chunk_auth(session, secret));
    Ok(())
}
