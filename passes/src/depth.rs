//! A model cut to some of its layers: the proxies `autotp plan` compiles. The forward of a
//! model whose parameters number its layers (`model.layers.N.*`, [`numbered_layers`]) keeps
//! the layers asked for (by position: the first two, or the first of each kind of layer); each
//! run of layers dropped is bypassed, the value read after it being the one its first layer
//! read, and what followed the last layer (the final norm, the head) reads the last kept
//! layer's output. Layers of one kind have the same shapes, so the compiled plans of two cuts
//! differ by whole layers.
//!
//! The layer boundaries are found as the pipeline finds its cuts: forward positions where one
//! activation alone is live ([`crate::pipeline`]). A dropped run's input is the one live at the
//! last such cut before its first layer's first node that reads its parameters; its output the
//! one live at the first cut after its last layer's last such node (after the residual add).

use autotp_ir::{Graph, Rewriter, ValueId};

use crate::pipeline::{activations, needed_by, numbered_layers, single_activation_cuts};
use crate::PassError;

const PASS: &str = "depth";

fn invalid(message: String) -> PassError {
    PassError::Invalid { pass: PASS, message }
}

/// The number of numbered layers of `graph` (0 when its parameter names number none).
pub fn layer_count(graph: &Graph) -> usize {
    numbered_layers(graph).map_or(0, |layers| layers.numbers.len())
}

/// `graph` (a forward graph, before `loss`) with only the layers at positions `keep` (among its
/// numbered layers, in order: `[0, 1]` keeps the first two), at least one.
pub fn keep_layers(graph: &Graph, keep: &[usize]) -> Result<Graph, PassError> {
    let layers =
        numbered_layers(graph).ok_or_else(|| invalid("no parameter name numbers the model's layers".into()))?;
    let count = layers.numbers.len();
    if keep.is_empty() || keep.windows(2).any(|w| w[0] >= w[1]) || keep.iter().any(|&k| k >= count) {
        return Err(invalid(format!(
            "cannot keep the layers at {keep:?} of the model's {count} (in increasing order)"
        )));
    }
    // Each run of dropped layers, first and last position.
    let mut dropped: Vec<(usize, usize)> = Vec::new();
    for position in (0..count).filter(|p| !keep.contains(p)) {
        match dropped.last_mut() {
            Some((_, last)) if *last + 1 == position => *last = position,
            _ => dropped.push((position, position)),
        }
    }
    if dropped.is_empty() {
        return Ok(graph.clone());
    }
    let nodes: Vec<&autotp_ir::Node> = graph.nodes().map(|(_, n)| n).collect();
    let roots: Vec<ValueId> = graph.outputs().iter().map(|(_, v)| *v).collect();
    let needed = needed_by(&nodes, graph.num_values(), &roots, |_| true);
    let forward: Vec<usize> = (0..nodes.len()).filter(|&i| needed[i]).collect();
    let activation = activations(graph);
    let counted: Vec<bool> =
        (0..graph.num_values()).map(|v| activation[v] && graph.ty(ValueId(v as u32)).rank() > 0).collect();
    let cuts: Vec<(usize, ValueId)> = single_activation_cuts(&nodes, &forward, &counted)
        .into_iter()
        .filter_map(|(k, live)| (live.len() == 1).then(|| (k, live[0])))
        .collect();
    // Forward positions of the nodes that read each layer's parameters.
    let mut layer_of = vec![None; graph.num_values()];
    for &p in graph.params() {
        layer_of[p.index()] = graph.name_of(p).and_then(|name| layers.number_of(name));
    }
    let positions = |number: u64| -> Vec<usize> {
        (0..forward.len())
            .filter(|&k| nodes[forward[k]].inputs.iter().any(|v| layer_of[v.index()] == Some(number)))
            .collect()
    };
    // Each run's output value, and the value read in its place.
    let mut bypasses: Vec<(ValueId, ValueId)> = Vec::new();
    for (first, last) in dropped {
        let (first, last) = (layers.numbers[first], layers.numbers[last]);
        let (Some(&start), Some(&end)) = (positions(first).first(), positions(last).last()) else {
            return Err(invalid("a numbered layer's parameters are not read by the forward".into()));
        };
        let input = cuts.iter().rev().find(|(k, _)| *k <= start).map(|(_, v)| *v);
        let output = cuts.iter().find(|(k, _)| *k > end).map(|(_, v)| *v);
        let (Some(input), Some(output)) = (input, output) else {
            return Err(invalid(format!(
                "layer {first} does not start, or layer {last} does not end, where one activation alone is live"
            )));
        };
        if graph.ty(input) != graph.ty(output) {
            return Err(invalid(format!(
                "layer {first}'s input is {}, layer {last}'s output {}",
                graph.ty(input),
                graph.ty(output)
            )));
        }
        bypasses.push((output, input));
    }
    let mut rw = Rewriter::new(graph, |_| true);
    for (id, node) in graph.nodes() {
        rw.copy_node(id);
        for &(output, input) in bypasses.iter().filter(|(output, _)| node.outputs.contains(output)) {
            let kept = rw.map(input);
            rw.set(output, kept);
        }
    }
    Ok(rw.finish().without_dead_code())
}

