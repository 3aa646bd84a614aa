#!/usr/bin/env bash
# The whole-job benchmark (train_job.py) on one host of 4 GPUs, in one call. Modes, run in the order given:
#   nvlink   both models on 4 GPUs, every default case (NVLink)
#   p2p-off  both models on 4 GPUs with NCCL_P2P_DISABLE=1 (traffic through host memory; no async cases)
#   small    both models on 2 GPUs (GPUs 0,1) and on 1 GPU (GPU 3), side by side
#   compile        both models on 4 GPUs: compiled 3-D blocks against the compiled peers, 10 timed steps
#   compile-small  the same on 2 GPUs (GPUs 0,1) and 1 GPU (GPU 3), side by side
#   check          the token-range check on and off in turn (check_cost.py) on 4 GPUs
#   check1         the same on 1 GPU (GPU 2: it can run beside compile-small)
#   reduce         both models on 4 GPUs: the dp gradient reduction in float32 and in bf16 (bf16grad)
#   repeat         the best 3-D cases and best peers of both models on 4 GPUs, each set in REPEAT processes
#                  (default 3) in rotated order, gathered per model; then `job_report.py --repeats`
#                  gives each case's median and range (steps moved by up to 30% between processes)
#   largest        Llama shapes on 4 GPUs at 8 and 16 layers, with and without activation checkpointing
#                  (ckpt); then `job_report.py --largest` extrapolates the most layers each case trains
# ISOLATE=1 runs every case of a mode in a process of its own (train_job.py --append gathers them
# into the mode's file): slower to start, but no case inherits another's state.
# Each torchrun gets a time budget (BUDGET_S seconds, default 200: both models of one mode fit one 10-minute call): cases that would end later are
# recorded as not run. Results: $OUT/job_w{N}_{model}_{links}.json and log_{mode}.txt.
set -u
OUT=${OUT:-out}
BUDGET_S=${BUDGET_S:-200}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# the caching allocator as torchtitan's launcher sets it, for every method alike
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}
MODELS="gpt2-1.3b llama-7b"
P2P_CASES="3d 1x2x1 dp2;3d 4x1x1;3d 2x2x1;3d auto;tp-sp compile;fsdp2 compile;fsdp2 compile noreshard;3d 1x1x1 dp4;3d 2x1x1 dp2;3d 1x4x1;fsdp2-tp 2x2 compile;ddp;tp-sp;fsdp2;tp"
COMPILE4_llama="3d 1x4x1 async compile;fsdp2 compile;fsdp2 compile noreshard;3d 1x4x1 async;3d 4x1x1 compile;3d 2x2x1 compile;fsdp2;3d 1x4x1 compile;3d 2x2x1 async compile"
COMPILE4_gpt2="3d 1x1x1 dp4 compile;ddp compile;ddp;3d 1x1x1 dp4;3d 2x2x1 compile;fsdp2 compile;fsdp2 compile noreshard;fsdp2;3d 1x4x1 compile"
COMPILE2="3d 2x1x1 compile;fsdp2 compile;fsdp2 compile noreshard;3d 1x2x1 async compile;3d 1x1x1 dp2 compile;fsdp2;ddp compile;3d 2x1x1"
COMPILE1="3d 1x1x1 compile;ddp compile;3d 1x1x1;ddp"
LARGEST="3d 1x4x1 async compile;fsdp2 compile;fsdp2 compile noreshard;3d 4x1x1 compile;3d 2x2x1 compile;tp-sp compile async;fsdp2-tp 2x2 compile;ddp"
LARGEST="$LARGEST;3d 1x4x1 async compile ckpt;fsdp2 compile ckpt;3d 4x1x1 compile ckpt;tp-sp compile async ckpt;fsdp2-tp 2x2 compile ckpt"
REPEAT_llama="3d 4x1x1 compile;fsdp2 compile;fsdp2 compile noreshard;3d 1x4x1 async compile"
REPEAT_gpt2="3d 1x1x1 dp4;ddp;3d 1x1x1 dp4 compile;3d 4x1x1"
REDUCE="3d 1x1x1 dp4;3d 1x1x1 dp4 bf16grad;ddp;ddp bf16grad;fsdp2;fsdp2 bf16grad;3d 1x2x1 dp2 async;3d 1x2x1 dp2 async bf16grad"
run_one() {
  local n=$1; shift
  timeout $((BUDGET_S + 90)) python3 -m torch.distributed.run --standalone --nproc_per_node "$n" "$(dirname "$0")/train_job.py" \
    --out "$OUT" --budget-s "$BUDGET_S" "$@"
}
job() {  # job N ARGS...: one torchrun, or with ISOLATE=1 one per case of its --cases
  local n=$1; shift
  [ -z "${ISOLATE:-}" ] && { run_one "$n" "$@"; return; }
  local args=() cases="" c
  while [ $# -gt 0 ]; do
    if [ "$1" = --cases ]; then cases=$2; shift 2; else args+=("$1"); shift; fi
  done
  [ -z "$cases" ] && { echo "ISOLATE=1 needs a mode with explicit --cases" >&2; return 2; }
  IFS=';' read -ra list <<< "$cases"
  for c in "${list[@]}"; do run_one "$n" "${args[@]}" --cases "$c" --append; done
}
for mode in "$@"; do
  case $mode in
    nvlink) for m in $MODELS; do job 4 --model "$m"; done 2>&1 | tee "$OUT/log_nvlink.txt" ;;
    p2p-off) for m in $MODELS; do NCCL_P2P_DISABLE=1 job 4 --model "$m" --links p2p-off --cases "$P2P_CASES"; done 2>&1 | tee "$OUT/log_p2p-off.txt" ;;
    small)
      (for m in $MODELS; do CUDA_VISIBLE_DEVICES=3 job 1 --model "$m"; done > "$OUT/log_w1.txt" 2>&1) &
      (for m in $MODELS; do CUDA_VISIBLE_DEVICES=0,1 job 2 --model "$m"; done > "$OUT/log_w2.txt" 2>&1) &
      wait
      cat "$OUT/log_w1.txt" "$OUT/log_w2.txt" > "$OUT/log_small.txt" && rm "$OUT/log_w1.txt" "$OUT/log_w2.txt" ;;
    compile)
      (job 4 --model llama-7b --steps 10 --cases "$COMPILE4_llama"; job 4 --model gpt2-1.3b --steps 10 --cases "$COMPILE4_gpt2") 2>&1 \
        | tee "$OUT/log_compile.txt" ;;
    compile-small)
      (for m in $MODELS; do CUDA_VISIBLE_DEVICES=3 job 1 --model "$m" --steps 10 --cases "$COMPILE1"; done > "$OUT/log_w1.txt" 2>&1) &
      (for m in $MODELS; do CUDA_VISIBLE_DEVICES=0,1 job 2 --model "$m" --steps 10 --cases "$COMPILE2"; done > "$OUT/log_w2.txt" 2>&1) &
      wait
      cat "$OUT/log_w1.txt" "$OUT/log_w2.txt" > "$OUT/log_compile-small.txt" && rm "$OUT/log_w1.txt" "$OUT/log_w2.txt" ;;
    check)
      for c in "llama-7b|3d 1x4x1 async compile" "llama-7b|3d 1x4x1 async" "gpt2-1.3b|3d 1x1x1 dp4"; do
        timeout 150 python3 -m torch.distributed.run --standalone --nproc_per_node 4 "$(dirname "$0")/check_cost.py" \
          --model "${c%%|*}" --case "${c#*|}" --out "$OUT"
      done 2>&1 | tee "$OUT/log_check.txt" ;;
    check1)
      for m in $MODELS; do
        CUDA_VISIBLE_DEVICES=2 timeout 150 python3 -m torch.distributed.run --standalone --nproc_per_node 1 "$(dirname "$0")/check_cost.py" \
          --model "$m" --case "3d 1x1x1" --out "$OUT"
      done > "$OUT/log_check1.txt" 2>&1 ;;
    reduce) for m in $MODELS; do job 4 --model "$m" --steps 10 --cases "$REDUCE"; done 2>&1 | tee "$OUT/log_reduce.txt" ;;
    repeat)
      for m in $MODELS; do
        [ "$m" = llama-7b ] && cases=$REPEAT_llama || cases=$REPEAT_gpt2
        IFS=';' read -ra list <<< "$cases"
        for ((r = 0; r < ${REPEAT:-3}; r++)); do  # process r starts at case r: each case runs first once
          k=$((r % ${#list[@]}))
          rotated=$(IFS=';'; echo "${list[*]:k};${list[*]:0:k}")
          run_one 4 --model "$m" --steps 10 --cases "${rotated%;}" --append --out "$OUT/repeat"
        done
        python3 "$(dirname "$0")/job_report.py" --repeats "$OUT"/repeat/job_w4_"$m"*_nvlink.json
      done 2>&1 | tee "$OUT/log_repeat.txt" ;;
    largest)
      for l in 8 16; do job 4 --model llama-7b --layers "$l" --steps 3 --cases "$LARGEST"; done 2>&1 | tee "$OUT/log_largest.txt"
      python3 "$(dirname "$0")/job_report.py" --largest "$OUT"/job_w4_llama-7b_L*_nvlink.json | tee "$OUT/largest.md" ;;
    *) echo "unknown mode $mode: use nvlink, p2p-off, small, compile, compile-small, check, check1, reduce, repeat or largest" >&2; exit 2 ;;
  esac
done
