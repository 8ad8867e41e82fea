"""Rollouts recorded and replayed (config save_rollouts, replay_rollouts): each iteration's sampled and scored rollout
kept in the run directory, and read back by a later run that trains on it instead of sampling (docs/replay.md).

    RUN/rollouts/manifest.json         written as the run starts: what the rollouts are sampled from (the SHA-256 of
                                       the policy checkpoint's weights and of its tokenizer), the rollout's shape
                                       (REPLAY_SHAPE) and the whole config
    RUN/rollouts/step-N.safetensors    iteration N's tensors: token ids, masks, scores, the sampler's log-probs, ...
    RUN/rollouts/step-N.json           the rest of it (prompt rows, texts, statistics) and the byte size and SHA-256 of
                                       step-N.safetensors; written after it, so a step counts once its JSON is there

What the loop records is a plain state (nested dicts and lists of JSON values and CPU tensors: the form of
ppo_core.rollout.sampled_state): write_rollout puts each tensor in the safetensors file and a {"tensor": key} in its
place in the JSON; Recording.read puts them back. Both files are written atomically (a temporary file, fsync, rename):
a run killed while writing leaves the step before it whole. Nothing is pickled.

A replay trusts nothing it has not checked (open_recording): the manifest must name the checkpoint, tokenizer and
rollout shape of the replaying run, and every step it will read must be there and match its SHA-256; else one
ConfigError naming config key 'replay_rollouts'. One process only, for now: check_processes.
"""
import hashlib
import json
import os

import torch
from safetensors.torch import save_file

from . import checkpoint
from ..rewards.redact import redact
from .runlog import IGNORED_FOR_IDENTITY, is_rank0, write_json
from ..config import ConfigError, PPOConfig, to_dict
from ..models.model import CheckpointError, read_safetensors

FOLDER = "rollouts"
MANIFEST = "manifest.json"
FORMAT = 1
# what a recorded rollout's tensors are shaped by: a replay with other values would train on batches of another size
REPLAY_SHAPE = ("rollout_batch_size", "n_samples_per_prompt", "max_new_tokens")
# a checkpoint's files that make its weights, and those that make its tokenizer (hashed where present)
WEIGHT_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")
# config keys that do not change the weights a replay trains: where things are written, when, evaluated, how fast,
# and how the recording was sampled (a replay samples nothing)
NOT_TRAINED = ("policy", "save_rollouts", "replay_rollouts", "save_every", "keep_checkpoints", "stop_grace_s",
               "threads", "eval_size", "eval_every", "eval_reward_fn", "eval_prompts_file", "max_staleness",
               "rollout_engine", "rollout_kv_cache_gb", "cuda_graph", "top_p", "top_k", "allow_filtered_sampling",
               "filter_groups", "filter_groups_max_batches")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "tokenizer.model")


def folder(run_path) -> str:
    return os.path.join(run_path, FOLDER)


def step_paths(run_path, step) -> tuple:
    """(step-N.safetensors, step-N.json) of recording `run_path`."""
    base = os.path.join(folder(run_path), f"step-{step}")
    return base + ".safetensors", base + ".json"


# ---------------------------------------------------------------------------- what a recording was sampled from

def files_sha256(directory, names) -> str:
    """One SHA-256 over the files `names` present in `directory`: each file's name and its own SHA-256, in order."""
    digest = hashlib.sha256()
    for name in sorted(names):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            digest.update(f"{name} {checkpoint.file_sha256(path)}\n".encode())
    return digest.hexdigest()


def checkpoint_identity(policy_path) -> dict:
    """{"weights_sha256", "tokenizer_sha256"} of a checkpoint directory: its weights (config, model*.safetensors: one
    file or HF's shards; not a ppo-core step's optimizer or RNG files) and its tokenizer, hashed apart so that a
    refusal can say which differs. Reads every weight file: seconds for a model of a few GB."""
    weights = [n for n in os.listdir(policy_path) if n.startswith("model") and n.endswith(".safetensors")]
    weights += list(WEIGHT_FILES)
    return {"weights_sha256": files_sha256(policy_path, weights),
            "tokenizer_sha256": files_sha256(policy_path, TOKENIZER_FILES)}


