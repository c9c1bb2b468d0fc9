"""The examples' entry points as the planner and the field name them: every catalog preset's
``braid.plan`` line is taken as printed (checked and built on the meta device, up to the
process group), and Megatron's batch flags."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from braid.cost.catalog import MODELS
from braid.cost.cluster import Cluster, Parallel
from braid.cost.hardware import get_hardware
from braid.plan import torchrun_command
from braid.planner.search import Candidate, Evaluation, Problem

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))


def _planner_line(name: str, k: int) -> list[str]:
    """The line ``braid.plan`` prints for ``name`` on 16 GPUs: every other LM with 2D-Attention, the rest with
    recomputation or offload (the flags the planner emits)."""
    model = MODELS[name]
    lm = model.vit is None
    sp = {"cp": 2, "hp": 2, "sp_placement": "context_first"} if lm and k % 2 == 0 else {"recompute": k % 4 == 1}
    par = Parallel(2, 2, 16 // (4 * sp.get("cp", 1)), micro_batch_size=2, **sp)
    m = 64 // (par.dp * par.micro_batch_size)
    cand = (Candidate(par, "braided_v_offload", m, (("offload_alpha", 0.5),)) if k % 4 == 3 else
            Candidate(par, "braided_v", m))
    prob = Problem(model, 16, Cluster(get_hardware("h200"), 8), 64, 141 * 2**30)
    line = torchrun_command(prob, Evaluation(cand, *[1.0] * 8, "full", 1.0))
    args = shlex.split(line.replace("$MASTER_ADDR", "localhost"))
    return args[next(i for i, a in enumerate(args) if a.startswith("examples/")):]


@pytest.mark.parametrize("k,name", list(enumerate(MODELS)), ids=list(MODELS))
def test_every_catalog_presets_planner_line_starts_training(k: int, name: str, monkeypatch) -> None:
    import importlib

    from train_cli import prepare

    script, *argv = _planner_line(name, k)
    task = importlib.import_module(Path(script).stem).TASK
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("RANK", "0")
    setup = prepare(task, [*argv, "--device", "cpu"])  # raises UsageError where the line does not run
    assert setup.args.mbs * setup.args.micro_batch_size * setup.args.dp == 64
    assert next(setup.model.parameters()).device.type == "meta"  # real size, nothing allocated
    assert script == ("examples/qwen2_vl.py" if MODELS[name].vit is not None else "examples/lm.py")


@pytest.mark.parametrize("flags,message", [
    (["--global-batch-size", "7"], "--global-batch-size 7 is not a multiple of --micro-batch-size 2 x dp 1 = 2; use 6 or 8"),
    (["--global-batch-size", "8", "--mbs", "3"], "--mbs 3 micro-batches and --global-batch-size 8 (4 micro-batches"),
    (["--global-batch-size", "0"], "--global-batch-size must be >= 1"),
])
def test_global_batch_size_that_does_not_divide_is_one_line(flags: list[str], message: str, monkeypatch) -> None:
    from lm import TASK
    from train_cli import UsageError, prepare

    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(UsageError) as err:
        prepare(TASK, [*flags, "--device", "cpu"])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_global_batch_size_gives_the_micro_batch_count_and_mbs_says_it_counts(monkeypatch) -> None:
    from lm import TASK
    from train_cli import build_parser, prepare

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    setup = prepare(TASK, ["--global-batch-size", "24", "--micro-batch-size", "3", "--pp", "2", "--device", "cpu"])
    assert (setup.args.dp, setup.args.mbs) == (2, 4)
    helps = {a.dest: a.help for a in build_parser(TASK)._actions}
    assert "NUMBER of micro-batches" in helps["mbs"] and "--global-batch-size" in helps["mbs"]
