#!/usr/bin/env bash
# trainer.slime.launch for a real slime cluster: `trainer.slime.launch: [bash, deploy/slime/launch.sh]`.
# Reef appends the job directory, which must be on storage the Ray cluster shares (trainer.slime.jobs_dir).
# Needs: RAY_ADDRESS (the cluster's dashboard, e.g. http://head:8265), SLIME_DIR (a slime checkout in the
# slimerl/slime image), MODEL_ARGS_SCRIPT (slime's scripts/models/<model>.sh, which defines the MODEL_ARGS array of
# Megatron architecture flags), and reef-core installed on every node (`pip install reef-core`, no extras): slime's
# processes import reef_slime_hooks (the custom-loss families and their advantage loader; torch only), and this
# script runs reef_core.grow.slime.finish.
set -euo pipefail
JOB="$1"
: "${RAY_ADDRESS:?}" "${SLIME_DIR:?}" "${MODEL_ARGS_SCRIPT:?}"
source "$MODEL_ARGS_SCRIPT"
# Reef's arguments for this job (checked against slime's argument list, reef_core/config/slime_args.py): the
# batch, the model (--load and --hf-checkpoint: the input HF directory), the save (--save-interval 1, --save inside
# the job, --save-hf), the loss family's hooks, trainer.slime.flags.
mapfile -t REEF_ARGS < <(python3 -c 'import json, sys; print("\n".join(json.load(open(sys.argv[1]))["slime_args"]))' \
  "$JOB/job.json")
ray job submit --address "$RAY_ADDRESS" --working-dir "$SLIME_DIR" -- \
  python3 train.py "${MODEL_ARGS[@]}" "${REEF_ARGS[@]}"
# Only a successful train.py gets here: the checkpoint's manifest, then the marker moves to CHECKPOINT.
python3 -m reef_core.grow.slime.finish "$JOB"
