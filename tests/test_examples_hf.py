"""``examples/qwen2.py`` / ``examples/qwen2_vl.py --hf DIR ... --save-hf OUT``: train from a
transformers-written checkpoint under torchrun (each rank reading its stages), match the
unsplit model (--reference), and export a checkpoint that transformers loads with the
trained weights. The VLM runs issue 21's command (4 processes, tp=2 pp=2 braided_v) on
gloo with a tiny Qwen2-VL, and a tied Qwen2.5-VL under 1f1b (the tied copies on two ranks)."""

from __future__ import annotations

import json

import pytest
import torch

from test_examples import LLM, VLM, _ok, _torchrun, _metrics

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
                     "--device", "cpu", "--reference", "--save-hf", str(out), "--metrics", str(metrics), forked=True)
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


def _vl_checkpoint(kind: str, tied: bool, path) -> type:
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    common = dict(depth=2, num_heads=4, patch_size=4, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    if kind == "qwen2_vl":
        config_cls, model_cls = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
        vision = dict(common, embed_dim=32, hidden_size=32, mlp_ratio=2)
    else:
        config_cls, model_cls = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
        vision = dict(common, hidden_size=32, out_hidden_size=32, intermediate_size=64, window_size=16, fullatt_block_indexes=[1])
    torch.manual_seed(0)
    config = config_cls(text_config=text, vision_config=vision, image_token_id=63, vision_start_token_id=61, vision_end_token_id=62,
                        video_token_id=60, tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None)
    model_cls(config).save_pretrained(path, max_shard_size="30KB")
    return model_cls


@pytest.mark.slow
@pytest.mark.parametrize("kind,tied,schedule", [("qwen2_vl", False, "braided_v"), ("qwen2_5_vl", True, "1f1b")])
def test_vlm_trains_from_hf_checkpoint_and_exports(kind: str, tied: bool, schedule: str, tmp_path) -> None:
    import braid.hf as bhf

    model_cls = _vl_checkpoint(kind, tied, tmp_path / "start")
    out = tmp_path / "trained"
    proc = _torchrun(4, VLM, "--hf", str(tmp_path / "start"), "--tp", "2", "--pp", "2", "--schedule", schedule, "--reference",
                     "--device", "cpu", "--image-size", "16", "--steps", "3", "--save-hf", str(out), forked=True)
    _ok(proc)
    row = next(line for line in proc.stdout.splitlines() if line.startswith(schedule))
    assert float(row.split()[5]) <= 1e-4  # max rel diff of the losses vs the unsplit model
    start, trained = bhf.load(tmp_path / "start"), bhf.load(out)
    assert trained.cfg == start.cfg and trained.cfg.vit.kind == kind and trained.cfg.tie_embeddings == tied
    assert not torch.equal(start.visual.blocks[0].q_proj.weight, trained.visual.blocks[0].q_proj.weight)  # it trained
    grid = torch.tensor([[1, 4, 4], [1, 4, 8]])  # two image sizes
    ids = torch.tensor([[61] + [63] * 4 + [62] + [5] * 12, [61] + [63] * 8 + [62] + [7] * 8])
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hf = model_cls.from_pretrained(out).eval()
        want = hf(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == 63).int()).logits
        torch.testing.assert_close(trained.logits(ids, pixel_values=pixels, image_grid_thw=grid), want, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_qwen3_moe_trains_with_experts_over_two_ranks_and_exports(tmp_path) -> None:
    """A transformers-written Qwen3-MoE checkpoint trained 20 steps with ``--ep 2`` (dp=2, ZeRO-1 with the
    experts' own shards) matches the unsplit model; the export gathers both ranks' experts and loads in
    transformers with braid's logits; its step-10 checkpoint resumes at pp=2 without expert parallelism
    (the same global batch) with the uninterrupted run's losses and gradient norms."""
    import braid.hf as bhf

    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(tmp_path / "start")
    out, ck, whole, part = tmp_path / "trained", tmp_path / "ck", tmp_path / "whole.jsonl", tmp_path / "part.jsonl"
    common = ["--hf", str(tmp_path / "start"), "--schedule", "1f1b", "--seq", "16", "--device", "cpu"]
    proc = _torchrun(2, LLM, *common, "--ep", "2", "--steps", "20", "--reference", "--save-hf", str(out), "--save", str(ck),
                     "--save-every", "10", "--metrics", str(whole), forked=True)
    _ok(proc)
    assert "max rel diff" in proc.stdout
    _ok(_torchrun(2, LLM, *common, "--pp", "2", "--mbs", "2", "--micro-batch-size", "4", "--steps", "12",
                  "--resume", str(ck / "step_00000010"), "--metrics", str(part), forked=True))
    got, want = _metrics(part), _metrics(whole)[10:12]
    assert [m["step"] for m in got] == [11, 12]
    for key in ("loss", "grad_norm"):
        for a, b in zip(got, want):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (key, a, b)
    start, trained = bhf.load(tmp_path / "start"), bhf.load(out)
    assert not torch.equal(start.layers[0].experts.down.weight[3], trained.layers[0].experts.down.weight[3])  # rank 1's expert trained
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, experts_implementation="eager").eval()
        torch.testing.assert_close(hf(ids).logits, trained.logits(ids), rtol=0, atol=1e-5)
