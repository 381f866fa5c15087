// Implementation of the ring engine. See Note [Ring design] in ring.h.
#include "ring.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

#if defined(__linux__)
#include <pthread.h>
#endif

namespace fastload {

namespace {

constexpr std::size_t kSlotAlign = 4096;  // page: slots can be cudaHostRegister'ed whole
constexpr std::size_t kFieldAlign = 256;  // each field region inside a slot
// Batches smaller than this do not wake a sleeping producer: waking a thread costs more than
// copying them, so an awake producer or the consumer (which helps, see take()) does them.
constexpr std::size_t kWakeBytes = 32 << 10;

std::size_t align_up(std::size_t x, std::size_t a) { return (x + a - 1) / a * a; }

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

}  // namespace

Engine::Engine(std::vector<std::size_t> row_bytes, std::int64_t batch_size,
               std::vector<std::vector<Source>> sources, int threads, int slots, int max_slots,
               std::size_t min_part_bytes)
    : row_bytes_(std::move(row_bytes)),
      batch_size_(batch_size),
      sources_(std::move(sources)),
      nthreads_(threads),
      max_slots_(max_slots),
      min_part_bytes_(std::max<std::size_t>(min_part_bytes, 1)) {
  if (row_bytes_.empty()) throw std::invalid_argument("a ring needs at least one field");
  if (sources_.size() != row_bytes_.size())
    throw std::invalid_argument("sources must have one entry per field");
  if (batch_size_ <= 0)
    throw std::invalid_argument("batch_size=" + std::to_string(batch_size_) + " must be > 0");
  if (nthreads_ < 1 || nthreads_ > 256)
    throw std::invalid_argument("threads=" + std::to_string(nthreads_) + " must be in [1, 256]");
  if (slots < 1) throw std::invalid_argument("slots=" + std::to_string(slots) + " must be >= 1");
  if (max_slots_ < slots)
    throw std::invalid_argument("max_slots=" + std::to_string(max_slots_) +
                                " must be >= slots=" + std::to_string(slots));

  // Shards: every sourced field must agree on shard count and rows per shard.
  bool have = false;
  for (std::size_t f = 0; f < sources_.size(); ++f) {
    if (sources_[f].empty()) continue;
    if (!have) {
      for (const Source& s : sources_[f]) {
        if (s.rows < 0) throw std::invalid_argument("negative shard size");
        shard_rows_.push_back(s.rows);
      }
      have = true;
      continue;
    }
    if (sources_[f].size() != shard_rows_.size())
      throw std::invalid_argument("field #" + std::to_string(f) + " has " +
                                  std::to_string(sources_[f].size()) + " shards, expected " +
                                  std::to_string(shard_rows_.size()));
    for (std::size_t s = 0; s < shard_rows_.size(); ++s)
      if (sources_[f][s].rows != shard_rows_[s])
        throw std::invalid_argument("field #" + std::to_string(f) + " shard " +
                                    std::to_string(s) + " has " +
                                    std::to_string(sources_[f][s].rows) + " rows, expected " +
                                    std::to_string(shard_rows_[s]));
  }

  std::size_t off = 0;
  for (std::size_t f = 0; f < row_bytes_.size(); ++f) {
    off = align_up(off, kFieldAlign);
    offsets_.push_back(off);
    off += row_bytes_[f] * static_cast<std::size_t>(batch_size_);
    if (!sources_[f].empty()) {
      sourced_row_bytes_ += row_bytes_[f];
      any_source_ = true;
    }
  }
  slot_bytes_ = std::max(align_up(off, kSlotAlign), kSlotAlign);

  // Allocate the initial slots and start the producers; undo everything on failure (the
  // destructor does not run when a constructor throws).
  try {
    for (int i = 0; i < slots; ++i) {
      auto s = std::make_unique<Slot>();
      s->mem = alloc_slot_memory();
      slots_.push_back(std::move(s));
    }
    for (int i = slots - 1; i >= 0; --i) free_.push_back(i);
    for (int i = 0; i < nthreads_; ++i) workers_.emplace_back(&Engine::worker, this);
  } catch (...) {
    close();
    for (auto& s : slots_) std::free(s->mem);
    throw;
  }
}

Engine::~Engine() {
  close();
  for (auto& s : slots_) std::free(s->mem);
}

std::uint8_t* Engine::alloc_slot_memory() {
  void* p = nullptr;
  if (posix_memalign(&p, kSlotAlign, slot_bytes_) != 0 || p == nullptr) throw std::bad_alloc();
  // Touch every page now so the first batches do not pay the page faults (and so pinning
  // later registers resident memory).
  std::memset(p, 0, slot_bytes_);
  return static_cast<std::uint8_t*>(p);
}

void Engine::close() {
  std::lock_guard<std::mutex> jg(join_mu_);
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    jobs_.clear();
  }
  cv_work_.notify_all();
  cv_cons_.notify_all();
  for (auto& t : workers_)
    if (t.joinable()) t.join();
  workers_.clear();
  std::unique_lock<std::mutex> lk(mu_);
  cv_idle_.wait(lk, [&] { return sync_gathers_ == 0; });
}

