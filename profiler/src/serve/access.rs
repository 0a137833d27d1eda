//! Who may read the endpoints. A heap profile shows a program's structure
//! and every process memprobe profiles, so off loopback the endpoints take
//! TLS and a bearer token or a client certificate (as Prometheus' and
//! Alloy's scrape configs send them, read from files), or an explicit
//! `--listen-insecure`. On loopback a token may still be asked for.
use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::Arc,
};

use tokio_rustls::rustls::{
    self, RootCertStore, ServerConfig,
    pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject},
    server::WebPkiClientVerifier,
};

use crate::serve::error::ServeError;

/// The endpoints' access flags, as given.
#[derive(Clone, Debug, Default)]
pub struct AccessOptions {
    /// `--tls-cert`: the server's certificate chain (PEM). Default: none.
    pub tls_cert: Option<PathBuf>,
    /// `--tls-key`: its private key (PEM). Default: none.
    pub tls_key: Option<PathBuf>,
    /// `--tls-client-ca`: client certificates must be signed by one of
    /// these (PEM). Default: none (no client certificate asked for).
    pub tls_client_ca: Option<PathBuf>,
    /// `--auth-token-file`: requests must carry `Authorization: Bearer`
    /// with the token this file holds. Default: none.
    pub token_file: Option<PathBuf>,
    /// `--listen-insecure`: serve a non-loopback address without TLS or
    /// authentication. Default: no.
    pub insecure: bool,
}

/// The access settled: a TLS configuration and the token, if any.
#[derive(Clone, Default)]
pub struct Access {
    pub tls: Option<Arc<ServerConfig>>,
    pub token: Option<Arc<str>>,
    /// Whether TLS clients must show a certificate.
    pub client_certificates: bool,
}

impl Access {
    /// Reads the files and checks that `address` is not left open.
    pub fn settle(options: &AccessOptions, address: SocketAddr) -> Result<Self, ServeError> {
        let refuse = |reason: &'static str| ServeError::UnsafeListen { address, reason };
        let tls = match (&options.tls_cert, &options.tls_key) {
            (Some(cert), Some(key)) => {
                Some(server_config(cert, key, options.tls_client_ca.as_deref())?)
            }
            (None, None) if options.tls_client_ca.is_some() => {
                return Err(refuse("--tls-client-ca needs --tls-cert and --tls-key"));
            }
            (None, None) => None,
            _ => return Err(refuse("give --tls-cert and --tls-key together")),
        };
        let token = options.token_file.as_deref().map(read_token).transpose()?;
        let authenticated = token.is_some() || options.tls_client_ca.is_some();
        let guarded = tls.is_some() && authenticated;
        if !(address.ip().is_loopback() || options.insecure || guarded) {
            return Err(refuse(
                "off loopback anyone who reaches the port could read every profiled process's \
                 heap: give --tls-cert, --tls-key and --auth-token-file (or --tls-client-ca), \
                 or --listen-insecure to serve it open",
            ));
        }
        Ok(Self {
            tls,
            token,
            client_certificates: options.tls_client_ca.is_some(),
        })
    }

    /// Whether a request's `Authorization` header value lets it in.
    pub fn admits(&self, authorization: Option<&[u8]>) -> bool {
        let Some(token) = &self.token else {
            return true;
        };
        authorization
            .and_then(|value| value.strip_prefix(b"Bearer "))
            .is_some_and(|given| same_bytes(given, token.as_bytes()))
    }
}

/// Compares in a time that depends on the lengths only, not on where the
/// first difference lies.
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn read_token(path: &Path) -> Result<Arc<str>, ServeError> {
    let unreadable = |cause: Box<dyn std::error::Error + Send + Sync>| ServeError::AccessFile {
        what: "--auth-token-file",
        path: path.to_owned(),
        cause,
    };
    let text = std::fs::read_to_string(path).map_err(|e| unreadable(e.into()))?;
    let token = text.trim();
    if token.is_empty() || token.contains(char::is_whitespace) {
        return Err(unreadable("it must hold one token, without spaces".into()));
    }
    Ok(token.into())
}

fn server_config(
    cert: &Path,
    key_path: &Path,
    client_ca: Option<&Path>,
) -> Result<Arc<ServerConfig>, ServeError> {
    let file_error = |what, path: &Path| {
        let path = path.to_owned();
        move |cause: Box<dyn std::error::Error + Send + Sync>| ServeError::AccessFile {
            what,
            path,
            cause,
        }
    };
    let certs = certificates(cert).map_err(file_error("--tls-cert", cert))?;
    let key = PrivateKeyDer::from_pem_file(key_path)
        .map_err(|e| file_error("--tls-key", key_path)(e.into()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| file_error("--tls-cert", cert)(e.into()))?;
    let builder = match client_ca {
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for certificate in certificates(ca).map_err(file_error("--tls-client-ca", ca))? {
                roots
                    .add(certificate)
                    .map_err(|e| file_error("--tls-client-ca", ca)(e.into()))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| file_error("--tls-client-ca", ca)(e.into()))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(certs, key)
        .map_err(|e| file_error("--tls-key", key_path)(e.into()))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Every certificate of a PEM file; at least one.
fn certificates(
    path: &Path,
) -> std::result::Result<Vec<CertificateDer<'static>>, Box<dyn std::error::Error + Send + Sync>> {
    let certs = CertificateDer::pem_file_iter(path)?.collect::<std::result::Result<Vec<_>, _>>()?;
    if certs.is_empty() {
        return Err("no PEM certificate in it".into());
    }
    Ok(certs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loopback() -> SocketAddr {
        "127.0.0.1:6060".parse().unwrap()
    }

    #[test]
    fn off_loopback_needs_tls_and_authentication_or_the_opt_out() {
        let open: SocketAddr = "0.0.0.0:6060".parse().unwrap();
        let refused = Access::settle(&AccessOptions::default(), open)
            .err()
            .unwrap();
        assert!(
            refused.to_string().contains("--listen-insecure"),
            "{refused}"
        );
        let insecure = AccessOptions {
            insecure: true,
            ..AccessOptions::default()
        };
        assert!(Access::settle(&insecure, open).is_ok());
        assert!(Access::settle(&AccessOptions::default(), loopback()).is_ok());
        let half = AccessOptions {
            tls_cert: Some("cert.pem".into()),
            ..AccessOptions::default()
        };
        let refused = Access::settle(&half, loopback()).err().unwrap();
        assert!(refused.to_string().contains("together"), "{refused}");
    }

    #[test]
    fn a_token_is_asked_for_exactly() {
        let dir = std::env::temp_dir().join(format!("memprobe-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("token");
        std::fs::write(&file, "s3cret\n").unwrap();
        let options = AccessOptions {
            token_file: Some(file.clone()),
            ..AccessOptions::default()
        };
        let access = Access::settle(&options, loopback()).unwrap();
        assert!(access.admits(Some(b"Bearer s3cret")));
        assert!(!access.admits(Some(b"Bearer s3cre")));
        assert!(!access.admits(Some(b"Bearer s3cret2")));
        assert!(!access.admits(Some(b"s3cret")));
        assert!(!access.admits(None));
        std::fs::write(&file, "two words\n").unwrap();
        assert!(Access::settle(&options, loopback()).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(Access::default().admits(None));
    }
}
