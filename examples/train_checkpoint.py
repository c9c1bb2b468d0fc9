"""Checkpoints of the example loop: model, optimizer and progress under the single-device model's names.

A checkpoint saved at one (tp, pp, dp, schedule) resumes at any other: parameters and
optimizer state are keyed by global parameter names (:mod:`braid.training.sharded_state`), the data
position (the next global sample index) and the step travel with them, and the directory
protocol (step folders, ``latest``, layout record, checksums) is :mod:`braid.training.checkpoint`'s.

:func:`check_resume` runs before any process group exists: it finds the step folder, reads
its layout record and manifest and compares the saved model with the one this run builds,
so a wrong directory or model costs one line. The checksums are verified once the ranks
can share the reading (:func:`verify_resume`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from braid.training import checkpoint
from train_cli import Run, Setup, Task, UsageError

log = logging.getLogger("braid.examples")


def model_record(task: Task, setup: Setup) -> dict[str, Any]:
    """What identifies the model: the script, its preset, its config and every global parameter's shape."""
    cfg = setup.model.cfg
    return {"task": task.prog, "preset": setup.args.model,
            "config": json_safe(dataclasses.asdict(cfg)) if dataclasses.is_dataclass(cfg) else repr(cfg),
            "params": {n: list(p.shape) for n, p in setup.model.named_parameters()}}


