"""``save_pretrained``: a parallelized Hugging Face model back to a folder that ``from_pretrained`` loads."""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint import dense_info, to_dense
from ..parallel import dense_state_dict

DEFAULT_MAX_SHARD_SIZE = "5GB"


def _tied_copies(model: nn.Module) -> set[str]:
    """Keys of parameters shared with an earlier key (a tied LM head's weight, saved under its embedding's key)."""
    first: dict[int, str] = {}
    later = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            later.add(name)
        else:
            first[id(p)] = name
    return later


def _check_shapes(model: nn.Module, state_dict: dict[str, torch.Tensor], source: object) -> None:
    """Refuse tensors whose shapes are not ``model``'s own, naming the first few."""
    own = model.state_dict()
    differ = [
        f"{k} {list(t.shape)} (the model's: {list(own[k].shape)})"
        for k, t in state_dict.items()
        if k in own and t.shape != own[k].shape
    ]
    if differ:
        raise ValueError(
            f"{source} holds tensors of other shapes than {type(model).__name__}'s: {', '.join(differ[:4])}"
            f"{f' and {len(differ) - 4} more' if len(differ) > 4 else ''}; a checkpoint written before "
            "layouts were recorded (no 'dense_transposed' in its layout.json) holds Conv1D weights "
            "[out, in]: load it onto a grid and save_pretrained from there"
        )


def write_pretrained(
    model: nn.Module,
    state_dict: dict[str, torch.Tensor],
    path: str | os.PathLike,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> None:
    """Write ``model``'s config (and generation config), and ``state_dict`` as safetensors shards, to ``path``.

    ``state_dict``: full tensors under the Hugging Face model's own keys. No communication.
    """
    from huggingface_hub import save_torch_state_dict

    os.makedirs(path, exist_ok=True)
    tied = _tied_copies(model)
    state_dict = {k: t.detach().contiguous() for k, t in state_dict.items() if k not in tied}
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    floating = next((t.dtype for t in state_dict.values() if t.is_floating_point()), None)
    if floating is not None:
        config.dtype = floating
    config.save_pretrained(path)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(path)
    save_torch_state_dict(state_dict, path, max_shard_size=max_shard_size, metadata={"format": "pt"})


def save_pretrained(
    model: nn.Module, path: str | os.PathLike, *, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
) -> None:
    """Save a parallelized ``transformers`` model as a folder that ``AutoModelForCausalLM.from_pretrained`` loads.

    Collective: call it on every rank. Each cube assembles the full tensors as the original model
    holds them (:func:`lightning_3d.dense_state_dict`: original keys and layouts, ``Conv1D`` weights
    ``[in, out]``, the vocabulary padding dropped); global rank 0 writes ``config.json``,
    ``generation_config.json`` and ``model.safetensors`` (sharded above ``max_shard_size``, with
    its index), a tied LM head under its embedding's key only. Every rank returns once the folder
    is complete.
    """
    state_dict = dense_state_dict(model)
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_pretrained(model, state_dict, path, max_shard_size)
    if dist.is_initialized():
        dist.barrier()


def checkpoint_to_pretrained(
    checkpoint: str | os.PathLike,
    path: str | os.PathLike,
    *,
    prefix: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> None:
    """A sharded checkpoint of a parallelized ``transformers`` model, saved on any grid, as a
    ``from_pretrained`` folder.

    One process, no process group. The checkpoint's dense tensors
    (:func:`lightning_3d.checkpoint.to_dense`, in the original layouts; ``prefix`` as there, by
    default the recorded model's, e.g. ``"model."`` for a LightningModule's ``self.model``) are
    written as :func:`save_pretrained` writes them, for the recorded ``transformers`` class and
    config (built on ``meta``).

    Raises:
        ValueError: the checkpoint records no ``transformers`` config for that prefix, or holds
            tensors whose shapes are not that model's.
    """
    import transformers

    info = dense_info(checkpoint, prefix)
    config_class = getattr(transformers, info.get("config_class") or "", None)
    model_class = getattr(transformers, info.get("model") or "", None)
    if not (
        isinstance(config_class, type)
        and issubclass(config_class, transformers.PreTrainedConfig)
        and isinstance(model_class, type)
        and issubclass(model_class, transformers.PreTrainedModel)
        and info.get("config") is not None
    ):
        raise ValueError(
            f"{checkpoint} records no transformers model and config under prefix {info['prefix']!r} "
            f"(it holds {info.get('model') or 'an unknown model'}); pass the prefix of the parallelized "
            "transformers model"
        )
    # a dtype recorded as the text of a torch.dtype ("torch.bfloat16") reads as transformers writes it ("bfloat16")
    config = {
        k: v.removeprefix("torch.") if k in ("dtype", "torch_dtype") and isinstance(v, str) else v
        for k, v in info["config"].items()
    }
    with torch.device("meta"):
        model = model_class(config_class.from_dict(config))
    state_dict = to_dense(checkpoint, prefix)
    _check_shapes(model, state_dict, checkpoint)
    write_pretrained(model, state_dict, path, max_shard_size)
