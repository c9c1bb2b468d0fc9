"""megatron-core's interleaved 1F1B (``mcore_1f1b_i``) computes what one process computes.

The weight conversion braid <-> megatron-core is exact both ways, and a megatron-core GPT
model with converted weights gives braid's logits (Qwen2 with Q/K/V biases, Llama without).
On 2 gloo ranks (megatron-core's CUDA-only allocations redirected to the CPU by
:func:`braid.baselines.megatron_gpt.allow_cpu`), at tp=1 x pp=2 (interleaved, 2 chunks a rank) and tp=2 x
pp=1 (megatron-core's own TP): the step's loss and every gradient match the single-process
model, and two AdamW steps give the reference losses. Skipped without megatron-core.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install -e '.[megatron]')")

from tests.distributed_utils import DistPool  # noqa: E402

M, B, SEQ = 4, 1, 8
RTOL, ATOL = 1e-4, 1e-5


def _cfg(family: str = "qwen2"):
    from braid.models.llama import LlamaConfig
    from braid.models.qwen2 import Qwen2Config

    kw = dict(vocab_size=64, hidden=32, layers=4, heads=4, kv_heads=2, ffn=64)
    return Qwen2Config(**kw) if family == "qwen2" else LlamaConfig(**kw)


def _model(family: str = "qwen2"):
    from braid.models import registry

    cfg = _cfg(family)
    return registry.get_family(family).model_cls(cfg).init_weights(7)


def _data(vocab: int, steps: int):
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(steps):
        toks = torch.randint(0, vocab, (M * B, SEQ), generator=g)
        labs = torch.randint(0, vocab, (M * B, SEQ), generator=g)
        labs[0, :2] = -100  # ignored positions count as in the reference
        out.append((toks, labs))
    return out


def _ref_loss(model, toks, labs) -> torch.Tensor:
    from braid.baselines.torch_pp import cross_entropy

    return sum(cross_entropy(model.logits(t), l) for t, l in zip(toks.chunk(M), labs.chunk(M))) / M


def test_weight_conversion_round_trip():
    from braid.baselines import megatron_gpt as bm

    for family in ("qwen2", "llama"):
        model = _model(family)
        sd = model.state_dict()
        back = bm.from_mcore(bm.to_mcore(sd, model.cfg), model.cfg)
        assert back.keys() == sd.keys()
        for k, v in sd.items():
            assert torch.equal(back[k], v), k


def _case_logits(ctx, family: str):
    from braid.baselines import megatron_gpt as bm
    bm.ensure_parallel_state(1, 1, None)
    model = _model(family)
    gpt = bm.gpt_model(model.cfg, bm.transformer_config(model.cfg), seq_len=SEQ)
    gpt.load_state_dict(bm.to_mcore(model.state_dict(), model.cfg), strict=True)
    back = bm.from_mcore(gpt.state_dict(), model.cfg)
    toks = _data(model.cfg.vocab_size, 1)[0][0]
    pos = torch.arange(SEQ).expand(toks.shape)
    with torch.no_grad():
        got, want = gpt(toks, pos, None).float(), model.logits(toks)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    return True


def _case_pipeline(ctx, tp: int, pp: int, family: str, device: str = "cpu", mode: str = "eager"):
    from braid.baselines import megatron_gpt as bm
    from braid.baselines.mcore import McorePipeline
    from braid.core.partition import layer_offset
    from braid.core.ir import stage_of
    from braid.core.topology import Topology

    groups = ctx.process_groups(Topology(ctx.world_size, pp=pp, tp=tp))
    model = _model(family)
    layers = (model.cfg.layers // (2 * pp),) * (2 * pp)
    dev = torch.device(f"cuda:{ctx.rank}" if device == "cuda" else "cpu")
    rtol, atol = (RTOL, ATOL) if device == "cpu" else (1e-3, 1e-4)  # GPU kernels reduce in another order
    from braid.baselines.modes import McoreMode

    pipe = McorePipeline("mcore_1f1b_i", model, layers, M, groups=groups, device=dev,
                         dtype=torch.float32, seq_len=SEQ, mode=McoreMode.parse(mode))
    ref = copy.deepcopy(model)
    data = _data(model.cfg.vocab_size, 2)
    # One step: loss and every gradient against the reference, in megatron-core's names and TP shards.
    toks, labs = data[0]
    loss = pipe.step((toks,), labs)
    ref_loss = _ref_loss(ref, toks, labs)
    ref_loss.backward()
    if loss is not None:
        assert abs(loss - float(ref_loss)) < atol, (loss, float(ref_loss))
    grads = bm.tp_shard(bm.to_mcore({n: p.grad for n, p in ref.named_parameters()}, model.cfg), groups.coords.tp, tp)
    stages = [0] if pp == 1 else [stage_of("loop", pp, groups.coords.pp, c) for c in range(2)]
    for mod, s in zip(pipe.modules, stages):
        n = model.cfg.layers if pp == 1 else layers[s]
        first = 0 if pp == 1 else layer_offset(layers, s)
        want = bm.chunk_state(grads, first, n, embed=mod.pre_process, head=mod.post_process)
        got = {k: p.grad.cpu() for k, p in mod.named_parameters()}
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")
    # Two AdamW steps from fresh gradients: the same losses as the reference.
    opt, ref_opt = pipe.optimizer(lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_opt.zero_grad()
    losses, ref_losses = [], []
    for toks, labs in data:
        opt.zero_grad(set_to_none=False)  # a graphed step accumulates into the gradients it captured
        losses.append(pipe.step((toks,), labs))
        opt.step()
        ref_opt.zero_grad()
        lo = _ref_loss(ref, toks, labs)
        lo.backward()
        ref_opt.step()
        ref_losses.append(float(lo))
    pipe.close()
    return losses, ref_losses


@pytest.fixture(scope="module")
def pool():
    p = DistPool(2)
    yield p
    p.close()


def test_mcore_logits_equal_braid(pool):
    assert all(pool.run(_case_logits, "qwen2")) and all(pool.run(_case_logits, "llama"))


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 1)])
def test_mcore_1f1b_i_matches_reference(pool, tp, pp):
    res = pool.run(_case_pipeline, tp, pp, "qwen2", timeout_s=240)
    reported = [r for r in res if r[0][0] is not None]
    assert reported, "no rank reported the loss"
    for losses, ref_losses in reported:
        assert losses == pytest.approx(ref_losses, rel=1e-4, abs=1e-5)


def test_example_runs_mcore_beside_braid_with_reference_losses(tmp_path):
    """``--schedule braided_v mcore_1f1b_i`` at tp=2 x pp=1 (megatron-core's no-pipelining schedule with
    its own TP): every per-step loss within 1e-4 of the unsplit model."""
    from tests.test_examples import COMMON, LLM, _metrics, _ok, _torchrun

    metrics = tmp_path / "m.jsonl"
    names = ["braided_v", "mcore_1f1b_i"]
    _ok(_torchrun(2, LLM, *COMMON, "--tp", "2", "--pp", "1", "--steps", "2", "--reference", "--metrics", str(metrics),
                  "--schedule", *names))
    got = _metrics(metrics)
    assert [m["schedule"] for m in got] == [n for n in names for _ in range(2)]
    by_step: dict[int, list[float]] = {}
    for m in got:
        by_step.setdefault(m["step"], []).append(m["loss"])
    for losses in by_step.values():
        assert max(losses) - min(losses) <= 1e-4 * max(losses)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 1)])
def test_mcore_1f1b_i_on_cuda_matches_reference(tp, pp):
    """The same check on 2 GPUs over NCCL: megatron-core's CUDA paths (batched P2P, its RNG tracker), fp32."""
    pool = DistPool(2, device="cuda")
    try:
        res = pool.run(_case_pipeline, tp, pp, "qwen2", "cuda", timeout_s=300)
    finally:
        pool.close()
    reported = [r for r in res if r[0][0] is not None]
    assert reported, "no rank reported the loss"
    for losses, ref_losses in reported:
        assert losses == pytest.approx(ref_losses, rel=1e-3, abs=1e-4)  # TF32/cuBLAS reductions vs the CPU reference


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 1)])
def test_mcore_graphed_on_cuda_matches_reference(tp, pp):
    """The graphed mode (``FullCudaGraphWrapper``: step 1 eager, step 2 captured and replayed, step 3
    replayed) on 2 GPUs: every loss and the first step's gradients as the unsplit model's."""
    pool = DistPool(2, device="cuda")
    try:
        res = pool.run(_case_pipeline, tp, pp, "qwen2", "cuda", "graphed", timeout_s=300)
    finally:
        pool.close()
    reported = [r for r in res if r[0][0] is not None]
    assert reported, "no rank reported the loss"
    for losses, ref_losses in reported:
        assert losses == pytest.approx(ref_losses, rel=1e-3, abs=1e-4)  # as the eager test above


