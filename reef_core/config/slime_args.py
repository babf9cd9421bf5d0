"""slime's command line as its source defines it: the data Reef's flags are checked against, at config load
(:mod:`.slime`) and in every job's arguments (:mod:`reef_core.grow.slime.flags`).

Read from THUDM/slime at commit ``624b824a898ab0ec1fcb4d373004c7f3852bf515`` (2026-08-21, "[NFC] Add observability
subfolder (#2298)"), and from the Megatron-LM commit that slime's ``docker/Dockerfile`` pins there
(``1dcf0dafa884ad52ffb243625717a3471643e087``).
Files read:

* ``slime/utils/arguments.py``: every ``add_argument`` / ``reset_arg`` flag of ``add_slime_arguments`` and
  ``_pre_parse_mode`` (:data:`SLIME_FLAGS`); ``slime_validate_args`` (how ``--load`` falls back to ``--ref-load``,
  ``--save`` required by ``--save-interval``, ``--num-rollout`` or ``--num-epoch``).
* ``slime/backends/megatron_utils/arguments.py``: ``megatron_parse_args`` calls Megatron's ``parse_args`` with
  ``ignore_unknown_args=True``, so slime drops a flag it does not know WITHOUT an error: Reef has to refuse unknown
  and removed flags itself.
* ``slime/backends/megatron_utils/model.py`` (``setup_model_and_optimizer``: ``assert args.load is not None or
  args.pretrained_checkpoint is not None``) and ``checkpoint.py`` (``load_checkpoint``: ``args.load`` must be a
  non-empty directory; an HF directory is read by ``hf_to_megatron.load_hf_weights``).
* ``slime/backends/megatron_utils/hf_to_megatron/__init__.py``: the HF ``model_type`` values slime can load an HF
  directory of (:data:`HF_MODEL_TYPES`); ``slime_validate_args`` treats ``--load`` as HF only for these.
* ``train.py``: ``actor_model.save_model`` runs only when ``should_run_periodic_action(rollout_id,
  args.save_interval, ...)`` (``slime/utils/misc.py``: never when ``--save-interval`` is unset), and
  ``actor.py``'s ``save_model`` writes ``--save-hf`` (``save_hf.format(rollout_id=...)``) after the Megatron save.
* Megatron-LM ``megatron/training/arguments.py`` at :data:`MEGATRON_COMMIT` (its parser built, flags listed): the
  Megatron flags Reef's jobs set or let a deployment pass (:data:`MEGATRON_FLAGS`), each present there.

Not covered: ``--sglang-*`` flags (a separate parser slime skips for ``--debug-train-only`` jobs) and the model
architecture flags of ``scripts/models/<model>.sh`` (``deploy/slime/launch.sh`` adds those, not Reef).

To check against a newer slime: list the flags of its ``slime/utils/arguments.py`` the same way, diff them with
:data:`SLIME_FLAGS`, move what disappeared into :data:`REMOVED`, and update the commits above.
"""

from __future__ import annotations

SLIME_REPO = "https://github.com/THUDM/slime"
SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
#: ``ARG MEGATRON_COMMIT`` of slime's ``docker/Dockerfile`` at :data:`SLIME_COMMIT`.
MEGATRON_COMMIT = "1dcf0dafa884ad52ffb243625717a3471643e087"
SOURCES = (
    "slime/utils/arguments.py",
    "slime/backends/megatron_utils/arguments.py",
    "slime/backends/megatron_utils/model.py",
    "slime/backends/megatron_utils/checkpoint.py",
    "slime/backends/megatron_utils/hf_to_megatron/__init__.py",
    "slime/backends/megatron_utils/actor.py",
    "slime/utils/misc.py",
    "train.py",
    "docker/Dockerfile",
    "Megatron-LM: megatron/training/arguments.py",
)

