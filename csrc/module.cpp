// fastload._C: the Python binding of the ring (see Note [Ring design] in ring.h) and of the
// gather kernel, which tests and benchmarks call on their own.
//
// Python objects cross this boundary only as buffers (py::buffer / py::array): the source
// shards come in through the buffer protocol, batches go out as numpy arrays whose `base`
// is a SlotLease (or FillHandle) object; numpy (and torch.from_numpy on top) keep that object
// alive, and when it dies the slot's holder reference is given back to the ring. The one
// other Python object held here is a failed external fill's exception, kept by batch until
// get() raises it (FillErrors below; GIL held, visible to the garbage collector).
//
// Validation: the user's arguments are checked once, in Python (fastload/ringspec.py, fastload/ring.py), with messages
// naming the field and shard. This file only asserts what would otherwise corrupt memory
// (buffer sizes, contiguity) and translates the ring's typed errors to Python exceptions in
// one place (raise_err).
//
// GIL rules: the GIL is released only around pure C++ work that may block or take long (the
// consumer's wait, a synchronous gather, close()); never in a constructor or destructor (see
// pybind11 issue #2177). Waits run in short slices; between slices, with the GIL held,
// PyErr_CheckSignals() turns Ctrl-C into KeyboardInterrupt. Lock order: a thread may take the
// ring mutex while holding the GIL, but never waits for the GIL while holding the mutex
// (ring code never calls into Python), so the two cannot deadlock.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fault.h"
#include "gather.h"
#include "ring.h"

namespace py = pybind11;

namespace fastload {
void register_files(py::module_& m);  // files.cpp: map_file, MappedFile, xxh3_128
void register_feistel(py::module_& m);  // feistel.cpp: the sampler's keyed bijection per element
}  // namespace fastload

using fastload::Delivery;
using fastload::ErrKind;
using fastload::Layout;
using fastload::RaggedPlan;
using fastload::RaggedSource;
using fastload::RaggedSpec;
using fastload::Request;
using fastload::Ring;
using fastload::Source;

