"""The cost model (``lightning_3d.cost``): consistent counts, sensible choices, clear errors. How its
predictions compare with measured runs is the benchmark's planner check (``benchmarks/report.py
planner``), not a test: measurements belong to the runs that made them."""

from dataclasses import replace

import pytest

from lightning_3d import cost
from lightning_3d.models import GPTConfig
from lightning_3d.options import RuntimeOptions

A = cost.ModelShape(4096, 32, 2048, 8, 4)
B = cost.ModelShape(8192, 64, 2048, 4, 2)


def test_more_gpus_cost_less_time_and_memory_per_gpu():
    one, four = cost.predict_3d(A, (1, 1, 1)), cost.predict_3d(A, (2, 2, 1))
    assert four.step_ms < one.step_ms / 2 and four.memory_GiB < one.memory_GiB / 2
    assert four.exposed_comm_ms > 0


def test_regathering_trades_memory_for_communication():
    saved, regathered = cost.predict_3d(B, (2, 2, 1)), cost.predict_3d(B, (2, 2, 1), save_gathered=False)
    assert regathered.memory_GiB < saved.memory_GiB and regathered.comm_ms > saved.comm_ms


def test_grid_error_names_the_broken_rule():
    assert cost.grid_error(A, (2, 2, 1), 1) is None
    assert cost.grid_error(cost.ModelShape(4096, 6, 2048, 8, 4), (1, 4, 1), 1) == "heads % py"
    # a batch of 2 on 2×2×1 runs on token rows: the sequence must cut into lcm(2·px·pz, px·py) = 4 chunks
    assert cost.grid_error(cost.ModelShape(4096, 32, 2048, 2, 4), (2, 2, 1), 1) is None
    assert cost.grid_error(cost.ModelShape(4096, 32, 2046, 2, 4), (2, 2, 1), 1) == (
        "seq % lcm(2·px·pz, px·py) (token rows)"
    )
    assert cost.grid_error(cost.ModelShape(4096, 32, 2048, 3, 4), (2, 1, 1), 2) == "batch 3 % dp 2"


