//! `Einsum` as sums, transposes and one batched matmul (diagonals by an identity mask).

use super::*;

/// An operand of an einsum: its value and one label per dim (letters; the dims an ellipsis
/// stands for get `'0'`, `'1'`, ... aligned from the right, so they broadcast like numpy's).
pub(super) struct Labelled {
    value: Sym,
    labels: Vec<char>,
}

/// An operand with a label repeated (`ii`) reduced to its diagonal: multiplied by an identity
/// mask over the two dims, then summed over the second.
pub(super) fn take_diagonals(imp: &mut Importer, cx: &NodeCx, mut o: Labelled) -> Result<Labelled, FrontendError> {
    while let Some((first, second)) = (0..o.labels.len())
        .find_map(|d| o.labels[d + 1..].iter().position(|&c| c == o.labels[d]).map(|p| (d, d + 1 + p)))
    {
        let ty = imp.ty(&o.value);
        let n = ty.shape[first];
        if ty.shape[second] != n {
            return Err(cx.invalid(format!("a diagonal of dims of sizes {n} and {}", ty.shape[second])));
        }
        let mut mask_shape = vec![1; ty.rank()];
        (mask_shape[first], mask_shape[second]) = (n, n);
        let eye: Vec<f64> = (0..n * n).map(|i| if i / n == i % n { 1.0 } else { 0.0 }).collect();
        let eye = Tensor::from_f64_values(ty.dtype, mask_shape, &eye);
        let masked = imp.emit1(cx, Op::Binary(BinaryOp::Mul), &[o.value, Sym::Const(eye)])?;
        let sum = Op::Reduce { op: ReduceOp::Sum, axes: vec![second], keep_dims: false };
        o.value = imp.emit1(cx, sum, &[masked])?;
        o.labels.remove(second);
    }
    Ok(o)
}

