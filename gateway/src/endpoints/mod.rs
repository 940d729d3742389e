//! The engines as the gateway reaches them: addresses by IP or DNS name (`http://decode-0.pd:8000`,
//! `decode-0.pd:9000`), names resolved by a maintained resolver (hickory) and kept fresh, `https://`
//! with a configurable CA, and the HTTP client every engine call goes through.
//!
//! A name is looked up when it is first used and then every [`DEFAULT_REFRESH`] (`[resolver]
//! refresh_ms`), and at once after a connection to it failed. A name with several addresses spreads
//! new connections over them (each lookup result is tried starting one further along); an address
//! that leaves the answer gets no new connection, and a kept-alive connection to it is not used
//! again ([`pool`]). An IP literal is never looked up.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use baton_dataplane::transport::{TlsError, pem_certs, pem_key};
use bytes::Bytes;
use hickory_resolver::TokioResolver;
use hickory_resolver::config::{NameServerConfig, NameServerConfigGroup, ResolverConfig};
use hickory_resolver::name_server::TokioConnectionProvider;
use hickory_resolver::proto::xfer::Protocol;
use http_body_util::Full;
use hyper::{Request, Response};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::dns::Name;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use rustls::RootCertStore;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// How often a name is looked up again while nothing failed.
pub const DEFAULT_REFRESH: Duration = Duration::from_secs(5);
/// The shortest time between two lookups of one name that failures asked for: a dead engine that
/// every request tries does not turn into a lookup per request.
const FAILURE_LOOKUP_SPACING: Duration = Duration::from_millis(200);
/// How long one lookup may take (per attempt; two attempts).
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);

/// A host as configured: an IP literal or a DNS name.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Host {
    Ip(IpAddr),
    Name(String),
}

impl Host {
    /// An IP on loopback, or `localhost`: reachable from this machine only.
    pub fn is_loopback(&self) -> bool {
        match self {
            Self::Ip(ip) => ip.is_loopback(),
            Self::Name(n) => n.eq_ignore_ascii_case("localhost"),
        }
    }
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ip(IpAddr::V6(ip)) => write!(f, "[{ip}]"),
            Self::Ip(ip) => write!(f, "{ip}"),
            Self::Name(n) => f.write_str(n),
        }
    }
}

/// `host:port` with the host an IP (`10.0.0.5:9000`, `[::1]:9000`) or a DNS name
/// (`decode-0.pd.svc.cluster.local:9000`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HostPort {
    pub host: Host,
    pub port: u16,
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

impl From<SocketAddr> for HostPort {
    fn from(a: SocketAddr) -> Self {
        Self { host: Host::Ip(a.ip()), port: a.port() }
    }
}

/// Why a `host:port` does not parse. Each message starts with the text as given.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HostPortError {
    /// No `:` separates a port.
    #[error("{input:?} must be HOST:PORT")]
    NoPort { input: String },
    /// What follows the last `:` is not a number from 0 to 65535.
    #[error("{input:?}: {port:?} is not a port")]
    BadPort {
        input: String,
        port: String,
        #[source]
        source: std::num::ParseIntError,
    },
    /// Port 0, which no engine listens on.
    #[error("{input:?}: the port must not be 0")]
    ZeroPort { input: String },
    /// An IPv6 address without the brackets that set it apart from the port.
    #[error("{input:?}: an IPv6 address is written [ADDR]:PORT")]
    BareIpv6 { input: String },
    /// The host is neither an IP nor a DNS name.
    #[error("{input:?}: {source}")]
    Name {
        input: String,
        #[source]
        source: NameError,
    },
}

/// Why a host is not a DNS name (RFC 1123).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NameError {
    /// Empty, or longer than 253 characters (a trailing dot not counted).
    #[error("a host name has 1 to 253 characters")]
    Length,
    /// A label is empty, longer than 63 bytes, or has a character other than a letter, a digit or
    /// an inner hyphen.
    #[error("{label:?} is not a DNS label (letters, digits, inner hyphens)")]
    Label { label: String },
}

impl std::str::FromStr for HostPort {
    type Err = HostPortError;

    fn from_str(s: &str) -> Result<Self, HostPortError> {
        if let Ok(a) = s.parse::<SocketAddr>() {
            return Ok(a.into());
        }
        let input = || s.to_owned();
        let (host, port) = s.rsplit_once(':').ok_or_else(|| HostPortError::NoPort { input: input() })?;
        let port: u16 = port.parse().map_err(|source| HostPortError::BadPort {
            input: input(),
            port: port.to_owned(),
            source,
        })?;
        if port == 0 {
            return Err(HostPortError::ZeroPort { input: input() });
        }
        if host.starts_with('[') || host.parse::<IpAddr>().is_ok() {
            return Err(HostPortError::BareIpv6 { input: input() });
        }
        check_name(host).map_err(|source| HostPortError::Name { input: input(), source })?;
        Ok(Self { host: Host::Name(host.to_ascii_lowercase()), port })
    }
}

impl<'de> serde::Deserialize<'de> for HostPort {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A DNS name by RFC 1123: labels of letters, digits and hyphens (not first or last), 63 bytes at
/// most, 253 in all; a trailing dot (fully qualified) is allowed.
fn check_name(name: &str) -> Result<(), NameError> {
    let bare = name.strip_suffix('.').unwrap_or(name);
    if bare.is_empty() || bare.len() > 253 {
        return Err(NameError::Length);
    }
    for label in bare.split('.') {
        let ok = !label.is_empty()
            && label.len() <= 63
            && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !label.starts_with('-')
            && !label.ends_with('-');
        if !ok {
            return Err(NameError::Label { label: label.to_owned() });
        }
    }
    Ok(())
}

/// `http` or `https`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scheme {
    Http,
    Https,
}

/// Why an engine URL does not parse. Each message starts with the URL as given.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UrlError {
    /// Neither `http://` nor `https://`.
    #[error("{url:?} must start with http:// or https://")]
    Scheme { url: String },
    /// A path, query, fragment or user after the scheme.
    #[error("{url:?} must be SCHEME://HOST:PORT, without a path, query or user")]
    NotBare { url: String },
    /// The `host:port` after the scheme does not parse.
    #[error("{url:?}: {source}")]
    HostPort {
        url: String,
        #[source]
        source: HostPortError,
    },
}

/// An engine's HTTP base: `http://host:port` or `https://host:port`. Cheap to clone.
#[derive(Clone, PartialEq, Eq)]
pub struct EngineUrl(Arc<EngineUrlInner>);

/// By `base` alone: the rest is made from it (equal URLs have equal bases). Derived, the hash took
/// in `http`'s `Scheme` and `Authority`, whose own hashes feed the hasher a byte at a time: some
/// 1,400 instructions a request in `sglang`, whose learned bootstrap ports are kept by URL
/// (`scripts/count-instructions sglang`'s profile).
impl std::hash::Hash for EngineUrl {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.base.hash(state);
    }
}

