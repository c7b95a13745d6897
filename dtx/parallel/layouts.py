"""The layouts: how the train state is placed on the mesh, each declared by what it needs.

A layout is a declaration (:class:`Layout`): which Dense/Conv kernels it splits over the
``model`` axis, which ZeRO stage of the state it splits over the batch axes, which drivers
run it, the settings it takes and its rank by communication cost. Everything else —
its partitioning rules, the optimizer state's, where the reduced gradients live, where
activations live, what the memory model (:mod:`dtx.perf.memory`) charges it — follows
from those fields, so the set-up, the memory model, ``verify`` and ``dtx simulate`` ask
the layout and never compare its name. A new layout is one declaration and one line of
:data:`LAYOUTS` (docs/extending.md).

* ``data`` — replicate every parameter, split the batch (Das et al., arXiv 1602.06709, §2;
  the Hitchhiker's Guide, arXiv 1810.11787, §3.1).
* ``zero1`` / ``zero2`` — ZeRO stages 1 and 2 (Rajbhandari et al. 2020, arXiv 1910.02054):
  parameters replicated, the optimizer state split over every device; the gradients are
  reduce-scattered to it, each device updates its ``1/N`` of every tensor, the new parameters
  are all-gathered. Stage 2 also keeps the gradients split while they are accumulated over
  micro-batches (one reduce-scatter per micro-batch into a ``1/N`` accumulator).
* ``hybrid`` — Das et al. §3.3: convolutions data-parallel, fully connected layers
  model-parallel inside groups of ``G`` devices (the ``model`` axis).
* ``model`` — every Dense/Conv kernel's output features split over the ``model`` axis
  (Das et al. §3.2): activations are exchanged instead of weight gradients.
* ``fsdp`` — ZeRO stage 3: every parameter and its optimizer state split over every device
  along its largest divisible dimension; gathered for use, reduce-scattered for the update.
* ``rules`` — the user's own rules (``parallel.rules``), e.g. a per-layer plan of
  :mod:`dtx.perf.model`.
* ``pipeline`` — pipeline parallelism (GPipe: Huang et al. 2019; 1F1B: Narayanan et al. 2021): the
  model's layer stack cut into stages along the ``stage`` axis, each stage's parameters one row
  (:mod:`dtx.parallel.pipeline.stages`), run by :mod:`dtx.parallel.pipeline.step` with the ``pipeline.*`` settings
  (``pipeline.microbatches``, ``pipeline.schedule``, ...; :mod:`dtx.parallel.pipeline.check`).
* ``tensor`` — Megatron's tensor parallelism (Shoeybi et al. 2019, arXiv 1909.08053): attention heads and
  the MLP split over the ``model`` axis, a column-split layer paired with a row-split one, and with
  ``tensor.sequence_parallel`` Korthikanti et al.'s sequence parallelism (:mod:`dtx.parallel.tensor.layout`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dtx import mesh as mesh_lib
from dtx.config import ConfigError, base_config, check_block, register_check
from dtx.parallel import fc_pairs as fc_pairs_lib
from dtx.parallel import rules as rules_lib
from dtx.parallel.activations import ActivationLayout, activation_layout
from dtx.parallel.context import CONTEXT_AXIS
from dtx.parallel.context import layout as context_layout
from dtx.parallel.expert import EXPERT_AXIS
from dtx.parallel.expert import layout as expert_layout
from dtx.parallel.pipeline.stages import STAGE_AXIS, row_spec
from dtx.parallel.rules import PartitionError
from dtx.parallel.tensor import layout as tensor_lib
from dtx.parallel.tensor import megatron

mesh_lib.declare_axis(mesh_lib.Axis(
    mesh_lib.MODEL_AXIS, "model", replicas=False,
    doc="a model-parallel group: kernels split over it (model, hybrid, rules, or Megatron's tensor pairs)"))

KERNEL_SPLITS = ("none", "all", "dense", "explicit", "paired")
REDUCE = ("per_microbatch", "once")  # parallel.reduce: when FSDP reduces the gradients under accumulation


class Placement(NamedTuple):
    """A layout applied to one state on one mesh: what a step is built with (:meth:`Layout.place`)."""

    layout: Layout
    state: Any  # a NamedSharding per leaf of the TrainState
    gradients: Any  # ZeRO 1/2: where the reduced gradients live (split like the optimizer state), else None
    activations: ActivationLayout | None  # where model-parallel layers' activations live, else None
    # A parallelism that runs its own step (the pipeline's schedule runner, dtx.parallel.pipeline.step.Pipeline),
    # else None. The drivers and the run ask it, never which layout it is: ``train_step(tx, mesh, spec)``,
    # ``eval_step(evaluate)`` (a data-parallel eval step over the model's own tree, wrapped), ``init_state(model, tx,
    # example, seed, mesh, shardings, loss_scaler)``, ``model_params(params)`` (the state's parameters as the model's
    # own tree) and ``clock(workers, global_batch, cluster, stragglers)`` (its simulated clock's model).
    runner: Any = None

    @property
    def whole_gradients(self) -> bool:
        """Whether each device can hold its own whole, unreduced gradient between micro-batches: whole
        parameters and no split accumulator (data parallelism and ZeRO-1), or FSDP accumulating whole
        gradients (``reduce="once"``)."""
        return not self.layout.splits_kernels and (self.layout.zero_stage in (0, 1) or self.layout.reduce == "once")

    @property
    def shard_accumulator(self) -> bool:
        """Whether each micro-batch's gradient is split while accumulated (ZeRO stage 2)."""
        return self.layout.zero_stage == 2


