"""Chaos: kill, stop and hang training runs at random moments, and compare what they end with to an
uninterrupted run.

    python benchmarks/chaos.py [--update-docs]   # 60 seeded trials, 2 at a time: ~40 min on 2 idle cores
    python benchmarks/chaos.py --trials 9        # one trial of each kind (the section is only written for >= 60)

With ``--update-docs`` (and >= 60 trials) it writes its section of BENCHMARKS.md and its log, one line per
reference run and trial, to ``benchmarks/logs/chaos.log``.

Faults (seeded: the seed fixes the fault, the moment, the signal and the rank):

- ``kill``: SIGKILL or SIGTERM to ``dtx train`` (one process, 8 emulated devices) 0-0.5 s after it completed a
  drawn step (steps, saves every 7 steps, the final evaluation; the machine's load cannot move the moment
  past the run's end), then the same command again until it exits 0.
- ``start-up``: SIGTERM to ``dtx train`` or ``dtx launch`` (the whole process group) 0.05-3 s after it starts.
- ``elastic``: SIGKILL or SIGTERM to one rank (rank 0 included) of ``dtx launch --elastic 1`` with 2 x 4, 3 x 2
  or 4 x 2 processes x devices, drawn as above; the launcher is to restart on the others by itself.
- ``hang``: one rank of such a job SIGSTOPped (drawn as above), or sleeping in its input pipeline before a
  drawn step (alive, heartbeating, outside the collective); the launcher must name it and go on without it.

A trial *held* when the run, rerun at most 3 times, ends with the uninterrupted run's batches (the chained
data digest, exactly), per-step losses, final evaluation and final checkpoint (every array of the state):
bit for bit when no restart changed the mesh, else within rtol 1e-5 (losses, test loss, arrays; atol 1e-6 for
arrays) and one test example of accuracy -- a mesh change adds the same per-example gradient terms in
another order. Each trial reports the reruns it needed and the steps lost (computed again after a restart).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
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
STEPS = 60
SETTINGS = [f"--config.num_steps={STEPS}", "--config.checkpoint.every_steps=7", "--config.log_every=1",
            "--config.progress=False", "--config.model.features=(64,)"]
# Every launch (references included: bounds do not change the math): bounds short enough for a trial.
BOUNDS = ["--config.heartbeat_seconds=10", "--config.watchdog_seconds=15", "--config.startup_seconds=40"]
# processes, devices each, global batch (and evaluation batch: both split over every mesh a restart may choose)
JOBS = {"2x4": (2, 4, 128), "3x2": (3, 2, 96), "4x2": (4, 2, 128)}
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
# The launch experiment: the default one, whose rank $CHAOS_HANG=rank:step sleeps before that step of the
# first start (the other ranks wait in that step's collective).
HANGING = """
import json, os, time
from dtx.data import loader

_batch = loader.TrainLoader.batch


def _batch_or_hang(self, step):
    hang = os.environ.get("CHAOS_HANG")
    if hang and json.loads(os.environ.get("DTX_MEMBERSHIP", '{"restart": 0}'))["restart"] == 0:
        rank, at = map(int, hang.split(":"))
        if int(os.environ.get("DTX_PROCESS_ID", "0")) == rank and step == at:
            time.sleep(3600)
    return _batch(self, step)


loader.TrainLoader.batch = _batch_or_hang


def get_config():
    default = {}
    exec(open(%r).read(), default)
    return default["get_config"]()