def test_token_rows_are_priced_with_their_key_value_gathers():
    """On token rows (batch 1 and 2 on 2×2×2) each layer all-gathers K and V over x·z (4 ranks) and
    reduce-scatters their gradients; sequence rows (batch 4) move none of these bytes. The products'
    activation bytes scale with the tokens and their weights' do not, which separates the three."""
    one = cost.ModelShape(4096, 32, 4096, 1, 8, 11008, kv_heads=8, gated=True, vocab=32000)
    s1, s2, s4 = (cost.sent_bytes(replace(one, batch=b), (2, 2, 2))["all_gather"] for b in (1, 2, 4))
    weights = 2 * s1 - s2
    activations = (s4 - weights) / 4  # per sequence
    kv = 2 * 4096 * (8 * 128 // 2) * 2  # K and V of every token, the y block's key/value heads, bf16
    assert s2 - s1 - activations == pytest.approx(8 * kv * 3 / 4)
    assert cost.token_rows(one, (2, 2, 2), 1) and not cost.token_rows(replace(one, batch=4), (2, 2, 2), 1)


def test_best_grid_is_the_fastest_feasible_candidate():
    grid = cost.best_grid(4096, 32, 2048, 8, 4, world=4)
    options = cost.candidates(A, 4)
    assert (
        grid == options[0].grid
        and sum(options[0].grid) >= 3
        and options[0].dp == 4 // (grid[0] * grid[1] * grid[2])
    )


def test_best_grid_errors():
    cost.best_grid(4096, 32, 2048, 3, 4, world=4)  # batch 3 on 4 ranks: a cube of 4 on token rows
    with pytest.raises(ValueError, match="sequence length divisible by 2·px·pz"):
        cost.best_grid(4096, 32, 2047, 3, 4, world=4)
    tiny = replace(cost.DEFAULT_MACHINE, memory_GiB=0.5)
    with pytest.raises(ValueError, match="fits 0 GiB|fits 1 GiB|needs"):
        cost.best_grid(4096, 32, 2048, 8, 4, world=4, machine=tiny)


def test_nodes_slow_groups_that_span_them():
    m = cost.DEFAULT_MACHINE
    inside, across = (
        cost.predict_3d(A, (8, 1, 1), 1, m),
        cost.predict_3d(A, (8, 1, 1), 1, replace(m, gpus_per_node=4)),
    )
    assert across.comm_ms > 2 * inside.comm_ms


@pytest.mark.parametrize(
    "grid, dp, gpus, axes",
    [
        ((2, 2, 2), 2, 8, ("dp",)),  # a cube per node, dp across
        (
            (2, 2, 2),
            2,
            4,
            ("dp", "x"),
        ),  # a cube on two nodes of 4: x (weights) across, y and z (activations) inside
        ((1, 4, 2), 1, 4, ("y",)),
        ((2, 2, 2), 2, 16, ()),
        ((4, 1, 1), 4, 8, ("dp",)),
    ],
)
def test_node_axes_follow_the_rank_order(grid, dp, gpus, axes):
    assert cost.node_axes(grid, dp, replace(cost.DEFAULT_MACHINE, gpus_per_node=gpus)) == axes


def test_inter_node_links_price_exactly_the_groups_that_span_nodes():
    m = cost.DEFAULT_MACHINE
    nodes_of = {g: replace(m, gpus_per_node=g) for g in (4, 8, 16)}
    one_node, dp_across, x_across = (cost.predict_3d(A, (2, 2, 2), 2, nodes_of[g]) for g in (16, 8, 4))
    # dp across nodes: only the gradient all-reduce moves to the slower link
    assert dp_across.detail["dp_sync_ms"] > 5 * one_node.detail["dp_sync_ms"]
    assert dp_across.comm_ms - dp_across.detail["dp_sync_ms"] == pytest.approx(
        one_node.comm_ms - one_node.detail["dp_sync_ms"]
    )
    # x across nodes too: the weight gathers slow down
    assert x_across.comm_ms > dp_across.comm_ms and x_across.detail["dp_sync_ms"] == pytest.approx(
        dp_across.detail["dp_sync_ms"]
    )
    # a faster network narrows the gap
    fast = replace(nodes_of[4], inter={op: cost.Link(360.0, 40.0) for op in cost.OPS})
    assert cost.predict_3d(A, (2, 2, 2), 2, fast).comm_ms < x_across.comm_ms


def test_collective_matmuls_only_on_cubes_inside_a_node():
    two_nodes = replace(cost.DEFAULT_MACHINE, gpus_per_node=8)
    shape = cost.ModelShape(8192, 64, 2048, 16, 48)
    assert all(
        8 % (p.grid[0] * p.grid[1] * p.grid[2]) == 0
        for p in cost.candidates(shape, 16, two_nodes, async_tp=True)
    )
    assert max(p.grid[0] * p.grid[1] * p.grid[2] for p in cost.candidates(shape, 16, two_nodes)) == 16


def test_collective_matmuls_hide_the_activation_collectives():
    """At h=8192 on 1×4×1 each block's product outlasts its copy: only the pipelines' barriers stay exposed."""
    plain, fused = cost.predict_3d(B, (1, 4, 1)), cost.predict_3d(B, (1, 4, 1), async_tp=True)
    assert fused.exposed_comm_ms < 0.7 * plain.exposed_comm_ms and fused.step_ms < plain.step_ms
    assert (
        cost.predict_3d(B, (4, 1, 1), async_tp=True).step_ms == cost.predict_3d(B, (4, 1, 1)).step_ms
    )  # no activation axis


@pytest.mark.parametrize(
    "nodes, hidden, heads, layers, batch, auto, across, with_async_tp, sequences",
    [
        (2, 2048, 16, 24, 16, ((8, 1, 1), 2), ("dp",), ((8, 1, 1), 2), ((8, 1, 1), 2)),
        (2, 4096, 32, 32, 8, ((1, 8, 1), 2), ("dp",), ((1, 8, 1), 2), ((2, 4, 2), 1)),
        (2, 8192, 64, 48, 4, ((2, 8, 1), 1), ("x",), ((1, 8, 1), 2), ((1, 4, 4), 1)),
        (16, 2048, 16, 24, 128, ((8, 1, 1), 16), ("dp",), ((8, 1, 1), 16), ((8, 1, 1), 16)),
        (16, 4096, 32, 32, 64, ((1, 8, 1), 16), ("dp",), ((1, 8, 1), 16), ((4, 4, 2), 4)),
        (16, 8192, 64, 48, 32, ((2, 8, 1), 8), ("dp", "x"), ((1, 8, 1), 16), ((4, 4, 4), 2)),
    ],
)
def test_auto_grids_on_nodes_of_8_as_docs_cluster_states(
    nodes, hidden, heads, layers, batch, auto, across, with_async_tp, sequences
):
    from lightning_3d.strategy import grid_rules

    shape, world = cost.ModelShape(hidden, heads, 2048, batch, layers), 8 * nodes

    def resolve(**options):
        return grid_rules.resolve("auto", "auto", world, 8, shape, options=RuntimeOptions(**options))

    assert resolve() == auto
    assert cost.node_axes(*auto, replace(cost.DEFAULT_MACHINE, gpus_per_node=8)) == across
    assert resolve(async_tp=True) == with_async_tp
    assert resolve(rows="sequences") == sequences


# ------------------------------------------------------------------ the whole training job

LLAMA_7B = cost.ModelShape(4096, 32, 2048, 8, 32, 11008, kv_heads=8, gated=True, vocab=32000)
SLOW = replace(
    cost.DEFAULT_MACHINE,
    intra={op: {g: cost.Link(15.0, 50.0) for g in table} for op, table in cost.DEFAULT_MACHINE.intra.items()},
)


def test_the_shape_of_a_gpt_config():
    config = GPTConfig(
        vocab_size=32000,
        block_size=2048,
        n_layer=32,
        n_head=32,
        n_kv_head=8,
        n_embd=4096,
        style="llama",
        ffn_hidden=11008,
    )
    assert cost.ModelShape.of(config, batch=8, seq=2048) == LLAMA_7B
    gpt2 = cost.ModelShape.of(
        GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768), 4, 1024
    )
    assert gpt2 == cost.ModelShape(768, 12, 1024, 4, 12, 3072, kv_heads=12, gated=False, vocab=50257)


