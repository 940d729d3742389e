//! The simulated engine as SGLang in PD mode (`--disaggregation-mode prefill|decode`,
//! `python/sglang/srt/disaggregation/`), so the gateway's `sglang` mode is tested against the real
//! request fields:
//!
//! - both legs get the same request with `bootstrap_host`, `bootstrap_port` and `bootstrap_room`
//!   (arrays of them when `n > 1`), sent at once;
//! - prefill: runs the prompt, keeps its KV under the room and answers; its bootstrap server
//!   (`disaggregation_bootstrap_port`, reported by `GET /get_server_info`) hands the KV to the
//!   decoder that asks for the room, then frees it. A room nobody asks for within `room_wait` is
//!   freed and counted as abandoned;
//! - decode: asks `bootstrap_host:bootstrap_port` for its room (waiting at most `room_wait` for the
//!   prefill leg to arrive), checks every byte against its own prompt, then decodes. A room that
//!   never arrives, or one whose prompt differs, fails the request loudly;
//! - `POST /abort_request {"rid"}` ends an in-flight request (as SGLang's does).
//!
//! Not SGLang's: the KV travels over a plain TCP line protocol instead of Mooncake/NIXL. A line
//! `ROOM <room> <rank> <prompt hash>` is answered, once the room is there, by a `u32` length and that
//! rank's KV (`u32::MAX`: never arrived; `u32::MAX - 1`: another prompt), `DONE <room>` frees it.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

use super::kv::{chunk_page, prefix_hashes, verify_chunk};
use super::{SimError, lock};
use baton_dataplane::geometry::KvGeometry;

/// How long a decoder waits for its room's prefill, and a prefill's room for its decoder, when the
/// configuration names no other (SGLang's own bootstrap waits are minutes; tests want seconds).
pub const DEFAULT_ROOM_WAIT: Duration = Duration::from_secs(10);
/// How often abandoned rooms are reaped.
const REAP_EVERY: Duration = Duration::from_millis(20);
const NEVER: u32 = u32::MAX;
const MISMATCH: u32 = u32::MAX - 1;

/// The PD fields of a request (each a value, or a list of them with `n > 1`).
#[derive(Clone, Debug, Default)]
pub struct SglangParams {
    pub hosts: Vec<String>,
    pub ports: Vec<u16>,
    pub rooms: Vec<u64>,
}

fn list(v: Option<&Value>) -> Vec<Value> {
    match v {
        Some(Value::Array(a)) => a.clone(),
        Some(Value::Null) | None => Vec::new(),
        Some(x) => vec![x.clone()],
    }
}

impl SglangParams {
    /// The fields of a request, when it has a `bootstrap_room`.
    pub fn of(
        host: Option<&Value>,
        port: Option<&Value>,
        room: Option<&Value>,
    ) -> Result<Option<Self>, SimError> {
        let rooms = list(room);
        if rooms.is_empty() {
            return Ok(None);
        }
        let bad = |f: &str| SimError::bad(format!("{f}: expected a value per bootstrap_room"));
        let rooms = rooms
            .iter()
            .map(Value::as_u64)
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| bad("bootstrap_room"))?;
        let hosts: Vec<String> = list(host).iter().filter_map(|h| h.as_str().map(str::to_owned)).collect();
        let ports: Vec<u16> =
            list(port).iter().filter_map(|p| p.as_u64().and_then(|p| u16::try_from(p).ok())).collect();
        Ok(Some(Self { hosts, ports, rooms }))
    }
}

struct Room {
    hash: u64,
    ids: Arc<[u32]>,
    expires: Instant,
    /// The request that made it (an abort naming it frees the room).
    rid: Option<String>,
}

