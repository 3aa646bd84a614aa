"""The cost model (``lightning_3d.planner``) against every point ``bench_gpt.py`` measured.

``python benchmarks/check_planner.py bench_w1.json bench_w2.json bench_w4.json`` prints, per
timed case (variants excluded, except ``async-tp``, predicted as collective matmuls), the measured and predicted step time and peak memory and their
relative errors, with each file's own measured machine rates; exits 1 if a step time is off by
more than ``--tol`` (default 15%).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_3d import planner  # noqa: E402


def predict(case: dict, shape: planner.ModelShape, machine: planner.Machine) -> planner.Prediction:
    if case["kind"] == "dense":
        return planner.predict_1d(shape, 1, 1, machine)
    if case["kind"] == "tp1d":
        return planner.predict_1d(shape, case["grid"][0], case["dp"], machine, anchor=True)
    return planner.predict_3d(shape, tuple(case["grid"]), case["dp"], machine, async_tp=case["variant"] == "async-tp")


def rows(paths: list[str]) -> list[dict]:
    out = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        machine = planner.Machine.from_bench(data["hardware"])
        for block in data["results"].values():
            s = block["shape"]
            shape = planner.ModelShape(s["h"], s["heads"], s["s"], s["b"], s["layers"])
            for case in block["cases"]:
                if "step_ms" not in case or case["variant"] not in ("", "async-tp"):
                    continue
                p = predict(case, shape, machine)
                out.append({"world": data["meta"]["world"], "shape": f"h{s['h']} b{s['b']} L{s['layers']}", "case": case["case"],
                            "step_ms": case["step_ms"], "pred_ms": p.step_ms, "step_err": p.step_ms / case["step_ms"] - 1,
                            "peak_GiB": case["peak_GiB"], "pred_GiB": p.memory_GiB, "mem_err": p.memory_GiB / case["peak_GiB"] - 1})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--tol", type=float, default=0.15)
    args = parser.parse_args()
    table = rows(args.files)
    print("| GPUs | shape | case | step ms | predicted | error | peak GiB | predicted | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['world']} | {r['shape']} | {r['case']} | {r['step_ms']:.1f} | {r['pred_ms']:.1f} | {100 * r['step_err']:+.1f}% "
              f"| {r['peak_GiB']:.2f} | {r['pred_GiB']:.2f} | {100 * r['mem_err']:+.1f}% |")
    worst_t = max(abs(r["step_err"]) for r in table)
    worst_m = max(abs(r["mem_err"]) for r in table)
    print(f"\n{len(table)} points: worst step-time error {100 * worst_t:.1f}%, worst memory error {100 * worst_m:.1f}%")
    sys.exit(0 if worst_t <= args.tol else 1)


if __name__ == "__main__":
    main()
