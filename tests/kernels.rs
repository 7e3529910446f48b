//! Generated kernels against the builtin ones: each case is a small graph lowered both ways
//! (`KernelChoice::Builtin` is the oracle), run on the same random inputs, compared element by
//! element with the tolerance stated per case. Shapes are odd on purpose (vector tails, rows
//! shorter and longer than a vector), masks carry -inf, and magnitudes run from 1e-30 to 1e30.

use autotp_codegen::{lower_with, KernelChoice, LowerOptions};
use autotp_ir::Tensor;
use autotp_program::Instruction;
use autotp_runtime::{Executor, HostTensor};

use crate::common::random_tensor;

/// The unit roundoff of f32.
const F32_UNIT: f64 = f32::EPSILON as f64 / 2.0;

/// γ_n = n·u / (1 − n·u) for f32: summing `n + 1` terms in any order, with any split into
/// lanes, errs by at most γ_n times the sum of their magnitudes (Higham, *Accuracy and Stability
/// of Numerical Algorithms*, §4.2). The generated kernels sum in the vector lanes of the CPU's
/// level (8 or 16) and the builtin ones in f64, so their difference is bounded by this, not by
/// a constant that holds for one vector width only.
fn gamma(n: usize) -> f64 {
    let nu = n as f64 * F32_UNIT;
    nu / (1.0 - nu)
}

/// The error allowed for ops computed element by element: the transcendentals are 1-3 ulps
/// from the exact value (`autotp_llvm::math`), the builtin kernels' libm within an ulp, and a
/// few roundings follow.
const ELEMENTWISE: f64 = 2e-6;

/// How far a generated output may be from the builtin one, element by element.
#[derive(Clone, Copy, Debug)]
enum Tolerance {
    /// Within this fraction of the output's largest reference magnitude (at least 1).
    Relative(f64),
    /// A sum or mean of `terms` elements: within γ(terms − 1) times the magnitudes summed (the
    /// same reduction of |x|, from the builtin kernel) plus two roundings of the result.
    Sum { terms: usize },
}

/// Runs `graph` with generated and with builtin kernels and checks every output within `tol`
/// (see [`Tolerance`]). Also checks that the generated program runs at least `generated`
/// generated kernels, so a case cannot pass by falling back to the builtin kernel.
fn check(text: &str, generated: usize, tol: Tolerance) {
    let magnitudes = match tol {
        Tolerance::Sum { .. } => Some(magnitudes_summed(text)),
        Tolerance::Relative(_) => None,
    };
    for (o, (name, g, w)) in outputs_both_ways(text, generated, false).into_iter().enumerate() {
        let scale = w.iter().filter(|x| x.is_finite()).fold(1f64, |m, x| m.max(x.abs()));
        for (i, (a, b)) in g.iter().zip(&w).enumerate() {
            let bound = match (tol, &magnitudes) {
                (Tolerance::Relative(r), _) => r * scale,
                (Tolerance::Sum { terms }, Some(m)) => gamma(terms - 1) * m[o][i] + 2.0 * F32_UNIT * b.abs(),
                (Tolerance::Sum { .. }, None) => unreachable!("magnitudes are computed for sums"),
            };
            let same_special = (a.is_nan() && b.is_nan()) || (a.is_infinite() && a == b);
            assert!(
                same_special || (a - b).abs() <= bound,
                "output '{name}' element {i}: generated {a}, builtin {b} (tolerance {bound:e}, {tol:?})\n{text}"
            );
        }
    }
}

/// The outputs of `text` with every input replaced by its magnitude (an `abs` before its first
/// use), from the builtin kernels: for a sum, the sum of the magnitudes of its terms.
fn magnitudes_summed(text: &str) -> Vec<Vec<f64>> {
    let graph = autotp_ir::text::parse(text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let mut absolute = String::new();
    let mut inputs = Vec::new();
    for line in text.lines() {
        let trimmed = line.trim_start();
        if let Some(rest) = trimmed.strip_prefix("input %") {
            let (name, ty) = rest.split_once(" : ").expect("input line");
            absolute.push_str(&format!("  input %{name}_signed : {ty}\n"));
            inputs.push((name.to_string(), ty.to_string()));
            continue;
        }
        if !inputs.is_empty() && !trimmed.starts_with("input") {
            for (name, ty) in inputs.drain(..) {
                absolute.push_str(&format!("  %{name} = abs %{name}_signed : {ty}\n"));
            }
        }
        absolute.push_str(line);
        absolute.push('\n');
    }
    let abs_graph = autotp_ir::text::parse(&absolute).unwrap_or_else(|e| panic!("{e}\n{absolute}"));
    assert_eq!(abs_graph.inputs().len(), graph.inputs().len());
    run(&abs_graph, &random_inputs(&graph), KernelChoice::Builtin).0.iter().map(values).collect()
}

/// Random inputs for `graph`, the same for every run of it.
fn random_inputs(graph: &autotp_ir::Graph) -> Vec<HostTensor> {
    graph
        .inputs()
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let t = random_tensor(graph.ty(v), 17 + i as u64);
            HostTensor { dtype: t.dtype(), shape: t.ty.shape.clone(), data: t.bytes().to_vec() }
        })
        .collect()
}

/// The outputs of `graph` on `inputs` with `kernels`, and how many generated kernels ran.
fn run(graph: &autotp_ir::Graph, inputs: &[HostTensor], kernels: KernelChoice) -> (Vec<HostTensor>, usize) {
    let program = lower_with(graph, &LowerOptions { kernels, ..Default::default() }).unwrap();
    let count = program.instructions.iter().filter(|i| matches!(i, Instruction::Generated { .. })).count();
    let mut executor = Executor::new(program).unwrap();
    (executor.run(inputs).unwrap(), count)
}

