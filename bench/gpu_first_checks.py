"""The GPU-only paths no CPU check runs, each exercised once at toy size, before the long benchmarks
(bench/gpu_suite.sh step 2b; gpu-audit-2's "GPU-only paths", issue 22 items 6 and 7).

    python bench/gpu_first_checks.py                 # on the GPU machine (about 30-60 s, most of it Triton JIT)
    python bench/gpu_first_checks.py --device cpu    # what runs on the CPU; the CUDA-only parts say "skipped"

One line per check, `ok`, `FAILED` or `skipped`, with what was chosen or measured:
  dispatch       the kernels' backend for CUDA tensors (`ppo_kernels.backend`), the SM count the split
                 plans use (`sm_count`), and what the trainer's dtype='auto' resolves to here.
  mm_fp32        which fp32-output matmul the Triton backward uses for bf16 and fp16 operands on CUDA
                 (kernels/linear_logprobs.py `mm_fp32_path`, probed on first use) and what each kind did. "rounded"
                 (each product rounded to bf16 first) would lose precision without failing anything: FAILED here.
  deterministic  sampling (`filter_logits`, `sample_from_probs`: sort, softmax, cumsum, searchsorted, scatter) at a
                 151936-token vocabulary, a 1-D cumsum of the same length, and a whole `generate` call (static
                 cache and bf16 autocast as the trainer decodes, the step eager: sampling runs outside the CUDA
                 graph either way; with and without top-p), all under torch.use_deterministic_algorithms(True):
                 torch's docstring lists CUDA float cumsum as raising there. Nothing may raise, and two runs
                 must give the same tokens.
  checkpoint RNG save_checkpoint / load_training_state (ppo_core/run/checkpoint.py): after a restore, the global CPU
                 and CUDA RNGs, a CUDA and a CPU torch.Generator, Python's and NumPy's RNGs draw what they drew
                 right after the save.
  distributed    distributed.init on this device (set_device on CUDA), then the process group the trainer makes
                 for more than one process ("cpu:gloo,cuda:nccl" on CUDA, "gloo" on the CPU) with one process:
                 all_reduce on a device and on a CPU tensor, all_reduce_max_int, all_gather_rows, and a DDP
                 replica (distributed.replicate, device_ids) whose gradients equal the plain model's.
  cuda graph     decoding under bf16 autocast with fp32 weights, as the trainer does (`CUDAGraphStep`, on by
                 default): the captured and replayed step gives the tokens and log-probs of the eager static
                 step, for the shipped demo policy and a random Qwen3-style model.
  engine graphs  the rollout engine's decode-only steps replayed as CUDA graphs (ppo_core.engine.static_decode, on by
                 default on CUDA) against the same steps run eagerly on the static buffers and against the dynamic
                 steps, on a random Qwen3-0.6B-shaped model (fp32 weights, bf16 autocast: the trainer's rollout),
                 64 prompts of 32 tokens, greedy: the decode step's time in each mode ((wall of 40 new tokens - wall
                 of 8) / 32, medians of 3 calls after a warm-up call; every call captures its graphs anew, so the
                 difference leaves the captures and the prefill out), the captures' cost, and equal tokens. FAILED
                 unless the graphs give the eager static steps' tokens and every decode-only step replays a graph.
                 On the CPU: the same measurement at toy size without graphs (dynamic and static eager).
  backward       the gradient of a log-prob + entropy loss through the model and the fused LM-head kernel
                 (ppo_core.rollout.response_logprobs, fused=True) against float64 on the CPU: CUDA fp32 (TF32 off)
                 and CUDA bf16 autocast must be within 4x the CPU's own error at the same precision, or within
                 8 units of that precision's rounding (2^-24, 2^-8), whichever is larger.
Exit status: 1 if any check FAILED, else 0.
"""
import argparse
import contextlib
import copy
import os
import random
import socket
import statistics
import sys
import tempfile
import time
import traceback

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts: deterministic mode needs it

import numpy as np  # noqa: E402
import torch  # noqa: E402

import ppo_core  # noqa: E402
from ppo_core.models import distributed  # noqa: E402
from ppo_core.run import checkpoint  # noqa: E402
from ppo_core.engine.generate import filter_logits, sample_from_probs  # noqa: E402
from ppo_core.engine import RolloutEngine  # noqa: E402
from ppo_core.models.model import CausalLM, ModelArgs, load_model, read_config  # noqa: E402
from ppo_core.models.tokenizer import load_tokenizer  # noqa: E402
from ppo_core.heads import response_logprobs  # noqa: E402
from ppo_core.train import DEMO_CHECKPOINT  # noqa: E402

