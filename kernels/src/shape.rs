//! Shape arithmetic for contiguous row-major tensors, and the broadcast iteration that every
//! elementwise kernel shares.

/// Number of elements of a shape (1 for a scalar).
pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Row-major strides, in elements.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    strides
}

/// The numpy broadcast of two shapes, or `None` when they are incompatible.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for (i, slot) in out.iter_mut().enumerate() {
        let da = dim_from_right(a, rank - 1 - i);
        let db = dim_from_right(b, rank - 1 - i);
        *slot = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        };
    }
    Some(out)
}

fn dim_from_right(shape: &[usize], from_right: usize) -> usize {
    if from_right < shape.len() {
        shape[shape.len() - 1 - from_right]
    } else {
        1
    }
}

/// Strides of `input` seen through a broadcast to `out` (0 along broadcast dims), aligned to
/// the output's rank.
pub fn broadcast_strides(input: &[usize], out: &[usize]) -> Vec<usize> {
    let own = strides(input);
    let offset = out.len() - input.len();
    (0..out.len()).map(|d| if d < offset || input[d - offset] == 1 { 0 } else { own[d - offset] }).collect()
}

/// Iterates an output shape row by row (a row is the last dimension) and gives, for each
/// input, the offset of the row's first element and the input's stride along the row.
pub(crate) struct Broadcast {
    outer: Vec<usize>,
    strides: Vec<Vec<usize>>,
    inner: usize,
}

impl Broadcast {
    pub fn new(inputs: &[&[usize]], out: &[usize]) -> Broadcast {
        let rank = out.len();
        let inner = if rank == 0 { 1 } else { out[rank - 1] };
        Broadcast {
            outer: out[..rank.saturating_sub(1)].to_vec(),
            strides: inputs.iter().map(|s| broadcast_strides(s, out)).collect(),
            inner,
        }
    }

    /// Length of a row.
    pub fn inner(&self) -> usize {
        self.inner
    }

    /// Stride of input `i` along a row (0 or 1).
    pub fn inner_stride(&self, i: usize) -> usize {
        self.strides[i].last().copied().unwrap_or(0)
    }

    /// Offsets of each input's first element of output row `row`.
    pub fn row_offsets(&self, mut row: usize, offsets: &mut [usize]) {
        offsets.iter_mut().for_each(|o| *o = 0);
        for d in (0..self.outer.len()).rev() {
            let idx = row % self.outer[d];
            row /= self.outer[d];
            for (o, s) in offsets.iter_mut().zip(&self.strides) {
                *o += idx * s[d];
            }
        }
    }
}

/// Minimum number of elements a parallel task should cover.
pub(crate) const GRAIN: usize = 1 << 14;

/// Rows per parallel task for rows of `row_len` elements.
pub(crate) fn rows_per_task(row_len: usize) -> usize {
    (GRAIN / row_len.max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcasting() {
        assert_eq!(broadcast_shapes(&[4, 1, 3], &[5, 1]), Some(vec![4, 5, 3]));
        assert_eq!(broadcast_shapes(&[], &[2, 2]), Some(vec![2, 2]));
        assert_eq!(broadcast_shapes(&[3], &[4]), None);
        assert_eq!(broadcast_strides(&[5, 1], &[4, 5, 3]), vec![0, 1, 0]);
        assert_eq!(strides(&[2, 3, 4]), vec![12, 4, 1]);
    }

    #[test]
    fn row_offsets_follow_strides() {
        let b = Broadcast::new(&[&[2, 1], &[3]], &[2, 3]);
        let mut offs = [0; 2];
        b.row_offsets(1, &mut offs);
        assert_eq!(offs, [1, 0]);
        assert_eq!(b.inner_stride(0), 0);
        assert_eq!(b.inner_stride(1), 1);
    }
}

/// The block one rank holds of a tensor of `shape` sharded by `cuts`, each `(dim, parts, index)`
/// applied in order: a cut splits the current extent of `dim` into `parts` equal pieces and keeps
/// piece `index` (so cuts of one dim nest, the first outermost). Returns (offsets, extent).
pub fn shard_block(shape: &[usize], cuts: &[(usize, usize, usize)]) -> (Vec<usize>, Vec<usize>) {
    let mut offsets = vec![0; shape.len()];
    let mut extent = shape.to_vec();
    for &(dim, parts, index) in cuts {
        extent[dim] /= parts.max(1);
        offsets[dim] += index * extent[dim];
    }
    (offsets, extent)
}

/// The byte ranges, in a row-major tensor of `shape` with elements of `size` bytes, of the rows
/// (runs along the last dim) of the block at `offsets` with `extent`, in block order.
fn block_rows(shape: &[usize], offsets: &[usize], extent: &[usize], size: usize) -> Vec<std::ops::Range<usize>> {
    if extent.contains(&0) {
        return Vec::new();
    }
    let rank = shape.len();
    if rank == 0 {
        return std::iter::once(0..size).collect();
    }
    let strides = strides(shape);
    let row = extent[rank - 1] * size;
    let outer = &extent[..rank - 1];
    let mut rows = Vec::with_capacity(numel(outer));
    for mut i in 0..numel(outer) {
        let mut start = offsets[rank - 1];
        for d in (0..rank - 1).rev() {
            start += (offsets[d] + i % outer[d]) * strides[d];
            i /= outer[d];
        }
        rows.push(start * size..start * size + row);
    }
    rows
}

/// Copies the block at `offsets` with `extent` out of `tensor` (row-major, `shape`, elements of
/// `size` bytes) into `block`, which must hold exactly the block.
pub fn extract_block(
    shape: &[usize],
    offsets: &[usize],
    extent: &[usize],
    size: usize,
    tensor: &[u8],
    block: &mut [u8],
) {
    let mut at = 0;
    for rows in block_rows(shape, offsets, extent, size) {
        block[at..at + rows.len()].copy_from_slice(&tensor[rows.clone()]);
        at += rows.len();
    }
}

/// Copies `block` into `tensor` at `offsets` (the inverse of [`extract_block`]).
pub fn insert_block(
    shape: &[usize],
    offsets: &[usize],
    extent: &[usize],
    size: usize,
    block: &[u8],
    tensor: &mut [u8],
) {
    let mut at = 0;
    for rows in block_rows(shape, offsets, extent, size) {
        let len = rows.len();
        tensor[rows].copy_from_slice(&block[at..at + len]);
        at += len;
    }
}

#[cfg(test)]
mod block_tests {
    use super::*;

    #[test]
    fn blocks_round_trip() {
        // A 4x6 tensor cut in 2 along dim 0 and 3 along dim 1: rank (1, 2) holds rows 2..4,
        // columns 4..6.
        let (offsets, extent) = shard_block(&[4, 6], &[(0, 2, 1), (1, 3, 2)]);
        assert_eq!((offsets.clone(), extent.clone()), (vec![2, 4], vec![2, 2]));
        let tensor: Vec<u8> = (0..24).collect();
        let mut block = vec![0u8; 4];
        extract_block(&[4, 6], &offsets, &extent, 1, &tensor, &mut block);
        assert_eq!(block, [16, 17, 22, 23]);
        let mut back = vec![0u8; 24];
        insert_block(&[4, 6], &offsets, &extent, 1, &block, &mut back);
        assert_eq!((back[16], back[17], back[22], back[23], back[15]), (16, 17, 22, 23, 0));
        // Two cuts of one dim nest: halves, then halves of the half.
        assert_eq!(shard_block(&[8], &[(0, 2, 1), (0, 2, 1)]), (vec![6], vec![2]));
    }
}
