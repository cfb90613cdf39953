#!/usr/bin/env bash
# Starts one process per GPU of PROGRAM (--rank r --world W --id-file F), as a job launcher would,
# all with the same STRIA_TEST_SEED; waits for every one; exits 77 (skipped) with fewer than two
# GPUs, else non-zero if any process failed. Each process is limited to LIMIT seconds (default 600),
# so a lost peer ends the test instead of hanging it.
#   usage: launch_ranks.sh PROGRAM [WORLD]      (WORLD: default every GPU, at most 8)
set -uo pipefail
program=$1
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
world=${2:-$(( gpus < 8 ? gpus : 8 ))}
if [ "${gpus:-0}" -lt 2 ] || [ "$world" -gt "$gpus" ]; then
  echo "fewer than two usable GPUs ($gpus): skipping the one-process-per-GPU test"
  exit 77
fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export STRIA_TEST_SEED=${STRIA_TEST_SEED:-$(( (RANDOM << 30) ^ (RANDOM << 15) ^ RANDOM ))}
echo "launching $world processes (STRIA_TEST_SEED=$STRIA_TEST_SEED)"
pids=()
for (( r = 0; r < world; ++r )); do
  timeout "${LIMIT:-600}" "$program" --rank "$r" --world "$world" --id-file "$dir/nccl_id" > "$dir/rank$r.log" 2>&1 &
  pids+=($!)
done
status=0
for (( r = 0; r < world; ++r )); do
  wait "${pids[$r]}"
  rc=$?
  echo "---- rank $r: exit $rc ----"
  tail -n 4 "$dir/rank$r.log"
  [ "$rc" -ne 0 ] && status=1
done
exit $status