bool Engine::closed() {
  std::lock_guard<std::mutex> lk(mu_);
  return stop_;
}

int Engine::num_slots() {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<int>(slots_.size());
}

std::uint8_t* Engine::slot_memory(int slot) {
  std::lock_guard<std::mutex> lk(mu_);
  if (slot < 0 || slot >= static_cast<int>(slots_.size()))
    throw std::out_of_range("slot " + std::to_string(slot) + " does not exist");
  return slots_[slot]->mem;
}

std::int64_t Engine::pending() {
  std::lock_guard<std::mutex> lk(mu_);
  return next_seq_ - head_seq_;
}

Engine::Stats Engine::stats() {
  std::lock_guard<std::mutex> lk(mu_);
  Stats s{};
  s.slots = static_cast<int>(slots_.size());
  for (auto& sl : slots_) {
    switch (sl->state) {
      case Slot::State::Free: ++s.free; break;
      case Slot::State::Filling: ++s.filling; break;
      case Slot::State::Ready: ++s.ready; break;
      case Slot::State::InUse: ++s.in_use; break;
    }
  }
  s.submitted = next_seq_;
  s.delivered = delivered_;
  s.grown = grown_;
  s.copies = copies_;
  s.pending = next_seq_ - head_seq_;
  s.gather_ns = gather_ns_.load(std::memory_order_relaxed);
  return s;
}

std::int64_t Engine::submit(std::vector<std::int64_t> shard, std::vector<std::int64_t> row) {
  const std::int64_t n = static_cast<std::int64_t>(shard.size());
  if (static_cast<std::int64_t>(row.size()) != n)
    throw std::invalid_argument("shard and row must have the same length (got " +
                                std::to_string(n) + " and " + std::to_string(row.size()) + ")");
  if (n < 1 || n > batch_size_)
    throw std::invalid_argument("a batch must have between 1 and batch_size=" +
                                std::to_string(batch_size_) + " rows, got " + std::to_string(n));
  for (std::size_t f = 0; f < sources_.size(); ++f)
    if (sources_[f].empty())
      throw std::invalid_argument("field #" + std::to_string(f) +
                                  " has no sources; fill it through acquire()");
  auto r = std::make_shared<Request>();
  r->shard = std::move(shard);
  r->row = std::move(row);
  r->rows = n;
  std::lock_guard<std::mutex> lk(mu_);
  if (stop_) throw std::logic_error("submit() on a closed ring");
  r->seq = next_seq_++;
  reqs_.push_back(std::move(r));
  assign_locked();
  return next_seq_ - 1;
}

std::int64_t Engine::submit_many(const std::int64_t* shard, const std::int64_t* row,
                                 std::int64_t n, std::int64_t per) {
  if (per < 1 || per > batch_size_)
    throw std::invalid_argument("batch_size=" + std::to_string(per) +
                                " must be between 1 and the ring's batch_size=" +
                                std::to_string(batch_size_));
  if (n < 1) throw std::invalid_argument("submit_many() needs at least one row");
  for (std::size_t f = 0; f < sources_.size(); ++f)
    if (sources_[f].empty())
      throw std::invalid_argument("field #" + std::to_string(f) +
                                  " has no sources; fill it through acquire()");
  std::vector<std::shared_ptr<Request>> reqs;
  reqs.reserve(static_cast<std::size_t>((n + per - 1) / per));
  for (std::int64_t b = 0; b < n; b += per) {
    const std::int64_t e = std::min(n, b + per);
    auto r = std::make_shared<Request>();
    r->shard.assign(shard + b, shard + e);
    r->row.assign(row + b, row + e);
    r->rows = e - b;
    reqs.push_back(std::move(r));
  }
  std::lock_guard<std::mutex> lk(mu_);
  if (stop_) throw std::logic_error("submit() on a closed ring");
  for (auto& r : reqs) {
    r->seq = next_seq_++;
    reqs_.push_back(std::move(r));
  }
  assign_locked();
  return static_cast<std::int64_t>(reqs.size());
}

