//! The printer: names, numbers, attributes in their fixed order, types and placements.

use std::fmt::Write;

use crate::{AttentionMask, DType, GeluApprox, Graph, NodeId, Op, Placement, Tensor, ValueId};

/// Display names of a graph's values, as the printed text names them (`%embed`, `%12`), made
/// when asked for (the verifier names values only in its messages).
pub struct ValueNames<'g> {
    graph: &'g Graph,
    /// Each unnamed value's number in the text (unused for a named value).
    numbers: Vec<u32>,
}

impl<'g> ValueNames<'g> {
    pub fn new(graph: &'g Graph) -> ValueNames<'g> {
        let mut next = 0;
        let numbers = graph
            .values()
            .map(|(_, v)| {
                let number = next;
                next += v.name.is_none() as u32;
                number
            })
            .collect();
        ValueNames { graph, numbers }
    }

    pub fn get(&self, v: ValueId) -> String {
        match self.numbers.get(v.index()) {
            None => format!("%<invalid {}>", v.0),
            Some(number) => match &self.graph.value(v).name {
                Some(name) => format!("%{}", quote_name(name)),
                None => format!("%{number}"),
            },
        }
    }

    /// `%3, %4 = split` — how a node is named in messages.
    pub fn node(&self, graph: &Graph, id: NodeId) -> String {
        let node = graph.node(id);
        let outs: Vec<String> = node.outputs.iter().map(|&o| self.get(o)).collect();
        format!("{} = {}", outs.join(", "), node.op.name())
    }
}

fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
}

fn quote_name(name: &str) -> String {
    if is_identifier(name) {
        name.to_string()
    } else {
        quote(name)
    }
}

fn quote(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// An attribute value in the text format.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Attr {
    Int(i64),
    Float(f64),
    Ints(Vec<i64>),
    Word(String),
}

impl std::fmt::Display for Attr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Attr::Int(v) => write!(f, "{v}"),
            Attr::Float(v) => f.write_str(&format_f64(*v)),
            Attr::Ints(vs) => {
                let parts: Vec<String> = vs.iter().map(|v| v.to_string()).collect();
                write!(f, "[{}]", parts.join(", "))
            }
            Attr::Word(w) => f.write_str(w),
        }
    }
}

fn format_f64(v: f64) -> String {
    if v.is_nan() {
        "nan".into()
    } else if v.is_infinite() {
        if v > 0.0 {
            "inf".into()
        } else {
            "-inf".into()
        }
    } else {
        format!("{v:?}")
    }
}

fn format_f32(v: f32) -> String {
    if v.is_nan() || v.is_infinite() {
        format_f64(v as f64)
    } else {
        format!("{v:?}")
    }
}

fn ints(v: &[usize]) -> Attr {
    Attr::Ints(v.iter().map(|&x| x as i64).collect())
}

fn bool_attr(b: bool) -> Attr {
    Attr::Word(if b { "true" } else { "false" }.into())
}

