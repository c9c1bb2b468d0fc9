"""``examples/qwen2.py --hf DIR ... --save-hf OUT``: train from a transformers-written checkpoint under
torchrun (pp=2, each rank reading its stages), match the unsplit model (--reference), and
export a checkpoint that transformers loads with the trained weights."""

from __future__ import annotations

import json

import pytest
import torch

from test_examples import LLM, _ok, _torchrun, _metrics

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


@pytest.mark.slow
def test_train_from_hf_checkpoint_and_export(tmp_path) -> None:
    import braid.hf as bhf

    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "start", max_shard_size="30KB")
    out, metrics = tmp_path / "trained", tmp_path / "m.jsonl"
    proc = _torchrun(2, LLM, "--hf", str(tmp_path / "start"), "--pp", "2", "--schedule", "1f1b", "--steps", "3", "--seq", "16",
                     "--device", "cpu", "--reference", "--save-hf", str(out), "--metrics", str(metrics))
    _ok(proc)
    assert "max rel diff" in proc.stdout and f"--hf {tmp_path / 'start'}" in proc.stdout
    assert [m["step"] for m in _metrics(metrics)] == [1, 2, 3]
    start, trained = bhf.load(tmp_path / "start"), bhf.load(out)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert not torch.equal(start.embed_tokens.weight, trained.embed_tokens.weight)  # it trained
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf_logits = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
        torch.testing.assert_close(hf_logits, trained.logits(ids), rtol=0, atol=1e-5)
