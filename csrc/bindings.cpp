// The only file that knows pybind11: checks every call at the border, releases the GIL for waits.
//
// [Note: addresses at the border]
// Tensors cross into the engine as raw addresses (Python's `tensor.data_ptr()`) with an element count and
// a DType, not as torch tensors: the engine knows nothing of torch (csrc/ builds and is tested without it,
// and one .so serves every torch version, since it links no libtorch ABI). The Python face
// (lightning_haiscale.hfreduce) owns what an address cannot say: it checks contiguity, device and dtype,
// and keeps each tensor alive until the collective that reads or writes it has completed.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>

#include "communicator.h"

namespace py = pybind11;
using hfreduce::Collective;
using hfreduce::Communicator;
using hfreduce::Config;
using hfreduce::DType;
using hfreduce::ErrorKind;
using hfreduce::Fingerprint;
using hfreduce::SharedBuffer;
using hfreduce::Work;

namespace {
// One rank's region of a SharedBuffer, exposed through the buffer protocol; it owns the buffer, so a
// tensor made by torch.frombuffer keeps the shared memory mapped for as long as the tensor lives.
struct Region {
  std::shared_ptr<SharedBuffer> buffer;
  int rank;
};
}  // namespace

namespace {
const void* as_ptr(uintptr_t address, size_t count, const char* what) {
  if (count > 0 && address == 0) throw std::invalid_argument(std::string("hfreduce: null ") + what + " pointer");
  return reinterpret_cast<const void*>(address);
}

// What a collective returns to Python: a queued one its Work; a blocking one None once it succeeded, else
// its failed Work. No Python object is built on the synchronous hot path (see [Note: the synchronous fast
// path] in lightning_haiscale/hfreduce/communicator.py).
std::shared_ptr<Work> outcome(std::shared_ptr<Work> work, bool blocking) {
  return blocking && work->error_kind() == ErrorKind::kNone ? nullptr : work;
}

double checked_divisor(DType dtype, double divisor) {
  if (divisor != 1.0 && !hfreduce::is_floating(dtype)) {
    throw std::invalid_argument("hfreduce: op='avg' needs a floating-point dtype");
  }
  if (!(divisor > 0)) throw std::invalid_argument("hfreduce: divisor must be positive");
  return divisor;
}
}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "hfreduce-style shared-memory collective engine (no torch inside; see lightning_haiscale.hfreduce)";
  m.def("simd_level", &hfreduce::simd_level);
  m.def("simd_levels", &hfreduce::simd_levels, "The reduce kernel sets this CPU runs, lowest first.");
  m.def("set_simd_level", &hfreduce::set_simd_level, py::arg("name"),
        "Dispatches the reduce kernels to `name` (test hook; users set HFREDUCE_KERNELS).");
  m.attr("KERNELS_ENV") = hfreduce::kKernelsEnv;
  hfreduce::simd_level();  // a bad HFREDUCE_KERNELS fails the import with its message, not a collective
  m.attr("WORKER_THREAD_NAME") = hfreduce::kWorkerThreadName;
  py::register_exception<hfreduce::ShmFullError>(m, "ShmFullError", PyExc_MemoryError);

  py::enum_<DType>(m, "DType")  // members named as torch names its dtypes (torch.float32 -> FLOAT32)
      .value("FLOAT32", DType::kFloat32)
      .value("FLOAT64", DType::kFloat64)
      .value("FLOAT16", DType::kFloat16)
      .value("BFLOAT16", DType::kBFloat16)
      .value("INT32", DType::kInt32)
      .value("INT64", DType::kInt64);

  py::enum_<ErrorKind>(m, "ErrorKind")
      .value("NONE", ErrorKind::kNone)
      .value("TIMEOUT", ErrorKind::kTimeout)
      .value("PEER_DIED", ErrorKind::kPeerDied)
      .value("OTHER", ErrorKind::kOther)
      .value("MISMATCH", ErrorKind::kMismatch)
      .value("ABORTED", ErrorKind::kAborted);

  py::enum_<Collective>(m, "Collective")
      .value("ALL_REDUCE", Collective::kAllReduce)
      .value("ALL_REDUCE_BUFFER", Collective::kAllReduceBuffer)
      .value("REDUCE_SCATTER", Collective::kReduceScatter)
      .value("ALL_GATHER", Collective::kAllGather)
      .value("BROADCAST", Collective::kBroadcast)
      .value("BARRIER", Collective::kBarrier)
      .value("DISAGREED_ELSEWHERE", Collective::kDisagreedElsewhere);

  m.def(
      "reduce",
      [](DType dt, uintptr_t dst, const std::vector<uintptr_t>& srcs, size_t count, double divisor) {
        if (srcs.empty()) throw std::invalid_argument("hfreduce: reduce needs at least one source");
        std::vector<const void*> ptrs;
        for (uintptr_t s : srcs) ptrs.push_back(as_ptr(s, count, "source"));
        py::gil_scoped_release release;
        hfreduce::reduce(dt, const_cast<void*>(as_ptr(dst, count, "destination")), ptrs.data(),
                         static_cast<int>(ptrs.size()), count, checked_divisor(dt, divisor));
      },
      "Sums arrays element-wise into dst (test hook for the SIMD kernels).");
  m.def(
      "reduce",
      [](DType dt, const std::vector<uintptr_t>& dsts, const std::vector<uintptr_t>& srcs, size_t count,
         double divisor) {
        if (srcs.empty() || dsts.empty()) throw std::invalid_argument("hfreduce: reduce needs a source and a destination");
        std::vector<const void*> ins;
        std::vector<void*> outs;
        for (uintptr_t s : srcs) ins.push_back(as_ptr(s, count, "source"));
        for (uintptr_t d : dsts) outs.push_back(const_cast<void*>(as_ptr(d, count, "destination")));
        py::gil_scoped_release release;
        hfreduce::reduce(dt, outs.data(), static_cast<int>(outs.size()), ins.data(), static_cast<int>(ins.size()),
                         count, checked_divisor(dt, divisor));
      },
      "Sums arrays element-wise into every one of dsts in one pass (test hook for the SIMD kernels).");

  py::class_<Fingerprint>(m, "Fingerprint")
      .def(py::init([](Collective collective, DType dtype, size_t count, uint64_t arg, double divisor) {
             Fingerprint call;
             call.collective = collective;
             call.dtype = static_cast<uint8_t>(dtype);
             call.divisor = static_cast<float>(checked_divisor(dtype, divisor));
             call.count = count;
             call.arg = arg;
             return call;
           }),
           py::arg("collective"), py::arg("dtype"), py::arg("count"), py::arg("arg") = 0, py::arg("divisor") = 1.0)
      .def_readonly("collective", &Fingerprint::collective)
      .def_property_readonly("dtype", [](const Fingerprint& f) { return static_cast<DType>(f.dtype); })
      .def_readonly("count", &Fingerprint::count)
      .def_readonly("arg", &Fingerprint::arg)
      .def_readonly("divisor", &Fingerprint::divisor)
      .def("__eq__", &Fingerprint::operator==)
      .def("describe", &Fingerprint::describe);

  py::class_<Work, std::shared_ptr<Work>>(m, "Work")
      .def("wait", &Work::wait, py::arg("timeout_s") = -1.0, py::call_guard<py::gil_scoped_release>())
      .def("is_completed", &Work::is_completed)
      .def("failed", [](Work& w) { return w.error_kind() != ErrorKind::kNone; })  // cheaper than error_kind()
      .def("error_kind", &Work::error_kind)
      .def("error_message", &Work::error_message)
      .def("error_ranks", &Work::error_ranks);

  py::class_<SharedBuffer, std::shared_ptr<SharedBuffer>>(m, "SharedBuffer", py::buffer_protocol())
      .def(py::init<const std::string&, size_t, int, bool>(), py::arg("name"), py::arg("region_bytes"),
           py::arg("local_size"), py::arg("create"))
      .def("unlink", &SharedBuffer::unlink)
      .def_property_readonly("region_bytes", &SharedBuffer::region_bytes)
      .def("region", [](std::shared_ptr<SharedBuffer> b, int r) {
        if (r < 0 || r >= b->local_size()) throw std::invalid_argument("hfreduce: region rank out of range");
        return Region{std::move(b), r};
      });

  py::class_<Region>(m, "Region", py::buffer_protocol()).def_buffer([](Region& r) {
    return py::buffer_info(r.buffer->region(r.rank), 1, py::format_descriptor<uint8_t>::format(), 1,
                           {static_cast<py::ssize_t>(r.buffer->region_bytes())}, {1}, false);
  });

  py::class_<Communicator>(m, "Communicator")
      .def(py::init([](const std::string& name, int local_rank, int local_size, bool create, size_t slot_bytes,
                       double timeout_s, int spin_iters) {
             Config c;
             c.name = name;
             c.local_rank = local_rank;
             c.local_size = local_size;
             c.create = create;
             c.slot_bytes = slot_bytes;
             c.timeout_s = timeout_s;
             c.spin_iters = spin_iters;
             return new Communicator(c);
           }),
           py::arg("name"), py::arg("local_rank"), py::arg("local_size"), py::arg("create"),
           py::arg("slot_bytes"), py::arg("timeout_s"), py::arg("spin_iters"))
      .def_static("segment_bytes", &Communicator::segment_bytes)
      .def("wait_attached", &Communicator::wait_attached, py::call_guard<py::gil_scoped_release>())
      .def("stop", &Communicator::stop, py::call_guard<py::gil_scoped_release>())
      .def("abort", &Communicator::abort, py::arg("rank"), py::arg("reason"))
      .def("aborted",
           [](const Communicator& c) -> py::object {
             int32_t rank = -1;
             std::string reason;
             if (!c.aborted(&rank, &reason)) return py::none();
             return py::make_tuple(rank, reason);
           })
      .def("all_reduce",
           [](Communicator& c, uintptr_t src, uintptr_t dst, size_t count, DType dt, double divisor,
              bool blocking) {
             const double div = checked_divisor(dt, divisor);
             py::gil_scoped_release release;
             auto work = c.all_reduce(as_ptr(src, count, "input"), const_cast<void*>(as_ptr(dst, count, "output")),
                                      count, dt, div, blocking);
             return outcome(std::move(work), blocking);
           },
           py::arg("src"), py::arg("dst"), py::arg("count"), py::arg("dtype"), py::arg("divisor"),
           py::arg("blocking") = false)
      .def("all_reduce_buffer",
           [](Communicator& c, std::shared_ptr<SharedBuffer> buffer, size_t offset, size_t count, DType dt,
              double divisor, bool blocking) {
             const double div = checked_divisor(dt, divisor);
             py::gil_scoped_release release;
             return outcome(c.all_reduce_buffer(std::move(buffer), offset, count, dt, div, blocking), blocking);
           },
           py::arg("buffer"), py::arg("offset"), py::arg("count"), py::arg("dtype"), py::arg("divisor"),
           py::arg("blocking") = false)
      .def("reduce_scatter",
           [](Communicator& c, uintptr_t src, uintptr_t dst, size_t count_per_rank, DType dt, double divisor,
              bool blocking) {
             const double div = checked_divisor(dt, divisor);
             py::gil_scoped_release release;
             auto work = c.reduce_scatter(as_ptr(src, count_per_rank, "input"),
                                          const_cast<void*>(as_ptr(dst, count_per_rank, "output")), count_per_rank, dt,
                                          div, blocking);
             return outcome(std::move(work), blocking);
           },
           py::arg("src"), py::arg("dst"), py::arg("count_per_rank"), py::arg("dtype"), py::arg("divisor"),
           py::arg("blocking") = false)
      .def("all_gather",
           [](Communicator& c, uintptr_t src, uintptr_t dst, size_t count_per_rank, DType dt, bool blocking) {
             py::gil_scoped_release release;
             auto work = c.all_gather(as_ptr(src, count_per_rank, "input"),
                                      const_cast<void*>(as_ptr(dst, count_per_rank, "output")), count_per_rank, dt,
                                      blocking);
             return outcome(std::move(work), blocking);
           },
           py::arg("src"), py::arg("dst"), py::arg("count_per_rank"), py::arg("dtype"), py::arg("blocking") = false)
      .def("broadcast",
           [](Communicator& c, uintptr_t buffer, size_t count, DType dt, int root, bool blocking) {
             py::gil_scoped_release release;
             auto work = c.broadcast(const_cast<void*>(as_ptr(buffer, count, "tensor")), count, dt, root, blocking);
             return outcome(std::move(work), blocking);
           },
           py::arg("buffer"), py::arg("count"), py::arg("dtype"), py::arg("root"), py::arg("blocking") = false)
      .def(
          "barrier", [](Communicator& c, bool blocking) { return outcome(c.barrier(blocking), blocking); },
          py::arg("blocking") = false, py::call_guard<py::gil_scoped_release>())
      .def(
          "agree",
          [](Communicator& c, const Fingerprint& call, bool blocking) {
            return outcome(c.agree(call, blocking), blocking);
          },
          py::arg("call"), py::arg("blocking") = false, py::call_guard<py::gil_scoped_release>());
}