// Give FREE slots to requests in sequence order. Called with mu_ held.
void Engine::assign_locked() {
  int work = 0;
  bool ext = false;
  while (!stop_) {
    const std::int64_t idx = next_assign_ - head_seq_;
    if (idx >= static_cast<std::int64_t>(reqs_.size())) break;
    Request& r = *reqs_[static_cast<std::size_t>(idx)];
    if (r.state == Request::State::Ready) {  // failed before it needed a slot
      ++next_assign_;
      continue;
    }
    if (free_.empty()) break;
    const int s = free_.back();
    free_.pop_back();
    Slot& sl = *slots_[s];
    sl.state = Slot::State::Filling;
    r.slot = s;
    r.state = Request::State::Filling;
    if (r.external) {
      sl.holders = 1;  // the fill handle
      ext = true;
    } else {
      // Split big batches across producers so one batch is not bound to one core.
      const std::int64_t n = r.rows;
      const std::size_t bytes = static_cast<std::size_t>(n) * sourced_row_bytes_;
      std::int64_t parts = static_cast<std::int64_t>(bytes / min_part_bytes_);
      parts = std::max<std::int64_t>(1, std::min<std::int64_t>({parts, nthreads_, n}));
      r.parts_left = static_cast<int>(parts);
      for (std::int64_t p = 0; p < parts; ++p)
        jobs_.push_back(Job{&r, sl.mem, n * p / parts, n * (p + 1) / parts});
      if (bytes >= kWakeBytes) work += static_cast<int>(parts);
    }
    ++next_assign_;
  }
  // Wake only as many idle producers as there are new jobs (no thundering herd), and the
  // consumer if it can now help with the batch it waits for.
  for (int i = 0; i < std::min(work, idle_workers_); ++i) cv_work_.notify_one();
  if (waiters_ > 0 && (ext || !jobs_.empty())) cv_cons_.notify_all();
}

void Engine::worker() {
#if defined(__linux__)
  pthread_setname_np(pthread_self(), "fastload-ring");  // visible in /proc, top -H, gdb
#endif
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    if (jobs_.empty() && !stop_) {
      ++idle_workers_;
      cv_work_.wait(lk, [&] { return stop_ || !jobs_.empty(); });
      --idle_workers_;
    }
    if (stop_) return;
    run_front_job(lk);
  }
}

// Pop the front job, gather it with mu_ released, and record the result. Called with `lk`
// (on mu_) held; returns with it held.
void Engine::run_front_job(std::unique_lock<std::mutex>& lk) {
  Job j = jobs_.front();
  jobs_.pop_front();
  lk.unlock();
  std::string msg;
  ErrKind e;
  try {
    e = gather(j.req->shard.data(), j.req->row.data(), j.begin, j.end, j.req->seq, j.base, msg);
  } catch (const std::exception& ex) {
    e = ErrKind::Runtime;
    msg = ex.what();
  } catch (...) {
    e = ErrKind::Runtime;
    msg = "unknown C++ exception in a ring producer";
  }
  lk.lock();
  finish_part_locked(*j.req, e, std::move(msg));
}

void Engine::finish_part_locked(Request& r, ErrKind err, std::string&& msg) {
  if (err != ErrKind::None && r.err == ErrKind::None) {
    r.err = err;
    r.msg = std::move(msg);
  }
  if (--r.parts_left > 0) return;
  r.state = Request::State::Ready;
  slots_[r.slot]->state = Slot::State::Ready;
  if (waiters_ > 0 && r.seq == head_seq_) cv_cons_.notify_all();
}

ErrKind Engine::gather(const std::int64_t* shard, const std::int64_t* row, std::int64_t begin,
                       std::int64_t end, std::int64_t seq, std::uint8_t* base,
                       std::string& msg) const {
  const auto t0 = std::chrono::steady_clock::now();
  const ErrKind e = gather_rows(shard, row, begin, end, seq, base, msg);
  gather_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                           std::chrono::steady_clock::now() - t0).count(),
                       std::memory_order_relaxed);
  return e;
}

