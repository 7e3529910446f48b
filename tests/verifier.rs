//! The verifier rejects hand-made broken graphs, reporting every problem precisely.

use autotp_ir::{verify, DType, Graph, Op, TensorType, UnaryOp};

/// Parses `text` (which must parse) and returns the verifier's messages.
fn errors(text: &str) -> Vec<String> {
    let g = autotp_ir::text::parse(text).unwrap_or_else(|e| panic!("{e}"));
    match verify(&g) {
        Ok(()) => vec![],
        Err(e) => e.0.iter().map(|e| e.to_string()).collect(),
    }
}

fn assert_rejects(text: &str, expected: &[&str]) {
    let found = errors(text);
    for want in expected {
        assert!(found.iter().any(|f| f.contains(want)), "expected an error containing {want:?}, got {found:#?}");
    }
    assert_eq!(found.len(), expected.len(), "unexpected errors: {found:#?}");
}

#[test]
fn accepts_a_valid_graph() {
    assert_rejects("graph \"ok\" {\n input %x : f32[2,3]\n %0 = exp %x : f32[2,3]\n output \"y\" = %0\n}", &[]);
}

#[test]
fn wrong_output_type() {
    assert_rejects(
        "graph \"g\" {\n input %x : f32[2,3]\n %0 = exp %x : f32[3,2]\n output \"y\" = %0\n}",
        &["%0 = exp: output 0 has type f32[3,2] but the op produces f32[2,3]"],
    );
}

#[test]
fn shapes_that_do_not_broadcast() {
    assert_rejects(
        "graph \"g\" {\n input %a : f32[2,3]\n input %b : f32[4]\n %0 = add %a, %b : f32[2,3]\n output \"y\" = %0\n}",
        &["%0 = add: shapes [2, 3] and [4] do not broadcast"],
    );
}

#[test]
fn reports_every_error() {
    assert_rejects(
        "graph \"g\" {\n input %a : f32[2,3]\n input %i : i64[2]\n param %w : f32[5,7]\n \
         %0 = matmul %a, %w : f32[2,7]\n %1 = exp %i : i64[2]\n %2 = softmax %a {axis = 2} : f32[2,3]\n output \"y\" = %0\n}",
        &[
            "%0 = matmul: contraction dims differ: 3 and 5",
            "%1 = exp: exp needs a floating-point input, got i64",
            "%2 = softmax: axis 2 is out of range for rank 2",
        ],
    );
}

#[test]
fn integer_parameter() {
    assert_rejects(
        "graph \"g\" {\n param %w : i64[3]\n output \"y\" = %w\n}",
        &["%w: parameters must be floating point, got i64"],
    );
}

#[test]
fn placement_checks() {
    assert_rejects(
        "graph \"g\" mesh [tp=4] {\n param %w : f32[6,8] {tp = shard(0)}\n param %v : f32[8] {tp = shard(1)}\n output \"y\" = %w\n}",
        &[
            "%w: dim 0 of size 6 is not divisible by mesh axis tp of size 4",
            "%v: is sharded on dim 1 over tp, but has rank 1",
            "output \"y\": must be replicated on every mesh axis",
        ],
    );
}

/// Axes sharding one dim nest in mesh order: each must divide the block the axes before it
/// left, and a rule decides on those blocks (cp splits the tokens of a dp rank's one sequence,
/// flattened to rows; over the whole two-sequence batch they would not be one block).
#[test]
fn nested_placements() {
    assert_rejects(
        "graph \"g\" mesh [dp=2, tp=2] {\n param %w : f32[6,8] {dp = shard(0), tp = shard(0)}\n output \"y\" = %w\n}",
        &[
            "%w: dim 0 of size 3 (its block under the mesh axes before, of 6) is not divisible by mesh axis tp of size 2",
            "output \"y\": must be replicated on every mesh axis",
        ],
    );
    assert_rejects(
        "graph \"g\" mesh [dp=2, cp=2] {\n input %x : f32[2,8,4] {dp = shard(0), cp = shard(1)}\n \
         %0 = reshape %x {shape = [16, 4]} : f32[16,4] {dp = shard(0), cp = shard(0)}\n \
         %1 = all_gather %0 {axis = cp, dim = 0} : f32[16,4] {dp = shard(0)}\n \
         %2 = all_gather %1 {axis = dp, dim = 0} : f32[16,4]\n output \"y\" = %2\n}",
        &[],
    );
    // Both sequences on every dp rank: cp's runs of their tokens are not one block of rows.
    assert_rejects(
        "graph \"g\" mesh [dp=2, cp=2] {\n input %x : f32[2,8,4] {cp = shard(1)}\n \
         %0 = reshape %x {shape = [16, 4]} : f32[16,4] {cp = shard(0)}\n \
         %1 = all_gather %0 {axis = cp, dim = 0} : f32[16,4]\n output \"y\" = %1\n}",
        &["%0 = reshape: needs its inputs as [replicate] on mesh axis cp"],
    );
}

