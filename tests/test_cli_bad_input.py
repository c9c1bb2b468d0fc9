"""Bad input to every command line: one line on stderr, exit code 2, no traceback, no file left behind.

Each case runs the command's ``main`` in this process (the parsers' checks come before any
work; ``python -m`` itself is run once per command below) in a fresh directory holding only
its input files; afterwards the directory must hold exactly those files, unchanged (no
output, no partial or temporary file). The line must say what is wrong (a fragment of it
is checked), and nothing may be logged beside it. None of these cases starts a distributed
job: the checks come first.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_COSTS = {"T_F": 1.0, "T_B": 1.0, "T_W": 1.0, "T_AR": 0.25}
_EVENT = {"rank": 0, "lane": "compute", "name": "F0c0", "kind": "F", "start": 0.0, "dur": 1.0}


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _trace(**changes) -> str:
    t = {"meta": {"schedule": "x"}, "events": [_EVENT], "memory": {"0": [[0.0, 1]]}, **changes}
    return json.dumps({"format": "braid-trace/1", "traces": [t]})


def _hf_config(drop: str | None = None, **change) -> str:
    cfg = {"model_type": "qwen2", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, **change}
    cfg.pop(drop, None)
    return json.dumps(cfg)


class _Sparse(int):
    """An input file of this many bytes, all holes (written with truncate: no disk, no time)."""


GOOD_TRACE = _trace()
_BINARY = bytes(range(128, 256)) * 8
# name -> (argv after "python -m", input files {name: text}, fragment of the error line)
CASES: dict[str, tuple[list[str], dict[str, str | bytes | _Sparse], str]] = {
    # --- simulate
    "simulate-pp0": (["braid.simulate", "--pp", "0"], {}, "--pp must be a positive integer"),
    "simulate-budget-nan": (["braid.simulate", "--offload-budget", "nan"], {}, "--offload-budget"),
    "simulate-alpha": (["braid.simulate", "--offload-alpha", "2"], {}, "--offload-alpha"),
    "simulate-model": (["braid.simulate", "--model", "nope"], {}, "unknown model 'nope'"),
    "simulate-seq-parallel-odd-seq": (["braid.simulate", "--seq", "4095", "--sequence-parallel"], {}, "not divisible by tp=2"),
    "simulate-unknown-flag": (["braid.simulate", "--bogus"], {}, "unrecognized arguments"),
    "simulate-ep0": (["braid.simulate", "--ep", "0"], {}, "--ep must be a positive integer"),
    "simulate-ep-dense": (["braid.simulate", "--dp", "2", "--ep", "2"], {}, "--ep 2 shards the experts of a mixture-of-experts model; 'qwen2-12b' is dense"),
    "simulate-ep-not-dividing-dp": (["braid.simulate", "--model", "qwen3-moe-30b-a3b", "--dp", "4", "--ep", "8"], {},
                                    "--ep 8 must divide the data-parallel ranks (dp=4)"),
    "simulate-ep-experts": (["braid.simulate", "--model", "qwen3-moe-30b-a3b", "--tp", "1", "--dp", "3", "--ep", "3"], {},
                            "--ep 3 must divide the 128 experts per layer"),
    "simulate-moe-imbalance": (["braid.simulate", "--model", "qwen3-moe-30b-a3b", "--moe-imbalance", "0.5"], {},
                               "--moe-imbalance must be a number >= 1"),
    "simulate-moe-imbalance-nan": (["braid.simulate", "--model", "qwen3-moe-30b-a3b", "--moe-imbalance", "nan"], {},
                                   "--moe-imbalance must be a number >= 1"),
    "plan-ep0": (["braid.plan", "--model", "qwen3-moe-30b-a3b", "--gpus", "8", "--ep", "0"], {},
                 "--ep must be a positive integer or auto, got '0'"),
    "plan-ep-dense": (["braid.plan", "--model", "qwen2-7b", "--gpus", "8", "--ep", "2"], {},
                      "--ep and --moe-imbalance weigh a mixture-of-experts model; 'qwen2-7b' is dense"),
    "plan-ep-no-layout": (["braid.plan", "--model", "qwen3-moe-30b-a3b", "--gpus", "8", "--ep", "16"], {},
                          "--ep 16 fits no layout of 8 GPUs"),
    "plan-moe-imbalance": (["braid.plan", "--model", "qwen3-moe-30b-a3b", "--gpus", "8", "--moe-imbalance", "0"], {},
                           "--moe-imbalance must be a number >= 1"),
    "simulate-moe-imbalance-dense": (["braid.simulate", "--moe-imbalance", "1.5"], {}, "weighs a mixture of experts; 'qwen2-12b' is dense"),
    "simulate-json-dir-missing": (["braid.simulate", "--json", "missing/r.json"], {}, "does not exist"),
    "simulate-json-is-dir": (["braid.simulate", "--json", "."], {}, "is a directory"),
    "simulate-json-is-costs": (["braid.simulate", "--costs", "c.json", "--json", "c.json"], {"c.json": json.dumps(_COSTS)},
                               "is also an input"),
    "simulate-trace-equals-html": (["braid.simulate", "--trace", "o.json", "--html", "o.json"], {}, "same file"),
    "simulate-costs-missing": (["braid.simulate", "--costs", "nope.json"], {}, "no such cost file"),
    "simulate-costs-nan-split": (["braid.simulate", "--pp", "2", "--mbs", "4", "--schedule", "1f1b", "--costs", "c.json"],
                                 {"c.json": json.dumps({**_COSTS, "unit_split": {"F": {u: "nan" for u in (
                                     "embed", "pre_attn", "attn", "pre_mlp", "mlp", "head")}}})}, "unit_split['F']"),
    "simulate-costs-pcie0": (["braid.simulate", "--costs", "c.json"], {"c.json": json.dumps({**_COSTS, "pcie_bytes_per_s": 0})},
                             "'pcie_bytes_per_s' must be a finite number"),
    "simulate-costs-chunks-list": (["braid.simulate", "--costs", "c.json"], {"c.json": json.dumps({**_COSTS, "chunks": [1]})},
                                   "'chunks' must be an object"),
    "simulate-costs-meta-list": (["braid.simulate", "--costs", "c.json"], {"c.json": json.dumps({**_COSTS, "meta": ["a"]})},
                                 "'meta' must be an object"),
    "simulate-costs-nested": (["braid.simulate", "--costs", "c.json"], {"c.json": _nested(100000)}, "nested too deeply"),
    "simulate-costs-1e308": (["braid.simulate", "--costs", "c.json"], {"c.json": json.dumps({**_COSTS, "T_F": 1e308})},
                             "'T_F' must be a finite number"),
    "simulate-costs-not-object": (["braid.simulate", "--costs", "c.json"], {"c.json": "[1, 2]"}, "expected a JSON object"),
    "simulate-layers-cannot-fill": (["braid.simulate", "--pp", "64", "--mbs", "256"], {}, "48 layers cannot fill"),
    "simulate-tp-heads": (["braid.simulate", "--tp", "3"], {}, "tp=3 must divide the 32 attention heads"),
    "simulate-too-few-mbs": (["braid.simulate", "--pp", "4", "--mbs", "3", "--schedule", "braided_v", "--schedule",
                              "dualpipe_v"], {}, "accepts --pp 4 --mbs 3 (see the notes above; raise --mbs)"),
    # --- programs
    "programs-schedule": (["braid.programs", "nope"], {}, "unknown schedule 'nope'"),
    "programs-pp0": (["braid.programs", "gpipe", "--pp", "0"], {}, "--pp must be a positive integer"),
    "programs-m-too-small": (["braid.programs", "braided_v", "--pp", "2", "--mbs", "3"], {}, "needs m >= 2p"),
    "programs-json-dir-missing": (["braid.programs", "gpipe", "--json", "missing/p.json"], {}, "does not exist"),
    # --- viz
    "viz-output-is-input": (["braid.viz", "t.json", "-o", "t.json"], {"t.json": GOOD_TRACE}, "is also an input"),
    "viz-chrome-is-output": (["braid.viz", "t.json", "-o", "o.html", "--chrome", "o.html"], {"t.json": GOOD_TRACE}, "same file"),
    "viz-output-dir-missing": (["braid.viz", "t.json", "-o", "missing/o.html"], {"t.json": GOOD_TRACE}, "does not exist"),
    "viz-empty-trace": (["braid.viz", "t.json", "-o", "o.html"], {"t.json": _trace(events=[], memory={})}, "no events"),
    "viz-meta-not-object": (["braid.viz", "t.json", "-o", "o.html"], {"t.json": _trace(meta="x")}, "'meta' must be an object"),
    "viz-memory-not-object": (["braid.viz", "t.json", "-o", "o.html"], {"t.json": _trace(memory=[1])},
                              "'memory' must be an object"),
    "viz-rank-not-int": (["braid.viz", "t.json", "-o", "o.html"], {"t.json": _trace(events=[{**_EVENT, "rank": "0"}])},
                         "has rank '0'"),
    "viz-missing-key": (["braid.viz", "t.json", "-o", "o.html"],
                        {"t.json": _trace(events=[{k: v for k, v in _EVENT.items() if k != "start"}])}, "does not match"),
    "viz-memory-nan": (["braid.viz", "t.json", "-o", "o.html"], {"t.json": _trace(memory={"0": [["nan", 1]]})},
                       "memory series of rank"),
    "viz-corrupt": (["braid.viz", "t.json", "-o", "o.html"], {"t.json": GOOD_TRACE[:-7]}, "not valid JSON"),
    "viz-nested": (["braid.viz", "t.json", "-o", "o.html"], {"t.json": _nested(100000)}, "nested too deeply"),
    # --- bench (nothing is spawned: every check comes first)
    "bench-costs-nan": (["braid.bench", "--costs", "c.json"], {"c.json": json.dumps({**_COSTS, "T_B": "nan"})},
                        "'T_B' must be a finite number"),
    "bench-costs-missing": (["braid.bench", "--costs", "nope.json"], {}, "no such cost file"),
    "bench-json-dir-missing": (["braid.bench", "--json", "missing/b.json"], {}, "does not exist"),
    "bench-capture-not-measurements": (["braid.bench", "--capture", "m.json"], {"m.json": "{}"}, "not a measurements file"),
    "bench-mbs0": (["braid.bench", "--mbs", "0"], {}, "--mbs"),
    "bench-rounds0": (["braid.bench", "--rounds", "0"], {}, "--rounds"),
    "bench-compute-busy-cpu": (["braid.bench", "--device", "cpu", "--compute-busy"], {}, "--compute-busy reads the CUDA profiler"),
    "bench-no-run-fits": (["braid.bench", "--pp", "2", "--chunks", "1", "--schedule", "braided_v"], {}, "no run fits"),
    "bench-peak-flops": (["braid.bench", "--peak-flops", "inf"], {}, "--peak-flops"),
    "bench-trace-dir-is-file": (["braid.bench", "--trace-dir", "m.json"], {"m.json": "{}"}, "not a directory"),
    # --- files a command takes (braid.io.inputs): one line naming the file
    "programs-import-binary": (["braid.programs", "--import-torch-csv", "b.csv"], {"b.csv": _BINARY},
                               "b.csv: not a UTF-8 text file"),
    "programs-import-missing": (["braid.programs", "--import-torch-csv", "nope.csv"], {}, "nope.csv: no such"),
    "simulate-torch-csv-binary": (["braid.simulate", "--torch-csv", "b.csv"], {"b.csv": _BINARY},
                                  "b.csv: not a UTF-8 text file"),
    "simulate-costs-binary": (["braid.simulate", "--costs", "c.json"], {"c.json": _BINARY}, "c.json: not valid JSON"),
    "simulate-config-no-hidden": (["braid.simulate", "--model", "m/config.json"], {"m/config.json": _hf_config(drop="hidden_size")},
                                  "m/config.json: no 'hidden_size'"),
    "simulate-config-negative-layers": (["braid.simulate", "--model", "m"], {"m/config.json": _hf_config(num_hidden_layers=-2)},
                                        "m/config.json: layers must be a positive integer"),
    "simulate-config-not-json": (["braid.simulate", "--model", "m"], {"m/config.json": "{"}, "m/config.json: not valid JSON"),
    "simulate-config-file-binary": (["braid.simulate", "--model", "b.json"], {"b.json": _BINARY}, "b.json: not valid JSON"),
    "simulate-config-file-missing": (["braid.simulate", "--model", "nope.json"], {}, "nope.json: no such Hugging Face config"),
    "plan-config-no-hidden": (["braid.plan", "--model", "m", "--gpus", "2"], {"m/config.json": _hf_config(drop="hidden_size")},
                              "m/config.json: no 'hidden_size'"),
    # --- sizes checked before compiling
    "simulate-pp-huge": (["braid.simulate", "--schedule", "gpipe", "--tp", "1", "--pp", "100000", "--mbs", "1"], {},
                         "--pp 100000: at most 1024"),
    "simulate-pp-over-layers": (["braid.simulate", "--schedule", "gpipe", "--tp", "1", "--pp", "1000", "--mbs", "1"], {},
                                "48 layers cannot fill 1000 virtual stages"),
    "simulate-mbs-huge": (["braid.simulate", "--mbs", "100000"], {}, "--mbs 100000: at most"),
    "simulate-pp-x-mbs": (["braid.simulate", "--pp", "32", "--mbs", "4096"], {}, "at most 65,536"),
    "bench-pp-huge": (["braid.bench", "--pp", "100000"], {}, "tp x pp = 100000 ranks on the CPU: at most 64"),
    "bench-mbs-huge": (["braid.bench", "--pp", "2", "--mbs", "1000000"], {}, "--mbs 1000000: at most"),
    "profile-too-many-cpu-ranks": (["braid.profile", "--tp", "8", "--pp", "9", "--device", "cpu"], {},
                                   "tp x pp = 72 ranks on the CPU: at most 64"),
    "programs-pp-huge": (["braid.programs", "gpipe", "--pp", "5000"], {}, "--pp 5000: at most 1024"),
    # --- plan: outputs and the launch layout
    "plan-json-equals-html": (["braid.plan", "--model", "qwen2-7b", "--gpus", "8", "--json", "p.out", "--html", "p.out"], {},
                              "name the same file 'p.out'"),
    "plan-json-is-timeline": (["braid.plan", "--model", "qwen2-7b", "--gpus", "8", "--json", "p.timeline.html", "--html",
                               "p.html"], {}, "name the same file 'p.timeline.html'"),
    "plan-gpus-not-whole-nodes": (["braid.plan", "--model", "qwen2-7b", "--gpus", "12", "--gpus-per-node", "8"], {},
                                  "--gpus 12 is not a whole number of nodes of --gpus-per-node 8"),
    # --- expert parallelism (bench and profile share the checks: braid.runtime.expert_parallel's)
    "bench-ep-dense": (["braid.bench", "--preset", "tiny", "--ep", "2"], {}, "--ep 2 shards the experts of a mixture-of-experts model; this one is dense"),
    "bench-ep-experts": (["braid.bench", "--model", "qwen3-moe-tiny", "--ep", "3"], {}, "--ep 3 must divide the model's 4 experts"),
    "bench-ep-tp-experts": (["braid.bench", "--model", "qwen3-moe-tiny", "--ep", "4", "--tp", "2"], {},
                            "--ep 4 x --tp 2 (8) must divide the model's 4 experts"),
    "bench-ep-cpu-ranks": (["braid.bench", "--model", "qwen3-moe-tiny", "--ep", "2", "--pp", "33", "--device", "cpu"], {},
                           "tp x pp x ep = 66 ranks on the CPU: at most 64"),
    "bench-ep-gpus": (["braid.bench", "--model", "qwen3-moe-tiny", "--ep", "2", "--pp", "200", "--device", "cuda"], {},
                      "--device cuda with tp x pp x ep = 400 ranks needs 400 GPUs"),
    "bench-tp-max-ctas": (["braid.bench", "--tp-max-ctas", "65"], {}, "--tp-max-ctas 65: thread blocks per NCCL kernel, 1..64"),
    "bench-ep-max-ctas": (["braid.bench", "--ep-max-ctas", "-1"], {}, "--ep-max-ctas -1: thread blocks per NCCL kernel"),
    "bench-ep0": (["braid.bench", "--model", "qwen3-moe-tiny", "--ep", "0"], {}, "--ep must be a positive integer"),
    "bench-ep-ce-splits": (["braid.bench", "--model", "qwen3-moe-tiny", "--ep", "2", "--ep-backend", "nccl-ce"], {},
                           "--ep-backend nccl-ce exchanges equal blocks of rows: it needs --moe-dispatch padded"),
    "profile-ep-ce-ctas": (["braid.profile", "--model", "qwen3-moe-tiny", "--ep", "2", "--moe-dispatch", "padded",
                            "--ep-backend", "nccl-ce", "--ep-max-ctas", "8"], {},
                           "--ep-backend nccl-ce runs no thread blocks; --ep-max-ctas applies to nccl only"),
    "profile-ep-dense": (["braid.profile", "--model", "qwen2-7b", "--ep", "2"], {}, "this one is dense"),
    "profile-ep-experts": (["braid.profile", "--model", "qwen3-moe-tiny", "--ep", "8"], {}, "--ep 8 must divide the model's 4 experts"),
    "bench-moe-dispatch-unknown": (["braid.bench", "--model", "qwen3-moe-tiny", "--ep", "2", "--moe-dispatch", "ragged"], {},
                                   "--moe-dispatch ragged: unknown; valid: splits, padded"),
    "bench-moe-dispatch-padded-ep1": (["braid.bench", "--model", "qwen3-moe-tiny", "--moe-dispatch", "padded"], {},
                                      "it needs --ep 2 or more (got --ep 1)"),
    "profile-moe-dispatch-padded-tp": (["braid.profile", "--model", "qwen3-moe-tiny", "--ep", "2", "--tp", "2",
                                        "--moe-dispatch", "padded"], {}, "--moe-dispatch padded runs at tp=1 only"),
    # --- profile
    "profile-output-dir-missing": (["braid.profile", "-o", "missing/c.json"], {}, "does not exist"),
    "profile-pp0": (["braid.profile", "--pp", "0"], {}, "--pp must be a positive integer"),
    "profile-preset": (["braid.profile", "--preset", "huge"], {}, "unknown preset"),
    "profile-layers": (["braid.profile", "--layers-per-stage", "a"], {}, "--layers-per-stage"),
    "profile-iters": (["braid.profile", "--iters", "0"], {}, "--iters must be a positive integer"),
    # --- half-layer stages
    "bench-layers-not-half": (["braid.bench", "--pp", "2", "--layers-per-stage", "1,1,1.3,0.7"], {}, "whole or half number"),
    "bench-layers-half-total": (["braid.bench", "--pp", "2", "--layers-per-stage", "1,1,1,0.5"], {}, "add up to 3.5 layers"),
    "bench-peers-whole-layers": (["braid.bench", "--pp", "2", "--layers-per-stage", "0.5"], {},
                                 "the external baselines split whole layers"),
    "simulate-lighter-negative": (["braid.simulate", "--last-stage-lighter", "-1"], {}, "--last-stage-lighter"),
    # --- every input bounded: files by size and nesting before they are parsed, counts by what a real job needs
    "simulate-lighter-1e308": (["braid.simulate", "--last-stage-lighter", "1e308"], {}, "1e308: at most 1024 layers"),
    "simulate-seq-1e12": (["braid.simulate", "--seq", str(10**12)], {}, f"--seq {10**12}: at most 16,777,216"),
    "simulate-layers-huge": (["braid.simulate", "--layers", "100000"], {}, "--layers 100000: at most 1,024"),
    "simulate-costs-dev-zero": (["braid.simulate", "--costs", "/dev/zero"], {}, "/dev/zero: more than 16 MiB, the most a cost file"),
    "simulate-costs-too-large": (["braid.simulate", "--costs", "c.json"], {"c.json": _Sparse(17 << 20)},
                                 "c.json: 17,825,792 bytes, more than a cost file may hold (16 MiB)"),
    "simulate-costs-deep": (["braid.simulate", "--costs", "c.json"], {"c.json": _nested(100)},
                            "c.json: nested too deeply (100 levels; a cost file has at most 32)"),
    "simulate-torch-csv-million-rows": (["braid.simulate", "--torch-csv", "r.csv"], {"r.csv": "0F0\n" * 10**6},
                                        "r.csv: 1,000,000 rows: at most 1024"),
    "simulate-config-layers-huge": (["braid.simulate", "--model", "m"], {"m/config.json": _hf_config(num_hidden_layers=10**6)},
                                    "m/config.json: layers 1,000,000: at most 1,024"),
    "programs-csv-million-rows": (["braid.programs", "--import-torch-csv", "r.csv"], {"r.csv": "0F0\n" * 10**6},
                                  "1,000,000 rows: at most 1024"),
    "programs-csv-mb-huge": (["braid.programs", "--import-torch-csv", "m.csv"], {"m.csv": "0F99999999,1F0\n"},
                             "100,000,000 micro-batches: at most 16,384"),
    "programs-chunks-huge": (["braid.programs", "gpipe", "--chunks", "100000"], {}, "--chunks 100000: at most 64"),
    "viz-dev-zero": (["braid.viz", "/dev/zero", "-o", "o.html"], {}, "/dev/zero: more than 64 MiB, the most a trace file"),
    "viz-trace-too-large": (["braid.viz", "t.json", "-o", "o.html"], {"t.json": _Sparse(200 << 20)},
                            "t.json: 209,715,200 bytes, more than a trace file may hold (64 MiB)"),
    "bench-steps-1e20": (["braid.bench", "--steps", str(10**20)], {}, f"--steps {10**20}: at most 100,000,000"),
    "bench-layers-per-stage-huge": (["braid.bench", "--layers-per-stage", "100000"], {}, "100000: at most 1024 layers"),
    "profile-layers-per-stage-huge": (["braid.profile", "--layers-per-stage", "100000"], {}, "100000: at most 1024 layers"),
    "profile-layers-total": (["braid.profile", "--pp", "8", "--layers-per-stage", "100"], {}, "1600 layers over 16 stages"),
    "profile-seq-huge": (["braid.profile", "--seq", str(10**9)], {}, f"--seq {10**9}: at most"),
    "acceptance-budget-huge": (["braid.acceptance", "--out", "o", "--budget-s", "1e308"], {}, "--budget-s must be a number "
                               "of seconds in [1, 86400], got 1e+308"),
    "plan-config-layers-huge": (["braid.plan", "--model", "m", "--gpus", "2"], {"m/config.json": _hf_config(num_hidden_layers=10**6)},
                                "m/config.json: layers 1,000,000: at most 1,024"),
}


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("MASTER_PORT", None)
    return env


def _snapshot(d: Path) -> dict[str, bytes | tuple[int, int]]:
    """Every file under ``d``: its bytes, or (size, mtime) for a large one."""
    return {str(p.relative_to(d)): p.read_bytes() if p.stat().st_size < 1 << 20 else (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(d.rglob("*")) if p.is_file()}


def _write_inputs(d: Path, files: dict[str, str | bytes | _Sparse]) -> None:
    for fname, content in files.items():
        (d / fname).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, _Sparse):
            with open(d / fname, "wb") as f:
                f.truncate(content)
        else:
            (d / fname).write_bytes(content if isinstance(content, bytes) else content.encode())


def _main(module: str):
    """The ``main(argv)`` that ``python -m module`` runs."""
    mod = importlib.import_module(module)
    return mod.main if hasattr(mod, "main") else importlib.import_module(f"{module}.__main__").main


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, monkeypatch, capsys, caplog, name: str) -> None:
    argv, files, fragment = CASES[name]
    _write_inputs(tmp_path, files)
    before = _snapshot(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    caplog.set_level(logging.INFO)
    try:
        code = _main(argv[0])(argv[1:])
    except SystemExit as exit_:  # a parser's error
        code = exit_.code
    out = capsys.readouterr()
    err = out.err.strip().splitlines()
    assert code == 2, (code, out.err[-2000:])
    assert len(err) == 1, out.err[-2000:]
    assert not [r for r in caplog.records if r.levelno >= logging.INFO], caplog.text[-2000:]  # nothing logged beside it
    assert err[0].startswith(f"python -m {argv[0]}: error: "), err[0]
    assert fragment in err[0], err[0]
    assert _snapshot(tmp_path) == before  # no output, no partial or temporary file, inputs untouched


@pytest.mark.parametrize("name", ["simulate-costs-dev-zero", "programs-pp0", "viz-corrupt", "bench-mbs0", "profile-pp0",
                                  "plan-gpus-not-whole-nodes"])
def test_python_m_entry_is_one_line_and_exit_2(tmp_path: Path, name: str) -> None:
    """The same through ``python -m`` (a case per command): the line is all of stderr, no traceback."""
    argv, files, fragment = CASES[name]
    _write_inputs(tmp_path, files)
    before = _snapshot(tmp_path)
    out = subprocess.run([sys.executable, "-m", *argv], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=300)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(err) == 1 and "Traceback" not in out.stderr, (out.returncode, out.stderr[-2000:])
    assert err[0].startswith(f"python -m {argv[0]}: error: ") and fragment in err[0], err[0]
    assert _snapshot(tmp_path) == before


def test_simulate_names_the_stage_count_and_what_fits(tmp_path: Path) -> None:
    # 48 layers: --pp 32 runs the one-chunk schedules (the two-chunk ones are skipped with a note);
    # --pp 64 fits none of them
    out = subprocess.run([sys.executable, "-m", "braid.simulate", "--pp", "64", "--mbs", "256"], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    line = out.stderr.strip()
    assert "64 or 128 virtual stages" in line and "--pp 24 for 2 chunks per rank" in line and "raise --mbs" not in line, line


def test_programs_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    # far more output than a pipe buffer holds: the writer meets the closed pipe
    proc = subprocess.Popen([sys.executable, "-m", "braid.programs", "1f1b_i", "--pp", "8", "--mbs", "512",
                             "--json", "p.json"], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    rc = proc.wait(timeout=300)
    assert first.startswith(b"# 1f1b_i: p=8 m=512")
    assert rc == 0 and "Traceback" not in err and "BrokenPipe" not in err, err
    doc = json.loads((tmp_path / "p.json").read_text())  # written whole before the printing began
    assert doc["name"] == "1f1b_i" and len(doc["programs"]) == 8


# ----------------------------------------------------------------------------------------
# The example training scripts: every file is read before any process group starts

EXAMPLE_FILES: dict[str, tuple[list[str], dict[str, str | bytes | _Sparse], str]] = {
    # name -> (flags after examples/qwen2.py --device cpu --steps 1, input files, fragment naming the file and the fault);
    # the other bad data files are read in-process (tests/test_data.py), through the same PackedText
    "data-bad-json-line": (["--data", "d.jsonl", "--tokenizer", "tok"], {"d.jsonl": '{"text": "a b"}\n{"text": \n'},
                           "d.jsonl: line 2 is not valid JSON"),
    "data-garbage-parquet": (["--data", "d.parquet", "--tokenizer", "tok"], {"d.parquet": _BINARY},
                             "d.parquet: cannot be read as parquet"),
    "data-deep-line": (["--data", "d.jsonl", "--tokenizer", "tok"],  # pyarrow's reader would crash on it (a segfault)
                       {"d.jsonl": '{"text": "a b"}\n{"text": "c", "x": ' + _nested(100000) + "}\n"},
                       "d.jsonl: nested too deeply (100,001 levels; a JSON lines data file has at most 64)"),
    "tokenizer-config-list": (["--data", "good.jsonl", "--tokenizer", "listtok"], {"listtok/tokenizer_config.json": "[1, 2]"},
                              "listtok/tokenizer_config.json: expected a JSON object"),
    "tokenizer-too-large": (["--data", "good.jsonl", "--tokenizer", "listtok"], {"listtok/tokenizer.json": _Sparse(300 << 20)},
                            "listtok/tokenizer.json: 314,572,800 bytes, more than a tokenizer.json may hold (96 MiB)"),
    "hf-truncated-shard": (["--hf", "trunc"], {}, "trunc/model.safetensors: its header claims"),
    "hf-config-no-hidden": (["--hf", "nohid"], {}, "nohid/config.json: no 'hidden_size'"),
    "hf-more-layers-than-tensors": (["--hf", "morelayers"], {}, "'morelayers': checkpoint lacks 432 tensor(s)"),
    "save-hf-parent-missing": (["--save-hf", "nodir/sub/out"], {}, "--save-hf nodir/sub/out: directory 'nodir/sub' does not exist"),
    "config-dev-zero": (["--config", "/dev/zero"], {}, "--config /dev/zero: more than 1 MiB, the most a run file may hold"),
    "config-too-large": (["--config", "r.toml"], {"r.toml": _Sparse(2 << 20)}, "r.toml: 2,097,152 bytes, more than a run file"),
    "config-deep": (["--config", "r.toml"], {"r.toml": "tp = " + _nested(5000) + "\n"},
                    "r.toml: nested too deeply (5,000 levels; a run file has at most 8)"),
    "config-dotted-keys": (["--config", "r.toml"], {"r.toml": "a." * 20000 + "a = 1\n"},  # tomllib: quadratic time
                           "r.toml: nested too deeply (20,000 levels"),
    "ep-not-dividing-dp": (["--model", "qwen3-moe-tiny", "--ep", "2"], {}, "--ep 2 must divide the data-parallel ranks (dp=1)"),
    "hf-moe-expert-missing": (["--hf", "moe"], {},
                              "'moe': checkpoint lacks 1 tensor(s) of a qwen3_moe model, e.g. ['model.layers.1.mlp.experts.2.up_proj"),
}


@pytest.fixture(scope="module")
def example_inputs(tmp_path_factory) -> Path:
    """A tokenizer, a good jsonl file and a tiny checkpoint (plus damaged copies) to copy into each case."""
    pytest.importorskip("datasets")
    pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    import shutil

    from test_data import make_tokenizer, write_jsonl
    from test_input_files import _tiny_checkpoint

    root = tmp_path_factory.mktemp("example_inputs")
    make_tokenizer(root / "tok")
    write_jsonl(root / "good.jsonl")
    ckpt = _tiny_checkpoint(root / "hf")
    shutil.copytree(root / "tok", root / "listtok")
    shutil.copytree(ckpt, root / "trunc")
    shard = root / "trunc" / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    for name, change in (("nohid", {"hidden_size": None}), ("morelayers", {"num_hidden_layers": 40})):
        shutil.copytree(ckpt, root / name)
        cfg = json.loads((root / name / "config.json").read_text())
        cfg.update(change)
        (root / name / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    shutil.rmtree(ckpt)
    _moe_checkpoint_without_an_expert_tensor(root / "moe")
    return root


def _moe_checkpoint_without_an_expert_tensor(path: Path) -> None:
    import braid.hf as bhf
    from braid.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeModel
    from safetensors.torch import load_file, save_file

    bhf.save(Qwen3MoeModel(Qwen3MoeConfig(vocab_size=64, layers=2)), path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("name", list(EXAMPLE_FILES))
def test_example_bad_files_are_one_line_and_exit_2(example_inputs: Path, tmp_path: Path, monkeypatch, capsys, qwen2_main,
                                                   name: str) -> None:
    """In-process: every file is read before any process group (the torchrun case below covers the launch)."""
    import shutil

    flags, files, fragment = EXAMPLE_FILES[name]
    shutil.copytree(example_inputs, tmp_path, dirs_exist_ok=True)
    _write_inputs(tmp_path, files)
    before = _snapshot(tmp_path)
    monkeypatch.chdir(tmp_path)
    code = qwen2_main(["--device", "cpu", "--steps", "1", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err[-20:]
    assert len(err) == 1 and err[0].startswith("qwen2.py: error: ") and fragment in err[0], err
    assert _snapshot(tmp_path) == before


@pytest.mark.slow
def test_the_vlm_example_refuses_a_language_model_checkpoint(example_inputs: Path, tmp_path: Path) -> None:
    import shutil

    from test_input_files import _tiny_checkpoint

    _tiny_checkpoint(tmp_path / "lm")
    from forkserver import shared_bin

    # forked from the session's fork server: the script's own process without an interpreter start-up
    out = subprocess.run([str(shared_bin() / "python"), str(ROOT / "examples" / "qwen2_vl.py"), "--device", "cpu", "--steps", "1",
                          "--hf", "lm"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-2000:]
    assert "--hf lm: config.json describes a language model" in out.stderr and "examples/lm.py" in out.stderr
    shutil.rmtree(tmp_path / "lm")


@pytest.mark.slow
def test_a_damaged_checkpoint_under_torchrun_is_one_line_from_rank_0(example_inputs: Path, tmp_path: Path) -> None:
    """Every rank reads the checkpoint before any process group and reaches the same verdict: the
    line appears once, no rank prints a traceback, every rank exits 2, and torchrun's summary names the line as the root cause."""
    import shutil
    import socket

    shutil.copytree(example_inputs, tmp_path, dirs_exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
                          str(ROOT / "examples" / "qwen2.py"), "--device", "cpu", "--steps", "1", "--pp", "2", "--hf", "trunc"],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert "SafetensorError" not in text, text[-3000:]
    from test_examples import _torchrun_summary_reads

    _torchrun_summary_reads(text, "qwen2.py: error: trunc/model.safetensors: its header claims", 2)
