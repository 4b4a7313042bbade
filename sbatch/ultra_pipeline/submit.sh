#!/bin/bash
# The ultra pipeline, submitted by hand: every stage's script in this directory, chained
# with Slurm dependencies; a stage whose upstream fails is cancelled by Slurm (--kill-on-invalid-dep).
# Rendered by `python -m hpc_rl.pipeline render ultra`; `python -m hpc_rl.launch +pipeline=ultra
# launcher=slurm` does the same and records pipeline.json for `python -m hpc_rl.pipeline status DIR`.
set -euo pipefail
umask 0077  # the stages' run directories; each stage's script sets its run.dir_mode
here=$(cd "$(dirname "$0")" && pwd)
PIPELINE_DIR=/lustre/ultra_pipeline
submit() {  # submit <stage> [job ids it waits for...]: prints the job id
    local stage=$1; shift
    local dep=()
    if [ $# -gt 0 ]; then dep=(--dependency="afterok:$(IFS=:; echo "$*")" --kill-on-invalid-dep=yes); fi
    mkdir -p "$PIPELINE_DIR/$stage"
    HPC_RL_RUN_DIR="$PIPELINE_DIR/$stage" sbatch --parsable "${dep[@]}" "$here/$stage.sbatch" | cut -d";" -f1
}
rlvr_phase1=$(submit rlvr_phase1)
echo "rlvr_phase1: job $rlvr_phase1"
rlvr_phase2=$(submit rlvr_phase2 "$rlvr_phase1")
echo "rlvr_phase2: job $rlvr_phase2"
teacher_ifbench=$(submit teacher_ifbench "$rlvr_phase2")
echo "teacher_ifbench: job $teacher_ifbench"
teacher_rlhf=$(submit teacher_rlhf "$rlvr_phase2")
echo "teacher_rlhf: job $teacher_rlhf"
teacher_reasoning=$(submit teacher_reasoning "$rlvr_phase2")
echo "teacher_reasoning: job $teacher_reasoning"
teacher_swe=$(submit teacher_swe "$rlvr_phase2")
echo "teacher_swe: job $teacher_swe"
mopd=$(submit mopd "$rlvr_phase2" "$teacher_rlhf" "$teacher_ifbench" "$teacher_reasoning" "$teacher_swe")
echo "mopd: job $mopd"
echo "pipeline directory: $PIPELINE_DIR"
