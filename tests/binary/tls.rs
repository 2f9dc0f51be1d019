//! TLS on both sides, with certificates generated here by `rcgen`:
//!
//! - the real TypeScript SDK client resumes a cut stream through a TLS listener (Node trusts
//!   the test CA through `NODE_EXTRA_CA_CERTS`);
//! - the certificate files are rotated under an attached stream: new connections get the new
//!   certificate, the attached stream keeps flowing; a bad new pair (mismatched, expired) is
//!   refused with a log line and the old certificate kept (the real binary); SIGHUP re-reads
//!   them at once;
//! - bad certificate, key and CA files at startup exit 64 naming the flag;
//! - a plaintext request on the TLS port is answered 400 at once; a silent client is closed
//!   after `--header-read-timeout`; ALPN offers h2;
//! - an HTTPS upstream with a private CA (`--upstream-ca`), SNI from the URL's host, and the
//!   platform roots refusing it;
//! - mTLS: clients without a certificate are refused, and with `--principal-source
//!   client-cert` only the certificate's subject that created a session may resume it.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::support;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use mcp_reattach::config::PrincipalSource;
use mcp_reattach::ServerTls;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use support::free_port;
use support::*;
use tokio::net::{TcpListener, TcpStream};

// ---------------------------------------------------------------------------------------------
// Certificates and files
// ---------------------------------------------------------------------------------------------

struct Ca {
    params: CertificateParams,
    key: KeyPair,
    pem: String,
}

fn ca(name: &str) -> Ca {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let key = KeyPair::generate().unwrap();
    let pem = params.self_signed(&key).unwrap().pem();
    Ca { params, key, pem }
}

/// A certificate and key (PEM) signed by `ca`; `sans` empty makes a client certificate.
fn leaf(ca: &Ca, cn: &str, sans: &[&str], tweak: impl FnOnce(&mut CertificateParams)) -> Pair {
    let mut params =
        CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
    params.distinguished_name.push(DnType::CommonName, cn);
    params
        .distinguished_name
        .push(DnType::OrganizationName, "Acme");
    params.extended_key_usages = vec![if sans.is_empty() {
        ExtendedKeyUsagePurpose::ClientAuth
    } else {
        ExtendedKeyUsagePurpose::ServerAuth
    }];
    tweak(&mut params);
    let key = KeyPair::generate().unwrap();
    let issuer = Issuer::from_params(&ca.params, &ca.key);
    let cert = params.signed_by(&key, &issuer).unwrap();
    Pair {
        der: cert.der().to_vec(),
        cert: cert.pem(),
        key: key.serialize_pem(),
    }
}

fn server_leaf(ca: &Ca, cn: &str) -> Pair {
    leaf(ca, cn, &["localhost", "127.0.0.1"], |_| {})
}

#[derive(Clone)]
struct Pair {
    der: Vec<u8>,
    cert: String,
    key: String,
}

/// A fresh directory under the target's test scratch space.
fn scratch(name: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "tls-{name}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// What a certificate rotation test starts from: a CA, two server leaves of it, and the first
/// one written to `tls.crt` / `tls.key` in a scratch folder of its own.
struct Rotation {
    ca: Ca,
    one: Pair,
    two: Pair,
    cert: PathBuf,
    key: PathBuf,
}

fn rotation(name: &str) -> Rotation {
    let dir = scratch(name);
    let ca = ca("test CA");
    let (one, two) = (
        server_leaf(&ca, "server one"),
        server_leaf(&ca, "server two"),
    );
    let cert = write(&dir, "tls.crt", &one.cert);
    let key = write(&dir, "tls.key", &one.key);
    Rotation {
        ca,
        one,
        two,
        cert,
        key,
    }
}

/// The real binary serving `r`'s pair, looking at it every `interval` (nothing listens
/// upstream: these tests need only the TLS listener).
fn binary_serving(r: &Rotation, interval: &str) -> Binary {
    Binary::start_blocking(
        free_port(),
        &[
            "--tls-cert",
            r.cert.to_str().unwrap(),
            "--tls-key",
            r.key.to_str().unwrap(),
            "--tls-reload-interval",
            interval,
        ],
    )
}

/// Replaces a file the way an atomic writer does (write aside, rename over).
fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

// ---------------------------------------------------------------------------------------------
// A TLS client
// ---------------------------------------------------------------------------------------------

fn client_config(ca_pem: &str, client: Option<&Pair>, alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots);
    let mut cfg = match client {
        None => builder.with_no_client_auth(),
        Some(p) => builder
            .with_client_auth_cert(
                vec![CertificateDer::from(p.der.clone())],
                PrivateKeyDer::from_pem_slice(p.key.as_bytes()).unwrap(),
            )
            .unwrap(),
    };
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(cfg)
}

