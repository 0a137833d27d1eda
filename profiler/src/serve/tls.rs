//! Serving the endpoints over TLS: each connection's handshake in a task
//! of its own, bounded in number and time, so that a client that stalls
//! holds up nobody else.
use std::{sync::Arc, time::Duration};

use axum::Router;
use hyper_util::{rt::TokioIo, service::TowerToHyperService};
use tokio::{net::TcpListener, sync::Semaphore};
use tokio_rustls::{TlsAcceptor, rustls::ServerConfig};

/// Connections open at once (handshaking or served); more are closed at once.
pub const MAX_CONNECTIONS: usize = 64;

/// The longest a client may take over its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Accepts and serves connections until the run ends.
pub async fn serve(listener: TcpListener, config: Arc<ServerConfig>, router: Router) {
    let acceptor = TlsAcceptor::from(config);
    let open = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            // Out of descriptors, say: let some connections close first.
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let Ok(slot) = open.clone().try_acquire_owned() else {
            continue; // dropped: closed
        };
        let (acceptor, router) = (acceptor.clone(), router.clone());
        tokio::spawn(async move {
            let _slot = slot;
            let Ok(Ok(stream)) =
                tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await
            else {
                return;
            };
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), TowerToHyperService::new(router))
                .await;
        });
    }
}
