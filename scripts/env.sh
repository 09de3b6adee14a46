# Sourced by the run and test scripts: finds nvcc where the CUDA toolkit
# installs it, so the CUDA backend is compiled whenever a toolkit is present.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
