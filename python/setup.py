# Builds spbcast._C with PyTorch's own extension machinery against the torch installed in the
# environment, so compiler flags, the C++ ABI and pybind11 match that torch exactly. Install
# without build isolation, so the build sees that torch and not a fresh one from an index:
#     pip install --no-build-isolation ./python
import os
import re
import subprocess
import sysconfig

import torch
from setuptools import setup
from setuptools.command.build_py import build_py
from torch.utils.cpp_extension import BuildExtension, CppExtension, include_paths

here = os.path.dirname(os.path.abspath(__file__))
# The header-only core lives beside this package in the repository; SPBCAST_INCLUDE points
# elsewhere (an installed spbcast) when the package is built on its own.
include = os.path.abspath(os.environ.get("SPBCAST_INCLUDE", os.path.join(here, "..", "include")))
if not os.path.isfile(os.path.join(include, "spbcast", "broadcast.hpp")):
    raise SystemExit(f"spbcast: no spbcast/broadcast.hpp under {include}; set SPBCAST_INCLUDE "
                     "to the directory that holds the spbcast headers")


class Build(BuildExtension):
    """Checks, before compiling, what the source includes: every LibTorch header from this torch
    (a system LibTorch in /usr/include, Debian's libtorch-dev, sits on the compiler's default
    path, where a header missing from the wheel would be found silently), and no Boost header -
    the extension builds on the reflection-free core, so that torch and a C++20 compiler are all
    it needs."""

    def build_extensions(self):
        compiler = os.environ.get("CXX", "c++").split()
        flags = ["-std=c++20", "-M", f"-I{include}", f"-I{sysconfig.get_paths()['include']}"]
        flags += [f"-I{p}" for p in include_paths()]
        deps = subprocess.run(compiler + flags + [os.path.join(here, "csrc", "_C.cpp")],
                              capture_output=True, text=True)
        if deps.returncode != 0:
            raise SystemExit("spbcast: preprocessing csrc/_C.cpp failed:\n" + deps.stderr)
        foreign = sorted(set(re.findall(r"/usr/include/(?:torch|ATen|c10|caffe2)/\S+", deps.stdout)))
        if foreign:
            raise SystemExit("spbcast: csrc/_C.cpp would include LibTorch headers from outside "
                             "this torch:\n  " + "\n  ".join(foreign[:5]))
        boost = sorted(set(re.findall(r"\S*/boost/\S+", deps.stdout)))
        if boost:
            raise SystemExit("spbcast: csrc/_C.cpp would include Boost headers, which the Python "
                             "package must build without:\n  " + "\n  ".join(boost[:5]))
        super().build_extensions()


class BuildPy(build_py):
    """Writes spbcast/_build_info.py: the torch the extension is compiled against, which
    `import spbcast` compares with the torch it runs under before loading the extension."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "spbcast", "_build_info.py")
        with open(target, "w") as f:
            f.write("# Written by setup.py when the package was built.\n"
                    f"BUILT_WITH_TORCH = {str(torch.__version__)!r}\n")


setup(
    ext_modules=[
        CppExtension(
            "spbcast._C",
            ["csrc/_C.cpp"],
            include_dirs=[include],
            extra_compile_args=["-std=c++20", "-O2"],
        )
    ],
    cmdclass={"build_ext": Build, "build_py": BuildPy},
)
