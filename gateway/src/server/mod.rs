//! The HTTP front door (HTTP/1.1 and HTTP/2, plain or over TLS): routes, limits, and the one place
//! errors become responses.

pub mod admin;
pub mod idle;
pub mod tls;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode, header};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::JoinSet;

use crate::api::{Endpoint, GatewayError, Origin};
use crate::handoff::{BoxError, RespBody};
use crate::pipeline::Gateway;
use crate::telemetry::request_id::{self, RequestId};

pub use crate::pipeline::{
    DEFAULT_BODY_READ_TIMEOUT, DEFAULT_HEADER_READ_TIMEOUT, DEFAULT_IDLE_TIMEOUT, HttpTimeouts,
};

pub(crate) fn full(status: u16, v: &Value) -> Response<RespBody> {
    let mut r =
        Response::new(Full::new(Bytes::from(v.to_string())).map_err(|e| -> BoxError { match e {} }).boxed());
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static("application/json"));
    r
}

/// The one mapping from errors to responses.
pub fn error_response(e: &GatewayError) -> Response<RespBody> {
    let mut body = e.body();
    // Inside a request: the error names it, as its header does.
    if let (Some(id), Some(err)) =
        (request_id::current(), body.get_mut("error").and_then(Value::as_object_mut))
    {
        err.insert("request_id".into(), json!(id.as_str()));
    }
    let mut r = full(e.status(), &body);
    if let Some(secs) = e.retry_after()
        && let Ok(v) = header::HeaderValue::from_str(&secs.to_string())
    {
        r.headers_mut().insert(header::RETRY_AFTER, v);
    }
    r
}

impl Gateway {
    /// Serves until `stop` is notified; over TLS when `tls` is given (plain HTTP only where the
    /// caller chose it).
    pub async fn serve(
        self: Arc<Self>,
        listener: TcpListener,
        tls: Option<tls::FrontTls>,
        stop: Arc<Notify>,
    ) {
        let mut conns = JoinSet::new();
        loop {
            tokio::select! {
                _ = stop.notified() => break,
                accepted = listener.accept() => {
                    let Ok((stream, _)) = accepted else {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    let this = Arc::clone(&self);
                    let tls = tls.clone();
                    conns.spawn(async move {
                        match tls {
                            None => this.connection(TokioIo::new(stream)).await,
                            Some(t) => {
                                // A client that cannot finish the handshake in time (or is refused:
                                // old protocol, no certificate) is simply dropped.
                                if let Ok(Ok(s)) = tokio::time::timeout(this.http.header_read, t.acceptor().accept(stream)).await {
                                    this.connection(TokioIo::new(s)).await;
                                }
                            }
                        }
                    });
                }
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        }
        conns.shutdown().await;
    }

    async fn connection<I>(self: Arc<Self>, io: I)
    where
        I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        let limits = self.http;
        let activity = idle::Activity::new();
        let io = idle::Stamped::new(io, Arc::clone(&activity));
        let act = Arc::clone(&activity);
        let svc = service_fn(move |req| {
            let this = Arc::clone(&self);
            let guard = act.request();
            async move {
                let r = this.handle(req).await;
                drop(guard);
                Ok::<_, Infallible>(r)
            }
        });
        let mut b = auto::Builder::new(TokioExecutor::new());
        b.http1()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_read)
            .max_buf_size(crate::pipeline::DEFAULT_MAX_HEADER_BYTES);
        b.http2().timer(TokioTimer::new()).max_header_list_size(
            u32::try_from(crate::pipeline::DEFAULT_MAX_HEADER_BYTES).unwrap_or(u32::MAX),
        );
        let conn = b.serve_connection(io, svc);
        tokio::pin!(conn);
        let mut tick = tokio::time::interval(limits.idle / 8);
        let mut closing = false;
        loop {
            tokio::select! {
                _ = conn.as_mut() => return,
                _ = tick.tick(), if !closing => {
                    if activity.idle_for(limits.idle) {
                        closing = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            }
        }
    }

    async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<RespBody> {
        let (method, path) = (req.method().clone(), req.uri().path().to_owned());
        let ep = match (&method, path.as_str()) {
            (&Method::POST, "/v1/completions") => Endpoint::Completions,
            (&Method::POST, "/v1/chat/completions") => Endpoint::Chat,
            (&Method::GET, "/v1/models") => {
                return full(
                    200,
                    &json!({"object": "list", "data": [{"id": self.model.name, "object": "model", "owned_by": "baton"}]}),
                );
            }
            (&Method::GET, "/health") => return full(200, &json!({"status": "ok"})),
            (&Method::GET, "/ready") => {
                let ready = self.ready();
                return full(if ready { 200 } else { 503 }, &json!({"ready": ready}));
            }
            (&Method::GET, "/admin/decoders") => return full(200, &admin::decoders(&self).await),
            (&Method::GET, "/admin/plugins") => {
                return full(200, &self.plugins.as_ref().map_or(json!({"plugins": []}), |p| p.view()));
            }
            (&Method::POST, "/admin/plugins/reload") => return admin::reload_plugins(&self).await,
            (&Method::GET, "/metrics") => return admin::metrics(&self),
            _ => return error_response(&GatewayError::NotFound(format!("{method} {path}"))),
        };
        let started = std::time::Instant::now();
        let id = RequestId::from_header(req.headers().get(request_id::HEADER));
        let header_value = header::HeaderValue::from_str(id.as_str()).ok();
        let mut r = request_id::scope(id, async {
            match self.generate(ep, req).await {
                Ok(r) => {
                    tracing::debug!(path, status = r.status().as_u16(), "answered");
                    r
                }
                Err(e) => {
                    if e.origin() == Origin::Client {
                        tracing::debug!(path, status = e.status(), code = e.code(), error = %e, "request refused");
                    } else {
                        tracing::warn!(path, status = e.status(), code = e.code(), error = %e, "request failed");
                    }
                    error_response(&e)
                }
            }
        })
        .await;
        if let Some(v) = header_value {
            r.headers_mut().insert(request_id::HEADER, v);
        }
        self.answered(started, r.status().as_u16());
        r
    }
}

/// Binds the listener (plain HTTP).
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}
