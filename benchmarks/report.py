"""The benchmark's report: ``python benchmarks/report.py DIR/job_*.json`` (tables of ``train_job.py`` results).

One table per file (one model, one GPU count, one link setting, one call): every case with its
step time, tokens/s, MFU, peak memory and first losses, and its speed against the fastest peer
and the fastest 3-D case of the same file. Compare only rows of one file: they ran in the same
call on the same machine.

``--repeats FILES`` (the same job in several processes, as ``launch.py`` runs it): each case's
median step time, tokens/s, MFU and peak memory over every time it ran, with the step's range, and
the best 3-D case's median against the best peer's: steps of one case moved by up to 30% between
processes at GPT-2 1.4B on 4 GPUs, so one process's ratio is not a result.

``--largest FILES`` (runs of one model at two or more ``--layers``): for each case, the peak
memory as a line in the layer count (parameters, gradients, optimizer state and activations grow
by a fixed amount a layer) and the most layers whose predicted peak fits in ``USABLE`` of the
GPU's memory (the rest is the CUDA context, NCCL's buffers and the allocator's slack).

``--planner FILES``: the cost model (:func:`lightning_3d.cost.predict_job`) against every measured
``3d`` case: measured and predicted step time and peak memory, each file priced with the machine
it measured (``meta["machine"]``; files from before that: ``DEFAULT_MACHINE`` at the file's matmul
rate, or ``--machine LINKS=FILE``, or with P2P off ``--p2p-off-busbw``), and per file the model's
pick among the measured grids against the measured fastest; exits 1 past ``--tol`` (15%).

``--bytes FILES`` (runs with ``--count-bytes``): the bytes each case's ranks sent in a step, by
collective, and the cost model's prediction of them: for 3-D cases, and for the peers whose
algorithm a 3-D grid runs (FSDP2 without resharding: P×1×1; DDP: 1×1×1 with dp P).

``--standings FILES``: one table per model, GPU count and link setting: every method's median
tokens/s, MFU and peak memory over the files (processes) that ran it, its ratio to the best peer's
median, and the runs, card, date and commit they came from (what ``docs/benchmarks.md`` shows).

``--plot OUT.svg FILES``: tokens/s per method and GPU count, one panel per model (the best case of
each method in each file, the median over files of one model and GPU count); an SVG written here,
no plotting library needed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_3d import cost  # noqa: E402
from lightning_3d.models import GPTConfig  # noqa: E402


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
    head = (
        f"{meta['model']} ({meta['params'] / 1e9:.2f}B parameters), {meta['world']} GPU(s), {meta['links']}: "
        f"{meta['device']}, torch {meta['torch']}, {meta['date']}, {meta['commit']}; batch "
        f"{meta['batch']}×{meta['seq']}, "
        f"matmul {meta['matmul_tflops']:.0f} TFLOP/s; median of {meta['steps']} steps after {meta['warmup']}"
    )
    lines = [
        head,
        "",
        "| case | step ms | tokens/s | MFU | peak GiB | losses, steps 1–3 | vs best peer |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        if "step_ms" not in c:
            lines.append(f"| {c['case']} | {c.get('error', '')[:90]} | | | | | |")
            continue
        name = c["case"] + (f" (= {c['picks']})" if "picks" in c else "")
        ratio = f"{best_peer['step_ms'] / c['step_ms']:.2f}×" if best_peer else "–"
        bold = "**" if c is best_peer or c is best_3d else ""
        losses = " ".join(f"{v:.4f}" for v in c["losses"])
        lines.append(
            f"| {bold}{name}{bold} | {c['step_ms']:.1f} | {c['tokens_per_s']:,.0f} | {c['mfu']:.1%} | "
            f"{c['peak_GiB']:.2f} | {losses} | {ratio} |"
        )
    return "\n".join(lines)


def repeats(paths: list[str]) -> str:
    """Per case, over ``paths``: its runs, the median step time (and its least and most), tokens/s, MFU
    and peak memory; and the best 3-D case's median against the best peer's."""
    runs: dict[str, list[dict]] = {}
    for path in paths:
        with open(path) as f:
            for c in json.load(f)["cases"]:
                if "step_ms" in c:
                    runs.setdefault(c["case"], []).append(c)
    median = {case: statistics.median(c["step_ms"] for c in cs) for case, cs in runs.items()}
    lines = [
        "| case | runs | median step ms | least | most | tokens/s | MFU | peak GiB (least–most) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case, cs in runs.items():
        ms, peaks = [c["step_ms"] for c in cs], [c["peak_GiB"] for c in cs]
        tokens = statistics.median(c.get("tokens_per_s", 0.0) for c in cs)
        mfu = statistics.median(c.get("mfu", 0.0) for c in cs)
        lines.append(
            f"| {case} | {len(ms)} | {median[case]:.1f} | {min(ms):.1f} | {max(ms):.1f} | {tokens:,.0f} | {mfu:.1%} "
            f"| {statistics.median(peaks):.2f} ({min(peaks):.2f}–{max(peaks):.2f}) |"
        )
    ours = [case for case in runs if not _is_peer(case)]
    peers = [case for case in runs if _is_peer(case)]
    if ours and peers:
        best, peer = min(ours, key=median.get), min(peers, key=median.get)
        lines += [
            "",
            f"best 3-D {best} against best peer {peer}, medians: {median[peer] / median[best]:.2f}×",
        ]
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
    lines = [
        f"GPU memory {capacity:.1f} GiB, {USABLE:.0%} usable",
        "",
        "| case | measured (layers: peak GiB) | GiB a layer | most layers |",
        "|---|---|---|---|",
    ]
    for case, pts in sorted(points.items()):
        pts = sorted(pts)
        measured = ", ".join(f"{n}: {g:.2f}" for n, g in pts) + "".join(
            f", {n}: failed" for n in failed.get(case, [])
        )
        if len(pts) < 2:
            lines.append(f"| {case} | {measured} | – | – |")
            continue
        (n0, g0), (n1, g1) = pts[0], pts[-1]
        per_layer = (g1 - g0) / (n1 - n0)
        most = int((USABLE * capacity - (g0 - per_layer * n0)) // per_layer)
        lines.append(f"| {case} | {measured} | {per_layer:.2f} | {most} |")
    for case in sorted(set(failed) - set(points)):
        lines.append(
            f"| {case} | {', '.join(f'{n}: failed' for n in failed[case])} | – | fewer than {min(failed[case])} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------ the cost model against the runs

P2P_OFF_LATENCY_US = 50.0  # with an assumed bus bandwidth: small collectives through host memory


def shape_of(meta: dict) -> cost.ModelShape:
    """The job's model (``meta["config"]``, a ``GPTConfig``) on its global batch."""
    return cost.ModelShape.of(GPTConfig(**meta["config"]), meta["batch"], meta["seq"])