/// Counters of one engine's PD side.
#[derive(Debug, Default)]
pub struct SglangStats {
    /// Rooms handed from a prefill to its decoder.
    pub paired: AtomicU64,
    /// Decode: rooms that never arrived within the wait.
    pub unpaired: AtomicU64,
    /// Prefill: rooms no decoder asked for within the wait.
    pub abandoned: AtomicU64,
    /// Rooms whose two legs carried different prompts.
    pub mismatched: AtomicU64,
    /// Requests ended by `/abort_request`.
    pub aborted: AtomicU64,
    /// `/abort_request` calls received, whether or not they found the request.
    pub abort_requests: AtomicU64,
}

/// The PD side of an SGLang-like engine: the prefill's bootstrap server and rooms, and the
/// in-flight requests either side can abort.
pub struct Sglang {
    /// Prefill: where the bootstrap server listens.
    pub bootstrap: Option<SocketAddr>,
    geometry: KvGeometry,
    rooms: Arc<Mutex<HashMap<u64, Room>>>,
    arrived: Arc<Notify>,
    room_wait: Duration,
    /// Prefill: how long after holding a room it answers ([`super::SglangSimConfig::answer_delay`]).
    pub answer_delay: Duration,
    in_flight: Mutex<HashMap<String, Arc<Notify>>>,
    pub stats: Arc<SglangStats>,
    _tasks: super::Tasks,
}

impl std::fmt::Debug for Sglang {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sglang").field("bootstrap", &self.bootstrap).finish()
    }
}

fn prompt_hash(ids: &[u32]) -> u64 {
    prefix_hashes(ids).last().copied().unwrap_or(0) ^ ids.len() as u64
}

/// A request registered for `/abort_request` until dropped.
#[derive(Debug)]
pub struct InFlight {
    owner: Arc<Sglang>,
    rid: Option<String>,
    /// Notified (a permit kept) when the request is aborted.
    pub cancel: Arc<Notify>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(rid) = &self.rid {
            lock(&self.owner.in_flight).remove(rid);
        }
    }
}

