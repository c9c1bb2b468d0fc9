"""The training machinery against one process: sharded fp32-master AdamW, global-norm clipping,
learning-rate schedules and weight-decay groups.

Distributed cases (gloo, CPU, fp32) train the executor's split model for three steps
beside the unsplit model: the gradient norm of every step, the loss and the parameters
after the last step must match (``training_cases``). Single-process tests check the pieces:
fp32 accumulation of bf16 contributions, the schedule's shape, the weight-decay groups.
"""

from __future__ import annotations

import math

import pytest
import torch

import training_cases as cases


# (pp, tp, schedule, mode, clip, weight decay, warm-up, decay) on 4 ranks (dp = 4 / (pp * tp))
CASES_4 = [
    (2, 1, "braided_v", "zero1", 0.5, 0.1, 1, "cosine"),   # dp=2 x pp=2
    (1, 2, "1f1b", "zero1", 0.5, 0.1, 1, "linear"),        # dp=2 x tp=2
    (2, 2, "zb_h1", "zero1", 0.5, 0.1, 1, "cosine"),       # tp=2 x pp=2, dp=1
    (2, 2, "braided_v", "plain", 0.5, 0.1, 0, "cosine"),   # the norm on p.grad at tp=2 x pp=2
    (2, 1, "1f1b", "master", None, 0.0, 0, "constant"),    # fp32 masters without sharding
    (1, 1, "gpipe", "zero1", None, 0.1, 2, "cosine"),      # dp=4: shards cut through parameters
    (1, 1, "gpipe", "plain", 0.5, 0.1, 0, "linear"),       # dp=4, replicas count the norm once
]


@pytest.mark.slow
def test_optimizers_match_the_single_process_run(pools) -> None:
    pool = pools(4)
    for case in CASES_4:
        norms = pool.run(cases.optimizer_matches_reference, *case, timeout_s=300)
        assert all(n == norms[0] for n in norms), f"{case}: ranks disagree on the norm {norms}"
        if case[4] is not None:
            assert max(norms[0]) > case[4], f"{case}: clipping never engaged (norms {norms[0]}), the case tests nothing"


@pytest.mark.slow
def test_sharded_state_dict_resumes_through_dcp(pools, tmp_path) -> None:
    pools(4).run(cases.state_dict_resumes, 2, 1, "braided_v", str(tmp_path / "ckpt"), timeout_s=300)


@pytest.mark.slow
def test_nonfinite_norm_skips_the_update(pools) -> None:
    pools(4).run(cases.nonfinite_norm_skips_update, timeout_s=120)


# -- single process ------------------------------------------------------------------------
def test_bf16_contributions_accumulate_in_fp32() -> None:
    """Deferred weight gradients and autograd's own both land in the fp32 buffer, unrounded."""
    from braid.models.qwen2 import RMSNorm
    from braid.tp.layers import ColumnParallelLinear, split_weight_grads
    from braid.training.optimizer import ShardedAdamW

    torch.manual_seed(0)
    lin = ColumnParallelLinear(torch.randn(8, 16).bfloat16(), None)
    norm = RMSNorm(16, 1e-6).bfloat16()
    lin_ref, norm_ref = ColumnParallelLinear(lin.weight.detach(), None), RMSNorm(16, 1e-6).bfloat16()
    opt = ShardedAdamW([("lin", lin.weight), ("norm", norm.weight)], lr=1e-3)
    xs = [torch.randn(4, 16).bfloat16() * (10.0 ** k) for k in range(4)]  # contributions of very different sizes
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []
    for mb, x in enumerate(xs):
        with split_weight_grads([lin], mb):  # W deferred: accumulated by weight_backward
            lin(norm(x)).float().square().sum().backward()  # the norm weight: by autograd
        lin.weight_backward(mb)
        parts.append(torch.autograd.grad(lin_ref(norm_ref(x)).float().square().sum(), [lin_ref.weight, norm_ref.weight]))
    assert lin.weight.grad is None and norm.weight.grad is None, "gradients must not stay in bf16 .grad"
    for i, p in enumerate((lin.weight, norm.weight)):
        want = sum(g[i].float() for g in parts)
        torch.testing.assert_close(p.main_grad, want, rtol=0, atol=0)
        rounded = torch.zeros_like(parts[0][i])
        for g in parts:
            rounded += g[i]
        assert not torch.equal(rounded.float(), want), "the test's sizes must make bf16 accumulation lose bits"
    opt.remove_hooks()


