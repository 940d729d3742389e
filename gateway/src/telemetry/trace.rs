//! Traces: one server span per generation request, named and attributed by the OpenTelemetry GenAI
//! semantic conventions, a child span per phase (the same phases as `Server-Timing` and
//! `baton_phase_seconds`), a client span per engine call whose `traceparent` the engine receives,
//! exported as OTLP/HTTP protobuf in batches. The client's `traceparent` is continued.
//!
//! Off (no `[telemetry] otlp_endpoint`), nothing here exists: the request path checks one `Option`.
//!
//! Spans are built with the OpenTelemetry API directly rather than through `tracing` and
//! `tracing-opentelemetry`: the gateway's log subscriber would then build every span of every
//! request whether or not it is traced, and the phases already have exact start and end instants
//! (the [`super::Timing`] marks), which the API takes as they are.
//!
//! The exporter is `opentelemetry-otlp`'s, sending through the gateway's own hyper client (the same
//! TLS roots and name resolution as the engines) on the gateway's runtime; the batch processor runs
//! on a thread of its own, so a slow collector never holds a request.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use futures_util::future::Either;
use http_body_util::{BodyExt, Full};
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{SpanKind, Status, TraceContextExt, Tracer as _, TracerProvider as _};
use opentelemetry::{Context, InstrumentationScope, KeyValue, StringValue};
use opentelemetry_http::{HeaderExtractor, HeaderInjector, HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider,
};

use super::Phase;
use crate::endpoints::{EngineClient, EngineUrl, UrlError};

/// The `service.name` of the spans when none is configured.
pub const DEFAULT_SERVICE_NAME: &str = "baton";
/// Requests traced (of those whose client did not decide) when no ratio is configured.
pub const DEFAULT_SAMPLING_RATIO: f64 = 1.0;
/// Where spans are posted on the collector when its URL has no path (OTLP/HTTP's traces path).
pub const TRACES_PATH: &str = "/v1/traces";
/// Finished spans wait at most this long before they are sent.
pub const EXPORT_DELAY: Duration = Duration::from_millis(1000);
/// Finished spans held for export; past this (a collector down or slower than the traffic) new
/// ones are dropped, never the requests' memory grown.
pub const EXPORT_QUEUE: usize = 16_384;
/// Spans per export request.
pub const EXPORT_BATCH: usize = 2048;
/// One export request's limit.
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// Why an OTLP endpoint is not a collector's URL.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CollectorError {
    /// The scheme, host or port part is not an engine-style URL.
    #[error(transparent)]
    Url(#[from] UrlError),
    /// The path has a query or a fragment, which OTLP/HTTP does not use.
    #[error("{endpoint:?}: no query or fragment")]
    QueryOrFragment { endpoint: String },
}

/// Why tracing could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// The endpoint is not a collector's URL.
    #[error(transparent)]
    Collector(#[from] CollectorError),
    /// Not called on a Tokio runtime, whose client would send the spans.
    #[error("tracing: {source}")]
    NoRuntime {
        #[source]
        source: tokio::runtime::TryCurrentError,
    },
    /// The OTLP exporter refused its settings.
    #[error("OTLP exporter: {source}")]
    Exporter {
        #[source]
        source: opentelemetry_otlp::ExporterBuildError,
    },
}

/// `[telemetry]`'s trace settings.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceConfig {
    /// The collector's OTLP/HTTP endpoint: `http(s)://HOST:PORT`, [`TRACES_PATH`] added, or a full
    /// URL with its path.
    pub endpoint: String,
    /// Of the requests whose client sent no sampled `traceparent`, the share traced (0 to 1).
    pub sampling_ratio: f64,
    pub service_name: String,
}

impl TraceConfig {
    /// The collector's base URL and the path spans are posted to; an error says why the URL is not
    /// one.
    pub fn collector(&self) -> Result<(EngineUrl, String), CollectorError> {
        let rest = self.endpoint.split_once("://").map_or("", |(_, r)| r);
        let (base, path) = match rest.find('/') {
            Some(at) => {
                let cut = self.endpoint.len() - rest.len() + at;
                (self.endpoint.get(..cut).unwrap_or_default(), self.endpoint.get(cut..).unwrap_or_default())
            }
            None => (self.endpoint.as_str(), ""),
        };
        let base = EngineUrl::parse(base)?;
        let path = if path.is_empty() || path == "/" { TRACES_PATH.to_owned() } else { path.to_owned() };
        if path.contains(['?', '#']) {
            return Err(CollectorError::QueryOrFragment { endpoint: self.endpoint.clone() });
        }
        Ok((base, path))
    }

