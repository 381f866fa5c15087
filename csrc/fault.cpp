// The SIGBUS recovery of mapped reads. See Note [Mapped reads and SIGBUS] in fault.h.
#include "fault.h"

#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>

namespace fastload {

namespace fault_detail {

constexpr int kGuardThreads = 256;  // threads inside guards at once (more copy unguarded)

struct Entry {
  std::atomic<unsigned long> owner{0};    // pthread_self() of the thread holding it; 0: free
  std::atomic<sigjmp_buf*> jmp{nullptr};  // armed recovery point; null: not in a guard
  std::atomic<const void*> addr{nullptr}; // the faulting address, written by the handler
};

namespace {

static_assert(sizeof(pthread_t) <= sizeof(unsigned long), "pthread_t must fit an unsigned long");

Entry g_table[kGuardThreads];
struct sigaction g_prev;  // the action before ours; written once, before ours is installed
std::atomic<bool> g_installed{false};
std::mutex g_install_mu;

unsigned long self_id() noexcept { return static_cast<unsigned long>(pthread_self()); }

// Give a fault outside any guard to whoever handled SIGBUS before us.
void chain(int sig, siginfo_t* info, void* uctx, bool from_fault) {
  const struct sigaction& p = g_prev;
  if (p.sa_flags & SA_SIGINFO) {
    if (p.sa_sigaction != nullptr) {
      p.sa_sigaction(sig, info, uctx);
      return;
    }
  } else if (p.sa_handler != SIG_DFL && p.sa_handler != SIG_IGN && p.sa_handler != nullptr) {
    p.sa_handler(sig);
    return;
  }
  if (!from_fault && p.sa_handler == SIG_IGN && !(p.sa_flags & SA_SIGINFO)) return;  // a sent signal, ignored as before
  // SIG_DFL (or an ignored hardware fault, which the kernel never lets pass): restore the
  // default action; a fault recurs when this handler returns, a sent signal is sent again.
  struct sigaction dfl;
  std::memset(&dfl, 0, sizeof dfl);
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(sig, &dfl, nullptr);
  if (!from_fault) raise(sig);
}

void on_sigbus(int sig, siginfo_t* info, void* uctx) {
  const int saved_errno = errno;
  // A fault of this thread's own read (si_code > 0), or the same fault re-raised by a handler
  // that was installed after ours and chains to it (Python's faulthandler raise()s it).
  const bool from_fault = info != nullptr && info->si_code > 0;
  const bool from_self = info != nullptr && info->si_code == SI_TKILL && info->si_pid == getpid();
  if (from_fault || from_self) {
    const unsigned long me = self_id();
    for (Entry& e : g_table) {
      if (e.owner.load(std::memory_order_relaxed) != me) continue;
      sigjmp_buf* jb = e.jmp.load(std::memory_order_relaxed);
      if (jb == nullptr) break;  // this thread is not in a guard
      e.addr.store(from_fault ? info->si_addr : nullptr, std::memory_order_relaxed);
      errno = saved_errno;
      siglongjmp(*jb, 1);
    }
  }
  errno = saved_errno;
  chain(sig, info, uctx, from_fault);
}

// In a forked child only the forking thread exists: the other entries are free again (a
// new thread may get the pthread_t of one that existed in the parent).
void after_fork_in_child() {
  const unsigned long me = self_id();
  for (Entry& e : g_table) {
    if (e.owner.load(std::memory_order_relaxed) == me) continue;
    e.jmp.store(nullptr, std::memory_order_relaxed);
    e.owner.store(0, std::memory_order_relaxed);
  }
}

void install() noexcept {
  try {
    std::lock_guard<std::mutex> lk(g_install_mu);
    if (g_installed.load(std::memory_order_relaxed)) return;
    struct sigaction sa, old;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sigemptyset(&sa.sa_mask);
    // SA_NODEFER: SIGBUS stays unblocked in the handler, so jumping out of it (sigsetjmp
    // without saving the mask, no system call per guard) leaves the thread's mask as it
    // was; SA_ONSTACK: on a thread with an alternate signal stack, use it.
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    if (sigaction(SIGBUS, nullptr, &g_prev) == 0 && sigaction(SIGBUS, &sa, &old) == 0) {
      g_prev = old;
      pthread_atfork(nullptr, nullptr, after_fork_in_child);
    }
    g_installed.store(true, std::memory_order_release);
  } catch (...) {
    // no handler: guarded copies run as unguarded ones
  }
}

// This thread's table entry, claimed on its first guard and freed when it exits.
struct Claim {
  Entry* e = nullptr;
  ~Claim() {
    if (e != nullptr) {
      e->jmp.store(nullptr, std::memory_order_relaxed);
      e->owner.store(0, std::memory_order_release);
    }
  }
};
thread_local Claim t_claim;

Entry* claim() noexcept {
  const unsigned long me = self_id();
  const std::size_t start = static_cast<std::size_t>((me >> 12) % kGuardThreads);
  for (std::size_t k = 0; k < kGuardThreads; ++k) {
    Entry& e = g_table[(start + k) % kGuardThreads];
    unsigned long expected = 0;
    if (e.owner.load(std::memory_order_relaxed) == 0 &&
        e.owner.compare_exchange_strong(expected, me, std::memory_order_acq_rel))
      return &e;
  }
  return nullptr;
}

}  // namespace

Entry* enter(sigjmp_buf* jb) noexcept {
  if (!g_installed.load(std::memory_order_acquire)) install();
  Claim& c = t_claim;
  if (c.e == nullptr) c.e = claim();
  Entry* e = c.e;
  if (e == nullptr || e->jmp.load(std::memory_order_relaxed) != nullptr) return nullptr;
  e->addr.store(nullptr, std::memory_order_relaxed);
  e->jmp.store(jb, std::memory_order_relaxed);
  std::atomic_signal_fence(std::memory_order_seq_cst);  // armed before the first read
  return e;
}

void leave(Entry* e) noexcept {
  if (e == nullptr) return;
  std::atomic_signal_fence(std::memory_order_seq_cst);  // after the last read
  e->jmp.store(nullptr, std::memory_order_relaxed);
}

const void* address(Entry* e) noexcept {
  return e == nullptr ? nullptr : e->addr.load(std::memory_order_relaxed);
}

}  // namespace fault_detail

namespace {

struct Mapping {
  std::size_t size;
  std::string path;
};
std::mutex g_maps_mu;
std::map<std::uintptr_t, Mapping>& maps() {
  static auto* m = new std::map<std::uintptr_t, Mapping>();  // never destroyed: mappings may outlive exit
  return *m;
}

}  // namespace

void register_mapping(const void* base, std::size_t size, const std::string& path) {
  if (base == nullptr || size == 0) return;
  std::lock_guard<std::mutex> lk(g_maps_mu);
  maps()[reinterpret_cast<std::uintptr_t>(base)] = Mapping{size, path};
}

void unregister_mapping(const void* base) {
  if (base == nullptr) return;
  std::lock_guard<std::mutex> lk(g_maps_mu);
  maps().erase(reinterpret_cast<std::uintptr_t>(base));
}

bool find_mapping(const void* addr, std::string& path, std::size_t& size, std::size_t& offset) {
  const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(addr);
  std::lock_guard<std::mutex> lk(g_maps_mu);
  auto& m = maps();
  auto it = m.upper_bound(a);
  if (it == m.begin()) return false;
  --it;
  if (a - it->first >= it->second.size) return false;
  path = it->second.path;
  size = it->second.size;
  offset = static_cast<std::size_t>(a - it->first);
  return true;
}

std::string describe_fault(const void* addr, const std::string& what, std::string& path) {
  std::size_t size = 0, offset = 0;
  path.clear();
  const bool known = addr != nullptr && find_mapping(addr, path, size, offset);
  std::string out = what;
  if (known) out += " (" + path + ")";
  out += ": reading ";
  out += known ? "byte " + std::to_string(offset) + " of its " + std::to_string(size) + "-byte memory mapping"
               : std::string("its memory mapping");
  out += " failed (SIGBUS): ";
  struct stat st;
  if (!known) {
    out += "the file was truncated while in use, or its storage failed (a bad sector, a network file "
           "system that went away)";
  } else if (::stat(path.c_str(), &st) != 0) {
    out += std::string("the file cannot be examined now (") + std::strerror(errno) +
           "); it was truncated or removed while in use, or its storage failed";
  } else if (static_cast<std::size_t>(st.st_size) < size) {
    out += "the file was truncated to " + std::to_string(st.st_size) + " bytes while it was in use (it had " +
           std::to_string(size) + ")";
  } else {
    out += "the storage reported an I/O error (the file still has all its bytes: a bad sector, or a "
           "network file system that went away)";
  }
  out += ". Re-download or re-convert the dataset (`fastload verify` names its damaged shards) and check the "
         "file system it is on";
  return out;
}

}  // namespace fastload
