//! The kinds of a model's layers, and which layers the search's cuts keep.
//!
//! Most models repeat one layer, but some mix kinds: DeepSeek-V3 and GLM-4.5 put dense layers
//! before their mixtures of experts (`first_k_dense_replace`), Llama 4 alternates them, LFM2 mixes
//! convolutions with attention. Layers of one kind have the same parameters (names after the
//! layer number, and shapes). The per-layer model is cut from layers of one kind, the
//! *modelled* kind: the one holding experts (so that `--ep` has experts to split in every cut),
//! else the one with the most layers. Each other kind is measured beside it, as a cut of the
//! first modelled layer and that kind's first layer against a cut of two modelled layers: the
//! difference is what a layer of that kind holds and does beyond a modelled one.
//!
//! A model whose modelled kind has a single layer (the 2-layer DeepSeek-V3 fixture: one dense
//! layer, one of experts) cannot be measured so: its cuts are its first layers, every layer
//! taken as alike, and expert parallelism is refused for want of two layers of experts to cut.

use std::collections::BTreeMap;

use autotp_ir::Graph;
use autotp_passes::pipeline::NumberedLayers;

use super::cuts::stage_layers;

/// The kind of each of a model's layers and the modelled one.
#[derive(Clone, Debug)]
pub(super) struct LayerKinds {
    /// The kind of each layer, in order: kinds are numbered by their first layer.
    of_layer: Vec<usize>,
    /// The kind the per-layer model is cut from, where it has two layers or more (cuts of it
    /// alone measure a layer); `None` cuts the first layers, every layer taken as alike.
    modelled: Option<usize>,
}

impl LayerKinds {
    /// The kinds of `numbered`'s layers in `graph`; `expert_layers` are the numbers of the layers
    /// whose parameters experts are looked up in.
    pub(super) fn of(graph: &Graph, numbered: &NumberedLayers, expert_layers: &[u64]) -> LayerKinds {
        // Each layer's parameters: name after the number, and shape.
        let mut signatures: BTreeMap<u64, Vec<(String, Vec<usize>)>> = BTreeMap::new();
        for &p in graph.params() {
            let Some(name) = graph.name_of(p) else { continue };
            let Some(number) = numbered.number_of(name) else { continue };
            let after = name.strip_prefix(&format!("{}.{number}", numbered.prefix)).unwrap_or(name);
            signatures.entry(number).or_default().push((after.to_string(), graph.ty(p).shape.clone()));
        }
        let mut kinds: Vec<Vec<(String, Vec<usize>)>> = Vec::new();
        let of_layer: Vec<usize> = (numbered.numbers.iter())
            .map(|number| {
                let mut signature = signatures.remove(number).unwrap_or_default();
                signature.sort();
                kinds.iter().position(|k| *k == signature).unwrap_or_else(|| {
                    kinds.push(signature);
                    kinds.len() - 1
                })
            })
            .collect();
        let count = |kind: usize| of_layer.iter().filter(|&&k| k == kind).count();
        let with_experts =
            (numbered.numbers.iter()).position(|n| expert_layers.contains(n)).map(|position| of_layer[position]);
        // The kind with the most layers, the first among equals.
        let most = (0..kinds.len()).rev().max_by_key(|&k| count(k)).unwrap_or(0);
        let modelled = Some(with_experts.unwrap_or(most)).filter(|&k| count(k) >= 2);
        LayerKinds { of_layer, modelled }
    }

    pub(super) fn layers(&self) -> usize {
        self.of_layer.len()
    }

    /// Whether the cuts measure a layer of the modelled kind alone (two or more of it).
    pub(super) fn measured(&self) -> bool {
        self.modelled.is_some()
    }

    fn kind_count(&self) -> usize {
        self.of_layer.iter().max().map_or(0, |k| k + 1)
    }

    /// The position of kind `kind`'s first layer.
    fn first_of(&self, kind: usize) -> usize {
        self.of_layer.iter().position(|&k| k == kind).unwrap_or(0)
    }

