"""Bad input to every command line: one line on stderr, exit code 2, no traceback, no file left behind.

Each case runs the real command (``python -m ...``) in a fresh directory holding only its
input files; afterwards the directory must hold exactly those files, unchanged (no
output, no partial or temporary file). The line must say what is wrong (a fragment of it
is checked). None of these cases starts a distributed job: the checks come first.
"""

from __future__ import annotations

import json
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


GOOD_TRACE = _trace()
_BINARY = bytes(range(128, 256)) * 8
# name -> (argv after "python -m", input files {name: text}, fragment of the error line)
CASES: dict[str, tuple[list[str], dict[str, str | bytes], str]] = {
    # --- simulate
    "simulate-pp0": (["braid.simulate", "--pp", "0"], {}, "--pp must be a positive integer"),
    "simulate-budget-nan": (["braid.simulate", "--offload-budget", "nan"], {}, "--offload-budget"),
    "simulate-alpha": (["braid.simulate", "--offload-alpha", "2"], {}, "--offload-alpha"),
    "simulate-model": (["braid.simulate", "--model", "nope"], {}, "unknown model 'nope'"),
    "simulate-unknown-flag": (["braid.simulate", "--bogus"], {}, "unrecognized arguments"),
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
}


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("MASTER_PORT", None)
    return env


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, name: str) -> None:
    argv, files, fragment = CASES[name]
    for fname, text in files.items():
        (tmp_path / fname).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / fname).write_bytes(text if isinstance(text, bytes) else text.encode())
    before = _snapshot(tmp_path)
    out = subprocess.run([sys.executable, "-m", *argv], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=300)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr
    assert len(err) == 1, out.stderr
    assert err[0].startswith(f"python -m {argv[0]}: error: "), err[0]
    assert fragment in err[0], err[0]
    assert _snapshot(tmp_path) == before  # no output, no partial or temporary file, inputs untouched


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

EXAMPLE_FILES: dict[str, tuple[list[str], dict[str, str | bytes], str]] = {
    # name -> (flags after examples/qwen2.py --device cpu --steps 1, input files, fragment naming the file and the fault);
    # the other bad data files are read in-process (tests/test_data.py), through the same PackedText
    "data-bad-json-line": (["--data", "d.jsonl", "--tokenizer", "tok"], {"d.jsonl": '{"text": "a b"}\n{"text": \n'},
                           "d.jsonl: line 2 is not valid JSON"),
    "data-garbage-parquet": (["--data", "d.parquet", "--tokenizer", "tok"], {"d.parquet": _BINARY},
                             "d.parquet: cannot be read as parquet"),
    "tokenizer-config-list": (["--data", "good.jsonl", "--tokenizer", "listtok"], {"listtok/tokenizer_config.json": "[1, 2]"},
                              "listtok/tokenizer_config.json: expected a JSON object"),
    "hf-truncated-shard": (["--hf", "trunc"], {}, "trunc/model.safetensors: its header claims"),
    "hf-config-no-hidden": (["--hf", "nohid"], {}, "nohid/config.json: no 'hidden_size'"),
    "save-hf-parent-missing": (["--save-hf", "nodir/sub/out"], {}, "--save-hf nodir/sub/out: directory 'nodir/sub' does not exist"),
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
    shutil.copytree(ckpt, root / "nohid")
    cfg = json.loads((root / "nohid" / "config.json").read_text())
    del cfg["hidden_size"]
    (root / "nohid" / "config.json").write_text(json.dumps(cfg))
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


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXAMPLE_FILES))
def test_example_bad_files_are_one_line_and_exit_2(example_inputs: Path, tmp_path: Path, name: str) -> None:
    import shutil

    flags, files, fragment = EXAMPLE_FILES[name]
    shutil.copytree(example_inputs, tmp_path, dirs_exist_ok=True)
    for fname, text in files.items():
        (tmp_path / fname).write_bytes(text if isinstance(text, bytes) else text.encode())
    before = _snapshot(tmp_path)
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "qwen2.py"), "--device", "cpu", "--steps", "1", *flags],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert len(err) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert err[0].startswith("qwen2.py: error: ") and fragment in err[0], err[0]
    assert _snapshot(tmp_path) == before


@pytest.mark.slow
def test_the_vlm_example_refuses_a_language_model_checkpoint(example_inputs: Path, tmp_path: Path) -> None:
    import shutil

    from test_input_files import _tiny_checkpoint

    _tiny_checkpoint(tmp_path / "lm")
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "qwen2_vl.py"), "--device", "cpu", "--steps", "1", "--hf", "lm"],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-2000:]
    assert "--hf lm: config.json describes a language model" in out.stderr and "examples/qwen2.py" in out.stderr
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