type TlsStream = tokio_rustls::client::TlsStream<TcpStream>;

async fn tls_connect(
    addr: SocketAddr,
    cfg: &Arc<rustls::ClientConfig>,
) -> std::io::Result<TlsStream> {
    let tcp = TcpStream::connect(addr).await?;
    tokio_rustls::TlsConnector::from(cfg.clone())
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
}

/// The DER of the certificate the server presented.
fn served(stream: &TlsStream) -> Vec<u8> {
    stream.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

/// One request over a fresh TLS connection (HTTP/1.1); the body streams from it.
async fn tls_try_send(
    addr: SocketAddr,
    cfg: &Arc<rustls::ClientConfig>,
    req: Request<Full<Bytes>>,
) -> Result<Response<Incoming>, String> {
    let tls = tls_connect(addr, cfg).await.map_err(|e| e.to_string())?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    tokio::time::timeout(WAIT, sender.send_request(req))
        .await
        .map_err(|_| "no response in time".to_string())?
        .map_err(|e| e.to_string())
}

async fn tls_send(
    addr: SocketAddr,
    cfg: &Arc<rustls::ClientConfig>,
    req: Request<Full<Bytes>>,
) -> Response<Incoming> {
    tls_try_send(addr, cfg, req).await.unwrap()
}

/// Initializes session `sid` through the gateway over TLS (the mock answers with JSON).
async fn tls_init(addr: SocketAddr, cfg: &Arc<rustls::ClientConfig>, mock: &mut Mock, sid: &str) {
    let c = cfg.clone();
    let pending = tokio::spawn(async move { tls_send(addr, &c, post(INITIALIZE, None)).await });
    mock.next().await.respond_initialized(sid);
    let resp = pending.await.unwrap();
    assert_eq!(resp.status(), 200);
}

/// A gateway in front of `upstream` serving TLS with `cert`/`key`.
async fn tls_gateway(
    upstream: SocketAddr,
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
    tweak: impl FnOnce(&mut mcp_reattach::Config),
) -> Gw {
    let mut tls = ServerTls::load(cert, key, client_ca).unwrap();
    tls.reload_interval = Duration::from_millis(50);
    gateway(upstream, |cfg| {
        cfg.tls = Some(tls);
        tweak(cfg);
    })
    .await
}

/// Waits (bounded) until a counter reaches `n`: the gateway counts a refused connection
/// after closing it, so the client may see the close first.
async fn wait_counter(gw: &Gw, line: &str, n: f64) {
    let deadline = Instant::now() + WAIT;
    let value = || gw.metric(line).unwrap_or(0.0);
    while value() < n {
        assert!(Instant::now() < deadline, "{line} = {}", value());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// The TypeScript SDK resumes through TLS
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ts_sdk_client_resumes_a_cut_stream_through_tls() {
    support::require_node();
    let dir = scratch("ts");
    let ca = ca("test CA");
    let pair = server_leaf(&ca, "gateway");
    let ca_path = write(&dir, "ca.pem", &ca.pem);
    let cert = write(&dir, "cert.pem", &pair.cert);
    let key = write(&dir, "key.pem", &pair.key);
    let server = support::Upstream::ts("sse").await;
    let gw = tls_gateway(server.addr, &cert, &key, None, |_| {}).await;
    let relay = support::Relay::start(gw.addr);
    let url = format!("https://localhost:{}/mcp", relay.addr().port());

    support::ensure_npm_deps();
    let mut client = support::ChildProc::spawn_env(
        "ts-client",
        &support::node_bin(),
        &["ts-client.mjs", &url, "8", "150", "20000"],
        &support::interop_dir(),
        &[("NODE_EXTRA_CA_CERTS", ca_path.to_str().unwrap())],
    );
    let (mut progress, mut result, mut cuts) = (Vec::new(), None, 0);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while result.is_none() {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let support::NextLine::Line(line) = client.next_line(left).await else {
            break;
        };
        eprintln!("[ts-client stdout] {line}");
        let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
        if let Some(p) = v.get("progress").and_then(serde_json::Value::as_u64) {
            progress.push(p);
            if p == 3 {
                cuts += relay.cut_all();
            }
        } else if v.get("result").is_some() || v.get("error").is_some() {
            result = Some(v);
        }
    }
    let _ = client.wait_exit(Duration::from_secs(5)).await;
    let stderr = client.stderr_to_end(Duration::from_secs(2)).await;
    assert!(cuts >= 1, "the cut hit no connection");
    assert_eq!(progress, (1..=8).collect::<Vec<_>>(), "{stderr:#?}");
    assert_eq!(
        result
            .as_ref()
            .and_then(|r| r["result"]["content"][0]["text"].as_str()),
        Some("done 8"),
        "{result:?}\n{stderr:#?}"
    );
    assert!(
        stderr.iter().any(|l| l.contains("GET last-event-id=")),
        "the client resumed with Last-Event-ID: {stderr:#?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Rotation
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotated_certificate_is_served_to_new_connections_while_a_stream_keeps_flowing() {
    let Rotation {
        ca,
        one,
        two,
        cert,
        key,
        ..
    } = rotation("rotate");
    let mut mock = Mock::start().await;
    let gw = tls_gateway(mock.addr, &cert, &key, None, |c| c.hold_standalone = false).await;
    let client = client_config(&ca.pem, None, &[b"http/1.1"]);

    tls_init(gw.addr, &client, &mut mock, "s1").await;
    let c = client.clone();
    let addr = gw.addr;
    let pending = tokio::spawn(async move { tls_send(addr, &c, post(&call(1), Some("s1"))).await });
    let writer = mock.next().await.respond_sse(Some("s1"));
    let mut stream = SseReader::new(pending.await.unwrap());
    writer.message(&progress(1)).await;
    assert_eq!(messages(&[stream.next().await.unwrap()]), vec![progress(1)]);
    assert_eq!(
        served(&tls_connect(gw.addr, &client).await.unwrap()),
        one.der
    );

    // cert-manager rewrites the files in place.
    replace(&cert, &two.cert);
    replace(&key, &two.key);
    let deadline = Instant::now() + WAIT;
    while served(&tls_connect(gw.addr, &client).await.unwrap()) != two.der {
        assert!(
            Instant::now() < deadline,
            "the new certificate was never served"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The stream attached before the rotation keeps flowing on its connection.
    writer.message(&progress(2)).await;
    writer.message(&result(1)).await;
    drop(writer);
    assert_eq!(messages(&stream.rest().await), vec![progress(2), result(1)]);
    // And requests on new connections work with the new certificate.
    let c = client.clone();
    let ping = r#"{"jsonrpc":"2.0","id":2,"method":"ping"}"#;
    let pending = tokio::spawn(async move { tls_send(addr, &c, post(ping, Some("s1"))).await });
    let seen = mock.next().await;
    assert_eq!(seen.headers["x-forwarded-proto"], "https");
    seen.respond_json(r#"{"jsonrpc":"2.0","id":2,"result":{}}"#);
    assert_eq!(pending.await.unwrap().status(), 200);
}

#[test]
fn bad_new_pair_is_refused_with_a_log_line_and_the_old_kept() {
    let r = rotation("refuse");
    let mut gw = binary_serving(&r, "50ms");
    let Rotation {
        ca,
        one,
        two,
        cert,
        key,
    } = r;
    let expired = leaf(&ca, "expired", &["localhost"], |p| {
        p.not_before = rcgen::date_time_ymd(2000, 1, 1);
        p.not_after = rcgen::date_time_ymd(2001, 1, 1);
    });
    let rt = tokio::runtime::Runtime::new().unwrap();
    let client = client_config(&ca.pem, None, &[b"http/1.1"]);
    let addr = gw.addr;
    let served_now = || rt.block_on(async { served(&tls_connect(addr, &client).await.unwrap()) });
    assert_eq!(served_now(), one.der);

    // A certificate with another's key: refused, the old one still served.
    replace(&cert, &two.cert);
    wait_log(
        &mut gw,
        "new TLS certificate refused",
        "does not match the certificate",
    );
    assert_eq!(served_now(), one.der);
    // An expired certificate with its own key: refused too.
    replace(&cert, &expired.cert);
    replace(&key, &expired.key);
    wait_log(&mut gw, "new TLS certificate refused", "expired");
    assert_eq!(served_now(), one.der);
    // A file gone missing (mid-rotation): said once, the old certificate kept.
    std::fs::remove_file(&key).unwrap();
    wait_log(&mut gw, "TLS files not readable", "--tls-key");
    assert_eq!(served_now(), one.der);
    // Then a good pair is taken.
    replace(&key, &two.key);
    replace(&cert, &two.cert);
    wait_log(&mut gw, "TLS certificate reloaded", "");
    assert_eq!(served_now(), two.der);
}

/// SIGHUP re-reads the pair at once, without waiting for `--tls-reload-interval` (an hour here),
/// and says what it found: unchanged, reloaded, or refused with the reason (each time it is
/// asked, not only the first), the served certificate kept.
#[test]
fn sighup_reloads_the_certificate_at_once() {
    let r = rotation("sighup");
    let mut gw = binary_serving(&r, "1h");
    let Rotation {
        ca,
        one,
        two,
        cert,
        key,
    } = r;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let client = client_config(&ca.pem, None, &[b"http/1.1"]);
    let addr = gw.addr;
    let served_now = || rt.block_on(async { served(&tls_connect(addr, &client).await.unwrap()) });
    assert_eq!(served_now(), one.der);

    gw.proc.signal("HUP");
    wait_log(&mut gw, "SIGHUP", "unchanged");
    assert_eq!(served_now(), one.der);

    replace(&cert, &two.cert);
    replace(&key, &two.key);
    gw.proc.signal("HUP");
    wait_log(&mut gw, "SIGHUP", "reloaded");
    assert_eq!(served_now(), two.der, "served at once after SIGHUP");

    // The certificate of one with the key of two: refused, twice, the served one kept.
    replace(&cert, &one.cert);
    for _ in 0..2 {
        gw.proc.signal("HUP");
        wait_log(&mut gw, "refused", "does not match the certificate");
        wait_log(&mut gw, "SIGHUP", "refused");
        assert_eq!(served_now(), two.der);
    }
}

// ---------------------------------------------------------------------------------------------
// The real binary: startup errors and logs
// ---------------------------------------------------------------------------------------------

/// Waits (bounded) for a line of `gw`'s log (stdout) after the last one matched containing both
/// strings.
fn wait_log(gw: &mut Binary, a: &str, b: &str) {
    if let Err(read) = gw
        .proc
        .wait_line_blocking(WAIT, |l| l.contains(a) && l.contains(b))
    {
        panic!("no log line with {a:?} and {b:?}: {read:#?}");
    }
}

/// Runs the binary expecting it to refuse to start: (exit code, stderr).
fn refuses(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_mcp-reattach"))
        .args([
            "--upstream",
            "http://127.0.0.1:9",
            "--listen",
            "127.0.0.1:0",
        ])
        .args(["--admin-listen", "127.0.0.1:0"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn unusable_tls_files_exit_64_naming_the_flag() {
    let dir = scratch("startup");
    let ca = ca("test CA");
    let good = server_leaf(&ca, "server");
    let other = server_leaf(&ca, "other");
    let expired = leaf(&ca, "expired", &["localhost"], |p| {
        p.not_before = rcgen::date_time_ymd(2000, 1, 1);
        p.not_after = rcgen::date_time_ymd(2001, 1, 1);
    });
    let cert = write(&dir, "cert.pem", &good.cert);
    let key = write(&dir, "key.pem", &good.key);
    let other_key = write(&dir, "other-key.pem", &other.key);
    let expired_cert = write(&dir, "expired.pem", &expired.cert);
    let expired_key = write(&dir, "expired-key.pem", &expired.key);
    let garbage = write(&dir, "garbage.pem", "not a certificate\n");
    let missing = dir.join("missing.pem");
    let s = |p: &Path| p.to_str().unwrap().to_owned();
    let cases: Vec<(Vec<String>, &str, &str)> = vec![
        (
            vec![
                "--tls-cert".into(),
                s(&expired_cert),
                "--tls-key".into(),
                s(&expired_key),
            ],
            "--tls-cert",
            "expired",
        ),
        (
            vec![
                "--tls-cert".into(),
                s(&cert),
                "--tls-key".into(),
                s(&other_key),
            ],
            "--tls-key",
            "does not match",
        ),
        (
            vec![
                "--tls-cert".into(),
                s(&missing),
                "--tls-key".into(),
                s(&key),
            ],
            "--tls-cert",
            "cannot read",
        ),
        (
            vec![
                "--tls-cert".into(),
                s(&cert),
                "--tls-key".into(),
                s(&missing),
            ],
            "--tls-key",
            "cannot read",
        ),
        (
            vec![
                "--tls-cert".into(),
                s(&garbage),
                "--tls-key".into(),
                s(&key),
            ],
            "--tls-cert",
            "no PEM certificate",
        ),
        (
            vec![
                "--tls-cert".into(),
                s(&cert),
                "--tls-key".into(),
                s(&garbage),
            ],
            "--tls-key",
            "no PEM private key",
        ),
        (
            vec![
                "--tls-cert".into(),
                s(&cert),
                "--tls-key".into(),
                s(&key),
                "--tls-client-ca".into(),
                s(&missing),
            ],
            "--tls-client-ca",
            "cannot read",
        ),
        (
            vec!["--upstream-ca".into(), s(&garbage)],
            "--upstream-ca",
            "no PEM certificate",
        ),
        (
            vec!["--principal-source".into(), "client-cert".into()],
            "--principal-source",
            "--tls-client-ca",
        ),
        (vec!["--tls-cert".into(), s(&cert)], "--tls-key", "required"),
    ];
    for (args, flag, why) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, stderr) = refuses(&args);
        assert_eq!(code, Some(64), "{args:?}: {stderr}");
        assert!(
            stderr.contains(flag) && stderr.contains(why),
            "{args:?} should name {flag} ({why}): {stderr}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Plaintext, slow handshakes, ALPN
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_on_the_tls_port_gets_a_400_not_a_hang() {
    let dir = scratch("plain");
    let ca = ca("test CA");
    let pair = server_leaf(&ca, "server");
    let cert = write(&dir, "cert.pem", &pair.cert);
    let key = write(&dir, "key.pem", &pair.key);
    let mock = Mock::start().await;
    let gw = tls_gateway(mock.addr, &cert, &key, None, |_| {}).await;
    let addr = gw.addr;
    let t0 = Instant::now();
    let answer = tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(b"POST /mcp HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            .unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    })
    .await
    .unwrap();
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer:?}");
    assert!(answer.contains("this port speaks TLS"), "{answer:?}");
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    wait_counter(
        &gw,
        "mcp_reattach_connection_errors_total{kind=\"plaintext_on_tls\"}",
        1.0,
    )
    .await;
}

/// A TLS gateway whose handshake deadline (`--header-read-timeout`) is `timeout`.
async fn slow_handshake_gateway(name: &str, timeout: Duration) -> (Gw, Mock) {
    let dir = scratch(name);
    let ca = ca("test CA");
    let pair = server_leaf(&ca, "server");
    let cert = write(&dir, "cert.pem", &pair.cert);
    let key = write(&dir, "key.pem", &pair.key);
    let mock = Mock::start().await;
    let gw = tls_gateway(mock.addr, &cert, &key, None, |c| {
        c.header_read_timeout = timeout;
    })
    .await;
    (gw, mock)
}

/// Connects, sends `opening` and then nothing; returns how long (tokio's clock) until the
/// gateway closed the connection, asserting it did close it (not our read timing out).
async fn handshake_closed_after(addr: SocketAddr, opening: &[u8]) -> Duration {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let t0 = tokio::time::Instant::now();
    s.write_all(opening).await.unwrap();
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .expect("closed by the gateway, not timed out on our side");
    assert!(matches!(read, Ok(0) | Err(_)), "closed: {read:?}");
    t0.elapsed()
}

/// One client says nothing; another starts a handshake record and stalls. Paused clock: each
/// is closed exactly at the deadline.
#[tokio::test(start_paused = true)]
async fn the_handshake_is_bounded_by_the_header_read_timeout() {
    let timeout = Duration::from_millis(300);
    let (gw, _mock) = slow_handshake_gateway("slow", timeout).await;
    for opening in [&b""[..], &[0x16, 0x03, 0x01][..]] {
        let waited = handshake_closed_after(gw.addr, opening).await;
        assert!(
            waited >= timeout && waited <= timeout + Duration::from_millis(5),
            "{opening:?}: closed after {waited:?}"
        );
    }
    wait_counter(
        &gw,
        "mcp_reattach_connection_errors_total{kind=\"tls_handshake_timeout\"}",
        2.0,
    )
    .await;
}

/// The real-time smoke of the handshake deadline: the one wall-clock check that it fires at
/// all outside a paused runtime (wide bounds: real scheduling).
#[tokio::test]
async fn the_handshake_deadline_fires_in_real_time() {
    let (gw, _mock) = slow_handshake_gateway("slow-rt", Duration::from_millis(300)).await;
    let waited = handshake_closed_after(gw.addr, &[0x16, 0x03, 0x01]).await;
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_secs(3),
        "closed after {waited:?}"
    );
}

/// A TLS gateway (certificate from a fresh CA, in scratch dir `name`) in front of a mock.
async fn alpn_gateway(name: &str) -> (Ca, Mock, Gw) {
    let dir = scratch(name);
    let ca = ca("test CA");
    let pair = server_leaf(&ca, "server");
    let cert = write(&dir, "cert.pem", &pair.cert);
    let key = write(&dir, "key.pem", &pair.key);
    let mock = Mock::start().await;
    let gw = tls_gateway(mock.addr, &cert, &key, None, |_| {}).await;
    (ca, mock, gw)
}

/// An `initialize` over HTTP/2 on `tls`, the mock answering it with JSON.
async fn h2_initialize(tls: TlsStream, mock: &mut Mock) -> Response<Incoming> {
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        TokioIo::new(tls),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let req = Request::post("https://localhost/mcp")
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .body(Full::new(Bytes::from_static(INITIALIZE.as_bytes())))
        .unwrap();
    let pending = tokio::spawn(sender.send_request(req));
    mock.next()
        .await
        .respond_json(r#"{"jsonrpc":"2.0","id":0,"result":{}}"#);
    let resp = pending.await.unwrap().unwrap();
    resp
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alpn_offers_h2_and_h2_requests_are_served() {
    let (ca, mut mock, gw) = alpn_gateway("alpn").await;
    let client = client_config(&ca.pem, None, &[b"h2", b"http/1.1"]);
    let tls = tls_connect(gw.addr, &client).await.unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let resp = h2_initialize(tls, &mut mock).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.version(), http::Version::HTTP_2);
    let client11 = client_config(&ca.pem, None, &[b"http/1.1"]);
    let tls = tls_connect(gw.addr, &client11).await.unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
}

/// A client that offers no ALPN: the gateway reads which HTTP it speaks from its first bytes
/// (HTTP/1.1, or HTTP/2 with prior knowledge), as it does on a plaintext port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_alpn_either_http_is_read_from_the_stream() {
    let (ca, mut mock, gw) = alpn_gateway("no-alpn").await;
    let client = client_config(&ca.pem, None, &[]);

    // HTTP/1.1.
    let c = client.clone();
    let pending = tokio::spawn(async move { tls_send(gw.addr, &c, post(INITIALIZE, None)).await });
    let seen = mock.next().await;
    assert_eq!(seen.method, http::Method::POST);
    seen.respond_json(r#"{"jsonrpc":"2.0","id":0,"result":{}}"#);
    let resp = pending.await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.version(), http::Version::HTTP_11);

    // HTTP/2 with prior knowledge.
    let tls = tls_connect(gw.addr, &client).await.unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), None);
    let resp = h2_initialize(tls, &mut mock).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.version(), http::Version::HTTP_2);
}

/// Issue 47 item 1: a TLS client that names no ALPN protocol speaks HTTP/1.1 to the gateway's
/// own engine, as on a plaintext port, not to hyper's (whose semantics differ, and which the
/// smuggling suite does not cover). A request with both `Content-Length` and
/// `Transfer-Encoding`, which hyper serves (chunked wins) and the gateway's engine refuses as
/// ambiguous, never reaches the upstream (before: hyper served it, the upstream got it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_alpn_http11_is_the_gateways_own_engine() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (ca, mut mock, gw) = alpn_gateway("no-alpn-engine").await;
    let client = client_config(&ca.pem, None, &[]);
    let mut tls = tls_connect(gw.addr, &client).await.unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), None);
    let head = format!(
        "POST /mcp HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nContent-Length: {}\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{INITIALIZE}\r\n0\r\n\r\n",
        INITIALIZE.len(),
        INITIALIZE.len()
    );
    tls.write_all(head.as_bytes()).await.unwrap();
    assert!(
        mock.nothing_within(Duration::from_secs(1)).await,
        "a request with both Content-Length and Transfer-Encoding reached the upstream"
    );
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_millis(200), tls.read_to_end(&mut got)).await;
    let text = String::from_utf8_lossy(&got);
    assert!(!text.starts_with("HTTP/1.1 2"), "{text}");
}

// ---------------------------------------------------------------------------------------------
// HTTPS upstream
// ---------------------------------------------------------------------------------------------

/// A TLS terminator in front of the mock upstream; records the SNI each client sent.
async fn tls_front(target: SocketAddr, pair: &Pair) -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(
        vec![CertificateDer::from(pair.der.clone())],
        PrivateKeyDer::from_pem_slice(pair.key.as_bytes()).unwrap(),
    )
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let sni = Arc::new(Mutex::new(Vec::new()));
    let seen = sni.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            let seen = seen.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    seen.lock().unwrap().push("<handshake failed>".into());
                    return;
                };
                let name = tls.get_ref().1.server_name().unwrap_or("<none>").to_owned();
                seen.lock().unwrap().push(name);
                let mut up = TcpStream::connect(target).await.unwrap();
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut up).await;
            });
        }
    });
    (addr, sni)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_upstream_with_a_private_ca_and_sni_from_the_host() {
    let dir = scratch("upstream");
    let ca = ca("upstream CA");
    let pair = server_leaf(&ca, "mcp server");
    let ca_path = write(&dir, "upstream-ca.pem", &ca.pem);
    let mut mock = Mock::start().await;
    let (front, sni) = tls_front(mock.addr, &pair).await;
    let upstream: http::Uri = format!("https://localhost:{}", front.port())
        .parse()
        .unwrap();
    let tls = mcp_reattach::upstream_client_config(Some(&ca_path)).unwrap();
    let gw = gateway(mock.addr, |cfg| {
        cfg.upstream = upstream.clone();
        cfg.upstream_tls = Some(Arc::new(tls));
    })
    .await;

    init_session(&gw, &mut mock, "s1").await;
    let pending = tokio::spawn(send(gw.addr, post(&call(1), Some("s1"))));
    let writer = mock.next().await.respond_sse(Some("s1"));
    let mut stream = SseReader::new(pending.await.unwrap());
    writer.message(&progress(1)).await;
    let first = stream.next().await.unwrap();
    assert!(
        first.id.is_some(),
        "tagged through the HTTPS upstream: {first:?}"
    );
    writer.message(&result(1)).await;
    drop(writer);
    assert_eq!(messages(&stream.rest().await), vec![result(1)]);
    let names = sni.lock().unwrap().clone();
    assert!(
        !names.is_empty() && names.iter().all(|n| n == "localhost"),
        "{names:?}"
    );

    // The platform's roots do not trust the private CA: 502, counted as a connect failure.
    let platform = gateway(mock.addr, |cfg| cfg.upstream = upstream.clone()).await;
    let resp = send(platform.addr, post(INITIALIZE, None)).await;
    assert_eq!(resp.status(), 502);
    assert_eq!(
        platform
            .metric("mcp_reattach_upstream_errors_total{kind=\"connect\"}")
            .unwrap_or(0.0),
        1.0
    );
    assert!(mock.nothing_within(Duration::from_millis(100)).await);
}

