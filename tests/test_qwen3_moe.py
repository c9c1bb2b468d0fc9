"""Qwen3 and Qwen3-MoE against transformers on tiny random checkpoints (written locally, no network).

A checkpoint written by ``save_pretrained`` loads with ``braid.hf.load`` and gives HF's logits,
loss (the load-balancing loss included, with a coefficient large enough to matter) and every
gradient in fp32 within HF's own fp32 rounding (its norms and router sums run in fp32);
``braid.hf.save`` output loads in transformers with equal logits. The expert GEMMs' two paths
(``torch._grouped_mm``, the loop over experts) agree; bad expert tensors are one clear error.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the test extra
pytest.importorskip("safetensors")

import braid.hf as bhf  # noqa: E402
from braid.cost.catalog import get_model  # noqa: E402
from braid.models.moe import GroupedLinear, grouped_mm_runs  # noqa: E402
from braid.models.shapes import decoder_config  # noqa: E402

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, rope_theta=1e4, rms_norm_eps=1e-6)  # heads x head_dim != hidden
MOE = dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
           mlp_only_layers=[1], output_router_logits=True, router_aux_loss_coef=0.5)


def _hf_model(moe: bool, **changes):
    cfg = (transformers.Qwen3MoeConfig(**SHAPE, **MOE, **changes) if moe else transformers.Qwen3Config(**SHAPE, **changes))
    cfg._experts_implementation = "eager"  # HF's grouped path takes no float64; the eager loop is its reference
    torch.manual_seed(0)
    model = (transformers.Qwen3MoeForCausalLM if moe else transformers.Qwen3ForCausalLM)(cfg).eval()
    with torch.no_grad():  # weights of a size that makes every term matter (HF's init is ~0.02)
        for n, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.2 * torch.randn_like(p))
    return model


def _hf_grads(hf) -> dict[str, torch.Tensor]:
    """HF's gradients under checkpoint tensor names (its fused in-memory expert stacks split per expert)."""
    out = {}
    for n, p in hf.named_parameters():
        base = n.rsplit(".", 1)[0]
        if n.endswith("experts.gate_up_proj"):
            for e, g in enumerate(p.grad):
                out[f"{base}.{e}.gate_proj.weight"], out[f"{base}.{e}.up_proj.weight"] = g.chunk(2)
        elif n.endswith("experts.down_proj"):
            out.update({f"{base}.{e}.down_proj.weight": g for e, g in enumerate(p.grad)})
        else:
            out[n] = p.grad
    return out


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3_moe"])
def test_load_matches_transformers_and_save_loads_back(moe: bool, tmp_path) -> None:
    hf = _hf_model(moe)
    hf.save_pretrained(tmp_path / "hf")
    model = bhf.load(tmp_path / "hf")
    assert type(model).__name__ == ("Qwen3MoeModel" if moe else "Qwen3Model")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 12), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100
    out = hf(input_ids=ids, labels=labels)
    torch.testing.assert_close(model.logits(ids), out.logits, rtol=0, atol=1e-5)
    loss = model(ids, bhf.shift_labels(labels))
    torch.testing.assert_close(loss, out.loss, rtol=1e-6, atol=1e-6)
    if moe:  # the load-balancing loss is in both, and it is not small
        with torch.no_grad():
            assert float(out.aux_loss) > 0.5 and abs(float(loss - bhf.causal_lm_loss(model.logits(ids), labels))) > 0.1
    out.loss.backward()
    loss.backward()
    want = _hf_grads(hf)
    from braid.models.registry import family_of

    got = family_of(model).weights(model.cfg).write({n: p.grad for n, p in model.named_parameters()})
    assert set(got) == set(want)
    for k, gk in got.items():
        torch.testing.assert_close(gk, want[k], rtol=1e-4, atol=1e-6, msg=lambda s: f"grad {k}: {s}")
    bhf.save(model, tmp_path / "braid")
    back = type(hf).from_pretrained(tmp_path / "braid", experts_implementation="eager") if moe else \
        type(hf).from_pretrained(tmp_path / "braid")
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, model.logits(ids), rtol=0, atol=1e-5)


