"""The field's defaults: optimizer modes defined once, documented as defined, and the planner's
README pick runnable with its own flags.

* ``docs/training.md``'s optimizer table equals :func:`braid.cost.optimizer_modes.mode_bytes`;
* the examples, ``braid.plan`` and ``braid.simulate`` offer the same modes with the same default;
* the README's planner pick (a 1024-GPU command) trains at the tiny size on CPU (gloo, 4
  processes) with its schedule and optimizer flags, equal to the unsplit model.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from braid.cost.optimizer_modes import DEFAULT_OPTIMIZER, OPTIMIZERS, mode_bytes
from test_examples import VLM, _ok, _torchrun

ROOT = Path(__file__).resolve().parent.parent


def _doc_table() -> dict[str, list[str]]:
    text = (ROOT / "docs" / "training.md").read_text()
    section = text.split("## Optimizer modes", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.match(r"`(\w+)`", cells[0]) if line.startswith("|") else None
        if m:
            rows[m.group(1)] = cells[1:]
    return rows


def test_docs_table_is_the_code_table() -> None:
    rows = _doc_table()
    assert list(rows) == list(OPTIMIZERS)
    for mode, cells in rows.items():
        for d in (2, 4):
            for n in (1, 8):
                mb = mode_bytes(mode, d, n)
                got = [eval(c, {"__builtins__": {}}, {"d": d, "n": n}) for c in cells[:4]]  # noqa: S307 (the doc's formulas)
                assert got == pytest.approx([mb.weights, mb.grads, mb.masters, mb.moments]), (mode, d, n)
        assert float(cells[4]) == mode_bytes(mode, 2, 1).state and float(cells[5]) == mode_bytes(mode, 2, 8).state, mode
    assert "(default)" in "".join(line for line in (ROOT / "docs" / "training.md").read_text().splitlines()
                                  if line.startswith(f"| `{DEFAULT_OPTIMIZER}`"))


def test_every_front_end_offers_the_same_modes_and_default() -> None:
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    from train_cli import build_parser  # noqa: E402

    from braid.plan import _parser as plan_parser
    from braid.planner.search import Problem
    from braid.cost.cluster import Parallel
    from qwen2 import TASK  # noqa: E402

    for ap in (plan_parser(),):
        act = next(a for a in ap._actions if "--optimizer" in a.option_strings)
        assert tuple(act.choices) == OPTIMIZERS and act.default == DEFAULT_OPTIMIZER
    from braid.simulate import _parser as sim_parser

    for ap in (build_parser(TASK), sim_parser(["1f1b"])):  # default None: zero1 (examples: plain beside a torch_* baseline)
        act = next(a for a in ap._actions if "--optimizer" in a.option_strings)
        assert tuple(act.choices) == OPTIMIZERS and f"default {DEFAULT_OPTIMIZER}" in act.help.lower()
    assert Parallel(1, 1, 2).optimizer == DEFAULT_OPTIMIZER
    assert Problem.__dataclass_fields__["optimizer"].default == DEFAULT_OPTIMIZER


def _readme_pick() -> list[str]:
    text = (ROOT / "README.md").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("torchrun --nnodes=128") and "--optimizer" in ln)
    return shlex.split(line.replace("$MASTER_ADDR", "localhost"))


@pytest.mark.slow
def test_the_readme_planner_pick_trains_at_tiny_size(tmp_path) -> None:
    """The pick's schedule, optimizer and recomputation flags, at tp=2 (from 8), dp=2 (from 128): 4 gloo processes."""
    args = _readme_pick()
    script = args.index("examples/qwen2_vl.py")
    flags = dict(zip(args[script + 1::2], args[script + 2::2]))
    assert flags["--optimizer"] == "zero1"
    m = int(flags["--global-batch-size"]) // (int(flags["--micro-batch-size"]) * int(flags["--dp"]))
    tiny = {**flags, "--model": "tiny", "--tp": str(min(2, int(flags["--tp"]))), "--pp": str(min(2, int(flags["--pp"]))),
            "--dp": "2", "--global-batch-size": str(2 * min(4, m)), "--micro-batch-size": "1", "--seq": "16",
            "--last-stage-lighter": "0"}
    world = int(tiny["--tp"]) * int(tiny["--pp"]) * 2
    argv = [x for kv in tiny.items() for x in kv]
    proc = _torchrun(world, VLM, *argv, "--device", "cpu", "--seed", "1", "--steps", "2", "--reference", timeout=600, forked=True)
    _ok(proc)
    assert "norm diff" in proc.stdout and tiny["--schedule"] in proc.stdout
