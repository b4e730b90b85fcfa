"""The compiled part of Ballast: one extension module, `dataprep._native`, built from
native/*.cpp by the normal install (`pip install .`, `make install`). Everything else is
declared in pyproject.toml. pybind11 (header-only, a build requirement) binds it; the
kernels take Arrow buffers and numpy arrays whole, so per-call binding cost does not
matter and the binding layer stays thin (native/module.cpp)."""

from glob import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

native = Pybind11Extension(
    "dataprep._native",
    sorted(glob("native/*.cpp")),
    include_dirs=["native"],
    cxx_std=17,
    # -O3 for the vectorisable loops (hashing, min over permutations); no -march=native,
    # so a build runs on any x86-64 of the cluster it is copied to.
    extra_compile_args=["-O3"],
    depends=sorted(glob("native/*.h")),
)

setup(ext_modules=[native], cmdclass={"build_ext": build_ext})