    /// Checks the ratio and the endpoint.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if !(0.0..=1.0).contains(&self.sampling_ratio) {
            return Err(("sampling_ratio", format!("{} is not between 0 and 1", self.sampling_ratio)));
        }
        if self.service_name.is_empty() {
            return Err(("service_name", "must not be empty".into()));
        }
        self.collector().map(|_| ()).map_err(|e| ("otlp_endpoint", e.to_string()))
    }
}

/// The OTLP exporter's HTTP client: the gateway's engine client, called on the gateway's runtime
/// (the batch processor's thread has none).
#[derive(Debug)]
struct Export {
    client: EngineClient,
    to: EngineUrl,
    runtime: tokio::runtime::Handle,
}

#[async_trait::async_trait]
impl HttpClient for Export {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let (client, to) = (self.client.clone(), self.to.clone());
        let call = self.runtime.spawn(async move {
            let send = async {
                let resp = client.send(&to, request.map(Full::new)).await?;
                let (parts, body) = resp.into_parts();
                let body = body.collect().await?.to_bytes();
                Ok::<_, HttpError>(Response::from_parts(parts, body))
            };
            tokio::time::timeout(EXPORT_TIMEOUT, send)
                .await
                .map_err(|_| HttpError::from(format!("no answer within {EXPORT_TIMEOUT:?}")))?
        });
        call.await?
    }
}

/// The gateway's tracer: the exporter's pipeline, started once.
#[derive(Debug)]
pub struct Tracing {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    propagator: TraceContextPropagator,
}

impl Tracing {
    /// Starts the exporter's pipeline; called on the gateway's runtime, whose client sends the spans.
    pub fn start(cfg: &TraceConfig, client: EngineClient) -> Result<Self, TraceError> {
        let (to, path) = cfg.collector()?;
        let runtime =
            tokio::runtime::Handle::try_current().map_err(|source| TraceError::NoRuntime { source })?;
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(Export { client, to: to.clone(), runtime })
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(to.uri(&path))
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|source| TraceError::Exporter { source })?;
        let batch = BatchConfigBuilder::default()
            .with_scheduled_delay(EXPORT_DELAY)
            .with_max_queue_size(EXPORT_QUEUE)
            .with_max_export_batch_size(EXPORT_BATCH)
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(BatchSpanProcessor::builder(exporter).with_batch_config(batch).build())
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(cfg.sampling_ratio))))
            .with_resource(Resource::builder().with_service_name(cfg.service_name.clone()).build())
            .build();
        let scope = InstrumentationScope::builder("baton").with_version(env!("CARGO_PKG_VERSION")).build();
        let tracer = provider.tracer_with_scope(scope);
        Ok(Self { provider, tracer, propagator: TraceContextPropagator::new() })
    }

    /// A generation request's trace from now: its server span, the child of the client's
    /// `traceparent` when it sent one.
    pub fn request(&self, headers: &hyper::HeaderMap, facts: RequestFacts<'_>) -> Arc<RequestTrace> {
        let parent = self.propagator.extract(&HeaderExtractor(headers));
        let (now, wall) = (Instant::now(), SystemTime::now());
        let mut attrs = vec![
            KeyValue::new("gen_ai.operation.name", facts.operation),
            KeyValue::new("gen_ai.request.model", facts.model.to_owned()),
            KeyValue::new("http.request.method", "POST"),
            KeyValue::new("url.path", facts.path),
            KeyValue::new("baton.request_id", facts.request_id.to_owned()),
            KeyValue::new("baton.stream", facts.stream),
        ];
        if let Some(n) = facts.max_tokens {
            attrs.push(KeyValue::new("gen_ai.request.max_tokens", i64::from(n)));
        }
        let span = self
            .tracer
            .span_builder(format!("{} {}", facts.operation, facts.model))
            .with_kind(SpanKind::Server)
            .with_start_time(wall)
            .with_attributes(attrs)
            .start_with_context(&self.tracer, &parent);
        Arc::new(RequestTrace {
            tracer: self.tracer.clone(),
            propagator: self.propagator.clone(),
            server: Context::new().with_span(span),
            anchor: (now, wall),
            state: Mutex::default(),
        })
    }

    /// Sends what is finished and stops the exporter (a drain's end); blocks up to its timeout.
    pub fn shutdown(&self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(error = %e, "traces: the exporter did not stop cleanly");
        }
    }
}

