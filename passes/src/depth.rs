//! A model cut to its first layers: the proxies `autotp plan` compiles. The forward of a
//! model whose parameters number its layers (`model.layers.N.*`, [`numbered_layers`]) keeps
//! layers `0..K`; what followed the last layer (the final norm, the head) reads layer `K`'s
//! input instead of the last layer's output. Every layer of a transformer has the same shapes,
//! so the compiled plan of the cut model differs from the whole one's by whole layers.
//!
//! The layer boundaries are found as the pipeline finds its cuts: forward positions where one
//! activation alone is live ([`crate::pipeline`]). Layer `K`'s input is the one live at the last
//! such cut before its first node that reads its parameters; the last layer's output the one
//! live at the first cut after its last such node (after the residual add).

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

/// `graph` (a forward graph, before `loss`) with only its first `keep` layers (at least 1).
pub fn keep_layers(graph: &Graph, keep: usize) -> Result<Graph, PassError> {
    let layers =
        numbered_layers(graph).ok_or_else(|| invalid("no parameter name numbers the model's layers".into()))?;
    let count = layers.numbers.len();
    if keep == 0 || keep >= count {
        return if keep == count {
            Ok(graph.clone())
        } else {
            Err(invalid(format!("cannot keep {keep} of the model's {count} layers")))
        };
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
    let first_dropped = positions(layers.numbers[keep]);
    let last_kept = positions(layers.numbers[count - 1]);
    let (Some(&start), Some(&end)) = (first_dropped.first(), last_kept.last()) else {
        return Err(invalid("a numbered layer's parameters are not read by the forward".into()));
    };
    let input = cuts.iter().rev().find(|(k, _)| *k <= start).map(|(_, v)| *v);
    let output = cuts.iter().find(|(k, _)| *k > end).map(|(_, v)| *v);
    let (Some(input), Some(output)) = (input, output) else {
        return Err(invalid(format!(
            "layer {} does not start, or layer {} does not end, where one activation alone is live",
            layers.numbers[keep],
            layers.numbers[count - 1]
        )));
    };
    if graph.ty(input) != graph.ty(output) {
        return Err(invalid(format!(
            "layer {}'s input is {}, the last layer's output {}",
            layers.numbers[keep],
            graph.ty(input),
            graph.ty(output)
        )));
    }
    let mut rw = Rewriter::new(graph, |_| true);
    for (id, node) in graph.nodes() {
        rw.copy_node(id);
        if node.outputs.contains(&output) {
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

    /// `x -> layers.0 (x @ w0 + x) -> layers.1 -> layers.2 -> norm (x @ head)`.
    fn three_layers() -> Graph {
        let mut g = Graph::new("m");
        let x = g.add_input("x", TensorType::new(DType::F32, vec![2, 4]));
        let weights: Vec<ValueId> =
            (0..3).map(|i| g.add_param(format!("layers.{i}.w"), TensorType::new(DType::F32, vec![4, 4]))).collect();
        let head = g.add_param("head", TensorType::new(DType::F32, vec![4, 3]));
        let mut h = x;
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
        let cut = keep_layers(&g, 1).unwrap();
        autotp_ir::verify(&cut).unwrap();
        let names: Vec<&str> = cut.params().iter().filter_map(|&p| cut.name_of(p)).collect();
        assert_eq!(names, ["layers.0.w", "head"]);
        assert_eq!(cut.num_nodes(), 3);
        assert_eq!(layer_count(&keep_layers(&g, 2).unwrap()), 2);
        assert_eq!(keep_layers(&g, 3).unwrap().num_nodes(), g.num_nodes());
        assert!(keep_layers(&g, 0).is_err() && keep_layers(&g, 4).is_err());
    }
}
