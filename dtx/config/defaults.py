"""Experiment configuration: one shared default, experiment files, command-line overrides.

An experiment is a Python file whose ``get_config()`` starts from :func:`base_config`
(locked, so a misspelt key in the experiment fails at once), changes what it needs
and returns the locked ``ml_collections.ConfigDict``; its docstring holds the launch
command and the expected result (big_vision's convention).

``--config.KEY=VALUE`` overrides are parsed by ``ml_collections.config_flags`` —
typed by the default's value, so ``--config.num_steps=1.5`` is refused at load time.
The config never enters jitted code: ``train`` reads it and builds collaborators.
"""

from __future__ import annotations

import inspect
import re

from collections.abc import Callable, Mapping, Sequence

from ml_collections import ConfigDict

from dtx.config.errors import ConfigError
from dtx.config.numbers import check_numbers

LOSS_SCALES = ("auto", "dynamic", "none")
RESUME_MODES = ("auto", "must", "never")




def base_config() -> ConfigDict:
    """The shared default every experiment overrides (locked: no new keys)."""
    c = ConfigDict()
    c.seed = 0  # parameter init, dropout and data shuffling all derive from it

    # Devices and parallelism.
    c.emulate_cpu_devices = 8  # CPU devices to emulate before JAX starts; 0 leaves the backend alone
    # Persistent XLA compilation cache: "auto" (the user's cache folder, $XDG_CACHE_HOME/dtx/jax or
    # ~/.cache/dtx/jax; $DTX_COMPILATION_CACHE overrides it), a folder, or "" (off).
    c.compilation_cache = "auto"
    # (axis, size) pairs, each axis declared by a parallelism (dtx.mesh.AXES): data/node/local replicas, fsdp
    # (replicas, the state split over them), stage (pipeline), model (kernels split); any subset composes
    c.mesh = (("data", -1),)
    c.distributed = "auto"  # join a multi-process job when launched as one (dtx launch, SLURM, ...); "off"
    c.watchdog_seconds = 300.0  # abort when no step completes for this long (0: off)
    # A process of a multi-process job that sends no heartbeat for this long is declared dead and the
    # job stops, naming it (jax.distributed's coordination service).
    c.heartbeat_seconds = 30
    # How long a process of a multi-process job waits for every rank to join (jax.distributed.initialize).
    c.startup_seconds = 300
    c.memory_limit = 0.0  # bytes per device a run may use (0: what an accelerator reports; none on CPU)
    # CPU backend: refuse a run whose estimate × emulated devices exceeds the host's available memory
    c.host_memory_check = True
    c.driver = "shard_map"  # "shard_map": explicit pmean per device; "jit": NamedSharding, compiler collectives
    c.allreduce = "psum"  # shard_map driver: psum | ring | halving_doubling | recursive_doubling | tree | hierarchical
    c.bucket_bytes = 0  # gradient fusion buckets (bytes) per allreduce; 0: one per leaf
    # Gradient compression around the allreduce (dtx.compress; needs driver=shard_map).
    c.compression = ConfigDict()
    c.compression.name = "none"  # none | cast | topk | randomk | sign | terngrad | qsgd | powersgd
    c.compression.dtype = "bfloat16"  # cast: the wire dtype (bfloat16 | float16 | float32)
    c.compression.fraction = 0.01  # topk / randomk: fraction of each gradient's entries sent, in (0, 1]
    c.compression.error_feedback = True  # carry what was not sent into the next step (topk, randomk, sign, powersgd)
    c.compression.momentum = 0.0  # topk: DGC momentum correction (then use optimizer.name=sgd)
    c.compression.clip_norm = 0.0  # topk: DGC local gradient clipping (0: off)
    c.compression.warmup_steps = 0  # topk: DGC sparsity warm-up, from 25% down to fraction
    c.compression.levels = 16  # qsgd: quantisation levels s
    c.compression.bucket_size = 512  # terngrad / qsgd: entries per float32 scale (0: one per chunk)
    c.compression.rank = 4  # powersgd: rank r

    # Synchronisation strategy (dtx.strategies; all but sync need driver=shard_map).
    c.strategy = ConfigDict()
    c.strategy.name = "sync"  # sync | async | ssp | local_sgd | diloco | easgd | gossip | streaming_diloco | onebit_adam | onebit_lamb
    c.strategy.staleness = 0  # async: delay tau (steps); ssp: staleness bound s
    c.strategy.random_delay = False  # async: delays drawn in [0, tau] per worker and step (seeded)
    c.strategy.period = 1  # local_sgd / diloco: H local steps per averaging; easgd: steps per exchange
    c.strategy.sync_steps = 0  # local_sgd: post-local SGD, synchronous for the first K steps
    c.strategy.outer_learning_rate = 0.7  # diloco: outer Nesterov SGD rate
    c.strategy.outer_momentum = 0.9  # diloco: outer Nesterov momentum
    c.strategy.rho = 0.1  # easgd: alpha in [0, 1], the fraction of (x_i - center) each worker moves back
    c.strategy.moving_rate = 0.5  # easgd: beta in [0, 1], the fraction of mean(x_i - center) the center moves
    c.strategy.topology = "ring"  # gossip: ring | complete (uniform 1/p) | exponential (one peer 2^k away)
    c.strategy.mixing = (1 / 3, 1 / 3, 1 / 3)  # gossip ring: weights of (self, left, right), >= 0, summing to 1
    c.strategy.consensus_every = 0  # gossip: steps between global averages of the workers (0: never in the step)
    c.strategy.backup_workers = 0  # backup: b of the p workers whose late gradients each step drops (N = p - b)
    c.strategy.fragments = 1  # streaming_diloco: P fragments on staggered outer steps, 1 <= P <= period
    c.strategy.overlap = 0  # streaming_diloco: tau inner steps before a fragment's outer update is merged, < period
    c.strategy.outer_bits = 0  # streaming_diloco: bits per outer-gradient entry (0: float32; 2..8: QSGD codes)
    c.strategy.merge_alpha = 0.5  # streaming_diloco with overlap: share of its own fragment a worker keeps
    c.strategy.warmup_steps = 100  # onebit_adam / onebit_lamb: full-precision Adam steps before 1-bit momentum
    c.strategy.adam_eps = 0.0  # onebit_adam / onebit_lamb: Adam's epsilon (0: optax.adam's 1e-8 / dtx lamb's 1e-6)

    c.parallel = ConfigDict()
    c.parallel.name = "data"  # data|model|hybrid|fsdp|zero1|zero2|rules|pipeline|tensor (model..rules, tensor: jit)
    c.parallel.rules = ()  # for name=rules: ((regex, (axis or None, ...)), ...), first match wins
    # for name=fsdp with grad_accum_steps > 1: per_microbatch (reduce-scatter each micro-batch's gradient into a 1/N
    # accumulator) | once (each device sums its whole gradient, one reduce-scatter per step; docs/large_batch.md)
    c.parallel.reduce = "per_microbatch"
    c.parallel.fc_pairs = False  # for name=model|hybrid: consecutive Dense layers as column/row pairs (no gather between)

    # parallel.name=pipeline (a "stage" mesh axis; docs/pipeline.md): M micro-batches per step (they are the run's
    # gradient accumulation: grad_accum_steps stays 1 or equals M), the schedule, the layer indices where stages
    # 1.. start (() balances the stages by FLOPs), the chunks of layers per device (interleaved)
    c.pipeline = ConfigDict()
    c.pipeline.microbatches = 1
    c.pipeline.schedule = "gpipe"  # gpipe | 1f1b | interleaved
    c.pipeline.boundaries = ()
    c.pipeline.virtual_stages = 1
    c.pipeline.zero_stage = 0  # 1: ZeRO-1 over the data axes (each stage row's optimizer state split over them)

    # parallel.name=tensor (a "model" mesh axis; docs/tensor_parallel.md): Megatron's heads and MLP split; with
    # sequence_parallel the activations between them also split by positions (dataset.seq_len divisible by it)
    c.tensor = ConfigDict()
    c.tensor.sequence_parallel = False
    c.tensor.zero_stage = 0  # ZeRO over the data axes: 1 optimizer state, 2 and gradients, 3 and parameters

    # An "fsdp" mesh axis (data replicas with the train state split over them; beside a "data" axis: hybrid
    # sharding, HSDP): which ZeRO stage it runs. With parallel.name=data (or tensor, or a "stage" axis) it composes.
    c.fsdp = ConfigDict()
    c.fsdp.zero_stage = 3  # 1 the optimizer state, 2 and the gradients, 3 and the parameters (FSDP)
    # A "model" mesh axis: how kernels split over it (dtx.parallel.compose), with parallel.name=data: "megatron"
    # (Megatron's column/row pairs, parallel.name=tensor's), "all" (every Dense/Conv: Das et al.'s model
    # parallelism) or "dense" (the fully connected layers: their hybrid); "" leaves it to the parallel.name preset.
    c.model_axis = ConfigDict()
    c.model_axis.split = ""
    # A "context" mesh axis (dtx.parallel.context): every sequence split over it; attention's kernel: ring
    # (ppermute of key/value chunks, online softmax), allgather (keys and values gathered) or ulysses (all-to-all
    # to a head split; the heads divisible by the axis).
    c.context = ConfigDict()
    c.context.attention = "ring"
    c.context.balance = True  # device i holds chunks i and 2C-1-i of 2C: equal causal work (False: contiguous)

    # Simulated clock (dtx.perf.simclock): records carry sim_time_s, the run's modelled time on this cluster.
    c.cluster = ConfigDict()
    c.cluster.name = ""  # "": no clock | a dtx simulate preset (cloud_10gbe, haswell_fdr, ...) | custom
    c.cluster.node_flops = 0.0  # peak FLOP/s per node (0: the preset's)
    c.cluster.memory_bandwidth = 0.0  # bytes/s per node (0: the preset's)
    c.cluster.bandwidth = 0.0  # network bytes/s per node and direction (0: the preset's)
    c.cluster.latency = -1.0  # network latency alpha, seconds (-1: the preset's)
    c.cluster.compute_s = 0.0  # one worker's compute per step, seconds, measured on your node (0: perf-model roofline)
    c.cluster.overlap = 0.0  # fraction of the backward pass communication hides behind, in [0, 1]
    c.cluster.straggler = "none"  # none | lognormal (sigma) | slow (slow_fraction, slow_factor); seeded by seed
    c.cluster.sigma = 0.3  # lognormal: sigma of each worker's compute-time multiplier (mean 1)
    c.cluster.slow_fraction = 0.1  # slow: probability a worker is slow at a step
    c.cluster.slow_factor = 4.0  # slow: how many times slower it then is

    # Data.
    c.dataset = ConfigDict()
    # synthetic | digits | mnist | cifar10 | image_folder | python_docs, or package.module:function (your arrays);
    # or dtx.train(data=)
    c.dataset.name = "digits"
    c.dataset.data_dir = ""  # folder with the files of mnist / cifar10 / image_folder (train/<class>/*.png, test/...)
    # mnist / cifar10 / image_folder are read through grain (dtx.data.inputs): augmentation of the training
    # images, a hash of (seed, epoch, example) so batches stay a function of (seed, step), and prefetch workers.
    c.dataset.augment = ConfigDict(dict(
        crop_padding=0,  # pixels of zero padding before a random crop back to the image size (0: no crop)
        flip=False,  # horizontal flip with probability 1/2
        normalize=False,  # per-channel (x - mean) / std, training and test images
        mean=(), std=(),  # per channel; empty: the statistics of up to 2048 training images
    ))
    c.dataset.workers = 0  # processes that prefetch training batches (0: built in the training process)
    c.dataset.seq_len = 64  # python_docs: tokens per example
    c.dataset.tokenizer = "bytes"  # python_docs: bytes (UTF-8, 256 ids) | bpe (byte-level BPE of vocab_size ids)
    c.dataset.vocab_size = 0  # bpe: ids, >= 257 (a special and the 256 bytes; cached in data_dir or ~/.cache/dtx)
    c.dataset.synthetic = ConfigDict(
        dict(num_train=4096, num_test=1024, num_features=32, num_classes=10, noise=0.8, clusters_per_class=4)
    )

    # Task: the loss and metrics (dtx.data.tasks; or dtx.train(..., task=)).
    c.task = ConfigDict()
    c.task.name = "classification"  # classification | regression | next_token | package.module:function
    c.task.label_smoothing = 0.0  # classification / next_token: in [0, 1)
    c.task.pad_id = -1  # next_token: label id that is not scored (padding); -1: every token is

    # Model: name plus that model's own settings (see models.model_fields(name)); the name may be your flax
    # module's class, package.module:Class, whose dataclass fields are then the settings.
    c.model = ConfigDict(dict(name="mlp", features=(256, 256)))

    # Optimisation.
    c.optimizer = ConfigDict()
    c.optimizer.name = "adam"  # sgd | momentum | nesterov | adam | adamw | lars | lamb
    c.optimizer.learning_rate = 1e-3  # base rate; the scaling rule turns it into the peak rate
    c.optimizer.scaling = "none"  # none | linear (lr x batch/base_batch) | sqrt
    c.optimizer.base_batch_size = 256  # the batch the base rate was tuned for
    c.optimizer.momentum = 0.9  # sgd-family and LARS momentum; adam's b1
    c.optimizer.weight_decay = 0.0  # weight decay, not applied to the parameters optimizer.exclude names; 0: off
    c.optimizer.exclude = r"(^|/)(bias|scale)$"  # params without weight decay / LARS-LAMB trust ratio
    c.optimizer.trust_coefficient = 0.001  # LARS's eta
    c.optimizer.clip_norm = 0.0  # > 0: clip the gradient by the whole model's L2 norm, in every layout (0: off)
    c.optimizer.schedule = "constant"  # constant | cosine | polynomial | step, after linear warmup
    c.optimizer.warmup_steps = 0  # linear warmup from 0 to the peak rate over these steps
    c.optimizer.warmup_epochs = 0.0  # alternative to warmup_steps (Goyal et al. count warmup in epochs)
    c.optimizer.decay_power = 2.0  # polynomial schedule
    c.optimizer.step_boundaries = (0.5, 0.75)  # step schedule: fractions of the post-warmup steps
    c.optimizer.step_factor = 0.1  # step schedule: multiplier at each boundary
    c.global_batch_size = 128  # examples per step over all devices
    c.grad_accum_steps = 1  # micro-batches per step (one gradient accumulator, one all-reduce)
    c.num_epochs = 10.0  # the run's length in passes over the training split (unless num_steps)
    c.num_steps = 0  # > 0 overrides num_epochs

    # Precision: params / compute / output / reduce (gradient communication) dtypes.
    c.precision = "params=float32,compute=float32,output=float32,reduce=float32"
    c.loss_scale = ConfigDict()
    c.loss_scale.name = "auto"  # auto (dynamic iff float16 is in the policy) | dynamic | none
    c.loss_scale.initial = 2.0**15  # the dynamic scale it starts from
    c.loss_scale.growth_interval = 2000  # finite steps before the scale doubles
    c.loss_scale.backoff = 0.5  # its factor after an overflowing (skipped) step
    c.loss_scale.min_scale = 1.0  # the scale never falls below it

    # Rematerialisation (dtx.models.remat; models that declare a remat field, the transformer): what each block
    # keeps for the backward pass: none (all) | full (its input; the block recomputed) | dots (its Dense outputs)
    # | offload (those, in pinned host memory)
    c.remat = ConfigDict()
    c.remat.policy = "none"

    # Checkpoints (orbax): every N steps and at the end; SIGTERM saves at the next step and exits 0.
    c.checkpoint = ConfigDict()
    c.checkpoint.every_steps = 0  # 0: no checkpoints
    c.checkpoint.keep = 3  # newest checkpoints kept
    c.checkpoint.resume = "auto"  # auto (resume if a checkpoint exists) | must | never
    c.checkpoint.async_save = True
    c.checkpoint.dir = ""  # default WORKDIR/checkpoints
    c.checkpoint.resume_step = 0  # > 0: resume exactly this step; 0: the newest step that verifies
    c.checkpoint.hmac_key_env = ""  # name of an environment variable holding an HMAC key for manifests ("": none)

    # Evaluation and logging.
    c.eval_batch_size = 256
    c.eval_batches = 0  # evaluate on at most this many eval batches from the start of the test split (0: all)
    c.eval_every = 0  # steps between evaluations; 0 evaluates only at the end
    c.log_every = 10  # steps between metric records
    c.progress = True  # progress bar on the terminal / notebook
    c.profile_steps = 0  # > 0: capture a jax.profiler trace of this many steps into WORKDIR/profile
    c.peak_flops = 0.0  # per-device peak FLOP/s for MFU; 0: look the device kind up in dtx.perf.flops
    c.log_grad_norm = False  # record grad_norm (norm of the reduced gradient); costs ~30% on the jit driver

    # Weights & Biases, beside TensorBoard (pip install 'dtx[wandb]'): "" project logs nothing there.
    c.wandb = ConfigDict()
    c.wandb.project = ""  # the wandb project; "" turns the sink off
    c.wandb.entity = ""  # team or user ("": wandb's default)
    c.wandb.name = ""  # display name ("": the workdir's name)
    c.wandb.mode = ""  # online | offline | disabled ("": wandb's default, or $WANDB_MODE)

    return c.lock()


