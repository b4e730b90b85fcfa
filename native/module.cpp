// The binding layer of `dataprep._native`: each kernel file registers its own functions
// (register_<kernel>), so a kernel is one .cpp file and this file only lists them.
#include <pybind11/pybind11.h>

#include "arrow_text.h"

namespace py = pybind11;

namespace ballast {
void register_minhash(py::module_& m);
void register_bpe(py::module_& m);
void register_quality(py::module_& m);
void register_near_cluster(py::module_& m);
}  // namespace ballast

namespace {

// The sum of the byte lengths of a text column: the smallest use of TextColumn, which the
// tests compare with pyarrow's own answer so a broken buffer hand-over fails loudly.
int64_t text_bytes(const py::tuple& column) {
  const ballast::TextColumn col(column);
  int64_t total = 0;
  for (int64_t i = 0; i < col.size(); ++i) total += static_cast<int64_t>(col[i].size());
  return total;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "Ballast's compiled kernels over Arrow buffers (see dataprep/native.py).";
  m.def("text_bytes", &text_bytes, "Total UTF-8 bytes of a text column (a self-check).");
  ballast::register_minhash(m);
  ballast::register_bpe(m);
  ballast::register_quality(m);
  ballast::register_near_cluster(m);
}
