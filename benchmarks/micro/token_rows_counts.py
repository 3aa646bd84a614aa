"""Token rows at batch 1, counted without a GPU: bytes each rank keeps for backward and sends per step.

On a gloo world of 8 CPU processes, each grid of ``--grids`` (dp fills the world) trains one
forward and backward of a small ``GPT3D`` (``--hidden`` wide, real ``--seq`` length, float32) on
one sequence per replica, which whole-sequence rows cannot split on any grid but 1×1×1: every
other grid runs on token rows. Per rank:

- ``saved``: the bytes autograd keeps for backward (``torch.autograd.graph.saved_tensors_hooks``,
  each storage once, parameters left out), against ``1/P`` of 1×1×1's plus the keys and values
  each layer gathers over the x·z plane and keeps (``L · 2 · s · kv_width/py`` elements);
- ``sent``: the bytes of the all-gathers and reduce-scatters (``benchmarks/comm_bytes.py``),
  against :func:`lightning_3d.cost.sent_bytes` of the same shape (its all-reduces, a few values a
  token, are left out of both).

    python -m torch.distributed.run --standalone --nproc_per_node 8 benchmarks/micro/token_rows_counts.py --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: comm_bytes

from comm_bytes import SentBytes  # noqa: E402

from lightning_3d import cost, destroy_grid, init_grid  # noqa: E402
from lightning_3d.models import GPT3D, GPTConfig  # noqa: E402


class SavedBytes:
    """Bytes of the tensors autograd saves inside the context, each storage once, parameters left out."""

    def __init__(self, parameters):
        self.skip = {p.untyped_storage().data_ptr() for p in parameters}
        self.seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.skip:
            self.seen[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def count(shape: tuple[int, int, int], config: GPTConfig, batch: int, seq: int) -> dict:
    """One forward and backward of ``batch`` sequences a replica on ``shape`` (dp the rest of the world):
    saved and sent bytes, this rank's."""
    grid = init_grid(shape)
    torch.manual_seed(0)
    model = GPT3D(config, grid)
    ids = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    saved = SavedBytes(model.parameters())
    with SentBytes() as sent:
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
    rows = model.token_rows(batch, seq, ids.device)
    destroy_grid(grid)
    return {
        "grid": list(shape),
        "token_rows": rows is not None,
        "saved_bytes": saved.total,
        "sent_bytes": {
            kind: sum(b for (k, _), b in sent.by_kind.items() if k == kind)
            for kind in ("all_gather", "reduce_scatter")
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument(
        "--batch", type=int, default=1, help="sequences a replica (4: whole-sequence rows on 2×2×2)"
    )
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--grids", default="1x1x1,2x1x1,2x2x1,2x2x2")
    p.add_argument("--out", default=None, help="a folder for token_rows_counts.json")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    config = GPTConfig(
        vocab_size=128,
        block_size=args.seq,
        n_layer=args.layers,
        n_head=4,
        n_kv_head=2,
        n_embd=args.hidden,
        ffn_hidden=2 * args.hidden,
        style="llama",
        tie_embeddings=False,
    )
    shapes = [tuple(int(n) for n in g.split("x")) for g in args.grids.split(",")]
    results = [count(shape, config, args.batch, args.seq) for shape in shapes]
    model_shape = cost.ModelShape.of(config, batch=args.batch, seq=args.seq)
    base = results[0]["saved_bytes"]
    for r in results:
        px, py, pz = r["grid"]
        cube = px * py * pz
        kv = (
            args.layers * 2 * args.seq * config.n_kv_head * config.head_dim // py * 4
            if r["token_rows"]
            else 0
        )
        r["saved_expected"] = base / cube + kv
        r["saved_ratio"] = r["saved_bytes"] / r["saved_expected"]
        predicted = cost.sent_bytes(model_shape, tuple(r["grid"]), element_bytes=4)
        r["sent_predicted"] = {k: predicted[k] for k in r["sent_bytes"]}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        report = {
            "batch": args.batch,
            "seq": args.seq,
            "hidden": args.hidden,
            "layers": args.layers,
            "ranks": gathered,
        }
        for r in gathered[0]:
            print(
                f"{'×'.join(map(str, r['grid']))}: token rows {r['token_rows']}, saved {r['saved_bytes'] / 2**20:.2f} "
                f"MiB ({r['saved_ratio']:.3f} of 1/P + K/V), sent {r['sent_bytes']} predicted {r['sent_predicted']}"
            )
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            Path(args.out, "token_rows_counts.json").write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