#[derive(PartialEq, Eq)]
struct EngineUrlInner {
    scheme: Scheme,
    at: HostPort,
    /// `scheme://host:port`, the prefix of every URI to it.
    base: String,
    /// What every call's URI and `Host` header are made of, built once: a call's URI shares
    /// them ([`EngineUrl::call_uri`]) instead of formatting and parsing `base` + path, and its
    /// `Host` is a clone instead of formatted (two allocations a call each). `None` only if `http`
    /// refused them, which a parsed [`HostPort`] never gives; calls then format both.
    parts: Option<UriParts>,
}

#[derive(PartialEq, Eq)]
struct UriParts {
    scheme: hyper::http::uri::Scheme,
    authority: hyper::http::uri::Authority,
    /// `host:port`, or `host` alone on the scheme's default port ([`host_text`]).
    host: hyper::header::HeaderValue,
}

impl UriParts {
    fn new(scheme: Scheme, at: &HostPort) -> Option<Self> {
        let uri_scheme = match scheme {
            Scheme::Http => hyper::http::uri::Scheme::HTTP,
            Scheme::Https => hyper::http::uri::Scheme::HTTPS,
        };
        let authority = hyper::http::uri::Authority::from_maybe_shared(Bytes::from(at.to_string())).ok()?;
        let host = hyper::header::HeaderValue::from_maybe_shared(Bytes::from(host_text(scheme, at))).ok()?;
        // Shared now: a `Bytes` made from a `String` allocates its shared form on its first clone,
        // which would otherwise be the first call's.
        drop((authority.clone(), host.clone()));
        Some(Self { scheme: uri_scheme, authority, host })
    }
}

/// A `Host` header's text: `host:port`, or `host` alone on the scheme's default port (as HTTP
/// clients write it).
fn host_text(scheme: Scheme, at: &HostPort) -> String {
    let default_port = match scheme {
        Scheme::Http => 80,
        Scheme::Https => 443,
    };
    if at.port == default_port { at.host.to_string() } else { at.to_string() }
}

impl fmt::Debug for EngineUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.base)
    }
}

impl fmt::Display for EngineUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.base)
    }
}

impl From<SocketAddr> for EngineUrl {
    fn from(a: SocketAddr) -> Self {
        Self::new(Scheme::Http, a.into())
    }
}

impl EngineUrl {
    pub fn new(scheme: Scheme, at: HostPort) -> Self {
        let s = match scheme {
            Scheme::Http => "http",
            Scheme::Https => "https",
        };
        let base = format!("{s}://{at}");
        let parts = UriParts::new(scheme, &at);
        Self(Arc::new(EngineUrlInner { scheme, at, base, parts }))
    }

    /// `http://HOST:PORT` or `https://HOST:PORT` (a trailing `/` allowed; no path, user or query).
    pub fn parse(url: &str) -> Result<Self, UrlError> {
        let (scheme, rest) = if let Some(r) = url.strip_prefix("http://") {
            (Scheme::Http, r)
        } else if let Some(r) = url.strip_prefix("https://") {
            (Scheme::Https, r)
        } else {
            return Err(UrlError::Scheme { url: url.to_owned() });
        };
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        if rest.contains(['/', '?', '#', '@']) {
            return Err(UrlError::NotBare { url: url.to_owned() });
        }
        let at =
            rest.parse::<HostPort>().map_err(|source| UrlError::HostPort { url: url.to_owned(), source })?;
        Ok(Self::new(scheme, at))
    }

    pub fn scheme(&self) -> Scheme {
        self.0.scheme
    }

    pub fn host_port(&self) -> &HostPort {
        &self.0.at
    }

    /// The host as written (a name, or an IP with IPv6 in brackets): `base` between the scheme and
    /// the port (formatting the host again, an IP above all, was some 1,400 instructions).
    pub fn host(&self) -> &str {
        let base = &self.0.base;
        let start = match self.0.scheme {
            Scheme::Http => "http://".len(),
            Scheme::Https => "https://".len(),
        };
        // The port comes last, after the host's last `:` (an IPv6 host's are inside brackets).
        let end = base.rfind(':').unwrap_or(base.len());
        base.get(start..end).unwrap_or_default()
    }

    /// The URI of `path` (which starts with `/`) on this engine.
    pub fn uri(&self, path: &str) -> String {
        format!("{}{path}", self.0.base)
    }

    /// The URI of `path` (which starts with `/`) on this engine, for a call: made of parts built
    /// once ([`EngineUrl::uri`] formats and parses a new string).
    pub fn call_uri(&self, path: &'static str) -> Result<hyper::Uri, hyper::http::Error> {
        let Some(p) = &self.0.parts else {
            return Ok(hyper::Uri::try_from(self.uri(path))?);
        };
        let mut uri = hyper::http::uri::Parts::default();
        uri.scheme = Some(p.scheme.clone());
        uri.authority = Some(p.authority.clone());
        uri.path_and_query =
            Some(hyper::http::uri::PathAndQuery::from_maybe_shared(Bytes::from_static(path.as_bytes()))?);
        Ok(hyper::Uri::from_parts(uri)?)
    }

    /// The `Host` header of a call to this engine, built once.
    pub fn host_header(&self) -> Option<&hyper::header::HeaderValue> {
        self.0.parts.as_ref().map(|p| &p.host)
    }

    /// The `Host` header of a call to this engine: [`Self::host_header`]'s, or formatted alike.
    fn host_value(&self) -> Option<hyper::header::HeaderValue> {
        match self.host_header() {
            Some(h) => Some(h.clone()),
            None => hyper::header::HeaderValue::try_from(host_text(self.0.scheme, &self.0.at)).ok(),
        }
    }

    /// The address, when the host is an IP literal.
    pub fn socket_addr(&self) -> Option<SocketAddr> {
        match self.0.at.host {
            Host::Ip(ip) => Some(SocketAddr::new(ip, self.0.at.port)),
            Host::Name(_) => None,
        }
    }
}

/// `[resolver]`: whom to ask and how often.
#[derive(Clone, Debug)]
pub struct ResolverSettings {
    /// DNS servers (`IP:PORT`, UDP with TCP fallback); empty: the system's (`/etc/resolv.conf`).
    pub nameservers: Vec<SocketAddr>,
    /// How often a name in use is looked up again.
    pub refresh: Duration,
}

impl Default for ResolverSettings {
    fn default() -> Self {
        Self { nameservers: Vec::new(), refresh: DEFAULT_REFRESH }
    }
}

/// A lookup that found no address, or could not ask.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{name}: {reason}")]
pub struct LookupError {
    pub name: String,
    pub reason: String,
    /// The DNS answered that the name has no address (not a transport failure).
    pub no_address: bool,
}

/// Why no resolver could be built (kept: every later lookup fails the same way).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ResolverError {
    /// No `[resolver] nameservers`, and the system's settings could not be read.
    #[error("the system's DNS settings (/etc/resolv.conf): {source}")]
    SystemConfig {
        #[source]
        source: hickory_resolver::ResolveError,
    },
}

/// The names in use and their addresses, kept fresh. Cheap to clone; the refresh tasks end when the
/// last clone is dropped.
#[derive(Clone)]
pub struct Names(Arc<NamesInner>);

