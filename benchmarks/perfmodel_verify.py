"""The Das et al. performance model against the programs XLA compiles for its plans.

    python benchmarks/perfmodel_verify.py [--update-docs]    # ~2 min on 2 cores

For VGG-A, OverFeat-FAST and the speech DNN at full size, the planner's plans for 2, 4 and 8
nodes (``haswell_fdr``, global batch 512, plan ``auto``) and the hybrid plans with groups of 2
and 4 at 8 nodes, are compiled on 8 emulated CPU devices (nothing runs) by ``dtx.run.verify``, the
code behind ``dtx simulate --verify``. Per device: predicted FLOPs and bytes (``dtx.perf.model``)
against XLA's cost analysis and the compiled program's collectives (``dtx.comm.hlo``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402

from dtx.perf import model as perfmodel  # noqa: E402
from dtx.perf import layers as layers_lib
from dtx.run import verify
from dtx.tools.plancheck import VERIFY_TOLERANCE  # noqa: E402
from dtx.perf.clusters import get_cluster  # noqa: E402
from dtx.perf.model import plan_text  # noqa: E402
from dtx.models import build_model  # noqa: E402

CASES = [(name, nodes, "auto", None) for name in ("vgg_a", "overfeat_fast", "speech_dnn") for nodes in (2, 4, 8)]
CASES += [(name, 8, "hybrid", g) for name in ("vgg_a", "overfeat_fast") for g in (2, 4)]
COMMAND = "python benchmarks/perfmodel_verify.py"


def _cell(check) -> str:
    return f"{check.flops_ratio:.3f} / {check.bytes_ratio:.3f}" if check else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    report.add_output_arguments(parser)
    args = parser.parse_args()
    cluster = get_cluster("haswell_fdr")
    rows, worst, start = [], 0.0, time.perf_counter()
    for name, nodes, mode, group in CASES:
        model = build_model(name)
        shape = type(model).default_input_shape
        plan = perfmodel.make_plan(layers_lib.analyze(model, shape), cluster, nodes, 512, mode=mode, group_size=group)
        layers = verify.verify_layers(model, shape, plan, cluster)
        groups = {g.choice: g for g in verify.group_totals(layers)}
        step = verify.verify_step(model, shape, plan, cluster)
        worst = max([worst] + [abs(r - 1) for c in layers + list(groups.values()) + [step]
                               for r in (c.flops_ratio, c.bytes_ratio) if r is not None])
        split = groups.get("model") or groups.get("hybrid")
        rows.append(f"| {name} | {nodes} | {plan_text(plan)} | {_cell(groups.get('data'))} | {_cell(split)} "
                    f"| {step.predicted_flops / 1e9:,.1f} | {step.compiled_flops / 1e9:,.1f} "
                    f"| {step.predicted_bytes / 1e6:,.1f} | {step.compiled_bytes / 1e6:,.1f} | {_cell(step)} "
                    f"| {max(abs(r - 1) for c in layers for r in (c.flops_ratio, c.bytes_ratio) if r is not None):.1%} |")
        print(rows[-1], flush=True)
    preamble = (f"`{COMMAND}` on {report.machine()}; {time.perf_counter() - start:.0f} s. Per device per iteration, "
                "global batch 512, `haswell_fdr`, float32. Ratios are compiled / predicted (FLOPs / bytes) for the "
                "data-parallel layers, the model-parallel layers and the whole training step (SGD), and the largest "
                f"per-layer deviation. Goal: every ratio within {VERIFY_TOLERANCE:.0%} (what `dtx simulate --verify` "
                f"and the tests hold); largest deviation found: {worst:.1%}.")
    header = ("| model | nodes | plan | data layers | split layers | step GFLOP model | step GFLOP XLA "
              "| step MB model | step MB XLA | step ratios | worst layer |\n|---|---|---|---|---|---|---|---|---|---|---|")
    report.write("perfmodel_verify", preamble, header + "\n" + "\n".join(rows), update_docs=args.update_docs)
    return 0 if worst <= VERIFY_TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