fn values(t: &HostTensor) -> Vec<f64> {
    Tensor::from_pod(t.dtype, t.shape.clone(), &t.data).to_f64_vec()
}

/// Each output of `graph` by name, from the generated kernels and from the builtin ones (see
/// [`check`]); with `fuse`, the generated side's ops grouped by the `fusion` pass first.
fn outputs_both_ways(text: &str, generated: usize, fuse: bool) -> Vec<(String, Vec<f64>, Vec<f64>)> {
    let graph = autotp_ir::text::parse(text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let inputs = random_inputs(&graph);
    let (want, none) = run(&graph, &inputs, KernelChoice::Builtin);
    assert_eq!(none, 0);
    let mut fused = graph.clone();
    if fuse {
        autotp_passes::PassManager::new(vec![Box::new(autotp_passes::fusion::Fusion::default())])
            .run(&mut fused)
            .unwrap();
        assert!(!fused.fusions().is_empty(), "nothing fused:\n{text}");
    }
    let (got, count) = run(&fused, &inputs, KernelChoice::Generated);
    assert!(count >= generated, "{count} generated kernels, expected {generated}:\n{text}");
    (graph.outputs().iter().zip(&want).zip(&got))
        .map(|(((name, _), w), g)| (name.clone(), values(g), values(w)))
        .collect()
}

/// Equal, or the same special value.
const EXACT: Tolerance = Tolerance::Relative(0.0);

const SHAPES: [&str; 4] = ["[1]", "[3,5]", "[2,7,37]", "[4,1000]"];

#[test]
fn unary_ops_match_the_builtin_kernels() {
    for shape in SHAPES {
        for (op, scale, tol) in [
            ("neg", 1.0, 0.0),
            ("abs", 1.0, 0.0),
            ("exp", 80.0, 2e-7),
            ("exp", 1e-30, 2e-7),
            ("log", 1.0, 2e-7),
            ("log", 1e30, 2e-7),
            ("sqrt", 1.0, 2e-7),
            ("rsqrt", 1.0, 2e-7),
            ("reciprocal", 1.0, 2e-7),
            ("tanh", 10.0, 2e-7),
            ("erf", 4.0, 4e-7),
            ("sigmoid", 100.0, 4e-7),
            ("softplus", 100.0, 4e-7),
            ("softplus", 1.0, 4e-7),
            ("relu", 1.0, 0.0),
            ("floor", 10.0, 0.0),
            ("ceil", 10.0, 0.0),
            ("round", 10.0, 0.0),
            ("sign", 1.0, 0.0),
            ("finite_zero", 1.0, 0.0),
        ] {
            let text = format!(
                "graph \"unary\" {{\n  input %x : f32{shape}\n  %0 = constant splat<{scale:e}> : f32[]\n  \
                 %1 = mul %x, %0 : f32{shape}\n  %2 = {op} %1 : f32{shape}\n  output \"y\" = %2\n}}\n"
            );
            check(&text, 1, Tolerance::Relative(tol));
        }
        // exp(100 x) is inf for x above 0.89: finite_zero is NaN there, 0 elsewhere, both ways.
        let text = format!(
            "graph \"finite\" {{\n  input %x : f32{shape}\n  %0 = constant splat<100.0> : f32[]\n  \
             %1 = mul %x, %0 : f32{shape}\n  %2 = exp %1 : f32{shape}\n  %3 = finite_zero %2 : f32{shape}\n  \
             output \"y\" = %3\n}}\n"
        );
        check(&text, 1, EXACT);
    }
}

#[test]
fn broadcasting_binary_ops_match_the_builtin_kernels() {
    let pairs = [
        ("[3,7,5]", "[3,7,5]"),
        ("[3,7,5]", "[5]"),
        ("[3,7,5]", "[3,1,5]"),
        ("[3,7,5]", "[1,7,1]"),
        ("[2,3,17,17]", "[1,1,17,17]"),
        ("[4,9]", "[]"),
        ("[4,1000]", "[4,1]"),
    ];
    for (lhs, rhs) in pairs {
        for op in ["add", "sub", "mul", "div", "max", "min"] {
            let text = format!(
                "graph \"binary\" {{\n  input %a : f32{lhs}\n  input %b : f32{rhs}\n  \
                 %0 = {op} %a, %b : f32{lhs}\n  output \"y\" = %0\n}}\n"
            );
            check(&text, 1, EXACT);
        }
        for op in ["less", "greater_equal", "equal"] {
            let text = format!(
                "graph \"compare\" {{\n  input %a : f32{lhs}\n  input %b : f32{rhs}\n  \
                 %0 = {op} %a, %b : bool{lhs}\n  %1 = cast %0 {{to = f32}} : f32{lhs}\n  output \"y\" = %1\n}}\n"
            );
            check(&text, 1, EXACT);
        }
    }
}

#[test]
fn transposes_match_the_builtin_kernels() {
    for (shape, perm, out) in [
        ("[2,7,3,5]", "[0, 2, 1, 3]", "[2,3,7,5]"),
        ("[37,19]", "[1, 0]", "[19,37]"),
        ("[2,3,4]", "[2, 0, 1]", "[4,2,3]"),
    ] {
        let text = format!(
            "graph \"transpose\" {{\n  input %x : f32{shape}\n  %0 = transpose %x {{perm = {perm}}} : f32{out}\n  \
             %1 = constant splat<2.0> : f32[]\n  %2 = mul %0, %1 : f32{out}\n  output \"t\" = %0\n  output \"y\" = %2\n}}\n"
        );
        check(&text, 2, EXACT);
    }
}

/// One transposed weight read through strides by two matmuls of other batch ranks (ProphetNet's
/// relative-position projection, read by its main and its n-gram streams): each matmul pads
/// the operand's batch dims to its own rank. The layout of one used to serve both, and the
/// program was refused as invalid.
#[test]
fn a_transpose_read_by_matmuls_of_two_batch_ranks() {
    let text = "graph \"shared_transpose\" {\n  input %a : f32[2,3,8]\n  input %b : f32[2,4,3,8]\n  \
                param %w : f32[5,8]\n  %0 = transpose %w {perm = [1, 0]} : f32[8,5]\n  \
                %1 = matmul %a, %0 : f32[2,3,5]\n  %2 = matmul %b, %0 : f32[2,4,3,5]\n  \
                output \"main\" = %1\n  output \"ngram\" = %2\n}\n";
    check(text, 0, Tolerance::Relative(1e-6));
}

#[test]
fn slices_and_pads_match_the_builtin_kernels() {
    // Rotary embeddings' halves (a slice of the last dim) and their gradients (a pad back).
    for (shape, starts, ends, steps, out) in [
        ("[2,7,3,16]", "[0, 0, 0, 8]", "[2, 7, 3, 16]", "[1, 1, 1, 1]", "[2,7,3,8]"),
        ("[2,7,3,16]", "[0, 0, 0, 0]", "[2, 7, 3, 8]", "[1, 1, 1, 1]", "[2,7,3,8]"),
        ("[9,10]", "[1, 3]", "[9, 10]", "[2, 3]", "[4,3]"),
    ] {
        let text = format!(
            "graph \"slice\" {{\n  input %x : f32{shape}\n  \
             %0 = slice %x {{starts = {starts}, ends = {ends}, steps = {steps}}} : f32{out}\n  \
             output \"y\" = %0\n}}\n"
        );
        check(&text, 1, EXACT);
    }
    for (shape, begin, end, out, value) in [
        ("[2,7,3,8]", "[0, 0, 0, 8]", "[0, 0, 0, 0]", "[2,7,3,16]", "0.0"),
        ("[2,7,3,8]", "[0, 0, 0, 0]", "[0, 0, 0, 8]", "[2,7,3,16]", "0.0"),
        ("[5,3]", "[1, 2]", "[2, 0]", "[8,5]", "-inf"),
        ("[37]", "[3]", "[5]", "[45]", "1.5"),
    ] {
        let text = format!(
            "graph \"pad\" {{\n  input %x : f32{shape}\n  \
             %0 = pad %x {{begin = {begin}, end = {end}, value = {value}}} : f32{out}\n  \
             output \"y\" = %0\n}}\n"
        );
        check(&text, 1, EXACT);
    }
}

#[test]
fn integer_comparisons_match_the_builtin_kernels() {
    let text = "graph \"one_hot\" {
  input %labels : i64[37,1]
  %0 = constant dense<[0, 1, 2, 3, 4]> : i64[5]
  %1 = equal %0, %labels : bool[37,5]
  %2 = cast %1 {to = f32} : f32[37,5]
  output \"y\" = %2
}
";
    check(text, 1, EXACT);
}

