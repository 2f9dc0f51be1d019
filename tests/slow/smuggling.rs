//! Request smuggling: a corpus of ambiguous HTTP/1.1 requests (CL+TE, duplicate or invalid
//! Content-Length, obs-fold, odd Transfer-Encodings, bad chunk sizes, bare LF) sent over raw
//! TCP to the gateway, in front of a recording upstream that keeps exactly the bytes it
//! receives. Each case is either rejected with 400 (nothing reaches the upstream), or reaches
//! the upstream as well-formed requests with normalized framing: one request per upstream
//! connection (the recorder answers `Connection: close`), no bytes after it, at most one
//! `Content-Length` that matches the body, or `chunked` alone, never both, no obs-fold. The
//! gateway and the upstream therefore always agree on where each request ends.
//!
//! Every case runs twice: on the plaintext listener, and on the TLS listener with a client
//! that offers no ALPN (whose HTTP/1.1 is the gateway's own engine too, not hyper's).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mcp_reattach::{Config, Gateway};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

type Log = Arc<Mutex<Vec<Vec<u8>>>>;

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Where the request that starts `buf` ends, if it is complete (lenient: only to know when
/// to answer; the strict check is `parse_strict`).
fn request_end(buf: &[u8]) -> Option<usize> {
    let h = find(buf, b"\r\n\r\n")? + 4;
    let head = String::from_utf8_lossy(&buf[..h]).to_ascii_lowercase();
    if head.contains("\r\ntransfer-encoding:") {
        let mut i = h;
        loop {
            let eol = find(&buf[i..], b"\r\n")?;
            let size = usize::from_str_radix(
                std::str::from_utf8(&buf[i..i + eol])
                    .ok()?
                    .split(';')
                    .next()?
                    .trim(),
                16,
            )
            .ok()?;
            if size == 0 {
                let end = find(&buf[i + eol + 2..], b"\r\n")?;
                return Some(i + eol + 2 + end + 2);
            }
            i += eol + 2 + size + 2;
            if i > buf.len() {
                return None;
            }
        }
    }
    let cl = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    (buf.len() >= h + cl).then_some(h + cl)
}

/// The recording upstream: records every byte of each connection; answers the first request
/// with `200` + `Connection: close`, then keeps reading briefly to catch smuggled leftovers.
async fn recorder() -> (SocketAddr, Log) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let log: Log = Default::default();
    let lg = log.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut tcp, _)) = l.accept().await else {
                return;
            };
            let lg = lg.clone();
            tokio::spawn(async move {
                let idx = {
                    let mut v = lg.lock().unwrap();
                    v.push(Vec::new());
                    v.len() - 1
                };
                let mut buf = [0u8; 8192];
                let mut answered = false;
                let mut data = Vec::new();
                loop {
                    let wait = if answered {
                        Duration::from_millis(150)
                    } else {
                        Duration::from_secs(5)
                    };
                    match tokio::time::timeout(wait, tcp.read(&mut buf)).await {
                        Ok(Ok(n)) if n > 0 => {
                            data.extend_from_slice(&buf[..n]);
                            lg.lock().unwrap()[idx].extend_from_slice(&buf[..n]);
                        }
                        _ => break,
                    }
                    if !answered && request_end(&data).is_some() {
                        answered = true;
                        let _ = tcp
                            .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")
                            .await;
                    }
                }
            });
        }
    });
    (addr, log)
}

/// A request parsed strictly (RFC 9112), or why it is not well-formed and normalized.
#[derive(Debug)]
struct Parsed {
    method: String,
    target: String,
    body: Vec<u8>,
    consumed: usize,
}

