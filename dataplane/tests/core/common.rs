use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_dataplane::device::Device;
use baton_dataplane::device::cpu::CpuDevice;
use baton_dataplane::{
    BufferOptions, KvGeometry, ManualClock, PagesReleased, QueueSink, RankBuffer, RankEvent, RankStatus,
    RequestId, RequestKey,
};

/// A geometry with 64-byte pages: 1 layer, 1 head of 8 bytes, 4 tokens per chunk.
pub(crate) fn tiny() -> KvGeometry {
    KvGeometry::new(1, 1, 8, 1, 4, 1).unwrap()
}

pub(crate) const QUARANTINE: Duration = Duration::from_secs(2);

pub(crate) struct Rig<D: Device = CpuDevice> {
    pub(crate) clock: Arc<ManualClock>,
    pub(crate) sink: Arc<QueueSink>,
    pub(crate) buf: RankBuffer<D>,
}

impl Rig {
    pub(crate) fn new(pages: u32) -> Self {
        Self::with_clock(pages, 0, Arc::new(ManualClock::new()))
    }

    pub(crate) fn with_clock(pages: u32, rank: u32, clock: Arc<ManualClock>) -> Self {
        Rig::with_device(Arc::new(CpuDevice), pages, rank, clock)
    }
}

impl<D: Device> Rig<D> {
    /// A rank's buffer on `device`.
    pub(crate) fn with_device(device: Arc<D>, pages: u32, rank: u32, clock: Arc<ManualClock>) -> Self {
        let sink = Arc::new(QueueSink::new());
        let options = BufferOptions { quarantine_ttl: QUARANTINE, max_requests: 1024 };
        let buf = RankBuffer::new(device, tiny(), rank, pages, options, clock.clone(), sink.clone()).unwrap();
        Self { clock, sink, buf }
    }

    pub(crate) fn lease(&self, secs: u64) -> Instant {
        self.buf.now() + Duration::from_secs(secs)
    }

    pub(crate) fn free(&self) -> u32 {
        self.buf.stats().pages.free
    }

    /// Events drained, split into statuses and releases.
    pub(crate) fn drain(&self) -> (Vec<RankStatus>, Vec<PagesReleased>) {
        let mut s = Vec::new();
        let mut r = Vec::new();
        for e in self.sink.drain() {
            match e {
                RankEvent::Status(x) => s.push(x),
                RankEvent::Released(x) => r.push(x),
            }
        }
        (s, r)
    }
}

pub(crate) fn key(i: u128) -> RequestKey {
    RequestKey::new(RequestId(i), 0)
}

/// Deterministic page bytes for a content id on a rank: what a prefiller derives from the tokens.
pub(crate) fn content(id: u64, rank: u32, len: usize) -> Vec<u8> {
    let mut x = id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(rank).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}
