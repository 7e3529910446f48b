//! Embedding padding rows.
//!
//! Hugging Face builds `nn.Embedding(vocab, hidden, padding_idx=pad_token_id)`. PyTorch never
//! gives row `padding_idx` a gradient. The row is zero at initialisation, and under AdamW it
//! stays zero; under weight decay alone a non-zero row only decays. The ONNX exporter drops
//! `padding_idx` (with a warning), so this module recovers it:
//! - an *embedding table* is a 2-D parameter read as the data of axis-0 gathers; *tied* when
//!   something else reads it too (the output projection of tied embeddings);
//! - its padding row is what `--padding-idx` or the model's metadata (`autotp.padding_idx`)
//!   says, else, for a table that is not tied, its one row that is exactly zero at import. With
//!   several zero rows nothing is guessed: the user says which with `--padding-idx`. A tied
//!   table's zero row is not taken for one (its row may be zero for other reasons, and the
//!   output projection trains it anyway).
//!
//! [`Autodiff::padding_rows`](crate::autodiff::Autodiff::padding_rows) then gives that row no
//! gradient: the gather's incoming gradient is zeroed where the index is the padding row, before
//! the scatter-add. That is PyTorch's `embedding_backward` with `padding_idx`; a tied table's
//! other readers (the LM head) still give the row their gradient, as in PyTorch. It is an
//! elementwise mask over values every rank has, so it holds under every parallel layout
//! (vocabulary-parallel tables, ZeRO shards, pipeline stages).

use std::collections::BTreeMap;

use autotp_ir::{Graph, Op, Tensor};

/// A 2-D parameter read by axis-0 gathers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EmbeddingTable {
    pub param: String,
    pub rows: usize,
    /// Read by other ops too (the output projection of tied embeddings).
    pub tied: bool,
    /// Its rows that are exactly zero (±0) at import, in order.
    pub zero_rows: Vec<usize>,
}

/// The embedding tables of `graph`, in parameter order, with their zero rows in `weights`
/// (a table without initial weights has none).
pub fn embedding_tables(graph: &Graph, weights: &BTreeMap<String, Tensor>) -> Vec<EmbeddingTable> {
    let mut gathered = vec![false; graph.num_values()];
    let mut other_use = vec![false; graph.num_values()];
    for (_, node) in graph.nodes() {
        for (position, input) in node.inputs.iter().enumerate() {
            if matches!(node.op, Op::Gather { axis: 0 }) && position == 0 {
                gathered[input.index()] = true;
            } else {
                other_use[input.index()] = true;
            }
        }
    }
    for (_, value) in graph.outputs() {
        other_use[value.index()] = true;
    }
    graph
        .params()
        .iter()
        .filter(|p| gathered[p.index()] && graph.ty(**p).shape.len() == 2)
        .map(|&p| {
            let param = graph.name_of(p).unwrap_or_default().to_string();
            let shape = &graph.ty(p).shape;
            let zero_rows = weights.get(&param).map_or_else(Vec::new, |t| zero_rows(t, shape[0], shape[1]));
            EmbeddingTable { param, rows: shape[0], tied: other_use[p.index()], zero_rows }
        })
        .collect()
}

fn zero_rows(table: &Tensor, rows: usize, width: usize) -> Vec<usize> {
    if table.numel() != rows * width || !table.dtype().is_float() {
        return Vec::new();
    }
    (0..rows).filter(|&r| (r * width..(r + 1) * width).all(|i| table.get_f64(i) == 0.0)).collect()
}

/// What `--padding-idx` says, for every table or for one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PaddingChoice {
    /// The table's one zero row, if it has exactly one.
    Detect,
    None,
    Row(usize),
}

/// One `--padding-idx` value: `N`, `none`, `TABLE=N` or `TABLE=none`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PaddingFlag {
    /// `None`: every embedding table.
    pub table: Option<String>,
    pub choice: PaddingChoice,
    /// Read from the model's metadata ([`PaddingRow::from_metadata`]) rather than given as
    /// `--padding-idx`.
    pub from_metadata: bool,
}

impl std::str::FromStr for PaddingFlag {
    type Err = String;

    fn from_str(text: &str) -> Result<PaddingFlag, String> {
        let (table, value) = match text.rsplit_once('=') {
            Some((table, value)) => (Some(table.to_string()), value),
            None => (None, text),
        };
        let choice = match value {
            "none" => PaddingChoice::None,
            row => PaddingChoice::Row(row.parse().map_err(|_| {
                format!("--padding-idx '{text}': expected N, none, TABLE=N or TABLE=none (N a row index)")
            })?),
        };
        Ok(PaddingFlag { table, choice, from_metadata: false })
    }
}

/// A padding row chosen for a table, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PaddingRow {
    pub table: String,
    pub row: usize,
    /// `true` when it was found (the table's one zero row), `false` when `--padding-idx` or
    /// the model's metadata set it.
    pub detected: bool,
    /// Set by the model's metadata (`autotp.padding_idx`), not by `--padding-idx`.
    pub from_metadata: bool,
}

