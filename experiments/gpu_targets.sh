#!/usr/bin/env bash
# The cohort engine's GPU measurements (README: "The cohort engine's targets"), one after another, each
# writing its output into OUT/<name>.txt (and .json where the tool writes one). For a machine with one GPU
# and full MNIST (MNIST/raw/) under DATA_DIR:
#   bash experiments/gpu_targets.sh DATA_DIR OUT [ROUNDS [PARTS]]
# ROUNDS: of the end-to-end runs (default 100; the paper runs 1000). PARTS: which of the numbered parts
# below to run (default "1 2 3 4 5 6 7 8"), e.g. "2 3" to split the work over several sessions or calls.
# A part that fails is recorded in OUT/failures.txt and the others still run. EXTRA (environment): key=value
# settings appended to the commands that take the paper's settings (parts 2, 3, 5, 6, 7 and 8), e.g.
# EXTRA="model=cnn-small device=cpu" to try the script on a CPU.
# The fedbr-bench parts also write what they print, with command, commit, machine and wall time, as their
# sections of OUT/benchmarks.md: copy those sections into docs/benchmarks.md.
# Parts take minutes each (docs/benchmarks.md gives their wall times on one H100): in a short GPU slot, run only
# the parts that fit before what must run after them.
set -uo pipefail
data=${1:?usage: gpu_targets.sh DATA_DIR OUT [ROUNDS [PARTS]]}
out=${2:?usage: gpu_targets.sh DATA_DIR OUT [ROUNDS [PARTS]]}
rounds=${3:-100}
parts=" ${4:-1 2 3 4 5 6 7 8} "
mkdir -p "$out"
read -r -a extra <<< "${EXTRA:-}"
paper=(dataset=mnist "data-dir=$data" num-clients=10 local-steps=50 batch-size=64 lr=0.001 "${extra[@]}")

measure() {  # measure NAME COMMAND...: its output into OUT/NAME.txt, its last lines on the terminal
  local name=$1
  shift
  echo "== $name: $*"
  "$@" > "$out/$name.txt" 2>&1
  local code=$?
  tail -n 12 "$out/$name.txt"
  if [ "$code" -ne 0 ]; then echo "$name: exit $code: $*" | tee -a "$out/failures.txt"; fi
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$out/gpu.txt" 2>&1
git rev-parse HEAD > "$out/commit.txt" 2>/dev/null

# 1. the CUDA-graph step against the vmapped one: the equivalence tests that need a GPU
if [[ $parts == *" 1 "* ]]; then
  measure graph-tests python -m pytest -q tests/test_vectorised.py -k "cuda_graph or replayed"
fi

# 2. one cohort of the paper's 10 clients in process: loop, vmap and graph, s/round
if [[ $parts == *" 2 "* ]]; then
  for strategy in fedavg fedbr distrans; do
    measure "cohort-step-$strategy" fedbr-bench --cohort-step "${paper[@]}" "strategy=$strategy" --rounds 5 \
      --json "$out/cohort-step-$strategy.json" --report "$out/benchmarks.md"
  done
fi

# 3. end to end through Flower: the paper protocol, evaluation every 10 rounds (rounds.jsonl has the times)
if [[ $parts == *" 3 "* ]]; then
  for strategy in fedavg fedbr; do
    for step in vmap graph; do
      measure "run-$strategy-$step" fedbr-run experiments/fedavg_rotmnist.yaml "${paper[@]}" "strategy=$strategy" \
        engine=cohort "cohort-step=$step" eval-every=10 "num-rounds=$rounds" "output-dir=$out/run-$strategy-$step" \
        --quiet
    done
  done
fi

# 4. 100 clients at 10% and 1000 at 1% on the one GPU: s/round and peak memory
if [[ $parts == *" 4 "* ]]; then
  for step in vmap graph; do
    measure "scale-$step" fedbr-bench --scale local-steps=50 "cohort-step=$step" --rounds 3 --json "$out/scale-$step.json" \
      --report "$out/benchmarks.md"
  done
fi

# 5. the bare loop against both Flower engines, with the achieved TFLOP/s beside the card's peak
if [[ $parts == *" 5 "* ]]; then
  measure suite fedbr-bench --suite --shapes rotmnist-cnn "${paper[@]}" --rounds 5 --json "$out/suite.json" \
    --report "$out/benchmarks.md"
fi

# 6. the speed levers (tf32, cudnn-autotune, bf16, cohort-conv=matmul) against strict fp32, one cohort in process:
#    s/round and how far each moves the first round's updates
if [[ $parts == *" 6 "* ]]; then
  for strategy in fedavg fedbr; do
    measure "levers-$strategy" fedbr-bench --levers "${paper[@]}" "strategy=$strategy" --rounds 3 \
      --json "$out/levers-$strategy.json" --report "$out/benchmarks.md"
  done
fi

# 7. several runs sharing the GPU: two FedBR seeds of the campaign's sweep (engine=cohort, evaluation every 2
#    rounds; 20 rounds), one after another in one simulation process, then at once (--jobs 2, a process each):
#    the wall time of each sweep, the median seconds of the rounds (rounds.jsonl), and the throughput of runs at once
if [[ $parts == *" 7 "* ]]; then
  shared=(experiments/table1_rotmnist.yaml engine=cohort num-rounds=20 "${paper[@]}" --only FedBR --seeds 0 1 --quiet)
  median_round() {
    python -c 'import json, statistics, sys; print(round(statistics.median(json.loads(l)["seconds"] for l in open(sys.argv[1])), 3))' \
      "$1"
  }
  start=$SECONDS
  measure share-one-by-one fedbr-sweep "${shared[@]}" --out "$out/share-one-by-one"
  one_by_one=$((SECONDS - start))
  start=$SECONDS
  measure share-at-once fedbr-sweep "${shared[@]}" --jobs 2 --out "$out/share-at-once"
  at_once=$((SECONDS - start))
  {
    for mode in one-by-one at-once; do
      for seed in 0 1; do
        echo "$mode, seed $seed: median round $(median_round "$out/share-$mode/FedBR/seed$seed/rounds.jsonl") s"
      done
    done
    echo "one after another: ${one_by_one} s; at once (--jobs 2): ${at_once} s; throughput of runs at once:" \
      "$(python -c "print(round($one_by_one / max($at_once, 1), 2))")x"
  } | tee "$out/share.txt"
fi

# 8. where a round's GPU time goes: the kernels of one FedAvg and one FedBR round (vmap step) under torch's
#    profiler, with vmap's grouped convolutions and with cohort-conv=matmul
if [[ $parts == *" 8 "* ]]; then
  for strategy in fedavg fedbr; do
    for conv in grouped matmul; do
      measure "kernels-$strategy-$conv" fedbr-bench --kernels "${paper[@]}" "strategy=$strategy" engine=cohort \
        "cohort-conv=$conv" --json "$out/kernels-$strategy-$conv.json" \
        --report "$out/benchmarks.md"
    done
  done
fi
