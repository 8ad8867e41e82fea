"""The flat config: TOML + command line, and one-line errors (exit status 2) for bad input."""
import json
import os
import subprocess
import sys

import pytest

from ppo_core.algo import POLICY_LOSS_KINDS
from ppo_core.config import FIELDS, ConfigError, PPOConfig, build_config, load_toml, parse_cli
from ppo_core.train import main

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_cli_overrides_toml_overrides_defaults(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('lr = 3e-4\nppo_epochs = 2\nkl_in_reward = false\nloss_agg = "seq-mean-token-sum"\ncritic_lr = 1\n')
    own, overrides = parse_cli(["--config", str(path), "--lr=5e-4", "--whiten_rewards", "--top-k", "7",
                           "--allow_filtered_sampling"])
    cfg = build_config(load_toml(own["config"]), overrides, own["config"])
    assert cfg.lr == 5e-4  # command line wins over the file
    assert cfg.ppo_epochs == 2 and cfg.kl_in_reward is False and cfg.loss_agg == "seq-mean-token-sum"
    assert cfg.critic_lr == 1.0 and isinstance(cfg.critic_lr, float)  # TOML int accepted for a float field
    assert cfg.whiten_rewards is True and cfg.top_k == 7
    assert cfg.gamma == PPOConfig().gamma  # untouched fields keep their defaults


def test_default_toml_lists_every_field_with_its_default():
    values = load_toml(os.path.join(ROOT, "configs", "default.toml"))
    assert set(values) == set(FIELDS)
    defaults = vars(PPOConfig())
    assert {k: values[k] for k in FIELDS} == defaults


@pytest.mark.parametrize("argv, message", [
    (["--lrr=1e-3"], "unknown config key 'lrr' (did you mean 'lr'?)"),
    (["--ppo_epoch", "3"], "unknown config key 'ppo_epoch' (did you mean 'ppo_epochs'?)"),
    (["--lr=fast"], "config key 'lr' expects float, got 'fast'"),
    (["--whiten_advantages=maybe"], "config key 'whiten_advantages' expects bool, got 'maybe'"),
    (["--clip_low=-0.1"], "config key 'clip_low' must be >= 0, got -0.1"),
    (["--clip_low=1.5"], "config key 'clip_low' must be < 1"),
    (["--minibatch_size=128"], "config key 'minibatch_size' must be <= rollout_batch_size * n_samples_per_prompt (64), got 128"),
    (["--micro_batch_size=64", "--minibatch_size=32"], "config key 'micro_batch_size' must be <= minibatch_size (32), got 64"),
    (["--micro_batch_size=6"], "config key 'minibatch_size' must be a multiple of micro_batch_size (6), got 32"),
    (["--loss_agg=mean"], "config key 'loss_agg' must be one of token-mean"),
    (["--dual_clip=0.5"], "config key 'dual_clip' must be 0 (off) or > 1, got 0.5"),
    (["--top_p=0"], "config key 'top_p' must be in (0, 1], got 0.0"),
    (["--top_p=0.9"], "config key 'top_p' filters the sampling distribution, but log-probs, ratio and KL are of the "
                      "unfiltered one; set allow_filtered_sampling=true to train so anyway, got 0.9"),
    (["--top_k=50"], "config key 'top_k' filters the sampling distribution"),
    (["--adv_estimator=ppo"], "config key 'adv_estimator' must be one of gae, grpo, dr_grpo, rloo, reinforce_pp, "
                              "reinforce_pp_baseline, got 'ppo'"),
    (["--adv_estimator=grpo"], "config key 'n_samples_per_prompt' must be > 1 for adv_estimator='grpo'"),
    (["--rollout_batch_size=10", "--n_samples_per_prompt=3", "--minibatch_size=20", "--micro_batch_size=10"],
     "config key 'rollout_batch_size' times n_samples_per_prompt (30) must be a multiple of minibatch_size (20), got 10"),
    (["--adv_estimator=rloo", "--n_samples_per_prompt=4", "--critic_warmup=2"],
     "config key 'critic_warmup' needs a critic (adv_estimator='gae'), not 'rloo', got 2"),
    (["--filter_groups"], "config key 'filter_groups' needs n_samples_per_prompt > 1, got True"),
    (["--kl_reward_kind=k4"], "config key 'kl_reward_kind' must be one of k1, k2, k3, got 'k4'"),
    (["--policy_loss_kind=grpo"], f"config key 'policy_loss_kind' must be one of {', '.join(POLICY_LOSS_KINDS)}, got 'grpo'"),
    (["--overlong_buffer=20"], "config key 'overlong_buffer' must be <= max_new_tokens (12), got 20"),
    (["--reward_fn=a.py:f,b.py:g", "--reward_weights=1"], "config key 'reward_weights' must hold one weight per "
                                                          "reward_fn (2), got [1.0]"),
    (["--reward_fn=a.py:f", "--reward_weights=nan"], "config key 'reward_weights' must be finite, got [nan]"),
    (["--reward_fn=a.py:f,b.py:g", "--reward_weights=1,x"], "config key 'reward_weights' expects a comma-separated "
                                                            "list of float, got '1,x'"),
    (["--reward_weights=2"], "config key 'reward_weights' needs reward_fn (one weight per reward function), got [2.0]"),
    (["--reward_fn=a.py:f,,b.py:g"], "config key 'reward_fn' has an empty item in 'a.py:f,,b.py:g'"),
    (["--reward_fn=a.py:f,a.py:f"], "config key 'reward_fn' names a function twice (add the weights up instead)"),
    (["--reward_fn=a.py:f,b.py"], "config key 'reward_fn' must name each function as 'module:function' (or "
                                  "'file.py:function'), not 'b.py', got ['a.py:f', 'b.py']"),
    (["positional"], "unexpected argument 'positional'"),
    (["--lr"], "option --lr needs a value"),
])
def test_bad_command_line_is_one_line_and_exit_2(argv, message, capsys, tmp_path):
    assert main(argv + [f"--out={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ppo-train: error: ")
    assert message in err
    assert not (tmp_path / "run").exists()  # nothing written for a run that never started


UNREAD = [  # (command line, the key refused, the key that makes it unread), one case for each rule
    (["--policy_loss_kind=gspo", "--dual_clip=3"], "dual_clip", "policy_loss_kind='gspo'"),
    (["--policy_loss_kind=gspo", "--loss_agg=seq-mean-token-sum"], "loss_agg", "policy_loss_kind='gspo'"),
    (["--adv_estimator=grpo", "--n_samples_per_prompt=2", "--value_clip=5"], "value_clip", "adv_estimator='grpo'"),
    (["--adv_estimator=rloo", "--n_samples_per_prompt=2", "--critic_lr=1e-5"], "critic_lr", "adv_estimator='rloo'"),
    (["--adv_estimator=reinforce_pp", "--critic=some/critic"], "critic", "adv_estimator='reinforce_pp'"),
    (["--adv_estimator=grpo", "--n_samples_per_prompt=2", "--lam=0.9"], "lam", "adv_estimator='grpo'"),
    (["--adv_estimator=dr_grpo", "--n_samples_per_prompt=2", "--whiten_advantages=false"], "whiten_advantages",
     "adv_estimator='dr_grpo'"),
    (["--kl_loss_kind=k2"], "kl_loss_kind", "kl_in_reward=True"),
    (["--kl_in_reward=false", "--kl_reward_kind=k3"], "kl_reward_kind", "kl_in_reward=False"),
    (["--kl_horizon=500"], "kl_horizon", "kl_target=0.0"),
    (["--overlong_penalty=2"], "overlong_penalty", "overlong_buffer=0"),
    (["--filter_groups_max_batches=8"], "filter_groups_max_batches", "filter_groups=False"),
    (["--enable_thinking=false"], "enable_thinking", "chat_template=False"),
    (["--shard_frozen=false"], "shard_frozen", "parallel='ddp'"),
    (["--reward_retries=5"], "reward_retries", "reward_url=[]"),
    (["--judge_max_new_tokens=64"], "judge_max_new_tokens", "judge=''"),
    (["--judge_mode=pairwise"], "judge_mode", "judge=''"),
]


@pytest.mark.parametrize("argv, key, other", UNREAD)
def test_a_setting_nothing_reads_in_its_combination_is_refused_naming_both_keys(argv, key, other, capsys, tmp_path):
    """A key that only some estimators, loss kinds or modes read, set away from its default where nothing reads it,
    would change nothing while the config says otherwise: one line naming both keys, exit 2, nothing written."""
    assert main(argv + [f"--out={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"ppo-train: error: config key '{key}' has no effect with {other} (")
    assert not (tmp_path / "run").exists()


def test_the_same_settings_are_accepted_where_they_are_read():
    """Each refused setting of UNREAD passes once the key that reads it is set (and at its default everywhere)."""
    readers = {"dual_clip": {"policy_loss_kind": "ppo"}, "loss_agg": {"entropy_coef": "0.01"},
               "value_clip": {"adv_estimator": "gae"}, "critic_lr": {"adv_estimator": "gae"},
               "critic": {"adv_estimator": "gae"}, "lam": {"adv_estimator": "gae"},
               "whiten_advantages": {"adv_estimator": "gae"}, "kl_loss_kind": {"kl_in_reward": "false"},
               "kl_reward_kind": {"kl_in_reward": "true"}, "kl_horizon": {"kl_target": "0.1"},
               "overlong_penalty": {"overlong_buffer": "4"}, "filter_groups_max_batches": {"filter_groups": "true", "n_samples_per_prompt": "2"},
               "enable_thinking": {"chat_template": "true"}, "shard_frozen": {"parallel": "fsdp"},
               "reward_retries": {"reward_url": "http://127.0.0.1:1"}, "judge_max_new_tokens": {"judge": "some/judge"},
               "judge_mode": {"reward_url": "http://127.0.0.1:1"}}
    assert sorted(readers) == sorted(key for _, key, _ in UNREAD)
    for argv, key, _ in UNREAD:
        overrides = dict(arg[2:].split("=", 1) for arg in argv)
        build_config(overrides={**overrides, **readers[key]})
    for estimator in ("grpo", "rloo", "reinforce_pp"):  # the defaults of every key are never refused
        build_config(overrides={"adv_estimator": estimator, "n_samples_per_prompt": "2", "policy_loss_kind": "gspo"})


def test_bad_toml_files(tmp_path, capsys):
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("gama = 0.9\n")
    assert main(["--config", str(unknown)]) == 2
    assert f"unknown config key 'gama' in {unknown} (did you mean 'gamma'?)" in capsys.readouterr().err

    wrong_type = tmp_path / "type.toml"
    wrong_type.write_text('iterations = "ten"\n')
    assert main(["--config", str(wrong_type)]) == 2
    assert "config key 'iterations' expects int, got str 'ten'" in capsys.readouterr().err

    broken = tmp_path / "broken.toml"
    broken.write_text("lr = = 1\n")
    assert main(["--config", str(broken)]) == 2
    assert f"config file {broken} is not valid TOML" in capsys.readouterr().err

    assert main(["--config", str(tmp_path / "absent.toml")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_list_fields_from_toml_lists_and_comma_separated_text(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('reward_fn = ["a.py:f", "pkg.mod:g"]\nreward_weights = [1, 0.5]\n')
    cfg = build_config(load_toml(path), toml_path=str(path))
    # a file made absolute (the working directory's, as the run starts), a module name left to sys.path
    assert cfg.reward_fn == [os.path.join(os.getcwd(), "a.py") + ":f", "pkg.mod:g"] and cfg.reward_weights == [1.0, 0.5]
    assert all(isinstance(w, float) for w in cfg.reward_weights)  # a TOML int is a float weight
    # the command line: comma-separated, spaces around items dropped; it overrides the file
    cfg = build_config(load_toml(path), {"reward_fn": "a.py:f, b.py:h", "reward_weights": "2,-1e-1"}, str(path))
    here = os.getcwd()
    assert cfg.reward_fn == [f"{here}/a.py:f", f"{here}/b.py:h"] and cfg.reward_weights == [2.0, -0.1]
    # a TOML string reads as the command line does (configs written before reward_fn became a list)
    assert build_config({"reward_fn": "a.py:f"}).reward_fn == [f"{here}/a.py:f"]
    assert build_config({}, {"reward_fn": ""}).reward_fn == [] and PPOConfig().reward_fn == []
    with pytest.raises(ConfigError, match="^config key 'reward_weights' expects a list of float, got float 1.0$"):
        build_config({"reward_fn": ["a.py:f"], "reward_weights": 1.0})
    with pytest.raises(ConfigError, match="^config key 'reward_fn' expects str, got int 3$"):
        build_config({"reward_fn": ["a.py:f", 3]})


def test_tilde_in_paths_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    home = str(tmp_path)
    paths = ("policy", "reference", "critic", "prompts_file", "eval_prompts_file", "out")
    cfg = build_config({"critic": "~/c"}, {**{key: f"~/{key}" for key in paths if key != "critic"},
                                            "reward_fn": "~/r.py:score,pkg.mod:f,~/x/s.py:g"})
    assert all(getattr(cfg, key) == f"{home}/{key}" for key in paths if key != "critic") and cfg.critic == f"{home}/c"
    assert cfg.reward_fn == [f"{home}/r.py:score", "pkg.mod:f", f"{home}/x/s.py:g"]
    assert build_config({}, {"reward_model": "~/rm"}).reward_model == f"{home}/rm"
    assert build_config().policy == ""


def test_help_lists_every_field_with_type_default_and_first_sentence():
    from ppo_core.config import first_sentence, help_text

    text = help_text()
    for name in FIELDS:
        assert text.count(f"  --{name} (") == 1
    assert text.startswith("models and data:\n  --policy (str, default \"\")\n      Policy checkpoint directory (HF layout).\n")
    assert "\n\nPPO update:\n  --adv_estimator (str, default \"gae\")\n" in text
    assert "  --lr (float, default 0.0005)\n      Peak AdamW learning rate of the policy.\n" in text
    assert "  --whiten_rewards (bool, default false)\n" in text and "  --eval_size (int, default 256)\n" in text
    assert "  --reward_weights (comma-separated list of float, default \"\")\n" in text
    # the sections in the class's order
    sections = [line[:-1] for line in text.splitlines() if line and not line.startswith(" ")]
    assert sections == ["models and data", "rollout", "PPO update", "reward and KL", "evaluation, logging, saving", "execution"]
    assert max(len(line) for line in text.splitlines()) <= 110
    # a full stop in parentheses (e.g. 'e.g.', 'et al.') does not end the sentence
    assert first_sentence("Adaptive (Ziegler et al.): steer\n    it. Then more.") == "Adaptive (Ziegler et al.): steer it."
    assert first_sentence("No full stop") == "No full stop"


def test_build_config_raises_config_error_naming_the_key():
    with pytest.raises(ConfigError, match="'gamma' must be in"):
        build_config({"gamma": 1.5})


def test_entry_point_subprocess_exit_status(tmp_path):
    """The real command, as a user runs it: one line on stderr, status 2, no traceback."""
    proc = subprocess.run([sys.executable, "-m", "ppo_core.train", "--kl_coeff=0.1", f"--out={tmp_path}/r"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "ppo-train: error: unknown config key 'kl_coeff' (did you mean 'kl_coef'?)"
    assert "Traceback" not in proc.stderr and not (tmp_path / "r").exists()


@pytest.mark.parametrize("name, estimator, rows", [("ppo-qwen3-0.6b.toml", "gae", 512), ("grpo-qwen3-0.6b.toml", "grpo", 512)])
def test_shipped_configs_for_real_checkpoints_are_valid(name, estimator, rows):
    from ppo_core.config import rollout_rows, uses_critic

    path = os.path.join(ROOT, "configs", name)
    cfg = build_config(load_toml(path), toml_path=path)
    assert cfg.adv_estimator == estimator and rollout_rows(cfg) == rows
    assert cfg.lr == 1e-6 and cfg.max_new_tokens == 1024 and cfg.chat_template
    assert cfg.rollout_engine == "paged" and cfg.rollout_kv_cache_gb == 30  # 512 responses on one 80 GB GPU (ppo-plan)
    assert uses_critic(cfg) == (estimator == "gae") and (not uses_critic(cfg) or cfg.critic_lr == 1e-5)


def test_every_shipped_config_builds_and_validates():
    """configs/*.toml as shipped: every key known, every value valid, nothing set that the run would not read (with
    the policy and data a user passes on the command line), and the peak learning rate reached early in the run."""
    import glob

    from ppo_core.config import refuse_unread_settings, validate

    paths = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "*.toml")))
    assert len(paths) >= 5
    for path in paths:
        cfg = build_config(load_toml(path), {"policy": "checkpoint", "prompts_file": "prompts.jsonl"}, path)
        validate(cfg)
        refuse_unread_settings(cfg)
        # the peak learning rate within the first tenth of the run's optimizer steps
        steps = cfg.iterations * cfg.ppo_epochs * cfg.rollout_batch_size * cfg.n_samples_per_prompt // cfg.minibatch_size
        assert cfg.warmup_steps <= 0.1 * steps, (path, cfg.warmup_steps, steps)


# ---------------------------------------------------------------------------- issue 47: batch sizes follow the rollout

@pytest.mark.parametrize("overrides, minibatch, micro", [
    ({}, 32, 32),  # 64 rows
    ({"rollout_batch_size": "2", "n_samples_per_prompt": "4"}, 8, 8),  # a rollout smaller than the old default
    ({"minibatch_size": "16"}, 16, 16),  # the micro-batch follows a minibatch the user set
    ({"rollout_batch_size": "48"}, 24, 24),  # 32 does not divide 48: the largest divisor below it
    ({"rollout_batch_size": "8", "n_samples_per_prompt": "16"}, 32, 32),
    ({"minibatch_size": "64", "rollout_batch_size": "128"}, 64, 32),
    ({"micro_batch_size": "4", "rollout_batch_size": "4"}, 4, 4),
    ({"micro_batch_tokens": "256"}, 32, 0),  # packed micro-batches: micro_batch_size is not read, left at 0
])
def test_batch_sizes_left_at_their_default_fit_the_rollout(overrides, minibatch, micro):
    cfg = build_config({}, overrides)
    assert (cfg.minibatch_size, cfg.micro_batch_size) == (minibatch, micro)
    assert build_config(dict(vars(cfg))) == cfg  # the resolved numbers, saved to config.json, rebuild the same run


def test_batch_sizes_the_user_set_are_still_refused_all_in_one_line(capsys, tmp_path):
    assert main(["--rollout_batch_size=2", "--n_samples_per_prompt=4", "--minibatch_size=16", "--micro_batch_size=32",
                 f"--out={tmp_path / 'run'}"]) == 2
    assert capsys.readouterr().err == (
        "ppo-train: error: 2 config problems: config key 'minibatch_size' must be <= rollout_batch_size * "
        "n_samples_per_prompt (8), got 16; config key 'micro_batch_size' must be <= minibatch_size (16), got 32\n")
    with pytest.raises(ConfigError, match=r"^config key 'minibatch_size' must be a multiple of micro_batch_size \(3\), "
                                          r"got 32$"):
        build_config({}, {"micro_batch_size": "3"})


def test_a_small_rollout_runs_and_its_config_json_holds_the_sizes_chosen(tmp_path):
    """The command of issue 47 that was refused twice for values the user never set."""
    run_dir = tmp_path / "run"
    assert main(["--rollout_batch_size=2", "--n_samples_per_prompt=4", "--iterations=1", "--eval_size=4",
                 "--progress=false", f"--out={run_dir}"]) == 0
    saved = json.loads((run_dir / "config.json").read_text())["config"]
    assert (saved["minibatch_size"], saved["micro_batch_size"]) == (8, 8)
