// fastload ring buffer: a fixed set of aligned host slots, a pool of C++ producer threads
// that gather rows into them, and an in-order hand-off to one consumer.
//
// This header is pure C++ (no Python, no torch). The gather kernel lives in gather.h, the
// Python binding in module.cpp (which exposes this class as fastload._C.Ring), and the
// Python face in fastload/ring.py (fastload.ring.Ring). One concept, one name: Ring.
//
// Note [Ring design]
// ~~~~~~~~~~~~~~~~~~
// Requests. Every batch is a *request* with a sequence number, created either by
// submit(shard, row, index) (the producers gather rows of every sourced field into a slot)
// or by begin_external() ("external fill": the caller writes the slot itself, e.g. DALI
// output, then commit()s). Requests are handed to the consumer strictly in sequence order,
// whatever order the producers finish them in.
//
// Slots. A slot is one block of host memory (4096-byte aligned, size rounded up to whole
// pages so it can be cudaHostRegister'ed), holding batch_size rows of every field; field f
// starts at layout().offsets[f] (256-byte aligned). A slot moves through
//
//     FREE --assign--> FILLING --gather done / commit()--> READY --take()--> IN_USE --> FREE
//
//  * assign:  slots are given to requests in sequence order (assign_locked()); a request
//             waits until a FREE slot exists. Requests that already failed need no slot.
//  * FILLING: the gather of a request may be split into parts (row ranges) that run on
//             several producer threads; the slot is READY when the last part finishes.
//  * IN_USE:  the consumer took the batch. The Python layer hands out zero-copy views of
//             the slot; each object that can still reach the slot's memory (a batch lease,
//             an external-fill handle) holds one "holder" reference.
//
// Reuse rule (the CPU lifetime rule). An IN_USE slot becomes FREE only when its holder
// count drops to zero, i.e. when the last numpy array / torch tensor viewing it is gone.
// A slot is never written while anything can read it. On CUDA the Python layer keeps the
// lease until the CUDA event recorded after the device copy has completed, so the same rule
// also covers the asynchronous device copy.
//
// Growth rule (never overwrite, never deadlock). When take() hands a batch out as a view it
// checks that at least one slot stays outside the user's hands (so producers can make
// progress). If not, the ring grows by one slot (allocated outside the lock) as long as it
// has fewer than max_slots slots; at the cap, the batch is delivered as a copy instead and its
// slot goes straight back to FREE (Delivery::copy). Holding any number of batches therefore
// costs memory, never correctness or liveness.
//
// Threading. One mutex (mu_) guards all state; it is held only for bookkeeping (queue
// pushes/pops, counters), never for a memcpy, an allocation or a wait on anything slow.
// Producers wait on cv_work_ (woken one per new job); the consumer and external-fill callers
// wait on cv_cons_ with timed waits, so the Python layer can check for Ctrl-C between slices.
// A consumer whose next batch is not ready runs queued (unstarted) parts itself instead of
// sleeping, oldest first: small batches then need no thread wake-up at all, and an
// input-bound loop gains a core. Batches under 32 KiB do not wake sleeping producers at all
// (a wake-up costs more than the copy); an awake producer or the consumer does them.
// Producer threads never touch Python and never own a reference to the Ring; the Ring is
// destroyed by whoever drops the last shared_ptr (always a Python object's destructor, GIL
// held), and its destructor joins the producers (they need no GIL, so this cannot deadlock).
//
// Errors. Arguments are validated once, in Python (fastload/ringspec.py); this class only
// asserts its invariants (std::invalid_argument / std::logic_error). A bad shard/row in a
// request is detected by the gather kernel and stored in the request (kind + message);
// take() delivers it to the consumer for that very batch. An external fill that failed is
// published as ErrKind::External: the binding (module.cpp) raises the fill's own exception,
// which it keeps by batch, for that batch.
// Later batches are unaffected. A read of a shard that raises SIGBUS (its file truncated
// while mapped, an I/O error under a mapped page) fails the batch that read it with
// ErrKind::Fault naming the shard and its file (see Note [Mapped reads and SIGBUS] in
// fault.h); batches that do not read that shard are unaffected.
//
// Note [Shard sources]
// ~~~~~~~~~~~~~~~~~~~~
// Every sourced field has one Source per shard (a ragged field one RaggedSource). A shard may
// start unloaded (null pointers) and be installed, dropped and installed again while the ring
// runs (a remote dataset's cache maps a shard when it arrives and unmaps it after its last
// use). Gathers read the sources without the lock, and so does the planning of ragged fields
// in submit (their offsets), so set_source() pauses the start of new gathers and plans
// (paused_), waits for the running ones (running_ jobs, sync_gathers_, planning_ submits) to
// finish, swaps the pointers under mu_, and resumes: pointer writes happen-before every later
// gather and plan through mu_. A pause lasts one gather part or one submit's planning.
// A ragged batch is planned in submit and copied later: each planned row records its source's
// generation (RaggedSource::gen, changed by every swap), and a row whose shard was dropped or
// replaced in between fails with ErrKind::Value instead of mixing two sources (a batch is
// never torn). A batch planned from a shard that is not loaded fails naming the shard.
//
// Shutdown. close() sets stop_, drops queued jobs, wakes everyone, joins the producers and
// waits for in-flight synchronous gathers (gather_external). Afterwards submit/take/commit
// report "closed"; leases still release their slots (the memory lives until the Ring dies).
//
// Fork. A process forked while a ring runs inherits its memory but none of its threads, and
// mu_ may be copied locked by a producer that does not exist there. In such a child the ring
// is *orphaned* (getpid() differs from the creator's): close(), release(), drop_external()
// and the destructor touch no lock and join no thread (the thread handles are leaked on
// purpose: joining or destroying them would wait forever or abort), and every other call
// throws std::logic_error. The Python layer refuses to use an inherited ring before that.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <sys/types.h>