#[cfg(test)]
mod tests {
    use super::*;
    use autotp_ir::{BinaryOp, DType, Op, TensorType};

    const MATMUL: Op = Op::MatMul { transpose_lhs: false, transpose_rhs: false };

    /// `x -> embed (x @ e) -> layers.0 (h @ w0 + h) -> layers.1 -> layers.2 -> head (h @ head)`.
    fn three_layers() -> Graph {
        let mut g = Graph::new("m");
        let x = g.add_input("x", TensorType::new(DType::F32, vec![2, 4]));
        let embed = g.add_param("embed", TensorType::new(DType::F32, vec![4, 4]));
        let weights: Vec<ValueId> =
            (0..3).map(|i| g.add_param(format!("layers.{i}.w"), TensorType::new(DType::F32, vec![4, 4]))).collect();
        let head = g.add_param("head", TensorType::new(DType::F32, vec![4, 3]));
        let mut h = g.add(MATMUL, vec![x, embed]).unwrap();
        for w in weights {
            let y = g.add(MATMUL, vec![h, w]).unwrap();
            h = g.add(Op::Binary(BinaryOp::Add), vec![y, h]).unwrap();
        }
        let logits = g.add(MATMUL, vec![h, head]).unwrap();
        g.add_output("logits", logits);
        g
    }

    #[test]
    fn keeps_the_first_layers_and_what_follows_them() {
        let g = three_layers();
        assert_eq!(layer_count(&g), 3);
        let cut = keep_layers(&g, &[0]).unwrap();
        autotp_ir::verify(&cut).unwrap();
        let names: Vec<&str> = cut.params().iter().filter_map(|&p| cut.name_of(p)).collect();
        assert_eq!(names, ["embed", "layers.0.w", "head"]);
        assert_eq!(cut.num_nodes(), 4);
        assert_eq!(layer_count(&keep_layers(&g, &[0, 1]).unwrap()), 2);
        assert_eq!(keep_layers(&g, &[0, 1, 2]).unwrap().num_nodes(), g.num_nodes());
        assert!(keep_layers(&g, &[]).is_err() && keep_layers(&g, &[3]).is_err() && keep_layers(&g, &[1, 0]).is_err());
    }

    /// Layers 0 and 2 of three: layer 1 is bypassed (layer 2 reads layer 0's output), and so
    /// is the run of the first two when only the last is kept.
    #[test]
    fn keeps_any_layers_bypassing_those_dropped() {
        let g = three_layers();
        let cut = keep_layers(&g, &[0, 2]).unwrap();
        autotp_ir::verify(&cut).unwrap();
        let names: Vec<&str> = cut.params().iter().filter_map(|&p| cut.name_of(p)).collect();
        assert_eq!(names, ["embed", "layers.0.w", "layers.2.w", "head"]);
        // The embedding, two layers of a matmul and an add, and the head.
        assert_eq!(cut.num_nodes(), 6);
        let skips_middle = autotp_ir::text::print(&cut);
        assert!(!skips_middle.contains("layers.1.w"), "{skips_middle}");
        let only_last = keep_layers(&g, &[2]).unwrap();
        let names: Vec<&str> = only_last.params().iter().filter_map(|&p| only_last.name_of(p)).collect();
        assert_eq!(names, ["embed", "layers.2.w", "head"]);
        assert_eq!(only_last.num_nodes(), 4);
    }
}
