//! The simulated engine's own paged KV cache blocks: a pool and a guard that returns them on drop.

use std::sync::{Arc, Mutex};

/// A fixed pool of engine cache blocks.
#[derive(Debug)]
pub struct BlockPool {
    total: u32,
    free: Mutex<Vec<u32>>,
}

/// Blocks held for one request; returned to the pool when dropped.
#[derive(Debug)]
pub struct Blocks {
    pool: Arc<BlockPool>,
    ids: Vec<u32>,
}

impl BlockPool {
    pub fn new(total: u32) -> Arc<Self> {
        Arc::new(Self { total, free: Mutex::new((0..total).rev().collect()) })
    }

    /// `n` blocks, or `None` when fewer are free (all or nothing).
    pub fn alloc(self: &Arc<Self>, n: usize) -> Option<Blocks> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() < n {
            return None;
        }
        let at = free.len() - n;
        let ids = free.split_off(at);
        Some(Blocks { pool: Arc::clone(self), ids })
    }

    pub fn total(&self) -> u32 {
        self.total
    }

    pub fn held(&self) -> u32 {
        let free = self.free.lock().unwrap_or_else(|e| e.into_inner()).len();
        self.total.saturating_sub(u32::try_from(free).unwrap_or(u32::MAX))
    }
}

impl Blocks {
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}

impl Drop for Blocks {
    fn drop(&mut self) {
        let mut free = self.pool.free.lock().unwrap_or_else(|e| e.into_inner());
        free.extend(self.ids.drain(..));
    }
}
