// fastload._C: the Python face of the ring engine (see Note [Ring design] in ring.h).
//
// Python objects cross this boundary only as buffers (py::buffer / py::array): the source
// shards come in through the buffer protocol, batches go out as numpy arrays whose `base`
// is a SlotLease (or FillHandle) object; numpy (and torch.from_numpy on top) keep that object
// alive, and when it dies the slot's holder reference is given back to the engine.
//
// GIL rules: the GIL is released only around pure C++ work that may block or take long (the
// consumer's wait, a synchronous gather, close()); never in a constructor or destructor (see
// pybind11 issue #2177). Waits run in short slices; between slices, with the GIL held,
// PyErr_CheckSignals() turns Ctrl-C into KeyboardInterrupt. Lock order: a thread may take the
// engine mutex while holding the GIL, but never waits for the GIL while holding the mutex
// (engine code never calls into Python), so the two cannot deadlock.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "permute.h"
#include "ring.h"

namespace py = pybind11;
using fastload::Delivery;
using fastload::Engine;
using fastload::ErrKind;
using fastload::Request;
using fastload::Source;

namespace {

constexpr int kSliceMs = 50;  // wait slice between Ctrl-C checks

[[noreturn]] void raise_err(ErrKind k, const std::string& msg) {
  switch (k) {
    case ErrKind::Index: throw py::index_error(msg);
    case ErrKind::Value: throw py::value_error(msg);
    default: throw std::runtime_error(msg);
  }
}

using IndexArray = py::array_t<std::int64_t, py::array::c_style>;

void check_index_pair(const IndexArray& shard, const IndexArray& row) {
  if (shard.ndim() != 1 || row.ndim() != 1)
    throw py::value_error("shard and row must be 1-D int64 arrays (got ndim " +
                          std::to_string(shard.ndim()) + " and " + std::to_string(row.ndim()) +
                          ")");
  if (shard.shape(0) != row.shape(0))
    throw py::value_error("shard and row must have the same length (got " +
                          std::to_string(shard.shape(0)) + " and " +
                          std::to_string(row.shape(0)) + ")");
}

// One batch handed to the user: holds one holder reference on its slot.
class SlotLease {
 public:
  SlotLease(std::shared_ptr<Engine> eng, int slot, std::int64_t seq)
      : eng_(std::move(eng)), slot_(slot), seq_(seq) {}
  ~SlotLease() { eng_->release(slot_); }  // no Python, no GIL juggling
  SlotLease(const SlotLease&) = delete;
  SlotLease& operator=(const SlotLease&) = delete;
  int slot() const { return slot_; }
  std::int64_t seq() const { return seq_; }

 private:
  std::shared_ptr<Engine> eng_;
  int slot_;
  std::int64_t seq_;
};

// A slot taken with acquire() for an external fill. Holds one holder reference on the slot
// for as long as it (or any array viewing the slot through it) is alive.
class FillHandle {
 public:
  FillHandle(std::shared_ptr<Engine> eng, std::shared_ptr<Request> req)
      : eng_(std::move(eng)), req_(std::move(req)) {}
  ~FillHandle() { eng_->drop_external(req_); }
  FillHandle(const FillHandle&) = delete;
  FillHandle& operator=(const FillHandle&) = delete;

  void gather(const IndexArray& shard, const IndexArray& row) {
    check_index_pair(shard, row);
    std::string msg;
    ErrKind e;
    {
      py::gil_scoped_release nogil;
      e = eng_->gather_external(req_, shard.data(), row.data(), shard.shape(0), msg);
    }
    if (e != ErrKind::None) raise_err(e, msg);
  }
  void commit(std::int64_t rows) { eng_->publish_external(req_, rows, ErrKind::None, ""); }
  void fail(const std::string& msg) {
    eng_->publish_external(req_, 0, ErrKind::Runtime, msg.empty() ? "external fill failed" : msg);
  }
  std::int64_t seq() const { return req_->seq; }
  int slot() const { return req_->slot; }
  const std::shared_ptr<Request>& request() const { return req_; }