// ---------------------------------------------------------------------------------------------
// mTLS
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_client_certificate_subject_is_the_resume_principal() {
    let dir = scratch("mtls");
    let server_ca = ca("server CA");
    let client_ca = ca("client CA");
    let pair = server_leaf(&server_ca, "server");
    let cert = write(&dir, "cert.pem", &pair.cert);
    let key = write(&dir, "key.pem", &pair.key);
    let client_ca_path = write(&dir, "client-ca.pem", &client_ca.pem);
    let alice = leaf(&client_ca, "alice", &[], |_| {});
    let bob = leaf(&client_ca, "bob", &[], |_| {});
    let stranger = leaf(&ca("stranger CA"), "alice", &[], |_| {});
    let mut mock = Mock::start().await;
    let gw = tls_gateway(mock.addr, &cert, &key, Some(&client_ca_path), |c| {
        c.principal_source = PrincipalSource::ClientCert;
    })
    .await;
    let as_alice = client_config(&server_ca.pem, Some(&alice), &[b"http/1.1"]);
    let as_bob = client_config(&server_ca.pem, Some(&bob), &[b"http/1.1"]);

    // No certificate, or one from another CA: refused.
    for cfg in [
        client_config(&server_ca.pem, None, &[b"http/1.1"]),
        client_config(&server_ca.pem, Some(&stranger), &[b"http/1.1"]),
    ] {
        let r = tls_try_send(gw.addr, &cfg, post(INITIALIZE, None)).await;
        assert!(
            r.is_err(),
            "served without a valid client certificate: {r:?}"
        );
    }
    wait_counter(
        &gw,
        "mcp_reattach_connection_errors_total{kind=\"tls_handshake\"}",
        2.0,
    )
    .await;

    tls_init(gw.addr, &as_alice, &mut mock, "s1").await;
    let c = as_alice.clone();
    let addr = gw.addr;
    let pending = tokio::spawn(async move { tls_send(addr, &c, post(&call(1), Some("s1"))).await });
    let writer = mock.next().await.respond_sse(Some("s1"));
    let mut stream = SseReader::new(pending.await.unwrap());
    writer.message(&progress(1)).await;
    let cursor = stream.next().await.unwrap().id.unwrap();
    drop(stream);
    writer.message(&progress(2)).await;
    gw.tagged_at_least(2).await;

    // Bob knows the session id and the cursor, but his certificate is not Alice's.
    let resp = tls_send(gw.addr, &as_bob, get("s1", Some(&cursor))).await;
    assert_eq!(resp.status(), 404, "bob may not resume alice's stream");
    assert_eq!(
        gw.metric("mcp_reattach_resumes_total{outcome=\"unauthorized\"}")
            .unwrap_or(0.0),
        1.0
    );
    // Alice resumes, from a new connection, and gets what she missed.
    let resp = tls_send(gw.addr, &as_alice, get("s1", Some(&cursor))).await;
    assert_eq!(resp.status(), 200);
    let mut resumed = SseReader::new(resp);
    writer.message(&result(1)).await;
    drop(writer);
    assert_eq!(
        messages(&resumed.rest().await),
        vec![progress(2), result(1)]
    );
}

/// Issue 22 item 3: a TLS connection that completes its handshake and then sends no request
/// is closed at `--header-read-timeout` like a plain one (the first-request deadline starts
/// once the handshake is done; the handshake has its own, the same timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_tls_connection_after_the_handshake_is_closed() {
    use tokio::io::AsyncReadExt;
    let dir = scratch("idle-after-handshake");
    let ca = ca("test CA");
    let pair = server_leaf(&ca, "server");
    let cert = write(&dir, "cert.pem", &pair.cert);
    let key = write(&dir, "key.pem", &pair.key);
    let mock = Mock::start().await;
    let gw = tls_gateway(mock.addr, &cert, &key, None, |c| {
        c.header_read_timeout = Duration::from_millis(400);
        c.idle_timeout = Duration::from_millis(400);
    })
    .await;
    let client = client_config(&ca.pem, None, &[b"http/1.1"]);
    let mut tls = tls_connect(gw.addr, &client).await.unwrap();
    let t0 = tokio::time::Instant::now();
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(5), tls.read(&mut buf))
        .await
        .expect("closed by the gateway, not timed out on our side");
    assert!(matches!(read, Ok(0) | Err(_)), "closed: {read:?}");
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(3),
        "closed after {waited:?}"
    );
}
