"""Checkpoint directories, global parameter names and run files, in one process.

* :mod:`braid.training.checkpoint`: a save is a complete step folder named by ``latest``; the last K
  are kept; a leftover partial folder is never read and is cleared by the next save;
  every kind of damage (truncated, empty, flipped bytes, missing files, broken manifest or
  pointer) is found before loading, as one line;
* :mod:`braid.models.global_names`: over all (pp, tp) ranks, the chunks' blocks (and TP
  rank 0's whole tensors) tile every parameter of the single-device model exactly once
  (LLM and VLM, tp 1 and 2);
* :mod:`braid.io.runconfig`: a run file becomes flags the command line overrides, and the
  effective configuration written back parses to the same values.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

from braid.training import checkpoint
from braid.training.checkpoint import CheckpointError
from braid.io.runconfig import ConfigError, config_argv, dump_config, settings_argv


def _save(d: Path, step: int, keep: int = 2) -> Path:
    state = {"w": torch.arange(1000, dtype=torch.float32) * step, "progress": {"step": torch.tensor(step)}}
    return checkpoint.save(d, step, state, {"note": "test"}, rank=0, barrier=lambda: None, keep=keep, extra={"config.toml": "x = 1\n"})


def _load(step_dir: Path) -> dict:
    state = {"w": torch.zeros(1000), "progress": {"step": torch.tensor(0)}}
    checkpoint.load(step_dir, state)
    return state


def test_save_keeps_the_last_k_and_latest_names_the_newest(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step)
    assert [p.name for p in checkpoint.step_folders(tmp_path)] == ["step_00000002", "step_00000003"]
    newest = checkpoint.resolve(tmp_path)
    assert newest.name == "step_00000003" and checkpoint.verify(newest) == []
    assert checkpoint.read_layout(newest)["step"] == 3 and checkpoint.read_layout(newest)["note"] == "test"
    state = _load(newest)
    assert int(state["progress"]["step"]) == 3 and torch.equal(state["w"], torch.arange(1000.0) * 3)
    assert not list(tmp_path.glob(".*"))  # no partial or trash folders left


def test_a_killed_save_leaves_the_previous_checkpoint_and_is_cleared_next_time(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    partial = tmp_path / ".step_00000002.partial"  # what a save killed midway leaves
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    assert checkpoint.resolve(tmp_path).name == "step_00000001"
    _save(tmp_path, 2)
    assert not partial.exists() and checkpoint.resolve(tmp_path).name == "step_00000002"


def test_a_step_saved_again_replaces_the_stale_folder(tmp_path: Path) -> None:
    """A run resumed from step 1 while a newer step 2 exists (killed before ``latest`` moved) saves step 2 anew."""
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    (tmp_path / "latest").write_text("step_00000001\n")
    _save(tmp_path, 2)
    assert checkpoint.resolve(tmp_path).name == "step_00000002" and checkpoint.verify(tmp_path / "step_00000002") == []


def _flip(p: Path) -> None:
    b = bytearray(p.read_bytes())
    for i in range(8):
        b[(len(b) // 9) * (i + 1)] ^= 0xFF
    p.write_bytes(bytes(b))


DAMAGE = {
    "truncated data": (lambda d: _truncate(d / "__0_0.distcp"), "bytes, the manifest says"),
    "empty data": (lambda d: (d / "__0_0.distcp").write_bytes(b""), "has 0 bytes"),
    "flipped bytes": (lambda d: _flip(d / "__0_0.distcp"), "does not match its checksum"),
    "flipped metadata": (lambda d: _flip(d / ".metadata"), "does not match its checksum"),
    "missing metadata": (lambda d: (d / ".metadata").unlink(), ".metadata is missing"),
    "missing manifest": (lambda d: (d / "manifest.json").unlink(), "manifest.json is missing"),
    "broken manifest": (lambda d: (d / "manifest.json").write_text("{"), "unreadable manifest"),
    "altered layout": (lambda d: (d / "layout.json").write_text((d / "layout.json").read_text() + " "), "bytes, the manifest says"),
}


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damage_is_found_before_loading_as_one_line(tmp_path: Path, case: str) -> None:
    folder = _save(tmp_path, 1)
    damage, message = DAMAGE[case]
    damage(folder)
    problems = checkpoint.verify(folder)
    if not problems:  # the manifest itself is gone: the record readers say so
        with pytest.raises(CheckpointError) as err:
            checkpoint.read_manifest(folder)
        problems = [str(err.value)]
    assert message in problems[0] and "\n" not in problems[0], problems


@pytest.mark.parametrize("content,message", [("garbage\n", "does not name a step folder"),
                                             ("step_00000009\n", "which is missing")])
def test_a_bad_latest_pointer_is_one_line(tmp_path: Path, content: str, message: str) -> None:
    _save(tmp_path, 1)
    (tmp_path / "latest").write_text(content)
    with pytest.raises(CheckpointError, match=message):
        checkpoint.resolve(tmp_path)


def test_verify_splits_the_reading_over_ranks(tmp_path: Path) -> None:
    folder = _save(tmp_path, 1)
    _flip(folder / "__0_0.distcp")
    shares = [checkpoint.verify(folder, (r, 3)) for r in range(3)]
    assert sum(len(s) for s in shares) == 1  # the damaged file is hashed by exactly one rank


def test_loading_into_another_structure_is_one_line(tmp_path: Path) -> None:
    folder = _save(tmp_path, 1)
    with pytest.raises(CheckpointError, match="cannot be loaded into this run") as err:
        checkpoint.load(folder, {"other": torch.zeros(3)})
    assert "\n" not in str(err.value)


# -- global parameter names -------------------------------------------------------------------
def _llm():
    from braid.models.qwen2 import Qwen2Config, Qwen2Model

    torch.manual_seed(0)
    return Qwen2Model(Qwen2Config(vocab_size=64, hidden=32, layers=4, heads=4, kv_heads=2, ffn=64))


def _vlm():
    from braid.models.qwen2_vl import Qwen2VLModel, vlm_preset

    torch.manual_seed(0)
    return Qwen2VLModel(vlm_preset("tiny"))


@pytest.mark.parametrize("kind", ["llm", "vlm"])
@pytest.mark.parametrize("tp", [1, 2])
def test_chunk_blocks_tile_every_global_parameter_once(kind: str, tp: int) -> None:
    from braid import schedules
    from braid.models.global_names import check_shards, chunk_shards

    model = _llm() if kind == "llm" else _vlm()
    plan = schedules.build("braided_v", 2, 4)
    if kind == "llm":
        from braid.models.build import build_rank_chunks

        stage_layers = (1, 1, 1, 1)
        build = lambda pp, t: build_rank_chunks(model, plan, pp, stage_layers, tp_rank=t, tp_size=tp)  # noqa: E731
    else:
        from braid.models.qwen2_vl import vlm_stage_layers
        from braid.models.vision_chunk import build_vlm_rank_chunks

        stage_layers = vlm_stage_layers(model.cfg, plan.num_stages, 0)
        build = lambda pp, t: build_vlm_rank_chunks(model, plan, pp, stage_layers, tp_rank=t, tp_size=tp)  # noqa: E731
    covered = {n: torch.zeros(p.shape, dtype=torch.int64) for n, p in model.named_parameters()}
    for pp in range(2):
        for t in range(tp):
            shards = chunk_shards(build(pp, t), t, tp, vlm=kind == "vlm")
            check_shards(shards, model)
            for p, spec in shards.items():
                if spec.dim is None and t > 0:
                    continue  # whole on every TP rank (norms): TP rank 0's copy is the one saved
                spec.block(covered[spec.name]).add_(1)
    for name, count in covered.items():
        assert bool((count == 1).all()), f"{name}: covered {count.min()}..{count.max()} times"


def test_a_wrong_block_is_refused() -> None:
    from braid.models.global_names import ShardSpec, check_shards

    model = _llm()
    p = torch.nn.Parameter(model.lm_head.weight.detach()[:32].clone())
    check_shards({p: ShardSpec("lm_head.weight", 0, 0, 2)}, model)
    with pytest.raises(ValueError, match="is not block 1"):
        check_shards({p: ShardSpec("lm_head.weight", 0, 1, 2)}, model)
    with pytest.raises(ValueError, match="does not have"):
        check_shards({p: ShardSpec("head.weight", 0, 0, 2)}, model)


# -- run files ----------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--config")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--schedule", nargs="+", default=["braided_v"])
    p.add_argument("--reference", action="store_true")
    p.add_argument("--metrics")
    return p


def test_run_file_flags_come_first_so_the_command_line_wins(tmp_path: Path) -> None:
    f = tmp_path / "run.toml"
    f.write_text('tp = 2\nlr = 3e-4\nschedule = ["zb_v", "1f1b"]\nreference = true\nmetrics = "m \\"x\\".jsonl"\n')
    p = _parser()
    args = p.parse_args(config_argv(p, ["--config", str(f), "--tp", "4"]))
    assert (args.tp, args.lr, args.schedule, args.reference, args.metrics) == (4, 3e-4, ["zb_v", "1f1b"], True, 'm "x".jsonl')


def test_effective_config_replays_to_the_same_values(tmp_path: Path) -> None:
    p = _parser()
    args = p.parse_args(["--tp", "2", "--lr", "1e-05", "--schedule", "zb_v", "braided_v", "--metrics", "ü/m.jsonl"])
    f = tmp_path / "eff.toml"
    f.write_text(dump_config(p, args, header="effective\nconfig"))
    again = p.parse_args(config_argv(p, ["--config", str(f)]))
    assert vars(again) | {"config": None} == vars(args) | {"config": None}


@pytest.mark.parametrize("data,message", [
    ({"bogus": 1}, "unknown setting 'bogus'"),
    ({"reference": 1}, "takes true or false"),
    ({"tp": [1, 2]}, "takes one value"),
    ({"tp": {"a": 1}}, "is not a number or a string"),
    ({"config": "x.toml"}, "cannot name another run file"),
])
def test_bad_settings_are_one_line(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        settings_argv(_parser(), data)


def test_bad_toml_is_one_line(tmp_path: Path) -> None:
    f = tmp_path / "run.toml"
    f.write_text("tp = = 2\n")
    with pytest.raises(ConfigError, match="not valid TOML") as err:
        config_argv(_parser(), ["--config", str(f)])
    assert "\n" not in str(err.value)
    assert json.dumps(str(err.value))  # printable as one line


@pytest.mark.parametrize("where,errno_name,cause", [
    ("dcp", "ENOSPC", "disk full"),
    ("manifest", "ENOSPC", "disk full"),
    ("dcp-wrapped", "EFBIG", "file size limit reached (ulimit -f)"),  # torch's CheckpointException: a BaseException
    ("dcp-wrapped", "EDQUOT", "disk quota exceeded"),
    ("dcp-wrapped", "EACCES", "permission denied"),
])
def test_a_failed_write_mid_save_is_one_line_and_keeps_latest(tmp_path: Path, monkeypatch, where: str, errno_name: str,
                                                              cause: str) -> None:
    """A full disk, a quota, a file size limit or a permission while DCP writes the shards or while rank 0
    writes the manifest: one line naming the directory and the cause, the partial folder removed,
    ``latest`` still naming the previous step."""
    import errno

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    _save(tmp_path, 1)
    failure = OSError(getattr(errno, errno_name), "the write failed")

    def fail(*args, **kwargs):
        if where == "dcp-wrapped":  # how DCP reports a rank's failed write
            raise CheckpointException("save", {0: (failure, None)})
        raise failure

    monkeypatch.setattr(*((dcp, "save") if where.startswith("dcp") else (checkpoint, "atomic_write_text")), fail)
    with pytest.raises(checkpoint.CheckpointWriteError) as info:
        _save(tmp_path, 2)
    msg = str(info.value)
    assert msg.startswith(f"{tmp_path}: {cause} while writing step_00000002"), msg
    assert "latest still names step_00000001" in msg and "\n" not in msg, msg
    assert (tmp_path / "latest").read_text().strip() == "step_00000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]