/// A router's gathers and masks as generated kernels, so that a GPU runs them: elements of a
/// row picked by i64 indices (negative ones from the end), index arithmetic and selects on
/// i64, a float mask cast to bool, and a sum over two dims apart (gpt-oss's sink gradient).
#[test]
fn routing_gathers_and_masks_match_the_builtin_kernels() {
    let text = "graph \"routing\" {
  input %x : f32[37,5]
  input %i : i64[37,3]
  %0 = constant dense<[2]> : i64[]
  %1 = sub %i, %0 : i64[37,3]
  %2 = gather_elements %x, %i {axis = 1} : f32[37,3]
  %3 = gather_elements %x, %1 {axis = 1} : f32[37,3]
  %4 = constant dense<[0]> : i64[]
  %5 = less %1, %4 : bool[37,3]
  %6 = constant dense<[5]> : i64[]
  %7 = add %1, %6 : i64[37,3]
  %8 = select %5, %7, %1 : i64[37,3]
  %9 = cast %x {to = bool} : bool[37,5]
  output \"picked\" = %2
  output \"from_end\" = %3
  output \"wrapped\" = %8
  output \"mask\" = %9
}
";
    check(text, 4, EXACT);
    let sums = "graph \"sink_gradient\" {
  input %g : f32[4,5,6,1]
  %0 = reduce_sum %g {axes = [0, 2], keep_dims = true} : f32[1,5,1,1]
  output \"y\" = %0
}
";
    check(sums, 1, Tolerance::Sum { terms: 24 });
}

/// `not` on bools is a generated kernel, alone and in the overflow test's chain (`x - x == 0`,
/// negated, as f32), so the overflow decision stays on the device.
#[test]
fn bool_negation_matches_the_builtin_kernel() {
    for shape in SHAPES {
        let text = format!(
            "graph \"not\" {{\n  input %x : f32{shape}\n  %0 = sub %x, %x : f32{shape}\n  \
             %1 = constant splat<0> : f32{shape}\n  %2 = equal %0, %1 : bool{shape}\n  \
             %3 = not %2 : bool{shape}\n  %4 = cast %3 {{to = f32}} : f32{shape}\n  output \"not\" = %3\n  \
             output \"overflow\" = %4\n}}\n"
        );
        check(&text, 4, EXACT);
    }
}

