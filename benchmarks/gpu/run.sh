#!/usr/bin/env bash
# The GPU check, from the repository root on a machine whose Python holds torch (CUDA), Triton and Lightning:
#   bash benchmarks/gpu/run.sh OUT_DIR
# the CUDA-marked tests, each codec's encode/decode time at 1e6..1e9 elements with torch.topk beside them, and the
# one-process NCCL DDP step per named strategy against plain DDP and PyTorch's hooks, each with the host syncs it
# makes. JSON and Markdown tables go to OUT_DIR; each part has a time limit, so that the whole fits in 8 minutes and
# what finished is kept.
set -u
out=${1:?usage: benchmarks/gpu/run.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/summary.txt" 2>&1
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$out/summary.txt" 2>&1
timeout 120 python -m pytest -q -p no:cacheprovider -m cuda -rfEs tests/test_cuda.py tests/test_cuda_training.py \
    tests/test_fused.py > "$out/cuda_tests.txt" 2>&1
echo "cuda tests: exit $?" >> "$out/summary.txt"
timeout 260 python benchmarks/gpu/codecs.py --out "$out" > "$out/codecs.log" 2>&1
echo "codecs: exit $?" >> "$out/summary.txt"
timeout 90 python benchmarks/gpu/ddp_step.py --out "$out" > "$out/ddp_step.log" 2>&1
echo "ddp step: exit $?" >> "$out/summary.txt"
cat "$out/summary.txt"
tail -n 25 "$out/cuda_tests.txt"
cat "$out"/codecs_cuda.md "$out"/ddp_step_cuda.md 2>/dev/null
