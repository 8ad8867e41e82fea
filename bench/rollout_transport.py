"""A rollout from a rollout worker to the trainer: its tensors as messages of their own against the same rollout as
JSON text (sampled_state's lists, as the checkpoint holds it). Both travel by the worker's own protocol,
ppo_core.run.rollout_worker's send_message / recv_message: the JSON text as one byte tensor.

    python bench/rollout_transport.py                      # 128 and 512 responses of 4096 tokens (~1 min)
    python bench/rollout_transport.py --rows 64 --tokens 1024

Two processes on this machine, gloo over loopback (what a CPU job uses; on GPUs the rollout's messages take the same
gloo path, the weights NCCL). The rollout: random tokens, masks, decode log-probs and entropy (old_logprobs_from_rollout
or an off-policy correction records them), scores, one reward metric, short prompt rows and texts. Timed: from the
worker's Sampled to the trainer's Sampled on its device (the CPU here), both sides included, median of --repeats.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ppo_core.rollout import Sampled, sampled_from_state, sampled_state  # noqa: E402
from ppo_core.run.rollout_worker import recv_message, send_message  # noqa: E402


def rollout(rows, tokens, prompt=256):
    g = torch.Generator().manual_seed(0)
    return Sampled(rows=[{"prompt": f"prompt {i}"} for i in range(rows)], prompts=[f"prompt {i}" for i in range(rows)],
                   responses=[f"response {i}" for i in range(rows)],
                   prompt_ids=torch.randint(0, 150000, (rows, prompt), generator=g),
                   prompt_mask=torch.ones(rows, prompt, dtype=torch.bool),
                   tokens=torch.randint(0, 150000, (rows, tokens), generator=g),
                   response_mask=torch.ones(rows, tokens), ended=torch.ones(rows, dtype=torch.bool),
                   scores=torch.rand(rows, generator=g), reward_metrics={"reward/fn": torch.rand(rows, generator=g)},
                   decode_logprobs=-torch.rand(rows, tokens, generator=g),
                   decode_entropy=torch.rand(rows, tokens, generator=g))


def worker(rank, args, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch_dist.init_process_group("gloo", rank=rank, world_size=2)
    group = torch.arange(1)
    for rows in args.rows:
        sampled = rollout(rows, args.tokens) if rank == 0 else None
        for transport in ("json", "tensors"):
            times = []
            for _ in range(args.repeats + 1):  # the first warms up
                torch_dist.barrier()
                start = time.perf_counter()
                if rank == 0 and transport == "json":  # the whole rollout as JSON text, its bytes one tensor
                    text = json.dumps(sampled_state(sampled, group, {})).encode()
                    send_message(torch.frombuffer(bytearray(text), dtype=torch.uint8), 1)
                elif rank == 0:
                    send_message(sampled_state(sampled, group, {}, lists=False), 1)
                else:
                    message = recv_message(0)
                    state = json.loads(bytes(message.numpy())) if transport == "json" else message
                    sampled_from_state(state, "cpu")
                torch_dist.barrier()
                times.append(time.perf_counter() - start)
            if rank == 0:
                results.put((rows, transport, statistics.median(times[1:])))
    torch_dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results = mp.get_context("spawn").Queue()
    port = 29000 + os.getpid() % 1000
    mp.spawn(worker, args=(args, port, results), nprocs=2)
    found = {}
    while not results.empty():
        rows, transport, seconds = results.get()
        found[rows, transport] = seconds
    print(f"\n--rollout transport: {args.tokens}-token responses, 256-token prompts, gloo over loopback, 2 processes x 1 "
          f"thread, torch {torch.__version__}, median of {args.repeats}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| responses | MB of tensors | JSON text s | tensor messages s | speed-up |")
    print("|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        mb = rows * (256 * 9 + args.tokens * (8 + 4 + 4 + 4) + 1 + 4 + 4 + 8) / 1e6
        j, t = found[rows, "json"], found[rows, "tensors"]
        print(f"| {rows} | {mb:.0f} | {j:.2f} | {t:.3f} | {j / t:.0f}x |")


if __name__ == "__main__":
    main()
