"""Mixed precision needs ZeRO stage ≥ 1 once the cube has more than one rank.

Without ZeRO, DeepSpeed wraps an fp16 or bf16 model in ``FP16_Optimizer`` /
``FP16_UnfusedOptimizer``, which take the gradient norm of one flattened tensor per parameter
group through ``runtime.utils.get_weight_norm``. The flattened tensor carries no
``model_parallel`` tag, so every model-parallel rank but rank 0 drops its gradients from the norm:
the reported norm is too small, and gradient clipping and loss scaling act on it. ZeRO 1, 2 and 3
compute the norm parameter by parameter and count every shard once
(:mod:`deepspeed_3d.grad_norm_tags`).
"""

from __future__ import annotations

from typing import Any

from lightning_3d.grid import Grid


def _enabled(config: dict[str, Any], key: str) -> bool:
    section = config.get(key)
    return bool(section.get("enabled", False)) if isinstance(section, dict) else False


def check_precision(config: dict[str, Any], grid: Grid) -> None:
    """Raise ``ValueError`` for fp16/bf16 without ZeRO on a cube of more than one rank."""
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    mixed = [key for key in ("fp16", "bf16", "bfloat16") if _enabled(config, key)]
    if mixed and stage == 0 and grid.cube_size > 1:
        px, py, pz = grid.shape
        raise ValueError(
            f"{mixed[0]} without ZeRO on a {px}×{py}×{pz} grid: DeepSpeed's stage-0 {mixed[0]} optimizer "
            "counts only model-parallel rank 0's gradients in the gradient norm; "
            'set "zero_optimization": {"stage": 1} (or 2, 3)'
        )
