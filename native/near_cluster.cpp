// Near-dedup clustering (dataprep/stages/near.py `cluster`): the union-find over bucket
// groups with each link confirmed by the exact Jaccard of two shingle sets. The Python
// loop spends ~20 us a candidate pair on interpreter and numpy call overhead (a pread, two
// frombuffer, intersect1d's concatenate and sort) for a few hundred shingles of work; at
// millions of pairs that is the step's whole cost. This is the same loop, pair for pair in
// the same order, so every union, every counted query and the confirmed-pair count match
// the Python path exactly (tests/unit/dataprep/test_near_cluster_native.py).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace ballast {

namespace py = pybind11;

namespace {

using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// A shingle set of candidate r from the scratch file (uint32, sorted, unique), read with
// pread as the Python path does: the file can be larger than memory should hold.
class ShingleFile {
 public:
  ShingleFile(int fd, const int64_t* bounds) : fd_(fd), bounds_(bounds) {}

  const std::vector<uint32_t>& get(int64_t r, std::vector<uint32_t>& buf) const {
    const int64_t a = bounds_[r], b = bounds_[r + 1];
    buf.resize(static_cast<size_t>(b - a));
    auto* p = reinterpret_cast<char*>(buf.data());
    size_t left = buf.size() * sizeof(uint32_t);
    off_t at = static_cast<off_t>(a) * static_cast<off_t>(sizeof(uint32_t));
    while (left > 0) {  // pread may return short; a regular file rarely does, but may
      const ssize_t got = ::pread(fd_, p, left, at);
      if (got < 0) {
        if (errno == EINTR) continue;
        throw std::system_error(errno, std::generic_category(), "near cluster: pread");
      }
      if (got == 0) throw std::runtime_error("near cluster: shingle file is short");
      p += got;
      left -= static_cast<size_t>(got);
      at += got;
    }
    return buf;
  }

 private:
  int fd_;
  const int64_t* bounds_;
};

// minhash.jaccard: |x & y| / |x | y| of two sorted unique arrays, 1.0 for two empty sets.
// Both counts are exact integers below 2^53, so the double division rounds exactly as
// Python's int / int does.
double jaccard(const std::vector<uint32_t>& x, const std::vector<uint32_t>& y) {
  if (x.empty() && y.empty()) return 1.0;
  size_t i = 0, j = 0;
  int64_t inter = 0;
  while (i < x.size() && j < y.size()) {
    if (x[i] < y[j]) {
      ++i;
    } else if (y[j] < x[i]) {
      ++j;
    } else {
      ++inter;
      ++i;
      ++j;
    }
  }
  const auto total = static_cast<int64_t>(x.size() + y.size()) - inter;
  return static_cast<double>(inter) / static_cast<double>(total);
}

// Returns (parent, queried, verified) exactly as near.cluster's loop leaves them.
// groups: per band, (members as candidate ranks, offsets of each group). fd < 0: links are
// not verified (near.verify off) and every first query of a pair links it.
py::tuple cluster_links(const py::list& groups, int64_t nc, int64_t max_checks,
                        double threshold, int fd, const I64Array& bounds) {
  std::vector<std::pair<I64Array, I64Array>> bands;
  bands.reserve(groups.size());
  for (const auto& g : groups) {
    auto t = g.cast<py::tuple>();
    bands.emplace_back(t[0].cast<I64Array>(), t[1].cast<I64Array>());
  }
  if (fd >= 0 && bounds.size() != nc + 1)
    throw std::invalid_argument("near cluster: bounds must have nc + 1 entries");
  std::vector<int64_t> parent(static_cast<size_t>(nc));
  for (int64_t i = 0; i < nc; ++i) parent[i] = i;
  std::vector<int64_t> queried;
  int64_t verified = 0;
  {
    py::gil_scoped_release release;  // the arrays stay referenced by `bands`
    const ShingleFile sets(fd, bounds.data());
    std::vector<uint32_t> sa, sb;
    auto find = [&parent](int64_t i) {
      int64_t root = i;
      while (parent[root] != root) root = parent[root];
      while (parent[i] != root) {  // path compression, as the Python loop does
        const int64_t next = parent[i];
        parent[i] = root;
        i = next;
      }
      return root;
    };
    for (const auto& [members_arr, offsets_arr] : bands) {
      const int64_t* members = members_arr.data();
      const int64_t* offsets = offsets_arr.data();
      const int64_t n_groups = static_cast<int64_t>(offsets_arr.size()) - 1;
      for (int64_t g = 0; g < n_groups; ++g) {
        const int64_t* grp = members + offsets[g];
        const int64_t len = offsets[g + 1] - offsets[g];
        for (int64_t i = 1; i < len; ++i) {
          const int64_t m = grp[i];
          const int64_t checks = std::min(i, max_checks);
          for (int64_t k = 0; k < checks; ++k) {
            const int64_t other = grp[k];
            const int64_t rm = find(m), ro = find(other);
            if (rm == ro) break;
            queried.push_back(other * nc + m);
            if (fd < 0 || jaccard(sets.get(other, sa), sets.get(m, sb)) >= threshold) {
              ++verified;
              parent[std::max(rm, ro)] = std::min(rm, ro);
              break;
            }
          }
        }
      }
    }
  }
  auto to_numpy = [](const std::vector<int64_t>& v) {
    py::array_t<int64_t> a(static_cast<py::ssize_t>(v.size()));
    std::copy(v.begin(), v.end(), a.mutable_data());
    return a;
  };
  return py::make_tuple(to_numpy(parent), to_numpy(queried), verified);
}

}  // namespace

void register_near_cluster(py::module_& m) {
  m.def("near_cluster_links", &cluster_links, py::arg("groups"), py::arg("nc"),
        py::arg("max_checks"), py::arg("threshold"), py::arg("fd"), py::arg("bounds"),
        "(parent, queried, verified) of near.cluster's union-find loop; fd < 0: unverified.");
}

}  // namespace ballast