#[test]
fn selects_and_gelus_match_the_builtin_kernels() {
    let select = "graph \"select\" {
  input %c : bool[2,3,17,17]
  input %x : f32[2,3,17,17]
  %0 = constant splat<-inf> : f32[]
  %1 = select %c, %x, %0 : f32[2,3,17,17]
  output \"y\" = %1
}
";
    check(select, 1, EXACT);
    for approx in ["none", "tanh"] {
        for shape in SHAPES {
            let text = format!(
                "graph \"gelu\" {{\n  input %x : f32{shape}\n  %0 = constant splat<6.0> : f32[]\n  \
                 %1 = mul %x, %0 : f32{shape}\n  %2 = gelu %1 {{approx = {approx}}} : f32{shape}\n  output \"y\" = %2\n}}\n"
            );
            check(&text, 1, Tolerance::Relative(1e-6));
        }
    }
}

/// Each `(shape, kept shape, axes)` reduced by sum, mean and max, as one generated kernel
/// against the builtin one (sums and means within their rounding bound, maxima exact).
fn check_reductions(cases: &[(&str, &str, &str)]) {
    for &(shape, keep, axes) in cases {
        let dims =
            |s: &str| -> Vec<usize> { s.trim_matches(['[', ']']).split(',').map(|d| d.parse().unwrap()).collect() };
        let terms = dims(shape).iter().product::<usize>() / dims(keep).iter().product::<usize>();
        for (op, tol) in [("sum", Tolerance::Sum { terms }), ("mean", Tolerance::Sum { terms }), ("max", EXACT)] {
            let text = format!(
                "graph \"reduce\" {{\n  input %x : f32{shape}\n  \
                 %0 = reduce_{op} %x {{axes = {axes}, keep_dims = true}} : f32{keep}\n  output \"y\" = %0\n}}\n"
            );
            check(&text, 1, tol);
        }
    }
}

#[test]
fn row_reductions_match_the_builtin_kernels() {
    check_reductions(&[
        ("[5,3]", "[5,1]", "[1]"),
        ("[2,7,37]", "[2,7,1]", "[2]"),
        ("[2,7,37]", "[2,1,1]", "[1, 2]"),
        ("[3,2000]", "[3,1]", "[1]"),
        // Over leading dims: bias gradients.
        ("[5,3]", "[1,3]", "[0]"),
        ("[2,7,37]", "[1,7,37]", "[0]"),
        ("[2,7,37]", "[1,1,37]", "[0, 1]"),
        ("[1000,3]", "[1,3]", "[0]"),
    ]);
}

/// Sums and maxima over whole tensors of more than 2^20 elements run as two kernels (partials
/// over rows, then their total: `autotp_kernelgen::split`), within a sum's rounding bound of
/// the builtin kernel; so does the overflow test of a 16-bit gradient (a sum, the cast it reads,
/// and the test on the total), whose cast values are stored too.
#[test]
fn whole_tensor_reductions_split_across_rows_match_the_builtin_kernels() {
    let terms = 1024 * 1536;
    for (op, tol) in [("sum", Tolerance::Sum { terms }), ("mean", Tolerance::Sum { terms }), ("max", EXACT)] {
        let text = format!(
            "graph \"whole\" {{\n  input %x : f32[1024,1536]\n  \
             %0 = reduce_{op} %x {{axes = [0, 1], keep_dims = false}} : f32[]\n  output \"y\" = %0\n}}\n"
        );
        check(&text, 2, tol);
    }
    let overflow = "graph \"overflow\" {\n  input %g : bf16[1024,1536]\n  \
                    %0 = cast %g {to = f32} : f32[1024,1536]\n  \
                    %1 = reduce_sum %0 {axes = [0, 1], keep_dims = false} : f32[]\n  \
                    %2 = sub %1, %1 : f32[]\n  %3 = constant splat<0> : f32[]\n  %4 = equal %2, %3 : bool[]\n  \
                    output \"finite\" = %4\n  output \"g32\" = %0\n}\n";
    for (name, got, want) in outputs_both_ways(overflow, 2, true) {
        assert_eq!(got, want, "{name}: the cast is exact and the sum of bf16 values finite either way");
    }
}

/// Sums, means and maxima over middle dims (grouped-query attention's key and value gradients
/// sum over the heads sharing them) are generated kernels whose rows are the kept dims.
#[test]
fn middle_dim_reductions_match_the_builtin_kernels() {
    check_reductions(&[
        ("[4,2,2,32,16]", "[4,2,1,32,16]", "[2]"),
        ("[2,7,37]", "[2,1,37]", "[1]"),
        ("[3,4,5,6]", "[3,1,1,6]", "[1, 2]"),
    ]);
}

#[test]
fn softmax_and_norms_match_the_builtin_kernels() {
    for shape in ["[3,1]", "[3,5]", "[2,7,37]", "[2,3,17,17]", "[4,1000]"] {
        let dims: Vec<usize> = shape.trim_matches(['[', ']']).split(',').map(|d| d.parse().unwrap()).collect();
        let last = dims.len() - 1;
        let cols = dims[last];
        for op in ["softmax", "log_softmax"] {
            // A causal-style mask of -inf on some elements, and one row fully visible.
            let text = format!(
                "graph \"softmax\" {{\n  input %x : f32{shape}\n  input %keep : bool{shape}\n  \
                 %0 = constant splat<-inf> : f32[]\n  %1 = constant splat<20.0> : f32[]\n  \
                 %2 = mul %x, %1 : f32{shape}\n  %3 = select %keep, %2, %0 : f32{shape}\n  \
                 %4 = {op} %2 {{axis = {last}}} : f32{shape}\n  %5 = {op} %3 {{axis = {last}}} : f32{shape}\n  \
                 output \"plain\" = %4\n  output \"masked\" = %5\n}}\n"
            );
            check(&text, 3, Tolerance::Relative(gamma(cols) + ELEMENTWISE));
        }
        let text = format!(
            "graph \"norms\" {{\n  input %x : f32{shape}\n  input %w : f32[{cols}]\n  input %b : f32[{cols}]\n  \
             %0 = layer_norm %x, %w, %b {{axis = {last}, eps = 1e-5}} : f32{shape}\n  \
             %1 = rms_norm %x, %w {{axis = {last}, eps = 1e-6}} : f32{shape}\n  \
             output \"ln\" = %0\n  output \"rms\" = %1\n}}\n"
        );
        // Two chained sums over the row: the mean (or mean square), then the variance.
        check(&text, 2, Tolerance::Relative(2.0 * gamma(cols) + ELEMENTWISE));
    }
}

