// A stand-in for SiMM's native module: the same class names and binding
// signatures (DataView's two constructors, KVStore's batch calls taking
// vectors and letting go of the GIL), with calls that touch no memory and
// answer at once. What it costs per call is nanobind's own work: argument
// conversion, a list becoming a std::vector (one DataView copy per object),
// the GIL release and the result list. measure.py compares that with the
// pure-Python null client in sglang_simm_dev.nullkv.

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace nb = nanobind;

namespace nullnative {

// A registered region. A real one owns an RDMA registration; views keep a
// copy of its handle, so a view is a few words whatever the region.
struct MrExt {
  std::uintptr_t start = 0;
  std::size_t size = 0;
  std::uint32_t lkey = 0;
};

// A client-owned buffer (SiMM hands these out from its pool).
struct Data {
  explicit Data(std::size_t n) : bytes(n) {}
  std::vector<std::uint8_t> bytes;
};

// ptr and size plus the region's key: what a transfer needs per object.
struct DataView {
  explicit DataView(Data &data)
      : ptr(reinterpret_cast<std::uintptr_t>(data.bytes.data())), size(data.bytes.size()) {}
  DataView(std::uintptr_t p, std::size_t n, MrExt &mr) : ptr(p), size(n), lkey(mr.lkey) {}
  std::uintptr_t ptr = 0;
  std::size_t size = 0;
  std::uint32_t lkey = 0;
};

struct KVStore {
  // Taken by value where SiMM's KVStore takes them by value, so the same
  // vector copy happens after the conversion.
  static std::vector<std::int32_t> MGet(const std::vector<std::string> &keys, std::vector<DataView> datas) {
    std::vector<std::int32_t> out(keys.size(), 0);
    for (std::size_t i = 0; i < out.size() && i < datas.size(); ++i) out[i] = static_cast<std::int32_t>(datas[i].size);
    return out;
  }
  static std::vector<std::int16_t> MPut(const std::vector<std::string> &keys, std::vector<DataView> datas) {
    (void)datas;
    return std::vector<std::int16_t>(keys.size(), 0);
  }
  static std::vector<std::int16_t> MExists(const std::vector<std::string> &keys) {
    return std::vector<std::int16_t>(keys.size(), 0);
  }
};

MrExt register_mr(std::uintptr_t start, std::size_t size) {
  static std::uint32_t next_key = 1;
  return MrExt{start, size, next_key++};
}

}  // namespace nullnative

NB_MODULE(_nullkv_native, m) {
  using namespace nullnative;
  nb::class_<MrExt>(m, "MrExt")
      .def_ro("start", &MrExt::start)
      .def_ro("size", &MrExt::size);
  m.def("register_mr", &register_mr);
  nb::class_<Data>(m, "Data").def(nb::init<std::size_t>());
  nb::class_<DataView>(m, "DataView")
      .def(nb::init<Data &>())
      .def(nb::init<std::uintptr_t, std::size_t, MrExt &>())
      .def_ro("ptr", &DataView::ptr)
      .def_ro("size", &DataView::size);
  nb::class_<KVStore>(m, "KVStore")
      .def(nb::init<>())
      .def(
          "MPut",
          [](KVStore &, const std::vector<std::string> &keys, const std::vector<DataView> &datas) {
            return KVStore::MPut(keys, datas);
          },
          nb::call_guard<nb::gil_scoped_release>())
      .def(
          "MGet",
          [](KVStore &, const std::vector<std::string> &keys, const std::vector<DataView> &datas) {
            return KVStore::MGet(keys, datas);
          },
          nb::call_guard<nb::gil_scoped_release>())
      .def(
          "MExists",
          [](KVStore &, const std::vector<std::string> &keys) { return KVStore::MExists(keys); },
          nb::call_guard<nb::gil_scoped_release>());
}
