#!/usr/bin/env bash
# The cohort engine's GPU measurements (README: "The cohort engine's targets"), one after another, each
# writing its figures into OUT. For a machine with one GPU and full MNIST (MNIST/raw/) under DATA_DIR:
#   bash experiments/gpu_targets.sh DATA_DIR OUT [ROUNDS]      # ROUNDS: of the end-to-end runs, default 100
# About 15-20 minutes at ROUNDS=100 (the end-to-end runs take the most; 1000 rounds is the paper's).
set -euo pipefail
data=${1:?usage: gpu_targets.sh DATA_DIR OUT [ROUNDS]}
out=${2:?usage: gpu_targets.sh DATA_DIR OUT [ROUNDS]}
rounds=${3:-100}
mkdir -p "$out"
paper=(dataset=mnist "data-dir=$data" num-clients=10 local-steps=50 batch-size=64)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"

# 1. the CUDA-graph step against the vmapped one (the equivalence tests that need a GPU)
if python -c "import pytest" 2>/dev/null; then
  python -m pytest -q tests/test_vectorised.py -k "cuda_graph or replayed" 2>&1 | tee "$out/cuda-graph-tests.txt"
fi

# 2. one cohort of the paper's 10 clients in process: loop, vmap and graph, s/round
for strategy in fedavg fedbr distrans; do
  fedbr-bench --cohort-step "${paper[@]}" "strategy=$strategy" --rounds 5 --json "$out/cohort-step-$strategy.json" \
    2>&1 | tee "$out/cohort-step-$strategy.txt"
done

# 3. end to end through Flower, the paper protocol with evaluation every 10 rounds; rounds.jsonl has the times
for strategy in fedavg fedbr; do
  for step in vmap graph; do
    fedbr-run experiments/fedavg_rotmnist.yaml "${paper[@]}" "strategy=$strategy" engine=cohort \
      "cohort-step=$step" eval-every=10 "num-rounds=$rounds" "output-dir=$out/run-$strategy-$step" --quiet \
      2>&1 | tail -5 | tee "$out/run-$strategy-$step.txt"
  done
done

# 4. 100 clients at 10% and 1000 at 1% on the one GPU: s/round and peak memory
for step in vmap graph; do
  fedbr-bench --scale local-steps=50 "cohort-step=$step" --rounds 3 --json "$out/scale-$step.json" 2>&1 \
    | tee "$out/scale-$step.txt"
done

# 5. the bare loop against both Flower engines, with achieved TFLOP/s beside the card's peak
fedbr-bench --suite --shapes rotmnist-cnn "${paper[@]}" --rounds 5 --json "$out/suite.json" 2>&1 | tee "$out/suite.txt"