/// The padding rows of `tables` under `flags` (`--padding-idx` overrides the model's metadata;
/// within either, later flags override earlier ones and a flag naming a table overrides one for
/// every table), and the tables whose several zero rows were left alone (to be reported).
pub fn choose_padding_rows<'t>(
    tables: &'t [EmbeddingTable],
    flags: &[PaddingFlag],
) -> Result<(Vec<PaddingRow>, Vec<&'t EmbeddingTable>), String> {
    for flag in flags {
        if let Some(name) = &flag.table {
            if !tables.iter().any(|t| &t.param == name) {
                let known: Vec<&str> = tables.iter().map(|t| t.param.as_str()).collect();
                let source = if flag.from_metadata { "the model's metadata" } else { "--padding-idx" };
                return Err(format!(
                    "{source}: '{name}' is not an embedding table (a parameter read by gathers); the \
                     model's are: {}",
                    if known.is_empty() { "none".to_string() } else { known.join(", ") }
                ));
            }
        }
    }
    let mut rows = Vec::new();
    let mut ambiguous = Vec::new();
    for table in tables {
        // The command line's flags before the model's metadata, whatever they name; among
        // either's, one naming the table before one for every table, the last first.
        let among = |from_metadata: bool| {
            let of = || flags.iter().rev().filter(move |f| f.from_metadata == from_metadata);
            let for_this = of().find(|f| f.table.as_deref() == Some(table.param.as_str()));
            for_this.or_else(|| of().find(|f| f.table.is_none()))
        };
        let flag = among(false).or_else(|| among(true));
        let from_metadata = flag.is_some_and(|f| f.from_metadata);
        match flag.map_or(&PaddingChoice::Detect, |f| &f.choice) {
            PaddingChoice::None => {}
            &PaddingChoice::Row(row) if row >= table.rows => {
                let source = if from_metadata { "the model's metadata: padding index" } else { "--padding-idx" };
                return Err(format!("{source} {row}: the embedding table '{}' has {} rows", table.param, table.rows));
            }
            &PaddingChoice::Row(row) => {
                rows.push(PaddingRow { table: table.param.clone(), row, detected: false, from_metadata })
            }
            PaddingChoice::Detect if table.tied => {}
            PaddingChoice::Detect => match table.zero_rows[..] {
                [row] => {
                    rows.push(PaddingRow { table: table.param.clone(), row, detected: true, from_metadata: false })
                }
                [] => {}
                _ => ambiguous.push(table),
            },
        }
    }
    Ok((rows, ambiguous))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(param: &str, zero_rows: &[usize]) -> EmbeddingTable {
        EmbeddingTable { param: param.into(), rows: 10, tied: false, zero_rows: zero_rows.to_vec() }
    }

    #[test]
    fn flags_choose_padding_rows() {
        let tables = [table("tok", &[0]), table("pos", &[]), table("seg", &[1, 2])];
        let flag = |s: &str| s.parse::<PaddingFlag>().unwrap();
        let chosen = |flags: &[PaddingFlag]| {
            let (rows, ambiguous) = choose_padding_rows(&tables, flags).unwrap();
            let rows: Vec<(String, usize, bool)> = rows.into_iter().map(|r| (r.table, r.row, r.detected)).collect();
            (rows, ambiguous.iter().map(|t| t.param.clone()).collect::<Vec<_>>())
        };
        assert_eq!(chosen(&[]), (vec![("tok".into(), 0, true)], vec!["seg".to_string()]));
        assert_eq!(chosen(&[flag("none")]), (vec![], vec![]));
        assert_eq!(
            chosen(&[flag("3"), flag("tok=none")]),
            (vec![("pos".into(), 3, false), ("seg".into(), 3, false)], vec![])
        );
        assert_eq!(chosen(&[flag("seg=2")]), (vec![("tok".into(), 0, true), ("seg".into(), 2, false)], vec![]));
        let err = choose_padding_rows(&tables, &[flag("10")]).unwrap_err();
        assert_eq!(err, "--padding-idx 10: the embedding table 'tok' has 10 rows");
        let err = choose_padding_rows(&tables, &[flag("wte=1")]).unwrap_err();
        assert!(err.contains("'wte' is not an embedding table") && err.contains("tok, pos, seg"), "{err}");
        // A tied table's zero row is not guessed to be its padding row; a flag sets one.
        let tied = [EmbeddingTable { tied: true, ..table("wte", &[0]) }];
        assert_eq!(choose_padding_rows(&tied, &[]).unwrap().0, vec![]);
        assert_eq!(choose_padding_rows(&tied, &[flag("0")]).unwrap().0[0].row, 0);
        let err = "x".parse::<PaddingFlag>().unwrap_err();
        assert!(err.contains("--padding-idx 'x': expected N, none"), "{err}");
    }
}