#: Every flag slime's own parser adds (``slime/utils/arguments.py`` at :data:`SLIME_COMMIT`).
SLIME_FLAGS = frozenset("""
--actor-num-gpus-per-node --actor-num-nodes --advantage-estimator --allgather-cp --apply-chat-template
--apply-chat-template-kwargs --async-save --balance-by-flops --balance-data --buffer-filter-path
--calculate-per-token-loss --check-weight-update-equal --ci-disable-kl-checker --ci-load-grad-norm
--ci-save-grad-norm --ci-test --ci-train-rollout-logprob-abs-diff-threshold --clip-grad --colocate
--custom-advantage-function-path --custom-config-path --custom-convert-samples-to-train-data-path
--custom-eval-rollout-log-function-path --custom-generate-function-path --custom-loss-function-path
--custom-megatron-before-log-prob-hook-path --custom-megatron-before-train-step-hook-path
--custom-megatron-init-path --custom-model-provider-path --custom-pg-loss-reducer-function-path
--custom-reward-post-process-path --custom-rm-path --custom-rollout-log-function-path --custom-tis-function-path
--custom-update-weight-post-write-path --data-pad-size-multiplier --data-source-path --debug-rollout-only
--debug-train-only --disable-compute-advantages-and-returns --disable-grpo-std-normalization
--disable-rewards-normalization --disable-rollout-global-dataset --disable-wandb-random-suffix --distributed-backend
--distributed-timeout-minutes --dump-details --dynamic-sampling-filter-path --enable-mtp-training --entropy-coef
--eps-clip --eps-clip-c --eps-clip-high --eval-config --eval-function-path --eval-input-key --eval-interval
--eval-label-key --eval-max-context-len --eval-max-prompt-len --eval-max-response-len --eval-min-new-tokens
--eval-prompt-data --eval-reward-key --eval-temperature --eval-tool-key --eval-top-k --eval-top-p
--fetch-trajectory-retry-times --freeze-indexer --freeze-params-name-list --gamma --get-mismatch-metrics
--global-batch-size --group-rm --hf-checkpoint --http-proxy --input-key --keep-old-actor --kl-coef --kl-loss-coef
--kl-loss-type --label-key --lambd --load --load-debug-rollout-data --load-debug-rollout-data-subsample
--load-forge-rollout-data --log-correct-samples --log-multi-turn --log-passrate --log-probs-chunk-size
--log-probs-max-tokens-per-gpu --log-reward-category --loss-mask-type --loss-type --lr
--mask-offpolicy-in-partial-rollout --max-tokens-per-gpu --megatron-config-path --megatron-deepgemm-forward-layers
--megatron-deepgemm-forward-modules --megatron-deepgemm-moe-forward-layers --megatron-deepgemm-moe-forward-modules
--memory-recorder --memory-snapshot-dir --memory-snapshot-num-steps --metadata-key --micro-batch-size
--min-batch-collection-ratio --model-name --mtp-loss-scaling-factor --mtp-num-layers --multimodal-keys
--n-samples-per-eval-prompt --n-samples-per-prompt --no-save-optim --normalize-advantages --num-critic-only-steps
--num-epoch --num-gpus-per-node --num-rollout --num-steps-per-rollout --offload --offload-rollout --offload-train
--only-train-params-name-list --opd-kl-coef --opd-teacher-ckpt-step --opd-teacher-load --opd-type --opsm-delta
--over-sampling-batch-size --padded-vocab-size --partial-rollout --profile-target --prompt-data --qwen-gdn-backend
--recompute-loss-function --record-memory-history --ref-ckpt-step --ref-load --ref-update-interval --release-train
--reset-optimizer-states --reward-key --rm-type --rm-url --rollout-all-samples-process-path --rollout-batch-size
--rollout-buffer-url --rollout-data-postprocess-path --rollout-data-transport --rollout-external-engine-addrs
--rollout-function-path --rollout-health-check-first-wait --rollout-health-check-interval
--rollout-health-check-timeout --rollout-max-context-len --rollout-max-prompt-len --rollout-max-response-len
--rollout-num-gpus --rollout-num-gpus-per-engine --rollout-sample-filter-path --rollout-sample-hook-path
--rollout-seed --rollout-shuffle --rollout-skip-special-tokens --rollout-stop --rollout-stop-token-ids
--rollout-task-type --rollout-temperature --rollout-top-k --rollout-top-p --save --save-debug-rollout-data
--save-debug-train-data --save-hf --save-interval --seed --skip-eval-before-train --start-rollout-id
--tb-experiment-name --tb-project-name --tis-clip --tis-clip-low --tool-key --train-backend --train-env-vars
--update-weight-buffer-size --update-weight-delta-checksum --update-weight-delta-encoding --update-weight-disk-dir
--update-weight-disk-keep-files --update-weight-local-checkpoint-dir --update-weight-mode --update-weight-transport
--update-weights-interval --use-distributed-post --use-dynamic-batch-size --use-fault-tolerance --use-kl-loss
--use-opd --use-opsm --use-rollout-entropy --use-rollout-logprobs --use-rollout-routing-replay --use-routing-replay
--use-stateless-adam --use-tensorboard --use-tis --use-unbiased-kl --use-wandb --value-clip
--wandb-always-use-train-step --wandb-dir --wandb-group --wandb-host --wandb-key --wandb-mode --wandb-project
--wandb-run-id --wandb-team
""".split())