@dataclasses.dataclass(frozen=True)
class Layout:
    """A way to place the train state on the mesh, known to the rest of dtx only by these fields.

    Attributes:
      name: its ``parallel.name``.
      kernels: which Dense/Conv kernels are split over the ``model`` axis by their output
        features — ``none``, ``all`` (model parallelism), ``dense`` (Das et al.'s hybrid) or
        ``explicit`` (the user's ``parallel.rules``), or ``paired``: Megatron's column/row pairs
        (:func:`dtx.parallel.tensor.megatron.megatron_rules`).
      zero_stage: what is split over every device along the batch axes: 0 nothing, 1 the
        optimizer state, 2 also the gradients while accumulated, 3 also the parameters (FSDP).
      drivers: the step drivers that run it (:mod:`dtx.step.drivers`).
      cost_rank: its place by communication per step, cheapest first (which layout to suggest
        when a run does not fit).
      settings: the ``parallel.*`` keys it takes besides ``name``.
      stages: whether it cuts the model into pipeline stages along the ``stage`` axis: the state is the
        stages' parameter rows (:mod:`dtx.parallel.pipeline.stages`), placed by :meth:`place` from an abstract state
        already in rows.
      block: the config block of its own settings (``tensor``), passed to :meth:`place` as keywords.
      reduce: FSDP under gradient accumulation (``parallel.reduce``): ``per_microbatch`` reduce-scatters every
        micro-batch's gradient into a ``1/N`` accumulator; ``once`` ("no sync" accumulation, as PyTorch FSDP's
        ``no_sync``) sums each device's whole, unreduced gradient over the micro-batches (``W`` bytes per device
        instead of ``W/N``) and reduce-scatters once per step (:mod:`dtx.step.accumulate`).
      fc_pairs: ``model``/``hybrid`` (``parallel.fc_pairs``): consecutive Dense layers as column/row pairs
        (:mod:`dtx.parallel.fc_pairs`).
      borrows: keys of another layout's block it takes too (``pipeline``: ``tensor.sequence_parallel``, its stages
        split over ``model``: :mod:`dtx.parallel.pipeline.tensor_stages`).
      activation_factory: a parallelism's own activation context, ``(specs, mesh, **block settings) -> context``
        (``context``: :func:`dtx.parallel.context.layout.context_split`, every sequence split over its axis);
        ``None``: the activations follow the kernels' split.
      memory_doubt: where the memory model is loose for it, and by how much, as the memory check says it
        (:func:`dtx.perf.memory.uncovered`); ``""``: nothing of its own.
      own_rules: a parallelism's own placement of some parameters, ``(abstract_params, mesh, rules) -> rules``,
        applied to the parameters' and the optimizer state's rules (``expert``: the experts split over its axis,
        :func:`dtx.parallel.expert.layout.expert_rules`); ``None``: the rules are the fields'.
    """

    name: str
    kernels: str = "none"
    zero_stage: int = 0
    drivers: tuple[str, ...] = ("shard_map", "jit")
    cost_rank: int = 0
    settings: tuple[str, ...] = ()
    stages: bool = False
    block: str = ""
    reduce: str = "per_microbatch"
    fc_pairs: bool = False
    borrows: tuple[str, ...] = ()
    activation_factory: Any = None
    own_rules: Any = None
    memory_doubt: str = ""

    def __post_init__(self):
        if self.kernels not in KERNEL_SPLITS or self.zero_stage not in (0, 1, 2, 3):
            raise PartitionError(f"layout {self.name!r}: kernels must be one of {KERNEL_SPLITS} and zero_stage 0-3")
        if self.reduce not in REDUCE:
            raise PartitionError(f"parallel.reduce={self.reduce!r} is unknown; choose one of {', '.join(REDUCE)}")
        if self.reduce == "once" and (self.zero_stage != 3 or self.splits_kernels or self.stages):
            raise PartitionError(f"parallel.reduce='once' applies to parallel.name=fsdp only, not {self.name!r} "
                                 + ("(ZeRO-2 accumulating whole gradients and reducing once is "
                                    "parallel.name=zero1)" if self.zero_stage == 2 else
                                    "(its gradients are reduced as its layout says)")
                                 + "; leave parallel.reduce at its default 'per_microbatch'")
        if self.fc_pairs not in (False, True) or (self.fc_pairs and self.kernels not in ("all", "dense")):
            raise PartitionError(f"{fc_pairs_lib.KEY}={self.fc_pairs!r} pairs the fully connected layers a model or "
                                 f"hybrid layout splits, not {self.name!r}'s: use parallel.name=model or hybrid, or "
                                 f"leave {fc_pairs_lib.KEY} at its default False")

    @property
    def splits_kernels(self) -> bool:
        """Whether any kernel is split over the ``model`` axis (model, hybrid, rules, Megatron's pairs)."""
        return self.kernels != "none"

    @property
    def pairs(self) -> bool:
        """Whether its kernels are Megatron's column/row pairs and attention heads (:mod:`dtx.parallel.tensor.layout`),
        which :mod:`dtx.parallel.tensor.costs` models, not the Das et al. layer model."""
        return self.kernels == "paired"

    @property
    def user_rules(self) -> bool:
        """Whether its split is the user's own rules (``parallel.rules``): which layers it splits is read from them."""
        return self.kernels == "explicit"

    @property
    def by_layer_kind(self) -> bool:
        """Whether which layers it splits follows from their kind alone (none, every Dense/Conv, the Dense ones):
        what the Das et al. performance model and its planner can enumerate."""
        return self.kernels in ("none", "all", "dense")

    def splits(self, kind: str) -> bool:
        """Whether it splits a layer of ``kind`` (``"dense"`` or ``"conv"``) by the layer's kind (:attr:`by_layer_kind`
        layouts; the user's rules and Megatron's pairs are read from the parameters instead)."""
        return self.kernels == "all" or (self.kernels == "dense" and kind == "dense")

    @property
    def needs_model_axis(self) -> bool:
        """Whether it splits kernels over a ``model`` mesh axis that must exist."""
        return self.kernels in ("all", "dense", "paired")

    @property
    def replicated(self) -> bool:
        """Whether every device holds the whole state (data parallelism): the one layout whose gradient
        all-reduce strategies and compressors can replace."""
        return not self.splits_kernels and self.zero_stage == 0 and not self.stages and not self.activation_factory

    def check(self, mesh: Mesh) -> None:
        """Refuse a mesh this layout cannot run on, naming the fix."""
        if self.stages and STAGE_AXIS not in mesh.axis_names:
            raise PartitionError(
                f"parallel.name={self.name!r} needs a {STAGE_AXIS!r} mesh axis (one device per stage), e.g. "
                f"--config.mesh='((\"{STAGE_AXIS}\", 2), (\"data\", -1))'; the mesh has axes {mesh.axis_names}")
        if self.needs_model_axis and mesh_lib.MODEL_AXIS not in mesh.axis_names:
            raise PartitionError(
                f"parallel.name={self.name!r} needs a {mesh_lib.MODEL_AXIS!r} mesh axis (the model-parallel group), "
                f"e.g. --config.mesh='((\"data\", -1), (\"model\", 2))' (in Python: make_mesh([(\"data\", -1), "
                f"(\"model\", 2)])); the mesh has axes {mesh.axis_names}")

    def param_rules(self, mesh: Mesh, abstract_params: Any = None, explicit: Sequence = ()) -> list:
        """The parameters' rules, first match wins, ending with ``(".*", P())``."""
        return self._own(mesh, abstract_params, self._param_rules(mesh, abstract_params, explicit))

    def _own(self, mesh: Mesh, abstract_params: Any, rules: list) -> list:
        """``rules`` with the parallelism's own placement first (:attr:`own_rules`)."""
        return rules if self.own_rules is None else self.own_rules(abstract_params, mesh, rules)

    def _param_rules(self, mesh: Mesh, abstract_params: Any = None, explicit: Sequence = ()) -> list:
        self.check(mesh)
        if self.kernels == "explicit":
            return rules_lib.explicit_rules(explicit, abstract_params)
        if self.zero_stage < 3 and self.kernels == "none":  # ZeRO 1/2 keep the parameters whole
            return list(rules_lib.REPLICATED)
        if abstract_params is None:
            raise PartitionError(f"parallel.name={self.name!r} derives its rules from the parameters; "
                                 "pass abstract_params")
        if self.kernels == "paired":
            return megatron.megatron_rules(abstract_params, mesh, self.name, data=self.zero_stage == 3)
        if self.zero_stage == 3:
            return rules_lib.fsdp_rules(abstract_params, mesh)
        rows = fc_pairs_lib.row_layers(abstract_params, self.name) if self.fc_pairs else ()
        return rules_lib.split_kernels(abstract_params, mesh, self.kernels, self.name, rows)

    def optimizer_rules(self, mesh: Mesh, abstract_params: Any = None, explicit: Sequence = ()) -> list:
        """The rules of the optimizer state (and under ZeRO 1/2 of the reduced gradients): split over every
        device for ZeRO 1/2, the parameters' own otherwise."""
        if self.zero_stage in (1, 2):
            self.check(mesh)
            if self.kernels == "paired":  # Megatron's split, and ZeRO's over the data axes
                return megatron.megatron_rules(abstract_params, mesh, self.name, data=True)
            return self._own(mesh, abstract_params, rules_lib.fsdp_rules(abstract_params, mesh))
        return self.param_rules(mesh, abstract_params, explicit)

    def place(self, abstract_state: Any, mesh: Mesh, explicit: Sequence = (), **settings) -> Placement:
        """Shardings of the whole state, of the reduced gradients (ZeRO 1/2) and the activation layout. A staged
        layout takes the state in rows (``params`` one ``(P, row)`` array): every leaf of that shape split over
        ``stage``, the rest replicated. ``settings``: those of the layout's :attr:`block`; one named like a
        field of the declaration (``zero_stage``) sets that field."""
        fields = {field.name for field in dataclasses.fields(self)}
        if fields & set(settings):
            own = {key: settings.pop(key) for key in list(settings) if key in fields}
            return dataclasses.replace(self, **own).place(abstract_state, mesh, explicit, **settings)
        if self.stages:
            self.check(mesh)
            rows = tuple(abstract_state.params.shape)
            split, whole = NamedSharding(mesh, row_spec(mesh)), NamedSharding(mesh, PartitionSpec())
            return Placement(self, jax.tree.map(lambda x: split if tuple(x.shape) == rows else whole, abstract_state),
                             None, None)
        params = self.param_rules(mesh, abstract_state.params, explicit)
        optimizer = self.optimizer_rules(mesh, abstract_state.params, explicit)
        state = rules_lib.state_shardings(abstract_state, params, mesh, optimizer)
        gradients = (rules_lib.gradient_shardings(abstract_state.params, optimizer, mesh)
                     if self.zero_stage in (1, 2) else None)
        specs = jax.tree.map(lambda s: s.spec, state.params)
        if self.activation_factory is not None:  # a parallelism that moves activations its own way
            activations = self.activation_factory(specs, mesh, **settings)
        else:
            activations = (tensor_lib.tensor_layout(specs, mesh, **settings) if self.kernels == "paired"
                           else activation_layout(specs, mesh))
        return Placement(self, state, gradients, activations)


LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (
    Layout("data", cost_rank=0),
    Layout("zero1", zero_stage=1, cost_rank=1),
    Layout("zero2", zero_stage=2, cost_rank=2),
    Layout("hybrid", kernels="dense", drivers=("jit",), cost_rank=3, settings=("fc_pairs",)),
    Layout("model", kernels="all", drivers=("jit",), cost_rank=4, settings=("fc_pairs",)),
    Layout("fsdp", zero_stage=3, drivers=("jit",), cost_rank=5, settings=("reduce",)),
    Layout("rules", kernels="explicit", drivers=("jit",), cost_rank=6, settings=("rules",)),
    Layout("pipeline", drivers=("shard_map",), cost_rank=7, stages=True, borrows=("tensor.sequence_parallel",)),
    Layout("tensor", kernels="paired", drivers=("jit",), cost_rank=4, block="tensor"),
    Layout("context", drivers=("jit",), cost_rank=8, block="context", activation_factory=context_layout.context_split,
           memory_doubt="activations moved by the layout itself (context parallelism): estimated as data "
           "parallelism at a device's S/C positions plus what its attention kernel keeps "
           "(dtx.parallel.context.costs.KEPT, read at C = 4): held-out lengths at C = 4 read 0.97-1.09x the "
           "compiled peak, at C = 2 1.10-1.35x"),
    Layout("expert", drivers=("jit",), cost_rank=9, own_rules=expert_layout.expert_rules,
           activation_factory=expert_layout.expert_split,
           memory_doubt="expert parallelism: estimated as data parallelism, every expert's weights and optimizer "
           "state whole on each device (the layout holds E/X of them), its all-to-all buckets not modelled: an "
           "upper bound by the experts' share"),
)}