# Keys that moved: an override of the old name is refused naming the new one (dtx.config.files).
MOVED_KEYS = {"parallel.schedule": "pipeline.schedule", "parallel.boundaries": "pipeline.boundaries",
              "parallel.virtual_stages": "pipeline.virtual_stages"}


def validate(config: ConfigDict) -> None:
    """Checks that need no devices or data; each error names the key and the fix."""
    for key in ("global_batch_size", "eval_batch_size", "log_every"):
        if config[key] < 1:
            raise ConfigError(f"{key}={config[key]} must be >= 1")
    if config.num_steps < 0 or (config.num_steps == 0 and config.num_epochs <= 0):
        raise ConfigError(
            f"num_steps={config.num_steps}, num_epochs={config.num_epochs}: set num_steps > 0 or num_epochs > 0"
        )
    if config.eval_every < 0:
        raise ConfigError(f"eval_every={config.eval_every} must be >= 0 (0: evaluate only at the end)")
    if config.get("eval_batches", 0) < 0:
        raise ConfigError(f"eval_batches={config.eval_batches} must be >= 0 (a cap on the eval batches; 0: the "
                          "whole test split)")
    if config.profile_steps < 0:
        raise ConfigError(f"profile_steps={config.profile_steps} must be >= 0 (steps to trace; 0: no trace)")
    if config.peak_flops < 0:
        raise ConfigError(f"peak_flops={config.peak_flops} must be >= 0 (per-device peak FLOP/s; 0: by device kind)")
    if config.emulate_cpu_devices < 0:
        raise ConfigError(f"emulate_cpu_devices={config.emulate_cpu_devices} must be >= 0")
    mesh = config.mesh
    if not all(isinstance(a, (tuple, list)) and len(a) == 2 and isinstance(a[0], str) and isinstance(a[1], int)
               and not isinstance(a[1], bool) for a in mesh):
        raise ConfigError(f"mesh={mesh!r} must be (name, size) pairs, e.g. (('data', -1),) or (('data', 4), ('model', 2))")
    if config.optimizer.warmup_steps and config.optimizer.warmup_epochs:
        raise ConfigError("set optimizer.warmup_steps or optimizer.warmup_epochs, not both")
    if config.checkpoint.resume not in RESUME_MODES:
        raise ConfigError(f"checkpoint.resume={config.checkpoint.resume!r}; choose one of {list(RESUME_MODES)}")
    if config.checkpoint.every_steps < 0 or config.checkpoint.keep < 1:
        raise ConfigError("checkpoint.every_steps must be >= 0 and checkpoint.keep >= 1")
    if config.checkpoint.resume_step < 0:
        raise ConfigError(f"checkpoint.resume_step={config.checkpoint.resume_step} must be >= 0 "
                          "(a step to resume exactly; 0: the newest step that verifies)")
    if config.checkpoint.resume_step and config.checkpoint.resume == "never":
        raise ConfigError(f"checkpoint.resume_step={config.checkpoint.resume_step} asks to resume but "
                          "checkpoint.resume='never' forbids it; set one of them differently")
    key_env = config.checkpoint.hmac_key_env
    if key_env and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key_env):
        raise ConfigError(f"checkpoint.hmac_key_env={key_env!r} is not an environment "
                          "variable name; give the variable's name (e.g. DTX_CHECKPOINT_KEY), never the key itself")
    if config.distributed not in ("auto", "off"):
        raise ConfigError(f"distributed={config.distributed!r}; choose 'auto' or 'off'")
    if config.grad_accum_steps < 1:
        raise ConfigError(f"grad_accum_steps={config.grad_accum_steps} must be >= 1")
    if config.loss_scale.name not in LOSS_SCALES:
        raise ConfigError(f"loss_scale.name={config.loss_scale.name!r} is unknown; choose one of {list(LOSS_SCALES)}")
    if "model" not in config or "name" not in config.model:
        raise ConfigError("config.model needs a 'name' (e.g. 'mlp')")
    check_numbers(config)
    for check in _CHECKS.values():  # the plug-ins' own rules, each kept beside its plug-in
        try:
            check(config)
        except ConfigError:
            raise
        except ValueError as e:  # a plug-in's own error type: the same message, as a config error
            raise ConfigError(str(e)) from None