""" % EXPERIMENT


def _command(job: str, workdir: str, experiment: str) -> list[str]:
    if job == "train":
        return [sys.executable, "-m", "dtx.tools.cli", "train", EXPERIMENT, "--workdir", workdir, *SETTINGS]
    processes, devices, batch = JOBS[job]
    return [sys.executable, "-m", "dtx.tools.cli", "launch", "--processes", str(processes), "--devices-per-process",
            str(devices), "--elastic", "1", experiment, "--workdir", workdir, *SETTINGS, *BOUNDS,
            f"--config.global_batch_size={batch}", f"--config.eval_batch_size={2 * batch}"]


class Outcome:
    """What an ended run must share with the uninterrupted one."""

    def __init__(self, workdir: str):
        from dtx.run import metrics

        records = metrics.read_metrics(workdir)
        by_step = {r["step"]: r["loss"] for r in records if "loss" in r}
        self.losses = [by_step[s] for s in sorted(by_step)]
        final = [r for r in records if "test_accuracy" in r][-1]
        self.accuracy, self.test_loss = final["test_accuracy"], final["test_loss"]
        self.digest = [r["data_digest"] for r in records if "data_digest" in r][-1]
        self.starts = [r["membership"] for r in records if "membership" in r]
        self.resumed = [r["resumed_from"] for r in records if "resumed_from" in r]
        self.arrays = _final_arrays(os.path.join(workdir, "checkpoints"))

    def mesh_changed(self, reference: Outcome) -> bool:
        """Whether a start ran on another mesh than the uninterrupted run (a start that began again from step 0
        moved its predecessor's records aside: compare with the reference, not only among the starts)."""
        return any(m["mesh"] != r["mesh"] for m in self.starts for r in reference.starts[:1])

    def compare(self, reference: Outcome) -> str:
        """'' when it holds (bitwise without a mesh change, within tolerance across one), else what differs."""
        import numpy as np

        if self.digest != reference.digest:
            return "other batches (data digest)"
        if len(self.losses) != len(reference.losses) or len(self.arrays) != len(reference.arrays):
            return f"{len(self.losses)} recorded steps, not {len(reference.losses)}"
        if not self.mesh_changed(reference):
            same = (self.losses == reference.losses and (self.accuracy, self.test_loss) == (
                reference.accuracy, reference.test_loss)
                and all(a.tobytes() == b.tobytes() for a, b in zip(self.arrays, reference.arrays)))
            return "" if same else "not bit-identical (no mesh change)"
        close = (np.allclose(self.losses, reference.losses, rtol=1e-5, atol=0)
                 and abs(self.accuracy - reference.accuracy) <= 1 / 360 + 1e-12
                 and np.isclose(self.test_loss, reference.test_loss, rtol=1e-5, atol=0)
                 and all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(self.arrays, reference.arrays)))
        return "" if close else "beyond rtol 1e-5 across the mesh change"


def _final_arrays(directory: str) -> list:
    """Every array of the newest checkpoint's state (parameters, Adam's moments, step), restored on one device."""
    import jax
    import numpy as np

    from dtx import mesh as mesh_lib
    from dtx import models, optim
    from dtx.ckpt.checkpoint import Checkpointer, abstract_target
    from dtx.step.state import abstract_train_state, replicated_shardings

    checkpointer = Checkpointer(directory, read_only=True)
    mesh = mesh_lib.make_mesh([("data", 1)], devices=jax.devices()[:1])
    tx = optim.make_optimizer("adam", optim.make_schedule("constant", 2e-3, STEPS))
    abstract = abstract_train_state(models.build_model("mlp", features=(64,)), tx,
                                    jax.ShapeDtypeStruct((1, 8, 8, 1), np.float32))
    state, _ = checkpointer.restore(checkpointer.latest_step(),
                                    abstract_target(abstract, replicated_shardings(abstract, mesh)))
    return [np.asarray(x) for x in jax.tree.leaves(state)]


def _rank_pids(workdir: str) -> dict[int, int]:
    found = subprocess.run(["pgrep", "-f", f"workdir {workdir} "], capture_output=True, text=True)
    ranks = {}
    for pid in (int(p) for p in found.stdout.split()):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().decode(errors="ignore").split("\0")
        except OSError:
            continue
        for entry in environ:
            if entry.startswith("DTX_PROCESS_ID="):
                ranks[int(entry.split("=", 1)[1])] = pid
    return ranks