impl Drop for Tracing {
    /// Stopped on a thread of its own: the last spans go out through the runtime this may be
    /// dropped on.
    fn drop(&mut self) {
        let provider = self.provider.clone();
        let _ = std::thread::Builder::new().name("baton-trace-stop".into()).spawn(move || {
            let _ = provider.shutdown();
        });
    }
}

/// What a request's server span is named and attributed by when it starts.
#[derive(Clone, Copy, Debug)]
pub struct RequestFacts<'a> {
    /// `chat` or `text_completion` (GenAI's operation names).
    pub operation: &'static str,
    pub model: &'a str,
    pub path: &'static str,
    pub request_id: &'a str,
    pub stream: bool,
    pub max_tokens: Option<u32>,
}

/// One request's trace: its server span and the phase span open now.
#[derive(Debug)]
pub struct RequestTrace {
    tracer: SdkTracer,
    propagator: TraceContextPropagator,
    server: Context,
    /// The same moment on both clocks: phases are timed by `Instant`, spans stamped in wall time.
    anchor: (Instant, SystemTime),
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// The phase span open now: the engine calls made in it are its children.
    open: Option<(Phase, Context)>,
    /// The stream's span, from the response headers to the body's end: it runs beside the phases
    /// that a handoff streaming before its decode still has to go through.
    stream: Option<Context>,
    /// A `first_token` span was made.
    first_token: bool,
    /// The handoff mode and the decoder, once routed: on every span after.
    routed: Vec<KeyValue>,
    ended: bool,
}

impl RequestTrace {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `at` in wall time; an instant before the request's span started is taken as its start (the
    /// route phase is timed from the request's parsing, a moment before).
    fn wall(&self, at: Instant) -> SystemTime {
        self.anchor.1 + at.saturating_duration_since(self.anchor.0)
    }

    /// Sets attributes on the server span.
    pub fn set(&self, attrs: impl IntoIterator<Item = KeyValue>) {
        self.server.span().set_attributes(attrs);
    }

    /// The request was routed: its mode and decoder go on the server span and every span after.
    pub fn routed(&self, mode: &'static str, decoder: &str, prefill: Option<&str>) {
        // Shared, not copied, by every span after.
        let decoder: Arc<str> = Arc::from(decoder);
        let mut kv = vec![KeyValue::new("baton.mode", mode), KeyValue::new("baton.decoder", decoder)];
        self.set(kv.iter().cloned());
        if let Some(p) = prefill {
            self.set([KeyValue::new("baton.prefill", p.to_owned())]);
        }
        kv.shrink_to_fit();
        self.state().routed = kv;
    }

    fn start(
        &self,
        name: impl Into<std::borrow::Cow<'static, str>>,
        kind: SpanKind,
        at: Instant,
        parent: &Context,
        attrs: Vec<KeyValue>,
    ) -> Context {
        let span = self
            .tracer
            .span_builder(name)
            .with_kind(kind)
            .with_start_time(self.wall(at))
            .with_attributes(attrs)
            .start_with_context(&self.tracer, parent);
        Context::new().with_span(span)
    }

    /// `phase` runs from `at`: its span is open (the engine calls made in it its children) until
    /// [`RequestTrace::mark`]; a span still open ends here.
    pub fn enter(&self, phase: Phase, at: Instant) {
        let mut st = self.state();
        if st.ended {
            return;
        }
        let cx = || self.start(phase.as_str(), SpanKind::Internal, at, &self.server, st.routed.clone());
        if phase == Phase::Stream {
            if st.stream.is_none() {
                st.stream = Some(cx());
            }
            return;
        }
        let cx = cx();
        if let Some((_, before)) = st.open.replace((phase, cx)) {
            before.span().end_with_timestamp(self.wall(at));
        }
    }