#[test]
fn cross_entropy_matches_the_builtin_kernel() {
    for shape in ["[7,5]", "[37,1000]", "[3,50257]"] {
        for (ignore, reduction) in [("none", "mean"), ("1", "mean"), ("0", "sum")] {
            let rows = &shape[1..shape.find(',').unwrap()];
            let text = format!(
                "graph \"ce\" {{\n  input %x : f32{shape}\n  input %labels : i64[{rows}]\n  \
                 %0 = constant splat<30.0> : f32[]\n  %1 = mul %x, %0 : f32{shape}\n  \
                 %2 = cross_entropy %1, %labels {{ignore_index = {ignore}, reduction = {reduction}}} : f32[]\n  \
                 output \"loss\" = %2\n}}\n"
            );
            let (rows, cols): (usize, usize) =
                (rows.parse().unwrap(), shape[shape.find(',').unwrap() + 1..shape.len() - 1].parse().unwrap());
            // A log-sum-exp over each row's classes, then the mean over rows.
            check(&text, 3, Tolerance::Relative(gamma(cols) + gamma(rows) + ELEMENTWISE));
        }
    }
}

/// Every fusion group the fixtures' gradient steps make, against its unfused ops: the loss and
/// every gradient computed with the `fusion` pass and generated kernels (and matmuls reading
/// transposes through strides) against the builtin kernels node by node (the same step, the
/// same inputs and weights).
#[test]
fn fused_gradient_steps_match_the_unfused_ones() {
    use crate::common::{fixture, read_npy, ARCHES};
    for arch in ARCHES {
        let options = autotp_frontend::ImportOptions { batch: Some(4), seq_len: Some(32), ..Default::default() };
        let mut model = autotp_frontend::import_onnx(&fixture(arch, "model_loss.onnx"), &options).unwrap();
        autotp_passes::PassManager::simplify_pipeline().run(&mut model.graph).unwrap();
        let autodiff = autotp_passes::autodiff::Autodiff::new("loss");
        autotp_passes::PassManager::new(vec![Box::new(autodiff)]).run(&mut model.graph).unwrap();
        let mut fused = model.graph.clone();
        autotp_passes::PassManager::new(vec![Box::new(autotp_passes::fusion::Fusion::default())])
            .run(&mut fused)
            .unwrap();
        assert!(fused.fusions().len() >= 4, "{arch}: only {} fusion groups", fused.fusions().len());
        let ids = read_npy(&fixture(arch, "input_ids.npy"));
        let feed: Vec<HostTensor> = [&ids, &ids]
            .iter()
            .map(|t| HostTensor { dtype: t.dtype(), shape: t.shape().to_vec(), data: t.bytes().to_vec() })
            .collect();
        // Attention's head transposes that only matmuls read are read through strides.
        let program =
            lower_with(&fused, &LowerOptions { kernels: KernelChoice::Generated, ..Default::default() }).unwrap();
        let strided = program.instructions.iter().any(|i| {
            matches!(i, Instruction::Kernel { kernel: autotp_kernels::Kernel::MatMul { dims, .. }, .. }
                if dims.lhs_layout.is_some() || dims.rhs_layout.is_some())
        });
        assert!(strided, "{arch}: no matmul reads a transpose through strides");
        let run = |graph: &autotp_ir::Graph, kernels: KernelChoice| {
            let program = lower_with(graph, &LowerOptions { kernels, ..Default::default() }).unwrap();
            let mut executor = Executor::new(program).unwrap();
            for (name, t) in &model.weights {
                executor.load_slot(name, t.bytes()).unwrap();
            }
            executor.run(&feed).unwrap()
        };
        let want = run(&model.graph, KernelChoice::Builtin);
        let got = run(&fused, KernelChoice::Generated);
        for (((name, _), w), g) in fused.outputs().iter().zip(&want).zip(&got) {
            let w = Tensor::from_pod(w.dtype, w.shape.clone(), &w.data);
            let g = Tensor::from_pod(g.dtype, g.shape.clone(), &g.data);
            let (diff, scale) = crate::common::max_abs_diff(&g, &w);
            assert!(diff <= 1e-5 * scale.max(1e-6), "{arch}: {name} differs by {diff} (max {scale})");
        }
    }
}