def _last_error(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    while lines and (lines[-1].startswith("---") or "JAX_TRACEBACK_FILTERING" in lines[-1]):
        lines.pop()
    return lines[-1] if lines else ""


def _verbatim(text: str) -> str:
    return "`" + text.replace("`", "'").replace("|", "\\|")[:200] + "`"


def trial(fault: str, seed: int, job: str, references: dict, root: str, experiment: str) -> dict:
    """One seeded trial of ``job``: the fault, the run until it exits 0 (at most 3 reruns), the comparison."""
    rng = random.Random(seed)
    reference = references[job][0]
    workdir = os.path.join(root, f"{fault}-{seed}")
    progress = os.path.join(root, f"{fault}-{seed}-progress")
    os.makedirs(progress)
    command = _command(job, workdir, experiment)
    env = {**ENV, **({"DTX_PROGRESS_DIR": progress} if job == "train" else {})}
    out = {"fault": fault, "seed": seed, "job": job, "reruns": 0, "named": None}
    if fault == "hang" and rng.random() < 0.5:  # asleep in Python before a step (alive, heartbeating)
        rank, at = rng.randrange(JOBS[job][0]), rng.randrange(3, STEPS - 5)
        env["CHAOS_HANG"] = f"{rank}:{at}"
        what, moment, signum = f"rank {rank} sleeps before step {at}", None, None
    else:
        # Start-up: a moment in its first seconds. Otherwise a moment inside the loop, where the machine's load
        # cannot move it past the end: when rank 0 has completed a drawn step (0 to 58; a save every 7),
        # plus up to 0.5 s (later steps, a save under way, the final evaluation).
        moment = rng.uniform(0.05, 3.0) if fault == "start-up" else None
        target, delay = rng.randrange(0, STEPS - 1), rng.uniform(0.0, 0.5)
        signum = (signal.SIGTERM if fault == "start-up" else signal.SIGSTOP if fault == "hang"
                  else rng.choice([signal.SIGKILL, signal.SIGTERM]))
        rank = rng.randrange(JOBS[job][0]) if fault in ("elastic", "hang") else None
        when = f"at {moment:.1f} s" if moment is not None else f"{delay:.2f} s after step {target}"
        what = f"{signal.Signals(signum).name} to {'rank ' + str(rank) if rank is not None else 'the run'} {when}"
    out["what"] = what
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True)
    hit = signum is None
    if signum is not None:
        if moment is not None:
            time.sleep(moment)
        else:
            marks = os.path.join(progress if job == "train" else os.path.join(workdir, "logs"), "progress_0.json")
            _wait_for_step(marks, target, process)
            time.sleep(delay)
        if process.poll() is None:
            pids = _rank_pids(workdir) if rank is not None else {}
            try:
                if rank is None:  # the whole session, as a scheduler's kill would
                    os.killpg(process.pid, signum)
                    hit = True
                elif rank in pids:
                    os.kill(pids[rank], signum)
                    hit = True
            except ProcessLookupError:
                pass
    try:
        _, stderr = process.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, stderr = process.communicate()
        stderr += "\nchaos: the run did not end within 900 s"
    code = process.returncode
    last = _progress_step(progress)
    out["hit"] = hit
    if fault == "hang" and hit and code is not None:
        out["named"] = f"rank {rank} is stuck" in stderr or f"first failed rank: {rank}" in stderr
    # A run the signal reached as a whole (kill, start-up) ends there: run it again, as its user would. A launch
    # that lost a rank is to go on by itself: it is rerun only if it failed.
    while (code != 0 or (hit and fault in ("kill", "start-up") and not out["reruns"])) and out["reruns"] < 3:
        out["reruns"] += 1
        done = subprocess.run(command, capture_output=True, text=True, env={**env, "CHAOS_HANG": ""}, timeout=900)
        code, stderr = done.returncode, done.stderr
    if code != 0:
        out["failed"] = f"exit {code} after {out['reruns']} reruns: {_verbatim(_last_error(stderr))}"
        return out
    try:
        outcome = Outcome(workdir)
    except (OSError, IndexError, KeyError, ValueError) as e:
        out["failed"] = f"unreadable outcome {_verbatim(f'{type(e).__name__}: {e}')}"
        return out
    out["failed"] = outcome.compare(reference)
    out["mesh_changed"] = outcome.mesh_changed(reference)
    recomputed = sum(m.get("steps_recomputed", 0) for m in outcome.starts)
    if job == "train" and out["reruns"] and last is not None:  # the rerun resumed from a checkpoint, or from 0
        recomputed += max(0, last - (outcome.resumed[-1] if outcome.resumed else 0))
    out["lost"] = recomputed
    out["restarts"] = max((m["restart"] for m in outcome.starts), default=0)
    return out