def start_recording(run_path, cfg: PPOConfig, policy_path):
    """RUN/rollouts/manifest.json for a run that records (rank 0; a resume writes the same again)."""
    if not is_rank0():
        return
    os.makedirs(folder(run_path), exist_ok=True)
    write_json(os.path.join(folder(run_path), MANIFEST),
               {"format": FORMAT, "policy": policy_path, **checkpoint_identity(policy_path),
                "shape": {key: getattr(cfg, key) for key in REPLAY_SHAPE}, "iterations": cfg.iterations,
                "config": redact(to_dict(cfg))})


def tensor_bytes_bound(rows, prompt_len, response_len, decode_logprobs: bool, attended: bool) -> int:
    """Bytes of the tensors the loop records an iteration (ppo_core.train.recorded_state), from their shapes: rows of
    prompt_len prompt and response_len response tokens, without the reward components (4 bytes a row each).
    Per row: prompt ids int64 + mask bool; tokens int64, response mask, old log-probs, entropy float32; the decoding
    pass's log-probs and entropy float32 (decode_logprobs); attended bool (episodes); ended bool, score float32,
    group int64."""
    per_token = 8 + 4 + 4 + 4 + (8 if decode_logprobs else 0) + (1 if attended else 0)
    return rows * (prompt_len * (8 + 1) + response_len * per_token + 1 + 4 + 8)


