# Third call: the tests stage on the direct launch path, an A/B of host time in one
# process (JIT vs direct), then the bench stage; each archived as it ends.
r=/tmp/r; mkdir -p $r
OUT=$r/tests bash bench/gpu_check.sh tests > $r/tests.out 2>&1; echo "tests rc=$? at $SECONDS s"
grep -E "gpu_check|passed|failed|FAILED" $r/tests.out | tail -8
tar czf $OUT/tests.tgz -C $r tests tests.out
timeout 150 python3 .scratch/ab.py $OUT/ab.json > $OUT/ab.txt 2>&1; echo "ab rc=$? at $SECONDS s"; tail -14 $OUT/ab.txt
[ $SECONDS -gt 360 ] && { echo "bench skipped at $SECONDS s"; exit 0; }
OUT=$r/bench bash bench/gpu_check.sh bench > $r/bench.out 2>&1; echo "bench rc=$? at $SECONDS s"
grep -E "gpu_check|passed|failed" $r/bench.out | tail -4
tar czf $OUT/bench.tgz -C $r bench bench.out
grep -A16 "### targets" $r/bench/report.md
