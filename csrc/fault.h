// Reads of memory-mapped shards that survive SIGBUS.
//
// Note [Mapped reads and SIGBUS]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A shard is memory-mapped (files.cpp). When its file is truncated while mapped, or the
// storage fails under a mapped page (a bad sector, a soft-mounted network file system that
// went away), the read of that page raises SIGBUS, which by default kills the process. The
// C++ copies out of mappings (the ring's gather and ragged planning, the hashing of a shard,
// the consumer's guarded copies in module.cpp) run inside run_guarded(): a per-thread
// recovery point (sigsetjmp, once per gather part / hash / copy, never per row). The SIGBUS
// handler, installed once on first use with the previous action saved, jumps back to that
// point only when the signal hit a thread that is inside a guarded copy (a real fault, or
// the same signal re-raised by a handler installed after ours, e.g. Python's faulthandler);
// run_guarded() then returns false with the fault address, and the caller turns it into an
// error naming the shard (describe_fault()). Every other SIGBUS goes to the previous handler
// as before (a function is called; SIG_DFL is restored and the fault re-raised), so a fault
// outside a guard still kills the process, faulthandler's traceback included.
//
// Rules for code inside a guard: it reads mappings and writes plain memory only; it holds
// no lock, allocates nothing that a jump would leak and has no live object with a
// destructor at a read (a jump skips destructors). Locals of the caller written inside the
// guard are not to be trusted after a fault.
//
// The handler touches no thread_local (in a dlopen'ed module their first access may
// allocate): guarded threads claim an entry of a fixed global table, found by pthread_self().
// A thread that cannot get an entry (more than kGuardThreads at once) copies unguarded.
//
// Mappings made by files.cpp are registered (register_mapping) so a fault address names the
// file and the byte offset, whatever view of the mapping was being read.
#pragma once

#include <csetjmp>
#include <cstddef>
#include <cstdint>
#include <string>

namespace fastload {

namespace fault_detail {
struct Entry;
// Arm this thread's recovery point (installs the handler on first use). Null: not armed
// (nested inside another guard, which then catches the fault, or no table entry left).
Entry* enter(sigjmp_buf* jb) noexcept;
void leave(Entry* e) noexcept;
const void* address(Entry* e) noexcept;  // the faulting address (null when unknown)
}  // namespace fault_detail

// Run f(); false if a SIGBUS interrupted it (then `addr` is the faulting address, or null
// when the signal carried none). See the Note for what f may do.
template <class F>
bool run_guarded(F&& f, const void*& addr) {
  sigjmp_buf jb;
  fault_detail::Entry* volatile e = nullptr;
  if (sigsetjmp(jb, 0) != 0) {  // mask not saved: the handler runs with SA_NODEFER
    fault_detail::Entry* armed = e;
    addr = fault_detail::address(armed);
    fault_detail::leave(armed);
    return false;
  }
  e = fault_detail::enter(&jb);
  f();
  fault_detail::leave(e);
  return true;
}

// Memory-mapped files, so a fault address can name its file (files.cpp registers them).
void register_mapping(const void* base, std::size_t size, const std::string& path);
void unregister_mapping(const void* base);
// The registered mapping holding `addr`: its path, size and addr's offset in it.
bool find_mapping(const void* addr, std::string& path, std::size_t& size, std::size_t& offset);

// "<what> (<path>): reading byte N of its M-byte memory mapping failed (SIGBUS): <cause>. <fix>"
// where the cause says whether the file is now shorter than its mapping (truncated while in
// use) or not (an I/O error of the storage). `what` names the shard as the caller knows it
// (e.g. "shard 3"); `path` is set to the file's path if known.
std::string describe_fault(const void* addr, const std::string& what, std::string& path);

// Raise fastload.errors.ShardReadError(msg) (errno EIO, .path = path or None) as the pending
// Python exception and throw pybind11::error_already_set. GIL held. (files.cpp)
[[noreturn]] void raise_shard_read_error(const std::string& msg, const std::string& path);

}  // namespace fastload
