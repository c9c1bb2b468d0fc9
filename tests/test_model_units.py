"""Model units on one process: the unit-by-unit chunk runner reproduces the single-device model."""

from __future__ import annotations

import copy

import pytest
import torch

from reference_error import assert_matches_reference

from braid.core.braiding import ChunkSpec, Comm, Phase, Unit, UnitTask, steps
from braid.core.ir import OpKind, parse_instruction
from braid.models.chunk_parts import ChunkStateError
from braid.models.build import build_chunk
from braid.models.qwen2 import Qwen2Config, Qwen2Model, parallelize_layer


def _setup(m: int = 3):
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden=32, layers=3, heads=4, kv_heads=2, ffn=64)
    model = Qwen2Model(cfg)
    g = torch.Generator().manual_seed(1)
    toks = [torch.randint(0, 64, (2, 8), generator=g) for _ in range(m)]
    labs = [torch.randint(0, 64, (2, 8), generator=g) for _ in range(m)]
    return cfg, model, toks, labs


def test_units_compose_to_the_layer_forward() -> None:
    cfg, model, _, _ = _setup()
    layer = model.layers[0]
    x = torch.randn(2, 8, cfg.hidden)
    x_attn = layer.attn(*layer.qkv(layer.norm1(x)), x)
    out = layer.mlp(*layer.gate_up(layer.norm2(x_attn)), x_attn)
    torch.testing.assert_close(out, layer(x))


@pytest.mark.parametrize("grouped", [True, False])
def test_tp_shards_sum_to_the_full_unit_output(grouped: bool, monkeypatch) -> None:
    """Q/K/V and gate/up grouped into one GEMM each (small layers) or one by one (above
    :data:`braid.tp.layers.GROUP_MAX_WEIGHT`): the shards' units sum to the full layer's."""
    from braid.tp import layers as tp_layers

    if not grouped:
        monkeypatch.setattr(tp_layers, "GROUP_MAX_WEIGHT", 0)
    cfg, model, _, _ = _setup()
    layer = model.layers[1]
    x = torch.randn(2, 8, cfg.hidden)
    shards = [parallelize_layer(layer, cfg, r, 2) for r in range(2)]
    assert all((s.qkv_group is not None) is grouped and (s.gate_up_group is not None) is grouped for s in shards)
    total = sum(s.attn(*s.qkv(s.norm1(x)), x) for s in shards)  # the all-reduce (operator g)
    torch.testing.assert_close(total, layer.attn(*layer.qkv(layer.norm1(x)), x))
    h = layer.norm2(x)
    torch.testing.assert_close(sum(s.mlp(*s.gate_up(h), x) for s in shards), layer.mlp(*layer.gate_up(h), x))
    with pytest.raises(ValueError, match="KV heads \\(2\\) not divisible by tp=4"):
        parallelize_layer(layer, cfg, 0, 4)


@pytest.mark.parametrize("program", [["F0c0", "F1c0", "F2c0", "BW0c0", "BW1c0", "BW2c0"],
                                     ["F0c0", "F1c0", "B0c0", "F2c0&B1c0", "W1c0", "W0c0", "BW2c0"]])
@pytest.mark.parametrize("grouped", [True, False])
def test_chunk_runner_matches_reference_gradients(program: list[str], grouped: bool, monkeypatch) -> None:
    from braid.tp import layers as tp_layers

    if not grouped:  # the linears one by one, as large layers run
        monkeypatch.setattr(tp_layers, "GROUP_MAX_WEIGHT", 0)
    cfg, model, toks, labs = _setup()
    model = model.double()  # float64: the bound of reference_error is ~1e-13 of the largest gradient
    ref = copy.deepcopy(model)
    for t, l in zip(toks, labs):
        (ref(t, l) / len(toks)).backward()
    spec = ChunkSpec(cfg.layers, embed=True, head=True)
    ch = build_chunk(model, spec, 0, num_microbatches=len(toks))
    assert all((lay.qkv_group is not None) is grouped for lay in ch.layers)
    ch.set_batch(toks, labs)
    for text in program:
        ins = parse_instruction(text)
        for st in steps(ins, lambda c: spec):
            ch.run(st.op.mb, st.task)
        for op in getattr(ins, "ops", (ins,)):
            if op.kind is OpKind.F:
                ch.end_forward(op.mb)
            elif op.kind in (OpKind.B, OpKind.BW):
                ch.end_backward(op.mb)
    assert ch.pending_work() == [] and ch.live_bytes() == 0
    want = dict(ref.named_parameters())
    scale = max(float(p.grad.abs().max()) for p in ref.parameters())
    for n, p in ch.named_parameters():
        assert_matches_reference(p.grad, want[n.replace("embed.", "embed_tokens.")].grad, what=f"grad {n}", scale=scale)


