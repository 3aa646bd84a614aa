"""The 1-D tensor-parallel peer: the anchor's GPT block under PyTorch's DTensor (Megatron scheme).

The block and the plan are PyTorch's native 1-D tensor parallelism as users run it: LayerNorm,
separate q/k/v/o projections, causal SDPA, a 4h MLP; q, k, v and fc1 ``ColwiseParallel``, o and
fc2 ``RowwiseParallel``. One deviation: GELU is tanh-approximated, so that the peer computes the
same function as ``lightning_3d.models`` (GPT-2's ``gelu_new``) and the losses can be compared.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

PLAN = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
        "o": RowwiseParallel(), "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


class AnchorBlock(nn.Module):
    """The anchor's block; with ``parallelize`` each rank keeps ``heads / tp`` heads."""

    def __init__(self, h: int, heads: int, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.hd = h // heads
        self.ln1, self.ln2 = nn.LayerNorm(h, **factory), nn.LayerNorm(h, **factory)
        self.q, self.k, self.v, self.o = (nn.Linear(h, h, **factory) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(h, 4 * h, **factory), nn.Linear(4 * h, h, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        y = self.ln1(x)
        q, k, v = (m(y).view(b, t, -1, self.hd).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.o(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


def anchor_state_dict(dense_block_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ``DenseBlock`` state dict (lightning_3d.models keys) under the anchor block's keys."""
    sd = dense_block_sd
    q, k, v = sd["attn.c_attn.weight"].chunk(3)
    qb, kb, vb = sd["attn.c_attn.bias"].chunk(3)
    return {"ln1.weight": sd["ln_1.weight"], "ln1.bias": sd["ln_1.bias"], "ln2.weight": sd["ln_2.weight"], "ln2.bias": sd["ln_2.bias"],
            "q.weight": q, "q.bias": qb, "k.weight": k, "k.bias": kb, "v.weight": v, "v.bias": vb,
            "o.weight": sd["attn.c_proj.weight"], "o.bias": sd["attn.c_proj.bias"],
            "fc1.weight": sd["mlp.c_fc.weight"], "fc1.bias": sd["mlp.c_fc.bias"],
            "fc2.weight": sd["mlp.c_proj.weight"], "fc2.bias": sd["mlp.c_proj.bias"]}


def build_peer(block_sds: list[dict[str, torch.Tensor]], h: int, heads: int, tp_mesh, device, dtype) -> nn.Sequential:
    """The anchor's block stack with the given dense weights, parallelized 1-D over ``tp_mesh`` (None: plain)."""
    blocks = []
    for sd in block_sds:
        block = AnchorBlock(h, heads, device="meta", dtype=dtype).to_empty(device=device)
        block.load_state_dict(anchor_state_dict(sd))
        if tp_mesh is not None and tp_mesh.size() > 1:
            parallelize_module(block, tp_mesh, PLAN)
        blocks.append(block)
    return nn.Sequential(*blocks)
