"""Attention of padded GQA batches (ppo_core/models/model.py: `attention` and Backbone's roll of padded rows): every SDPA
call is shaped for a fused CUDA kernel, and the results are those of plain masked attention.

    python -m pytest -q tests/test_attention.py

On CUDA, flash attention takes no mask (nor float32) and the memory-efficient kernel of torch 2.11 no GQA, so a
masked GQA call runs the math fallback. Checked here on the CPU: (a) a spy around the real
F.scaled_dot_product_attention records every call: a padded training forward calls it with no mask and
is_causal; a sliding window shorter than the sequence, with a mask and equal q/k head counts; a decoding step,
with equal q/k head counts, no enable_gqa and no K/V copy; float32 on (fake) CUDA tensors, with equal head
counts. (b) Logits at real positions and (c) parameter gradients through them equal those of today's masked
path with attention written out below, in float64 (pads before, after and between real tokens; with and
without activation checkpointing). (d) A KV cache in another dtype than the model's decodes (bf16 cache under
an fp32 model, and the reverse). transformers parity of padded batches is in tests/test_model_parity.py.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import ppo_core.models.model as model_module
from ppo_core.models.model import CausalLM, KVCache, ModelArgs, record_attention_paths

BASE = dict(vocab_size=131, hidden_size=60, intermediate_size=86, num_hidden_layers=4, num_attention_heads=6,
            num_key_value_heads=3, max_position_embeddings=128)
CONFIGS = {
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], head_dim=14),  # GQA, every layer full attention
    "olmo3": dict(architectures=["Olmo3ForCausalLM"], sliding_window=5),  # layers 1-3 slide over 5 < T, 4 full
}
T = 13


def tiny(name, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    model = CausalLM(ModelArgs.from_hf_config({**BASE, **CONFIGS[name]})).to(dtype)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in pname else torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model


def padded_batch(holes=False, seed=0):
    """ids [5, T] and their mask: PPO's rows [pads, prompt, response, pads]: none, left only, right only, both;
    and (holes=True) a row with pads between real tokens, which no roll can move after them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 131, (5, T), generator=g)
    mask = torch.ones(5, T, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, -3:] = 0
    mask[3, :2] = 0
    mask[3, -5:] = 0
    mask[4, :1] = 0
    if holes:
        mask[4, 5:7] = 0
    return ids.masked_fill(mask == 0, 0), mask


def plain_attention(q, k, v, attn_mask=None, is_causal=False):
    """The reference: softmax(q k^T / sqrt(hs) masked) v with each kv head repeated for its nh/nkv query heads,
    in float64, scores written out."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, nh, T, S]
    if is_causal:
        attn_mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.fixture
def masked_reference(monkeypatch):
    """Inside: Backbone takes today's masked path for every padded batch (no roll), with plain_attention."""
    monkeypatch.setattr(model_module, "padding_layout", lambda key_mask: (not bool(key_mask.all()), False))
    monkeypatch.setattr(model_module, "attention", plain_attention)


@pytest.fixture
def sdpa_calls(monkeypatch):
    """The real F.scaled_dot_product_attention, with each call's shapes and flags recorded."""
    calls, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        calls.append(dict(q=tuple(q.shape), k=tuple(k.shape), v=tuple(v.shape), is_causal=is_causal,
                          enable_gqa=enable_gqa, mask=None if attn_mask is None else tuple(attn_mask.shape),
                          k_storage=k.untyped_storage().data_ptr() if k.device.type == "cpu" else None))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


# ----------------------------------------------------------------------------------- (a) the calls SDPA sees

def test_padding_layout_and_roll_by_hand():
    mask = torch.tensor([[0, 0, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 0, 1, 1, 0]]).bool()
    assert model_module.padding_layout(mask[:3]) == (True, True)  # left + right, none, all pads: one run each
    assert model_module.padding_layout(mask[1:2]) == (False, True)
    assert model_module.padding_layout(mask) == (True, False)  # row 3 has a hole
    index, inverse = model_module.roll_indices(mask[:3])
    assert index.tolist() == [[2, 3, 4, 0, 1], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]
    assert inverse.tolist() == [[3, 4, 0, 1, 2], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]



def test_padded_training_forward_calls_sdpa_causal_without_a_mask(sdpa_calls):
    model = tiny("qwen3", torch.float32).train()
    ids, mask = padded_batch()
    with record_attention_paths() as paths:
        model(ids, mask).sum().backward()
    assert len(sdpa_calls) == 4 and paths == ["causal"] * 4
    for call in sdpa_calls:
        assert call["mask"] is None and call["is_causal"] and call["enable_gqa"]  # flash, native GQA
        assert call["q"] == (5, 6, T, 14) and call["k"] == call["v"] == (5, 3, T, 14)


