#!/bin/bash
# The real-checkpoint comparison of bench/results/compare-smollm2.md: seven variants of the SmolLM2-135M-Instruct
# addition recipe (configs/grpo-smollm2-135m-addition.toml) from one initialisation, paired seeds, each run's final
# checkpoint scored by ppo-eval (greedy, pass@1, pass@8, maj@8 over 8 samples) on the 256 held-out rows.
#
#   bash bench/compare_smollm2.sh [OUT] [ITERATIONS] [SEEDS]     # defaults: runs/compare-smollm2 8 "0 1 2"
#
# Needs the checkpoint and the prompts (configs/grpo-smollm2-135m-addition.toml says how); CKPT and PROMPTS name them
# (defaults: ~/.cache/ppo-core/SmolLM2-135M-Instruct, addition.jsonl). Two streams of runs side by side, one torch
# thread each (two cores): the four losses of GRPO (ppo's clip, GSPO, CISPO, SAPO), and Dr. GRPO, RLOO and PPO with a
# critic (GAE) one after the other. 64 responses an iteration for every variant (8 prompts x 8; GAE 64 x 1).
#
# The held-out rows are evaluated once, by ppo-eval after training: the prompts file is split here into its training
# rows (all but the last 256, what ppo-train trains on when it holds them out itself, in the same order) and the 256
# held-out rows, and ppo-train's own before/after evaluation is cut to 8 of them (eval_size only sizes that
# evaluation once eval_prompts_file is given). The base checkpoint's scores ("before") are one ppo-eval, the same
# for every variant. At the end, compare.py --from_runs reads every run into one report: OUT/report/compare.md.
set -euo pipefail
OUT=${1:-runs/compare-smollm2}
ITERATIONS=${2:-8}
SEEDS=${3:-0 1 2}
CKPT=${CKPT:-$HOME/.cache/ppo-core/SmolLM2-135M-Instruct}
PROMPTS=${PROMPTS:-addition.jsonl}
HERE=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

head -n -256 "$PROMPTS" > "$OUT/train.jsonl"
tail -n 256 "$PROMPTS" > "$OUT/heldout.jsonl"
# the recipe without the keys compare.py sets per variant (estimator, group size, prompts per iteration)
grep -v '^adv_estimator\|^n_samples_per_prompt\|^rollout_batch_size\|^iterations' \
    "$HERE/configs/grpo-smollm2-135m-addition.toml" > "$OUT/recipe.toml"
echo "iterations = $ITERATIONS" >> "$OUT/recipe.toml"

COMMON=(--config "$OUT/recipe.toml" "--policy=$CKPT" "--prompts_file=$OUT/train.jsonl"
        "--eval_prompts_file=$OUT/heldout.jsonl" --eval_size=8)
EVAL="--n 8 --k 1,8 --eval_size=256"
# shellcheck disable=SC2086
C=(python "$HERE/scripts/compare.py" --seeds $SEEDS --samples_per_iteration 64 --group_size 8 --jobs 1 --eval "$EVAL")

ppo-eval --config "$OUT/recipe.toml" --policy "$CKPT" --prompts_file "$OUT/train.jsonl" \
         --eval_prompts_file="$OUT/heldout.jsonl" --eval_size=256 --n 8 --k 1,8 --threads=2 --out "$OUT/base-eval.json"
( "${C[@]}" --estimators grpo --variant "" --variant "policy_loss_kind=gspo clip_low=3e-4 clip_high=4e-4" \
            --variant "policy_loss_kind=cispo clip_low=10 clip_high=0.2" --variant "policy_loss_kind=sapo" \
            --out "$OUT/losses" -- "${COMMON[@]}" ) > "$OUT/losses.log" 2>&1 &
( "${C[@]}" --estimators dr_grpo --out "$OUT/dr_grpo" -- "${COMMON[@]}" --loss_agg=seq-mean-token-sum-norm
  "${C[@]}" --estimators rloo --out "$OUT/rloo" -- "${COMMON[@]}"
  "${C[@]}" --estimators gae --out "$OUT/gae" -- "${COMMON[@]}" --critic_lr=2e-5 --value_clip=0.2 --lam=0.95
) > "$OUT/estimators.log" 2>&1 &
wait
python "$HERE/scripts/compare.py" --out "$OUT/report" --from_runs "$OUT"/losses/grpo-seed* "$OUT"/losses/grpo-policy*-seed* "$OUT"/dr_grpo/*-seed* \
       "$OUT"/rloo/*-seed* "$OUT"/gae/*-seed*