def get_layout(layout: str | Layout) -> Layout:
    """The registered layout ``name`` (a :class:`Layout` passes through)."""
    if isinstance(layout, Layout):
        return layout
    if layout not in LAYOUTS:
        raise PartitionError(f"unknown parallel.name {layout!r}; choose one of {list(LAYOUTS)}")
    return LAYOUTS[layout]


def rules_layout() -> Layout:
    """The layout whose split is the user's own rules (:attr:`Layout.user_rules`): how a plan of per-layer splits
    (:mod:`dtx.perf.model`'s) or a layout's actual split on a model is estimated and run."""
    return next(layout for layout in LAYOUTS.values() if layout.user_rules)


def configured(config) -> Layout:
    """The layout ``config.parallel.name`` composed with the parallelisms its mesh's axes bring (:func:`compose`),
    with the ``parallel.*`` settings that are fields of the composed declaration applied (``parallel.reduce``: FSDP's,
    from the ``fsdp`` preset or an ``fsdp`` axis at ZeRO-3)."""
    chosen = compose(get_layout(config.parallel.name), tuple(name for name, _ in config.mesh),
                     config.fsdp.zero_stage, config.model_axis.split)
    own = {key: config.parallel[key] for key in chosen.settings if key in config.parallel
           and key in {field.name for field in dataclasses.fields(Layout)}}
    return dataclasses.replace(chosen, **own) if own else chosen