    /// `phase` ran from `from` to `to`: its open span ends, or one is made for that time.
    pub fn mark(&self, phase: Phase, from: Instant, to: Instant) {
        let mut st = self.state();
        if st.ended {
            return;
        }
        if phase == Phase::FirstToken {
            st.first_token = true;
        }
        if let Some((_, cx)) = st.open.take_if(|(p, _)| *p == phase) {
            cx.span().end_with_timestamp(self.wall(to));
            return;
        }
        let cx = self.start(phase.as_str(), SpanKind::Internal, from, &self.server, st.routed.clone());
        cx.span().end_with_timestamp(self.wall(to));
    }

    /// `phase` ran beside the others from `from` to `to` (a leg sent concurrently): a span of its
    /// own under the server span, made even after the request's answer ended. SGLang's prefill
    /// answers once its KV has gone to the decoder, which for a short answer can be after the
    /// answer went out whole: its span then ends after the server span (OpenTelemetry allows a
    /// child to), rather than being left out of the trace.
    pub fn beside(&self, phase: Phase, from: Instant, to: Instant) {
        let routed = self.state().routed.clone();
        let cx = self.start(phase.as_str(), SpanKind::Internal, from, &self.server, routed);
        cx.span().end_with_timestamp(self.wall(to));
    }

    /// The first streamed chunk went out at `to`: a `first_token` span from the request's start,
    /// unless the handoff marked that phase itself.
    pub fn first_token(&self, to: Instant) {
        let mut st = self.state();
        if st.ended || std::mem::replace(&mut st.first_token, true) {
            return;
        }
        let cx = self.start(
            Phase::FirstToken.as_str(),
            SpanKind::Internal,
            self.anchor.0,
            &self.server,
            st.routed.clone(),
        );
        cx.span().end_with_timestamp(self.wall(to));
    }

    /// A span beside the phases (a plugin call), under the server span.
    pub fn span(&self, name: &'static str, from: Instant, to: Instant, attrs: Vec<KeyValue>) {
        let cx = self.start(name, SpanKind::Internal, from, &self.server, attrs);
        cx.span().end_with_timestamp(self.wall(to));
    }

    /// An engine call on `leg` starts: its client span, under the open phase span of the same name
    /// (else the server span), whose `traceparent` goes in `headers`.
    pub fn leg(
        &self,
        leg: &'static str,
        to: &EngineUrl,
        path: &str,
        headers: &mut hyper::HeaderMap,
    ) -> LegSpan {
        let st = self.state();
        let parent = match &st.open {
            Some((p, cx)) if p.as_str() == leg => cx,
            _ => &self.server,
        };
        let at = to.host_port();
        let mut attrs = vec![
            KeyValue::new("baton.leg", leg),
            KeyValue::new("server.address", at.host.to_string()),
            KeyValue::new("server.port", i64::from(at.port)),
            KeyValue::new("http.request.method", "POST"),
            KeyValue::new("url.full", to.uri(path)),
        ];
        attrs.extend(st.routed.iter().cloned());
        let name = match leg {
            "prefill" => "POST prefill",
            "decode" => "POST decode",
            "drain" => "POST drain",
            "abort" => "POST abort",
            _ => "POST",
        };
        let cx = self.start(name, SpanKind::Client, Instant::now(), parent, attrs);
        drop(st);
        self.propagator.inject_context(&cx, &mut HeaderInjector(headers));
        LegSpan(cx)
    }

    /// The request ended: the open span (the stream) ends now, the server span with the answer's
    /// status, its usage and finish reasons, or the error it got.
    pub fn finish(&self, end: End<'_>) {
        let mut st = self.state();
        if std::mem::replace(&mut st.ended, true) {
            return;
        }
        let now = SystemTime::now();
        for cx in st.open.take().map(|(_, cx)| cx).into_iter().chain(st.stream.take()) {
            cx.span().end_with_timestamp(now);
        }
        drop(st);
        let span = self.server.span();
        // 0: no response was sent (the client left before its headers).
        if end.status != 0 {
            span.set_attribute(KeyValue::new("http.response.status_code", i64::from(end.status)));
        }
        if let Some(n) = end.output_tokens {
            span.set_attribute(KeyValue::new("gen_ai.usage.output_tokens", i64::from(n)));
        }
        if !end.finish_reasons.is_empty() {
            let reasons: Vec<StringValue> =
                end.finish_reasons.iter().map(|r| StringValue::from(r.clone())).collect();
            span.set_attribute(KeyValue::new(
                "gen_ai.response.finish_reasons",
                opentelemetry::Value::Array(opentelemetry::Array::String(reasons)),
            ));
        }
        if let Some((kind, message)) = end.error {
            span.set_attribute(KeyValue::new("error.type", kind.to_owned()));
            span.set_status(Status::error(message.to_owned()));
        }
        span.end_with_timestamp(now);
    }
}