# The checks of each plug-in family's block, registered by the family's module (the clock's
# cluster block, the tasks, a compressor's or strategy's rule about the optimizer, ...). Keyed by
# qualified name, so reloading a module replaces its check instead of adding a second one.
_CHECKS: dict[str, Callable[[ConfigDict], None]] = {}


def register_check(check: Callable[[ConfigDict], None]) -> Callable[[ConfigDict], None]:
    """Add a plug-in's check to :func:`validate`: it takes the whole config and raises
    :class:`ConfigError` (or its own ``ValueError``) naming the key and the fix."""
    _CHECKS[f"{check.__module__}.{check.__qualname__}"] = check
    return check


# ------------------------------------------------------------- plug-in blocks
# A plug-in family's block (strategy, compression, task) holds ``name`` and the settings of all its
# plug-ins, flattened. Each factory's signature declares the settings its plug-in takes; a key set
# for a choice that does not take it is refused (at load time here, in Python by the family's registry).


def declared_settings(factory: Callable, supplied: Sequence[str] = ()) -> tuple[str, ...]:
    """The settings a plug-in's ``factory`` takes: its parameters, less those its registry ``supplied``
    (a strategy's ``stragglers``). A factory that swallows ``**kwargs`` declares nothing and is refused."""
    parameters = inspect.signature(factory).parameters.values()
    swallowing = [p.name for p in parameters if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    if swallowing:
        raise TypeError(f"{getattr(factory, '__qualname__', factory)} takes *{swallowing[0]}: a plug-in's factory "
                        "names each setting it takes as a parameter, so that other settings are refused")
    return tuple(p.name for p in parameters if p.name not in supplied)


def foreign_setting(block: str, name: str, key: str, value, taken: Mapping[str, Sequence[str]]) -> str:
    """Why ``{block}.{key}={value}`` cannot go to the plug-in ``name`` (``taken``: each plug-in's settings)."""
    users = [other for other, keys in taken.items() if key in keys]
    mine = taken.get(name, ())
    takes = f"{block} {name!r} takes: {', '.join(mine)}" if mine else f"{block} {name!r} takes none"
    if not users:
        every = sorted({k for keys in taken.values() for k in keys})
        return f"unknown {block} setting(s) [{key!r}] ({takes}; {block} settings are {every})"
    where = ", ".join(users[:-1]) + f" or {users[-1]}" if len(users) > 1 else users[0]
    return f"{block}.{key}={value!r} applies to {block}.name={where} only, not {name} ({takes})"


def refuse_foreign(block: str, name: str, settings: Mapping, taken: Mapping[str, Sequence[str]],
                   error: type[Exception]) -> None:
    """A registry's check: raise ``error`` for the ``settings`` its plug-in ``name`` does not take."""
    foreign = [foreign_setting(block, name, key, value, taken) for key, value in settings.items()
               if key not in taken[name]]
    if foreign:
        raise error("; ".join(foreign))


def check_block(config: ConfigDict, block: str, taken: Mapping[str, Sequence[str]]) -> None:
    """Refuse a key of ``config[block]`` that differs from :func:`base_config`'s default and that the chosen
    plug-in (``config[block].name``; ``taken``: each plug-in's settings) does not take. An unknown name is
    left to its family's own check."""
    node, defaults = config[block], base_config()[block]
    if node.name not in taken:
        return
    problems = [foreign_setting(block, node.name, key, value, taken) +
                f"; leave {block}.{key} at its default {defaults[key]!r} or choose a {block}.name that takes it"
                for key, value in node.items()
                if key != "name" and key not in taken[node.name]
                and not (key in defaults and _plain(value) == _plain(defaults[key]))]
    if problems:
        raise ConfigError("; ".join(problems))


def chosen_settings(block: ConfigDict, taken: Mapping[str, Sequence[str]]) -> dict:
    """The keys of a plug-in ``block`` its chosen plug-in takes: the keyword arguments of its factory (a key the
    block lacks leaves the factory's default)."""
    return {key: _plain(block[key]) for key in taken.get(block.name, ()) if key in block}


def replaces_optimizer(part: str, when: str = "") -> Callable[[Callable], Callable]:
    """Declare on a plug-in's factory that the plug-in does the optimizer's ``part`` (its momentum, its
    preconditioning) itself — always, or while its setting ``when`` is non-zero — so it runs over plain SGD;
    :func:`check_plain_sgd` holds the config to it."""
    def declare(factory: Callable) -> Callable:
        factory.replaces_optimizer = (part, when)
        return factory
    return declare


def check_plain_sgd(config: ConfigDict, block: str, factory: Callable | None) -> None:
    """Refuse an optimizer other than SGD under a plug-in that :func:`replaces_optimizer`'s part."""
    from dtx.optim import DECLARED  # the optimizers' declarations (dtx.optim, on this floor)

    part, when = getattr(factory, "replaces_optimizer", (None, ""))
    node, optimizer = config[block], config.optimizer.name
    declared = DECLARED.get(optimizer)
    plain = declared is not None and declared.slots == 0 and declared.by_entry  # no state, no preconditioning
    if part is None or plain or (when and not node[when]):
        return
    setting = f"{block}.{when}={node[when]!r} ({block} {node.name!r})" if when else f"{block}.name={node.name!r}"
    raise ConfigError(f"{setting} does the optimizer's {part} itself, so optimizer.name={optimizer!r} would apply "
                      f"{part} twice; set --config.optimizer.name=sgd (its learning rate, schedule and weight decay "
                      "then give the step)" + (f" or {block}.{when}=0" if when else ""))


def _plain(value):
    """Lists (a config read back from JSON) as tuples, so that they compare with the defaults."""
    return tuple(_plain(v) for v in value) if isinstance(value, (list, tuple)) else value
