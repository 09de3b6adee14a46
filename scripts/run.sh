#!/usr/bin/env bash
# The main job: install dependencies, build the reference MoE language model
# (examples/moe_lm), pretrain its base and run the reduced grids of the RPB
# post-training study and the CIPHER admission study, printing progress and
# both tables (about 15 minutes on 2 cores, build included). Outputs go to
# build/run/studies; a second run reuses the base and the finished runs there.
# Flags go to examples/moe_lm/studies.py: --full runs the full grids.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
cmake --preset run
cmake --build --preset run --target moe_lm
python3 examples/moe_lm/studies.py --moe-lm build/run/examples/moe_lm/moe_lm --out build/run/studies "$@"
