"""The ``dtx`` command line: parses arguments and calls the library, nothing more.

    dtx train EXPERIMENT.py [--workdir DIR] [--config.KEY=VALUE ...]
    dtx launch --processes N --devices-per-process D EXPERIMENT.py [...]
    dtx simulate --model NAME [...]     dtx plot RUN_DIR [...]
    dtx bench collectives [...]         dtx bench step EXPERIMENT.py [...]
    dtx eval WORKDIR [--step N]         dtx export WORKDIR --out DIR [--step N]
    dtx generate WORKDIR --prompt TEXT [--max-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]
    dtx config [PREFIX ...]             every config key, its default and meaning
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time
from collections.abc import Sequence

from dtx import _sigterm


# Commands with parsers of their own: (module, function, one-line help). Imported only when used.
_COMMANDS = {
    "launch": ("dtx.tools.launch", "launch_main", "run an experiment as several local processes (jax.distributed)"),
    "simulate": ("dtx.tools.simulate", "simulate_main", "predict iteration time and scaling (Das et al. model)"),
    "plot": ("dtx.tools.plots", "plot_main", "compare runs: PNG plots of their metrics"),
    "eval": ("dtx.run.evaluate", "eval_main", "evaluate a run's checkpoint (newest or --step N) on the test split"),
    "export": ("dtx.run.evaluate", "export_main", "write a run's checkpoint for plain flax (--out DIR)"),
    "generate": ("dtx.run.generate", "generate_main", "continue a prompt with a trained language model"),
    "config": ("dtx.config.keys", "config_main", "list every config key with its default and meaning"),
    "bench collectives": ("dtx.tools.bench", "collectives_main", "time every allreduce algorithm on this mesh"),
    "bench step": ("dtx.tools.bench", "step_main", "split a train step's time into compute and communication"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for name, (module, function, _) in _COMMANDS.items():
        words = name.split()
        if argv[: len(words)] == words:
            return getattr(importlib.import_module(module), function)(argv[len(words):])
    if argv and argv[0] in _groups():  # "dtx bench", "dtx bench --help", "dtx bench typo"
        return _group_help(argv[0], argv[1:])

    parser = argparse.ArgumentParser(prog="dtx", description="Distributed training on JAX meshes.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train_cmd = commands.add_parser(
        "train",
        help="train an experiment config",
        description="Train EXPERIMENT.py (a file whose get_config() returns a ConfigDict). "
        "Override any config key with --config.KEY=VALUE, e.g. --config.driver=jit.",
    )
    train_cmd.add_argument("experiment", help="experiment file (experiments/digits_mlp.py) or the name of one "
                           "that ships with dtx (digits_mlp)")
    train_cmd.add_argument("--workdir", help="where metrics.jsonl and TensorBoard events go "
                           "(default: runs/<experiment>-<time>)")
    for name, (_, _, help_text) in _COMMANDS.items():
        commands.add_parser(name, help=f"{help_text} ('dtx {name} --help')", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command != "train":  # e.g. a bare "dtx bench"
        parser.error(f"'{args.command}' needs more words: see 'dtx --help'")
    overrides = [a for a in rest if a.startswith("--config.")]
    unknown = [a for a in rest if not a.startswith("--config.")]
    if unknown:
        parser.error(f"unrecognised arguments: {' '.join(unknown)} (config overrides are --config.KEY=VALUE)")
    code = _train(args.experiment, args.workdir, overrides)
    _sigterm.settle()  # the run has ended and said so: a SIGTERM while Python shuts down has nothing to stop
    return _unless_a_save_is_stuck(code)


def _unless_a_save_is_stuck(code: int) -> int:
    """``code``; but where a checkpoint save stalled (dtx.ckpt.checkpoint.stalled), exit now: the interpreter
    would wait for orbax's stuck thread forever. What that save wrote was never committed."""
    checkpoint, barrier = sys.modules.get("dtx.ckpt.checkpoint"), sys.modules.get("dtx.ckpt.barrier")
    if barrier is not None and barrier.abandoned():  # JAX's shutdown would wait for the rank that never came
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 4)
    if checkpoint is not None and checkpoint.stalled():
        print("dtx: a checkpoint save is stuck; exiting without it (it was never committed)", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 4)
    return code


