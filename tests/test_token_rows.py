"""Token rows: GPT3D equals DenseGPT (float64) at batches no grid's whole-sequence rows take, on every
grid of worlds 2, 4 and 8; the rule that chooses the rows; the arrangement's index math."""

import harness
import pytest
import torch
from checks import assert_close, on_grids, rel, seed_for
from test_gpt import V, config, grads_as_dense, pair

from lightning_3d.layout import gather_activation
from lightning_3d.ops.sequence_split import chunks_of
from lightning_3d.options import RuntimeOptions
from lightning_3d.token_rows import TokenRows, choose_rows

WORLD_2 = [(2, 1, 1), (1, 2, 1), (1, 1, 2)]
WORLD_4 = [(2, 2, 1), (2, 1, 2), (1, 2, 2), (4, 1, 1), (1, 4, 1), (1, 1, 4)]
GRIDS = [(1, 1, 1), *WORLD_2, *WORLD_4, (2, 2, 2)]  # in a world of 8: dp 8, 4, 2 and 1
CASES = ((1, 16), (3, 24))  # (batch, sequence length): whole-sequence rows take neither on any grid above


def equivalence(grid, style, b, s, options=None):
    """Logits, loss and every gradient of GPT3D on token rows against DenseGPT."""
    dense, model = pair(grid, config(style, block_size=64), 1, options=options)
    rows = model.token_rows(b, s, torch.device("cpu"))
    torch.manual_seed(seed_for(grid, 2))
    idx, targets = torch.randint(0, V, (b, s)), torch.randint(0, V, (b, s))
    targets[0, 0] = targets[-1, s // 2] = -100
    ref_logits = dense(idx).detach()
    ref_loss = dense(idx, targets)
    ref_loss.backward()
    with torch.no_grad():
        logits = rows.restore(gather_activation(model(idx), "y", grid))[..., :V]
    loss = model(idx, targets)
    loss.backward()
    errs = {
        "token_rows": float(rows is None),
        "logits": rel(logits, ref_logits),
        "loss": rel(loss.detach(), ref_loss.detach()),
    }
    grads = grads_as_dense(model)
    errs.update({"d" + k: rel(grads[k], p.grad) for k, p in dense.named_parameters()})
    return {f"{style}_b{b}_s{s}_{k}": e for k, e in errs.items()}


def token_rows_job(grid):
    styles = ("gpt2", "llama") if grid.size("y") == 4 else ("gpt2", "gqa")  # gqa: 2 kv heads over py
    if grid.cube_size == 1:  # one rank takes any batch as whole sequences: force token rows
        return equivalence(grid, "gqa", 1, 16, RuntimeOptions(rows="tokens"))
    if grid.size("x") > 1:  # which style takes batch 1 alternates, so each style meets both batches
        styles = styles[::-1]
    # batch 1 in one style, batch 3 in the other: both batches on every grid, both styles on every grid class
    return {k: e for style, (b, s) in zip(styles, CASES) for k, e in equivalence(grid, style, b, s).items()}


def test_gpt3d_on_token_rows_equals_dense():
    assert_close(harness.run(8, on_grids, GRIDS, token_rows_job), tol=1e-9)


def compiled_job(grid):
    """Each block compiled and recomputed in backward: the same numbers on token rows."""
    options = RuntimeOptions(compile=True, activation_checkpointing=True)
    return equivalence(grid, "gqa", 1, 16, options)


def test_compiled_and_checkpointed_blocks_on_token_rows():
    assert_close(harness.run(2, on_grids, [(2, 1, 1)], compiled_job), tol=1e-9)


def arrangement_job(grid):
    """Round trip, and each y-layout rank's rows are its zig-zag chunks of every sequence."""
    b, s = 3, 48
    rows = TokenRows(b, s, grid)
    x = torch.arange(b * s).view(b, s)
    arranged = rows.arrange(x)
    ranks = grid.size("xz")
    r = grid.coord("x") * grid.size("z") + grid.coord("z")
    length = s // (2 * ranks)
    mine = arranged.chunk(ranks)[r].reshape(b, 2 * length)
    want = torch.cat([x[:, c * length : (c + 1) * length] for c in chunks_of(r, ranks)], 1)
    positions = rows.positions("y").reshape(b, 2 * length)
    return {
        "round_trip": float(not torch.equal(rows.restore(arranged), x)),
        "zigzag": float(not torch.equal(mine, want)),
        "positions": float(not torch.equal(positions, want % s)),
        "z_positions": float(
            not torch.equal(
                rows.positions("z"),
                arranged.chunk(grid.size("xy"))[grid.coord("x") * grid.size("y") + grid.coord("y")] % s,
            )
        ),
    }


def test_token_rows_arrangement():
    assert_close(harness.run(8, on_grids, [(2, 2, 2), (1, 2, 2), (2, 1, 1)], arrangement_job), tol=0.5)


class Shape:  # choose_rows reads only the grid's shape
    def __init__(self, shape):
        self.shape = shape


@pytest.mark.parametrize(
    "shape, batch, seq, rows, want",
    [
        ((2, 2, 2), 4, 8, "auto", "sequences"),
        ((2, 2, 2), 1, 8, "auto", "tokens"),
        ((2, 2, 2), 4, 8, "tokens", "tokens"),
        ((1, 1, 1), 1, 5, "auto", "sequences"),
        ((1, 4, 1), 2, 4, "auto", "tokens"),
        ((4, 1, 1), 3, 16, "auto", "tokens"),
    ],
)
def test_choose_rows(shape, batch, seq, rows, want):
    assert choose_rows(batch, seq, Shape(shape), rows) == want


def test_choose_rows_names_the_multiples():
    with pytest.raises(
        ValueError, match=r"multiple of lcm\(2·px·pz, px·py\) = 8 \(pad each sequence to 16 tokens"
    ):
        choose_rows(1, 12, Shape((2, 2, 2)))
    with pytest.raises(
        ValueError, match=r"whole-sequence rows need a batch that is a multiple of .* = 4, got 2"
    ):
        choose_rows(2, 8, Shape((2, 2, 1)), "sequences")
    with pytest.raises(ValueError, match="rows must be one of"):
        RuntimeOptions(rows="chunks")
