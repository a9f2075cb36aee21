//! TLS for NBD_OPT_STARTTLS, with nbdkit's conventions so that existing
//! clients work unchanged: libnbd's `nbds://` URIs (`tls-certificates=DIR`,
//! `tls-psk-file=FILE`), QEMU's `tls-creds-x509` and `tls-creds-psk`
//! objects, and nbd-client.
//!
//! Two ways to authenticate, as in nbdkit:
//! - X.509: a directory with `ca-cert.pem`, `server-cert.pem` and
//!   `server-key.pem`; with peer verification, a client must present a
//!   certificate signed by that CA.
//! - Pre-shared keys: a file of `username:hexkey` lines (what `psktool`
//!   writes and libnbd and QEMU read), one key per client. The client names
//!   its user; a user not in the file, or a wrong key, fails the handshake.
//!
//! OpenSSL does the cryptography. GnuTLS clients (libnbd, QEMU) negotiate
//! TLS 1.3 with either method; for PSK, OpenSSL's server callback serves
//! TLS 1.3 sessions with a SHA-256 suite and TLS 1.2 PSK suites alike.
//!
//! A [`TlsSession`] is non-blocking: every call returns at once, asking the
//! caller to wait for the socket when it cannot proceed (see `transport.rs`).

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use std::sync::OnceLock;

use openssl::error::ErrorStack;
use openssl::ex_data::Index;
use openssl::ssl::{
    ErrorCode, Ssl, SslAcceptor, SslContext, SslFiletype, SslMethod, SslOptions, SslStream,
    SslVerifyMode, SslVersion,
};
use openssl::x509::X509;

use crate::socket::{Blocked, Socket};

/// Whether clients may, or must, use TLS (nbdkit's `--tls`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TlsMode {
    /// NBD_OPT_STARTTLS is refused by policy (NBD_REP_ERR_POLICY).
    #[default]
    Off,
    /// Clients choose: plain text or TLS.
    On,
    /// Every option but NBD_OPT_STARTTLS and NBD_OPT_ABORT is refused with
    /// NBD_REP_ERR_TLS_REQD until TLS is up; NBD_OPT_EXPORT_NAME, which
    /// cannot be refused, ends the connection.
    Require,
}

impl TlsMode {
    pub fn parse(text: &str) -> Result<TlsMode, String> {
        match text {
            "off" => Ok(TlsMode::Off),
            "on" => Ok(TlsMode::On),
            "require" => Ok(TlsMode::Require),
            other => Err(format!(
                "unknown TLS mode {other:?}: use off, on or require"
            )),
        }
    }
}

impl fmt::Display for TlsMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TlsMode::Off => "off",
            TlsMode::On => "on",
            TlsMode::Require => "require",
        })
    }
}

/// Where the server's credentials come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TlsCredentials {
    /// A directory with `ca-cert.pem`, `server-cert.pem`, `server-key.pem`.
    Certificates { dir: PathBuf, verify_peer: bool },
    /// A file of `username:hexkey` lines.
    PskFile(PathBuf),
}

/// Credentials loaded and checked, ready for handshakes.
#[derive(Clone)]
pub struct TlsConfig {
    context: SslContext,
    summary: String,
}

impl fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConfig")
            .field("summary", &self.summary)
            .finish()
    }
}

fn invalid(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, message)
}

fn openssl_error(what: &str, path: &Path, error: ErrorStack) -> io::Error {
    invalid(format!("{what} {}: {error}", path.display()))
}

impl TlsConfig {
    /// Loads and checks the credentials, so a bad file fails at start-up
    /// with its name, not at the first client.
    pub fn load(credentials: &TlsCredentials) -> io::Result<TlsConfig> {
        match credentials {
            TlsCredentials::Certificates { dir, verify_peer } => {
                Self::from_certificates(dir, *verify_peer)
            }
            TlsCredentials::PskFile(path) => Self::from_psk_file(path),
        }
    }

    fn from_certificates(dir: &Path, verify_peer: bool) -> io::Result<TlsConfig> {
        let file = |name: &str| {
            let path = dir.join(name);
            if path.is_file() {
                Ok(path)
            } else {
                Err(invalid(format!(
                    "{} is missing: a certificates directory holds ca-cert.pem, server-cert.pem and server-key.pem",
                    path.display()
                )))
            }
        };
        let (ca, cert, key) = (
            file("ca-cert.pem")?,
            file("server-cert.pem")?,
            file("server-key.pem")?,
        );
        let mut builder = acceptor_builder()?;
        builder
            .set_certificate_chain_file(&cert)
            .map_err(|e| openssl_error("cannot load the certificate", &cert, e))?;
        builder
            .set_private_key_file(&key, SslFiletype::PEM)
            .map_err(|e| openssl_error("cannot load the private key", &key, e))?;
        builder.check_private_key().map_err(|e| {
            invalid(format!(
                "{} does not match {}: {e}",
                key.display(),
                cert.display()
            ))
        })?;
        builder
            .set_ca_file(&ca)
            .map_err(|e| openssl_error("cannot load the CA certificate", &ca, e))?;
        if verify_peer {
            builder.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
            // The CA names sent in the certificate request tell a client
            // with several certificates which one to present.
            let pem = std::fs::read(&ca)?;
            let names =
                X509::stack_from_pem(&pem).map_err(|e| openssl_error("cannot parse", &ca, e))?;
            let mut list = openssl::stack::Stack::new().map_err(io::Error::other)?;
            for certificate in names {
                list.push(
                    certificate
                        .subject_name()
                        .to_owned()
                        .map_err(io::Error::other)?,
                )
                .map_err(io::Error::other)?;
            }
            builder.set_client_ca_list(list);
        }
        let summary = format!(
            "X.509 certificates from {}{}",
            dir.display(),
            if verify_peer {
                ", client certificates verified"
            } else {
                ""
            }
        );
        Ok(TlsConfig {
            context: builder.build().into_context(),
            summary,
        })
    }

