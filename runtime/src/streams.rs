//! Where a program's instructions run: the streams of a device and the events that order them.
//!
//! A rank's device has three streams that schedules use, each running what it is given in order:
//! - [`Stream::Compute`]: kernels, GEMMs, the optimizer step and receives;
//! - [`Stream::Collectives`]: every collective, in program order (one stream, so NCCL sees
//!   each communicator's operations in the same order on every rank). Those a program starts
//!   (ZeRO-3 prefetch, gradient buckets) overlap the compute stream's work until their waits;
//!   a blocking one is a start whose wait follows at once;
//! - [`Stream::Peer`]: pipeline sends, so a send never holds up the stage's compute (with
//!   synchronous sends, two stages sending to each other before receiving would deadlock, which
//!   1F1B's steady state does; Megatron pairs them with `batch_isend_irecv` for this reason).
//!
//! and a fourth, [`Stream::Transfer`], that a GPU device keeps to itself: over NCCL a send is a
//! copy into a staging buffer on the peer stream, then the NCCL send from there on the transfer
//! stream (NCCL's send returns only once the peer receives, so nothing a schedule orders may wait
//! for it).
//!
//! [`StreamSchedule::of`] turns the instruction list into stream operations: launches, and
//! events recorded on one stream and waited on by another. A start waits on the compute stream's
//! event (its input is made there), its wait makes the compute stream wait on the collective's
//! event; a send waits on the compute stream, and the first later instruction that overwrites
//! the bytes being sent (the memory plan reuses regions) waits for the send. At the end of a run
//! the device synchronises every stream.
//!
//! The CPU device ([`crate::Executor`]) and the CUDA device run the same schedule: on the CPU
//! the compute and peer streams are the calling thread (a send copies its bytes before it
//! returns) and the collectives stream is the rank's communication thread, but for blocking
//! collectives, which the calling thread runs itself: communicators run a group's collectives
//! in sequence-number order, so it still runs after those started before it, and it is done
//! before anything later starts. On a GPU the streams are CUDA streams and events. [`StreamSchedule::check`] proves the schedule race-free: every two
//! instructions on different streams that touch overlapping bytes (one writing) are ordered by
//! the events (vector clocks), so a device that honours streams and events computes what the
//! instructions compute in program order. Every schedule is checked when a program loads.

use crate::RuntimeError;
use autotp_program::Collective;
use autotp_program::{Instruction, Program, Region};

/// A stream of a rank's device.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Stream {
    Compute,
    Collectives,
    Peer,
    /// A GPU's NCCL sends of pipeline messages (see the module doc); no schedule uses it.
    Transfer,
}

/// Per stream, a count (the vector clocks of [`StreamSchedule::check`]).
type Counts = [usize; Stream::ALL.len()];

impl Stream {
    pub const ALL: [Stream; 4] = [Stream::Compute, Stream::Collectives, Stream::Peer, Stream::Transfer];

    fn index(self) -> usize {
        self as usize
    }

    pub fn name(self) -> &'static str {
        match self {
            Stream::Compute => "compute",
            Stream::Collectives => "collectives",
            Stream::Peer => "peer",
            Stream::Transfer => "transfer",
        }
    }
}

/// One operation of a schedule. Events are numbered from 0 in the order they are recorded.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum StreamOp {
    /// Runs instruction `instruction` (an index into the program's list) on `stream`.
    Launch { stream: Stream, instruction: usize },
    /// Records event `event` on `stream`: it completes when everything launched there so far has.
    Record { stream: Stream, event: usize },
    /// Makes `stream` wait until event `event` has completed before it runs anything launched
    /// after this.
    Wait { stream: Stream, event: usize },
}

/// A program's instructions as stream operations (see the module doc).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamSchedule {
    pub ops: Vec<StreamOp>,
    pub events: usize,
}

impl StreamSchedule {
    /// The schedule of `program` (which `Program::validate` has accepted), checked race-free.
    pub fn of(program: &Program) -> Result<StreamSchedule, RuntimeError> {
        let schedule = StreamSchedule::build(program);
        schedule.check(program)?;
        Ok(schedule)
    }

