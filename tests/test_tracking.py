"""ppo_core.run.tracking: TensorBoard and W&B get the metrics.jsonl names and values, read back from the files they
write (TensorBoard's event file through its own EventAccumulator, W&B's offline .wandb log record by record);
samples.jsonl round-trips and truncates like metrics.jsonl; a missing package is one line; rank 1 writes nothing.

The tracker packages are optional extras: their tests skip when the package is absent."""
import glob
import json
import os
import struct
import sys
import time
import zlib

import numpy as np
import pytest
import torch

from ppo_core.run import tracking
from ppo_core.run.tracking import Tracker, TrackingError, truncate_samples, write_samples

CONFIG = {"lr": 5e-4, "task": "reverse", "iterations": 3, "max_new_tokens": 12, "reward_api_key": "sk-not-for-logs"}
# three iterations of metrics as the loop builds them: "step" (the x-axis), floats, an int, and entries that are
# not real numbers and must be left out
METRICS = [
    {"step": 1, "reward/mean": 0.25, "kl/mean": 0.1, "train/steps": 4, "lr": 5e-4,
     "note": "warm-up", "flag": True, "none": None},
    {"step": 2, "reward/mean": 0.5, "kl/mean": 0.30000000000000004, "train/steps": 8, "lr": 4.5e-4,
     "note": "", "flag": False, "none": None},
    {"step": 3, "reward/mean": 0.875, "kl/mean": 1e-7, "train/steps": 12, "lr": 4e-4,
     "note": "x", "flag": True, "none": None},
]
SCALARS = ("kl/mean", "lr", "reward/mean", "train/steps")
ROWS = [
    {"prompt": "reverse: abc", "response": "cba", "reward": 1.0, "reward/exact": 1.0, "answer": "cba"},
    {"prompt": "reverse: a|b", "response": "<think>b*a</think>\nb|a", "reward": 0.25, "reward/exact": 0.0, "answer": "b|a"},
]


def test_report_to_names():
    assert tracking.parse_report_to("") == []
    assert tracking.parse_report_to([]) == []
    assert tracking.parse_report_to(" tensorboard , wandb ") == ["tensorboard", "wandb"]
    assert tracking.parse_report_to(["wandb", "tensorboard", "wandb"]) == ["wandb", "tensorboard"]
    with pytest.raises(TrackingError) as e:
        tracking.parse_report_to("tensorbord")
    assert str(e.value) == "report_to: unknown tracker 'tensorbord' (known: tensorboard, wandb)"


def test_no_tracker_writes_nothing(tmp_path):
    with Tracker("", str(tmp_path), CONFIG, "run") as tracker:
        tracker.log(METRICS[0], 1)
        tracker.log_samples(ROWS, 1)
    assert os.listdir(tmp_path) == []


