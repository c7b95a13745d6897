"""Context parallelism in the transformer planner (dtx.perf.lm_plan: ``C``, every sequence split over a ``context``
axis, with the ring, all-gather or Ulysses kernel) and in ``dtx simulate --seq-len``: its choices under memory, its
kernels' bytes against dtx.parallel.context.costs, its printed overrides accepted by ``dtx train``'s config, and one
data × context plan compiled at 8 devices and held to the model as ``--verify`` holds it.

Where the context rules came from (dtx.tools.lm_sim.CONTEXT_KINDS, the development twins: 2 blocks of width 256, 8
heads, 128 positions, 16 sequences, 8 devices): D2×C4 ring, D1×C8 ring, D4×C2 all-gather, D2×C4 Ulysses, D2×C4 ring
ZeRO-1 and ZeRO-3, under ``full`` and ``dots``, and with 2 micro-batches (with ZeRO-1 and 3 too). The bytes: the
kernels' collectives are dtx.parallel.context.costs.block_bytes at 4 bytes (XLA:CPU's f32), half again under
``dots`` and ``full``; the gradients are all-reduced over ``context`` and over the data shards apart, the tied
table's two gradients apart (``held + V·d``), under ZeRO ``held`` over data and ``(held + V·d)/D`` over context,
each micro-batch's. Held out, written before they were first compiled (dtx.tools.lm_sim.CONTEXT_HELD_OUT): D4×C2
Ulysses ZeRO-2 at 4 blocks of 192, 6 heads, 96 positions (compiled here), D2×C4 all-gather ZeRO-3 ``dots`` with 2
micro-batches at 2 blocks of 128, 4 heads, 256 positions, and D1×C8 ring ``full`` at 3 blocks of 320, 10 heads, 64
positions (held through the published table below).

Tensor × context (Megatron's pairs over ``model`` beside the context axis, ``P = 1``, each remat policy): the T×C
gradients were read from CONTEXT_KINDS' T×C twins (D1×T2×C4 ring, D2×T2+SP×C2 ring, D2×T2×C2 Ulysses, D2×T2×C2
ring ZeRO-1, D2×T2+SP×C2 all-gather ZeRO-3) and from D4×T2×C2 and D2×T4×C2 with and without SP and ZeRO on 16
emulated devices (where the groups' sizes tell the axes apart); the held-out T×C rows of CONTEXT_HELD_OUT
(D2×T2+SP×C2 Ulysses ZeRO-2, compiled here; D1×T2×C4 all-gather M = 2; D1×T4+SP×C2 ring) were written before they
were first compiled.
"""

import dataclasses
import os
import re
import shlex

import pytest

from dtx import config as config_lib
from dtx import parallel
from dtx.parallel.context import costs as context_costs
from dtx.parallel.tensor import costs as tensor_costs
from dtx.perf import lm_plan
from dtx.perf.clusters import get_cluster
from dtx.tools import lm_sim
from dtx.tools.plancheck import MEMORY_TOLERANCE, VERIFY_TOLERANCE
from dtx.tools.simulate import simulate_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT2 = os.path.join(REPO, "experiments", "gpt2_small.py")
H100 = get_cluster("h100_nvlink_ndr")
SMALL = lm_plan.LMShape(12, 768, 12, 1024, name="gpt2_small")
BIG = lm_plan.LMShape(32, 4096, 32, 2048, name="gpt_7b")


def at(shape, seq):
    return dataclasses.replace(shape, seq=seq)


@pytest.mark.parametrize("shape, seq, nodes, batch, kernel", [
    (BIG, 131072, 256, 256, "ulysses"),  # 32 heads: C = 32 divides them
    (SMALL, 524288, 64, 64, "allgather"),  # 12 heads: no Ulysses at C = 8
], ids=["7b-128K-256", "gpt2-512K-64"])
def test_context_is_chosen_where_no_whole_sequence_plan_fits(shape, seq, nodes, batch, kernel):
    """Where no plan keeping each sequence on one device fits the H100 (every ``C = 1`` candidate, tensor, SP, ZeRO,
    remat and pipelines included, is over 90 % of its memory), the planner splits the sequences; why() says so and
    names the kernel's reason. The 7B shape at 128K tokens on 256 H100s: Ulysses over 32 devices (across nodes: the
    network); GPT-2 small at 512K on 64: the all-gather, as Ulysses cannot split 12 heads 8 ways and the ring sends
    the same bytes in 28 messages a block, not 4."""
    found = lm_plan.best(at(shape, seq), H100, nodes, batch)
    chosen = found["chosen"]
    assert found["whole"] is None and not lm_plan.fits(found["least"], H100)
    assert chosen.context > 1 and chosen.attention == kernel and lm_plan.fits(chosen, H100)
    why = lm_plan.why(found, H100)
    assert why.startswith("no plan keeping each sequence on one device fits") and chosen.text() in why
    if kernel == "allgather":
        assert "Ulysses needs the 12 heads divisible by 8" in why and "ring sends more messages" in why