/// 16-bit kernels (mixed precision): loads widen, every op with a 16-bit result rounds it to
/// nearest even, stores narrow; the builtin kernels compute each op in f32 and round once, so
/// the two agree but for a transcendental's last f32 bit tipping a rounding (one 16-bit ulp).
#[test]
fn sixteen_bit_kernels_match_the_builtin_kernels() {
    for (dtype, ulp) in [("bf16", 2f64.powi(-8)), ("f16", 2f64.powi(-11))] {
        for shape in ["[3,5]", "[2,7,37]", "[4,1000]"] {
            let last = shape.matches(',').count();
            let text = format!(
                "graph \"half\" {{\n  input %x : {dtype}{shape}\n  input %y : {dtype}{shape}\n  \
                 %0 = constant splat<3.0> : {dtype}[]\n  %1 = mul %x, %0 : {dtype}{shape}\n  \
                 %2 = add %1, %y : {dtype}{shape}\n  %3 = tanh %2 : {dtype}{shape}\n  \
                 %4 = cast %3 {{to = f32}} : f32{shape}\n  %5 = exp %4 : f32{shape}\n  \
                 %6 = softmax %5 {{axis = {last}}} : f32{shape}\n  %7 = cast %6 {{to = {dtype}}} : {dtype}{shape}\n  \
                 %8 = reduce_sum %4 {{axes = [{last}], keep_dims = true}} : f32{shape_keep}\n  \
                 %9 = cast %8 {{to = {dtype}}} : {dtype}{shape_keep}\n  %10 = gelu %2 : {dtype}{shape}\n  \
                 output \"sum\" = %2\n  output \"probs\" = %7\n  output \"total\" = %9\n  output \"gelu\" = %10\n}}\n",
                shape_keep = shape.rsplit_once(',').map_or("[1]".to_string(), |(head, _)| format!("{head},1]")),
            );
            let cols: usize = shape.rsplit(',').next().unwrap().trim_matches(['[', ']']).parse().unwrap();
            check(&text, 2, Tolerance::Relative(ulp + gamma(cols)));
            // Fused, each op still rounds where the builtin kernels round: all but a few
            // elements are equal.
            for (name, got, want) in outputs_both_ways(&text, 2, true) {
                let differ = got.iter().zip(&want).filter(|(a, b)| a != b && !(a.is_nan() && b.is_nan())).count();
                assert!(
                    differ * 50 <= got.len(),
                    "{dtype} {shape} '{name}': {differ} of {} elements differ",
                    got.len()
                );
            }
        }
    }
}

/// `ptxas` from the PyPI package nvidia-cuda-nvcc, which `scripts/ensure-deps.sh` installs into
/// `target/ptxas-venv`; `AUTOTP_PTXAS` names another.
fn ptxas() -> std::path::PathBuf {
    if let Some(path) = std::env::var_os("AUTOTP_PTXAS") {
        return path.into();
    }
    let venv = crate::common::repo().join("target/ptxas-venv/lib");
    let found = std::fs::read_dir(&venv).ok().and_then(|pythons| {
        pythons.flatten().find_map(|python| {
            let nvidia = python.path().join("site-packages/nvidia");
            std::fs::read_dir(nvidia).ok()?.flatten().map(|d| d.path().join("bin/ptxas")).find(|p| p.is_file())
        })
    });
    found.unwrap_or_else(|| {
        panic!(
            "ptxas not found in {} (nor AUTOTP_PTXAS): run scripts/ensure-deps.sh, which installs the PyPI \
             package nvidia-cuda-nvcc there",
            venv.display()
        )
    })
}

/// A step's clipped, guarded updates (`select(finite, grad * coef, old)` for 60 tensors of one
/// shape, `coef` and `finite` computed once, which fusion groups together) become kernels of
/// at most `autotp_kernelgen::MAX_BUFFERS` buffers, none of which spills registers on either
/// architecture; one kernel of all 182 buffers spilled.
#[test]
fn wide_fusion_groups_do_not_spill_registers() {
    let ptxas = ptxas();
    let mut text = String::from(
        "graph \"guarded\" {\n  input %total : f32[]\n  %coef = reciprocal %total : f32[]\n  \
         %nothing = sub %total, %total : f32[]\n  %zero = constant splat<0> : f32[]\n  \
         %finite = equal %nothing, %zero : bool[]\n",
    );
    for i in 0..60 {
        text.push_str(&format!("  input %g{i} : f32[4096]\n  input %p{i} : f32[4096]\n"));
    }
    for i in 0..60 {
        text.push_str(&format!(
            "  %c{i} = mul %g{i}, %coef : f32[4096]\n  %s{i} = select %finite, %c{i}, %p{i} : f32[4096]\n"
        ));
    }
    for i in 0..60 {
        text.push_str(&format!("  output \"s{i}\" = %s{i}\n"));
    }
    let mut graph = autotp_ir::text::parse(&(text + "}\n")).unwrap();
    autotp_passes::PassManager::new(vec![Box::new(autotp_passes::fusion::Fusion::default())]).run(&mut graph).unwrap();
    let options = LowerOptions { kernels: KernelChoice::Generated, ptx: true, ..Default::default() };
    let program = lower_with(&graph, &options).unwrap();
    let generated = program.instructions.iter().filter(|i| matches!(i, Instruction::Generated { .. })).count();
    assert!((6..60).contains(&generated), "{generated} generated kernels");
    assert!(program.kernels.iter().all(|k| k.buffers.len() <= autotp_kernelgen::MAX_BUFFERS));
    let dir = crate::common::scratch("wide-groups");
    for module in &program.ptx {
        let source = dir.join(format!("{}.ptx", module.arch));
        std::fs::write(&source, &module.code).unwrap();
        let report = assemble(&ptxas, &source, &module.arch);
        assert_eq!(register_use(&report).1, 0, "{}: entries spill registers:\n{report}", module.arch);
    }
}