def test_the_whole_job_costs_more_than_its_blocks_and_needs_the_vocabulary():
    job, blocks = cost.predict_job(LLAMA_7B, (2, 2, 1)), cost.predict_3d(LLAMA_7B, (2, 2, 1))
    assert job.step_ms > blocks.step_ms and job.memory_GiB > blocks.memory_GiB
    assert job.detail["head_ms"] > 0 and job.detail["loss_ms"] > 0 and job.detail["optimizer_ms"] > 0
    with pytest.raises(ValueError, match="vocab=V"):
        cost.predict_job(A, (1, 1, 1))


def test_whole_job_time_grows_with_layers_batch_and_slower_links():
    deeper, bigger = replace(LLAMA_7B, layers=40), replace(LLAMA_7B, batch=16)
    for grid, dp in ((1, 1, 1), 4), ((2, 2, 1), 1), ((1, 4, 1), 1), ((4, 1, 1), 1):
        base = cost.predict_job(LLAMA_7B, grid, dp)
        assert cost.predict_job(deeper, grid, dp).step_ms > base.step_ms
        assert cost.predict_job(bigger, grid, dp).step_ms > base.step_ms
        assert cost.predict_job(LLAMA_7B, grid, dp, SLOW).step_ms > base.step_ms
    one = cost.predict_job(LLAMA_7B, (1, 1, 1), 1)
    assert cost.predict_job(LLAMA_7B, (1, 1, 1), 1, SLOW).step_ms == one.step_ms  # nothing to communicate
    # the grid that moves more bytes loses more to the slow links
    grids = ((1, 4, 1), (2, 2, 1), (4, 1, 1))
    comm = {g: cost.predict_job(LLAMA_7B, g, 1, SLOW).comm_ms for g in grids}
    slowdown = {
        g: cost.predict_job(LLAMA_7B, g, 1, SLOW).step_ms - cost.predict_job(LLAMA_7B, g, 1).step_ms
        for g in grids
    }
    assert sorted(grids, key=comm.get) == sorted(grids, key=slowdown.get)


