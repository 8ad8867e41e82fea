"""Decode throughput of `ppo_core.generate`: against `transformers`' `generate` on the CPU, and on a GPU with and
without CUDA graphs.

    python bench/generate.py                       # CPU: SmolLM2-135M shape, batch 8, 32 prompt + 64 new, 2 threads
    python bench/generate.py --batch 4 --new 32 --repeats 5 --threads 2 --config configs/models/SmolLM2-360M
    python bench/generate.py --device cuda         # GPU: batch 64, 128 new tokens, bf16, CUDA graphs on and off
    python bench/generate.py --smoke               # the GPU table's code on the CPU, toy size, seconds

CPU: a random-weight checkpoint with the architecture of `--config` is written to a temporary directory by
`transformers` and loaded by both libraries (float32, CPU). Both decode greedily for exactly `--new` tokens
(EOS ignored) from the same random prompts; the script checks the tokens are identical, then reports the
median wall time of `--repeats` timed calls after a short warm-up call each (the calls of the implementations
interleaved), as new tokens per second (batch * new / time, prefill included) and milliseconds per new token
step. ppo_core runs three times: with its default CPU fast path (oneDNN-packed weights, see model.cpu_packed_linears),
with plain F.linear, the same matmul transformers uses, and with packed weights and the static-cache decode step
(`static_cache=True`, every step attends over all prompt + new slots with a mask: the default on a GPU).

GPU (--device cuda): random weights (std 0.02) in ppo_core's own model, no transformers needed; rows: bf16
weights, and fp32 weights under bf16 autocast (what the trainer's rollout runs), each with the static-cache step
eager and captured as a CUDA graph (`cuda_graph=True`), plus the dynamic cache, plus transformers' generate on the
same weights when it is installed (`--no-hf` leaves it out). Timed with torch.cuda.synchronize around each
call (prefill included; a CUDA graph is captured inside every call, as in a rollout), median of --repeats calls
(transformers: one) after a 16-token warm-up call; "same tokens" compares greedy tokens with the bf16 eager
static-cache row (bf16 rounding makes other weight layouts legitimately differ in a few tokens).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import ppo_core  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(HERE, "..", "configs", "models", "SmolLM2-135M")  # shipped in the repository
HF_ROW = "transformers generate, bf16, dynamic cache"
BASE_ROW = "bf16 weights, static cache, eager step"


def timed(fns: dict, new, repeats):
    """name -> (tokens, median seconds) of fn(new). Each fn is warmed up with a short call (allocator, thread
    pool, kernel choice); the timed calls of all fns are interleaved so that a change in the load of a shared
    machine hits every implementation alike."""
    for fn in fns.values():
        fn(4)
    outputs, times = {}, {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            outputs[name] = fn(new)
            times[name].append(time.perf_counter() - t0)
    return {name: (outputs[name], statistics.median(times[name])) for name in fns}


def random_model(cfg, device, seed=0):
    """ppo_core's CausalLM with the architecture of the config dict `cfg` and random weights: matrices
    ~ N(0, 0.02^2) (the configs' initializer_range), norms 1, biases 0. Also used by bench/ppo_step.py."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = ppo_core.CausalLM(ppo_core.ModelArgs.from_hf_config(cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0 if "norm" in name else 0.0)
    return model.eval()


def read_config(config_dir, layers=None, vocab=None):
    """config_dir/config.json, optionally cut to its first `layers` layers and a `vocab`-token vocabulary."""
    cfg = ppo_core.models.model.read_config(config_dir)
    if layers:
        cfg = {**cfg, "num_hidden_layers": layers}
        if cfg.get("layer_types"):
            cfg["layer_types"] = cfg["layer_types"][:layers]
    if vocab:
        cfg = {**cfg, "vocab_size": vocab}
    return cfg


def device_table(args):
    """The GPU table (or, with --smoke, its code on the CPU at toy size): see the module docstring."""
    import contextlib
    import copy

    device = args.device
    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("bench/generate.py: --device cuda but torch sees no CUDA device")
    batch, new = args.batch or (4 if args.smoke else 64), args.new or (8 if args.smoke else 128)
    prompt_len = 8 if args.smoke else args.prompt
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fp32 = random_model(read_config(args.config, layers=2 if args.smoke else None,
                                   vocab=2048 if args.smoke else None), device)
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    V = fp32.args.vocab_size
    g = torch.Generator(device=device).manual_seed(1)
    prompts = torch.randint(1, V, (batch, prompt_len), generator=g, device=device)
    mask = torch.ones_like(prompts)
    mask[::4, : prompt_len // 4] = 0  # every fourth row left-padded, as in a rollout batch
    prompts = prompts.masked_fill(mask == 0, 0)

    def ours(model, autocast=False, **kw):
        def run(n):
            ctx = torch.autocast(device, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
            with ctx:
                return ppo_core.generate(model, prompts, n, attention_mask=mask, greedy=True, stop_at_eos=False,
                                         cpu_packed_weights=False, **kw)
        return run

    # Most telling first (rows print as they finish, so a time limit cuts the last ones): the eager static step
    # (the base of "vs eager static"), its CUDA graph, the trainer's rollout both ways, then the dynamic cache.
    rows = {
        BASE_ROW: ours(bf16, static_cache=True),
        "bf16 weights, static cache, CUDA graph": ours(bf16, static_cache=True, cuda_graph=True),
        "fp32 weights + bf16 autocast (trainer), static, CUDA graph": ours(fp32, True, static_cache=True, cuda_graph=True),
        "fp32 weights + bf16 autocast (trainer), static, eager": ours(fp32, True, static_cache=True),
        "bf16 weights, dynamic cache": ours(bf16, static_cache=False),
    }
    if not cuda:  # CUDA graphs need a GPU: the smoke run checks the rest of the table
        rows = {name: fn for name, fn in rows.items() if "CUDA graph" not in name}
    hf_note = ""
    hf = {}  # the transformers model, loaded when its row comes (last): the rows before it print meanwhile
    if not args.no_hf:
        def load_hf():
            import tempfile as _tempfile

            from transformers import AutoModelForCausalLM
            with _tempfile.TemporaryDirectory() as ckpt:
                bf16.save_pretrained(ckpt)
                model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).to(device).eval()
            model.generation_config.eos_token_id = None  # decode exactly n tokens
            model.generation_config.pad_token_id = 0
            hf["model"] = model

        def run_hf(n):
            with torch.no_grad():
                out = hf["model"].generate(input_ids=prompts, attention_mask=mask, max_new_tokens=n,
                                           min_new_tokens=n, do_sample=False)
            return out[:, prompt_len:]
        rows[HF_ROW] = run_hf

    where = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads (smoke: toy size)"
    n_params = fp32.num_parameters()
    print(f"model {os.path.basename(os.path.normpath(args.config))}{' (2 layers, 2048 tokens)' if args.smoke else ''} "
          f"({n_params / 1e6:.1f}M params, random weights), batch {batch} (every 4th row left-padded), prompt "
          f"{prompt_len}, new {new}, greedy, {where}, torch {torch.__version__}, median of {args.repeats} calls "
          f"(transformers: 1) after a 16-token warm-up call, prefill included")
    print(f"| {'implementation':<58} | {'time (s)':>8} | {'new tok/s':>9} | {'ms/step':>7} | {'vs eager static':>15} | {'same tokens':>11} |")
    print(f"|{'-' * 60}|{'-' * 10}:|{'-' * 10}:|{'-' * 8}:|{'-' * 16}:|{'-' * 12}:|", flush=True)
    failed = False
    base_tokens, base_time = None, None
    for name, fn in rows.items():  # each row is printed as soon as it is measured
        if name == HF_ROW:
            try:
                load_hf()
            except Exception as e:  # not installed, or a version that cannot read this checkpoint
                hf_note = (f"transformers row left out: {type(e).__name__}: "
                           f"{str(e).splitlines()[0][:120] if str(e) else ''}")
                continue
        try:
            fn(min(new, 16))  # warm-up: cuBLAS heuristics, the allocator; a CUDA graph is captured in every call
            times, tokens = [], None
            for _ in range(1 if name == HF_ROW else args.repeats):  # transformers: one call, it is the slow row
                sync()
                t0 = time.perf_counter()
                tokens = fn(new)
                sync()
                times.append(time.perf_counter() - t0)
            t = statistics.median(times)
        except Exception as e:
            failed = True
            error = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:140] if str(e) else ''}"
            print(f"  {name}: {error}", file=sys.stderr, flush=True)
            print(f"| {name:<58} | {error} | | | | |", flush=True)
            continue
        print(f"  {name}: {t}", file=sys.stderr, flush=True)
        if name == BASE_ROW:
            base_tokens, base_time = tokens, t
        vs = f"{base_time / t:14.2f}x" if base_time is not None else f"{'':>15}"
        same = "" if base_tokens is None else ("yes" if torch.equal(tokens, base_tokens) else
                                                f"{(tokens != base_tokens).any(-1).sum().item()}/{batch} rows differ")
        print(f"| {name:<58} | {t:8.3f} | {batch * new / t:9.1f} | {1000 * t / new:7.2f} | {vs} | {same:>11} |",
              flush=True)
    if hf_note:
        print(hf_note)
    if failed and args.smoke:
        sys.exit("bench/generate.py --smoke: a row failed (see the table)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=DEFAULT_CONFIG, help="a directory holding config.json")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--smoke", action="store_true", help="the --device cuda table's code on --device, toy size")
    ap.add_argument("--batch", type=int, default=None, help="default 8 (CPU), 64 (CUDA)")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=None, help="default 64 (CPU), 128 (CUDA)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hf-static", action="store_true", help="also time transformers with cache_implementation='static'")
    ap.add_argument("--no-hf", action="store_true", help="GPU table: leave out the transformers row")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.device == "cuda" or args.smoke:
        return device_table(args)
    args.batch, args.new = args.batch or 8, args.new or 64

    from transformers import AutoConfig, AutoModelForCausalLM  # the reference only; ppo_core never imports it

    config = AutoConfig.from_pretrained(args.config)
    config.dtype = "float32"
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory() as ckpt:
        hf.save_pretrained(ckpt)
        ours = ppo_core.load_model(ckpt).eval()
    hf.generation_config.eos_token_id = None  # decode exactly --new tokens in both
    hf.generation_config.pad_token_id = 0

    prompts = torch.randint(0, config.vocab_size, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompts)

    def run_ours(new, **kw):
        return ppo_core.generate(ours, prompts, new, attention_mask=mask, greedy=True, stop_at_eos=False, **kw)

    def run_hf(new, **kw):
        with torch.no_grad():
            out = hf.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, **kw)
        return out[:, args.prompt:]

    fns = {"transformers generate (dynamic cache)": run_hf}
    if args.hf_static:
        fns["transformers generate (static cache)"] = lambda new: run_hf(new, cache_implementation="static")
    fns["ppo_core generate, plain F.linear"] = lambda new: run_ours(new, cpu_packed_weights=False)
    fns["ppo_core generate (packed CPU weights)"] = run_ours
    fns["ppo_core generate (packed, static cache)"] = lambda new: run_ours(new, static_cache=True)
    results = timed(fns, args.new, args.repeats)
    hf_tokens, t_hf = results["transformers generate (dynamic cache)"]
    rows = [(name, t, bool(torch.equal(tokens, hf_tokens))) for name, (tokens, t) in results.items()]

    n_params = ppo_core.count_parameters(args.config)
    print(f"model {os.path.basename(os.path.normpath(args.config))} ({n_params / 1e6:.1f}M params, random weights, float32), "
          f"batch {args.batch}, prompt {args.prompt}, new {args.new}, greedy, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, median of {args.repeats} after warm-up, load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs")
    print(f"| {'implementation':<40} | {'time (s)':>8} | {'new tok/s':>9} | {'ms/step':>7} | {'vs transformers':>15} | {'same tokens':>11} |")
    print(f"|{'-' * 42}|{'-' * 10}:|{'-' * 10}:|{'-' * 8}:|{'-' * 16}:|{'-' * 12}:|")
    for name, t, same in rows:
        print(f"| {name:<40} | {t:8.3f} | {args.batch * args.new / t:9.1f} | {1000 * t / args.new:7.1f} | "
              f"{t_hf / t:14.2f}x | {'yes' if same else 'NO':>11} |")
    for name, (tokens, _) in results.items():
        if not torch.equal(tokens, hf_tokens):
            print(f"WARNING: {name}: greedy tokens differ from transformers in "
                  f"{(tokens != hf_tokens).any(-1).sum().item()}/{args.batch} rows")
            sys.exit(1)


if __name__ == "__main__":
    main()