QWEN_VOCAB = 151936


def tiny_qwen3(device, seed=0):
    """A random Qwen3-style model (q/k norms, GQA, head_dim != hidden/heads), unit-scale weights."""
    torch.manual_seed(seed)
    args = ModelArgs.from_hf_config(dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=1000, hidden_size=64, intermediate_size=96,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=128))
    model = CausalLM(args).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model.to(device)


def prompts(vocab, device, B=6, P=10, seed=0):
    """Left-padded prompts [B, P] and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :1] = 0
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


# ------------------------------------------------------------------------------------------------ the checks
def check_dispatch(device):
    from ppo_core.config import build_config
    from ppo_core.models.precision import precision_line, resolve_precision
    import ppo_kernels
    from ppo_kernels import linear_logprobs

    precision = precision_line(resolve_precision(build_config()))
    if device.type != "cuda":
        return "skipped", f"CUDA only; on the CPU: backend {ppo_kernels.backend(device)}, dtype='auto' -> {precision}"
    props = torch.cuda.get_device_properties(device)
    sm = linear_logprobs.sm_count(device)
    status = "ok" if ppo_kernels.backend(device) == "triton" and sm == props.multi_processor_count else "FAILED"
    return status, (f"backend for CUDA tensors: {ppo_kernels.backend(device)}; sm_count {sm} "
                    f"(device: {props.multi_processor_count} SMs); dtype='auto' -> {precision}")


def check_mm_fp32(device):
    from ppo_kernels import linear_logprobs as ll

    if device.type != "cuda":
        return "skipped", f"CUDA only (on {device.type} the backward's matmuls take '{ll.mm_fp32_path(device, torch.bfloat16)}')"
    status, parts = "ok", []
    for dtype in (torch.bfloat16, torch.float16):
        gen = torch.Generator().manual_seed(0)
        a, b = (torch.randn(16, 16, generator=gen).to(device, dtype) for _ in range(2))
        exact = a.double() @ b.double()
        tried = []
        for kind in ll.MM_FP32_KINDS:
            try:
                out = ll.mm_fp32_impl(kind, a, b, torch.full((16, 16), float("nan"), device=device), False)
                tried.append(f"{kind}: max err {(out.double() - exact).abs().max().item():.1e}")
            except Exception as e:
                tried.append(f"{kind}: {type(e).__name__} {str(e).splitlines()[0][:60]}")
        chosen = ll.mm_fp32_path(device, dtype)
        if chosen == "rounded":
            status = "FAILED"
        parts.append(f"{str(dtype).replace('torch.', '')} -> {chosen.upper() if chosen == 'rounded' else chosen} "
                     f"({'; '.join(tried)})")
    if status != "ok":
        parts.append("'rounded' rounds each product to bf16/fp16 before the fp32 sum: the backward loses precision")
    return status, " | ".join(parts)


def check_deterministic(device):
    gen = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(8, QWEN_VOCAB, generator=gen)).to(device)  # [8, V]
    uniforms = torch.rand(8, generator=gen).to(device)  # [8]
    settings = [(0, 1.0), (0, 0.9), (50, 1.0)]  # (top_k, top_p)

    def sample_all():
        return [sample_from_probs(filter_logits(logits, k, p).softmax(-1), uniforms) for k, p in settings]

    model = load_model(DEMO_CHECKPOINT, device=device)
    ids, mask = prompts(model.args.vocab_size, device)
    on_cuda = device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if on_cuda else torch.autocast("cpu", enabled=False)

    def decode(top_p):
        with autocast:
            return ppo_core.generate(model, ids, 16, attention_mask=mask, temperature=1.0, top_p=top_p,
                                     stop_at_eos=False, static_cache=on_cuda,
                                     generator=torch.Generator(device).manual_seed(1))

    free = sample_all() + [decode(1.0), decode(0.9)]
    was, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(2):
            cdf = logits[0].softmax(-1).cumsum(0)  # [V], 1-D: the case torch once scanned non-deterministically
            runs.append(sample_all() + [decode(1.0), decode(0.9)] + [cdf])
    except RuntimeError as e:
        return "FAILED", f"raised under torch.use_deterministic_algorithms(True): {str(e).splitlines()[0][:200]}"
    finally:
        torch.use_deterministic_algorithms(was)
        torch.utils.deterministic.fill_uninitialized_memory = fill
    repeat_equal = all(torch.equal(x, y) for x, y in zip(*runs))
    same_as_free = sum(torch.equal(x, y) for x, y in zip(runs[0], free))
    return ("ok" if repeat_equal else "FAILED"), (
        f"nothing raised ({len(settings)} sampler settings at V={QWEN_VOCAB}, a 1-D cumsum, generate with and "
        f"without top-p{', static cache, bf16 autocast' if on_cuda else ''}); two runs "
        f"{'bitwise equal' if repeat_equal else 'DIFFER'}; {same_as_free}/{len(free)} token sets equal to "
        f"deterministic mode off")


def check_checkpoint_rng(device):
    on_cuda = device.type == "cuda"
    model = load_model(DEMO_CHECKPOINT, device=device)
    opt = torch.optim.AdamW(model.parameters())
    generators = {"sample": torch.Generator(device).manual_seed(1), "shuffle": torch.Generator().manual_seed(2)}
    torch.manual_seed(3), random.seed(4), np.random.seed(5)

    def draws():
        out = {"torch.cpu": torch.rand(4), "generator.sample": torch.rand(4, generator=generators["sample"], device=device),
               "generator.shuffle": torch.randperm(8, generator=generators["shuffle"]),
               "python": torch.tensor([random.random()]), "numpy": torch.from_numpy(np.random.rand(2))}
        if on_cuda:
            out["torch.cuda"] = torch.rand(4, device=device)
        return {k: v.cpu() for k, v in out.items()}

    draws()  # states that are not the seeds' own
    with tempfile.TemporaryDirectory() as run:
        parts = checkpoint.CheckpointParts(policy=model, critic=None, tokenizer=load_tokenizer(DEMO_CHECKPOINT),
                                           policy_opt=opt, critic_opt=None, generators=generators, state={})
        path = checkpoint.save_checkpoint(run, 1, parts, keep=1)
        expected = draws()
        draws()
        checkpoint.load_training_state(path, policy=model, critic=None, policy_opt=opt, critic_opt=None,
                                       generators=generators)
        again = draws()
    wrong = [k for k in expected if not torch.equal(expected[k], again[k])]
    detail = f"{len(expected) - len(wrong)}/{len(expected)} streams draw the same after the restore ({', '.join(expected)})"
    if wrong:
        return "FAILED", detail + f"; DIFFERENT: {', '.join(wrong)}"
    return "ok", detail + ("" if on_cuda else "; the CUDA RNG part skipped (no GPU)")


def check_distributed(device):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        rank, world, dev = distributed.init(device.type)  # one process: set_device on CUDA, no group
        # what init does for more than one process (distributed.py): the same backends, here with one member
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, rank=0, world_size=1)
        x = torch.arange(4.0, device=dev)
        checks = {
            f"all_reduce ({dev.type} tensor)": torch.equal(distributed.all_reduce_sum(x), x),
            "all_reduce (CPU tensor, gloo)": torch.equal(distributed.all_reduce_sum(x.cpu()), x.cpu()),
            "all_reduce_max_int": distributed.all_reduce_max_int(7) == 7,
            "all_gather_rows": torch.equal(distributed.all_gather_rows(x[None]), x[None]),
        }
        model = load_model(DEMO_CHECKPOINT, device=dev)
        plain = copy.deepcopy(model)
        ddp = distributed.replicate(model, dev)
        ids, mask = prompts(model.args.vocab_size, dev, B=4, P=12)
        ddp(ids, mask).float().square().mean().backward()
        plain(ids, mask).float().square().mean().backward()
        checks["DDP gradients"] = all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters()))
        group = str(torch.distributed.get_backend())
    finally:
        distributed.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    failed = [k for k, ok in checks.items() if not ok]
    detail = (f"init({device.type!r}) -> rank {rank}, world {world}, device {dev}; group {backend!r} (backend {group}): "
              f"{len(checks) - len(failed)}/{len(checks)} right ({', '.join(checks)})")
    if device.type != "cuda":
        detail += "; set_device and cpu:gloo,cuda:nccl skipped (no GPU)"
    return ("FAILED", detail + f"; WRONG: {', '.join(failed)}") if failed else ("ok", detail)


def check_cuda_graph(device):
    if device.type != "cuda":
        return "skipped", "CUDA graphs need CUDA"
    parts, status = [], "ok"
    for name, model in (("demo policy", load_model(DEMO_CHECKPOINT, device=device)), ("random qwen3", tiny_qwen3(device))):
        ids, mask = prompts(model.args.vocab_size, device)
        kw = dict(attention_mask=mask, temperature=1.0, stop_at_eos=False, static_cache=True, return_logprobs=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):  # fp32 weights, bf16 matmuls and KV cache: the trainer's
            eager = ppo_core.generate(model, ids, 20, generator=torch.Generator(device).manual_seed(3), **kw)
            graph = ppo_core.generate(model, ids, 20, generator=torch.Generator(device).manual_seed(3), cuda_graph=True, **kw)
        same_tokens = int((eager[0] == graph[0]).sum())
        lp_diff = (eager[1] - graph[1]).abs().max().item()
        if same_tokens != eager[0].numel() or lp_diff != 0:
            status = "FAILED"
        parts.append(f"{name}: {same_tokens}/{eager[0].numel()} tokens equal, max |log-prob diff| {lp_diff:.1e}")
    return status, "graph vs eager static step under bf16 autocast: " + "; ".join(parts)


def check_engine_graphs(device):
    cuda = device.type == "cuda"
    if cuda:  # random weights of Qwen3-0.6B's shapes (28 layers, GQA 16/8, head_dim 128, 151936-token vocabulary)
        torch.manual_seed(0)
        config = read_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "models",
                                          "Qwen3-0.6B"))
        with torch.device(device):
            model = CausalLM(ModelArgs.from_hf_config(config)).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) / p.shape[-1] ** 0.5)
        rows, prompt_len, short, long = 64, 32, 8, 40
    else:
        model, rows, prompt_len, short, long = tiny_qwen3(device), 8, 10, 2, 6
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, model.args.vocab_size, (rows, prompt_len), generator=g).tolist()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    modes = {"dynamic": dict(cuda_graphs=False), "static eager": dict(cuda_graphs=False, static_decode=True)}
    if cuda:
        modes["graphs"] = dict(cuda_graphs=True)
    results = {}  # mode -> (decode step ms, tokens of a long call, its stats)
    for mode, kw in modes.items():
        engine = RolloutEngine(model, **kw)

        def call(new):
            sync()
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext():
                tokens = engine.generate(prompts, new, greedy=True)
            sync()
            return time.perf_counter() - t0, tokens, dict(engine.stats)

        call(short)  # warm-up: Triton's JIT, cuBLAS, the allocator
        short_s = statistics.median(call(short)[0] for _ in range(3))
        longs = [call(long) for _ in range(3)]
        long_s = statistics.median(wall for wall, _, _ in longs)
        results[mode] = (1e3 * (long_s - short_s) / (long - short), longs[-1][1], longs[-1][2])
    dynamic_ms, dynamic_tokens, _ = results["dynamic"]
    parts = [f"{mode} {ms:.2f} ms ({dynamic_ms / ms:.2f}x)" for mode, (ms, _, _) in results.items()]
    detail = (f"decode step, {rows} rows, {model.args.num_hidden_layers} layers"
              f"{', bf16 autocast' if cuda else ', float32 (toy size)'}: " + ", ".join(parts))
    n_tokens = rows * long
    same = {mode: sum(a == b for x, y in zip(tokens, dynamic_tokens) for a, b in zip(x, y))
            for mode, (_, tokens, _) in results.items() if mode != "dynamic"}
    detail += "; tokens equal to the dynamic steps': " + ", ".join(f"{m} {n}/{n_tokens}" for m, n in same.items())
    if not cuda:
        return "skipped", detail + "; graphs skipped (no GPU)"
    _, graph_tokens, stats = results["graphs"]
    same_static = sum(a == b for x, y in zip(graph_tokens, results["static eager"][1]) for a, b in zip(x, y))
    detail += (f"; graphs vs static eager {same_static}/{n_tokens} tokens equal; per call: {stats['graph_captures']} "
               f"capture(s) in {stats['graph_capture_s']:.3f} s, {stats['graph_replays']} replays of "
               f"{stats['static_steps']} static of {stats['steps']} steps (graphs {stats['cuda_graphs']})")
    ok = (same_static == n_tokens and stats["cuda_graphs"] == "on"
          and stats["graph_replays"] == stats["static_steps"] > 0)
    return ("ok" if ok else "FAILED"), detail


def check_backward(device):
    def loss_and_grads(model, batch, fused, autocast=None):
        ids, mask, response_mask, weights, P = batch
        model.zero_grad(set_to_none=True)
        with autocast or torch.autocast(ids.device.type, enabled=False):
            logprobs, entropy = response_logprobs(model, ids, mask, response_mask, P, 0.7, fused)  # [B, R] each
        loss = (logprobs * weights * response_mask).sum() + 0.1 * (entropy * response_mask).sum()
        loss.backward()
        grads = torch.cat([p.grad.double().flatten().cpu() for p in model.parameters()])
        return logprobs.detach().double().cpu() * response_mask.cpu(), grads

    def batch_on(dev):
        g = torch.Generator().manual_seed(0)
        B, P, R = 4, 8, 8
        ids = torch.randint(3, 29, (B, P + R), generator=g)  # the demo policy's vocabulary has 29 tokens
        mask = torch.ones(B, P + R, dtype=torch.long)
        mask[1, :3] = 0  # left-padded prompts
        mask[2, :1] = 0
        response_mask = torch.ones(B, R, dtype=torch.long)
        response_mask[0, 5:] = 0  # right-padded responses
        response_mask[3, 2:] = 0
        mask[:, P:] = response_mask
        weights = torch.randn(B, R, generator=g)
        return ids.to(dev), mask.to(dev), response_mask.to(dev), weights.to(dev), P

    def rel(grads, truth):
        return ((grads - truth).norm() / truth.norm()).item()

    cpu = torch.device("cpu")
    lp64, g64 = loss_and_grads(load_model(DEMO_CHECKPOINT).double(), batch_on(cpu), fused=False)
    errors = {"cpu fp32": rel(loss_and_grads(load_model(DEMO_CHECKPOINT), batch_on(cpu), True)[1], g64),
              "cpu bf16": rel(loss_and_grads(load_model(DEMO_CHECKPOINT), batch_on(cpu), True,
                                             torch.autocast("cpu", dtype=torch.bfloat16))[1], g64)}
    detail = f"gradient vs float64, |g - g64| / |g64|: CPU fp32 {errors['cpu fp32']:.1e}, CPU bf16 autocast {errors['cpu bf16']:.1e}"
    if device.type != "cuda":
        return "skipped", detail + "; CUDA part skipped (no GPU)"
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        model = load_model(DEMO_CHECKPOINT, device=device)
        lp32, g32 = loss_and_grads(model, batch_on(device), True)
        lp16, g16 = loss_and_grads(model, batch_on(device), True, torch.autocast("cuda", dtype=torch.bfloat16))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    errors["cuda fp32"], errors["cuda bf16"] = rel(g32, g64), rel(g16, g64)
    bounds = {"cuda fp32": max(4 * errors["cpu fp32"], 8 * 2.0 ** -24), "cuda bf16": max(4 * errors["cpu bf16"], 8 * 2.0 ** -8)}
    failed = [k for k, bound in bounds.items() if not errors[k] <= bound]  # NaN fails
    detail += (f"; CUDA fp32 {errors['cuda fp32']:.1e} (bound {bounds['cuda fp32']:.1e}), CUDA bf16 autocast "
               f"{errors['cuda bf16']:.1e} (bound {bounds['cuda bf16']:.1e}); log-probs max err fp32 "
               f"{(lp32 - lp64).abs().max().item():.1e}, bf16 {(lp16 - lp64).abs().max().item():.1e}")
    return ("FAILED" if failed else "ok"), detail


CHECKS = [("dispatch", check_dispatch), ("mm_fp32", check_mm_fp32), ("deterministic", check_deterministic),
          ("checkpoint RNG", check_checkpoint_rng), ("distributed", check_distributed),
          ("cuda graph", check_cuda_graph), ("engine graphs", check_engine_graphs), ("backward", check_backward)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    args = parser.parse_args()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        print(f"device {torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    else:
        print(f"device cpu (no GPU: the CUDA-only parts are skipped), torch {torch.__version__}")
    counts = {"ok": 0, "skipped": 0, "FAILED": 0}
    for name, check in CHECKS:
        t0 = time.perf_counter()
        try:
            status, detail = check(device)
        except Exception as e:
            traceback.print_exc()
            status, detail = "FAILED", f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        counts[status] += 1
        print(f"{status:<8} {name:<15} {detail} ({time.perf_counter() - t0:.1f} s)", flush=True)
    summary = f"{counts['ok']} ok, {counts['skipped']} skipped, {counts['FAILED']} FAILED"
    print(f"first checks: {summary}")
    if os.environ.get("STEP_NOTE"):  # the results row of bench/gpu_suite.sh
        with open(os.environ["STEP_NOTE"], "w") as f:
            f.write(summary + "\n")
    return 1 if counts["FAILED"] else 0


if __name__ == "__main__":
    sys.exit(main())
