"""What every 3-D layer shares: sharded parameters and the dense state dict.

A module whose global tensors are not its dense twin's declares how they differ (``dense_shapes``,
``dense_transposed``, ``dense_row_order``: :mod:`lightning_3d.dense_twin`); :func:`dense_state_dict`
and :func:`load_dense_state_dict` go through those declarations, so a dense state dict is exactly
what the dense twin's ``state_dict()`` holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import ClassVar

import torch
from torch import nn

from ..dense_twin import dense_row_orders, dense_shapes, dense_to_global, dense_transposed, global_to_dense
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
        """:func:`lightning_3d.dense_state_dict` of this layer: full tensors under the keys of the equivalent
        ``torch.nn`` module (collective over the cube)."""
        return dense_state_dict(self)

    def load_dense_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """:func:`lightning_3d.load_dense_state_dict` into this layer."""
        load_dense_state_dict(self, state_dict, strict)

    def _describe(self, **fields) -> str:
        px, py, pz = self.grid.shape
        head = ", ".join(f"{k}={v}" for k, v in fields.items())
        specs = "; ".join(
            f"{n}: {get_spec(p).describe(self.grid)}" for n, p in self.named_parameters(recurse=False)
        )
        return f"{head}, grid={px}×{py}×{pz}" + (f", {specs}" if specs else "")


def modules_3d(model: nn.Module) -> list[Module3D]:
    """The 3-D layers of ``model`` (``ValueError`` when it holds none)."""
    layers = [m for m in model.modules() if isinstance(m, Module3D)]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} holds no 3-D layers: call lightning_3d.parallelize(model) first"
        )
    return layers


def grid_of(model: nn.Module) -> Grid:
    """The grid the 3-D layers of ``model`` live on."""
    grids = {id(m.grid): m.grid for m in modules_3d(model)}
    if len(grids) > 1:
        raise ValueError(
            f"{type(model).__name__} has 3-D layers on {len(grids)} different grids: {list(grids.values())}"
        )
    return next(iter(grids.values()))


@torch.no_grad()
def dense_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The dense twin's ``state_dict()`` of a parallelized model (or a 3-D layer): full tensors under its
    keys, in its shapes (vocabulary padding dropped, packed weights flattened, ``[in, out]`` weights as it
    stores them), on every cube rank. Collective over the cube."""
    grid = grid_of(model)
    out, done, shapes, transposed, orders = (
        {},
        {},
        dense_shapes(model),
        set(dense_transposed(model)),
        dense_row_orders(model),
    )
    for key, t in model.state_dict(keep_vars=True).items():
        spec = get_spec(t)
        if spec is None:
            out[key] = t.detach().clone()
            continue
        if id(t) not in done:
            done[id(t)] = unshard_tensor(t.detach(), spec, grid)
        out[key] = global_to_dense(done[id(t)], shapes.get(key), key in transposed, orders.get(key))
    return out


@torch.no_grad()
def load_dense_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Copy each rank's shard out of full dense tensors: the unparallelized model's ``state_dict()``, or
    :func:`dense_state_dict`'s from any grid. ``strict``: the keys must be the model's."""
    grid = grid_of(model)
    own = model.state_dict(keep_vars=True)
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    if strict and (missing or unexpected):
        raise KeyError(
            f"dense state dict does not match the module: missing {missing}, unexpected {unexpected}"
        )
    shapes, transposed, orders = dense_shapes(model), set(dense_transposed(model)), dense_row_orders(model)
    for key, t in own.items():
        if key not in state_dict:
            continue
        full = state_dict[key]
        spec = get_spec(t)
        shape = (
            tuple(shapes[key]) if key in shapes else spec.global_shape if spec is not None else tuple(t.shape)
        )
        shape = shape[::-1] if key in transposed else shape
        if tuple(full.shape) != shape:
            raise ValueError(
                f"{key}: the dense state dict holds shape {list(full.shape)}, the module expects {list(shape)}"
                + (" (the dense twin's [in, out] layout)" if key in transposed else "")
            )
        if spec is not None:
            full = shard_tensor(
                dense_to_global(full.to(t.device), spec.global_shape, key in transposed, orders.get(key)),
                spec,
                grid,
            )
        t.copy_(full)
