"""How layers are spread over virtual stages: whole layers, and stages cut at a layer's half."""

from __future__ import annotations

import pytest
import torch

from braid.core.braiding import ChunkSpec, Unit, unit_tasks
from braid.core.ir import OpKind
from braid.core.partition import chunk_specs, layer_offset, split_layers, stage_halves, whole_layers


def test_whole_lighter_keeps_the_papers_split() -> None:
    assert split_layers(28, 8, last_stage_lighter=2) == (4, 4, 4, 4, 4, 3, 3, 2)
    assert split_layers(4, 4) == (1, 1, 1, 1)


@pytest.mark.parametrize("layers,stages,lighter,want", [
    (4, 4, 0.5, (1, 1, 1.5, 0.5)),
    (28, 8, 2.5, (4, 4, 4, 4, 4, 3, 3.5, 1.5)),
    (4, 2, 0.5, (2.5, 1.5)),
])
def test_a_half_lighter_moves_an_attention_half_to_the_stage_before(layers, stages, lighter, want) -> None:
    got = split_layers(layers, stages, last_stage_lighter=lighter)
    assert got == want and sum(got) == layers
    assert not whole_layers(got)


@pytest.mark.parametrize("lighter", [0.3, -0.5])
def test_a_lighter_that_is_no_half_is_refused(lighter) -> None:
    with pytest.raises(ValueError, match="whole or half"):
        split_layers(4, 4, last_stage_lighter=lighter)


@pytest.mark.parametrize("layout,match", [
    ((1, 0.3), "whole or half"),
    ((1, -1), "whole or half"),
    ((1, 1.5), "add up to 2.5 layers"),
])
def test_stage_halves_refuses_what_no_model_holds(layout, match) -> None:
    with pytest.raises(ValueError, match=match):
        stage_halves(layout)


def test_chunk_specs_mark_each_half() -> None:
    specs = chunk_specs((1.5, 0.5, 1.5, 0.5), 2, "v")
    by_stage = [specs[(0, 0)], specs[(1, 0)], specs[(1, 1)], specs[(0, 1)]]  # V: stages 0, 1 down, 2, 3 back up
    assert by_stage == [
        ChunkSpec(1, embed=True, half_out=True),
        ChunkSpec(0, half_in=True),
        ChunkSpec(1, half_out=True),
        ChunkSpec(0, head=True, half_in=True),
    ]
    assert [layer_offset((1.5, 0.5, 1.5, 0.5), s) for s in range(4)] == [0, 1, 2, 3]
    assert [s.modules for s in by_stage] == [2, 1, 2, 1]


def test_unit_tasks_of_half_layers() -> None:
    spec = ChunkSpec(1, half_in=True, half_out=True)
    fwd = [(t.unit, t.layer) for t in unit_tasks(OpKind.F, spec)]
    assert fwd == [(Unit.PRE_MLP, 0), (Unit.MLP, 0), (Unit.PRE_ATTN, 1), (Unit.ATTN, 1), (Unit.PRE_MLP, 1), (Unit.MLP, 1),
                   (Unit.PRE_ATTN, 2), (Unit.ATTN, 2)]
    assert [(t.unit, t.layer) for t in unit_tasks(OpKind.B, spec)] == fwd[::-1]
    # the all-reduce rule is per unit: the halves end on attn's / start with pre_mlp's
    assert [t.ar for t in unit_tasks(OpKind.F, spec)] == [False, True, False, True, False, True, False, True]


def test_chunk_spec_refuses_a_halved_vision_stage() -> None:
    with pytest.raises(ValueError, match="whole ViT blocks"):
        ChunkSpec(1, embed=True, merge=True, half_out=True)


def test_keep_units_leaves_one_half_and_refuses_unknown_weights() -> None:
    from braid.models.qwen2 import Qwen2Config, Qwen2Layer
    from braid.models.seam import keep_units

    cfg = Qwen2Config(vocab_size=32, hidden=16, layers=1, heads=2, kv_heads=1, ffn=24)
    attn = keep_units(Qwen2Layer(cfg), (Unit.PRE_ATTN, Unit.ATTN))
    assert {n.split(".")[0] for n, _ in attn.named_parameters()} == {"input_layernorm", "q_proj", "k_proj", "v_proj", "o_proj"}
    mlp = keep_units(Qwen2Layer(cfg), (Unit.PRE_MLP, Unit.MLP))
    assert {n.split(".")[0] for n, _ in mlp.named_parameters()} == {"post_attention_layernorm", "gate_proj", "up_proj", "down_proj"}
    odd = Qwen2Layer(cfg)
    odd.q_norm = torch.nn.LayerNorm(8)  # a weight the seam does not name
    with pytest.raises(ValueError, match="cannot be cut in half"):
        keep_units(odd, (Unit.PRE_ATTN, Unit.ATTN))
