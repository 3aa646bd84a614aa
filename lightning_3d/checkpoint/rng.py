"""A process's RNG states as JSON: integers and base64 bytes, nothing that can carry code."""

from __future__ import annotations

import base64
import random

import torch


def _bytes(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state() -> dict:
    """This process's Python, torch (CPU and its current CUDA device) and NumPy RNG states, as JSON-ready data."""
    version, internal, gauss = random.getstate()
    state = {"python": [version, list(internal), gauss], "torch": _bytes(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = _bytes(torch.cuda.get_rng_state())
    try:
        import numpy
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = numpy.random.get_state()
    state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_tensor(state["cuda"]))
    if "numpy" in state:
        import numpy

        kind, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, cached))