impl Sglang {
    /// A prefill's PD side: its bootstrap server on `host:port` (ephemeral with `None`) and the
    /// reaper of abandoned rooms.
    pub async fn prefill(
        geometry: KvGeometry,
        host: IpAddr,
        port: Option<u16>,
        room_wait: Duration,
    ) -> Result<Self, SimError> {
        let listener = TcpListener::bind(SocketAddr::new(host, port.unwrap_or(0)))
            .await
            .map_err(|e| SimError::internal(format!("bootstrap server: {e}")))?;
        let at = listener.local_addr().map_err(SimError::internal)?;
        let mut s = Self::decode(geometry, room_wait);
        s.bootstrap = Some(at);
        let reaper = {
            let (rooms, stats) = (Arc::clone(&s.rooms), Arc::clone(&s.stats));
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(REAP_EVERY).await;
                    let now = Instant::now();
                    let mut r = lock(&rooms);
                    let before = r.len();
                    r.retain(|_, room| room.expires > now);
                    stats.abandoned.fetch_add((before - r.len()) as u64, Ordering::Relaxed);
                }
            })
        };
        let server = tokio::spawn(serve_bootstrap(
            listener,
            Arc::clone(&s.rooms),
            Arc::clone(&s.arrived),
            geometry,
            room_wait,
            Arc::clone(&s.stats),
        ));
        s._tasks = super::Tasks(vec![reaper, server]);
        Ok(s)
    }

    /// A decoder's PD side.
    pub fn decode(geometry: KvGeometry, room_wait: Duration) -> Self {
        Self {
            bootstrap: None,
            geometry,
            rooms: Arc::default(),
            arrived: Arc::default(),
            room_wait,
            answer_delay: Duration::ZERO,
            in_flight: Mutex::default(),
            stats: Arc::default(),
            _tasks: super::Tasks::default(),
        }
    }

    /// Registers a request under its `rid` (when it has one) so `/abort_request` can end it.
    pub fn track(self: &Arc<Self>, rid: Option<&str>) -> InFlight {
        let cancel = Arc::new(Notify::new());
        if let Some(r) = rid {
            lock(&self.in_flight).insert(r.to_owned(), Arc::clone(&cancel));
        }
        InFlight { owner: Arc::clone(self), rid: rid.map(str::to_owned), cancel }
    }

    /// `/abort_request`: ends the request `rid` and frees the rooms it holds (as SGLang's prefill
    /// frees an aborted request's KV); whether anything was.
    pub fn abort(&self, rid: &str) -> bool {
        self.stats.abort_requests.fetch_add(1, Ordering::Relaxed);
        let running = lock(&self.in_flight).remove(rid);
        if let Some(c) = &running {
            c.notify_one();
        }
        let mut rooms = lock(&self.rooms);
        let before = rooms.len();
        rooms.retain(|_, r| r.rid.as_deref() != Some(rid));
        let freed = before != rooms.len();
        drop(rooms);
        let aborted = running.is_some() || freed;
        if aborted {
            self.stats.aborted.fetch_add(1, Ordering::Relaxed);
        }
        aborted
    }

    /// Requests in flight (tracked by rid).
    pub fn in_flight(&self) -> usize {
        lock(&self.in_flight).len()
    }

    /// Prefill: rooms held for their decoders.
    pub fn rooms_held(&self) -> usize {
        lock(&self.rooms).len()
    }

    /// Prefill: keeps the prompt's KV under each room until its decoder takes it.
    pub fn hold(&self, p: &SglangParams, ids: &[u32], rid: Option<&str>) {
        let ids: Arc<[u32]> = ids.into();
        let hash = prompt_hash(&ids);
        let expires = Instant::now() + self.room_wait;
        let mut rooms = lock(&self.rooms);
        for room in &p.rooms {
            rooms.insert(*room, Room { hash, ids: Arc::clone(&ids), expires, rid: rid.map(str::to_owned) });
        }
        drop(rooms);
        self.arrived.notify_waiters();
    }

    /// Decode: pulls every room's KV from its prefill's bootstrap server and checks it against
    /// `ids`; fails when a room does not arrive within the wait or carries another prompt.
    pub async fn pull(&self, p: &SglangParams, ids: &[u32]) -> Result<(), SimError> {
        for (i, room) in p.rooms.iter().enumerate() {
            let host = p
                .hosts
                .get(i)
                .or(p.hosts.first())
                .ok_or_else(|| SimError::bad("bootstrap_host is required"))?;
            let port = *p
                .ports
                .get(i)
                .or(p.ports.first())
                .ok_or_else(|| SimError::bad("bootstrap_port is required"))?;
            let ip: IpAddr =
                host.parse().map_err(|_| SimError::bad(format!("bootstrap_host must be an IP: {host:?}")))?;
            self.pull_room(SocketAddr::new(ip, port), *room, ids).await?;
        }
        Ok(())
    }

    async fn pull_room(&self, at: SocketAddr, room: u64, ids: &[u32]) -> Result<(), SimError> {
        let g = &self.geometry;
        let stream = TcpStream::connect(at).await.map_err(|e| {
            SimError::upstream(format!("bootstrap server {at} (bootstrap_host:bootstrap_port): {e}"))
        })?;
        let _ = stream.set_nodelay(true);
        let mut io = BufReader::new(stream);
        let hashes = prefix_hashes(ids);
        let hash = prompt_hash(ids);
        let page = usize::try_from(g.page_bytes_per_rank()).unwrap_or(usize::MAX).max(1);
        let io_err =
            |e: std::io::Error| SimError::upstream(format!("reading KV from bootstrap server {at}: {e}"));
        for rank in 0..g.tp_size {
            io.get_mut()
                .write_all(format!("ROOM {room} {rank} {hash}\n").as_bytes())
                .await
                .map_err(io_err)?;
            let len = io.read_u32_le().await.map_err(io_err)?;
            if len == NEVER {
                self.stats.unpaired.fetch_add(1, Ordering::Relaxed);
                return Err(SimError::timeout(format!(
                    "bootstrap room {room}: the prefill leg never arrived at {at} within {:?}",
                    self.room_wait
                )));
            }
            if len == MISMATCH {
                self.stats.mismatched.fetch_add(1, Ordering::Relaxed);
                return Err(SimError::internal(format!(
                    "bootstrap room {room}: the prefill at {at} ran another prompt"
                )));
            }
            let mut data = vec![0u8; len as usize];
            io.read_exact(&mut data).await.map_err(io_err)?;
            for (c, chunk) in data.chunks(page).enumerate() {
                verify_chunk(g, rank, &hashes, u32::try_from(c).unwrap_or(u32::MAX), chunk)
                    .map_err(SimError::internal)?;
            }
        }
        io.get_mut().write_all(format!("DONE {room}\n").as_bytes()).await.map_err(io_err)?;
        let _ = io.read_u8().await;
        self.stats.paired.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// Waits (at most `wait`) for `room` to be held; its prompt's ids, or why not.
async fn room_ids(
    rooms: &Mutex<HashMap<u64, Room>>,
    arrived: &Notify,
    room: u64,
    hash: u64,
    wait: Duration,
) -> Result<Arc<[u32]>, u32> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let notified = arrived.notified();
        if let Some(r) = lock(rooms).get(&room) {
            return if r.hash == hash { Ok(Arc::clone(&r.ids)) } else { Err(MISMATCH) };
        }
        if tokio::time::timeout_at(deadline, notified).await.is_err() {
            return Err(NEVER);
        }
    }
}

