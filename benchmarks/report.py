"""Tables of ``train_job.py`` results: ``python benchmarks/job_report.py DIR/job_*.json``.

One table per file (one model, one GPU count, one link setting, one call): every case with its
step time, tokens/s, MFU, peak memory and first losses, and its speed against the fastest peer
and the fastest 3-D case of the same file. Compare only rows of one file: they ran in the same
call on the same machine.

``--repeats FILES`` (the same job in several processes, e.g. ``run_job.sh repeat``): each case's
median step over every time it ran, with its range, and the best 3-D case's median against the
best peer's: steps of one case moved by up to 30% between processes at GPT-2 1.4B on 4 GPUs, so
one process's ratio is not a result.

``--largest FILES`` (runs of one model at two or more ``--layers``): for each case, the peak
memory as a line in the layer count (parameters, gradients, optimizer state and activations grow
by a fixed amount a layer) and the most layers whose predicted peak fits in ``USABLE`` of the
GPU's memory (the rest is the CUDA context, NCCL's buffers and the allocator's slack).
"""

from __future__ import annotations

import json
import statistics
import sys


def _is_peer(label: str) -> bool:
    return not label.startswith("3d ")


def table(path: str) -> str:
    with open(path) as f:
        data = json.load(f)
    meta, cases = data["meta"], data["cases"]
    ran = [c for c in cases if "step_ms" in c]
    peers = [c for c in ran if _is_peer(c["case"])]
    best_peer = min(peers, key=lambda c: c["step_ms"]) if peers else None
    best_3d = min((c for c in ran if not _is_peer(c["case"])), key=lambda c: c["step_ms"], default=None)
    head = (f"{meta['model']} ({meta['params'] / 1e9:.2f}B parameters), {meta['world']} GPU(s), {meta['links']}: "
            f"{meta['device']}, torch {meta['torch']}, {meta['date']}, {meta['commit']}; batch {meta['batch']}×{meta['seq']}, "
            f"matmul {meta['matmul_tflops']:.0f} TFLOP/s; median of {meta['steps']} steps after {meta['warmup']}")
    lines = [head, "", "| case | step ms | tokens/s | MFU | peak GiB | losses, steps 1–3 | vs best peer |", "|---|---|---|---|---|---|---|"]
    for c in cases:
        if "step_ms" not in c:
            lines.append(f"| {c['case']} | {c.get('error', '')[:90]} | | | | | |")
            continue
        name = c["case"] + (f" (= {c['picks']})" if "picks" in c else "")
        ratio = f"{best_peer['step_ms'] / c['step_ms']:.2f}×" if best_peer else "–"
        bold = "**" if c is best_peer or c is best_3d else ""
        losses = " ".join(f"{v:.4f}" for v in c["losses"])
        lines.append(f"| {bold}{name}{bold} | {c['step_ms']:.1f} | {c['tokens_per_s']:,.0f} | {c['mfu']:.1%} | {c['peak_GiB']:.2f} | {losses} | {ratio} |")
    return "\n".join(lines)


def repeats(paths: list[str]) -> str:
    """Per case, the median, least and most of its step times over ``paths``; the medians' best ratio."""
    steps: dict[str, list[float]] = {}
    for path in paths:
        with open(path) as f:
            for c in json.load(f)["cases"]:
                if "step_ms" in c:
                    steps.setdefault(c["case"], []).append(c["step_ms"])
    median = {case: statistics.median(ms) for case, ms in steps.items()}
    lines = ["| case | runs | median step ms | least | most |", "|---|---|---|---|---|"]
    lines += [f"| {case} | {len(ms)} | {median[case]:.1f} | {min(ms):.1f} | {max(ms):.1f} |" for case, ms in steps.items()]
    ours = [case for case in steps if not _is_peer(case)]
    peers = [case for case in steps if _is_peer(case)]
    if ours and peers:
        best, peer = min(ours, key=median.get), min(peers, key=median.get)
        lines += ["", f"best 3-D {best} against best peer {peer}, medians: {median[peer] / median[best]:.2f}×"]
    return "\n".join(lines)


USABLE = 0.92


def largest(paths: list[str]) -> str:
    """The most layers each case trains, extrapolated linearly from its peaks at the measured layer counts."""
    points: dict[str, list[tuple[int, float]]] = {}
    failed: dict[str, list[int]] = {}
    capacity = None
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        layers, capacity = data["meta"]["config"]["n_layer"], data["meta"]["gpu_GiB"]
        for c in data["cases"]:
            if "peak_GiB" in c:
                points.setdefault(c["case"], []).append((layers, c["peak_GiB"]))
            else:
                failed.setdefault(c["case"], []).append(layers)
    lines = [f"GPU memory {capacity:.1f} GiB, {USABLE:.0%} usable", "",
             "| case | measured (layers: peak GiB) | GiB a layer | most layers |", "|---|---|---|---|"]
    for case, pts in sorted(points.items()):
        pts = sorted(pts)
        measured = ", ".join(f"{n}: {g:.2f}" for n, g in pts) + "".join(f", {n}: failed" for n in failed.get(case, []))
        if len(pts) < 2:
            lines.append(f"| {case} | {measured} | – | – |")
            continue
        (n0, g0), (n1, g1) = pts[0], pts[-1]
        per_layer = (g1 - g0) / (n1 - n0)
        most = int((USABLE * capacity - (g0 - per_layer * n0)) // per_layer)
        lines.append(f"| {case} | {measured} | {per_layer:.2f} | {most} |")
    for case in sorted(set(failed) - set(points)):
        lines.append(f"| {case} | {', '.join(f'{n}: failed' for n in failed[case])} | – | fewer than {min(failed[case])} |")
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == ["--largest"]:
        print(largest(sys.argv[2:]))
        return
    if sys.argv[1:2] == ["--repeats"]:
        print(repeats(sys.argv[2:]))
        return
    print("\n\n".join(table(p) for p in sys.argv[1:]))


if __name__ == "__main__":
    main()