def test_scalar_metrics_and_public_config():
    assert tracking.scalar_metrics({**METRICS[0], "np": np.float32(0.5), "tensor": torch.tensor(1.0)}) == {
        "reward/mean": 0.25, "kl/mean": 0.1, "train/steps": 4.0, "lr": 5e-4, "np": 0.5}
    public = tracking.public_config({**CONFIG, "hf_token": "hf_x", "password": "p", "max_new_tokens": 12})
    assert public == {"lr": 5e-4, "task": "reverse", "iterations": 3, "max_new_tokens": 12}


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_missing_package_is_one_line(tmp_path, monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ImportError, as when not installed
    with pytest.raises(TrackingError) as e:
        Tracker(f"{name}", str(tmp_path), CONFIG, "run")
    assert str(e.value) == f"report_to={name} needs the {name} package: pip install -e '.[{name}]'"
    assert os.listdir(tmp_path) == []


def test_samples_markdown():
    # TensorBoard renders markdown and strips HTML: every character that would change the text is escaped
    assert tracking.samples_markdown(ROWS + [{"prompt": "p", "response": "r", "reward": 1 / 3, "extra": [1, 2]}]) == (
        "| prompt | response | reward | reward/exact | answer | extra |\n"
        "|---|---|---|---|---|---|\n"
        "| reverse: abc | cba | 1 | 1 | cba |  |\n"
        "| reverse: a\\|b | &lt;think&gt;b\\*a&lt;/think&gt;<br>b\\|a | 0.25 | 0 | b\\|a |  |\n"
        "| p | r | 0.333333 |  |  | \\[1, 2\\] |")


# ------------------------------------------------------------------ samples.jsonl

def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_samples_jsonl_round_trip_and_truncation(tmp_path):
    run = str(tmp_path)
    truncate_samples(run, 0)  # no file yet: nothing to do
    tensor_row = {"prompt": "q", "response": "r", "reward": torch.tensor(0.5), "reward/len": np.float64(2.0),
                  "ids": np.array([3, 4])}
    for step in (1, 2, 3):
        write_samples(run, ROWS, step)
    write_samples(run, [tensor_row], 3)
    path = tmp_path / "samples.jsonl"
    expected = [{"step": step, **row} for step in (1, 2, 3) for row in ROWS]
    expected.append({"step": 3, "prompt": "q", "response": "r", "reward": 0.5, "reward/len": 2.0, "ids": [3, 4]})
    assert read_jsonl(path) == expected
    assert list(read_jsonl(path)[0]) == ["step", "prompt", "response", "reward", "reward/exact", "answer"]
    lines = path.read_text().splitlines(keepends=True)

    truncate_samples(run, 2)  # a resume from the step-2 checkpoint redoes iteration 3
    assert path.read_text() == "".join(lines[:4])
    write_samples(run, ROWS[:1], 3)
    assert read_jsonl(path) == expected[:4] + [{"step": 3, **ROWS[0]}]
    truncate_samples(run, 0)
    assert path.read_text() == ""

    with pytest.raises(TrackingError, match="row 1 has a column named 'step'"):
        write_samples(run, [ROWS[0], {**ROWS[1], "step": 7}], 4)
    assert path.read_text() == ""


# ------------------------------------------------------------------ TensorBoard

def read_tensorboard(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(run_dir, "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def f32(value):
    """TensorBoard stores a scalar as float32 (its simple_value)."""
    return float(np.float32(value))


def test_tensorboard_scalars_and_samples(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    run = str(tmp_path)
    with Tracker("tensorboard", run, CONFIG, "run") as tracker:
        for m in METRICS:
            tracker.log(m, m["step"])
        tracker.log_samples(ROWS, 3)
    assert os.listdir(tmp_path) == ["tensorboard"]

    events = read_tensorboard(run)
    assert sorted(events.Tags()["scalars"]) == sorted(SCALARS)
    for tag in SCALARS:
        assert [(e.step, e.value) for e in events.Scalars(tag)] == [(m["step"], f32(m[tag])) for m in METRICS], tag
    (text,) = events.Tensors("samples/text_summary")
    assert text.step == 3
    assert text.tensor_proto.string_val[0].decode() == tracking.samples_markdown(ROWS)


def next_second():
    """Sleep into the next second of the clock. An event file is named events.out.tfevents.<second>.<host>.<pid>.<n>
    and read in name order; a resume is a later process, so its file sorts after the first attempt's. Two writers of
    one process in one second sort by the counter n as text instead (10 before 9: the suite's 10th writer), which no
    real resume does."""
    time.sleep(1.01 - time.time() % 1)


def test_tensorboard_resume_hides_redone_steps(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    run = str(tmp_path)
    with Tracker("tensorboard", run, CONFIG, "run") as tracker:  # the first attempt reaches iteration 3
        for step in (1, 2, 3):
            tracker.log({"reward/mean": step * 1.0}, step)
    next_second()
    with Tracker("tensorboard", run, CONFIG, "run", resume_step=1) as tracker:  # resumed from the step-1 checkpoint
        for step in (2, 3, 4):
            tracker.log({"reward/mean": step * 10.0}, step)
    assert len(glob.glob(os.path.join(run, "tensorboard", "events.out.tfevents.*"))) == 2
    assert [(e.step, e.value) for e in read_tensorboard(run).Scalars("reward/mean")] == [
        (1, 1.0), (2, 20.0), (3, 30.0), (4, 40.0)]
    next_second()
    with Tracker("tensorboard", run, CONFIG, "run") as tracker:  # started over: no checkpoint kept
        tracker.log({"reward/mean": 0.5}, 1)
    assert [(e.step, e.value) for e in read_tensorboard(run).Scalars("reward/mean")] == [(1, 0.5)]


# ------------------------------------------------------------------ Weights & Biases (offline)

@pytest.fixture
def wandb_home(tmp_path, monkeypatch):
    """W&B with its settings, cache and logs under tmp_path, no API key, and its per-process setup
    (where it reads WANDB_MODE once) reset before and after."""
    wandb = pytest.importorskip("wandb", reason="the wandb extra is not installed")
    home = tmp_path / "home"
    home.mkdir()
    for var in ("WANDB_API_KEY", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_PROJECT", "WANDB_ENTITY",
                "WANDB_NAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(home / var.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.teardown()
    yield wandb
    wandb.teardown()


def wandb_logs(run_dir, run_id):
    """The offline logs of W&B run ID in RUN_DIR, oldest first: RUN_DIR/wandb/offline-run-<time>-ID/run-ID.wandb."""
    return sorted(glob.glob(os.path.join(run_dir, "wandb", f"offline-run-*-{run_id}", f"run-{run_id}.wandb")))


def read_wandb_records(path):
    """The records of an offline W&B run log, as protobufs. The file is a LevelDB-style
    log: a 7-byte header (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each with a 7-byte
    header (CRC-32 of type + data, length, type: 1 full, 2 first, 3 middle, 4 last); a block's tail shorter
    than a header is padding. Each assembled record is a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + chunk) == crc
        pending, pos = pending + chunk, pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(records):
    """The logged rows, W&B's own keys (_step, _runtime, _timestamp) left out."""
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {}
            for item in r.history.item:  # a logged object (a table) comes as one item per field: nested_key [name, field]
                *parents, key = [item.key] if item.key else item.nested_key
                node = row
                for parent in parents:
                    node = node.setdefault(parent, {})
                node[key] = json.loads(item.value_json)
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def test_wandb_offline_metrics_config_and_samples(tmp_path, monkeypatch, wandb_home):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = str(tmp_path / "run")
    os.makedirs(run)
    with Tracker("wandb", run, CONFIG, "reverse-demo") as tracker:
        for m in METRICS:
            tracker.log(m, m["step"])
        tracker.log_samples(ROWS, 3)
    wandb_home.teardown()  # finish() returns before W&B's service process has written the offline log; this waits for it
    run_id = (tmp_path / "run" / "wandb_id.txt").read_text().strip()
    (log,) = wandb_logs(run, run_id)
    records = read_wandb_records(log)

    (run_record,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run_record.run_id, run_record.project, run_record.display_name) == (run_id, "ppo-core", "reverse-demo")
    config = {u.key: json.loads(u.value_json) for u in run_record.config.update if u.key != "_wandb"}
    assert config == {k: v for k, v in CONFIG.items() if k != "reward_api_key"}  # the secret never left
    assert b"sk-not-for-logs" not in b"".join(r.SerializeToString() for r in records)

    history = wandb_history(records)
    # float64 values travel as JSON text: they come back exactly
    assert history[:3] == [{"step": m["step"], **{k: m[k] for k in SCALARS}} for m in METRICS]
    samples = history[3]
    assert samples["step"] == 3 and samples["samples"]["_type"] == "table-file"
    with open(os.path.join(os.path.dirname(log), "files", samples["samples"]["path"])) as f:
        table = json.load(f)
    assert table["columns"] == ["prompt", "response", "reward", "reward/exact", "answer"]
    assert table["data"] == [[row[c] for c in table["columns"]] for row in ROWS]
    assert len(history) == 4

    # a resume from the step-2 checkpoint continues the same W&B run; a fresh start makes a new one. W&B names an
    # offline log by the second it starts in: started in the first log's second, the resume's log could share its
    # directory (seen once in three suite runs on a loaded machine: the first log read back); start in the next second
    time.sleep(1.01 - time.time() % 1)
    with Tracker("wandb", run, CONFIG, "reverse-demo", resume_step=2) as tracker:
        tracker.log(METRICS[2], 3)
    wandb_home.teardown()
    assert (tmp_path / "run" / "wandb_id.txt").read_text().strip() == run_id
    # the newest log of run ID
    assert wandb_history(read_wandb_records(wandb_logs(run, run_id)[-1])) == [
        {"step": 3, **{k: METRICS[2][k] for k in SCALARS}}]
    fresh_id = tracking.wandb_run_id(run, 0)
    assert fresh_id != run_id and (tmp_path / "run" / "wandb_id.txt").read_text() == fresh_id + "\n"


def test_wandb_not_logged_in_is_one_line(tmp_path, monkeypatch, wandb_home):
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(TrackingError) as e:
        Tracker("wandb", str(tmp_path), CONFIG, "run")
    message = str(e.value)
    assert message.startswith("report_to=wandb: ") and message.endswith("(or run W&B offline: WANDB_MODE=offline)")
    assert "\n" not in message and "login" in message


# ------------------------------------------------------------------ only rank 0 writes

def _two_ranks(rank, tmp):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=2)
    run = os.path.join(tmp, f"rank{rank}")
    os.makedirs(run)
    with Tracker("tensorboard", run, CONFIG, "run") as tracker:
        tracker.log(METRICS[0], 1)
        tracker.log_samples(ROWS, 1)
    write_samples(run, ROWS, 1)
    truncate_samples(run, 0)
    torch.distributed.destroy_process_group()


def test_only_rank0_writes(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    # fork: the children inherit the imports (spawn would import torch again, seconds per process)
    torch.multiprocessing.start_processes(_two_ranks, args=(str(tmp_path),), nprocs=2, start_method="fork")
    assert sorted(os.listdir(tmp_path / "rank0")) == ["samples.jsonl", "tensorboard"]
    assert os.listdir(tmp_path / "rank1") == []
