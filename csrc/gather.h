// The gather kernel: copy rows of memory-mapped shard columns into one batch slot.
//
// Pure C++ (no Python, no threads, no locks): the ring's producers call it on row ranges of
// a request, and fastload._C.gather_rows exposes it alone so tests can check it against
// numpy without a ring around it.
//
// The destination of field f is dst[f], the address of its row 0 (in a ring: the slot's
// memory plus the field's offset). A field is either *sourced* (one Source per shard, gathered here), the *index field* (int64:
// receives the request's own global sample indices, so batch["index"] travels with the other
// fields), or neither (written by the caller, e.g. DALI's decoded images).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace fastload {

// What went wrong, translated to a Python exception type once, at the binding.
// Fault: a read of a memory-mapped shard raised SIGBUS (see Note [Mapped reads and SIGBUS] in
// fault.h); the message names the shard and its file.
enum class ErrKind : int { None = 0, Index = 1, Value = 2, Runtime = 3, External = 4, Fault = 5 };

// One shard of one field: `rows` rows, C-contiguous, of the field's row size. `ptr` is null
// while the shard is not loaded (a ring can install and drop a shard's sources while running).
struct Source {
  const std::uint8_t* ptr = nullptr;
  std::int64_t rows = 0;
};

// One shard of one ragged field: sample r is items offsets[r]..offsets[r+1]-1 of `values`.
// `offsets` is null while the shard is not loaded (Ring::set_source installs and drops it);
// `gen` changes with every install or drop, so a batch planned from one source is never
// copied from another (see Note [Ragged gather]).
struct RaggedSource {
  const std::uint8_t* values = nullptr;   // `items` items of item_bytes each
  const std::int64_t* offsets = nullptr;  // rows + 1 entries
  std::int64_t rows = 0;
  std::int64_t items = 0;
  std::uint64_t gen = 0;
};

// How a ragged field is gathered and laid out in a batch (see Note [Ragged gather]).
struct RaggedSpec {
  bool padded = false;             // (rows, width, item) with padding; else packed (items, item)
  std::size_t item_bytes = 0;      // bytes of one item (a token, a box)
  std::vector<std::uint8_t> pad;   // one element's bytes, repeated to fill padding
  std::int64_t max_items = -1;     // per-sample truncation (-1: none)
  std::int64_t multiple = 1;       // padded width rounded up to a multiple (at least one)
  std::int64_t capacity = 0;       // items the slot region holds; larger batches get own memory
  bool positions = false;          // packed only: also each item's position in its sample (int64)
  std::vector<RaggedSource> sources;  // per shard
};

// One batch's plan for one ragged field, computed before its rows are copied (so the copy
// can be split across threads): where each row's items come from and go to.
struct RaggedPlan {
  std::vector<std::int64_t> src;  // per row: first item in its shard's values
  std::vector<std::int64_t> dst;  // rows + 1: rebased offsets (prefix sums of the item counts)
  std::vector<std::int64_t> first;  // positions only: per row, its first item's place in its sample
  std::vector<std::uint64_t> gen;   // per row: the generation of the source it was planned from
  std::int64_t width = 0;         // padded: items per row of the output
  std::size_t bytes = 0;          // output bytes (packed: total items; padded: rows * width)
  std::uint8_t* own = nullptr;    // memory of its own when `bytes` exceeds the slot region
  RaggedPlan() = default;
  RaggedPlan(const RaggedPlan&) = delete;
  RaggedPlan& operator=(const RaggedPlan&) = delete;
  RaggedPlan(RaggedPlan&& o) noexcept
      : src(std::move(o.src)), dst(std::move(o.dst)), first(std::move(o.first)), gen(std::move(o.gen)),
        width(o.width), bytes(o.bytes), own(o.own) {
    o.own = nullptr;
  }
  RaggedPlan& operator=(RaggedPlan&& o) noexcept {
    if (this != &o) {
      std::free(own);
      src = std::move(o.src);
      dst = std::move(o.dst);
      first = std::move(o.first);
      gen = std::move(o.gen);
      width = o.width;
      bytes = o.bytes;
      own = o.own;
      o.own = nullptr;
    }
    return *this;
  }
  ~RaggedPlan() { std::free(own); }
  std::int64_t total() const { return dst.empty() ? 0 : dst.back(); }
  // Memory of its own holds the items, then (positions) one int64 per item from this offset.
  std::size_t positions_at() const { return (bytes + 63) / 64 * 64; }
  std::size_t own_bytes(bool positions) const {
    return positions ? positions_at() + static_cast<std::size_t>(total()) * sizeof(std::int64_t) : bytes;
  }
};

