"""ppo_core/engine/generate.py and the decoding path of ppo_core/models/model.py (runs everywhere; transformers only where named).

    python -m pytest -q tests/test_generate.py

Tiny random models of several families (odd sizes). Parity of greedy tokens with transformers' generate is in
tests/test_model_parity.py; here: the CPU fast path against the plain F.linear reference, EOS handling,
log-probs against a full forward, sampling controls; and the static-cache decode step (`decode_step`): the
tokens of the dynamic path and of transformers (with its configs, skipped without transformers), the same ops
and shapes at every step with no host synchronisation, a trace-once-replay stand-in for a CUDA graph on the CPU,
window-sized rings for sliding layers, and the CUDA graph itself (GPU only).
"""
import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ppo_core
from ppo_core.engine.generate import filter_logits
from ppo_core.models.model import CausalLM, KVCache, Linear, ModelArgs, can_pack_for_cpu, cpu_packed_linears

BASE = dict(vocab_size=131, hidden_size=60, intermediate_size=86, num_hidden_layers=4, num_attention_heads=6,
            num_key_value_heads=3, max_position_embeddings=128)
CONFIGS = {
    "llama_bias": dict(architectures=["LlamaForCausalLM"], attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], head_dim=14),
    "smollm3": dict(architectures=["SmolLM3ForCausalLM"]),
    "olmo": dict(architectures=["OlmoForCausalLM"], clip_qkv=0.9),
    "olmo3": dict(architectures=["Olmo3ForCausalLM"], sliding_window=5),
}


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


# ------------------------------------------------------------------------------- the static-cache decode step

def generate_both(model, ids, new, **kw):
    """(output of the dynamic path, the CPU default; output of the static-cache path)."""
    return (ppo_core.generate(model, ids, new, static_cache=False, **kw),
            ppo_core.generate(model, ids, new, static_cache=True, **kw))


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_static_cache_gives_the_tokens_of_the_dynamic_path(name, packed):
    """Greedy and sampled (fixed generator) decoding of a left-padded batch: the same tokens either way, and
    log-probs equal to float32 rounding; 14 new tokens after a 6-token prompt run past OLMo 3's window of 5."""
    model = tiny(name)
    if packed and not can_pack_for_cpu(model):
        pytest.skip("torch built without oneDNN")
    ids, mask = prompts()
    kw = dict(attention_mask=mask, stop_at_eos=False, cpu_packed_weights=packed)
    dynamic, static = generate_both(model, ids, 14, greedy=True, **kw)
    assert torch.equal(static, dynamic)
    (dyn_tok, dyn_lp), (st_tok, st_lp) = [
        ppo_core.generate(model, ids, 14, temperature=0.8, top_k=40, return_logprobs=True, static_cache=static_cache,
                          generator=torch.Generator().manual_seed(7), **kw) for static_cache in (False, True)]
    assert torch.equal(st_tok, dyn_tok)
    torch.testing.assert_close(st_lp, dyn_lp, rtol=0, atol=1e-5)
    assert not torch.equal(st_tok, static)  # sampling at 0.8 is not greedy here: the check above is not vacuous


@pytest.mark.parametrize("name", list(CONFIGS))
def test_decode_step_logits_match_a_full_forward(name):
    """Prefill 4 or 8 tokens of a left-padded batch (shorter / longer than OLMo 3's window of 5; all pads inside
    them), then `decode_step` one token at a time: every step's logits equal one forward over the whole sequence."""
    model = tiny(name)
    ids, mask = prompts(P=14)  # rows 1 and 2 start with 3 and 1 pads
    with torch.no_grad():
        full = model(ids, mask)  # [B, 14, V]
        for prefill in (4, 8):
            cache = KVCache(model.args, 3, 14, "cpu", torch.float32)
            steps = [model(ids[:, :prefill], mask[:, :prefill], cache=cache)]
            steps += [model.decode_step(ids[:, t : t + 1], cache) for t in range(prefill, 14)]
            real = mask.bool()
            torch.testing.assert_close(torch.cat(steps, 1)[real], full[real], rtol=1e-5, atol=1e-5)
            assert cache.length == 14 and int(cache.slot) == 14
            assert torch.equal(cache.n_real, mask.sum(-1))


