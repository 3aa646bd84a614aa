"""Bad input is caught where it enters: token ids and targets out of range, ranks that disagree on
the grid or on a batch, and arguments of the wrong type. Each raises a clear error on every rank,
within seconds, instead of a wrong loss, a hang or an abort of some ranks."""

import datetime
import math
import time
from functools import partial

import harness
import pytest
import torch
import torch.distributed as dist

from lightning_3d import (
    CrossEntropyLoss3D,
    Linear3D,
    VocabParallelEmbedding3D,
    arguments,
    gather_activation,
    init_grid,
    split_activation,
)
from lightning_3d.models import GPT3D, GPTConfig
from lightning_3d.ops import replicated
from lightning_3d.options import RuntimeOptions
from lightning_3d.parallel import runtime_of, set_options
from lightning_3d.runtime import DeferredTokenChecks, check_token_range
from lightning_3d.strategy import grid_rules

FAST = 30  # seconds: a hang would be cut at the workers' 60 s collective timeout
TINY = GPTConfig(vocab_size=50, block_size=8, n_layer=1, n_head=2, n_embd=8)  # padded to 64 rows on the grid


def _error(fn) -> str:
    with pytest.raises(ValueError) as e:
        fn()
    return str(e.value)


# ----- token ids and targets out of range -----


def out_of_range_job():
    grid = harness.grid((2, 2, 1))
    torch.manual_seed(3)
    emb, loss = VocabParallelEmbedding3D(16, 8, grid=grid), CrossEntropyLoss3D(grid=grid)
    ids = torch.randint(0, 16, (4, 5))
    logits = torch.randn(2, 5, 8)  # y-layout block of [4, 5, 16]
    msgs = {}
    for name, value in (("id_high", 16), ("id_negative", -1)):
        bad = ids.clone()
        bad[1, 2] = value
        msgs[name] = _error(partial(emb, bad))
    for name, value in (("target_high", 16), ("target_negative", -3)):
        bad = ids.clone()
        bad[3, 4] = value
        msgs[name] = _error(partial(loss, logits, bad))
    ignored = ids.clone()
    ignored[0, 0] = -100
    msgs["ignored_ok"] = bool(torch.isfinite(loss(logits, ignored)))
    model = GPT3D(TINY, grid=grid)
    bad = ids % 50
    bad[2, 1] = 55  # inside the padded table of 64 rows, outside the vocabulary of 50
    msgs["gpt_id"] = _error(lambda: model(bad))
    msgs["gpt_target"] = _error(lambda: model(ids % 50, bad))
    msgs["short_targets"] = _error(lambda: model(ids % 50, ids[:, :3] % 50))  # raised in before_forward
    msgs["contexts_left"] = not runtime_of(model).token_checks.is_open and all(
        getattr(p, replicated._VIEWS, None) is None for p in model.parameters()
    )
    msgs["reads_after_products"] = _flag_reads_after_products(lambda: model(ids % 50, ids % 50))
    set_options(model, check_inputs=False)  # the check skipped: the same bad ids pass, every rank alike
    msgs["unchecked_loss"] = float(model(bad, ids % 50))
    return msgs


