"""Render the results tables of README.md and docs/ from the files in ``benchmarks/results/``.

A rendered block sits between two comment lines in a Markdown file::

    <!-- results: NAME -->
    ... (written by this script) ...
    <!-- /results -->

and NAME is one of :data:`BLOCKS`: a function that reads its stored files and returns the
block's Markdown, every table row or line naming the file its figures come from. So a
figure in a block is what its file says, and a block whose file is gone cannot render::

    PYTHONPATH=. python benchmarks/render_results.py            # rewrite the blocks in place
    PYTHONPATH=. python benchmarks/render_results.py --check    # exit 1, a line per stale block

``tests/test_results_docs.py`` runs the check in CI, and checks that every
``benchmarks/results/`` path named in README.md and docs/ exists. Prose around the blocks is
written by hand and quotes them.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ("README.md", "docs/bench.md", "docs/bench_runs.md", "docs/costs.md", "docs/results.md", "docs/results_peers.md",
        "docs/results_runtime.md", "docs/training.md")
BLOCK = re.compile(r"(<!-- results: (?P<name>[a-z0-9-]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)


def _load(name: str) -> Any:
    return json.loads((RESULTS / name).read_text())


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _ratio(r: dict[str, Any]) -> str:
    return f"{r['median']:.3f}x [{r['min']:.3f}, {r['max']:.3f}]"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


# -- python -m braid.bench --json files ---------------------------------------------------------
def _bench_rows(doc: dict[str, Any]) -> dict[str, dict[int, float]]:
    """Step seconds per row label and m: braid's runs (``braid <schedule>``, ``, graphed`` for a
    whole-step CUDA graph) and the external rows, in the file's order."""
    rows: dict[str, dict[int, float]] = {}
    for r in doc["runs"]:
        label = f"braid {r['schedule']}" + (", graphed" if r.get("cuda_graph") == "step" else "")
        rows.setdefault(label, {})[r["m"]] = r["step_s"]
    for e in doc["external"]:
        if e.get("step_s") is not None:
            rows.setdefault(e["schedule"], {})[e["m"]] = e["step_s"]
    return rows


def bench_steps(*files: str) -> list[str]:
    """Step ms of every row of ``braid.bench --json`` files (the median of its round medians), then
    per file and m braid's best over the best external row and over each peer's best, per round."""
    docs = {f: _load(f) for f in files}
    mbs = sorted({r["m"] for d in docs.values() for r in d["runs"]})
    rows = [[f"`{f}`", label, *(_ms(by_m.get(m)) for m in mbs)] for f, d in docs.items() for label, by_m in _bench_rows(d).items()]
    lines = _table(["file", "run (step ms)", *(f"m={m}" for m in mbs)], rows)
    lines.append("")
    for f, d in docs.items():
        for m, r in d.get("best_over_external", {}).items():
            peers = d.get("best_per_peer", {}).get(m, {})
            per_peer = "".join(f"; / {p}'s best {_ratio(b)}" for p, b in sorted(peers.items()))
            lines.append(f"- `{f}`, m={m}: braid's best / the best external row {_ratio(r)} over {len(r['rounds'])} "
                         f"rounds{per_peer}")
    return lines


def _layout(cfg: dict[str, Any]) -> str:
    sp = ", sequence-parallel" if cfg.get("seq_shard") else ""
    ep = f" x ep={cfg['ep']}" if cfg.get("ep", 1) > 1 else ""
    return f"tp={cfg['tp']} x pp={cfg['pp']}{ep}{sp}, layers/stage {','.join(map(str, cfg['layers_per_stage']))}"


def bench_headlines() -> list[str]:
    """Every stored ``braid.bench --json`` file with rounds against external rows: per m, braid's
    fastest run, the fastest external row and braid's best over it per round."""
    rows = []
    for path in sorted(RESULTS.glob("*.json")):
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or not doc.get("best_over_external") or "config" not in doc:
            continue
        cfg = doc["config"]
        for m, r in doc["best_over_external"].items():
            ours = min((x for x in doc["runs"] if str(x["m"]) == m), key=lambda x: x["step_s"])
            theirs = min((e for e in doc["external"] if str(e["m"]) == m and e.get("step_s")), key=lambda e: e["step_s"])
            rows.append([f"`{path.name}`", doc["device"], _layout(cfg), f"hidden {cfg['model']['hidden']}, seq {cfg['seq']}",
                         str(m), f"{ours['schedule']} {_ms(ours['step_s'])}", f"{theirs['schedule']} {_ms(theirs['step_s'])}",
                         f"{_ratio(r)} ({len(r['rounds'])})"])
    return _table(["file", "device", "layout", "shape", "m", "braid's fastest (ms)", "fastest external (ms)",
                   "braid / external per round (rounds)"], rows)