/// `Einsum` of one or two operands as transposes, sums and one batched matmul: labels only in
/// one operand and not in the output are summed first; the two operands are laid out as
/// `[batch, free, contracted]` and `[batch, contracted, free]`, multiplied, and the result
/// permuted to the output's labels; a label repeated inside one operand takes its diagonal.
pub(super) fn einsum(imp: &mut Importer, cx: &NodeCx, operands: Vec<Sym>) -> Result<Sym, FrontendError> {
    let equation: String =
        attr_string(cx, "equation").unwrap_or_default().chars().filter(|c| !c.is_whitespace()).collect();
    let (lhs, rhs) = match equation.split_once("->") {
        Some((l, r)) => (l.to_string(), Some(r.to_string())),
        None => (equation.clone(), None),
    };
    let terms: Vec<&str> = lhs.split(',').collect();
    if terms.len() != operands.len() || !(1..=2).contains(&terms.len()) {
        return Err(cx.invalid(format!(
            "equation '{equation}' for {} operands: one or two operands are supported",
            operands.len()
        )));
    }
    let ranks: Vec<usize> = operands.iter().map(|o| imp.ty(o).rank()).collect();
    let explicit = |t: &str| t.replace("...", "").chars().count();
    let ellipsis =
        terms.iter().zip(&ranks).map(|(t, &r)| if t.contains("...") { r.saturating_sub(explicit(t)) } else { 0 });
    let ellipsis_rank = ellipsis.max().unwrap_or(0);
    let ellipsis_labels: Vec<char> = (0..ellipsis_rank).map(|i| char::from(b'0' + i as u8)).collect();
    let expand = |term: &str, rank: usize| -> Result<Vec<char>, FrontendError> {
        let mut labels = Vec::new();
        let (before, after) = term.split_once("...").map_or((term, None), |(b, a)| (b, Some(a)));
        labels.extend(before.chars());
        if let Some(after) = after {
            let own = rank.saturating_sub(explicit(term));
            labels.extend(&ellipsis_labels[ellipsis_rank - own..]);
            labels.extend(after.chars());
        }
        if labels.len() != rank || labels.iter().any(|c| !(c.is_ascii_alphanumeric())) {
            return Err(
                cx.invalid(format!("equation '{equation}': term '{term}' does not match a rank-{rank} operand"))
            );
        }
        Ok(labels)
    };
    let mut ops: Vec<Labelled> = Vec::new();
    for ((term, value), &rank) in terms.iter().zip(operands).zip(&ranks) {
        let operand = Labelled { labels: expand(term, rank)?, value };
        ops.push(take_diagonals(imp, cx, operand)?);
    }
    let count = |c: char| ops.iter().filter(|o| o.labels.contains(&c)).count();
    let output: Vec<char> = match &rhs {
        Some(r) => expand(r, explicit(r) + if r.contains("...") { ellipsis_rank } else { 0 })?,
        None => {
            let mut once: Vec<char> = ops
                .iter()
                .flat_map(|o| o.labels.iter().copied())
                .filter(|c| c.is_ascii_alphabetic() && count(*c) == 1)
                .collect();
            once.sort_unstable();
            once.dedup();
            ellipsis_labels.iter().copied().chain(once).collect()
        }
    };
    for (i, c) in output.iter().enumerate() {
        if count(*c) == 0 || output[..i].contains(c) {
            let why = if count(*c) == 0 { "is in no operand" } else { "appears twice" };
            return Err(cx.invalid(format!("equation '{equation}': the output's label '{c}' {why}")));
        }
    }
    // Sum each operand's labels that neither the other operand nor the output has.
    for k in 0..ops.len() {
        let other: Vec<char> =
            ops.iter().enumerate().filter(|(j, _)| *j != k).flat_map(|(_, o)| o.labels.clone()).collect();
        let summed: Vec<usize> = (0..ops[k].labels.len())
            .filter(|&d| !output.contains(&ops[k].labels[d]) && !other.contains(&ops[k].labels[d]))
            .collect();
        if !summed.is_empty() {
            let op = Op::Reduce { op: ReduceOp::Sum, axes: summed.clone(), keep_dims: false };
            ops[k].value = imp.emit1(cx, op, &[ops[k].value.clone()])?;
            let labels =
                ops[k].labels.iter().enumerate().filter(|(d, _)| !summed.contains(d)).map(|(_, c)| *c).collect();
            ops[k].labels = labels;
        }
    }
    let permute = |imp: &mut Importer, o: Labelled, order: &[char]| -> Result<Sym, FrontendError> {
        let perm: Vec<usize> =
            order.iter().map(|c| o.labels.iter().position(|l| l == c).expect("a label of o")).collect();
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            Ok(o.value)
        } else {
            imp.emit1(cx, Op::Transpose { perm }, &[o.value])
        }
    };
    if ops.len() == 1 {
        let only = ops.pop().expect("one operand");
        return permute(imp, only, &output);
    }
    let b_op = ops.pop().expect("two operands");
    let a_op = ops.pop().expect("two operands");
    let size_of = |o: &Labelled, imp: &Importer, c: char| {
        imp.ty(&o.value).shape[o.labels.iter().position(|l| *l == c).expect("label")]
    };
    let batch: Vec<char> =
        a_op.labels.iter().copied().filter(|c| b_op.labels.contains(c) && output.contains(c)).collect();
    let contracted: Vec<char> =
        a_op.labels.iter().copied().filter(|c| b_op.labels.contains(c) && !output.contains(c)).collect();
    let a_free: Vec<char> = a_op.labels.iter().copied().filter(|c| !b_op.labels.contains(c)).collect();
    let b_free: Vec<char> = b_op.labels.iter().copied().filter(|c| !a_op.labels.contains(c)).collect();
    // Shared labels must agree in size, but for numpy broadcasting of 1s.
    let mut sizes = std::collections::BTreeMap::new();
    for &c in batch.iter().chain(&contracted) {
        let (sa, sb) = (size_of(&a_op, imp, c), size_of(&b_op, imp, c));
        if sa != sb && sa != 1 && sb != 1 {
            return Err(
                cx.invalid(format!("equation '{equation}': label '{c}' is {sa} in one operand and {sb} in the other"))
            );
        }
        sizes.insert(c, sa.max(sb));
    }
    for &c in &a_free {
        sizes.insert(c, size_of(&a_op, imp, c));
    }
    for &c in &b_free {
        sizes.insert(c, size_of(&b_op, imp, c));
    }
    let product = |labels: &[char]| labels.iter().map(|c| sizes[c]).product::<usize>();
    let lay_out =
        |imp: &mut Importer, o: Labelled, order: Vec<char>, shape: Vec<usize>| -> Result<Sym, FrontendError> {
            let full: Vec<usize> = order.iter().map(|c| sizes[c]).collect();
            let mut v = permute(imp, o, &order)?;
            if imp.ty(&v).shape != full {
                v = imp.emit1(cx, Op::Expand { shape: full }, &[v])?;
            }
            imp.emit1(cx, Op::Reshape { shape }, &[v])
        };
    let (nb, m, k, n) = (product(&batch), product(&a_free), product(&contracted), product(&b_free));
    let a = lay_out(imp, a_op, [&batch[..], &a_free, &contracted].concat(), vec![nb, m, k])?;
    let b = lay_out(imp, b_op, [&batch[..], &contracted, &b_free].concat(), vec![nb, k, n])?;
    let y = imp.emit1(cx, Op::MatMul { transpose_lhs: false, transpose_rhs: false }, &[a, b])?;
    let labels: Vec<char> = [&batch[..], &a_free, &b_free].concat();
    let shape: Vec<usize> = labels.iter().map(|c| sizes[c]).collect();
    let y = imp.emit1(cx, Op::Reshape { shape }, &[y])?;
    permute(imp, Labelled { value: y, labels }, &output)
}
