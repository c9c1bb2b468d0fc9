"""Fused chunks (one backward engine call per op where nothing needs the unit cuts), in gloo processes.

At tp=1 without offload the executor runs its chunks fused; at tp=2 or with an offload
program it keeps the cuts, and asking for fused mode there is refused. Fused and cut mode
give the same losses and gradients (within fp32 rounding: the same sums in another order)
and the same parameters after two AdamW steps, for braided_v, 1f1b_i and zb_v at pp=1 and
pp=2. (That both equal the single-process reference is ``test_executor.py``'s job.) On one
process the chunk runner agrees in both modes for whole, first, middle, last and
embedding-only chunks, with and without selective recomputation.
"""

from __future__ import annotations

import pytest
import torch

import fused_cases as cases
from chunk_driver import drive
from reference_error import assert_matches_reference

SCHEDULES = ("braided_v", "1f1b_i", "zb_v")


@pytest.mark.parametrize("pp", [1, 2])
def test_fused_and_cut_mode_agree(pools, pp: int) -> None:
    combos = [(name, 4) for name in SCHEDULES]  # m a multiple of p (1f1b_i)
    for ran in pools(pp).run(cases.fused_matches_cut, pp, 1, combos, timeout_s=300):
        assert [(n, m) for n, m, _, _ in ran] == combos
        assert all(fused for _, _, fused, _ in ran), f"tp=1 without offload did not run fused: {ran}"


@pytest.mark.parametrize("tp", [1, 2])
def test_mode_is_chosen_by_tp_and_offload(pools, tp: int) -> None:
    for got in pools(2 * tp).run(cases.modes_chosen, tp, timeout_s=300):
        assert got["braided_v"] == ([True] if tp == 1 else [False]), got
        assert got["braided_v_offload"] == [False], got
        assert got["braided_v fuse=True"] == ("accepted" if tp == 1 else
                                              "fused chunk requested (fuse=True), but tensor parallelism (tp > 1) needs the unit cuts; build it with fuse=None"), got
        assert "the program offloads activations needs the unit cuts" in str(got["braided_v_offload fuse=True"]), got


def test_fused_at_tp2_is_not_taken(pools) -> None:
    ran = pools(2).run(cases.fused_matches_cut, 1, 2, [("braided_v", 3)], timeout_s=300)
    assert all(not fused for r in ran for _, _, fused, _ in r), ran


# -- the chunk runner on one process ------------------------------------------------------
PROGRAM = ["F0c0", "F1c0", "B0c0", "F2c0&B1c0", "W1c0", "W0c0", "BW2c0"]  # braided block and split W included
SPECS = {"whole": (2, True, True), "first": (2, True, False), "middle": (2, False, False), "last": (2, False, True),
         "embedding only": (0, True, False)}


def _chunk_run(fuse: bool, layers: int, embed: bool, head: bool, recompute: str, joint: bool = False):
    from braid.core.braiding import ChunkSpec
    from braid.models.build import build_chunk
    from braid.models.qwen2 import Qwen2Config, Qwen2Model

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden=32, layers=3, heads=4, kv_heads=2, ffn=64)
    model = Qwen2Model(cfg)
    g = torch.Generator().manual_seed(1)
    toks = [torch.randint(0, 64, (2, 16), generator=g) for _ in range(3)]
    labs = [torch.randint(0, 64, (2, 16), generator=g) for _ in range(3)]
    xs = [torch.randn(2, 16, 32, generator=g) for _ in range(3)]
    dys = [torch.randn(2, 16, 32, generator=g) for _ in range(3)]
    spec = ChunkSpec(layers, embed=embed, head=head)
    ch = build_chunk(model, spec, 1, num_microbatches=3, fuse=fuse)
    assert ch.choose_fused() is fuse
    if joint:
        ch.set_joint({2})  # BW2c0 computes its weight gradients in its backward call
    ch.set_recompute(recompute)
    ch.set_batch(toks, labs)
    dxs, peak = drive(ch, spec, PROGRAM, inputs=None if embed else xs, output_grads=None if head else dys)
    assert ch.pending_work() == [] and ch.live_bytes() == 0
    grads = {n: p.grad.clone() for n, p in ch.named_parameters() if p.grad is not None}
    assert len(grads) == len(list(ch.parameters())), "a parameter got no gradient"
    return [float(ch.losses[k]) for k in sorted(ch.losses)], dxs, grads, peak