// Where each field lives in a slot and where its rows come from. Immutable once a ring runs.
struct Layout {
  std::vector<std::size_t> row_bytes;        // bytes of one row, per field
  std::vector<std::size_t> offsets;          // byte offset of each field inside a ring slot
  std::vector<std::vector<Source>> sources;  // [field][shard]; empty: not gathered
  std::vector<std::int64_t> shard_rows;      // rows per shard, shared by every sourced field
  int index_field = -1;                      // the int64 field receiving global indices, or -1
  std::vector<int> ragged_of;                // per field: index into `ragged`, or -1
  std::vector<RaggedSpec> ragged;            // the ragged fields (not gathered by gather_rows)
  std::vector<std::size_t> ragged_values;    // per ragged field: byte offset of its items in a slot
  std::vector<std::size_t> ragged_positions; // per ragged field: byte offset of its positions (if any)

  bool sourced(std::size_t f) const { return !sources[f].empty(); }
  bool is_ragged(std::size_t f) const { return f < ragged_of.size() && ragged_of[f] >= 0; }
  std::int64_t num_shards() const { return static_cast<std::int64_t>(shard_rows.size()); }
};

// The shard whose source (a fixed-size field's rows, a ragged field's values or offsets)
// holds `addr`, or -1: names the shard of a faulting read (see fault.h).
inline std::int64_t shard_of_address(const Layout& L, const void* addr) {
  const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(addr);
  auto within = [a](const void* p, std::size_t bytes) {
    const std::uintptr_t b = reinterpret_cast<std::uintptr_t>(p);
    return p != nullptr && a >= b && a - b < bytes;
  };
  for (std::size_t f = 0; f < L.sources.size(); ++f)
    for (std::size_t s = 0; s < L.sources[f].size(); ++s)
      if (within(L.sources[f][s].ptr, static_cast<std::size_t>(L.sources[f][s].rows) * L.row_bytes[f]))
        return static_cast<std::int64_t>(s);
  for (const RaggedSpec& spec : L.ragged)
    for (std::size_t s = 0; s < spec.sources.size(); ++s) {
      const RaggedSource& rs = spec.sources[s];
      if (within(rs.values, static_cast<std::size_t>(rs.items) * spec.item_bytes) ||
          within(rs.offsets, static_cast<std::size_t>(rs.rows + 1) * sizeof(std::int64_t)))
        return static_cast<std::int64_t>(s);
    }
  return -1;
}

namespace detail {

constexpr std::int64_t kPrefetchRows = 4;   // prefetch distance, in rows
constexpr std::size_t kPrefetchLines = 64;  // cache lines prefetched at the head of a row

inline void prefetch_row(const std::uint8_t* p, std::size_t lines) {
  for (std::size_t l = 0; l < lines; ++l) __builtin_prefetch(p + 64 * l, 0, 3);
}

// Copy `n` bytes; the common tiny row sizes get fixed-size copies the compiler inlines.
inline void copy_bytes(std::uint8_t* dst, const std::uint8_t* src, std::size_t n) {
  switch (n) {
    case 1: *dst = *src; return;
    case 2: std::memcpy(dst, src, 2); return;
    case 4: std::memcpy(dst, src, 4); return;
    case 8: std::memcpy(dst, src, 8); return;
    case 16: std::memcpy(dst, src, 16); return;
    default: std::memcpy(dst, src, n);
  }
}

}  // namespace detail