def machine_of(
    meta: dict, p2p_off_busbw: float | None, measured: dict[str, dict] | None = None
) -> cost.Machine | None:
    """The file's measured machine, or the one ``measured`` holds for its links; else the default with
    its matmul rate (None: P2P off, nothing measured or assumed)."""
    rates = meta.get("machine") or (measured or {}).get(meta.get("links", "nvlink"))
    if rates:
        return cost.Machine.from_rates(rates)
    m = replace(cost.DEFAULT_MACHINE, matmul_tflops=meta["matmul_tflops"], gpus_per_node=meta["world"])
    if meta.get("links") != "p2p-off":
        return m
    if p2p_off_busbw is None:
        return None
    slow = cost.Link(p2p_off_busbw, P2P_OFF_LATENCY_US)
    return replace(m, intra={op: {g: slow for g in table} for op, table in m.intra.items()})


def planner_points(
    paths: list[str], p2p_off_busbw: float | None = None, measured: dict[str, dict] | None = None
) -> tuple[list[dict], list[str]]:
    """Per measured ``3d`` case: measured and predicted step ms and peak GiB, errors; and the files skipped.
    ``measured``: links (``nvlink``, ``p2p-off``) → ``Machine.rates()`` for files that record no machine."""
    out, skipped = [], []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        meta = data["meta"]
        machine = machine_of(meta, p2p_off_busbw, measured)
        if machine is None:
            skipped.append(path)
            continue
        shape = shape_of(meta)
        for case in data["cases"]:
            method = case.get("method")
            if not method or method["kind"] != "3d" or "step_ms" not in case or method.get("checkpointing"):
                continue
            p = cost.predict_job(
                shape,
                tuple(method["grid"]),
                method["dp"],
                machine,
                async_tp=method["async_tp"],
                compiled=method.get("compile", False),
                save_gathered=method.get("save_gathered", True),
                half_grads=method.get("half_grads", False),
                grads_at_end=method.get("grads_at_end", False),
            )
            out.append(
                {
                    "file": path,
                    "links": meta.get("links", ""),
                    "model": meta["model"],
                    "world": meta["world"],
                    "variant": " ".join(
                        w for w in case["case"].split()[1:] if "x" not in w and not w.startswith("dp")
                    ),
                    "case": case["case"],
                    "step_ms": case["step_ms"],
                    "pred_ms": p.step_ms,
                    "step_err": p.step_ms / case["step_ms"] - 1,
                    "peak_GiB": case["peak_GiB"],
                    "pred_GiB": p.memory_GiB,
                    "mem_err": p.memory_GiB / case["peak_GiB"] - 1 if case["peak_GiB"] else None,
                }
            )  # no peak on CPU
    return out, skipped


