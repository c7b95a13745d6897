"""Data x pipeline: the planner's choice for three models on three clusters at 8 to 1024 nodes (model only).

    python benchmarks/pipeline_plans.py [--update-docs]    # seconds; log in benchmarks/logs/

For each model, cluster and node count, :func:`dtx.parallel.pipeline.plan.best` puts the fastest pipeline that fits a
node's memory (``P`` stages x ``N/P`` data shards, ``M = k·P`` micro-batches, 1F1B or interleaved with ``V``
virtual stages per device, the stages balanced by the roofline) beside Das et al.'s plan of the same nodes
(:func:`dtx.perf.model.make_plan`: per layer data or model parallel) and keeps the faster, saying why. Weak
scaling: 16 examples per node (VGG-A at 224x224, the speech DNN), 4 sequences of 1024 tokens per node (the
transformer). The models:

* VGG-A and the speech DNN (Das et al. §5), as :func:`dtx.perf.layers.analyze` reads their Dense/Conv layers;
  memory of Das et al.'s plan by :mod:`dtx.perf.memory` (Adam, without the model's own activation profile).
  dtx runs both as pipelines (VGG-A without dropout: the plan's overrides set ``model.dropout_rate=0``).
* A GPT-2-small-sized transformer (12 blocks of 768, vocabulary 50257): planned as dtx cuts it, one layer per block
  (:func:`dtx.parallel.pipeline.plan.transformer_layers`, from :mod:`dtx.perf.decoder`, the block costs the LM planner
  reads too: attention's products included) between the embedding and the untied head, and Das et al.'s split of
  a block would be tensor parallelism, which is planned elsewhere (``parallel.name=tensor``): its plan here is
  data parallelism, and its memory counts each block's input and output, not attention's activations.

Each figure is modelled (``dtx simulate --verify`` compiles plans of up to ``--devices`` nodes and holds FLOPs and
bytes to them: tests/test_pipeline_sim.py); time is per step, memory per device.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402

COMMAND = "python benchmarks/pipeline_plans.py"
LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "logs", "pipeline_plans.log")
MODELS = ("vgg_a", "speech_dnn", "gpt2_small")
CLUSTERS = ("haswell_fdr", "cloud_10gbe", "h100_nvlink_ndr")
NODES = (8, 64, 256, 1024)
PER_NODE = {"vgg_a": 16, "speech_dnn": 16, "gpt2_small": 4}


def _layers(name: str):
    from dtx.parallel.pipeline import plan as pipeline_plan
    from dtx.perf.report import model_layers

    return pipeline_plan.transformer_layers(12, 768, 1024) if name == "gpt2_small" else model_layers(name)


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def rows() -> list[str]:
    from dtx.parallel.pipeline import plan as pipeline_plan
    from dtx.perf import clusters
    from dtx.perf import memory as memory_lib
    from dtx.perf import model as perfmodel
    from dtx.precision import parse_policy

    out = []
    for name in MODELS:
        layers = _layers(name)
        example = 8 * 1024 if name == "gpt2_small" else None  # token ids and labels, int32
        for cluster_name in CLUSTERS:
            cluster = clusters.get_cluster(cluster_name)
            policy = parse_policy("p=f32,c=bf16,r=bf16" if cluster.bytes_per_element == 2 else "p=f32")
            for n in NODES:
                batch = PER_NODE[name] * n
                das = perfmodel.make_plan(layers, cluster, n, batch, mode="data" if name == "gpt2_small" else "auto")
                das_memory = memory_lib.estimate_plan(das, optimizer="adam", policy=policy).total
                chosen, fitting = pipeline_plan.best(layers, cluster, n, batch, das, das_memory, optimizer="adam",
                                                     example_bytes=example, runnable=True)
                p = fitting[0] if fitting else None
                pipe = "none fits" if p is None else (f"{p.text()}: bubble {p.bubble:.0%}, {_ms(p.time)}, "
                                                     f"{_size(p.memory_bytes)}")
                fits = "" if das_memory <= cluster.device_memory else " (does not fit)"
                choice = "nothing fits" if chosen is None else pipeline_plan.text(chosen)
                out.append(f"| {name} | {cluster_name} | {n} | {batch} | **{choice}** | "
                           f"{perfmodel.plan_text(das)}: {_ms(das.times['none'])}, {_size(das_memory)}{fits} | "
                           f"{pipe} | {pipeline_plan.why(chosen, das, das_memory, fitting, cluster)} |")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    report.add_output_arguments(parser)
    args = parser.parse_args()
    start = time.perf_counter()
    table = rows()
    os.makedirs(os.path.dirname(LOG), exist_ok=True)
    with open(LOG, "w", encoding="utf-8") as log:
        log.write("\n".join(table) + "\n")
    preamble = (f"`{COMMAND}` on {report.machine()}; {time.perf_counter() - start:.1f} s, model only (nothing "
                "compiles; `dtx simulate --plan auto --verify` compiles such plans of up to 8 nodes and holds the "
                "pipelines' FLOPs and bytes to the model within 2 %). Per model, cluster and node count: the planner's "
                "choice between Das et al.'s plan (per layer data or model parallel; the transformer: data "
                "parallel, tensor parallelism being planned elsewhere) and the fastest data x pipeline split that "
                "fits a node's memory (1F1B, or interleaved with V = 2 or 4 virtual stages per device: the `V=` plans; "
                "M = k·P micro-batches, stages balanced by the roofline), per-step time "
                "and per-device memory (Adam) of each, and why. Weak scaling: 16 examples per node (VGG-A, speech "
                "DNN), 4 sequences of 1024 tokens (a GPT-2-small-sized transformer with an untied head, planned as one "
                "layer per block: attention's activations are not counted). dtx runs each of these pipelines (VGG-A "
                "without dropout).")
    header = ("| model | cluster | nodes | global batch | chosen | Das et al.'s plan: time, memory | best pipeline | "
              "why |\n|---|---|---|---|---|---|---|---|")
    report.write("pipeline_plans", preamble, header + "\n" + "\n".join(table), update_docs=args.update_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