def size_text(n) -> str:
    """A byte count for the log: 812 B, 3.1 kB, 1.62 MB, 2.05 GB (powers of 1000)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.{2 if unit != 'kB' else 1}f} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------------------- writing

def split_tensors(obj, tensors: dict, path=""):
    """`obj` with each CPU tensor replaced by {"tensor": key}, the tensor put in tensors[key]: its dotted path,
    "sampled.tensors.tokens.values"."""
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().cpu().contiguous()
        return {"tensor": path}
    if isinstance(obj, dict):
        return {k: split_tensors(v, tensors, f"{path}.{k}" if path else str(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [split_tensors(v, tensors, f"{path}.{i}" if path else str(i)) for i, v in enumerate(obj)]
    return obj


def write_rollout(run_path, step, state: dict) -> tuple:
    """Iteration `step`'s rollout `state` to RUN/rollouts/step-N.safetensors, then step-N.json (which vouches for the
    first by its size and SHA-256), each atomically. -> (tensor bytes, file bytes of both). Rank 0 writes."""
    tensor_file, json_file = step_paths(run_path, step)
    tensors = {}
    record = split_tensors(state, tensors)
    if not is_rank0():
        return 0, 0
    tmp = tensor_file + ".tmp"
    save_file(tensors, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, tensor_file)
    size = os.path.getsize(tensor_file)
    write_json(json_file, {"format": FORMAT, "step": step, "state": record,
                           "tensors": {"file": os.path.basename(tensor_file), "bytes": size,
                                       "sha256": checkpoint.file_sha256(tensor_file)}})
    return sum(t.numel() * t.element_size() for t in tensors.values()), size + os.path.getsize(json_file)


# ---------------------------------------------------------------------------- reading

def refused(what) -> ConfigError:
    return ConfigError(f"config key 'replay_rollouts': {what}")


def check_processes(cfg: PPOConfig, world):
    """Recording and replay run in one process: a rollout split over processes (or sampled by rollout workers)
    would be recorded, and read back, per process. Refused in one line otherwise."""
    for key in ("save_rollouts", "replay_rollouts"):
        if getattr(cfg, key) and world > 1:
            raise ConfigError(f"config key '{key}': recorded rollouts are written and replayed by one process; this "
                              f"run has {world} (docs/replay.md)")


class Recording:
    """A recorded run's rollouts, checked (open_recording); read(step) -> iteration step's state."""

    def __init__(self, path, manifest, steps):
        self.path, self.manifest, self.steps = path, manifest, steps

    def read(self, step) -> dict:
        """Iteration `step`'s state, tensors in place, its safetensors file checked against its JSON again."""
        tensor_file, json_file = step_paths(self.path, step)
        record = self._record(step)
        try:
            tensors = read_safetensors(tensor_file)
        except CheckpointError as e:  # its SHA-256 matches, yet it is no safetensors file: written so on purpose
            raise refused(str(e)) from None

        def join(obj):
            if isinstance(obj, dict) and set(obj) == {"tensor"}:
                if obj["tensor"] not in tensors:
                    raise refused(f"{json_file} names tensor {obj['tensor']!r}, which {tensor_file} lacks")
                return tensors[obj["tensor"]]
            if isinstance(obj, dict):
                return {k: join(v) for k, v in obj.items()}
            if isinstance(obj, list):
                return [join(v) for v in obj]
            return obj
        state = join(record["state"])
        if not (isinstance(state, dict) and isinstance(state.get("sampled"), dict)
                and isinstance(state.get("sampler"), dict)):
            raise refused(f"{json_file} holds no recorded rollout (its state lacks 'sampled' or 'sampler')")
        return state

    def _record(self, step) -> dict:
        """step-N.json, parsed, with its safetensors file matching the size and SHA-256 it names."""
        tensor_file, json_file = step_paths(self.path, step)
        try:
            with open(json_file) as f:
                record = json.load(f)
            size, sha = int(record["tensors"]["bytes"]), str(record["tensors"]["sha256"])
            record["state"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise refused(f"{json_file} is unreadable or torn ({type(e).__name__}: {e})") from None
        if not os.path.isfile(tensor_file):
            raise refused(f"{tensor_file} is missing ({os.path.basename(json_file)} names it)")
        if os.path.getsize(tensor_file) != size:
            raise refused(f"{tensor_file} has {os.path.getsize(tensor_file)} bytes, {os.path.basename(json_file)} "
                          f"says {size}: torn or replaced")
        if checkpoint.file_sha256(tensor_file) != sha:
            raise refused(f"{tensor_file} does not match its SHA-256 in {os.path.basename(json_file)}")
        return record


def recorded_steps(path) -> int:
    """How many iterations `path` holds from the first on: N where step-1.json .. step-N.json are all there."""
    n = 0
    while os.path.isfile(step_paths(path, n + 1)[1]):
        n += 1
    return n


def open_recording(path, cfg: PPOConfig, policy_path) -> Recording:
    """The recording of run directory `path`, checked for a run of `cfg` on `policy_path`: its manifest names the
    same checkpoint weights, tokenizer and REPLAY_SHAPE, it holds cfg.iterations iterations, and each of them is
    whole (its JSON readable, its tensors the size and SHA-256 the JSON names). Raises ConfigError in one line."""
    manifest_file = os.path.join(folder(path), MANIFEST)
    if not os.path.isdir(path):
        raise refused(f"no such run directory: {path!r}")
    if not os.path.isfile(manifest_file):
        raise refused(f"{path} holds no recorded rollouts (no {FOLDER}/{MANIFEST}; record them with --save_rollouts)")
    try:
        with open(manifest_file) as f:
            manifest = json.load(f)
        recorded_shape, recorded_policy = dict(manifest["shape"]), str(manifest["policy"])
        weights, tokenizer = str(manifest["weights_sha256"]), str(manifest["tokenizer_sha256"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise refused(f"{manifest_file} is unreadable or torn ({type(e).__name__}: {e})") from None
    if manifest.get("format") != FORMAT:
        raise refused(f"{manifest_file} has format {manifest.get('format')!r}; this version reads {FORMAT}")
    here = checkpoint_identity(policy_path)
    if here["weights_sha256"] != weights:
        raise refused(f"{path}'s rollouts were sampled from another checkpoint ({recorded_policy}, weights SHA-256 "
                      f"{weights[:12]}) than this run's policy {policy_path} ({here['weights_sha256'][:12]})")
    if here["tokenizer_sha256"] != tokenizer:
        raise refused(f"{path}'s rollouts were tokenized by another tokenizer ({recorded_policy}'s, SHA-256 "
                      f"{tokenizer[:12]}) than this run's policy {policy_path}'s ({here['tokenizer_sha256'][:12]})")
    differ = [f"{key} {recorded_shape.get(key)!r} there, {getattr(cfg, key)!r} here" for key in REPLAY_SHAPE
              if recorded_shape.get(key) != getattr(cfg, key)]
    if differ:
        raise refused(f"{path}'s rollouts have another shape: {'; '.join(differ)}")
    steps = recorded_steps(path)
    if steps < cfg.iterations:
        raise refused(f"{path} holds {steps} recorded iteration(s); this run asks for iterations={cfg.iterations}")
    recording = Recording(path, manifest, steps)
    for step in range(1, cfg.iterations + 1):  # every step this run reads, whole, before any work
        recording._record(step)
    return recording


def config_differences(recording: Recording, cfg: PPOConfig) -> list:
    """The config keys that change what a replay trains, whose values this run and the recording differ in."""
    recorded, here = recording.manifest.get("config", {}), redact(to_dict(cfg))
    skip = set(IGNORED_FOR_IDENTITY + NOT_TRAINED)
    return sorted(k for k in set(recorded) | set(here) if k not in skip and recorded.get(k) != here.get(k))