namespace {

constexpr int kSliceMs = 50;  // wait slice between Ctrl-C checks

// The exceptions external fills failed with, by batch seq: FillHandle::fail() puts one in,
// BoundRing::get() takes it out and raises it for that very batch (its own type, message and
// traceback). Only touched with the GIL held; owned by the BoundRing (visible to Python's
// garbage collector through its tp_traverse), the fill handles hold a weak_ptr.
using FillErrors = std::unordered_map<std::int64_t, py::object>;

// Removes and returns the exception kept for batch `seq` (a null object if none): the map
// is consistent before the caller drops the reference (which may run arbitrary Python).
py::object take_fill_error(FillErrors* errors, std::int64_t seq) {
  if (errors == nullptr) return py::object();
  auto it = errors->find(seq);
  if (it == errors->end()) return py::object();
  py::object exc = std::move(it->second);
  errors->erase(it);
  return exc;
}

// The one translation of the ring's error kinds into Python exceptions. A batch whose
// external fill failed raises the fill's exception (`errors`, when given and still holding
// it), else a RuntimeError with the message. A read of a shard that raised SIGBUS
// (ErrKind::Fault, see fault.h) raises fastload.errors.ShardReadError with the shard's `path`.
[[noreturn]] void raise_err(ErrKind k, const std::string& msg, std::int64_t seq, FillErrors* errors = nullptr,
                            const std::string& path = std::string()) {
  switch (k) {
    case ErrKind::Index: throw py::index_error(msg);
    case ErrKind::Value: throw py::value_error(msg);
    case ErrKind::Fault: fastload::raise_shard_read_error(msg, path);
    case ErrKind::External: {
      py::object exc = take_fill_error(errors, seq);
      if (!exc) throw std::runtime_error(msg);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
      throw py::error_already_set();
    }
    default: throw std::runtime_error(msg);
  }
}

using IndexArray = py::array_t<std::int64_t, py::array::c_style>;

// Asserts: 1-D int64 arrays of equal length (ring.py made them so).
std::int64_t index_length(const IndexArray& shard, const IndexArray& row, const py::object& index) {
  if (shard.ndim() != 1 || row.ndim() != 1 || shard.shape(0) != row.shape(0))
    throw py::value_error("shard and row must be 1-D int64 arrays of the same length");
  if (!index.is_none()) {
    auto ix = index.cast<IndexArray>();
    if (ix.ndim() != 1 || ix.shape(0) != shard.shape(0))
      throw py::value_error("index must be a 1-D int64 array as long as shard and row");
  }
  return shard.shape(0);
}

const std::int64_t* index_data(const py::object& index, IndexArray& keep) {
  if (index.is_none()) return nullptr;
  keep = index.cast<IndexArray>();
  return keep.data();
}

// One field's numpy description: dtype and per-row shape (per item for a ragged field).
struct FieldDesc {
  std::string name;
  py::dtype dtype;
  std::vector<py::ssize_t> shape;
  std::size_t row_bytes;
  int ragged = -1;  // index into Layout::ragged, or -1
};


// A shard source taken through the buffer protocol, checked against the field's row size.
// An int instead of a buffer is a shard that is not loaded yet: just its row count.
Source load_source(const FieldDesc& fd, py::handle h,
                   std::vector<std::unique_ptr<py::buffer_info>>& keep) {
  if (py::isinstance<py::int_>(h)) {
    Source unloaded;
    unloaded.rows = h.cast<std::int64_t>();
    keep.push_back(nullptr);
    return unloaded;
  }
  auto info = std::make_unique<py::buffer_info>(py::reinterpret_borrow<py::buffer>(h).request());
  std::size_t bytes = static_cast<std::size_t>(info->itemsize);
  for (py::ssize_t d = 1; d < info->ndim; ++d) bytes *= static_cast<std::size_t>(info->shape[d]);
  py::ssize_t expect = info->itemsize;
  bool contiguous = true;
  for (py::ssize_t d = info->ndim - 1; d >= 0; --d) {
    if (info->shape[d] > 1 && info->strides[d] != expect) contiguous = false;
    expect *= info->shape[d];
  }
  if (info->ndim < 1 || bytes != fd.row_bytes || !contiguous)
    throw py::value_error("field '" + fd.name + "': a source is not a C-contiguous (rows, *shape) "
                          "array of the field's row size");
  Source src;
  src.ptr = static_cast<const std::uint8_t*>(info->ptr);
  src.rows = static_cast<std::int64_t>(info->shape[0]);
  keep.push_back(std::move(info));
  return src;
}

std::vector<py::ssize_t> shape_with(std::int64_t rows, const FieldDesc& fd) {
  std::vector<py::ssize_t> shape;
  shape.reserve(fd.shape.size() + 1);
  shape.push_back(static_cast<py::ssize_t>(rows));
  shape.insert(shape.end(), fd.shape.begin(), fd.shape.end());
  return shape;
}

const std::int64_t* optional_index(const py::object& a, std::int64_t n, IndexArray& keep, const char* what) {
  if (a.is_none()) return nullptr;
  keep = a.cast<IndexArray>();
  if (keep.ndim() != 1 || keep.shape(0) != n)
    throw py::value_error(std::string(what) + " must be a 1-D int64 array as long as shard and row");
  return keep.data();
}

// One shard of a ragged field: (values, offsets) through the buffer protocol, checked; an int
// instead is a shard that is not loaded yet (its row count). Pushes two entries to `keep`.
RaggedSource load_ragged_source(const FieldDesc& fd, py::handle pair,
                                std::vector<std::unique_ptr<py::buffer_info>>& keep) {
  if (py::isinstance<py::int_>(pair)) {
    RaggedSource unloaded;
    unloaded.rows = pair.cast<std::int64_t>();
    keep.push_back(nullptr);
    keep.push_back(nullptr);
    return unloaded;
  }
  if (!py::isinstance<py::tuple>(pair)) throw py::value_error("field '" + fd.name + "': a ragged source is (values, offsets)");
  py::tuple t = py::reinterpret_borrow<py::tuple>(pair);
  if (t.size() != 2) throw py::value_error("field '" + fd.name + "': a ragged source is (values, offsets)");
  FieldDesc items = fd;
  Source v = load_source(items, t[0], keep);
  auto info = std::make_unique<py::buffer_info>(py::reinterpret_borrow<py::buffer>(t[1]).request());
  if (info->ndim != 1 || info->itemsize != 8 || (info->shape[0] > 1 && info->strides[0] != 8) ||
      info->shape[0] < 1)
    throw py::value_error("field '" + fd.name + "': ragged offsets must be a contiguous 1-D int64 array");
  RaggedSource rs;
  rs.values = v.ptr;
  rs.items = v.rows;
  rs.offsets = static_cast<const std::int64_t*>(info->ptr);
  rs.rows = static_cast<std::int64_t>(info->shape[0]) - 1;
  keep.push_back(std::move(info));
  return rs;
}

// (padded, pad bytes, max_items, multiple, capacity[, positions]) -> a RaggedSpec without sources.
RaggedSpec ragged_spec(const FieldDesc& fd, const py::handle& desc) {
  py::tuple t = py::reinterpret_borrow<py::tuple>(desc);
  if (t.size() != 5 && t.size() != 6) throw py::value_error("field '" + fd.name + "': bad ragged description");
  RaggedSpec rs;
  rs.padded = t[0].cast<bool>();
  std::string pad = t[1].cast<std::string>();
  rs.pad.assign(pad.begin(), pad.end());
  rs.max_items = t[2].cast<std::int64_t>();
  rs.multiple = t[3].cast<std::int64_t>();
  rs.capacity = t[4].cast<std::int64_t>();
  rs.positions = t.size() == 6 && t[5].cast<bool>();
  rs.item_bytes = fd.row_bytes;
  if (rs.positions && rs.padded) throw py::value_error("field '" + fd.name + "': positions are for packed fields");
  if (!rs.pad.empty() && rs.pad.size() != static_cast<std::size_t>(fd.dtype.itemsize()))
    throw py::value_error("field '" + fd.name + "': the pad value must be one element of the field's dtype");
  if (rs.capacity < 0 || rs.multiple < 1) throw py::value_error("field '" + fd.name + "': bad ragged capacity");
  return rs;
}

// A ragged field's items of one delivered batch: (rows, width, *item) padded, else (total, *item).
std::vector<py::ssize_t> ragged_shape(const FieldDesc& fd, const RaggedSpec& rs, const RaggedPlan& plan,
                                      std::int64_t rows) {
  std::vector<py::ssize_t> shape;
  if (rs.padded) {
    shape.push_back(static_cast<py::ssize_t>(rows));
    shape.push_back(static_cast<py::ssize_t>(plan.width));
  } else {
    shape.push_back(static_cast<py::ssize_t>(plan.total()));
  }
  shape.insert(shape.end(), fd.shape.begin(), fd.shape.end());
  return shape;
}

// Memory a batch owns outside the ring (a ragged batch too large for its slot region).
py::capsule owning_capsule(std::uint8_t* p) {
  return py::capsule(p, [](void* q) { std::free(q); });
}

// One batch handed to the user: holds one holder reference on its slot.
class SlotLease {
 public:
  SlotLease(std::shared_ptr<Ring> ring, int slot, std::int64_t seq)
      : ring_(std::move(ring)), slot_(slot), seq_(seq) {}
  ~SlotLease() { ring_->release(slot_); }  // no Python, no GIL juggling
  SlotLease(const SlotLease&) = delete;
  SlotLease& operator=(const SlotLease&) = delete;
  int slot() const { return slot_; }
  std::int64_t seq() const { return seq_; }

 private:
  std::shared_ptr<Ring> ring_;
  int slot_;
  std::int64_t seq_;
};

// A slot taken with acquire() for an external fill. Holds one holder reference on the slot
// for as long as it (or any array viewing the slot through it) is alive.
class FillHandle {
 public:
  FillHandle(std::shared_ptr<Ring> ring, std::shared_ptr<Request> req, std::weak_ptr<FillErrors> errors)
      : ring_(std::move(ring)), req_(std::move(req)), errors_(std::move(errors)) {}
  ~FillHandle() { ring_->drop_external(req_); }
  FillHandle(const FillHandle&) = delete;
  FillHandle& operator=(const FillHandle&) = delete;

