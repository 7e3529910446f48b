//! `If` whose condition is known at import. The legacy exporter writes one for a `squeeze` of a
//! dim whose size it cannot see (`If(shape[d] == 1, Squeeze, Identity)`, as in LongCat-Flash's
//! loop over its experts), and the static shapes autotp imports with decide it. The taken branch's nodes are
//! converted in place: a branch reads the enclosing graph's values by name, and ONNX names are
//! unique across subgraphs. A condition computed from the data is refused, naming the node:
//! autotp compiles one static graph.

use super::*;

/// The node's outputs, or `None` when its op is not of this family.
pub(super) fn convert(
    imp: &mut Importer,
    cx: &NodeCx,
    external: &mut ExternalFiles,
) -> Result<Option<Vec<Sym>>, FrontendError> {
    if cx.node.op_type != "If" {
        return Ok(None);
    }
    let taken = match input(imp, cx, 0)? {
        Sym::Const(cond) if cond.ty.dtype == DType::Bool && cond.ty.numel() == 1 => cond.bytes()[0] != 0,
        Sym::Const(cond) => return Err(cx.invalid(format!("the condition must be one bool, got {}", cond.ty))),
        Sym::Value(_) => {
            return Err(cx.invalid(
                "the condition is computed from the model's data, not its shapes: a data-dependent branch, \
                 which a static training graph cannot hold",
            ))
        }
    };
    let branch_name = if taken { "then_branch" } else { "else_branch" };
    let branch =
        attr(cx, branch_name).and_then(|a| a.g.as_ref()).ok_or_else(|| cx.invalid(format!("has no {branch_name}")))?;
    for t in &branch.initializer {
        let tensor = decode(t, &t.name, external)?;
        imp.env.insert(t.name.clone(), Sym::Const(tensor));
    }
    for node in &branch.node {
        let inner = NodeCx { node, opset: cx.opset };
        let outputs = super::convert(imp, &inner, external)?;
        for (name, sym) in node.output.iter().zip(outputs) {
            if !name.is_empty() {
                imp.env.insert(name.clone(), sym);
            }
        }
    }
    if branch.output.len() != cx.node.output.len() {
        return Err(cx.invalid(format!(
            "its {branch_name} has {} outputs, the node {}",
            branch.output.len(),
            cx.node.output.len()
        )));
    }
    let outputs = branch.output.iter().map(|out| imp.lookup(cx, &out.name)).collect::<Result<Vec<_>, _>>()?;
    Ok(Some(outputs))
}
