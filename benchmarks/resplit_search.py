"""Which split of half layers over the virtual stages a measured profile ranks fastest.

Reads a ``braid.bench --json`` summary, rewrites its (calibrated) profile for every split of the
same layers into halves (:func:`braid.cost.resplit.resplit`), simulates each schedule at each m
on it and prints the fastest splits with the stored split marked beside them. No device needed;
the pick is then measured with ``braid.bench --layers-per-stage``:

    PYTHONPATH=. python benchmarks/resplit_search.py benchmarks/results/bench_7b_h100x4_tp2_pp2.json --top 5
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

from braid.cost.resplit import resplit
from braid.measure.calibrate import predict
from braid.measure.refit import profile_config, run_mode


def splits(layers: float, stages: int):
    """Every split of ``layers`` into ``stages`` multiples of one half (a stage may hold none)."""
    halves = round(2 * layers)
    for cut in itertools.combinations(range(halves + stages - 1), stages - 1):  # stars and bars
        edges = (-1, *cut, halves + stages - 1)
        yield tuple((edges[i + 1] - edges[i] - 1) / 2 for i in range(stages))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("summary", help="a braid.bench --json file")
    ap.add_argument("--schedule", nargs="+", default=None, help="schedules (default: the summary's)")
    ap.add_argument("--mbs", type=int, nargs="+", default=None, help="micro-batch counts (default: the summary's)")
    ap.add_argument("--top", type=int, default=8, help="splits to print (default 8)")
    args = ap.parse_args(argv)
    try:
        doc = json.loads(open(args.summary).read())
        pc = profile_config(doc)
    except (OSError, ValueError, KeyError) as err:
        ap.error(f"{args.summary}: {err}")
    if pc.vision is not None:
        ap.error(f"{args.summary}: a vision-language profile's first stage is its tower; re-split the LM stages by hand")
    scheds = args.schedule or list(dict.fromkeys(r["schedule"] for r in doc["runs"] if ":" not in r["schedule"]))
    mbs = args.mbs or sorted({r["m"] for r in doc["runs"]})
    mode = run_mode(doc, doc["runs"][0]) if doc["runs"] else None
    old = tuple(pc.layers_per_stage)
    rows = []
    for split in splits(sum(old), len(old)):
        try:
            prof = resplit(doc["profile"], pc.tp, pc.pp, old, split, pc.placement, pc.moe_layers)
        except ValueError:  # a middle stage with nothing to run
            continue
        rows.append((split, {(s, m): 1e3 * predict(prof, s, m, pc.pp, pc.tp, split, cuda_graph=mode,
                                                    moe_layers=pc.moe_layers)[0].report.step_time_s
                             for s in scheds for m in mbs}))
    key = (scheds[0], mbs[0])
    rows.sort(key=lambda r: r[1][key])
    print(f"# {args.summary}: {len(rows)} splits of {sum(old):g} layers over {len(old)} stages, predicted step ms, "
          f"sorted by {key[0]} at m={key[1]}; the stored split {old} marked *")
    head = " ".join(f"{s}@{m:<3d}" for s in scheds for m in mbs)
    print(f"{'split':28s} {head}")
    for split, t in rows[:args.top] + [r for r in rows[args.top:] if r[0] == old]:
        mark = "*" if split == old else " "
        print(f"{mark}{','.join(f'{x:g}' for x in split):27s} " + " ".join(f"{t[(s, m)]:>{len(s) + 4}.1f}" for s in scheds for m in mbs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
