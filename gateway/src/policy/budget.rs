//! Call budgets in CPU time.
//!
//! A call's deadline is CPU time used on its own thread, not wall-clock time: on a busy host a
//! thread is preempted for milliseconds at a time, and a wall-clock deadline then cut calls that
//! had used a few microseconds (seen in the e2e tests with a CPU hog beside them: a 1 µs Rust
//! decision faulted at the 5 ms deadline, and a plugin can be switched off by such faults). A
//! runaway plugin still burns CPU at full speed, so it is cut as quickly as before. A wall-clock
//! cap stays as a backstop: `2 × budget + WALL_SLACK`.
//!
//! The thread's CPU clock costs a system call (about 0.7 µs here, as much as a whole decision),
//! so a call does not read it when it starts. The epoch ticker's first tick during the call
//! (at most one tick of running in) reads the baseline; the time before it is counted as CPU, up
//! to two ticks. Calls shorter than a tick, nearly all of them, never read the clock.

use std::time::{Duration, Instant};

use wasmtime::UpdateDeadline;

use super::EPOCH_TICK;

/// Wall-clock time past twice the CPU budget after which a call is cut whatever CPU it used.
pub const WALL_SLACK: Duration = Duration::from_millis(250);

/// The longest a call with this CPU budget can take in wall-clock time.
pub fn wall_cap(cpu: Duration) -> Duration {
    cpu.saturating_mul(2).saturating_add(WALL_SLACK)
}

/// Epoch ticks covering `d`, rounded up, plus one for the partial tick in progress.
pub(super) fn ticks(d: Duration) -> u64 {
    let t = EPOCH_TICK.as_micros().max(1);
    u64::try_from(d.as_micros().div_ceil(t)).unwrap_or(u64::MAX).saturating_add(1)
}

/// One call's budget, kept in the store and consulted at each epoch deadline.
#[derive(Debug, Clone, Copy)]
pub(super) struct Budget {
    cpu: Duration,
    started: Instant,
    /// The thread's CPU clock at the first tick, and the time counted as used before it.
    base: Option<(Duration, Duration)>,
}

impl Budget {
    /// A budget starting now. Arm the store's deadline one tick out ([`Budget::FIRST_TICKS`]).
    pub(super) fn new(cpu: Duration) -> Self {
        Self { cpu, started: Instant::now(), base: None }
    }

    /// Epoch ticks until the first check.
    pub(super) const FIRST_TICKS: u64 = 1;

    /// Whether the call goes on (and how many ticks until the next check) or is cut.
    pub(super) fn check(&mut self) -> UpdateDeadline {
        self.check_with(self.started.elapsed(), thread_cpu())
    }

    fn check_with(&mut self, elapsed: Duration, cpu_now: Duration) -> UpdateDeadline {
        if elapsed >= wall_cap(self.cpu) {
            return UpdateDeadline::Interrupt;
        }
        let used = match self.base {
            Some((base, before)) => before.saturating_add(cpu_now.saturating_sub(base)),
            None => {
                let before = elapsed.min(EPOCH_TICK * 2);
                self.base = Some((cpu_now, before));
                before
            }
        };
        match self.cpu.checked_sub(used) {
            Some(left) if !left.is_zero() => UpdateDeadline::Continue(ticks(left)),
            _ => UpdateDeadline::Interrupt,
        }
    }
}

/// CPU time the calling thread has used.
fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(u64::try_from(t.tv_sec).unwrap_or(0), u32::try_from(t.tv_nsec).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn cut(u: &UpdateDeadline) -> bool {
        matches!(u, UpdateDeadline::Interrupt)
    }

    #[test]
    fn preemption_does_not_count_but_running_does() {
        let mut b = Budget::new(ms(5));
        // First tick after 40 ms of wall time (the thread was preempted): only two ticks count.
        assert!(!cut(&b.check_with(ms(40), ms(100))));
        // 60 ms of wall time later, 1 ms more CPU: 1.5 ms used in all.
        assert!(!cut(&b.check_with(ms(100), ms(101))));
        // Running flat out from there: cut once 5 ms of CPU are used.
        assert!(!cut(&b.check_with(ms(103), ms(104))));
        assert!(cut(&b.check_with(ms(105), ms(100) + ms(5) - EPOCH_TICK * 2)));
    }

    #[test]
    fn the_next_check_comes_when_the_rest_of_the_budget_could_be_spent() {
        let mut b = Budget::new(ms(5));
        let next = b.check_with(EPOCH_TICK, ms(7));
        assert!(matches!(next, UpdateDeadline::Continue(n) if n == ticks(ms(5) - EPOCH_TICK)));
    }

    #[test]
    fn the_wall_clock_cap_cuts_a_starved_call() {
        let mut b = Budget::new(ms(5));
        assert!(!cut(&b.check_with(ms(1), ms(0))));
        assert!(cut(&b.check_with(wall_cap(ms(5)), ms(1))));
    }

    #[test]
    fn the_thread_clock_moves_with_work_only() {
        let a = thread_cpu();
        std::thread::sleep(ms(30));
        let slept = thread_cpu().saturating_sub(a);
        assert!(slept < ms(10), "a sleeping thread used {slept:?} of CPU");
        let start = Instant::now();
        let mut x = 0u64;
        while start.elapsed() < ms(30) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        assert!(thread_cpu().saturating_sub(a) >= ms(5), "spinning for 30 ms used no CPU");
    }
}
