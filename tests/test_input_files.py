"""Cost and trace files from outside: every malformed one is one CostFileError / TraceError
naming the file and the field, and every file braid writes itself reads back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from braid.core.braiding import ChunkSpec
from braid.cost.costs import CostFileError, Layout, analytic_costs, costs_from_dict, read_costs, write_costs
from braid.cost.hardware import HARDWARE, get_hardware
from braid.cost.catalog import MODELS, get_model
from braid.io.trace import Event, Trace, TraceError, dump_traces, load_traces

BASE = {"T_F": 1.0, "T_B": 1.0, "T_W": 1.0, "T_AR": 0.25}
UNITS = ("embed", "pre_attn", "attn", "pre_mlp", "mlp", "head")
LAYOUT, SPECS = Layout(1, 1, 1), {(0, 0): ChunkSpec(1, embed=True, head=True)}


@pytest.mark.parametrize("change,match", [
    ({"unit_split": {"F": {u: "nan" for u in UNITS}}}, r"unit_split\['F'\]\['embed'\] must be a number"),
    ({"unit_split": {"F": {u: True for u in UNITS}}}, r"unit_split\['F'\]\['embed'\] must be a number"),
    ({"unit_split": {"F": [1, 2]}}, r"unit_split\['F'\] must be an object"),
    ({"unit_split": [1]}, "'unit_split' must be an object"),
    ({"unit_workspace": "x"}, "'unit_workspace' must be an object"),
    ({"pcie_bytes_per_s": 0}, "'pcie_bytes_per_s' must be a finite number in"),
    ({"chunks": [1]}, "'chunks' must be an object"),
    ({"chunks": {"0": 5}}, r"chunks\['0'\] must be an object"),
    ({"meta": "text"}, "'meta' must be an object"),
    ({"layout": 3}, "'layout' must be an object"),
    ({"p2p_over_pcie": "yes"}, "'p2p_over_pcie' must be true or false"),
    ({"T_F": 1e308}, "'T_F' must be a finite number in"),
    ({"chunks": {"0": {"T_B": 1e308}}}, "'T_B' must be a finite number in"),
    ({"T_F": "1"}, "'T_F' must be a finite number"),
    ({"M_a_bytes": 1e300}, "'M_a_bytes' must be a finite number"),
    ({"samples_per_microbatch": 1.5}, "'samples_per_microbatch' must be a whole number"),
    ({"samples_per_microbatch": 0}, "'samples_per_microbatch' must be a finite number in"),
    ({"peak_flops": -1}, "'peak_flops' must be a finite number in"),
    ({"ar_slowdown": 0.5}, "'ar_slowdown' must be a finite number in"),
    ({"unit_workspace": {"attn": float("inf")}}, "'attn' must be a finite number"),
])
def test_bad_cost_fields(change: dict, match: str) -> None:
    with pytest.raises(CostFileError, match=match):
        costs_from_dict({**BASE, **change}, LAYOUT, SPECS)


@pytest.mark.parametrize("text,match", [
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
    ("[1, 2]", "expected a JSON object"),
    ('{"T_F": 1,', "not valid JSON"),
    ("1" * 5000, "not valid JSON"),  # an integer literal past Python's digit limit
    (b"\xff\xfe{}", "not valid JSON"),
])
def test_unreadable_cost_files(tmp_path: Path, text: str | bytes, match: str) -> None:
    p = tmp_path / "c.json"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(CostFileError, match=match) as info:
        read_costs(p, LAYOUT, SPECS)
    assert str(p) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_preset_cost_model_reads_back(tmp_path: Path, model: str) -> None:
    """The ranges admit every figure braid itself produces (all presets, on every hardware)."""
    m = get_model(model)
    # p=4, v=2 where the model has layers enough for 8 stages (smaller presets: fewer ranks)
    lay = Layout(2, 4 if m.layers >= 16 else 2 if m.layers >= 8 else 1, 2, "v")
    for hw in HARDWARE:
        costs = analytic_costs(m, get_hardware(hw), lay)
        write_costs(costs, tmp_path / f"{hw}.json")
        back = read_costs(tmp_path / f"{hw}.json", lay, {k: c.spec for k, c in costs.chunks.items()})
        key = (lay.p - 1, 0)
        assert back.chunks[key].total("f") == pytest.approx(costs.chunks[key].total("f"))
        assert back.pcie_bytes_per_s == costs.pcie_bytes_per_s and back.peak_flops == costs.peak_flops


# ----------------------------------------------------------------------------------------
# Traces
# ----------------------------------------------------------------------------------------
EVENT = {"rank": 0, "lane": "compute", "name": "F0c0", "kind": "F", "start": 0.0, "dur": 1.0}


def _write(tmp_path: Path, trace: object) -> Path:
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"format": "braid-trace/1", "traces": [trace]}))
    return p


@pytest.mark.parametrize("trace,match", [
    ({"meta": "x", "events": [EVENT]}, "'meta' must be an object"),
    ({"meta": [1], "events": [EVENT]}, "'meta' must be an object"),
    ({"events": [EVENT], "memory": [1]}, "'memory' must be an object"),
    ({"events": [EVENT], "memory": {"a": [[0, 1]]}}, "memory must map a rank"),
    ({"events": [EVENT], "memory": {"-1": [[0, 1]]}}, "memory must map a rank"),
    ({"events": [EVENT], "memory": {"0": 5}}, "memory must map a rank"),
    ({"events": [EVENT], "memory": {"0": [[0, 1, 2]]}}, "memory series of rank '0'"),
    ({"events": [EVENT], "memory": {"0": [["nan", 1]]}}, "memory series of rank '0'"),
    ({"events": [EVENT], "memory": {"0": [[0.0, 1.5]]}}, "memory series of rank '0'"),
    ({"events": [{**EVENT, "rank": "0"}]}, "event 0 has rank '0'"),
    ({"events": [{**EVENT, "rank": True}]}, "event 0 has rank True"),
    ({"events": [{**EVENT, "rank": -2}]}, "event 0 has rank -2"),
    ({"events": [{k: v for k, v in EVENT.items() if k != "kind"}]}, "event 0 does not match the schema"),
    ({"events": [{**EVENT, "extra": 1}]}, "event 0 does not match the schema"),
    ({"events": ["F0c0"]}, "event 0 must be an object"),
    ({"events": [{**EVENT, "name": 3}]}, "event 0 has name 3"),
    ({"events": [{**EVENT, "mb": 1.5}]}, "event 0 has mb 1.5"),
    ({"events": [{**EVENT, "peer": "1"}]}, "event 0 has peer '1'"),
    ({"events": [{**EVENT, "unit": 4}]}, "event 0 has unit 4"),
    ({"events": [{**EVENT, "dur": -1.0}]}, "non-negative dur"),
    ({"events": [{**EVENT, "start": True}]}, "finite numeric start"),
])
def test_bad_trace_fields(tmp_path: Path, trace: dict, match: str) -> None:
    with pytest.raises(TraceError, match=match):
        load_traces(_write(tmp_path, trace))


@pytest.mark.parametrize("text,match", [
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
    ('{"format": "braid-trace/1", "traces": [', "not valid JSON"),
    ('{"format": "braid-trace/1", "traces": []}', "non-empty list"),
    ("[]", "not a braid trace"),
])
def test_unreadable_trace_files(tmp_path: Path, text: str, match: str) -> None:
    p = tmp_path / "t.json"
    p.write_text(text)
    with pytest.raises(TraceError, match=match):
        load_traces(p)


def test_written_traces_read_back(tmp_path: Path) -> None:
    t = Trace({"schedule": "x"}, [Event(1, "p2p", "SEND", "SEND", 0.5, 0.25, mb=2, chunk=1, peer=0)], {1: [(0.0, 10)]})
    dump_traces([t], tmp_path / "t.json")
    (back,) = load_traces(tmp_path / "t.json")
    assert back.events == t.events and back.memory == t.memory and back.meta == t.meta
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temporary file left beside it