// Gather rows begin..end-1 of a request (shard[i], row[i], and index[i] for the index field)
// into row i of every field's destination dst[f]. Every (shard, row) is checked before anything is copied; on a bad one returns
// ErrKind::Index with `msg` naming the sample ("sample i: ...") and copies nothing.
inline ErrKind gather_rows(const Layout& L, const std::int64_t* shard, const std::int64_t* row,
                           const std::int64_t* index, std::int64_t begin, std::int64_t end,
                           std::uint8_t* const* dst_of, std::string& msg) {
  const std::int64_t nshards = L.num_shards();
  int first_sourced = -1;
  for (std::size_t f = 0; f < L.sources.size() && first_sourced < 0; ++f)
    if (L.sourced(f)) first_sourced = static_cast<int>(f);
  if (first_sourced >= 0) {
    const std::vector<Source>& probe = L.sources[first_sourced];
    for (std::int64_t i = begin; i < end; ++i) {
      const std::int64_t s = shard[i], r = row[i];
      if (s < 0 || s >= nshards) {
        msg = "sample " + std::to_string(i) + ": shard " + std::to_string(s) +
              " is out of range (the ring has " + std::to_string(nshards) + " shards)";
        return ErrKind::Index;
      }
      if (r < 0 || r >= L.shard_rows[s]) {
        msg = "sample " + std::to_string(i) + ": row " + std::to_string(r) +
              " is out of range for shard " + std::to_string(s) + " (" +
              std::to_string(L.shard_rows[s]) + " rows)";
        return ErrKind::Index;
      }
      // A shard's sources are installed and dropped for every field at once (Ring::set_source).
      if (probe[s].ptr == nullptr && L.shard_rows[s] > 0) {
        msg = "sample " + std::to_string(i) + ": shard " + std::to_string(s) +
              " is not loaded (its source was never installed or was dropped)";
        return ErrKind::Value;
      }
    }
  }
  for (std::size_t f = 0; f < L.sources.size(); ++f) {
    const std::size_t rb = L.row_bytes[f];
    std::uint8_t* dst = dst_of[f] + static_cast<std::size_t>(begin) * rb;
    if (static_cast<int>(f) == L.index_field) {
      if (index != nullptr && end > begin)
        std::memcpy(dst, index + begin, static_cast<std::size_t>(end - begin) * sizeof(std::int64_t));
      continue;
    }
    if (!L.sourced(f)) continue;
    const std::vector<Source>& src = L.sources[f];
    // Random rows are latency-bound: prefetch the head of the row kPrefetchRows ahead so its
    // TLB walk and first cache misses overlap the current copy (the hardware prefetcher
    // takes over within a row). Costs nothing measurable for big rows.
    const std::size_t pf_lines = std::min<std::size_t>((rb + 63) / 64, detail::kPrefetchLines);
    for (std::int64_t k = begin; k < std::min(end, begin + detail::kPrefetchRows); ++k)
      detail::prefetch_row(src[shard[k]].ptr + static_cast<std::size_t>(row[k]) * rb, pf_lines);
    std::int64_t i = begin;
    while (i < end) {
      // Coalesce a run of consecutive rows of one shard into one copy.
      const std::int64_t s = shard[i], r0 = row[i];
      std::int64_t j = i + 1;
      while (j < end && shard[j] == s && row[j] == r0 + (j - i)) ++j;
      const std::size_t n = static_cast<std::size_t>(j - i) * rb;
      for (std::int64_t k = i + detail::kPrefetchRows; k < std::min(end, j + detail::kPrefetchRows); ++k)
        detail::prefetch_row(src[shard[k]].ptr + static_cast<std::size_t>(row[k]) * rb, pf_lines);
      detail::copy_bytes(dst, src[s].ptr + static_cast<std::size_t>(r0) * rb, n);
      dst += n;
      i = j;
    }
  }
  return ErrKind::None;
}

// Note [Ragged gather]
// ~~~~~~~~~~~~~~~~~~~~
// A ragged field is gathered in two steps. plan_ragged() reads only the offsets: it checks
// every (shard, row), applies each row's window (start, count: the pieces of sequence
// packing) and the field's truncation (max_items), and computes where each row's items go:
// packed, rows follow each other (dst[i] is row i's first item, dst[rows] the total: the
// batch's offsets, rebased to 0); padded, row i starts at i * width items and the rest of the
// row is filled with the pad element. gather_ragged() then copies a range of rows (so one
// batch can be split across threads), runs of consecutive items coalesced into one copy, and
// writes the rebased offsets. Each item is copied exactly once. A shard's sources can be
// installed and dropped while a ring runs (Ring::set_source): the plan records, per row, the
// generation of the source it read, and the ring refuses to copy a row whose source changed
// since (a batch is never planned from one source and copied from another). A packed field with
// `positions` also gets each item's position within its sample (int64: the row's window
// start plus its place in the row), the position ids of sequence packing, written by the
// same producer right after the items.

