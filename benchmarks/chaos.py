"""Chaos: kill training runs at random moments, resume them, and compare with an uninterrupted run.

    python benchmarks/chaos.py [--update-docs]   # 52 seeded trials, ~30 min on 2 cores
    python benchmarks/chaos.py --trials 6      # a quick look (the section is only written for >= 50 trials)

With ``--update-docs`` (and >= 50 trials) it writes its section of BENCHMARKS.md and its log, one line per
reference run and trial, to ``benchmarks/logs/chaos.log``.

Each trial starts ``dtx train`` (40 trials, 8 emulated devices) or ``dtx launch`` (12 trials, 2 processes
x 4 devices) on the default experiment with checkpoints every 7 steps, sends SIGKILL or SIGTERM at a
moment drawn uniformly from the reference run's wall time — so some land before the first checkpoint
commits, some during saves, some in the loop — then runs the same command again until it exits 0 (at
most 3 restarts). It *held* when the restarted run's per-step losses, final record (test accuracy and
loss) and last checkpoint's state digest equal the uninterrupted run's bit for bit. Seeds fix the
moments and the signals; the machine's load still moves where in the run each moment falls.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)
import report  # noqa: E402

EXPERIMENT = os.path.join(REPO, "experiments", "digits_mlp.py")
LOG = os.path.join(HERE, "logs", "chaos.log")  # written with --update-docs, beside the section
SETTINGS = ["--config.num_steps=60", "--config.checkpoint.every_steps=7", "--config.log_every=1",
            "--config.progress=False", "--config.model.features=(64,)"]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}


def _command(kind: str, workdir: str) -> list[str]:
    if kind == "launch":
        return [sys.executable, "-m", "dtx.tools.cli", "launch", "--processes", "2", "--devices-per-process", "4",
                EXPERIMENT, "--workdir", workdir, *SETTINGS]
    return [sys.executable, "-m", "dtx.tools.cli", "train", EXPERIMENT, "--workdir", workdir, *SETTINGS]


def _outcome(workdir: str) -> tuple:
    """(per-step losses, final record, last checkpoint's state digest): what must be bit-identical."""
    from dtx.run import metrics

    records = metrics.read_metrics(workdir)
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    final = [r for r in records if "test_accuracy" in r][-1]
    digest = _checkpoint_digest(os.path.join(workdir, "checkpoints"))
    return [losses[s] for s in sorted(losses)], (final["test_accuracy"], final["test_loss"]), digest


def _checkpoint_digest(directory: str) -> str:
    """SHA-256 of the newest committed step's manifest (every array's digest, the data digest, the
    communication totals): equal iff the saved run is the same run, bit for bit."""
    import hashlib

    steps = sorted(int(n) for n in os.listdir(directory) if n.isdigit())
    manifest = os.path.join(directory, str(steps[-1]), "manifest")
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(manifest)):
        for name in sorted(f for f in files if f != "commit_success.txt"):  # orbax's marker names the path
            h.update(name.encode())
            h.update(open(os.path.join(root, name), "rb").read())
    return f"{steps[-1]}:{h.hexdigest()}"


def _run(command: list[str], timeout: float = 600) -> tuple[int, float, str]:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=timeout)
    return done.returncode, time.perf_counter() - start, done.stderr[-2000:]


def _last_error(stderr: str) -> str:
    """The line of ``stderr`` that says what went wrong: the last one, less JAX's note on filtered frames."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    while lines and (lines[-1].startswith("---") or "JAX_TRACEBACK_FILTERING" in lines[-1]):
        lines.pop()
    return lines[-1] if lines else ""


def _verbatim(text: str) -> str:
    """A process's words as a markdown code span that fits in a table cell."""
    return "`" + text.replace("`", "'").replace("|", "\\|") + "`"


