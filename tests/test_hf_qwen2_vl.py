"""braid's Qwen2-VL / Qwen2.5-VL against ``transformers`` on tiny random configs (built here, no network).

HF model -> :mod:`braid.models.hf_qwen2_vl` -> braid model: logits within 1e-5 (fp32) on a
batch of two right-padded samples whose images have different grids, M-RoPE positions
equal to HF's ``get_rope_index``, the loss equal under HF's label convention; and braid
model -> HF weights and config -> ``transformers`` model: equal logits; every gradient
equal to HF's.
"""

from __future__ import annotations

import pytest
import torch

from braid.models.hf_qwen2_vl import config_from_hf, config_to_hf, model_from_hf, state_dict_from_hf, state_dict_to_hf, weight_map
from braid.models.qwen2_vl import Qwen2VLModel, rope_index, shift_labels

pytest.importorskip("transformers", reason="the HF comparison needs transformers (pip install -e .[test])")

IMAGE, START, END, VIDEO = 63, 61, 62, 60
TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
IDS = dict(image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END, video_token_id=VIDEO,
           tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
VISION = {
    "qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=32, mlp_ratio=2, num_heads=4, patch_size=4, spatial_merge_size=2,
                     temporal_patch_size=2, in_channels=3),
    # window of 2x2 merged tokens; block 1 attends over the whole image
    "qwen2_5_vl": dict(depth=3, hidden_size=32, out_hidden_size=32, intermediate_size=48, num_heads=4, patch_size=4,
                       spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=16, fullatt_block_indexes=[1]),
}


def _hf_classes(kind: str):
    import transformers

    if kind == "qwen2_vl":
        return transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    return transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration


def _hf_model(kind: str, seed: int = 0):
    config_cls, model_cls = _hf_classes(kind)
    model = model_cls(config_cls(text_config=dict(TEXT), vision_config=dict(VISION[kind]), **IDS))
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


def _batch():
    """Two samples, right-padded: a 4x6-patch image (6 tokens) and an 8x4-patch one (8 tokens)."""
    g = torch.Generator().manual_seed(1)
    grid = torch.tensor([[1, 4, 6], [1, 8, 4]])
    pixel_values = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 4 * 4, generator=g)
    s0 = [5, START] + [IMAGE] * 6 + [END] + [7, 8, 9, 10, 11, 12]
    s1 = [START] + [IMAGE] * 8 + [END] + [13, 14, 15]
    n = max(len(s0), len(s1))
    input_ids = torch.tensor([s + [0] * (n - len(s)) for s in (s0, s1)])
    mask = torch.tensor([[1] * len(s) + [0] * (n - len(s)) for s in (s0, s1)])
    labels = torch.where((mask == 1) & (input_ids != IMAGE), input_ids, torch.full_like(input_ids, -100))
    return input_ids, mask, pixel_values, grid, labels


