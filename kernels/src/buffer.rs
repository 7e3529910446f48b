//! Aligned host byte buffers and typed views of byte slices.
//!
//! Kernels take and produce plain byte slices. Buffers we allocate are 64-byte aligned, so the
//! typed view of an output is always a cast; an input may come from a memory-mapped file at any
//! offset, so its view falls back to an aligned copy when the cast is not possible.

use std::borrow::Cow;

use bytemuck::Pod;

use crate::KernelError;

/// A zero-initialised, 64-byte aligned, fixed-size byte buffer.
///
/// The words come zeroed from the allocator (`vec![0u64; n]` is a calloc, whose fresh pages
/// are zero and touched only when used: a multi-GiB arena is ready at once; an allocation
/// aligned to 64 would be written with zeros page by page), and the buffer starts at the
/// first 64-byte boundary inside them.
pub struct AlignedBuf {
    words: Vec<u64>,
    /// Bytes from the words' start to the buffer's.
    start: usize,
    len: usize,
}

impl AlignedBuf {
    pub fn zeroed(len: usize) -> AlignedBuf {
        let words = vec![0u64; (len + 64).div_ceil(8)];
        let start = (words.as_ptr() as usize).wrapping_neg() % 64;
        AlignedBuf { words, start, len }
    }

    pub fn from_bytes(bytes: &[u8]) -> AlignedBuf {
        let mut buf = AlignedBuf::zeroed(bytes.len());
        buf.as_mut_slice().copy_from_slice(bytes);
        buf
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[self.start..self.start + self.len]
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[self.start..self.start + self.len]
    }
}

impl Default for AlignedBuf {
    fn default() -> AlignedBuf {
        AlignedBuf::zeroed(0)
    }
}

impl Clone for AlignedBuf {
    /// A copy at its own 64-byte boundary.
    fn clone(&self) -> AlignedBuf {
        AlignedBuf::from_bytes(self.as_slice())
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

/// A typed view of an input: borrowed when aligned, copied otherwise.
pub fn view<T: Pod>(bytes: &[u8]) -> Cow<'_, [T]> {
    match bytemuck::try_cast_slice(bytes) {
        Ok(slice) => Cow::Borrowed(slice),
        Err(_) => Cow::Owned(bytemuck::pod_collect_to_vec(bytes)),
    }
}

/// A typed view of an output buffer, which must be aligned for `T`.
pub fn view_mut<T: Pod>(bytes: &mut [u8]) -> Result<&mut [T], KernelError> {
    bytemuck::try_cast_slice_mut(bytes).map_err(|_| KernelError::Misaligned)
}

#[cfg(test)]
mod tests {
    use super::AlignedBuf;

    #[test]
    fn buffers_are_zeroed_and_64_byte_aligned() {
        for len in [0, 1, 63, 64, 65, 4096, 3 << 20] {
            let mut buf = AlignedBuf::zeroed(len);
            assert_eq!(buf.len(), len);
            assert_eq!(buf.as_slice().as_ptr() as usize % 64, 0, "len {len}");
            assert!(buf.as_slice().iter().all(|&b| b == 0));
            buf.as_mut_slice().iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
            let copy = buf.clone();
            assert_eq!(copy.as_slice(), buf.as_slice());
            assert_eq!(copy.as_slice().as_ptr() as usize % 64, 0);
        }
    }
}
