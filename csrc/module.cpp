// fastload._C: the Python binding of the ring (see Note [Ring design] in ring.h) and of the
// gather kernel and the permutation, which tests and the sampler call on their own.
//
// Python objects cross this boundary only as buffers (py::buffer / py::array): the source
// shards come in through the buffer protocol, batches go out as numpy arrays whose `base`
// is a SlotLease (or FillHandle) object; numpy (and torch.from_numpy on top) keep that object
// alive, and when it dies the slot's holder reference is given back to the ring.
//
// Validation: the user's arguments are checked once, in fastload/ring.py, with messages
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

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gather.h"
#include "permute.h"
#include "ring.h"

namespace py = pybind11;
using fastload::Delivery;
using fastload::ErrKind;
using fastload::Layout;
using fastload::Request;
using fastload::Ring;
using fastload::Source;

namespace {

constexpr int kSliceMs = 50;  // wait slice between Ctrl-C checks

// Raised by get() for a batch whose external fill failed: args (message, seq). The Python
// face raises the fill's own exception for that seq instead.
py::object g_fill_failed;

// The one translation of the ring's error kinds into Python exceptions.
[[noreturn]] void raise_err(ErrKind k, const std::string& msg, std::int64_t seq) {
  switch (k) {
    case ErrKind::Index: throw py::index_error(msg);
    case ErrKind::Value: throw py::value_error(msg);
    case ErrKind::External: {
      PyErr_SetObject(g_fill_failed.ptr(), py::make_tuple(msg, seq).ptr());
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

// One field's numpy description: dtype and per-row shape.
struct FieldDesc {
  std::string name;
  py::dtype dtype;
  std::vector<py::ssize_t> shape;
  std::size_t row_bytes;
};

// A shard source taken through the buffer protocol, checked against the field's row size.
Source load_source(const FieldDesc& fd, py::handle h,
                   std::vector<std::unique_ptr<py::buffer_info>>& keep) {
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
  FillHandle(std::shared_ptr<Ring> ring, std::shared_ptr<Request> req)
      : ring_(std::move(ring)), req_(std::move(req)) {}
  ~FillHandle() { ring_->drop_external(req_); }
  FillHandle(const FillHandle&) = delete;
  FillHandle& operator=(const FillHandle&) = delete;

  void gather(const IndexArray& shard, const IndexArray& row, const py::object& index) {
    const std::int64_t n = index_length(shard, row, index);
    IndexArray keep;
    const std::int64_t* ix = index_data(index, keep);
    std::string msg;
    ErrKind e;
    {
      py::gil_scoped_release nogil;
      e = ring_->gather_external(req_, shard.data(), row.data(), ix, n, msg);
    }
    if (e != ErrKind::None) raise_err(e, msg, req_->seq);
  }
  void commit(std::int64_t rows) { ring_->publish_external(req_, rows, ErrKind::None, ""); }
  // external: the Python face holds the exception to raise for this batch.
  void fail(const std::string& msg, bool external) {
    ring_->publish_external(req_, 0, external ? ErrKind::External : ErrKind::Runtime,
                            msg.empty() ? "external fill failed" : msg);
  }
  std::int64_t seq() const { return req_->seq; }
  int slot() const { return req_->slot; }
  const std::shared_ptr<Request>& request() const { return req_; }

 private:
  std::shared_ptr<Ring> ring_;
  std::shared_ptr<Request> req_;
};

// fastload._C.Ring: the ring plus what Python needs around it (field dtypes and shapes for
// the arrays it hands out, and the exported source buffers it keeps alive).
class BoundRing {
 public:
  BoundRing(const std::vector<std::string>& names, const std::vector<py::dtype>& dtypes,
            const std::vector<std::vector<py::ssize_t>>& shapes, std::int64_t batch_size,
            const py::list& sources, int index_field, int threads, int slots, int max_slots,
            std::int64_t min_part_bytes) {
    const std::size_t nf = names.size();
    if (dtypes.size() != nf || shapes.size() != nf || py::len(sources) != nf)
      throw py::value_error("names, dtypes, shapes and sources must have one entry per field");
    Layout layout;
    layout.index_field = index_field;
    for (std::size_t f = 0; f < nf; ++f) {
      FieldDesc fd{names[f], dtypes[f], shapes[f], static_cast<std::size_t>(dtypes[f].itemsize())};
      for (py::ssize_t d : fd.shape) fd.row_bytes *= static_cast<std::size_t>(d);
      layout.row_bytes.push_back(fd.row_bytes);
      layout.sources.emplace_back();
      py::object fs = sources[f];
      if (!fs.is_none())
        for (py::handle h : fs) layout.sources.back().push_back(load_source(fd, h, bufs_));
      fields_.push_back(std::move(fd));
    }
    // Starts C++ threads; does not touch Python (GIL stays held, see the file comment).
    ring_ = std::make_shared<Ring>(std::move(layout), batch_size, threads, slots, max_slots,
                                   static_cast<std::size_t>(min_part_bytes));
  }

  // Joins the producers with the GIL held: they never take the GIL, so this cannot deadlock;
  // the source buffers are released afterwards (GIL held, as PyBuffer_Release requires).
  ~BoundRing() {
    if (ring_) ring_->close();
  }

  std::int64_t submit_many(const IndexArray& shard, const IndexArray& row,
                           const py::object& index, std::int64_t per) {
    const std::int64_t n = index_length(shard, row, index);
    IndexArray keep;
    return ring_->submit_many(shard.data(), row.data(), index_data(index, keep), n, per);
  }

  // -> (rows, arrays, slot, copied); arrays[f] has shape (rows, *shape_f).
  py::tuple get() {
    Delivery d;
    Ring::Status st;
    for (;;) {
      {
        py::gil_scoped_release nogil;
        st = ring_->take(kSliceMs, d);
      }
      if (st != Ring::Status::Timeout) break;
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
    if (st == Ring::Status::Closed) throw std::runtime_error("get() on a closed ring");
    if (st == Ring::Status::Empty)
      throw std::runtime_error("get(): no batch is pending; submit() or acquire() one first");
    if (d.err != ErrKind::None) raise_err(d.err, d.msg, d.seq);

    // From here the slot carries our holder; the lease gives it back on every path.
    auto lease = std::make_unique<SlotLease>(ring_, d.slot, d.seq);
    const Layout& L = ring_->layout();
    py::tuple arrays(fields_.size());
    if (d.copy) {
      for (std::size_t f = 0; f < fields_.size(); ++f) {
        py::array a(fields_[f].dtype, shape_with(d.rows, fields_[f]));
        std::memcpy(a.mutable_data(), d.mem + L.offsets[f],
                    static_cast<std::size_t>(d.rows) * L.row_bytes[f]);
        arrays[f] = std::move(a);
      }
      lease.reset();  // slot back to FREE now
    } else {
      py::object owner = py::cast(std::move(lease));
      for (std::size_t f = 0; f < fields_.size(); ++f)
        arrays[f] = py::array(fields_[f].dtype, shape_with(d.rows, fields_[f]), {},
                              d.mem + L.offsets[f], owner);
    }
    return py::make_tuple(d.rows, std::move(arrays), d.slot, d.copy);
  }

  // -> (handle, arrays); arrays[f] is a writable (batch_size, *shape_f) view of the slot.
  py::tuple acquire() {
    auto handle = std::make_unique<FillHandle>(ring_, ring_->begin_external());
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
      arrays[f] = py::array(fields_[f].dtype, shape_with(ring_->batch_size(), fields_[f]), {},
                            mem + L.offsets[f], owner);
    return py::make_tuple(owner, std::move(arrays));
  }

  void close() {
    py::gil_scoped_release nogil;  // a plain method, not a destructor: safe to release
    ring_->close();
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
  std::vector<FieldDesc> fields_;
  std::vector<std::unique_ptr<py::buffer_info>> bufs_;  // keep the sources exported
  std::shared_ptr<Ring> ring_;
};

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
  ErrKind e;
  {
    py::gil_scoped_release nogil;
    e = fastload::gather_rows(L, shard.data(), row.data(), ix, 0, n, dst.data(), msg);
  }
  if (e != ErrKind::None) raise_err(e, msg, -1);
}

void permutation_into(py::buffer out, std::uint64_t key0, std::uint64_t key1) {
  py::buffer_info info = out.request(/*writable=*/true);
  if (info.ndim != 1 || (info.shape[0] > 1 && info.strides[0] != info.itemsize))
    throw py::value_error("permutation: out must be a contiguous 1-D array");
  const bool i32 = info.itemsize == 4 && (info.format == "i" || info.format == "l");
  const bool i64 = info.itemsize == 8 && (info.format == "l" || info.format == "q");
  if (!i32 && !i64) throw py::value_error("permutation: out must be int32 or int64, got format " + info.format);
  const std::int64_t n = static_cast<std::int64_t>(info.shape[0]);
  if (i32 && n > (std::int64_t{1} << 31))
    throw py::value_error("permutation: more than 2^31 positions need an int64 array");
  py::gil_scoped_release nogil;
  if (i32)
    fastload::permutation(static_cast<std::int32_t*>(info.ptr), n, key0, key1);
  else
    fastload::permutation(static_cast<std::int64_t*>(info.ptr), n, key0, key1);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastload C++ core: the ring buffer of aligned host slots with a gather thread pool";
  g_fill_failed = py::reinterpret_steal<py::object>(
      PyErr_NewException("fastload._C.FillFailed", PyExc_RuntimeError, nullptr));
  m.attr("FillFailed") = g_fill_failed;

  m.def("permutation", &permutation_into, py::arg("out"), py::arg("key0"), py::arg("key1"),
        "Fill the int32/int64 array `out` with a uniformly random permutation of "
        "0..len(out)-1 determined by the 128-bit key (xoshiro256** Fisher-Yates; GIL released).");
  m.def("gather_rows", &gather_rows_py, py::arg("out"), py::arg("sources"), py::arg("shard"),
        py::arg("row"), py::arg("index") = py::none(), py::arg("index_field") = -1,
        "The gather kernel alone: rows (shard[i], row[i]) of each field's per-shard sources "
        "into out[f][i] (GIL released); IndexError names a bad sample.");

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
      .def("fail", &FillHandle::fail, py::arg("message"), py::arg("external") = false,
           "Publish an error for this batch instead.")
      .def_property_readonly("seq", &FillHandle::seq)
      .def_property_readonly("slot", &FillHandle::slot);

  py::class_<BoundRing>(m, "Ring")
      .def(py::init<const std::vector<std::string>&, const std::vector<py::dtype>&,
                    const std::vector<std::vector<py::ssize_t>>&, std::int64_t,
                    const py::list&, int, int, int, int, std::int64_t>(),
           py::arg("names"), py::arg("dtypes"), py::arg("shapes"), py::arg("batch_size"),
           py::arg("sources"), py::arg("index_field"), py::arg("threads"), py::arg("slots"),
           py::arg("max_slots"), py::arg("min_part_bytes"))
      .def("submit_many", &BoundRing::submit_many, py::arg("shard"), py::arg("row"),
           py::arg("index"), py::arg("batch_size"),
           "Enqueue rows as consecutive batches of batch_size rows (the last may be shorter); "
           "returns the number of batches.")
      .def("get", &BoundRing::get,
           "Wait (GIL released, Ctrl-C aware) for the next batch in order; returns "
           "(rows, arrays, slot, copied).")
      .def("acquire", &BoundRing::acquire,
           "Reserve the next batch for an external fill; returns (FillHandle, arrays).")
      .def("close", &BoundRing::close, "Stop and join the producer threads. Idempotent.")
      .def("slot_memory", &BoundRing::slot_memory, py::arg("slot"))
      .def("stats", &BoundRing::stats)
      .def_property_readonly("pending", [](BoundRing& r) { return r.ring().pending(); })
      .def_property_readonly("closed", [](BoundRing& r) { return r.ring().closed(); })
      .def_property_readonly("num_slots", [](BoundRing& r) { return r.ring().num_slots(); })
      .def_property_readonly("max_slots", [](BoundRing& r) { return r.ring().max_slots(); })
      .def_property_readonly("threads", [](BoundRing& r) { return r.ring().threads(); })
      .def_property_readonly("batch_size", [](BoundRing& r) { return r.ring().batch_size(); })
      .def_property_readonly("slot_bytes", [](BoundRing& r) { return r.ring().slot_bytes(); });
}
