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


GOOD_TRACE = _trace()
# name -> (argv after "python -m", input files {name: text}, fragment of the error line)
CASES: dict[str, tuple[list[str], dict[str, str], str]] = {
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
    "bench-no-run-fits": (["braid.bench", "--pp", "2", "--chunks", "1", "--schedule", "braided_v"], {}, "no run fits"),
    "bench-peak-flops": (["braid.bench", "--peak-flops", "inf"], {}, "--peak-flops"),
    "bench-trace-dir-is-file": (["braid.bench", "--trace-dir", "m.json"], {"m.json": "{}"}, "not a directory"),
    # --- profile
    "profile-output-dir-missing": (["braid.profile", "-o", "missing/c.json"], {}, "does not exist"),
    "profile-pp0": (["braid.profile", "--pp", "0"], {}, "--pp must be a positive integer"),
    "profile-preset": (["braid.profile", "--preset", "huge"], {}, "unknown preset"),
    "profile-layers": (["braid.profile", "--layers-per-stage", "a"], {}, "--layers-per-stage"),
    "profile-iters": (["braid.profile", "--iters", "0"], {}, "--iters must be a positive integer"),
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
        (tmp_path / fname).write_text(text)
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