struct NamesInner {
    settings: ResolverSettings,
    /// Built on the first name: a gateway configured by IPs never reads the system's DNS settings.
    resolver: OnceLock<Result<TokioResolver, ResolverError>>,
    /// Read on every request to a named engine (is the connection's address current?), written
    /// when a name is first used.
    table: RwLock<HashMap<String, Arc<Entry>>>,
    /// Counts the moves of every name: health checks run at once after one.
    moves: tokio::sync::watch::Sender<u64>,
}

/// One name's current addresses.
struct Entry {
    addrs: RwLock<Arc<[IpAddr]>>,
    /// Where the next connection's list starts.
    next: AtomicUsize,
    /// A connection failed: look the name up now.
    wake: tokio::sync::Notify,
    last_lookup: Mutex<Instant>,
    lookups: std::sync::atomic::AtomicU64,
    lookup_failures: std::sync::atomic::AtomicU64,
    /// Counts this name's moves (its address set changed).
    generation: std::sync::atomic::AtomicU64,
}

impl fmt::Debug for Names {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = self.0.table.read().unwrap_or_else(|e| e.into_inner());
        f.debug_struct("Names").field("settings", &self.0.settings).field("names", &t.len()).finish()
    }
}

impl Default for Names {
    fn default() -> Self {
        Self::new(ResolverSettings::default())
    }
}

impl Names {
    pub fn new(settings: ResolverSettings) -> Self {
        let (moves, _) = tokio::sync::watch::channel(0);
        Self(Arc::new(NamesInner { settings, resolver: OnceLock::new(), table: RwLock::default(), moves }))
    }

    pub fn settings(&self) -> &ResolverSettings {
        &self.0.settings
    }

    fn resolver(&self) -> Result<&TokioResolver, &ResolverError> {
        self.0
            .resolver
            .get_or_init(|| {
                let mut builder = if self.0.settings.nameservers.is_empty() {
                    TokioResolver::builder_tokio().map_err(|source| ResolverError::SystemConfig { source })?
                } else {
                    let mut group = NameServerConfigGroup::new();
                    for &ns in &self.0.settings.nameservers {
                        group.push(NameServerConfig::new(ns, Protocol::Udp));
                        group.push(NameServerConfig::new(ns, Protocol::Tcp));
                    }
                    TokioResolver::builder_with_config(
                        ResolverConfig::from_parts(None, vec![], group),
                        TokioConnectionProvider::default(),
                    )
                };
                // The system's own options (ndots, search domains) stay. Answers are cached no
                // longer than the refresh: a moved record is seen on the next refresh whatever
                // its TTL says.
                let o = builder.options_mut();
                o.positive_max_ttl = Some(self.0.settings.refresh);
                o.negative_max_ttl = Some(self.0.settings.refresh);
                o.timeout = LOOKUP_TIMEOUT;
                o.attempts = 2;
                Ok(builder.build())
            })
            .as_ref()
    }

    /// Asks the DNS now (no table, no refresh): `check-config` and the refresh tasks.
    pub async fn lookup(&self, name: &str) -> Result<Vec<IpAddr>, LookupError> {
        let fail =
            |reason: String, no_address: bool| LookupError { name: name.to_owned(), reason, no_address };
        let resolver = self.resolver().map_err(|r| fail(r.to_string(), false))?;
        match resolver.lookup_ip(name).await {
            Ok(found) => {
                let mut ips: Vec<IpAddr> = found.iter().collect();
                ips.sort_unstable();
                ips.dedup();
                if ips.is_empty() { Err(fail("no address".into(), true)) } else { Ok(ips) }
            }
            Err(e) => {
                let none = e.is_no_records_found() || e.is_nx_domain();
                Err(fail(if none { "no address".into() } else { e.to_string() }, none))
            }
        }
    }

    /// The name's entry, looked up and watched from the first call on (also when that first
    /// lookup found nothing: the refresh keeps asking).
    async fn entry(&self, name: &str) -> Arc<Entry> {
        let existing = self.0.table.read().unwrap_or_else(|e| e.into_inner()).get(name).cloned();
        if let Some(e) = existing {
            return e;
        }
        let first = self.lookup(name).await;
        let mut table = self.0.table.write().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = table.get(name) {
            return Arc::clone(e);
        }
        let entry = Arc::new(Entry {
            addrs: RwLock::new(first.as_deref().unwrap_or_default().into()),
            next: AtomicUsize::new(0),
            wake: tokio::sync::Notify::new(),
            last_lookup: Mutex::new(Instant::now()),
            lookups: 1.into(),
            lookup_failures: u64::from(first.is_err()).into(),
            generation: 0.into(),
        });
        table.insert(name.to_owned(), Arc::clone(&entry));
        drop(table);
        tokio::spawn(refresh(Arc::downgrade(&self.0), name.to_owned(), Arc::downgrade(&entry)));
        match first {
            Ok(ips) => tracing::info!(name, addrs = ?ips, "resolved"),
            Err(e) => {
                tracing::warn!(name, error = %e.reason, "no address yet; looking it up again every refresh")
            }
        }
        entry
    }

    /// The name's addresses, the list starting one further along at each call (connections
    /// spread). None now: an error, and a lookup soon (spaced by [`FAILURE_LOOKUP_SPACING`]).
    pub async fn addrs(&self, name: &str) -> Result<Vec<IpAddr>, LookupError> {
        let entry = self.entry(name).await;
        let now = entry.current();
        if now.is_empty() {
            entry.wake.notify_one();
            return Err(LookupError { name: name.to_owned(), reason: "no address".into(), no_address: true });
        }
        let start = entry.next.fetch_add(1, Ordering::Relaxed) % now.len();
        Ok(now.iter().cycle().skip(start).take(now.len()).copied().collect())
    }

    /// `at`'s socket addresses: the IP, or the name's current addresses.
    pub async fn socket_addrs(&self, at: &HostPort) -> Result<Vec<SocketAddr>, LookupError> {
        match &at.host {
            Host::Ip(ip) => Ok(vec![SocketAddr::new(*ip, at.port)]),
            Host::Name(n) => {
                Ok(self.addrs(n).await?.into_iter().map(|ip| SocketAddr::new(ip, at.port)).collect())
            }
        }
    }

    /// A connection to `name` failed: look it up again now (at most every
    /// [`FAILURE_LOOKUP_SPACING`]).
    pub fn failed(&self, name: &str) {
        if let Some(e) = self.0.table.read().unwrap_or_else(|e| e.into_inner()).get(name) {
            e.wake.notify_one();
        }
    }

    /// `ip` is among `name`'s addresses now (true for a name not watched).
    pub fn current(&self, name: &str, ip: IpAddr) -> bool {
        match self.0.table.read().unwrap_or_else(|e| e.into_inner()).get(name) {
            Some(e) => e.addrs.read().unwrap_or_else(|e| e.into_inner()).contains(&ip),
            None => true,
        }
    }

