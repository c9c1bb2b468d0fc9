"""``braid.hf`` on Qwen2-VL / Qwen2.5-VL checkpoints written by ``transformers`` (tiny, built here, no network).

* ``save_pretrained`` (sharded, with index) -> :func:`braid.hf.load` -> logits within 1e-5
  of HF's on one batch holding images of two grid sizes; tied and untied heads;
* :func:`braid.hf.save` -> ``from_pretrained`` -> equal logits (and the tie kept);
* ``save_pretrained`` writes the released ``visual.*`` / ``model.*`` layout (so does
  :func:`braid.hf.save`); the recent ``model.visual.*`` / ``model.language_model.*`` one with
  a flat ``config.json`` reads the same;
* sharded loading: each pipeline rank's VLM chunks (TP shards) built from
  :func:`braid.hf.load_meta` read only their own tensors and equal the chunks cut from the
  whole loaded model; the same with by-name initialisation (:func:`braid.models.build.meta_model`).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from test_hf_qwen2_vl import IDS, TEXT, VISION, _batch, _hf_classes, _hf_forward

import braid.hf as bhf
from braid import schedules
from braid.models.build import chunk_state, materialize, meta_model
from braid.models.global_names import check_shards, chunk_shards
from braid.models.qwen2_vl import Qwen2VLModel, vlm_preset, vlm_stage_layers
from braid.models.vision_chunk import build_vlm_rank_chunks

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

KINDS = ["qwen2_vl", "qwen2_5_vl"]


def _hf(kind: str, tied: bool, seed: int = 0, layers: int = 2):
    config_cls, model_cls = _hf_classes(kind)
    model = model_cls(config_cls(text_config={**TEXT, "num_hidden_layers": layers}, vision_config=dict(VISION[kind]), **{**IDS, "tie_word_embeddings": tied}))
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


def _logits(model, hf=False):
    input_ids, mask, pixel_values, grid, _ = _batch()
    assert grid[0].tolist() != grid[1].tolist()  # two image grid sizes in one batch
    with torch.no_grad():
        if hf:
            out = _hf_forward(model, input_ids, mask, pixel_values, grid).logits
        else:
            out = model.logits(input_ids, pixel_values=pixel_values, image_grid_thw=grid, attention_mask=mask)
    return out[mask.bool()]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tied", [False, True])
def test_transformers_checkpoint_loads_with_hf_logits_and_saves_back(kind: str, tied: bool, tmp_path) -> None:
    hf = _hf(kind, tied)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()  # sharded
    model = bhf.load(tmp_path / "hf")
    assert isinstance(model, Qwen2VLModel) and model.cfg.vit.kind == kind and model.cfg.tie_embeddings == tied
    assert (model.lm.lm_head.weight is model.lm.embed_tokens.weight) == tied
    want = _logits(hf, hf=True)
    torch.testing.assert_close(_logits(model), want, rtol=0, atol=1e-5)
    bhf.save(model, tmp_path / "braid")
    cfg = json.loads((tmp_path / "braid" / "config.json").read_text())
    assert cfg["model_type"] == kind and cfg["tie_word_embeddings"] is tied
    back = _hf_classes(kind)[1].from_pretrained(tmp_path / "braid").eval()
    assert (back.lm_head.weight is back.model.language_model.embed_tokens.weight) == tied
    torch.testing.assert_close(_logits(back, hf=True), _logits(model), rtol=0, atol=1e-5)
    assert bhf.load(tmp_path / "braid").cfg == model.cfg


def test_recent_layout_and_flat_config_load(tmp_path) -> None:
    from safetensors.torch import save_file

    hf = _hf("qwen2_5_vl", tied=False, seed=4)
    d = hf.config.to_dict()
    flat = {**{k: v for k, v in d.items() if k != "text_config"}, **d["text_config"], "model_type": "qwen2_5_vl",
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]}, "rope_theta": 10000.0}
    flat.pop("rope_parameters")
    recent = {k: v.contiguous() for k, v in hf.state_dict().items()}  # the module's own names
    assert any(k.startswith("model.language_model.") for k in recent)
    (tmp_path / "ck").mkdir()
    save_file(recent, str(tmp_path / "ck" / "model.safetensors"))
    (tmp_path / "ck" / "config.json").write_text(json.dumps(flat))
    torch.testing.assert_close(_logits(bhf.load(tmp_path / "ck")), _logits(hf, hf=True), rtol=0, atol=1e-5)


def test_bad_vl_checkpoints_are_one_clear_error(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    hf = _hf("qwen2_vl", tied=False)
    hf.save_pretrained(tmp_path / "ck")
    sd = load_file(str(tmp_path / "ck" / "model.safetensors"))
    save_file({k: v for k, v in sd.items() if "blocks.1.attn.qkv.weight" not in k}, str(tmp_path / "ck" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\).*blocks\.1\.attn\.qkv\.weight"):
        bhf.load(tmp_path / "ck")
    key = next(k for k in sd if k.endswith("visual.blocks.0.attn.qkv.weight"))
    save_file({**sd, key: sd[key][:-3]}, str(tmp_path / "ck" / "model.safetensors"))
    with pytest.raises(ValueError, match="has shape .* expects"):
        bhf.load(tmp_path / "ck")


class _Recorder:
    def __init__(self, inner) -> None:
        self.inner, self.device, self.filled = inner, inner.device, []

    def fill(self, t: torch.Tensor, name: str) -> None:
        self.filled.append(name)
        self.inner.fill(t, name)


def _global_names(chunks: dict, tied: bool) -> set[str]:
    """Every single-device parameter name the chunks hold (a tied head reads the embedding)."""
    names = {n for ch in chunks.values() for n in chunk_state(ch)}
    return {"lm.embed_tokens.weight" if tied and n == "lm.lm_head.weight" else n for n in names}


@pytest.mark.parametrize("schedule,kind,tied", [("1f1b", "qwen2_vl", True), ("braided_v", "qwen2_5_vl", False),
                                                ("braided_v", "qwen2_vl", True)])
def test_each_rank_reads_only_its_chunks_tensors(schedule: str, kind: str, tied: bool, tmp_path) -> None:
    hf = _hf(kind, tied, layers=3)  # braided_v at pp=2: the vision stage and 3 LM stages
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    full = bhf.load(tmp_path / "hf")
    pp, tp = 2, 2
    plan = schedules.build(schedule, pp, 4)
    layers = vlm_stage_layers(full.cfg, plan.num_stages, 0)
    seen: set[str] = set()
    for pp_rank in range(pp):
        whole = _global_names(build_vlm_rank_chunks(full, plan, pp_rank, layers), tied)  # the rank's layers, unsplit
        for tp_rank in range(tp):
            meta = bhf.load_meta(tmp_path / "hf")
            got = build_vlm_rank_chunks(meta, plan, pp_rank, layers, tp_rank=tp_rank, tp_size=tp)
            want = build_vlm_rank_chunks(full, plan, pp_rank, layers, tp_rank=tp_rank, tp_size=tp)
            assert all(p.is_meta for p in meta.parameters()), "the meta model itself must stay without storage"
            key = meta.braid_source.weights.key
            own = {key(n) for n in whole}
            read = set(meta.braid_source.read)
            assert read == own, f"rank {pp_rank}: read {sorted(read - own)[:3]} beyond its chunks, missed {sorted(own - read)[:3]}"
            holds_vision = any(plan.stage_of(pp_rank, c) == 0 for c in got)
            assert any(re.match(r"(model\.)?visual\.", k) for k in read) == holds_vision
            seen |= read
            for c in want:
                w = dict(want[c].named_parameters())
                for n, p in got[c].named_parameters():
                    assert torch.equal(p, w[n]), f"{schedule} rank {pp_rank}/{tp_rank} chunk {c} {n}"
    stored = bhf.CheckpointReader(tmp_path / "hf").keys() - ({"lm_head.weight"} if tied else set())
    assert seen == stored  # the ranks together read the whole checkpoint


@pytest.mark.parametrize("kind", KINDS)
def test_meta_vlm_chunks_materialise_only_their_own_layers(kind: str) -> None:
    pp, tp = 2, 2
    plan = schedules.build("1f1b", pp, 4)  # rank 0: the vision stage; rank 1: the LM
    cfg = vlm_preset("tiny", kind=kind)
    layers = vlm_stage_layers(cfg, plan.num_stages, 0)
    full = materialize(meta_model(Qwen2VLModel, cfg, seed=5))
    for pp_rank in range(pp):
        whole = _global_names(build_vlm_rank_chunks(full, plan, pp_rank, layers), False)
        for tp_rank in range(tp):
            meta = meta_model(Qwen2VLModel, cfg, seed=5)
            rec = meta.braid_source = _Recorder(meta.braid_source)
            got = build_vlm_rank_chunks(meta, plan, pp_rank, layers, tp_rank=tp_rank, tp_size=tp)
            want = build_vlm_rank_chunks(full, plan, pp_rank, layers, tp_rank=tp_rank, tp_size=tp)
            assert all(p.is_meta for p in meta.parameters())
            touched = set(rec.filled)
            assert touched == whole
            shards = chunk_shards(got, tp_rank, tp, vlm=True)
            check_shards(shards, meta)  # every local block equals the meta model's values, made from its source
            assert {s.name for s in shards.values()} == {n for ch in got.values() for n in chunk_state(ch)}
            vision = {n for n in touched if n.startswith("visual.")}
            lm_layers = {int(m.group(1)) for n in touched if (m := re.match(r"lm\.layers\.(\d+)\.", n))}
            if pp_rank == 0:
                assert len({n.split(".")[2] for n in vision if ".blocks." in n}) == cfg.vit.layers and not lm_layers
            else:
                assert not vision and lm_layers == set(range(cfg.lm.layers))
            for c in want:
                w = dict(want[c].named_parameters())
                for n, p in got[c].named_parameters():
                    assert torch.equal(p, w[n]), f"rank {pp_rank}/{tp_rank} chunk {c} {n}"

