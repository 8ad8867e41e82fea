"""torch.compile's CPU backend on the decoder blocks of a real checkpoint, against eager, on a packed micro-batch of
the SmolLM2 recipe's shape: what it would buy the scoring and training passes, what it costs to compile, and how
far its results move from eager's.

    python bench/compile_block.py --policy ~/.cache/ppo-core/SmolLM2-135M-Instruct --threads 2

Each decoder block (ppo_core.models.model.Block) is wrapped in torch.compile (inductor, the default mode); attention
over the packed rows stays eager (torch.compiler.disable: one SDPA call per distinct length, Python loops), so each
block compiles into the graphs around it: norm, q/k/v projections, RoPE, then o-projection, residual, norm, MLP.
Measured in one process, eager and compiled interleaved, under the recipe's autocast (bf16 matmuls where this CPU
has fast bf16, else float32): the scoring pass (forward, no grad) and a training pass (forward + backward of the
hidden states' sum), medians of --repeats, and the first compiled calls (compile time). The difference from eager is
the RMS of the hidden states' difference over the micro-batch (random tokens: a few positions swing widely, so the
largest difference says little), next to how far eager's own autocast moves them from float32.
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(HERE)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]

import torch  # noqa: E402

from bench.cpu_precision import timed  # noqa: E402  (one warm-up call, then the median of `repeats`)
from ppo_core.models import model as model_lib  # noqa: E402
from ppo_core.models.model import load_model  # noqa: E402
from ppo_core.models.precision import bf16_matmul_hardware  # noqa: E402


def packed_batch(rows, vocab, seed=0):
    """rows sequences of 30-70 tokens one after another: input_ids [N], positions [N], seq_lens."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(30, 71, (rows,), generator=g).tolist()
    ids = torch.randint(0, vocab, (sum(seq_lens),), generator=g)
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    return ids, positions, seq_lens


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default=os.path.expanduser("~/.cache/ppo-core/SmolLM2-135M-Instruct"))
    ap.add_argument("--rows", type=int, default=40, help="sequences in the packed micro-batch (the recipe: ~40)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    policy = load_model(args.policy, dtype=torch.float32)
    ids, positions, seq_lens = packed_batch(args.rows, policy.args.vocab_size)
    fast_bf16 = bf16_matmul_hardware("cpu")
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if fast_bf16 else (
        lambda: torch.autocast("cpu", enabled=False))
    backbone = policy.model
    eager_layers = list(backbone.layers)
    model_lib.packed_attention = torch.compiler.disable(model_lib.packed_attention)
    # one graph for every layer: a layer's index is an input, not a constant to recompile for
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    torch._dynamo.config.cache_size_limit = 4 * len(backbone.layers)

    def forward(train):
        with autocast(), torch.set_grad_enabled(train):
            hidden = backbone.forward_packed(ids, positions, seq_lens)
            if train:
                hidden.float().sum().backward()
        return hidden.detach()

    def use(layers):
        for i, layer in enumerate(layers):
            backbone.layers[i] = layer

    compiled_layers = [torch.compile(layer) for layer in eager_layers]
    t0 = time.perf_counter()
    use(compiled_layers)
    forward(False)
    compile_fwd = time.perf_counter() - t0
    t0 = time.perf_counter()
    forward(True)
    compile_train = time.perf_counter() - t0
    results = {}
    for name, layers in (("eager", eager_layers), ("compiled", compiled_layers)):
        use(layers)
        forward(False)  # warm
        results[name] = {"score": timed(lambda: forward(False), args.repeats),
                         "train": timed(lambda: (forward(True), policy.zero_grad(set_to_none=True)), args.repeats),
                         "hidden": forward(False)}
    use(eager_layers)
    with torch.no_grad():  # float32 throughout: how far eager's own autocast rounding moves the hidden states
        fp32 = backbone.forward_packed(ids, positions, seq_lens).float()
    rms = lambda t: t.float().pow(2).mean().sqrt().item()  # noqa: E731  (random tokens: a few positions swing widely)
    moved = {name: rms(results[name]["hidden"].float() - fp32) for name in results}
    diff = rms(results["compiled"]["hidden"].float() - results["eager"]["hidden"].float())
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"# {os.path.basename(os.path.normpath(args.policy))}, packed micro-batch of {len(seq_lens)} rows, "
          f"{len(ids)} tokens; {cpu} ({fast_bf16 or 'no fast bf16'}), {args.threads} threads, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; matmuls in {'bf16' if fast_bf16 else 'fp32'}")
    print("pass                 eager s   compiled s   compiled/eager")
    for phase in ("score", "train"):
        e, c = results["eager"][phase], results["compiled"][phase]
        print(f"{phase + (' (fwd)' if phase == 'score' else ' (fwd+bwd)'):<20} {e:8.3f}   {c:10.3f}   {c / e:14.3f}")
    print(f"first compiled calls (compile included): forward {compile_fwd:.1f} s, forward + backward {compile_train:.1f} s")
    print(f"RMS of the hidden states' difference: compiled vs eager {diff:.3e}; from float32 eager: eager "
          f"{moved['eager']:.3e}, compiled {moved['compiled']:.3e} (RMS of the hidden states {rms(fp32):.3e})")


if __name__ == "__main__":
    main()