    fn build(program: &Program) -> StreamSchedule {
        let mut schedule = StreamSchedule { ops: Vec::new(), events: 0 };
        // The event each start's collective completes with, for its wait.
        let mut finished: Vec<Option<usize>> = vec![None; program.instructions.len()];
        // Sends not yet waited for: (the region sent, the event its send completes with).
        let mut sending: Vec<(Region, usize)> = Vec::new();
        for (index, instruction) in program.instructions.iter().enumerate() {
            let (reads, writes) = instruction.regions();
            let stream = match instruction {
                // A shard slice meets no other rank: it is a copy.
                Instruction::Collective { op, .. } if matches!(op.kind, Collective::ShardSlice { .. }) => {
                    Stream::Compute
                }
                Instruction::Collective { .. } | Instruction::CollectiveStart { .. } => Stream::Collectives,
                Instruction::Send { .. } => Stream::Peer,
                _ => Stream::Compute,
            };
            // An instruction that overwrites bytes still being sent waits for the send. Once
            // the compute stream has waited, every later instruction is ordered after the send
            // (those on other streams wait for the compute stream before they start).
            sending.retain(|(region, event)| {
                let overwritten = writes.iter().any(|w| w.overlaps(region));
                if overwritten {
                    schedule.ops.push(StreamOp::Wait { stream, event: *event });
                }
                !(overwritten && stream == Stream::Compute)
            });
            if stream != Stream::Compute {
                let made = schedule.record(Stream::Compute);
                schedule.ops.push(StreamOp::Wait { stream, event: made });
            }
            if let Instruction::Wait { start, .. } = instruction {
                let event = finished[*start].expect("validated: a wait follows its start");
                schedule.ops.push(StreamOp::Wait { stream: Stream::Compute, event });
            }
            schedule.ops.push(StreamOp::Launch { stream, instruction: index });
            match instruction {
                Instruction::Collective { .. } if stream == Stream::Collectives => {
                    let done = schedule.record(stream);
                    schedule.ops.push(StreamOp::Wait { stream: Stream::Compute, event: done });
                }
                Instruction::CollectiveStart { .. } => finished[index] = Some(schedule.record(stream)),
                Instruction::Send { .. } => {
                    let event = schedule.record(stream);
                    sending.extend(reads.iter().map(|r| (*r, event)));
                }
                _ => {}
            }
        }
        schedule
    }

    fn record(&mut self, stream: Stream) -> usize {
        let event = self.events;
        self.events += 1;
        self.ops.push(StreamOp::Record { stream, event });
        event
    }

    /// Checks that the schedule launches every instruction once, in program order, waits only
    /// for recorded events, and orders every two conflicting instructions on different streams
    /// (the module doc). Within a run: the device synchronises every stream between runs.
    pub fn check(&self, program: &Program) -> Result<(), RuntimeError> {
        let bad = |what: String| Err(RuntimeError::InvalidProgram(format!("stream schedule: {what}")));
        // Per stream, the vector clock of what it has seen: entry `s` counts stream s's
        // launches that happen before the stream's next operation.
        let mut clocks: [Counts; Stream::ALL.len()] = Default::default();
        let mut events: Vec<Option<Counts>> = vec![None; self.events];
        // Per launched instruction: its stream, its position there, the clock it ran with.
        let mut launched: Vec<(usize, Stream, usize, Counts)> = Vec::new();
        for op in &self.ops {
            match *op {
                StreamOp::Launch { stream, instruction } => {
                    if instruction != launched.len() || instruction >= program.instructions.len() {
                        return bad(format!("instruction {instruction} is launched out of program order"));
                    }
                    let clock = &mut clocks[stream.index()];
                    clock[stream.index()] += 1;
                    launched.push((instruction, stream, clock[stream.index()], *clock));
                }
                StreamOp::Record { stream, event } => match events.get_mut(event) {
                    Some(slot @ None) => *slot = Some(clocks[stream.index()]),
                    _ => return bad(format!("event {event} is recorded twice or does not exist")),
                },
                StreamOp::Wait { stream, event } => {
                    let Some(Some(seen)) = events.get(event) else {
                        return bad(format!(
                            "the {} stream waits for event {event} before it is recorded",
                            stream.name()
                        ));
                    };
                    let clock = &mut clocks[stream.index()];
                    for (mine, theirs) in clock.iter_mut().zip(seen) {
                        *mine = (*mine).max(*theirs);
                    }
                }
            }
        }
        if launched.len() != program.instructions.len() {
            return bad(format!(
                "{} of the program's {} instructions are launched",
                launched.len(),
                program.instructions.len()
            ));
        }
        let touches: Vec<(Vec<Region>, Vec<Region>)> = program.instructions.iter().map(Instruction::regions).collect();
        let conflict = |a: usize, b: usize| {
            let ((reads_a, writes_a), (reads_b, writes_b)) = (&touches[a], &touches[b]);
            let meets = |xs: &[Region], ys: &[Region]| xs.iter().any(|x| ys.iter().any(|y| x.overlaps(y)));
            meets(writes_a, writes_b) || meets(writes_a, reads_b) || meets(reads_a, writes_b)
        };
        // Instructions off the compute stream are few: check each against every other stream's.
        for &(a, stream_a, position_a, _) in launched.iter().filter(|l| l.1 != Stream::Compute) {
            for &(b, stream_b, _, clock_b) in &launched[a + 1..] {
                if stream_b != stream_a && clock_b[stream_a.index()] < position_a && conflict(a, b) {
                    return bad(format!(
                        "instruction {b} ({}) on the {} stream may run while instruction {a} ({}) on the {} stream still uses its bytes",
                        program.instructions[b].label(),
                        stream_b.name(),
                        program.instructions[a].label(),
                        stream_a.name()
                    ));
                }
            }
            let clock_a = launched[a].3;
            for &(b, stream_b, position_b, _) in &launched[..a] {
                if stream_b != stream_a && clock_a[stream_b.index()] < position_b && conflict(a, b) {
                    return bad(format!(
                        "instruction {a} ({}) on the {} stream may run before instruction {b} ({}) on the {} stream is done with its bytes",
                        program.instructions[a].label(),
                        stream_a.name(),
                        program.instructions[b].label(),
                        stream_b.name()
                    ));
                }
            }
        }
        Ok(())
    }
}

