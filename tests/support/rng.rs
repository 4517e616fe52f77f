//! xorshift64*: a small seeded generator, so a randomised test replays from its seed.

pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`, mixed so that small seeds start far apart (never at zero).
    pub fn new(seed: u64) -> Rng {
        Rng((seed ^ 0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// A generator starting from `state` exactly (the partial-sync invariant's seeds are
    /// states, and its recorded failures replay from them).
    pub fn with_state(state: u64) -> Rng {
        Rng(state)
    }

    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// True `percent` times in a hundred.
    pub fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}