    fn from_psk_file(path: &Path) -> io::Result<TlsConfig> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            io::Error::new(e.kind(), format!("cannot read {}: {e}", path.display()))
        })?;
        let keys = Arc::new(
            parse_psk_file(&text).map_err(|e| invalid(format!("{}: {e}", path.display())))?,
        );
        let mut builder = acceptor_builder()?;
        // TLS 1.2 clients need a PSK suite. In TLS 1.3 OpenSSL's PSK
        // callback makes a SHA-256 session, so only SHA-256 suites fit.
        builder
            .set_cipher_list("ECDHE-PSK:DHE-PSK:PSK:!eNULL:!aNULL@STRENGTH")
            .map_err(io::Error::other)?;
        builder
            .set_ciphersuites("TLS_AES_128_GCM_SHA256:TLS_CHACHA20_POLY1305_SHA256")
            .map_err(io::Error::other)?;
        builder.set_options(SslOptions::CIPHER_SERVER_PREFERENCE);
        let users = keys.len();
        let user_index = psk_user_index()?;
        builder.set_psk_server_callback(move |ssl, identity, out| {
            let found = identity
                .and_then(|name| keys.get_key_value(name))
                .filter(|(_, key)| key.len() <= out.len());
            Ok(match found {
                Some((name, key)) => {
                    out[..key.len()].copy_from_slice(key);
                    // OpenSSL does not report the identity of a TLS 1.3
                    // PSK session afterwards, so it is kept here.
                    ssl.set_ex_data(user_index, String::from_utf8_lossy(name).into_owned());
                    key.len()
                }
                // Zero length: unknown user, the handshake fails.
                None => 0,
            })
        });
        Ok(TlsConfig {
            context: builder.build().into_context(),
            summary: format!(
                "pre-shared keys from {} ({users} user{})",
                path.display(),
                if users == 1 { "" } else { "s" }
            ),
        })
    }

    /// E.g. "pre-shared keys from keys.psk (2 users)".
    pub fn summary(&self) -> &str {
        &self.summary
    }
}

/// Where a PSK session keeps the name of its user.
fn psk_user_index() -> io::Result<Index<Ssl, String>> {
    static INDEX: OnceLock<Index<Ssl, String>> = OnceLock::new();
    if let Some(index) = INDEX.get() {
        return Ok(*index);
    }
    let index = Ssl::new_ex_index().map_err(io::Error::other)?;
    Ok(*INDEX.get_or_init(|| index))
}

fn acceptor_builder() -> io::Result<openssl::ssl::SslAcceptorBuilder> {
    let mut builder =
        SslAcceptor::mozilla_intermediate_v5(SslMethod::tls_server()).map_err(io::Error::other)?;
    builder
        .set_min_proto_version(Some(SslVersion::TLS1_2))
        .map_err(io::Error::other)?;
    builder.set_options(SslOptions::NO_RENEGOTIATION);
    // NBD clients never resume sessions.
    builder.set_num_tickets(0).map_err(io::Error::other)?;
    Ok(builder)
}

/// Parses `username:hexkey` lines. Blank lines and `#` comments are
/// skipped; anything else malformed is an error naming its line.
fn parse_psk_file(text: &str) -> Result<HashMap<Vec<u8>, Vec<u8>>, String> {
    let mut keys = HashMap::new();
    for (index, line) in text.lines().enumerate() {
        let number = index + 1;
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() || line.starts_with('#') {
            continue;
        }
        let (user, hex) = line
            .rsplit_once(':')
            .ok_or_else(|| format!("line {number} is not username:hexkey"))?;
        if user.is_empty() {
            return Err(format!("line {number} has an empty username"));
        }
        let key = decode_hex(hex.trim())
            .ok_or_else(|| format!("line {number}: the key is not hexadecimal"))?;
        if key.is_empty() || key.len() > 256 {
            return Err(format!(
                "line {number}: a key must be 1 to 256 bytes, not {}",
                key.len()
            ));
        }
        if keys.insert(user.as_bytes().to_vec(), key).is_some() {
            return Err(format!("line {number}: user {user:?} appears twice"));
        }
    }
    if keys.is_empty() {
        return Err("no keys in the file (expected username:hexkey lines)".into());
    }
    Ok(keys)
}

