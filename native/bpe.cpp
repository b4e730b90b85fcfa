// Kernel: bpe (not yet ported; the Python implementation runs).
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace ballast {

void register_bpe(py::module_& m) { (void)m; }

}  // namespace ballast
