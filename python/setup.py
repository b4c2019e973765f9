# Builds spbcast._C with PyTorch's own extension machinery against the torch installed in the
# environment, so compiler flags, the C++ ABI and pybind11 match that torch exactly. Install
# without build isolation, so the build sees that torch and not a fresh one from an index:
#     pip install --no-build-isolation ./python
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

here = os.path.dirname(os.path.abspath(__file__))
# The header-only core lives beside this package in the repository; SPBCAST_INCLUDE points
# elsewhere (an installed spbcast) when the package is built on its own.
include = os.environ.get("SPBCAST_INCLUDE", os.path.join(here, "..", "include"))
if not os.path.isfile(os.path.join(include, "spbcast", "broadcast.hpp")):
    raise SystemExit(f"spbcast: no spbcast/broadcast.hpp under {include}; set SPBCAST_INCLUDE "
                     "to the directory that holds the spbcast headers")

setup(
    ext_modules=[
        CppExtension(
            "spbcast._C",
            ["csrc/_C.cpp"],
            include_dirs=[os.path.abspath(include)],
            extra_compile_args=["-std=c++20", "-O2"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