fn parse_strict(buf: &[u8]) -> Result<Parsed, String> {
    let h = find(buf, b"\r\n\r\n").ok_or("no end of head")?;
    let head = std::str::from_utf8(&buf[..h]).map_err(|_| "head not UTF-8")?;
    let mut lines = head.split("\r\n");
    let start = lines.next().ok_or("no request line")?;
    let parts: Vec<&str> = start.split(' ').collect();
    if parts.len() != 3 || parts[2] != "HTTP/1.1" {
        return Err(format!("request line {start:?}"));
    }
    let mut cl: Vec<&str> = Vec::new();
    let mut te: Vec<&str> = Vec::new();
    for line in lines {
        if line.starts_with([' ', '\t']) {
            return Err(format!("obs-fold forwarded: {line:?}"));
        }
        if line.contains('\n') || line.contains('\r') {
            return Err(format!("bare CR/LF in {line:?}"));
        }
        let (name, value) = line.split_once(':').ok_or(format!("header {line:?}"))?;
        if name.is_empty() || name.contains([' ', '\t']) {
            return Err(format!("header name {name:?}"));
        }
        match name.to_ascii_lowercase().as_str() {
            "content-length" => cl.push(value.trim()),
            "transfer-encoding" => te.push(value.trim()),
            _ => {}
        }
    }
    let b = h + 4;
    let (body, consumed) = match (cl.as_slice(), te.as_slice()) {
        ([], []) => (Vec::new(), b),
        ([v], []) => {
            if v.is_empty() || !v.bytes().all(|c| c.is_ascii_digit()) {
                return Err(format!("content-length {v:?}"));
            }
            let n: usize = v.parse().map_err(|_| "content-length overflow")?;
            if buf.len() < b + n {
                return Err("body shorter than content-length".into());
            }
            (buf[b..b + n].to_vec(), b + n)
        }
        ([], ["chunked"]) => {
            let mut body = Vec::new();
            let mut i = b;
            loop {
                let eol = find(&buf[i..], b"\r\n").ok_or("unterminated chunk size")?;
                let line = std::str::from_utf8(&buf[i..i + eol]).map_err(|_| "chunk size")?;
                if line.is_empty() || !line.bytes().all(|c| c.is_ascii_hexdigit()) {
                    return Err(format!("chunk size line {line:?}"));
                }
                let size = usize::from_str_radix(line, 16).map_err(|_| "chunk size")?;
                i += eol + 2;
                if size == 0 {
                    if buf.get(i..i + 2) != Some(b"\r\n") {
                        return Err("trailers or no final CRLF".into());
                    }
                    break (body, i + 2);
                }
                if buf.len() < i + size + 2 || &buf[i + size..i + size + 2] != b"\r\n" {
                    return Err("chunk data".into());
                }
                body.extend_from_slice(&buf[i..i + size]);
                i += size + 2;
            }
        }
        (c, t) => return Err(format!("framing not normalized: CL {c:?}, TE {t:?}")),
    };
    Ok(Parsed {
        method: parts[0].to_owned(),
        target: parts[1].to_owned(),
        body,
        consumed,
    })
}

/// A gateway's listener as a client reaches it: plaintext, or TLS with a client that offers
/// no ALPN (trusting the listener's CA).
#[derive(Clone)]
enum Front {
    Plain(SocketAddr),
    Tls(SocketAddr, Arc<rustls::ClientConfig>),
}

/// Sends `raw` on a fresh connection and returns every byte the gateway answers until it
/// closes or stays quiet for 300 ms, and whether it closed the connection.
async fn exchange(front: &Front, raw: &[u8]) -> (Vec<u8>, bool) {
    match front {
        Front::Plain(addr) => talk(TcpStream::connect(addr).await.unwrap(), raw).await,
        Front::Tls(addr, client) => {
            let tcp = TcpStream::connect(addr).await.unwrap();
            let tls = tokio_rustls::TlsConnector::from(client.clone())
                .connect(ServerName::try_from("localhost").unwrap(), tcp)
                .await
                .unwrap();
            assert_eq!(tls.get_ref().1.alpn_protocol(), None, "no protocol named");
            talk(tls, raw).await
        }
    }
}

/// [`exchange`] on a connected transport.
async fn talk(mut io: impl AsyncRead + AsyncWrite + Unpin, raw: &[u8]) -> (Vec<u8>, bool) {
    let _ = io.write_all(raw).await;
    let _ = io.flush().await;
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match tokio::time::timeout(Duration::from_millis(300), io.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (out, true),
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Err(_) => return (out, false),
        }
    }
}

