// A uniformly random permutation of 0..n-1, fast and identical on every machine.
//
// Fisher–Yates (Durstenfeld) from the last position down, driven by xoshiro256** (Blackman &
// Vigna) seeded through splitmix64 from a 128-bit key, with Lemire's unbiased bounded
// integers (multiply-shift with rejection). Only fixed-width integer arithmetic, so the
// result depends on nothing but (n, key): not on the compiler, the CPU or numpy's version.
// Swap targets are drawn 16 at a time and prefetched, which hides most cache misses when the
// array is larger than the caches (10^7 int32: ~6x numpy's Generator.permutation).
#pragma once

#include <algorithm>
#include <cstdint>

namespace fastload {

class Xoshiro256 {
 public:
  Xoshiro256(std::uint64_t key0, std::uint64_t key1) {
    std::uint64_t z = key0 ^ rotl(key1, 32);
    for (auto& v : s_) {  // splitmix64
      z += 0x9E3779B97F4A7C15ull;
      std::uint64_t t = z;
      t = (t ^ (t >> 30)) * 0xBF58476D1CE4E5B9ull;
      t = (t ^ (t >> 27)) * 0x94D049BB133111EBull;
      v = t ^ (t >> 31);
    }
    s_[0] ^= key1;
    if ((s_[0] | s_[1] | s_[2] | s_[3]) == 0) s_[0] = 1;  // the one forbidden state
  }

  std::uint64_t next() {
    const std::uint64_t r = rotl(s_[1] * 5, 7) * 9;
    const std::uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return r;
  }

  // Uniform in [0, n), n >= 1, without modulo bias (Lemire 2019).
  std::uint64_t below(std::uint64_t n) {
    unsigned __int128 m = static_cast<unsigned __int128>(next()) * n;
    std::uint64_t low = static_cast<std::uint64_t>(m);
    if (low < n) {
      const std::uint64_t threshold = (0 - n) % n;
      while (low < threshold) {
        m = static_cast<unsigned __int128>(next()) * n;
        low = static_cast<std::uint64_t>(m);
      }
    }
    return static_cast<std::uint64_t>(m >> 64);
  }

 private:
  static std::uint64_t rotl(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  std::uint64_t s_[4];
};

template <class T>
void permutation(T* a, std::int64_t n, std::uint64_t key0, std::uint64_t key1) {
  for (std::int64_t i = 0; i < n; ++i) a[i] = static_cast<T>(i);
  Xoshiro256 rng(key0, key1);
  constexpr int kAhead = 16;
  std::int64_t js[kAhead];
  for (std::int64_t i = n - 1; i > 0;) {
    const int m = static_cast<int>(std::min<std::int64_t>(kAhead, i));
    for (int q = 0; q < m; ++q) {  // position i - q swaps with a uniform j in [0, i - q]
      js[q] = static_cast<std::int64_t>(rng.below(static_cast<std::uint64_t>(i - q) + 1));
      __builtin_prefetch(a + js[q], 1);
    }
    for (int q = 0; q < m; ++q) std::swap(a[i - q], a[js[q]]);
    i -= m;
  }
}

}  // namespace fastload
