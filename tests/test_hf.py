"""braid.hf against transformers on tiny random checkpoints (written locally, no network).

For each family -- Qwen2, Qwen2.5 (tied head), Llama (untied, tied, Llama-3.1 RoPE) -- a checkpoint
written by ``save_pretrained`` (sharded, with an index) loads with ``braid.hf.load`` and
gives HF's logits within 1e-5 in fp32, the same loss with HF's label convention and the
same gradients; ``braid.hf.save`` output loads in transformers with equal logits; a rank's
chunks read only their own tensors.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the test extra
pytest.importorskip("safetensors")

import braid.hf as bhf  # noqa: E402
from braid import schedules  # noqa: E402
from braid.models.build import build_rank_chunks  # noqa: E402

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6)),
    "qwen2.5-tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False, rope_theta=5e5, rms_norm_eps=1e-5)),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, rope_theta=5e5, rms_norm_eps=1e-5)),
    # Llama-3.1's RoPE scaling; a short original context so that every frequency band is exercised
    "llama3.1": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
}


def _hf_model(kind: str, seed: int = 0):
    cfg_name, cls_name, extra = FAMILIES[kind]
    cfg = getattr(transformers, cfg_name)(**SHAPE, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(cfg).eval()
    with torch.no_grad():  # random weights of a size that makes every term matter (HF's init is ~0.02)
        for n, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    """(kind, HF model, directory written by save_pretrained in several shards)."""
    kind = request.param
    model = _hf_model(kind)
    path = tmp_path_factory.mktemp(kind.replace(".", "_"))
    model.save_pretrained(path, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    return kind, model, path


def _batch(vocab: int = SHAPE["vocab_size"]):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 12), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt that takes no loss
    return ids, labels


def test_load_gives_hf_logits_loss_and_gradients(checkpoint) -> None:
    kind, hf, path = checkpoint
    model = bhf.load(path)
    assert type(model).__name__ == ("LlamaModel" if kind.startswith("llama") else "Qwen2Model")
    assert model.cfg.tie_embeddings == kind.endswith("tied")
    assert (getattr(model.cfg, "llama3_rope", None) is not None) == (kind == "llama3.1")
    ids, labels = _batch()
    out = hf(ids, labels=labels)
    logits = model.logits(ids)
    torch.testing.assert_close(logits, out.logits, rtol=0, atol=1e-5)
    loss = model(ids, bhf.shift_labels(labels))
    torch.testing.assert_close(loss, out.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(bhf.causal_lm_loss(logits, labels), out.loss, rtol=1e-6, atol=1e-6)
    out.loss.backward()
    loss.backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    from braid.models.registry import family_of

    key = family_of(model).hf_key
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, hf_grads[key(n)], rtol=1e-4, atol=1e-6, msg=lambda s: f"{kind} grad {n}: {s}")


def test_save_loads_in_transformers_with_equal_logits(checkpoint, tmp_path) -> None:
    kind, _, path = checkpoint
    model = bhf.load(path)
    out = bhf.save(model, tmp_path / "saved")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == ("llama" if kind.startswith("llama") else "qwen2")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model.logits(ids), rtol=0, atol=1e-5)
    again = bhf.load(out)
    for (n, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), n


def test_shift_labels_moves_targets_left() -> None:
    labels = torch.tensor([[5, 6, -100, 7]])
    assert bhf.shift_labels(labels).tolist() == [[6, -100, 7, -100]]


def test_chunks_read_only_their_tensors(tmp_path) -> None:
    hf = _hf_model("qwen2.5-tied")
    hf.save_pretrained(tmp_path)
    full = bhf.load(tmp_path)
    plan = schedules.build("1f1b", 2, 2)
    layers = (2, 1)
    for pp_rank in range(2):
        meta = bhf.load_meta(tmp_path)
        chunks = build_rank_chunks(meta, plan, pp_rank, layers, tp_rank=1, tp_size=2)
        want = build_rank_chunks(full, plan, pp_rank, layers, tp_rank=1, tp_size=2)
        read = set(meta.braid_source.read)
        own = range(0, 2) if pp_rank == 0 else range(2, 3)
        layer_keys = {k for k in read if ".layers." in k}
        assert {int(k.split(".")[2]) for k in layer_keys} == set(own)
        ends = read - layer_keys
        assert ends == ({"model.embed_tokens.weight"} if pp_rank == 0 else {"model.embed_tokens.weight", "model.norm.weight"})
        for c in chunks:
            w = dict(want[c].named_parameters())
            for n, p in chunks[c].named_parameters():
                assert torch.equal(p, w[n]), f"rank {pp_rank} chunk {c} {n}"


def test_half_layer_chunks_read_only_their_halfs_tensors(tmp_path) -> None:
    """Stages of 1.5 layers: the first reads layer 1's attention half only, the second its MLP
    half (and layer 2), and the chunks equal those built from the loaded model."""
    hf = _hf_model("qwen2.5-tied")
    hf.save_pretrained(tmp_path)
    full = bhf.load(tmp_path)
    plan = schedules.build("1f1b", 2, 2)
    layers = (1.5, 1.5)
    attn = {"input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
            "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.o_proj.weight"}
    mlp = {"post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
    for pp_rank, want_layer1 in ((0, attn), (1, mlp)):
        meta = bhf.load_meta(tmp_path)
        chunks = build_rank_chunks(meta, plan, pp_rank, layers, tp_rank=0, tp_size=2)
        want = build_rank_chunks(full, plan, pp_rank, layers, tp_rank=0, tp_size=2)
        read = set(meta.braid_source.read)
        assert {k.split(".", 3)[3] for k in read if k.startswith("model.layers.1.")} == want_layer1
        assert {int(k.split(".")[2]) for k in read if ".layers." in k} == ({0, 1} if pp_rank == 0 else {1, 2})
        for c in chunks:
            w = dict(want[c].named_parameters())
            assert {n for n, _ in chunks[c].named_parameters()} == set(w)
            for n, p in chunks[c].named_parameters():
                assert torch.equal(p, w[n]), f"rank {pp_rank} chunk {c} {n}"  # an unread (NaN) parameter would differ


def test_bad_checkpoints_are_one_clear_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        bhf.load(tmp_path)
    hf = _hf_model("llama")
    hf.save_pretrained(tmp_path / "ok")
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    for change, msg in [({"model_type": "gpt2"}, "unsupported HF model_type 'gpt2'"),
                        ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "RoPE scaling"),
                        ({"attention_bias": True}, "attention_bias=true is not supported"),
                        ({"num_hidden_layers": 4}, "lacks 9 tensor")]:
        bad = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        bad.mkdir()
        for f in (tmp_path / "ok").iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        (bad / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=msg):
            bhf.load(bad)
    with pytest.raises(ValueError, match="not an empty directory"):
        bhf.save(bhf.load(tmp_path / "ok"), tmp_path / "ok")