def json_safe(value: Any) -> Any:
    """Nested dataclass fields as JSON values (tuples as lists)."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def layout_record(task: Task, setup: Setup, run: Run, pos: int) -> dict[str, Any]:
    """The layout record of a save: the model, how it was split and where the data stood."""
    a = setup.args
    return {"model": model_record(task, setup), "pos": pos,
            "layout": {"world": setup.world, "tp": a.tp, "pp": a.pp, "dp": a.dp, "cp": a.cp, "ep": a.ep, "schedule": run.name,
                       "stage_layers": list(run.stage_layers), "micro_batches": a.mbs, "micro_batch_size": a.micro_batch_size},
            "torch": torch.__version__}


def check_resume(task: Task, setup: Setup) -> Path | None:
    """The step folder ``--resume`` names, its record read and its model compared with this run's (:class:`UsageError`).

    None: ``--resume`` is the run's own ``--save`` directory and holds no checkpoint yet.
    """
    a = setup.args
    if _nothing_saved_yet(a.resume, a.save):
        if setup.rank == 0:
            log.info("--resume %s: no complete checkpoint there yet (the --save directory); starting at step 0", a.resume)
        return None
    try:
        step_dir = checkpoint.resolve(a.resume)
        rec = checkpoint.read_layout(step_dir)
        checkpoint.read_manifest(step_dir)
    except checkpoint.CheckpointError as err:
        raise UsageError(f"--resume {err}") from None
    want, got = model_record(task, setup), rec.get("model")
    if not isinstance(got, dict):
        raise UsageError(f"--resume {step_dir}: layout record without a model entry; the checkpoint is damaged")
    if got.get("task") != want["task"]:
        raise UsageError(f"--resume {step_dir}: saved by {got.get('task')}, not {want['task']}")
    for key in ("config", "params"):
        if got.get(key) != want[key]:
            diff = _first_difference(got.get(key), want[key])
            raise UsageError(f"--resume {step_dir}: saved for another model ({diff}; saved with --model "
                             f"{got.get('preset')}, this run --model {a.model})")
    per_step = a.dp * a.mbs * a.micro_batch_size
    saved = rec.get("layout", {})
    saved_per_step = saved.get("dp", 0) * saved.get("micro_batches", 0) * saved.get("micro_batch_size", 0)
    if saved_per_step != per_step and setup.rank == 0:
        log.warning("--resume %s: saved with %d samples per step (dp x mbs x micro-batch size), this run takes %d: "
                    "the data continues at the saved sample, but the run is not the one that was saved", step_dir,
                    saved_per_step, per_step)
    return step_dir


def _nothing_saved_yet(resume: str, save: str | None) -> bool:
    """``--resume DIR --save DIR`` before DIR holds any checkpoint: the same command starts and restarts a run.

    Only for the run's own --save directory (a mistyped --resume elsewhere stays an error),
    and only when nothing there could be a checkpoint (no step folder, no ``latest``).
    """
    r = Path(resume)
    if not save or r.resolve() != Path(save).resolve():
        return False
    if not r.exists():
        return True
    return r.is_dir() and not checkpoint.step_folders(r) and not any((r / n).exists() for n in (checkpoint.LATEST, ".metadata"))


def _first_difference(saved: Any, want: Any) -> str:
    if isinstance(saved, dict) and isinstance(want, dict):
        for k in list(want) + [k for k in saved if k not in want]:
            if saved.get(k) != want.get(k):
                return f"{k}: saved {saved.get(k)}, this run {want.get(k)}"
    return "records differ"


def verify_resume(step_dir: Path, rank: int, world: int) -> None:
    """Checksums of the step folder, the reading split over the ranks; every rank raises the same error."""
    import torch.distributed as dist

    mine = checkpoint.verify(step_dir, (rank, world))
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    problems = [p for lst in every for p in lst]
    if problems:
        raise checkpoint.CheckpointError(f"--resume {problems[0]}")


class TrainState:
    """What a checkpoint holds for one schedule's run: model, optimizer, progress (step, next sample).

    The optimizer's state is saved under global parameter names too: a ``torch.optim``
    optimizer over the runner's parameters through ``get_optimizer_state_dict``
    (:class:`braid.training.sharded_state.OptimizerState`). An optimizer that keeps its state
    elsewhere (fp32 master weights, shards over data-parallel ranks) provides
    ``checkpoint_state(params: ShardedParams) -> Stateful`` whose ``state_dict()`` is keyed by
    global names (``params.by_name``; TP blocks via ``params.to_global``) -- resharding over
    tp, pp and dp then stays DCP's job.
    """

    def __init__(self, task: Task, runner: Any, optimizer: Any, groups: Any) -> None:
        from braid.models.global_names import check_shards, chunk_shards
        from braid.training.sharded_state import ModelState, OptimizerState, ShardedParams

        topo = groups.topo
        shards = getattr(runner, "shards", None) or chunk_shards(runner.chunks, groups.coords.tp, topo.tp, vlm=task.vision)
        experts = getattr(runner, "experts", None)
        self.params = ShardedParams(shards, groups.tp if topo.tp > 1 else None, experts.ep_group if experts is not None else None)
        self.model = ModelState(self.params)
        from braid.training.optimizer import ShardedAdamW

        # An optimizer that checkpoints itself under global names says so (checkpoint_state).
        # braid.training.step.Optimization wraps a torch AdamW over the parameters (saved as any
        # torch optimizer) or a ShardedAdamW with fp32 masters (MasterState); its learning-rate
        # schedule is the step count (Optimization.resume_at).
        own = getattr(optimizer, "checkpoint_state", None)
        inner = getattr(optimizer, "optimizer", optimizer)
        expert_opt = getattr(optimizer, "expert_optimizer", None)
        if callable(own):
            self.optim: Any = own(self.params)
        elif expert_opt is not None:  # expert parallelism: the experts' masters and moments apart
            self.optim = JointState([MasterState(self.params, inner), MasterState(self.params, expert_opt)])
        elif isinstance(inner, ShardedAdamW):
            self.optim = MasterState(self.params, inner)
        else:
            self.optim = OptimizerState(self.params, inner)
        self._check = lambda model: check_shards(shards, model)

    def check_against(self, model: torch.nn.Module) -> None:
        """Every local parameter is its block of the single-device ``model`` (names and values)."""
        self._check(model)

    def state(self, step: int, pos: int) -> dict[str, Any]:
        return {"model": self.model, "optim": self.optim,
                "progress": {"step": torch.tensor(step, dtype=torch.int64), "pos": torch.tensor(pos, dtype=torch.int64)}}

    def save(self, task: Task, setup: Setup, run: Run, step: int, pos: int, extra: dict[str, str]) -> Path:
        import torch.distributed as dist

        return checkpoint.save(setup.args.save, step, self.state(step, pos), layout_record(task, setup, run, pos),
                               rank=setup.rank, barrier=dist.barrier, keep=setup.args.keep_checkpoints, extra=extra)

    def load(self, step_dir: Path) -> tuple[int, int]:
        """Load a verified step folder into the model and optimizer; returns (step, next sample)."""
        sd = self.state(0, 0)
        checkpoint.load(step_dir, sd)
        return int(sd["progress"]["step"]), int(sd["progress"]["pos"])


class MasterState:
    """``Stateful`` state of a :class:`braid.training.optimizer.ShardedAdamW` under global names.

    Its parameters are named by their global names (``BraidRunner.named``); the masters and
    moments come whole per parameter (gathered over the data-parallel ranks), so a TP block
    becomes a ``DTensor`` shard as the parameter does and any (tp, pp, dp) reads it back.
    """

    KEYS = ("master", "exp_avg", "exp_avg_sq")

    def __init__(self, params: Any, optimizer: Any) -> None:
        self.params, self.optimizer = params, optimizer

    def state_dict(self) -> dict[str, Any]:
        sd = self.optimizer.state_dict()
        device = self.optimizer.params[0].device
        out: dict[str, Any] = {"step": sd["step"], "lr": sd["lr"]}
        for name, entry in sd["params"].items():
            for key in self.KEYS:
                out[f"{name}.{key}"] = self.params.to_global(name, entry[key].to(device))
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from braid.training.sharded_state import _local

        params = {name: {key: _local(sd[f"{name}.{key}"]) for key in self.KEYS} for name in self.optimizer.names}
        self.optimizer.load_state_dict({"step": sd["step"], "lr": sd["lr"], "params": params})


class JointState:
    """The :class:`MasterState` of several :class:`ShardedAdamW` over disjoint parameters (an expert-parallel
    run's dense and expert optimizers) as one: their entries are keyed by parameter name, and they step
    together (one step count, one learning rate), so the checkpoint is the one a single optimizer
    over all the parameters writes, and resumes under any layout."""

    def __init__(self, parts: list[MasterState]) -> None:
        self.parts = parts

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for part in self.parts:
            out.update({k: v for k, v in part.state_dict().items() if k not in out})  # step and lr: the first's
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for part in self.parts:
            part.load_state_dict(sd)


def describe_resume(step_dir: Path, setup: Setup, run: Run, step: int, pos: int) -> str:
    """The log line of a resume, naming a change of layout."""
    saved = checkpoint.read_layout(step_dir).get("layout", {})
    a = setup.args
    now = {"tp": a.tp, "pp": a.pp, "dp": a.dp, "cp": a.cp, "ep": a.ep, "schedule": run.name}
    line = f"resumed from {step_dir} at step {step} (sample {pos})"
    saved = {"ep": 1, **saved}  # (saved before expert parallelism was recorded: ep=1)
    if any(saved.get(k) != v for k, v in now.items()):
        was = " ".join(f"{k}={saved.get(k)}" for k in now)
        line += f"; saved at {was}, resharded to " + " ".join(f"{k}={v}" for k, v in now.items())
    return line
