"""The cost model's weak- and strong-scaling tables (laid out as Bian et al. 2021, Tables 1–2)
at 8, 64, 512 and 4096 GPUs: the best 3-D grid against Megatron 1-D TP=8 with data parallelism
and against FSDP without resharding after forward.

``python benchmarks/extrapolate.py [bench_w4.json]`` uses the measured rates of that file (else
``planner.DEFAULT_MACHINE``), nodes of 8 GPUs on NVLink, and the assumed inter-node link of the
planner; 1-D is modelled at its best (fused QKV, no dispatch overhead). FSDP is the best grid
``P×1×1`` with dp (each weight gathered over P ranks once in forward, its gradient
reduce-scattered once in backward, data parallelism over the rest: FSDP's algorithm with
``reshard_after_forward=False``, hybrid-sharded), priced by the same model as 3-D.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_3d import planner  # noqa: E402

GPUS = (8, 64, 512, 4096)
SEQ, LAYERS = 2048, 4
# weak scaling: hidden ∝ √GPUs (parameters per GPU constant); batch grows too (as in the paper), by 4× per 8× GPUs
WEAK = {8: (4096, 16), 64: (11264, 64), 512: (32768, 256), 4096: (92160, 1024)}
STRONG = (12288, 512)  # hidden, batch: one problem on every size


def best(options: list[planner.Prediction], machine: planner.Machine) -> planner.Prediction | None:
    fitting = [p for p in options if planner.fits(p, machine)]
    return min(fitting or options, key=lambda p: p.step_ms, default=None)


def row(method: str, n: int, shape: planner.ModelShape, p: planner.Prediction | None, machine: planner.Machine) -> str:
    if p is None:
        return f"| {method} | {n} | {shape.batch} | {shape.hidden} | – | – | – | no layout divides the shape | – | – |"
    fit = "" if planner.fits(p, machine) else " (does not fit)"
    return (f"| {method} | {n} | {shape.batch} | {shape.hidden} | {p.fwd_ms:.1f} | {p.bwd_ms:.1f} | {p.step_ms / shape.batch:.2f} "
            f"| {p.label} | {p.memory_GiB:.1f}{fit} | {100 * p.exposed_comm_ms / p.step_ms:.0f}% |")


def table(title: str, shapes: dict[int, planner.ModelShape], machine: planner.Machine) -> str:
    lines = [f"\n{title}\n", "| method | # GPUs | batch | hidden | fwd (ms) | bwd (ms) | avg step per sequence (ms) | layout | GiB/GPU | exposed comm |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for method in ("1-D TP=8 + dp", "FSDP (P×1×1 + dp)", "3-D"):
        for n, shape in shapes.items():
            if method == "1-D TP=8 + dp":
                options = [planner.predict_1d(shape, 8, n // 8, machine)] if shape.batch % (n // 8) == 0 and shape.heads % 8 == 0 else []
            else:
                grids = [(g, dp) for g, dp in planner.scaling_candidates(n) if planner.grid_error(shape, g, dp) is None
                         and (method == "3-D" or g[1] == g[2] == 1)]
                options = [planner.predict_3d(shape, g, dp, machine) for g, dp in grids]
            lines.append(row(method, n, shape, best(options, machine), machine))
    return "\n".join(lines)


def main() -> None:
    machine = planner.DEFAULT_MACHINE
    if len(sys.argv) > 1:
        with open(sys.argv[1]) as f:
            machine = planner.Machine.from_bench(json.load(f)["hardware"])
    machine = replace(machine, memory_GiB=140.0)
    weak = {n: planner.ModelShape(h, h // 128, SEQ, b, LAYERS) for n, (h, b) in WEAK.items()}
    strong = {n: planner.ModelShape(STRONG[0], STRONG[0] // 128, SEQ, STRONG[1], LAYERS) for n in GPUS}
    print(table(f"Weak scaling ({LAYERS} layers, s={SEQ}; hidden ∝ √GPUs, batch ∝ GPUs^(2/3)):", weak, machine))
    print(table(f"Strong scaling ({LAYERS} layers, s={SEQ}, hidden {STRONG[0]}, batch {STRONG[1]}):", strong, machine))


if __name__ == "__main__":
    main()
