# One H100 call: the Adam/unscale A/B (HEAD vs working tree), ncu on the new Adam, GPU tests.
python3 -m pip install --no-build-isolation --no-deps -e . -q > $OUT/pip.txt 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv >> $OUT/pip.txt 2>&1
timeout 95 python3 .scratch/adam_ab.py $OUT/adam_ab.json > $OUT/adam_ab.txt 2>&1; echo "ab rc=$? at $SECONDS s"
cat $OUT/adam_ab.txt | cut -c1-160
if [ $SECONDS -lt 125 ]; then
  timeout 35 ncu --clock-control none -k regex:_adam_kernel -s 2 -c 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats python3 .scratch/adam_ncu.py > $OUT/ncu_adam.txt 2>&1; echo "ncu rc=$? at $SECONDS s"
  grep -E "Duration|Memory Throughput|Registers|Achieved Occupancy|Block Limit Reg|Warp Cycles Per Issued" $OUT/ncu_adam.txt | head
fi
if [ $SECONDS -lt 150 ]; then
  timeout $((175 - SECONDS)) python3 -m pytest -q -x tests/test_fused_optim.py tests/test_unscale.py -p no:cacheprovider > $OUT/tests.txt 2>&1; echo "tests rc=$? at $SECONDS s"; tail -3 $OUT/tests.txt
fi