def test_saved_activations_are_counted_and_freed_and_missing_input_is_an_error() -> None:
    cfg, model, toks, labs = _setup(1)
    ch = build_chunk(model, ChunkSpec(1, embed=True), 0, num_microbatches=1)
    ch.set_batch(toks, labs)
    ch.run(0, UnitTask(Phase.F, Unit.EMBED, -1, Comm.AR))
    ch.run(0, UnitTask(Phase.F, Unit.PRE_ATTN, 0))
    held = ch.live_bytes()
    assert held > 0
    moved = ch.offload(0)  # storages also held as autograd leaves/outputs stay on the device
    assert 0 < moved < held and ch.live_bytes() == held - moved
    assert ch.reload(0) == moved and ch.live_bytes() == held
    later = build_chunk(model, ChunkSpec(1, head=True), 2, num_microbatches=1)
    with pytest.raises(ChunkStateError, match="F0: input activation missing"):
        later.run(0, UnitTask(Phase.F, Unit.PRE_ATTN, 0))


def test_rope_tables_are_made_once_and_never_counted_as_saved_activations() -> None:
    """RoPE's tables persist across micro-batches (one pair per layer): autograd saves them
    for RoPE's backward, but the chunk neither counts nor offloads them, as with parameters."""
    import pickle

    cfg, model, toks, labs = _setup(2)
    ch = build_chunk(model, ChunkSpec(1, embed=True), 0, num_microbatches=2)
    ch.set_batch(toks, labs)
    layer = ch.layers[0]
    held = []
    for mb in range(2):
        ch.run(mb, UnitTask(Phase.F, Unit.EMBED, -1, Comm.AR))
        ch.run(mb, UnitTask(Phase.F, Unit.PRE_ATTN, 0))
        held.append(ch.live_bytes())
    tables = layer.rope_cache[(8, cfg.head_dim, torch.device("cpu"), torch.float32)]
    assert len(layer.rope_cache) == 1 and layer.rope_cache.ptrs == {t.data_ptr() for t in tables}
    # eager RoPE saves cos and sin, yet no box holds them, and the second micro-batch adds what the first did
    saved = {t.data_ptr() for b in ch._boxes.values() for t in b.tensors if isinstance(t, torch.Tensor)}
    assert saved and not saved & layer.rope_cache.ptrs
    assert held[1] == 2 * held[0]
    assert ch.offload(0) > 0 and all(t.data_ptr() in layer.rope_cache.ptrs for t in tables)
    # copies and pickles start empty: their tables are made where they run
    assert len(copy.deepcopy(layer).rope_cache) == 0 and len(pickle.loads(pickle.dumps(layer)).rope_cache) == 0


def test_a_compiled_layer_fills_its_rope_cache_and_then_reads_it() -> None:
    """``torch.compile(fullgraph=True)`` of a layer (as the torch baselines compile theirs)
    traces the cache's first fill, then reads the stored tables; values as eager."""
    cfg, model, _, _ = _setup()
    layer = model.layers[0]
    x = torch.randn(2, 8, cfg.hidden)
    want = layer(x)
    layer.rope_cache.clear()
    fn = torch.compile(layer, fullgraph=True, backend="eager")
    got = [fn(x) for _ in range(2)]
    assert len(layer.rope_cache) == 1 and len(layer.rope_cache.ptrs) == 2
    for g in got:
        assert torch.equal(g, want)