def short(path: str) -> str:
    return os.path.join(os.path.basename(os.path.dirname(path)), os.path.basename(path))


def choices(points: list[dict]) -> list[dict]:
    """Per file and variant (the case's words besides the grid: ``async``, ``compile``, ...) with two or
    more grids measured: the case the model predicts fastest against the measured fastest."""
    groups: dict[tuple[str, str], dict[str, dict]] = {}
    for r in points:
        if r["variant"].split()[:1] != ["auto"]:  # "3d auto" repeats a measured grid
            cases = groups.setdefault((r["file"], r["variant"]), {})
            if (
                r["case"] not in cases or r["step_ms"] < cases[r["case"]]["step_ms"]
            ):  # a case measured twice: its warm run
                cases[r["case"]] = r
    out = []
    for (path, variant), by_case in groups.items():
        measured = list(by_case.values())
        if len(measured) > 1:
            pick, best = min(measured, key=lambda r: r["pred_ms"]), min(measured, key=lambda r: r["step_ms"])
            out.append(
                {
                    "file": path,
                    "variant": variant,
                    "pick": pick["case"],
                    "pick_ms": pick["step_ms"],
                    "best": best["case"],
                    "best_ms": best["step_ms"],
                    "loss": pick["step_ms"] / best["step_ms"] - 1,
                }
            )
    return out


def planner(
    paths: list[str], p2p_off_busbw: float | None = None, measured: dict[str, dict] | None = None
) -> tuple[str, float]:
    """The planner check's tables (every point, the picks) and the worst step-time error."""
    points, skipped = planner_points(paths, p2p_off_busbw, measured)
    if not points:
        raise SystemExit(f"no measured 3d case in {len(paths)} file(s)")
    lines = [
        "| file | GPUs | links | model | case | step ms | predicted | error | peak GiB | predicted | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {short(r['file'])} | {r['world']} | {r['links']} | {r['model']} | {r['case']} | "
        f"{r['step_ms']:.1f} | {r['pred_ms']:.1f} "
        f"| {100 * r['step_err']:+.1f}% | {r['peak_GiB']:.2f} | {r['pred_GiB']:.2f} | "
        + ("–" if r["mem_err"] is None else f"{100 * r['mem_err']:+.1f}%")
        + " |"
        for r in points
    ]
    lines += [
        f"\nskipped {path}: P2P off and no measured machine (give --p2p-off-busbw to assume one)"
        for path in skipped
    ]
    lines += [
        "",
        "| file | variant | model's pick | measured ms | measured fastest | ms | pick's loss |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {short(c['file'])} | {c['variant'] or '(eager)'} | {c['pick']} | {c['pick_ms']:.1f} | "
        f"{c['best']} | {c['best_ms']:.1f} "
        f"| {100 * c['loss']:+.1f}% |"
        for c in choices(points)
    ]
    worst_t = max(points, key=lambda r: abs(r["step_err"]))
    lines.append(
        f"\n{len(points)} points: worst step-time error {100 * worst_t['step_err']:+.1f}% "
        f"({worst_t['case']}, {worst_t['file']})"
    )
    with_peaks = [r for r in points if r["mem_err"] is not None]
    if with_peaks:
        worst_m = max(with_peaks, key=lambda r: abs(r["mem_err"]))
        lines[-1] += (
            f", worst memory error {100 * worst_m['mem_err']:+.1f}% ({worst_m['case']}, {worst_m['file']})"
        )
    return "\n".join(lines), abs(worst_t["step_err"])