def test_mcore_modes_that_cannot_run_here_say_why():
    from braid.baselines.modes import McoreMode

    assert "needs CUDA" in McoreMode.parse("graphed").unavailable("cpu")
    assert "needs CUDA" in McoreMode.parse("te").unavailable("cpu")
    assert McoreMode.parse("eager").unavailable("cpu") is None


def test_te_names_hold_the_norms_in_the_linears():
    from braid.baselines import megatron_gpt as bm

    state = {"decoder.layers.3.input_layernorm.weight": 1, "decoder.layers.3.pre_mlp_layernorm.weight": 2,
             "decoder.layers.3.mlp.linear_fc2.weight": 3, "decoder.final_layernorm.weight": 4}
    assert bm.te_state(state) == {"decoder.layers.3.self_attention.linear_qkv.layer_norm_weight": 1,
                                  "decoder.layers.3.mlp.linear_fc1.layer_norm_weight": 2,
                                  "decoder.layers.3.mlp.linear_fc2.weight": 3, "decoder.final_layernorm.weight": 4}


@pytest.mark.slow
def test_mcore_1f1b_i_tp2_pp2_matches_reference():
    """tp=2 x pp=2 on 4 gloo ranks: megatron-core's TP inside its interleaved pipeline."""
    pool = DistPool(4)
    try:
        res = pool.run(_case_pipeline, 2, 2, "qwen2", timeout_s=300)
    finally:
        pool.close()
    reported = [r for r in res if r[0][0] is not None]
    assert len(reported) == 2, "both TP ranks of the last stage report the loss"
    for losses, ref_losses in reported:
        assert losses == pytest.approx(ref_losses, rel=1e-4, abs=1e-5)
