"""Multi-turn episodes on the rollout engine: does decoding go on while tools run?

    python bench/agents.py                 # 32 episodes, SmolLM2-135M shape with random weights, 2 threads (~2 min)
    python bench/agents.py --quick         # a 2-layer model, 8 episodes

Each episode (what ppo_core.agents.environments.run_episodes wires up, here straight on the engine's on_turn_end) is a
prompt of 32 random tokens, then turns of --turn-tokens sampled tokens, each answered by a tool that sleeps before
returning a 12-token observation, for --turns turns. Tools are slow unevenly, as real ones are: episode i's sleeps
--tool-ms x (0.25 + 1.5 i / (n - 1)) (the mean is --tool-ms, the slowest 1.75x). The tools run in a thread pool; a
sequence waiting on its tool leaves the batch, keeping its cache, and the others go on decoding. The table gives, per
mean tool latency, the engine's busy fraction (the share of the call's wall time spent in decode/prefill steps rather
than waiting with nothing to compute: engine.stats['busy_fraction']), the wall time, sampled tokens per second, and
what a loop in rounds would take (every episode decodes its turn, then all tools run at once and the round waits for
the slowest: decode seconds + turns x the slowest latency), which is what overlapping tools with decoding saves.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ppo_core.engine import RolloutEngine  # noqa: E402
from ppo_core.models.model import CausalLM, ModelArgs, read_config  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "models", "SmolLM2-135M")


def random_model(quick):
    config = read_config(CONFIG)
    if quick:
        config = {**config, "num_hidden_layers": 2}
    torch.manual_seed(0)
    model = CausalLM(ModelArgs.from_hf_config(config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) * 0.02)
    return model


def play(engine, prompts, turns, turn_tokens, tool_s, pool):
    """Episodes of `turns` tool calls, straight on the engine's on_turn_end (what run_episodes wires up, without a
    tokenizer: the observation is 12 fixed tokens). -> (wall seconds, sampled tokens, engine.stats)."""
    seen = {}

    def tool(index):
        time.sleep(tool_s * (0.25 + 1.5 * index / max(1, len(prompts) - 1)))
        return list(range(100, 112))

    def on_turn_end(index, tokens):
        seen[index] = seen.get(index, 0) + 1
        return pool.submit(tool, index) if seen[index] <= turns else None

    budget = (turns + 1) * (turn_tokens + 12)
    start = time.perf_counter()
    out, mask = engine.generate(prompts, budget, max_turn_tokens=turn_tokens, on_turn_end=on_turn_end,
                                return_mask=True, seed=0)
    return time.perf_counter() - start, sum(map(sum, mask)), engine.stats


def main():
    from concurrent.futures import ThreadPoolExecutor

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--turn-tokens", type=int, default=16)
    parser.add_argument("--tool-ms", default="0,50,200,1000")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    episodes = 8 if args.quick else args.episodes
    model = random_model(args.quick)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, model.args.vocab_size, (32,), generator=g).tolist() for _ in range(episodes)]
    engine = RolloutEngine(model)
    with ThreadPoolExecutor(episodes) as pool:
        play(engine, prompts[:2], 1, 4, 0.0, pool)  # warm-up
        print(f"\n--agents: {episodes} episodes x {args.turns} tool calls, turns of {args.turn_tokens} tokens, "
              f"12-token observations, {'2-layer ' if args.quick else ''}SmolLM2-135M shape, float32, {args.threads} "
              f"threads, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        print("| mean tool latency ms | busy fraction | wall s | sampled tok/s | in rounds s, computed: decode + slowest tool per round |")
        print("|---:|---:|---:|---:|---:|")
        for ms in (float(x) for x in args.tool_ms.split(",")):
            wall, sampled, stats = play(engine, prompts, args.turns, args.turn_tokens, ms / 1000, pool)
            decode_s = wall * stats["busy_fraction"]
            serial = decode_s + args.turns * 1.75 * ms / 1000
            print(f"| {ms:.0f} | {stats['busy_fraction']:.3f} | {wall:.2f} | {sampled / wall:.1f} | {serial:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
