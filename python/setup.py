"""pip install --no-build-isolation ./python   (docs/python.md)

Builds moe_route._C from the library's headers with torch's extension
machinery, against the torch already installed (hence no build isolation).
With a CUDA torch and nvcc (CUDA_HOME, or nvcc on PATH) it also compiles the
CUDA branch: the runtime routers' CUDA instances (src/cuda_runtime*.cu) and
MOE_ROUTE_TORCH_WITH_CUDA in bindings.cpp, for the architectures in
TORCH_CUDA_ARCH_LIST (torch's default: the visible GPUs). MOE_ROUTE_CPU_ONLY=1
skips it. The CMake build (python/CMakeLists.txt) compiles the same sources
for the test suite."""

import glob
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

here = os.path.dirname(os.path.abspath(__file__))
include = os.path.join(here, "..", "include")
if not os.path.isdir(os.path.join(include, "moe_route")):
    raise RuntimeError("moe_route: build from the repository (python/ needs ../include/moe_route)")


def sources(pattern):
    return sorted(os.path.relpath(p) for p in glob.glob(os.path.join(here, pattern)))


cpp = sources("src/*.cpp") + sources("../src/runtime_*.cpp")
with_cuda = torch.version.cuda is not None and CUDA_HOME is not None and os.environ.get("MOE_ROUTE_CPU_ONLY") != "1"
if with_cuda:
    extension = CUDAExtension(
        "moe_route._C",
        cpp + sources("../src/cuda_runtime*.cu"),
        include_dirs=[include],
        define_macros=[("MOE_ROUTE_TORCH_WITH_CUDA", None)],
        extra_compile_args={
            # C++20 for PyTorch 2.15's headers; the .cu sources do not include torch.
            "cxx": ["-O3", "-std=c++20"],
            # torch turns off the half/bfloat16 operators for its own kernels; the library's use them.
            "nvcc": ["-O3", "-std=c++17", "--threads=0", "-U__CUDA_NO_HALF_OPERATORS__",
                     "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                     "-U__CUDA_NO_HALF2_OPERATORS__"],
        },
    )
else:
    extension = CppExtension("moe_route._C", cpp, include_dirs=[include], extra_compile_args=["-O3", "-std=c++20"])

setup(
    name="moe_route",
    version="0.1.0",
    description="Mixture-of-Experts router policies (RPB, CIPHER admission, gating, penalties) for PyTorch",
    packages=["moe_route", "moe_route.integrations"],
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension},
    python_requires=">=3.8",
)
