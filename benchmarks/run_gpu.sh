#!/usr/bin/env bash
# The benchmark on 1, 2 and 4 GPUs of one host in one call: N=1 (GPU 3) and N=2 (GPUs 0,1) side
# by side on disjoint GPUs, then N=4. Results: $OUT/bench_w{1,2,4}.json, log.txt and the 4-GPU
# profiler traces; `python3 benchmarks/report.py $OUT/bench_w*.json` prints the tables.
# Extra arguments go to every bench_gpt.py run (e.g. --before DIR to time commit 4e34463's code).
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
bench() { python3 -m torch.distributed.run --standalone --nproc_per_node "$1" "$(dirname "$0")/bench_gpt.py" --out "$OUT" "${@:2}"; }
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > "$OUT/log.txt" 2>&1
CUDA_VISIBLE_DEVICES=3 bench 1 "$@" > "$OUT/log_w1.txt" 2>&1 &
CUDA_VISIBLE_DEVICES=0,1 bench 2 "$@" > "$OUT/log_w2.txt" 2>&1 &
wait
cat "$OUT/log_w1.txt" "$OUT/log_w2.txt" >> "$OUT/log.txt" && rm "$OUT/log_w1.txt" "$OUT/log_w2.txt"
bench 4 --profile "$@" 2>&1 | tee -a "$OUT/log.txt"