  void gather(const IndexArray& shard, const IndexArray& row, const py::object& index) {
    const std::int64_t n = index_length(shard, row, index);
    IndexArray keep;
    const std::int64_t* ix = index_data(index, keep);
    std::string msg, path;
    ErrKind e;
    {
      py::gil_scoped_release nogil;
      e = ring_->gather_external(req_, shard.data(), row.data(), ix, n, msg, path);
    }
    if (e != ErrKind::None) raise_err(e, msg, req_->seq, nullptr, path);
  }
  void commit(std::int64_t rows) { ring_->publish_external(req_, rows, ErrKind::None, ""); }
  // An exception object is kept (GIL held) and raised as is by get() for this batch; any
  // other object becomes the message of a RuntimeError.
  void fail(const py::object& error) {
    if (!PyExceptionInstance_Check(error.ptr())) {
      const std::string msg = py::str(error);
      ring_->publish_external(req_, 0, ErrKind::Runtime, msg.empty() ? "external fill failed" : msg);
      return;
    }
    const std::string msg = py::str(py::type::handle_of(error).attr("__name__")).cast<std::string>() + ": " +
                            py::str(error).cast<std::string>();
    std::shared_ptr<FillErrors> errors = errors_.lock();  // gone with the BoundRing: no consumer left
    if (errors) (*errors)[req_->seq] = error;  // before publishing: get() may deliver it at once
    try {
      ring_->publish_external(req_, 0, ErrKind::External, msg);
    } catch (...) {
      if (errors) take_fill_error(errors.get(), req_->seq);
      throw;
    }
  }
  std::int64_t seq() const { return req_->seq; }
  int slot() const { return req_->slot; }
  const std::shared_ptr<Request>& request() const { return req_; }

 private:
  std::shared_ptr<Ring> ring_;
  std::shared_ptr<Request> req_;
  std::weak_ptr<FillErrors> errors_;
};

// fastload._C.Ring: the ring plus what Python needs around it (field dtypes and shapes for
// the arrays it hands out, and the exported source buffers it keeps alive).
class BoundRing {
 public:
  BoundRing(const std::vector<std::string>& names, const std::vector<py::dtype>& dtypes,
            const std::vector<std::vector<py::ssize_t>>& shapes, std::int64_t batch_size,
            const py::list& sources, int index_field, int threads, int slots, int max_slots,
            std::int64_t min_part_bytes, const py::list& ragged, int nice) {
    const std::size_t nf = names.size();
    if (dtypes.size() != nf || shapes.size() != nf || py::len(sources) != nf || py::len(ragged) != nf)
      throw py::value_error("names, dtypes, shapes, sources and ragged must have one entry per field");
    Layout layout;
    layout.index_field = index_field;
    for (std::size_t f = 0; f < nf; ++f) {
      FieldDesc fd{names[f], dtypes[f], shapes[f], static_cast<std::size_t>(dtypes[f].itemsize())};
      for (py::ssize_t d : fd.shape) fd.row_bytes *= static_cast<std::size_t>(d);
      layout.sources.emplace_back();
      bufs_.emplace_back();
      py::object fs = sources[f];
      py::object rdesc = ragged[f];
      if (!rdesc.is_none()) {  // items of row_bytes each; sources are (values, offsets) pairs
        RaggedSpec rs = ragged_spec(fd, rdesc);
        ragged_bufs_.emplace_back();
        if (!fs.is_none())
          for (py::handle h : fs) {
            ragged_bufs_.back().emplace_back();
            rs.sources.push_back(load_ragged_source(fd, h, ragged_bufs_.back().back()));
          }
        fd.ragged = static_cast<int>(layout.ragged.size());
        layout.ragged.push_back(std::move(rs));
        layout.row_bytes.push_back(0);
      } else {
        layout.row_bytes.push_back(fd.row_bytes);
        if (!fs.is_none())
          for (py::handle h : fs) layout.sources.back().push_back(load_source(fd, h, bufs_.back()));
      }
      layout.ragged_of.push_back(fd.ragged);
      fields_.push_back(std::move(fd));
    }
    // Starts C++ threads; does not touch Python (GIL stays held, see the file comment).
    ring_ = std::make_shared<Ring>(std::move(layout), batch_size, threads, slots, max_slots,
                                   static_cast<std::size_t>(min_part_bytes), nice);
    // each shard's first global index (rows per shard are fixed for the ring's life)
    const std::vector<std::int64_t>& rows = ring_->layout().shard_rows;
    starts_.assign(rows.size() + 1, 0);
    for (std::size_t sh = 0; sh < rows.size(); ++sh) starts_[sh + 1] = starts_[sh] + rows[sh];
  }

  // Install (arrays, one per field: a (values, offsets) pair for a ragged field; None for
  // fields without sources) or drop (every entry None) one shard's sources. The ring waits
  // until no gather or ragged planning runs (GIL released meanwhile); the buffers it no longer
  // reads are released afterwards, with the GIL held. Concurrent calls for one shard keep the
  // buffers of the swap the ring applied last.
  void set_source(std::int64_t shard, const py::list& per_field) {
    const std::size_t nf = fields_.size();
    if (py::len(per_field) != nf) throw py::value_error("set_source: one entry per field");  // guards per_field[f]
    const Layout& L = ring_->layout();
    if (shard < 0 || shard >= L.num_shards())  // before bufs_ is indexed
      throw py::index_error("set_source: shard " + std::to_string(shard) + " is out of range (" +
                            std::to_string(L.num_shards()) + " shards)");
    const std::size_t sh = static_cast<std::size_t>(shard);
    std::vector<Source> srcs(nf);
    std::vector<std::unique_ptr<py::buffer_info>> fresh(nf);
    std::vector<RaggedSource> rsrcs(L.ragged.size());
    std::vector<std::vector<std::unique_ptr<py::buffer_info>>> rfresh(L.ragged.size());
    for (std::size_t f = 0; f < nf; ++f) {
      py::handle h = per_field[f];
      const int g = fields_[f].ragged;
      if (g >= 0) {
        if (h.is_none()) {
          rfresh[g].resize(2);
          continue;
        }
        if (py::isinstance<py::int_>(h)) throw py::value_error("set_source: field '" + fields_[f].name +
                                                               "' needs (values, offsets) or None");
        rsrcs[g] = load_ragged_source(fields_[f], h, rfresh[g]);
        continue;
      }
      if (h.is_none() || !L.sourced(f)) continue;
      std::vector<std::unique_ptr<py::buffer_info>> one;
      srcs[f] = load_source(fields_[f], h, one);
      fresh[f] = std::move(one.back());
    }
    std::uint64_t seq;
    {
      py::gil_scoped_release nogil;
      seq = ring_->set_source(shard, srcs, rsrcs);
    }
    if (swap_seq_.size() != static_cast<std::size_t>(L.num_shards())) swap_seq_.assign(L.num_shards(), 0);
    if (seq < swap_seq_[sh]) return;  // a later swap of this shard is in place: ours are released here
    swap_seq_[sh] = seq;
    for (std::size_t f = 0; f < nf; ++f) {
      if (!L.sourced(f)) continue;
      bufs_[f][sh] = std::move(fresh[f]);  // the old one is released
    }
    for (std::size_t g = 0; g < rfresh.size(); ++g)
      if (sh < ragged_bufs_[g].size()) ragged_bufs_[g][sh] = std::move(rfresh[g]);
  }

