"""Rank agreement: one small all-gather that checks that every rank of a group holds the same values.

Ranks that disagree about a grid or a batch shape would enter mismatched collectives, which hang
until the timeout or abort some ranks while others go on. :func:`agree` turns the disagreement into
the same ``ValueError`` on every rank of the group, naming each value and the ranks that hold it.
Values travel as JSON text: nothing received from a peer is unpickled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import torch
import torch.distributed as dist

from . import comm

SAME_BATCH = (
    "every rank of a cube must be given the same batch: shard the data over the dp group only "
    "(grid.group('dp'), as Tensor3DStrategy's sampler does), never over the whole world"
)


def _device(group: dist.ProcessGroup) -> torch.device:
    """Where ``group``'s backend takes tensors: the CPU for gloo, else the current accelerator."""
    if "gloo" in str(dist.get_backend(group)):
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def exchange(values: Mapping[str, object], group: dist.ProcessGroup) -> list[dict[str, str]]:
    """Every rank's ``{name: repr(value)}``, in group-rank order (two all-gathers: lengths, then text)."""
    text = json.dumps({k: repr(v) for k, v in values.items()}).encode()
    if dist.get_world_size(group) == 1:
        return [json.loads(text)]
    device = _device(group)
    lengths, _ = comm.all_gather_dim0(torch.tensor([len(text)], dtype=torch.int64, device=device), group)
    lengths = lengths.tolist()
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    rows, _ = comm.all_gather_dim0(padded.to(device), group)
    rows = rows.view(len(lengths), -1).cpu()
    return [json.loads(bytes(row[:n].tolist())) for row, n in zip(rows, lengths)]


def describe_ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 3, 6]`` → ``"ranks 0-3, 6"``."""
    spans, start = [], ranks[0]
    for prev, r in zip(ranks, ranks[1:] + [None]):
        if r != prev + 1:
            spans.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = r
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(spans)


def require_equal(seen: list[Mapping[str, str]], names, global_ranks: list[int], what: str, fix: str) -> None:
    """Raise, identically on every rank that holds ``seen``, unless all entries agree on ``names``."""
    parts = []
    for name in names:
        holders: dict[str, list[int]] = {}
        for rank, values in zip(global_ranks, seen):
            holders.setdefault(values.get(name, "nothing"), []).append(rank)
        if len(holders) > 1:
            parts.append(f"{name} = " + ", ".join(f"{v} on {describe_ranks(r)}" for v, r in holders.items()))
    if parts:
        raise ValueError(f"{what}: the ranks disagree on " + "; ".join(parts) + f". {fix}")


def agree(values: Mapping[str, object], group: dist.ProcessGroup, what: str, fix: str) -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` unless all ranks passed equal ``values``.

    ``values`` maps names to plain values (ints, bools, strings, tuples of them), compared by their
    ``repr``; every rank must pass the same names. ``what`` says who checks, ``fix`` how to agree.
    """
    seen = exchange(values, group)
    ranks = [dist.get_global_rank(group, r) for r in range(len(seen))] if len(seen) > 1 else [dist.get_rank()]
    require_equal(seen, values.keys(), ranks, what, fix)


def _describe(tensors: Mapping[str, torch.Tensor]) -> dict[str, object]:
    """Each tensor's shape, and for integer tensors (token ids, targets) a checksum of the values."""
    out: dict[str, object] = {}
    for name, t in tensors.items():
        out[f"{name} shape"] = tuple(t.shape)
        if not (t.is_floating_point() or t.is_complex()):
            flat = t.reshape(-1).long()
            out[f"{name} checksum"] = int(
                (flat * torch.arange(1, flat.numel() + 1, device=flat.device)).sum()
            )
    return out


def agree_on_first_call(
    owner: object, group: dist.ProcessGroup, what: str, **tensors: torch.Tensor | None
) -> None:
    """On ``owner``'s first call with these ``tensors`` (None ones left out), :func:`agree` over
    ``group`` (a cube) on their shapes, and on the values of the integer ones; later calls cost nothing.

    ``owner`` is the layer being called (or the grid, for a function such as ``split_activation``):
    every rank of a cube calls its layers in the same order, so all of them check on the same call.
    Call it before any check that could fail on some ranks only. Code that ``torch.compile``
    traces (the blocks of a compiled model) skips it: its inputs come from a model whose entry
    agreed on the batch eagerly, and a collective here would break the graph.
    """
    if dist.get_world_size(group) == 1 or torch.compiler.is_compiling():
        return
    tensors = {name: t for name, t in tensors.items() if t is not None}
    key = (what, *tensors)
    done = owner.__dict__.setdefault("_agreed_inputs", set())
    if key in done:
        return
    agree(_describe(tensors), group, what, SAME_BATCH)
    done.add(key)
