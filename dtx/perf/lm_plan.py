"""Transformer plans: data × tensor × pipeline × ZeRO × remat per GPU count, under the device's memory.

A GPT-shaped decoder (:class:`LMShape`: ``L`` blocks of width ``d``, ``a`` heads, ``S`` positions, vocabulary
``V``, MLP ``f = 4d``, the output layer tied to the embedding as GPT-2's) on ``N = D·T·P`` GPUs: ``D`` data
shards, ``T`` tensor-parallel devices (Megatron, :mod:`dtx.parallel.tensor.layout`; within one NVLink node, ``T ≤``
``Cluster.local_size``), ``P`` pipeline stages of ``L/P`` blocks (1F1B, ``M`` micro-batches), ZeRO stage
``z`` over the data axis and a remat policy (:mod:`dtx.models.remat`). Per step and device:

* **compute**: the matmul FLOPs per token ``6·(L·(4d² + 2fd) + dV) + 12·L·d·S`` (Kaplan et al. 2020's
  ``6N``, attention's scores counted whole as XLA does), the recomputed forward of the policy (docs/remat.md:
  ``full`` ``L·(2·(4d² + fd) + 4Sd)``, ``dots`` ``L·4Sd``) and the element-wise work XLA counts
  (:data:`ELEMENTWISE`), on ``1/N`` of the tokens (TP splits the blocks by ``T`` and runs the head split by
  examples over every device), at ``efficiency["dense"]`` of the roofline's peak; a pipeline's ticks carry
  the bubble ``(M + P − 1)/M`` (:mod:`dtx.parallel.pipeline.plan`'s schedule);
* **tensor collectives**: :func:`dtx.parallel.tensor.costs.block_bytes` per block and micro-batch in the compute dtype on
  the node's NVLink (α-β), the forward ones once more under ``full`` (the block's recomputation re-runs them);
* **pipeline messages**: :mod:`dtx.parallel.pipeline.plan`'s ``2(M + P − 2)`` boundary messages of ``b·S·d``;
* **gradients**: each device's parameter bytes in the reduce dtype, all-reduced over ``D`` (ring, hierarchical
  on the cluster); under ZeRO (every stage, 1 to 3) the step also all-gathers the updated parameter slices, so
  it sends ``3(D−1)/D`` of the bytes, 1.5 times an all-reduce's ``2(D−1)/D``: XLA:CPU all-reduces the gradient
  whole and each device slices its share (the compiled program's collectives; GPT-2 small on 8 devices sends
  152 MB under ZeRO-1 against 101 MB data parallel), where a GPU backend may reduce-scatter it instead;
* **memory** (:func:`memory_terms`, against ``Cluster.device_memory`` less :data:`MEMORY_HEADROOM`): float32
  parameters (4 B) and AdamW's two moments (8 B) per parameter a device holds — the blocks' ``1/(T·P)``; the
  embedding, positions and LayerNorms whole under TP (dtx replicates them) — the moments divided by ``D`` from ZeRO
  stage 1 on, the parameters at stage 3; gradients (4 B; ``/D`` from stage 2 on a GPU); the compute copy (2 B,
  whole under ZeRO-3 too: the gathered weights are kept from the forward to the backward pass); activations per
  block and token in bytes by Korthikanti et al. (arXiv 2205.05198, Table 2, 16-bit): ``d·(34 + 5aS/d)`` without
  remat, ``d·(10 + 24/T + 5aS/(dT))`` under TP, ``/T`` of it all under SP; ``dots`` (their selective
  recomputation) drops the ``5aS/d`` scores; ``full`` keeps the block input ``2d`` and holds one block's
  activations again while it recomputes; the logits' gradient in the compute dtype and the loss's float32 softmax
  (6 B per logit), split as the head is; the tied embedding's second gradient (4 B per ``V·d``: the lookup's,
  a scatter into zeros, apart from the head's until the two are summed; ``/D`` under ZeRO-3, and under ZeRO with
  TP, which splits the table's gradient); with ``M > 1`` the accumulated gradient (4 B per parameter held, ``/D``
  from ZeRO stage 2: :mod:`dtx.step.accumulate` carries it beside each micro-batch's own). On a GPU
  (``backend="gpu"``, the planner's tables) the terms are summed: a bound on the step's peak (gradients and
  activations are not all live at once), unchecked on a GPU. On XLA:CPU (``backend="xla_cpu"``, what ``--verify``
  compiles) the model is its buffer assignment's, read at the peak of the development twins (tests/test_lm_memory.py
  names them; they read 0.615–0.847 of the compiled peak before these terms, 0.948–1.023 after, the held-out
  twins 0.947–1.084): the parameters and moments, then the larger of two phases — the head's backward (the compute
  copy in **float32**, 4 B: XLA:CPU rounds each weight through bf16 and keeps the result as float32; the
  activations in float32, twice Korthikanti et al.'s; 10 B per logit, the bf16 gradient and a float32 copy of it
  for each of the head's two products; the tied embedding's second gradient, whose zeros XLA:CPU allocates in the
  forward pass; the accumulator) or the update (every gradient whole, 4 B: XLA:CPU all-reduces whole and slices
  under ZeRO 2–3 too, and the all-reduce's out-of-place result, 4 B more). At --verify's twins (vocabulary 50257,
  width 256) the head's backward is the peak. A pipeline (``P > 1``) is costed by
  :mod:`dtx.parallel.pipeline.lm_costs` as dtx runs it: its 1F1B keeps ``min(2P − 1, M)`` stage inputs in flight (the
  lock-step schedule's table, not PipeDream-Flush's ``P − s``) and each stage's activations for one micro-batch.

* **context** (``C > 1``, :mod:`dtx.parallel.context`): every sequence split over a ``context`` axis of ``C``
  devices, beside data shards and ZeRO (``T = P = 1`` here; with Megatron's pairs, **tensor × context**
  below), with one of three kernels — the ring (Liu, Zaharia & Abbeel 2023, arXiv 2310.01889), the all-gather of
  keys and values (Llama 3, Dubey et al. 2024, arXiv 2407.21783 §3.3.2) or Ulysses' all-to-alls (Jacobs et al.
  2023, arXiv 2309.14509; heads divisible by ``C``), the sequence in ``2C`` balanced chunks. Compute on
  ``1/(D·C)`` of the tokens, scores included (balanced; the ring's skipped blocks not credited: XLA's cost
  analysis counts them); the kernel's
  :func:`dtx.parallel.context.costs.block_bytes` per block and micro-batch in the compute dtype, half again under
  ``dots`` and ``full``, on NVLink when ``C ≤ local_size`` (the axis is the mesh's last) else on the network, one
  latency per collective (:func:`context_collectives`); the gradients as the compiled step reduces them
  (:func:`_context_gradients`); activations and logits of ``S/C`` positions, and for the all-gather the whole
  sequence's keys and values of one block, ``2·b·S·d`` in the compute dtype. :func:`why` says why the sequence is
  split and why its kernel (bytes, memory, head count, messages).

* **tensor × context** (``T, C > 1``, ``P = 1``: dtx refuses a stage axis beside context): Megatron's pairs over
  ``model`` (``model_axis.split=megatron``, with or without SP: Korthikanti et al. 2022) with every sequence split
  over ``context`` too, each attention region running the kernel over its ``h/T`` heads (Ulysses: heads divisible
  by ``T·C``; SP: positions by ``T·C``, ``S/(C·T)`` a device between the pairs). Compute on ``1/(D·T·C)`` of the
  block tokens (the head as TP runs it: split by examples over every device); the tensor layout's
  :func:`dtx.parallel.tensor.costs.block_bytes` (and its ends) on a device's ``S/C`` positions, the kernel's
  :func:`dtx.parallel.context.costs.block_bytes` at the attention width ``d/T``; the mesh ``(data|fsdp, model,
  context)``, context the fastest-varying axis, so both groups run on NVLink when ``T·C ≤ local_size`` — past it
  the model group spans nodes (its collectives on the network) and, where ``C > local_size``, the context group
  too; the gradients as the compiled step reduces them (:func:`_tensor_context_gradients`); memory: TP's or SP's
  activations per device ``/C``, the logits ``/(T·C)``, the all-gather's gathered keys and values of ``h/T``
  heads. Each remat policy (:data:`TENSOR_CONTEXT_POLICIES`). ``--verify``'s T×C rows
  (:data:`dtx.tools.lm_sim.CONTEXT_KINDS`, ``CONTEXT_HELD_OUT``) hold FLOPs and bytes to the compiled twins.

:func:`best` keeps the fastest plan that fits, its modelled memory at most ``1 − MEMORY_HEADROOM`` (90 %)
of the device's; :func:`why` says why in one sentence; :meth:`LMPlan.overrides` prints a plan as the named mesh
axes it composes (docs/composing.md: ``data`` or, under ZeRO, ``fsdp`` at ``fsdp.zero_stage``; ``stage``;
``model``; ``context`` last). What dtx runs: data parallelism with ZeRO over an ``fsdp`` axis, tensor parallelism
with SP and ZeRO over that axis under ``driver=jit``, and any remat policy; a context axis beside them (no remat
policy beside a model axis); and a pipeline (``P > 1``) of ``L/P`` blocks per stage, with or without a ``model``
axis splitting each stage, with or without SP inside the stages, with or without ZeRO-1 or ZeRO-3 over an
``fsdp`` axis (``fsdp.zero_stage`` 1 or 3: :mod:`dtx.parallel.pipeline.zero`;
not for LARS/LAMB, which dtx refuses there; no ZeRO-2 or remat policy with stages),
planned as dtx runs it (:mod:`dtx.parallel.pipeline.lm_costs`: an untied output layer, each stage's
forward re-run in its backward slot, its own element-wise terms).
``offload`` is not planned: its host transfers are not modelled.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from dtx.parallel.context import costs as context_model
from dtx.parallel.context.attention import KINDS as ATTENTION_KINDS
from dtx.parallel.pipeline import lm_costs as lm_pipeline
from dtx.parallel.tensor import costs as tensor_model
from dtx.perf import decoder
from dtx.perf.clusters import Cluster
from dtx.perf.decoder import ACTIVATION_WIDENING, COMPUTE, COMPUTE_COPY

POLICIES = ("none", "dots", "full")
# The remat policies a context plan takes: all three (remat wraps each block around the kernel's shard_map); under
# `dots` and `full` the block's recomputed forward runs the kernel's forward collectives again (the compiled twins:
# the ring's 2(C - 1) hops each way and 2(C - 1) again, lm_sim.CONTEXT_KINDS).
CONTEXT_POLICIES = POLICIES
# The remat policies a plan with Megatron's pairs beside a context axis takes: all three (the twins D2xT2xC2 ring
# under `dots` and D2xT2+SPxC2 all-gather under `full`, lm_sim.CONTEXT_KINDS, read FLOPs 1.008 and 1.006, bytes 1.000,
# memory 1.02 of the model: the tensor pairs' and the kernel's recomputed forward collectives as each alone).
TENSOR_CONTEXT_POLICIES = POLICIES
# The ZeRO stages dtx's pipeline runs over an fsdp axis (dtx.parallel.pipeline.zero; stage 2 is refused there: a
# pipeline accumulates its gradient row whole over the micro-batches and reduces it once, which is stage 1's).
PIPELINE_ZERO = (0, 1, 3)
MICRO = (1, 2, 4, 8, 16, 32, 64)  # gradient accumulation steps (or pipeline micro-batches) tried
# Element-wise FLOPs XLA's cost analysis counts beside the matmuls (LayerNorm, GELU, softmax, residual adds,
# the loss's softmax, AdamW's update), per token per logit, per token per block and width, per token per block
# per head and position (attention's scores), per parameter updated: read from XLA:CPU's cost analysis of the
# compiled bf16 AdamW step, data x 8, of the development cases (tests/test_lm_plan.py: 2 blocks of width 256, 4
# heads, 128 positions, V = 50257, 16 sequences; and each of 32 sequences, V = 25000, 3 blocks, 256 positions),
# checked on held-out shapes and on the tensor, SP, ZeRO and remat plans (`dtx simulate --verify`).
ELEMENTWISE = dict(logit=19.7, width=381.0, score=36.5, update=27.3)
PARAM, GRAD, ADAM = 4, 4, 8  # bytes per parameter: float32 master, gradient, AdamW moments (bf16 copy: COMPUTE)
BACKENDS = ("gpu", "xla_cpu")  # whose memory a plan models (module docstring, **memory**)
# Per backend: bytes per logit at the head's backward (the bf16 logits' gradient and the loss's float32 softmax; on
# XLA:CPU the bf16 gradient and a float32 copy for each of the head's two products); the compute copy's bytes and the
# activations' widening are dtx.perf.decoder's (shared with the pipeline's model). Read from the development cases'
# buffer assignments.
LOGIT_BYTES = dict(gpu=COMPUTE + 4, xla_cpu=COMPUTE + 2 * 4)
# The fraction of a GPU's memory a chosen plan leaves free: the model's largest shortfall against XLA:CPU's compiled
# peak, 5.3 % on the held-out twins (D4xT2 ZeRO-1 M=2 reads 0.947; tests/test_lm_memory.py) and 5.2 % on the
# development ones (D2xT2+SPxP2 0.948; of the ZeRO-1 pipeline twin's 5.0 %, 4.4 % is the allocator's
# fragmentation: its temporaries' allocation over their live peak), with as much again for what no twin measures
# (a GPU's own runtime buffers and allocator; the GPU terms are a sum, a bound, but unchecked on a GPU).
MEMORY_HEADROOM = 0.10


class PlanError(ValueError):
    """A shape or setting the planner cannot plan."""


@dataclasses.dataclass(frozen=True)
class LMShape:
    """A GPT-2-style decoder (``models/transformer.py``): ``layers`` pre-LayerNorm blocks, tied output layer."""

    layers: int
    width: int
    heads: int
    seq: int
    vocab: int = 50257
    mlp_ratio: int = 4
    name: str = "gpt"

    @classmethod
    def from_config(cls, config, name: str = "gpt") -> LMShape:
        m = config.model
        if m.get("name") != "transformer" or not m.get("tie_embeddings", False):
            raise PlanError(f"model.name={m.get('name')!r}: the LM planner plans models/transformer.py with "
                            "model.tie_embeddings=True (GPT-2's)")
        return cls(m.num_layers, m.d_model, m.num_heads, config.dataset.seq_len, 50257, m.mlp_ratio, name)

    @property
    def block(self) -> decoder.Block:
        """One block's costs (:mod:`dtx.perf.decoder`, shared with the pipeline planner)."""
        return decoder.Block(self.width, self.heads, self.seq, self.mlp_ratio)

    @property
    def block_params(self) -> int:
        return self.block.params  # QKV + out, the MLP pair, two LayerNorms

    @property
    def params(self) -> int:
        """Every parameter: the blocks, the token embedding (= the head), the positions, the last LayerNorm."""
        return self.layers * self.block_params + self.vocab * self.width + self.seq * self.width + 2 * self.width

    def matmul_flops(self, policy: str = "none") -> float:
        """Training matmul FLOPs per token, the policy's recomputed forward included (module docstring)."""
        d, f, s, n = self.width, self.mlp_ratio * self.width, self.seq, self.layers
        train = 6 * (n * self.block.macs + decoder.head_macs(d, self.vocab))  # = 6(L(4d² + 2fd) + dV) + 12LdS
        again = {"none": 0, "dots": n * 4 * s * d, "full": n * (2 * (4 * d * d + f * d) + 4 * s * d)}[policy]
        return float(train + again)

    def elementwise_flops(self) -> float:
        """Element-wise FLOPs per token XLA counts (:data:`ELEMENTWISE`), the update aside."""
        e = ELEMENTWISE
        return (e["logit"] * self.vocab + self.layers * (e["width"] * self.width + e["score"] * self.heads * self.seq))

    def activation_bytes(self, tensor: int, sp: bool, policy: str) -> float:
        """Bytes one block keeps per token (Korthikanti et al., Table 2; module docstring), on one device."""
        return self.block.activation_bytes(tensor, sp, policy)