  // Joins the producers with the GIL held: they never take the GIL, so this cannot deadlock;
  // the source buffers are released afterwards (GIL held, as PyBuffer_Release requires).
  //
  // In a process forked while the ring ran, the ring is orphaned (see ring.h): it must never
  // be destroyed there (its condition variables may count waiters that do not exist in this
  // process, and destroying them would wait for those forever), so this handle keeps it
  // alive for good.
  ~BoundRing() {
    if (!ring_) return;
    if (ring_->orphaned()) {
      new std::shared_ptr<Ring>(ring_);  // deliberately leaked: see above
      return;
    }
    ring_->close();
  }

  std::int64_t submit_many(const IndexArray& shard, const IndexArray& row, const py::object& index,
                           std::int64_t per, const py::object& start, const py::object& count) {
    const std::int64_t n = index_length(shard, row, index);
    IndexArray keep, keep_start, keep_count;
    const std::int64_t* ix = index_data(index, keep);
    const std::int64_t* st = optional_index(start, n, keep_start, "start");
    const std::int64_t* ct = optional_index(count, n, keep_count, "count");
    py::gil_scoped_release nogil;  // ragged planning reads offsets: pure C++, arrays kept alive
    return ring_->submit_many(shard.data(), row.data(), ix, n, per, st, ct);
  }

  // Global sample indices (numbered across the shards in order) as consecutive batches of
  // `per` rows, located here as Dataset.locate does (the last shard whose first index is <=
  // the index), with the GIL released: no (shard, row) arrays are made in Python. The index
  // field, if any, receives the indices. One out of range raises IndexError naming it, and
  // nothing is submitted.
  std::int64_t submit_indices(const IndexArray& index, std::int64_t per) {
    if (index.ndim() != 1) throw py::value_error("index must be a 1-D int64 array");
    const Layout& L = ring_->layout();
    if (L.shard_rows.empty()) throw py::value_error("submit_indices() needs a ring with sourced fields");
    const std::int64_t n = index.shape(0);
    const std::int64_t* ix = index.data();
    std::vector<std::int64_t> shard(static_cast<std::size_t>(n)), row(static_cast<std::size_t>(n));
    const std::vector<std::int64_t>& starts = starts_;
    const std::int64_t total = starts.back();
    std::int64_t bad = -1;
    {
      py::gil_scoped_release nogil;
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t v = ix[i];
        if (v < 0 || v >= total) {
          bad = i;
          break;
        }
        const std::size_t s = starts.size() == 2
                                  ? 0
                                  : static_cast<std::size_t>(std::upper_bound(starts.begin(), starts.end(), v) -
                                                             starts.begin() - 1);
        shard[static_cast<std::size_t>(i)] = static_cast<std::int64_t>(s);
        row[static_cast<std::size_t>(i)] = v - starts[s];
      }
      if (bad < 0)
        return ring_->submit_many(shard.data(), row.data(), L.index_field >= 0 ? ix : nullptr, n, per, nullptr,
                                  nullptr);
    }
    throw py::index_error("sample index " + std::to_string(ix[bad]) + " is out of range (the ring's shards hold " +
                          std::to_string(total) + " rows)");
  }

  std::int64_t submit_sizes(const IndexArray& shard, const IndexArray& row, const py::object& index,
                            const IndexArray& sizes, const py::object& start, const py::object& count) {
    const std::int64_t n = index_length(shard, row, index);
    IndexArray keep, keep_start, keep_count;
    const std::int64_t* ix = index_data(index, keep);
    const std::int64_t* st = optional_index(start, n, keep_start, "start");
    const std::int64_t* ct = optional_index(count, n, keep_count, "count");
    if (sizes.ndim() != 1) throw py::value_error("sizes must be a 1-D int64 array");
    py::gil_scoped_release nogil;
    return ring_->submit_sized(shard.data(), row.data(), ix, n, sizes.data(), sizes.shape(0), st, ct);
  }

