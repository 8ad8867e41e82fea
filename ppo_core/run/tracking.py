"""Experiment tracking (TensorBoard, Weights & Biases) and the table of sampled completions.

    ppo-train --report_to=tensorboard,wandb --log_samples_every=10
    tensorboard --logdir RUN_DIR/tensorboard

    RUN_DIR/tensorboard/    TensorBoard event files: one scalar per metric, a text table of samples
    RUN_DIR/wandb/          the W&B run's local files (WANDB_MODE=offline keeps it there: `wandb sync` later)
    RUN_DIR/wandb_id.txt    the W&B run id, so `ppo-train --resume RUN_DIR` continues the same W&B run
    RUN_DIR/samples.jsonl   one JSON object per sampled completion: {"step", "prompt", "response", "reward",
                            <reward components>, <the row's extra columns>}

Scalars carry the names metrics.jsonl uses ("reward/mean", "kl/mean", ...), at the iteration number as
step. Both trackers are optional extras (`pip install -e '.[tensorboard]'`, `'.[wandb]'`), imported only
when asked for. Only rank 0 writes; every method here is a no-op on the other ranks, so the loop never
says `if rank == 0`.
"""
import json
import numbers
import os
import secrets

from ..rewards.redact import redact
from .runlog import is_rank0, truncate_jsonl

REPORT_TO = ("tensorboard", "wandb")
SAMPLES_FILE = "samples.jsonl"
WANDB_ID_FILE = "wandb_id.txt"
# config keys whose "_"-separated words include one of these are never sent to a tracker
SECRET_WORDS = ("key", "token", "secret", "password", "credentials")


class TrackingError(RuntimeError):
    """A tracker that cannot start (unknown name, package missing, W&B not logged in); one line, shown as is."""


def parse_report_to(report_to) -> list[str]:
    """'tensorboard,wandb' or ['tensorboard', 'wandb'] -> the tracker names, in order ('' or [] -> [])."""
    names = report_to.split(",") if isinstance(report_to, str) else list(report_to)
    names = [n.strip() for n in names if n.strip()]
    for name in names:
        if name not in REPORT_TO:
            raise TrackingError(f"report_to: unknown tracker {name!r} (known: {', '.join(REPORT_TO)})")
    return list(dict.fromkeys(names))  # a name given twice tracks once


def public_config(config: dict) -> dict:
    """The config without keys that name a secret (api_key, token, ...) and with the credentials in its URLs replaced
    by *** (ppo_core.rewards.redact): what trackers may store."""
    return {k: redact(v) for k, v in config.items() if not set(k.lower().split("_")) & set(SECRET_WORDS)}


def scalar_metrics(metrics: dict) -> dict[str, float]:
    """The real-number entries of a metrics dict as floats (bools, strings, tensors, None and the
    "step" key, which is the x-axis, are left out)."""
    return {k: float(v) for k, v in metrics.items()
            if k != "step" and isinstance(v, numbers.Real) and not isinstance(v, bool)}


def sample_columns(rows: list[dict]) -> list[str]:
    """Column order of a samples table: prompt, response, reward, then the other keys in first-seen order."""
    columns = ["prompt", "response", "reward"]
    for row in rows:
        columns += [k for k in row if k not in columns]
    return columns


def _cell_text(value) -> str:
    """One value as text for a table cell: floats to 6 significant digits, lists and dicts as JSON."""
    if value is None:
        return ""
    if isinstance(value, float):
        return format(value, ".6g")
    if isinstance(value, (str, int)):
        return str(value)
    return json.dumps(value, default=_json_default)


def _markdown_cell(value) -> str:
    # Escaped so a response shows as written: `<think>` is not eaten as HTML, `|` does not split the cell,
    # `*` and `_` do not turn into emphasis, and a newline stays inside its row.
    text = _cell_text(value)
    for char, escaped in (("\\", "\\\\"), ("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"), ("|", "\\|"),
                          ("*", "\\*"), ("_", "\\_"), ("`", "\\`"), ("[", "\\["), ("]", "\\]")):
        text = text.replace(char, escaped)
    return text.replace("\r\n", "\n").replace("\n", "<br>")


