"""Training checkpoints: everything a resumed run needs to continue bit for bit, saved atomically.

    RUN/checkpoints/step-N/
        config.json, model.safetensors, tokenizer.json   the policy, Hugging Face layout (load_model works)
        critic/                                          the critic, HF *ForSequenceClassification layout
        optimizer.safetensors                            AdamW moments and step counts of both models
        rng.safetensors                                  torch CPU/CUDA RNG states, sampling and shuffle generators
        trainer_state.json                               iteration, optimizer step, KL controller, prompt
                                                         stream position, Python and NumPy RNG states
        manifest.json                                    written last: the byte size and SHA-256 of every
                                                         other file of the step (sharded/ included)
        trainable.safetensors                            LoRA runs only: the adapters (and the critic's head), what
                                                         a resume loads on top of the base checkpoint; the HF
                                                         files above hold the merged weights
        sharded/                                         parallel='fsdp' only, instead of optimizer.safetensors:
                                                         each process's shards of both models' parameters and
                                                         AdamW moments (torch.distributed.checkpoint, one
                                                         safetensors file per process, offsets in its metadata)
    RUN/checkpoints/latest                               "step-N", replaced only after step-N is complete

With FSDP the policy and critic above are consolidated (gathered to rank 0) so the checkpoint loads in
the rest of the ecosystem; a resume reads the sharded copy, each process its own shards.

Tensors go to safetensors and small state to JSON: nothing is pickled, and loading never runs code.
A save writes `checkpoints/.tmp-step-N/`, fsyncs every file, renames it to `step-N`, and only then
points `latest` at it; a process killed anywhere in between leaves the previous checkpoint loadable.

A resume trusts nothing it has not checked (resume_checkpoint): every file of the step must match its manifest
(size, then SHA-256, read in 4 MiB chunks), else the step is skipped, with a line saying which file, for the
newest older step that does match; `latest` missing, or naming a step that is not there, is said in a line and the
newest intact step resumed (never a silent restart); trainer_state.json must pass a schema check (STATE_SCHEMA), and
the optimizer moments must have the shapes of the parameters they belong to. A step saved before checkpoints carried
a manifest (trainer_state.json without "manifest") is used unverified, with a line saying so.
"""
import dataclasses
import hashlib
import json
import os
import random
import re
import shutil

import numpy as np
import torch
from safetensors.torch import save_file

from ..models import distributed as dist
from ..models import lora
from ..models.model import CheckpointError, check_links, read_safetensors

LATEST = "latest"
STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"


class CheckpointMismatch(CheckpointError):
    """A step's files are not what its save wrote (or its manifest is gone): a resume skips it for an older one."""


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path):
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(root)


def optimizer_tensors(opt: torch.optim.Optimizer, prefix: str) -> dict:
    """AdamW state as flat named tensors: '{prefix}.{param index}.{exp_avg|exp_avg_sq|step}'."""
    out = {}
    for idx, state in opt.state_dict()["state"].items():
        for name, value in state.items():
            out[f"{prefix}.{idx}.{name}"] = value.detach().contiguous().cpu()
    return out


def load_optimizer_tensors(opt: torch.optim.Optimizer, tensors: dict, prefix: str):
    sd = opt.state_dict()
    state = {}
    for key, value in tensors.items():
        role, idx, name = key.split(".", 2)
        if role == prefix:
            state.setdefault(int(idx), {})[name] = value
    sd["state"] = state
    opt.load_state_dict(sd)


def python_rng_state():
    version, internal, gauss = random.getstate()
    return {"version": version, "internal": list(internal), "gauss": gauss}


def set_python_rng_state(s):
    random.setstate((s["version"], tuple(s["internal"]), s["gauss"]))


def numpy_rng_state():
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"name": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}


def set_numpy_rng_state(s):
    np.random.set_state((s["name"], np.array(s["keys"], dtype=np.uint32), s["pos"], s["has_gauss"], s["cached"]))