# How kernels split over a 'model' mesh axis (model_axis.split): the Layout.kernels each choice is.
MODEL_SPLITS = {"megatron": "paired", "all": "all", "dense": "dense"}


def _split(kernels: str) -> Layout:
    """The layout that splits kernels over ``model`` as ``kernels`` says and does nothing else."""
    return next(layout for layout in LAYOUTS.values() if layout.kernels == kernels and not layout.stages
                and not layout.zero_stage)


def _zero(stage: int) -> Layout:
    """The layout that splits the state over the data axes at ZeRO stage ``stage`` and does nothing else."""
    return next(layout for layout in LAYOUTS.values() if layout.kernels == "none" and not layout.stages
                and layout.zero_stage == stage)


def compose(layout: Layout, axes: Sequence[str], fsdp_stage: int = 3, model_split: str = "") -> Layout:
    """``layout`` (a ``parallel.name`` preset) with the parallelisms the mesh's ``axes`` declare.

    A ``context`` axis beside data axes (and an ``fsdp`` axis, at ``fsdp_stage``; a ``model`` axis with Megatron's
    split) makes a replicated or Megatron preset context parallelism (:mod:`dtx.parallel.context`). ``model_split`` (``model_axis.split``) chooses how a ``model`` axis
    splits kernels when the preset replicates them: ``megatron`` (:data:`MODEL_SPLITS`: the tensor layout's pairs),
    ``all`` or ``dense`` (Das et al.'s model and hybrid parallelism); a preset that already splits them must agree.
    A ``stage`` axis makes a replicated or Megatron preset a pipeline (its ``model`` axis Megatron's split of each
    stage, an ``fsdp`` axis ZeRO over each stage's row: :mod:`dtx.parallel.pipeline.zero`); an ``fsdp`` axis makes a
    replicated preset ZeRO at ``fsdp_stage`` and gives a Megatron preset that stage over it. Presets that already
    split the state (zero1, zero2, fsdp) split it over the ``fsdp`` axis alone when there is one. What does not
    compose is refused, naming the axes and the presets that take them."""
    mesh_lib.check_axes(axes, "--config.mesh")
    if model_split:
        if model_split not in MODEL_SPLITS:
            raise PartitionError(f"model_axis.split={model_split!r}: choose one of {', '.join(MODEL_SPLITS)} (or "
                                 "leave it empty for the parallel.name preset's split)")
        if mesh_lib.MODEL_AXIS not in axes:
            raise PartitionError(f"model_axis.split={model_split!r} sets how kernels split over a "
                                 f"{mesh_lib.MODEL_AXIS!r} mesh axis, and the mesh's axes {tuple(axes)} have none: "
                                 "add one, e.g. --config.mesh='((\"data\", -1), (\"model\", 2))', or leave "
                                 "model_axis.split empty")
    if EXPERT_AXIS in axes:  # expert parallelism: with data replicas and ZeRO over fsdp
        return _expert(layout, axes, fsdp_stage, model_split)
    if CONTEXT_AXIS in axes:  # context parallelism: with data replicas, ZeRO over fsdp, Megatron over model
        return _context(layout, axes, fsdp_stage, model_split)
    if model_split:
        kernels = MODEL_SPLITS[model_split]
        if layout.replicated:
            layout = _split(kernels)
        elif layout.kernels != kernels and not (layout.stages and kernels == "paired"):
            raise PartitionError(f"model_axis.split={model_split!r} and parallel.name={layout.name!r} disagree "
                                 "about how kernels split over 'model': set parallel.name=data and let the axis "
                                 "setting decide, or leave model_axis.split empty")
    if STAGE_AXIS in axes and not layout.stages:
        if layout.replicated or (layout.pairs and not layout.zero_stage):
            return LAYOUTS["pipeline"]
        raise PartitionError(f"parallel.name={layout.name!r} does not compose with a {STAGE_AXIS!r} mesh axis: "
                             "pipeline stages take Megatron's split over 'model' and ZeRO over 'fsdp'; use "
                             "parallel.name=data (the mesh's axes decide) or drop the stage axis")
    if mesh_lib.FSDP_AXIS in axes and not layout.stages:
        if fsdp_stage not in (1, 2, 3):
            raise PartitionError(f"fsdp.zero_stage={fsdp_stage!r}: choose 1 (optimizer state), 2 (and gradients) "
                                 "or 3 (and parameters)")
        if layout.replicated:
            return _zero(fsdp_stage)
        if layout.pairs:
            return dataclasses.replace(layout, zero_stage=fsdp_stage)
        if layout.splits_kernels:
            raise PartitionError(f"parallel.name={layout.name!r} does not compose with an 'fsdp' mesh axis (it "
                                 "splits kernels as Das et al.'s model or hybrid parallelism, and its model-axis "
                                 "activations are laid out for replicated parameters); use parallel.name=tensor "
                                 "or data with an fsdp axis, or a 'data' axis with this preset")
    return layout