def _groups() -> set[str]:
    """First words of the two-word commands (``bench``)."""
    return {name.split()[0] for name in _COMMANDS if " " in name}


def _group_help(group: str, rest: list[str]) -> int:
    """List a group's commands: on stdout with status 0 when asked (``--help``), else on stderr with 2."""
    members = {name.split()[1]: help_text for name, (_, _, help_text) in _COMMANDS.items()
               if name.split()[0] == group and " " in name}
    asked = rest[:1] in (["-h"], ["--help"])
    lines = [f"usage: dtx {group} {{{','.join(members)}}} ...", "", "commands:",
             *(f"  {word:<13} {text}" for word, text in members.items()), "",
             f"options of a command: dtx {group} COMMAND --help"]
    if rest and not asked:
        lines.insert(0, f"dtx {group}: unknown command {rest[0]!r}; choose from {', '.join(members)}")
    print("\n".join(lines), file=sys.stdout if asked else sys.stderr)
    return 0 if asked else 2


def _train(experiment: str, workdir: str | None, overrides: list[str]) -> int:
    from dtx import config as config_lib

    try:
        config = config_lib.load(experiment, overrides)
    except config_lib.ConfigError as e:
        print(f"dtx: config error: {e}", file=sys.stderr)
        return 2
    if workdir is None:
        stem = os.path.splitext(os.path.basename(experiment.split(":")[0]))[0]
        workdir = os.path.join("runs", f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}")

    from dtx.ckpt.barrier import BarrierTimeout
    from dtx.ckpt.checkpoint import CheckpointError
    from dtx.run.watchdog import EXIT_CODE as WATCHDOG_EXIT
    from dtx.run.preflight import show_on_terminal
    from dtx.run.trainer import train

    show_on_terminal()

    try:
        result = train(config, workdir)
    except (ValueError, FileExistsError, FileNotFoundError) as e:
        # Bad input found before training started: say what and how to fix it, no traceback.
        print(f"dtx: error: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:  # the run diverged: the message names the step and what to change
        print(f"dtx: diverged: {e}", file=sys.stderr)
        return 3
    except BarrierTimeout as e:  # a peer never came to a save, restore or evaluation: the watchdog's code (named)
        print(f"dtx: a peer did not arrive: {e}", file=sys.stderr)
        return WATCHDOG_EXIT
    except CheckpointError as e:  # a checkpoint that cannot be written or must not be restored: says why
        print(f"dtx: checkpoint error: {e}", file=sys.stderr)
        return 4
    if result.preempted:
        step = int(result.state.step)
        print(f"preempted: checkpoint saved at step {step}; run the same command to resume" if result.saved else
              f"preempted at step {step} before anything new was saved; run the same command to start again")
        return 0
    final = result.metrics
    # Whatever the task scores (accuracy, mae, perplexity ...), the loss first; none without a test split.
    scores = sorted((k for k in final if (k.startswith("test_") or k == "perplexity") and k != "test_examples"
                     and k != "test_tokens"), key=lambda k: (k != "test_loss", k))
    shown = "  ".join(f"{k} {final[k]:.4f}" for k in scores) or "no test split"
    examples = f"{final['test_examples']} test examples, " if "test_examples" in final else ""
    print(f"step {int(result.state.step)}: {shown}  ({examples}{config.driver} driver)")
    # TensorBoard's viewer is an extra (the event files are written by tensorboardX, a dependency)
    viewer = "" if importlib.util.find_spec("tensorboard") else "pip install 'dtx[tensorboard]', then "
    print(f"records: {os.path.join(workdir, 'metrics.jsonl')}  ({viewer}tensorboard --logdir {workdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