def test_slow_links_make_auto_pick_a_grid_that_communicates_less():
    fields = {
        k: getattr(LLAMA_7B, k)
        for k in ("hidden", "heads", "seq", "batch", "layers", "ffn", "kv_heads", "gated", "vocab")
    }
    for world in (4, 8):
        fast, slow = (
            cost.best_grid(**fields, world=world),
            cost.best_grid(**fields, world=world, machine=SLOW),
        )
        assert fast != slow
        comm = {
            g: cost.predict_job(LLAMA_7B, g, world // (g[0] * g[1] * g[2]), SLOW).comm_ms
            for g in (fast, slow)
        }
        assert comm[slow] < comm[fast]


def test_auto_resolves_with_a_given_machine():
    from lightning_3d.strategy import grid_rules

    fast = grid_rules.resolve("auto", "auto", 4, 4, LLAMA_7B)
    slow = grid_rules.resolve("auto", "auto", 4, 4, LLAMA_7B, machine=SLOW)
    assert fast[1] == slow[1] == 1 and fast[0] != slow[0]


def test_grads_at_end_takes_a_share_of_the_weight_scatters_off():
    """``grads_at_end`` takes ``late_scatter_fraction`` of the reduce-scatters of the weights gathered
    over x off the step: nothing where px = 1, more where the weights' reduce-scatters are slower;
    with dp > 1 the dp reduction of those gradients starts after backward, hidden behind none of it."""
    none = replace(cost.DEFAULT_MACHINE, late_scatter_fraction=0.0)
    for grid, dp in (((4, 1, 1), 1), ((2, 2, 1), 1), ((2, 1, 1), 2)):
        plain, late = (
            cost.predict_job(LLAMA_7B, grid, dp),
            cost.predict_job(LLAMA_7B, grid, dp, grads_at_end=True),
        )
        dp_later = late.detail["dp_exposed_ms"] - plain.detail["dp_exposed_ms"]
        assert dp_later == (
            0 if dp == 1 else pytest.approx(late.detail["dp_sync_ms"] - plain.detail["dp_exposed_ms"])
        )
        assert 0 < plain.step_ms - late.step_ms + dp_later < plain.detail["blocks_ms"] * 0.1
        assert plain.exposed_comm_ms - late.exposed_comm_ms == pytest.approx(plain.step_ms - late.step_ms)
        assert cost.predict_job(LLAMA_7B, grid, dp, none, grads_at_end=True).step_ms == pytest.approx(
            plain.step_ms + dp_later
        )
    for dp in (1, 4):
        grid = (1, 4 // dp, 1)
        assert (
            cost.predict_job(LLAMA_7B, grid, dp, grads_at_end=True).step_ms
            == cost.predict_job(LLAMA_7B, grid, dp).step_ms
        )
    fast, slow = (
        cost.predict_job(LLAMA_7B, (4, 1, 1), 1, m).step_ms
        - cost.predict_job(LLAMA_7B, (4, 1, 1), 1, m, grads_at_end=True).step_ms
        for m in (cost.DEFAULT_MACHINE, SLOW)
    )
    assert slow > fast


def test_half_precision_reductions_halve_the_dp_reduction():
    """``half_grads`` (a bf16 or fp16 DDP hook) prices the reduction over dp in half the bytes."""
    full, half = (cost.predict_job(LLAMA_7B, (1, 2, 1), 2, SLOW, half_grads=h) for h in (False, True))
    assert half.detail["dp_sync_ms"] < 0.55 * full.detail["dp_sync_ms"] and half.step_ms < full.step_ms
    assert (
        cost.predict_job(LLAMA_7B, (1, 4, 1), 1, SLOW, half_grads=True).step_ms
        == cost.predict_job(LLAMA_7B, (1, 4, 1), 1, SLOW).step_ms
    )


@pytest.mark.parametrize(
    "grid, dp",
    [((4, 1, 1), 1), ((1, 4, 1), 1), ((1, 1, 4), 1), ((2, 2, 1), 1), ((1, 2, 1), 2), ((1, 1, 1), 4)],
)
def test_sent_bytes_are_the_bytes_the_step_time_prices(grid, dp):
    """The bytes a rank sends: FSDP's on a P×1×1 grid (each weight gathered once, its gradient
    scattered once; the embedding in fp32), the gradients' all-reduce with dp only; and the time
    formulas price exactly these bytes (at links of 1 GB/s and no latency, their seconds)."""
    sent = cost.sent_bytes(LLAMA_7B, grid, dp)
    if grid == (4, 1, 1):
        weights = LLAMA_7B.params * cost.BYTES + LLAMA_7B.vocab * LLAMA_7B.hidden * (cost.FP32 - cost.BYTES)
        assert sent["all_gather"] == sent["reduce_scatter"] == pytest.approx(weights * 3 / 4)
    assert (sent["all_reduce"] > 0) == (dp > 1) and (sent["all_gather"] > 0) == (grid != (1, 1, 1))
    unit = replace(
        cost.DEFAULT_MACHINE, intra={op: {g: cost.Link(1.0, 0.0) for g in (2, 4)} for op in cost.OPS}
    )
    priced_bytes = cost.predict_job(LLAMA_7B, grid, dp, unit).comm_ms * 1e-3 * 1e9
    assert priced_bytes == pytest.approx(sum(sent.values()), rel=1e-9)


def test_the_lm_head_is_a_z_input_product():
    """The LM head reads the final norm's z-layout output: its input gathered over y and its logits
    scattered over z, as every z-input product's. So the vocabulary moves no bytes on 1×4×1 (the
    input ``[tokens, h]`` is gathered), and the logits' ``[tokens, V]`` on 1×1×4."""
    tokens = LLAMA_7B.batch * LLAMA_7B.seq
    for grid, per_token in (((1, 4, 1), 0), ((1, 1, 4), LLAMA_7B.vocab * cost.BYTES * 3 / 4)):
        small, large = (
            cost.sent_bytes(replace(LLAMA_7B, vocab=v), grid) for v in (LLAMA_7B.vocab, 2 * LLAMA_7B.vocab)
        )
        for op in ("all_gather", "reduce_scatter"):
            assert large[op] - small[op] == pytest.approx(tokens * per_token)
