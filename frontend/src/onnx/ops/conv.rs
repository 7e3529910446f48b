//! `Conv` (1-D, 2-D and up; grouped, depthwise; explicit, `VALID` and `SAME` padding; strides
//! and dilations), imported as its taps: for each kernel position, the strided slice of the
//! zero-padded input that position reads.
//!
//! - A depthwise convolution (one input channel a group, as Mamba's and LFM2's gated short
//!   convolutions are) is the sum over taps of `slice * weight[:, 0, tap]` (the weight read
//!   once, as `[Cout, K]`, and split into its taps): elementwise, so the
//!   fusion pass makes it one generated kernel and each channel stays local to its slice (a
//!   tensor-parallel split of the channels needs no communication).
//! - Any other grouping stacks the taps (`[N, G, Cin/G * K, P]`, "im2col") and multiplies them
//!   by the weight reshaped to `[G, Cout/G, Cin/G * K]`: one batched matmul.
//!
//! Gradients and sharding follow from those ops' rules; no IR op is added.

use super::*;

/// The geometry of one convolution, from its attributes and operand shapes.
struct ConvShape {
    batch: usize,
    in_channels: usize,
    out_channels: usize,
    groups: usize,
    kernel: Vec<usize>,
    strides: Vec<usize>,
    dilations: Vec<usize>,
    pad_begin: Vec<usize>,
    pad_end: Vec<usize>,
    output: Vec<usize>,
}

impl ConvShape {
    fn read(cx: &NodeCx, x: &[usize], w: &[usize]) -> Result<ConvShape, FrontendError> {
        if x.len() < 3 || w.len() != x.len() {
            return Err(cx.invalid(format!(
                "input {x:?} and weight {w:?} must be [N, C, spatial...] and [Cout, C/group, kernel...] of one rank of at least 3"
            )));
        }
        let spatial = x.len() - 2;
        let groups = usize::try_from(attr_int(cx, "group", 1))
            .ok()
            .filter(|&g| g > 0)
            .ok_or_else(|| cx.invalid("group must be positive"))?;
        let (in_channels, out_channels) = (x[1], w[0]);
        if w[1].checked_mul(groups) != Some(in_channels) || !out_channels.is_multiple_of(groups) {
            return Err(cx.invalid(format!(
                "{groups} group(s) do not fit input channels {in_channels} and weight {w:?} (needs C = group x weight dim 1, Cout divisible by group)"
            )));
        }
        let kernel = w[2..].to_vec();
        if kernel.contains(&0) {
            return Err(cx.invalid(format!("weight {w:?} has an empty kernel")));
        }
        if let Some(attribute) = attr_ints(cx, "kernel_shape") {
            if dims(&attribute, cx, "kernel_shape")? != kernel {
                return Err(cx.invalid(format!("kernel_shape {attribute:?} differs from the weight's {kernel:?}")));
            }
        }
        let per_axis = |name: &str| -> Result<Vec<usize>, FrontendError> {
            match attr_ints(cx, name) {
                None => Ok(vec![1; spatial]),
                Some(v) if v.len() == spatial && v.iter().all(|&s| s > 0) => dims(&v, cx, name),
                Some(v) => Err(cx.invalid(format!("{name} {v:?} must be {spatial} positive integers"))),
            }
        };
        let (strides, dilations) = (per_axis("strides")?, per_axis("dilations")?);
        if x[2..].contains(&0) {
            return Err(cx.invalid(format!("input {x:?} has an empty spatial axis")));
        }
        // Attributes may hold any size: the arithmetic on them is checked.
        let too_large = || cx.invalid(format!("strides, dilations or pads too large for input {x:?}"));
        let extent = (0..spatial)
            .map(|d| dilations[d].checked_mul(kernel[d] - 1).and_then(|e| e.checked_add(1)))
            .collect::<Option<Vec<usize>>>()
            .ok_or_else(too_large)?;
        let (mut pad_begin, mut pad_end) = (vec![0; spatial], vec![0; spatial]);
        match attr_string(cx, "auto_pad").as_deref().unwrap_or("NOTSET") {
            "NOTSET" => {
                if let Some(pads) = attr_ints(cx, "pads") {
                    if pads.len() != 2 * spatial {
                        return Err(
                            cx.invalid(format!("pads {pads:?} must have 2 entries per spatial axis ({spatial})"))
                        );
                    }
                    let pads = dims(&pads, cx, "pads")?;
                    (pad_begin, pad_end) = (pads[..spatial].to_vec(), pads[spatial..].to_vec());
                }
            }
            "VALID" => {}
            mode @ ("SAME_UPPER" | "SAME_LOWER") => {
                for d in 0..spatial {
                    let out = x[2 + d].div_ceil(strides[d]);
                    let covered = ((out - 1).checked_mul(strides[d])).and_then(|c| c.checked_add(extent[d]));
                    let total = covered.ok_or_else(too_large)?.saturating_sub(x[2 + d]);
                    let small = total / 2;
                    (pad_begin[d], pad_end[d]) =
                        if mode == "SAME_UPPER" { (small, total - small) } else { (total - small, small) };
                }
            }
            other => {
                return Err(
                    cx.invalid(format!("auto_pad '{other}' is not one of NOTSET, VALID, SAME_UPPER, SAME_LOWER"))
                )
            }
        }
        let mut output = Vec::with_capacity(spatial);
        for d in 0..spatial {
            let padded =
                (x[2 + d].checked_add(pad_begin[d])).and_then(|p| p.checked_add(pad_end[d])).ok_or_else(too_large)?;
            if padded < extent[d] {
                return Err(cx.invalid(format!(
                    "spatial axis {d}: the padded input ({padded}) is shorter than the dilated kernel ({})",
                    extent[d]
                )));
            }
            output.push((padded - extent[d]) / strides[d] + 1);
        }
        Ok(ConvShape {
            batch: x[0],
            in_channels,
            out_channels,
            groups,
            kernel,
            strides,
            dilations,
            pad_begin,
            pad_end,
            output,
        })
    }

