"""What every 3-D layer shares: sharded parameters, dense state dicts, and their description.

A module whose global tensors are not the dense ones (a padded vocabulary, packed projections
viewed as ``[groups, out, in]``) declares ``dense_shapes = {name: dense shape}``: the dense tensor
is the leading elements of the global one in row-major order, so padding is zeros appended to the
rows and grouping is a reshape. A weight its dense twin stores transposed (``[in, out]``, as
Hugging Face's ``Conv1D``) is named in ``dense_transposed``: the dense tensor is the transpose of
that. A layer whose dense twin orders the rows otherwise (LitGPT's fused ``qkv``) declares
``dense_row_order``. :func:`dense_to_global` and :func:`~lightning_3d.checkpoint.global_to_dense` are the two
directions; dense state dicts, loads, ``parallelize`` and checkpoint export all go through them,
so a dense state dict is exactly what the dense twin's ``state_dict()`` holds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Callable, ClassVar

import torch
from torch import nn

from ..checkpoint import dense_row_orders, dense_shapes, dense_transposed, global_to_dense, reorder_rows
from ..grid import Grid, resolve_grid
from ..options import RuntimeOptions
from ..runtime import Runtime
from ..sharding import ShardSpec, get_spec, set_spec, shard_tensor, unshard_tensor


def sharded_parameter(spec: ShardSpec, grid: Grid, what: str, device=None, dtype=None) -> nn.Parameter:
    """An uninitialised plain ``nn.Parameter`` holding this rank's shard, tagged with ``spec``."""
    spec.check(grid, what)
    return set_spec(nn.Parameter(torch.empty(spec.local_shape(grid), device=device, dtype=dtype)), spec)


@torch.no_grad()
def init_sharded_(param: torch.Tensor, grid: Grid, init: Callable[[torch.Tensor], object]) -> None:
    """Initialise the global tensor with ``init`` and keep this rank's shard.

    Every rank draws the whole tensor from the same RNG state, so the global weights equal those a
    1×1×1 grid (or the dense ``torch.nn`` module, for the same init) would draw.
    """
    if param.is_meta:
        return
    full = torch.empty(get_spec(param).global_shape, device=param.device, dtype=param.dtype)
    init(full)
    param.copy_(shard_tensor(full, get_spec(param), grid))


def dense_to_global(dense: torch.Tensor, global_shape: tuple[int, ...], transposed: bool = False,
                    row_order: tuple[int, list[int]] | None = None) -> torch.Tensor:
    """The global tensor whose leading elements are ``dense`` (row-major; first transposed where
    ``transposed``: a 2-D weight stored ``[in, out]``; then its rows put back in the global order where
    the dense twin orders them by ``row_order``), zeros after them."""
    dense = dense.t() if transposed else dense
    flat = (dense if row_order is None else reorder_rows(dense, row_order, inverse=True)).reshape(-1)
    pad = math.prod(global_shape) - flat.numel()
    if pad < 0:
        raise ValueError(f"a dense tensor of shape {list(dense.shape)} does not fit the global shape {list(global_shape)}")
    return (torch.cat([flat, flat.new_zeros(pad)]) if pad else flat).reshape(global_shape)


@torch.no_grad()
def dense_state_dict(module: nn.Module, grid: Grid) -> dict[str, torch.Tensor]:
    """Full dense tensors under the module's own keys, on every cube rank (collective over the cube):
    the dense twin's ``state_dict()``, its shapes and layouts.

    Padding is dropped, grouped tensors flattened and weights stored ``[in, out]`` transposed, as the
    modules' ``dense_shapes`` and ``dense_transposed`` declare.
    """
    out, done, shapes, transposed, orders = {}, {}, dense_shapes(module), set(dense_transposed(module)), dense_row_orders(module)
    for key, t in module.state_dict(keep_vars=True).items():
        spec = get_spec(t)
        if spec is None:
            out[key] = t.detach().clone()
            continue
        if id(t) not in done:
            done[id(t)] = unshard_tensor(t.detach(), spec, grid)
        out[key] = global_to_dense(done[id(t)], shapes.get(key), key in transposed, orders.get(key))
    return out


