. bench/device_out.sh; use_carried_wheels
python3 -m pip install --no-build-isolation --no-deps . > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
for c in 0 1 2 3 4; do
  FASTQWEN_GEMV_STAGED_CONFIG=$c timeout 120 python3 bench/bench_gemv.py --batches 1 --iters 20 --shapes qkv o_proj gate_up down --json $OUT/gemv_c$c.json > $OUT/gemv_c$c.log 2>&1
  python3 -c "
import json,sys; d=json.load(open('$OUT/gemv_c$c.json'))
print('config $c', ' '.join(f\"{k.split('/')[1]} st_bf16 {v[0]['gemv_bf16_frac_copy']} st_fp8 {v[0]['gemv_fp8_frac_copy']} fma_bf16 {v[0]['gemv_simt_bf16_frac_copy']} fma_fp8 {v[0]['gemv_simt_fp8_frac_copy']} |\" for k,v in d['shapes'].items()))"
done