/// Final statuses of the responses in `resp` (interim 1xx left out).
fn statuses(resp: &[u8]) -> Vec<u16> {
    let text = String::from_utf8_lossy(resp);
    text.match_indices("HTTP/1.")
        .filter_map(|(i, _)| text.get(i + 9..i + 12)?.parse().ok())
        .filter(|s| *s >= 200)
        .collect()
}

const J: &str = r#"{"jsonrpc":"2.0","id":1,"method":"ping"}"#;

fn cases() -> Vec<(&'static str, String)> {
    let p = |headers: &str, body: &str| {
        format!("POST /mcp HTTP/1.1\r\nHost: mcp.example\r\nContent-Type: application/json\r\n{headers}\r\n{body}")
    };
    let smuggled = "GET /admin HTTP/1.1\r\nHost: mcp.example\r\n\r\n";
    vec![
        ("plain CL (control)", p(&format!("Content-Length: {}\r\n", J.len()), J)),
        ("plain chunked (control)", p("Transfer-Encoding: chunked\r\n", &format!("{:x}\r\n{J}\r\n0\r\n\r\n", J.len()))),
        ("CL.TE: CL covers a smuggled prefix", p("Content-Length: 6\r\nTransfer-Encoding: chunked\r\n", "0\r\n\r\nG")),
        ("TE.CL: chunked body, short CL", p("Transfer-Encoding: chunked\r\nContent-Length: 4\r\n", &format!("{:x}\r\n{smuggled}\r\n0\r\n\r\n", smuggled.len()))),
        ("CL.TE with a full smuggled request", p(&format!("Content-Length: {}\r\nTransfer-Encoding: chunked\r\n", 5 + smuggled.len()), &format!("0\r\n\r\n{smuggled}"))),
        ("duplicate CL, same value", p(&format!("Content-Length: {0}\r\nContent-Length: {0}\r\n", J.len()), J)),
        ("duplicate CL, different values", p(&format!("Content-Length: {}\r\nContent-Length: 3\r\n", J.len()), J)),
        ("CL list, same values", p(&format!("Content-Length: {0}, {0}\r\n", J.len()), J)),
        ("CL list, different values", p(&format!("Content-Length: {}, 3\r\n", J.len()), J)),
        ("CL not a number", p("Content-Length: abc\r\n", J)),
        ("CL negative", p("Content-Length: -1\r\n", J)),
        ("CL with plus sign", p(&format!("Content-Length: +{}\r\n", J.len()), J)),
        ("CL hex", p("Content-Length: 0x10\r\n", J)),
        ("CL with inner space", p("Content-Length: 1 0\r\n", J)),
        ("CL overflow", p("Content-Length: 99999999999999999999999\r\n", J)),
        ("CL empty", p("Content-Length: \r\n", J)),
        ("space before colon (CL)", p(&format!("Content-Length : {}\r\n", J.len()), J)),
        ("space before colon (TE)", p("Transfer-Encoding : chunked\r\n", &format!("{:x}\r\n{J}\r\n0\r\n\r\n", J.len()))),
        ("TE obs-fold", p("Transfer-Encoding:\r\n chunked\r\n", &format!("{:x}\r\n{J}\r\n0\r\n\r\n", J.len()))),
        ("obs-fold in another header", p(&format!("X-Folded: a\r\n b\r\nContent-Length: {}\r\n", J.len()), J)),
        ("TE: identity", p(&format!("Transfer-Encoding: identity\r\nContent-Length: {}\r\n", J.len()), J)),
        ("TE: chunked, identity", p("Transfer-Encoding: chunked, identity\r\n", &format!("{:x}\r\n{J}\r\n0\r\n\r\n", J.len()))),
        ("TE: gzip, chunked", p("Transfer-Encoding: gzip, chunked\r\n", &format!("{:x}\r\n{J}\r\n0\r\n\r\n", J.len()))),
        ("TE: xchunked", p(&format!("Transfer-Encoding: xchunked\r\nContent-Length: {}\r\n", J.len()), J)),
        ("TE: Chunked (case)", p("Transfer-Encoding: Chunked\r\n", &format!("{:x}\r\n{J}\r\n0\r\n\r\n", J.len()))),
        ("TE with tab", p("Transfer-Encoding:\tchunked\r\n", &format!("{:x}\r\n{J}\r\n0\r\n\r\n", J.len()))),
        ("TE twice (chunked, identity)", p("Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n", &format!("{:x}\r\n{J}\r\n0\r\n\r\n", J.len()))),
        ("TE twice (chunked, chunked)", p("Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n", &format!("{:x}\r\n{J}\r\n0\r\n\r\n", J.len()))),
        ("chunk size not hex", p("Transfer-Encoding: chunked\r\n", "zz\r\nhello\r\n0\r\n\r\n")),
        ("chunk size negative", p("Transfer-Encoding: chunked\r\n", "-1\r\nhello\r\n0\r\n\r\n")),
        ("chunk size 0x prefix", p("Transfer-Encoding: chunked\r\n", "0x5\r\nhello\r\n0\r\n\r\n")),
        ("chunk size overflow", p("Transfer-Encoding: chunked\r\n", "fffffffffffffffffff\r\nhello\r\n0\r\n\r\n")),
        ("chunk size with space", p("Transfer-Encoding: chunked\r\n", "5 \r\nhello\r\n0\r\n\r\n")),
        ("chunk extension", p("Transfer-Encoding: chunked\r\n", "5;name=value\r\nhello\r\n0\r\n\r\n")),
        ("chunk data longer than size", p("Transfer-Encoding: chunked\r\n", "3\r\nhello\r\n0\r\n\r\n")),
        ("chunk lines with bare LF", p("Transfer-Encoding: chunked\r\n", "5\nhello\n0\n\n")),
        ("chunked with trailer", p("Transfer-Encoding: chunked\r\n", "5\r\nhello\r\n0\r\nX-Trailer: 1\r\n\r\n")),
        ("head with bare LF", format!("POST /mcp HTTP/1.1\nHost: mcp.example\nContent-Length: {}\n\n{J}", J.len())),
        ("NUL in a header value", p(&format!("X-Nul: a\0b\r\nContent-Length: {}\r\n", J.len()), J)),
        ("CR in a header value", p(&format!("X-Cr: a\rb\r\nContent-Length: {}\r\n", J.len()), J)),
        ("HTTP/1.0 with chunked", format!("POST /mcp HTTP/1.0\r\nHost: mcp.example\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{J}\r\n0\r\n\r\n", J.len())),
        ("HTTP/1.0 with CL and keep-alive", format!("POST /mcp HTTP/1.0\r\nHost: mcp.example\r\nConnection: keep-alive\r\nContent-Length: {}\r\n\r\n{J}", J.len())),
        ("GET with a body (CL)", "GET /mcp HTTP/1.1\r\nHost: mcp.example\r\nContent-Length: 5\r\n\r\nhello".to_string()),
        ("GET with CL.TE", "GET /mcp HTTP/1.1\r\nHost: mcp.example\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n".to_string()),
        ("two requests pipelined (CL: 0 then a request)", p("Content-Length: 0\r\n", smuggled)),
        ("request line with two spaces", format!("POST  /mcp HTTP/1.1\r\nHost: mcp.example\r\nContent-Length: {}\r\n\r\n{J}", J.len())),
        ("absolute-form target", format!("POST http://evil.example/mcp HTTP/1.1\r\nHost: mcp.example\r\nContent-Length: {}\r\n\r\n{J}", J.len())),
        ("unknown HTTP version", format!("POST /mcp HTTP/1.2\r\nHost: mcp.example\r\nContent-Length: {}\r\n\r\n{J}", J.len())),
        ("Connection names Content-Length", p(&format!("Connection: content-length\r\nContent-Length: {}\r\n", J.len()), J)),
        ("Connection names Transfer-Encoding", p("Connection: transfer-encoding\r\nTransfer-Encoding: chunked\r\n", &format!("{:x}\r\n{J}\r\n0\r\n\r\n", J.len()))),
        ("Expect: 100-continue", p(&format!("Expect: 100-continue\r\nContent-Length: {}\r\n", J.len()), J)),
    ]
}