ErrKind Engine::gather_rows(const std::int64_t* shard, const std::int64_t* row,
                            std::int64_t begin, std::int64_t end, std::int64_t seq,
                            std::uint8_t* base, std::string& msg) const {
  const std::int64_t nshards = static_cast<std::int64_t>(shard_rows_.size());
  for (std::int64_t i = begin; i < end; ++i) {
    const std::int64_t s = shard[i], r = row[i];
    if (s < 0 || s >= nshards) {
      msg = "batch " + std::to_string(seq) + ", sample " + std::to_string(i) + ": shard " +
            std::to_string(s) + " is out of range (the ring has " + std::to_string(nshards) +
            " shards)";
      return ErrKind::Index;
    }
    if (r < 0 || r >= shard_rows_[s]) {
      msg = "batch " + std::to_string(seq) + ", sample " + std::to_string(i) + ": row " +
            std::to_string(r) + " is out of range for shard " + std::to_string(s) + " (" +
            std::to_string(shard_rows_[s]) + " rows)";
      return ErrKind::Index;
    }
  }
  for (std::size_t f = 0; f < sources_.size(); ++f) {
    const std::vector<Source>& src = sources_[f];
    if (src.empty()) continue;
    const std::size_t rb = row_bytes_[f];
    std::uint8_t* dst = base + offsets_[f] + static_cast<std::size_t>(begin) * rb;
    std::int64_t i = begin;
    // Random rows are latency-bound: prefetch the head of the row kPrefetchRows ahead so its
    // TLB walk and first cache misses overlap the current copy (the hardware prefetcher
    // takes over within a row). Costs nothing measurable for big rows.
    const std::size_t pf_lines = std::min<std::size_t>((rb + 63) / 64, kPrefetchLines);
    for (std::int64_t k = begin; k < std::min(end, begin + kPrefetchRows); ++k)
      prefetch_row(src[shard[k]].ptr + static_cast<std::size_t>(row[k]) * rb, pf_lines);
    while (i < end) {
      // Coalesce a run of consecutive rows of one shard into one copy.
      const std::int64_t s = shard[i], r0 = row[i];
      std::int64_t j = i + 1;
      while (j < end && shard[j] == s && row[j] == r0 + (j - i)) ++j;
      const std::size_t n = static_cast<std::size_t>(j - i) * rb;
      for (std::int64_t k = i + kPrefetchRows; k < std::min(end, j + kPrefetchRows); ++k)
        prefetch_row(src[shard[k]].ptr + static_cast<std::size_t>(row[k]) * rb, pf_lines);
      copy_bytes(dst, src[s].ptr + static_cast<std::size_t>(r0) * rb, n);
      dst += n;
      i = j;
    }
  }
  return ErrKind::None;
}

Engine::Status Engine::take(int timeout_ms, Delivery& d) {
  bool grow = false;
  {
    std::unique_lock<std::mutex> lk(mu_);
    bool waited = false;
    for (;;) {
      if (stop_) return Status::Closed;
      if (reqs_.empty()) return Status::Empty;
      Request* head = reqs_.front().get();
      if (head->state == Request::State::Ready) break;
      // Help instead of waiting: run the oldest queued part (of this batch or, when all of
      // its parts are taken, of a later one) ourselves. For small batches this saves two
      // thread wake-ups per batch; when the loop is input-bound it adds a core. Cost: get()
      // may return up to one part's copy time after its batch became ready.
      if (!jobs_.empty()) {
        run_front_job(lk);
        continue;
      }
      if (waited) return Status::Timeout;
      ++waiters_;
      cv_cons_.wait_for(lk, std::chrono::milliseconds(timeout_ms), [&] {
        return stop_ || reqs_.empty() || reqs_.front()->state == Request::State::Ready ||
               !jobs_.empty();
      });
      --waiters_;
      waited = true;
    }

    std::shared_ptr<Request> r = std::move(reqs_.front());
    reqs_.pop_front();
    ++head_seq_;
    next_assign_ = std::max(next_assign_, head_seq_);
    ++delivered_;
    d = Delivery{};
    d.seq = r->seq;
    d.rows = r->rows;
    d.err = r->err;
    d.msg = std::move(r->msg);
    if (r->slot < 0) return Status::Got;  // failed before it had a slot
    Slot& s = *slots_[r->slot];
    s.state = Slot::State::InUse;
    ++in_use_;
    if (r->err != ErrKind::None) {
      // Nothing is handed out; the slot is free as soon as no fill handle holds it.
      if (s.holders == 0) {
        s.state = Slot::State::Free;
        --in_use_;
        free_.push_back(r->slot);
        assign_locked();
      }
      return Status::Got;
    }
    s.holders += 1;  // the caller's lease
    d.slot = r->slot;
    d.mem = s.mem;
    // Growth rule: keep at least one slot outside the user's hands.
    const int total = static_cast<int>(slots_.size()) + growing_;
    if (total - in_use_ < 1) {
      if (total < max_slots_) {
        ++growing_;
        grow = true;
      } else {
        d.copy = true;
        ++copies_;
      }
    }
  }
  if (grow) {
    std::uint8_t* mem = nullptr;
    try {
      mem = alloc_slot_memory();
    } catch (...) {
      mem = nullptr;
    }
    std::lock_guard<std::mutex> lk(mu_);
    --growing_;
    if (mem != nullptr) {
      auto s = std::make_unique<Slot>();
      s->mem = mem;
      slots_.push_back(std::move(s));
      free_.push_back(static_cast<int>(slots_.size()) - 1);
      ++grown_;
      assign_locked();
    } else {  // out of memory: deliver this batch as a copy instead
      d.copy = true;
      ++copies_;
    }
  }
  return Status::Got;
}

