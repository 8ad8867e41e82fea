"""ppo_core/generate.py and the decoding path of ppo_core/model.py, without transformers (runs everywhere).

    python -m pytest -q tests/test_generate.py

Tiny random models of several families (odd sizes). Parity of greedy tokens with transformers' generate is in
tests/test_model_parity.py; here: the CPU fast path against the plain F.linear reference, EOS handling,
log-probs against a full forward, sampling controls.
"""
import pytest
import torch

import ppo_core
from ppo_core.generate import filter_logits
from ppo_core.model import CausalLM, KVCache, Linear, ModelArgs, can_pack_for_cpu, cpu_packed_linears

BASE = dict(vocab_size=131, hidden_size=60, intermediate_size=86, num_hidden_layers=4, num_attention_heads=6,
            num_key_value_heads=3, max_position_embeddings=128)
CONFIGS = {
    "llama_bias": dict(architectures=["LlamaForCausalLM"], attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], head_dim=14),
    "smollm3": dict(architectures=["SmolLM3ForCausalLM"]),
    "olmo": dict(architectures=["OlmoForCausalLM"], clip_qkv=0.9),
    "olmo3": dict(architectures=["Olmo3ForCausalLM"], sliding_window=5),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: a second thread only adds synchronisation
    yield
    torch.set_num_threads(threads)


def tiny(name, seed=0):
    torch.manual_seed(seed)
    model = CausalLM(ModelArgs.from_hf_config({**BASE, **CONFIGS[name]})).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in pname else torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model


def prompts(B=3, P=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 131, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_cpu_linears_match_plain_f_linear(name):
    """The fast path (oneDNN-packed weights) against its reference (F.linear): same logits to float32 rounding,
    prefill and decode, and nothing left packed afterwards."""
    model = tiny(name)
    assert can_pack_for_cpu(model)
    ids, mask = prompts(P=9)
    with torch.no_grad():
        plain = model(ids, mask)
        with cpu_packed_linears(model, ids.shape[0]):
            assert model.lm_head.packed_weight is not None and model.model.layers[0].self_attn.packed_qkv is not None
            packed = model(ids, mask)
            cache = KVCache(model.args, 3, 9, "cpu", torch.float32)
            steps = [model(ids[:, :4], mask[:, :4], cache=cache)] + [model(ids[:, t : t + 1], cache=cache) for t in range(4, 9)]
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
    real = mask.bool()
    torch.testing.assert_close(torch.cat(steps, 1)[real], plain[real], rtol=1e-5, atol=1e-5)
    assert all(m.packed_weight is None for m in model.modules() if isinstance(m, Linear))
    assert all(layer.self_attn.packed_qkv is None and layer.mlp.packed_gate_up is None for layer in model.model.layers)


@needs_onednn
def test_packed_path_is_ignored_under_autograd():
    model = tiny("qwen3").train()
    ids, mask = prompts()
    with cpu_packed_linears(model, 3):
        loss = model(ids, mask).pow(2).mean()  # grad enabled: F.linear, so backward works
        loss.backward()
    assert model.lm_head.weight.grad is not None


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_tokens_same_with_and_without_the_fast_path_and_one_by_one(name):
    model = tiny(name)
    ids, mask = prompts()
    fast = ppo_core.generate(model, ids, 9, attention_mask=mask, greedy=True, stop_at_eos=False)
    plain = ppo_core.generate(model, ids, 9, attention_mask=mask, greedy=True, stop_at_eos=False, cpu_packed_weights=False)
    assert torch.equal(fast, plain)
    for b in range(3):
        alone = ppo_core.generate(model, ids[b : b + 1, mask[b].bool()], 9, greedy=True, stop_at_eos=False)
        assert torch.equal(alone[0], fast[b]), b


def test_generate_stops_at_eos_and_pads():
    model = tiny("qwen3")
    ids, mask = prompts()
    free = ppo_core.generate(model, ids, 8, attention_mask=mask, greedy=True, stop_at_eos=False)
    eos = int(free[0, 2])  # pretend the third token of row 0 is EOS
    out, lp = ppo_core.generate(model, ids, 8, attention_mask=mask, greedy=True, eos_token_id=eos, pad_token_id=0,
                                return_logprobs=True)
    first = (free[0] == eos).nonzero()[0].item()
    assert torch.equal(out[0, : first + 1], free[0, : first + 1]) and (out[0, first + 1 :] == 0).all()
    assert (lp[0, first + 1 :] == 0).all() and (lp[0, : first + 1] < 0).all()
    for b in (1, 2):  # the other rows run on until their own EOS, or to the end
        hit = (free[b] == eos).nonzero()
        n = hit[0].item() + 1 if len(hit) else 8
        assert torch.equal(out[b, :n], free[b, :n]) and (out[b, n:] == 0).all()


def test_logprobs_are_those_of_a_full_forward():
    """Sampled tokens' log-probs (temperature 0.7) equal log_softmax(logits / 0.7) of one forward over prompt +
    response."""
    model = tiny("olmo3")
    ids, mask = prompts()
    g = torch.Generator().manual_seed(0)
    tokens, lp = ppo_core.generate(model, ids, 10, attention_mask=mask, temperature=0.7, return_logprobs=True,
                                   generator=g, stop_at_eos=False)
    full_ids = torch.cat([ids, tokens], 1)
    full_mask = torch.cat([mask, torch.ones_like(tokens)], 1)
    with torch.no_grad():
        logits = model(full_ids, full_mask)[:, ids.shape[1] - 1 : -1].float() / 0.7  # [B, 10, V]
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(lp, expected, rtol=1e-4, atol=1e-4)


def test_sampling_controls():
    model = tiny("smollm3")
    ids, mask = prompts()
    kw = dict(attention_mask=mask, stop_at_eos=False)
    a = ppo_core.generate(model, ids, 8, generator=torch.Generator().manual_seed(3), **kw)
    b = ppo_core.generate(model, ids, 8, generator=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(a, b)  # reproducible with a generator
    greedy = ppo_core.generate(model, ids, 8, greedy=True, **kw)
    assert torch.equal(ppo_core.generate(model, ids, 8, top_k=1, generator=torch.Generator().manual_seed(5), **kw), greedy)
    assert torch.equal(ppo_core.generate(model, ids, 8, top_p=1e-6, generator=torch.Generator().manual_seed(5), **kw), greedy)


def test_filter_logits_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[False, False, True, True]]
    # top_p=0.8: 0.5 + 0.3 reaches 0.8, the first token past the threshold is kept, the rest dropped
    assert torch.isinf(filter_logits(logits, top_p=0.8)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.81)).tolist() == [[False, False, False, True]]