def _flag_reads_after_products(forward) -> bool:
    """True when every host read of a tensor in ``forward`` (the token checks' flags) comes after its
    last matrix product: the checks are read once, at the end, not where they start."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        forward()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    reads = [e.time_range.start for e in events if e.name == "aten::_local_scalar_dense"]
    products = [e.time_range.start for e in events if e.name in ("aten::mm", "aten::addmm", "aten::bmm")]
    return len(reads) == 2 and min(reads) > max(products)


def test_deferred_checks_raise_at_exit_and_nest():
    ids = torch.tensor([[1, 2], [3, 9]])
    checks, after_inner = DeferredTokenChecks(), None
    with pytest.raises(
        ValueError, match=r"outer: token id 9 at index \(1, 1\) of \[2, 2\] is outside \[0, 8\)"
    ):
        with checks:
            check_token_range(ids, 8, "outer", "token id", deferred=checks)
            with pytest.raises(ValueError, match="inner: target -5"):
                with checks:
                    check_token_range(
                        torch.tensor([-5, 1]), 8, "inner", "target", ignore_index=-100, deferred=checks
                    )
                    check_token_range(ids, 10, "inner", "token id", deferred=checks)  # in range: no error
            after_inner = (len(checks._open), [c.who for c in checks._open[-1]])
    # the outer check was started first, outlived the inner context unread, and raised at the outer exit
    assert after_inner == (1, ["outer"]) and not checks.is_open, after_inner
    with pytest.raises(ValueError, match="now: token id 9"):  # closed: at once
        check_token_range(ids, 8, "now", "token id", deferred=checks)
    with DeferredTokenChecks():  # another model's checks open: a check given these closed ones raises at once
        assert "other: token id 9" in _error(
            lambda: check_token_range(ids, 8, "other", "token id", deferred=checks)
        )


def test_ids_and_targets_out_of_range_raise_on_every_rank():
    for m in harness.run(4, out_of_range_job, timeout=FAST):
        assert (
            "VocabParallelEmbedding3D: token id 16 at index (1, 2) of [4, 5] is outside [0, 16)"
            in m["id_high"]
        ), m
        assert (
            "token id -1 at index (1, 2)" in m["id_negative"]
            and "map the token ids into [0, 16)" in m["id_negative"]
        ), m
        assert (
            "target 16 at index (3, 4) of [4, 5] is outside [0, 16) or ignore_index -100" in m["target_high"]
        ), m
        assert "target -3 at index (3, 4)" in m["target_negative"], m
        assert m["ignored_ok"]
        assert "token id 55 at index (2, 1) of [4, 5] is outside [0, 50)" in m["gpt_id"], m
        assert (
            "GPT3D: target 55 at index (2, 1) of [4, 5] is outside [0, 50) or ignore_index -100"
            in m["gpt_target"]
        ), m
        assert math.isfinite(m["unchecked_loss"]), m
        assert (
            "targets [4, 3] must have the shape of idx [4, 5]" in m["short_targets"] and m["contexts_left"]
        ), m
        assert m["reads_after_products"], m


# ----- ranks that disagree -----


def disagreeing_grid_job(kind):
    rank = dist.get_rank()
    args = {
        "shape": dict(shape=(2, 2, 1) if rank < 2 else (4, 1, 1)),
        "dp": dict(shape=(2, 1, 1), data_parallel_size=2 if rank != 3 else None),
        "timeout": dict(shape=(2, 1, 1), timeout=30 if rank == 1 else 60),
    }[kind]
    shape = args.pop("shape")
    start = time.monotonic()
    msg = _error(lambda: init_grid(shape, **args))
    return msg, time.monotonic() - start


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("shape", "init_grid: the ranks disagree on shape = (2, 2, 1) on ranks 0-1, (4, 1, 1) on ranks 2-3"),
        ("dp", "data_parallel_size = 2 on ranks 0-2, None on rank 3"),
        ("timeout", "timeout = 60 on ranks 0, 2-3, 30 on rank 1"),
    ],
)
def test_ranks_that_disagree_on_the_grid_all_raise(kind, expected):
    for msg, seconds in harness.run(4, disagreeing_grid_job, kind, timeout=FAST):
        assert expected in msg and "every rank must call init_grid with the same arguments" in msg, msg
        assert seconds < 10, seconds


def different_batches_job():
    """Rank 0 of a 2×2×1 cube is given a batch of 8 (or other ids, or the same ids in another order), the
    others a batch of 4."""
    grid = init_grid((2, 2, 1))  # fresh: each entry point checks on its first call on a grid
    rank = dist.get_rank()
    torch.manual_seed(5)
    b = 8 if rank == 0 else 4
    ids = torch.randint(0, 16, (b, 3))
    other_ids = torch.full((4, 3), 1 if rank == 0 else 2)  # the same shape, another batch
    same_ids = torch.arange(12).reshape(4, 3)
    permuted_ids = same_ids.flip(0) if rank == 0 else same_ids  # the same ids, rows in another order
    cases = {
        "embedding": lambda: VocabParallelEmbedding3D(16, 8, grid=grid)(ids),
        "embedding_ids": lambda: VocabParallelEmbedding3D(16, 8, grid=grid)(other_ids),
        "embedding_order": lambda: VocabParallelEmbedding3D(16, 8, grid=grid)(permuted_ids),
        "split": lambda: split_activation(torch.randn(b, 3, 8), "z", grid),
        "gather": lambda: gather_activation(torch.randn(b // 4, 3, 8), "z", grid),
        "linear": lambda: Linear3D(8, 8, grid=grid)(torch.randn(b // 4, 3, 8)),
        "loss": lambda: CrossEntropyLoss3D(grid=grid)(torch.randn(2, 3, 8), ids[:4] if rank else ids),
        "gpt": lambda: GPT3D(TINY, grid=grid)(ids),
        "options": lambda: GPT3D(TINY, grid=grid, options=RuntimeOptions(async_tp=rank == 0)),
    }
    out = {}
    for name, case in cases.items():
        start = time.monotonic()
        out[name] = (_error(case), time.monotonic() - start)
    return out


def test_cube_ranks_given_different_batches_or_options_all_raise():
    for rank, r in enumerate(harness.run(4, different_batches_job, timeout=FAST)):
        options, seconds = r.pop("options")  # run-time options that differ: every rank raises too
        assert (
            "RuntimeOptions: the ranks disagree on async_tp = True on rank 0, False on ranks 1-3" in options
        ), options
        assert seconds < 10, seconds
        for name, (msg, seconds) in r.items():
            assert (
                "the ranks disagree on" in msg and "every rank of a cube must be given the same batch" in msg
            ), (rank, name, msg)
            assert seconds < 10, (name, seconds)
        assert "ids shape = (8, 3) on rank 0, (4, 3) on ranks 1-3" in r["embedding"][0], r["embedding"]
        for ids in ("embedding_ids", "embedding_order"):
            assert "ids checksum = " in r[ids][0] and "shape" not in r[ids][0].split("disagree on")[1], r
        assert (
            "split_activation input: the ranks disagree on full shape = (8, 3, 8) on rank 0" in r["split"][0]
        )
        assert (
            "Linear3D input: the ranks disagree on input shape = (2, 3, 8) on rank 0, (1, 3, 8) on ranks 1-3"
            in r["linear"][0]
        )
        assert "targets shape = (8, 3) on rank 0" in r["loss"][0] and "GPT3D input" in r["gpt"][0]


# ----- types are checked, not coerced -----


@pytest.mark.parametrize(
    "bad, expected",
    [
        ("221", "got '221' (a str: strings are not parsed, pass a tuple)"),
        ("2x2x1", "got '2x2x1' (a str: strings are not parsed"),
        ((2.7, 1, 1), "px = 2.7 is a float"),
        ((2.0, 1, 1), "px = 2.0 is a float"),
        ((2, True, 1), "py = True is a bool"),
        ((2, 2), "grid shape must be (px, py, pz), got (2, 2): 2 entries"),
        ((2, 0, 2), "every grid axis must be >= 1, got (px, py, pz) = (2, 0, 2)"),
    ],
)
def test_grid_shapes_are_checked_not_coerced(bad, expected):
    assert expected in _error(lambda: arguments.grid_shape(bad))
    assert expected in _error(
        lambda: grid_rules.check_grid_arg(bad)
    )  # the strategy accepts exactly what init_grid does


@pytest.mark.parametrize(
    "bad, expected",
    [
        (
            datetime.timedelta(0),
            "timeout must be positive, got datetime.timedelta(0): every collective would fail at once",
        ),
        (datetime.timedelta(seconds=-5), "timeout must be positive"),
        (float("inf"), "timeout must be a positive, finite number of seconds, got inf"),
        (float("nan"), "got nan"),
        (0, "got 0"),
        (True, "timeout must be a timedelta or a number of seconds, got True (a bool)"),
        ("60", "got '60' (a str)"),
    ],
)
def test_timeouts_must_be_positive_and_finite(bad, expected):
    msg = _error(lambda: arguments.timeout(bad))
    assert expected in msg and "timedelta(minutes=10)" in msg, msg


def test_flags_and_counts_are_checked():
    assert "async_tp must be True or False, got 'no' (a str)" in _error(
        lambda: arguments.flag("no", "async_tp")
    )
    assert "got 1 (a int)" in _error(lambda: arguments.flag(1, "async_tp"))
    assert "data_parallel_size must be a positive int, got 2.0 (a float)" in _error(
        lambda: arguments.positive_int(2.0, "data_parallel_size")
    )
    assert "got True (a bool)" in _error(lambda: grid_rules.check_dp_arg(True))
    assert arguments.grid_shape(torch.Size([2, 1, 2])) == (2, 1, 2) and arguments.timeout(
        1.5
    ) == datetime.timedelta(seconds=1.5)
    assert "async_tp must be True or False, got 'no' (a str)" in _error(lambda: RuntimeOptions(async_tp="no"))
    assert "save_gathered must be True or False, got 0 (a int)" in _error(
        lambda: RuntimeOptions(save_gathered=0)
    )


def bad_types_job():
    return {
        name: _error(partial(init_grid, *args, **kwargs))
        for name, args, kwargs in [
            ("string", ("221",), {}),
            ("float", ((2.7, 1, 1),), {}),
            ("bool", ((2, True, 1),), {}),
            ("timeout", ((2, 1, 1),), {"timeout": datetime.timedelta(0)}),
            ("dp", ((2, 1, 1), 2.0), {}),
        ]
    }


def test_init_grid_refuses_wrong_types_on_every_rank():
    for m in harness.run(4, bad_types_job, timeout=FAST):
        assert (
            "strings are not parsed" in m["string"]
            and "px = 2.7 is a float" in m["float"]
            and "py = True is a bool" in m["bool"]
        )
        assert "timeout must be positive, got datetime.timedelta(0)" in m["timeout"]
        assert "data_parallel_size must be a positive int, got 2.0" in m["dp"]
