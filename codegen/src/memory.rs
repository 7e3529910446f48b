//! Buffer assignment: first-fit placement of intermediate values in the arena by liveness.
//! Parameters, inputs and constants get dedicated regions first; intermediates reuse space
//! once their last reader has run. An instruction's outputs never share bytes with its
//! inputs, because outputs are placed before the inputs' space is released.

/// Every region starts at a multiple of this, so kernels can view any dtype in place.
pub const ALIGN: usize = 64;

pub fn align(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// Live blocks sorted by offset; allocation takes the lowest gap that fits.
#[derive(Default)]
pub struct FirstFit {
    base: usize,
    live: Vec<(usize, usize)>,
    high_water: usize,
}

impl FirstFit {
    /// An allocator over the arena from `base` on.
    pub fn new(base: usize) -> FirstFit {
        FirstFit { base, live: Vec::new(), high_water: base }
    }

    pub fn alloc(&mut self, len: usize) -> usize {
        let len = align(len.max(1));
        let mut at = self.base;
        let mut index = self.live.len();
        for (i, &(offset, size)) in self.live.iter().enumerate() {
            if offset >= at + len {
                index = i;
                break;
            }
            at = at.max(offset + size);
        }
        self.live.insert(index, (at, len));
        self.high_water = self.high_water.max(at + len);
        at
    }

    pub fn free(&mut self, offset: usize) {
        if let Some(i) = self.live.iter().position(|&(o, _)| o == offset) {
            self.live.remove(i);
        }
    }

    /// The end of the highest block ever allocated.
    pub fn high_water(&self) -> usize {
        self.high_water
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reuses_freed_space() {
        let mut a = FirstFit::new(128);
        let x = a.alloc(100);
        let y = a.alloc(10);
        assert_eq!((x, y), (128, 256));
        a.free(x);
        assert_eq!(a.alloc(64), 128);
        assert_eq!(a.alloc(64), 192);
        assert_eq!(a.alloc(1), 320);
        assert_eq!(a.high_water(), 384);
    }
}