def _hf_forward(hf, input_ids, mask, pixel_values, grid, labels=None):
    return hf(input_ids=input_ids, attention_mask=mask, pixel_values=pixel_values, image_grid_thw=grid,
              mm_token_type_ids=(input_ids == IMAGE).int(), labels=labels)


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_hf_weights_give_hf_logits_and_loss(kind: str) -> None:
    hf = _hf_model(kind)
    cfg = config_from_hf(hf.config.to_dict())
    assert cfg.vit.kind == kind and cfg.mrope_section == (2, 1, 1)
    model = Qwen2VLModel(cfg)
    model.load_state_dict(state_dict_from_hf(cfg, hf.state_dict()), strict=True)
    input_ids, mask, pixel_values, grid, labels = _batch()
    with torch.no_grad():
        want = _hf_forward(hf, input_ids, mask, pixel_values, grid, labels)
        got = model.logits(input_ids=input_ids, pixel_values=pixel_values, image_grid_thw=grid, attention_mask=mask,
                           mm_token_type_ids=(input_ids == IMAGE).int())  # all the processor gives
        loss = model(pixel_values, input_ids, shift_labels(labels), grid)
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want.logits[valid], rtol=0, atol=1e-5)
    torch.testing.assert_close(loss, want.loss, rtol=0, atol=1e-5)
    direct = model_from_hf(hf.config.to_dict(), hf.state_dict(), dtype=torch.float64)
    assert all(p.dtype == torch.float64 and p.device.type == "cpu" for p in direct.parameters())
    with torch.no_grad():
        got64 = direct.logits(input_ids, pixel_values.double(), grid, attention_mask=mask)
    torch.testing.assert_close(got64[valid].float(), want.logits[valid], rtol=0, atol=1e-5)
    hf_pos, _ = hf.model.get_rope_index(input_ids, (input_ids == IMAGE).int(), grid, None, attention_mask=mask)
    assert torch.equal(rope_index(cfg, input_ids, grid, mask)[:, valid], hf_pos[:, valid])


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_braid_weights_load_in_transformers_with_equal_logits(kind: str) -> None:
    cfg = config_from_hf(_hf_model(kind).config.to_dict())
    torch.manual_seed(5)
    model = Qwen2VLModel(cfg)  # braid's own random init
    config_cls, model_cls = _hf_classes(kind)
    hf = model_cls(config_cls(**{**config_to_hf(cfg), "bos_token_id": None, "eos_token_id": None})).eval()
    hf.load_state_dict(state_dict_to_hf(cfg, model.state_dict()), strict=True)
    assert config_from_hf(hf.config.to_dict()) == cfg
    input_ids, mask, pixel_values, grid, _ = _batch()
    with torch.no_grad():
        want = _hf_forward(hf, input_ids, mask, pixel_values, grid).logits
        got = model.logits(input_ids, pixel_values, grid, attention_mask=mask)
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], rtol=0, atol=1e-5)
    hf_sd = state_dict_to_hf(cfg, model.state_dict())
    back = state_dict_from_hf(cfg, hf_sd)
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    names = weight_map(cfg)
    assert sorted(names) == sorted(model.state_dict()) and set(names.values()) == set(hf_sd)


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_gradients_equal_hf_gradients(kind: str) -> None:
    hf = _hf_model(kind, seed=2)
    cfg = config_from_hf(hf.config.to_dict())
    model = Qwen2VLModel(cfg)
    model.load_state_dict(state_dict_from_hf(cfg, hf.state_dict()), strict=True)
    input_ids, mask, pixel_values, grid, labels = _batch()
    _hf_forward(hf, input_ids, mask, pixel_values, grid, labels).loss.backward()
    model(pixel_values, input_ids, shift_labels(labels), grid).backward()
    got = state_dict_to_hf(cfg, {n: p.grad for n, p in model.named_parameters()})
    for name, p in hf.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-5, msg=lambda s, name=name: f"{name}: {s}")


def test_released_layout_and_flat_config_are_read() -> None:
    hf = _hf_model("qwen2_vl")
    d = hf.config.to_dict()
    flat = {**{k: v for k, v in d.items() if k != "text_config"}, **d["text_config"], "model_type": "qwen2_vl",
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]}, "rope_theta": 10000.0}
    flat.pop("rope_parameters")
    cfg = config_from_hf(flat)
    assert cfg == config_from_hf(d)
    old = {("visual." + k[len("model.visual."):]) if k.startswith("model.visual.") else
           ("model." + k[len("model.language_model."):]) if k.startswith("model.language_model.") else k: v
           for k, v in hf.state_dict().items()}
    sd = state_dict_from_hf(cfg, old)
    assert all(torch.equal(sd[k], v) for k, v in state_dict_from_hf(cfg, hf.state_dict()).items())


def test_bad_checkpoints_are_clear_errors() -> None:
    hf = _hf_model("qwen2_5_vl")
    d = hf.config.to_dict()
    with pytest.raises(ValueError, match="not a Qwen2-VL family"):
        config_from_hf({**d, "model_type": "llama"})
    with pytest.raises(ValueError, match="vision output size"):
        config_from_hf({**d, "vision_config": {**d["vision_config"], "out_hidden_size": 48}})
    cfg = config_from_hf(d)
    sd = hf.state_dict()
    with pytest.raises(ValueError, match="missing"):
        state_dict_from_hf(cfg, {k: v for k, v in sd.items() if "blocks.0.attn.qkv" not in k})
    with pytest.raises(ValueError, match="no place"):
        state_dict_from_hf(cfg, {**sd, "model.visual.extra.weight": torch.zeros(1)})
    input_ids, mask, pixel_values, grid, _ = _batch()
    model = Qwen2VLModel(cfg)
    with pytest.raises(ValueError, match="right padding"):
        model.logits(input_ids, pixel_values, grid, attention_mask=mask.flip(1))
    with pytest.raises(ValueError, match="image tokens"):
        model.logits(input_ids, pixel_values, grid[[1, 0]], attention_mask=mask)
    with pytest.raises(ValueError, match="mm_token_type_ids"):
        model.logits(input_ids, pixel_values, grid, mm_token_type_ids=torch.zeros_like(input_ids))
    with pytest.raises(ValueError, match="video"):
        model.logits(input_ids, pixel_values, grid, video_grid_thw=grid)
