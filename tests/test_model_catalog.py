"""One preset list (braid.cost.catalog) for the simulator, the profiler and the examples.

Canonical names ``<family>-<size>``; the examples' short names resolve with a family prefix;
``braid.simulate --model`` also takes a Hugging Face ``config.json`` (or its directory).
"""

from __future__ import annotations

import json

import pytest

from braid.models.llama import LlamaConfig
from braid.models.qwen2 import Qwen2Config, qwen2_to_hf
from braid.cost.catalog import MODELS, get_model
from braid.models.shapes import decoder_config
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
    from braid.measure.config import PRESETS

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


def test_vision_language_presets_are_the_catalogs() -> None:
    from braid.models.qwen2_vl import LM_PRESETS, PRESETS, vlm_preset

    assert get_model("tiny", prefix="qwen2-vl-") is MODELS["qwen2-vl-tiny"]
    for short in ("tiny", "small", "7b", "15b"):
        cfg, shape = PRESETS[short], MODELS[f"qwen2-vl-{short}"]
        assert cfg == vlm_preset(short) == vlm_preset(f"qwen2-vl-{short}") and LM_PRESETS[short] == cfg.lm
        assert cfg.lm == decoder_config(shape) and (cfg.vit.hidden, cfg.vit.layers, cfg.vit.ffn) == (
            shape.vit.hidden, shape.vit.layers, shape.vit.ffn)
    q25 = vlm_preset("qwen2.5-vl-7b")
    assert q25.vit.kind == "qwen2_5_vl" and q25.vit.full_attention_blocks == (7, 15, 23, 31) and q25.vit.window == 112
    assert q25.mrope_section == (16, 24, 24) and q25.image_token_id == 151655
    assert vlm_preset("qwen2.5-vl-3b").tie_embeddings and vlm_preset("2b").tie_embeddings
    # published sizes (norms and biases aside)
    for name, n in (("qwen2-vl-2b", 2.21e9), ("qwen2-vl-7b", 8.29e9), ("qwen2.5-vl-3b", 3.75e9), ("qwen2.5-vl-7b", 8.29e9)):
        assert get_model(name).params() == pytest.approx(n, rel=0.01), name
    with pytest.raises(ValueError, match="unknown model preset 'qwen2-7b'"):
        vlm_preset("qwen2-7b")  # an LM, no vision tower


def test_vlm_flops_are_the_cost_models() -> None:
    from braid.cost.costs import model_forward_flops
    from braid.models.qwen2_vl import vlm_preset, vlm_train_flops_per_sample

    for name in ("qwen2-vl-7b", "qwen2.5-vl-7b"):
        cfg = vlm_preset(name)
        seq = cfg.visual_tokens + 2 + 512
        assert vlm_train_flops_per_sample(cfg, 512) == 3 * model_forward_flops(get_model(name).with_(seq=seq))
    # the SwiGLU tower of Qwen2.5-VL (ffn 3420) against Qwen2-VL's fc1/fc2 (ffn 5120), same LM
    assert vlm_train_flops_per_sample(vlm_preset("qwen2.5-vl-7b"), 512) != vlm_train_flops_per_sample(vlm_preset("7b"), 512)


def test_simulate_runs_a_qwen25_vl_preset_and_its_config_json(tmp_path) -> None:
    from braid.models.hf_qwen2_vl import config_to_hf
    from braid.models.qwen2_vl import vlm_preset

    out = tmp_path / "r.json"
    args = ["--pp", "4", "--tp", "4", "--mbs", "8", "--schedule", "braided_v", "--json", str(out)]
    assert main([*args, "--model", "qwen2.5-vl-7b"]) == 0
    preset = json.loads(out.read_text())["schedules"]["braided_v"]["step_time_s"]
    assert preset > 0
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config_to_hf(vlm_preset("qwen2.5-vl-7b"))))
    assert main([*args, "--model", str(tmp_path / "ckpt")]) == 0
    assert json.loads(out.read_text())["schedules"]["braided_v"]["step_time_s"] == preset