def test_sliding_layers_keep_a_window_sized_ring():
    """OLMo 3 (window 5, layers 1-3 sliding): the three sliding layers keep 5 slots, the full layer all of them;
    a window at least as long as the cache is cached as a full layer."""
    args = tiny("olmo3").args
    assert args.sliding_windows == [5, 5, 5, None]
    cache = KVCache(args, 3, 20, "cpu", torch.float32)
    nkv, hs = args.num_key_value_heads, args.head_dim
    assert cache.k_ring.shape == cache.v_ring.shape == (3, 3, nkv, 5, hs)
    assert cache.k.shape == cache.v.shape == (1, 3, nkv, 20, hs)
    assert [k.shape[2] for k in cache.layer_k] == [5, 5, 5, 20]
    assert cache.layer_k[3].data_ptr() == cache.k[0].data_ptr()
    assert cache.layer_k[1].data_ptr() == cache.k_ring[1].data_ptr()
    short = KVCache(args, 3, 5, "cpu", torch.float32)
    assert short.windows == [None] * 4 and short.k.shape[0] == 4 and short.k_ring.shape[0] == 0


def test_ring_decoding_matches_recomputing_without_a_cache():
    """Greedy tokens with the ring (prompt of 9 > window 5, 12 new) equal those of a cache-free loop that runs
    the full forward over the whole sequence at every step (windows masked over all keys, no ring)."""
    model = tiny("olmo3")
    ids, mask = prompts(P=9)
    seq, seq_mask = ids, mask
    with torch.no_grad():
        for _ in range(12):
            next_tok = model(seq, seq_mask)[:, -1].argmax(-1, keepdim=True)
            seq, seq_mask = torch.cat([seq, next_tok], 1), torch.cat([seq_mask, torch.ones_like(next_tok)], 1)
    expected = seq[:, 9:]
    for static_cache in (False, True):
        out = ppo_core.generate(model, ids, 12, attention_mask=mask, greedy=True, stop_at_eos=False,
                                static_cache=static_cache)
        assert torch.equal(out, expected), static_cache


class OpRecorder(TorchDispatchMode):
    """Records every aten op with its arguments' shapes, dtypes and scalar values, and fails on any op that
    makes the host wait for the device: reading a value (`.item()`, `bool()`, `int()`: _local_scalar_dense)
    or an output shape that depends on values (nonzero, masked_select, boolean indexing)."""

    SYNCING = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
               "aten.unique.default", "aten._unique2.default", "aten.item.default"}

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(func) in self.SYNCING:
            raise AssertionError(f"{func}: a host synchronisation")
        flat = torch.utils._pytree.tree_leaves((args, kwargs))
        if str(func) == "aten.index.Tensor" and any(isinstance(a, torch.Tensor) and a.dtype == torch.bool
                                                    for a in flat):
            raise AssertionError(f"{func} with a boolean index: a host synchronisation")
        self.ops.append((str(func), tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else repr(a)
                                          for a in flat)))
        return func(*args, **kwargs)


def record_steps(step, first_token, n_steps):
    """Run n_steps greedy steps of step(ids [B, 1]) -> logits [B, 1, V] under an OpRecorder each, with
    Tensor.tolist/numpy (which read memory without an aten op) disabled -> the list of each step's ops."""
    steps, token = [], first_token
    saved = torch.Tensor.tolist, torch.Tensor.numpy

    def refuse(*args, **kwargs):
        raise AssertionError("tolist()/numpy() inside the decode step: a host synchronisation")

    torch.Tensor.tolist = torch.Tensor.numpy = refuse
    try:
        for _ in range(n_steps):
            with OpRecorder() as recorder:
                logits = step(token[:, None])
            token = logits[:, -1].argmax(-1)
            steps.append(recorder.ops)
    finally:
        torch.Tensor.tolist, torch.Tensor.numpy = saved
    return steps