#include "gather.h"

namespace fastload {

struct Request {
  std::int64_t seq = 0;
  bool external = false;
  std::vector<std::int64_t> shard, row, index;  // gather requests only (index: may be empty)
  std::vector<std::int64_t> start, count;       // per-row item windows of ragged fields (may be empty)
  std::vector<RaggedPlan> ragged;               // one per ragged field, planned before the copy
  std::size_t ragged_bytes = 0;                 // bytes the ragged fields copy (to split parts)
  std::int64_t rows = 0;                        // rows in the batch (external: set by commit)
  int slot = -1;
  int parts_left = 0;
  enum class State { Waiting, Filling, Ready } state = State::Waiting;
  bool committed = false;                       // external: commit() or fail() happened
  ErrKind err = ErrKind::None;
  std::string msg;
  std::string path;  // Fault: the file of the shard whose read failed (empty if unknown)
};

struct Delivery {
  std::int64_t seq = 0;
  std::int64_t rows = 0;
  int slot = -1;
  std::uint8_t* mem = nullptr;
  bool copy = false;  // deliver as a copy, then release(slot)
  ErrKind err = ErrKind::None;
  std::string msg;
  std::string path;  // Fault: the file of the shard whose read failed (empty if unknown)
  std::vector<RaggedPlan> ragged;  // extents of each ragged field (and memory of its own, if any)
};

class Ring : public std::enable_shared_from_this<Ring> {
 public:
  // `layout` gives row sizes, sources and the index field (offsets are computed here).
  // nice: the producers' thread priority (Linux nice value, 0..19; 0 leaves it as is). A
  // loader's producers run below the training loop's threads, which then win a contended core;
  // the consumer helps with queued parts when its batch is late, so they cannot starve it.
  Ring(Layout layout, std::int64_t batch_size, int threads, int slots, int max_slots,
       std::size_t min_part_bytes, int nice = 0);
  ~Ring();
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  // Enqueue n rows as consecutive batches of `per` rows (the last may be shorter), under one
  // lock; `index` (n values, or null) fills the index field; `start`/`count` (n values, or
  // null) are each row's item window in the ragged fields. Ragged fields are planned here,
  // before the lock (see Note [Ragged gather] in gather.h). Returns the number of batches.
  std::int64_t submit_many(const std::int64_t* shard, const std::int64_t* row,
                           const std::int64_t* index, std::int64_t n, std::int64_t per,
                           const std::int64_t* start = nullptr, const std::int64_t* count = nullptr);
  // The same with batches of varying sizes: batch k is the next sizes[k] rows (each between 1
  // and batch_size; they add up to n), e.g. the pieces of packed sequences.
  std::int64_t submit_sized(const std::int64_t* shard, const std::int64_t* row, const std::int64_t* index,
                            std::int64_t n, const std::int64_t* sizes, std::int64_t batches,
                            const std::int64_t* start = nullptr, const std::int64_t* count = nullptr);

