"""One transformer block's costs (dtx.perf.decoder), the one source the two planners read: the LM planner
(dtx.perf.lm_plan) and the data x pipeline planner's view of a transformer (dtx.parallel.pipeline.plan), held to each
other and to the model's own matrix products (dtx.perf.layers.model_flops) at GPT-2 small's shape."""

import jax.numpy as jnp
import pytest
from dtx.models import build_model

from dtx.parallel.pipeline import plan as pipeline_plan
from dtx.perf import decoder, lm_plan
from dtx.perf.layers import model_flops

L, D, H, S, V = 12, 768, 12, 1024, 50257  # GPT-2 small


@pytest.fixture(scope="module")
def per_block():
    """One block's training FLOPs per sequence read from the model: model_flops (6 x every product's MACs, traced
    abstractly) of 2 blocks minus that of 1, at GPT-2 small's width, heads, positions and vocabulary."""
    def flops(blocks):
        model = build_model("transformer", num_layers=blocks, d_model=D, num_heads=H, mlp_ratio=4, max_len=S,
                            num_classes=V, tie_embeddings=False)
        return model_flops(model, (S,), dtype=jnp.int32)
    return flops(2) - flops(1), flops(1)


def test_both_planners_count_gpt2_smalls_block_as_the_model_does(per_block):
    """The LM planner's per-token matmul FLOPs and the pipeline planner's block layer agree on one block,
    6·(12d² + 2·S·d) per token (the projections, the MLP, and attention's scores over the full S x S), and both
    equal the model's own products; the head the same, 6·d·V."""
    block, whole_one = per_block
    shape = lm_plan.LMShape(L, D, H, S, V)
    lm_block = (shape.matmul_flops() - lm_plan.LMShape(L - 1, D, H, S, V).matmul_flops()) * S
    layers = pipeline_plan.transformer_layers(L, D, S, V, heads=H)
    assert lm_block == layers[1].train_flops == block == 6 * S * (12 * D * D + 2 * S * D)
    assert layers[-1].train_flops == 6 * S * D * V == whole_one - block  # one block and the head make the model
    assert sum(layer.train_flops for layer in layers) == shape.matmul_flops() * S


def test_weights_boundary_and_memory_come_from_one_block():
    """Weights 12d² + 13d per block in both planners; the pipeline boundary is the d-wide stream of every token; the
    LM planner's activations per token are the block's (Korthikanti et al.)."""
    block = decoder.Block(D, H, S)
    shape = lm_plan.LMShape(L, D, H, S, V)
    layers = pipeline_plan.transformer_layers(L, D, S, V, heads=H)
    assert shape.block_params == layers[1].weights == block.params == 12 * D * D + 13 * D
    assert layers[1].out_elements == S * block.boundary == S * D
    for args in ((1, False, "none"), (8, True, "none"), (4, False, "dots"), (2, True, "full")):
        assert shape.activation_bytes(*args) == block.activation_bytes(*args)
    assert block.activation_bytes() == D * (34 + 5 * H * S / D)