def _wait_for_step(path: str, target: int, process: subprocess.Popen) -> None:
    """Until the progress file at ``path`` says ``target`` steps are done (or the run has ended)."""
    while process.poll() is None:
        try:
            with open(path) as f:
                record = json.load(f)
            if record.get("phase") == "training" and record.get("step", 0) >= target:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.02)


def _progress_step(directory: str) -> int | None:
    try:
        with open(os.path.join(directory, "progress_0.json")) as f:
            record = json.load(f)
        return record["step"] if record.get("phase") == "training" else None
    except (OSError, ValueError):
        return None


# Per 60 trials: (fault, job, count). Processes cost start-up time each, so the 2-process job comes most often.
MIX = (("kill", "train", 30), ("start-up", "train", 8), ("start-up", "2x4", 2),
       ("elastic", "2x4", 6), ("elastic", "3x2", 3), ("elastic", "4x2", 3),
       ("hang", "2x4", 4), ("hang", "3x2", 2), ("hang", "4x2", 2))


def plan_trials(trials: int, seed: int) -> list[tuple[str, str, int]]:
    """``trials`` trials in :data:`MIX`'s proportions (at least one of each row), each with its own seed."""
    counts = [max(1, round(trials * n / 60)) for _, _, n in MIX]
    counts[0] += trials - sum(counts)
    return [(fault, job, seed + 1000 * i + j) for i, ((fault, job, _), n) in enumerate(zip(MIX, counts))
            for j in range(n)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parallel", type=int, default=2, help="trials at a time (default 2)")
    report.add_output_arguments(parser)
    args = parser.parse_args(argv)
    plan = plan_trials(args.trials, args.seed)
    start, log, load = time.perf_counter(), [], os.getloadavg()[0]

    def say(line: str) -> None:
        log.append(line)
        print(line, flush=True)

    say(f"chaos: {len(plan)} trials, seed {args.seed}, {' '.join(SETTINGS)}; launches {' '.join(BOUNDS)}; "
        f"load average {load:.1f}")
    results = []
    with tempfile.TemporaryDirectory(prefix="dtx-chaos-") as root:
        experiment = os.path.join(root, "hanging_digits_mlp.py")
        with open(experiment, "w") as f:
            f.write(HANGING)
        references = {}

        def reference(job: str) -> str:
            workdir = os.path.join(root, f"reference-{job}")
            began = time.perf_counter()
            done = subprocess.run(_command(job, workdir, experiment), capture_output=True, text=True, env=ENV,
                                  timeout=900)
            if done.returncode:
                logs = os.path.join(workdir, "logs", "process_0.log")
                tail = open(logs).read()[-2000:] if os.path.exists(logs) else ""
                return f"reference {job} run failed: {done.stderr[-2000:]}\n{tail}"
            outcome = Outcome(workdir)
            if len(outcome.starts) > 1:  # a restart (a rank lost in the reference itself) would not be a reference
                return f"reference {job} run restarted: {outcome.starts}"
            references[job] = (outcome, time.perf_counter() - began)
            say(f"reference {job}: {references[job][1]:.1f} s")
            return ""

        with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:  # each trial is its own processes
            failed = [e for e in pool.map(reference, sorted({job for _, job, _ in plan})) if e]
            if failed:
                print("\n".join(failed), file=sys.stderr)
                return 1

            def one(item):
                fault, job, seed = item
                began = time.perf_counter()
                return trial(fault, seed, job, references, root, experiment), time.perf_counter() - began

            for r, took in pool.map(one, plan):  # in plan order, each said as soon as it and those before it end
                results.append(r)
                state = "failed: " + r["failed"] if r["failed"] else "held"
                extra = "" if r["failed"] else (f"; {r['reruns']} reruns, {r['restarts']} restarts, "
                                                 f"{r['lost']} steps lost{', mesh changed' if r.get('mesh_changed') else ''}")
                named = "" if r["named"] is None else ("; hang named" if r["named"] else "; HANG NOT NAMED")
                say(f"{r['fault']} seed {r['seed']} ({r['job']}): {state} ({r['what']}"
                    f"{'' if r['hit'] else ', landed after the end'}{extra}{named}; trial {took:.0f} s)")
    body = _table(results)
    say(body)
    if args.trials >= 60:
        preamble = (f"`python benchmarks/chaos.py` on {report.machine('8 emulated CPU devices per run')}; "
                    f"{time.perf_counter() - start:.0f} s, load average {load:.1f} at the start (other jobs on the "
                    f"machine slow the runs and move where each fault lands); {args.parallel} trials at a time. "
                    f"{STEPS}-step runs of the default "
                    "experiment (MLP width 64, checkpoints every 7 steps); launches are `--elastic 1` with "
                    "heartbeat_seconds=10, watchdog_seconds=15, startup_seconds=40. A trial held when the run (rerun "
                    "at most 3 times) ends with the uninterrupted run's batches exactly and its losses, final "
                    "evaluation and every array of its final checkpoint bit for bit, or, where a restart changed "
                    "the mesh, within rtol 1e-5 (one test example of accuracy). Steps lost: steps computed again "
                    "after a restart (the membership records) or a rerun. Every trial: `benchmarks/logs/chaos.log`.")
        if args.update_docs:
            os.makedirs(os.path.dirname(LOG), exist_ok=True)
            with open(LOG, "w", encoding="utf-8") as f:
                f.write("\n".join(log) + "\n")
        report.write("chaos", preamble, body, update_docs=args.update_docs)
    return 0 if not any(r["failed"] for r in results) else 1


FAULTS = {"kill": "SIGKILL/SIGTERM to `dtx train` (1 process x 8)",
          "start-up": "SIGTERM at 0.05-3 s to `dtx train` or `dtx launch` 2 x 4",
          "elastic": "SIGKILL/SIGTERM to one rank of `dtx launch --elastic 1` (2 x 4, 3 x 2, 4 x 2)",
          "hang": "one rank SIGSTOPped or asleep before a step (same launches)"}


def _table(results: list[dict]) -> str:
    rows = ["| fault | trials | held | failed | bitwise / within tolerance (mesh changed) | reruns needed: 0 / 1 / 2+ "
            "| restarts by the launcher | steps lost: total (max) | hangs named |", "|---|---|---|---|---|---|---|---|---|"]
    for fault, label in FAULTS.items():
        mine = [r for r in results if r["fault"] == fault]
        if not mine:
            continue
        held = [r for r in mine if not r["failed"]]
        reruns = [sum(1 for r in held if min(r["reruns"], 2) == n) for n in (0, 1, 2)]
        lost = [r["lost"] for r in held]
        hangs = [r for r in mine if r["named"] is not None]
        named = f"{sum(1 for r in hangs if r['named'])} of {len(hangs)}" if fault == "hang" else "-"
        changed = sum(1 for r in held if r.get("mesh_changed"))
        rows.append(f"| {label} | {len(mine)} | {len(held)} | {len(mine) - len(held)} | {len(held) - changed} / "
                    f"{changed} | {' / '.join(map(str, reruns))} | {sum(r['restarts'] for r in held)} | "
                    f"{sum(lost)} ({max(lost, default=0)}) | {named} |")
    failed = [r for r in results if r["failed"] or r["named"] is False]
    body = "\n".join(rows)
    if failed:
        body += "\n\nFailed trials:\n\n| fault | seed | what happened |\n|---|---|---|\n" + "\n".join(
            f"| {r['fault']} | {r['seed']} | {r['what']}: {r['failed'] or 'the hung rank was not named'} |"
            for r in failed)
    return body


if __name__ == "__main__":
    sys.exit(main())