def trial(kind: str, seed: int, reference: tuple, wall: float, root: str) -> tuple[str, str]:
    rng = random.Random(seed)
    moment = rng.uniform(0.05, 0.95) * wall
    signum = rng.choice([signal.SIGKILL, signal.SIGTERM])
    workdir = os.path.join(root, f"{kind}-{seed}")
    command = _command(kind, workdir)
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV,
                               start_new_session=True)
    time.sleep(moment)
    if process.poll() is None:
        try:  # the whole session: the launcher and its workers, as a scheduler's kill would
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            pass
    process.wait(timeout=300)
    detail = f"{signal.Signals(signum).name} at {moment:.1f}s"
    for _ in range(3):
        code, _, err = _run(command)
        if code == 0:
            break
    else:
        return "failed", f"{detail}: resume exited {code}: {_verbatim(_last_error(err))}"
    try:
        held = _outcome(workdir) == reference
    except (OSError, IndexError, KeyError) as e:
        return "failed", f"{detail}: unreadable outcome {_verbatim(f'{type(e).__name__}: {e}')}"
    return ("held" if held else "failed"), detail + ("" if held else ": differs from the uninterrupted run")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=52, help="total trials (about 3/13 of them 2-process)")
    parser.add_argument("--seed", type=int, default=0)
    report.add_output_arguments(parser)
    args = parser.parse_args(argv)
    two = max(1, round(args.trials * 12 / 52)) if args.trials > 1 else 0
    plan = [("train", args.seed + i) for i in range(args.trials - two)]
    plan += [("launch", args.seed + 1000 + i) for i in range(two)]
    rows, counts, start, log = [], {}, time.perf_counter(), []
    load = os.getloadavg()[0]

    def say(line: str) -> None:
        log.append(line)
        print(line, flush=True)

    say(f"chaos: {args.trials} trials, seed {args.seed}, {' '.join(SETTINGS)}; load average {load:.1f}")
    with tempfile.TemporaryDirectory(prefix="dtx-chaos-") as root:
        references = {}
        for kind in sorted({k for k, _ in plan}):
            workdir = os.path.join(root, f"{kind}-reference")
            code, wall, err = _run(_command(kind, workdir))
            if code:
                print(f"reference {kind} run failed: {err}", file=sys.stderr)
                return 1
            references[kind] = (_outcome(workdir), wall)
            say(f"reference {kind}: {wall:.1f} s")
        for kind, seed in plan:
            began = time.perf_counter()
            outcome, detail = trial(kind, seed, references[kind][0], references[kind][1], root)
            counts[kind, outcome] = counts.get((kind, outcome), 0) + 1
            say(f"{kind} seed {seed}: {outcome} ({detail}; trial {time.perf_counter() - began:.0f} s)")
            if outcome != "held":
                rows.append(f"| {kind} | {seed} | {detail} |")
    total = {k: sum(v for (kind, _), v in counts.items() if kind == k) for k, _ in plan}
    table = ["| run | trials | held | failed |", "|---|---|---|---|"]
    for kind in total:
        table.append(f"| {'dtx train, 1 process x 8 devices' if kind == 'train' else 'dtx launch, 2 processes x 4'} "
                     f"| {total[kind]} | {counts.get((kind, 'held'), 0)} | {counts.get((kind, 'failed'), 0)} |")
    body = "\n".join(table)
    if rows:
        body += "\n\nFailed trials:\n\n| run | seed | what happened |\n|---|---|---|\n" + "\n".join(rows)
    say(body)
    if args.trials >= 50:
        preamble = (f"`python benchmarks/chaos.py` on {report.machine('8 emulated CPU devices per run')}; "
                    f"{time.perf_counter() - start:.0f} s, load average {load:.1f} at the start (other jobs on the "
                    "machine slow the runs and move where each kill lands). Each trial kills a run (SIGKILL or SIGTERM "
                    "to the whole process group, at a seeded moment within the reference run's wall time), runs the "
                    "same command again, and compares per-step losses, the final record and the last checkpoint bit "
                    "for bit with an uninterrupted run. Every trial's signal, moment and outcome: "
                    "`benchmarks/logs/chaos.log`.")
        if args.update_docs:
            os.makedirs(os.path.dirname(LOG), exist_ok=True)
            with open(LOG, "w", encoding="utf-8") as f:
                f.write("\n".join(log) + "\n")
        report.write("chaos", preamble, body, update_docs=args.update_docs)
    return 0 if not rows else 1


if __name__ == "__main__":
    sys.exit(main())
