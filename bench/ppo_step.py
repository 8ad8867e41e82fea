"""One PPO iteration at a real shape through the real trainer, and the attention kernel each pass runs on.

    python bench/ppo_step.py                      # GPU: Qwen3-0.6B shape, random weights, 64 prompts x (<=128 + 128)
    python bench/ppo_step.py --tiny               # the same code on the CPU at a toy shape, seconds
    python bench/ppo_step.py --only attention     # only the attention table (or: --only step)

What it builds, in a scratch directory (--workdir, default a temporary one):
  - a checkpoint with the architecture of configs/models/Qwen3-0.6B and random weights (ppo_core.models.model's
    save_pretrained, bf16 on a GPU);
  - a tokenizer.json whose vocabulary covers every id (a WordLevel model over "t0" .. "t151935", with the config's
    EOS id as "<|im_end|>"): random weights sample any id, and every sampled id must decode;
  - a prompts file (left padding: lengths prompt/2 .. prompt) and a reward function file (response length).
Then the attention table (below; it runs first because it takes seconds, so a time limit that cuts the
iteration leaves it printed), then `ppo_core.train.run` with a PPOConfig runs --iterations iterations (the first
one includes cuBLAS warm-up and any Triton JIT the attention table's passes did not already do; the second is
the steady state) and the table gives, per iteration, the rollout and update
seconds, response tokens/s and the peak GPU memory of the whole run. The final checkpoint write (about 7 GB of
weights and optimizer state for this shape) measures the disk, not the GPU: it is skipped unless --save.

The attention table: each pass of the loop (the policy's training forward + backward through the fused loss, the
old/reference log-prob pass, the critic's value pass, a reward model's scoring forward, the prefill and one
static-cache decode step), run under the trainer's precision (fp32 weights + bf16 autocast on CUDA) on a
rollout-shaped batch (left-padded prompts, right-padded responses). "runs on" is the SDPA kernel torch
dispatched to (read from the profiler's op names); then each of flash, memory-efficient and cuDNN is tried alone
under torch.nn.attention.sdpa_kernel, with the math backend excluded: "yes" = the pass runs on it. A pass whose
only kernel is the math fallback (it upcasts to fp32 and materialises [B, nh, T, S] scores) is reported as
MATH, a failure of the goal.
"""
import argparse
import contextlib
import gc
import json
import os
import random
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ppo_core.models import model as ppo_model  # noqa: E402
from ppo_core.run import runlog
from ppo_core import train  # noqa: E402
from ppo_core import algo  # noqa: E402
from ppo_core.heads import response_logprobs, response_values  # noqa: E402
from ppo_core.update import MicroBatch, policy_objective  # noqa: E402
from ppo_core.config import PPOConfig  # noqa: E402
from generate import random_model  # noqa: E402  (bench/generate.py: this script's folder is on sys.path)

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(HERE, "..", "configs", "models", "Qwen3-0.6B")
EOS, PAD = "<|im_end|>", "<|endoftext|>"
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512, eos_token_id=511, layer_types=["full_attention"] * 2)


# ---------------------------------------------------------------------------------------- the scratch checkpoint
def write_checkpoint(path, config, device, dtype):
    """config.json + model.safetensors with random weights (bench/generate.py's random_model)."""
    model = random_model(config, device)
    model.to(dtype).save_pretrained(path)
    del model


def write_tokenizer(path, vocab_size, eos_id):
    """A whitespace-split WordLevel tokenizer over every id: "t{i}" for id i, EOS named EOS, PAD one id below."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    pad_id = eos_id - 1 if eos_id > 0 else eos_id + 1
    vocab = {f"t{i}": i for i in range(vocab_size)}
    del vocab[f"t{eos_id}"], vocab[f"t{pad_id}"]
    vocab[EOS], vocab[PAD] = eos_id, pad_id
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=PAD))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([EOS, PAD])
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": EOS, "pad_token": PAD}, f)
    return pad_id


REWARD_FILE = '''"""Reward of the bench/ppo_step.py run: the response's length in tokens / 100 (any number will do)."""


def reward(prompts, responses):
    return [len(r.split()) / 100 for r in responses]
