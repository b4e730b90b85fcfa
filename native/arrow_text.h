// A pyarrow string column seen from C++ without a Python object per document: the
// offsets buffer and the UTF-8 data buffer of the array, read in place.
//
// Python hands over the tuple that dataprep/native.py's `text_column` builds from a
// pyarrow (large_)string array: (offsets buffer, data buffer or None, array offset,
// length, whether offsets are 64-bit). The buffers stay pinned (buffer protocol) for the
// lifetime of the TextColumn.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string_view>

namespace ballast {

namespace py = pybind11;

class TextColumn {
 public:
  explicit TextColumn(const py::tuple& t) {
    if (t.size() != 5) throw std::invalid_argument("text column: expected a 5-tuple");
    offsets_info_ = py::buffer(t[0]).request();
    if (!t[1].is_none()) {
      data_info_ = py::buffer(t[1]).request();
      data_ = static_cast<const char*>(data_info_->ptr);
    }
    const auto offset = t[2].cast<int64_t>();
    n_ = t[3].cast<int64_t>();
    if (t[4].cast<bool>()) {
      off64_ = static_cast<const int64_t*>(offsets_info_->ptr) + offset;
    } else {
      off32_ = static_cast<const int32_t*>(offsets_info_->ptr) + offset;
    }
  }

  int64_t size() const { return n_; }

  std::string_view operator[](int64_t i) const {
    const int64_t a = off32_ ? off32_[i] : off64_[i];
    const int64_t b = off32_ ? off32_[i + 1] : off64_[i + 1];
    if (b == a) return {};
    return {data_ + a, static_cast<size_t>(b - a)};
  }

 private:
  std::optional<py::buffer_info> offsets_info_;
  std::optional<py::buffer_info> data_info_;
  const char* data_ = nullptr;
  const int32_t* off32_ = nullptr;
  const int64_t* off64_ = nullptr;
  int64_t n_ = 0;
};

}  // namespace ballast