/// Fused attention's GPU passes (forward, `dq`, `dk`/`dv`) at GPT-2 124M's shapes (12 heads of
/// 64, 1024 tokens, causal) in bf16 and f32, and with a bias, and with Llama's heads of 128
/// (grouped) in fp16, assemble for sm_80 and sm_90 without spilling registers (an f32 thread
/// holds a row of q, k, v or dout and its accumulators; a 16-bit warp its 16 rows' fragments).
/// Every 16-bit pass multiplies on tensor cores: `mma.sync` for every product, its B
/// fragments from the tiles in shared memory through `ldmatrix` (`.trans` for `p v`'s kind).
/// A context-parallel rank's passes (queries from a position an operand gives) assemble too;
/// its `dk`/`dv` tile pass, at 255 registers, may spill one (the queries' start).
#[test]
fn attention_ptx_assembles_without_spills() {
    use autotp_kernels::attention::{AttentionDims, AttentionFunction, AttentionMask, AttentionPass, AttentionTarget};
    use autotp_kernels::{DType, Kernel};
    let ptxas = ptxas();
    let dims = AttentionDims {
        lead: vec![8, 12],
        kv_lead: vec![8, 12],
        q_len: 1024,
        kv_len: 1024,
        head_dim: 64,
        value_dim: 64,
        bias: None,
        query_runs: None,
        key_blocks: None,
    };
    let with_bias = AttentionDims { bias: Some(vec![1, 12, 1024, 1024]), ..dims.clone() };
    let wide =
        AttentionDims { lead: vec![2, 8, 4], kv_lead: vec![2, 8, 1], head_dim: 128, value_dim: 128, ..dims.clone() };
    // A context-parallel rank's queries, from the position an operand gives.
    let positioned = AttentionDims { query_runs: Some(1), ..dims.clone() };
    let mut functions = Vec::new();
    let cases = [
        (DType::BF16, &dims),
        (DType::F32, &dims),
        (DType::BF16, &with_bias),
        (DType::F16, &wide),
        (DType::BF16, &positioned),
    ];
    for (dtype, dims) in cases {
        for kernel in [
            Kernel::Attention { dtype, dims: dims.clone(), scale: 0.125, mask: AttentionMask::Causal, generated: true },
            Kernel::AttentionGrad {
                dtype,
                dims: dims.clone(),
                scale: 0.125,
                mask: AttentionMask::Causal,
                generated: true,
            },
        ] {
            functions.extend(AttentionFunction::of(&kernel, AttentionTarget::Gpu).unwrap());
        }
    }
    let dir = crate::common::scratch("attention-ptx");
    for arch in autotp_llvm::nvptx::Arch::ALL {
        let entries = autotp_llvm::nvptx::GpuEntries { attention: &functions, ..Default::default() };
        let code = autotp_llvm::nvptx::program_ptx(&entries, arch).unwrap();
        for i in 0..functions.len() {
            assert!(code.contains(&format!(".entry {}(", autotp_llvm::attention::entry_name(i))));
        }
        let source = dir.join(format!("{}.ptx", arch.name()));
        std::fs::write(&source, &code).unwrap();
        let report = assemble(&ptxas, &source, arch.name());
        let positioned = autotp_llvm::attention::entry_name(functions.len() - 1);
        let spills = spills_by_entry(&report);
        assert_eq!(spills.len(), functions.len(), "a spill count per entry:\n{report}");
        for (entry, spilled) in spills {
            let allowed = if entry == positioned { 4 } else { 0 };
            assert!(spilled <= allowed, "{}: {entry} spills {spilled} bytes:\n{report}", arch.name());
        }
        let tiled: Vec<_> = functions.iter().filter(|f| f.tensor_cores).collect();
        assert_eq!(tiled.len(), 3 * 3 + 4, "every 16-bit pass runs on tensor cores");
        for operands in [DType::BF16, DType::F16] {
            let instruction = format!("mma.sync.aligned.m16n8k16.row.col.f32.{operands}.{operands}.f32");
            // Per column tile, a product with a tile's rows (q k^T) is 8 groups of 8 columns x
            // head_dim / 16 steps, one through a tile (p v) 4 steps of 16 columns x head_dim / 8
            // groups of head dims: head_dim / 2 each.
            let expected: usize = (tiled.iter().filter(|f| f.dtype == operands))
                .map(|f| {
                    let products = match f.pass {
                        AttentionPass::Forward | AttentionPass::ValueGrad => 2,
                        AttentionPass::QueryGrad | AttentionPass::KeyGrad => 3,
                        AttentionPass::KeyValueGrad => 4,
                    };
                    products * f.dims.head_dim / 2
                })
                .sum();
            assert_eq!(code.matches(&instruction).count(), expected, "{}: {instruction}", arch.name());
        }
        for ldmatrix in ["ldmatrix.sync.aligned.m8n8.x4.shared.b16", "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"] {
            assert!(code.contains(ldmatrix), "{}: {ldmatrix}", arch.name());
        }
        assert!(report.contains("bytes smem"), "{}: the key tiles live in shared memory:\n{report}", arch.name());
    }
}

/// `ptxas -v` on the PTX file `source` for `arch`, which must assemble: its report.
fn assemble(ptxas: &std::path::Path, source: &std::path::Path, arch: &str) -> String {
    let out = std::process::Command::new(ptxas)
        .args(["-v", &format!("-arch={arch}"), source.to_str().unwrap(), "-o", "/dev/null"])
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ptxas -arch={arch} failed on {}:\n{report}", source.display());
    report
}

