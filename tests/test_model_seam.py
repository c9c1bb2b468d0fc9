"""The model seam: registry, a second family (Llama-style), tied embeddings across pipeline
stages, and models built where they run (meta device, by-name initialisation).

Exactness is checked against the single-process model in real gloo processes: the tied
embedding's gradient is the sum of its uses on the first and the last stage, whether one
rank holds both (V placement, tp > 1 single stage) or two ranks do (loop placement).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest
import torch

import model_cases as cases
import moe_cases
from braid import schedules
from braid.models.build import InitSource, build_rank_chunks, materialize, meta_model
from braid.models.llama import LlamaConfig, LlamaLayer, LlamaModel
from braid.models.qwen2 import Qwen2Config, Qwen2Model
from braid.models.registry import family_for_hf, family_of, get_family, names
from braid.models.seam import StageModel, UnitLayer, keep_units
from braid.core.braiding import LAYER_UNITS
from braid.models.tp_partial import is_partial


def test_registry_dispatches_on_hf_model_type() -> None:
    assert {"qwen2", "llama"} <= set(names())
    assert family_for_hf("qwen2").model_cls is Qwen2Model
    assert family_for_hf("llama").model_cls is LlamaModel
    assert family_of(LlamaModel(LlamaConfig())).name == "llama"
    assert family_of(Qwen2Model(Qwen2Config())).name == "qwen2"
    with pytest.raises(ValueError, match="unsupported HF model_type 'gpt2'; braid reads: .*llama.*qwen2"):
        family_for_hf("gpt2")
    with pytest.raises(ValueError, match="unknown model family"):
        get_family("nope")


def test_families_implement_the_seam() -> None:
    for fam in ("qwen2", "llama"):
        f = get_family(fam)
        model = f.model_cls(f.config_cls(tie_embeddings=True))
        assert isinstance(model, StageModel) and isinstance(model.layers[0], UnitLayer)
        assert model.lm_head.weight is model.embed_tokens.weight
        shard = model.shard_layer(model.layers[0], 1, 2)
        assert isinstance(shard, UnitLayer) and type(shard) is type(model.layers[0])
    lay = LlamaModel(LlamaConfig()).layers[0]
    assert isinstance(lay, LlamaLayer) and lay.q_proj.bias is None and Qwen2Model(Qwen2Config()).layers[0].q_proj.bias is not None


def test_qwen3_families_implement_the_seam() -> None:
    """Dense and MoE layers shard into unit layers whose halves can be cut; at tp=2 the head norms
    (and the router) are marked partial over TP and the experts split; the load-balancing loss in
    a pipelined run and experts that tp does not divide are one clear error."""
    import copy

    for fam, kw in (("qwen3", {}), ("qwen3_moe", {"mlp_only_layers": (1,)})):
        f = get_family(fam)
        model = f.model_cls(f.config_cls(tie_embeddings=True, **kw))
        assert isinstance(model, StageModel)
        for layer in model.layers:
            shard = model.shard_layer(layer, 0, 1)
            assert isinstance(shard, UnitLayer) and type(shard) is type(layer)
            for units in (LAYER_UNITS[:2], LAYER_UNITS[2:]):
                keep_units(copy.deepcopy(shard), units)
        half = model.shard_layer(model.layers[0], 1, 2)
        assert is_partial(half.q_norm.weight) and is_partial(half.k_norm.weight) and not is_partial(half.input_layernorm.weight)
    moe = get_family("qwen3_moe")
    half = moe.model_cls(moe.config_cls()).shard_layer(moe.model_cls(moe.config_cls()).layers[0], 1, 2)
    assert half.experts.count == 2 and is_partial(half.router.weight) and half.dispatcher.first == 2
    with pytest.raises(ValueError, match="the 4 experts are split over TP ranks; tp=3 must divide them"):
        moe.model_cls(moe.config_cls()).shard_layer(moe.model_cls(moe.config_cls()).layers[0], 0, 3)
    aux = moe.model_cls(moe.config_cls(output_router_logits=True))
    with pytest.raises(ValueError, match="load-balancing loss .* not supported by pipelined runs"):
        aux.shard_layer(aux.layers[0], 0, 1)


@dataclass
class _Recorder:
    """An init source that records which global names it filled."""

    inner: InitSource
    filled: list[str] = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        return self.inner.device

    def fill(self, t: torch.Tensor, name: str) -> None:
        self.filled.append(name)
        self.inner.fill(t, name)


@pytest.mark.parametrize("schedule,tie", [("1f1b", False), ("1f1b", True), ("braided_v", True)])
def test_per_chunk_init_equals_single_device_and_touches_only_own_layers(schedule: str, tie: bool) -> None:
    pp, tp = 2, 2
    plan = schedules.build(schedule, pp, 4)
    layers = (2,) * plan.num_stages
    cfg = LlamaConfig(layers=sum(layers), tie_embeddings=tie, vocab_size=64)
    full = LlamaModel(cfg).init_weights(seed=3)
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            meta = meta_model(LlamaModel, cfg, seed=3)
            rec = meta.braid_source = _Recorder(meta.braid_source)
            got = build_rank_chunks(meta, plan, pp_rank, layers, tp_rank=tp_rank, tp_size=tp)
            want = build_rank_chunks(full, plan, pp_rank, layers, tp_rank=tp_rank, tp_size=tp)
            assert all(p.is_meta for p in meta.parameters()), "the meta model itself must stay without storage"
            own = {i for c, ch in got.items() for i in range(ch.first_layer, ch.first_layer + ch.spec.layers)}
            touched = {int(m.group(1)) for n in rec.filled if (m := re.match(r"layers\.(\d+)\.", n))}
            assert touched == own, f"rank {pp_rank}: materialised layers {sorted(touched)}, owns {sorted(own)}"
            ends = {n for n in rec.filled if not n.startswith("layers.")}
            has_embed = any(ch.spec.embed for ch in got.values())
            has_head = any(ch.spec.head for ch in got.values())
            expect = ({"embed_tokens.weight"} if has_embed or (tie and has_head) else set())
            expect |= ({"norm.weight"} | (set() if tie else {"lm_head.weight"})) if has_head else set()
            assert ends == expect, f"rank {pp_rank}: {ends} != {expect}"
            for c in want:
                w = dict(want[c].named_parameters())
                for n, p in got[c].named_parameters():
                    assert torch.equal(p, w[n]), f"{schedule} rank {pp_rank}/{tp_rank} chunk {c} {n}"


def test_materialize_equals_init_weights_and_keeps_the_tie() -> None:
    cfg = Qwen2Config(tie_embeddings=True)
    model = materialize(meta_model(Qwen2Model, cfg, seed=11, std=0.1))
    want = Qwen2Model(cfg).init_weights(11, 0.1)
    assert model.lm_head.weight is model.embed_tokens.weight
    for (n, p), (_, q) in zip(model.named_parameters(), want.named_parameters()):
        assert torch.equal(p, q), n
    other = Qwen2Model(cfg).init_weights(12, 0.1)
    assert not torch.equal(other.layers[0].q_proj.weight, want.layers[0].q_proj.weight)


def test_meta_construction_of_a_7b_shape_is_instant_and_allocates_nothing() -> None:
    cfg = Qwen2Config(vocab_size=152064, hidden=3584, layers=28, heads=28, kv_heads=4, ffn=18944)
    meta = meta_model(Qwen2Model, cfg, seed=0, dtype=torch.bfloat16)
    assert all(p.is_meta for p in meta.parameters())
    assert sum(p.numel() for p in meta.parameters()) > 7e9


@pytest.mark.slow
def test_tied_and_llama_pipelines_match_single_process(pools) -> None:
    pool = pools(2)
    # Loop placement: embedding on rank 0, head on rank 1 (the tied gradient crosses ranks);
    # V placement: both on rank 0 (summed locally).
    pool.run(cases.family_equivalence, "qwen2", True, 2, 1, [("1f1b", 2), ("braided_v", 5), ("zb_h1", 5)], timeout_s=300)
    pool.run(cases.family_equivalence, "llama", True, 2, 1, [("1f1b", 3), ("braided_v", 5)], True, timeout_s=300)
    pool.run(cases.family_equivalence, "llama", False, 2, 1, [("1f1b_i", 4)], True, timeout_s=300)
    # One stage split over tp=2: both copies in one chunk, vocabulary rows sharded alike.
    pool.run(cases.family_equivalence, "qwen2", True, 1, 2, [("gpipe", 2)], timeout_s=300)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(60)
def test_meta_chunks_on_cuda_equal_the_single_device_model_on_cuda() -> None:
    plan = schedules.build("braided_v", 2, 4)
    layers = (1, 1, 1, 1)
    cfg = Qwen2Config(layers=4, tie_embeddings=True)
    full = Qwen2Model(cfg).to("cuda").init_weights(seed=9)
    for pp_rank in range(2):
        got = build_rank_chunks(meta_model(Qwen2Model, cfg, seed=9, device="cuda"), plan, pp_rank, layers, tp_rank=1, tp_size=2)
        want = build_rank_chunks(full, plan, pp_rank, layers, tp_rank=1, tp_size=2)
        for c in want:
            w = dict(want[c].named_parameters())
            for n, p in got[c].named_parameters():
                assert p.is_cuda and torch.equal(p, w[n]), f"rank {pp_rank} chunk {c} {n}"


@pytest.mark.slow
def test_moe_pipelines_match_single_process(pools) -> None:
    """Qwen3-MoE (one dense layer among MoE ones): units cut and braided (braided_v), W split off
    (zb_h1) over two stages; experts over two data-parallel ranks (dp=2, ep=2); Qwen3 and
    Qwen3-MoE at tp=2. pp x ep: :mod:`test_moe_pipeline`."""
    pool = pools(2)
    assert pool.run(moe_cases.ep_equivalence, 2, 1, [("braided_v", 5), ("zb_h1", 3)], timeout_s=300) == [
        ["braided_v m=5", "zb_h1 m=3"]] * 2
    assert pool.run(moe_cases.ep_equivalence, 1, 2, [("1f1b", 3)], timeout_s=300) == [["1f1b m=3"]] * 2
    # tp=2: head norms and the router summed over TP ranks, experts split over them
    for fam in ("qwen3", "qwen3_moe"):
        assert pool.run(cases.family_equivalence, fam, False, 1, 2, [("gpipe", 2)], timeout_s=300) == [["gpipe m=2"]] * 2