def _context(layout: Layout, axes: Sequence[str], fsdp_stage: int, model_split: str) -> Layout:
    """:func:`compose` on a mesh with a ``context`` axis: the context preset, its state split over an ``fsdp`` axis
    at ``fsdp_stage``, and with a ``model`` axis Megatron's pairs over it (``model_axis.split=megatron`` or
    ``parallel.name=tensor``: the tensor layout with every sequence split over ``context`` too,
    :func:`dtx.parallel.context.layout.context_tensor_split`). A ``stage`` axis makes it the pipeline with each
    stage's sequences split over ``context`` (:mod:`dtx.parallel.pipeline.context_stages`; it borrows the
    ``context.*`` keys), refused beside a ``model`` axis."""
    own = layout.activation_factory in (context_layout.context_split, context_layout.context_tensor_split)
    if STAGE_AXIS in axes and (layout.replicated or own or layout.stages):
        if mesh_lib.MODEL_AXIS in axes:
            raise PartitionError(f"a pipeline's stages split over both {CONTEXT_AXIS!r} and 'model': each runs "
                                 "alone inside the stages (dtx.parallel.pipeline.context_stages, tensor_stages); "
                                 f"drop one of them from --config.mesh (context with Megatron's split runs without "
                                 f"a {STAGE_AXIS!r} axis)")
        pipeline = next(chosen for chosen in LAYOUTS.values() if chosen.stages)  # the stages run the kernels
        return dataclasses.replace(pipeline, borrows=pipeline.borrows + tuple(
            f"{LAYOUTS['context'].block}.{key}" for key in ("attention", "balance")))
    megatron_split = model_split == "megatron" or (not model_split and layout.pairs and not layout.stages)
    others = [axis for axis in axes if axis != CONTEXT_AXIS and not mesh_lib.AXES[axis].replicas
              and not (axis == mesh_lib.MODEL_AXIS and megatron_split)]
    if others or not (layout.replicated or own or megatron_split):
        raise PartitionError(f"a {CONTEXT_AXIS!r} mesh axis (context parallelism) composes with data and fsdp axes, "
                             f"with Megatron's split over 'model' and with pipeline stages, not with "
                             f"{others or [layout.name]}"
                             + (" (over 'model' it takes Megatron's pairs: model_axis.split=megatron)"
                                if mesh_lib.MODEL_AXIS in others else "")
                             + ": use parallel.name=data on a mesh of data, fsdp, 'context' and (with "
                             "--config.model_axis.split=megatron) model or stage axes, or drop the context axis")
    if mesh_lib.FSDP_AXIS in axes and fsdp_stage not in (1, 2, 3):
        raise PartitionError(f"fsdp.zero_stage={fsdp_stage!r}: choose 1 (optimizer state), 2 (and gradients) "
                             "or 3 (and parameters)")
    zero = fsdp_stage if mesh_lib.FSDP_AXIS in axes else 0  # the state split over fsdp, as FSDP's own
    chosen = LAYOUTS["context"]
    if mesh_lib.MODEL_AXIS in axes:  # Megatron's pairs (and SP) with the sequence split over context too
        chosen = dataclasses.replace(chosen, kernels="paired", borrows=("tensor.sequence_parallel",
                                                                        "tensor.zero_stage"),
                                     activation_factory=context_layout.context_tensor_split)
    return dataclasses.replace(chosen, zero_stage=zero) if zero else chosen