/// Ends the request's spans as cancelled when dropped armed: the request's future was dropped
/// before it answered (the client left while it was queued, prefilling or waiting for its KV).
/// Disarmed once the response's headers go out; from then on the answer's body ends the trace.
#[derive(Debug)]
pub struct UntilAnswered(Option<Arc<RequestTrace>>);

impl UntilAnswered {
    pub fn new(trace: Option<Arc<RequestTrace>>) -> Self {
        Self(trace)
    }

    pub fn answered(mut self) {
        self.0 = None;
    }
}

impl Drop for UntilAnswered {
    fn drop(&mut self) {
        if let Some(t) = self.0.take() {
            t.finish(End {
                error: Some(("cancelled", "the client left before the response")),
                ..End::default()
            });
        }
    }
}

/// How a request ended, for its server span.
#[derive(Debug, Default)]
pub struct End<'a> {
    /// The response's status; 0 when none was sent.
    pub status: u16,
    pub output_tokens: Option<u32>,
    pub finish_reasons: &'a [String],
    /// The error's type (its code, or `cancelled`, `stream`) and message.
    pub error: Option<(&'a str, &'a str)>,
}

/// An engine call's span, ended with its answer (the response's headers) or its failure.
#[derive(Debug)]
pub struct LegSpan(Context);

impl LegSpan {
    pub fn answered(self, status: u16) {
        let span = self.0.span();
        span.set_attribute(KeyValue::new("http.response.status_code", i64::from(status)));
        if status >= 400 {
            span.set_attribute(KeyValue::new("error.type", status.to_string()));
            span.set_status(Status::error(format!("the engine answered {status}")));
        }
        span.end();
    }

    pub fn failed(self, kind: &'static str, message: &str) {
        let span = self.0.span();
        span.set_attribute(KeyValue::new("error.type", kind));
        span.set_status(Status::error(message.to_owned()));
        span.end();
    }
}

tokio::task_local! {
    static CURRENT: Arc<RequestTrace>;
}

/// The trace of the request this task serves, when it is traced.
pub fn current() -> Option<Arc<RequestTrace>> {
    CURRENT.try_with(Arc::clone).ok()
}

/// Runs `fut` with `trace` as its request's (when there is one). Not an `async fn`: one would hold
/// `fut` twice (its argument and the scope it is moved into), and copy it into each.
pub fn scope<F: Future>(trace: Option<Arc<RequestTrace>>, fut: F) -> impl Future<Output = F::Output> {
    match trace {
        Some(t) => Either::Left(CURRENT.scope(t, fut)),
        None => Either::Right(fut),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(endpoint: &str) -> TraceConfig {
        TraceConfig { endpoint: endpoint.into(), sampling_ratio: 1.0, service_name: "baton".into() }
    }

    #[test]
    fn collector_urls() {
        let at = |e: &str| cfg(e).collector().map(|(u, p)| format!("{u} {p}")).map_err(|e| e.to_string());
        assert_eq!(at("http://127.0.0.1:4318").as_deref(), Ok("http://127.0.0.1:4318 /v1/traces"));
        assert_eq!(at("http://otel:4318/").as_deref(), Ok("http://otel:4318 /v1/traces"));
        assert_eq!(
            at("https://otel.example:443/otlp/v1/traces").as_deref(),
            Ok("https://otel.example:443 /otlp/v1/traces")
        );
        for bad in ["otel:4318", "http://otel", "http://otel:4318/v1/traces?x=1", "ftp://otel:1"] {
            assert!(cfg(bad).check().is_err(), "{bad} accepted");
        }
        let mut c = cfg("http://127.0.0.1:4318");
        c.sampling_ratio = 1.5;
        assert_eq!(c.check().map_err(|e| e.0), Err("sampling_ratio"));
    }
}