    /// Changes when any name moves (its addresses changed); ends when the names are dropped.
    pub fn moves(&self) -> tokio::sync::watch::Receiver<u64> {
        self.0.moves.subscribe()
    }

    /// How many times `name` has moved (0 for a name not watched).
    pub fn generation(&self, name: &str) -> u64 {
        self.0
            .table
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .map_or(0, |e| e.generation.load(Ordering::Relaxed))
    }

    /// Every watched name: its addresses and lookup counts (`/admin/names`, metrics).
    pub fn snapshot(&self) -> Vec<(String, Vec<IpAddr>, u64, u64)> {
        let t = self.0.table.read().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<_> = t
            .iter()
            .map(|(n, e)| {
                (
                    n.clone(),
                    e.current().to_vec(),
                    e.lookups.load(Ordering::Relaxed),
                    e.lookup_failures.load(Ordering::Relaxed),
                )
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

impl Entry {
    fn current(&self) -> Arc<[IpAddr]> {
        Arc::clone(&self.addrs.read().unwrap_or_else(|e| e.into_inner()))
    }

    fn set(&self, ips: &[IpAddr]) {
        *self.addrs.write().unwrap_or_else(|e| e.into_inner()) = ips.into();
        self.generation.fetch_add(1, Ordering::Relaxed);
    }
}

/// Looks `name` up every refresh, and soon after a failure asked for it, until the table or the
/// entry is gone. A transport failure keeps the last addresses; an answer of no address drops them.
async fn refresh(names: Weak<NamesInner>, name: String, entry: Weak<Entry>) {
    loop {
        let (period, wake_entry) = {
            let (Some(n), Some(e)) = (names.upgrade(), entry.upgrade()) else { return };
            (n.settings.refresh, e)
        };
        tokio::select! {
            () = tokio::time::sleep(period) => {}
            () = wake_entry.wake.notified() => {
                let last = *wake_entry.last_lookup.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(wait) = FAILURE_LOOKUP_SPACING.checked_sub(last.elapsed()) {
                    tokio::time::sleep(wait).await;
                }
            }
        }
        drop(wake_entry);
        let (Some(n), Some(e)) = (names.upgrade(), entry.upgrade()) else { return };
        let names = Names(n);
        let found = names.lookup(&name).await;
        let moved = e.generation.load(Ordering::Relaxed);
        *e.last_lookup.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        e.lookups.fetch_add(1, Ordering::Relaxed);
        match found {
            Ok(ips) => {
                if *e.current() != *ips {
                    tracing::info!(name, was = ?e.current(), now = ?ips, "name moved");
                    e.set(&ips);
                }
            }
            Err(err) if err.no_address => {
                e.lookup_failures.fetch_add(1, Ordering::Relaxed);
                if !e.current().is_empty() {
                    tracing::warn!(name, was = ?e.current(), "name has no address now");
                    e.set(&[]);
                }
            }
            Err(err) => {
                e.lookup_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(name, error = %err.reason, "lookup failed; keeping the last addresses");
            }
        }
        if e.generation.load(Ordering::Relaxed) != moved {
            names.0.moves.send_modify(|n| *n += 1);
        }
    }
}

/// hyper's connector asks this for a name's addresses.
impl tower_service::Service<Name> for Names {
    type Response = std::vec::IntoIter<SocketAddr>;
    type Error = LookupError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, LookupError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), LookupError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, name: Name) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            // The connector sets each address's port from the URI.
            let ips = this.addrs(name.as_str()).await?;
            Ok(ips.into_iter().map(|ip| SocketAddr::new(ip, 0)).collect::<Vec<_>>().into_iter())
        })
    }
}

/// Why `[engine_tls]` could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineTlsError {
    /// A PEM file (the CA, the client certificate or its key) could not be read or holds nothing
    /// usable.
    #[error(transparent)]
    Pem(#[from] TlsError),
    /// A certificate of the CA file is not a usable trust anchor.
    #[error("{path}: {source}")]
    Ca {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    /// No CA was named, and the system has no root certificates.
    #[error("no CA given and no system root certificates found")]
    NoSystemRoots,
    /// rustls refused the protocol versions (never with the ring provider, which has both).
    #[error("{source}")]
    Versions {
        #[source]
        source: rustls::Error,
    },
    /// The client certificate and key do not make an identity (an unsupported key, or a key that
    /// does not match the certificate).
    #[error("{source}")]
    ClientCert {
        #[source]
        source: rustls::Error,
    },
}

/// `[engine_tls]`: how `https://` engines are verified, and the gateway's certificate when they
/// ask for one (mTLS).
#[derive(Clone)]
pub struct EngineTls(Arc<rustls::ClientConfig>, Option<EngineTlsFiles>);

/// The files `[engine_tls]` was read from: read again when they change ([`EngineClient::reload`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineTlsFiles {
    pub ca: Option<PathBuf>,
    pub client: Option<(PathBuf, PathBuf)>,
}

impl EngineTlsFiles {
    fn paths(&self) -> impl Iterator<Item = &Path> {
        let client = self.client.as_ref().map(|(c, k)| [c.as_path(), k.as_path()]);
        self.ca.as_deref().into_iter().chain(client.into_iter().flatten())
    }

    fn load(&self) -> Result<EngineTls, EngineTlsError> {
        EngineTls::from_pem_files(
            self.ca.as_deref(),
            self.client.as_ref().map(|(c, k)| (c.as_path(), k.as_path())),
        )
    }
}

/// `[dataplane_tls]` (or a pool's `[decode.dataplane_tls]`) as read from its files: the client
/// that native decoders' rank links share ([`baton_dataplane::transport::TlsClient`] clones share
/// one configuration), replaced in place when the files change. New data-plane connections (a
/// pool that grows, a reconnect) use the new certificates; open ones keep theirs.
#[derive(Clone, Debug)]
pub struct DataplaneCerts {
    pub client: baton_dataplane::transport::TlsClient,
    files: Arc<DataplaneFiles>,
}

#[derive(Debug)]
struct DataplaneFiles {
    /// What `/metrics` calls it: `dataplane`, or `dataplane:decode[N]` for a pool's own.
    name: String,
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
    server_name: String,
    watch: CertFiles,
}

impl DataplaneFiles {
    fn load(&self) -> Result<baton_dataplane::transport::TlsClient, TlsError> {
        baton_dataplane::transport::TlsClient::from_pem_files(
            &self.ca,
            &self.server_name,
            Some((&self.cert, &self.key)),
        )
    }
}

impl DataplaneCerts {
    /// Reads the files (the CA the ranks' certificates chain to, the gateway's certificate and
    /// key) and starts watching them.
    pub fn load(
        name: String,
        ca: PathBuf,
        cert: PathBuf,
        key: PathBuf,
        server_name: String,
    ) -> Result<Self, TlsError> {
        let watch = CertFiles::new([ca.as_path(), cert.as_path(), key.as_path()].into_iter());
        let files = DataplaneFiles { name, ca, cert, key, server_name, watch };
        Ok(Self { client: files.load()?, files: Arc::new(files) })
    }