    /// Every kernel position, the last spatial axis fastest (the weight's order).
    fn taps(&self) -> Vec<Vec<usize>> {
        let mut taps = vec![vec![]];
        for &k in &self.kernel {
            taps = taps.into_iter().flat_map(|t| (0..k).map(move |j| [t.clone(), vec![j]].concat())).collect();
        }
        taps
    }
}

pub(super) fn convert_conv(imp: &mut Importer, cx: &NodeCx) -> Result<Vec<Sym>, FrontendError> {
    let (x, w) = (input(imp, cx, 0)?, input(imp, cx, 1)?);
    let (x_ty, w_ty) = (imp.ty(&x), imp.ty(&w));
    let conv = ConvShape::read(cx, &x_ty.shape, &w_ty.shape)?;
    let spatial = conv.kernel.len();
    let mut padded = x;
    if conv.pad_begin.iter().chain(&conv.pad_end).any(|&p| p > 0) {
        let begin = [vec![0, 0], conv.pad_begin.clone()].concat();
        let end = [vec![0, 0], conv.pad_end.clone()].concat();
        padded = imp.emit1(cx, Op::Pad { begin, end, value: 0.0 }, &[padded])?;
    }
    let padded_shape = imp.ty(&padded).shape;
    let mut tap_inputs = Vec::new();
    for tap in conv.taps() {
        let mut starts = vec![0; padded_shape.len()];
        let mut ends: Vec<i64> = padded_shape.iter().map(|&d| d as i64).collect();
        let mut steps = vec![1; padded_shape.len()];
        for d in 0..spatial {
            starts[2 + d] = tap[d] * conv.dilations[d];
            ends[2 + d] = (starts[2 + d] + (conv.output[d] - 1) * conv.strides[d] + 1) as i64;
            steps[2 + d] = conv.strides[d] as i64;
        }
        tap_inputs.push(imp.emit1(cx, Op::Slice { starts, ends, steps }, &[padded.clone()])?);
    }
    let in_per_group = conv.in_channels / conv.groups;
    let mut y = if in_per_group == 1 {
        depthwise(imp, cx, &conv, &w, tap_inputs)?
    } else {
        im2col(imp, cx, &conv, &w, tap_inputs)?
    };
    if let Some(bias) = opt_input(imp, cx, 2)? {
        let shape = [vec![conv.out_channels], vec![1; spatial]].concat();
        let bias = imp.emit1(cx, Op::Reshape { shape }, &[bias])?;
        y = imp.emit1(cx, Op::Binary(BinaryOp::Add), &[y, bias])?;
    }
    one(y)
}