@torch.no_grad()
def load_dense_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor], grid: Grid, strict: bool = True) -> None:
    """Copy each rank's shard out of full dense tensors keyed and laid out as :func:`dense_state_dict`
    returns them (the dense twin's ``state_dict()``)."""
    own = module.state_dict(keep_vars=True)
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    if strict and (missing or unexpected):
        raise KeyError(f"dense state dict does not match the module: missing {missing}, unexpected {unexpected}")
    shapes, transposed, orders = dense_shapes(module), set(dense_transposed(module)), dense_row_orders(module)
    for key, t in own.items():
        if key not in state_dict:
            continue
        full = state_dict[key]
        spec = get_spec(t)
        shape = tuple(shapes[key]) if key in shapes else spec.global_shape if spec is not None else tuple(t.shape)
        shape = shape[::-1] if key in transposed else shape
        if tuple(full.shape) != shape:
            raise ValueError(f"{key}: the dense state dict holds shape {list(full.shape)}, the module expects {list(shape)}"
                             + (" (the dense twin's [in, out] layout)" if key in transposed else ""))
        if spec is not None:
            full = shard_tensor(dense_to_global(full.to(t.device), spec.global_shape, key in transposed, orders.get(key)),
                                spec, grid)
        t.copy_(full)


class Module3D(nn.Module):
    """Base of the 3-D layers: holds the grid and the :class:`~lightning_3d.runtime.Runtime` it runs
    with (its model's, which ``parallelize`` hands to every layer of the model; its own, made from
    ``options``, for a layer built alone), and exchanges weights as dense state dicts."""

    #: Names of this layer's parameters that its dense twin stores transposed (``[in, out]``, as
    #: Hugging Face's ``Conv1D``): dense state dicts, loads and exports hold them so.
    dense_transposed: tuple[str, ...] = ()

    #: ``{name: (block, order)}`` for parameters whose dense twin holds the rows of the global tensor
    #: (after ``dense_shapes``) in another order: its row block ``k`` (``block`` rows) is the global's
    #: block ``order[k]`` (LitGPT's fused ``qkv``, query heads grouped by key/value head). Set by the rule
    #: that builds the layer; dense state dicts, loads and exports follow it.
    dense_row_order: Mapping[str, tuple[int, tuple[int, ...]]] = MappingProxyType({})

    #: Whether ``torch.compile`` traces the forward on a cube of several ranks: true where the layer
    #: communicates only through custom ops (the 3-D products, norm statistics, replicated
    #: gradients), which the compiler keeps whole. Any other layer runs there as one opaque eager
    #: step; on a one-rank cube every layer is traced.
    traceable: ClassVar[bool] = False

    def __init__(self, grid: Grid | None = None, options: RuntimeOptions | None = None):
        super().__init__()
        self.grid = resolve_grid(grid)
        self.runtime = Runtime(options)
        if self.grid.cube_size > 1 and not self.traceable:
            self.forward = torch.compiler.disable(self.forward)

    @property
    def options(self) -> RuntimeOptions:
        """The run-time choices this layer runs with: its runtime's, fixed
        (``lightning_3d.parallel.set_options`` changes them)."""
        return self.runtime.options

    def _apply(self, fn, recurse=True):
        """Keep each parameter's ShardSpec when a conversion (``to_empty``, ``to(device)``) replaces it."""
        specs = {name: get_spec(p) for name, p in self._parameters.items() if p is not None}
        result = super()._apply(fn, recurse)
        for name, spec in specs.items():
            if spec is not None and self._parameters[name] is not None:
                set_spec(self._parameters[name], spec)
        return result

    def replicated_parameters(self) -> list[tuple[nn.Parameter, str]]:
        """The parameters this layer's forward passes to :func:`~lightning_3d.ops.use_replicated`,
        each with the ``grad_summed_over`` it passes (none by default)."""
        return []

    def dense_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors under the keys of the equivalent ``torch.nn`` module (collective over the cube)."""
        return dense_state_dict(self, self.grid)

    def load_dense_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load full tensors keyed as the equivalent ``torch.nn`` module's state dict."""
        load_dense_state_dict(self, state_dict, self.grid, strict)

    def _describe(self, **fields) -> str:
        px, py, pz = self.grid.shape
        head = ", ".join(f"{k}={v}" for k, v in fields.items())
        specs = "; ".join(f"{n}: {get_spec(p).describe(self.grid)}" for n, p in self.named_parameters(recurse=False))
        return f"{head}, grid={px}×{py}×{pz}" + (f", {specs}" if specs else "")