  // -> (rows, arrays, slot, copied); arrays[f] has shape (rows, *shape_f). With
  // timeout_ms >= 0, None when no batch became ready within that time. With drop_failed, a
  // batch that failed is dropped (its error too) and False returned instead of raising.
  py::object get(std::int64_t timeout_ms, bool drop_failed) {
    Delivery d;
    Ring::Status st;
    std::int64_t waited = 0;
    for (;;) {
      const int slice = timeout_ms < 0 ? kSliceMs
                                       : static_cast<int>(std::min<std::int64_t>(kSliceMs, std::max<std::int64_t>(timeout_ms - waited, 0)));
      {
        py::gil_scoped_release nogil;
        st = ring_->take(slice, d);
      }
      if (st != Ring::Status::Timeout) break;
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
      waited += slice;
      if (timeout_ms >= 0 && waited >= timeout_ms) return py::none();
    }
    if (st == Ring::Status::Closed) throw std::runtime_error("get() on a closed ring");
    if (st == Ring::Status::Empty)
      throw std::runtime_error("get(): no batch is pending; submit() or acquire() one first");
    if (d.err != ErrKind::None) {
      if (!drop_failed) raise_err(d.err, d.msg, d.seq, fill_errors_.get(), d.path);
      take_fill_error(fill_errors_.get(), d.seq);  // dropped
      return py::bool_(false);
    }

    // From here the slot carries our holder; the lease gives it back on every path.
    auto lease = std::make_unique<SlotLease>(ring_, d.slot, d.seq);
    const Layout& L = ring_->layout();
    py::tuple arrays(fields_.size());
    py::object owner = py::none();
    if (!d.copy) owner = py::cast(std::move(lease));
    for (std::size_t f = 0; f < fields_.size(); ++f) {
      const FieldDesc& fd = fields_[f];
      if (fd.ragged >= 0) {
        arrays[f] = ragged_arrays(fd, L, d, owner);
        continue;
      }
      if (d.copy) {
        py::array a(fd.dtype, shape_with(d.rows, fd));
        std::memcpy(a.mutable_data(), d.mem + L.offsets[f], static_cast<std::size_t>(d.rows) * L.row_bytes[f]);
        arrays[f] = std::move(a);
      } else {
        arrays[f] = py::array(fd.dtype, shape_with(d.rows, fd), {}, d.mem + L.offsets[f], owner);
      }
    }
    lease.reset();  // a copy: the slot is back to FREE now (a view: `owner` holds it)
    return py::make_tuple(d.rows, std::move(arrays), d.slot, d.copy);
  }

  // A ragged field of a delivered batch: (values, offsets), and positions (int64, one per
  // item) for a field with positions. Views of the slot (kept alive by `owner`), a copy when
  // the batch is delivered as one, or the batch's own memory.
  py::tuple ragged_arrays(const FieldDesc& fd, const Layout& L, Delivery& d, const py::object& owner) {
    const std::size_t f = static_cast<std::size_t>(&fd - fields_.data());
    const RaggedSpec& rs = L.ragged[static_cast<std::size_t>(fd.ragged)];
    if (static_cast<std::size_t>(fd.ragged) >= d.ragged.size()) {  // an external fill never gathered it
      RaggedPlan empty;
      empty.dst.assign(static_cast<std::size_t>(d.rows) + 1, 0);
      py::array off(py::dtype("int64"), std::vector<py::ssize_t>{static_cast<py::ssize_t>(d.rows + 1)});
      std::memset(off.mutable_data(), 0, static_cast<std::size_t>(d.rows + 1) * 8);
      if (rs.positions)
        return py::make_tuple(py::array(fd.dtype, ragged_shape(fd, rs, empty, d.rows)), off,
                              py::array(py::dtype("int64"), std::vector<py::ssize_t>{0}));
      return py::make_tuple(py::array(fd.dtype, ragged_shape(fd, rs, empty, d.rows)), off);
    }
    RaggedPlan& plan = d.ragged[static_cast<std::size_t>(fd.ragged)];
    const auto shape = ragged_shape(fd, rs, plan, d.rows);
    const std::uint8_t* off_mem = d.mem + L.offsets[f];
    py::array values, offsets, positions;
    const std::vector<py::ssize_t> npos{static_cast<py::ssize_t>(rs.positions ? plan.total() : 0)};
    if (plan.own != nullptr) {
      std::uint8_t* mem = plan.own;
      plan.own = nullptr;  // the capsule frees it with the last array viewing it
      py::capsule cap = owning_capsule(mem);
      values = py::array(fd.dtype, shape, {}, mem, cap);
      if (rs.positions) positions = py::array(py::dtype("int64"), npos, {}, mem + plan.positions_at(), cap);
    } else if (d.copy) {
      values = py::array(fd.dtype, shape);
      std::memcpy(values.mutable_data(), d.mem + L.ragged_values[fd.ragged], plan.bytes);
      if (rs.positions) {
        positions = py::array(py::dtype("int64"), npos);
        std::memcpy(positions.mutable_data(), d.mem + L.ragged_positions[fd.ragged],
                    static_cast<std::size_t>(plan.total()) * 8);
      }
    } else {
      values = py::array(fd.dtype, shape, {}, d.mem + L.ragged_values[fd.ragged], owner);
      if (rs.positions) positions = py::array(py::dtype("int64"), npos, {}, d.mem + L.ragged_positions[fd.ragged], owner);
    }
    if (d.copy) {
      offsets = py::array(py::dtype("int64"), std::vector<py::ssize_t>{static_cast<py::ssize_t>(d.rows + 1)});
      std::memcpy(offsets.mutable_data(), off_mem, static_cast<std::size_t>(d.rows + 1) * 8);
    } else {
      offsets = py::array(py::dtype("int64"), std::vector<py::ssize_t>{static_cast<py::ssize_t>(d.rows + 1)}, {}, off_mem, owner);
    }
    if (rs.positions) return py::make_tuple(values, offsets, positions);
    return py::make_tuple(values, offsets);
  }

