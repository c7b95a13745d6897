"""experiments/gpt2_small.py: GPT-2 small's shape compiled at full size on the CPU mesh (never trained there),
and its width-scaled twin trained for a few steps.

Full size: one train step (data x 8, the jit driver, bf16 compute, AdamW; one 1024-token sequence per
device) is lowered from abstract inputs and compiled once per module. Its parameters are GPT-2's
124,439,808; its FLOPs per token are 6N + 12·L·d·T (Chowdhery et al. 2022, App. B; N the parameters that
multiply: all but the position table, the tied embedding once, as the output layer).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dtx import config as config_lib
from dtx.comm import hlo
from dtx.data.tasks import make_task
from dtx.experiments import gpt2_small
from dtx.models import build_model
from dtx.perf import flops as flops_lib
from dtx.precision import parse_policy
from dtx.run import setup, verify

GPT2_PARAMS = 124_439_808  # GPT-2 small (Radford et al. 2019; HuggingFace's gpt2 checkpoint holds as many)
DEVICES, SEQ = 8, 1024


def full_size_model(**changes):
    config = gpt2_small.get_config()
    policy = parse_policy(config.precision)
    settings = {key: value for key, value in config.model.items() if key != "name"}
    return build_model("transformer", num_classes=gpt2_small.VOCAB, dtype=policy.compute,
                       param_dtype=policy.params, **{**settings, **changes}), policy


@pytest.fixture(scope="module")
def full_size():
    """The full-width train step with 1 and with 2 blocks, compiled from shapes only (nothing is allocated or run).

    Compiling all 12 blocks takes ~50 s on XLA:CPU here; the blocks are one program unrolled, so a step's FLOPs
    and memory are affine in the block count, and the 12-block step is the 2-block step plus 10 times the
    difference. Checked once by compiling all 12 (FLOPs 886.57 G per device against 886.58 G extrapolated, peak
    4.784 GB against 4.785 GB, temp 3.2908 GB against 3.2912 GB).
    """
    model, policy = full_size_model()
    found = {}
    for blocks in (1, 2):
        compiled = verify.compile_layout_step(model.clone(num_layers=blocks), (SEQ,), "data", [("data", DEVICES)],
                                              DEVICES, dtype=jnp.int32, task=make_task("next_token"),
                                              labels_shape=(SEQ,), policy=policy, optimizer="adamw")
        found[blocks] = dict(flops=flops_lib.compiled_flops(compiled), memory=compiled.memory_analysis(),
                             reduced=[c for c in hlo.collectives(compiled) if c.kind == "all-reduce"])
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32)))["params"]
    return dict(model=model, policy=policy, compiled=found, params=params)


def at_full_depth(one: float, two: float, blocks: int) -> float:
    """A per-step figure of ``blocks`` blocks from those of 1 and 2 (affine in the block count)."""
    return two + (blocks - 2) * (two - one)


def test_the_model_is_gpt2_small(full_size):
    """12 blocks of width 768 with 12 heads, 1024 positions, a 50257-word vocabulary tied to the output:
    GPT-2 small's 124,439,808 parameters, exactly; float32 master weights, bfloat16 compute."""
    model, params = full_size["model"], full_size["params"]
    assert (model.num_layers, model.d_model, model.num_heads, model.max_len) == (12, 768, 12, 1024)
    assert sum(math.prod(p.shape) for p in jax.tree.leaves(params)) == GPT2_PARAMS
    assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    assert model.dtype == jnp.bfloat16 and model.tie_embeddings


def test_flops_per_token_are_6n_plus_12ldt(full_size):
    """XLA's count of the compiled step per device over its 1024 tokens against 6N + 12·L·d·T = 855.1 M FLOPs per
    token (N = 123,653,376: the position table is a lookup, the tied embedding counts once, as the output layer).
    Measured 1.0125 (865.8 M); XLA adds the element-wise work (LayerNorm, GELU, softmax, AdamW), so the bound is
    [1, 1.03). One block alone: 6·7,087,872 + 12·768·1024 FLOPs per token, within the same bound."""
    params, model, compiled = full_size["params"], full_size["model"], full_size["compiled"]
    n = sum(math.prod(p.shape) for p in jax.tree.leaves(params)) - math.prod(params["positions"].shape)
    per_token = 6 * n + 12 * model.num_layers * model.d_model * SEQ
    measured = at_full_depth(compiled[1]["flops"], compiled[2]["flops"], model.num_layers) / SEQ  # a sequence each
    assert 1.0 <= measured / per_token < 1.03, (measured, per_token)
    block = sum(math.prod(p.shape) for p in jax.tree.leaves(params["Block_0"]))
    per_block = (compiled[2]["flops"] - compiled[1]["flops"]) / SEQ
    assert 1.0 <= per_block / (6 * block + 12 * model.d_model * SEQ) < 1.03, per_block