fn decode_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// How far a handshake got.
pub(crate) enum TlsStep {
    Done,
    /// Wait for these poll events on the socket, then call again.
    Wait(libc::c_short),
}

/// One connection's TLS session over its own handle on the socket.
pub(crate) struct TlsSession {
    stream: SslStream<Socket>,
}

impl TlsSession {
    pub fn new(config: &TlsConfig, socket: Socket) -> io::Result<TlsSession> {
        let ssl = Ssl::new(&config.context).map_err(io::Error::other)?;
        let stream = SslStream::new(ssl, socket).map_err(io::Error::other)?;
        Ok(TlsSession { stream })
    }

    /// Advances the server side of the handshake.
    pub fn handshake(&mut self) -> io::Result<TlsStep> {
        match self.stream.accept() {
            Ok(()) => Ok(TlsStep::Done),
            Err(error) => {
                // OpenSSL's own text names source files; its reasons are
                // what an operator needs ("binder does not verify" is a
                // wrong pre-shared key).
                let reasons: Vec<&str> = error
                    .ssl_error()
                    .map(|stack| stack.errors().iter().filter_map(|e| e.reason()).collect())
                    .unwrap_or_default();
                let why = if reasons.is_empty() {
                    error.to_string()
                } else {
                    reasons.join("; ")
                };
                match blocked(error) {
                    Blocked::On(events) => Ok(TlsStep::Wait(events)),
                    Blocked::Failed(_) => Err(io::Error::new(
                        io::ErrorKind::PermissionDenied,
                        format!("TLS handshake failed: {why}"),
                    )),
                }
            }
        }
    }

    pub fn read(&mut self, buf: &mut [u8]) -> Result<usize, Blocked> {
        match self.stream.ssl_read(buf) {
            Ok(count) => Ok(count),
            // close_notify, or a client that closed without one (QEMU
            // does): an ordinary end of stream for NBD, whose messages are
            // framed, so a cut inside one is still caught as such.
            Err(error) if error.code() == ErrorCode::ZERO_RETURN => Ok(0),
            Err(error) if error.code() == ErrorCode::SYSCALL && error.io_error().is_none() => Ok(0),
            Err(error) => Err(blocked(error)),
        }
    }

    /// Sends close_notify if the socket takes it at once; never waits.
    pub fn close(&mut self) {
        let _ = self.stream.shutdown();
    }

    pub fn write(&mut self, buf: &[u8]) -> Result<usize, Blocked> {
        self.stream.ssl_write(buf).map_err(blocked)
    }

    /// E.g. "TLSv1.3 TLS_AES_256_GCM_SHA384, PSK user alice".
    pub fn describe(&self) -> String {
        let ssl = self.stream.ssl();
        let cipher = ssl.current_cipher().map_or("?", |c| c.name());
        let mut text = format!("{} {cipher}", ssl.version_str());
        let user = psk_user_index().ok().and_then(|index| ssl.ex_data(index));
        if let Some(user) = user {
            text.push_str(&format!(", PSK user {user:?}"));
        } else if let Some(certificate) = ssl.peer_certificate() {
            let subject: Vec<String> = certificate
                .subject_name()
                .entries()
                .map(|e| String::from_utf8_lossy(e.data().as_slice()).into_owned())
                .collect();
            text.push_str(&format!(", client certificate {}", subject.join("/")));
        }
        text
    }
}

/// Sorts an OpenSSL error into "wait for the socket" or a real failure.
fn blocked(error: openssl::ssl::Error) -> Blocked {
    match error.code() {
        ErrorCode::WANT_READ => Blocked::On(libc::POLLIN),
        ErrorCode::WANT_WRITE => Blocked::On(libc::POLLOUT),
        _ => Blocked::Failed(match error.into_io_error() {
            Ok(io_error) => io_error,
            Err(error) => io::Error::other(error.to_string()),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psk_files_parse_as_psktool_writes_them() {
        let keys = parse_psk_file("alice:00ff10\n# comment\n\nbob:ABCDEF\n").unwrap();
        assert_eq!(keys[b"alice".as_slice()], vec![0x00, 0xff, 0x10]);
        assert_eq!(keys[b"bob".as_slice()], vec![0xab, 0xcd, 0xef]);
        for (bad, expected) in [
            ("alice", "line 1 is not username:hexkey"),
            ("alice:0g", "not hexadecimal"),
            ("alice:abc", "not hexadecimal"),
            (":abcd", "empty username"),
            ("a:00\na:01", "appears twice"),
            ("# nothing\n", "no keys"),
        ] {
            let error = parse_psk_file(bad).unwrap_err();
            assert!(error.contains(expected), "{bad:?}: {error}");
        }
    }

    #[test]
    fn modes_parse() {
        assert_eq!(TlsMode::parse("require"), Ok(TlsMode::Require));
        assert!(TlsMode::parse("yes").is_err());
    }
}
