// fastload._C.feistel: the keyed bijection of fastload/sampling/bijection.py, one element at a
// time in C++ (the same numbers, bit for bit: tests/test_sampling_bijection.py compares the
// two over random domains, keys and sub-streams).
//
// Why: the sampler computes a batch's indices per position, and for a class-balanced or a
// mixture stream that is several bijections over a few thousand positions each, with keys per
// element. In numpy every Feistel round is seven ufunc calls and every cycle-walking pass a
// whole network over the few elements still outside the domain, so a call costs tens of
// microseconds of per-call overhead whatever its size; here a position costs ~10 ns.
//
// What it computes (see bijection.py's docstring for the construction): for each element i,
// b = max(2, bit length of n_i - 1), lo = b / 2, hi = b - lo; rounds = 12 when b <= 10, else 6
// (ROUNDS, FEW_ROUNDS, SMALL_BITS there); the Feistel network over [0, 2^b) (round r xors the
// low part with the top bits of mix(high ^ key_r) when r is even, the high part with those of
// mix(low ^ key_r) when odd; mix: z *= C1; z ^= z >> 32; z *= C2), rounds in reverse order
// for the inverse; applied again while the image is >= n_i (cycle walking). Round keys: one
// set for all elements ((R,) keys), one per element ((R, m)), and with `sub` the keys of
// element i's sub-stream, splitmix64(key_r ^ splitmix64(sub_i + golden)) (derive_keys there).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace py = pybind11;

namespace fastload {
namespace {

constexpr std::uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
constexpr std::uint64_t kC1 = 0xBF58476D1CE4E5B9ULL;
constexpr std::uint64_t kC2 = 0x94D049BB133111EBULL;
constexpr int kRounds = 12, kFewRounds = 6, kSmallBits = 10;

inline std::uint64_t splitmix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * kC1;
  z = (z ^ (z >> 27)) * kC2;
  return z ^ (z >> 31);
}

inline int bit_length(std::uint64_t v) { return v == 0 ? 0 : 64 - __builtin_clzll(v); }

inline int domain_bits(std::uint64_t n) { return std::max(2, bit_length((n < 2 ? 2 : n) - 1)); }
inline int rounds_of(std::uint64_t n) { return domain_bits(n) <= kSmallBits ? kRounds : kFewRounds; }

// One element: the network (or its inverse) restricted to [0, n) by cycle walking.
inline std::uint64_t walk(std::uint64_t x, std::uint64_t n, const std::uint64_t* key, std::size_t stride,
                          bool inverse) {
  const int b = domain_bits(n);
  const int lo = b / 2, hi = b - lo;
  const int rounds = b <= kSmallBits ? kRounds : kFewRounds;
  const std::uint64_t mask = (std::uint64_t{1} << lo) - 1;
  const int shift_lo = 64 - lo, shift_hi = 64 - hi;
  do {
    std::uint64_t low = x & mask, high = x >> lo;
    for (int k = 0; k < rounds; ++k) {
      const int r = inverse ? rounds - 1 - k : k;
      std::uint64_t z = ((r & 1) == 0 ? high : low) ^ key[r * stride];
      z *= kC1;
      z ^= z >> 32;
      z *= kC2;
      if ((r & 1) == 0) {
        low ^= z >> shift_lo;
      } else {
        high ^= z >> shift_hi;
      }
    }
    x = (high << lo) | low;
  } while (x >= n);
  return x;
}

using U64 = py::array_t<std::uint64_t, py::array::c_style | py::array::forcecast>;

// feistel(x, n, keys, sub=None, inverse=False) -> uint64 array like x (see the file comment).
// x: (m,); n: (m,) or (1,); keys: (R,) or (R, m) with R >= 12; sub: None or (m,).
py::array_t<std::uint64_t> feistel_py(const U64& x, const U64& n, const U64& keys, const py::object& sub_obj,
                                      bool inverse) {
  const std::size_t m = static_cast<std::size_t>(x.size());
  if (x.ndim() != 1) throw std::invalid_argument("feistel: positions must be one-dimensional");
  if (n.ndim() != 1 || (n.size() != 1 && static_cast<std::size_t>(n.size()) != m))
    throw std::invalid_argument("feistel: n must hold one domain size or one per position");
  const bool per_key = keys.ndim() == 2;
  if ((keys.ndim() != 1 && !per_key) || keys.shape(0) < kRounds ||
      (per_key && static_cast<std::size_t>(keys.shape(1)) != m))
    throw std::invalid_argument("feistel: keys must have shape (R,) or (R, len(positions)) with R >= " +
                                std::to_string(kRounds));
  U64 sub;
  const bool derive = !sub_obj.is_none();
  if (derive) {
    sub = sub_obj.cast<U64>();
    if (per_key || sub.ndim() != 1 || static_cast<std::size_t>(sub.size()) != m)
      throw std::invalid_argument("feistel: sub must hold one sub-stream per position, with keys of shape (R,)");
  }
  py::array_t<std::uint64_t> out(static_cast<py::ssize_t>(m));
  const std::uint64_t* px = x.data();
  const std::uint64_t* pn = n.data();
  const bool per_n = n.size() != 1 || m == 1;
  const std::uint64_t* pk = keys.data();
  const std::uint64_t* ps = derive ? sub.data() : nullptr;
  std::uint64_t* po = out.mutable_data();
  std::size_t bad = m;  // the first position outside [0, n): refused (its walk would not end)
  {
    py::gil_scoped_release release;
    std::uint64_t derived[kRounds];
    int have = 0;  // rounds of `derived` computed for sub-stream `last` (runs of one sub-stream share them)
    std::uint64_t last = 0;
    for (std::size_t i = 0; i < m; ++i) {
      const std::uint64_t ni = pn[per_n ? i : 0];
      const std::uint64_t xi = px[i];  // read once: another thread may write the caller's array meanwhile
      if (xi >= ni) {
        bad = i;
        break;
      }
      if (derive) {
        const int need = rounds_of(ni);  // a large domain reads only its first kFewRounds keys
        if (have == 0 || ps[i] != last) {
          have = 0;
          last = ps[i];
        }
        if (have < need) {
          const std::uint64_t h = splitmix64(last + kGolden);
          for (int r = have; r < need; ++r) derived[r] = splitmix64(pk[r] ^ h);
          have = need;
        }
        po[i] = walk(xi, ni, derived, 1, inverse);
      } else if (per_key) {
        po[i] = walk(xi, ni, pk + i, m, inverse);
      } else {
        po[i] = walk(xi, ni, pk, 1, inverse);
      }
    }
  }
  if (bad < m)
    throw py::index_error("feistel: position " + std::to_string(px[bad]) + " (element " + std::to_string(bad) +
                          ") lies outside [0, " + std::to_string(pn[per_n ? bad : 0]) + ")");
  return out;
}

}  // namespace

void register_feistel(py::module_& m) {
  m.def("feistel", &feistel_py, py::arg("x"), py::arg("n"), py::arg("keys"), py::arg("sub") = py::none(),
        py::arg("inverse") = false,
        "The keyed bijection of fastload.sampling.bijection per element (cycle walking over [0, n)); "
        "GIL released.");
}

}  // namespace fastload
