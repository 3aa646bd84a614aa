"""A sharded tensor's dense twin: the tensor the unparallelized model holds under the same key.

The global tensor a :class:`~lightning_3d.sharding.ShardSpec` describes is usually the dense one. A
module whose global tensors differ says how, under its own parameter names:

- ``dense_shapes = {name: dense shape}``: the dense tensor is the leading elements of the global one
  in row-major order (a padded vocabulary: zero rows appended; packed projections viewed as
  ``[groups, out, in]``: a reshape);
- ``dense_transposed = (name, ...)``: the dense twin stores the (2-D) weight ``[in, out]``, as
  Hugging Face's ``Conv1D``;
- ``dense_row_order = {name: (block, order)}``: the dense twin holds the rows in another order
  (LitGPT's fused ``qkv``, query heads grouped by key/value head), see :func:`reorder_rows`.

:func:`dense_shapes`, :func:`dense_transposed` and :func:`dense_row_orders` collect them under a
module's state-dict keys; :func:`dense_to_global` and :func:`global_to_dense` are the two
directions. Dense state dicts, their loads, ``parallelize``'s copy-in and every checkpoint's dense
export go through them, so a dense state dict is exactly the dense twin's ``state_dict()``.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def dense_shapes(module: nn.Module) -> dict[str, list[int]]:
    """Dense shapes declared by submodules (``dense_shapes`` attribute), under the module's state-dict keys."""
    declared = {
        _key(prefix, k): list(shape)
        for prefix, sub in module.named_modules()
        if isinstance(getattr(sub, "dense_shapes", None), dict)
        for k, shape in sub.dense_shapes.items()
    }
    return _under_state_dict_keys(module, declared)


def dense_transposed(module: nn.Module) -> list[str]:
    """The state-dict keys whose dense tensor is the transpose of the (``dense_shapes``-shaped) global
    one, as submodules declare them (``dense_transposed`` attribute: a weight the dense twin stores
    ``[in, out]``), under the module's state-dict keys."""
    declared = {
        _key(prefix, k): True
        for prefix, sub in module.named_modules()
        for k in getattr(sub, "dense_transposed", ())
    }
    return sorted(_under_state_dict_keys(module, declared))


def dense_row_orders(module: nn.Module) -> dict[str, list]:
    """``{key: [block, order]}``: the keys whose dense tensor holds the (``dense_shapes``-shaped) global
    one's rows in another order, as submodules declare them (``dense_row_order`` attribute, ``{name:
    (block, order)}``, see :func:`reorder_rows`), under the module's state-dict keys."""
    declared = {
        _key(prefix, k): [block, list(order)]
        for prefix, sub in module.named_modules()
        for k, (block, order) in getattr(sub, "dense_row_order", {}).items()
    }
    return _under_state_dict_keys(module, declared)


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _under_state_dict_keys(module: nn.Module, declared: dict[str, object]) -> dict[str, object]:
    """``declared``, keyed by ``named_modules()`` names, under the keys of ``module.state_dict()``, matched by
    tensor: the same names, unless a wrapper's state dict is its inner module's under other names (Lightning
    Fabric's ``_FabricModule`` lists its model as ``_forward_module`` among its modules, not in its state dict)."""
    if not declared:
        return {}
    named = {
        **dict(module.named_parameters(remove_duplicate=False)),
        **dict(module.named_buffers(remove_duplicate=False)),
    }
    by_tensor = {id(named[name]): value for name, value in declared.items() if name in named}
    return {
        key: by_tensor[id(t)] for key, t in module.state_dict(keep_vars=True).items() if id(t) in by_tensor
    }


def reorder_rows(t: torch.Tensor, row_order: tuple[int, list[int]], inverse: bool = False) -> torch.Tensor:
    """``t``'s rows (dim 0) in blocks of ``block`` rows, ``row_order = (block, order)``: block ``k`` of the
    result is block ``order[k]`` of ``t`` (the dense twin's order of a global tensor's rows, e.g.
    LitGPT's query heads grouped by key/value head where the 3-D layer groups them by slot);
    ``inverse``: the global order back from the dense one."""
    block, order = row_order
    index = torch.as_tensor(order, device=t.device)
    if inverse:
        index = torch.argsort(index)
    return t.unflatten(0, (-1, block))[index].flatten(0, 1)


def global_to_dense(
    full: torch.Tensor,
    shape: list[int] | None = None,
    transposed: bool = False,
    row_order: tuple[int, list[int]] | None = None,
) -> torch.Tensor:
    """The dense twin's tensor of a global one: the leading rows that make up ``shape`` (drops padding;
    default: all of them), reshaped to ``shape``; then its rows in the dense twin's order where
    ``row_order`` is given (:func:`reorder_rows`); then, where ``transposed``, the 2-D result
    transposed (a weight the dense twin stores ``[in, out]``, as Hugging Face's ``Conv1D``)."""
    if shape is not None:
        row = math.prod(full.shape[1:])
        need = math.prod(shape)
        if need % row or need // row > full.shape[0]:
            raise ValueError(
                f"cannot make a dense tensor of shape {shape} from a global tensor of shape {list(full.shape)}"
            )
        full = full[: need // row].reshape(shape)
    if row_order is not None:
        full = reorder_rows(full, row_order)
    return full.t().contiguous() if transposed else full


def dense_to_global(
    dense: torch.Tensor,
    global_shape: tuple[int, ...],
    transposed: bool = False,
    row_order: tuple[int, list[int]] | None = None,
) -> torch.Tensor:
    """The global tensor whose leading elements are ``dense`` (row-major; first transposed where
    ``transposed``: a 2-D weight stored ``[in, out]``; then its rows put back in the global order where
    the dense twin orders them by ``row_order``), zeros after them: :func:`global_to_dense` inverted."""
    dense = dense.t() if transposed else dense
    flat = (dense if row_order is None else reorder_rows(dense, row_order, inverse=True)).reshape(-1)
    pad = math.prod(global_shape) - flat.numel()
    if pad < 0:
        raise ValueError(
            f"a dense tensor of shape {list(dense.shape)} does not fit the global shape {list(global_shape)}"
        )
    return (torch.cat([flat, flat.new_zeros(pad)]) if pad else flat).reshape(global_shape)