@dataclasses.dataclass(frozen=True)
class LMPlan:
    """One plan: ``data`` × ``tensor`` × ``stages`` GPUs; per device per step."""

    shape: LMShape
    nodes: int
    global_batch: int  # sequences
    data: int
    tensor: int
    stages: int
    zero: int
    policy: str
    sp: bool
    micro: int  # accumulation steps (P = 1) or pipeline micro-batches
    flops: float  # per device per step (the busiest stage's)
    compute_s: float
    tensor_s: float
    p2p_s: float
    grad_s: float
    tensor_bytes: float
    p2p_bytes: float
    grad_bytes: float
    memory: dict
    update_flops: float = 0.0  # of flops: the optimizer's update, outside the micro-batch loop (--verify reads it apart)
    context: int = 1  # C: every sequence split over a ``context`` axis of C devices (module docstring, **context**)
    attention: str = ""  # the context kernel (dtx.parallel.context.attention: ring, allgather, ulysses) when C > 1
    context_s: float = 0.0
    context_bytes: float = 0.0

    @property
    def time(self) -> float:
        return self.compute_s + self.tensor_s + self.p2p_s + self.grad_s + self.context_s

    @property
    def memory_bytes(self) -> float:
        return sum(self.memory.values())

    @property
    def bytes_sent(self) -> float:
        return self.tensor_bytes + self.p2p_bytes + self.grad_bytes + self.context_bytes

    @property
    def runnable(self) -> bool:
        """Whether ``dtx train`` takes it (module docstring)."""
        return self.stages == 1 or (self.zero in PIPELINE_ZERO and self.policy == "none")

    def text(self) -> str:
        parts = [f"D{self.data}"] + ([f"T{self.tensor}" + ("+SP" if self.sp else "")] if self.tensor > 1 else [])
        parts += [f"P{self.stages}"] if self.stages > 1 else []
        parts += [f"C{self.context}({self.attention})"] if self.context > 1 else []
        extra = [f"ZeRO-{self.zero}"] if self.zero else []
        extra += [f"remat {self.policy}"] if self.policy != "none" else []
        extra += [f"M={self.micro}"] if self.micro > 1 else []
        return "x".join(parts) + (" " + ", ".join(extra) if extra else "")

    def axes(self) -> list[tuple[str, int]]:
        """The plan as named mesh axes (docs/composing.md): the ``D`` data shards a ``data`` axis, or an ``fsdp``
        axis where ZeRO splits the state over them; ``stage`` for ``P > 1``; ``model`` for ``T > 1``; ``context``
        for ``C > 1``, last: the fastest-varying axis, so a group of ``C ≤ local_size`` devices is one node's."""
        axes = [("fsdp" if self.zero else "data", self.data)]
        return (axes + [("stage", self.stages)] * (self.stages > 1) + [("model", self.tensor)] * (self.tensor > 1)
                + [("context", self.context)] * (self.context > 1))

    def overrides(self) -> list[str]:
        """The ``dtx train`` overrides that run this plan (only a :attr:`runnable` one): its mesh axes (the
        parallelisms compose from them: :func:`dtx.parallel.compose`), the ZeRO stage of its ``fsdp`` axis, and
        the settings of each parallelism it uses."""
        if not self.runnable:
            raise PlanError(f"{self.text()} is modelled only: the planned pipeline takes ZeRO "
                            f"{' or '.join(map(str, PIPELINE_ZERO[1:]))} and no remat policy")
        mesh = "(" + ", ".join(f'(\"{name}\", {size})' for name, size in self.axes()) + ("," if len(self.axes()) == 1
                                                                                      else "") + ")"
        out = [f"--config.mesh='{mesh}'"] + ([f"--config.fsdp.zero_stage={self.zero}"] if self.zero else [])
        if self.stages > 1:  # dtx.parallel.pipeline.lm_costs: L/P blocks per stage, the output layer untied
            cut = lm_pipeline.boundaries(self.shape.layers, self.stages)
            return out + ["--config.parallel.name=data", "--config.driver=shard_map",
                          f"--config.pipeline.schedule={lm_pipeline.SCHEDULE}",
                          f"--config.pipeline.microbatches={self.micro}",
                          f"--config.pipeline.boundaries='{cut}'",
                          "--config.model.tie_embeddings=False", f"--config.global_batch_size={self.global_batch}"] + (
                ["--config.tensor.sequence_parallel=True"] if self.sp else [])
        if self.tensor > 1 and self.context > 1:  # Megatron's pairs beside a context axis (docs/context_parallel.md)
            out += ["--config.parallel.name=data", "--config.model_axis.split=megatron", "--config.driver=jit",
                    f"--config.context.attention={self.attention}"]
            out += ["--config.tensor.sequence_parallel=True"] if self.sp else []
        elif self.tensor > 1:
            out += ["--config.parallel.name=tensor", "--config.driver=jit"]
            out += ["--config.tensor.sequence_parallel=True"] if self.sp else []
        elif self.context > 1:  # the context layout runs under the jit driver (docs/context_parallel.md)
            out += ["--config.parallel.name=data", "--config.driver=jit", f"--config.context.attention={self.attention}"]
        else:
            out += ["--config.parallel.name=data"]
        out += [f"--config.global_batch_size={self.global_batch}"]
        out += [f"--config.grad_accum_steps={self.micro}"] if self.micro > 1 else []
        out += [f"--config.remat.policy={self.policy}"] if self.policy != "none" else []
        return out


