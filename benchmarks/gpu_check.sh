#!/usr/bin/env bash
# On a machine with a CUDA GPU: the CUDA tests (pinned mirror, side-stream transfers with
# per-layer events, the Triton kernel compiled for the GPU), then the transfer benchmark's
# H2D and D2H against a plain pinned copy_ of the same bytes. Under 5 minutes.
# Run from the repository root: bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch, sys; ok = torch.cuda.is_available(); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'device', torch.cuda.get_device_name() if ok else None); sys.exit(0 if ok else 'no CUDA GPU here: nothing to check')"
# the kernels must compile for the GPU, not run under the interpreter the CPU tests use
export TRITON_INTERPRET=0
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/tiers/test_cuda.py -rs
timeout 120 python3 benchmarks/transfer.py --device cuda --gib 1.0 --repeat 5