def samples_markdown(rows: list[dict]) -> str:
    """A markdown table of sampled completions (TensorBoard's text tab renders it), one row per sample."""
    columns = sample_columns(rows)
    lines = ["| " + " | ".join(_markdown_cell(c) for c in columns) + " |",
             "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_markdown_cell(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def _json_default(value):
    """Tensors and NumPy values as Python numbers or lists; anything else JSON cannot hold as its str()."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def _import_tensorboard():
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it; checked first for a clear message)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise TrackingError("report_to=tensorboard needs the tensorboard package: "
                            "pip install -e '.[tensorboard]'") from None
    return SummaryWriter


def _import_wandb():
    try:
        import wandb
    except ImportError:
        raise TrackingError("report_to=wandb needs the wandb package: pip install -e '.[wandb]'") from None
    return wandb


def wandb_run_id(run_dir: str, resume_step: int) -> str:
    """The W&B run id of this run directory: the saved one when resuming from a checkpoint, else a new one
    (a run restarted from scratch on the same directory is a new W&B run, as its metrics.jsonl starts over)."""
    path = os.path.join(run_dir, WANDB_ID_FILE)
    if resume_step > 0 and os.path.isfile(path):
        with open(path) as f:
            return f.read().strip()
    run_id = secrets.token_hex(4)  # 8 characters of [0-9a-f], like wandb's own ids
    with open(path + ".tmp", "w") as f:
        f.write(run_id + "\n")
    os.replace(path + ".tmp", path)
    return run_id


class Tracker:
    """Sends each iteration's metrics (and sample tables) to TensorBoard and/or W&B.

    report_to:   "tensorboard", "wandb", "tensorboard,wandb" or a list of those; "" or [] = nothing.
    run_dir:     the run directory (TensorBoard writes RUN_DIR/tensorboard, W&B RUN_DIR/wandb).
    config:      the resolved config dict, stored with the W&B run (keys naming a secret left out).
    run_name:    the W&B run's display name.
    resume_step: the last iteration a resumed run keeps (its checkpoint's step; 0 for a fresh run).
                 TensorBoard hides the events of later steps, which the resume redoes (purge_step);
                 W&B continues the run of RUN_DIR/wandb_id.txt, where redone steps appear a second time
                 (W&B cannot rewind an offline run), so its curves can hold both attempts there.

    W&B's mode (online, offline, disabled) is WANDB_MODE as wandb reads it. Every rank checks that the
    packages import (so all fail alike); only rank 0 creates writers.
    """

    def __init__(self, report_to, run_dir: str, config: dict, run_name: str, resume_step: int = 0):
        self.names = parse_report_to(report_to)
        SummaryWriter = _import_tensorboard() if "tensorboard" in self.names else None
        wandb = _import_wandb() if "wandb" in self.names else None
        self.tensorboard, self.wandb_run, self._wandb = None, None, wandb
        if not is_rank0():
            return
        if SummaryWriter is not None:
            # purge_step: events at steps >= it in earlier files are dropped on reading (0 on a fresh start
            # drops the whole of an earlier attempt on this directory)
            self.tensorboard = SummaryWriter(os.path.join(run_dir, "tensorboard"),
                                             purge_step=resume_step + 1 if resume_step > 0 else 0)
        if wandb is not None:
            try:
                self.wandb_run = wandb.init(project="ppo-core", name=run_name, config=public_config(config),
                                            dir=run_dir, id=wandb_run_id(run_dir, resume_step), resume="allow")
            except wandb.errors.Error as e:
                self.close()
                message = " ".join(str(e).split())
                raise TrackingError(f"report_to=wandb: {message} (or run W&B offline: WANDB_MODE=offline)") from None
            # x-axis of every chart: the iteration, logged as "step" like metrics.jsonl, not W&B's own
            # counter (which a resume could not go back on)
            self.wandb_run.define_metric("step")
            self.wandb_run.define_metric("*", step_metric="step")

    def log(self, metrics: dict, step: int):
        """One iteration's metrics: every real number under its metrics.jsonl name, at `step`."""
        scalars = scalar_metrics(metrics)
        if self.tensorboard is not None:
            for name, value in scalars.items():
                self.tensorboard.add_scalar(name, value, step)
            self.tensorboard.flush()
        if self.wandb_run is not None:
            self.wandb_run.log({**scalars, "step": step})

    def log_samples(self, rows: list[dict], step: int):
        """A table of sampled completions: rows of {"prompt", "response", "reward", <components>, <extra columns>}.
        TensorBoard: a markdown table under the text tag "samples"; W&B: a wandb.Table logged as "samples"."""
        if not rows:
            return
        if self.tensorboard is not None:
            self.tensorboard.add_text("samples", samples_markdown(rows), step)
            self.tensorboard.flush()
        if self.wandb_run is not None:
            columns = sample_columns(rows)

            def cell(value):  # numbers and text as they are; lists and dicts as JSON text
                return value if value is None or isinstance(value, (str, int, float)) else _cell_text(value)

            table = self._wandb.Table(columns=columns, data=[[cell(row.get(c)) for c in columns] for row in rows],
                                allow_mixed_types=True)
            self.wandb_run.log({"samples": table, "step": step})

    def close(self, exit_code: int = 0):
        """Flush and close the writers; W&B marks the run failed when exit_code != 0. (W&B's service process
        writes an offline run's log after finish() returns; it is complete when the process exits, or after
        wandb.teardown(), which waits for it.)"""
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=exit_code)
            self.wandb_run = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(exit_code=0 if exc_type is None else 1)
        return False


def sample_rows(sampled, tokenizer) -> list:
    """What samples.jsonl and the trackers' table show of each row of `sampled` (a
    ppo_core.rollout.Sampled): prompt (the raw text the
    reward saw), response, reward (the score), each reward component, the row's extra columns,
    then policy_prompt (the prompt as the policy saw it: chat-rendered, special tokens written
    out) and stop ("eos": the response ended at a stop token of the checkpoint's; "length": it ran
    into max_new_tokens)."""
    components = {k: v.tolist() for k, v in sampled.reward_metrics.items()}
    components.update(sampled.reward_texts)
    scores, ended = sampled.scores.tolist(), sampled.ended.tolist()
    policy_prompts = [tokenizer.decode(ids[mask].tolist(), skip_special_tokens=False)
                      for ids, mask in zip(sampled.prompt_ids.cpu(),
                                           sampled.prompt_mask.cpu().bool())]
    return [{"prompt": text, "response": response, "reward": scores[i],
             **{k: v[i] for k, v in components.items()},
             **{k: v for k, v in row.items() if k not in ("prompt", "messages")},
             "policy_prompt": policy_prompts[i], "stop": "eos" if ended[i] else "length"}
            for i, (row, text, response) in enumerate(zip(sampled.rows, sampled.prompts,
                                                          sampled.responses))]


def write_iteration_samples(cfg, run_dir, tracker, tokenizer, it, sampled):
    """Every cfg.log_samples_every iterations: iteration `it`'s samples to samples.jsonl and the
    trackers."""
    if cfg.log_samples_every and (it + 1) % cfg.log_samples_every == 0:
        samples = sample_rows(sampled, tokenizer)
        write_samples(run_dir.path, samples, it + 1)
        tracker.log_samples(samples, it + 1)


def write_samples(run_dir: str, rows: list[dict], step: int):
    """Append one JSON line per sample to RUN_DIR/samples.jsonl: {"step": step, **row} (rank 0 only).
    Rows hold "prompt", "response", "reward", the reward components and the prompt row's extra columns;
    a row may not have a key "step" of its own (it would hide the iteration number)."""
    if not is_rank0() or not rows:
        return
    for i, row in enumerate(rows):
        if "step" in row:
            raise TrackingError(f"samples: row {i} has a column named 'step', which samples.jsonl uses for "
                                f"the iteration; rename that column")
    with open(os.path.join(run_dir, SAMPLES_FILE), "a") as f:
        for row in rows:
            f.write(json.dumps({"step": step, **row}, default=_json_default) + "\n")


def truncate_samples(run_dir: str, step: int):
    """Keep the samples of iterations <= step: later lines belong to iterations a resume redoes
    (as runlog.RunDir.truncate_metrics does for metrics.jsonl). -> a line when a torn end was dropped, else None."""
    return truncate_jsonl(os.path.join(run_dir, SAMPLES_FILE), step)
