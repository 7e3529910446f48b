//! `dce`: dead-code elimination. Input: any phase. Output: the same graph without nodes or
//! parameters that no graph output depends on, renumbered canonically. Inputs are kept.
//! Tests: tests/golden/dce.ir.

use autotp_ir::Graph;

use crate::{Pass, PassError};

pub struct Dce;

impl Pass for Dce {
    fn name(&self) -> &'static str {
        "dce"
    }

    fn run(&self, graph: &mut Graph) -> Result<(), PassError> {
        *graph = graph.without_dead_code();
        Ok(())
    }
}