def plan(shape: LMShape, cluster: Cluster, nodes: int, global_batch: int, *, tensor: int = 1, stages: int = 1,
         zero: int = 0, policy: str = "none", sp: bool = False, micro: int = 1, reduce_bytes: int = 4,
         tensor_element: int = COMPUTE, backend: str = "gpu", context: int = 1, attention: str = "ring",
         context_element: int = COMPUTE) -> LMPlan:
    """The plan's time, bytes and memory (module docstring); ``tensor_element``: the element the tensor layout's
    activation collectives move (the compute dtype's, bf16, as on a GPU; XLA:CPU carries them as float32, 4);
    ``reduce_bytes``: the gradients' element size
    (GPT-2 small's experiment reduces in float32); ``backend``: whose memory (:func:`memory_terms`): ``"gpu"`` (the
    planner's) or ``"xla_cpu"`` (what ``--verify``'s twins compile to); ``context``: ``C``, every sequence split
    over a ``context`` axis with the kernel ``attention`` (module docstring, **context**), whose keys and values
    move as ``context_element`` bytes (the compute dtype's)."""
    if backend not in BACKENDS:
        raise PlanError(f"backend={backend!r}: one of {', '.join(BACKENDS)}")
    if nodes % (tensor * stages * context) or shape.layers % stages or shape.heads % tensor:
        raise PlanError(f"{nodes} GPUs as tensor {tensor} x stages {stages} x context {context} of {shape.layers} "
                        f"blocks, {shape.heads} heads: does not divide")
    if context > 1:
        check_context(shape, context, attention, tensor, stages, sp, policy)
    data = nodes // (tensor * stages * context)
    if global_batch % (data * micro):
        raise PlanError(f"global batch {global_batch} does not split into {data} shards x {micro} micro-batches")
    if stages > 1:  # dtx's pipeline as it runs (dtx.parallel.pipeline.lm_costs)
        if zero not in PIPELINE_ZERO or (zero and data == 1) or policy != "none":
            raise PlanError(f"the planned pipeline takes ZeRO {' or '.join(map(str, PIPELINE_ZERO[1:]))} over data "
                            f"shards (D = {data} here) and no remat policy (zero={zero}, policy={policy})")
        figures = lm_pipeline.costs(shape, cluster, nodes, global_batch, tensor, stages, micro, ELEMENTWISE,
                                    reduce_bytes=reduce_bytes, element=tensor_element, sp=sp, zero=zero,
                                    backend=backend)
        return LMPlan(shape, nodes, global_batch, data, tensor, stages, zero, policy, sp, micro, **figures)
    s, d = shape.seq, shape.width
    b = global_batch // (data * micro)  # sequences per micro-batch of a data shard
    shard_tokens = global_batch * s / data  # the tokens of one data shard per step (its context group's)
    # The busiest stage: its L/P blocks and the tied head with the loss (the last stage; all of it when P = 1).
    head = 6 * d * shape.vocab + ELEMENTWISE["logit"] * shape.vocab
    recomputed = recomputes(policy, tensor)
    per_token = (shape.matmul_flops(recomputed) + shape.elementwise_flops() - head) / stages + head
    blocks_params = shape.layers * shape.block_params
    held = blocks_params / (tensor * stages) + (shape.params - blocks_params)  # the rest whole (TP replicates it)
    update = ELEMENTWISE["update"] * held / (data if zero else 1)  # each device updates what it holds
    # A context group splits its shard's tokens C ways: every position-wise term on S/C positions, and attention's
    # scores too (each device's queries against every key, S/C x S; balanced, equal on every device). The ring's
    # skipped blocks are not credited: XLA's cost analysis counts a lax.cond as its costlier branch (docstring).
    flops = per_token * shard_tokens / (tensor * context) + update
    rate = cluster.node_flops * cluster.efficiency["dense"]
    compute_s = flops / rate  # one stage: no bubble, no messages (a pipeline returned above)
    x = reduce_bytes  # the element the gradients' collectives move (module docstring)
    # The tensor layout's collectives on a device's S/C positions (a context split of every sequence beside it);
    # on NVLink while the model group is inside a node (T·C <= local_size: context is the mesh's last axis).
    tensor_bytes, collectives = _tensor_bytes(shape, b, tensor, sp, recomputed, tensor_element, s // context)
    tensor_bytes *= micro / stages
    bandwidth, latency = ((cluster.local_bandwidth, cluster.local_latency)
                          if group_per_node(cluster, (data, tensor, context), "t") == tensor
                          else (cluster.bandwidth, cluster.latency))
    tensor_s = tensor_bytes / bandwidth + micro * collectives / stages * latency
    p2p_bytes = p2p_s = 0.0
    if context > 1 and tensor > 1:  # Megatron's pairs beside a context axis (module docstring, **context**)
        grad_bytes, grad_s = _tensor_context_gradients(shape, cluster, held, data, tensor, context, zero, sp, x,
                                                       micro, b)
    else:
        grad_bytes, grad_s = _gradients(shape, cluster, held, data, tensor, stages, zero, sp, x, micro, context)
    memory = memory_terms(shape, b, data, tensor, zero, policy, sp, micro, backend, context, attention)
    context_bytes, context_s = context_collectives(shape, cluster, b, micro, context, attention, policy,
                                                   context_element, tensor)
    return LMPlan(shape, nodes, global_batch, data, tensor, stages, zero, policy, sp, micro, flops, compute_s,
                  tensor_s, p2p_s, grad_s, tensor_bytes, p2p_bytes, grad_bytes, memory, update_flops=update,
                  context=context, attention=attention if context > 1 else "", context_s=context_s,
                  context_bytes=context_bytes)


def check_context(shape: LMShape, context: int, attention: str, tensor: int = 1, stages: int = 1,
                  sp: bool = False, policy: str = "none") -> None:
    """What a context axis of ``context`` devices needs (docs/context_parallel.md), refused as dtx refuses it: data,
    fsdp and (Megatron's pairs) model axes beside it, no stages (not modelled here), a known kernel, the
    sequence in ``2C`` chunks (the balanced layout, :func:`dtx.parallel.context.attention.order`), for Ulysses heads
    divisible by ``T·C`` (it splits a device's ``h/T`` heads over ``C``) and under SP positions divisible by ``T·C``
    (``S/(C·T)`` a device between the pairs); beside a model axis the remat policies of :data:`TENSOR_CONTEXT_POLICIES`."""
    if stages > 1:
        raise PlanError(f"the planner plans a context axis beside data, fsdp and model axes, not beside {stages} "
                        "stages (dtx runs them, dtx.parallel.pipeline.context_stages, but their costs are not "
                        "modelled here)")
    if attention not in ATTENTION_KINDS:
        raise PlanError(f"context.attention={attention!r}: one of {', '.join(ATTENTION_KINDS)}")
    if shape.seq % (2 * context):
        raise PlanError(f"{shape.seq} positions do not cut into 2 x {context} chunks (the balanced layout)")
    if attention == "ulysses" and shape.heads % (tensor * context):
        raise PlanError(f"Ulysses splits the {shape.heads} heads over {tensor * context} devices (model {tensor} x "
                        f"context {context}): they do not divide")
    if tensor > 1 and policy not in TENSOR_CONTEXT_POLICIES:
        raise PlanError(f"remat.policy={policy!r} beside model {tensor} x context {context}: one of "
                        f"{', '.join(TENSOR_CONTEXT_POLICIES)}")
    if sp and shape.seq % (tensor * context):
        raise PlanError(f"SP splits the {shape.seq} positions over model {tensor} x context {context}: they do not "
                        "divide")


# Collectives per block and micro-batch of each context kernel (dtx.parallel.context.costs' table; tests/test_context.py
# counts them in the compiled step): the ring's 2(C - 1) key and value hops each way, the all-gather's 2 all-gathers
# and 2 reduce-scatters, Ulysses' 4 all-to-alls each way. Each is one latency, as the tensor layout's are here.
def context_messages(attention: str, context: int) -> int:
    return {"ring": 4 * (context - 1), "allgather": 4, "ulysses": 8}[attention]


def context_link(cluster: Cluster, context: int) -> tuple[float, float]:
    """``(bandwidth, latency)`` a context group's collectives run at: the node's NVLink when the group is inside one
    node (``C ≤ local_size``: the context axis is the mesh's last, :meth:`LMPlan.axes`), else the network (each
    device's own link: a ring or an all-to-all spanning nodes is as slow as its slowest hop)."""
    if context <= cluster.local_size:
        return cluster.local_bandwidth, cluster.local_latency
    return cluster.bandwidth, cluster.latency


def context_collectives(shape: LMShape, cluster: Cluster, b: int, micro: int, context: int, attention: str,
                        policy: str = "none", element: int = COMPUTE, tensor: int = 1) -> tuple[float, float]:
    """Bytes one device sends over ``context`` per step and their time (α-β on :func:`context_link`): per block and
    micro-batch :func:`dtx.parallel.context.costs.block_bytes` of ``b`` sequences at ``element`` bytes (the compute
    dtype's: the kernels move the projections' bf16 keys and values); under ``dots`` and ``full`` the block's
    recomputed forward runs the kernel's forward collectives again (half of them: the table's forward column; ``dots``
    keeps the projections, not what the kernel computes from the keys and values it received). Beside ``T``
    tensor-parallel devices each attention region runs the kernel over its own ``h/T`` heads: the attention width
    ``d/T``."""
    if context == 1:
        return 0.0, 0.0
    per_block = context_model.block_bytes(attention, b, shape.seq, shape.width // tensor, context, element)
    messages = context_messages(attention, context)
    if policy in ("dots", "full"):
        per_block, messages = 1.5 * per_block, messages * 3 // 2
    bandwidth, latency = context_link(cluster, context)
    sent = micro * shape.layers * per_block
    return sent, sent / bandwidth + micro * shape.layers * messages * latency


def memory_terms(shape: LMShape, b: int, data: int, tensor: int, zero: int, policy: str, sp: bool, micro: int,
                 backend: str = "gpu", context: int = 1, attention: str = "ring") -> dict:
    """Bytes per device of a one-stage plan (``P = 1``), ``b`` sequences per micro-batch of a data shard, by term
    (module docstring, **memory**); their sum is the modelled peak. ``"gpu"``: every term at once (a bound on the
    step's phases, unchecked on a GPU); ``"xla_cpu"``: the persistent state and the larger of the two phases whose
    terms XLA:CPU's buffer assignment holds at its peak (the head's backward or the update), the sizes it keeps."""
    v, d, s = shape.vocab, shape.width, shape.seq
    blocks = shape.layers * shape.block_params
    held = blocks / tensor + (shape.params - blocks)  # the rest whole (TP replicates it)
    cpu = backend == "xla_cpu"
    wide = ACTIVATION_WIDENING[backend]
    # Under context parallelism a device holds S/C positions of each of its b sequences: every activation /C (the
    # scores' 5aS/d per token stay: its queries attend to all S keys).
    act = shape.layers * b * s * shape.activation_bytes(tensor, sp, policy) / context
    if policy == "full":  # the block being recomputed holds its activations again
        act += b * s * shape.activation_bytes(tensor, sp, "none") / context
    persistent = dict(params=PARAM * held / (data if zero == 3 else 1),
                      optimizer=ADAM * held / (data if zero >= 1 else 1))
    accumulator = GRAD * held / (data if zero >= 2 else 1) if micro > 1 else 0.0  # dtx.step.accumulate's carry
    head = dict(compute_copy=COMPUTE_COPY[backend] * held, activations=wide * act,
                logits=b * s * v * LOGIT_BYTES[backend] / (tensor * context),
                embedding_grad=GRAD * v * d / (data if zero == 3 or (zero and tensor > 1) else 1),
                accumulator=accumulator)
    if context > 1 and attention == "allgather":  # the whole sequence's keys and values (a device's h/T heads), one
        head["gathered"] = 2 * b * s * shape.width / tensor * COMPUTE * wide  # block's, while it attends
    if not cpu:  # every term at once; ZeRO 2-3 reduce-scatter the gradients (1/D)
        return dict(persistent, grads=GRAD * held / (data if zero >= 2 else 1), **head)
    reduced = GRAD * held if data * tensor * context > 1 else 0.0  # the all-reduce's result, out of place, whole
    update = dict(grads=GRAD * held, reduced=reduced, accumulator=accumulator)
    return dict(persistent, **max(head, update, key=lambda phase: sum(phase.values())))


def contexts(shape: LMShape, nodes: int) -> list[int]:
    """The context sizes ``C > 1`` a candidate takes: powers of two dividing ``nodes`` whose ``2C`` chunks cut the
    sequence (the balanced layout), past the node (the network then carries the group's collectives)."""
    out, c = [], 2
    while c <= nodes:
        if nodes % c == 0 and shape.seq % (2 * c) == 0:
            out.append(c)
        c *= 2
    return out


def candidates(shape: LMShape, cluster: Cluster, nodes: int, global_batch: int, *, reduce_bytes: int = 4,
               policies: Sequence[str] = POLICIES, pipeline_zero: bool = True, context: bool = True) -> list[LMPlan]:
    """Every plan of ``nodes`` GPUs: ``T`` a power of two up to the node (dividing the heads), ``P`` dividing the
    blocks, ZeRO 0–3 (a pipeline's :data:`PIPELINE_ZERO`; only 0 when not ``pipeline_zero``: dtx refuses ZeRO with stages for
    LARS/LAMB, whose trust ratios need each tensor whole, ``dtx.optim.Optimizer.whole_tensors``), each
    policy, SP on or off under TP, ``M`` from :data:`MICRO` (``M ≥ P`` for a pipeline); and (``context``) with
    ``P = 1``, each context size of :func:`contexts` under each kernel that takes it (Ulysses: heads divisible
    by ``T·C``), ZeRO 0–3 over the data shards: with ``T = 1`` each policy (:data:`CONTEXT_POLICIES`), with
    ``T > 1`` (SP on or off; the model group on the network where ``T·C > local_size``)
    :data:`TENSOR_CONTEXT_POLICIES`."""
    stage_zero = PIPELINE_ZERO if pipeline_zero else (0,)
    out = []
    tensors = [t for t in (1, 2, 4, 8, 16) if t <= cluster.local_size and shape.heads % t == 0 and nodes % t == 0]
    for t, c in ((t, c) for t in tensors[1:] for c in (contexts(shape, nodes) if context else ())
                 if nodes % (t * c) == 0):
        # Megatron's pairs beside a context axis: both groups inside a node where T·C <= local_size (context the
        # mesh's last axis, model next); past it the model group spans nodes and plan() puts its collectives on the
        # network (and the context group's too where C > local_size).
        data = nodes // (t * c)
        for m in MICRO:
            if global_batch % (data * m):
                continue
            for zero in ((0, 1, 2, 3) if data > 1 else (0,)):
                for policy in (p for p in policies if p in TENSOR_CONTEXT_POLICIES):
                    for sp in (False, True):
                        if sp and shape.seq % (t * c):
                            continue
                        for kind in ATTENTION_KINDS:
                            if kind == "ulysses" and shape.heads % (t * c):
                                continue
                            out.append(plan(shape, cluster, nodes, global_batch, tensor=t, zero=zero, policy=policy,
                                            sp=sp, micro=m, reduce_bytes=reduce_bytes, context=c, attention=kind))
    for c in contexts(shape, nodes) if context else ():  # dtx composes a context axis with data and fsdp axes only
        data = nodes // c
        for m in MICRO:
            if global_batch % (data * m):
                continue
            for zero in ((0, 1, 2, 3) if data > 1 else (0,)):
                for policy in (p for p in policies if p in CONTEXT_POLICIES):
                    for kind in ATTENTION_KINDS:
                        if kind == "ulysses" and shape.heads % c:
                            continue
                        out.append(plan(shape, cluster, nodes, global_batch, zero=zero, policy=policy, micro=m,
                                        reduce_bytes=reduce_bytes, context=c, attention=kind))
    for t in tensors:
        for p in (q for q in range(1, shape.layers + 1) if shape.layers % q == 0 and nodes % (t * q) == 0):
            data = nodes // (t * p)
            for m in MICRO:
                if global_batch % (data * m) or (p > 1 and m < p):
                    continue
                for zero in ((0, 1, 2, 3) if data > 1 else (0,)):
                    if p > 1 and zero not in stage_zero:
                        continue  # dtx's pipeline takes fsdp.zero_stage 1 and 3 (neither for LARS/LAMB)
                    for policy in (policies if p == 1 else ("none",)):  # a pipeline re-runs each stage anyway
                        for sp in ((False, True) if t > 1 else (False,)):
                            if sp and shape.seq % t:
                                continue
                            out.append(plan(shape, cluster, nodes, global_batch, tensor=t, stages=p, zero=zero,
                                            policy=policy, sp=sp, micro=m, reduce_bytes=reduce_bytes))
    return out


def _key(p: LMPlan) -> tuple:
    # The fastest; among equal times, the simplest (fewest micro-batches, no ZeRO, no remat, fewer splits, the
    # smaller context group, then the kernel holding the least: ring, all-gather, Ulysses in ATTENTION_KINDS' order).
    return (round(p.time, 12), p.micro, p.zero, POLICIES.index(p.policy), p.tensor * p.stages, p.sp, p.context,
            ATTENTION_KINDS.index(p.attention) if p.attention else -1)


def usable(cluster: Cluster) -> float:
    """The device memory a plan may fill: all but :data:`MEMORY_HEADROOM` of it."""
    return (1 - MEMORY_HEADROOM) * cluster.device_memory


def fits(p: LMPlan, cluster: Cluster) -> bool:
    """Whether the plan's modelled memory leaves :data:`MEMORY_HEADROOM` of the device free."""
    return p.memory_bytes <= usable(cluster)


def best(shape: LMShape, cluster: Cluster, nodes: int, global_batch: int, **kwargs) -> dict:
    """The fastest plan that fits the device's memory less :data:`MEMORY_HEADROOM` (``chosen``), the fastest one
    dtx runs (``runnable``), the fastest data-parallel plan without ZeRO or remat and whether it fits (``plain``),
    and every candidate that fits (``fitting``); the fastest that fits keeping every sequence on one device
    (``whole``, ``C = 1``) and the one of those needing the least memory (``least``, fitting or not); the fastest
    context plan that fits without a model axis (``untensored``, ``C > 1``, ``T = 1``)."""
    every = candidates(shape, cluster, nodes, global_batch, **kwargs)
    fitting = sorted((p for p in every if fits(p, cluster)), key=_key)
    whole = [p for p in every if p.context == 1]
    plain = min((p for p in every if p.tensor == p.stages == p.context == 1 and not p.zero and p.policy == "none"),
                key=lambda p: (not fits(p, cluster), _key(p)), default=None)
    return dict(chosen=fitting[0] if fitting else None, fastest=min(every, key=_key, default=None),
                runnable=next((p for p in fitting if p.runnable), None), plain=plain, fitting=fitting,
                whole=next((p for p in fitting if p.context == 1), None),
                untensored=next((p for p in fitting if p.context > 1 and p.tensor == 1), None),
                least=min(whole, key=lambda p: p.memory_bytes, default=None))


def why(found: dict, cluster: Cluster) -> str:
    """One sentence: why the chosen plan won over plain data parallelism (and what it trades); "fits" is within the
    device's memory less :data:`MEMORY_HEADROOM`."""
    chosen, plain = found["chosen"], found["plain"]
    gib, room = cluster.device_memory / 2**30, usable(cluster) / 2**30
    if chosen is None:
        return f"nothing fits the device's memory ({room:.1f} of {gib:.0f} GiB, {MEMORY_HEADROOM:.0%} kept free)"
    if chosen.context > 1:
        return _why_context(found, cluster)
    if plain is None:
        return (f"{chosen.global_batch} sequences do not split over {chosen.nodes} data shards; {chosen.text()} is "
                f"the fastest split that fits ({chosen.memory_bytes / 2**30:.1f} of {room:.1f} GiB)"
                + _trade(chosen, found["fastest"]))
    if chosen is plain:
        return (f"plain data parallelism fits ({plain.memory_bytes / 2**30:.1f} of {room:.1f} GiB, "
                f"{MEMORY_HEADROOM:.0%} of {gib:.0f} kept free) and nothing is "
                f"faster: its gradient all-reduce {plain.grad_s * 1e3:.3g} ms beside {plain.compute_s * 1e3:.3g} ms "
                "of compute")
    if not fits(plain, cluster):
        over = max(plain.memory, key=plain.memory.get)
        return (f"plain data parallelism needs {plain.memory_bytes / 2**30:.1f} GiB (> {room:.1f}: {gib:.0f} less "
                f"{MEMORY_HEADROOM:.0%}; {over} {plain.memory[over] / 2**30:.1f} GiB); {chosen.text()} is the "
                f"fastest that fits ({chosen.memory_bytes / 2**30:.1f} GiB)" + _trade(chosen, found["fastest"]))
    return (f"{plain.time / chosen.time:.2f}x faster than plain data parallelism ({plain.time * 1e3:.3g} ms: "
            f"gradients {plain.grad_s * 1e3:.3g} ms); {chosen.text()}: compute {chosen.compute_s * 1e3:.3g} ms, "
            f"tensor {chosen.tensor_s * 1e3:.3g} ms, gradients {chosen.grad_s * 1e3:.3g} ms")


def variant(p: LMPlan, cluster: Cluster, attention: str) -> LMPlan | None:
    """The context plan ``p`` (GPU terms) with the kernel ``attention`` instead, or None where it cannot run
    (Ulysses: heads not divisible by ``T·C``): only its context collectives and its gathered keys and values differ."""
    if attention == "ulysses" and p.shape.heads % (p.tensor * p.context):
        return None
    b = p.global_batch // (p.data * p.micro)
    sent, seconds = context_collectives(p.shape, cluster, b, p.micro, p.context, attention, p.policy,
                                        tensor=p.tensor)
    memory = memory_terms(p.shape, b, p.data, p.tensor, p.zero, p.policy, p.sp, p.micro, "gpu", p.context,
                          attention)
    return dataclasses.replace(p, attention=attention, context_bytes=sent, context_s=seconds, memory=memory)


def _why_context(found: dict, cluster: Cluster) -> str:
    """Why a context plan: why the sequence is split (``C = 1`` does not fit, or is slower), then why this kernel —
    bytes (Ulysses sends ``C/2`` times fewer), memory (the all-gather holds the whole sequence's keys and values),
    head count (Ulysses needs heads divisible by ``T·C``), messages (the ring sends ``4(C − 1)`` a block, the others
    4 or 8). With ``T > 1`` also why a model axis beside the context one (against the fastest context plan with
    ``T = 1``: :func:`best`'s ``untensored``) and where its groups run (both inside a node when
    ``T·C ≤ local_size``)."""
    chosen, whole, least = found["chosen"], found["whole"], found["least"]
    room = usable(cluster) / 2**30
    c, link = chosen.context, "NVLink inside a node" if chosen.context <= cluster.local_size else "the network"
    t = chosen.tensor
    if whole is None:
        head = (f"no plan keeping each sequence on one device fits ({least.text()} needs "
                f"{least.memory_bytes / 2**30:.1f} of {room:.1f} GiB)" if least is not None else
                f"{chosen.global_batch} sequences do not split over {chosen.nodes} devices without a context axis")
    else:
        head = (f"{whole.time / chosen.time:.3f}x faster than the fastest plan keeping sequences whole "
                f"({whole.text()}, {whole.time * 1e3:.4g} ms)")
    head += (f"; {chosen.text()} splits each sequence over {c} devices on {link} "
             f"({chosen.memory_bytes / 2**30:.1f} GiB, context collectives {chosen.context_s * 1e3:.3g} ms)")
    if t > 1:
        inside = group_per_node(cluster, (chosen.data, t, c), "t") == t
        where = ("both groups inside a node" if inside and c <= cluster.local_size else
                 "the model group inside a node" if inside else "the model group over the network")
        head += (f" and each block's heads over {t} ({where}, "
                 f"tensor collectives {chosen.tensor_s * 1e3:.3g} ms, each device's attention over its "
                 f"{chosen.shape.heads // t} heads)")
        alone = found.get("untensored")
        head += (f", {alone.time / chosen.time:.3f}x faster than the fastest context plan without a model axis "
                 f"({alone.text()}, {alone.time * 1e3:.4g} ms, {alone.memory_bytes / 2**30:.1f} GiB)"
                 if alone is not None else ", where no context plan without a model axis fits")
    reasons = []
    for kind in ATTENTION_KINDS:
        if kind == chosen.attention:
            continue
        other = variant(chosen, cluster, kind)
        if other is None:
            reasons.append(f"Ulysses needs the {chosen.shape.heads} heads divisible by {t * c}"
                           + (f" (model {t} x context {c})" if t > 1 else ""))
        elif not fits(other, cluster):
            reasons.append(f"{kind} needs {other.memory_bytes / 2**30:.1f} GiB (the whole sequence's keys and values)"
                           if kind == "allgather" else f"{kind} needs {other.memory_bytes / 2**30:.1f} GiB")
        elif other.time > chosen.time:
            what = ("bytes" if other.context_bytes > chosen.context_bytes else "messages" if context_messages(
                kind, c) > context_messages(chosen.attention, c) else "time")
            reasons.append(f"{kind} sends more {what} ({other.context_bytes / 2**30:.3g} GiB a step, "
                           f"{context_messages(kind, c)} collectives a block and micro-batch: "
                           f"{other.context_s * 1e3:.3g} ms)")
        else:
            reasons.append(f"{kind} ties and holds more ({other.memory_bytes / 2**30:.1f} GiB)")
    return (f"{head}; {chosen.attention} ({chosen.context_bytes / 2**30:.3g} GiB a step, "
            f"{context_messages(chosen.attention, c)} collectives a block and micro-batch): " + "; ".join(reasons))


def _trade(chosen: LMPlan, fastest: LMPlan) -> str:
    if fastest is chosen:
        return ""
    return (f", {chosen.time / fastest.time:.2f}x the time of {fastest.text()}, which needs "
            f"{fastest.memory_bytes / 2**30:.1f} GiB")


def recomputes(policy: str, tensor: int) -> str:
    """What the backward pass recomputes: the policy's own, under tensor parallelism too (the Megatron regions name
    their projections and reduced outputs for ``dots``, :data:`dtx.models.remat.PROJECTION`, so no region's forward
    or collective runs again; before they did, ``dots`` recomputed there as ``full``)."""
    return policy


def _tensor_bytes(shape: LMShape, b: int, tensor: int, sp: bool, policy: str, x: int,
                  positions: int | None = None) -> tuple[float, int]:
    """Bytes one device sends over ``model`` per micro-batch, and how many collectives: the blocks'
    (:func:`dtx.parallel.tensor.costs.block_bytes`; under ``full`` the forward ones again) and the ends' (the token ids and
    the head's input gradient: :mod:`dtx.parallel.tensor.costs`'s docstring), on ``positions`` a sequence (a
    device's ``S/C`` beside a context axis; ``S`` when not given)."""
    if tensor == 1:
        return 0.0, 0
    s, d, send = positions or shape.seq, shape.width, tensor_model.bytes_sent
    block = tensor_model.block_bytes(b, s, d, tensor, sp, x)
    # The recomputed forward re-runs the block's forward collectives but the MLP's closing one, whose output only
    # the residual sum uses (XLA drops it as dead code): TP one all-reduce, SP one reduce-scatter, two all-gathers.
    n = b * s * d * x
    again = ({"all-reduce": [n]} if not sp else {"reduce-scatter": [n], "all-gather": [n // tensor] * 2}
             ) if policy == "full" else {}
    again_bytes = sum(send(kind, o, tensor) for kind, ops in again.items() for o in ops)
    count = (10 if sp else 4) + sum(map(len, again.values()))
    tokens = b * s * 4
    if sp:
        ends = send("all-to-all", tokens // tensor, tensor) + 2 * send("all-to-all", n // tensor, tensor)
    else:
        ends = send("all-gather", tokens // tensor, tensor) + send("all-gather", n // tensor, tensor)
    return shape.layers * (block + again_bytes) + ends, shape.layers * count + 3


def _gradients(shape: LMShape, cluster: Cluster, held: float, data: int, tensor: int, stages: int, zero: int,
               sp: bool, x: int, micro: int = 1, context: int = 1) -> tuple[float, float]:
    """Bytes one device sends for the gradients per step and their time (module docstring): the parameters it
    holds all-reduced over ``D``; under TP the tied head's gradient over every device too (the head runs data
    parallel over every device, so XLA reduces the embedding's two uses apart), or with ``M`` micro-batches
    (each data group's gradient summed apart, :mod:`dtx.step.accumulate`) over ``model`` once per micro-batch
    (SP: in the stream's sum); ZeRO all-reduces the gradients and all-gathers the updated parameters
    (``3(D−1)/D``; under TP each micro-batch's, as they are reduced), and
    under TP reduces the tied embedding's ``1/D`` share over ``model`` and over ``data`` apart (D4×T2 FSDP read
    1.21x without it); SP sums the replicated parameters used on split positions over ``T`` first."""

    def send(kind: str, nbytes: float, group: int) -> float:  # whole elements (a V·d share need not divide)
        return tensor_model.bytes_sent(kind, int(nbytes // x) * x, group)

    if context > 1:
        return _context_gradients(shape, cluster, held, data, zero, x, micro, context, send)
    devices = data * tensor * stages
    local = max(1, cluster.local_size // (tensor * stages))
    head = shape.vocab * shape.width * x
    sent = send("all-reduce", held * x, data) if data > 1 else 0.0
    seconds = cluster.allreduce_time(held * x, data, local)
    if zero:
        sent += send("all-gather", held * x / data, data)
        seconds *= 1.5
        if tensor > 1 and not sp:  # the tied head's gradient, as the embedding's optimizer state is split (1/D),
            # summed over model; the lookup's part over data beside the rest (SP: both in the stream's)
            sent += send("all-reduce", head / data, tensor) + send("all-reduce", head / data, data)
            seconds += cluster.allreduce_time(head / data, tensor, tensor) + cluster.allreduce_time(
                head / data, data, local)
    elif tensor > 1 and micro == 1:
        sent += send("all-reduce", head, devices)
        seconds += cluster.allreduce_time(head, devices, cluster.local_size)
    elif tensor > 1 and not sp:  # the head's partial sums over model, each micro-batch
        sent += micro * send("all-reduce", head, tensor)
        seconds += micro * cluster.allreduce_time(head, tensor, tensor)
    if tensor > 1 and zero:  # ZeRO under TP reduces each micro-batch's gradient
        sent, seconds = sent * micro, seconds * micro
    if sp:
        stream = (shape.params - shape.layers * shape.block_params + 6 * shape.layers * shape.width) * x
        sent += micro * send("all-reduce", stream, tensor)
        seconds += micro * cluster.allreduce_time(stream, tensor, tensor)
    return sent, seconds


def _context_gradients(shape: LMShape, cluster: Cluster, held: float, data: int, zero: int, x: int, micro: int,
                       context: int, send) -> tuple[float, float]:
    """The gradients of a context plan (``T = P = 1``; module docstring, **context**), as the compiled step reduces
    them (read from --verify's development twins, :data:`dtx.tools.lm_sim.CONTEXT_KINDS`): every device of a
    context group holds the parameters whole and computes their gradient on its positions, so XLA sums each over
    ``context`` where the backward pass makes it — the tied table's two gradients (the lookup's and the output
    layer's) apart, ``held + V·d`` — and over the data shards in a second all-reduce; under ZeRO the data shards
    all-reduce the summed gradient (``held``), each then reduces its ``1/D`` slice of both tables' over ``context``,
    and the updated parameters are all-gathered over the data shards. The step accumulating ``M`` micro-batches in
    the global view (no per-shard map: :mod:`dtx.step.accumulate`) reduces each micro-batch's: ``M`` times (the
    all-gather once). On a
    GPU the context group is a node's when ``C ≤ local_size`` and the data group then has ``local_size/C`` of its
    devices in each node."""
    both = (held + shape.vocab * shape.width) * x
    inside = min(context, cluster.local_size)  # the context group's devices per node
    across = max(1, cluster.local_size // context)  # the data group's devices per node
    if zero:  # each micro-batch's reductions, then one all-gather of the updated slices
        sent = micro * (send("all-reduce", held * x, data) + send("all-reduce", both / data, context)) + send(
            "all-gather", held * x / data, data)
        seconds = micro * (cluster.allreduce_time(held * x, data, across) + cluster.allreduce_time(
            both / data, context, inside)) + 0.5 * cluster.allreduce_time(held * x, data, across)  # all-gather: half
        return sent, seconds
    sent = send("all-reduce", both, context) + (send("all-reduce", both, data) if data > 1 else 0.0)
    seconds = cluster.allreduce_time(both, context, inside) + cluster.allreduce_time(both, data, across)
    return micro * sent, micro * seconds


def group_per_node(cluster: Cluster, sizes: tuple[int, int, int], axes: str) -> int:
    """How many devices of one ``axes`` group (letters of ``"dtc"``: data, model, context) a node holds on the mesh
    ``(data|fsdp, model, context)`` of ``sizes`` (:meth:`LMPlan.axes`: context the fastest-varying, then model, then
    data; each node ``local_size`` consecutive devices): the group of device 0, counted below ``local_size``."""
    data, tensor, context = sizes
    strides = dict(d=(data, tensor * context), t=(tensor, context), c=(context, 1))
    ids = [0]
    for axis in axes:
        size, stride = strides[axis]
        ids = [i + k * stride for i in ids for k in range(size)]
    return max(1, sum(i < cluster.local_size for i in ids))


def _tensor_context_gradients(shape: LMShape, cluster: Cluster, held: float, data: int, tensor: int, context: int,
                              zero: int, sp: bool, x: int, micro: int, b: int) -> tuple[float, float]:
    """The gradients of a plan with Megatron's pairs over ``model`` beside a ``context`` axis (``T, C > 1``), as the
    compiled step reduces them (read from the compiled twins' collectives, :data:`dtx.tools.lm_sim.CONTEXT_KINDS`'s
    T×C rows, and from D4×T2×C2, D2×T4×C2 with and without SP and ZeRO on 16 devices, where the groups' sizes tell
    the axes apart). The positions of the residual stream split over ``G`` devices: ``C``, or ``T·C`` under SP
    (Korthikanti et al. 2022). Without ZeRO, per micro-batch (the step accumulates in the global view): the tied
    head's gradient over data × model (its examples) and over context (its positions), the lookup's with the
    replicated parameters (positions whole, LayerNorms, row biases) over ``G`` and again, with the ``S/G`` rows of
    the position table a device holds, over data; the split blocks' ``1/T`` over data × context in one all-reduce.
    Under ZeRO (each stage alike: XLA:CPU reduces whole and slices) the head's gradient whole over data, its ``1/D``
    slice over model × context; the lookup's ``1/D`` slice (its rows exchanged over data in an all-to-all and
    gathered over ``G``) with the replicated ``1/D`` over ``G`` (without SP a second ``1/D`` slice of the table over
    context), the replicated parameters and the position rows over data, the split blocks over data × context; and
    once a step the updated ``1/D`` slices all-gathered over data."""
    s, d = shape.seq, shape.width
    sizes = (data, tensor, context)
    table, positions = shape.vocab * d * x, s * d * x
    rest = (2 * d + 6 * shape.layers * d) * x  # the final LayerNorm; each block's two LayerNorms and row biases
    split = held * x - table - positions - rest  # the blocks' split kernels and column biases, 1/T
    stream = "tc" if sp else "c"
    g = tensor * context if sp else context
    if zero:
        each = [("all-reduce", table, "d"), ("all-reduce", table / data, "tc"),
                ("all-reduce", table / data + positions / data + rest, stream),
                ("all-reduce", rest + positions / g, "d"), ("all-reduce", split, "dc"),
                ("all-to-all", 2 * b * s // context * d * x, "d"), ("all-gather", b * s // g * d * x, stream)]
        each += [] if sp else [("all-reduce", table / data, "c")]
        once = [("all-gather", held * x / data, "d")]
    else:
        each = [("all-reduce", table, "dt"), ("all-reduce", table, "c"), ("all-reduce", table + rest + positions,
                                                                           stream),
                ("all-reduce", table + rest + positions / g, "d"), ("all-reduce", split, "dc")]
        once = []
    sent = seconds = 0.0
    for times, ops in ((micro, each), (1, once)):
        for kind, nbytes, axes in ops:
            group = math.prod(dict(d=data, t=tensor, c=context)[a] for a in axes)
            if group == 1:
                continue
            sent += times * tensor_model.bytes_sent(kind, int(nbytes // x) * x, group)
            local = group_per_node(cluster, sizes, axes)
            # an all-reduce's time; an all-gather of the gathered bytes, or an all-to-all, half of one
            whole = nbytes * group if kind == "all-gather" else nbytes
            seconds += times * cluster.allreduce_time(whole, group, local) * (1.0 if kind == "all-reduce" else 0.5)
    return sent, seconds