def test_the_tied_embedding_crosses_the_data_axes_once(full_size):
    """The step's gradient all-reduce over the 8 devices carries each float32 gradient once: its operand bytes are
    the parameters' (and the loss and accuracy), at 1 and at 2 blocks. The table (50257 x 768, 154 MB) is used
    twice, by the lookup and by the tied output layer; reduced apart, as XLA does for a gradient taken on the
    global batch, it went twice (+31 % of the gradient bytes at 12 blocks); each device sums its two uses first
    (dtx.step.jit)."""
    model, compiled = full_size["model"], full_size["compiled"]
    for blocks in (1, 2):
        params = jax.eval_shape(lambda: model.clone(num_layers=blocks).init(jax.random.key(0),
                                                                            jnp.zeros((1, SEQ), jnp.int32)))
        nbytes = sum(p.size * p.dtype.itemsize for p in jax.tree.leaves(params))
        reduced = compiled[blocks]["reduced"]
        assert [(c.group_size, c.trips) for c in reduced] == [(DEVICES, 1)], reduced
        assert reduced[0].operand_bytes == nbytes + 8, (reduced[0].operand_bytes, nbytes)


TWIN = ["--config.model.num_layers=2", "--config.model.d_model=64", "--config.model.num_heads=4",
        "--config.model.max_len=64", "--config.dataset.seq_len=64", "--config.global_batch_size=16",
        "--config.optimizer.learning_rate=3e-3", "--config.optimizer.warmup_steps=2", "--config.num_steps=12"]


def test_the_width_scaled_twin_trains():
    """The experiment's own config with the twin's overrides (its docstring's command): the same data, vocabulary,
    precision and step, 2 blocks of width 64 at tiny_lm's rate (3e-3). The loss starts near ln 50257 = 10.8 nats
    per byte (tied logits start with variance ~1: measured 11.44) and 12 AdamW steps take the mean of the last
    three batches' losses 2.5 nats below that of the first three (measured under jax 0.10: 11.44, 11.35, 10.66,
    9.79, 9.64, 9.08, 9.01, 8.53, 8.35, 8.40, 8.31, 8.31, a drop of 2.81; under jax 0.11, whose initial draws
    differ: 11.32 ... 7.80, 8.53, 8.26, 2.88). Each step's batch differs, so single steps may rise."""
    config = config_lib.load(gpt2_small.__file__, TWIN)
    mesh = setup.make_mesh(config)
    inputs = setup.load_data(config, mesh)
    assert inputs.dataset.num_classes == gpt2_small.VOCAB and inputs.dataset.train.inputs.max() < 256
    parts = setup.build_parts(config, mesh, inputs.dataset, inputs.loader.steps_per_epoch, inputs.num_steps)
    assert parts.model.tie_embeddings and parts.policy.compute == jnp.bfloat16
    step = setup.make_step(config, parts, mesh)
    state = setup.init_state(config, parts, mesh)
    losses = []
    for index in range(inputs.num_steps):
        state, metrics = step(state, inputs.loader.batch(index))
        losses.append(float(metrics["loss"]))
    shown = ", ".join(f"{loss:.2f}" for loss in losses)
    assert abs(losses[0] - math.log(gpt2_small.VOCAB)) < 1.0, shown  # tied logits start with variance ~1
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 2.5 and np.all(np.isfinite(losses)), shown


def test_the_memory_model_at_full_size_and_where_it_is_not_checked(full_size):
    """dtx.perf.memory's estimate of the full-size step's peak against XLA's (compiled_peak; both affine in the
    block count: extrapolated from 1 and 2 blocks): 4.07 GB against 4.78 GB, 0.85, on the XLA:CPU of jax 0.10. A
    bfloat16 compute dtype on XLA:CPU (which computes in float32 and keeps converted copies) is a regime dtx says
    its estimate does not cover within 15 % (memory.uncovered, the warning a run with memory_limit prints), and
    0.85 is inside the range that warning names (0.68-0.90); the XLA:CPU of jax 0.11 keeps less, and there the
    estimate reads 1.06, within 15 %. The bound is the union of the two."""
    from dtx.perf import memory

    model, policy, compiled = full_size["model"], full_size["policy"], full_size["compiled"]
    estimates = [memory.estimate_model(model.clone(num_layers=blocks), (SEQ,), "data", dtype=jnp.int32,
                                       nodes=DEVICES, global_batch=DEVICES, optimizer="adamw", policy=policy).total
                 for blocks in (1, 2)]
    peaks = [memory.compiled_peak(_Stats(compiled[blocks]["memory"])) for blocks in (1, 2)]
    ratio = at_full_depth(*estimates, model.num_layers) / at_full_depth(*peaks, model.num_layers)
    assert "2-byte compute dtype on XLA:CPU" in memory.uncovered("data", policy=policy, backend="xla_cpu")
    assert 0.68 <= ratio <= 1.15, ratio


class _Stats:
    """A compiled step's memory_analysis, as memory.compiled_peak reads it."""

    def __init__(self, stats):
        self.stats = stats

    def memory_analysis(self):
        return self.stats
