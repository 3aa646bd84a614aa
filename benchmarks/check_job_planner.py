"""The whole-job cost model (``lightning_3d.planner.predict_job``) against every ``3d`` case ``train_job.py`` measured.

``python benchmarks/check_job_planner.py job_w4_llama-7b_nvlink.json ...`` prints, per measured
``3d`` case, the measured and predicted step time and peak memory and their relative errors, each
file priced with its own machine: the one ``train_job.py`` measured (``meta["machine"]``), or for
files from before it measured links :data:`~lightning_3d.planner.DEFAULT_MACHINE` with the file's
matmul rate, or ``--machine LINKS=FILE``: the rates (``Machine.rates()`` JSON) measured on the
files' host for its LINKS (``nvlink``, ``p2p-off``) when the files record none. Files with
``NCCL_P2P_DISABLE=1`` and no measured machine are skipped unless ``--p2p-off-busbw`` gives an
assumed bus bandwidth for every collective (a sanity check, not a measurement). Also prints, per
file, the model's pick among the measured grids against the measured fastest. Exits 1 if a step
time is off by more than ``--tol`` (default 15%).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_3d import cost as planner  # noqa: E402

P2P_OFF_LATENCY_US = 50.0  # with an assumed bus bandwidth: small collectives through host memory


def shape_of(meta: dict) -> planner.ModelShape:
    """The job's model (``meta["config"]``, a ``GPTConfig``) on its global batch."""
    c = meta["config"]
    return planner.ModelShape(c["n_embd"], c["n_head"], meta["seq"], meta["batch"], c["n_layer"], c["ffn_hidden"],
                              kv_heads=c.get("n_kv_head"), gated=c["style"] == "llama", vocab=c["vocab_size"])


def machine_of(meta: dict, p2p_off_busbw: float | None, measured: dict[str, dict] | None = None) -> planner.Machine | None:
    """The file's measured machine, or the one ``measured`` holds for its links; else the default with
    its matmul rate (None: P2P off, nothing measured or assumed)."""
    rates = meta.get("machine") or (measured or {}).get(meta.get("links", "nvlink"))
    if rates:
        return planner.Machine.from_rates(rates)
    m = replace(planner.DEFAULT_MACHINE, matmul_tflops=meta["matmul_tflops"], gpus_per_node=meta["world"])
    if meta.get("links") != "p2p-off":
        return m
    if p2p_off_busbw is None:
        return None
    slow = planner.Link(p2p_off_busbw, P2P_OFF_LATENCY_US)
    return replace(m, intra={op: {g: slow for g in table} for op, table in m.intra.items()})


def rows(paths: list[str], p2p_off_busbw: float | None = None, measured: dict[str, dict] | None = None) -> tuple[list[dict], list[str]]:
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
            p = planner.predict_job(shape, tuple(method["grid"]), method["dp"], machine, async_tp=method["async_tp"],
                                    compiled=method.get("compile", False), save_gathered=method.get("save_gathered", True),
                                    half_grads=method.get("half_grads", False), grads_at_end=method.get("grads_at_end", False))
            out.append({"file": path, "links": meta.get("links", ""), "model": meta["model"], "world": meta["world"],
                        "variant": " ".join(w for w in case["case"].split()[1:] if "x" not in w and not w.startswith("dp")),
                        "case": case["case"], "step_ms": case["step_ms"], "pred_ms": p.step_ms, "step_err": p.step_ms / case["step_ms"] - 1,
                        "peak_GiB": case["peak_GiB"], "pred_GiB": p.memory_GiB, "mem_err": p.memory_GiB / case["peak_GiB"] - 1})
    return out, skipped


def short(path: str) -> str:
    return os.path.join(os.path.basename(os.path.dirname(path)), os.path.basename(path))


def choices(table: list[dict]) -> list[dict]:
    """Per file and variant (the case's words besides the grid: ``async``, ``compile``, ...) with two or
    more grids measured: the case the model predicts fastest against the measured fastest."""
    groups: dict[tuple[str, str], dict[str, dict]] = {}
    for r in table:
        if r["variant"].split()[:1] != ["auto"]:  # "3d auto" repeats a measured grid
            cases = groups.setdefault((r["file"], r["variant"]), {})
            if r["case"] not in cases or r["step_ms"] < cases[r["case"]]["step_ms"]:  # a case measured twice: its warm run
                cases[r["case"]] = r
    out = []
    for (path, variant), by_case in groups.items():
        rows = list(by_case.values())
        if len(rows) > 1:
            pick, best = min(rows, key=lambda r: r["pred_ms"]), min(rows, key=lambda r: r["step_ms"])
            out.append({"file": path, "variant": variant, "pick": pick["case"], "pick_ms": pick["step_ms"], "best": best["case"],
                        "best_ms": best["step_ms"], "loss": pick["step_ms"] / best["step_ms"] - 1})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--tol", type=float, default=0.15)
    parser.add_argument("--p2p-off-busbw", type=float, default=None,
                        help="GB/s assumed for every collective of P2P-off files without a measured machine (sanity check)")
    parser.add_argument("--machine", action="append", default=[], metavar="LINKS=FILE",
                        help="Machine.rates() JSON measured on the files' host, for files of these links that record none")
    args = parser.parse_args()
    measured = {}
    for spec in args.machine:
        links, _, path = spec.partition("=")
        with open(path) as f:
            measured[links] = json.load(f)
    table, skipped = rows(args.files, args.p2p_off_busbw, measured)
    print("| file | GPUs | links | model | case | step ms | predicted | error | peak GiB | predicted | error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {short(r['file'])} | {r['world']} | {r['links']} | {r['model']} | {r['case']} | {r['step_ms']:.1f} | {r['pred_ms']:.1f} "
              f"| {100 * r['step_err']:+.1f}% | {r['peak_GiB']:.2f} | {r['pred_GiB']:.2f} | {100 * r['mem_err']:+.1f}% |")
    for path in skipped:
        print(f"\nskipped {path}: P2P off and no measured machine (give --p2p-off-busbw to assume one)")
    if not table:
        sys.exit(f"no measured 3d case in {len(args.files)} file(s)")
    print("\n| file | variant | model's pick | measured ms | measured fastest | ms | pick's loss |")
    print("|---|---|---|---|---|---|---|")
    for c in choices(table):
        print(f"| {short(c['file'])} | {c['variant'] or '(eager)'} | {c['pick']} | {c['pick_ms']:.1f} | {c['best']} | {c['best_ms']:.1f} "
              f"| {100 * c['loss']:+.1f}% |")
    worst_t = max(table, key=lambda r: abs(r["step_err"]))
    worst_m = max(table, key=lambda r: abs(r["mem_err"]))
    print(f"\n{len(table)} points: worst step-time error {100 * worst_t['step_err']:+.1f}% ({worst_t['case']}, {worst_t['file']}), "
          f"worst memory error {100 * worst_m['mem_err']:+.1f}% ({worst_m['case']}, {worst_m['file']})")
    sys.exit(0 if abs(worst_t["step_err"]) <= args.tol else 1)


if __name__ == "__main__":
    main()