  // -> (handle, arrays); arrays[f] is a writable (batch_size, *shape_f) view of the slot
  // (None for a ragged field: the ring gathers those).
  py::tuple acquire() {
    auto handle = std::make_unique<FillHandle>(ring_, ring_->begin_external(), fill_errors_);
    std::shared_ptr<Request> req = handle->request();
    Ring::Status st;
    for (;;) {
      {
        py::gil_scoped_release nogil;
        st = ring_->wait_slot(req, kSliceMs);
      }
      if (st != Ring::Status::Timeout) break;
      // On KeyboardInterrupt `handle` dies here and fails its batch (no deadlock later).
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
    if (st == Ring::Status::Closed) throw std::runtime_error("acquire() on a closed ring");
    std::uint8_t* mem = ring_->slot_memory(req->slot);
    const Layout& L = ring_->layout();
    py::object owner = py::cast(std::move(handle));
    py::tuple arrays(fields_.size());
    for (std::size_t f = 0; f < fields_.size(); ++f)
      arrays[f] = fields_[f].ragged >= 0
                      ? py::object(py::none())
                      : py::object(py::array(fields_[f].dtype, shape_with(ring_->batch_size(), fields_[f]), {},
                                             mem + L.offsets[f], owner));
    return py::make_tuple(owner, std::move(arrays));
  }

  void close() {
    {
      py::gil_scoped_release nogil;  // a plain method, not a destructor: safe to release
      ring_->close();
    }
    clear_fill_errors();  // undelivered fill errors go with the ring (GIL held again)
  }

  // Python's garbage collector sees the fill errors held here (an exception's traceback
  // often reaches back to the Python ring that holds this object: a cycle it must break).
  int traverse(visitproc visit, void* arg) const {
    for (const auto& kv : *fill_errors_) Py_VISIT(kv.second.ptr());
    return 0;
  }
  void clear_fill_errors() {
    FillErrors gone;
    gone.swap(*fill_errors_);  // decref'd after the map is consistent again
  }

  // The whole slot as a uint8 array (for pinning); keeps the ring's memory alive.
  py::array slot_memory(int slot) {
    std::uint8_t* mem = ring_->slot_memory(slot);
    py::capsule keep(new std::shared_ptr<Ring>(ring_),
                     [](void* p) { delete static_cast<std::shared_ptr<Ring>*>(p); });
    return py::array(py::dtype("uint8"), {static_cast<py::ssize_t>(ring_->slot_bytes())}, {},
                     mem, keep);
  }

  py::dict stats() {
    Ring::Stats s = ring_->stats();
    py::dict d;
    d["slots"] = s.slots;
    d["free"] = s.free;
    d["filling"] = s.filling;
    d["ready"] = s.ready;
    d["in_use"] = s.in_use;
    d["submitted"] = s.submitted;
    d["delivered"] = s.delivered;
    d["grown"] = s.grown;
    d["copies"] = s.copies;
    d["pending"] = s.pending;
    d["gather_ns"] = s.gather_ns;
    d["max_slots"] = ring_->max_slots();
    d["slot_bytes"] = ring_->slot_bytes();
    d["threads"] = ring_->threads();
    return d;
  }

  Ring& ring() { return *ring_; }

 private:
  std::shared_ptr<FillErrors> fill_errors_ = std::make_shared<FillErrors>();
  std::vector<FieldDesc> fields_;
  // keep the sources exported: [field][shard] (null: not loaded)
  std::vector<std::vector<std::unique_ptr<py::buffer_info>>> bufs_;
  // ragged fields' (values, offsets): [ragged field][shard] -> two buffers (null: not loaded)
  std::vector<std::vector<std::vector<std::unique_ptr<py::buffer_info>>>> ragged_bufs_;
  std::vector<std::uint64_t> swap_seq_;  // per shard: the sequence number of the swap bufs_ hold
  std::vector<std::int64_t> starts_;     // per shard its first global index, then the total (submit_indices)
  std::shared_ptr<Ring> ring_;
};

// A SIGBUS interrupted a guarded read of `shard` (-1: unknown) of the kernels called alone.
[[noreturn]] void raise_fault(const void* addr, std::int64_t shard) {
  std::string path;
  const std::string msg =
      fastload::describe_fault(addr, shard >= 0 ? "shard " + std::to_string(shard) + " of the sources" : "a source", path);
  fastload::raise_shard_read_error(msg, path);
}

// The binary/string kernel: the bytes of rows `row` of one shard's binary column (Arrow int32
// `offsets`, rows + 1 of them, into `values`), read guarded (a SIGBUS raises ShardReadError
// naming the file) -> (one uint8 array of the rows' bytes back to back, int64 bounds: row i
// is bytes bounds[i]..bounds[i+1]-1). ValueError if offsets run outside `values`.
py::tuple gather_binary_py(py::buffer offsets, py::buffer values, const IndexArray& row) {
  py::buffer_info oi = offsets.request(), vi = values.request();
  if (oi.ndim != 1 || oi.itemsize != 4 || (oi.shape[0] > 1 && oi.strides[0] != 4) || oi.shape[0] < 1)
    throw py::value_error("gather_binary: offsets must be a contiguous 1-D int32 array");
  if (vi.ndim != 1 || vi.itemsize != 1 || (vi.shape[0] > 1 && vi.strides[0] != 1))
    throw py::value_error("gather_binary: values must be a contiguous 1-D uint8 array");
  if (row.ndim() != 1) throw py::value_error("gather_binary: row must be a 1-D int64 array");
  const std::int32_t* off = static_cast<const std::int32_t*>(oi.ptr);
  const std::uint8_t* val = static_cast<const std::uint8_t*>(vi.ptr);
  const std::int64_t rows = static_cast<std::int64_t>(oi.shape[0]) - 1, items = static_cast<std::int64_t>(vi.shape[0]);
  const std::int64_t n = row.shape(0);
  const std::int64_t* r = row.data();
  py::array_t<std::int64_t> bounds(n + 1);
  std::int64_t* b = bounds.mutable_data();
  std::string msg;
  const void* fault = nullptr;
  bool ok;
  {
    py::gil_scoped_release nogil;
    ok = fastload::run_guarded([&] {  // pass 1: the rows' extents (offsets read from the mapping)
      b[0] = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        if (r[i] < 0 || r[i] >= rows) {
          b[0] = -1 - i;  // reported below, outside the guard
          return;
        }
        const std::int64_t a = off[r[i]], z = off[r[i] + 1];
        if (a < 0 || z < a || z > items) {
          b[0] = -1 - i;
          return;
        }
        b[i + 1] = b[i] + (z - a);
      }
    }, fault);
  }
  if (!ok) raise_fault(fault, -1);
  if (b[0] < 0) {
    const std::int64_t i = -1 - b[0];
    if (r[i] < 0 || r[i] >= rows)
      throw py::index_error("gather_binary: row " + std::to_string(r[i]) + " is out of range (" + std::to_string(rows) + " rows)");
    throw py::value_error("gather_binary: the offsets of row " + std::to_string(r[i]) +
                          " run outside the column's bytes (a damaged shard? run `fastload verify`)");
  }
  py::array_t<std::uint8_t> blob(b[n]);
  std::uint8_t* out = blob.mutable_data();
  {
    py::gil_scoped_release nogil;
    ok = fastload::run_guarded([&] {  // pass 2: the bytes
      for (std::int64_t i = 0; i < n; ++i)
        if (b[i + 1] > b[i]) std::memcpy(out + b[i], val + off[r[i]], static_cast<std::size_t>(b[i + 1] - b[i]));
    }, fault);
  }
  if (!ok) raise_fault(fault, -1);
  return py::make_tuple(blob, bounds);
}

