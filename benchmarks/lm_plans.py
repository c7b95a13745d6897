"""Transformer plans: data x tensor x pipeline x ZeRO x remat for GPT-2 small and a 7B GPT shape on H100 and H200
nodes at 8 to 1024 GPUs (dtx.perf.lm_plan), and the runnable kinds compiled at 8 devices (``--verify``).

    python benchmarks/lm_plans.py [--verify] [--update-docs]    # seconds; --verify: minutes (compiles)

For each shape, cluster and GPU count: the fastest plan that fits a GPU's memory, its step time and per-device
memory, the fastest plan dtx runs where the chosen one is modelled only, and why
(:func:`dtx.perf.lm_plan.why`). Strong scaling at GPT-2's and GPT-3's batches: 512 sequences of 1024 tokens for
GPT-2 small (experiments/gpt2_small.py), 1024 sequences of 2048 tokens for the 7B shape (32 blocks of 4096, 32
heads). ``--verify`` compiles, as ``dtx simulate --verify`` does, the kinds of plan dtx runs (data, ZeRO, tensor,
SP, tensor.zero_stage, each remat policy, a pipeline split over model, without and with SP, and with ZeRO-1) at
the width-scaled twin on 8 emulated CPU devices and records per-device FLOPs and bytes, modelled and compiled
(dtx.tools.lm_sim).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402

COMMAND = "python benchmarks/lm_plans.py"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG = os.path.join(REPO, "benchmarks", "logs", "lm_plans.log")
GPT2 = os.path.join(REPO, "experiments", "gpt2_small.py")
CLUSTERS = ("h100_nvlink_ndr", "h200_nvlink_ndr")
NODES = (8, 64, 256, 1024)


def shapes():
    from dtx.perf import lm_plan
    from dtx.tools import lm_sim

    return ((lm_sim.load_shape(GPT2)[0], 512), (lm_plan.LMShape(32, 4096, 32, 2048, name="gpt_7b"), 1024))


def rows() -> list[str]:
    from dtx.perf import lm_plan
    from dtx.perf.clusters import get_cluster

    out = []
    for shape, batch in shapes():
        for name in CLUSTERS:
            cluster = get_cluster(name)
            for n in NODES:
                found = lm_plan.best(shape, cluster, n, batch)
                p, runs = found["chosen"], found["runnable"]
                chosen = "nothing fits" if p is None else (f"**{p.text()}**: {p.time * 1e3:.4g} ms, "
                                                           f"{p.memory_bytes / 2**30:.1f} GiB")
                if p is not None and not p.runnable:
                    chosen += " (modelled only)"
                ran = "-" if runs is None or runs is p else f"{runs.text()}: {runs.time * 1e3:.4g} ms"
                out.append(f"| {shape.name} | {name} | {n} | {chosen} | {ran} | {lm_plan.why(found, cluster)} |")
    return out


def verified() -> list[dict]:
    from dtx.perf.clusters import get_cluster
    from dtx.tools import lm_sim

    cluster = get_cluster("h100_nvlink_ndr")
    table = lm_sim.rows(shapes()[0][0], cluster, [8], 512)
    return lm_sim.verify_plans(GPT2, cluster, table)


def verified_rows(checks: list[dict]) -> list[str]:
    """The --verify table's rows; a ratio outside its tolerance (2 % for FLOPs and bytes, 15 % for memory) says so."""
    from dtx.tools.plancheck import MEMORY_TOLERANCE, VERIFY_TOLERANCE

    def ratio(value: float, tolerance: float, digits: int) -> str:
        return f"{value:.{digits}f}" + ("" if abs(value - 1) <= tolerance else f" (outside {tolerance:.0%})")

    return [f"| {r['role']} | {r['shape']} | {r['plan']} | {r['predicted_flops'] / 1e9:.4f} | "
            f"{r['compiled_flops'] / 1e9:.4f} | {ratio(r['flops_ratio'], VERIFY_TOLERANCE, 4)} | "
            f"{r['predicted_bytes'] / 1e6:.3f} | {r['compiled_bytes'] / 1e6:.3f} | "
            f"{ratio(r['bytes_ratio'], VERIFY_TOLERANCE, 4)} | {ratio(r['memory_ratio'], MEMORY_TOLERANCE, 3)} |"
            for r in checks]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verify", action="store_true", help="also compile the runnable kinds at 8 devices")
    report.add_output_arguments(parser)
    args = parser.parse_args()
    if args.verify:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
    start = time.perf_counter()
    table = rows()
    results = verified() if args.verify else []
    checks = verified_rows(results)
    os.makedirs(os.path.dirname(LOG), exist_ok=True)
    with open(LOG, "w", encoding="utf-8") as log:
        log.write("\n".join(table + checks) + "\n")
    preamble = (f"`{COMMAND}{' --verify' if args.verify else ''}` on {report.machine()}; "
                f"{time.perf_counter() - start:.0f} s. Per shape, cluster and GPU count, the fastest plan of "
                "dtx.perf.lm_plan that fits a GPU's memory (D data x T tensor x P pipeline, ZeRO stage, remat "
                "policy, M micro-batches; pipelines as dtx runs them, each stage's forward re-run in its backward "
                "slot and the output layer untied: dtx.parallel.pipeline.lm_costs), its step time and per-device memory; "
                "and why. GPT-2 small: 512 "
                "sequences of 1024 tokens per step; the 7B shape (32 blocks of 4096, 32 heads): 1024 of 2048. "
                "`dtx simulate --model experiments/gpt2_small.py --cluster h100_nvlink_ndr` prints the GPT-2 rows "
                "with their `dtx train` overrides.")
    header = ("| shape | cluster | GPUs | chosen: step, memory | fastest dtx runs | why |\n"
              "|---|---|---|---|---|---|")
    body = header + "\n" + "\n".join(table)
    if checks:
        body += ("\n\n`--verify`: each kind compiled at 8 emulated CPU devices at the width-scaled twin of "
                 "experiments/gpt2_small.py (2 blocks of width 256, 8 heads, 128 positions, 16 sequences; nothing "
                 "runs), then the held-out rows at their own shapes; per device per step, XLA's FLOPs and the HLO's "
                 "bytes sent (loop trips included) against the model, which charges the tensor layout's activation "
                 "collectives 4 bytes an element here (XLA:CPU upcasts their bf16; the plans above charge a GPU's "
                 "2). Rows marked fitted are the compiles the planner's constants were read from (in-sample: their "
                 "ratios show the fit, not a prediction); held-out rows were chosen and committed before they were "
                 "first compiled (dtx.tools.lm_sim.HELD_OUT). Held to 2 %, the held-out ones by "
                 "tests/test_lm_plan.py. Memory: the model's per-device bytes (its XLA:CPU terms: bf16 kept as float32, "
                 "dtx.perf.lm_plan) over XLA:CPU's compiled peak, held to 15 % on the held-out twins of "
                 "tests/test_lm_memory.py; here reported, each ratio outside its tolerance marked."
                 "\n\n| rows | shape | plan | GFLOP model | GFLOP XLA | ratio | MB model | MB XLA | ratio | "
                 "memory model/XLA |\n"
                 "|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(checks))
    report.write("lm_plans", preamble, body, update_docs=args.update_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
