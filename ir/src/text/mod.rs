//! The IR text format: one op per line, deterministic, with a parser such that
//! `parse(&print(g)) == g` for every canonical graph.
//!
//! ```text
//! graph "tiny" mesh [tp=2] {
//!   input %input_ids : i64[4,32]
//!   param %wte : f32[1000,64] {tp = shard(0)}
//!   %0 = gather %wte, %input_ids {axis = 0} : f32[4,32,64]
//!   %1 = constant splat<0.5> : f32[]
//!   %2 = mul %0, %1 : f32[4,32,64]
//!   output "hidden" = %2
//! }
//! ```
//!
//! A training step also declares `state %name : type` values (persistent, zero at the start)
//! and, after its outputs, `update %target = %value` lines (a parameter or state takes a new
//! value after each run):
//!
//! ```text
//!   state %adamw.m.wte : f32[1000,64]
//!   update %wte = %41
//! ```
//!
//! Unnamed values print as `%N`, numbered densely in definition order; named values (inputs,
//! parameters) print their name, quoted when it is not an identifier. Attributes print in a
//! fixed order per op; placements other than `replicate` print after a value's type.

mod parse;
mod print;

pub use parse::{parse, ParseError};
pub use print::print;
pub use print::ValueNames;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, Graph, Op, Tensor, ValueId};

    #[test]
    fn float_constants_round_trip_exactly() {
        let mut g = Graph::new("constants");
        let values = [0.1f64, 1.0 / 3.0, -2.5e-300, f64::MAX];
        g.add(Op::Constant { value: Tensor::from_pod(DType::F64, vec![4], &values) }, vec![]).unwrap();
        g.add(Op::Constant { value: Tensor::from_pod(DType::F32, vec![2], &[0.1f32, 1.0e-38]) }, vec![]).unwrap();
        let half = [half::bf16::from_f32(0.3), half::bf16::from_f32(-7.0)];
        g.add(Op::Constant { value: Tensor::from_pod(DType::BF16, vec![2], &half) }, vec![]).unwrap();
        let last = ValueId(g.num_values() as u32 - 1);
        g.add_output("y", last);
        let parsed = parse(&print(&g)).unwrap();
        assert!(parsed == g, "constants changed:\n{}\n{}", print(&g), print(&parsed));
    }

    #[test]
    fn attention_ops_round_trip() {
        use crate::{AttentionMask, TensorType};
        let text = |mask: AttentionMask| {
            let mut g = Graph::new("attention");
            let t = |shape: &[usize]| TensorType::new(DType::F32, shape.to_vec());
            let (q, k, v) =
                (g.add_input("q", t(&[2, 4, 3])), g.add_input("k", t(&[1, 4, 3])), g.add_input("v", t(&[1, 4, 2])));
            let forward = g.add_node(Op::Attention { scale: 0.125, mask, kv_block: None }, vec![q, k, v], 2).unwrap();
            let [out, lse] = g.node(forward).outputs[..] else { unreachable!() };
            let backward = g
                .add_node(Op::AttentionGrad { scale: 0.125, mask, kv_block: None }, vec![q, k, v, out, lse, out], 3)
                .unwrap();
            for (i, &o) in g.node(backward).outputs.clone().iter().enumerate() {
                g.add_output(format!("d{i}"), o);
            }
            g
        };
        for mask in [AttentionMask::None, AttentionMask::Causal, AttentionMask::SlidingWindow { window: 3 }] {
            let g = text(mask);
            let printed = print(&g);
            assert!(parse(&printed).unwrap() == g, "{printed}");
        }
        let bad = print(&text(AttentionMask::Causal)).replace("causal", "diagonal");
        assert!(parse(&bad).unwrap_err().to_string().contains("unknown attention mask 'diagonal'"), "{bad}");
    }

    /// A splat makes its constant whole; one past 256 MiB, or a type past the shape limits, is
    /// refused before anything is allocated.
    #[test]
    fn splats_are_made_fast_within_a_limit() {
        let graph =
            |ty: &str| format!("graph \"g\" {{\n  %0 = constant splat<1.5> : {ty}\n  output \"out\" = %0\n}}\n");
        let g = parse(&graph("f32[1024,1024]")).unwrap();
        let Op::Constant { value } = &g.node(crate::NodeId(0)).op else { panic!("a constant") };
        assert_eq!(value.bytes().len(), 4 << 20);
        assert!(value.bytes().chunks(4).all(|c| c == 1.5f32.to_le_bytes()));
        let big = parse(&graph("i32[4,34444444,2]")).unwrap_err().to_string();
        assert!(big.contains("holds 1102222208 bytes") && big.contains("at most 268435456"), "{big}");
        let huge = parse(&graph("i64[1099511627776,1099511627776]")).unwrap_err().to_string();
        assert!(huge.contains("more than 2^48 elements"), "{huge}");
    }
}
