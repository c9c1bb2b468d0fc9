"""The torch.distributed.pipelining baselines compute what one process computes.

Each of ``torch_1f1b_i``, ``torch_zb_v``, ``torch_dualpipe_v`` on 4 gloo ranks, at tp=1 x
pp=4 and at tp=2 x pp=2 (DTensor tensor parallelism with a vocabulary-parallel loss), for
the LLM and the VLM: the step's loss and every parameter's gradient match the single-process
model on the same weights and micro-batches, and two AdamW steps give the same losses (float64,
within the rounding bound of ``tests/reference_error.py``). The
baselines are what braid is measured against, so a wrong baseline would be a wrong claim.
"""

from __future__ import annotations

import copy

import pytest
import torch

from braid.baselines.torch_pp import TORCH_SCHEDULES
from tests.reference_error import assert_matches_reference, loss_amplify

M, B = 8, 1
LR, ADAM_EPS = 1e-2, 1e-8  # torch AdamW's default epsilon


@pytest.fixture(scope="module")
def pool(pools):
    return pools(4)


def _model(vlm: bool):
    from braid.models.qwen2 import Qwen2Config, Qwen2Model
    from braid.models.qwen2_vl import Qwen2VLConfig, Qwen2VLModel, vlm_preset

    lm = Qwen2Config(vocab_size=64, hidden=32, layers=8, heads=4, kv_heads=2, ffn=64)
    torch.manual_seed(3)
    if vlm:
        model = Qwen2VLModel(Qwen2VLConfig(lm, vlm_preset("tiny").vit))
        model.reset_parameters(0.2)
        return model.double()
    return Qwen2Model(lm).double()


def _data(model, vlm: bool, steps: int):
    g = torch.Generator().manual_seed(5)
    lm = model.lm if vlm else model
    seq = 6
    out = []
    for _ in range(steps):
        toks = torch.randint(0, lm.cfg.vocab_size, (M * B, seq), generator=g)
        labs = torch.randint(0, lm.cfg.vocab_size, (M * B, seq), generator=g)
        if vlm:  # every sample: its image's tokens, then text below the vision token ids
            size = model.cfg.vit.image_size
            pix = torch.randn(M * B, 3, size, size, generator=g, dtype=torch.float64)
            image = torch.tensor(model.cfg.image_tokens()).expand(M * B, -1)
            toks = torch.cat([image, toks % model.cfg.vision_start_token_id], dim=1)
            labs = torch.cat([torch.full_like(image, -100), labs], dim=1)
            out.append(((pix, toks), labs, labs))
        else:
            out.append(((toks,), labs, labs))
    return out