# ------------------------------------------------------------------ bytes sent


SAME_ALGORITHM = {
    "fsdp2 noreshard": "FSDP2 without resharding: each weight gathered once, its gradient scattered once, as P×1×1",
    "ddp": "DDP: the gradients all-reduced, as 1×1×1 with dp P",
}


def predicted_bytes(case: dict, meta: dict) -> dict | None:
    """The cost model's bytes a rank sends for a 3-D case (recorded by ``--count-bytes``), and for the
    peers whose algorithm a 3-D grid runs (:data:`SAME_ALGORITHM`) that grid's, at their precision."""
    if "predicted_sent_bytes" in case:
        return case["predicted_sent_bytes"]
    words = case["case"].split()
    key = " ".join(w for w in words if w in ("fsdp2", "noreshard", "ddp"))
    if key not in SAME_ALGORITHM or "ckpt" in words:
        return None
    world, cpu = meta["world"], meta["device"] == "cpu"
    grid, dp = ((world, 1, 1), 1) if key == "fsdp2 noreshard" else ((1, 1, 1), world)
    grads = 2 if "bf16grad" in words else 4
    operands = 4 if cpu else (grads if key == "fsdp2 noreshard" else 2)  # FSDP2 reduces in its reduce_dtype
    return cost.sent_bytes(shape_of(meta), grid, dp, element_bytes=operands, grad_bytes=grads)


def sent_bytes(paths: list[str]) -> str:
    """Per case that counted its collectives (``--count-bytes``): the most any rank sent in a step, by
    collective, and the cost model's prediction (3-D cases; for FSDP2 without resharding and DDP, the
    3-D grid that runs their algorithm) with the ratio of counted to predicted."""
    lines = [
        "| file | case | all-gather MB | reduce-scatter MB | all-reduce MB | other MB | total MB | predicted "
        "MB | counted / predicted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for c in data["cases"]:
            if "sent_bytes_by_rank" not in c:
                continue
            worst = max(c["sent_bytes_by_rank"], key=lambda r: r["total"])
            kinds = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0, "other": 0.0}
            for key, nbytes in worst["by_kind"].items():
                kind = key.split("/")[0]
                kinds[kind if kind in kinds else "other"] += nbytes
            predicted = predicted_bytes(c, data["meta"])
            total_p = sum(predicted.values()) if predicted else None
            lines.append(
                f"| {short(path)} | {c['case']} | "
                + " | ".join(f"{v / 1e6:.3f}" for v in kinds.values())
                + f" | {worst['total'] / 1e6:.3f} | "
                + (f"{total_p / 1e6:.3f} | {worst['total'] / total_p:.3f} |" if total_p else "– | – |")
            )
    return "\n".join(lines)


# ------------------------------------------------------------------ the standings


