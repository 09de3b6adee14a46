"""pip install --no-build-isolation ./python   (docs/python.md)

Builds moe_route._C from the library's headers with torch's extension
machinery, against the torch already installed (hence no build isolation).
The CMake build (python/CMakeLists.txt) compiles the same sources for the
test suite."""

import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

here = os.path.dirname(os.path.abspath(__file__))
include = os.path.join(here, "..", "include")
if not os.path.isdir(os.path.join(include, "moe_route")):
    raise RuntimeError("moe_route: build from the repository (python/ needs ../include/moe_route)")

setup(
    name="moe_route",
    version="0.1.0",
    description="Mixture-of-Experts router policies (RPB, CIPHER admission, gating, penalties) for PyTorch",
    packages=["moe_route"],
    ext_modules=[
        CppExtension(
            "moe_route._C",
            sorted(glob.glob(os.path.join("src", "*.cpp")))
            + sorted(os.path.relpath(p) for p in glob.glob(os.path.join(here, "..", "instances", "*.cpp"))),
            include_dirs=[include],
            extra_compile_args=["-O2", "-std=c++17"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    python_requires=">=3.8",
)
