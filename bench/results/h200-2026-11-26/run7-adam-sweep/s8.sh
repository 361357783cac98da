# Last call (~4 min of budget): Adam's and SGD's launch shapes on the H200, then ncu on the guide's Adam.
r=/tmp/r8; mkdir -p $r
python3 -m pip install -q --no-build-isolation --no-deps -e . > $r/pip.txt 2>&1; echo "pip rc=$? at $SECONDS s"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv >> $r/pip.txt 2>&1
timeout 85 python3 bench/sweep_optim.py $r/sweep.json > $r/sweep.log 2>&1; echo "sweep rc=$? at $SECONDS s"
python3 -c "
import json
for r in json.load(open('$r/sweep.json'))['rows']: print(r.get('optimizer', r['impl']), r.get('copies'), r.get('block'), r.get('num_warps'), round(r['us'], 1), round(r['gb_per_s']), r.get('same_bits_as_default'))
" 2>&1 | tail -30
if [ $SECONDS -lt 115 ]; then
  timeout 35 ncu --clock-control none -k regex:_adam_kernel -s 2 -c 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis python3 .scratch/adam_ncu.py > $r/ncu_adam.txt 2>&1; echo "ncu rc=$? at $SECONDS s"
  grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Block Limit Reg|Warp Cycles Per Issued" $r/ncu_adam.txt | head
fi
tar czf $OUT/r8.tgz -C $r .
echo "done at $SECONDS s"