def test_sharded_adamw_single_rank_equals_torch_adamw() -> None:
    from braid.training.grads import param_groups
    from braid.training.optimizer import ShardedAdamW

    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    b = torch.nn.Sequential(*[type(m)(*_args(m)) for m in a])
    b.load_state_dict(a.state_dict())
    ref = torch.optim.AdamW(param_groups(a.parameters(), 0.1), lr=1e-2)
    opt = ShardedAdamW(list(b.named_parameters()), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        x = torch.randn(4, 6)
        ref.zero_grad()
        opt.zero_grad()
        a(x).square().sum().backward()
        b(x).square().sum().backward()
        norm = opt.step()
        want = torch.nn.utils.clip_grad_norm_(a.parameters(), float("inf"))
        ref.step()
        assert math.isclose(norm, float(want), rel_tol=1e-6)
    for (n, p), q in zip(b.named_parameters(), a.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=n)
    opt.remove_hooks()


def _args(m: torch.nn.Module) -> tuple:
    return (m.in_features, m.out_features) if isinstance(m, torch.nn.Linear) else (m.normalized_shape,)


def test_weight_decay_groups_exclude_norms_and_biases() -> None:
    from braid.training.grads import param_groups

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Embedding(5, 4))
    decayed, plain = param_groups(model.parameters(), 0.1)
    assert {id(p) for p in decayed["params"]} == {id(model[0].weight), id(model[2].weight)}
    assert {id(p) for p in plain["params"]} == {id(model[0].bias), id(model[1].weight), id(model[1].bias)}
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_lr_schedule_warms_up_then_decays_to_the_floor(decay: str) -> None:
    from braid.training.lr import build_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(opt, total=10, warmup=4, decay=decay, lr=2.0, min_lr=0.2)
    lrs = []
    for _ in range(12):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([0.5, 1.0, 1.5, 2.0])
    if decay == "constant":
        assert lrs[4:] == pytest.approx([2.0] * 8)
    else:
        assert lrs[4] == pytest.approx(2.0)
        assert all(a >= b for a, b in zip(lrs[4:], lrs[5:])), lrs
        assert lrs[10:] == pytest.approx([0.2, 0.2])
        mid = 0.2 + 1.8 * (0.5 if decay == "cosine" else 0.5)  # half-way through the 6 decay steps
        assert lrs[7] == pytest.approx(mid)
    state = sched.state_dict()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched2 = build_scheduler(opt2, total=10, warmup=4, decay=decay, lr=2.0, min_lr=0.2)
    sched2.load_state_dict(state)
    assert sched2.get_last_lr() == sched.get_last_lr()


def test_lr_schedule_rejects_bad_settings() -> None:
    from braid.training.lr import LRSchedule

    with pytest.raises(ValueError, match="decay must be one of"):
        LRSchedule(10, 2, "step")
    with pytest.raises(ValueError, match="warmup"):
        LRSchedule(10, 11)


def test_reference_comparison_catches_a_scaled_gradient() -> None:
    """A gradient 5x too large leaves AdamW's losses nearly unchanged; the norm comparison fails it."""
    from braid.models.qwen2 import Qwen2Config, Qwen2Model
    from braid.training.step import OptimConfig, Optimization, reference_mismatches

    cfg = Qwen2Config(layers=2, **cases.CFG_KW)
    torch.manual_seed(0)
    model = Qwen2Model(cfg)
    data = cases._steps_data(cfg, 2, 3)
    runs = []
    for mult in (1.0, 5.0):
        m = __import__("copy").deepcopy(model)
        opt = Optimization(OptimConfig(lr=1e-3, total_steps=3, weight_decay=0.0), list(m.named_parameters()), [m])
        losses, norms = [], []
        for toks, labs in data:
            opt.zero_grad()
            total = 0.0
            for t, lab in zip(toks, labs):
                loss = m(t, lab) / len(toks)
                (loss * mult).backward()
                total += loss.item()
            norms.append(opt.step())
            losses.append(total)
        runs.append((losses, norms))
    (ref_l, ref_n), (bad_l, bad_n) = runs
    assert reference_mismatches(bad_l, [None] * 3, ref_l, ref_n, 1e-4) == [], "the losses alone must not tell (else the test shows nothing)"
    found = reference_mismatches(bad_l, bad_n, ref_l, ref_n, 1e-4)
    assert len(found) == 3 and all("gradient norm" in f for f in found), found
    assert reference_mismatches(ref_l, ref_n, ref_l, ref_n, 1e-4) == []


def test_optim_config_refuses_settings_that_cannot_work() -> None:
    from braid.training.step import OptimConfig

    for bad, match in [(dict(lr=0.0), "lr > 0"), (dict(lr=1e-3, min_lr=1e-2), "min_lr"), (dict(warmup=5, total_steps=3), "warm-up"),
                       (dict(clip=0.0), "positive max norm"), (dict(weight_decay=-1.0), "weight decay")]:
        with pytest.raises(ValueError, match=match):
            OptimConfig(**bad).check()


def test_recipe_learning_rate_and_warmup_follow_the_model_size() -> None:
    """The examples' defaults: GPT-3's table (log-log between its sizes), the tiny presets' 1e-3 below it."""
    from braid.training.lr import RECIPE_LR, RECIPE_WARMUP, TINY_LR, recipe_lr, recipe_warmup

    assert recipe_lr(80_000) == TINY_LR and recipe_warmup(80_000) == 0
    for n, lr in RECIPE_LR:
        assert recipe_lr(n) == pytest.approx(lr)
    assert recipe_lr(6.7e9) > recipe_lr(8.3e9) > recipe_lr(13e9)  # Qwen2-VL-7B's 8.3B parameters fall between
    assert recipe_lr(1e12) == RECIPE_LR[-1][1]
    assert recipe_warmup(7e9) == RECIPE_WARMUP and recipe_warmup(1e8) == 0


def test_a_rank_holding_padding_only_resumes_at_the_saved_step(monkeypatch) -> None:
    """Three elements over four sharding ranks: rank 3's shard is padding only (an empty piece in the optimizer).
    Loading a state restores the step count there too, so the state it saves next carries it."""
    from braid.training import optimizer as mod

    monkeypatch.setattr(mod.dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(mod.dist, "get_rank", lambda group=None: 3)
    opt = mod.ShardedAdamW([("w", torch.nn.Parameter(torch.ones(3)))], group=object())
    assert not opt.pieces and len(opt.state) == 1
    opt.load_state_dict({"step": torch.tensor(5.0), "params": {"w": {k: torch.ones(3) for k in ("master", "exp_avg", "exp_avg_sq")}}})
    assert opt._step_count_value() == 5.0
