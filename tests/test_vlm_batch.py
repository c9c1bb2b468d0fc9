"""What a VLM's chunks read on the host, once per batch shape (braid.models.vlm_batch), and the example's --profile.

The visual tokens written by index equal ``masked_scatter`` (values and both gradients,
bitwise); a micro-batch's shape is read off its ids and images and checked in one line; the
device tensors are built once per shape; ``--profile`` writes its report on CPU too.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from braid.models.vlm_batch import MAX_SHAPES, BatchShape, ShapeCache, batch_shapes, flat_positions, image_runs, scatter_rows

PAD = 7


def _ids(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows)


def test_scatter_rows_equals_masked_scatter_with_gradients() -> None:
    g = torch.Generator().manual_seed(0)
    ids = _ids([[1, PAD, PAD, 2, 3, 0], [4, 5, PAD, PAD, PAD, 0]])
    n = int((ids == PAD).sum())
    x = torch.randn(2, 6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    vis = torch.randn(n, 4, generator=g, dtype=torch.float64, requires_grad=True)
    shape = batch_shapes([(torch.zeros(2, 1), ids, torch.tensor([[1, 2, 1], [1, 3, 1]]))], patch=1, merge=1, image_token_id=PAD)[0]
    want = x.masked_scatter((ids == PAD).unsqueeze(-1), vis)
    got = scatter_rows(x, flat_positions(shape), vis)
    assert torch.equal(got, want)
    dy = torch.randn(2, 6, 4, generator=g, dtype=torch.float64)
    gw = torch.autograd.grad(want, (x, vis), dy)
    gg = torch.autograd.grad(got, (x, vis), dy)
    assert all(torch.equal(a, b) for a, b in zip(gw, gg))


def test_batch_shape_reads_runs_grids_and_checks_them() -> None:
    ids = _ids([[1, PAD, PAD, PAD, PAD, 2], [PAD, PAD, PAD, PAD, 3, 4]])
    images = torch.zeros(2, 3, 4, 4)  # (b, c, H, W): 2x2 patches of 2 pixels, merge 1: 4 tokens each
    (shape,) = batch_shapes([(images, ids)], patch=2, merge=1, image_token_id=PAD)
    assert shape == BatchShape((2, 6), ((1, 2, 2), (1, 2, 2)), ((0, 1, 4), (1, 0, 4)))
    assert image_runs(ids == PAD) == shape.runs
    assert flat_positions(shape).tolist() == [1, 2, 3, 4, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="needs 4 image tokens, input_ids has 3"):
        batch_shapes([(images, _ids([[1, PAD, PAD, PAD, 2, 2], [PAD, PAD, PAD, PAD, 3, 4]]))], 2, 1, PAD)
    with pytest.raises(ValueError, match="2 runs of image tokens for 1 images"):
        batch_shapes([(images[:1], _ids([[PAD, PAD, 1, PAD, PAD, 2]]))], 2, 1, PAD)


def test_device_tensors_are_built_once_per_shape_and_bounded() -> None:
    built = []
    cache = ShapeCache(lambda s: built.append(s) or len(built))
    shapes = [BatchShape((1, k), (), ()) for k in range(MAX_SHAPES + 3)]
    assert cache(shapes[0]) == cache(shapes[0]) == 1 and len(built) == 1
    for s in shapes:
        cache(s)
    assert len(cache) == MAX_SHAPES  # the oldest went first
    assert cache(shapes[-1]) == len(built)  # still there: not built again


def test_vlm_example_profile_writes_its_report(tmp_path) -> None:
    """--profile on the tiny CPU VLM: the report names the step, and each rank's trace is written."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import qwen2_vl
    from train_loop import main

    out = tmp_path / "prof"
    assert main(qwen2_vl.TASK, ["--device", "cpu", "--steps", "2", "--profile", str(out), "--profile-step", "1"]) == 0
    doc = json.loads((out / "profile.json").read_text())
    assert doc["step"] == 1 and [r["rank"] for r in doc["ranks"]] == [0]
    rank = doc["ranks"][0]
    assert rank["step_s"] > 0 and rank["data_s"] >= 0 and rank["cpu_top"]
    assert "braided_v step 1 of 2" in (out / "profile.txt").read_text()
    assert (out / "rank0.json.gz").stat().st_size > 0
    assert main(qwen2_vl.TASK, ["--device", "cpu", "--steps", "2", "--profile-step", "3", "--profile", str(out)]) == 2