#: The Megatron flags Reef's jobs set or pass through, each in Megatron's parser at :data:`MEGATRON_COMMIT` (slime
#: parses Megatron's flags and its own in one parser; some, like ``--load``, are both).
MEGATRON_FLAGS = frozenset("""
--adam-beta1 --adam-beta2 --attention-backend --bf16 --calculate-per-token-loss --clip-grad --context-parallel-size
--expert-model-parallel-size --fp16 --global-batch-size --load --lr --lr-decay-style --micro-batch-size --min-lr
--no-save-optim --no-save-rng --optimizer --optimizer-cpu-offload --pipeline-model-parallel-size
--recompute-granularity --recompute-method --recompute-num-layers --save --save-interval --seed --sequence-parallel
--tensor-model-parallel-size --weight-decay
""".split())

#: What Reef may put on a job's command line.
KNOWN = SLIME_FLAGS | MEGATRON_FLAGS

#: What a train-only job needs on its command line, each entry satisfied by any one of its flags, with where
#: slime requires it.
REQUIRED: dict[tuple[str, ...], str] = {
    ("--rollout-batch-size",): "add_data_arguments: required=True",
    ("--num-rollout", "--num-epoch"): "slime_validate_args: 'please set --num-rollout or --num-epoch'",
    ("--load", "--ref-load"): "setup_model_and_optimizer asserts args.load (slime_validate_args sets it from "
                              "--ref-load when --load is neither a Megatron checkpoint nor a loadable HF directory)",
    ("--hf-checkpoint",): "the tokenizer, the HF config, and the assets --save-hf copies",
    ("--save-interval",): "train.py calls save_model, which writes --save-hf, only when --save-interval is set",
    ("--save",): "slime_validate_args: '--save' is required when save_interval is set",
    ("--save-hf",): "actor.save_model writes the HF checkpoint only to --save-hf",
}

#: Flags slime no longer has, with the commit that removed them. slime ignores unknown flags, so passing one of
#: these is silently without effect.
REMOVED: dict[str, str] = {
    "--megatron-to-hf-mode": "removed by slime f655e13d9 'Internalize mbridge and remove megatron-bridge (#2251)'; "
                             "--save-hf always uses slime's own converter now",
}

#: HF ``config.json`` ``model_type`` values slime's ``hf_to_megatron`` loads (``_LOADERS``): ``--load`` may name an
#: HF directory of one of these.
HF_MODEL_TYPES = frozenset("""
deepseek_v3 deepseek_v32 glm4 glm4_moe glm4_moe_lite glm_moe_dsa kimi_k2 llama mimo minimax_m2 qwen2 qwen2_moe
qwen3 qwen3_5 qwen3_5_moe qwen3_moe qwen3_next
""".split())