  enum class Status { Got, Timeout, Closed, Empty };
  // Wait up to timeout_ms for the next batch in sequence; on Got, fills `d`. A delivered
  // slot carries one holder reference that the caller must give back with release(slot)
  // (when d.err != None the slot, if any, is already handled and d.slot == -1).
  Status take(int timeout_ms, Delivery& d);
  void release(int slot);

  // External fill: reserve the next sequence number; wait_slot() waits for its slot (which
  // then carries one holder for the fill handle, given back with release()).
  std::shared_ptr<Request> begin_external();
  Status wait_slot(const std::shared_ptr<Request>& r, int timeout_ms);
  // Synchronously gather the sourced fields (and the index field) into the request's slot in
  // the calling thread. Returns ErrKind::None or an error kind with `msg` set.
  // ErrKind::Fault (a SIGBUS reading a shard) sets `path` to the shard's file, if known.
  ErrKind gather_external(const std::shared_ptr<Request>& r, const std::int64_t* shard,
                          const std::int64_t* row, const std::int64_t* index, std::int64_t n,
                          std::string& msg, std::string& path);
  // commit (err == None, rows > 0) or fail (err != None): publishes the request. Throws
  // std::logic_error if already published or the ring is closed.
  void publish_external(const std::shared_ptr<Request>& r, std::int64_t rows, ErrKind err,
                        const std::string& msg);
  // Called when the fill handle dies: fails the request if it was never published, then
  // drops the handle's holder on the slot.
  void drop_external(const std::shared_ptr<Request>& r);

  // Install (ptr != null) or drop (ptr == null) one shard's sources, one Source per field
  // (entries of unsourced fields are ignored; rows must equal the shard's rows) and one
  // RaggedSource per ragged field (offsets null: drop; may be empty when the ring has no
  // ragged field). Waits until no gather or ragged planning is running, so nothing reads the
  // old pointers afterwards; batches planned or gathered later from a dropped shard fail with
  // ErrKind::Value naming it. Returns the swap's sequence number (increasing: the binding
  // keeps the buffers of the latest swap of a shard). See Note [Shard sources].
  std::uint64_t set_source(std::int64_t shard, const std::vector<Source>& per_field,
                           const std::vector<RaggedSource>& per_ragged = {});

  void close();
  // True in a process forked from the one that made this ring (see Note [Ring design]).
  bool orphaned() const;

  // Introspection.
  const Layout& layout() const { return layout_; }
  std::int64_t batch_size() const { return batch_size_; }
  int threads() const { return nthreads_; }
  int max_slots() const { return max_slots_; }
  std::size_t slot_bytes() const { return slot_bytes_; }
  int num_slots();
  std::uint8_t* slot_memory(int slot);  // stable for the Ring's life
  bool closed();
  std::int64_t pending();  // requests created and not yet taken
  struct Stats {
    int slots, free, filling, ready, in_use;
    std::int64_t submitted, delivered, grown, copies, pending;
    std::int64_t gather_ns;  // time spent gathering rows, summed over all threads
  };
  Stats stats();

 private:
  struct Slot {
    std::uint8_t* mem = nullptr;
    enum class State { Free, Filling, Ready, InUse } state = State::Free;
    int holders = 0;
  };
  struct Job {
    Request* req;
    std::uint8_t* base;
    std::int64_t begin, end;
  };

