//! How a rank times one run of its program, for the pipeline's idle shares.
//!
//! [`Clock::Wall`] is real time: a rank's waits are the time it spent blocked in `recv`.
//! [`Clock::Cpu`] times a rank by its thread's CPU time and stamps every message with the
//! sender's reading; a rank that receives a message stamped later than its own reading moves its
//! clock forward to the stamp, and counts the difference as waiting (Lamport's logical clock,
//! with CPU time for the local ticks). The idle shares it gives are those the run would have if
//! every rank had a core of its own, on a machine with fewer cores than ranks: a rank's work is
//! timed only while it runs, and its waits follow from when its messages were sent, not from
//! when the operating system scheduled it. It times a rank correctly when the rank runs its
//! kernels on one thread (the one that runs the program) and meets no other rank in a
//! collective (whose waits it does not see); `Trainer::set_clock` refuses other plans.

use std::time::{Duration, Instant};

use crate::RuntimeError;

#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum Clock {
    #[default]
    Wall,
    Cpu,
}

impl Clock {
    pub fn parse(name: &str) -> Option<Clock> {
        match name {
            "wall" => Some(Clock::Wall),
            "cpu" => Some(Clock::Cpu),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Clock::Wall => "wall",
            Clock::Cpu => "cpu",
        }
    }
}

/// What one run of a program took by its rank's clock.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct RunTime {
    /// From the start of the run to its end.
    pub length: Duration,
    /// The part of it spent waiting for other ranks' messages.
    pub waited: Duration,
}

impl RunTime {
    /// The time the rank worked.
    pub fn busy(&self) -> Duration {
        self.length.saturating_sub(self.waited)
    }
}

/// A rank's clock during one run of its program.
pub(crate) struct RankClock {
    clock: Clock,
    wall_start: Instant,
    cpu_start: Duration,
    waited: Duration,
}

impl RankClock {
    /// Starts timing a run on the calling thread.
    pub fn start(clock: Clock) -> Result<RankClock, RuntimeError> {
        let cpu_start = match clock {
            Clock::Wall => Duration::ZERO,
            Clock::Cpu => thread_cpu_time()?,
        };
        Ok(RankClock { clock, wall_start: Instant::now(), cpu_start, waited: Duration::ZERO })
    }

    /// The time since the run started, waits included: what a message sent now is stamped with.
    pub fn now(&self) -> Result<Duration, RuntimeError> {
        Ok(match self.clock {
            Clock::Wall => self.wall_start.elapsed(),
            Clock::Cpu => thread_cpu_time()?.saturating_sub(self.cpu_start) + self.waited,
        })
    }

    /// Accounts for a message received after blocking for `blocked` (real time), stamped
    /// `sent_at` by its sender's clock.
    pub fn received(&mut self, sent_at: Duration, blocked: Duration) -> Result<(), RuntimeError> {
        match self.clock {
            Clock::Wall => self.waited += blocked,
            Clock::Cpu => self.waited += sent_at.saturating_sub(self.now()?),
        }
        Ok(())
    }

    /// Accounts for `waited` that a device's stream spent waiting for messages (a GPU's receives
    /// over NCCL, timed by its events: the host did not block for them).
    pub fn waited_on_device(&mut self, waited: Duration) {
        self.waited += waited;
    }

    pub fn finish(&self) -> Result<RunTime, RuntimeError> {
        Ok(RunTime { length: self.now()?, waited: self.waited })
    }
}

/// The CPU time the calling thread has used.
#[cfg(unix)]
fn thread_cpu_time() -> Result<Duration, RuntimeError> {
    let mut time = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `time` is a valid timespec for the call to fill.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut time) } != 0 {
        return Err(RuntimeError::ThreadCpuTime(std::io::Error::last_os_error()));
    }
    Ok(Duration::new(time.tv_sec as u64, time.tv_nsec as u32))
}

#[cfg(not(unix))]
fn thread_cpu_time() -> Result<Duration, RuntimeError> {
    Err(RuntimeError::ThreadCpuTime(std::io::Error::new(std::io::ErrorKind::Unsupported, "it needs Unix")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Under the CPU clock a message stamped after the receiver's reading moves its clock to the
    /// stamp; one stamped before costs nothing, however long the thread was blocked.
    #[test]
    fn the_cpu_clock_waits_for_later_stamps_only() -> Result<(), RuntimeError> {
        let mut clock = RankClock::start(Clock::Cpu)?;
        let early = clock.now()?;
        clock.received(Duration::ZERO, Duration::from_secs(1))?;
        assert_eq!(clock.waited, Duration::ZERO);
        let ahead = early + Duration::from_secs(3);
        clock.received(ahead, Duration::ZERO)?;
        let run = clock.finish()?;
        assert!(run.length >= ahead && run.length < ahead + Duration::from_millis(100), "{run:?}");
        assert!(run.waited > Duration::from_millis(2900) && run.waited <= Duration::from_secs(3), "{run:?}");
        assert!(run.busy() < Duration::from_millis(100), "{run:?}");
        Ok(())
    }

    /// Under the wall clock a wait is the time blocked; stamps do not matter.
    #[test]
    fn the_wall_clock_counts_the_time_blocked() -> Result<(), RuntimeError> {
        let mut clock = RankClock::start(Clock::Wall)?;
        clock.received(Duration::from_secs(10), Duration::from_millis(5))?;
        let run = clock.finish()?;
        assert_eq!(run.waited, Duration::from_millis(5));
        Ok(())
    }
}