# -- benchmarks/bench_braided_overlap.py --json -------------------------------------------------
def overlap(file: str) -> list[str]:
    """Per TP backend: plain and braided step, the all-reduces alone (a burst), the share hidden,
    the unbraided ends, the share hidden in the blocks, the GEMM slowdown beside an all-reduce."""
    doc = _load(file)

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    rows = [[f"`{b}`", f"{r['plain_ms']:.2f} ms", f"{r['braided_ms']:.2f} ms", f"{r['braided_over_plain']:.3f}",
             f"{r['ar_alone_ms']:.2f} ms", pct(r.get("ar_hidden")), f"{r['ends_exposed_ar_ms']:.2f} ms",
             pct(r.get("ar_hidden_in_blocks")), f"{r['overlap']['gemm_slowdown']:.3f}" if r.get("overlap") else "-", f"`{file}`"]
            for b, r in doc.items() if "error" not in r]
    return _table(["TP backend", "plain step", "braided step", "braided/plain", "AR alone (burst)", "AR hidden",
                   "ends exposed", "hidden in blocks", "GEMM slowdown", "file"], rows)


# -- benchmarks/bench_executor_limit.py --out ---------------------------------------------------
def executor_limit(file: str) -> list[str]:
    """Every contender's step and tokens/s [min, max over rounds] and its speed over braid's best,
    then braid's best over each other contender, per round."""
    doc = _load(file)
    tps, step = doc["tokens_per_s"], doc["step_s"]
    best = max((k for k in tps if k.startswith("braid_") and not k.endswith(("_eager", "_nograph"))), key=tps.get)
    rows = []
    for k, v in tps.items():
        rounds = doc["tokens_per_s_rounds"].get(k, [])
        spread = f" [{min(rounds):,.0f}, {max(rounds):,.0f}]" if len(rounds) > 1 else ""
        rows.append([k, _ms(step.get(k)), f"{v:,.0f}{spread}", f"{v / tps[best]:.3f}", f"`{file}`"])
    lines = _table(["contender", "step ms", "tokens/s [min, max over rounds]", "vs braid best", "file"], rows)
    return [*lines, "", *(f"- `{file}`: {k.replace('braid_best', 'braid best')} {_ratio(r)} over {len(r['rounds'])} rounds"
                          for k, r in doc["ratios"].items())]


# -- benchmarks/bench_executor_overhead.py --json ----------------------------------------------
def executor_overhead(file: str) -> list[str]:
    """Per unit task by this process's CPU time: the floor, then the executor on cut and fused chunks
    in each recording mode, with the ratio to the floor."""
    doc = _load(file)
    us = doc["us_per_unit_task"]
    floor = us["floor"]["cpu_us"]

    def runs(kind: str) -> str:
        cells = [(k.split("=")[1], v["cpu_us"]) for k, v in us.items() if k.startswith(kind + " ")]
        return " / ".join(f"{v:.1f} ({v / floor:.2f}x)" for _, v in cells) + " us"

    kinds = [k for k in ("cut", "fused") if any(u.startswith(k + " ") for u in us)]
    modes = " / ".join(f'`"{k.split("=")[1]}"`' for k in us if k.startswith(kinds[0] + " "))
    return _table(["floor", *(f"{k}, {modes}" for k in kinds), "file"],
                  [[f"{floor:.1f} us", *(runs(k) for k in kinds), f"`{file}`"]])


# -- python -m braid.acceptance: its summary.json, or its printed output ---------------------------
def acceptance(file: str) -> list[str]:
    """The table an acceptance run printed: from its ``summary.json`` (which holds it), or from a
    file of its printed output, whose bench parts' lines then say nothing of how braid ran."""
    if file.endswith(".json"):
        doc = _load(file)
        head, table = f"{doc['gpus']} x {doc['device']}, torch {doc['torch']}, NCCL {doc['nccl']}", doc["table"]
        if "tree" in doc:  # a stored run says which tree ran (summary.json itself does not)
            head += f"; tree at {doc['tree']}"
    else:
        text = (RESULTS / file).read_text().splitlines()
        start = next(i for i, line in enumerate(text) if line.startswith("part "))
        end = next(i for i in range(start, len(text)) if text[i].startswith("total "))
        bench = next((line for line in text if line.startswith("$ ") and "braid.bench" in line), "")
        how = "eager units (`--no-compile`)" if "--no-compile" in bench else "compiled units"
        head, table = f"{text[0].lstrip('# ').split(';')[0]}; braid's bench parts ran {how}", text[start:end + 1]
    return [f"`{file}` ({head}):", "", "```text", *table, "```"]


