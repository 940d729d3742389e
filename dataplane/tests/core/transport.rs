//! The data plane over loopback TCP: reserve, chunk writes in segments, readiness and release events,
//! and peers that send hostile frames.

use std::sync::Arc;
use std::time::Duration;

use baton_dataplane::device::cpu::CpuDevice;
use baton_dataplane::transport::{
    ControlClient, EventStream, ProducerClient, RankServer, ServerHandle, TransportError, WaitError,
};
use baton_dataplane::wire::{Decoded, Frame, Hello, RefusalCode, Role, decode, encode};
use baton_dataplane::{
    BufferOptions, KvGeometry, PageAddr, RankBuffer, RankEvent, ReleaseReason, SystemClock, TerminalState,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::common::{content, key, tiny};

const WAIT: Duration = Duration::from_secs(5);

async fn server(pages: u32) -> (Arc<RankServer<CpuDevice>>, ServerHandle) {
    let (sink, tx) = RankServer::<CpuDevice>::sink();
    let options = BufferOptions { quarantine_ttl: Duration::from_secs(30), ..BufferOptions::default() };
    let buf =
        RankBuffer::new(Arc::new(CpuDevice), tiny(), 0, pages, options, Arc::new(SystemClock), sink).unwrap();
    let srv = RankServer::new(buf, 1, tx);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let handle = srv.start(listener).unwrap();
    (srv, handle)
}

async fn next_event(ev: &mut EventStream, want: impl Fn(&RankEvent) -> bool) -> RankEvent {
    tokio::time::timeout(WAIT, async {
        loop {
            let e = ev.next().await.unwrap().unwrap();
            if want(&e) {
                return e;
            }
        }
    })
    .await
    .expect("event did not come")
}

fn fp() -> u64 {
    tiny().fingerprint()
}

#[tokio::test]
async fn loopback_write_ready_consume_release() {
    let (srv, h) = server(8).await;
    let mut events = EventStream::connect(h.addr, fp(), 0).await.unwrap();
    let mut ctl = ControlClient::connect(h.addr, fp(), 0).await.unwrap();
    let mut prod = ProducerClient::connect(h.addr, fp(), 0).await.unwrap().with_segment(16);
    assert_eq!(ctl.welcome.pages_total, 8);
    let k = key(1);
    let addrs = ctl.reserve(k, 3, Duration::from_secs(30), &[]).await.unwrap();
    assert_eq!(addrs.len(), 3);
    assert_eq!(ctl.info().await.unwrap().pages_free, 5);
    let page = srv.buffer().page_bytes();
    for (c, a) in &addrs {
        assert!(!prod.write_chunk(k, *c, *a, &content(u64::from(*c), 0, page)).await.unwrap());
    }
    // A retransmitted chunk is acknowledged as a duplicate and changes nothing.
    assert!(prod.write_chunk(k, addrs[0].0, addrs[0].1, &content(0, 0, page)).await.unwrap());
    let e = next_event(&mut events, |e| matches!(e, RankEvent::Status(_))).await;
    let RankEvent::Status(s) = e else { unreachable!() };
    assert_eq!((s.key(), s.state, s.chunks, s.bytes), (k, TerminalState::Ready, 3, 3 * page as u64));

    // The embedding decoder takes the reservation, consumes it and verifies every byte.
    let Ok(ready) = srv.take(k).unwrap().try_ready() else { panic!("not ready") };
    let consuming = ready.consume().unwrap();
    for c in 0..3 {
        let mut got = vec![0; page];
        consuming.read_chunk(c, &mut got).unwrap();
        assert_eq!(got, content(u64::from(c), 0, page), "chunk {c}");
    }
    drop(consuming);
    let e = next_event(&mut events, |e| matches!(e, RankEvent::Released(_))).await;
    assert!(matches!(e, RankEvent::Released(r) if r.reason == ReleaseReason::Consumed && r.pages == 3));
    assert_eq!(ctl.info().await.unwrap().pages_free, 8);
    srv.buffer().check_invariants().unwrap();
    h.shutdown().await;
}

#[tokio::test]
async fn refusals_carry_their_numbers() {
    let (_srv, h) = server(8).await;
    let mut ctl = ControlClient::connect(h.addr, fp(), 0).await.unwrap();
    let r = ctl.reserve(key(1), 9, Duration::from_secs(30), &[]).await;
    assert!(
        matches!(&r, Err(TransportError::Refused { code: RefusalCode::TooLarge, need: 9, have: 8, message }) if message == "request needs 9 pages but the buffer holds 8"),
        "{r:?}"
    );
    ctl.reserve(key(2), 6, Duration::from_secs(30), &[]).await.unwrap();
    let r = ctl.reserve(key(3), 3, Duration::from_secs(30), &[]).await;
    assert!(
        matches!(r, Err(TransportError::Refused { code: RefusalCode::Busy, need: 3, have: 2, .. })),
        "{r:?}"
    );
    let r = ctl.reserve(key(2), 1, Duration::from_secs(30), &[]).await;
    assert!(matches!(r, Err(TransportError::Refused { code: RefusalCode::Duplicate, .. })), "{r:?}");
    // The connection is still usable after refusals.
    assert_eq!(ctl.info().await.unwrap().pages_free, 2);
    h.shutdown().await;
}

/// A cancel that overtakes its reservation (sent on another connection by a client that gave up
/// while the Reserve was in flight) makes the late Reserve fail instead of holding pages until its
/// lease ends.
#[tokio::test]
async fn a_cancel_that_overtakes_its_reserve_refuses_it() {
    let (srv, h) = server(8).await;
    let mut ctl = ControlClient::connect(h.addr, fp(), 0).await.unwrap();
    let mut other = ControlClient::connect(h.addr, fp(), 0).await.unwrap();
    other.cancel_unsent(key(7)).await.unwrap();
    let r = ctl.reserve(key(7), 2, Duration::from_secs(30), &[]).await;
    assert!(matches!(r, Err(TransportError::Refused { code: RefusalCode::Closed, .. })), "{r:?}");
    assert_eq!(srv.buffer().stats().pages.free, 8);
    // Other keys are unaffected, and a cancel after a reservation leaves no mark.
    ctl.reserve(key(8), 2, Duration::from_secs(30), &[]).await.unwrap();
    ctl.cancel_unsent(key(8)).await.unwrap();
    assert_eq!(srv.buffer().stats().pages.free, 8);
    h.shutdown().await;
}

#[tokio::test]
async fn cancel_mid_transfer_quarantines_until_the_producer_fences() {
    let (srv, h) = server(8).await;
    let mut events = EventStream::connect(h.addr, fp(), 0).await.unwrap();
    let mut ctl = ControlClient::connect(h.addr, fp(), 0).await.unwrap();
    let mut prod = ProducerClient::connect(h.addr, fp(), 0).await.unwrap();
    let k = key(5);
    let addrs = ctl.reserve(k, 2, Duration::from_secs(30), &[]).await.unwrap();
    let page = srv.buffer().page_bytes();
    prod.write_chunk(k, addrs[0].0, addrs[0].1, &vec![1; page]).await.unwrap();
    ctl.cancel(k).await.unwrap();
    let e = next_event(&mut events, |e| matches!(e, RankEvent::Status(_))).await;
    assert!(matches!(e, RankEvent::Status(s) if s.state == TerminalState::Cancelled));
    // The unwritten page waits for the producer; the written one is back already.
    assert_eq!(srv.buffer().stats().pages.quarantined, 1);
    assert_eq!(srv.buffer().stats().pages.free, 7);
    // A late write is refused, not landed.
    let late = prod.write_chunk(k, addrs[1].0, addrs[1].1, &vec![2; page]).await;
    assert!(matches!(late, Err(TransportError::Refused { code: RefusalCode::Stale, .. })), "{late:?}");
    prod.fence(k).await.unwrap();
    let e = next_event(&mut events, |e| matches!(e, RankEvent::Released(_))).await;
    assert!(matches!(e, RankEvent::Released(r) if r.reason == ReleaseReason::Fenced));
    assert_eq!(srv.buffer().stats().pages.free, 8);
    h.shutdown().await;
}

async fn raw_exchange(addr: std::net::SocketAddr, bytes: &[u8]) -> Vec<Frame> {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    // Half-close: the server answers what it read, sees the end and closes.
    s.shutdown().await.unwrap();
    let mut buf = Vec::new();
    // The server answers and closes; read to the end (bounded by the timeout).
    let _ = tokio::time::timeout(WAIT, s.read_to_end(&mut buf)).await;
    let mut frames = Vec::new();
    let mut at = 0;
    while let Ok(Decoded::Frame(f, n)) = decode(&buf[at..]) {
        frames.push(f);
        at += n;
    }
    frames
}

fn frame(f: &Frame) -> Vec<u8> {
    let mut b = Vec::new();
    encode(f, &mut b);
    b
}

#[tokio::test]
async fn hostile_peers_cannot_touch_the_buffer() {
    let (srv, h) = server(8).await;
    // A legitimate request with one chunk written, whose bytes must survive everything below.
    let mut ctl = ControlClient::connect(h.addr, fp(), 0).await.unwrap();
    let mut prod = ProducerClient::connect(h.addr, fp(), 0).await.unwrap();
    let victim = key(1);
    let addrs = ctl.reserve(victim, 2, Duration::from_secs(30), &[]).await.unwrap();
    let page = srv.buffer().page_bytes();
    prod.write_chunk(victim, addrs[0].0, addrs[0].1, &content(7, 0, page)).await.unwrap();
    let before = srv.buffer().stats();

    let hello = |role, geometry, rank| frame(&Frame::Hello(Hello { role, geometry, rank }));
    let mut bad_version = hello(Role::Producer, fp(), 0);
    bad_version[4] = 99;
    let mut oversized = hello(Role::Producer, fp(), 0);
    oversized.extend_from_slice(&u32::MAX.to_le_bytes());
    oversized.extend_from_slice(&[1, 11, 0, 0]);
    let attacker = key(666);
    let mut steal = hello(Role::Producer, fp(), 0);
    steal.extend(frame(&Frame::Chunk {
        key: attacker,
        chunk: 0,
        addr: addrs[1].1,
        offset: 0,
        bytes: vec![0xAA; page],
    }));
    let mut stale = hello(Role::Producer, fp(), 0);
    let old = PageAddr { page: addrs[1].1.page, generation: addrs[1].1.generation.wrapping_sub(1) };
    stale.extend(frame(&Frame::Chunk {
        key: victim,
        chunk: addrs[1].0,
        addr: old,
        offset: 0,
        bytes: vec![0xBB; page],
    }));
    let mut overwrite = hello(Role::Producer, fp(), 0);
    overwrite.extend(frame(&Frame::Chunk {
        key: victim,
        chunk: addrs[0].0,
        addr: addrs[0].1,
        offset: 0,
        bytes: vec![0xCC; page],
    }));
    let mut no_page = hello(Role::Producer, fp(), 0);
    no_page.extend(frame(&Frame::Chunk {
        key: victim,
        chunk: 0,
        addr: PageAddr { page: 4000, generation: 0 },
        offset: 0,
        bytes: vec![0; page],
    }));
    let mut wrong_role_frame = hello(Role::Producer, fp(), 0);
    wrong_role_frame.extend(frame(&Frame::Cancel { key: victim, unsent: true, report: false }));

    // (name, bytes, what the first answer after the welcome must be)
    type Case = (&'static str, Vec<u8>, fn(&Frame) -> bool);
    let cases: Vec<Case> = vec![
        ("unknown version", bad_version, |f| matches!(f, Frame::Error { code: RefusalCode::Version, .. })),
        ("other geometry", hello(Role::Control, fp() ^ 1, 0), |f| {
            matches!(f, Frame::Error { code: RefusalCode::Geometry, .. })
        }),
        ("other rank", hello(Role::Control, fp(), 3), |f| {
            matches!(f, Frame::Error { code: RefusalCode::Geometry, .. })
        }),
        ("garbage", b"GET / HTTP/1.1\r\n\r\n".to_vec(), |f| matches!(f, Frame::Error { .. })),
        ("oversized frame", oversized, |f| matches!(f, Frame::Error { code: RefusalCode::BadRequest, .. })),
        ("page of another request", steal, |f| {
            matches!(f, Frame::Refused { code: RefusalCode::NotOwner, .. })
        }),
        ("stale generation", stale, |f| matches!(f, Frame::Refused { code: RefusalCode::Stale, .. })),
        ("rewrite of a filled chunk", overwrite, |f| matches!(f, Frame::ChunkAck { duplicate: true, .. })),
        ("page out of range", no_page, |f| matches!(f, Frame::Refused { code: RefusalCode::BadRequest, .. })),
        ("control frame on a producer connection", wrong_role_frame, |f| {
            matches!(f, Frame::Error { code: RefusalCode::BadRequest, .. })
        }),
    ];
    for (name, bytes, ok) in cases {
        let frames = raw_exchange(h.addr, &bytes).await;
        let answer = frames.iter().find(|f| !matches!(f, Frame::Welcome { .. }));
        assert!(answer.is_some_and(ok), "{name}: {frames:?}");
    }
    assert_eq!(srv.buffer().stats(), before, "a hostile frame changed the accounting");
    srv.buffer().check_invariants().unwrap();
    // The victim completes with its own bytes.
    prod.write_chunk(victim, addrs[1].0, addrs[1].1, &content(8, 0, page)).await.unwrap();
    let Ok(ready) = srv.take(victim).unwrap().try_ready() else { panic!("victim not ready") };
    let c = ready.consume().unwrap();
    let mut got = vec![0; page];
    c.read_chunk(0, &mut got).unwrap();
    assert_eq!(got, content(7, 0, page));
    c.read_chunk(1, &mut got).unwrap();
    assert_eq!(got, content(8, 0, page));
    drop(c);
    assert_eq!(srv.buffer().stats().pages.free, 8);
    h.shutdown().await;
}

#[test]
fn geometry_fingerprint_is_what_peers_compare() {
    assert_ne!(tiny().fingerprint(), KvGeometry::new(1, 1, 8, 1, 8, 1).unwrap().fingerprint());
}

/// The same-host path: chunks written through the rank's shared-memory export land byte for byte,
/// grants are checked like socket writes, an abandoned grant aborts cleanly, and the export file is
/// removed with the buffer.
#[tokio::test]
async fn same_host_producer_writes_through_shared_memory() {
    use baton_dataplane::device::shm::ShmDevice;
    let (sink, tx) = RankServer::<ShmDevice>::sink();
    let buf = RankBuffer::new(
        Arc::new(ShmDevice::default()),
        tiny(),
        0,
        8,
        BufferOptions::default(),
        Arc::new(SystemClock),
        sink,
    )
    .unwrap();
    let export = buf.export().unwrap();
    assert!(std::path::Path::new(&export).exists());
    let srv = RankServer::new(buf, 1, tx);
    let h = srv.start(TcpListener::bind("127.0.0.1:0").await.unwrap()).unwrap();
    let fp = fp();
    let mut ctl = ControlClient::connect(h.addr, fp, 0).await.unwrap();
    let mut prod = ProducerClient::connect(h.addr, fp, 0).await.unwrap();
    assert_eq!(prod.welcome.export, export);
    prod.use_shared_memory().unwrap();
    let k = key(1);
    let addrs = ctl.reserve(k, 3, Duration::from_secs(30), &[]).await.unwrap();
    let page = srv.buffer().page_bytes();
    // A grant with a stale generation is refused before any byte is written.
    let stale = PageAddr { page: addrs[0].1.page, generation: addrs[0].1.generation.wrapping_add(1) };
    let r = prod.write_chunk(k, addrs[0].0, stale, &vec![9; page]).await;
    assert!(matches!(r, Err(TransportError::Refused { code: RefusalCode::Stale, .. })), "{r:?}");
    // A producer that is granted a chunk and vanishes: its grant aborts, the chunk can be written again.
    {
        let mut io = baton_dataplane::transport::FrameIo::new(TcpStream::connect(h.addr).await.unwrap());
        io.write(&Frame::Hello(Hello { role: Role::Producer, geometry: fp, rank: 0 })).await.unwrap();
        let _welcome = io.read().await.unwrap();
        io.write(&Frame::Grant { key: k, chunk: addrs[0].0, addr: addrs[0].1 }).await.unwrap();
        assert!(matches!(io.read().await.unwrap(), Some(Frame::Granted { .. })));
        drop(io);
    }
    for (c, a) in &addrs {
        // Retried until the vanished producer's connection has been noticed and its grant dropped.
        let bytes = content(u64::from(*c), 0, page);
        let mut tries = 0;
        loop {
            match prod.write_chunk(k, *c, *a, &bytes).await {
                Ok(dup) => {
                    assert!(!dup);
                    break;
                }
                Err(TransportError::Refused { code: RefusalCode::BadRequest, .. }) if tries < 100 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(e) => panic!("chunk {c}: {e}"),
            }
        }
    }
    // Once in, a repeated write is a duplicate.
    assert!(prod.write_chunk(k, addrs[1].0, addrs[1].1, &vec![0; page]).await.unwrap());
    let Ok(ready) = srv.take(k).unwrap().try_ready() else { panic!("not ready") };
    let c = ready.consume().unwrap();
    for chunk in 0..3 {
        let mut got = vec![0; page];
        c.read_chunk(chunk, &mut got).unwrap();
        assert_eq!(got, content(u64::from(chunk), 0, page), "chunk {chunk}");
    }
    drop(c);
    assert_eq!(srv.buffer().stats().pages.free, 8);

    // A producer that reserves for itself through the export: the grants name chunks, and land in
    // the reservation's own pages (the offset the rank resolved). Another reservation holding the
    // first pages makes the new one's pages differ from its chunk numbers.
    ctl.reserve(key(2), 2, Duration::from_secs(30), &[]).await.unwrap();
    let k = key(3);
    prod.queue_reserve(k, 3, Duration::from_secs(30));
    for chunk in 0..3 {
        let bytes = content(u64::from(chunk) + 10, 0, page);
        prod.queue_chunk(k, chunk, PageAddr::BY_CHUNK, &bytes).await.unwrap();
    }
    assert_eq!(prod.finish(Some(k)).await.unwrap(), 0);
    let Ok(ready) = srv.take(k).unwrap().try_ready() else { panic!("not ready") };
    let c = ready.consume().unwrap();
    for chunk in 0..3 {
        let mut got = vec![0; page];
        c.read_chunk(chunk, &mut got).unwrap();
        assert_eq!(got, content(u64::from(chunk) + 10, 0, page), "chunk {chunk}");
    }
    drop(c);
    ctl.cancel_unsent(key(2)).await.unwrap();
    assert_eq!(srv.buffer().stats().pages.free, 8);
    srv.buffer().check_invariants().unwrap();
    h.shutdown().await;
    drop(srv);
    assert!(!std::path::Path::new(&export).exists(), "export file left behind");
}

#[tokio::test]
async fn shared_memory_needs_an_export() {
    let (_srv, h) = server(4).await;
    let mut prod = ProducerClient::connect(h.addr, fp(), 0).await.unwrap();
    assert!(prod.welcome.export.is_empty());
    assert!(prod.use_shared_memory().is_err());
    assert!(!prod.is_shared_memory());
    h.shutdown().await;
}

/// Chunks sent without waiting (more than the window, so the producer also reads answers on the
/// way) and the fence riding with them: every byte lands, the request is ready, and the
/// duplicates of a second pass are counted. A refused chunk in the middle of a pipeline is that
/// call's error.
#[tokio::test]
async fn pipelined_chunks_and_their_fence_land_in_one_pass() {
    use baton_dataplane::transport::PIPELINE_WINDOW;
    let chunks = u32::try_from(PIPELINE_WINDOW).unwrap() + 4;
    let (srv, h) = server(chunks + 2).await;
    let mut ctl = ControlClient::connect(h.addr, fp(), 0).await.unwrap();
    let mut prod = ProducerClient::connect(h.addr, fp(), 0).await.unwrap();
    let page = usize::try_from(ctl.welcome.page_bytes).unwrap();
    let k = key(40);
    let addrs = ctl.reserve(k, chunks, Duration::from_secs(30), &[]).await.unwrap();
    for (c, a) in &addrs {
        prod.send_chunk(k, *c, *a, &content(u64::from(*c), 0, page)).await.unwrap();
    }
    assert_eq!(prod.finish(Some(k)).await.unwrap(), 0);
    // Sent again: every chunk is already there.
    for (c, a) in &addrs {
        prod.send_chunk(k, *c, *a, &content(u64::from(*c), 0, page)).await.unwrap();
    }
    assert_eq!(prod.finish(None).await.unwrap(), chunks);
    let Ok(ready) = srv.take(k).unwrap().try_ready() else { panic!("every chunk is in") };
    let consuming = ready.consume().unwrap();
    let mut got = vec![0u8; page];
    for (c, _) in &addrs {
        consuming.read_chunk(*c, &mut got).unwrap();
        assert_eq!(got, content(u64::from(*c), 0, page), "chunk {c}");
    }
    drop(consuming);

    // A stale address in the middle: the refusal surfaces, from the send or the finish.
    let k2 = key(41);
    let addrs = ctl.reserve(k2, 2, Duration::from_secs(30), &[]).await.unwrap();
    let stale = PageAddr { generation: addrs[1].1.generation + 7, ..addrs[1].1 };
    let mut prod = ProducerClient::connect(h.addr, fp(), 0).await.unwrap();
    let sent = async {
        prod.send_chunk(k2, addrs[0].0, addrs[0].1, &vec![1; page]).await?;
        prod.send_chunk(k2, addrs[1].0, stale, &vec![2; page]).await?;
        prod.finish(Some(k2)).await
    };
    let err = sent.await.unwrap_err();
    assert!(matches!(err, TransportError::Refused { code: RefusalCode::Stale, .. }), "{err:?}");
}

/// Chunks at hand together (`write_chunks`): more than a window of them and the fence in one
/// call land whole and make the request ready; the same again counts every one a duplicate; a
/// stale address among them is the call's refusal.
#[tokio::test]
async fn chunks_written_together_land_with_their_fence() {
    use baton_dataplane::transport::PIPELINE_WINDOW;
    let chunks = u32::try_from(PIPELINE_WINDOW).unwrap() + 5;
    let (srv, h) = server(chunks + 2).await;
    let mut ctl = ControlClient::connect(h.addr, fp(), 0).await.unwrap();
    let mut prod = ProducerClient::connect(h.addr, fp(), 0).await.unwrap();
    let page = usize::try_from(ctl.welcome.page_bytes).unwrap();
    let k = key(42);
    let addrs = ctl.reserve(k, chunks, Duration::from_secs(30), &[]).await.unwrap();
    let pages: Vec<Vec<u8>> = addrs.iter().map(|(c, _)| content(u64::from(*c), 0, page)).collect();
    let batch: Vec<(u32, PageAddr, &[u8])> =
        addrs.iter().zip(&pages).map(|((c, a), p)| (*c, *a, p.as_slice())).collect();
    assert_eq!(prod.write_chunks(k, &batch, true).await.unwrap(), 0);
    assert_eq!(prod.write_chunks(k, &batch, false).await.unwrap(), chunks);
    let Ok(ready) = srv.take(k).unwrap().try_ready() else { panic!("every chunk is in") };
    let consuming = ready.consume().unwrap();
    let mut got = vec![0u8; page];
    for ((c, _), want) in addrs.iter().zip(&pages) {
        consuming.read_chunk(*c, &mut got).unwrap();
        assert_eq!(&got, want, "chunk {c}");
    }
    drop(consuming);

    let k2 = key(43);
    let addrs = ctl.reserve(k2, 2, Duration::from_secs(30), &[]).await.unwrap();
    let stale = PageAddr { generation: addrs[1].1.generation + 7, ..addrs[1].1 };
    let (one, two) = (vec![1; page], vec![2; page]);
    let mut prod = ProducerClient::connect(h.addr, fp(), 0).await.unwrap();
    let err = prod.write_chunks(k2, &[(addrs[0].0, addrs[0].1, &one), (addrs[1].0, stale, &two)], true).await;
    assert!(matches!(err, Err(TransportError::Refused { code: RefusalCode::Stale, .. })), "{err:?}");
}

/// `send_chunk` sends at once (a chunk computed after another is not held back for it): with no
/// `finish`, the rank holds the chunk and the one-chunk request is ready. `queue_chunk` holds its
/// chunk until `flush`.
#[tokio::test]
async fn a_sent_chunk_leaves_at_once_and_a_queued_one_with_the_flush() {
    let (srv, h) = server(4).await;
    let mut ctl = ControlClient::connect(h.addr, fp(), 0).await.unwrap();
    let mut prod = ProducerClient::connect(h.addr, fp(), 0).await.unwrap();
    let page = usize::try_from(ctl.welcome.page_bytes).unwrap();
    let ready_within = |k, ms| srv.take_ready(k, Duration::from_millis(ms));
    let k = key(44);
    let addrs = ctl.reserve(k, 1, Duration::from_secs(30), &[]).await.unwrap();
    prod.send_chunk(k, addrs[0].0, addrs[0].1, &vec![5; page]).await.unwrap();
    ready_within(k, 2_000).await.expect("the sent chunk reached the rank");

    let k = key(45);
    let addrs = ctl.reserve(k, 1, Duration::from_secs(30), &[]).await.unwrap();
    prod.queue_chunk(k, addrs[0].0, addrs[0].1, &vec![6; page]).await.unwrap();
    let early = ready_within(k, 200).await;
    assert!(matches!(early, Err(WaitError::TimedOut(..))), "a queued chunk left before the flush: {early:?}");
    prod.flush().await.unwrap();
    ready_within(k, 2_000).await.expect("the flushed chunk reached the rank");
}

/// A rank whose engine waits for the KV says so in its Welcome to the gateway's control
/// connections (a producer is not told: an older one would refuse the flag); one that does not,
/// does not.
#[tokio::test]
async fn the_welcome_says_whether_the_engine_waits_for_the_kv() {
    let (srv, h) = server(4).await;
    assert!(!ControlClient::connect(h.addr, fp(), 0).await.unwrap().welcome.decode_waits);
    srv.set_decode_waits(true);
    assert!(ControlClient::connect(h.addr, fp(), 0).await.unwrap().welcome.decode_waits);
    assert!(!ProducerClient::connect(h.addr, fp(), 0).await.unwrap().welcome.decode_waits);
    assert!(!EventStream::connect(h.addr, fp(), 0).await.unwrap().welcome.decode_waits);
}

/// `take_ready` waits for the last chunk and hands the ready request over; it fails at its deadline
/// for a request the rank never held, as soon as its request is cancelled while it waits, and at its
/// deadline when the KV never completes.
#[tokio::test]
async fn take_ready_waits_for_the_last_chunk_and_no_longer_than_the_request_lives() {
    use baton_dataplane::transport::WaitError;
    let (srv, h) = server(8).await;
    let mut ctl = ControlClient::connect(h.addr, fp(), 0).await.unwrap();
    let mut prod = ProducerClient::connect(h.addr, fp(), 0).await.unwrap();
    let page = usize::try_from(ctl.welcome.page_bytes).unwrap();

    // Never reserved: waited for (it may come with its producer) until the deadline.
    let t = std::time::Instant::now();
    let out = srv.take_ready(key(50), Duration::from_millis(100)).await.map(|r| r.key());
    assert_eq!(out, Err(WaitError::NotReserved(key(50))));
    assert!(t.elapsed() >= Duration::from_millis(100), "{:?}", t.elapsed());

    // Ready after the wait began.
    let k = key(51);
    let addrs = ctl.reserve(k, 2, Duration::from_secs(30), &[]).await.unwrap();
    let waiter = {
        let srv = Arc::clone(&srv);
        tokio::spawn(async move { srv.take_ready(k, WAIT).await.map(|r| r.key()) })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiter.is_finished(), "it waits while a chunk is missing");
    for (c, a) in &addrs {
        prod.send_chunk(k, *c, *a, &vec![3; page]).await.unwrap();
    }
    prod.finish(Some(k)).await.unwrap();
    assert_eq!(tokio::time::timeout(WAIT, waiter).await.unwrap().unwrap(), Ok(k));
    assert!(srv.take(k).is_none(), "taken by the waiter");

    // Cancelled while it waits: the wait ends at once, not at its deadline.
    let k = key(52);
    ctl.reserve(k, 2, Duration::from_secs(30), &[]).await.unwrap();
    let waiter = {
        let srv = Arc::clone(&srv);
        tokio::spawn(async move { srv.take_ready(k, Duration::from_secs(30)).await.map(|r| r.key()) })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let t = std::time::Instant::now();
    ctl.cancel_unsent(k).await.unwrap();
    let out = tokio::time::timeout(WAIT, waiter).await.unwrap().unwrap();
    assert_eq!(out, Err(WaitError::Closed(k, baton_dataplane::LeaseError::Closed(TerminalState::Cancelled))));
    assert!(t.elapsed() < Duration::from_secs(2), "woken by the cancel: {:?}", t.elapsed());

    // Never complete: the deadline.
    let k = key(53);
    ctl.reserve(k, 2, Duration::from_secs(30), &[]).await.unwrap();
    let out = srv.take_ready(k, Duration::from_millis(100)).await.map(|r| r.key());
    assert_eq!(out, Err(WaitError::TimedOut(k, Duration::from_millis(100))));
    assert!(srv.take(k).is_some(), "a wait that timed out leaves the reservation where it was");
    assert_eq!(ctl.info().await.unwrap().pages_free, 6);

    // Its lease runs out while it waits: said as an expiry.
    let k = key(54);
    ctl.reserve(k, 2, Duration::from_millis(150), &[]).await.unwrap();
    let out = srv.take_ready(k, Duration::from_secs(30)).await.map(|r| r.key());
    assert_eq!(out, Err(WaitError::Closed(k, baton_dataplane::LeaseError::Expired)));

    // Ended before the wait began (a decode request that came late): said at once, not waited
    // for until the deadline as a reservation still on its way would be.
    let t = std::time::Instant::now();
    let out = srv.take_ready(k, Duration::from_secs(30)).await.map(|r| r.key());
    assert_eq!(out, Err(WaitError::Closed(k, baton_dataplane::LeaseError::Expired)));
    let k = key(55);
    ctl.reserve(k, 2, Duration::from_secs(30), &[]).await.unwrap();
    ctl.cancel(k).await.unwrap();
    let cancelled = baton_dataplane::LeaseError::Closed(TerminalState::Cancelled);
    let out = tokio::time::timeout(WAIT, async {
        loop {
            // The cancel's status reaches the server's own bookkeeping a moment after its answer.
            match srv.take_ready(k, Duration::from_millis(20)).await.map(|r| r.key()) {
                Err(WaitError::TimedOut(..)) => continue,
                other => return other,
            }
        }
    })
    .await
    .unwrap();
    assert_eq!(out, Err(WaitError::Closed(k, cancelled)));
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());

    // Ready, then cancelled (its client left) before the decode request came: a ready
    // reservation's cancel says nothing more on the feed but its release, and the late wait still
    // ends at once (a decoder with several ranks takes them in turn, so it can come late to one).
    let k = key(56);
    let addrs = ctl.reserve(k, 2, Duration::from_secs(30), &[]).await.unwrap();
    for (c, a) in &addrs {
        prod.send_chunk(k, *c, *a, &vec![5; page]).await.unwrap();
    }
    prod.finish(Some(k)).await.unwrap();
    ctl.cancel(k).await.unwrap();
    let t = std::time::Instant::now();
    let out = srv.take_ready(k, Duration::from_secs(30)).await.map(|r| r.key());
    assert_eq!(out, Err(WaitError::Closed(k, cancelled)));
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}

/// A producer that reserves for itself: the Reserve and its chunks, named by chunk, leave in one
/// write and are answered in one; the pages are the reservation's own, and the decode side
/// waiting before the reservation came takes it once the KV is in.
#[tokio::test]
async fn a_producer_reserves_for_itself_and_writes_by_chunk_in_one_round_trip() {
    let (srv, h) = server(8).await;
    let mut ctl = ControlClient::connect(h.addr, fp(), 0).await.unwrap();
    let mut prod = ProducerClient::connect(h.addr, fp(), 0).await.unwrap();
    let page = usize::try_from(prod.welcome.page_bytes).unwrap();
    let k = key(60);
    let waiter = {
        let srv = Arc::clone(&srv);
        tokio::spawn(async move { srv.take_ready(k, WAIT).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiter.is_finished(), "it waits for a reservation that is not here yet");
    prod.queue_reserve(k, 3, Duration::from_secs(30));
    for c in 0..3 {
        prod.queue_chunk(k, c, PageAddr::BY_CHUNK, &content(u64::from(c), 0, page)).await.unwrap();
    }
    assert_eq!(prod.finish(Some(k)).await.unwrap(), 0);
    let ready = tokio::time::timeout(WAIT, waiter).await.unwrap().unwrap().unwrap();
    assert_eq!(ready.key(), k);
    assert_eq!(ctl.info().await.unwrap().pages_free, 5, "the three pages are the reservation's");
    drop(ready);

    // A chunk named by chunk for a key this rank does not hold is refused, and writes nothing.
    let mut prod = ProducerClient::connect(h.addr, fp(), 0).await.unwrap();
    let err = prod.write_chunk(key(61), 0, PageAddr::BY_CHUNK, &vec![1; page]).await.unwrap_err();
    assert!(matches!(err, TransportError::Refused { code: RefusalCode::Closed, .. }), "{err}");
    // One past the reservation's chunks: refused as not its page.
    let mut prod = ProducerClient::connect(h.addr, fp(), 0).await.unwrap();
    prod.queue_reserve(key(62), 1, Duration::from_secs(30));
    prod.queue_chunk(key(62), 1, PageAddr::BY_CHUNK, &vec![1; page]).await.unwrap();
    let err = prod.finish(None).await.unwrap_err();
    assert!(matches!(err, TransportError::Refused { code: RefusalCode::NotOwner, .. }), "{err}");
}

/// A producer's Reserve that does not fit is refused as `Busy` with the numbers, before any of its
/// chunks is written; a key cancelled before its producer reserved is refused, and the decode side
/// waiting for it learns at once; `cancel_held` says whether the rank held the key.
#[tokio::test]
async fn a_producer_reservation_refused_or_cancelled_first_holds_nothing() {
    let (srv, h) = server(4).await;
    let mut ctl = ControlClient::connect(h.addr, fp(), 0).await.unwrap();
    let page = usize::try_from(ctl.welcome.page_bytes).unwrap();
    ctl.reserve(key(70), 3, Duration::from_secs(30), &[]).await.unwrap();

    let mut prod = ProducerClient::connect(h.addr, fp(), 0).await.unwrap();
    prod.queue_reserve(key(71), 2, Duration::from_secs(30));
    for c in 0..2 {
        prod.queue_chunk(key(71), c, PageAddr::BY_CHUNK, &vec![1; page]).await.unwrap();
    }
    match prod.finish(Some(key(71))).await.unwrap_err() {
        TransportError::Refused { code: RefusalCode::Busy, need, have, .. } => {
            assert_eq!((need, have), (2, 1))
        }
        other => panic!("{other}"),
    }
    assert_eq!(ctl.info().await.unwrap().pages_free, 1);

    // Cancelled (by the gateway, say) before the producer's Reserve came: the waiting decode ends
    // at once, the rank says it held nothing, and the Reserve that follows is refused.
    let k = key(72);
    let waiter = {
        let srv = Arc::clone(&srv);
        tokio::spawn(async move { srv.take_ready(k, Duration::from_secs(30)).await.map(|r| r.key()) })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let t = std::time::Instant::now();
    assert!(!ctl.cancel_held(k, false).await.unwrap(), "nothing of it was held");
    let out = tokio::time::timeout(WAIT, waiter).await.unwrap().unwrap();
    assert_eq!(out, Err(WaitError::Closed(k, baton_dataplane::LeaseError::Closed(TerminalState::Cancelled))));
    assert!(t.elapsed() < Duration::from_secs(2), "woken by the cancel: {:?}", t.elapsed());
    let mut prod = ProducerClient::connect(h.addr, fp(), 0).await.unwrap();
    prod.queue_reserve(k, 1, Duration::from_secs(30));
    let err = prod.finish(None).await.unwrap_err();
    assert!(matches!(err, TransportError::Refused { code: RefusalCode::Closed, .. }), "{err}");

    // A held key: said so, and its pages come back.
    assert!(ctl.cancel_held(key(70), true).await.unwrap());
    assert_eq!(ctl.info().await.unwrap().pages_free, 4);

    // A producer that gave up fences on another connection, which may overtake its Reserve: the
    // Reserve that comes after the fence is refused, and holds nothing.
    let k = key(73);
    ProducerClient::connect(h.addr, fp(), 0).await.unwrap().fence(k).await.unwrap();
    let mut prod = ProducerClient::connect(h.addr, fp(), 0).await.unwrap();
    prod.queue_reserve(k, 1, Duration::from_secs(30));
    prod.queue_chunk(k, 0, PageAddr::BY_CHUNK, &vec![1; page]).await.unwrap();
    let err = prod.finish(None).await.unwrap_err();
    assert!(matches!(err, TransportError::Refused { code: RefusalCode::Closed, .. }), "{err}");
    assert_eq!(ctl.info().await.unwrap().pages_free, 4);
}
