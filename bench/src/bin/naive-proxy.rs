//! The naive pass-through: hyper 1 server + hyper-util pooled client, request and response
//! bodies streamed frame by frame, nothing inspected. The cost floor of one HTTP hop, built
//! from the same libraries as mcp-reattach.

use std::net::SocketAddr;

use http_body_util::{combinators::BoxBody, BodyExt};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::{TokioExecutor, TokioIo};

type Body = BoxBody<Bytes, hyper::Error>;

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let listen: SocketAddr = args.next().expect("LISTEN UPSTREAM").parse().unwrap();
    let upstream = args.next().expect("UPSTREAM host:port");
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    let client: Client<_, Incoming> = Client::builder(TokioExecutor::new()).build(conn);
    let l = tokio::net::TcpListener::bind(listen).await.unwrap();
    loop {
        let Ok((tcp, _)) = l.accept().await else {
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let (client, upstream) = (client.clone(), upstream.clone());
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |mut req: Request<Incoming>| {
                let (client, upstream) = (client.clone(), upstream.clone());
                async move {
                    let pq = req.uri().path_and_query().map_or("/", |p| p.as_str());
                    *req.uri_mut() = format!("http://{upstream}{pq}").parse().unwrap();
                    match client.request(req).await {
                        Ok(r) => Ok::<_, hyper::Error>(r.map(|b| b.boxed())),
                        Err(_) => Ok(Response::builder().status(502).body(empty()).unwrap()),
                    }
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(tcp), svc)
                .await;
        });
    }
}

fn empty() -> Body {
    http_body_util::Empty::new().map_err(|n| match n {}).boxed()
}