 private:
  std::shared_ptr<Engine> eng_;
  std::shared_ptr<Request> req_;
};

class PyRing {
 public:
  PyRing(std::vector<std::string> names, std::vector<py::dtype> dtypes,
         std::vector<std::vector<py::ssize_t>> shapes, std::int64_t batch_size,
         const py::list& sources, int threads, int slots, int max_slots,
         std::int64_t min_part_bytes)
      : names_(std::move(names)), dtypes_(std::move(dtypes)), shapes_(std::move(shapes)) {
    const std::size_t nf = names_.size();
    if (dtypes_.size() != nf || shapes_.size() != nf || py::len(sources) != nf)
      throw py::value_error("names, dtypes, shapes and sources must have one entry per field");
    if (batch_size <= 0)
      throw py::value_error("batch_size=" + std::to_string(batch_size) + " must be > 0");
    if (min_part_bytes < 1)
      throw py::value_error("min_part_bytes=" + std::to_string(min_part_bytes) + " must be > 0");
    std::vector<std::size_t> row_bytes(nf);
    std::vector<std::vector<Source>> srcs(nf);
    for (std::size_t f = 0; f < nf; ++f) {
      std::size_t rb = static_cast<std::size_t>(dtypes_[f].itemsize());
      for (py::ssize_t d : shapes_[f]) {
        if (d < 0) throw py::value_error("field '" + names_[f] + "': negative dimension in shape");
        rb *= static_cast<std::size_t>(d);
      }
      row_bytes[f] = rb;
      py::object fs = sources[f];
      if (fs.is_none()) continue;
      std::size_t s = 0;
      for (py::handle h : fs) {
        srcs[f].push_back(load_source(f, s, h, rb));
        ++s;
      }
    }
    // Engine construction starts C++ threads; it does not touch Python (GIL stays held).
    eng_ = std::make_shared<Engine>(std::move(row_bytes), batch_size, std::move(srcs), threads,
                                    slots, max_slots, static_cast<std::size_t>(min_part_bytes));
  }

  // Joins the producers with the GIL held: they never take the GIL, so this cannot deadlock;
  // the source buffers are released afterwards (GIL held, as PyBuffer_Release requires).
  ~PyRing() {
    if (eng_) eng_->close();
  }

  std::int64_t submit(const IndexArray& shard, const IndexArray& row) {
    check_index_pair(shard, row);
    const std::int64_t n = shard.shape(0);
    for (std::size_t f = 0; f < names_.size(); ++f)
      if (!eng_->has_source(f))
        throw py::value_error("field '" + names_[f] +
                              "' has no sources, so submit() cannot gather it; fill it with "
                              "acquire() instead");
    std::vector<std::int64_t> s(shard.data(), shard.data() + n);
    std::vector<std::int64_t> r(row.data(), row.data() + n);
    return eng_->submit(std::move(s), std::move(r));
  }

  std::int64_t submit_many(const IndexArray& shard, const IndexArray& row, std::int64_t per) {
    check_index_pair(shard, row);
    for (std::size_t f = 0; f < names_.size(); ++f)
      if (!eng_->has_source(f))
        throw py::value_error("field '" + names_[f] +
                              "' has no sources, so submit_many() cannot gather it; fill it "
                              "with acquire() instead");
    return eng_->submit_many(shard.data(), row.data(), shard.shape(0), per);
  }

