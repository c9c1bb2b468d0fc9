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

from tests.conftest import GPU_RUN_S, GPU_TEST_S  # noqa: E402

M, B, SEQ = 4, 1, 8
RTOL, ATOL = 1e-4, 1e-5  # megatron-core's logits against braid's: two implementations, not one in another order
LR, ADAM_EPS = 1e-2, 1e-8  # torch AdamW's default epsilon, as megatron-core's optimizer


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
    """One step's loss and every gradient, then two AdamW steps' losses, against the single-process
    model within :func:`reference_error.bound` (megatron-core runs in float32: it rounds some
    internals to float32 whatever its weights; the reference runs in float32 and float64).
    Returns per step (loss, reference loss, float64 reference loss, loss amplification)."""
    from braid.baselines import megatron_gpt as bm
    from braid.baselines.mcore import McorePipeline
    from braid.core.partition import layer_offset
    from braid.core.ir import stage_of
    from braid.core.topology import Topology
    from tests.reference_error import assert_matches_reference, loss_amplify

    groups = ctx.process_groups(Topology(ctx.world_size, pp=pp, tp=tp))
    model = _model(family)
    layers = (model.cfg.layers // (2 * pp),) * (2 * pp)
    dev = torch.device(f"cuda:{ctx.rank}" if device == "cuda" else "cpu")
    from braid.baselines.modes import McoreMode

    pipe = McorePipeline("mcore_1f1b_i", model, layers, M, groups=groups, device=dev,
                         dtype=torch.float32, seq_len=SEQ, mode=McoreMode.parse(mode))
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    data = _data(model.cfg.vocab_size, 2)
    # One step: loss and every gradient against the reference, in megatron-core's names and TP shards.
    toks, labs = data[0]
    loss = pipe.step((toks,), labs)
    ref_loss, ref64_loss = _ref_loss(ref, toks, labs), _ref_loss(ref64, toks, labs)
    ref_loss.backward()
    ref64_loss.backward()
    where = f"mcore_1f1b_i tp={tp} pp={pp} {device} rank={ctx.rank}"
    if loss is not None:
        assert_matches_reference(torch.tensor(loss, dtype=torch.float32), ref_loss.detach(), ref64_loss.detach(), what=f"{where} loss")

    def shards(m):
        return bm.tp_shard(bm.to_mcore({n: p.grad for n, p in m.named_parameters()}, model.cfg), groups.coords.tp, tp)

    grads, grads64 = shards(ref), shards(ref64)
    scale = max(float(p.grad.abs().max()) for p in ref.parameters())
    stages = [0] if pp == 1 else [stage_of("loop", pp, groups.coords.pp, c) for c in range(2)]
    for mod, s in zip(pipe.modules, stages):
        n = model.cfg.layers if pp == 1 else layers[s]
        first = 0 if pp == 1 else layer_offset(layers, s)
        want = bm.chunk_state(grads, first, n, embed=mod.pre_process, head=mod.post_process)
        want64 = bm.chunk_state(grads64, first, n, embed=mod.pre_process, head=mod.post_process)
        got = {k: p.grad.cpu() for k, p in mod.named_parameters()}
        assert got.keys() == want.keys()
        for k in want:
            assert_matches_reference(got[k], want[k], want64[k], what=f"{where} grad {k}", scale=scale)
    # Two AdamW steps from fresh gradients: the same losses as the reference.
    first_grads = [p.grad.detach().clone() for p in ref.parameters()]
    opt = pipe.optimizer(lr=LR)
    refs = [(m, torch.optim.AdamW(m.parameters(), lr=LR, eps=ADAM_EPS)) for m in (ref, ref64)]
    out = []
    for step, (toks, labs) in enumerate(data):
        opt.zero_grad(set_to_none=False)  # a graphed step accumulates into the gradients it captured
        got_loss = pipe.step((toks,), labs)
        opt.step()
        want = []
        for m, ref_opt in refs:
            ref_opt.zero_grad()
            lo = _ref_loss(m, toks, labs)
            lo.backward()
            ref_opt.step()
            want.append(float(lo.detach()))
        out.append((got_loss, *want, loss_amplify(first_grads, lr=LR, eps=ADAM_EPS, steps=step)))
    pipe.close()
    return out


def _check_losses(res: list, where: str) -> None:
    """The AdamW losses of :func:`_case_pipeline` within the rounding bound; some rank reports them."""
    from tests.reference_error import assert_matches_reference

    reported = [r for r in res if r[0][0] is not None]
    assert reported, "no rank reported the loss"
    for rank_steps in reported:
        for step, (loss, want, want64, amp) in enumerate(rank_steps):
            assert_matches_reference(torch.tensor(loss, dtype=torch.float32), torch.tensor(want, dtype=torch.float32), want64,
                                     what=f"{where} step {step} loss", amplify=amp)


@pytest.fixture(scope="module")
def pool(pools):
    return pools(2)


def test_mcore_logits_equal_braid(pool):
    assert all(pool.run(_case_logits, "qwen2")) and all(pool.run(_case_logits, "llama"))


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 1)])
def test_mcore_1f1b_i_matches_reference(pool, tp, pp):
    _check_losses(pool.run(_case_pipeline, tp, pp, "qwen2", timeout_s=240), f"tp={tp} pp={pp}")


