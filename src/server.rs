//! Accept loops (placeholder).
use std::future::Future;
use tokio::net::TcpListener;
use crate::config::Config;

/// Serves the gateway on `listener` until `shutdown` resolves.
pub async fn serve(listener: TcpListener, config: Config, shutdown: impl Future<Output = ()> + Send + 'static) -> std::io::Result<()> {
    let _ = (listener, config, shutdown);
    Ok(())
}
