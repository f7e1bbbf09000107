#!/usr/bin/env bash
# The GPU checks, prepared for a short lease: two calls on one warm machine, each writing under $OUT.
#
#   bench/run_device.sh 1   # make test-gpu's tests, then bench_device.py's main rows (eager, compiled, checkpointed)
#   bench/run_device.sh 2   # ZeRO-Offload's headline rows (5.93B); MORE_S=120: then the remaining qwZ rows
#   bench/run_device.sh 3   # torch.profiler tables of the eager and compiled rows of FSDP2 and zeropp
#   bench/run_device.sh 4   # after a change: the main eager and compiled rows, then the offload rows (1b model)
#   bench/run_device.sh 5   # all of a change in one call (about 560 s): the GPU tests, the main eager and compiled
#                           # rows, then ZeRO-Offload's 5.93B rows of zeropp and DeepSpeed side by side
#
# A cap of 0 (MORE_S=0) skips that step.
# Runs with the machine's own python3 and packages (zeropp from src/ on PYTHONPATH, no install); DeepSpeed and
# its pure-Python needs travel as wheels in .whl/ (docs/benchmarks.md says how they were made). Every step has
# a time cap, so the call ends inside its limit with whatever finished written to $OUT.
set -u
OUT=${OUT:-bench/results/device_run}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/bench
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, '| transformers', transformers.__version__, '| triton', triton.__version__)"
# the micro-batch is fixed beforehand (zeropp plan: 8 x 2048 needs ~97 GiB on a 1.2B model): 8 where the card
# has over 100 GB (H200), else 4 (H100)
MB=$(python3 -c "import torch; print(8 if torch.cuda.get_device_properties(0).total_memory > 100e9 else 4)")
case "${1:-}" in
1)
  timeout -k 5 "${TESTS_S:-130}" python3 -m pytest -q -p no:cacheprovider --timeout 100 tests/gpu 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -30
  timeout -k 5 "${ROWS_S:-300}" python3 bench/bench_device.py --micro-batch "$MB" --row-timeout 90 \
    --rows plain,fsdp2,zeropp_s3,zeropp_qwz,deepspeed,fsdp2_compile,zeropp_s3_compile,plain_ckpt,zeropp_s3_ckpt \
    --out "$OUT/device.json" 2>&1 | tee "$OUT/device.log" | grep -v "^wrote"
  ;;
2)
  # 5.93B: ~30 s to build, DeepSpeed's CPU Adam ~70 s to compile (once per call), each host step several
  # seconds: one warm-up and three timed steps, and every row's progress on stderr
  timeout -k 5 "${OFFLOAD_S:-500}" python3 bench/bench_device.py --offload --warmup 1 --steps 3 \
    --row-timeout "${OFFLOAD_ROW_S:-240}" --out "$OUT/device_offload.json" 2>&1 | tee "$OUT/device_offload.log" \
    | grep -v "^wrote"
  [ "${MORE_S:-0}" = 0 ] || timeout -k 5 "${MORE_S:-0}" python3 bench/bench_device.py --micro-batch "$MB" --row-timeout 60 \
    --rows plain,zeropp_qwz_compile,zeropp_qwz_ckpt,zeropp_s3_compile_ckpt,zeropp_qwz_compile_ckpt \
    --out "$OUT/device_more.json" 2>&1 | tee "$OUT/device_more.log" | grep -v "^wrote"
  ;;
3)
  timeout -k 5 "${PROFILE_S:-200}" python3 bench/bench_device.py --micro-batch "$MB" --row-timeout 60 --profile \
    --rows fsdp2,zeropp_s3,fsdp2_compile,zeropp_s3_compile --out "$OUT/device_profile.json" 2>&1 \
    | tee "$OUT/device_profile.log" | grep -v "^wrote"
  ;;
4)
  timeout -k 5 "${ROWS_S:-170}" python3 bench/bench_device.py --micro-batch "$MB" --row-timeout 60 \
    --rows plain,fsdp2,zeropp_s3,fsdp2_compile,zeropp_s3_compile --out "$OUT/device.json" 2>&1 \
    | tee "$OUT/device.log" | grep -v "^wrote"
  timeout -k 5 "${OFFLOAD_S:-190}" python3 bench/bench_device.py --offload --model "${OFFLOAD_MODEL:-1b}" \
    --micro-batch "$MB" --row-timeout "${OFFLOAD_ROW_S:-110}" --out "$OUT/device_offload.json" 2>&1 \
    | tee "$OUT/device_offload.log" | grep -v "^wrote"
  ;;
5)
  timeout -k 5 "${TESTS_S:-120}" python3 -m pytest -q -p no:cacheprovider --timeout 100 tests/gpu 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -5
  timeout -k 5 "${ROWS_S:-170}" python3 bench/bench_device.py --micro-batch "$MB" --row-timeout 60 \
    --rows plain,fsdp2,zeropp_s3,fsdp2_compile,zeropp_s3_compile --out "$OUT/device.json" 2>&1 \
    | tee "$OUT/device.log" | grep -v "^wrote"
  # OFFLOAD_ROWS=zeropp_offload,zeropp_offload_dpu,deepspeed_offload adds the delayed update (~90 s more: lower
  # TESTS_S or ROWS_S to stay within a call)
  timeout -k 5 "${OFFLOAD_S:-260}" python3 bench/bench_device.py --offload --warmup 1 --steps 3 --row-timeout 160 \
    --rows "${OFFLOAD_ROWS:-zeropp_offload,deepspeed_offload}" --out "$OUT/device_offload.json" 2>&1 \
    | tee "$OUT/device_offload.log" | grep -v "^wrote"
  ;;
*)
  echo "usage: bench/run_device.sh 1|2|3|4|5" >&2; exit 2 ;;
esac