def test_example_runs_mcore_beside_braid_with_reference_losses(tmp_path):
    """``--schedule braided_v mcore_1f1b_i`` at tp=2 x pp=1 (megatron-core's no-pipelining schedule with
    its own TP): every per-step loss within 1e-4 of the unsplit model."""
    from tests.test_examples import COMMON, LLM, _metrics, _ok, _torchrun

    metrics = tmp_path / "m.jsonl"
    names = ["braided_v", "mcore_1f1b_i"]
    _ok(_torchrun(2, LLM, *COMMON, "--tp", "2", "--pp", "1", "--steps", "2", "--reference", "--metrics", str(metrics),
                  "--schedule", *names, forked=True))
    got = _metrics(metrics)
    assert [m["schedule"] for m in got] == [n for n in names for _ in range(2)]
    by_step: dict[int, list[float]] = {}
    for m in got:
        by_step.setdefault(m["step"], []).append(m["loss"])
    for losses in by_step.values():
        assert max(losses) - min(losses) <= 1e-4 * max(losses)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.timeout(GPU_TEST_S)
@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 1)])
def test_mcore_1f1b_i_on_cuda_matches_reference(gpu_pools, tp, pp):
    """The same check on 2 GPUs over NCCL: megatron-core's CUDA paths (batched P2P, its RNG tracker), fp32."""
    _check_losses(gpu_pools(2).run(_case_pipeline, tp, pp, "qwen2", "cuda", timeout_s=GPU_RUN_S), f"cuda tp={tp} pp={pp}")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.timeout(GPU_TEST_S)
@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 1)])
def test_mcore_graphed_on_cuda_matches_reference(gpu_pools, tp, pp):
    """The graphed mode (``FullCudaGraphWrapper``: step 1 eager, step 2 captured and replayed, step 3
    replayed) on 2 GPUs: every loss and the first step's gradients as the unsplit model's."""
    _check_losses(gpu_pools(2).run(_case_pipeline, tp, pp, "qwen2", "cuda", "graphed", timeout_s=GPU_RUN_S),
                  f"cuda graphed tp={tp} pp={pp}")


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
def test_mcore_1f1b_i_tp2_pp2_matches_reference(pools):
    """tp=2 x pp=2 on 4 gloo ranks: megatron-core's TP inside its interleaved pipeline."""
    res = pools(4).run(_case_pipeline, 2, 2, "qwen2", timeout_s=300)
    assert len([r for r in res if r[0][0] is not None]) == 2, "both TP ranks of the last stage report the loss"
    _check_losses(res, "tp=2 pp=2")


def test_mcore_p2p_is_unbatched_in_every_mode():
    """megatron-core's batched P2P pairs the two directions wrongly when both neighbours are one rank
    (pp=2: a received activation matched with a sent gradient); its unbatched ops keep them apart.
    The CPU equivalence tests above run the unbatched ops at pp=2; every CUDA mode must use them too."""
    from braid.baselines import megatron_gpt as bm

    cfg = _model("qwen2").cfg
    for device, graphed in (("cpu", False), ("cuda", False), ("cuda", True)):
        conf = bm.transformer_config(cfg, pp=2, vp=2, device=device, graphed=graphed)
        assert not conf.batch_p2p_comm, (device, graphed)
        assert conf.overlap_p2p_comm == (device == "cuda" and not graphed), (device, graphed)