/// A rank's device as the schedule sees it: streams that run instructions in order, and events
/// between them. The CPU executor implements it; so does the CUDA device.
pub(crate) trait Device {
    /// A recorded event; waiting for it may happen on any stream, any number of times.
    type Event;

    /// Runs instruction `index` of `program` on `stream` (or enqueues it there).
    fn launch(&mut self, program: &Program, index: usize, stream: Stream) -> Result<(), RuntimeError>;

    /// An event that completes when everything launched on `stream` so far has.
    fn record(&mut self, stream: Stream) -> Result<Self::Event, RuntimeError>;

    /// Makes `stream` run nothing launched from now on before `event` has completed.
    fn wait(&mut self, stream: Stream, event: &Self::Event) -> Result<(), RuntimeError>;

    /// Returns once every stream has run everything launched on it.
    fn synchronize(&mut self) -> Result<(), RuntimeError>;

    /// After `error`: stops the rank's collectives with the other ranks and returns once
    /// nothing launched runs any more (their results are dropped).
    fn abort(&mut self, error: &RuntimeError);
}

/// Issues `schedule`'s operations (of `program`) to `device`, without waiting for them.
pub(crate) fn issue<D: Device>(
    device: &mut D,
    program: &Program,
    schedule: &StreamSchedule,
) -> Result<(), RuntimeError> {
    let mut events: Vec<Option<D::Event>> = (0..schedule.events).map(|_| None).collect();
    for op in &schedule.ops {
        match *op {
            StreamOp::Launch { stream, instruction } => device.launch(program, instruction, stream)?,
            StreamOp::Record { stream, event } => events[event] = Some(device.record(stream)?),
            StreamOp::Wait { stream, event } => {
                let recorded = events[event].as_ref().expect("checked: events are recorded before their waits");
                device.wait(stream, recorded)?;
            }
        }
    }
    Ok(())
}

