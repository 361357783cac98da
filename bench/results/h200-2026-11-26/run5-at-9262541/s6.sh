# One call: tests (confirm the ten GPU fixes), targets, a profile, a LoRA-like frozen step, BF16 train.
r=/tmp/r; mkdir -p $r
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
OUT=$r/tests timeout -s INT 250 bash bench/gpu_check.sh tests > $r/tests.out 2>&1; echo "tests rc=$? at $SECONDS s"
tar czf $OUT/tests.tgz -C $r tests tests.out
grep -E "passed|failed|FAILED|ERROR" $r/tests.out | tail -15
OUT=$r/targets timeout -s INT 200 bash bench/gpu_check.sh targets > $r/targets.out 2>&1; echo "targets rc=$? at $SECONDS s"
tar czf $OUT/targets.tgz -C $r targets targets.out
grep -E "passed|failed" $r/targets.out | tail -2
grep -A16 "### targets" $r/targets/report.md
if [ $SECONDS -lt 420 ]; then
  mkdir -p $r/prof
  timeout -s INT 90 python3 bench/profile_gpu.py $r/prof "idle,phases,guide mpgemm,launch" > $r/prof/prof.log 2>&1; echo "profile rc=$? at $SECONDS s"
  tar czf $OUT/prof.tgz -C $r prof
  grep -B2 -A14 "idle GPU" $r/prof/profile.md | head -40
fi
if [ $SECONDS -lt 470 ]; then
  mkdir -p $r/frozen
  timeout -s INT 60 python3 .scratch/frozen.py $r/frozen/frozen.json > $r/frozen/frozen.log 2>&1; echo "frozen rc=$? at $SECONDS s"
  grep -v USDT $r/frozen/frozen.log | tail -6
  tar czf $OUT/frozen.tgz -C $r frozen
fi
if [ $SECONDS -lt 500 ]; then
  mkdir -p $r/bf16
  timeout -s INT $((575-SECONDS)) python3 -m mpgemm train --data synthetic --features 784 --samples 65536 --hidden 4096,4096 --batch-size 8192 --steps 200 --mode all --dtype bfloat16 --no-progress --out $r/bf16/train_guide_bf16 > $r/bf16/train.log 2>&1; echo "bf16 rc=$? at $SECONDS s"
  tail -12 $r/bf16/train.log
  tar czf $OUT/bf16.tgz -C $r bf16
fi
echo "done at $SECONDS s"