'''


def write_prompts(path, n, prompt_len, vocab_size, special, seed=0):
    """n prompts of prompt_len/2 .. prompt_len random ordinary tokens, one per line."""
    rng = random.Random(seed)
    ordinary = [i for i in range(vocab_size) if i not in special]
    with open(path, "w") as f:
        for _ in range(n):
            length = rng.randint(max(1, prompt_len // 2), prompt_len)
            f.write(" ".join(f"t{rng.choice(ordinary)}" for _ in range(length)) + "\n")


def model_config(args):
    config = ppo_model.read_config(args.config)
    if args.tiny:
        config = {**config, **TINY}
    return config


# ---------------------------------------------------------------------------------------- one PPO iteration
def ppo_iterations(args, ckpt, workdir, device):
    """ppo_core.train.run on the scratch checkpoint; -> (metrics rows, summary, peak bytes or None, seconds)."""
    cfg_fields = {f for f in PPOConfig.__dataclass_fields__}
    values = dict(policy=ckpt, reward_fn=[os.path.join(workdir, "reward.py") + ":reward"],
                  prompts_file=os.path.join(workdir, "prompts.txt"), eval_size=args.eval_size,
                  iterations=args.iterations, rollout_batch_size=args.batch, minibatch_size=args.batch // 2,
                  micro_batch_size=args.micro_batch, ppo_epochs=args.ppo_epochs, max_new_tokens=args.new,
                  warmup_steps=1, device=device, out=os.path.join(workdir, "run"), progress=False,
                  threads=0 if device == "cuda" else 2, save_every=0)
    if "cuda_graph" in cfg_fields:  # the config key that makes rollouts decode through a CUDA graph
        values["cuda_graph"] = not args.no_cuda_graph
    cfg = PPOConfig(**values)
    save = runlog.RunDir.save_checkpoint
    if not args.save:  # see the module docstring: the final checkpoint write measures the disk
        runlog.RunDir.save_checkpoint = lambda self, step, parts, **kwargs: None
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the trainer's own log and summary: to the log, not the table
            summary = train.run(cfg)
    finally:
        runlog.RunDir.save_checkpoint = save
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    with open(os.path.join(workdir, "run", "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows, summary, peak, seconds, cfg


def print_iterations(rows, summary, peak, seconds, cfg, config, device, prompt_len):
    n_params = ppo_model.count_parameters(config)
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    graph = getattr(cfg, "cuda_graph", None)
    print(f"\n## One PPO iteration: {n_params / 1e6:.{0 if n_params > 1e7 else 2}f}M-parameter {config.get('architectures', ['?'])[0]} "
          f"(random weights), {where}, torch {torch.__version__}\n")
    print(f"rollout_batch_size {cfg.rollout_batch_size}, prompts of <= {prompt_len} "
          f"tokens, max_new_tokens {cfg.max_new_tokens}, ppo_epochs {cfg.ppo_epochs}, minibatch {cfg.minibatch_size}, "
          f"micro-batch {cfg.micro_batch_size}, dtype {cfg.dtype}, fused_kernels {cfg.fused_kernels}, "
          f"cuda_graph {graph if graph is not None else 'n/a (no such config key)'}\n")
    print("| iteration | rollout s | update s | response tokens | tokens/s | reward | first ratio max dev |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        tokens = r["response/length_mean"] * cfg.rollout_batch_size
        print(f"| {r['step']} | {r['time/rollout_s']:.2f} | {r['time/train_s']:.2f} | {tokens:.0f} | "
              f"{r['tokens_per_s']:.0f} | {r['reward/mean']:.3f} | {r.get('policy/first_ratio_max_dev', float('nan')):.2e} |")
    peak_text = f"{peak / 2**30:.1f} GiB" if peak is not None else "n/a on the CPU"
    print(f"\npeak GPU memory of the run (torch.cuda.max_memory_allocated): {peak_text}; whole run incl. loading, "
          f"evaluation before and after ({summary['eval/prompts']} prompts): {seconds:.1f} s")


# ---------------------------------------------------------------------------------------- attention backends
def sdpa_ops_of(fn):
    """Names of the scaled-dot-product-attention aten ops fn() runs (forward and backward), from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sorted({e.name for e in prof.events() if "scaled_dot_product" in e.name and e.name != "aten::scaled_dot_product_attention"})


def kernel_names(ops):
    """aten op names -> the SDPA backends they are (FLASH, EFFICIENT, CUDNN, MATH)."""
    kinds = set()
    for name in ops:
        low = name.lower()
        if "math" in low:
            kinds.add("MATH")
        elif "flash" in low:
            kinds.add("FLASH" + (" (cpu)" if "for_cpu" in low else ""))
        elif "efficient" in low:
            kinds.add("EFFICIENT")
        elif "cudnn" in low:
            kinds.add("CUDNN")
        elif "overrideable" in low:
            kinds.add("OVERRIDEABLE")
    return kinds


def attention_passes(ckpt, device, batch, prompt_len, new):
    """name -> a function running one pass of the loop once, on a rollout-shaped batch, at the trainer's precision."""
    autocast = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device == "cuda"
                else contextlib.nullcontext)
    policy = ppo_model.load_model(ckpt, dtype=torch.float32, device=device)
    critic = ppo_model.load_score_model(ckpt, dtype=torch.float32, device=device)
    V = policy.args.vocab_size
    g = torch.Generator(device=device).manual_seed(0)
    P, R = prompt_len, new
    prompt_ids = torch.randint(0, V - 2, (batch, P), generator=g, device=device)
    prompt_mask = torch.ones(batch, P, dtype=torch.bool, device=device)
    response_mask = torch.ones(batch, R, device=device)
    for row in range(batch):  # left padding of 0 .. P/2, responses of R/2 .. R tokens
        prompt_mask[row, : (row * P // 2) // max(1, batch - 1)] = False
        response_mask[row, R - (row * R // 2) // max(1, batch - 1):] = 0
    responses = torch.randint(0, V - 2, (batch, R), generator=g, device=device)
    ids = torch.cat([prompt_ids, responses], 1)  # [B, P+R]
    am = torch.cat([prompt_mask, response_mask.bool()], 1)
    cfg = PPOConfig()
    old = torch.full((batch, R), -12.0, device=device)
    adv = torch.randn(batch, R, generator=g, device=device)

    def train_step():
        policy.train(), critic.train()
        agg = algo.Aggregation(cfg.loss_agg, num_tokens=response_mask.sum(),
                               num_seqs=torch.tensor(float(batch), device=device))
        try:
            with autocast():
                micro = MicroBatch(input_ids=ids, attention_mask=am, response_mask=response_mask, prompt_len=P,
                                   old_logprobs=old, advantages=adv, ref_logprobs=old)
                loss, *_ = policy_objective(policy, micro, cfg, 0.0, agg)
            loss.backward()
            with autocast():
                values = response_values(critic, ids, am, P).float()
            ((values - adv) ** 2 * response_mask).mean().backward()
        finally:
            policy.zero_grad(set_to_none=True), critic.zero_grad(set_to_none=True)
            policy.eval(), critic.eval()

    @torch.no_grad()
    def logprobs():
        with autocast():
            response_logprobs(policy, ids, am, response_mask, P, 1.0, True)

    @torch.no_grad()
    def values():
        with autocast():
            response_values(critic, ids, am, P)

    @torch.no_grad()
    def reward_score():  # a reward model reads prompt + response right-padded (reward_model.RewardModelReward)
        right = torch.zeros_like(ids)
        right_mask = torch.zeros_like(am)
        for row in range(batch):
            real = ids[row][am[row]]
            right[row, : len(real)], right_mask[row, : len(real)] = real, True
        with autocast():
            critic.score(right, right_mask)

    def cache_dtype():
        return torch.bfloat16 if device == "cuda" else torch.float32

    @torch.no_grad()
    def prefill():
        cache = ppo_model.KVCache(policy.args, batch, P + R, device, cache_dtype())
        with autocast():
            policy(prompt_ids, prompt_mask, cache=cache, return_hidden=True)

    prefilled = {}

    @torch.no_grad()
    def decode_step():
        # the prefill runs outside the measured call once; each call decodes from a fresh copy of its cache
        if "cache" not in prefilled:
            cache = ppo_model.KVCache(policy.args, batch, P + R, device, cache_dtype())
            with autocast():
                policy(prompt_ids, prompt_mask, cache=cache, return_hidden=True)
            prefilled["cache"] = cache
        base = prefilled["cache"]
        cache = ppo_model.KVCache(policy.args, batch, P + R, device, cache_dtype())
        for name in ("k", "v", "k_ring", "v_ring", "mask", "n_real", "slot"):
            getattr(cache, name).copy_(getattr(base, name))
        cache.length, cache.has_padding = base.length, base.has_padding
        with autocast():
            policy.decode_step(responses[:, :1], cache)

    return {"training forward + backward (policy loss, critic)": train_step,
            "old / reference log-probs (fused head)": logprobs, "critic values": values,
            "reward-model scoring (right-padded)": reward_score, "prefill (left-padded prompts)": prefill,
            "static-cache decode step": decode_step}


def attention_table(ckpt, device, batch, prompt_len, new):
    """Print the attention table; -> (passes that failed outright, passes that ran the math backend)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    passes = attention_passes(ckpt, device, batch, prompt_len, new)
    record = getattr(ppo_model, "record_attention_paths", None)  # which SDPA call shape model.attention chose
    backends = [("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                ("cudnn", SDPBackend.CUDNN_ATTENTION)]
    print(f"\n## Attention: the SDPA kernel of each pass (batch {batch}, prompts <= {prompt_len} left-padded, "
          f"responses <= {new} right-padded, {'fp32 weights + bf16 autocast' if device == 'cuda' else 'fp32, CPU'})\n")
    print("| pass | runs on | " + " | ".join(f"{name} alone" for name, _ in backends) + " | call shapes (model.attention) |")
    print("|---|---|" + "---|" * len(backends) + "---|")
    failed, on_math = [], []
    for name, fn in passes.items():
        try:
            fn()  # warm-up (and a plain failure shows here)
            with (record() if record else contextlib.nullcontext([])) as paths:
                ops = sdpa_ops_of(fn)
            kinds = kernel_names(ops)
        except Exception as e:
            print(f"| {name} | failed: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''} |"
                  + " |" * (len(backends) + 1))
            failed.append(name)
            continue
        accepted = []
        for backend_name, backend in backends:
            try:
                with sdpa_kernel([backend]):  # the math fallback excluded
                    fn()
                accepted.append("yes")
            except Exception as e:  # RuntimeError "No available kernel"; anything else is reported, not raised
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                refused = "No available kernel" in first or "No viable backend" in first
                accepted.append("no" if refused else f"error: {first[:60]}")
        runs_on = ", ".join(sorted(kinds)) or "none (no SDPA op seen)"
        if "MATH" in kinds:  # the profiler saw the math fallback: [B, nh, T, S] fp32 scores
            runs_on = f"{runs_on} (MATH: goal failed)"
            on_math.append(name)
        shapes = ", ".join(sorted(set(paths))) if record else "n/a"
        print(f"| {name} | {runs_on} | " + " | ".join(accepted) + f" | {shapes} |", flush=True)
    return failed, on_math


# ---------------------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=DEFAULT_CONFIG, help="a directory holding config.json")
    ap.add_argument("--tiny", "--cpu-smoke", action="store_true",
                    help="toy shape on the CPU (2 layers, hidden 64, vocabulary 512): checks the code in seconds")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if present (cpu with --tiny)")
    ap.add_argument("--only", choices=["step", "attention"], help="run one of the two tables")
    ap.add_argument("--batch", type=int, default=None, help="rollout batch (default 64; --tiny 8)")
    ap.add_argument("--prompt", type=int, default=None, help="longest prompt (default 128; --tiny 12)")
    ap.add_argument("--new", type=int, default=None, help="max_new_tokens (default 128; --tiny 6)")
    ap.add_argument("--micro-batch", type=int, default=None, help="micro-batch (default 16; --tiny 4)")
    ap.add_argument("--ppo-epochs", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=2, help="the first includes JIT and warm-up")
    ap.add_argument("--eval-size", type=int, default=8)
    ap.add_argument("--no-cuda-graph", action="store_true", help="decode rollouts without the CUDA graph")
    ap.add_argument("--save", action="store_true", help="write the final checkpoint (skipped by default)")
    ap.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one, removed)")
    args = ap.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/ppo_step.py: --device cuda but torch sees no CUDA device")
    args.batch = args.batch or (8 if args.tiny else 64)
    args.prompt = args.prompt or (12 if args.tiny else 128)
    args.new = args.new or (6 if args.tiny else 128)
    args.micro_batch = args.micro_batch or (4 if args.tiny else 16)
    if device == "cpu":
        torch.set_num_threads(min(2, os.cpu_count() or 1))

    config = model_config(args)
    failed = []
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        ckpt = os.path.join(workdir, "policy")
        os.makedirs(ckpt)
        t0 = time.perf_counter()
        write_checkpoint(ckpt, config, device, torch.bfloat16 if device == "cuda" else torch.float32)
        pad_id = write_tokenizer(ckpt, config["vocab_size"], config["eos_token_id"])
        with open(os.path.join(workdir, "reward.py"), "w") as f:
            f.write(REWARD_FILE)
        write_prompts(os.path.join(workdir, "prompts.txt"), args.batch + 2 * args.eval_size, args.prompt,
                      config["vocab_size"], {config["eos_token_id"], pad_id})
        print(f"scratch checkpoint, tokenizer, prompts and reward written in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)

        # The attention table first: it takes seconds (and compiles the fused head's Triton kernels for the
        # iteration), so a time limit that cuts the iteration still leaves it printed.
        if args.only in (None, "attention"):
            try:
                broken, on_math = attention_table(ckpt, device, min(args.batch, 8), args.prompt, args.new)
                failed += broken + (on_math if device == "cuda" else [])  # the goal is for CUDA kernels
            except Exception:
                traceback.print_exc()
                print("\n## Attention: FAILED (traceback above)")
                failed.append("attention table")
            if device == "cuda":
                gc.collect()  # the passes' models, before the iteration loads its own
                torch.cuda.empty_cache()
        if args.only in (None, "step"):
            try:
                rows, summary, peak, seconds, cfg = ppo_iterations(args, ckpt, workdir, device)
                print_iterations(rows, summary, peak, seconds, cfg, config, device, args.prompt)
            except Exception:
                traceback.print_exc()
                print("\n## One PPO iteration: FAILED (traceback above)")
                failed.append("ppo iteration")
    if failed:
        sys.exit(f"bench/ppo_step.py: failed or on the math backend: {', '.join(failed)}")


if __name__ == "__main__":
    main()
