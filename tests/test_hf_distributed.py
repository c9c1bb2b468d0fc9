"""braid.hf.save_chunks: a pipelined, tensor-parallel model saved stage by stage is the single-device model (gloo)."""

from __future__ import annotations

import json

import pytest

import model_cases as cases

pytest.importorskip("safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("family,tie,pp,tp,schedule", [
    ("qwen2", True, 2, 1, "1f1b"),       # embedding on rank 0, tied head on rank 1 (not written twice)
    ("llama", False, 2, 1, "braided_v"),  # V placement: first and last stage on rank 0
    ("qwen2", False, 1, 2, "gpipe"),      # TP shards joined: column, row and vocabulary splits
])
def test_save_chunks_loads_back_as_the_single_device_model(pools, tmp_path, family, tie, pp, tp, schedule) -> None:
    out = tmp_path / "ckpt"
    assert pools(pp * tp).run(cases.save_distributed, family, tie, pp, tp, schedule, str(out), timeout_s=200) == [True] * (pp * tp)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f"model-{k:05d}-of-{pp:05d}.safetensors" for k in range(1, pp + 1)]
    assert ("lm_head.weight" in index["weight_map"]) == (not tie)
    assert not list(tmp_path.glob(".ckpt.partial"))
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}
    assert len(set(modes.values())) == 1, modes  # the shards readable like the index and config.json
    transformers = pytest.importorskip("transformers")
    import torch

    import braid.hf as bhf

    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf_logits = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
        torch.testing.assert_close(hf_logits, bhf.load(out).logits(ids), rtol=0, atol=1e-5)