void Engine::release(int slot) {
  std::lock_guard<std::mutex> lk(mu_);
  release_locked(slot);
}

void Engine::release_locked(int slot) {
  Slot& s = *slots_[slot];
  if (s.holders <= 0) return;  // defensive: never underflow
  if (--s.holders > 0 || s.state != Slot::State::InUse) return;
  s.state = Slot::State::Free;
  --in_use_;
  free_.push_back(slot);
  assign_locked();
}

std::shared_ptr<Request> Engine::begin_external() {
  auto r = std::make_shared<Request>();
  r->external = true;
  std::lock_guard<std::mutex> lk(mu_);
  if (stop_) throw std::logic_error("acquire() on a closed ring");
  r->seq = next_seq_++;
  reqs_.push_back(r);
  assign_locked();
  return r;
}

Engine::Status Engine::wait_slot(const std::shared_ptr<Request>& r, int timeout_ms) {
  std::unique_lock<std::mutex> lk(mu_);
  auto done = [&] { return stop_ || r->slot >= 0; };
  if (!done()) {
    ++waiters_;
    cv_cons_.wait_for(lk, std::chrono::milliseconds(timeout_ms), done);
    --waiters_;
  }
  if (r->slot >= 0) return Status::Got;
  return stop_ ? Status::Closed : Status::Timeout;
}

ErrKind Engine::gather_external(const std::shared_ptr<Request>& r, const std::int64_t* shard,
                                const std::int64_t* row, std::int64_t n, std::string& msg) {
  if (n < 1 || n > batch_size_) {
    msg = "a batch must have between 1 and batch_size=" + std::to_string(batch_size_) +
          " rows, got " + std::to_string(n);
    return ErrKind::Value;
  }
  if (!any_source_) {
    msg = "no field of this ring has sources to gather from";
    return ErrKind::Value;
  }
  std::uint8_t* base;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) {
      msg = "the ring is closed";
      return ErrKind::Runtime;
    }
    if (r->committed || r->slot < 0) {
      msg = "gather() after commit()/fail() on this slot";
      return ErrKind::Runtime;
    }
    base = slots_[r->slot]->mem;
    ++sync_gathers_;
  }
  ErrKind e;
  try {
    e = gather(shard, row, 0, n, r->seq, base, msg);
  } catch (const std::exception& ex) {
    e = ErrKind::Runtime;
    msg = ex.what();
  }
  std::lock_guard<std::mutex> lk(mu_);
  if (--sync_gathers_ == 0 && stop_) cv_idle_.notify_all();
  return e;
}

void Engine::publish_external(const std::shared_ptr<Request>& r, std::int64_t rows, ErrKind err,
                              const std::string& msg) {
  if (err == ErrKind::None && (rows < 1 || rows > batch_size_))
    throw std::invalid_argument("commit(rows=" + std::to_string(rows) +
                                "): rows must be between 1 and batch_size=" +
                                std::to_string(batch_size_));
  std::lock_guard<std::mutex> lk(mu_);
  if (r->committed) throw std::logic_error("this slot was already committed or failed");
  if (stop_) throw std::logic_error("the ring is closed");
  r->committed = true;
  r->err = err;
  r->msg = msg;
  r->rows = err == ErrKind::None ? rows : 0;
  r->state = Request::State::Ready;
  if (r->slot >= 0) slots_[r->slot]->state = Slot::State::Ready;
  if (waiters_ > 0 && r->seq == head_seq_) cv_cons_.notify_all();
}

void Engine::drop_external(const std::shared_ptr<Request>& r) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!r->committed) {
    r->committed = true;
    r->err = ErrKind::Runtime;
    r->msg = "batch " + std::to_string(r->seq) +
             ": a slot taken with acquire() was dropped without commit() or fail()";
    r->rows = 0;
    r->state = Request::State::Ready;
    if (r->slot >= 0) slots_[r->slot]->state = Slot::State::Ready;
    if (waiters_ > 0 && r->seq == head_seq_) cv_cons_.notify_all();
  }
  if (r->slot >= 0) release_locked(r->slot);
}

}  // namespace fastload