def standings(paths: list[str]) -> str:
    """Per (model, GPUs, links): each case's medians over the files that ran it, against the best peer."""
    groups: dict[tuple[str, int, str], dict[str, list[tuple[dict, dict, str]]]] = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        meta = data["meta"]
        for c in data["cases"]:
            if "tokens_per_s" in c:
                key = (meta["model"], meta["world"], meta.get("links", "nvlink"))
                groups.setdefault(key, {}).setdefault(c["case"], []).append(
                    (c, meta, os.path.basename(os.path.dirname(path)))
                )
    out = []
    for (model, world, links), by_case in sorted(groups.items()):
        tokens = {
            case: statistics.median(c["tokens_per_s"] for c, _, _ in runs) for case, runs in by_case.items()
        }
        peers = [case for case in by_case if _is_peer(case)]
        best_peer = max(peers, key=tokens.get) if peers else None
        out += [
            f"{model}, {world} GPU{'s' if world > 1 else ''}, {links}",
            "",
            "| method | tokens/s | MFU | peak GiB | vs best peer | runs | card | date | commit |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for case in sorted(by_case, key=lambda k: -tokens[k]):
            runs = by_case[case]
            t = [c["tokens_per_s"] for c, _, _ in runs]
            peaks = [c["peak_GiB"] for c, _, _ in runs]
            spread = f" ({min(t):,.0f}–{max(t):,.0f})" if len(t) > 1 else ""
            peak = f"{statistics.median(peaks):.2f}" + (
                f" ({min(peaks):.2f}–{max(peaks):.2f})" if len(set(peaks)) > 1 else ""
            )
            ratio = f"{tokens[case] / tokens[best_peer]:.3f}×" if best_peer else "–"
            metas = [m for _, m, _ in runs]
            name = case + (f" (= {runs[0][0]['picks']})" if "picks" in runs[0][0] else "")
            out.append(
                f"| {name} | {tokens[case]:,.0f}{spread} | "
                f"{statistics.median(c['mfu'] for c, _, _ in runs):.1%} | {peak} | {ratio} "
                f"| {', '.join(sorted({r for _, _, r in runs}))} | {metas[0]['device']} "
                f"| {', '.join(sorted({m['date'][:10] for m in metas}))} | "
                f"{', '.join(sorted({m.get('commit') or '–' for m in metas}))} |"
            )
        out.append("")
    return "\n".join(out)


# ------------------------------------------------------------------ the plot

FAMILIES = (
    ("3-D (best grid)", lambda w: w[0] == "3d"),
    ("FSDP2 no resharding", lambda w: w[0] == "fsdp2" and "noreshard" in w),
    ("FSDP2", lambda w: w[0] == "fsdp2" and "noreshard" not in w),
    ("DDP", lambda w: w[0] == "ddp"),
    ("TP + SP", lambda w: w[0] == "tp-sp"),
    ("FSDP2 × TP", lambda w: w[0] == "fsdp2-tp"),
)
COLOURS = ("#d62728", "#1f77b4", "#6baed6", "#2ca02c", "#9467bd", "#8c564b")


def best_per_method(paths: list[str]) -> dict[str, dict[int, dict[str, float]]]:
    """model → GPUs → method → tokens/s: each method's best case in each file, the median over the
    files of one model and GPU count."""
    seen: dict[tuple[str, int, str], list[float]] = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        meta = data["meta"]
        best: dict[str, float] = {}
        for c in data["cases"]:
            if "tokens_per_s" not in c:
                continue
            family = next((name for name, match in FAMILIES if match(c["case"].split())), None)
            if family:
                best[family] = max(best.get(family, 0.0), c["tokens_per_s"])
        for family, tokens in best.items():
            seen.setdefault((meta["model"], meta["world"], family), []).append(tokens)
    out: dict[str, dict[int, dict[str, float]]] = {}
    for (model, world, family), tokens in seen.items():
        out.setdefault(model, {}).setdefault(world, {})[family] = statistics.median(tokens)
    return out


def plot_svg(paths: list[str], title: str = "") -> str:
    """Grouped bars: tokens/s (thousands) per method at each GPU count, one panel per model."""
    data = best_per_method(paths)
    families = [name for name, _ in FAMILIES if any(name in g for m in data.values() for g in m.values())]
    panel_w, panel_h, top, left, bottom = 360, 220, 40, 50, 40
    width = left + len(data) * (panel_w + 20) + 10
    height = top + panel_h + bottom + 20 * ((len(families) + 2) // 3)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2}" y="16" text-anchor="middle" font-size="13">{title}</text>',
    ]
    for p, (model, by_world) in enumerate(sorted(data.items())):
        x0, y0 = left + p * (panel_w + 20), top
        peak = max(v for g in by_world.values() for v in g.values()) / 1e3
        scale = panel_h / (peak * 1.1)
        out.append(
            f'<text x="{x0 + panel_w / 2}" y="{y0 - 6}" text-anchor="middle" font-size="12">{model}</text>'
        )
        out.append(
            f'<line x1="{x0}" y1="{y0 + panel_h}" x2="{x0 + panel_w}" y2="{y0 + panel_h}" stroke="black"/>'
        )
        out.append(f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y0 + panel_h}" stroke="black"/>')
        for t in range(5):
            v = peak * 1.1 * t / 4
            y = y0 + panel_h - v * scale
            out.append(f'<text x="{x0 - 4}" y="{y + 4:.1f}" text-anchor="end">{v:.0f}</text>')
        worlds = sorted(by_world)
        group_w = panel_w / len(worlds)
        for i, world in enumerate(worlds):
            present = [f for f in families if f in by_world[world]]
            bar_w = (group_w - 16) / max(len(families), 1)
            for j, family in enumerate(families):
                if family not in by_world[world]:
                    continue
                v = by_world[world][family] / 1e3
                x = x0 + i * group_w + 8 + j * bar_w
                out.append(
                    f'<rect x="{x:.1f}" y="{y0 + panel_h - v * scale:.1f}" width="{bar_w - 1:.1f}" '
                    f'height="{v * scale:.1f}" fill="{COLOURS[[n for n, _ in FAMILIES].index(family)]}">'
                    f"<title>{family}: {v:.1f}k tokens/s</title></rect>"
                )
            out.append(
                f'<text x="{x0 + (i + 0.5) * group_w:.1f}" y="{y0 + panel_h + 14}" text-anchor="middle">'
                f"{world} GPU{'s' if world > 1 else ''}{'' if present else ' (none)'}</text>"
            )
        out.append(
            f'<text x="{x0 - 38}" y="{y0 + panel_h / 2}" transform="rotate(-90 {x0 - 38} {y0 + panel_h / 2})" '
            f'text-anchor="middle">thousand tokens/s</text>'
        )
    for k, family in enumerate(families):
        x, y = left + (k % 3) * 200, top + panel_h + bottom + 20 * (k // 3)
        out.append(
            f'<rect x="{x}" y="{y - 9}" width="10" height="10" '
            f'fill="{COLOURS[[n for n, _ in FAMILIES].index(family)]}"/>'
            f'<text x="{x + 14}" y="{y}">{family}</text>'
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument(
        "--repeats",
        action="store_true",
        help="medians and ranges over the files (one job, several processes)",
    )
    what.add_argument(
        "--largest",
        action="store_true",
        help="the most layers each case trains, from runs at several --layers",
    )
    what.add_argument("--planner", action="store_true", help="the cost model against every measured 3d case")
    what.add_argument(
        "--bytes", action="store_true", help="the bytes each case's ranks sent (runs with --count-bytes)"
    )
    what.add_argument(
        "--standings",
        action="store_true",
        help="every method's medians against the best peer, per model, GPUs and links",
    )
    what.add_argument("--plot", metavar="OUT.svg", help="tokens/s per method and GPU count, an SVG")
    parser.add_argument("--title", default="", help="the plot's title")
    parser.add_argument(
        "--tol", type=float, default=0.15, help="--planner: the step-time error past which it exits 1"
    )
    parser.add_argument(
        "--p2p-off-busbw",
        type=float,
        default=None,
        help="--planner: GB/s assumed for every collective of P2P-off files without a measured machine",
    )
    parser.add_argument(
        "--machine",
        action="append",
        default=[],
        metavar="LINKS=FILE",
        help="--planner: Machine.rates() JSON measured on the files' host, for files of these links that record none",
    )
    parser.add_argument("files", nargs="+")
    args = parser.parse_args(argv)
    if args.repeats:
        print(repeats(args.files))
    elif args.largest:
        print(largest(args.files))
    elif args.bytes:
        print(sent_bytes(args.files))
    elif args.standings:
        print(standings(args.files))
    elif args.plot:
        with open(args.plot, "w") as f:
            f.write(plot_svg(args.files, args.title))
    elif args.planner:
        measured = {}
        for spec in args.machine:
            links, _, path = spec.partition("=")
            with open(path) as f:
                measured[links] = json.load(f)
        text, worst = planner(args.files, args.p2p_off_busbw, measured)
        print(text)
        return 0 if worst <= args.tol else 1
    else:
        print("\n\n".join(table(p) for p in args.files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