/// The attributes of an op in print order (constants print their data separately).
fn attributes(op: &Op) -> Vec<(&'static str, Attr)> {
    match op {
        Op::Constant { .. }
        | Op::Unary(_)
        | Op::Binary(_)
        | Op::Select
        | Op::GatherNd
        | Op::Gelu { approx: GeluApprox::None } => {
            vec![]
        }
        Op::Gelu { approx } => vec![("approx", Attr::Word(approx.name().into()))],
        Op::Cast { to } => vec![("to", Attr::Word(to.name().into()))],
        Op::Reduce { axes, keep_dims, .. } => vec![("axes", ints(axes)), ("keep_dims", bool_attr(*keep_dims))],
        Op::MatMul { transpose_lhs, transpose_rhs } => {
            let mut a = vec![];
            if *transpose_lhs {
                a.push(("transpose_lhs", bool_attr(true)));
            }
            if *transpose_rhs {
                a.push(("transpose_rhs", bool_attr(true)));
            }
            a
        }
        Op::Reshape { shape } | Op::Expand { shape } => vec![("shape", ints(shape))],
        Op::Transpose { perm } => vec![("perm", ints(perm))],
        Op::Slice { starts, ends, steps } => {
            vec![("starts", ints(starts)), ("ends", Attr::Ints(ends.clone())), ("steps", Attr::Ints(steps.clone()))]
        }
        Op::Concat { axis }
        | Op::Gather { axis }
        | Op::GatherElements { axis }
        | Op::Softmax { axis }
        | Op::LogSoftmax { axis } => {
            vec![("axis", Attr::Int(*axis as i64))]
        }
        Op::Attention { scale, mask, kv_block } | Op::AttentionGrad { scale, mask, kv_block } => {
            let mut a = vec![("scale", Attr::Float(*scale))];
            match mask {
                AttentionMask::None => a.push(("mask", Attr::Word("none".into()))),
                AttentionMask::Causal => a.push(("mask", Attr::Word("causal".into()))),
                AttentionMask::SlidingWindow { window } => {
                    a.push(("mask", Attr::Word("sliding_window".into())));
                    a.push(("window", Attr::Int(*window as i64)));
                }
            }
            a.extend(kv_block.map(|block| ("kv_block", Attr::Int(block as i64))));
            a
        }
        Op::AdamW { beta1, beta2, eps, weight_decay } => vec![
            ("beta1", Attr::Float(*beta1)),
            ("beta2", Attr::Float(*beta2)),
            ("eps", Attr::Float(*eps)),
            ("weight_decay", Attr::Float(*weight_decay)),
        ],
        Op::Sgd { momentum, weight_decay, nesterov } => vec![
            ("momentum", Attr::Float(*momentum)),
            ("weight_decay", Attr::Float(*weight_decay)),
            ("nesterov", bool_attr(*nesterov)),
        ],
        Op::ScatterAdd { axis, size } | Op::ScatterElements { axis, size } => {
            vec![("axis", Attr::Int(*axis as i64)), ("size", Attr::Int(*size as i64))]
        }
        Op::ScatterNd { reduction } => vec![("reduction", Attr::Word(reduction.name().into()))],
        Op::TopK { axis, k, largest } => {
            vec![("axis", Attr::Int(*axis as i64)), ("k", Attr::Int(*k as i64)), ("largest", bool_attr(*largest))]
        }
        Op::Split { axis, sizes } => {
            vec![("axis", Attr::Int(*axis as i64)), ("sizes", ints(sizes))]
        }
        Op::Pad { begin, end, value } => {
            vec![("begin", ints(begin)), ("end", ints(end)), ("value", Attr::Float(*value))]
        }
        Op::Triangle { k, .. } => vec![("k", Attr::Int(*k))],
        Op::CumSum { axis, exclusive, reverse } => vec![
            ("axis", Attr::Int(*axis as i64)),
            ("exclusive", bool_attr(*exclusive)),
            ("reverse", bool_attr(*reverse)),
        ],
        Op::LayerNorm { axis, eps } | Op::RmsNorm { axis, eps } => {
            vec![("axis", Attr::Int(*axis as i64)), ("eps", Attr::Float(*eps))]
        }
        Op::CrossEntropy { ignore_index, reduction } | Op::NllLoss { ignore_index, reduction } => vec![
            ("ignore_index", ignore_index.map(Attr::Int).unwrap_or_else(|| Attr::Word("none".into()))),
            ("reduction", Attr::Word(reduction.name().into())),
        ],
        Op::Wait => vec![],
        Op::Send { to, tag, message } => vec![
            ("to", Attr::Int(*to as i64)),
            ("tag", Attr::Int(*tag as i64)),
            ("message", Attr::Word(message.name().into())),
        ],
        Op::Recv { from, tag, message, .. } => vec![
            ("from", Attr::Int(*from as i64)),
            ("tag", Attr::Int(*tag as i64)),
            ("message", Attr::Word(message.name().into())),
        ],
        Op::Collective { kind, axis, .. } => {
            let mut a = vec![("axis", Attr::Word(axis.clone()))];
            for (name, dim) in kind.dims() {
                a.push((name, Attr::Int(dim as i64)));
            }
            a
        }
    }
}