// The gather kernel alone: rows (shard[i], row[i]) of `sources[f]` (one array per shard, or
// None) into `out[f]` (a writable (n, *shape) array), index[i] into out[index_field].
void gather_rows_py(const py::list& out, const py::list& sources, const IndexArray& shard,
                    const IndexArray& row, const py::object& index, int index_field) {
  const std::int64_t n = index_length(shard, row, index);
  const std::size_t nf = py::len(out);
  if (py::len(sources) != nf) throw py::value_error("out and sources need one entry per field");
  Layout L;
  L.index_field = index_field;
  std::vector<std::unique_ptr<py::buffer_info>> keep;
  std::vector<std::uint8_t*> dst(nf);
  for (std::size_t f = 0; f < nf; ++f) {
    py::buffer_info o = py::reinterpret_borrow<py::buffer>(out[f]).request(/*writable=*/true);
    if (o.ndim < 1 || o.shape[0] < n) throw py::value_error("out arrays need n rows");
    std::size_t rb = static_cast<std::size_t>(o.itemsize);
    for (py::ssize_t d = 1; d < o.ndim; ++d) rb *= static_cast<std::size_t>(o.shape[d]);
    if (o.size > 0 && static_cast<std::size_t>(o.strides[0]) != rb)
      throw py::value_error("out arrays must be C-contiguous");
    FieldDesc fd{"#" + std::to_string(f), py::dtype("uint8"), {}, rb};
    L.row_bytes.push_back(rb);
    L.offsets.push_back(0);
    L.sources.emplace_back();
    py::object fs = sources[f];
    if (!fs.is_none())
      for (py::handle h : fs) L.sources.back().push_back(load_source(fd, h, keep));
    dst[f] = static_cast<std::uint8_t*>(o.ptr);
  }
  for (std::size_t f = 0; f < nf; ++f) {
    if (!L.sourced(f)) continue;
    if (L.shard_rows.empty())
      for (const Source& s : L.sources[f]) L.shard_rows.push_back(s.rows);
  }
  IndexArray keep_ix;
  const std::int64_t* ix = index_data(index, keep_ix);
  std::string msg;
  ErrKind e = ErrKind::None;
  const void* fault = nullptr;
  bool ok;
  {
    py::gil_scoped_release nogil;  // the reads run guarded: a SIGBUS raises ShardReadError
    ok = fastload::run_guarded([&] { e = fastload::gather_rows(L, shard.data(), row.data(), ix, 0, n, dst.data(), msg); },
                               fault);
  }
  if (!ok) raise_fault(fault, fault != nullptr ? fastload::shard_of_address(L, fault) : -1);
  if (e != ErrKind::None) raise_err(e, msg, -1);
}

