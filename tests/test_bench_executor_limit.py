"""``benchmarks/bench_executor_limit.py`` on CPU with the tiny preset (the smoke run of the GPU benchmark).

Every contender trains the same seeded model on the same data with the same AdamW steps,
so after the run their losses agree (to float32 rounding): a contender that trained a
different model, or dropped micro-batches, would show here. The results file has the
keys the issue names, and bad arguments cost one line and exit code 2.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest


def _bench(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    return importlib.import_module("bench_executor_limit")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("interleave", [False, True], ids=["one-after-another", "interleaved"])
def test_tiny_cpu_run_writes_every_contender_and_their_losses_agree(monkeypatch, tmp_path, capsys, interleave) -> None:
    bench = _bench(monkeypatch)
    out = tmp_path / "limit.json"
    assert bench.main(["--preset", "tiny", "--device", "cpu", "--seq", "8", "--m", "2", "--layers-per-stage", "1",
                       "--warmup", "0", "--steps", "2", "--skip", "eager_compiled", "--out", str(out)]
                      + ["--interleave"] * interleave) == 0
    doc = json.loads(out.read_text())
    tps = doc["tokens_per_s"]
    want = {"braid_braided_v", "braid_1f1b_i", "braid_zb_v", "eager", "torch_pp_best"}
    assert want <= tps.keys() and not doc["errors"], doc
    assert all(v > 0 for v in tps.values())
    assert tps["torch_pp_best"] == max(tps[k] for k in ("torch_1f1b_i", "torch_zb_v", "torch_dualpipe_v"))
    losses = doc["losses"]
    assert len(losses) == 7
    for name, loss in losses.items():
        assert loss == pytest.approx(losses["eager"], rel=1e-5), (name, losses)
    printed = capsys.readouterr().out
    assert "braid_zb_v" in printed and "/ torch_pp_best:" in printed and "/ eager:" in printed


def test_bad_arguments_are_one_line_and_exit_2(monkeypatch, tmp_path, capsys) -> None:
    bench = _bench(monkeypatch)
    for argv, msg in ((["--device", "cpu", "--schedule", "gpipe"], "pp=1 runs braided_v"),
                      (["--device", "cpu", "--m", "0"], "must be >= 1"),
                      (["--device", "cpu", "--out", str(tmp_path / "no" / "x.json")], "does not exist"),
                      (["--device", "cpu", "--compute-busy"], "--compute-busy reads the CUDA profiler")):
        with pytest.raises(SystemExit) as exc:
            bench.main(argv)
        assert exc.value.code == 2
        assert msg in capsys.readouterr().err