    pub fn name(&self) -> &str {
        &self.files.name
    }

    /// Whether `other` is this one (a pool without its own shares the global one).
    pub fn same(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.files, &other.files)
    }

    /// Reads the files again when any changed since last read (always with `force`: SIGHUP):
    /// `Some(Ok(()))` when new connections now use them, `None` when nothing changed. A set that
    /// does not load is refused and the one in force stays.
    pub fn reload(&self, force: bool) -> Option<Result<(), TlsError>> {
        Some(self.files.watch.reload(force, || self.files.load())?.map(|new| self.client.replace(&new)))
    }

    pub fn counts(&self) -> Arc<TlsReloads> {
        Arc::clone(&self.files.watch.counts)
    }
}

/// Certificate files read again when they change (the listeners', `[engine_tls]`'s and
/// `[dataplane_tls]`'s), and what their reloads did.
#[derive(Debug)]
pub struct CertFiles {
    paths: Vec<PathBuf>,
    /// Each file's modification time and size when last read.
    seen: Mutex<Vec<Option<(std::time::SystemTime, u64)>>>,
    pub counts: Arc<TlsReloads>,
}

/// Reloads of one set of certificate files: swapped for new connections, or refused (the
/// certificates in force stay). Read by `/metrics`.
#[derive(Debug, Default)]
pub struct TlsReloads {
    pub swapped: std::sync::atomic::AtomicU64,
    pub refused: std::sync::atomic::AtomicU64,
}

impl CertFiles {
    /// Watches `paths`, as they are now (just read).
    pub fn new<'a>(paths: impl Iterator<Item = &'a Path>) -> Self {
        let paths: Vec<PathBuf> = paths.map(Path::to_owned).collect();
        Self { seen: Mutex::new(Self::stamps(&paths)), paths, counts: Arc::default() }
    }

    fn stamps(paths: &[PathBuf]) -> Vec<Option<(std::time::SystemTime, u64)>> {
        paths
            .iter()
            .map(|p| {
                let m = std::fs::metadata(p).ok()?;
                Some((m.modified().ok()?, m.len()))
            })
            .collect()
    }

    /// Runs `load` when a file changed since it was last read (always with `force`: SIGHUP), and
    /// counts what it did; `None` when nothing changed. A set refused is tried again at its next
    /// change, not on every check.
    pub fn reload<T, E>(&self, force: bool, load: impl FnOnce() -> Result<T, E>) -> Option<Result<T, E>> {
        let now = Self::stamps(&self.paths);
        {
            let mut seen = self.seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if !force && *seen == now {
                return None;
            }
            *seen = now;
        }
        let r = load();
        let counter = if r.is_ok() { &self.counts.swapped } else { &self.counts.refused };
        counter.fetch_add(1, Ordering::Relaxed);
        Some(r)
    }
}

impl fmt::Debug for EngineTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("EngineTls")
    }
}

impl EngineTls {
    /// Trusts `ca` (PEM), or the system's roots without one; presents `client` (certificate chain
    /// and key, PEM) when given.
    pub fn from_pem_files(ca: Option<&Path>, client: Option<(&Path, &Path)>) -> Result<Self, EngineTlsError> {
        let mut roots = RootCertStore::empty();
        match ca {
            Some(p) => {
                for c in pem_certs(p)? {
                    roots.add(c).map_err(|source| EngineTlsError::Ca { path: p.to_owned(), source })?;
                }
            }
            None => {
                let found = rustls_native_certs::load_native_certs();
                let (added, _) = roots.add_parsable_certificates(found.certs);
                if added == 0 {
                    return Err(EngineTlsError::NoSystemRoots);
                }
            }
        }
        let files = EngineTlsFiles {
            ca: ca.map(Path::to_owned),
            client: client.map(|(c, k)| (c.to_owned(), k.to_owned())),
        };
        let client = match client {
            Some((cert, key)) => Some((pem_certs(cert)?, pem_key(key)?)),
            None => None,
        };
        Ok(Self(Self::build(roots, client)?.0, Some(files)))
    }

    fn build(
        roots: RootCertStore,
        client: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
    ) -> Result<Self, EngineTlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(|source| EngineTlsError::Versions { source })?
            .with_root_certificates(roots);
        // No ALPN here: the connector offers HTTP/1.1, which the engines' servers (uvicorn,
        // SGLang's) speak.
        let config = match client {
            Some((chain, key)) => builder
                .with_client_auth_cert(chain, key)
                .map_err(|source| EngineTlsError::ClientCert { source })?,
            None => builder.with_no_client_auth(),
        };
        Ok(Self(Arc::new(config), None))
    }

    /// The system's roots (read once per process), or none: an `https://` engine then fails its
    /// handshake, and `check-config` has said why before that.
    fn system() -> rustls::ClientConfig {
        static SYSTEM: OnceLock<rustls::ClientConfig> = OnceLock::new();
        SYSTEM
            .get_or_init(|| {
                let t =
                    Self::from_pem_files(None, None).or_else(|_| Self::build(RootCertStore::empty(), None));
                t.map_or_else(
                    |_| {
                        rustls::ClientConfig::builder()
                            .with_root_certificates(RootCertStore::empty())
                            .with_no_client_auth()
                    },
                    |t| (*t.0).clone(),
                )
            })
            .clone()
    }
}

mod pool;

pub use pool::{EngineBody, SendError};

type Connector = HttpsConnector<TcpConnector>;

/// hyper-util's [`HttpConnector`] (names looked up by [`Names`]), whose connections to a named
/// engine remember the address they reached: [`pool::Pool`] checks it against the name's current
/// addresses before it uses the connection again.
#[derive(Clone, Debug)]
struct TcpConnector(HttpConnector<Names>);

type ConnectError = <HttpConnector<Names> as tower_service::Service<hyper::Uri>>::Error;

impl tower_service::Service<hyper::Uri> for TcpConnector {
    type Response = TokioIo<TcpConn>;
    type Error = ConnectError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, ConnectError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ConnectError>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, to: hyper::Uri) -> Self::Future {
        let named = named(&to);
        let connecting = self.0.call(to);
        Box::pin(async move {
            let tcp = connecting.await?.into_inner();
            let remote = if named { tcp.peer_addr().ok().map(|a| a.ip()) } else { None };
            Ok(TokioIo::new(TcpConn { tcp, remote }))
        })
    }
}

/// Whether `to`'s host is a name, not an IP literal (`Uri::host` keeps an IPv6 literal's brackets).
fn named(to: &hyper::Uri) -> bool {
    to.host().is_some_and(|h| !h.starts_with('[') && h.parse::<IpAddr>().is_err())
}

/// A connection to an engine; see [`TcpConnector`].
#[derive(Debug)]
struct TcpConn {
    tcp: tokio::net::TcpStream,
    /// The address reached, when the engine is named (not an IP literal).
    remote: Option<IpAddr>,
}

