"""``dtx bench collectives --out docs``, and an excerpt of its CSV for BENCHMARKS.md.

    python benchmarks/collectives.py [--update-docs] [extra ``dtx bench collectives`` flags]

Writes collectives.csv and collectives.png, then the section ``collectives``, into a
results folder (printed), or with ``--update-docs`` into docs/ and BENCHMARKS.md: the
measured time of every algorithm at four sizes, the bytes each device sends in the
ring, and the α-β model's prediction for the ring on 10 GbE.
"""

import argparse
import csv
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
EXCERPT = (4 << 10, 256 << 10, 4 << 20, 64 << 20)
NAMES = {"psum": "psum", "ring": "ring", "halving_doubling": "halving-doubling",
         "recursive_doubling": "recursive doubling", "tree": "tree", "hierarchical": "hierarchical"}


def _size(nbytes):
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes} B"


def _ms(seconds):
    return f"{seconds * 1e3:.3g} ms"


def excerpt(rows):
    """The markdown table of ``rows`` (dicts from collectives.csv) at the sizes in :data:`EXCERPT`."""
    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
    by = {(int(r["size_bytes"]), r["algorithm"]): r for r in rows}
    mesh = {a: next(r["mesh"] for r in rows if r["algorithm"] == a) for a in algorithms}
    header = [NAMES.get(a, a) + (f" {mesh[a].replace('x', '×')}" if a == "hierarchical" else "") for a in algorithms]
    lines = ["| size | " + " | ".join(header) + " | bytes sent/device (ring) | predicted ring @10 GbE |",
             "|---|" + "---|" * (len(algorithms) + 2)]
    for size in sorted({int(r["size_bytes"]) for r in rows}):
        if size not in EXCERPT or (size, "ring") not in by:
            continue
        cells = [_ms(float(by[(size, a)]["time_s"])) if (size, a) in by else "—" for a in algorithms]
        ring = by[(size, "ring")]
        lines.append(f"| {_size(size)} | " + " | ".join(cells)
                     + f" | {_size(int(ring['bytes_sent']))} | {_ms(float(ring['predicted_s']))} |")
    largest = max(int(r["size_bytes"]) for r in rows)
    if (largest, "ring") in by and (largest, "psum") in by:
        ratio = float(by[(largest, "ring")]["time_s"]) / float(by[(largest, "psum")]["time_s"])
        lines.append(f"\n**ring ÷ psum at {_size(largest)}: {ratio:.2f}**")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--update-docs", action="store_true",
                        help="write docs/collectives.csv and .png and the BENCHMARKS.md section (default: a results "
                             "folder, printed)")
    args, extra = parser.parse_known_args()
    sys.path.insert(0, HERE)
    import report

    out = report.figures_dir(args.update_docs)
    subprocess.run([sys.executable, "-m", "dtx.tools.cli", "bench", "collectives", "--out", out, *extra], check=True,
                   cwd=REPO)
    with open(os.path.join(out, "collectives.csv"), newline="") as f:
        table = excerpt(list(csv.DictReader(f)))
    print(table)
    report.write("collectives", (
        f"`dtx bench collectives --out docs` ({report.machine('8 emulated CPU devices')}; table excerpt; full "
        "CSV `docs/collectives.csv`, plot `docs/collectives.png`). Time is the median of 5 calls, each waited "
        "on; \"predicted\" is the α-β model for a 10 Gb/s network with α = 5 µs (the flags' defaults) — a "
        "network this machine does not have, so it is a model, not a measurement. Bytes sent per device are "
        "counted from each algorithm's own schedule (equal to the formula; `psum`'s schedule is XLA's, "
        "modelled as a ring)."), table, update_docs=args.update_docs)


if __name__ == "__main__":
    main()