def test_context_is_chosen_only_where_it_fits_or_wins():
    """Across sequence lengths (GPT-2 small on 8 H100s, 512K tokens a step): a ``C > 1`` plan is chosen exactly where
    no ``C = 1`` plan fits or it is faster than the fastest that does; at GPT-2's own 1024 and at 8K every sequence
    stays whole (the context collectives and the second gradient all-reduce cost time, and save nothing)."""
    for seq in (1024, 8192, 32768, 131072, 262144, 524288):
        found = lm_plan.best(at(SMALL, seq), H100, 8, max(8, 512 * 1024 // seq))
        chosen, whole = found["chosen"], found["whole"]
        split = chosen is not None and chosen.context > 1
        assert split == (chosen is not None and (whole is None or whole.time > chosen.time)), seq
        if seq <= 8192:
            assert chosen.context == 1 and chosen is whole


def test_ulysses_needs_the_heads_to_divide():
    """Ulysses is never a candidate where ``C`` does not divide the heads (GPT-2 small's 12 at C = 8), and plan()
    refuses it as dtx's config check does; the ring and the all-gather are."""
    every = lm_plan.candidates(at(SMALL, 8192), H100, 64, 64)
    kinds = {(p.context, p.attention) for p in every if p.context > 1}
    assert ("ulysses", 8) not in kinds and (8, "ulysses") not in kinds and (4, "ulysses") in kinds
    assert {(8, "ring"), (8, "allgather"), (64, "ring")} <= kinds
    assert all(SMALL.heads % p.context == 0 for p in every if p.attention == "ulysses")
    with pytest.raises(lm_plan.PlanError, match="heads"):
        lm_plan.plan(at(SMALL, 8192), H100, 8, 8, context=8, attention="ulysses")
    with pytest.raises(lm_plan.PlanError, match="2 x 16 chunks"):  # the balanced layout: 2C chunks
        lm_plan.plan(at(SMALL, 1040), H100, 16, 16, context=16)
    with pytest.raises(lm_plan.PlanError, match="stages"):  # the planner does not model stages beside context
        lm_plan.plan(at(SMALL, 8192), H100, 8, 8, context=2, stages=2)


@pytest.mark.parametrize("kernel", ["ring", "allgather", "ulysses"])
def test_context_bytes_are_the_kernels_block_bytes(kernel):
    """A context plan's context bytes are dtx.parallel.context.costs.block_bytes per block and micro-batch (b
    sequences of a data shard's micro-batch, the compute dtype's 2 bytes) times the blocks and ``M``, half again
    under ``dots`` and ``full`` (the recomputed forward's collectives); the time is α-β on NVLink inside a node and on
    the network past it."""
    shape = at(SMALL, 8192)
    p = lm_plan.plan(shape, H100, 64, 64, context=4, attention=kernel, micro=2)
    b = 64 // (16 * 2)
    per_block = context_costs.block_bytes(kernel, b, 8192, 768, 4, 2)
    assert p.context_bytes == 2 * 12 * per_block
    assert p.bytes_sent == p.context_bytes + p.grad_bytes
    full = lm_plan.plan(shape, H100, 64, 64, context=4, attention=kernel, micro=2, policy="full")
    assert full.context_bytes == 1.5 * p.context_bytes
    messages = lm_plan.context_messages(kernel, 4)
    assert p.context_s == pytest.approx(p.context_bytes / H100.local_bandwidth + 2 * 12 * messages * H100.local_latency)
    far = lm_plan.plan(shape, H100, 64, 64, context=16, attention="ring" if kernel == "ulysses" else kernel)
    assert lm_plan.context_link(H100, 16) == (H100.bandwidth, H100.latency) and far.context_s > 0


def test_context_memory_splits_the_sequence():
    """Per device a context plan holds ``1/C`` of its sequences' activations and logits; the all-gather also the
    whole sequence's keys and values for one block (``2·b·S·d`` in bf16); the state is the data plan's of ``D``
    shards (ZeRO over the data axis alone)."""
    shape = at(SMALL, 8192)
    one = lm_plan.plan(shape, H100, 8, 8)
    ring = lm_plan.plan(shape, H100, 32, 8, context=4)
    gather = lm_plan.plan(shape, H100, 32, 8, context=4, attention="allgather")
    assert ring.memory["activations"] == one.memory["activations"] / 4 and ring.memory["logits"] == \
        one.memory["logits"] / 4
    assert gather.memory["gathered"] == 2 * 1 * 8192 * 768 * 2 and "gathered" not in ring.memory
    assert ring.memory["params"] == one.memory["params"] and ring.memory["optimizer"] == one.memory["optimizer"]


def test_printed_context_overrides_load_and_cli_prints_them(capsys):
    """``dtx simulate --model experiments/gpt2_small.py --seq-len N`` plans N tokens a sequence and prints a context
    plan with its kernel and why; the overrides (the ``context`` axis last, ``context.attention``, the jit driver,
    ZeRO over ``fsdp``) load as ``dtx train`` loads them and compose the context layout. ``--seq-len`` for a
    model that is not a transformer experiment is refused."""
    assert simulate_main(["--model", GPT2, "--cluster", "h100_nvlink_ndr", "--nodes", "64", "--global-batch", "64",
                          "--seq-len", "524288"]) == 0
    out = capsys.readouterr().out
    assert "524288 positions" in out and "D8xT2+SPxC4(allgather) remat dots" in out
    line = next(row for row in out.splitlines() if "dtx train ..." in row)
    assert "--config.context.attention=allgather" in line and "--config.driver=jit" in line
    config = config_lib.load(GPT2, shlex.split(line.split("dtx train ...", 1)[1]))
    assert tuple(map(tuple, config.mesh)) == (("data", 8), ("model", 2), ("context", 4))
    assert config.context.attention == "allgather" and config.remat.policy == "dots"
    layout = parallel.configured(config)
    assert layout.name == "context" and layout.pairs and layout.zero_stage == 0
    assert simulate_main(["--model", "vgg_a", "--cluster", "h100_nvlink_ndr", "--seq-len", "4096"]) == 2
    assert "--seq-len" in capsys.readouterr().err


MEDIUM = lm_plan.LMShape(24, 1024, 16, 1024, name="gpt2_medium")


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("kernel", ["ring", "allgather", "ulysses"])
def test_tensor_by_context_bytes_are_both_layouts_block_bytes(kernel, sp):
    """A T×C plan (Megatron's pairs over ``model`` beside a ``context`` axis) sends per block and micro-batch the
    tensor layout's dtx.parallel.tensor.costs.block_bytes on a device's ``S/C`` positions (Korthikanti et al. 2022's
    table, its ends once a micro-batch: the token ids and the head's input gradient) and the kernel's
    dtx.parallel.context.costs.block_bytes at the attention width ``d/T`` (a device's ``h/T`` heads), each in the
    compute dtype's 2 bytes; the rest is the gradients; with T·C inside the node both run on NVLink."""
    shape, t, c, m = at(SMALL, 8192), 2, 2, 2
    p = lm_plan.plan(shape, H100, 64, 64, tensor=t, context=c, attention=kernel, sp=sp, micro=m, zero=1)
    b, s, d = 64 // (16 * m), 8192 // c, 768
    n, ids = b * s * d * 2, b * s * 4
    send = tensor_costs.bytes_sent
    ends = (send("all-to-all", ids // t, t) + 2 * send("all-to-all", n // t, t) if sp else
            send("all-gather", ids // t, t) + send("all-gather", n // t, t))
    assert p.tensor_bytes == m * (shape.layers * tensor_costs.block_bytes(b, s, d, t, sp, 2) + ends)
    assert p.context_bytes == m * shape.layers * context_costs.block_bytes(kernel, b, 8192, d // t, c, 2)
    assert p.bytes_sent == p.tensor_bytes + p.context_bytes + p.grad_bytes and p.grad_bytes > 0
    assert p.tensor_s == pytest.approx(p.tensor_bytes / H100.local_bandwidth + m * (
        shape.layers * (10 if sp else 4) + 3) * H100.local_latency)
    assert lm_plan.group_per_node(H100, (p.data, t, c), "tc") == t * c  # both groups inside a node
    # Past the node the model group spans nodes (context the mesh's last axis, model next): its collectives go on
    # the network, priced at its bandwidth.
    far = lm_plan.plan(shape, H100, 64, 64, tensor=t, context=8, attention="ring", sp=sp, micro=m)
    assert lm_plan.group_per_node(H100, (far.data, t, 8), "t") == 1
    assert far.tensor_s > far.tensor_bytes / H100.bandwidth


def test_ulysses_with_tensor_needs_the_heads_to_divide_by_t_times_c():
    """Ulysses splits a device's ``h/T`` heads over ``C``: it is never a candidate where ``T·C`` does not divide the
    heads (GPT-2 small's 12 at T2×C4, T4×C2), nor chosen there, and plan() refuses it as dtx's config check does;
    SP needs the positions to divide by ``T·C``. T×C candidates carry each remat policy."""
    every = lm_plan.candidates(at(SMALL, 8192), H100, 64, 64)
    mixed = [p for p in every if p.tensor > 1 and p.context > 1]
    assert {(2, 2, "ulysses"), (2, 4, "ring"), (4, 2, "allgather")} <= {(p.tensor, p.context, p.attention)
                                                                      for p in mixed}
    assert all(SMALL.heads % (p.tensor * p.context) == 0 for p in mixed if p.attention == "ulysses")
    assert {p.policy for p in mixed} == set(lm_plan.TENSOR_CONTEXT_POLICIES) == set(lm_plan.POLICIES)
    for seq, nodes, batch in ((16384, 8, 32), (65536, 64, 64)):
        chosen = lm_plan.best(at(SMALL, seq), H100, nodes, batch, policies=("none",))["chosen"]
        assert chosen.attention != "ulysses" or SMALL.heads % (chosen.tensor * chosen.context) == 0
    with pytest.raises(lm_plan.PlanError, match="heads"):
        lm_plan.plan(at(SMALL, 8192), H100, 8, 8, tensor=4, context=2, attention="ulysses")
    with pytest.raises(lm_plan.PlanError, match="remat.policy='offload'"):
        lm_plan.plan(at(SMALL, 8192), H100, 8, 8, tensor=2, context=2, policy="offload")
    with pytest.raises(lm_plan.PlanError, match="SP splits"):
        lm_plan.plan(at(SMALL, 8196), H100, 8, 8, tensor=4, context=2, sp=True)  # 2C chunks, not T·C


def test_tensor_by_context_memory_and_why():
    """Where dtx's remat is not asked for (``policies=("none",)``), GPT-2 medium's 16 heads at 16K tokens on 16 H100s
    train fastest as D2×T2×C4 Ulysses: SP-free TP inside the node with each sequence over 4 devices; why() says
    why the sequence is split, why a model axis beside the context one, where both groups run and why the kernel.
    Its memory: the activations ``1/C`` of TP's, the logits ``1/(T·C)``; the all-gather's keys and values of
    ``h/T`` heads."""
    found = lm_plan.best(at(MEDIUM, 16384), H100, 16, 32, policies=("none",))
    chosen = found["chosen"]
    assert chosen.tensor > 1 and chosen.context > 1 and lm_plan.fits(chosen, H100)
    why = lm_plan.why(found, H100)
    assert chosen.text() in why and f"each block's heads over {chosen.tensor}" in why
    assert "both groups inside a node" in why and "than the fastest context plan without a model axis" in why
    assert found["untensored"] is None or found["untensored"].time > chosen.time
    shape = at(MEDIUM, 16384)
    tp = lm_plan.plan(shape, H100, 8, 4, tensor=2)  # D4, one sequence a shard
    tc = lm_plan.plan(shape, H100, 32, 4, tensor=2, context=4, attention="allgather")
    assert tc.memory["activations"] == tp.memory["activations"] / 4
    assert tc.memory["logits"] == tp.memory["logits"] / 4
    assert tc.memory["gathered"] == 2 * 1 * 16384 * 1024 / 2 * 2


def test_printed_tensor_by_context_overrides_load():
    """A T×C plan's overrides: the mesh ``(("fsdp", D), ("model", T), ("context", C))`` (context last), Megatron's
    split by ``model_axis.split=megatron`` (not ``parallel.name=tensor``), SP, the kernel and the jit driver; they
    load as ``dtx train`` loads them and compose the context layout with Megatron's pairs."""
    p = lm_plan.plan(at(SMALL, 16384), H100, 16, 32, tensor=2, context=2, zero=1, sp=True, attention="ulysses",
                     micro=2)
    out = p.overrides()
    assert "--config.model_axis.split=megatron" in out and "--config.parallel.name=tensor" not in out
    assert {"--config.driver=jit", "--config.tensor.sequence_parallel=True",
            "--config.context.attention=ulysses"} <= set(out)
    config = config_lib.load(GPT2, shlex.split(" ".join(out)))
    assert tuple(map(tuple, config.mesh)) == (("fsdp", 4), ("model", 2), ("context", 2))
    layout = parallel.configured(config)
    assert layout.name == "context" and layout.kernels == "paired" and layout.zero_stage == 1


@pytest.fixture(scope="module")
def compiled_tc():
    """The held-out D2×T2+SP×C2 Ulysses ZeRO-2 row (dtx.tools.lm_sim.CONTEXT_HELD_OUT[3], written before it was
    first compiled): a T×C plan built by dtx train's own parts and compiled once."""
    shape, batch, kind, micro = lm_sim.CONTEXT_HELD_OUT[3]
    assert kind[0] > 1 and kind[5] > 1
    return lm_sim.verify_one(GPT2, H100, dataclasses.replace(SMALL, **shape), batch, kind, micro)


def test_a_tensor_by_context_plan_compiles_to_the_model(compiled_tc):
    """--verify's check on the held-out T×C plan: FLOPs and bytes within VERIFY_TOLERANCE (2 %) of the planner's at
    XLA:CPU's element, memory within the 15 % of the held-out twins (this plan accumulates no micro-batches)."""
    row = compiled_tc
    assert row["role"] == "held out" and row["plan"] == "D2xT2+SPxC2(ulysses) ZeRO-2"
    assert abs(row["flops_ratio"] - 1) <= VERIFY_TOLERANCE and abs(row["bytes_ratio"] - 1) <= VERIFY_TOLERANCE, row
    assert abs(row["memory_ratio"] - 1) <= MEMORY_TOLERANCE, row


@pytest.fixture(scope="module")
def compiled():
    """The held-out D4×C2 Ulysses ZeRO-2 row (dtx.tools.lm_sim.CONTEXT_HELD_OUT[0], written before it was first
    compiled): a data × context plan built by dtx train's own parts and compiled once for the tests below."""
    shape, batch, kind, micro = lm_sim.CONTEXT_HELD_OUT[0]
    return lm_sim.verify_one(GPT2, H100, dataclasses.replace(SMALL, **shape), batch, kind, micro)


def test_a_data_by_context_plan_compiles_to_the_model(compiled):
    """--verify's check on a held-out data × context plan: per-device FLOPs (XLA's cost analysis) and bytes sent
    (the HLO's collectives) within :data:`dtx.tools.plancheck.VERIFY_TOLERANCE` (2 %) of the planner's at XLA:CPU's
    element (4 bytes), and its memory within the 15 % the other held-out twins are held to (tests/test_lm_memory.py;
    this plan accumulates no micro-batches: see docs/context_parallel.md for the ones that do)."""
    row = compiled
    assert row["role"] == "held out" and row["plan"] == "D4xC2(ulysses) ZeRO-2"
    assert abs(row["flops_ratio"] - 1) <= VERIFY_TOLERANCE and abs(row["bytes_ratio"] - 1) <= VERIFY_TOLERANCE, row
    assert abs(row["memory_ratio"] - 1) <= MEMORY_TOLERANCE, row


def test_the_published_context_table_holds_the_held_out_rows():
    """BENCHMARKS' ``context_plans`` section, as benchmarks/context_plans.py last wrote it (tests/test_benchmarks_docs.py
    holds it to that rendering): every development kind is there marked ``fitted``, every
    :data:`dtx.tools.lm_sim.CONTEXT_HELD_OUT` row marked ``held out``, all within 2 % in FLOPs and bytes; and the
    planner's table has a row per shape, sequence length and GPU count."""
    text = open(os.path.join(REPO, "BENCHMARKS.md"), encoding="utf-8").read()
    section = re.search(r"<!-- bench:context_plans -->\n(.*?)\n<!-- /bench:context_plans -->", text, re.S).group(1)
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines() if line.startswith("| ")]
    checks = [row for row in cells if row[0] in ("fitted", "held out")]
    assert len([r for r in checks if r[0] == "fitted"]) == len(lm_sim.CONTEXT_KINDS)
    assert len([r for r in checks if r[0] == "held out"]) == len(lm_sim.CONTEXT_HELD_OUT)
    for row in checks:
        flops, sent = float(row[5].split()[0]), float(row[8].split()[0])
        assert abs(flops - 1) <= VERIFY_TOLERANCE and abs(sent - 1) <= VERIFY_TOLERANCE, row
    plans = [row for row in cells if row[0] in ("gpt2_small", "gpt_7b")]
    assert len(plans) == 2 * 5 * 3