/// What hyper-rustls's connector asks of the connection it wraps; nothing here reads it.
impl Connection for TcpConn {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

impl tokio::io::AsyncRead for TcpConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for TcpConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

/// The gateway's client to the engines: names resolved by [`Names`], `https://` by [`EngineTls`]
/// (the system's roots when none is configured), connections kept alive.
#[derive(Clone, Debug)]
pub struct EngineClient {
    /// Swapped whole when `[engine_tls]`'s files change: new requests get a pool of connections
    /// made with the new certificates; requests under way keep theirs.
    http: Arc<RwLock<pool::Pool>>,
    names: Names,
    /// An idle connection is not used again after this long ([`crate::handoff::DEFAULT_ENGINE_IDLE`]).
    idle: Duration,
    /// `[engine_tls]`'s files, watched.
    tls: Option<Arc<(EngineTlsFiles, CertFiles)>>,
}

impl EngineClient {
    pub fn new(names: Names, tls: Option<EngineTls>, idle: Duration) -> Self {
        let reloading = tls.as_ref().and_then(|t| t.1.clone()).map(|files| {
            let watch = CertFiles::new(files.paths());
            Arc::new((files, watch))
        });
        // No [engine_tls]: the system's roots.
        let config = tls.map_or_else(EngineTls::system, |t| (*t.0).clone());
        Self { http: Arc::new(RwLock::new(Self::pool(&names, config, idle))), names, idle, tls: reloading }
    }

    fn pool(names: &Names, config: rustls::ClientConfig, idle: Duration) -> pool::Pool {
        let mut connector = HttpConnector::new_with_resolver(names.clone());
        connector.set_nodelay(true);
        // https:// URIs need the TLS layer to see them.
        connector.enforce_http(false);
        let connector = HttpsConnectorBuilder::new()
            .with_tls_config(config)
            .https_or_http()
            .enable_http1()
            .wrap_connector(TcpConnector(connector));
        pool::Pool::new(connector, idle)
    }

    /// Reads `[engine_tls]`'s files again when any changed since last read (always with
    /// `force`): `Some(Ok(()))` when new connections now use them, `None` when nothing changed (or
    /// nothing is configured). A set that does not load is refused and the one in force stays.
    pub fn reload(&self, force: bool) -> Option<Result<(), EngineTlsError>> {
        let (files, watch) = &**self.tls.as_ref()?;
        Some(watch.reload(force, || files.load())?.map(|t| {
            *self.http.write().unwrap_or_else(std::sync::PoisonError::into_inner) =
                Self::pool(&self.names, (*t.0).clone(), self.idle);
        }))
    }

    /// `[engine_tls]`'s reloads; `None` without its files.
    pub fn reloads(&self) -> Option<Arc<TlsReloads>> {
        self.tls.as_ref().map(|t| Arc::clone(&t.1.counts))
    }

    /// Whether `[engine_tls]` names files to watch.
    pub fn watches_files(&self) -> bool {
        self.tls.is_some()
    }

    pub fn names(&self) -> &Names {
        &self.names
    }