def test_op_recorder_catches_host_syncs():
    """The recorder below can fail: each way of reading a tensor on the host is refused."""
    x = torch.arange(4.0)
    for read in (lambda: x.sum().item(), lambda: bool(x.sum() > 1), lambda: int(x[0]), lambda: x[x > 1],
                 lambda: x.nonzero()):
        with pytest.raises(AssertionError, match="host synchronisation"):
            with OpRecorder():
                read()
    with pytest.raises(AssertionError, match="host synchronisation"):
        record_steps(lambda ids: ids.float()[..., None] + ids.sum().tolist(), torch.zeros(2, dtype=torch.long), 1)


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_decode_step_has_the_same_ops_and_shapes_at_every_step_and_never_syncs(name, packed):
    """10 steps of `decode_step` after a left-padded prompt (past OLMo 3's window of 5): the same aten ops with
    the same argument shapes, dtypes and scalars at every step, and no host synchronisation. The dynamic
    path, recorded the same way, changes shapes every step (so the comparison can fail)."""
    model = tiny(name)
    if packed and not can_pack_for_cpu(model):
        pytest.skip("torch built without oneDNN")
    ids, mask = prompts()
    with torch.no_grad(), cpu_packed_linears(model, 3) if packed else contextlib.nullcontext():
        runs = {}
        for static in (True, False):
            cache = KVCache(model.args, 3, 6 + 11, "cpu", torch.float32)
            first = model(ids, mask, cache=cache)[:, -1].argmax(-1)
            if static:
                step = lambda ids: model.decode_step(ids, cache)  # noqa: E731
            else:
                step = lambda ids: model(ids, None, cache=cache)  # noqa: E731
            runs[static] = record_steps(step, first, 10)
    static_steps, dynamic_steps = runs[True], runs[False]
    # each layer attends over all 17 slots of the cache, or over the 5 of a ring (OLMo 3's sliding layers)
    key_lengths = [args[1][0][2] for op, args in static_steps[0] if "scaled_dot_product" in op]
    assert key_lengths == [17 if w is None else 5 for w in model.args.sliding_windows]
    assert all(ops == static_steps[0] for ops in static_steps[1:])
    assert any(ops != dynamic_steps[0] for ops in dynamic_steps[1:])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_decode_step_traced_once_replays_every_step(name):
    """The CPU stand-in for a CUDA graph: trace `decode_step` once into a graph of aten ops (make_fx: the
    Python runs once, the recorded ops with their recorded arguments are replayed, as a CUDA graph does) and
    replay it for every step: the greedy tokens of `generate`. A step that read a host counter (cache.length)
    or a Python int taken from a tensor would replay the value of the traced step and give other tokens."""
    from torch.fx.experimental.proxy_tensor import make_fx

    model = tiny(name)
    ids, mask = prompts()
    new = 12
    expected = ppo_core.generate(model, ids, new, attention_mask=mask, greedy=True, stop_at_eos=False,
                                 cpu_packed_weights=False)
    with torch.no_grad():
        cache = KVCache(model.args, 3, 6 + new, "cpu", torch.float32)
        token = model(ids, mask, cache=cache)[:, -1].argmax(-1)
        # tracing runs the step for real: put back what it advanced (its k/v writes go to the slot step 1 rewrites)
        saved = cache.slot.clone(), cache.n_real.clone(), cache.mask.clone()
        graph = make_fx(lambda ids: model.decode_step(ids, cache))(token[:, None])
        cache.slot.copy_(saved[0]), cache.n_real.copy_(saved[1]), cache.mask.copy_(saved[2])
        tokens = [token]
        for _ in range(new - 1):
            tokens.append(graph(tokens[-1][:, None])[:, -1].argmax(-1))
    assert torch.equal(torch.stack(tokens, 1), expected)


