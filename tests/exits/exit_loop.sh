#!/usr/bin/env bash
# Issue 32's exit count: every example and strategy script run N times, one line per run ("case status
# seconds") in OUT/results.txt, a failed run's output kept as OUT/fail-RUN-CASE.out. Two loops at once (a
# loaded machine shows rare aborts sooner) need their own OUT and PORT:
#   tests/exits/exit_loop.sh 100 /tmp/exits-a 29511 & tests/exits/exit_loop.sh 100 /tmp/exits-b 29611
# Count: cat /tmp/exits-*/results.txt | awk '{n[$1]++; if ($2) f[$1]++} END {for (k in n) print k, n[k], f[k]+0}'
N=${1:-100}
OUT=$(realpath -m "${2:-/tmp/exits}")
PORT=${3:-29511}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
export PYTHONPATH=$ROOT OMP_NUM_THREADS=1
unset MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE NODE_RANK PL_GLOBAL_SEED
mkdir -p "$OUT"

one() {  # case name, then its command
  local name=$1 start rc
  shift
  start=$(date +%s.%N)
  rm -rf "$OUT/run" && mkdir -p "$OUT/run"
  (cd "$OUT/run" && timeout 300 "$@" > "$OUT/last.out" 2>&1)
  rc=$?
  echo "$name $rc $(echo "$(date +%s.%N) - $start" | bc)" >> "$OUT/results.txt"
  [ $rc -ne 0 ] && cp "$OUT/last.out" "$OUT/fail-$run-$name.out"
}

torchrun=("$PY" -m torch.distributed.run --master-port "$PORT" --nproc-per-node 2)
for run in $(seq 1 "$N"); do
  for api in trainer fabric; do
    for strategy in hai_ddp hai_fsdp hai_pipedream; do
      [ "$api/$strategy" = fabric/hai_pipedream ] && continue  # Fabric has no pipeline strategy
      one "${api}_$strategy" "${torchrun[@]}" "$ROOT/tests/exits/exit_job.py" "$api" "$strategy"
    done
  done
  for example in ddp fsdp pipeline cpu_offload hfreduce_allreduce; do
    one "plain_$example" "${torchrun[@]}" -m "examples.plain.$example"
  done
  for example in ddp fsdp pipeline cpu_offload; do
    one "lightning_$example" "$PY" -m "examples.lightning.$example"
  done
  one fabric_pipeline "$PY" -m examples.fabric.pipeline
  one gpt_train "$PY" -m examples.gpt.train --config "$ROOT/examples/gpt/demo.yaml" --trainer.max_steps=4 \
    --trainer.val_check_interval=2 --trainer.limit_val_batches=1 --trainer.log_every_n_steps=1 \
    --throughput.window_size=2 --model.cfg.block_size=32 --data.max_bytes=20000 \
    --trainer.default_root_dir="$OUT/run"
done
