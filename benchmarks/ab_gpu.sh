#!/usr/bin/env bash
# A/B of two engine trees on one machine, alternating old/new ROUNDS times: batch-1 decode
# of the Llama-3.2-1B and 8B shapes, and the nano-vllm throughput run on Qwen3-0.6B. Only
# numbers from one such run are compared (lent machines differ by more than the change).
#
#   git archive <commit> src 'benchmarks/*.py' benchmarks/configs | tar -x -C .ab/old
#   bash benchmarks/ab_gpu.sh .ab/old .                # OLD_ROOT NEW_ROOT (src/, benchmarks/)
#
# Environment: ROUNDS (default 2), WHAT (default "decode throughput"), TINY=1 (a CPU check
# of this script), RESULTS_DIR. Results: <name>_<device>_ab_<old|new>_<round>.json.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
old=$1 new=$2
common=(--skip-peer --results-dir "${RESULTS_DIR:-benchmarks/results}")
[[ "${TINY:-0}" == 1 ]] && common+=(--tiny)
status=0
for round in $(seq 1 "${ROUNDS:-2}"); do
  for side in old new; do
    root=$old
    [[ $side == new ]] && root=$new
    for what in ${WHAT:-decode throughput}; do
      echo "== round $round, $side ($root): $what"
      case $what in
        decode) args=("$root/benchmarks/decode.py" --batches 1) ;;
        throughput) args=("$root/benchmarks/throughput.py" --models qwen3-0.6b) ;;
        *) echo "unknown benchmark $what"; exit 2 ;;
      esac
      PYTHONPATH=$root/src${PYTHONPATH:+:$PYTHONPATH} python3 "${args[@]}" "${common[@]}" --suffix "_ab_${side}_$round" \
        || status=1
    done
  done
done
exit $status