def _layers(model, vlm: bool, stages: int) -> tuple[int, ...]:
    if vlm:
        from braid.models.qwen2_vl import vlm_stage_layers

        return (0,) + vlm_stage_layers(model.cfg, stages, 0)[1:]  # LM layers per stage; stage 0 holds the ViT
    return (model.cfg.layers // stages,) * stages


def _ref_name(local: str, first: int, vlm: bool) -> str:
    pre = "lm." if vlm else ""
    head, _, rest = local.partition(".")
    if head == "layers":
        i, _, rest = rest.partition(".")
        return f"{pre}layers.{first + int(i)}.{rest}"
    return {"visual": f"visual.{rest}", "embed": f"{pre}embed_tokens.{rest}", "norm": f"{pre}norm.{rest}",
            "head": f"{pre}lm_head.{rest}"}[head]


def _run_baseline(ctx, name: str, tp: int, pp: int, vlm: bool):
    from braid.baselines.torch_pp import TorchPipeline
    from braid.core.partition import layer_offset
    from braid.core.topology import Topology

    groups = ctx.process_groups(Topology(4, pp=pp, tp=tp))
    model = _model(vlm)
    lm_layers = _layers(model, vlm, 2 * pp)
    pipe = TorchPipeline(name, model.lm if vlm else model, lm_layers, M, groups=groups, device=torch.device("cpu"),
                         dtype=torch.float64, vision=model.visual if vlm else None)
    opt = pipe.optimizer(lr=LR)  # foreach kernels, as on CUDA
    losses, grads = [], {}
    for i, (inputs, labels, _) in enumerate(_data(model, vlm, 2)):
        opt.zero_grad(set_to_none=True)
        losses.append(pipe.step(inputs, labels))
        if i == 0:
            for mod, st in zip(pipe.modules, pipe.stages):
                first = layer_offset(lm_layers, st.stage_index)
                for n, p in mod.named_parameters():
                    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # collective over TP
                    if groups.coords.tp == 0:
                        grads[_ref_name(n, first, vlm)] = g.detach().clone()
        opt.step()
    return losses, grads


def _reference(vlm: bool):
    model = _model(vlm)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    losses, grads = [], None
    for inputs, _, labs in _data(model, vlm, 2):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for k in range(M):
            sl = slice(k * B, (k + 1) * B)
            loss = model(*(x[sl] for x in inputs), labs[sl]) / M
            loss.backward()
            total += loss.item()
        losses.append(total)
        if grads is None:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
    return losses, grads


@pytest.mark.parametrize("vlm", [False, True], ids=["llm", "vlm"])
@pytest.mark.parametrize("tp,pp", [(1, 4), (2, 2)])
@pytest.mark.parametrize("name", sorted(TORCH_SCHEDULES))
def test_baseline_matches_single_process(pool, name: str, tp: int, pp: int, vlm: bool) -> None:
    ref_losses, ref_grads = _reference(vlm)
    got = pool.run(_run_baseline, name, tp, pp, vlm)
    reported = [losses for losses, _ in got if losses[0] is not None]
    assert len(reported) == tp  # the last stage's TP ranks report the loss
    for losses in reported:
        for step, (loss, want) in enumerate(zip(losses, ref_losses)):
            assert_matches_reference(loss, want, what=f"{name} tp={tp} pp={pp} step {step} loss",
                                     amplify=loss_amplify(ref_grads.values(), lr=LR, eps=ADAM_EPS, steps=step))
    seen = {}
    for _, grads in got:
        for n, g in grads.items():
            assert n not in seen, f"{n} held by two pipeline ranks"
            seen[n] = g
    assert sorted(seen) == sorted(ref_grads)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for n, g in seen.items():
        assert_matches_reference(g, ref_grads[n], what=f"{name} tp={tp} pp={pp} grad {n}", scale=scale)


def test_unknown_baseline_and_bad_layout_say_what_to_change() -> None:
    from types import SimpleNamespace

    from braid.baselines.torch_pp import TorchPipeline
    from braid.core.topology import Topology

    model, cpu = _model(False), torch.device("cpu")
    pp2 = SimpleNamespace(topo=Topology(2, pp=2), rank=0)
    with pytest.raises(ValueError, match="valid: torch_1f1b_i"):
        TorchPipeline("torch_gpipe", model, (2, 2, 2, 2), 2, groups=pp2, device=cpu, dtype=torch.float32)
    with pytest.raises(ValueError, match="2 virtual stages per rank"):
        TorchPipeline("torch_zb_v", model, (2, 2, 1, 1, 1, 1), 2, groups=pp2, device=cpu, dtype=torch.float32)
    with pytest.raises(ValueError, match="use dp=1"):
        TorchPipeline("torch_zb_v", model, (4, 4), 2, groups=SimpleNamespace(topo=Topology(2, pp=1, dp=2), rank=0), device=cpu,
                      dtype=torch.float32)
    with pytest.raises(ValueError, match="use m >= 4"):
        TorchPipeline("torch_dualpipe_v", model, (2, 2, 2, 2), 2, groups=pp2, device=cpu, dtype=torch.float32)


def test_stage_module_of_the_whole_model_is_the_model() -> None:
    from braid.baselines.torch_pp import StageModule, cross_entropy

    model = _model(False)
    (toks,), labs, _ = _data(model, False, 1)[0]
    whole = StageModule(model, 0, model.cfg.layers, embed=True, head=True)
    torch.testing.assert_close(cross_entropy(whole(toks), labs), model(toks, labs))
    assert copy.deepcopy(whole).embed is not model.embed_tokens
