"""A mixture-of-experts byte-level LM: experiments/tiny_lm.py with every MLP 8 experts, top-2 (docs/moe.md).

The corpus, optimizer, schedule, width and depth are tiny_lm.py's; each block's MLP becomes a mixture of 8 expert
MLPs of hidden width 2·64, of which a float32 softmax router picks 2 per byte (gates renormalised over the 2, as
Mixtral does), in capacity buckets of ``ceil(1.25 · 64 · 2 / 8) = 20`` slots per expert and sequence. Two experts
of width 128 are the dense MLP's 256 in FLOPs, so a byte costs what it costs in tiny_lm.py (plus the router's
64 × 8), while the MLPs hold 4 times the parameters (0.34 M in all against tiny_lm's 0.14 M). Balance: Switch's
load-balancing loss at 0.01 and ST-MoE's router z-loss at 0.001, both added to the loss. The mesh is
``(("data", 2), ("expert", 4))`` under the ``jit`` driver: each device holds 2 of the 8 experts of every layer
(dtx.parallel.expert), the examples are split over all 8 devices, and each layer's capacity buckets travel to the
experts' devices and back by all-to-all.

Launch (8 emulated CPU devices):

    dtx train experiments/moe_lm.py
    dtx train experiments/moe_lm.py --config.model.moe.aux_weight=0                # no balancing
    dtx train experiments/moe_lm.py --config.model.moe.aux_weight=0 --config.model.moe.balance=bias  # DeepSeek-V3
    dtx train experiments/tiny_lm.py                                               # dense, equal active FLOPs
    dtx plot runs/moe_lm-* --metrics loss,Block_0.moe.load_max,Block_1.moe.load_max,Block_0.moe.dropped

Each training record holds, per MoE layer, ``Block_<i>.moe.dropped`` (the fraction of the byte-expert assignments
that found their expert's bucket full), ``load_max`` (the busiest expert's assignments over the mean), ``aux_loss``
and ``z_loss``.

Measured (300 steps of 64 windows of 64 bytes on ``data 2 × expert 4``, 55-110 s each on a 2-core x86_64 host
(two runs shared it), jax 0.10.2; test perplexity per byte, exp(test_loss), on the 728 test windows; ``load_max``
and ``dropped`` of blocks 0 / 1 at step 300, the busiest expert's share over the mean, at most 8 / 2 = 4 when one
expert is in every byte's top 2):

    run (command above)                        perplexity   load_max      dropped
    MoE, aux loss 0.01 (the default)           7.82         1.21 / 1.12   6.2 % / 5.4 %
    MoE, no balancing (aux_weight=0)           8.05         1.56 / 3.63   13.4 % / 34.6 %
    MoE, bias balancing, no aux loss           7.96         1.06 / 1.21   4.9 % / 6.8 %
    dense tiny_lm.py, equal active FLOPs       8.07         -             -

Without balancing the second layer's router collapses toward one expert (3.63 of the 4 possible; a third of its
assignments dropped); the aux loss and DeepSeek-V3's bias each hold both layers near even, and the balanced MoEs
beat the dense model of equal active FLOPs (7.82 against 8.07), the unbalanced one barely does (8.05). The same runs
data-parallel on 8 devices (``--config.mesh='(("data", -1),)'``, before the expert axis) gave 7.78, 8.04 and 7.96:
the layouts route and drop the same tokens, and 300 steps of float32 rounding in another order (a near-tie of
the router's scores turned over) move the final figures by up to 0.5 %.
"""

from ml_collections import ConfigDict

from dtx.experiments import tiny_lm


def get_config():
    config = tiny_lm.get_config()  # its corpus, optimizer, schedule, batch and length; the MLPs mixtures of experts
    config.model.mlp_ratio = 2  # each expert half the dense MLP's width: top-2 of them is its FLOPs
    config.mesh = (("data", 2), ("expert", 4))  # expert parallelism: 2 experts a device, the batch over all 8
    config.driver = "jit"  # the expert layout runs under jit (its all-to-alls inside a shard_map region)
    with config.model.unlocked():
        config.model.moe = ConfigDict(dict(experts=8, top_k=2, every=1, capacity_factor=1.25, aux_weight=0.01,
                                           z_weight=0.001, balance="aux", bias_rate=0.001, renormalize=True))
    return config
