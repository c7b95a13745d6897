"""Plans for a cluster you don't own: 64-node plans compiled on 64 emulated CPU devices (nothing runs).

    python benchmarks/plans_at_scale.py [--update-docs]    # ~8 min on 2 cores; log in benchmarks/logs/

Each row is one child process, so its wall time and peak RSS (``os.wait4``) are its own:

* VGG-A and the speech DNN: ``dtx simulate --model M --cluster haswell_fdr --nodes 64 --verify
  --devices 64 --json`` (global batch 512, Das et al.'s setting), the planner's 64-node plan: the
  whole step's per-device FLOPs and bytes, predicted (``dtx.perf.model``) against compiled, the worst
  layer, and the step's memory with Adam, ``dtx.perf.memory`` against ``compiled.memory_analysis()``,
  with the answer for a 128 GiB node.
* A transformer LM (``models/transformer.py``, GPT-2 architecture at the sizes below): the planner and
  the memory model read ``nn.Dense``/``nn.Conv`` layers, and attention's projections are neither, so
  this row compiles the train step (``dtx.run.verify.compile_layout_step``: next-token loss, Adam, float32)
  of the ``data`` and ``fsdp`` layouts and holds it against modelled figures: FLOPs ``6·N + 12·L·d·T`` per
  token (Chowdhery et al. 2022, App. B), bytes a ring all-reduce of the gradients (``2(n-1)/n`` of the
  parameters) or FSDP's ``3(n-1)/n`` (Rajbhandari et al. 2020: two all-gathers and one reduce-scatter; the
  program XLA:CPU compiles sends the same bytes another way, each parameter all-gathered once and kept for the
  backward, the gradient all-reduced whole and sliced),
  memory the state alone (parameters, gradients, Adam: 16 bytes per parameter, ``/n`` under FSDP), a
  lower bound; the answer is for a 141 GB H200.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402

COMMAND = "python benchmarks/plans_at_scale.py"
LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "logs", "plans_at_scale.log")
DEVICES = 64
PLANNED = ("vgg_a", "speech_dnn")
# name: (layers L, width d, heads, sequence T); vocabulary 50257, one sequence per device.
TRANSFORMERS = {"gpt2-large": (36, 1280, 20, 1024), "7b-shape": (32, 4096, 32, 2048)}
# FSDP's compile is the slow one (5-8 min each here): the largest model only.
TRANSFORMER_ROWS = [("gpt2-large", "data"), ("7b-shape", "data"), ("7b-shape", "fsdp")]
H200 = 141e9  # bytes of one H200's HBM


def _child(argv: list[str]) -> tuple[dict, float, int]:
    """Run ``argv``, return its JSON output, wall seconds and peak RSS in bytes (its own, from wait4)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, text=True,
                                env={**os.environ, "DTX_COMPILATION_CACHE": ""})  # compile, never read a cache
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (Popen.wait would discard it)
        wall = time.perf_counter() - start
        code = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        if code not in (0, 1):  # 1: a ratio outside 2 %, which the table shows
            raise SystemExit(f"{' '.join(argv)} failed ({code}):\n{err.read()[-3000:]}")
        return json.loads(out.read()), wall, usage.ru_maxrss * 1024  # Linux: KiB


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.2f} GiB"


def planned_row(name: str) -> str:
    argv = [sys.executable, "-m", "dtx.tools.cli", "simulate", "--model", name, "--cluster", "haswell_fdr",
            "--nodes", str(DEVICES), "--verify", "--devices", str(DEVICES), "--json"]
    result, wall, rss = _child(argv)
    plan = result["verify"][0]
    step = plan["checks"][-1]
    worst = max(abs(r - 1) for row in plan["checks"][:-1] for r in (row["flops_ratio"], row["bytes_ratio"])
                if r is not None)
    m = plan["memory"]
    answer = "fits" if m["fits"] else "OOM"
    return (f"| {name} | {plan['plan']} | {step['predicted_flops'] / 1e9:,.1f} | {step['compiled_flops'] / 1e9:,.1f} "
            f"| {step['flops_ratio']:.3f} | {step['predicted_bytes'] / 1e6:,.1f} | {step['compiled_bytes'] / 1e6:,.1f} "
            f"| {step['bytes_ratio']:.3f} | {worst:.1%} | {_size(m['predicted_bytes'])} | {_size(m['compiled_bytes'])} "
            f"| {m['ratio']:.3f} | {answer} in {_size(m['device_memory'])} | {wall:.0f} s | {rss / 2**30:.2f} GiB |")


