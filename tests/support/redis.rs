//! A `redis-server` of a test's own ([`Redis`]), for the fleet's shared store (`--store`), and
//! the fleet's shared secret in a file ([`key_file`]).

use super::*;
use std::path::PathBuf;
use std::process::Command;

/// A `redis-server` of the test's own on a free loopback port, killed on drop.
pub struct Redis {
    proc: Option<ChildProc>,
    pub url: String,
    bin: String,
    port: u16,
}

impl Redis {
    /// Starts one, or `None` (after saying so) when it is not installed and `CI_REQUIRE_REDIS`
    /// is not set.
    pub async fn start(case: &str) -> Option<Redis> {
        let bin = std::env::var("REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        if Command::new(&bin)
            .arg("--version")
            .output()
            .map_or(true, |o| !o.status.success())
        {
            assert!(
                std::env::var_os("CI_REQUIRE_REDIS").is_none(),
                "redis-server is required (CI_REQUIRE_REDIS is set): apt-get install redis-server"
            );
            eprintln!("\n*** SKIPPED store {case}: redis-server is not installed (apt-get install -y redis-server) ***\n");
            return None;
        }
        let port = free_port().port();
        let proc = Redis::spawn(&bin, port).await;
        Some(Redis {
            proc: Some(proc),
            url: format!("redis://127.0.0.1:{port}"),
            bin,
            port,
        })
    }

    /// Runs `redis-server` on `port` and waits (at most 10 s) until it listens.
    async fn spawn(bin: &str, port: u16) -> ChildProc {
        let port_arg = port.to_string();
        let proc = ChildProc::spawn(
            "redis",
            bin,
            &[
                "--port",
                &port_arg,
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--maxmemory-policy",
                "noeviction",
            ],
            std::path::Path::new(env!("CARGO_TARGET_TMPDIR")),
        );
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "redis-server did not listen"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        proc
    }

    /// The store goes away (SIGKILL: everything it held is lost).
    pub async fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
            let _ = p.wait_exit(Duration::from_secs(5)).await;
        }
    }

    /// The store comes back on the same port, empty.
    pub async fn restart(&mut self) {
        self.stop().await;
        self.proc = Some(Redis::spawn(&self.bin, self.port).await);
    }
}

/// The fleet's shared secret, in a file of the test's own.
pub fn key_file(name: &str, bytes: usize) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("store-{name}.key"));
    let secret: String = (0..bytes)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    std::fs::write(&path, secret).unwrap();
    path
}