// Plan rows 0..n-1 of one batch for ragged field `spec` (see the Note). start/count may be
// null (whole samples); count[i] < 0 means "to the end". On a bad row returns Index (or Value
// for damaged offsets) with `msg` naming the sample, and plans nothing.
inline ErrKind plan_ragged(const RaggedSpec& spec, const std::int64_t* shard, const std::int64_t* row,
                           const std::int64_t* start, const std::int64_t* count, std::int64_t n,
                           RaggedPlan& plan, std::string& msg) {
  const std::int64_t nshards = static_cast<std::int64_t>(spec.sources.size());
  plan.src.assign(static_cast<std::size_t>(n), 0);
  plan.dst.assign(static_cast<std::size_t>(n) + 1, 0);
  plan.gen.assign(static_cast<std::size_t>(n), 0);
  if (spec.positions) plan.first.assign(static_cast<std::size_t>(n), 0);
  std::int64_t total = 0, widest = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t s = shard[i], r = row[i];
    if (s < 0 || s >= nshards) {
      msg = "sample " + std::to_string(i) + ": shard " + std::to_string(s) +
            " is out of range (the ring has " + std::to_string(nshards) + " shards)";
      return ErrKind::Index;
    }
    const RaggedSource& src = spec.sources[s];
    if (r < 0 || r >= src.rows) {
      msg = "sample " + std::to_string(i) + ": row " + std::to_string(r) +
            " is out of range for shard " + std::to_string(s) + " (" + std::to_string(src.rows) + " rows)";
      return ErrKind::Index;
    }
    if (src.offsets == nullptr) {
      msg = "sample " + std::to_string(i) + ": shard " + std::to_string(s) +
            " is not loaded (its source was never installed or was dropped)";
      return ErrKind::Value;
    }
    const std::int64_t o0 = src.offsets[r], o1 = src.offsets[r + 1];
    if (o0 < 0 || o1 < o0 || o1 > src.items) {
      msg = "sample " + std::to_string(i) + ": offsets " + std::to_string(o0) + ".." + std::to_string(o1) +
            " of row " + std::to_string(r) + " of shard " + std::to_string(s) + " do not fit its " +
            std::to_string(src.items) + " items (a damaged shard? run `fastload verify`)";
      return ErrKind::Value;
    }
    std::int64_t first = start != nullptr ? start[i] : 0;
    if (first < 0) {
      msg = "sample " + std::to_string(i) + ": window start " + std::to_string(first) + " is negative";
      return ErrKind::Value;
    }
    first = std::min(first, o1 - o0);
    std::int64_t k = o1 - o0 - first;
    if (count != nullptr && count[i] >= 0) k = std::min(k, count[i]);
    if (spec.max_items >= 0) k = std::min(k, spec.max_items);
    plan.src[i] = o0 + first;
    plan.gen[i] = src.gen;
    if (spec.positions) plan.first[i] = first;
    total += k;
    plan.dst[i + 1] = total;
    widest = std::max(widest, k);
  }
  if (spec.padded) {
    const std::int64_t m = std::max<std::int64_t>(spec.multiple, 1);
    plan.width = std::max<std::int64_t>((widest + m - 1) / m * m, m > 1 ? m : 0);
    plan.bytes = static_cast<std::size_t>(n) * static_cast<std::size_t>(plan.width) * spec.item_bytes;
  } else {
    plan.width = 0;
    plan.bytes = static_cast<std::size_t>(total) * spec.item_bytes;
  }
  return ErrKind::None;
}