    /// Sends `req` (its URI on `to`) on the current pool (the one built from the engine TLS files
    /// last read). A connection that failed asks for `to`'s name to be looked up again; a
    /// kept-alive connection to an address the name no longer has is not used again.
    pub async fn send(
        &self,
        to: &EngineUrl,
        req: Request<Full<Bytes>>,
    ) -> Result<Response<EngineBody>, SendError> {
        let pool = self.http.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let name = match &to.0.at.host {
            Host::Name(n) => Some(n.as_str()),
            Host::Ip(_) => None,
        };
        // Boxed: the call's future is some 1.2 kB (the request, and hyper's future that holds it
        // until written), and the futures of the legs that await it are moved and boxed whole.
        let sent = Box::pin(pool.send(to, name, &self.names, req)).await;
        if let (Err(e), Some(name)) = (&sent, name)
            && e.is_connect()
        {
            self.names.failed(name);
        }
        sent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn call_uris_and_host_headers_are_what_formatting_gave() {
        for (url, host) in [
            ("https://decode-0.pd:8443", "decode-0.pd:8443"),
            ("https://decode-0.pd:443/", "decode-0.pd"),
            ("http://10.0.0.5:80", "10.0.0.5"),
            ("http://10.0.0.5:443", "10.0.0.5:443"),
            ("http://[::1]:9000", "[::1]:9000"),
            ("https://[::1]:443", "[::1]"),
            ("http://decode-0.pd.:80", "decode-0.pd."),
            ("http://Decode-0.PD:8000", "decode-0.pd:8000"),
        ] {
            let e = EngineUrl::parse(url).unwrap_or_else(|e| unreachable(e));
            for path in ["/v1/completions", "/generate", "/health"] {
                let formatted: hyper::Uri = e.uri(path).parse().unwrap_or_else(|e| unreachable(e));
                let built = e.call_uri(path).unwrap_or_else(|e| unreachable(e));
                assert_eq!(built, formatted, "{url}{path}");
                assert_eq!(built.to_string(), formatted.to_string(), "{url}{path}");
            }
            assert_eq!(e.host_header().map(|h| h.to_str().unwrap_or_default()), Some(host), "{url}");
        }
    }

    #[test]
    fn host_ports_parse() {
        let hp: HostPort = "decode-0.pd.svc.cluster.local:9000".parse().unwrap_or_else(|e| unreachable(e));
        assert_eq!(hp.host, Host::Name("decode-0.pd.svc.cluster.local".into()));
        assert_eq!(hp.port, 9000);
        let hp: HostPort = "10.0.0.5:9000".parse().unwrap_or_else(|e| unreachable(e));
        assert_eq!(hp.host, Host::Ip("10.0.0.5".parse().unwrap_or_else(|_| unreachable("ip"))));
        let hp: HostPort = "[::1]:9000".parse().unwrap_or_else(|e| unreachable(e));
        assert_eq!(hp.to_string(), "[::1]:9000");
        for bad in ["decode-0", "decode-0:0", "decode-0:x", "-a.b:1", "a..b:1", "::1:80", "a_b:1", ":80"] {
            assert!(bad.parse::<HostPort>().is_err(), "{bad} parsed");
        }
    }

    #[test]
    fn endpoints_parse() {
        let e = EngineUrl::parse("https://Decode-0.pd:8443/").unwrap_or_else(|e| unreachable(e));
        assert_eq!(e.scheme(), Scheme::Https);
        assert_eq!(e.uri("/v1/completions"), "https://decode-0.pd:8443/v1/completions");
        assert_eq!(e.host(), "decode-0.pd");
        let e = EngineUrl::parse("http://127.0.0.1:8000").unwrap_or_else(|e| unreachable(e));
        assert_eq!(e.socket_addr(), Some(SocketAddr::from(([127, 0, 0, 1], 8000))));
        // The host as written, as its `Display` writes it.
        for url in ["http://127.0.0.1:8000", "https://[::1]:443", "http://[fe80::1]:9", "http://a.b.:80/"] {
            let e = EngineUrl::parse(url).unwrap_or_else(|e| unreachable(e));
            assert_eq!(e.host(), e.host_port().host.to_string(), "{url}");
        }
        for bad in
            ["127.0.0.1:8000", "ftp://a:1", "http://a:1/v1", "http://u@a:1", "http://a", "http://a:1?x"]
        {
            assert!(EngineUrl::parse(bad).is_err(), "{bad} parsed");
        }
    }

    /// A URL is found in a map by an equal one (written differently, parsed the same), and only by
    /// an equal one.
    #[test]
    fn equal_urls_are_one_key() {
        let url = |u: &str| EngineUrl::parse(u).unwrap_or_else(|e| unreachable(e));
        let mut ports = std::collections::HashMap::new();
        ports.insert(url("http://Prefill-0.pd:8000"), 1u16);
        ports.insert(url("https://prefill-0.pd:8000"), 2);
        ports.insert(url("http://prefill-0.pd:8001"), 3);
        ports.insert(url("http://10.0.0.5:8000"), 4);
        ports.insert(url("http://[::1]:80"), 5);
        assert_eq!(ports.len(), 5);
        assert_eq!(ports.get(&url("http://prefill-0.pd:8000/")), Some(&1));
        assert_eq!(ports.get(&url("https://prefill-0.pd:8000")), Some(&2));
        assert_eq!(ports.get(&url("http://PREFILL-0.PD:8001/")), Some(&3));
        assert_eq!(ports.get(&url("http://[0:0::1]:80")), Some(&5));
        assert_eq!(ports.get(&url("http://10.0.0.5:8000")), Some(&4));
        assert_eq!(ports.get(&url("http://10.0.0.6:8000")), None);
    }

    #[test]
    fn refusals_name_the_input_and_the_reason() {
        for (bad, message) in [
            ("decode-0", r#""decode-0" must be HOST:PORT"#),
            ("decode-0:x", r#""decode-0:x": "x" is not a port"#),
            ("decode-0:0", r#""decode-0:0": the port must not be 0"#),
            ("::1:80", r#""::1:80": an IPv6 address is written [ADDR]:PORT"#),
            ("a_b:1", r#""a_b:1": "a_b" is not a DNS label (letters, digits, inner hyphens)"#),
            (":80", r#"":80": a host name has 1 to 253 characters"#),
        ] {
            let e = bad.parse::<HostPort>().err().map(|e| e.to_string());
            assert_eq!(e.as_deref(), Some(message), "{bad}");
        }
        for (bad, message) in [
            ("ftp://a:1", r#""ftp://a:1" must start with http:// or https://"#),
            ("http://a:1/v1", r#""http://a:1/v1" must be SCHEME://HOST:PORT, without a path, query or user"#),
            ("http://a", r#""http://a": "a" must be HOST:PORT"#),
        ] {
            let e = EngineUrl::parse(bad).err().map(|e| e.to_string());
            assert_eq!(e.as_deref(), Some(message), "{bad}");
        }
    }

    async fn get(client: &EngineClient, at: SocketAddr) -> Result<u16, String> {
        let to = EngineUrl::from(at);
        let req = Request::get(format!("{}/x", to.0.base))
            .body(Full::new(Bytes::new()))
            .unwrap_or_else(|e| unreachable(e));
        let resp = client.send(&to, req).await.map_err(|e| e.to_string())?;
        let status = resp.status().as_u16();
        http_body_util::BodyExt::collect(resp.into_body()).await.map_err(|e| e.to_string())?;
        Ok(status)
    }

    /// A connection idle longer than `engine_idle` is not used again: an engine that closes idle
    /// connections after 300 ms loses the request sent on one idle 400 ms when the gateway keeps
    /// them 4 s, and answers it on a new connection when the gateway keeps them 200 ms.
    #[tokio::test]
    async fn an_idle_connection_is_not_reused_past_engine_idle() {
        let (at, conns, _) =
            engine(b"ok", Duration::ZERO, Closes::WhenIdle(Duration::from_millis(300))).await;
        let keeps = EngineClient::new(Names::default(), None, Duration::from_secs(4));
        assert_eq!(get(&keeps, at).await, Ok(200));
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(get(&keeps, at).await.is_err(), "the stale connection was not reused");
        assert_eq!(conns.load(Ordering::SeqCst), 1);

        let (at, conns, _) =
            engine(b"ok", Duration::ZERO, Closes::WhenIdle(Duration::from_millis(300))).await;
        let drops = EngineClient::new(Names::default(), None, Duration::from_millis(200));
        assert_eq!(get(&drops, at).await, Ok(200));
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(get(&drops, at).await, Ok(200));
        assert_eq!(conns.load(Ordering::SeqCst), 2);
    }

    /// A connection to a named engine remembers the address it reached (the pool checks it
    /// against the name's before using it again); one to an IP literal has nothing to check.
    #[tokio::test]
    async fn only_named_engines_connections_remember_their_addresses() {
        use tower_service::Service;
        let (at, _, _) = engine(b"ok", Duration::ZERO, Closes::Never).await;
        let mut connector = TcpConnector(HttpConnector::new_with_resolver(Names::default()));
        for (uri, remote) in
            [(format!("http://{at}/"), None), (format!("http://localhost:{}/", at.port()), Some(at.ip()))]
        {
            let conn = connector.call(uri.parse().unwrap_or_else(|e| unreachable(e)));
            let conn = conn.await.unwrap_or_else(|e| unreachable(e));
            assert_eq!(conn.inner().remote, remote, "{uri}");
        }
        for (uri, is_named) in [
            ("http://127.0.0.1:9000/x", false),
            ("https://[::1]:9000/x", false),
            ("http://decode-0.pd.svc:9000/x", true),
            ("http://localhost:9000/x", true),
        ] {
            assert_eq!(named(&uri.parse().unwrap_or_else(|e| unreachable(e))), is_named, "{uri}");
        }
    }

    /// When [`engine`] closes a connection.
    #[derive(Clone, Copy)]
    enum Closes {
        Never,
        AfterAnswer,
        /// Idle this long, the way uvicorn does, with a request already on its way: that request
        /// is read by nobody and gets no answer.
        WhenIdle(Duration),
    }

    /// An engine that answers any request with `body`, in two writes `gap` apart, counts the
    /// connections it accepted and keeps the requests' heads.
    async fn engine(
        body: &'static [u8],
        gap: Duration,
        closes: Closes,
    ) -> (SocketAddr, Arc<AtomicUsize>, Heads) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap_or_else(|e| unreachable(e));
        let at = l.local_addr().unwrap_or_else(|e| unreachable(e));
        let conns = Arc::new(AtomicUsize::new(0));
        let heads = Heads::default();
        let (counted, kept) = (Arc::clone(&conns), Arc::clone(&heads));
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                let kept = Arc::clone(&kept);
                tokio::spawn(async move {
                    let mut answered: Option<Instant> = None;
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    loop {
                        let Ok(n) = s.read(&mut chunk).await else { return };
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                        if !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                            continue;
                        }
                        kept.lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .push(String::from_utf8_lossy(&buf).into_owned());
                        buf.clear();
                        if let Closes::WhenIdle(after) = closes
                            && answered.is_some_and(|t| t.elapsed() >= after)
                        {
                            return; // closed while the request crossed
                        }
                        let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len());
                        let (first, rest) = body.split_at(body.len() / 2);
                        if s.write_all(head.as_bytes()).await.is_err() || s.write_all(first).await.is_err() {
                            return;
                        }
                        tokio::time::sleep(gap).await;
                        if s.write_all(rest).await.is_err() || matches!(closes, Closes::AfterAnswer) {
                            return;
                        }
                        answered = Some(Instant::now());
                    }
                });
            }
        });
        (at, conns, heads)
    }

    type Heads = Arc<Mutex<Vec<String>>>;

    fn pool_of(client: &EngineClient) -> pool::Pool {
        client.http.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// One connection carries call after call; calls at once get one each, and those
    /// connections carry the next calls. A request goes in origin form, with the engine's `Host`
    /// when it has none.
    #[tokio::test]
    async fn connections_are_kept_and_reused() {
        let (at, conns, heads) = engine(b"ok", Duration::ZERO, Closes::Never).await;
        let client = EngineClient::new(Names::default(), None, Duration::from_secs(4));
        for _ in 0..20 {
            assert_eq!(get(&client, at).await, Ok(200));
        }
        assert_eq!(conns.load(Ordering::SeqCst), 1);
        let first = heads.lock().unwrap_or_else(std::sync::PoisonError::into_inner)[0].clone();
        assert!(first.starts_with("GET /x HTTP/1.1\r\n"), "{first}");
        assert!(first.contains(&format!("\r\nhost: {at}\r\n")), "{first}");

        let (at, conns, _) = engine(b"slow answer", Duration::from_millis(50), Closes::Never).await;
        for _ in 0..3 {
            let calls: Vec<_> = (0..8).map(|_| get(&client, at)).collect();
            for r in futures_util::future::join_all(calls).await {
                assert_eq!(r, Ok(200));
            }
        }
        assert_eq!(conns.load(Ordering::SeqCst), 8);
    }

    /// An engine that closes each connection after one answer still answers every call: a
    /// closed connection is not used again, or the call is sent again on a new one.
    #[tokio::test]
    async fn an_engine_closing_each_connection_answers_every_call() {
        let (at, conns, _) = engine(b"ok", Duration::ZERO, Closes::AfterAnswer).await;
        let client = EngineClient::new(Names::default(), None, Duration::from_secs(4));
        for _ in 0..20 {
            assert_eq!(get(&client, at).await, Ok(200));
        }
        assert_eq!(conns.load(Ordering::SeqCst), 20);
    }

    /// An answer dropped before its end takes its connection with it (the rest of the answer
    /// would be read as the next one's); an answer read to its end gives it back.
    #[tokio::test]
    async fn an_answer_dropped_part_read_closes_its_connection() {
        let (at, conns, _) = engine(b"a longer answer", Duration::from_millis(100), Closes::Never).await;
        let client = EngineClient::new(Names::default(), None, Duration::from_secs(4));
        let to = EngineUrl::from(at);
        let req = Request::get(to.uri("/x")).body(Full::new(Bytes::new())).unwrap_or_else(|e| unreachable(e));
        let resp = client.send(&to, req).await.unwrap_or_else(|e| unreachable(e));
        drop(resp);
        assert_eq!(pool_of(&client).idle_count(&to), 0);
        assert_eq!(get(&client, at).await, Ok(200));
        assert_eq!(pool_of(&client).idle_count(&to), 1);
        assert_eq!(get(&client, at).await, Ok(200));
        assert_eq!(conns.load(Ordering::SeqCst), 2);
    }

    /// A kept-alive connection found closed once the request was handed to it, before it was
    /// written, has the request sent again on a new connection: nothing is lost, and the closed
    /// connection's engine read nothing.
    #[tokio::test]
    async fn a_request_unsent_on_a_closed_kept_connection_goes_on_a_new_one() {
        let (at, conns, _) = engine(b"ok", Duration::ZERO, Closes::Never).await;
        let client = EngineClient::new(Names::default(), None, Duration::from_secs(4));
        let to = EngineUrl::from(at);
        let (near, mut far) = tokio::io::duplex(4096);
        let (tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(near))
            .await
            .unwrap_or_else(|e| unreachable(e));
        let conn = tokio::spawn(conn);
        // The connection's task runs once and waits for a request: the connection is free.
        tokio::task::yield_now().await;
        pool_of(&client).keep(&to, tx);
        // Its engine's end closes; the connection's task sees that only when it next runs, after
        // the request was handed to it (this test's runtime has one thread).
        tokio::io::AsyncWriteExt::shutdown(&mut far).await.unwrap_or_else(|e| unreachable(e));
        assert_eq!(get(&client, at).await, Ok(200));
        assert_eq!(conns.load(Ordering::SeqCst), 1);
        assert!(conn.await.is_ok_and(|c| c.is_ok()), "the closed connection ended as closed");
        let mut read = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(&mut far, &mut read).await.unwrap_or_else(|e| unreachable(e));
        assert!(read.is_empty(), "the closed connection was written to: {read:?}");
    }

    /// A kept-alive connection that does not become free for a request is closed after
    /// `KEPT_READY` and the call goes on another; it is not waited on for the call's whole timeout.
    #[tokio::test]
    async fn a_kept_connection_never_free_is_not_waited_on() {
        let (at, conns, _) = engine(b"ok", Duration::ZERO, Closes::Never).await;
        let client = EngineClient::new(Names::default(), None, Duration::from_secs(4));
        let to = EngineUrl::from(at);
        let (near, _far) = tokio::io::duplex(4096);
        // Its task never runs: never free.
        let (tx, _conn) = hyper::client::conn::http1::handshake(TokioIo::new(near))
            .await
            .unwrap_or_else(|e| unreachable(e));
        pool_of(&client).keep(&to, tx);
        let called = tokio::time::timeout(Duration::from_secs(2), get(&client, at)).await;
        assert_eq!(called, Ok(Ok(200)));
        assert_eq!(conns.load(Ordering::SeqCst), 1);
    }

    /// A call to a port nobody listens on fails as a connect (the engine saw nothing), naming the
    /// engine and the cause.
    #[tokio::test]
    async fn a_refused_connect_is_unsent_and_says_so() {
        let at = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| unreachable(e));
            l.local_addr().unwrap_or_else(|e| unreachable(e))
        };
        let client = EngineClient::new(Names::default(), None, Duration::from_secs(4));
        let to = EngineUrl::from(at);
        let req = Request::get(to.uri("/x")).body(Full::new(Bytes::new())).unwrap_or_else(|e| unreachable(e));
        let e = client.send(&to, req).await.err().unwrap_or_else(|| unreachable("answered"));
        assert!(e.is_connect(), "{e:?}");
        let text = e.to_string();
        assert!(text.starts_with(&format!("connect to http://{at}: ")), "{text}");
        assert!(text.to_lowercase().contains("refused"), "{text}");
    }

    #[allow(clippy::panic)]
    fn unreachable(e: impl std::fmt::Display) -> ! {
        panic!("{e}")
    }
}
