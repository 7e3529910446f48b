//! Where a rank's step time goes: the executor's per-instruction times (`autotp run
//! --profile`) summed by the IR op each instruction came from.

use std::collections::BTreeMap;
use std::time::Duration;

use autotp_program::Program;

/// The time of one kind of op (`matmul`, `all_reduce`, `wait`...) over a run.
#[derive(Clone, Debug, PartialEq)]
pub struct OpTime {
    pub op: String,
    /// Instructions of this op in the program (each runs once per step).
    pub instructions: usize,
    pub total: Duration,
}

/// `times` (one per instruction of `program`) summed by op, the slowest first.
pub fn by_op(program: &Program, times: &[Duration]) -> Vec<OpTime> {
    let mut ops: BTreeMap<String, OpTime> = BTreeMap::new();
    for (instruction, &time) in program.instructions.iter().zip(times) {
        let op = crate::trace::op_of(instruction.label());
        let entry = ops.entry(op.clone()).or_insert(OpTime { op, instructions: 0, total: Duration::ZERO });
        entry.instructions += 1;
        entry.total += time;
    }
    let mut rows: Vec<OpTime> = ops.into_values().collect();
    rows.sort_by(|a, b| b.total.cmp(&a.total).then(a.op.cmp(&b.op)));
    rows
}

/// The `n` slowest instructions: (label, total time).
pub fn slowest(program: &Program, times: &[Duration], n: usize) -> Vec<(String, Duration)> {
    let mut rows: Vec<(String, Duration)> = program
        .instructions
        .iter()
        .zip(times)
        .map(|(instruction, &time)| (instruction.label().to_string(), time))
        .collect();
    rows.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    rows.truncate(n);
    rows
}