/// Runs `schedule` (of `program`) on `device` and synchronises it; on an error, aborts the
/// device before returning the error.
pub(crate) fn drive<D: Device>(
    device: &mut D,
    program: &Program,
    schedule: &StreamSchedule,
) -> Result<(), RuntimeError> {
    let result = issue(device, program, schedule).and_then(|()| device.synchronize());
    if let Err(e) = &result {
        device.abort(e);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use autotp_kernels::{DType, Kernel};
    use autotp_program::{CollectiveOp, MeshAxis};

    fn region(offset: usize) -> Region {
        Region { offset, len: 24 }
    }

    fn copy(from: usize, to: usize) -> Instruction {
        Instruction::Kernel {
            kernel: Kernel::Copy,
            inputs: vec![region(from)],
            outputs: vec![region(to)],
            label: format!("copy {from}->{to}"),
            gpu: None,
        }
    }

    fn program(instructions: Vec<Instruction>) -> Program {
        let program = Program::bare(instructions, vec![MeshAxis { name: "dp".into(), size: 2 }], 256);
        program.validate().unwrap();
        program
    }

    fn all_reduce(start: bool, input: usize, output: usize) -> Instruction {
        let op = CollectiveOp { kind: Collective::AllReduce, axis: 0, dtype: DType::F32, shape: vec![6] };
        let (input, output, label) = (region(input), region(output), "all_reduce".to_string());
        match start {
            true => Instruction::CollectiveStart { op, input, output, label },
            false => Instruction::Collective { op, input, output, label },
        }
    }

    use StreamOp::{Launch, Record, Wait};
    const COMPUTE: Stream = Stream::Compute;
    const COLLECTIVES: Stream = Stream::Collectives;
    const PEER: Stream = Stream::Peer;

    #[test]
    fn a_started_collective_overlaps_until_its_wait() {
        let p = program(vec![
            copy(0, 32),
            all_reduce(true, 32, 64),
            copy(0, 96),
            Instruction::Wait { start: 1, label: "wait".into() },
            copy(64, 128),
        ]);
        let schedule = StreamSchedule::of(&p).unwrap();
        assert_eq!(
            schedule.ops,
            vec![
                Launch { stream: COMPUTE, instruction: 0 },
                Record { stream: COMPUTE, event: 0 },
                Wait { stream: COLLECTIVES, event: 0 },
                Launch { stream: COLLECTIVES, instruction: 1 },
                Record { stream: COLLECTIVES, event: 1 },
                Launch { stream: COMPUTE, instruction: 2 },
                Wait { stream: COMPUTE, event: 1 },
                Launch { stream: COMPUTE, instruction: 3 },
                Launch { stream: COMPUTE, instruction: 4 },
            ]
        );
        // Without the wait, instruction 4 could read the sum before it is made; without the
        // first, the collective could read its input before instruction 0 made it.
        for (missing, complaint) in [(6, "instruction 4"), (2, "instruction 1")] {
            let mut broken = schedule.clone();
            broken.ops.remove(missing);
            let err = broken.check(&p).unwrap_err().to_string();
            assert!(err.contains(complaint), "{err}");
        }
    }

    #[test]
    fn a_blocking_collective_is_a_start_and_its_wait() {
        let p = program(vec![copy(0, 32), all_reduce(false, 32, 64), copy(64, 96)]);
        let schedule = StreamSchedule::of(&p).unwrap();
        assert_eq!(
            &schedule.ops[1..6],
            &[
                Record { stream: COMPUTE, event: 0 },
                Wait { stream: COLLECTIVES, event: 0 },
                Launch { stream: COLLECTIVES, instruction: 1 },
                Record { stream: COLLECTIVES, event: 1 },
                Wait { stream: COMPUTE, event: 1 },
            ]
        );
    }

    #[test]
    fn bytes_being_sent_are_overwritten_only_after_the_send() {
        let send = Instruction::Send { input: region(32), to: 1, tag: 7, label: "send".into() };
        let p = program(vec![copy(0, 32), send, copy(0, 64), copy(64, 32)]);
        let schedule = StreamSchedule::of(&p).unwrap();
        assert_eq!(
            schedule.ops,
            vec![
                Launch { stream: COMPUTE, instruction: 0 },
                Record { stream: COMPUTE, event: 0 },
                Wait { stream: PEER, event: 0 },
                Launch { stream: PEER, instruction: 1 },
                Record { stream: PEER, event: 1 },
                Launch { stream: COMPUTE, instruction: 2 },
                Wait { stream: COMPUTE, event: 1 },
                Launch { stream: COMPUTE, instruction: 3 },
            ]
        );
        let mut broken = schedule.clone();
        broken.ops.remove(6);
        let err = broken.check(&p).unwrap_err().to_string();
        assert!(
            err.contains("instruction 3 (copy 64->32) on the compute stream may run while instruction 1 (send)"),
            "{err}"
        );
    }

    #[test]
    fn schedules_that_skip_or_reorder_instructions_are_refused() {
        let p = program(vec![copy(0, 32), copy(32, 64)]);
        let mut schedule = StreamSchedule::of(&p).unwrap();
        schedule.ops.swap(0, 1);
        assert!(schedule.check(&p).unwrap_err().to_string().contains("out of program order"));
        schedule.ops.pop();
        schedule.ops.pop();
        assert!(schedule.check(&p).unwrap_err().to_string().contains("0 of the program's 2 instructions"));
    }
}