/// The most registers an entry of a `ptxas -v` report uses, and the bytes its entries spill.
/// Each entry's bytes of spill stores in a `ptxas -v` report.
fn spills_by_entry(report: &str) -> Vec<(String, usize)> {
    let mut spills = Vec::new();
    let mut entry = String::new();
    for line in report.lines() {
        if let Some(rest) = line.split("Function properties for ").nth(1) {
            entry = rest.trim().to_string();
        }
        if let Some(before) = line.find(" bytes spill stores").map(|at| &line[..at]) {
            let bytes = before.split_whitespace().last().and_then(|n| n.parse().ok()).unwrap_or(usize::MAX);
            spills.push((entry.clone(), bytes));
        }
    }
    spills
}

fn register_use(report: &str) -> (usize, usize) {
    let number_before = |line: &str, what: &str| -> Option<usize> {
        let before = &line[..line.find(what)?];
        before.split_whitespace().last()?.parse().ok()
    };
    let registers = report.lines().filter_map(|l| number_before(l, " registers")).max().unwrap_or(0);
    let spills = report.lines().filter_map(|l| number_before(l, " bytes spill stores")).sum();
    (registers, spills)
}

/// All PTX the fixtures' plans carry (one rank, tp 2, dp 2 with ZeRO-3, pp 2, bf16, fp16; a
/// mixture of experts' routing), the builtin kernels' GPU forms included, assembles with ptxas
/// for sm_80 and sm_90, and no entry spills registers (`ptxas -v`).
#[test]
fn fixture_plans_ptx_assembles_with_ptxas() {
    use crate::common::{autotp, fixture, scratch, success};
    let ptxas = ptxas();
    let dir = scratch("ptxas");
    let layouts: [&[&str]; 7] = [
        &[],
        &["--tp", "2"],
        &["--dp", "2", "--zero", "3"],
        &["--pp", "2", "--grad-accum", "2"],
        &["--precision", "bf16"],
        &["--precision", "fp16", "--dp", "2", "--zero", "2"],
        &["--attention", "fused", "--precision", "bf16"],
    ];
    let (mut assembled, mut indexed_modules, mut most_registers) = (0, 0, 0);
    let (mut axis_entries, mut grouped_entries) = (0, 0);
    let routing: [&[&str]; 2] = [&[], &["--precision", "bf16"]];
    for (arch, layouts) in [("gpt2", &layouts[..]), ("llama", &layouts[..]), ("mixtral", &routing[..])] {
        for (l, layout) in layouts.iter().enumerate() {
            let model = fixture(arch, "model.onnx");
            let plan_path = dir.join(format!("{arch}-{l}.atp"));
            let args = [
                &["compile", model.to_str().unwrap(), "--seq-len", "32", "--micro-batch", "4"][..],
                layout,
                &["-o", plan_path.to_str().unwrap()],
            ]
            .concat();
            success(autotp(&args));
            let plan = autotp_program::plan::PlanFile::open(&plan_path).unwrap().plan;
            for (s, program) in plan.stages.iter().enumerate() {
                assert_eq!(program.ptx.len(), 2, "{arch} {layout:?} stage {s}: PTX for sm_80 and sm_90");
                // The builtin kernels' data movement and gathers and scatter-adds, which the
                // plan's modules hold; also assembled on their own.
                let (movement, indexed) = (&program.gpu_kernels.movement, &program.gpu_kernels.indexed);
                indexed_modules += usize::from(!indexed.is_empty());
                let (axis, grouped) = (program.gpu_kernels.axis.len(), program.gpu_kernels.grouped.len());
                (axis_entries, grouped_entries) = (axis_entries + axis, grouped_entries + grouped);
                for module in &program.ptx {
                    let entries = (0..movement.len()).map(autotp_llvm::nvptx::movement_entry_name);
                    let entries = entries.chain((0..indexed.len()).map(autotp_llvm::indexed::entry_name));
                    let entries = entries.chain((0..axis).map(autotp_llvm::axis::entry_name));
                    for entry in entries.chain((0..grouped).map(autotp_llvm::grouped::entry_name)) {
                        assert!(module.code.contains(&format!(".entry {entry}(")), "{} lacks {entry}", module.arch);
                    }
                }
                let mut modules = program.ptx.clone();
                for gpu_arch in autotp_llvm::nvptx::Arch::ALL {
                    let arch = gpu_arch.name().to_string();
                    let code = autotp_llvm::nvptx::ptx(movement, &[], gpu_arch).unwrap();
                    modules.push(autotp_program::PtxModule { arch: arch.clone(), code });
                    if !indexed.is_empty() {
                        let code = autotp_llvm::indexed::ptx(indexed, gpu_arch).unwrap();
                        modules.push(autotp_program::PtxModule { arch, code });
                    }
                }
                for (m, module) in modules.iter().enumerate() {
                    let source = dir.join(format!("{arch}-{l}-{s}-{m}-{}.ptx", module.arch));
                    std::fs::write(&source, &module.code).unwrap();
                    let report = assemble(&ptxas, &source, &module.arch);
                    let (registers, spills) = register_use(&report);
                    assert_eq!(spills, 0, "{}: entries spill registers ({}):\n{report}", source.display(), module.arch);
                    most_registers = most_registers.max(registers);
                    assembled += 1;
                }
            }
        }
    }
    assert!(assembled >= 76, "{assembled} PTX modules assembled");
    assert!(most_registers > 0 && most_registers < 255, "{most_registers} registers at most");
    assert!(indexed_modules >= 12, "every plan's embedding gathers on the GPU ({indexed_modules} stages)");
    assert!(axis_entries >= 4, "mixtral's top-k and scatter-elements are entries ({axis_entries})");
    assert!(grouped_entries >= 4, "mixtral's grouped expert GEMMs are entries ({grouped_entries})");
}