fn format_constant(t: &Tensor) -> String {
    let element = |i: usize| -> String {
        match t.dtype() {
            DType::F32 | DType::F16 | DType::BF16 => format_f32(t.get_f64(i) as f32),
            DType::F64 => format_f64(t.get_f64(i)),
            DType::Bool => (if t.get_f64(i) != 0.0 { "true" } else { "false" }).into(),
            _ => t.get_i64(i).to_string(),
        }
    };
    if t.numel() > 1 && t.is_splat() {
        format!("splat<{}>", element(0))
    } else {
        let parts: Vec<String> = (0..t.numel()).map(element).collect();
        format!("dense<[{}]>", parts.join(", "))
    }
}

fn format_type_and_placement(graph: &Graph, v: ValueId) -> String {
    let value = graph.value(v);
    let mut s = value.ty.to_string();
    let sharded: Vec<String> = graph
        .mesh
        .axes
        .iter()
        .zip(&value.placements)
        .filter(|(_, p)| **p != Placement::Replicate)
        .map(|(axis, p)| format!("{} = {p}", axis.name))
        .collect();
    if !sharded.is_empty() {
        write!(s, " {{{}}}", sharded.join(", ")).unwrap();
    }
    s
}

/// Prints a graph in the text format.
pub fn print(graph: &Graph) -> String {
    let names = ValueNames::new(graph);
    let mut out = format!("graph {}", quote(&graph.name));
    if !graph.mesh.axes.is_empty() {
        let axes: Vec<String> = graph.mesh.axes.iter().map(|a| format!("{}={}", a.name, a.size)).collect();
        write!(out, " mesh [{}]", axes.join(", ")).unwrap();
    }
    out.push_str(" {\n");
    for &v in graph.inputs() {
        writeln!(out, "  input {} : {}", names.get(v), format_type_and_placement(graph, v)).unwrap();
    }
    for &v in graph.params() {
        writeln!(out, "  param {} : {}", names.get(v), format_type_and_placement(graph, v)).unwrap();
    }
    for &v in graph.states() {
        writeln!(out, "  state {} : {}", names.get(v), format_type_and_placement(graph, v)).unwrap();
    }
    let mut fusions = graph.fusions().iter().peekable();
    for (id, node) in graph.nodes() {
        let fusion = fusions.peek().filter(|f| f.nodes.contains(&id.index()));
        if let Some(f) = fusion.filter(|f| f.nodes.start == id.index()) {
            writeln!(out, "  fusion {} {{", quote(&f.name)).unwrap();
        }
        let indent = if fusion.is_some() { "    " } else { "  " };
        let outs: Vec<String> = node.outputs.iter().map(|&o| names.get(o)).collect();
        if outs.is_empty() {
            write!(out, "{indent}{}", node.op.name()).unwrap();
        } else {
            write!(out, "{indent}{} = {}", outs.join(", "), node.op.name()).unwrap();
        }
        if let Op::Constant { value } = &node.op {
            write!(out, " {}", format_constant(value)).unwrap();
        }
        let ins: Vec<String> = node.inputs.iter().map(|&v| names.get(v)).collect();
        if !ins.is_empty() {
            write!(out, " {}", ins.join(", ")).unwrap();
        }
        let attrs = attributes(&node.op);
        if !attrs.is_empty() {
            let parts: Vec<String> = attrs.iter().map(|(k, v)| format!("{k} = {v}")).collect();
            write!(out, " {{{}}}", parts.join(", ")).unwrap();
        }
        let types: Vec<String> = node.outputs.iter().map(|&o| format_type_and_placement(graph, o)).collect();
        if types.is_empty() {
            out.push('\n');
        } else {
            writeln!(out, " : {}", types.join(", ")).unwrap();
        }
        if fusion.is_some_and(|f| f.nodes.end == id.index() + 1) {
            out.push_str("  }\n");
            fusions.next();
        }
    }
    for (name, v) in graph.outputs() {
        writeln!(out, "  output {} = {}", quote(name), names.get(*v)).unwrap();
    }
    for (target, value) in graph.updates() {
        writeln!(out, "  update {} = {}", names.get(*target), names.get(*value)).unwrap();
    }
    out.push_str("}\n");
    out
}