// The ragged kernel alone: plan and gather rows (shard[i], row[i]) of one ragged field from
// its per-shard (values, offsets) into a new batch -> (values, offsets).
py::tuple gather_ragged_py(const py::list& sources, const IndexArray& shard, const IndexArray& row,
                           const py::object& start, const py::object& count, bool padded,
                           const std::string& pad, std::int64_t max_items, std::int64_t multiple,
                           const py::dtype& dtype, const std::vector<py::ssize_t>& item_shape) {
  const std::int64_t n = index_length(shard, row, py::none());
  FieldDesc fd{"ragged", dtype, item_shape, static_cast<std::size_t>(dtype.itemsize())};
  for (py::ssize_t d : item_shape) fd.row_bytes *= static_cast<std::size_t>(d);
  std::vector<std::unique_ptr<py::buffer_info>> keep;
  RaggedSpec rs = ragged_spec(fd, py::make_tuple(padded, py::bytes(pad), max_items, multiple, 0));
  for (py::handle h : sources) rs.sources.push_back(load_ragged_source(fd, h, keep));
  IndexArray ks, kc;
  const std::int64_t* st = optional_index(start, n, ks, "start");
  const std::int64_t* ct = optional_index(count, n, kc, "count");
  RaggedPlan plan;
  std::string msg;
  ErrKind e = ErrKind::None;
  const void* fault = nullptr;
  bool ok;
  Layout L;  // for naming a faulting shard
  {
    py::gil_scoped_release nogil;  // the reads run guarded: a SIGBUS raises ShardReadError
    ok = fastload::run_guarded([&] { e = fastload::plan_ragged(rs, shard.data(), row.data(), st, ct, n, plan, msg); },
                               fault);
  }
  if (!ok) {
    L.ragged.push_back(std::move(rs));
    raise_fault(fault, fault != nullptr ? fastload::shard_of_address(L, fault) : -1);
  }
  if (e != ErrKind::None) raise_err(e, msg, -1);
  py::array values(dtype, ragged_shape(fd, rs, plan, n));
  py::array offsets(py::dtype("int64"), std::vector<py::ssize_t>{static_cast<py::ssize_t>(n + 1)});
  {
    py::gil_scoped_release nogil;
    ok = fastload::run_guarded([&] {
      fastload::gather_ragged(rs, plan, shard.data(), n, 0, n, static_cast<std::uint8_t*>(values.mutable_data()),
                              static_cast<std::int64_t*>(offsets.mutable_data()));
    }, fault);
  }
  if (!ok) {
    L.ragged.push_back(std::move(rs));
    raise_fault(fault, fault != nullptr ? fastload::shard_of_address(L, fault) : -1);
  }
  return py::make_tuple(values, offsets);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastload C++ core: the ring buffer of aligned host slots with a gather thread pool";

  m.def("gather_rows", &gather_rows_py, py::arg("out"), py::arg("sources"), py::arg("shard"),
        py::arg("row"), py::arg("index") = py::none(), py::arg("index_field") = -1,
        "The gather kernel alone: rows (shard[i], row[i]) of each field's per-shard sources "
        "into out[f][i] (GIL released); IndexError names a bad sample.");

  m.def("gather_binary", &gather_binary_py, py::arg("offsets"), py::arg("values"), py::arg("row"),
        "The bytes of rows `row` of a binary column (int32 offsets into uint8 values), read with "
        "SIGBUS guarded (ShardReadError naming the file) -> (uint8 blob, int64 bounds[n+1]).");
  m.def("gather_ragged", &gather_ragged_py, py::arg("sources"), py::arg("shard"), py::arg("row"),
        py::arg("start") = py::none(), py::arg("count") = py::none(), py::arg("padded") = false,
        py::arg("pad") = std::string(), py::arg("max_items") = -1, py::arg("multiple") = 1,
        py::arg("dtype"), py::arg("item_shape") = std::vector<py::ssize_t>{},
        "The ragged kernel alone: rows (shard[i], row[i]) of one ragged field, from per-shard "
        "(values, offsets), packed (items, *item) or padded (rows, width, *item), with the "
        "batch's rebased offsets -> (values, offsets). GIL released.");

  py::class_<SlotLease>(m, "SlotLease",
                        "Owner of one delivered batch's slot; the slot is reused only after "
                        "this object (and so every array viewing it) is gone.")
      .def_property_readonly("slot", &SlotLease::slot)
      .def_property_readonly("seq", &SlotLease::seq);

  py::class_<FillHandle>(m, "FillHandle", "A slot taken with Ring.acquire() for an external fill.")
      .def("gather", &FillHandle::gather, py::arg("shard"), py::arg("row"),
           py::arg("index") = py::none(),
           "Gather the sourced fields (and the index field) for (shard, row) into this slot "
           "(GIL released).")
      .def("commit", &FillHandle::commit, py::arg("rows"),
           "Publish the slot as the next batch with `rows` valid rows.")
      .def("fail", &FillHandle::fail, py::arg("error"),
           "Publish an error for this batch instead: get() raises `error` itself if it is an "
           "exception, else RuntimeError(str(error)).")
      .def_property_readonly("seq", &FillHandle::seq)
      .def_property_readonly("slot", &FillHandle::slot);

  py::class_<BoundRing>(m, "Ring", py::custom_type_setup([](PyHeapTypeObject* heap_type) {
                          auto* type = &heap_type->ht_type;
                          type->tp_flags |= Py_TPFLAGS_HAVE_GC;
                          type->tp_traverse = [](PyObject* self, visitproc visit, void* arg) -> int {
                            Py_VISIT(Py_TYPE(self));
                            if (!py::detail::is_holder_constructed(self)) return 0;
                            return py::cast<BoundRing&>(py::handle(self)).traverse(visit, arg);
                          };
                          type->tp_clear = [](PyObject* self) -> int {
                            if (py::detail::is_holder_constructed(self))
                              py::cast<BoundRing&>(py::handle(self)).clear_fill_errors();
                            return 0;
                          };
                        }))
      .def(py::init<const std::vector<std::string>&, const std::vector<py::dtype>&,
                    const std::vector<std::vector<py::ssize_t>>&, std::int64_t,
                    const py::list&, int, int, int, int, std::int64_t, const py::list&, int>(),
           py::arg("names"), py::arg("dtypes"), py::arg("shapes"), py::arg("batch_size"),
           py::arg("sources"), py::arg("index_field"), py::arg("threads"), py::arg("slots"),
           py::arg("max_slots"), py::arg("min_part_bytes"), py::arg("ragged"), py::arg("nice") = 0)
      .def("submit_many", &BoundRing::submit_many, py::arg("shard"), py::arg("row"),
           py::arg("index"), py::arg("batch_size"), py::arg("start") = py::none(),
           py::arg("count") = py::none(),
           "Enqueue rows as consecutive batches of batch_size rows (the last may be shorter); "
           "returns the number of batches.")
      .def("submit_indices", &BoundRing::submit_indices, py::arg("index"), py::arg("batch_size"),
           "Enqueue global sample indices (numbered across the shards in order) as consecutive batches "
           "of batch_size rows, located in C++; returns the number of batches.")
      .def("submit_sizes", &BoundRing::submit_sizes, py::arg("shard"), py::arg("row"), py::arg("index"),
           py::arg("sizes"), py::arg("start") = py::none(), py::arg("count") = py::none(),
           "Enqueue rows as consecutive batches of sizes[k] rows; returns the number of batches.")
      .def("get", &BoundRing::get, py::arg("timeout_ms") = -1, py::arg("drop_failed") = false,
           "Wait (GIL released, Ctrl-C aware) for the next batch in order; returns "
           "(rows, arrays, slot, copied), or None if timeout_ms >= 0 passed first. A batch's "
           "error raises (a failed external fill: its own exception); with drop_failed, the "
           "failed batch is dropped and False returned.")
      .def("acquire", &BoundRing::acquire,
           "Reserve the next batch for an external fill; returns (FillHandle, arrays).")
      .def("set_source", &BoundRing::set_source, py::arg("shard"), py::arg("sources"),
           "Install (one array per field, a (values, offsets) pair per ragged field, None for "
           "unsourced fields) or drop (all None) one shard's sources while the ring runs; waits "
           "until no gather or ragged planning is running.")
      .def("close", &BoundRing::close, "Stop and join the producer threads. Idempotent.")
      .def("slot_memory", &BoundRing::slot_memory, py::arg("slot"))
      .def("stats", &BoundRing::stats)
      .def_property_readonly("pending", [](BoundRing& r) { return r.ring().pending(); })
      .def_property_readonly("closed", [](BoundRing& r) { return r.ring().closed(); })
      .def_property_readonly("num_slots", [](BoundRing& r) { return r.ring().num_slots(); })
      .def_property_readonly("max_slots", [](BoundRing& r) { return r.ring().max_slots(); })
      .def_property_readonly("threads", [](BoundRing& r) { return r.ring().threads(); })
      .def_property_readonly("batch_size", [](BoundRing& r) { return r.ring().batch_size(); })
      .def_property_readonly("slot_bytes", [](BoundRing& r) { return r.ring().slot_bytes(); })
      .def_property_readonly("orphaned", [](BoundRing& r) { return r.ring().orphaned(); },
                             "True in a process forked after the ring was made: it is inert there.");

  fastload::register_files(m);
  fastload::register_feistel(m);
}