def _expert(layout: Layout, axes: Sequence[str], fsdp_stage: int, model_split: str) -> Layout:
    """:func:`compose` on a mesh with an ``expert`` axis: the expert layout (:mod:`dtx.parallel.expert`), beside data
    axes, and with an ``fsdp`` axis the state split over it at ``fsdp_stage`` (or at the stage of a zero1, zero2 or
    fsdp preset). A ``model``, ``stage`` or ``context`` axis beside it is refused, naming the axis."""
    others = [axis for axis in axes if axis != EXPERT_AXIS and not mesh_lib.AXES[axis].replicas]
    if others:
        reason = {mesh_lib.MODEL_AXIS: "the experts' own MLPs are not split Megatron-style over 'model' yet",
                  STAGE_AXIS: "pipeline stages collect no balancing losses or bias from a mixture of experts",
                  CONTEXT_AXIS: "the buckets are filled per whole sequence, which a context split cuts"}
        raise PartitionError(f"an {EXPERT_AXIS!r} mesh axis (expert parallelism) composes with data and fsdp axes, "
                             f"not with {others[0]!r} in --config.mesh ({reason.get(others[0], 'not built')}): "
                             f"drop the {others[0]!r} axis, e.g. --config.mesh='((\"data\", 2), (\"{EXPERT_AXIS}\", "
                             "4))'" + (", and leave model_axis.split empty" if model_split else ""))
    own = layout.own_rules is expert_layout.expert_rules
    if not (layout.replicated or own or (layout.zero_stage and not layout.splits_kernels and not layout.stages)):
        raise PartitionError(f"parallel.name={layout.name!r} does not compose with an {EXPERT_AXIS!r} mesh axis: "
                             "expert parallelism takes data replicas and ZeRO over an 'fsdp' axis; use "
                             "--config.parallel.name=data (the mesh's axes decide)")
    zero = layout.zero_stage
    if mesh_lib.FSDP_AXIS in axes:
        if fsdp_stage not in (1, 2, 3):
            raise PartitionError(f"fsdp.zero_stage={fsdp_stage!r}: choose 1 (optimizer state), 2 (and gradients) "
                                 "or 3 (and parameters)")
        zero = zero or fsdp_stage
    elif zero and not own:
        raise PartitionError(f"parallel.name={layout.name!r} splits the state over every batch axis, and an "
                             f"{EXPERT_AXIS!r} axis already splits the experts: add an 'fsdp' axis for ZeRO, e.g. "
                             f"--config.mesh='((\"fsdp\", 2), (\"{EXPERT_AXIS}\", 4))', or use "
                             "--config.parallel.name=data")
    chosen = LAYOUTS["expert"]
    return dataclasses.replace(chosen, zero_stage=zero) if zero else chosen


def fsdp_stage(config) -> int:
    """The ZeRO stage of a run's ``fsdp`` axis (``fsdp.zero_stage``), 0 where its mesh has none."""
    return int(config.fsdp.zero_stage) if any(name == mesh_lib.FSDP_AXIS for name, _ in config.mesh) else 0


