# Sourced by the run and test scripts: finds nvcc where the CUDA toolkit
# installs it, so the CUDA backend is compiled whenever a toolkit is present,
# and puts the project's virtual environment (scripts/setup.sh) first on PATH.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
moe_route_venv="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv"
if [ -x "$moe_route_venv/bin/python" ]; then
  export VIRTUAL_ENV="$moe_route_venv"
  export PATH="$moe_route_venv/bin:$PATH"
fi
unset moe_route_venv