@pytest.mark.parametrize("family", ["llama", "llama_bias", "qwen2", "qwen2_sliding", "qwen3", "qwen3_sliding", "smollm3",
                                    "smollm3_sliding", "olmo", "olmo2", "olmo3", "olmo3_yarn"])
def test_static_cache_greedy_matches_transformers(tmp_path, family):
    """Every family config of tests/test_model_parity.py, a left-padded batch with a prompt of 13 (longer than
    the sliding windows of 5) and 12 new tokens: both decode paths give transformers' greedy tokens."""
    pytest.importorskip("transformers")
    import test_model_parity as parity  # its configs and random-weight checkpoints written by transformers

    hf = parity.write_hf(str(tmp_path), family)
    model = ppo_core.load_model(str(tmp_path)).eval()
    ids, mask = parity.ids_and_mask()  # [3, 13], rows 1 and 2 left-padded
    new = 12
    with torch.no_grad():
        ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          pad_token_id=0, eos_token_id=None)[:, ids.shape[1]:]
    dynamic, static = generate_both(model, ids, new, attention_mask=mask, greedy=True, stop_at_eos=False)
    assert torch.equal(static, ref) and torch.equal(dynamic, ref)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cuda_graph_decoding_gives_the_tokens_of_eager_decoding(name):
    """On a GPU: the captured and replayed step (CUDAGraphStep) gives the tokens of the eager static step and
    of the dynamic path, greedy and sampled (float32, TF32 off so that the paths round alike)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        model = tiny(name).cuda()
        ids, mask = (t.cuda() for t in prompts())
        kw = dict(attention_mask=mask, stop_at_eos=False)
        for sample in (dict(greedy=True), dict(temperature=0.8)):
            runs = [ppo_core.generate(model, ids, 14, static_cache=static, cuda_graph=graph,
                                      generator=torch.Generator("cuda").manual_seed(3), **sample, **kw)
                    for static, graph in ((False, False), (True, False), (True, True))]
            assert torch.equal(runs[2], runs[1]) and torch.equal(runs[1], runs[0]), sample
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


@needs_cuda
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cuda_graph_under_bf16_autocast_gives_the_tokens_of_the_eager_static_step(name):
    """On a GPU, as the trainer decodes (fp32 weights, bf16 autocast, bf16 KV cache): the replayed graph, which reads
    the autocast cache's bf16 weights filled by the warm-up, gives the tokens and log-probs of the same step run
    eagerly (the same kernels on the same inputs)."""
    model = tiny(name).cuda()
    ids, mask = (t.cuda() for t in prompts())
    kw = dict(attention_mask=mask, stop_at_eos=False, static_cache=True, temperature=0.8, return_logprobs=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = ppo_core.generate(model, ids, 14, generator=torch.Generator("cuda").manual_seed(3), **kw)
        graph = ppo_core.generate(model, ids, 14, generator=torch.Generator("cuda").manual_seed(3), cuda_graph=True, **kw)
    assert torch.equal(graph[0], eager[0]) and torch.equal(graph[1], eager[1])


def test_cuda_graph_needs_the_static_cache_on_cuda():
    model = tiny("qwen3")
    ids, mask = prompts()
    with pytest.raises(ValueError, match="cuda_graph=True needs static_cache=True and a CUDA device"):
        ppo_core.generate(model, ids, 4, attention_mask=mask, cuda_graph=True)


def test_an_unknown_decode_option_is_a_type_error_naming_it():
    model = tiny("qwen3")
    ids, mask = prompts()
    with pytest.raises(TypeError, match="temprature"):
        ppo_core.generate(model, ids, 4, attention_mask=mask, temprature=0.5)


def test_static_cache_stops_at_eos_like_the_dynamic_path():
    """With EOS: the same tokens, pads and log-probs (the static path looks at `done` every 16 steps only)."""
    model = tiny("olmo3")
    ids, mask = prompts()
    free = ppo_core.generate(model, ids, 20, attention_mask=mask, greedy=True, stop_at_eos=False)
    eos = int(free[0, 2])
    kw = dict(attention_mask=mask, greedy=True, eos_token_id=eos, pad_token_id=0, return_logprobs=True)
    (dyn_tok, dyn_lp), (st_tok, st_lp) = generate_both(model, ids, 20, **kw)
    assert torch.equal(st_tok, dyn_tok) and (st_tok[0, 3:] == 0).all()
    torch.testing.assert_close(st_lp, dyn_lp, rtol=0, atol=1e-5)


def cut_at_first_stop(row, stop_ids, pad):
    """Plain Python: the tokens up to and including the first that is in stop_ids, then pad to the same length."""
    out = []
    for token in row:
        out.append(token)
        if token in stop_ids:
            break
    return out + [pad] * (len(row) - len(out))


@pytest.mark.parametrize("static_cache", [False, True])
def test_generate_stops_at_the_first_of_several_eos_ids(static_cache):
    """eos_token_id=[a, b] (generation_config.json's list): each row is the greedy tokens cut at the first token that
    is a or b, then padded; pad defaults to the first id; log-probs are 0 after the cut. Here rows 0 and 1 stop at a,
    row 2 at b, so both ids are exercised."""
    model = tiny("olmo3")
    ids, mask = prompts()
    free = ppo_core.generate(model, ids, 20, attention_mask=mask, greedy=True, stop_at_eos=False,
                             static_cache=static_cache)
    a, b = int(free[1, 2]), int(free[2, 2])
    rows = free.tolist()
    stopped_at = [next(t for t in row if t in (a, b)) for row in rows]
    assert stopped_at == [a, a, b]  # the check below is not vacuous
    for eos, pad in (([a, b], 0), ((a, b), 0), ([a, b], None)):
        out, lp = ppo_core.generate(model, ids, 20, attention_mask=mask, greedy=True, eos_token_id=eos,
                                    pad_token_id=pad, return_logprobs=True, static_cache=static_cache)
        expected = [cut_at_first_stop(row, {a, b}, a if pad is None else pad) for row in rows]
        assert out.tolist() == expected, (eos, pad)
        for r, row in enumerate(rows):
            n = row.index(stopped_at[r]) + 1
            assert (lp[r, n:] == 0).all() and (lp[r, :n] < 0).all()
    # one id in a list is the same as the bare id
    one = ppo_core.generate(model, ids, 20, attention_mask=mask, greedy=True, eos_token_id=[b], pad_token_id=0,
                            static_cache=static_cache)
    assert torch.equal(one, ppo_core.generate(model, ids, 20, attention_mask=mask, greedy=True, eos_token_id=b,
                                              pad_token_id=0, static_cache=static_cache))
    assert one.tolist() == [cut_at_first_stop(row, {b}, 0) for row in rows]
    # an empty list stops nothing
    assert torch.equal(ppo_core.generate(model, ids, 20, attention_mask=mask, greedy=True, eos_token_id=[],
                                         static_cache=static_cache), free)


@needs_cuda
def test_cuda_graph_stops_at_the_first_of_several_eos_ids():
    """On a GPU with the captured step: the stop test (torch.isin on a device tensor of ids) runs outside the graph;
    the tokens are the graph's own free run cut at the first of either id."""
    model = tiny("olmo3").cuda()
    ids, mask = (t.cuda() for t in prompts())
    kw = dict(attention_mask=mask, greedy=True, static_cache=True, cuda_graph=True)
    rows = ppo_core.generate(model, ids, 20, stop_at_eos=False, **kw).tolist()
    a, b = rows[1][2], rows[2][2]
    out = ppo_core.generate(model, ids, 20, eos_token_id=[a, b], pad_token_id=0, **kw)
    assert out.tolist() == [cut_at_first_stop(row, {a, b}, 0) for row in rows]
    stopped_at = {next((t for t in row if t in (a, b)), None) for row in rows}
    assert {a, b} <= stopped_at  # both ids end some row: the check above is not vacuous
