"""Context parallelism in the transformer planner: GPT-2 small and a 7B GPT shape at 8K to 128K tokens a sequence on
H100 nodes at 8, 64 and 256 GPUs — which context size ``C`` and which attention kernel dtx.perf.lm_plan chooses,
and why; ``--verify`` compiles the context kinds and the held-out context rows at 8 emulated CPU devices.

    python benchmarks/context_plans.py [--verify] [--update-docs]    # seconds; --verify: minutes (compiles)

For each shape, sequence length and GPU count: the fastest plan that fits a GPU's memory (data × tensor × pipeline ×
ZeRO × remat, and ``C`` with ring, all-gather or Ulysses attention beside data, ZeRO and ``T``), its step time and
per-device memory, the fastest plan keeping every sequence on one device (``C = 1``), and why
(:func:`dtx.perf.lm_plan.why`). The global batch keeps the tokens per step of benchmarks/lm_plans.py (512 × 1024 for
GPT-2 small, 1024 × 2048 for the 7B shape), at least one sequence per GPU. ``--verify`` compiles, as ``dtx simulate
--verify`` does, :data:`dtx.tools.lm_sim.CONTEXT_KINDS` at the width-scaled twin and
:data:`dtx.tools.lm_sim.CONTEXT_HELD_OUT` at their shapes, and records per-device FLOPs, bytes and memory,
modelled and compiled.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402

COMMAND = "python benchmarks/context_plans.py"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG = os.path.join(REPO, "benchmarks", "logs", "context_plans.log")
GPT2 = os.path.join(REPO, "experiments", "gpt2_small.py")
CLUSTER = "h100_nvlink_ndr"
NODES = (8, 64, 256)
SEQ = (8192, 16384, 32768, 65536, 131072)


def shapes():
    """``(shape, tokens per step)``: benchmarks/lm_plans.py's shapes and batches."""
    from dtx.perf import lm_plan
    from dtx.tools import lm_sim

    return ((lm_sim.load_shape(GPT2)[0], 512 * 1024), (lm_plan.LMShape(32, 4096, 32, 2048, name="gpt_7b"),
                                                       1024 * 2048))


