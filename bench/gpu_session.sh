#!/usr/bin/env bash
# One device call of a GPU session: the runbook's parts in order, each archived into
# $OUT as soon as it ends (a .tgz a part: the device returns at most 8 files), all
# within SESSION_SECONDS (default 560, under the device's 600 s a call).
#   OUT=DIR bash bench/gpu_session.sh [PART ...]
#   (default: tests targets native graph profile train sweep adam; also bench, ab)
# Parts: a gpu_check stage (tests, targets, bench, train: bench/gpu_check.py); native
# (the targets stage again with MPGEMM_NATIVE_LAUNCH=1: the launches that repeat an
# earlier one made from C++, mpgemm.kernels.native_launch, off as shipped); profile
# (bench/profile_gpu.py, the runbook's sections); sweep (bench/sweep_optim.py, against
# $SCRATCH/old_fused_optim.py where it exists, with $SCRATCH/old_tensor_table.py where
# that does); ab (bench/ab_activation.py against
# $SCRATCH/old_activation.py, skipped without it; SCRATCH is .scratch unless set); adam
# (bench/probe_adam.py, then ncu on its Adam step and 4/4 stream, every stall reason); graph
# (bench/ab_graph.py: the graphed steps, then the eager ones, as shipped against
# variants). A
# part starts only with its minimum time left, and every part is cut at the session's
# end. GPU_CHECK_DRY_RUN=1: the same on a CPU at toy scale (the stages' dry runs, the
# scripts' --smoke, their kernels interpreted). With a warm cache carried ($WARM,
# .warm/triton-cache.tar.xz unless set: bench/warm_cache.py build), its binaries are
# installed in triton's cache before the first part, and after the last the binaries
# compiled beyond them are counted.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
out=${OUT:?OUT: the folder whose files the device returns}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT  # (what a part made is in its archive)
end=$((SECONDS + ${SESSION_SECONDS:-560}))
dry=${GPU_CHECK_DRY_RUN:-0}
scratch=${SCRATCH:-.scratch}
warm=${WARM:-.warm/triton-cache.tar.xz}
# (run8 answered the head's, the ReLU backward's and the 8192x4096x4096 products'
# sections; they stay in profile_gpu.py. The head's weight gradient again: its K split
# 8 ways now, against the 4 run8 timed. The two input gradients that now take the ReLU's
# backward, against themselves without it and the ReLU's kernel: dZ relu. GELU's and
# SiLU's backward from the stored 16-bit z, at 8 warps, against autocast's ops, and
# tanh GELU's at 4 warps, which its 172 registers leave one program an SM.)
sections="launch,phases,guide mpgemm,guide mpgemm_cuda_graph,guide autocast_fused,head dW,head dW 4 splits,head dX fp32 padded,head dX relu,matmul 8192x4096x4096 A.T,matmul 8192x4096x4096 A.T relu,dZ relu,dZ gelu,dZ gelu torch,dZ gelu_tanh,dZ gelu_tanh torch,dZ gelu_tanh 4 warps,dZ silu"
# Seconds a part needs to be worth starting (the H200's times: tests 179, targets 42).
declare -A minimum=(
  [tests]=200 [targets]=60 [bench]=200 [train]=100 [profile]=60 [sweep]=40 [ab]=20 [adam]=60
  [graph]=55 [native]=60
)
# ncu on probe_adam.py --ncu's third Adam step and its stream: speed of light, memory,
# and the warps' stall reasons, each one (the section's table names only the largest);
# if this ncu refuses the extra options, again with run7's (sections only).
ncu_options=(--clock-control none -k "regex:_adam_kernel|_stream_kernel" -s 2 -c 2
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
  --section MemoryWorkloadAnalysis)
