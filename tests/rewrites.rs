//! The egg rewrites, golden-tested: tests/golden/index_rewrites.txt lists index expressions of
//! generated kernels as the kernel builder writes them and as `autotp_kernelgen::index_rewrite`
//! simplifies them, one case per rule (the graph peepholes are golden IR files,
//! tests/golden/peephole_*.ir). Every case also checks that each offset is kept.
//! `AUTOTP_BLESS=1` rewrites the file.

use autotp_kernelgen::index_rewrite::simplify;
use autotp_kernels::kir::{Index, Term, Var};

use crate::common::repo;

/// The kernel builder's naive index of a walk over `sizes` with element `strides` (one term
/// per dim, the first `split` dims on the outer variable), and the variables' extents.
fn walk(sizes: &[usize], strides: &[usize], split: usize) -> (Index, usize, usize) {
    let index = autotp_kernelgen::strided_index(sizes, strides, split);
    (index, sizes[..split].iter().product(), sizes[split..].iter().product())
}

#[test]
fn index_rewrites_match_their_golden_file() {
    let row_major = |sizes: &[usize]| -> Vec<usize> {
        let mut strides = vec![1; sizes.len()];
        for d in (0..sizes.len().saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * sizes[d + 1];
        }
        strides
    };
    let wrapped = Term { var: Var::Inner, div: 1, modulo: Some(8), stride: 1, offset: 0, wrap: Some(4) };
    let padded = Term { var: Var::Inner, div: 1, modulo: Some(8), stride: 1, offset: 2, wrap: Some(16) };
    let cases: Vec<(&str, (Index, usize, usize))> = vec![
        ("contiguous dims merge into one term per variable", walk(&[2, 3, 4, 5], &row_major(&[2, 3, 4, 5]), 2)),
        ("size-1 dims vanish", walk(&[4, 1, 8, 1], &row_major(&[4, 1, 8, 1]), 2)),
        ("a bias [h] broadcast over [b, s, h]", walk(&[2, 16, 64], &[0, 0, 1], 2)),
        ("a row statistic [b, s, 1] broadcast over [b, s, h]", walk(&[2, 16, 64], &[16, 1, 0], 2)),
        ("attention heads [b, h, s, d] read as [b, s, h, d]", walk(&[2, 16, 4, 8], &[512, 8, 128, 1], 2)),
        ("a transpose of the last two dims", walk(&[3, 5, 7], &[35, 1, 5], 1)),
        ("the outermost modulo goes (the variable stays below it)", walk(&[6, 10], &[10, 1], 1)),
        (
            "a wrap that divides the modulo replaces it (mod-mod)",
            (Index { base: 0, terms: vec![Term::new(Var::Outer, 1, None, 4), wrapped] }, 3, 8),
        ),
        (
            "a wrap no coordinate reaches goes; the offset stays",
            (Index { base: 0, terms: vec![Term::new(Var::Outer, 1, None, 16), padded] }, 3, 8),
        ),
    ];
    let mut text = String::from(
        "# Index rewrites (autotp_kernelgen::index_rewrite): each case, the kernel builder's index, then\n\
         # its simplest form for loop variables o < OUTER and i < INNER.\n",
    );
    for (what, (index, outer, inner)) in &cases {
        let simple = simplify(index, *outer, *inner);
        for o in 0..*outer {
            for i in 0..*inner {
                assert_eq!(simple.offset(o, i), index.offset(o, i), "{what}: {index} -> {simple} at o={o} i={i}");
            }
        }
        text += &format!("\n# {what}\no < {outer}, i < {inner}: {index}\n  => {simple}\n");
    }
    let path = repo().join("tests/golden/index_rewrites.txt");
    let expected = std::fs::read_to_string(&path).unwrap_or_default();
    if text != expected {
        if std::env::var_os("AUTOTP_BLESS").is_some() {
            std::fs::write(&path, &text).unwrap();
        } else {
            panic!("index rewrites differ from {}:\n{text}(AUTOTP_BLESS=1 rewrites it)", path.display());
        }
    }
}