def test_grouped_gemm_and_expert_loop_agree() -> None:
    """``torch._grouped_mm`` (fp32, aligned rows) and the loop (fp64): forward, input and weight gradients;
    an expert with no rows included."""
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 5, 2])
    x64 = torch.randn(10, 16, dtype=torch.float64, requires_grad=True)
    lin = GroupedLinear(4, 16, 8).double()
    torch.nn.init.normal_(lin.weight)
    g = torch.randn(10, 8, dtype=torch.float64)
    (lin(x64, counts) * g).sum().backward()
    x32 = x64.detach().float().requires_grad_()
    lin32 = GroupedLinear.from_weight(lin.weight.float())
    assert grouped_mm_runs(x32, lin32.weight) and not grouped_mm_runs(x64, lin.weight)
    y32 = lin32(x32, counts)
    (y32 * g.float()).sum().backward()
    torch.testing.assert_close(y32.double(), lin(x64, counts), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x32.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin32.weight.grad.double(), lin.weight.grad, rtol=1e-5, atol=1e-5)
    assert torch.equal(lin.weight.grad[1], torch.zeros_like(lin.weight.grad[1]))


def test_bad_expert_checkpoints_are_one_clear_error(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    _hf_model(True).save_pretrained(tmp_path / "ok")
    tensors = load_file(tmp_path / "ok" / "model.safetensors")
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    key = "model.layers.0.mlp.experts.3.up_proj.weight"
    cases = [
        ({k: t for k, t in tensors.items() if k != key}, {}, f"lacks 1 tensor.*{key}"),
        ({**tensors, key: tensors[key][:-1]}, {}, rf"tensor '{key}' has shape \(15, 32\), .* expects \(16, 32\)"),
        (tensors, {"num_experts": 3}, "not used by a qwen3_moe model"),
        (tensors, {"num_experts_per_tok": 5}, "experts_per_token .top-k 5. must be between 1 and the 4 experts"),
    ]
    for i, (state, change, msg) in enumerate(cases):
        bad = tmp_path / f"bad{i}"
        bad.mkdir()
        save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
        (bad / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=msg):
            bhf.load(bad)


def test_catalog_presets_have_the_published_sizes() -> None:
    """30B-A3B and 235B-A22B: total and active parameters as published; the meta-device model agrees."""
    from braid.models.build import meta_model
    from braid.models.qwen3_moe import Qwen3MoeModel

    for name, total, active in (("qwen3-moe-30b-a3b", 30.5e9, 3.3e9), ("qwen3-moe-235b-a22b", 235e9, 22e9)):
        m = get_model(name)
        assert abs(m.params() - total) / total < 0.01 and abs(m.active_params() - active) / active < 0.03, name
        model = meta_model(Qwen3MoeModel, decoder_config(m, layers=2), seed=0)
        layer_params = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.0.") and "norm" not in n)
        assert layer_params == m.lm_layer_params(), name
    tiny = decoder_config(get_model("qwen3-moe-tiny"))
    assert (tiny.experts, tiny.experts_per_token, tiny.moe_ffn) == (4, 2, 16)


def test_expert_parallel_layouts_that_cannot_work_are_one_line() -> None:
    from braid.runtime.expert_parallel import check_expert_layout, expert_rank_groups
    from braid.core.topology import Topology

    for (ep, dp, experts, tp), msg in (((2, 3, 4, 1), r"--ep 2 must divide the data-parallel ranks \(dp=3\)"),
                                       ((4, 4, 6, 1), "--ep 4 must divide the model's 6 experts"),
                                       ((2, 2, 6, 2), r"--ep 2 x --tp 2 \(4\) must divide the model's 6 experts"),
                                       ((0, 2, 4, 1), "--ep must be a positive integer")):
        with pytest.raises(ValueError, match=msg):
            check_expert_layout(ep, dp, experts=experts, tp=tp)
    # megatron-core's folding: consecutive DP ranks share tokens, strided ones share experts
    assert expert_rank_groups(Topology(8, pp=2, dp=4), 2) == ([[0, 2], [4, 6], [1, 3], [5, 7]], [[0, 4], [2, 6], [1, 5], [3, 7]])
