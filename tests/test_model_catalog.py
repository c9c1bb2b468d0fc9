"""One preset list (braid.models_catalog) for the simulator, the profiler and the examples.

Canonical names ``<family>-<size>``; the examples' short names resolve with a family prefix;
``braid.simulate --model`` also takes a Hugging Face ``config.json`` (or its directory).
"""

from __future__ import annotations

import json

import pytest

from braid.models.llama import LlamaConfig
from braid.models.qwen2 import Qwen2Config, qwen2_to_hf
from braid.models_catalog import MODELS, decoder_config, get_model
from braid.simulate import main


def test_short_and_canonical_names_are_one_preset() -> None:
    assert get_model("7b") is get_model("qwen2-7b") is MODELS["qwen2-7b"]
    assert get_model("15b", prefix="qwen2-vl-") is MODELS["qwen2-vl-15b"]
    assert get_model("15b").vit is None and get_model("15b").layers == get_model("qwen2-vl-15b").layers
    with pytest.raises(ValueError, match=r"unknown model 'llama'; valid names: .*qwen2-7b.*\(or short: .*7b.*config\.json"):
        get_model("llama")


def test_presets_become_runnable_configs_of_their_family() -> None:
    cfg = decoder_config(get_model("tiny"))
    assert cfg == Qwen2Config(vocab_size=32, hidden=32, layers=4, heads=4, kv_heads=2, ffn=64)
    llama = decoder_config(get_model("llama3-8b"), layers=2)
    assert isinstance(llama, LlamaConfig) and llama.layers == 2 and llama.hidden == 4096
    assert decoder_config(get_model("qwen2-1.5b")).tie_embeddings
    tied = get_model("qwen2-1.5b")
    assert tied.params() == pytest.approx(1.54e9, rel=0.02)  # Qwen2-1.5B: 1.54B with its tied head


def test_profile_presets_take_their_shapes_from_the_catalog() -> None:
    from braid.profile import PRESETS

    for name, preset in (("7b-layer", "qwen2-7b"), ("small", "qwen2-small"), ("tiny", "qwen2-toy")):
        want = get_model(preset)
        got = PRESETS[name]
        assert (got.hidden, got.heads, got.kv_heads, got.ffn, got.layers) == (want.hidden, want.heads, want.kv_heads, want.ffn, 1)


def test_simulate_reads_a_hf_config(tmp_path, capsys) -> None:
    cfg = Qwen2Config(vocab_size=151936, hidden=1536, layers=28, heads=12, kv_heads=2, ffn=8960, tie_embeddings=True)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(qwen2_to_hf(cfg)))
    out = tmp_path / "r.json"
    for where in (tmp_path / "ckpt" / "config.json", tmp_path / "ckpt"):
        assert main(["--pp", "2", "--mbs", "4", "--model", str(where), "--schedule", "1f1b_i", "--json", str(out)]) == 0
        doc = json.loads(out.read_text())
        assert doc["config"]["model"] == "ckpt" and doc["schedules"]["1f1b_i"]["step_time_s"] > 0
    # the same shape as the preset simulates to the same step time
    assert main(["--pp", "2", "--mbs", "4", "--model", "1.5b", "--schedule", "1f1b_i", "--json", str(out)]) == 0
    preset = json.loads(out.read_text())["schedules"]["1f1b_i"]["step_time_s"]
    assert preset == doc["schedules"]["1f1b_i"]["step_time_s"]
    capsys.readouterr()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(SystemExit) as err:
        main(["--model", str(tmp_path / "bad" / "config.json")])
    assert err.value.code == 2
    msg = capsys.readouterr().err.strip()
    assert len(msg.splitlines()) == 1 and "unsupported HF model_type 'gpt2'" in msg
