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
#include <cstring>
#include <string>
#include <vector>

namespace fastload {

// What went wrong, translated to a Python exception type once, at the binding.
enum class ErrKind : int { None = 0, Index = 1, Value = 2, Runtime = 3, External = 4 };

// One shard of one field: `rows` rows, C-contiguous, of the field's row size.
struct Source {
  const std::uint8_t* ptr = nullptr;
  std::int64_t rows = 0;
};

// Where each field lives in a slot and where its rows come from. Immutable once a ring runs.
struct Layout {
  std::vector<std::size_t> row_bytes;        // bytes of one row, per field
  std::vector<std::size_t> offsets;          // byte offset of each field inside a ring slot
  std::vector<std::vector<Source>> sources;  // [field][shard]; empty: not gathered
  std::vector<std::int64_t> shard_rows;      // rows per shard, shared by every sourced field
  int index_field = -1;                      // the int64 field receiving global indices, or -1

  bool sourced(std::size_t f) const { return !sources[f].empty(); }
  std::int64_t num_shards() const { return static_cast<std::int64_t>(shard_rows.size()); }
};

namespace detail {

constexpr std::int64_t kPrefetchRows = 4;   // prefetch distance, in rows
constexpr std::size_t kPrefetchLines = 16;  // cache lines prefetched at the head of a row

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
  bool any_sourced = false;
  for (std::size_t f = 0; f < L.sources.size(); ++f) any_sourced = any_sourced || L.sourced(f);
  if (any_sourced) {
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

}  // namespace fastload