@dataclasses.dataclass
class CheckpointParts:
    """What a checkpoint holds: the models (critic None for a critic-free run), the tokenizer, their
    optimizers, generators (name -> torch.Generator: their states go to rng.safetensors) and the
    trainer's JSON-able state."""
    policy: object
    critic: object
    tokenizer: object
    policy_opt: object
    critic_opt: object
    generators: dict
    state: dict


def save_checkpoint(run_path, step, parts: CheckpointParts, *, keep: int, write_hook=None,
                    sharded=False):
    """Write RUN/checkpoints/step-{step} atomically with `parts`, point `latest` at it, prune to the
    newest `keep`.

    write_hook(name) is called between files (the tests use it to kill a save half way).
    sharded: FSDP models; every process calls this (the gathers and the sharded save are collective)
    and rank 0 writes the rest. Otherwise only rank 0 calls it. Returns the checkpoint's path."""
    policy, critic, tokenizer = parts.policy, parts.critic, parts.tokenizer
    policy_opt, critic_opt, generators, state = (parts.policy_opt, parts.critic_opt, parts.generators,
                                                 parts.state)
    root = os.path.join(run_path, "checkpoints")
    name = f"step-{step}"
    final, tmp = os.path.join(root, name), os.path.join(root, f".tmp-{name}")
    hook = write_hook or (lambda _: None)
    rank0 = dist.rank() == 0
    if rank0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    if sharded:
        dist.barrier()
    policy_state = export_state(policy)
    if rank0:
        policy.save_pretrained(tmp, state_dict=policy_state)
        tokenizer.save_pretrained(tmp)
    del policy_state
    hook("policy")
    if critic is not None:  # critic-free estimators have none
        critic_state = export_state(critic)
        if rank0:
            critic.save_pretrained(os.path.join(tmp, "critic"), state_dict=critic_state)
        del critic_state
    hook("critic")
    roles = _roles(policy, policy_opt, critic, critic_opt)
    if rank0 and lora.has_lora(policy) and not sharded:  # sharded: the adapters are in sharded/
        save_file({k: v for role, (model, _) in roles.items() for k, v in trainable_tensors(model, role).items()},
                  os.path.join(tmp, TRAINABLE_FILE))
    if sharded:
        save_sharded(os.path.join(tmp, SHARDED_DIR), roles)
    else:
        save_file({k: v for role, (_, opt) in roles.items() for k, v in optimizer_tensors(opt, role).items()},
                  os.path.join(tmp, "optimizer.safetensors"))
    hook("optimizer")
    if rank0:
        rng = {f"generator.{k}": g.get_state() for k, g in generators.items()}
        rng["torch.cpu"] = torch.get_rng_state()
        if torch.cuda.is_available():
            for i, s in enumerate(torch.cuda.get_rng_state_all()):
                rng[f"torch.cuda.{i}"] = s
        save_file(rng, os.path.join(tmp, "rng.safetensors"))
        full_state = {**state, "step": step, "python_rng": python_rng_state(), "numpy_rng": numpy_rng_state(),
                      "manifest": MANIFEST}  # this step has one: a resume refuses it without
        with open(os.path.join(tmp, STATE_FILE), "w") as f:
            json.dump(full_state, f)
    hook("state")
    if sharded:
        _fsync_tree(os.path.join(tmp, SHARDED_DIR))  # each process its own shard file (and the rest: harmless)
        dist.barrier()
    if rank0:
        write_manifest(tmp)  # last: it vouches for every file above, each process's shards included
        _fsync_tree(tmp)
        old = os.path.join(root, f".tmp-old-{name}")  # cleaned by clean_partial_saves if a kill leaves it
        if os.path.exists(final):  # the same step saved again (after a resume): set aside, not removed, so that a kill
            shutil.rmtree(old, ignore_errors=True)  # leaves `latest` naming a missing step (resume_checkpoint then
            os.rename(final, old)  # takes the newest intact one) for the time of a rename, not of a whole rmtree
        os.rename(tmp, final)
        _fsync_dir(root)
        shutil.rmtree(old, ignore_errors=True)
        hook("renamed")
        latest_tmp = os.path.join(root, LATEST + ".tmp")
        with open(latest_tmp, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(latest_tmp, os.path.join(root, LATEST))
        _fsync_dir(root)
        _prune(root, keep, name)
    if sharded:
        dist.barrier()
    return final


def _roles(policy, policy_opt, critic, critic_opt) -> dict:
    """role -> (model, optimizer) of the trainable models: the policy, and the critic when there is one."""
    roles = {"policy": (policy, policy_opt)}
    if critic is not None:
        roles["critic"] = (critic, critic_opt)
    return roles


def export_state(model) -> dict:
    """What the Hugging Face layout gets: the full tensors (gathered to rank 0 from FSDP shards), LoRA
    adapters merged into their base weights."""
    full = dist.full_state_dict(model)  # {} on ranks other than 0 when sharded
    return lora.merged_state_dict(model, state=full) if lora.has_lora(model) and full else full


# ---------------------------------------------------------------------------- LoRA: the trainable part
TRAINABLE_FILE = "trainable.safetensors"


def trainable_tensors(model, prefix) -> dict:
    return {f"{prefix}.{n}": p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def load_trainable_tensors(model, tensors: dict, prefix, path):
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    missing = [n for n in params if f"{prefix}.{n}" not in tensors]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {prefix} tensors {missing[:3]} (another lora_rank?)")
    with torch.no_grad():
        for n, p in params.items():
            if tensors[f"{prefix}.{n}"].shape != p.shape:
                raise CheckpointError(f"checkpoint {path}: {prefix}.{n} has shape {tuple(tensors[f'{prefix}.{n}'].shape)}, "
                                      f"the model's is {tuple(p.shape)} (another lora_rank?)")
            p.copy_(tensors[f"{prefix}.{n}"])


# ---------------------------------------------------------------------------- sharded state (FSDP)
SHARDED_DIR = "sharded"


def _sharded_tensors(roles: dict) -> dict:
    """{role: (sharded model, its AdamW)} -> flat {name: DTensor or tensor}: '{role}.{param fqn}' and
    '{role}_optimizer.{param fqn}.{exp_avg|exp_avg_sq|step}'."""
    out = {}
    for role, (model, opt) in roles.items():
        fqn = {p: n for n, p in model.named_parameters()}
        out.update({f"{role}.{n}": p.detach() for n, p in model.named_parameters()})
        for param, st in opt.state.items():
            for key, value in st.items():
                out[f"{role}_optimizer.{fqn[param]}.{key}"] = value
    return out


def save_sharded(path, roles: dict):
    """Every process writes its shards of the models' parameters and optimizer moments to one safetensors
    file of `path` (torch.distributed.checkpoint's Hugging Face storage: no pickle, offsets in the
    file's metadata). Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    dcp.save(_sharded_tensors(roles), storage_writer=HuggingFaceStorageWriter(path, save_distributed=True),
             process_group=dist.role_group())  # the trainers (beside rollout workers), else every process


def load_sharded(path, roles: dict):
    """Read the shards this process owns back into the models and their optimizers (any world size can
    read what any other wrote: each tensor's chunks carry their offsets). Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(path)
    saved = reader.read_metadata().state_dict_metadata
    template = {}
    for role, (model, opt) in roles.items():
        params = dict(model.named_parameters())
        for name in saved:
            owner, _, rest = name.partition(".")
            if owner == role:
                template[name] = params[rest].detach()  # loaded in place into the parameter's shard
            elif owner == f"{role}_optimizer":
                fqn, key = rest.rsplit(".", 1)
                template[name] = torch.zeros((), dtype=torch.float32) if key == "step" else torch.zeros_like(params[fqn])
    missing = [f"{role}.{n}" for role, (model, _) in roles.items() for n, _ in model.named_parameters()
               if f"{role}.{n}" not in saved]
    if missing:
        raise CheckpointError(f"sharded checkpoint {path} lacks {sorted(missing)[:3]}")
    dcp.load(template, storage_reader=HuggingFaceStorageReader(path), process_group=dist.role_group())
    for role, (model, opt) in roles.items():
        params = dict(model.named_parameters())
        state = {}
        for name, value in template.items():
            if name.startswith(f"{role}_optimizer."):
                fqn, key = name[len(role) + len("_optimizer."):].rsplit(".", 1)
                state.setdefault(fqn, {})[key] = value
        for fqn, st in state.items():
            opt.state[params[fqn]] = st


STEP_NAME = re.compile(r"step-([1-9][0-9]*)")  # what save_checkpoint names a step: no leading zero, no suffix


def saved_steps(root) -> list:
    """The step numbers of the `step-N` directories in checkpoints directory `root`, newest first. Names this module
    does not make (`step-best`, `step-07`, a file called step-3) are not steps: never pruned, resumed or counted."""
    if not os.path.isdir(root):
        return []
    steps = [int(m.group(1)) for d in os.listdir(root)
             if (m := STEP_NAME.fullmatch(d)) and os.path.isdir(os.path.join(root, d))]
    return sorted(steps, reverse=True)


def _prune(root, keep, current):
    for s in saved_steps(root)[keep:]:
        if f"step-{s}" != current:
            shutil.rmtree(os.path.join(root, f"step-{s}"), ignore_errors=True)


def latest_checkpoint(run_path):
    """The path `latest` points to, or None when the run has no complete checkpoint (read as it is: a resume
    goes through resume_checkpoint, which checks it)."""
    root = os.path.join(run_path, "checkpoints")
    pointer = os.path.join(root, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        name = f.read().strip()
    path = os.path.join(root, name)
    if not os.path.isfile(os.path.join(path, STATE_FILE)):
        raise CheckpointError(f"{pointer} names {name}, which is not a complete checkpoint")
    return path


def checkpoint_step(path) -> int:
    return read_state(path)["step"]


# ---------------------------------------------------------------------------- trusting what is on disk
def file_sha256(path, chunk_bytes=4 << 20) -> str:
    """SHA-256 of a file read in 4 MiB chunks into one buffer: memory stays flat whatever the file's size."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(max(1, min(chunk_bytes, os.fstat(f.fileno()).st_size)))  # a small file, a small buffer
        view = memoryview(buf)
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def _step_files(step_dir) -> list:
    """Every file of a step directory but the manifest, as '/'-separated paths relative to it, sorted."""
    out = []
    for root, _, files in os.walk(step_dir):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), step_dir).replace(os.sep, "/")
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def directory_manifest(step_dir) -> dict:
    """{"format": 1, "files": {relative path: {"bytes": size, "sha256": hex digest}}} of every file but the manifest."""
    files = {rel: {"bytes": os.path.getsize(os.path.join(step_dir, rel)),
                   "sha256": file_sha256(os.path.join(step_dir, rel))} for rel in _step_files(step_dir)}
    return {"format": 1, "files": files}


def write_manifest(step_dir):
    """manifest.json: directory_manifest(step_dir), which vouches for every other file."""
    with open(os.path.join(step_dir, MANIFEST), "w") as f:
        json.dump(directory_manifest(step_dir), f, indent=1)


def manifest_sha256(checkpoint_dir) -> str:
    """The SHA-256 of the manifest of a checkpoint directory's files as they are now (directory_manifest, written as
    write_manifest writes it): the SHA-256 of an intact ppo-train step's manifest.json, and for any other directory
    (one transformers saved, a shipped demo) the same hash over its files. One hex string names the weights, the
    tokenizer and the config an evaluation read (ppo-eval's eval.json)."""
    return hashlib.sha256(json.dumps(directory_manifest(checkpoint_dir), indent=1).encode()).hexdigest()


def verify_step(step_dir) -> bool:
    """Whether every file of a step is what its save wrote: True when it matches its manifest, False when it was
    saved before checkpoints carried one (unverified). CheckpointMismatch (one line naming the file) when a file
    differs in size or SHA-256, is missing or is not listed, or when the manifest is missing or malformed;
    CheckpointError when there is no manifest and trainer_state.json is malformed (read_state)."""
    manifest_path = os.path.join(step_dir, MANIFEST)
    if not os.path.isfile(manifest_path):
        if read_state(step_dir).get("manifest") is None:
            return False  # saved by an older version: nothing to check against
        raise CheckpointMismatch(f"{manifest_path} is missing (its {STATE_FILE} says the save wrote one)")
    try:
        with open(manifest_path) as f:
            listed = json.load(f)["files"]
        # the sizes first: a truncated file is caught before anything is hashed
        expected = {rel: (int(entry["bytes"]), str(entry["sha256"])) for rel, entry in listed.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointMismatch(f"{manifest_path} is malformed ({type(e).__name__}: {e})") from None
    on_disk = _step_files(step_dir)
    unlisted = sorted(set(on_disk) - set(expected))
    if unlisted:
        raise CheckpointMismatch(f"{os.path.join(step_dir, unlisted[0])} is not listed in {MANIFEST}: not written by "
                                 f"the save")
    for rel, (size, _) in expected.items():
        path = os.path.join(step_dir, rel)
        if rel not in on_disk:  # also a listed path that climbs out of the step ('../x'): never read
            raise CheckpointMismatch(f"{path} is missing (listed in {MANIFEST})")
        if os.path.getsize(path) != size:
            raise CheckpointMismatch(f"{path} has {os.path.getsize(path)} bytes, {MANIFEST} says {size}")
    for rel, (_, sha) in expected.items():
        if file_sha256(os.path.join(step_dir, rel)) != sha:
            raise CheckpointMismatch(f"{os.path.join(step_dir, rel)} does not match its SHA-256 in {MANIFEST}")
    return True


def _pointer(root):
    """What checkpoints/latest says (a step name, stripped), or None when there is no such file."""
    pointer = os.path.join(root, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer, "rb") as f:
        return f.read(100).decode("utf-8", "replace").strip()


def resume_checkpoint(run_path):
    """The checkpoint a resume loads: the step `latest` names if its files match its manifest, else the newest older
    step that does. With `latest` missing, or naming a step that is not there (a kill while a step was re-saved), the
    newest intact step of them all, with a line saying so. -> (path or None, notes): notes are the lines the run prints
    first (a step skipped and why, a step used unverified, `latest` lost). None only when there is neither `latest` nor
    any step. CheckpointError when steps exist and none is intact, naming each step's first bad file."""
    root = os.path.join(run_path, "checkpoints")
    steps, named = saved_steps(root), _pointer(root)
    if named is None and not steps:
        return None, []
    pointer, lost = os.path.join(root, LATEST), None
    match = STEP_NAME.fullmatch(named or "")
    if match and int(match.group(1)) in steps:
        candidates = [s for s in steps if s <= int(match.group(1))]  # newer ones: saved, `latest` not yet moved
    else:
        candidates = steps
        lost = f"{pointer} is missing" if named is None else f"{pointer} names {named!r}, which is not a step in {root}"
    notes, refused = [], []
    for path in [os.path.join(root, f"step-{s}") for s in candidates]:
        try:
            verified = verify_step(path)
        except CheckpointMismatch as e:
            refused.append(str(e))
            continue
        if lost:
            notes.append(f"warning: {lost}: resuming from {path}, the newest intact step")
        if refused:
            notes += [f"warning: checkpoint refused: {why}" for why in refused]
            notes.append(f"warning: resuming from {path}, the newest intact checkpoint (the newer ones failed "
                         f"verification; they stay on disk until the run saves those steps again)")
        if not verified:
            notes.append(f"warning: {path} has no {MANIFEST} (saved before checkpoints carried one): its files "
                         f"are used unverified")
        read_state(path)  # the schema: a step whose state file is malformed is an error, not a fallback
        return path, notes
    if not refused:
        raise CheckpointError(f"{lost} and no step-N directory is left to resume from; the run cannot continue: "
                              f"choose another --out to start again")
    raise CheckpointError(f"no intact checkpoint in {root}: " + "; ".join(refused))


# The form of trainer_state.json's own keys, those save_checkpoint writes: a key -> a type (int means int, not bool),
# a tuple of types, a nested schema (dict) or [type] for a list of them; a key ending in '?' may be absent (older
# versions lack it). The caller's `state` keys are the caller's to check (check_state; ppo_core.run.checkpoints.TRAINER_STATE).
NUMBER = (int, float)
STATE_SCHEMA = {
    "step": int, "manifest?": str,
    "python_rng": {"version": int, "internal": [int], "gauss": (float, type(None))},
    "numpy_rng": {"name": str, "keys": [int], "pos": int, "has_gauss": int, "cached": NUMBER},
}


def _schema_error(value, schema, where):
    """Where `value` first departs from `schema`, as 'KEY: expected ..., found ...', or None."""
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return f"{where or 'the file'}: expected an object, found {type(value).__name__}"
        for key, sub in schema.items():
            name = key.rstrip("?")
            if name not in value:
                if key.endswith("?"):
                    continue
                return f"{where + '.' if where else ''}{name}: missing"
            error = _schema_error(value[name], sub, f"{where + '.' if where else ''}{name}")
            if error:
                return error
        return None
    if isinstance(schema, list):
        if not isinstance(value, list):
            return f"{where}: expected a list, found {type(value).__name__}"
        return next((e for i, v in enumerate(value) if (e := _schema_error(v, schema[0], f"{where}[{i}]"))), None)
    types = schema if isinstance(schema, tuple) else (schema,)
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        return f"{where}: expected {' or '.join(t.__name__ for t in types)}, found {json.dumps(value)[:40]}"
    return None


def read_state(path) -> dict:
    """trainer_state.json of checkpoint `path`, checked against STATE_SCHEMA. CheckpointError naming the file
    and the key when it is not JSON, is truncated, lacks a key or holds a value of the wrong type."""
    state_path = os.path.join(path, STATE_FILE)
    try:
        with open(state_path) as f:
            state = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: not JSON, truncated, not UTF-8
        raise CheckpointError(f"{state_path}: cannot read ({e})") from None
    check_state(state, STATE_SCHEMA, path)
    return state


def check_state(state: dict, schema: dict, path):
    """CheckpointError naming checkpoint `path`'s trainer_state.json and the key where `state` departs from `schema`
    (STATE_SCHEMA's form)."""
    error = _schema_error(state, schema, "")
    if error:
        raise CheckpointError(f"{os.path.join(path, STATE_FILE)}: {error}")


def clean_partial_saves(run_path):
    """Remove half-written `.tmp-*` directories a killed save left behind."""
    root = os.path.join(run_path, "checkpoints")
    if os.path.isdir(root):
        for d in os.listdir(root):
            if d.startswith(".tmp-"):
                shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def _load_into(model, path):
    """Copy a saved model's tensors into `model` in place (ties and devices kept), checking names."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state = {}
    for name in files:
        state.update(read_safetensors(os.path.join(path, name)))
    to_module = {hf: ours for ours, hf in getattr(model, "hf_names", {}).items()}  # e.g. score.weight -> score_head.weight
    state = {to_module.get(k, k): v for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if model.args.tie_word_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path} does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")


def load_training_state(path, *, policy, critic, policy_opt, critic_opt, generators: dict, sharded=False) -> dict:
    """Restore weights, optimizer moments and every RNG from a checkpoint; returns the trainer state.
    sharded: FSDP models, restored from the checkpoint's sharded/ copy (collective). A checkpoint with a
    sharded/ copy is read from it in any case, so an FSDP run resumes on any number of processes.
    Every file is checked before it is used (read_state, check_optimizer_tensors, check_rng_tensors):
    CheckpointError naming the file and the key."""
    # A sharded checkpoint also resumes on another number of processes (each tensor's chunks carry their
    # offsets), a single process included, where the models are plain and read their whole tensors.
    check_links(path)  # a step's files are its own, as any checkpoint's (ppo_core.models.model.check_links)
    from_shards = sharded or os.path.isdir(os.path.join(path, SHARDED_DIR))
    state = read_state(path)
    roles = _roles(policy, policy_opt, critic, critic_opt)
    try:
        if from_shards:
            load_sharded(os.path.join(path, SHARDED_DIR), roles)
        else:
            if lora.has_lora(policy):  # the base is the run's starting checkpoint, already loaded
                trainable = read_safetensors(os.path.join(path, TRAINABLE_FILE))
                for role, (model, _) in roles.items():
                    load_trainable_tensors(model, trainable, role, path)
            else:
                _load_into(policy, path)
                if critic is not None:
                    _load_into(critic, os.path.join(path, "critic"))
            opt_tensors = read_safetensors(os.path.join(path, "optimizer.safetensors"))
            check_optimizer_tensors(opt_tensors, roles, os.path.join(path, "optimizer.safetensors"))
        rng = read_safetensors(os.path.join(path, "rng.safetensors"))
        check_rng_tensors(rng, generators, os.path.join(path, "rng.safetensors"))
        if not from_shards:
            for role, (_, opt) in roles.items():
                load_optimizer_tensors(opt, opt_tensors, role)
        for name, g in generators.items():
            g.set_state(rng[f"generator.{name}"])
        torch.set_rng_state(rng["torch.cpu"])
        if torch.cuda.is_available():
            torch.cuda.set_rng_state_all([rng[f"torch.cuda.{i}"] for i in range(torch.cuda.device_count()) if f"torch.cuda.{i}" in rng])
        set_python_rng_state(state["python_rng"])
        set_numpy_rng_state(state["numpy_rng"])
    except CheckpointError:
        raise
    except Exception as e:  # OSError, safetensors' own error for a truncated file, an RNG state of the wrong size
        raise CheckpointError(f"cannot load checkpoint {path}: {type(e).__name__}: {e}") from None
    return state


ADAM_STATE = ("exp_avg", "exp_avg_sq", "step")  # what torch.optim.AdamW keeps per parameter


def check_optimizer_tensors(tensors: dict, roles: dict, file):
    """optimizer.safetensors' tensors against the run's optimizers: every key '{role}.{index}.{name}' with a role the
    run has, the index of one of its optimizer's parameters and an AdamW state name; each parameter's state whole;
    the moments shaped as the parameter, the step count a scalar. CheckpointError naming the file and the key."""
    params = {role: [p for group in opt.param_groups for p in group["params"]] for role, (_, opt) in roles.items()}
    seen = {}
    for key, value in tensors.items():
        role, _, rest = key.partition(".")
        index, _, name = rest.partition(".")
        if role not in params or not index.isdigit() or int(index) >= len(params[role]) or name not in ADAM_STATE:
            raise CheckpointError(f"{file}: key {key!r} is not '<{'|'.join(params)}>.<parameter index>."
                                  f"<{'|'.join(ADAM_STATE)}>' of this run's optimizers "
                                  f"({', '.join(f'{r}: {len(p)} parameters' for r, p in params.items())})")
        want = () if name == "step" else tuple(params[role][int(index)].shape)
        if tuple(value.shape) != want or not value.is_floating_point():
            raise CheckpointError(f"{file}: {key} is {value.dtype} of shape {tuple(value.shape)}, the optimizer's "
                                  f"parameter needs floating point of shape {want}")
        seen.setdefault((role, int(index)), set()).add(name)
    for (role, index), names in seen.items():
        if len(names) != len(ADAM_STATE):
            raise CheckpointError(f"{file}: {role}.{index} lacks {sorted(set(ADAM_STATE) - names)}")


def check_rng_tensors(tensors: dict, generators: dict, file):
    """rng.safetensors holds every generator's state and the CPU RNG's, each a byte tensor."""
    for key in [f"generator.{name}" for name in generators] + ["torch.cpu"]:
        if key not in tensors:
            raise CheckpointError(f"{file}: {key}: missing")
    for key, value in tensors.items():
        if value.dtype != torch.uint8 or value.dim() != 1:
            raise CheckpointError(f"{file}: {key} is {value.dtype} of shape {tuple(value.shape)}, an RNG state is "
                                  f"a 1-D uint8 tensor")


def state_lists(obj):
    """A state holding tensors (sampled_state with lists=False, in dicts and lists) as plain JSON:
    each tensor a list."""
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, dict):
        return {k: state_lists(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [state_lists(v) for v in obj]
    return obj
