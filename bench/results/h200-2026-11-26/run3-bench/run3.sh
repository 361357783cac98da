# Third call (warm machine): the bench stage.
r=/tmp/r3; mkdir -p $r; OUT=$r/bench timeout -s INT 290 bash bench/gpu_check.sh bench > $r/bench.out 2>&1; echo "bench rc=$? at $SECONDS s"; tar czf $OUT/bench.tgz -C $r bench bench.out; grep -E "gpu_check|passed|failed" $r/bench.out | tail -4
