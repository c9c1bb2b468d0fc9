"""The example scripts with the optimizer and data flags, launched as a user would (gloo on CPU), their
processes forked from the session's fork server (``test_examples._python``'s ``forked``).

* warm-up + cosine decay, clipping, weight decay, selective recomputation and the sharded
  fp32-master optimizer at dp=2 x pp=2: every schedule's losses *and gradient norms*
  equal the unsplit model's;
* a sharded-optimizer run saved after step 2 and resumed gives the uninterrupted run's
  losses, gradient norms and learning rates;
* ``--data`` over local jsonl files with a tokenizer built here trains and matches the
  unsplit model;
* bad optimizer/data flags exit with code 2 and one line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from test_examples import COMMON, LLM, _in_process, _metrics, _ok, _python, _torchrun

OPTIM = ["--lr-schedule", "cosine", "--warmup", "1", "--min-lr", "1e-4", "--clip-grad", "0.5", "--weight-decay", "0.1"]


def _table_rows(stdout: str, names: list[str]) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in stdout.splitlines() if line.split() and line.split()[0] in names}


@pytest.mark.slow
def test_zero1_with_schedule_clipping_and_recompute_matches_the_unsplit_model(tmp_path) -> None:
    names = ["braided_v", "zb_v"]
    metrics = tmp_path / "m.jsonl"
    proc = _torchrun(4, LLM, *COMMON, "--pp", "2", "--dp", "2", "--steps", "3", *OPTIM, "--optimizer", "zero1", "--recompute", "selective",
                     "--reference", "--metrics", str(metrics), "--schedule", *names, forked=True)
    _ok(proc)
    rows = _table_rows(proc.stdout, names)
    assert sorted(rows) == sorted(names), proc.stdout
    for name, row in rows.items():
        assert float(row[5]) <= 1e-4 and float(row[6]) <= 1e-4, (name, row)  # loss and gradient-norm differences
    got = _metrics(metrics)
    assert all(math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0 for m in got)
    assert any(m["grad_norm"] > 0.5 for m in got), "clipping never engaged: the run tests less than it claims"
    lrs = [m["lr"] for m in got if m["schedule"] == "braided_v"]
    assert lrs == pytest.approx([1e-3, 1e-3, 1e-4 + (1e-3 - 1e-4) * 0.5])  # warm-up step, peak, half-way down the cosine


@pytest.mark.slow
def test_zero1_resume_continues_the_uninterrupted_run(tmp_path) -> None:
    flags = [*COMMON, "--dp", "2", "--schedule", "1f1b", *OPTIM, "--optimizer", "zero1"]
    whole, part = tmp_path / "whole.jsonl", tmp_path / "part.jsonl"
    _ok(_torchrun(2, LLM, *flags, "--steps", "4", "--metrics", str(whole), forked=True))
    _ok(_torchrun(2, LLM, *flags, "--steps", "2", "--save", str(tmp_path / "ck"), forked=True))
    _ok(_torchrun(2, LLM, *flags, "--steps", "4", "--resume", str(tmp_path / "ck"), "--metrics", str(part), forked=True))
    want, got = _metrics(whole)[2:], _metrics(part)
    assert [m["step"] for m in got] == [3, 4]
    for key in ("loss", "grad_norm", "lr"):
        assert [m[key] for m in got] == [m[key] for m in want], key  # exact: same layout, same arithmetic


@pytest.mark.slow
def test_zero1_checkpoint_resumes_at_another_layout(tmp_path) -> None:
    """Saved at dp=2 x pp=2 (masters sharded over 2 ranks), resumed at tp=2 x pp=2, dp=1 (another schedule, the
    same global batch): steps 3-4 give the uninterrupted run's losses and gradient norms."""
    base = ["--model", "tiny", "--micro-batch-size", "2", "--seed", "1", "--device", "cpu", "--pp", "2", *OPTIM, "--optimizer", "zero1"]
    whole, part = tmp_path / "whole.jsonl", tmp_path / "part.jsonl"
    saved = [*base, "--dp", "2", "--mbs", "4", "--schedule", "braided_v"]
    _ok(_torchrun(4, LLM, *saved, "--steps", "4", "--metrics", str(whole), forked=True))
    _ok(_torchrun(4, LLM, *saved, "--steps", "2", "--save", str(tmp_path / "ck"), forked=True))
    _ok(_torchrun(4, LLM, *base, "--tp", "2", "--dp", "1", "--mbs", "8", "--schedule", "zb_v", "--steps", "4",
                  "--resume", str(tmp_path / "ck"), "--metrics", str(part), forked=True))
    want, got = _metrics(whole)[2:], _metrics(part)
    assert [m["step"] for m in got] == [3, 4]
    for key in ("loss", "grad_norm", "lr"):
        for a, b in zip(got, want):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (key, a, b)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    pytest.importorskip("datasets")
    pytest.importorskip("tokenizers")
    from test_data import DOCS, make_tokenizer, write_jsonl

    root = tmp_path_factory.mktemp("text")
    write_jsonl(root / "docs" / "part0.jsonl", DOCS * 3)
    return root / "docs", make_tokenizer(root / "tok")