# -- examples' --profile reports, with the run's step lines above them ----------------------------
_STEP = re.compile(r"^#\s+(\S+)\s+step\s+(\d+)/(\d+)\s.*?\s([\d,.]+) ms .*?mfu ([\d.]+)")
_BUSY = re.compile(r"^\s*(\d+)\s+(?:[\d.-]+\s+){6}([\d.]+)%")


def profiles(*files: str) -> list[str]:
    """Per stored profile: its schedule, the step times and MFU of the timed steps (eager: all but the first
    and the profiled last one; graphed: the replays before the profiled one), each rank's device busy share."""
    rows = []
    for name in files:
        lines = (RESULTS / name).read_text().splitlines()
        captured = max((k for k, line in enumerate(lines) if "capture of" in line), default=-1)
        steps = [m.groups() for m in map(_STEP.match, lines) if m]
        timed = [m.groups() for m in map(_STEP.match, lines[captured + 1:]) if m][1:-1]  # not the first, captured or profiled
        middle = [(float(ms.replace(",", "")), float(mfu)) for _, _, _, ms, mfu in timed]
        busy = [f"{float(m[2]):.1f}%" for m in map(_BUSY.match, lines) if m]
        ms, mfu = [t for t, _ in middle], [100 * u for _, u in middle]
        rows.append([f"`{name}`", steps[0][0], f"{min(ms):,.0f}-{max(ms):,.0f}", f"{min(mfu):.1f}-{max(mfu):.1f}%", " / ".join(busy)])
    return _table(["file", "schedule", "step ms", "MFU", "device busy, profiled step (rank 0 / 1)"], rows)


BLOCKS: dict[str, Callable[[], list[str]]] = {
    "vlm-profiles": lambda: profiles("vlm_profile_7b_h100x2_tp2_before.txt", "vlm_profile_7b_h100x2_tp2_braided_v.txt",
                                     "vlm_profile_7b_h100x2_tp2_1f1b_i.txt"),
    "acceptance": lambda: [*acceptance("acceptance_h100x2_tests.json"), "", *acceptance("acceptance_h100x2_bench.json")],
    "braided-overlap": lambda: overlap("braided_overlap_burst_h200x2.json"),
    "executor-limit": lambda: executor_limit("executor_limit_h100.json"),
    "executor-overhead": lambda: executor_overhead("executor_overhead_cpu.json"),
    "graphs-tp2": lambda: bench_steps("bench_7b_h100x2_tp2_pp1_graphs.json"),
    "peers-h100x2": lambda: bench_steps("peers_2gpu_tp2_pp1.json", "peers_2gpu_tp1_pp2.json", "peers_2gpu_tp1_pp2_mcore.json"),
    "bench-headlines": bench_headlines,
}


def render(text: str) -> tuple[str, list[str]]:
    """``text`` with every block rendered afresh, and the names of the blocks that changed
    (``KeyError`` for a block name not in :data:`BLOCKS`)."""
    changed: list[str] = []

    def fill(match: re.Match) -> str:
        body = "\n".join(BLOCKS[match["name"]]()) + "\n"
        if body != match["body"]:
            changed.append(match["name"])
        return match.group(1) + body + match.group(4)

    return BLOCK.sub(fill, text), changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 with a line per block that differs from its files")
    args = ap.parse_args(argv)
    stale = []
    for doc in DOCS:
        path = ROOT / doc
        text = path.read_text()
        unknown = sorted({m["name"] for m in BLOCK.finditer(text)} - set(BLOCKS))
        if unknown:
            ap.error(f"{doc}: unknown results block {unknown[0]!r}; known: {', '.join(BLOCKS)}")
        new, changed = render(text)
        stale += [f"{doc}: block {name!r} differs from its stored files" for name in changed]
        if changed and not args.check:
            path.write_text(new)
    for line in stale:
        print(("stale: " if args.check else "rewrote: ") + line)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