ncu_extra=(--print-details all
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio")
installed=0

install() {  # the stages install the package themselves; the scripts need it once
  # (a dry run, as the stages' dry runs, uses the package as it is installed)
  [ "$installed" = 1 ] || [ "$dry" = 1 ] || {
    "$python" -m pip install -q --no-build-isolation --no-deps -e . > "$work/pip.log" 2>&1 &&
      installed=1
  }
}

run() {  # run PART: its command, cut at the session's end, its output in $work/PART/
  local part=$1 left=$((end - SECONDS)) smoke=() interpret=()
  [ "$dry" = 1 ] && smoke=(--smoke) && interpret=(env TRITON_INTERPRET=1)
  mkdir -p "$work/$part"
  case $part in
    tests|targets|bench|train)
      OUT=$work/$part timeout -s INT "$left" bash bench/gpu_check.sh "$part" ;;
    native)
      OUT=$work/$part MPGEMM_NATIVE_LAUNCH=1 timeout -s INT "$left" bash bench/gpu_check.sh targets ;;
    profile)
      install && timeout -s INT "$left" "$python" bench/profile_gpu.py "$work/$part" "$sections" ;;
    sweep)
      local against=()
      [ -f "$scratch/old_fused_optim.py" ] && against=(--against="$scratch/old_fused_optim.py")
      [ -f "$scratch/old_tensor_table.py" ] && against+=(--against-table="$scratch/old_tensor_table.py")
      install && timeout -s INT "$left" "${interpret[@]}" "$python" bench/sweep_optim.py \
        "$work/$part/sweep.json" "${smoke[@]}" "${against[@]}" ;;
    ab)
      install && timeout -s INT "$left" "${interpret[@]}" "$python" bench/ab_activation.py \
        "$scratch/old_activation.py" "$work/$part/ab_activation.json" "${smoke[@]}" ;;
    adam)
      install && timeout -s INT "$left" "${interpret[@]}" "$python" bench/probe_adam.py \
        "$work/$part/probe.json" "${smoke[@]}" || return
      [ "$dry" = 1 ] || timeout -s INT $((end - SECONDS)) ncu "${ncu_options[@]}" \
        "${ncu_extra[@]}" "$python" bench/probe_adam.py --ncu > "$work/$part/ncu_adam.txt" 2>&1 ||
        timeout -s INT $((end - SECONDS)) ncu "${ncu_options[@]}" "$python" \
          bench/probe_adam.py --ncu > "$work/$part/ncu_adam_sections.txt" 2>&1 ;;
    graph)
      install && timeout -s INT "$left" "${interpret[@]}" "$python" bench/ab_graph.py \
        "$work/$part/ab_graph.json" "${smoke[@]}" ;;
  esac
}

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(tests targets native graph profile train sweep adam)
for part in "${parts[@]}"; do  # all names checked before anything runs
  if [ -z "${minimum[$part]:-}" ]; then
    echo "gpu_session: no part $part (parts: tests targets native bench train profile sweep ab adam graph)"
    exit 2
  fi
done
mkdir -p "$out"
[ -f "$warm" ] && "$python" bench/warm_cache.py install "$warm"
for part in "${parts[@]}"; do
  if [ "$part" = ab ] && [ ! -f "$scratch/old_activation.py" ]; then
    echo "gpu_session: ab skipped: no $scratch/old_activation.py"
    continue
  fi
  if [ $((end - SECONDS)) -lt "${minimum[$part]}" ]; then
    echo "gpu_session: $part skipped: $((end - SECONDS)) s left, it needs ${minimum[$part]}"
    continue
  fi
  start=$SECONDS
  run "$part" > "$work/$part.out" 2>&1
  status=$?
  tar czf "$out/$part.tgz" -C "$work" "$part" "$part.out"
  echo "gpu_session: $part rc=$status in $((SECONDS - start)) s, at $SECONDS s"
  grep -hE "passed|failed|section\(s\) failed|stage .* took" "$work/$part.out" | tail -3
  if [ -f "$work/$part/report.md" ]; then grep -A16 "^### targets" "$work/$part/report.md"; fi
done
[ -f "$warm" ] && "$python" bench/warm_cache.py misses
echo "gpu_session: done at $SECONDS s"
