#!/usr/bin/env bash
# The standings' runs on one GPU host, each through launch.py (every case in a process of its own,
# the order rotated between REPEATS repeats, default 3), results under $OUT/<mode>/. Modes, in the order given:
#   four       both models on 4 GPUs (NVLink): the best 3-D grids against every tuned peer
#   four-slow  the same with NCCL_P2P_DISABLE=1 (traffic through host memory; no async cases)
#   two        both models on GPUs 0,1;   two-slow: with NCCL_P2P_DISABLE=1
#   one        both models on GPU 0: 3-D on one rank against the dense model (DDP of one)
#   bytes      the bytes each rank sends, on CPU (gloo): worlds 2, 4 and 8, every 3-D grid and peer
# Then: python benchmarks/report.py --repeats|--plot|--planner FILES (report.py's docstring).
set -u
OUT=${OUT:-out}
REPEATS=${REPEATS:-3}
HERE=$(dirname "$0")
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# the caching allocator as torchtitan's launcher sets it, for every method alike
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}
PEERS="fsdp2 compile noreshard bf16grad;fsdp2 compile bf16grad;ddp compile bf16grad;tp-sp compile async"
FOUR_llama="3d 4x1x1 compile;3d 2x2x1 compile;3d 1x4x1 async compile;3d auto compile;$PEERS;fsdp2-tp 2x2 compile"
FOUR_gpt2="3d 4x1x1 compile;3d 1x1x1 dp4 compile bf16grad;3d auto compile;$PEERS"
TWO="3d 2x1x1 compile;3d 1x2x1 async compile;3d 1x1x1 dp2 compile bf16grad;3d auto compile;$PEERS"
ONE="3d 1x1x1 compile;ddp compile"
launch() {  # launch GPUS MODE MODEL CASES [train_job args...]
  local n=$1 mode=$2 model=$3 cases=$4; shift 4
  python3 "$HERE/launch.py" --nproc "$n" --repeats "$REPEATS" --out "$OUT/$mode/$model" --cases "$cases" -- \
    --model "$model" --steps 10 "$@"
}
for mode in "$@"; do
  case $mode in
    four) launch 4 four llama-7b "$FOUR_llama"; launch 4 four gpt2-1.3b "$FOUR_gpt2" ;;
    four-slow)
      export NCCL_P2P_DISABLE=1
      launch 4 four-slow llama-7b "${FOUR_llama//;3d 1x4x1 async compile/}" --links p2p-off
      launch 4 four-slow gpt2-1.3b "$FOUR_gpt2" --links p2p-off
      unset NCCL_P2P_DISABLE ;;
    two) for m in llama-7b gpt2-1.3b; do CUDA_VISIBLE_DEVICES=0,1 launch 2 two "$m" "$TWO"; done ;;
    two-slow)
      for m in llama-7b gpt2-1.3b; do
        CUDA_VISIBLE_DEVICES=0,1 NCCL_P2P_DISABLE=1 launch 2 two-slow "$m" "${TWO//;3d 1x2x1 async compile/}" --links p2p-off
      done ;;
    one) for m in llama-7b gpt2-1.3b; do CUDA_VISIBLE_DEVICES=0 launch 1 one "$m" "$ONE"; done ;;
    bytes)
      for w in 2 4 8; do
        [ "$w" = 2 ] && grids="3d 2x1x1;3d 1x2x1;3d 1x1x2;3d 1x1x1 dp2" || grids="3d 2x2x1;3d 1x2x2;3d 2x1x1 dp2"
        [ "$w" = 8 ] && grids="3d 2x2x2;3d 4x2x1;3d 2x2x1 dp2;3d 8x1x1"
        [ "$w" = 2 ] && peers="fsdp2;fsdp2 noreshard;ddp;tp-sp;tp" || peers="fsdp2;fsdp2 noreshard;ddp;tp-sp;fsdp2-tp 2x$((w / 2))"
        python3 -m torch.distributed.run --standalone --nproc_per_node "$w" "$HERE/train_job.py" --cpu --model tiny-llama \
          --count-bytes --cases "$grids;$peers" --out "$OUT/bytes"
      done
      python3 "$HERE/report.py" --bytes "$OUT"/bytes/job_*.json ;;
    *) echo "unknown mode $mode: use four, four-slow, two, two-slow, one or bytes" >&2; exit 2 ;;
  esac
done
