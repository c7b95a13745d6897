"""The floors of dtx, bottom to top: the one place their order is written.

A module imports only from its own floor or the floors below it, and no import (lazy ones
included) closes a circle; ``tests/test_house.py`` reads every import with :mod:`ast` and holds
the library to both, and checks that README.md's layout section is :func:`render`'s text.
Each floor is a list of ``(module or package, what it holds)``.
"""

from __future__ import annotations

import textwrap

FLOORS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("ground", (
        ("config", "the shared defaults and their checks; reading experiment files and overrides"),
        ("mesh", "device meshes as data; emulated CPU devices"),
        ("xla_cache", "the persistent compilation cache and JAX's compile timings"),
        ("precision", "the precision policy and dynamic loss scaling"),
        ("optim", "optimizers (SGD, momentum, Adam, LARS, LAMB) and learning-rate schedules"),
        ("paths", "names of a pytree's leaves"),
        ("figures", "PNG figures: lines, labelled points, bars, marks (matplotlib, headless)"),
        ("models", "flax models by name (models/, installed as dtx.models)"),
        ("_sigterm", "SIGTERM noted from the dtx command's first moment, before its imports"),
        ("_checkout", "dtx.models and dtx.experiments from a source checkout"),
        ("_floors", "this list"),
    )),
    ("workers", (
        ("comm", "the workers' context, the α-β cost model and traffic accountant, allreduce algorithms and "
                 "their schedules, the compressed allreduce, gossip topologies, what a compiled program sends"),
        ("compress", "gradient compression with error feedback: quantisation, sparsification, low rank"),
        ("strategies", "how workers synchronise: sync, async, SSP, backup workers, local models, "
                       "Streaming DiLoCo, 1-bit Adam/LAMB; the straggler model"),
    )),
    ("data", (
        ("data", "data sets, the loader (batches a function of seed and step), your own data, tasks"),
    )),
    ("layout and the step", (
        ("perf", "the performance model: layers, FLOPs, clusters, iteration time and plans, memory, "
                 "the simulated clock; each parallelism's own terms live in its package"),
        ("step", "the train state, the one per-worker body, the shard_map and jit drivers, ZeRO's step, "
                 "batch norm, pacing"),
        ("parallel", "where the state and the activations live: the mesh axes' layouts (data, model, hybrid, "
                     "FSDP, ZeRO, rules), one package per parallelism that straddles layout and step "
                     "(pipeline/, tensor/: its axis, placement, settings, cost terms and runner)"),
    )),
    ("the run", (
        ("ckpt", "checkpoints onto any mesh, their integrity, preemption"),
        ("run", "train() top to bottom: set-up, run directory, records, checks, watchdog, evaluation, "
                "plans against compiled programs"),
    )),
    ("commands", (
        ("tools", "the dtx command: cli, launch, simulate, plancheck, plots, bench"),
    )),
)


def floor_of(module: str) -> int | None:
    """The floor index of a dotted ``dtx.`` module (``None``: the package face ``dtx`` or
    ``dtx.experiments``, which stand on everything)."""
    parts = module.split(".")
    if parts[0] != "dtx" or len(parts) < 2:
        return None
    for index, (_, rooms) in enumerate(FLOORS):
        if parts[1] in {name for name, _ in rooms}:
            return index
    return None


def render() -> str:
    """README.md's layout block: the floors bottom to top, then the folders beside the library."""
    lines = ["dtx/          the library, floor by floor from the bottom (a module imports only from its own",
             "              floor or the floors below; tests/test_house.py checks it)"]
    for name, rooms in FLOORS:
        lines.append(f"  {name}")
        for room, meaning in rooms:
            if room.startswith("_") or room == "models":  # private, or a folder of its own (below)
                continue
            shown = room if room in ("mesh", "xla_cache", "precision", "optim", "paths", "figures") else room + "/"
            wrapped = textwrap.wrap(meaning, 96)
            lines.append(f"    {shown:<12}{wrapped[0]}")
            lines += [" " * 16 + more for more in wrapped[1:]]
    lines += [
        "models/       flax models (mlp, lenet, vgg_a, overfeat_fast, speech_dnn, resnet18, resnet50,",
        "              transformer), by name; installed as dtx.models",
        "experiments/  one file per experiment; installed as dtx.experiments",
        "tests/        one test file per module (test_<module>.py), on exactly 8 emulated CPU devices",
        "benchmarks/   speed measurements; figures in BENCHMARKS.md",
    ]
    return "\n".join(lines)