async fn serve_bootstrap(
    listener: TcpListener,
    rooms: Arc<Mutex<HashMap<u64, Room>>>,
    arrived: Arc<Notify>,
    g: KvGeometry,
    wait: Duration,
    stats: Arc<SglangStats>,
) {
    super::serve_each(listener, move |stream| {
        let (rooms, arrived, stats) = (Arc::clone(&rooms), Arc::clone(&arrived), Arc::clone(&stats));
        async move {
            let mut io = BufReader::new(stream);
            let mut line = String::new();
            loop {
                line.clear();
                match io.read_line(&mut line).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
                let mut parts = line.split_whitespace();
                let reply: Vec<u8> = match (parts.next(), parts.next(), parts.next(), parts.next()) {
                    (Some("ROOM"), Some(room), Some(rank), Some(hash)) => {
                        let (Ok(room), Ok(rank), Ok(hash)) =
                            (room.parse(), rank.parse::<u32>(), hash.parse())
                        else {
                            return;
                        };
                        match room_ids(&rooms, &arrived, room, hash, wait).await {
                            Ok(ids) if rank < g.tp_size => {
                                let hashes = prefix_hashes(&ids);
                                let chunks = ids.len().div_ceil(g.chunk_tokens.max(1) as usize);
                                let mut out = Vec::new();
                                for c in 0..chunks {
                                    out.extend(chunk_page(
                                        &g,
                                        rank,
                                        &hashes,
                                        u32::try_from(c).unwrap_or(u32::MAX),
                                    ));
                                }
                                let mut v = u32::try_from(out.len()).unwrap_or(NEVER).to_le_bytes().to_vec();
                                v.extend(out);
                                v
                            }
                            Ok(_) => NEVER.to_le_bytes().to_vec(),
                            Err(code) => {
                                if code == MISMATCH {
                                    stats.mismatched.fetch_add(1, Ordering::Relaxed);
                                }
                                code.to_le_bytes().to_vec()
                            }
                        }
                    }
                    (Some("DONE"), Some(room), None, None) => {
                        let found = room.parse::<u64>().is_ok_and(|r| lock(&rooms).remove(&r).is_some());
                        if found {
                            stats.paired.fetch_add(1, Ordering::Relaxed);
                        }
                        vec![u8::from(found)]
                    }
                    _ => return,
                };
                if io.get_mut().write_all(&reply).await.is_err() {
                    return;
                }
            }
        }
    })
    .await;
}