    /// The positions of the first `count` layers of the modelled kind (of the model, where it
    /// is not measured), or `None` when there are fewer.
    pub(super) fn first_modelled(&self, count: usize) -> Option<Vec<usize>> {
        let positions: Vec<usize> = match self.modelled {
            Some(kind) => (0..self.layers()).filter(|&p| self.of_layer[p] == kind).take(count).collect(),
            None => (0..self.layers().min(count)).collect(),
        };
        (positions.len() == count).then_some(positions)
    }

    /// The kinds other than the modelled one (none where it is not measured), in order.
    fn others(&self) -> Vec<usize> {
        self.modelled.map_or(Vec::new(), |modelled| (0..self.kind_count()).filter(|&k| k != modelled).collect())
    }

    /// For each of the other kinds, in order, the cut that measures it beside the modelled one:
    /// the first modelled layer and the kind's first layer, in order.
    pub(super) fn other_cuts(&self) -> Vec<Vec<usize>> {
        let Some(modelled) = self.modelled else { return Vec::new() };
        (self.others().into_iter())
            .map(|kind| {
                let mut positions = vec![self.first_of(modelled), self.first_of(kind)];
                positions.sort();
                positions
            })
            .collect()
    }

    /// Of each pipeline rank's layers (`pp` ranks of `virtual_stages` model chunks each, rank
    /// `r` holding chunks `r, r + pp, ...`), how many are of each other kind ([`Self::other_cuts`]'
    /// order).
    pub(super) fn others_on_stages(&self, pp: usize, virtual_stages: usize) -> Vec<Vec<usize>> {
        let others = self.others();
        let mut on_stage = vec![vec![0; others.len()]; pp];
        let mut first = 0;
        for (chunk, count) in stage_layers(self.layers(), pp * virtual_stages).into_iter().enumerate() {
            for &kind in &self.of_layer[first..first + count] {
                if let Some(k) = others.iter().position(|&o| o == kind) {
                    on_stage[chunk % pp][k] += 1;
                }
            }
            first += count;
        }
        on_stage
    }

    /// The number of layers of each kind and its first layer's position, in order of kinds.
    pub(super) fn summary(&self) -> Vec<(usize, usize)> {
        (0..self.kind_count()).map(|k| (self.of_layer.iter().filter(|&&o| o == k).count(), self.first_of(k))).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(of_layer: &[usize], modelled: Option<usize>) -> LayerKinds {
        LayerKinds { of_layer: of_layer.to_vec(), modelled }
    }

    /// DeepSeek-V3's shape: 3 dense layers, then experts.
    #[test]
    fn dense_layers_first_are_measured_beside_the_experts() {
        let k = kinds(&[0, 0, 0, 1, 1, 1, 1, 1], Some(1));
        assert_eq!(k.first_modelled(2), Some(vec![3, 4]));
        assert_eq!(k.first_modelled(4), Some(vec![3, 4, 5, 6]));
        assert_eq!(k.first_modelled(6), None);
        assert_eq!(k.other_cuts(), vec![vec![0, 3]]);
        // 2 stages of 4 layers: the first holds the dense layers.
        assert_eq!(k.others_on_stages(2, 1), vec![vec![3], vec![0]]);
        // 2 stages of 2 chunks of 2 layers: rank 0 holds layers 0-1 and 4-5, rank 1 layers 2-3, 6-7.
        assert_eq!(k.others_on_stages(2, 2), vec![vec![2], vec![1]]);
        assert_eq!(k.summary(), vec![(3, 0), (5, 3)]);
    }

    /// One layer of each kind: cut as the first layers, every layer alike.
    #[test]
    fn a_kind_of_one_layer_is_not_measured() {
        let k = kinds(&[0, 1], None);
        assert!(!k.measured());
        assert_eq!(k.first_modelled(2), Some(vec![0, 1]));
        assert_eq!(k.first_modelled(4), None);
        assert!(k.other_cuts().is_empty());
        assert_eq!(k.others_on_stages(2, 1), vec![Vec::<usize>::new(); 2]);
    }

    #[test]
    fn one_kind_is_cut_as_the_first_layers() {
        let k = kinds(&[0; 6], Some(0));
        assert_eq!(k.first_modelled(4), Some(vec![0, 1, 2, 3]));
        assert!(k.other_cuts().is_empty());
    }
}
