# Second call: the failing test after its fix (its file, compiled kernels), then the profiles
# the closing note needs for the targets missed (small step, unscale of 200, syncs).
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/pip.txt 2>&1 || exit 1
MPGEMM_SINGLE_CONFIG=1 timeout 200 python3 -m pytest -p no:cacheprovider tests/test_fused_optim.py -n 8 -q -rfE > $OUT/tests.txt 2>&1; echo "tests rc=$? at $SECONDS s"; tail -3 $OUT/tests.txt
timeout $((560-SECONDS)) python3 bench/profile_gpu.py $OUT "syncs,small mpgemm,small fp32,unscale 200,guide autocast_fused,matmul 4096" > $OUT/prof.log 2>&1; echo "profile rc=$? at $SECONDS s"
grep -E "^## |^### |host enqueue|busy" $OUT/profile.md