/// A gateway with the default config in front of the upstream at `up`; its address.
async fn gateway_before(up: SocketAddr) -> SocketAddr {
    serve(Config::new(format!("http://{up}").parse().unwrap())).await
}

/// Serves a gateway with `cfg` on a loopback port; its address.
async fn serve(cfg: Config) -> SocketAddr {
    let gateway = Gateway::new(cfg);
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(mcp_reattach::serve_gateway(
        l,
        gateway,
        std::future::pending(),
    ));
    addr
}

/// A gateway with the default config in front of the upstream at `up`, on a TLS listener
/// (a certificate for `localhost` from a fresh CA); a client of it that offers no ALPN.
async fn tls_gateway_before(up: SocketAddr, name: &str) -> Front {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "smuggling CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_key = KeyPair::generate().unwrap();
    let ca_pem = ca_params.self_signed(&ca_key).unwrap().pem();
    let mut params =
        CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
    params.distinguished_name.push(DnType::CommonName, "server");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let key = KeyPair::generate().unwrap();
    let cert = params
        .signed_by(&key, &Issuer::from_params(&ca_params, &ca_key))
        .unwrap();
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("smuggling-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (cert_path, key_path) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert_path, cert.pem()).unwrap();
    std::fs::write(&key_path, key.serialize_pem()).unwrap();
    let mut cfg = Config::new(format!("http://{up}").parse().unwrap());
    cfg.tls = Some(mcp_reattach::ServerTls::load(&cert_path, &key_path, None).unwrap());
    let addr = serve(cfg).await;
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let client = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    assert!(client.alpn_protocols.is_empty());
    Front::Tls(addr, Arc::new(client))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ambiguous_requests_are_rejected_or_forwarded_normalized() {
    let (up, log) = recorder().await;
    let front = Front::Plain(gateway_before(up).await);
    ambiguous_requests_through(front, log).await;
}

/// [`ambiguous_requests_are_rejected_or_forwarded_normalized`] on the TLS listener, its
/// client naming no protocol.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ambiguous_requests_over_tls_without_alpn_are_rejected_or_forwarded_normalized() {
    let (up, log) = recorder().await;
    let front = tls_gateway_before(up, "ambiguous").await;
    ambiguous_requests_through(front, log).await;
}

/// Every case of the corpus through `front`, the upstream recording into `log`.
async fn ambiguous_requests_through(front: Front, log: Log) {
    let mut table = Vec::new();
    let mut failures = Vec::new();
    for (name, raw) in cases() {
        log.lock().unwrap().clear();
        let (resp, closed) = exchange(&front, raw.as_bytes()).await;
        let head_end = raw.find("\r\n\r\n").unwrap_or(raw.len());
        let head = raw[..head_end].to_ascii_lowercase();
        if head.contains("content-length") && head.contains("transfer-encoding") && !closed {
            // RFC 9112 §6.3: with both, the server MUST close the connection after responding.
            failures.push(format!("{name}: CL + TE and the connection stayed open"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await; // the recorder's leftovers window
        let recorded = log.lock().unwrap().clone();
        let st = statuses(&resp);
        let outcome = if st.first() == Some(&400) {
            if recorded.iter().any(|r| !r.is_empty()) {
                failures.push(format!(
                    "{name}: 400 but the upstream got {:?}",
                    recorded
                        .iter()
                        .map(|r| String::from_utf8_lossy(r).into_owned())
                        .collect::<Vec<_>>()
                ));
            }
            "400".to_owned()
        } else {
            let mut forwarded = Vec::new();
            for r in &recorded {
                match parse_strict(r) {
                    Ok(p) if p.consumed == r.len() => {
                        forwarded.push(format!("{} {} ({} B)", p.method, p.target, p.body.len()))
                    }
                    Ok(p) => failures.push(format!(
                        "{name}: {} bytes after the request on one upstream connection: {:?}",
                        r.len() - p.consumed,
                        String::from_utf8_lossy(&r[p.consumed..])
                    )),
                    Err(e) => failures.push(format!(
                        "{name}: not normalized at the upstream: {e}: {:?}",
                        String::from_utf8_lossy(r)
                    )),
                }
            }
            // The client sees one answer per request the upstream got (no desync), plus at
            // most a final gateway error for a trailing malformed request.
            let ok = st.iter().filter(|s| **s == 200).count();
            if ok != recorded.len() {
                failures.push(format!(
                    "{name}: the client got statuses {st:?} for {} upstream requests",
                    recorded.len()
                ));
            }
            if st.iter().any(|s| *s != 200 && *s != 400) {
                failures.push(format!("{name}: unexpected statuses {st:?}"));
            }
            if st.is_empty() {
                format!("no response, {} upstream", recorded.len())
            } else {
                format!("{st:?} → upstream: {}", forwarded.join("; "))
            }
        };
        table.push(format!("| {name} | {outcome} |"));
    }
    eprintln!("{}", table.join("\n"));
    assert!(
        failures.is_empty(),
        "smuggling corpus:\n{}",
        failures.join("\n")
    );
}

/// Trailer lines are header lines: one that is not (a name that is no token, no colon, a
/// control byte in the value, obs-fold) is refused with 400 and nothing reaches the upstream;
/// well-formed trailers are read and dropped, the request forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_trailer_lines_are_refused_with_400() {
    let (up, log) = recorder().await;
    let front = Front::Plain(gateway_before(up).await);
    malformed_trailers_through(front, log).await;
}

/// [`malformed_trailer_lines_are_refused_with_400`] on the TLS listener, its client naming
/// no protocol.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_trailer_lines_over_tls_without_alpn_are_refused_with_400() {
    let (up, log) = recorder().await;
    let front = tls_gateway_before(up, "trailers").await;
    malformed_trailers_through(front, log).await;
}

/// Every trailer case through `front`, the upstream recording into `log`.
async fn malformed_trailers_through(front: Front, log: Log) {
    let chunked = |trailers: &str| {
        format!(
            "POST /mcp HTTP/1.1\r\nHost: mcp.example\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{J}\r\n0\r\n{trailers}\r\n",
            J.len()
        )
    };
    let mut failures = Vec::new();
    for (name, trailers, want) in [
        (
            "well-formed trailers (control)",
            "X-Checksum: 1\r\nX-Other:\tv w\r\n",
            200,
        ),
        ("space in a trailer name", "Bad Name: 1\r\n", 400),
        ("space before the colon", "X-Checksum : 1\r\n", 400),
        ("no colon", "X-Checksum\r\n", 400),
        ("empty name", ": 1\r\n", 400),
        ("obs-fold", "X-Checksum: 1\r\n folded\r\n", 400),
        ("NUL in a value", "X-Checksum: a\0b\r\n", 400),
        ("DEL in a value", "X-Checksum: a\x7fb\r\n", 400),
        (
            "a request line as a trailer",
            "GET /admin HTTP/1.1\r\n",
            400,
        ),
    ] {
        log.lock().unwrap().clear();
        let (resp, _) = exchange(&front, chunked(trailers).as_bytes()).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let st = statuses(&resp);
        let reached = log.lock().unwrap().iter().filter(|r| !r.is_empty()).count();
        let ok = st.first() == Some(&want) && (want != 400 || reached == 0);
        if !ok {
            failures.push(format!(
                "{name}: statuses {st:?}, {reached} upstream requests (want {want})"
            ));
        }
    }
    assert!(failures.is_empty(), "trailers:\n{}", failures.join("\n"));
}