/// `sum over taps of x_tap * w[:, 0, tap]`, each output channel reading its group's one input
/// channel (`Cout / G` outputs a group).
fn depthwise(imp: &mut Importer, cx: &NodeCx, conv: &ConvShape, w: &Sym, taps: Vec<Sym>) -> Result<Sym, FrontendError> {
    let spatial = conv.kernel.len();
    let multiplier = conv.out_channels / conv.groups;
    // The weight read once (one use: one ZeRO-3 gather), as `[Cout, K]` split into its taps.
    let kernel_size = taps.len();
    let w = imp.emit1(cx, Op::Reshape { shape: vec![conv.out_channels, kernel_size] }, std::slice::from_ref(w))?;
    let w_taps = imp.emit(cx, Op::Split { axis: 1, sizes: vec![1; kernel_size] }, &[w], kernel_size)?;
    let mut sum: Option<Sym> = None;
    for (x_tap, w_tap) in taps.into_iter().zip(w_taps) {
        let product = if multiplier == 1 {
            let shape = [vec![conv.out_channels], vec![1; spatial]].concat();
            let w_tap = imp.emit1(cx, Op::Reshape { shape }, &[w_tap])?;
            imp.emit1(cx, Op::Binary(BinaryOp::Mul), &[x_tap, w_tap])?
        } else {
            let x_shape = [vec![conv.batch, conv.groups, 1], conv.output.clone()].concat();
            let x_tap = imp.emit1(cx, Op::Reshape { shape: x_shape }, &[x_tap])?;
            let w_shape = [vec![conv.groups, multiplier], vec![1; spatial]].concat();
            let w_tap = imp.emit1(cx, Op::Reshape { shape: w_shape }, &[w_tap])?;
            let product = imp.emit1(cx, Op::Binary(BinaryOp::Mul), &[x_tap, w_tap])?;
            let shape = [vec![conv.batch, conv.out_channels], conv.output.clone()].concat();
            imp.emit1(cx, Op::Reshape { shape }, &[product])?
        };
        sum = Some(match sum {
            None => product,
            Some(s) => imp.emit1(cx, Op::Binary(BinaryOp::Add), &[s, product])?,
        });
    }
    sum.ok_or_else(|| cx.invalid("the kernel has no positions"))
}

/// The taps stacked per group as `[N, G, Cin/G * K, P]` (input channel outer, kernel position
/// inner: the weight's order), multiplied by the weight as `[G, Cout/G, Cin/G * K]`.
fn im2col(imp: &mut Importer, cx: &NodeCx, conv: &ConvShape, w: &Sym, taps: Vec<Sym>) -> Result<Sym, FrontendError> {
    let in_per_group = conv.in_channels / conv.groups;
    let positions: usize = conv.output.iter().product();
    let kernel_size = taps.len();
    let column_shape = vec![conv.batch, conv.groups, in_per_group, 1, positions];
    let columns = taps
        .into_iter()
        .map(|t| imp.emit1(cx, Op::Reshape { shape: column_shape.clone() }, &[t]))
        .collect::<Result<Vec<_>, _>>()?;
    let stacked =
        if columns.len() == 1 { columns[0].clone() } else { imp.emit1(cx, Op::Concat { axis: 3 }, &columns)? };
    let stacked = imp.emit1(
        cx,
        Op::Reshape { shape: vec![conv.batch, conv.groups, in_per_group * kernel_size, positions] },
        &[stacked],
    )?;
    let w_shape = vec![conv.groups, conv.out_channels / conv.groups, in_per_group * kernel_size];
    let w = imp.emit1(cx, Op::Reshape { shape: w_shape }, std::slice::from_ref(w))?;
    let product = imp.emit1(cx, Op::MatMul { transpose_lhs: false, transpose_rhs: false }, &[w, stacked])?;
    let shape = [vec![conv.batch, conv.out_channels], conv.output.clone()].concat();
    imp.emit1(cx, Op::Reshape { shape }, &[product])
}
