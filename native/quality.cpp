// Kernel: quality (not yet ported; the Python implementation runs).
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace ballast {

void register_quality(py::module_& m) { (void)m; }

}  // namespace ballast