  void worker();
  void run_front_job(std::unique_lock<std::mutex>& lk);
  void assign_locked();
  void finish_part_locked(Request& r, ErrKind err, std::string&& msg, std::string&& path);
  void release_locked(int slot);
  void publish_ready_locked(Request& r);
  // take(), in three steps: wait for the head request (helping with queued parts), hand it
  // out (deciding view / grow / copy), and allocate a grown slot outside the lock.
  Status wait_head_locked(std::unique_lock<std::mutex>& lk, int timeout_ms);
  bool hand_out_locked(Delivery& d);  // true: a slot must be grown
  void grow_slot(Delivery& d);
  std::uint8_t* alloc_slot_memory();  // no lock held
  // A submit's ragged planning reads sources without the lock: it starts when no set_source()
  // is swapping (waits for !paused_) and counts in planning_ until end_planning_locked().
  void begin_planning();
  void end_planning_locked();
  // Plan a request's ragged fields (and give a batch too large for its slot region memory of
  // its own). No lock held. Returns ErrKind::None or the error with `msg` set.
  ErrKind plan_locked_free(Request& r, const std::int64_t* start, const std::int64_t* count,
                           std::string& msg) const;  // Fault: r.path is set
  // The gather kernel on rows begin..end-1 of a request, timed into gather_ns_; the message
  // of an error is prefixed with the batch's sequence number.
  // The reads of the sources run guarded (Note [Mapped reads and SIGBUS] in fault.h): a
  // SIGBUS fails the part with ErrKind::Fault, `msg` naming the shard and `path` its file.
  ErrKind gather(const Request& r, const std::int64_t* shard, const std::int64_t* row,
                 const std::int64_t* index, std::int64_t begin, std::int64_t end,
                 std::uint8_t* base, std::string& msg, std::string& path) const;
  // gather()'s reads of the sources (gather_rows, gather_ragged): run inside its guard.
  ErrKind gather_guarded(const Request& r, const std::int64_t* shard, const std::int64_t* row,
                         const std::int64_t* index, std::int64_t begin, std::int64_t end,
                         std::uint8_t* base, std::uint8_t* const* dst, std::string& msg) const;
  // A SIGBUS at `addr` while reading rows begin..end-1 of a request: the message naming the
  // shard (found from the address among the sources; else the shards those rows read).
  std::string fault_message(const void* addr, const std::int64_t* shard, std::int64_t begin,
                            std::int64_t end, std::string& path) const;

  // Immutable after construction.
  Layout layout_;
  const std::int64_t batch_size_;
  std::size_t slot_bytes_ = 0;
  std::size_t gathered_row_bytes_ = 0;  // bytes per row the producers copy (parts are cut by it)
  bool any_gathered_ = false;           // some field is sourced or the index field
  int nthreads_;
  int nice_ = 0;
  int max_slots_;
  std::size_t min_part_bytes_;

  // Guarded by mu_.
  std::mutex mu_;
  std::condition_variable cv_work_;  // producers: jobs_ or stop_
  std::condition_variable cv_cons_;  // consumer / external fill: request state changes
  std::condition_variable cv_idle_;  // close(): sync gathers finished
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<int> free_;             // stack of FREE slot ids
  std::deque<std::shared_ptr<Request>> reqs_;  // reqs_[0] has seq head_seq_
  std::int64_t head_seq_ = 0;         // next sequence number to deliver
  std::int64_t next_seq_ = 0;         // next sequence number to create
  std::int64_t next_assign_ = 0;      // first request without a slot decision
  std::deque<Job> jobs_;
  int waiters_ = 0;                   // threads waiting on cv_cons_
  int idle_workers_ = 0;              // producers waiting on cv_work_
  int growing_ = 0;                   // slots being allocated
  int in_use_ = 0;                    // slots in state InUse
  int sync_gathers_ = 0;              // gather_external calls in flight
  int running_ = 0;                   // producer / consumer gather parts in flight
  int planning_ = 0;                  // submits planning ragged fields (reading offsets) now
  std::uint64_t swaps_ = 0;           // set_source() calls done (their sequence numbers)
  bool paused_ = false;               // set_source(): no new gather starts
  bool stop_ = false;
  std::int64_t delivered_ = 0, grown_ = 0, copies_ = 0;
  mutable std::atomic<std::int64_t> gather_ns_{0};  // no lock: updated after each gather part

  std::vector<std::thread> workers_;
  std::mutex join_mu_;  // serializes close()
  const pid_t owner_pid_;  // the process whose threads these are
  void check_owner() const;  // throws std::logic_error in a forked child
};

}  // namespace fastload
