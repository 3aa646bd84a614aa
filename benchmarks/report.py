"""Markdown tables from the JSON files of ``bench_gpt.py``.

``python benchmarks/report.py bench_w1.json bench_w2.json bench_w4.json`` prints, per file and
shape, every case, then the paper-style strong- and weak-scaling tables (Bian et al. 2021,
Tables 1–2: GPUs, batch, hidden, forward, backward, average step time per sequence) of the 1-D
peer and the best 3-D grid over all files.
"""

from __future__ import annotations

import json
import sys

WEAK = {1: 2048, 2: 3072, 4: 4096, 8: 5792}


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def case_table(data: dict, shape_name: str) -> str:
    block = data["results"][shape_name]
    cases = block["cases"]
    world = data["meta"]["world"]
    peer = next((c for c in cases if c["kind"] == "tp1d" and c["dp"] == 1 and "step_ms" in c), None)
    lines = [_row(["case", "GPUs", "fwd ms", "bwd ms", "step ms", "TFLOP/s/GPU", "MFU", "peak GiB", f"speed-up vs TP={world}",
                   "out err vs dense", "loss diff vs peer"]), _row(["---"] * 11)]
    for c in cases:
        if "step_ms" not in c:
            lines.append(_row([c["case"], c["gpus"], "–", "–", "–", "–", "–", "–", "–", "–", "skipped: grid does not divide the shape"]))
            continue
        speedup = peer["step_ms"] / c["step_ms"] if peer and c["gpus"] == world else None
        lines.append(_row([c["case"], c["gpus"], f"{c['fwd_ms']:.2f}", f"{c['bwd_ms']:.2f}", f"{c['step_ms']:.2f}",
                           f"{c['tflops_per_gpu']:.0f}", f"{100 * c['mfu']:.1f}%", f"{c['peak_GiB']:.2f}",
                           f"{speedup:.3f}×" if speedup else "–", f"{c['out_rel_err_vs_dense']:.1e}",
                           f"{c['loss_rel_diff_vs_peer']:.1e}"]))
    return "\n".join(lines)


def hardware_line(data: dict) -> str:
    hw, meta = data["hardware"], data["meta"]
    parts = [f"{meta['device']} ×{meta['world']}, torch {meta['torch']}, NCCL {meta['nccl']}, {meta['date'][:16]}Z, commit {meta['commit'] or '?'}",
             f"matmul {hw['matmul_tflops']:.0f} TFLOP/s, copy {hw['copy_GBps']:.0f} GB/s"]
    for g, ops in hw["collectives"].items():
        parts.append(f"groups of {g}: " + ", ".join(f"{op} {v['busbw_GBps']:.0f} GB/s + {v['latency_us']:.0f} µs" for op, v in ops.items()))
    return "; ".join(parts)


def _best(cases: list[dict], kind: str, world: int) -> dict | None:
    timed = [c for c in cases if c["kind"] == kind and c["gpus"] == world and c["dp"] == 1 and not c["variant"] and "step_ms" in c]
    return min(timed, key=lambda c: c["step_ms"], default=None)


def scaling_tables(datas: list[dict]) -> str:
    """Strong scaling on each main shape and weak scaling (hidden grows with √GPUs), 1-D vs best 3-D."""
    out = []
    main_shapes = sorted({name for d in datas for name, b in d["results"].items() if b["main"]})
    header = [_row(["method", "# GPUs", "batch", "hidden", "fwd (ms)", "bwd (ms)", "avg step per sequence (ms)", "grid"]), _row(["---"] * 8)]
    for name in main_shapes:
        out += [f"\nStrong scaling, {name}:\n"] + header
        for kind, label in (("tp1d", "1-D"), ("3d", "3-D")):
            for d in sorted(datas, key=lambda d: d["meta"]["world"]):
                if name in d["results"]:
                    out.append(_scaling_row(d, d["results"][name], kind, label))
    out += ["\nWeak scaling (hidden ∝ √GPUs, s=2048, b=8, 4 layers):\n"] + header
    for kind, label in (("tp1d", "1-D"), ("3d", "3-D")):
        for d in sorted(datas, key=lambda d: d["meta"]["world"]):
            world = d["meta"]["world"]
            block = next((b for b in d["results"].values() if b["shape"]["h"] == WEAK.get(world) and b["shape"]["b"] == 8), None)
            if block is not None:
                out.append(_scaling_row(d, block, kind, label))
    return "\n".join(out)


def _scaling_row(d: dict, block: dict, kind: str, label: str) -> str:
    world = d["meta"]["world"]
    best = _best(block["cases"], kind, world)
    shape = block["shape"]
    if best is None:
        return _row([label, world, shape["b"], shape["h"], "–", "–", "–", "–"])
    grid = f"TP={world}" if kind == "tp1d" else "x".join(map(str, best["grid"]))
    return _row([label, world, shape["b"], shape["h"], f"{best['fwd_ms']:.1f}", f"{best['bwd_ms']:.1f}",
                 f"{best['step_ms'] / shape['b']:.2f}", grid])


def tables(paths: list[str]) -> str:
    datas = [_load(p) for p in paths]
    out = []
    for d in datas:
        out.append(f"\n### {d['meta']['world']} GPU(s)\n\n{hardware_line(d)}\n")
        if d["checks"]:
            worst = max(c["max_rel_err"] for c in d["checks"])
            bad = [c["case"] for c in d["checks"] if not c["ok"]]
            out.append(f"Correctness (float32, TF32 off, vs float64 dense, {len(d['checks'])} grids): max rel err {worst:.1e}"
                       + (f", FAILED on {bad}" if bad else ", all below 1e-4") + "\n")
        for name in d["results"]:
            out.append(f"\n{name}:\n\n{case_table(d, name)}\n")
    out.append(scaling_tables(datas))
    return "\n".join(out)


if __name__ == "__main__":
    print(tables(sys.argv[1:]))