def test_gradient_checkpointing_recomputes_the_same_causal_calls(sdpa_calls):
    model = tiny("qwen3", torch.float32).train()
    model.model.gradient_checkpointing = True
    ids, mask = padded_batch()
    model(ids, mask).sum().backward()
    assert len(sdpa_calls) == 8  # 4 forward + 4 recomputed in the backward
    assert all(c["mask"] is None and c["is_causal"] for c in sdpa_calls)


def test_sliding_layers_shorter_than_the_sequence_get_a_mask_in_mha_shapes(sdpa_calls):
    model = tiny("olmo3", torch.float32).eval()
    ids, mask = padded_batch()
    with torch.no_grad(), record_attention_paths() as paths:
        model(ids, mask)
    assert paths == ["MHA shapes"] * 3 + ["causal"]
    for call in sdpa_calls[:3]:  # window 5 < T: a mask, one for the whole batch (rows rolled: no padding in it)
        assert call["mask"] == (1, 1, T, T) and not call["is_causal"] and not call["enable_gqa"]
        assert call["q"][1] == call["k"][1] == call["v"][1] == 6
    assert sdpa_calls[3]["mask"] is None and sdpa_calls[3]["is_causal"] and sdpa_calls[3]["enable_gqa"]


def test_rows_with_holes_keep_the_padding_mask_in_mha_shapes(sdpa_calls):
    model = tiny("qwen3", torch.float32).eval()
    ids, mask = padded_batch(holes=True)
    with torch.no_grad():
        model(ids, mask)
    assert all(c["mask"] == (5, 1, T, T) and c["q"][1] == c["k"][1] == 6 and not c["enable_gqa"] for c in sdpa_calls)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_decoding_steps_put_query_heads_on_rows_without_copying_the_cache(sdpa_calls, name):
    """After a left-padded prefill (a mask: K/V repeated to MHA shapes, once), each static step calls SDPA with
    q [B, nkv, nh/nkv, hs] against the cache's own K/V tensors and a mask [B, 1, 1, S]."""
    model = tiny(name, torch.float32).eval()
    ids, mask = padded_batch()
    P, new = 6, 4
    cache = KVCache(model.args, 5, P + new, "cpu", torch.float32)
    with torch.no_grad():
        model(ids[:, :P], mask[:, :P], cache=cache)
        prefill = len(sdpa_calls)
        with record_attention_paths() as paths:
            for t in range(new):
                model.decode_step(ids[:, P + t : P + t + 1], cache)
    assert all(c["q"][1] == c["k"][1] == 6 and c["mask"] is not None for c in sdpa_calls[:prefill])
    steps = sdpa_calls[prefill:]
    assert len(steps) == 4 * new and paths == ["query heads as rows"] * (4 * new)
    cache_storages = {cache.k.untyped_storage().data_ptr(), cache.k_ring.untyped_storage().data_ptr()}
    for call in steps:
        assert call["q"][:3] == (5, 3, 2) and call["k"][:2] == (5, 3) and not call["enable_gqa"]
        assert call["mask"] == (5, 1, 1, call["k"][2]) and not call["is_causal"]
        assert call["k_storage"] in cache_storages  # attends over the cache itself, no copy


def test_float32_on_cuda_goes_to_mha_shapes_and_16_bit_keeps_native_gqa(sdpa_calls):
    """Flash takes 16-bit inputs only: without a mask, float32 CUDA attention repeats K/V for the memory-efficient
    kernel, bf16 keeps enable_gqa (CUDA tensors under FakeTensorMode: shapes and devices, no data; CPU tensors
    never repeat, as the tests above show)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        for dtype in (torch.float32, torch.bfloat16):
            q = torch.empty(2, 6, 5, 16, device="cuda", dtype=dtype)
            k = torch.empty(2, 3, 5, 16, device="cuda", dtype=dtype)
            assert model_module.attention(q, k, k, None, True).shape == (2, 6, 5, 16)
    assert [(c["k"][1], c["enable_gqa"]) for c in sdpa_calls] == [(6, False), (3, True)]


# ------------------------------------------------------------- (b), (c) values and gradients: float64 reference

def real_positions_loss(logits, mask, seed=1):
    """A weighted sum of the logits at real positions (random weights: every logit counts)."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.randn(logits.shape, generator=g, dtype=logits.dtype) * mask[..., None]
    return (logits * weights).sum()


def forward_and_grads(model, ids, mask):
    model.zero_grad()
    logits = model(ids, mask)
    real_positions_loss(logits, mask).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("checkpointing", [False, True])