def batch(tokens: int, seq: int, nodes: int) -> int:
    """Sequences per step: the tokens of benchmarks/lm_plans.py's step, at least one sequence per GPU."""
    return max(nodes, tokens // seq)


def results() -> list[dict]:
    """One record per shape, sequence length and GPU count (the section's rows, raw)."""
    from dtx.perf import lm_plan
    from dtx.perf.clusters import get_cluster

    cluster = get_cluster(CLUSTER)
    out = []
    for base, tokens in shapes():
        for seq in SEQ:
            shape = dataclasses.replace(base, seq=seq)
            for n in NODES:
                b = batch(tokens, seq, n)
                found = lm_plan.best(shape, cluster, n, b)
                p, whole = found["chosen"], found["whole"]
                out.append(dict(shape=shape.name, seq=seq, nodes=n, batch=b, why=lm_plan.why(found, cluster),
                                chosen=None if p is None else p.text(), context=p.context if p else None,
                                attention=(p.attention or "-") if p else None,
                                data=p.data if p else None, tensor=p.tensor if p else None,
                                time=p.time if p else None, memory=p.memory_bytes if p else None,
                                whole=None if whole is None else whole.text(),
                                whole_time=whole.time if whole else None))
    return out


def rows(records: list[dict]) -> list[str]:
    out = []
    for r in records:
        if r["chosen"] is None:
            out.append(f"| {r['shape']} | {r['seq'] // 1024}K | {r['nodes']} | {r['batch']} | nothing fits | - | - | "
                       f"- | - | - | {r['why']} |")
            continue
        whole = "none fits" if r["whole"] is None else f"{r['whole']}: {r['whole_time'] * 1e3:.4g} ms"
        out.append(f"| {r['shape']} | {r['seq'] // 1024}K | {r['nodes']} | {r['batch']} | **{r['chosen']}** | "
                   f"{r['context']} | {r['attention']} | {r['time'] * 1e3:.4g} ms | {r['memory'] / 2**30:.1f} GiB | "
                   f"{whole} | {r['why']} |")
    return out


def verified() -> list[dict]:
    """The context development kinds at the twin and the held-out context rows, compiled at 8 devices."""
    from dtx.perf.clusters import get_cluster
    from dtx.tools import lm_sim

    cluster = get_cluster(CLUSTER)
    base = lm_sim.load_shape(GPT2)[0]
    twin = dataclasses.replace(base, **lm_sim.TWIN)
    cases = [(twin, lm_sim.TWIN_BATCH, kind, 1, "fitted") for kind in lm_sim.CONTEXT_KINDS]
    cases += [(dataclasses.replace(base, **shape), b, kind, micro, "held out")
              for shape, b, kind, micro in lm_sim.CONTEXT_HELD_OUT]
    return [lm_sim.verify_one(GPT2, cluster, shape, b, kind, micro, role=role) for shape, b, kind, micro, role in cases]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verify", action="store_true", help="also compile the context kinds at 8 devices")
    report.add_output_arguments(parser)
    args = parser.parse_args()
    if args.verify:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
    import lm_plans  # the --verify table's rows, as benchmarks/lm_plans.py renders them

    start = time.perf_counter()
    records = results()
    table = rows(records)
    checks = verified() if args.verify else []
    check_rows = lm_plans.verified_rows(checks)
    os.makedirs(os.path.dirname(LOG), exist_ok=True)
    with open(LOG, "w", encoding="utf-8") as log:
        log.write("\n".join(table + check_rows) + "\n")
    preamble = (f"`{COMMAND}{' --verify' if args.verify else ''}` on {report.machine()}; "
                f"{time.perf_counter() - start:.0f} s. Per shape, sequence length and GPU count on {CLUSTER}, the "
                "fastest plan of dtx.perf.lm_plan that fits a GPU's memory: D data x T tensor x P pipeline, ZeRO, "
                "remat, M micro-batches, and C, every sequence split over a context axis (beside data, ZeRO and "
                "Megatron's pairs over model with or without SP: P = 1, dtx refuses a stage axis beside context), with its kernel (ring: Liu et al. 2023; allgather: Llama 3; ulysses: Jacobs "
                "et al. 2023; Ulysses needs the heads divisible by T·C); its step time and per-device memory; the "
                "fastest plan keeping every sequence on one device (C = 1); and why. Sequences per step: the tokens "
                "of the lm_plans section (GPT-2 small 512 x 1024, the 7B shape 1024 x 2048), at least one a GPU. "
                "`dtx simulate --model experiments/gpt2_small.py --cluster h100_nvlink_ndr --seq-len N` prints the "
                "GPT-2 rows with their `dtx train` overrides.")
    header = ("| shape | tokens a sequence | GPUs | sequences | chosen | C | kernel | step | memory | fastest with "
              "C = 1 | why |\n|---|---|---|---|---|---|---|---|---|---|---|")
    body = header + "\n" + "\n".join(table)
    if check_rows:
        body += ("\n\n`--verify`: the context kinds (dtx.tools.lm_sim.CONTEXT_KINDS, T x C ones included) compiled "
                 "at 8 emulated CPU "
                 "devices at the width-scaled twin of experiments/gpt2_small.py (2 blocks of width 256, 8 heads, 128 "
                 "positions, 16 sequences; nothing runs), the rows the context rules were read from (fitted: their "
                 "ratios show the fit), then the held-out rows at their own shapes, chosen and committed before they "
                 "were first compiled (dtx.tools.lm_sim.CONTEXT_HELD_OUT); per device per step, XLA's FLOPs and the "
                 "HLO's bytes sent (loop trips included) against the model, which charges the kernels' keys and "
                 "values 4 bytes an element here (XLA:CPU upcasts their bf16; the plans above charge a GPU's 2). "
                 "FLOPs and bytes held to 2 % by tests/test_context_plan.py; memory: the model's XLA:CPU terms "
                 "over XLA:CPU's compiled peak, each ratio outside 15 % marked."
                 "\n\n| rows | shape | plan | GFLOP model | GFLOP XLA | ratio | MB model | MB XLA | ratio | "
                 "memory model/XLA |\n"
                 "|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(check_rows))
    # No raw results kept beside the section (as benchmarks/lm_plans.py): its why column's figures are in the units it
    # prints (ms, GiB), not the records'; the log and tests/test_benchmarks_docs.py hold the markdown as written.
    report.write("context_plans", preamble, body, update_docs=args.update_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
