// fastload._C.map_file: a shard file memory-mapped read-only, with no file descriptor kept.
//
// Why not pyarrow.memory_map / mmap.mmap: both keep one open file descriptor per mapping, so
// a dataset with more shards than `ulimit -n` (1,024 is a common soft limit) failed with "Too
// many open files". A mapping needs no descriptor once made: this one is closed right after
// mmap(2), and the mapping (and the file's inode, even if the file is deleted or replaced
// later) lives until the last Python object viewing it dies. Mappings are bounded by
// vm.max_map_count (65,530 by default), not by the open-file limit.
//
// Only regular files are mapped: the file is opened with O_NONBLOCK (so a FIFO in place of a
// shard does not block the open), fstat(2)ed through the descriptor (no race with a rename),
// and refused, naming what it is, unless it is a regular file of the expected size.
//
// hash_xxh3_128() hashes the mapped bytes (the very bytes a reader will deliver) with the GIL
// released, so several shards hash in parallel on several cores and a training thread is
// never blocked by hashing. The checksum is the same as the python `xxhash` package's
// `xxh3_128(...).hexdigest()` (csrc/third_party/xxhash.h is xxHash 0.8.3, BSD-2-Clause).
//
// Every mapping is registered (fault.h) so a SIGBUS on one of its pages (the file truncated
// while mapped, an I/O error) names the file, whoever read it; hashing reads it guarded and
// raises fastload.errors.ShardReadError instead of dying (raise_shard_read_error below).
#include <pybind11/pybind11.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#define XXH_INLINE_ALL
#include "third_party/xxhash.h"

#include "fault.h"

namespace py = pybind11;

namespace {

std::string kind_of(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO (named pipe)";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}

// "xxh3_128:<32 hex digits>", the form fastload's manifest records.
std::string checksum_text(XXH128_hash_t h) {
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, h);
  static const char* hex = "0123456789abcdef";
  std::string out = "xxh3_128:";
  for (unsigned char b : c.digest) {
    out.push_back(hex[b >> 4]);
    out.push_back(hex[b & 15]);
  }
  return out;
}

[[noreturn]] void raise_os(int err, const std::string& path, const std::string& what) {
  // OSError(errno, message, filename): Python maps errno to FileNotFoundError etc.
  py::object exc = py::module_::import("builtins").attr("OSError")(err, what, path);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw py::error_already_set();
}

class MappedFile {
 public:
  MappedFile(const std::string& path, std::int64_t expected_size, std::int64_t max_size)
      : path_(path) {
    int fd;
    {
      py::gil_scoped_release nogil;
      fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    }
    if (fd < 0) raise_os(errno, path, std::strerror(errno));
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      raise_os(err, path, std::strerror(err));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      throw py::value_error(path + " is " + kind_of(st.st_mode) +
                            ", not a regular file; fastload reads only regular files");
    }
    size_ = static_cast<std::int64_t>(st.st_size);
    if (expected_size >= 0 && size_ != expected_size) {
      ::close(fd);
      throw py::value_error(path + " holds " + std::to_string(size_) + " bytes, expected " +
                            std::to_string(expected_size));
    }
    if (max_size >= 0 && size_ > max_size) {
      ::close(fd);
      throw py::value_error(path + " holds " + std::to_string(size_) +
                            " bytes, more than the limit of " + std::to_string(max_size));
    }
    dev_ = static_cast<std::uint64_t>(st.st_dev);
    ino_ = static_cast<std::uint64_t>(st.st_ino);
    mtime_ns_ = static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000LL + st.st_mtim.tv_nsec;
    ctime_ns_ = static_cast<std::int64_t>(st.st_ctim.tv_sec) * 1000000000LL + st.st_ctim.tv_nsec;
    if (size_ > 0) {
      void* p = ::mmap(nullptr, static_cast<std::size_t>(size_), PROT_READ, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED) {
        const int err = errno;
        ::close(fd);
        raise_os(err, path, std::string("cannot be memory-mapped: ") + std::strerror(err));
      }
      data_ = static_cast<const std::uint8_t*>(p);
      try {
        fastload::register_mapping(data_, static_cast<std::size_t>(size_), path_);
      } catch (...) {  // out of memory: the mapping works, a fault in it just names no file
      }
    }
    ::close(fd);  // the mapping keeps the file (its inode) alive, not the descriptor
  }
  ~MappedFile() {
    if (data_ == nullptr) return;
    fastload::unregister_mapping(data_);
    ::munmap(const_cast<std::uint8_t*>(data_), static_cast<std::size_t>(size_));
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  // "xxh3_128:<32 hex digits>" of the whole file, as fastload's manifest records it.
  // A SIGBUS while reading (truncated while mapped, an I/O error) raises ShardReadError.
  std::string hash_xxh3_128() const {
    XXH128_hash_t h{};
    const void* fault = nullptr;
    bool ok;
    {
      py::gil_scoped_release nogil;
      ok = fastload::run_guarded([&] {
        h = XXH3_128bits(data_ == nullptr ? "" : static_cast<const void*>(data_), static_cast<std::size_t>(size_));
      }, fault);
    }
    if (!ok) {
      std::string path;
      std::string msg = fastload::describe_fault(fault, "hashing the shard", path);
      if (path.empty()) msg = fastload::describe_fault(nullptr, "hashing the shard " + path_, path);
      fastload::raise_shard_read_error(msg, path_);
    }
    return checksum_text(h);
  }

  py::buffer_info buffer() const {
    static const std::uint8_t empty = 0;
    const void* p = data_ != nullptr ? static_cast<const void*>(data_) : &empty;
    return py::buffer_info(const_cast<void*>(p), 1, py::format_descriptor<std::uint8_t>::format(), 1,
                           {static_cast<py::ssize_t>(size_)}, {static_cast<py::ssize_t>(1)},
                           /*readonly=*/true);
  }

  const std::string& path() const { return path_; }
  std::int64_t size() const { return size_; }
  std::uint64_t dev() const { return dev_; }
  std::uint64_t ino() const { return ino_; }
  std::int64_t mtime_ns() const { return mtime_ns_; }
  std::int64_t ctime_ns() const { return ctime_ns_; }

 private:
  std::string path_;
  const std::uint8_t* data_ = nullptr;
  std::int64_t size_ = 0;
  std::uint64_t dev_ = 0, ino_ = 0;
  std::int64_t mtime_ns_ = 0, ctime_ns_ = 0;
};

}  // namespace

