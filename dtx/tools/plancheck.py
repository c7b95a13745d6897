"""``dtx simulate --verify``: each plan the simulator chose, compiled on emulated devices, its predicted
FLOPs and bytes per layer, per group and for the whole step against what XLA compiles (:mod:`dtx.run.verify`)."""

from __future__ import annotations

import sys

from dtx.perf.clusters import Cluster
from dtx.perf.model import plan_text


VERIFY_TOLERANCE = 0.02  # the claim: compiled within 2 % of predicted, per layer, per group and for the step


def verify_plans(args, cluster: Cluster, points) -> list[dict]:
    """Compile each plan that fits the emulated devices; predicted against compiled (:mod:`dtx.run.verify`)."""
    import jax

    from dtx.run import verify
    from dtx.models import build_model

    if cluster.bytes_per_element == 2 and jax.default_backend() == "cpu":
        # XLA:CPU runs bfloat16 collectives in float32: compile and predict at 4 bytes, a uniform factor.
        cluster = cluster.replace(bytes_per_element=4)
        print("verify: XLA:CPU sends bfloat16 collectives as float32, so plans are compiled and predicted at 4 bytes "
              "per element; the 2-byte communication figures of the scaling tables are half of these", file=sys.stderr)
    dtype = {2: "bfloat16", 4: "float32", 8: "float64"}.get(cluster.bytes_per_element, "float32")
    model = build_model(args.model, dtype=dtype, param_dtype=dtype)  # the bytes per element the model assumes
    shape = args.input_shape or type(model).default_input_shape
    devices = jax.devices()
    out = []
    for point in points:
        if point.nodes > len(devices) or point.nodes < 2:
            continue
        layers = verify.verify_layers(model, shape, point.plan, cluster, algorithm=args.algorithm, devices=devices)
        checks = layers + verify.group_totals(layers) + [verify.verify_step(model, shape, point.plan, cluster,
                                                                           devices=devices)]
        out.append(dict(nodes=point.nodes, group_size=point.plan.group_size, plan=plan_text(point.plan),
                        checks=[_check_json(c) for c in checks]))
    return out


def _check_json(check) -> dict:
    ratios = (check.flops_ratio, check.bytes_ratio)
    within = all(r is not None and abs(r - 1) <= VERIFY_TOLERANCE for r in ratios)
    return dict(name=check.name, choice=check.choice, predicted_flops=check.predicted_flops,
                compiled_flops=check.compiled_flops, flops_ratio=check.flops_ratio,
                predicted_bytes=check.predicted_bytes, compiled_bytes=check.compiled_bytes,
                bytes_ratio=check.bytes_ratio, within=within)


def print_checks(verified: list[dict]) -> None:
    print("\nverify: each plan compiled on emulated CPU devices (nothing runs); per device per iteration; "
          "predicted = dtx.perf.model, compiled = XLA's cost analysis (FLOPs) and the HLO's collectives (bytes, "
          "ring convention)")
    if not verified:
        print("  no plan of 2..--verify-devices nodes to compile; add such node counts to --nodes")
    for plan in verified:
        print(f"\n{plan['nodes']} nodes, {plan['plan']}:")
        print(f"{'layer':>20} {'choice':>12} {'GFLOP model':>12} {'GFLOP XLA':>10} {'ratio':>6} "
              f"{'MB model':>10} {'MB XLA':>10} {'ratio':>6}")
        for row in plan["checks"]:
            ratio = ["-" if r is None else f"{r:.3f}" for r in (row["flops_ratio"], row["bytes_ratio"])]
            flag = "" if row["within"] else f"  outside {VERIFY_TOLERANCE:.0%}"
            print(f"{row['name']:>20} {row['choice']:>12} {row['predicted_flops'] / 1e9:>12.4f} "
                  f"{row['compiled_flops'] / 1e9:>10.4f} {ratio[0]:>6} {row['predicted_bytes'] / 1e6:>10.3f} "
                  f"{row['compiled_bytes'] / 1e6:>10.3f} {ratio[1]:>6}{flag}")