# The functions of the layouts by name, for code that holds a name (configs, the memory model's callers).

def make_rules(name: str | Layout, mesh: Mesh, abstract_params: Any = None, explicit: Sequence = ()) -> list:
    """The parameter rules of layout ``name`` on ``mesh`` (:meth:`Layout.param_rules`)."""
    return get_layout(name).param_rules(mesh, abstract_params, explicit)


def optimizer_rules(name: str | Layout, mesh: Mesh, abstract_params: Any = None, explicit: Sequence = ()) -> list:
    """The optimizer state's rules of layout ``name`` (:meth:`Layout.optimizer_rules`)."""
    return get_layout(name).optimizer_rules(mesh, abstract_params, explicit)


@register_check
def check_config(config) -> None:
    """``parallel.name`` is a registered layout, and a ``parallel.*`` setting goes only to a layout that takes it
    (``parallel.rules``: to ``rules``), a layout's own block (``tensor.*``) only to that layout."""
    chosen = get_layout(config.parallel.name)
    axes = tuple(name for name, _ in config.mesh)
    composed = compose(chosen, axes, config.fsdp.zero_stage, config.model_axis.split)  # and what does not compose
    stage = config.fsdp.zero_stage
    if mesh_lib.FSDP_AXIS not in axes and stage != 3:
        raise ConfigError(f"fsdp.zero_stage={stage!r} sets the ZeRO stage of an 'fsdp' mesh axis, and the mesh "
                          f"{tuple(config.mesh)} has none: add one, e.g. --config.mesh='((\"data\", 2), (\"fsdp\", "
                          "-1))', or leave fsdp.zero_stage at its default 3")
    if mesh_lib.FSDP_AXIS in axes:
        for key in ("tensor.zero_stage", "pipeline.zero_stage"):
            block, name = key.split(".")
            if config[block][name]:
                raise ConfigError(f"{key}={config[block][name]!r} with an 'fsdp' mesh axis: the axis's ZeRO stage is "
                                  f"fsdp.zero_stage ({stage}); set that and leave {key} at 0")
    if composed.name != chosen.name:  # the axes made it another layout (a pipeline, tensor): its settings apply
        chosen = composed
    reduce = config.parallel.get("reduce", REDUCE[0])
    if reduce != REDUCE[0]:  # before the generic refusal: zero2's own hint, an unknown value, k = 1
        try:
            dataclasses.replace(chosen, reduce=reduce)
        except PartitionError as error:
            raise ConfigError(str(error)) from None
        if config.get("grad_accum_steps", 1) == 1:
            raise ConfigError(f"parallel.reduce={reduce!r} chooses when FSDP reduces the gradients of several "
                              "micro-batches, and grad_accum_steps=1 has one: set --config.grad_accum_steps=k > 1 "
                              "or leave parallel.reduce at its default 'per_microbatch'")
    taken = {name: layout.settings for name, layout in LAYOUTS.items()}
    if config.parallel.name in taken:  # what the axes composed takes too (parallel.reduce with an fsdp axis)
        taken[config.parallel.name] = tuple(dict.fromkeys(taken[config.parallel.name] + chosen.settings))
    check_block(config, "parallel", taken)
    defaults = base_config()
    for layout in LAYOUTS.values():  # a layout's own block (tensor.*) is set only for it
        for key, value in (config.get(layout.block) or {}).items() if layout.block != chosen.block else ():
            if value == defaults.get(layout.block, {}).get(key):
                continue
            if value and f"{layout.block}.{key}" not in chosen.borrows:
                takes = f" (it takes {', '.join(chosen.borrows)} only)" if chosen.borrows else ""
                raise ConfigError(f"{layout.block}.{key}={value!r} applies to parallel.name={layout.name}, not "
                                  f"{config.parallel.name!r}{takes}: set --config.parallel.name={layout.name} or "
                                  f"leave {layout.block}.{key} at its default")
            if value and layout.pairs and not any(name == mesh_lib.MODEL_AXIS for name, _ in config.mesh):
                raise ConfigError(f"{layout.block}.{key}={value!r} with parallel.name={config.parallel.name!r} "
                                  f"splits each stage's positions over the {mesh_lib.MODEL_AXIS!r} mesh axis, and "
                                  f"the mesh {tuple(config.mesh)} has none: add one, e.g. --config.mesh='((\"data\", "
                                  f"-1), (\"stage\", 2), (\"model\", 2))', or leave {layout.block}.{key} at its "
                                  "default")