def transformer_child(name: str, layout: str) -> int:
    """Compile one transformer step on ``DEVICES`` emulated devices; print its figures as JSON."""
    import jax

    jax.config.update("jax_num_cpu_devices", DEVICES)
    import jax.numpy as jnp

    from dtx.comm import hlo
    from dtx.data.tasks import make_task
    from dtx.models import build_model
    from dtx.perf import flops as flops_lib, memory
    from dtx.run import verify

    layers, width, heads, seq = TRANSFORMERS[name]
    model = build_model("transformer", num_layers=layers, d_model=width, num_heads=heads, max_len=seq,
                        num_classes=50257)
    start = time.perf_counter()
    compiled = verify.compile_layout_step(model, (seq,), layout, [("data", DEVICES)], DEVICES, optimizer="adam",
                                          dtype=jnp.int32, task=make_task("next_token"), labels_shape=(seq,))
    params = sum(x.size for x in jax.tree.leaves(jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((1, seq), jnp.int32)))))
    print(json.dumps(dict(compile_s=time.perf_counter() - start, params=params, compiled_flops=flops_lib.compiled_flops(compiled),
                          compiled_bytes=hlo.total(compiled).bytes_sent, compiled_memory=memory.compiled_peak(compiled))))
    return 0


def transformer_row(name: str, layout: str) -> str:
    layers, width, heads, seq = TRANSFORMERS[name]
    result, wall, rss = _child([sys.executable, os.path.abspath(__file__), "--transformer", name, "--layout", layout])
    n, params = DEVICES, result["params"]
    tokens = DEVICES * seq / n  # one sequence per device
    flops = tokens * (6 * (12 * layers * width**2 + width * 50257) + 12 * layers * width * seq)
    sent = (2 if layout == "data" else 3) * (n - 1) / n * 4 * params
    state = 16 * params / (1 if layout == "data" else n)
    answer = "fits" if result["compiled_memory"] <= H200 else "OOM"
    return (f"| transformer {name} ({params / 1e9:.2f} B parameters, T={seq}) | {layout} | {flops / 1e9:,.1f} "
            f"| {result['compiled_flops'] / 1e9:,.1f} | {result['compiled_flops'] / flops:.3f} | {sent / 1e6:,.1f} "
            f"| {result['compiled_bytes'] / 1e6:,.1f} | {result['compiled_bytes'] / sent:.3f} | - | {_size(state)} (state) "
            f"| {_size(result['compiled_memory'])} | {result['compiled_memory'] / state:.3f} "
            f"| {answer} in {_size(H200)} (H200) | {wall:.0f} s | {rss / 2**30:.2f} GiB |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    report.add_output_arguments(parser)
    parser.add_argument("--transformer", choices=sorted(TRANSFORMERS), help=argparse.SUPPRESS)  # a child's row
    parser.add_argument("--layout", default="data", choices=("data", "fsdp"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.transformer:
        return transformer_child(args.transformer, args.layout)
    start, rows = time.perf_counter(), []
    os.makedirs(os.path.dirname(LOG), exist_ok=True)
    with open(LOG, "w", encoding="utf-8") as log:
        for make, arg in [(planned_row, (name,)) for name in PLANNED] + [
                (transformer_row, row) for row in TRANSFORMER_ROWS]:
            rows.append(make(*arg))
            print(rows[-1], flush=True)
            log.write(rows[-1] + "\n")
            log.flush()
    preamble = (f"`{COMMAND}` on {report.machine(f'{DEVICES} emulated CPU devices')}; {time.perf_counter() - start:.0f} s. "
                f"Each row compiles one {DEVICES}-node training step on {DEVICES} emulated CPU devices in a child "
                "process (nothing runs): per device per iteration, predicted against compiled (XLA's cost analysis, "
                "the HLO's collectives, `compiled.memory_analysis()`), the child's wall time (start-up and compiles) "
                "and its peak resident memory. VGG-A and the speech DNN: `dtx simulate --verify --devices 64`, the "
                "planner's plan at global batch 512, `haswell_fdr`, memory with Adam against `dtx.perf.memory`. "
                "Transformer rows: the planner does not model attention, so their predicted figures are modelled "
                "by this script (6N + 12LdT FLOPs per token; ring all-reduce or FSDP bytes; the state alone, a lower "
                "bound on memory), 64 sequences per step, Adam, float32.")
    header = ("| model | plan | GFLOP model | GFLOP XLA | ratio | MB sent model | MB sent XLA | ratio | worst layer "
              "| memory model | memory XLA | ratio | answer | wall | host peak RSS |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    report.write("plans_at_scale", preamble, header + "\n" + "\n".join(rows), update_docs=args.update_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
