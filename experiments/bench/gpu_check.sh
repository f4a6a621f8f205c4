#!/usr/bin/env bash
# The one GPU check of issue 32, for a machine with stock jax + jax-cuda (no wandb, gguf,
# reasoning-gym or math-verify needed), run from the repository root:
#
#     bash experiments/bench/gpu_check.sh            # results under $OUT (default /tmp/gpu_check)
#
# Two commands, each under `timeout`, each running every part and baseline in its own
# process under a time budget and appending every row as a JSON line the moment it
# exists (experiments.bench.accelerator); together at most 7.5 minutes (H100 / H200):
#   1. accelerator  correctness of every kernel / backend (bf16, fp32; d 64, 128), DualKV
#                   fwd+bwd vs cuDNN on N copies (that baseline first), segment decode,
#                   train step (packed vs unpacked), sampler          -> budget 300 s
#   2. tune         per-launch Triton configs + split knobs; writes the tuned table to
#                   $OUT/tuned/<device>.json (commit it once read)    -> budget 100 s
# Files in $OUT (7): accelerator.{json,jsonl,log}, tune.{json,jsonl,log}, tuned/<device>.json.
set -u
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT/tuned"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

{
  echo "== $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null || echo no-git)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__)"
} 2>&1 | tee "$OUT/accelerator.log"

timeout -k 10 330 python3 -m experiments.bench.accelerator --budget 300 \
  --out "$OUT/accelerator.json" --jsonl "$OUT/accelerator.jsonl" 2>&1 | tee -a "$OUT/accelerator.log"
echo "== accelerator exit ${PIPESTATUS[0]}" | tee -a "$OUT/accelerator.log"

timeout -k 10 125 python3 -m experiments.bench.accelerator --parts tune --budget 100 \
  --out "$OUT/tune.json" --jsonl "$OUT/tune.jsonl" --tuned-dir "$OUT/tuned" 2>&1 | tee "$OUT/tune.log"
echo "== tune exit ${PIPESTATUS[0]}" | tee -a "$OUT/tune.log"
ls -la "$OUT" "$OUT/tuned"
