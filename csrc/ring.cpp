// Implementation of the ring. See Note [Ring design] in ring.h.
#include "ring.h"

#include "fault.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

#if defined(__linux__)
#include <pthread.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <cerrno>
#endif
#include <unistd.h>

namespace fastload {

namespace {

constexpr std::size_t kSlotAlign = 4096;  // page: slots can be cudaHostRegister'ed whole
constexpr std::size_t kFieldAlign = 256;  // each field region inside a slot
// Batches smaller than this do not wake a sleeping producer: waking a thread costs more than
// copying them, so an awake producer or the consumer (which helps, see take()) does them.
constexpr std::size_t kWakeBytes = 32 << 10;

std::size_t align_up(std::size_t x, std::size_t a) { return (x + a - 1) / a * a; }

}  // namespace

Ring::Ring(Layout layout, std::int64_t batch_size, int threads, int slots, int max_slots,
           std::size_t min_part_bytes, int nice)
    : layout_(std::move(layout)),
      batch_size_(batch_size),
      nthreads_(threads),
      nice_(std::max(0, std::min(19, nice))),
      max_slots_(max_slots),
      min_part_bytes_(std::max<std::size_t>(min_part_bytes, 1)),
      owner_pid_(::getpid()) {
  // Invariants (the Python face validated the user's arguments already).
  const std::size_t nf = layout_.row_bytes.size();
  if (nf == 0 || layout_.sources.size() != nf)
    throw std::invalid_argument("ring layout: one row size and one source list per field");
  if (batch_size_ <= 0 || nthreads_ < 1 || slots < 1 || max_slots_ < slots)
    throw std::invalid_argument("ring: batch_size, threads, slots or max_slots out of range");
  if (layout_.index_field >= static_cast<int>(nf) ||
      (layout_.index_field >= 0 && (layout_.row_bytes[layout_.index_field] != 8 ||
                                    layout_.sourced(layout_.index_field))))
    throw std::invalid_argument("ring layout: the index field must be an unsourced int64 field");
  layout_.ragged_of.resize(nf, -1);
  for (std::size_t f = 0; f < nf; ++f)
    if (layout_.is_ragged(f) && (layout_.ragged_of[f] >= static_cast<int>(layout_.ragged.size()) ||
                                 layout_.sourced(f) || static_cast<int>(f) == layout_.index_field))
      throw std::invalid_argument("ring layout: a ragged field has ragged sources only");
  layout_.shard_rows.clear();
  bool have = false;
  for (const RaggedSpec& rs : layout_.ragged) {
    if (!have) {
      for (const RaggedSource& s : rs.sources) layout_.shard_rows.push_back(s.rows);
      have = true;
    } else if (rs.sources.size() != layout_.shard_rows.size()) {
      throw std::invalid_argument("ring layout: every sourced field needs the same shards");
    }
    for (std::size_t s = 0; s < layout_.shard_rows.size(); ++s)
      if (rs.sources[s].rows != layout_.shard_rows[s] || rs.sources[s].rows < 0)
        throw std::invalid_argument("ring layout: every sourced field needs the same rows per shard");
  }
  for (std::size_t f = 0; f < nf; ++f) {
    if (!layout_.sourced(f)) continue;
    if (!have) {
      for (const Source& s : layout_.sources[f]) layout_.shard_rows.push_back(s.rows);
      have = true;
    } else if (layout_.sources[f].size() != layout_.shard_rows.size()) {
      throw std::invalid_argument("ring layout: every sourced field needs the same shards");
    }
    for (std::size_t s = 0; s < layout_.shard_rows.size(); ++s)
      if (layout_.sources[f][s].rows != layout_.shard_rows[s] || layout_.sources[f][s].rows < 0)
        throw std::invalid_argument("ring layout: every sourced field needs the same rows per shard");
  }

  // Field offsets, and the slot size with overflow checks: a slot is batch_size rows of
  // every field, and a huge batch_size must fail here, not wrap around to a tiny slot.
  const std::size_t cap = static_cast<std::size_t>(1) << 48;
  std::size_t off = 0;
  layout_.offsets.clear();
  layout_.ragged_values.assign(layout_.ragged.size(), 0);
  layout_.ragged_positions.assign(layout_.ragged.size(), 0);
  for (std::size_t f = 0; f < nf; ++f) {
    off = align_up(off, kFieldAlign);
    layout_.offsets.push_back(off);
    if (layout_.is_ragged(f)) {  // the batch's offsets (rows + 1 int64), then its items
      const RaggedSpec& rs = layout_.ragged[layout_.ragged_of[f]];
      off += (static_cast<std::size_t>(batch_size_) + 1) * sizeof(std::int64_t);
      off = align_up(off, kFieldAlign);
      layout_.ragged_values[layout_.ragged_of[f]] = off;
      if (rs.item_bytes != 0 && static_cast<std::size_t>(rs.capacity) > (cap - off) / rs.item_bytes)
        throw std::length_error("a ring slot with a ragged capacity of " + std::to_string(rs.capacity) +
                                " items would exceed 2^48 bytes");
      off += static_cast<std::size_t>(rs.capacity) * rs.item_bytes;
      if (rs.positions) {  // then one int64 position per item
        off = align_up(off, kFieldAlign);
        layout_.ragged_positions[layout_.ragged_of[f]] = off;
        if (static_cast<std::size_t>(rs.capacity) > (cap - off) / sizeof(std::int64_t))
          throw std::length_error("a ring slot with a ragged capacity of " + std::to_string(rs.capacity) +
                                  " positions would exceed 2^48 bytes");
        off += static_cast<std::size_t>(rs.capacity) * sizeof(std::int64_t);
      }
      any_gathered_ = true;
      continue;
    }
    const std::size_t rb = layout_.row_bytes[f];
    if (rb != 0 && static_cast<std::size_t>(batch_size_) > (cap - off) / rb)
      throw std::length_error("a ring slot of batch_size=" + std::to_string(batch_size_) +
                              " rows would exceed 2^48 bytes");
    off += rb * static_cast<std::size_t>(batch_size_);
    if (layout_.sourced(f) || static_cast<int>(f) == layout_.index_field) {
      gathered_row_bytes_ += rb;
      any_gathered_ = true;
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
    for (int i = 0; i < nthreads_; ++i) workers_.emplace_back(&Ring::worker, this);
  } catch (...) {
    close();
    for (auto& s : slots_) std::free(s->mem);
    throw;
  }
}

Ring::~Ring() {
  close();  // in an orphaned ring (never destroyed by the binding, see module.cpp): a no-op
  for (auto& s : slots_) std::free(s->mem);
}

bool Ring::orphaned() const { return ::getpid() != owner_pid_; }

void Ring::check_owner() const {
  if (orphaned())
    throw std::logic_error(
        "this ring was created in another process (before os.fork()); its threads do not exist "
        "here: create a new one in this process");
}

std::uint8_t* Ring::alloc_slot_memory() {
  void* p = nullptr;
  if (posix_memalign(&p, kSlotAlign, slot_bytes_) != 0 || p == nullptr) throw std::bad_alloc();
  // Pages are not touched here: the thread that first writes a slot faults its pages in
  // (the kernel zero-fills them), so building a ring costs no time per slot and the first
  // batch waits only for its own slot's pages. Touching every slot up front put ~0.13 s
  // before the first batch of an image Loader on the CPU (8 slots of 64 float32 224x224
  // images). Pinning (cudaHostRegister) faults pages in itself.
  return static_cast<std::uint8_t*>(p);
}

void Ring::close() {
  if (orphaned()) {
    // A forked child: the producers do not exist here and mu_ may be held by one of them.
    // Leak the thread handles (destroying a joinable std::thread aborts; joining waits
    // forever) and touch nothing else.
    if (!workers_.empty()) new std::vector<std::thread>(std::move(workers_));
    return;
  }
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

bool Ring::closed() {
  if (orphaned()) return true;
  std::lock_guard<std::mutex> lk(mu_);
  return stop_;
}

int Ring::num_slots() {
  check_owner();
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<int>(slots_.size());
}

std::uint8_t* Ring::slot_memory(int slot) {
  check_owner();
  std::lock_guard<std::mutex> lk(mu_);
  if (slot < 0 || slot >= static_cast<int>(slots_.size()))
    throw std::out_of_range("slot " + std::to_string(slot) + " does not exist");
  return slots_[slot]->mem;
}

std::int64_t Ring::pending() {
  if (orphaned()) return 0;
  std::lock_guard<std::mutex> lk(mu_);
  return next_seq_ - head_seq_;
}

Ring::Stats Ring::stats() {
  check_owner();
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

std::int64_t Ring::submit_many(const std::int64_t* shard, const std::int64_t* row,
                               const std::int64_t* index, std::int64_t n, std::int64_t per,
                               const std::int64_t* start, const std::int64_t* count) {
  if (per < 1 || per > batch_size_ || n < 1)
    throw std::invalid_argument("submit: batch size or row count out of range");
  std::vector<std::int64_t> sizes;
  sizes.reserve(static_cast<std::size_t>((n + per - 1) / per));
  for (std::int64_t b = 0; b < n; b += per) sizes.push_back(std::min(per, n - b));
  return submit_sized(shard, row, index, n, sizes.data(), static_cast<std::int64_t>(sizes.size()), start, count);
}

std::int64_t Ring::submit_sized(const std::int64_t* shard, const std::int64_t* row, const std::int64_t* index,
                                std::int64_t n, const std::int64_t* sizes, std::int64_t batches,
                                const std::int64_t* start, const std::int64_t* count) {
  check_owner();
  std::int64_t rows = 0;
  for (std::int64_t k = 0; k < batches; ++k) {
    if (sizes[k] < 1 || sizes[k] > batch_size_)
      throw std::invalid_argument("submit: a batch size is out of range");
    rows += sizes[k];
  }
  if (n < 1 || batches < 1 || rows != n) throw std::invalid_argument("submit: the batch sizes do not add up to the rows");
  for (std::size_t f = 0; f < layout_.sources.size(); ++f)
    if (!layout_.sourced(f) && static_cast<int>(f) != layout_.index_field && !layout_.is_ragged(f))
      throw std::invalid_argument("submit: a field of this ring has no sources");
  if ((layout_.index_field >= 0) != (index != nullptr))
    throw std::invalid_argument("submit: global indices are needed exactly when the ring has an index field");
  // Ragged planning reads the shards' offsets outside the lock: no set_source() meanwhile.
  const bool planning = !layout_.ragged.empty();
  if (planning) begin_planning();
  struct Planning {  // leaves the planning count on every path (an allocation may throw)
    Ring* ring;
    bool on;
    ~Planning() {
      if (!on) return;
      std::lock_guard<std::mutex> g(ring->mu_);
      ring->end_planning_locked();
    }
  } guard{this, planning};
  std::vector<std::shared_ptr<Request>> reqs;
  reqs.reserve(static_cast<std::size_t>(batches));
  std::int64_t e = 0;
  for (std::int64_t k = 0; k < batches; ++k) {
    const std::int64_t b = e;
    e = b + sizes[k];
    auto r = std::make_shared<Request>();
    r->shard.assign(shard + b, shard + e);
    r->row.assign(row + b, row + e);
    if (index != nullptr) r->index.assign(index + b, index + e);
    r->rows = e - b;
    if (!layout_.ragged.empty()) {
      std::string msg;
      const ErrKind err = plan_locked_free(*r, start != nullptr ? start + b : nullptr,
                                           count != nullptr ? count + b : nullptr, msg);
      if (err != ErrKind::None) {  // delivered as this batch's error; it needs no slot
        r->err = err;
        r->msg = std::move(msg);  // prefixed with the batch's sequence number below
        r->state = Request::State::Ready;
        r->ragged.clear();
      }
    }
    reqs.push_back(std::move(r));
  }
  std::lock_guard<std::mutex> lk(mu_);
  if (planning) {
    guard.on = false;
    end_planning_locked();
  }
  if (stop_) throw std::logic_error("submit() on a closed ring");
  for (auto& r : reqs) {
    r->seq = next_seq_++;
    if (r->err != ErrKind::None) r->msg = "batch " + std::to_string(r->seq) + ", " + r->msg;
    reqs_.push_back(std::move(r));
  }
  assign_locked();
  return static_cast<std::int64_t>(reqs.size());
}

void Ring::begin_planning() {
  std::unique_lock<std::mutex> lk(mu_);
  cv_idle_.wait(lk, [&] { return stop_ || !paused_; });
  if (stop_) throw std::logic_error("submit() on a closed ring");
  ++planning_;
}

void Ring::end_planning_locked() {
  if (--planning_ == 0 && paused_) cv_idle_.notify_all();
}

// Give FREE slots to requests in sequence order. Called with mu_ held.
void Ring::assign_locked() {
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
      const std::size_t bytes = static_cast<std::size_t>(n) * gathered_row_bytes_ + r.ragged_bytes;
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

void Ring::worker() {
#if defined(__linux__)
  if (nice_ > 0) {  // Linux nice values are per thread; only raising it needs no privilege
    const id_t tid = static_cast<id_t>(::syscall(SYS_gettid));
    errno = 0;
    const int cur = ::getpriority(PRIO_PROCESS, tid);
    if (errno == 0 && cur < nice_) ::setpriority(PRIO_PROCESS, tid, nice_);
  }
  // named after its priority is set: a thread seen by this name runs at it
  pthread_setname_np(pthread_self(), "fastload-ring");  // visible in /proc, top -H, gdb
#endif
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    if ((jobs_.empty() || paused_) && !stop_) {
      ++idle_workers_;
      cv_work_.wait(lk, [&] { return stop_ || (!jobs_.empty() && !paused_); });
      --idle_workers_;
    }
    if (stop_) return;
    run_front_job(lk);
  }
}

// Pop the front job, gather it with mu_ released, and record the result. Called with `lk`
// (on mu_) held; returns with it held.
void Ring::run_front_job(std::unique_lock<std::mutex>& lk) {
  Job j = jobs_.front();
  jobs_.pop_front();
  ++running_;
  lk.unlock();
  std::string msg, path;
  ErrKind e;
  try {
    const Request& r = *j.req;
    e = gather(r, r.shard.data(), r.row.data(), r.index.empty() ? nullptr : r.index.data(),
               j.begin, j.end, j.base, msg, path);
  } catch (const std::exception& ex) {
    e = ErrKind::Runtime;
    msg = ex.what();
  } catch (...) {
    e = ErrKind::Runtime;
    msg = "unknown C++ exception in a ring producer";
  }
  lk.lock();
  if (--running_ == 0 && paused_) cv_idle_.notify_all();
  finish_part_locked(*j.req, e, std::move(msg), std::move(path));
}

void Ring::finish_part_locked(Request& r, ErrKind err, std::string&& msg, std::string&& path) {
  if (err != ErrKind::None && r.err == ErrKind::None) {
    r.err = err;
    r.msg = std::move(msg);
    r.path = std::move(path);
  }
  if (--r.parts_left > 0) return;
  publish_ready_locked(r);
}

void Ring::publish_ready_locked(Request& r) {
  r.state = Request::State::Ready;
  if (r.slot >= 0) slots_[r.slot]->state = Slot::State::Ready;
  if (waiters_ > 0 && r.seq == head_seq_) cv_cons_.notify_all();
}

ErrKind Ring::plan_locked_free(Request& r, const std::int64_t* start, const std::int64_t* count,
                               std::string& msg) const {
  const std::int64_t n = static_cast<std::int64_t>(r.shard.size());
  if (start != nullptr) r.start.assign(start, start + n);
  if (count != nullptr) r.count.assign(count, count + n);
  r.ragged.clear();
  r.ragged.resize(layout_.ragged.size());
  r.ragged_bytes = 0;
  for (std::size_t g = 0; g < layout_.ragged.size(); ++g) {
    const RaggedSpec& spec = layout_.ragged[g];
    RaggedPlan& plan = r.ragged[g];
    // The offsets are read from the mapped shards: guarded (a SIGBUS fails this batch).
    ErrKind e = ErrKind::None;
    const void* fault = nullptr;
    if (!run_guarded([&] { e = plan_ragged(spec, r.shard.data(), r.row.data(), start, count, n, plan, msg); },
                     fault)) {
      msg = fault_message(fault, r.shard.data(), 0, n, r.path);
      return ErrKind::Fault;
    }
    if (e != ErrKind::None) return e;
    if (plan.bytes > static_cast<std::size_t>(spec.capacity) * spec.item_bytes) {
      // A batch larger than the slot region (rare: sized for the longest samples) gets
      // memory of its own, handed to the consumer with the batch.
      void* p = nullptr;
      const std::size_t own = plan.own_bytes(spec.positions);
      if (posix_memalign(&p, kSlotAlign, std::max<std::size_t>(own, 1)) != 0 || p == nullptr) {
        msg = "cannot allocate " + std::to_string(own) + " bytes for a ragged batch";
        return ErrKind::Runtime;
      }
      plan.own = static_cast<std::uint8_t*>(p);
    }
    r.ragged_bytes += plan.own_bytes(spec.positions);
  }
  return ErrKind::None;
}

ErrKind Ring::gather(const Request& r, const std::int64_t* shard, const std::int64_t* row,
                     const std::int64_t* index, std::int64_t begin, std::int64_t end,
                     std::uint8_t* base, std::string& msg, std::string& path) const {
  const auto t0 = std::chrono::steady_clock::now();
  // Each field's destination in this slot (on the stack for the usual few fields).
  constexpr std::size_t kInline = 32;
  const std::size_t nf = layout_.offsets.size();
  std::uint8_t* inline_dst[kInline];
  std::vector<std::uint8_t*> heap_dst(nf > kInline ? nf : 0);
  std::uint8_t** dst = nf > kInline ? heap_dst.data() : inline_dst;
  for (std::size_t f = 0; f < nf; ++f) dst[f] = base + layout_.offsets[f];
  ErrKind e = ErrKind::None;
  for (std::size_t g = 0; g < layout_.ragged.size() && e == ErrKind::None; ++g)  // not swapped since planned
    e = check_planned(layout_.ragged[g], r.ragged[g], shard, begin, end, msg);
  // The copies read the mapped shards: one recovery point for the whole part (see Note
  // [Mapped reads and SIGBUS] in fault.h); the kernels hold no object a jump would skip.
  const void* fault = nullptr;
  if (e == ErrKind::None && !run_guarded([&] { e = gather_guarded(r, shard, row, index, begin, end, base, dst, msg); },
                                         fault)) {
    e = ErrKind::Fault;
    msg = fault_message(fault, shard, begin, end, path);
  }
  gather_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                           std::chrono::steady_clock::now() - t0).count(),
                       std::memory_order_relaxed);
  if (e != ErrKind::None) msg = "batch " + std::to_string(r.seq) + ", " + msg;
  return e;
}

ErrKind Ring::gather_guarded(const Request& r, const std::int64_t* shard, const std::int64_t* row,
                             const std::int64_t* index, std::int64_t begin, std::int64_t end,
                             std::uint8_t* base, std::uint8_t* const* dst, std::string& msg) const {
  const std::size_t nf = layout_.offsets.size();
  ErrKind e = gather_rows(layout_, shard, row, index, begin, end, dst, msg);
  if (e == ErrKind::None) {
    for (std::size_t f = 0; f < nf; ++f) {
      if (!layout_.is_ragged(f)) continue;
      const int g = layout_.ragged_of[f];
      const RaggedPlan& plan = r.ragged[static_cast<std::size_t>(g)];
      const RaggedSpec& spec = layout_.ragged[g];
      std::uint8_t* values = plan.own != nullptr ? plan.own : base + layout_.ragged_values[g];
      std::int64_t* positions = nullptr;
      if (spec.positions)
        positions = reinterpret_cast<std::int64_t*>(plan.own != nullptr ? plan.own + plan.positions_at()
                                                                        : base + layout_.ragged_positions[g]);
      gather_ragged(spec, plan, shard, static_cast<std::int64_t>(plan.dst.size()) - 1, begin, end, values,
                    reinterpret_cast<std::int64_t*>(dst[f]), positions);
    }
  }
  return e;
}

std::string Ring::fault_message(const void* addr, const std::int64_t* shard, std::int64_t begin,
                                std::int64_t end, std::string& path) const {
  const std::int64_t found = addr != nullptr ? shard_of_address(layout_, addr) : -1;
  std::string what;
  if (found >= 0) {
    what = "shard " + std::to_string(found);
  } else {  // no address (re-raised by another handler) or not in a source: the shards read
    std::vector<std::int64_t> read(shard + begin, shard + end);
    std::sort(read.begin(), read.end());
    read.erase(std::unique(read.begin(), read.end()), read.end());
    what = read.size() == 1 ? "shard " : "one of shards ";
    for (std::size_t k = 0; k < read.size() && k < 16; ++k) what += (k ? ", " : "") + std::to_string(read[k]);
    if (read.size() > 16) what += ", ...";
  }
  return describe_fault(addr, what, path);
}

Ring::Status Ring::wait_head_locked(std::unique_lock<std::mutex>& lk, int timeout_ms) {
  bool waited = false;
  for (;;) {
    if (stop_) return Status::Closed;
    if (reqs_.empty()) return Status::Empty;
    if (reqs_.front()->state == Request::State::Ready) return Status::Got;
    // Help instead of waiting: run the oldest queued part (of this batch or, when all of
    // its parts are taken, of a later one) ourselves. For small batches this saves two
    // thread wake-ups per batch; when the loop is input-bound it adds a core. Cost: get()
    // may return up to one part's copy time after its batch became ready.
    if (!jobs_.empty() && !paused_) {
      run_front_job(lk);
      continue;
    }
    if (waited) return Status::Timeout;
    ++waiters_;
    cv_cons_.wait_for(lk, std::chrono::milliseconds(timeout_ms), [&] {
      return stop_ || reqs_.empty() || reqs_.front()->state == Request::State::Ready ||
             (!jobs_.empty() && !paused_);
    });
    --waiters_;
    waited = true;
  }
}

bool Ring::hand_out_locked(Delivery& d) {
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
  d.path = std::move(r->path);
  if (r->err == ErrKind::None) d.ragged = std::move(r->ragged);
  if (r->slot < 0) return false;  // failed before it had a slot
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
    return false;
  }
  s.holders += 1;  // the caller's lease
  d.slot = r->slot;
  d.mem = s.mem;
  // Growth rule: keep at least one slot outside the user's hands.
  const int total = static_cast<int>(slots_.size()) + growing_;
  if (total - in_use_ >= 1) return false;
  if (total < max_slots_) {
    ++growing_;
    return true;
  }
  d.copy = true;
  ++copies_;
  return false;
}

void Ring::grow_slot(Delivery& d) {
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

Ring::Status Ring::take(int timeout_ms, Delivery& d) {
  check_owner();
  bool grow;
  {
    std::unique_lock<std::mutex> lk(mu_);
    const Status st = wait_head_locked(lk, timeout_ms);
    if (st != Status::Got) return st;
    grow = hand_out_locked(d);
  }
  if (grow) grow_slot(d);
  return Status::Got;
}

void Ring::release(int slot) {
  if (orphaned()) return;  // a forked child's copy of a lease: nothing to give back here
  std::lock_guard<std::mutex> lk(mu_);
  release_locked(slot);
}

void Ring::release_locked(int slot) {
  Slot& s = *slots_[slot];
  if (s.holders <= 0) return;  // defensive: never underflow
  if (--s.holders > 0 || s.state != Slot::State::InUse) return;
  s.state = Slot::State::Free;
  --in_use_;
  free_.push_back(slot);
  assign_locked();
}

std::shared_ptr<Request> Ring::begin_external() {
  auto r = std::make_shared<Request>();
  r->external = true;
  check_owner();
  std::lock_guard<std::mutex> lk(mu_);
  if (stop_) throw std::logic_error("acquire() on a closed ring");
  r->seq = next_seq_++;
  reqs_.push_back(r);
  assign_locked();
  return r;
}

Ring::Status Ring::wait_slot(const std::shared_ptr<Request>& r, int timeout_ms) {
  check_owner();
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

ErrKind Ring::gather_external(const std::shared_ptr<Request>& r, const std::int64_t* shard,
                              const std::int64_t* row, const std::int64_t* index,
                              std::int64_t n, std::string& msg, std::string& path) {
  if (n < 1 || n > batch_size_) {
    msg = "a batch must have between 1 and batch_size=" + std::to_string(batch_size_) +
          " rows, got " + std::to_string(n);
    return ErrKind::Value;
  }
  if (!any_gathered_) {
    msg = "no field of this ring has sources to gather from";
    return ErrKind::Value;
  }
  std::uint8_t* base;
  if (orphaned()) {
    msg = "this ring was created in another process (before os.fork())";
    return ErrKind::Runtime;
  }
  {
    std::unique_lock<std::mutex> lk(mu_);
    cv_idle_.wait(lk, [&] { return stop_ || !paused_; });
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
  ErrKind e = ErrKind::None;
  try {
    if (!layout_.ragged.empty()) {  // the fill handle is the only writer of this request
      r->shard.assign(shard, shard + n);
      r->row.assign(row, row + n);
      e = plan_locked_free(*r, nullptr, nullptr, msg);
      if (e != ErrKind::None) msg = "batch " + std::to_string(r->seq) + ", " + msg;
      if (e == ErrKind::Fault) path = r->path;
    }
    if (e == ErrKind::None) e = gather(*r, shard, row, index, 0, n, base, msg, path);
  } catch (const std::exception& ex) {
    e = ErrKind::Runtime;
    msg = ex.what();
  }
  std::lock_guard<std::mutex> lk(mu_);
  if (--sync_gathers_ == 0 && (stop_ || paused_)) cv_idle_.notify_all();
  return e;
}

std::uint64_t Ring::set_source(std::int64_t shard, const std::vector<Source>& per_field,
                               const std::vector<RaggedSource>& per_ragged) {
  check_owner();
  if (shard < 0 || shard >= layout_.num_shards())
    throw std::out_of_range("set_source: shard " + std::to_string(shard) + " is out of range (" +
                            std::to_string(layout_.num_shards()) + " shards)");
  if (per_field.size() != layout_.sources.size())
    throw std::invalid_argument("set_source: one source per field");
  if (!per_ragged.empty() && per_ragged.size() != layout_.ragged.size())
    throw std::invalid_argument("set_source: one ragged source per ragged field");
  const std::int64_t rows = layout_.shard_rows[static_cast<std::size_t>(shard)];
  for (std::size_t f = 0; f < per_field.size(); ++f)
    if (layout_.sourced(f) && per_field[f].ptr != nullptr && per_field[f].rows != rows)
      throw std::invalid_argument("set_source: a source has the wrong number of rows");
  for (const RaggedSource& rs : per_ragged)
    if (rs.offsets != nullptr && (rs.rows != rows || rs.items < 0 || (rs.values == nullptr && rs.items > 0)))
      throw std::invalid_argument("set_source: a ragged source has the wrong number of rows");
  std::unique_lock<std::mutex> lk(mu_);
  cv_idle_.wait(lk, [&] { return !paused_; });  // one set_source at a time
  paused_ = true;
  cv_idle_.wait(lk, [&] { return running_ == 0 && sync_gathers_ == 0 && planning_ == 0; });
  for (std::size_t f = 0; f < per_field.size(); ++f) {
    if (!layout_.sourced(f)) continue;
    layout_.sources[f][static_cast<std::size_t>(shard)].ptr = per_field[f].ptr;
  }
  for (std::size_t g = 0; g < per_ragged.size(); ++g) {
    if (layout_.ragged[g].sources.size() <= static_cast<std::size_t>(shard)) continue;  // a field without sources
    RaggedSource& dst = layout_.ragged[g].sources[static_cast<std::size_t>(shard)];
    const RaggedSource& src = per_ragged[g];
    const bool load = src.offsets != nullptr;
    dst.values = load ? src.values : nullptr;
    dst.offsets = load ? src.offsets : nullptr;
    dst.items = load ? src.items : 0;
    ++dst.gen;  // batches planned from the old source are not copied from this one
  }
  const std::uint64_t seq = ++swaps_;
  paused_ = false;
  cv_idle_.notify_all();
  cv_work_.notify_all();
  if (waiters_ > 0) cv_cons_.notify_all();
  return seq;
}

void Ring::publish_external(const std::shared_ptr<Request>& r, std::int64_t rows, ErrKind err,
                            const std::string& msg) {
  if (err == ErrKind::None && (rows < 1 || rows > batch_size_))
    throw std::invalid_argument("commit(rows=" + std::to_string(rows) +
                                "): rows must be between 1 and batch_size=" +
                                std::to_string(batch_size_));
  check_owner();
  std::lock_guard<std::mutex> lk(mu_);
  if (r->committed) throw std::logic_error("this slot was already committed or failed");
  if (stop_) throw std::logic_error("the ring is closed");
  r->committed = true;
  r->err = err;
  r->msg = msg;
  r->rows = err == ErrKind::None ? rows : 0;
  publish_ready_locked(*r);
}

void Ring::drop_external(const std::shared_ptr<Request>& r) {
  if (orphaned()) return;
  std::lock_guard<std::mutex> lk(mu_);
  if (!r->committed) {
    r->committed = true;
    r->err = ErrKind::Runtime;
    r->msg = "batch " + std::to_string(r->seq) +
             ": a slot taken with acquire() was dropped without commit() or fail()";
    r->rows = 0;
    publish_ready_locked(*r);
  }
  if (r->slot >= 0) release_locked(r->slot);
}

}  // namespace fastload