@pytest.mark.slow
def test_text_files_with_a_local_tokenizer_train_like_the_unsplit_model(corpus, tmp_path) -> None:
    data, tok = corpus
    metrics = tmp_path / "m.jsonl"
    proc = _torchrun(2, LLM, *COMMON, "--pp", "2", "--seq", "16", "--steps", "3", *OPTIM, "--optimizer", "master",
                     "--data", str(data), "--tokenizer", str(tok), "--reference", "--schedule", "braided_v",
                     "--metrics", str(metrics), forked=True)
    _ok(proc)
    row = _table_rows(proc.stdout, ["braided_v"])["braided_v"]
    assert float(row[5]) <= 1e-4 and float(row[6]) <= 1e-4, row
    assert all(math.isfinite(m["loss"]) for m in _metrics(metrics))


@pytest.mark.slow
def test_text_data_resumes_at_the_same_sample(corpus, tmp_path) -> None:
    data, tok = corpus
    flags = [*COMMON, "--seq", "16", "--schedule", "1f1b", *OPTIM, "--data", str(data), "--tokenizer", str(tok)]
    whole, part = tmp_path / "whole.jsonl", tmp_path / "part.jsonl"
    _ok(_python(LLM, *flags, "--steps", "4", "--metrics", str(whole), forked=True))
    _ok(_python(LLM, *flags, "--steps", "2", "--save", str(tmp_path / "ck"), forked=True))
    _ok(_python(LLM, *flags, "--steps", "4", "--resume", str(tmp_path / "ck"), "--metrics", str(part), forked=True))
    assert [m["loss"] for m in _metrics(part)] == [m["loss"] for m in _metrics(whole)[2:]]


@pytest.mark.parametrize("extra,message", [
    (["--warmup", "9"], "warm-up (9 steps) must lie within the run's 2 steps"),
    (["--clip-grad", "0"], "positive max norm"),
    (["--min-lr", "1"], "min_lr <= lr"),
    (["--tokenizer", "x"], "--tokenizer needs --data"),
    (["--data", "x"], "--data needs --tokenizer"),
    (["--optimizer", "zero1", "--schedule", "torch_1f1b_i", "--pp", "1"], "torch_1f1b_i trains with plain AdamW"),
    (["--recompute", "selective", "--cp", "2"], "does not cover 2D-Attention"),
    (["--recompute", "full", "--cp", "2"], "--recompute full does not cover 2D-Attention"),
    (["--optimizer", "adam8bit"], "invalid choice: 'adam8bit'"),
])
def test_bad_optimizer_and_data_flags_are_one_line(extra, message, monkeypatch, capsys) -> None:
    """In this process (checks made before any work; test_train_faults runs the script's exit path for real)."""
    rc, _, err = _in_process(LLM, [*COMMON, "--steps", "2", *extra], monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("qwen2.py: error:") and message in lines[0], err


def test_data_errors_are_one_line(corpus, tmp_path, monkeypatch, capsys) -> None:
    """In this process, as the flags above."""
    data, tok = corpus
    big = tmp_path / "big"
    big.mkdir()
    cfg = json.loads((tok / "tokenizer.json").read_text())
    cfg["model"]["vocab"].update({f"w{i}": 1000 + i for i in range(40)})  # more tokens than the tiny model's 32
    (big / "tokenizer.json").write_text(json.dumps(cfg))
    (big / "tokenizer_config.json").write_text((tok / "tokenizer_config.json").read_text())
    for extra, message in [(["--data", str(tmp_path / "none"), "--tokenizer", str(tok)], "does not exist"),
                           (["--data", str(data), "--tokenizer", str(tmp_path)], "no tokenizer.json"),
                           (["--data", str(data), "--tokenizer", str(big)], "vocabulary is 32")]:
        rc, _, err = _in_process(LLM, [*COMMON, "--steps", "2", *extra], monkeypatch, capsys)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and message in lines[0], err