// Rows begin..end-1 of a planned batch still read the sources they were planned from (no
// set_source() installed or dropped their shard since): ErrKind::None, else Value with `msg`.
inline ErrKind check_planned(const RaggedSpec& spec, const RaggedPlan& plan, const std::int64_t* shard,
                             std::int64_t begin, std::int64_t end, std::string& msg) {
  for (std::int64_t i = begin; i < end; ++i) {
    const RaggedSource& src = spec.sources[static_cast<std::size_t>(shard[i])];
    if (src.gen != plan.gen[static_cast<std::size_t>(i)]) {
      msg = "sample " + std::to_string(i) + ": shard " + std::to_string(shard[i]) +
            (src.offsets == nullptr ? " was dropped" : " was replaced") +
            " (set_source) after the batch was planned; a shard's sources must stay installed until the "
            "batches that read it are gathered";
      return ErrKind::Value;
    }
  }
  return ErrKind::None;
}

namespace detail {

// Fill `n` bytes at `dst` with the repeated pattern `pat` (its size divides the element size).
inline void fill_pattern(std::uint8_t* dst, std::size_t n, const std::vector<std::uint8_t>& pat) {
  if (n == 0) return;
  const std::size_t p = pat.size();
  bool uniform = p > 0;
  for (std::size_t i = 1; i < p && uniform; ++i) uniform = pat[i] == pat[0];
  if (p == 0 || uniform) {
    std::memset(dst, p == 0 ? 0 : pat[0], n);
    return;
  }
  std::size_t done = std::min(p, n);
  std::memcpy(dst, pat.data(), done);
  while (done < n) {  // doubling copies of what is already written
    const std::size_t c = std::min(done, n - done);
    std::memcpy(dst + done, dst, c);
    done += c;
  }
}

}  // namespace detail

// Copy rows begin..end-1 of a planned batch (n rows in all) into `values` (packed or padded,
// see the Note), write offsets[begin..end-1] (and offsets[n] with the last row) and, for a
// field with positions, positions[dst[begin]..dst[end]-1].
inline void gather_ragged(const RaggedSpec& spec, const RaggedPlan& plan, const std::int64_t* shard,
                          std::int64_t n, std::int64_t begin, std::int64_t end, std::uint8_t* values,
                          std::int64_t* offsets, std::int64_t* positions = nullptr) {
  const std::size_t ib = spec.item_bytes;
  if (spec.padded) {
    const std::size_t row_bytes = static_cast<std::size_t>(plan.width) * ib;
    for (std::int64_t i = begin; i < end; ++i) {
      const std::size_t k = static_cast<std::size_t>(plan.dst[i + 1] - plan.dst[i]) * ib;
      std::uint8_t* d = values + static_cast<std::size_t>(i) * row_bytes;
      if (k) std::memcpy(d, spec.sources[shard[i]].values + static_cast<std::size_t>(plan.src[i]) * ib, k);
      detail::fill_pattern(d + k, row_bytes - k, spec.pad);
    }
  } else {
    std::int64_t i = begin;
    while (i < end) {
      // Coalesce rows whose items follow each other in one shard (sequential reads, pieces
      // of one document) into one copy.
      std::int64_t j = i + 1;
      while (j < end && shard[j] == shard[i] &&
             plan.src[j] == plan.src[j - 1] + (plan.dst[j] - plan.dst[j - 1]))
        ++j;
      const std::size_t k = static_cast<std::size_t>(plan.dst[j] - plan.dst[i]) * ib;
      if (k)
        std::memcpy(values + static_cast<std::size_t>(plan.dst[i]) * ib,
                    spec.sources[shard[i]].values + static_cast<std::size_t>(plan.src[i]) * ib, k);
      i = j;
    }
  }
  if (offsets != nullptr) {
    std::memcpy(offsets + begin, plan.dst.data() + begin, static_cast<std::size_t>(end - begin) * 8);
    if (end == n) offsets[n] = plan.dst[static_cast<std::size_t>(n)];
  }
  if (positions != nullptr && spec.positions && !spec.padded) {
    for (std::int64_t i = begin; i < end; ++i) {
      std::int64_t* p = positions + plan.dst[i];
      const std::int64_t k = plan.dst[i + 1] - plan.dst[i], f = plan.first[i];
      for (std::int64_t j = 0; j < k; ++j) p[j] = f + j;
    }
  }
}

}  // namespace fastload