def test_rolled_rows_equal_masked_attention_in_float64(request, name, checkpointing):
    """Logits at real positions and the parameter gradients through them: the rolled batch (SDPA, no mask) against
    today's masked path with attention written out, both float64: equal to float64 rounding. Pad slots finite."""
    model = tiny(name).train()
    model.model.gradient_checkpointing = checkpointing
    ids, mask = padded_batch()
    logits, grads = forward_and_grads(model, ids, mask)
    request.getfixturevalue("masked_reference")
    ref_logits, ref_grads = forward_and_grads(model, ids, mask)
    real = mask.bool()
    assert ref_logits[real].abs().max() > 1.0  # logits that vary
    torch.testing.assert_close(logits[real], ref_logits[real], rtol=1e-12, atol=1e-12)
    assert torch.isfinite(logits).all()
    for pname, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[pname], rtol=1e-11, atol=1e-12, msg=pname)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_rows_with_holes_equal_masked_attention_in_float64(request, name):
    model = tiny(name).eval()
    ids, mask = padded_batch(holes=True)
    with torch.no_grad():
        logits = model(ids, mask)
        request.getfixturevalue("masked_reference")
        ref = model(ids, mask)
    real = mask.bool()
    torch.testing.assert_close(logits[real], ref[real], rtol=1e-12, atol=1e-12)


def test_a_row_alone_gives_its_padded_logits():
    """Each row of the padded batch, run alone without padding: the same logits at its real positions."""
    model = tiny("olmo3").eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        batch = model(ids, mask)
        for b in range(ids.shape[0]):
            real = mask[b].bool()
            torch.testing.assert_close(model(ids[b : b + 1, real])[0], batch[b, real], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------- (d) KV cache in its own dtype

def greedy_static(model, ids, mask, new, cache_dtype):
    """Greedy tokens and step logits from a prefill and `new` static decode steps with a cache of cache_dtype."""
    B, P = ids.shape
    cache = KVCache(model.args, B, P + new, "cpu", cache_dtype)
    with torch.no_grad():
        logits = model(ids, mask, cache=cache)[:, -1:]
        tokens, steps = [], []
        for _ in range(new):
            token = logits[:, -1].float().argmax(-1, keepdim=True)  # [B, 1]
            tokens.append(token)
            logits = model.decode_step(token, cache)
            steps.append(logits.float())
    return torch.cat(tokens, 1), torch.cat(steps, 1)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_bfloat16_cache_under_a_float32_model_decodes_the_same_tokens(name):
    """The cache keeps its own dtype (index_copy_ demands equal ones: a bf16 cache under fp32 weights used to
    raise): greedy tokens equal the fp32 cache's, step logits differ by bf16 rounding of K and V only."""
    model = tiny(name, torch.float32).eval()
    ids, mask = padded_batch()
    ids, mask = ids[:, :7], mask[:, :7]
    tokens, logits = greedy_static(model, ids, mask, 6, torch.float32)
    tokens_bf16, logits_bf16 = greedy_static(model, ids, mask, 6, torch.bfloat16)
    assert torch.equal(tokens_bf16, tokens)
    assert (logits_bf16 - logits).abs().max() <= 0.05 * logits.abs().max()
    assert not torch.equal(logits_bf16, logits)  # the cache really held bf16
    model_bf16 = tiny(name, torch.bfloat16).eval()  # and the reverse: a float32 cache under bf16 weights runs
    tokens_rev, _ = greedy_static(model_bf16, ids, mask, 6, torch.float32)
    assert tokens_rev.shape == tokens.shape


# ---------------------------------------------------------------------------------------- (e) GPU only

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_pass_runs_on_a_fused_cuda_kernel(name):
    """With the math backend excluded, SDPA raises 'No available kernel' for a call no fused kernel takes: a padded
    training forward + backward, rows with holes, a left-padded prefill and static decode steps, under the
    trainer's bf16 autocast and in float32. head_dim 16: the memory-efficient kernel wants a multiple of 8."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    torch.manual_seed(0)
    model = CausalLM(ModelArgs.from_hf_config({**BASE, **CONFIGS[name], "head_dim": 16})).cuda().train()
    ids, mask = (t.cuda() for t in padded_batch())
    holes_ids, holes_mask = (t.cuda() for t in padded_batch(holes=True))
    P, new = 6, 4
    for bf16 in (True, False):
        with sdpa_kernel(fused), torch.autocast("cuda", torch.bfloat16, enabled=bf16):
            model(ids, mask).float().sum().backward()
            with torch.no_grad():
                model(holes_ids, holes_mask)
                cache = KVCache(model.args, 5, P + new, "cuda", torch.bfloat16 if bf16 else torch.float32)
                model(ids[:, :P], mask[:, :P], cache=cache)
                for t in range(new):
                    logits = model.decode_step(ids[:, P + t : P + t + 1], cache)
        assert torch.isfinite(logits).all()