#[test]
fn sharding_rule_checks() {
    // A row-parallel matmul gives a partial sum, not a replicated value; an all-reduce takes a
    // partial sum; a collective must name an axis of the mesh.
    assert_rejects(
        "graph \"g\" mesh [tp=2] {\n input %x : f32[4,8] {tp = shard(1)}\n param %w : f32[8,4] {tp = shard(0)}\n %0 = matmul %x, %w : f32[4,4]\n %1 = all_reduce %x {axis = tp} : f32[4,8]\n %2 = all_reduce %0 {axis = dp} : f32[4,4]\n output \"y\" = %0\n}",
        &[
            "%0 = matmul: gives [partial(sum)] on mesh axis tp, not what its outputs say",
            "%1 = all_reduce: needs its inputs as [partial(sum)] on mesh axis tp",
            "%2 = all_reduce: names mesh axis 'dp', which the mesh does not have",
        ],
    );
}

#[test]
fn duplicate_names_and_bad_split() {
    assert_rejects(
        "graph \"g\" {\n input %x : f32[4,6]\n %x2, %y = split %x {axis = 1, sizes = [2, 3]} : f32[4,2], f32[4,3]\n output \"y\" = %y\n}",
        &["split: sizes [2, 3] do not split dim 1 of size 6 into 2 outputs"],
    );
}

#[test]
fn use_before_definition() {
    // The parser refuses undefined names, so build this one directly.
    let mut g = Graph::new("g");
    let x = g.add_input("x", TensorType::new(DType::F32, vec![2]));
    let later = autotp_ir::ValueId(5);
    g.add_node_typed(Op::Unary(UnaryOp::Exp), vec![later], vec![TensorType::new(DType::F32, vec![2])]);
    g.add_output("y", x);
    let errs = verify(&g).unwrap_err();
    assert!(errs.to_string().contains("input 0 refers to a value that does not exist"), "{errs}");
}

#[test]
fn parse_errors_name_the_line() {
    let err = autotp_ir::text::parse("graph \"g\" {\n input %x : f32[2]\n %0 = frobnicate %x : f32[2]\n}").unwrap_err();
    assert_eq!(err.line, 3);
    assert!(err.to_string().contains("unknown op 'frobnicate'"), "{err}");
    let err = autotp_ir::text::parse("graph \"g\" {\n %0 = exp %nope : f32[2]\n}").unwrap_err();
    assert!(err.to_string().contains("value %nope is not defined"), "{err}");
}

#[test]
fn bad_updates() {
    assert_rejects(
        "graph \"g\" {\n input %x : f32[2]\n param %w : f32[2]\n state %s : f32[3]\n %0 = exp %w : f32[2]\n \
         update %x = %0\n update %s = %0\n update %w = %0\n update %w = %0\n}",
        &[
            "update %x: can only update a parameter or a state",
            "update %s: takes %0 (f32[2]), which is not its type f32[3]",
            "update %w: is updated twice",
        ],
    );
}

/// A partial sum may be rounded to a narrower type only for reductions over its axis to sum
/// (`--comm-dtype`): read by anything else, or widened, the cast needs its input whole.
#[test]
fn narrowing_a_partial_sum_is_for_reductions_alone() {
    let graph = |reader: &str, to: &str| {
        format!(
            "graph \"g\" mesh [dp=2] {{\n input %x : f32[4,8] {{dp = shard(0)}}\n param %w : f32[8,4]\n \
             %0 = matmul %x, %w : f32[4,4] {{dp = shard(0)}}\n %1 = reduce_sum %0 {{axes = [0], keep_dims = false}} : f32[4] {{dp = partial(sum)}}\n \
             %2 = cast %1 {{to = {to}}} : {to}[4] {{dp = partial(sum)}}\n %3 = {reader} : {to}[4]\n output \"y\" = %3\n}}"
        )
    };
    assert_rejects(&graph("all_reduce %2 {axis = dp}", "bf16"), &[]);
    assert_rejects(
        &graph("exp %2", "bf16"),
        &["%2 = cast: needs its inputs as [replicate] on mesh axis dp", "%3 = exp: needs its inputs as [replicate]"],
    );
    assert_rejects(&graph("all_reduce %2 {axis = dp}", "f64"), &[]);
}