  // -> (rows, arrays, slot, copied); arrays[f] has shape (rows, *shape_f).
  py::tuple get() {
    Delivery d;
    Engine::Status st;
    for (;;) {
      {
        py::gil_scoped_release nogil;
        st = eng_->take(kSliceMs, d);
      }
      if (st != Engine::Status::Timeout) break;
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
    if (st == Engine::Status::Closed) throw std::runtime_error("get() on a closed ring");
    if (st == Engine::Status::Empty)
      throw std::runtime_error("get(): no batch is pending; submit() or acquire() one first");
    if (d.err != ErrKind::None) raise_err(d.err, d.msg);

    // From here the slot carries our holder; the lease gives it back on every path.
    auto lease = std::make_unique<SlotLease>(eng_, d.slot, d.seq);
    const std::size_t nf = names_.size();
    py::tuple arrays(nf);
    if (d.copy) {
      for (std::size_t f = 0; f < nf; ++f) {
        py::array a(dtypes_[f], shape_with(d.rows, f));
        std::memcpy(a.mutable_data(), d.mem + eng_->field_offset(f),
                    static_cast<std::size_t>(d.rows) * eng_->row_bytes(f));
        arrays[f] = std::move(a);
      }
      lease.reset();  // slot back to FREE now
    } else {
      py::object owner = py::cast(std::move(lease));
      for (std::size_t f = 0; f < nf; ++f)
        arrays[f] = py::array(dtypes_[f], shape_with(d.rows, f), {},
                              d.mem + eng_->field_offset(f), owner);
    }
    return py::make_tuple(d.rows, std::move(arrays), d.slot, d.copy);
  }

  // -> (handle, arrays); arrays[f] is a writable (batch_size, *shape_f) view of the slot.
  py::tuple acquire() {
    auto handle = std::make_unique<FillHandle>(eng_, eng_->begin_external());
    std::shared_ptr<Request> req = handle->request();
    Engine::Status st;
    for (;;) {
      {
        py::gil_scoped_release nogil;
        st = eng_->wait_slot(req, kSliceMs);
      }
      if (st != Engine::Status::Timeout) break;
      // On KeyboardInterrupt `handle` dies here and fails its batch (no deadlock later).
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
    if (st == Engine::Status::Closed) throw std::runtime_error("acquire() on a closed ring");
    std::uint8_t* mem = eng_->slot_memory(req->slot);
    py::object owner = py::cast(std::move(handle));
    const std::size_t nf = names_.size();
    py::tuple arrays(nf);
    for (std::size_t f = 0; f < nf; ++f)
      arrays[f] = py::array(dtypes_[f], shape_with(eng_->batch_size(), f), {},
                            mem + eng_->field_offset(f), owner);
    return py::make_tuple(owner, std::move(arrays));
  }

  void close() {
    py::gil_scoped_release nogil;  // a plain method, not a destructor: safe to release
    eng_->close();
  }

  // The whole slot as a uint8 array (for pinning); keeps the engine's memory alive.
  py::array slot_memory(int slot) {
    std::uint8_t* mem = eng_->slot_memory(slot);
    py::capsule keep(new std::shared_ptr<Engine>(eng_),
                     [](void* p) { delete static_cast<std::shared_ptr<Engine>*>(p); });
    return py::array(py::dtype("uint8"), {static_cast<py::ssize_t>(eng_->slot_bytes())}, {},
                     mem, keep);
  }

  py::dict stats() {
    Engine::Stats s = eng_->stats();
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
    d["max_slots"] = eng_->max_slots();
    d["slot_bytes"] = eng_->slot_bytes();
    d["threads"] = eng_->threads();
    return d;
  }

  Engine& engine() { return *eng_; }

 private:
  std::vector<py::ssize_t> shape_with(std::int64_t rows, std::size_t f) const {
    std::vector<py::ssize_t> shape;
    shape.reserve(shapes_[f].size() + 1);
    shape.push_back(static_cast<py::ssize_t>(rows));
    shape.insert(shape.end(), shapes_[f].begin(), shapes_[f].end());
    return shape;
  }

  Source load_source(std::size_t f, std::size_t s, py::handle h, std::size_t rb) {
    const std::string where = "field '" + names_[f] + "' shard " + std::to_string(s);
    if (!PyObject_CheckBuffer(h.ptr()))
      throw py::value_error(where + ": source is not a buffer (pass a numpy array)");
    auto info = std::make_unique<py::buffer_info>(py::reinterpret_borrow<py::buffer>(h).request());
    if (info->ndim < 1)
      throw py::value_error(where + ": source must have a leading row dimension");
    if (info->itemsize != dtypes_[f].itemsize())
      throw py::value_error(where + ": item size " + std::to_string(info->itemsize) +
                            " does not match the field dtype's " +
                            std::to_string(dtypes_[f].itemsize()));
    std::size_t bytes = static_cast<std::size_t>(info->itemsize);
    for (py::ssize_t d = 1; d < info->ndim; ++d) bytes *= static_cast<std::size_t>(info->shape[d]);
    if (bytes != rb)
      throw py::value_error(where + ": a row has " + std::to_string(bytes) +
                            " bytes, the field needs " + std::to_string(rb));
    // C-contiguous: strides must be the packed ones (dimensions of extent <= 1 are free).
    py::ssize_t expect = info->itemsize;
    for (py::ssize_t d = info->ndim - 1; d >= 0; --d) {
      if (info->shape[d] > 1 && info->strides[d] != expect)
        throw py::value_error(where + ": source must be C-contiguous (use np.ascontiguousarray)");
      expect *= info->shape[d];
    }
    Source src;
    src.ptr = static_cast<const std::uint8_t*>(info->ptr);
    src.rows = static_cast<std::int64_t>(info->shape[0]);
    bufs_.push_back(std::move(info));
    return src;
  }

  std::vector<std::string> names_;
  std::vector<py::dtype> dtypes_;
  std::vector<std::vector<py::ssize_t>> shapes_;
  std::vector<std::unique_ptr<py::buffer_info>> bufs_;  // keep the sources exported
  std::shared_ptr<Engine> eng_;
};

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
  m.doc() = "fastload C++ core: ring buffer of aligned host slots with a gather thread pool";
  m.def("permutation", &permutation_into, py::arg("out"), py::arg("key0"), py::arg("key1"),
        "Fill the int32/int64 array `out` with a uniformly random permutation of "
        "0..len(out)-1 determined by the 128-bit key (xoshiro256** Fisher-Yates; GIL released).");

  py::class_<SlotLease>(m, "SlotLease",
                        "Owner of one delivered batch's slot; the slot is reused only after "
                        "this object (and so every array viewing it) is gone.")
      .def_property_readonly("slot", &SlotLease::slot)
      .def_property_readonly("seq", &SlotLease::seq);

  py::class_<FillHandle>(m, "FillHandle",
                         "A slot taken with RingCore.acquire() for an external fill.")
      .def("gather", &FillHandle::gather, py::arg("shard"), py::arg("row"),
           "Gather the sourced fields for (shard, row) into this slot (GIL released).")
      .def("commit", &FillHandle::commit, py::arg("rows"),
           "Publish the slot as the next batch with `rows` valid rows.")
      .def("fail", &FillHandle::fail, py::arg("message"),
           "Publish an error for this batch instead; get() raises RuntimeError(message).")
      .def_property_readonly("seq", &FillHandle::seq)
      .def_property_readonly("slot", &FillHandle::slot);

  py::class_<PyRing>(m, "RingCore")
      .def(py::init<std::vector<std::string>, std::vector<py::dtype>,
                    std::vector<std::vector<py::ssize_t>>, std::int64_t, const py::list&, int,
                    int, int, std::int64_t>(),
           py::arg("names"), py::arg("dtypes"), py::arg("shapes"), py::arg("batch_size"),
           py::arg("sources"), py::arg("threads"), py::arg("slots"), py::arg("max_slots"),
           py::arg("min_part_bytes"))
      .def("submit", &PyRing::submit, py::arg("shard"), py::arg("row"),
           "Enqueue one batch request; returns its sequence number. Never blocks.")
      .def("submit_many", &PyRing::submit_many, py::arg("shard"), py::arg("row"),
           py::arg("batch_size"),
           "Enqueue rows as consecutive batches of batch_size rows (the last may be shorter); "
           "returns the number of batches.")
      .def("get", &PyRing::get,
           "Wait (GIL released, Ctrl-C aware) for the next batch in order; returns "
           "(rows, arrays, slot, copied).")
      .def("acquire", &PyRing::acquire,
           "Reserve the next batch for an external fill; returns (FillHandle, arrays).")
      .def("close", &PyRing::close, "Stop and join the producer threads. Idempotent.")
      .def("slot_memory", &PyRing::slot_memory, py::arg("slot"))
      .def("stats", &PyRing::stats)
      .def_property_readonly("pending", [](PyRing& r) { return r.engine().pending(); })
      .def_property_readonly("closed", [](PyRing& r) { return r.engine().closed(); })
      .def_property_readonly("num_slots", [](PyRing& r) { return r.engine().num_slots(); })
      .def_property_readonly("max_slots", [](PyRing& r) { return r.engine().max_slots(); })
      .def_property_readonly("threads", [](PyRing& r) { return r.engine().threads(); })
      .def_property_readonly("batch_size", [](PyRing& r) { return r.engine().batch_size(); })
      .def_property_readonly("slot_bytes", [](PyRing& r) { return r.engine().slot_bytes(); });
}
