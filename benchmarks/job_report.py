"""Tables of ``train_job.py`` results: ``python benchmarks/job_report.py DIR/job_*.json``.

One table per file (one model, one GPU count, one link setting, one call): every case with its
step time, tokens/s, MFU, peak memory and first losses, and its speed against the fastest peer
and the fastest 3-D case of the same file. Compare only rows of one file: they ran in the same
call on the same machine.
"""

from __future__ import annotations

import json
import sys


def _is_peer(case: dict) -> bool:
    return not case["case"].startswith("3d ")


def table(path: str) -> str:
    with open(path) as f:
        data = json.load(f)
    meta, cases = data["meta"], data["cases"]
    ran = [c for c in cases if "step_ms" in c]
    peers = [c for c in ran if _is_peer(c)]
    best_peer = min(peers, key=lambda c: c["step_ms"]) if peers else None
    best_3d = min((c for c in ran if not _is_peer(c)), key=lambda c: c["step_ms"], default=None)
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


def main() -> None:
    print("\n\n".join(table(p) for p in sys.argv[1:]))


if __name__ == "__main__":
    main()
