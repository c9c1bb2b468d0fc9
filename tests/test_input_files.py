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


# ----------------------------------------------------------------------------------------
# Hugging Face checkpoints: every damaged file is a ValueError naming it (braid.hf's documented type)

def _tiny_checkpoint(directory: Path, shard_size: str = "5GB") -> Path:
    import torch

    import braid.hf
    from braid.models.build import meta_model
    from braid.models.registry import get_family
    from braid.models.shapes import decoder_config

    preset = get_model("qwen2-tiny")
    model = meta_model(get_family(preset.family).model_cls, decoder_config(preset), seed=0, std=0.02,
                       device=torch.device("cpu"))
    from braid.models.build import materialize

    return braid.hf.save(materialize(model), directory, max_shard_size=shard_size)


def _shard_edit(path: Path, edit) -> None:
    """Rewrite a safetensors file's JSON header with ``edit(header)`` (data bytes unchanged)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


def _set_offsets(header: dict) -> None:
    key = next(k for k in header if k != "__metadata__")
    header[key]["data_offsets"] = [0, 10**12]


def _config_edit(change: dict, drop: str | None = None):
    def run(ckpt: Path) -> Path:
        cfg = json.loads((ckpt / "config.json").read_text())
        cfg.update(change)
        if drop:
            cfg.pop(drop)
        (ckpt / "config.json").write_text(json.dumps(cfg))
        return ckpt / "config.json"
    return run


def _first_shard(ckpt: Path) -> Path:
    return sorted(ckpt.glob("*.safetensors"))[0]


def _truncate(size: int | None = None, by: int | None = None):
    def run(ckpt: Path) -> Path:
        f = _first_shard(ckpt)
        raw = f.read_bytes()
        f.write_bytes(raw[:size] if size is not None else raw[:-by])
        return f
    return run


def _garbage(ckpt: Path) -> Path:
    f = _first_shard(ckpt)
    f.write_bytes(bytes(range(256)) * 64)
    return f


def _huge_header(ckpt: Path) -> Path:
    f = _first_shard(ckpt)
    raw = f.read_bytes()
    f.write_bytes((10**15).to_bytes(8, "little") + raw[8:])
    return f


def _offsets(ckpt: Path) -> Path:
    f = _first_shard(ckpt)
    _shard_edit(f, _set_offsets)
    return f


def _missing_shard(ckpt: Path) -> Path:
    f = _first_shard(ckpt)
    f.unlink()
    return ckpt / "model.safetensors.index.json"


def _index_not_json(ckpt: Path) -> Path:
    (ckpt / "model.safetensors.index.json").write_text('{"weight_map": ')
    return ckpt / "model.safetensors.index.json"


def _index_wrong_shard(ckpt: Path) -> Path:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    key = next(k for k, v in index["weight_map"].items() if v == shards[0])
    index["weight_map"][key] = shards[1]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    return ckpt / "model.safetensors.index.json"


HF_DAMAGE = {
    "truncated-header": (_truncate(size=100), "header claims"),
    "truncated-data": (_truncate(by=100), "not a valid safetensors file"),
    "empty-shard": (_truncate(size=0), "too short for a safetensors file"),
    "garbage-shard": (_garbage, "header claims"),
    "header-1PB": (_huge_header, "header claims 1,000,000,000,000,000 bytes"),
    "offsets-out-of-range": (_offsets, "not a valid safetensors file"),
    "index-names-missing-shard": (_missing_shard, "names shard"),
    "index-not-json": (_index_not_json, "not valid JSON"),
    "index-maps-to-wrong-shard": (_index_wrong_shard, "which does not hold it"),
    "config-no-hidden-size": (_config_edit({}, drop="hidden_size"), "no 'hidden_size'"),
    "config-negative-layers": (_config_edit({"num_hidden_layers": -2}), "layers must be a positive integer"),
    "config-layers-text": (_config_edit({"num_hidden_layers": "many"}), "config.json"),
    "config-model-type-list": (_config_edit({"model_type": ["qwen2"]}), "model_type must be a string"),
    "config-layers-huge": (_config_edit({"num_hidden_layers": 10**6}), "layers 1,000,000: at most 1,024"),
    "config-vocab-huge": (_config_edit({"vocab_size": 10**9}), "vocab_size 1,000,000,000: at most 8,388,608"),
    # valid on its own, but the files hold 4 layers: refused before a tensor is read (was a KeyError per rank)
    "fewer-tensors-than-config-layers": (lambda d: (_config_edit({"num_hidden_layers": 40})(d), d)[1],
                                         "checkpoint lacks 432 tensor(s) of the qwen2 model its config.json describes"),
}


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    pytest.importorskip("safetensors")
    pytest.importorskip("huggingface_hub")
    return _tiny_checkpoint(tmp_path_factory.mktemp("hf") / "ckpt", shard_size="60KB")


@pytest.mark.parametrize("case", list(HF_DAMAGE))
def test_damaged_hf_checkpoints_are_a_value_error_naming_the_file(tiny_ckpt: Path, tmp_path: Path, case: str) -> None:
    import shutil

    import braid.hf
    from braid.models.shapes import from_hf_config

    assert len(list(tiny_ckpt.glob("*.safetensors"))) > 1  # sharded: the index is read
    ckpt = Path(shutil.copytree(tiny_ckpt, tmp_path / "ckpt"))
    damage, fragment = HF_DAMAGE[case]
    bad_file = damage(ckpt)
    for load in (braid.hf.load, braid.hf.load_meta):
        with pytest.raises(ValueError) as info:
            load(ckpt)
        msg = str(info.value)
        assert str(bad_file) in msg and fragment in msg and "\n" not in msg, msg
    if case.startswith("config"):  # the cost model reads the same config.json (braid.simulate/plan --model DIR)
        with pytest.raises(ValueError, match="config.json"):
            from_hf_config(ckpt)


def test_an_undamaged_tiny_checkpoint_loads(tiny_ckpt: Path) -> None:
    import braid.hf

    model = braid.hf.load(tiny_ckpt)
    assert model.cfg.layers == get_model("qwen2-tiny").layers


# ----------------------------------------------------------------------------------------
# braid.io.inputs itself

@pytest.mark.parametrize("content,match", [
    (b"\xff\xfe\x00binary", "not a UTF-8 text file"),
    (None, "no such"),
])
def test_read_text_names_the_file(tmp_path: Path, content: bytes | None, match: str) -> None:
    from braid.io.inputs import InputFileError, read_text

    p = tmp_path / "f.csv"
    if content is not None:
        p.write_bytes(content)
    with pytest.raises(InputFileError, match=match) as info:
        read_text(p, "torch schedule CSV")
    assert str(p) in str(info.value)
    with pytest.raises(InputFileError, match="is a directory"):
        read_text(tmp_path)


def test_read_json_checks_the_top_level_type(tmp_path: Path) -> None:
    from braid.io.inputs import InputFileError, read_json

    p = tmp_path / "tokenizer_config.json"
    p.write_text("[1, 2]")
    with pytest.raises(InputFileError, match="expected a JSON object, got list"):
        read_json(p, "tokenizer_config.json")
    assert read_json(p, expect=list) == [1, 2]


@pytest.mark.parametrize("text,syntax,depth", [
    (b'{"a": [1, [2, "[[[[{{"]], "b": "\\"[["}', "json", 3),  # brackets in strings (escaped quotes too) are text
    (b"[" * 1000 + b"]" * 1000, "json", 1000),
    (b'{"a": [[1]]}\n{"b": [[[[2]]]]}\n[[\n{}\n', "jsonl", 5),  # per line: an unclosed line does not deepen the next
    (b'a = [[1], "[[[["]  # [[[[[[\n[t]\nb = \'[[[\'\nc = """\n[[[[\n"""', "toml", 2),
    (b"a.b.c.d = 1\nx = [1.5, 2.5]\n", "toml", 3),  # a dotted key nests, the dots of numbers do not
    (b"", "json", 0),
])
def test_nesting_is_counted_outside_strings(text: bytes, syntax: str, depth: int) -> None:
    from braid.io.inputs import nesting

    assert nesting(text, syntax) == depth


def test_a_trace_file_holds_at_most_max_trace_events(tmp_path: Path, monkeypatch) -> None:
    """A trace of more events than a command reads is refused after the JSON, before any event is checked
    (the file's size limit bounds the JSON itself)."""
    import braid.io.trace as trace

    monkeypatch.setattr(trace, "MAX_TRACE_EVENTS", 3)
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"format": "braid-trace/1", "traces": [{"events": [EVENT] * 2}, {"events": [EVENT] * 2}]}))
    with pytest.raises(TraceError, match=r"t.json: 4 events, more than a trace file may hold \(3\)"):
        load_traces(p)
    monkeypatch.setattr(trace, "MAX_TRACE_EVENTS", 4)
    assert [len(t.events) for t in load_traces(p)] == [2, 2]


def test_a_run_file_from_a_pipe_or_device_is_read_to_its_limit(tmp_path: Path) -> None:
    """A file without a size (a device) is read one byte past the limit, never to its end."""
    from braid.io.inputs import InputFileError, read_text
    from braid.io.limits import FileLimit

    with pytest.raises(InputFileError, match="/dev/zero: more than 1,000 bytes, the most a run file may hold"):
        read_text("/dev/zero", "run file", FileLimit(1000))
    p = tmp_path / "r.toml"
    p.write_bytes(b"x" * 1000)
    assert len(read_text(p, "run file", FileLimit(1000))) == 1000  # the limit itself is allowed