@pytest.mark.parametrize("joint", ["split", "joint", "joint-accumulate"])
@pytest.mark.parametrize("recompute", ["none", "selective"])
@pytest.mark.parametrize("kind", list(SPECS))
def test_fused_chunk_runner_matches_cut_mode(kind: str, recompute: str, joint: str, monkeypatch) -> None:
    """Fused mode agrees with cut mode, with the BW op's micro-batch split (weight gradients
    stashed for its W tasks) or joint (one backward() call): there the linears run as plain
    ``F.linear`` or, above the size limit (here: all of them), add their weight gradient
    into ``.grad`` during the call (grouped linears always do)."""
    from braid.tp import layers as tp_layers

    layers, embed, head = SPECS[kind]
    cut = _chunk_run(False, layers, embed, head, recompute)
    seen: list = []  # per deferred-gradient backward: the stash key, or "now" (accumulated at once)
    real = tp_layers.DeferredWeightGrad._stash_or_grad

    def spy(self, inp, grad_out):
        seen.append(self.split_mode.key if self.split_mode.on else "now" if self.native.accumulate else None)
        return real(self, inp, grad_out)

    monkeypatch.setattr(tp_layers.DeferredWeightGrad, "_stash_or_grad", spy)
    if joint == "joint-accumulate":
        monkeypatch.setattr(tp_layers, "JOINT_NATIVE_WORK", 0)
    fused = _chunk_run(True, layers, embed, head, recompute, joint=joint != "split")
    # mb 2 (BW2c0): stashed when split; when joint, plain modules, or (above the limit, the
    # linears only: the embedding is always plain) accumulated during the call; grouped linears
    # (Q/K/V, gate/up) are never plain modules: they accumulate at any size.
    assert (2 in seen) is (joint == "split") and None not in seen, sorted(set(map(str, seen)))
    accumulated = (joint == "joint-accumulate" and layers + head > 0) or (joint == "joint" and layers > 0)
    assert ("now" in seen) is accumulated, sorted(set(map(str, seen)))
    assert {0, 1} <= set(seen)
    assert fused[0] == pytest.approx(cut[0], abs=1e-6, rel=0) and len(fused[0]) == (3 if head else 0)
    assert sorted(fused[1]) == sorted(cut[1]) == ([] if embed else [0, 1, 2])
    for mb in cut[1]:
        assert _close(fused[1][mb], cut[1][mb]), f"input gradient of mb {mb}"
    assert sorted(fused[2]) == sorted(cut[2])
    for n in cut[2]:
        assert _close(fused[2][n], cut[2][n]), n
    assert 0 < fused[3] <= cut[3], "fused mode held more saved bytes than cut mode"


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to fp32 rounding: 1e-6 of the tensor's largest magnitude (at least 1e-6 absolute;
    the random output gradients here make some gradients ~100)."""
    return float((a - b).abs().max()) <= 1e-6 * max(1.0, float(b.abs().max()))



def test_chunks_shared_by_executors_of_two_programs() -> None:
    """The joint micro-batches are the running program's: chunks driven by a zb_v executor (B
    and W split) built *before* a braided_v executor (every backward a BW) on the same chunks
    still stash for zb_v's W ops, and both give the gradients of one autograd pass."""
    from braid import schedules
    from braid.core.compiler import compile_plan
    from braid.models.qwen2 import Qwen2Config, Qwen2Model
    from braid.runtime.executor import Executor
    from braid.models.build import build_rank_chunks

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden=32, layers=4, heads=4, kv_heads=2, ffn=64)
    model, m = Qwen2Model(cfg).double(), 4  # float64: reference_error's bound is ~1e-13 of the scale
    g = torch.Generator().manual_seed(1)
    toks = [torch.randint(0, 64, (1, 8), generator=g) for _ in range(m)]
    labs = [torch.randint(0, 64, (1, 8), generator=g) for _ in range(m)]
    ref = sum(model(t, lab) / m for t, lab in zip(toks, labs))
    ref.backward()
    plans = {name: schedules.build(name, 1, m) for name in ("zb_v", "braided_v")}
    chunks = build_rank_chunks(model, plans["zb_v"], 0, (2, 2))
    exs = {name: Executor(plan, compile_plan(plan)[0], chunks, pp_ranks=[0], act_shape=(1, 8, cfg.hidden), dtype=torch.float64)
           for name, plan in plans.items()}
    assert all(ex.fused == {0: True, 1: True} for ex in exs.values())
    for name in ("zb_v", "braided_v", "zb_v"):
        for ch in chunks.values():
            ch.zero_grad(set_to_none=True)
        res = exs[name].run(toks, labs)
        assert res.counts["W"] > 0
        assert chunks[0].joint == (frozenset(range(m)) if name == "braided_v" else frozenset())
        assert_matches_reference(res.loss, float(ref.detach()), what=f"{name} loss")
        scale = max(float(p.grad.abs().max()) for p in model.parameters())
        got = dict(chunks[0].embed.named_parameters(prefix="embed"))
        assert_matches_reference(got["embed.weight"].grad, model.embed_tokens.weight.grad, what=f"{name} embed", scale=scale)
        assert_matches_reference(chunks[1].lm_head.weight.grad, model.lm_head.weight.grad, what=f"{name} head", scale=scale)
        for ch, lays in ((chunks[0], model.layers[:2]), (chunks[1], model.layers[2:])):
            for mine, theirs in zip(ch.layers, lays):
                assert_matches_reference(mine.down_proj.weight.grad, theirs.down_proj.weight.grad, what=f"{name} down_proj",
                                         scale=scale)
                assert_matches_reference(mine.input_layernorm.weight.grad, theirs.input_layernorm.weight.grad,
                                         what=f"{name} input_layernorm", scale=scale)