namespace fastload {

void raise_shard_read_error(const std::string& msg, const std::string& path) {
  py::object cls;
  try {
    cls = py::module_::import("fastload.errors").attr("ShardReadError");
  } catch (py::error_already_set&) {  // fastload.errors unusable: the built-in base
    cls = py::module_::import("builtins").attr("OSError");
  }
  py::object exc = cls(msg);
  exc.attr("errno") = EIO;
  exc.attr("path") = path.empty() ? py::object(py::none()) : py::object(py::str(path));
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw py::error_already_set();
}

void register_files(py::module_& m) {
  py::class_<MappedFile>(m, "MappedFile", py::buffer_protocol(),
                         "A regular file memory-mapped read-only (no file descriptor kept); "
                         "a read-only buffer of its bytes.")
      .def_buffer(&MappedFile::buffer)
      .def("hash_xxh3_128", &MappedFile::hash_xxh3_128,
           "'xxh3_128:<hex>' of the mapped bytes (GIL released).")
      .def_property_readonly("path", &MappedFile::path)
      .def_property_readonly("size", &MappedFile::size)
      .def_property_readonly("st_dev", &MappedFile::dev)
      .def_property_readonly("st_ino", &MappedFile::ino)
      .def_property_readonly("st_mtime_ns", &MappedFile::mtime_ns)
      .def_property_readonly("st_ctime_ns", &MappedFile::ctime_ns)
      .def("__len__", &MappedFile::size);
  m.def(
      "map_file",
      [](const std::string& path, std::int64_t expected_size, std::int64_t max_size) {
        return new MappedFile(path, expected_size, max_size);
      },
      py::arg("path"), py::arg("expected_size") = -1, py::arg("max_size") = -1,
      py::return_value_policy::take_ownership,
      "Map a regular file read-only without keeping a descriptor. OSError if it cannot be "
      "opened; ValueError naming the file if it is not a regular file or its size is not "
      "expected_size (>= 0) or exceeds max_size (>= 0).");
  m.def(
      "xxh3_128",
      [](py::buffer b) {
        py::buffer_info info = b.request();
        py::ssize_t expect = info.itemsize;
        for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
          if (info.shape[d] > 1 && info.strides[d] != expect)
            throw py::value_error("xxh3_128: the buffer must be C-contiguous");
          expect *= info.shape[d];
        }
        XXH128_hash_t h{};
        const void* fault = nullptr;
        bool ok;
        {
          py::gil_scoped_release nogil;
          ok = fastload::run_guarded(
              [&] { h = XXH3_128bits(info.ptr, static_cast<std::size_t>(info.size * info.itemsize)); }, fault);
        }
        if (!ok) {
          std::string path;
          const std::string msg = fastload::describe_fault(fault, "hashing a mapped buffer", path);
          raise_shard_read_error(msg, path);
        }
        return checksum_text(h);
      },
      py::arg("data"), "'xxh3_128:<hex>' of a contiguous buffer (GIL released).");
}

}  // namespace fastload
