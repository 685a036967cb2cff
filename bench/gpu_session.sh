#!/usr/bin/env bash
# One device session: install the carried wheels (the GPU image lacks grain, ml_collections,
# tokamax), then run the named stages, logging everything under $OUT.
#   bash bench/gpu_session.sh tests attention dilution train_step
# The wheels (cp312, ~8 MB; carry .whl): bench/study_device.sh's list, plus tokamax's dependencies
# (.whl/stub holds the xprof.cli.tools module tokamax imports):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl einshape pydantic \
#     pydantic-core qwix immutabledict annotated-types typing-inspection typing_extensions
# tokamax itself is not on the image (2026-11-30: ModuleNotFoundError), and the index here has no
# 0.0.17 (0.1.0 is an empty placeholder): carry tokamax==0.0.12 with jaxtyping, typeguard==2.13.3
# and wadler-lindig (pure Python; it imports and matches XLA through ops.focal_attention on CPU).
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# jax's default pool is 75% of the GPU (~104 GiB on an H200): the 400M step at batch 32 asked for
# one 73.6 GiB buffer and ran out of memory there, and ran at 0.95 (twenty-second session). The
# allocator hint XLA prints (TF_GPU_ALLOCATOR=cuda_malloc_async) did not change jax's allocator.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$OUT/env.log"
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv >> "$OUT/env.log" 2>&1
python3 -c "import tokamax; print('tokamax', getattr(tokamax, '__version__', '?'))" >> "$OUT/env.log" 2>&1
# A stage may be given a wall limit as name:seconds (default 900), so one stuck stage cannot eat
# the whole call; each stage tees its full log under $OUT as it goes. The limit is the stage's:
# its commands share it, each running under what is left (until the nineteenth session each
# command had the whole limit, so auto_crossover:240's three ran past 380 s).
left() {
  local s=$((deadline - SECONDS))
  if [ "$s" -le 0 ]; then echo "stage limit reached; not run: $*"; return 124; fi
  timeout "$s" "$@"
}
for spec in "$@"; do
  stage=${spec%%:*}; limit=${spec#*:}; [ "$limit" = "$spec" ] && limit=900
  deadline=$((SECONDS + limit)); RUN=left
  echo "=== $stage $(date +%T)"
  case $stage in
    tests) $RUN python3 -m pytest -q -x -p no:cacheprovider tests/kernels/focal/test_focal_triton.py \
             tests/kernels/dilution/test_dilution_triton.py -k "Compiled" 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    bwd_tests) $RUN python3 -m pytest -q -p no:cacheprovider tests/kernels/focal/test_focal_mosaic_bwd.py \
             tests/kernels/condense/test_condense.py -k "Compiled" 2>&1 | tee "$OUT/bwd_tests.log" | tail -40 ;;
    fused_bwd) $RUN python3 -m pytest -q -p no:cacheprovider tests/kernels/focal/test_focal_mosaic_bwd_fused.py \
             -k Compiled 2>&1 | tee "$OUT/fused_bwd_tests.log" | tail -20
             $RUN python3 bench/focal_mgpu_bwd.py --fused --joint 2>&1 | tee "$OUT/fused_bwd.log" | tail -20 ;;
    glue_kernels)  # issue 3: the Pallas QK-norm + RoPE backward and SwiGLU passes, compiled
             # tests, then the step A/B (the presets' "auto" = both kernels, then the XLA pair,
             # then each XLA one alone) in one process per size
             $RUN python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/kernels/glue/test_norm_rope.py \
               tests/kernels/glue/test_swiglu.py -k Compiled 2>&1 | tee "$OUT/glue_tests.log" | tail -3
             $RUN python3 bench/train_step.py --sizes "${GLUE_SIZES:-400m,1.3b}" --impls cudnn \
               --steps 8 --variants "${GLUE_VARIANTS:-;model.qk_rope_backward=separate,model.mlp_backward=autodiff;model.qk_rope_backward=separate;model.mlp_backward=autodiff}" \
               --out "$OUT/glue_step.json" 2>&1 | grep --line-buffered -v -i autotun \
               | tee "$OUT/glue_step.log" | tail -10 ;;
    dilution_2p)  # issue 4: the Mosaic B1 with two bf16 mask pieces, compiled test then timed
             $RUN python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/kernels/dilution/test_dilution_triton.py \
               -k "Compiled and mosaic_2p" 2>&1 | tee "$OUT/dilution_2p_tests.log" | tail -3
             $RUN python3 bench/dilution.py --passes --b1-variants b1_mosaic,b1_mosaic_2p \
               --out "$OUT/dilution_2p_passes.json" 2>&1 | tee "$OUT/dilution_2p_passes.log" | tail -8
             $RUN python3 bench/dilution.py --impls dilution,cudnn --skip prefill,decode \
               --train-variants default,b1_mosaic_2p --train-shapes 2x12x16384x64,1x16x8192x128 \
               --out "$OUT/dilution_2p.json" 2>&1 | tee "$OUT/dilution_2p.log" | tail -12 ;;
    dilution_ptx)  # issue 4: the Mosaic B1's PTX and ptxas report (B1 spills ~600 bytes at D = 64,
             # twenty-seventh session), for register work on the CPU machine with ptxas there
             mkdir -p "$OUT/ptx"
             MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO="$OUT/ptx" $RUN python3 \
               bench/dilution.py --passes --b1-variants b1_mosaic_2p,b1_mosaic \
               --reps 1 > "$OUT/dilution_ptx.log" 2>&1
             find "$OUT/ptx" -type f ! -name "*.ptx" ! -name "*.ptxas" -delete
             grep -H "spill stores" "$OUT"/ptx/*.ptxas | grep -v warning ;;
    dilution_regs)  # issue 4: the Mosaic B1 (and F2) at 232 registers per compute thread against
             # the default 256 (BlockSizes.mosaic_registers; twenty-eighth session: 256 spills
             # less in B1, 2% faster): compiled test, ptxas, the passes, then forward+backward
             $RUN python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/kernels/dilution/test_dilution_triton.py \
               -k "Compiled and r232" 2>&1 | tee "$OUT/dilution_regs_tests.log" | tail -3
             MOSAIC_GPU_DUMP_PTXAS=1 $RUN python3 bench/dilution.py --passes \
               --b1-variants b1_mosaic_2p,b1_mosaic_2p_r232 --out "$OUT/dilution_regs_passes.json" \
               > "$OUT/dilution_regs_passes.log" 2>&1
             grep -i "spill stores\|TFLOP" "$OUT/dilution_regs_passes.log" | grep -v warning | tail -20
             $RUN python3 bench/dilution.py --impls dilution,cudnn --skip prefill,decode \
               --train-variants default,b1_mosaic_2p_r232 --train-shapes 2x12x16384x64 \
               --out "$OUT/dilution_regs.json" 2>&1 | tee "$OUT/dilution_regs.log" | tail -8 ;;
    dilution_f2)  # issue 4: the Mosaic F2 with two bf16 mask pieces (BlockSizes.f2_mask_pieces) and
             # with 2 or 4 key tiles per CTA (f2_key_tiles: a quarter of the float32 reduce-adds);
             # timed in the twenty-ninth session (~200 s): compiled tests, the passes (F2 Triton
             # and every Mosaic arm), then forward+backward
             $RUN python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/kernels/dilution/test_dilution_triton.py \
               -k "Compiled and (f2_2p or f2_k4)" 2>&1 | tee "$OUT/f2_tests.log" | tail -3
             $RUN python3 bench/dilution.py --passes --b1-variants b1_mosaic_2p \
               --out "$OUT/f2_passes.json" 2>&1 | grep "TFLOP" | tee "$OUT/f2_passes.log"
             $RUN python3 bench/dilution.py --impls dilution,cudnn --skip prefill,decode \
               --train-variants default,mosaic_2p,mosaic_2p_k4,mosaic_2p_k2 \
               --train-shapes 2x12x16384x64,1x16x8192x128 \
               --out "$OUT/f2.json" 2>&1 | tee "$OUT/f2.log" | tail -14 ;;
    dilution_defaults)  # issue 4: both Mosaic passes with two pieces (and two F2 key tiles at
             # D = 64), the Hopper default since the twenty-ninth session: compiled tests, then the
             # issue's shapes and prefill against the old defaults, the default timed first and last
             $RUN python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/kernels/dilution/test_dilution_triton.py \
               -k "Compiled and (machine or triton_b1 or prefill or head_dim)" 2>&1 \
               | tee "$OUT/defaults_tests.log" | tail -3
             $RUN python3 bench/dilution.py --impls dilution,cudnn --skip decode \
               --train-variants default,f2_triton,b1_triton,default \
               --out "$OUT/defaults.json" 2>&1 | tee "$OUT/defaults.log" | tail -30 ;;
    dilution_f1b2)  # issue 4: F1 (row statistics) as focal_mgpu's flash forward with V := K
             # (BlockSizes.f1_impl) and B2 with two compute warpgroups on wgmma (b2_impl), both
             # written in the thirty-first session, the Hopper default since the thirty-second
             # (alone at (2,12,16K,64): F1 307, B2 278 TFLOP/s against the Triton passes' ~170):
             # compiled tests, each pass alone (F1 and B2 both ways), then two of the issue's
             # shapes and prefill with each pass alone, both, and neither (the old default)
             $RUN python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/kernels/dilution/test_dilution_triton.py \
               -k "Compiled and (machine_f1 or machine_b2)" 2>&1 | tee "$OUT/f1b2_tests.log" | tail -3
             $RUN python3 bench/dilution.py --passes --b1-variants default \
               --out "$OUT/f1b2_passes.json" 2>&1 | grep "TFLOP" | tee "$OUT/f1b2_passes.log"
             $RUN python3 bench/dilution.py --impls dilution,cudnn --skip decode \
               --train-shapes 2x12x16384x64,1x16x8192x128 \
               --train-variants f1_b2_triton,f1_mosaic,b2_mosaic,default,f1_b2_triton \
               --out "$OUT/f1b2.json" 2>&1 | tee "$OUT/f1b2.log" | tail -30 ;;
    dilution_ckpt64)  # issue 4: the new default's compiled test (F1 and B2 on Mosaic together,
             # "machine") and a checkpoint per 64-row tile (BlockSizes.ckpt_rows=64, past the
             # issue's R >= 1024: the Mosaic B1 skips its carry rebuild), compiled, B1 alone, then
             # forward+backward at two shapes against the default, then the 209M step both ways
             # (model.attention.checkpoint_rows) beside the softmax model's step, the ratio's anchor
             # (its checkpoint_rows arm is the same program: dilution-only field)
             $RUN python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/kernels/dilution/test_dilution_triton.py \
               -k "Compiled and machine and not machine_f1 and not machine_b2" 2>&1 \
               | tee "$OUT/ckpt64_tests.log" | tail -3
             $RUN python3 bench/dilution.py --passes --b1-variants default,ckpt64 \
               --out "$OUT/ckpt64_passes.json" 2>&1 | grep "B1" | tee "$OUT/ckpt64_passes.log"
             $RUN python3 bench/dilution.py --impls dilution,cudnn --skip prefill,decode \
               --train-shapes 2x12x16384x64,1x16x8192x128 --train-variants default,ckpt64,default \
               --out "$OUT/ckpt64.json" 2>&1 | tee "$OUT/ckpt64.log" | tail -12
             $RUN python3 bench/train_step.py --sizes 209m --seq_len 16384 --batch 1 --impls pallas \
               --patterns "softmax:rope;dilution:none" --variants ";model.attention.checkpoint_rows=64" \
               --steps 6 --out "$OUT/ckpt64_step.json" 2>&1 | grep --line-buffered -v -i autotun \
               | tee "$OUT/ckpt64_step.log" | tail -4 ;;
    dilution_lean)  # issue 4: BlockSizes.mosaic_lean (approx_math, rsqrt² reciprocals, position
             # vectors, XLA's per-query rows in the Mosaic B1 and F2): compiled tests (against the
             # reference through the op; B1 and F2 against themselves without it), each pass alone
             # with the PTX and ptxas reports kept (for bench/sass_loops.py on the CPU machine),
             # then forward+backward at the issue's shapes and prefill, between two defaults
             $RUN python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/kernels/dilution/test_dilution_triton.py \
               tests/kernels/dilution/test_dilution_mosaic.py -k "(Compiled and machine_lean_skip) or lean_matches_compiled" \
               2>&1 | tee "$OUT/lean_tests.log" | tail -3
             mkdir -p "$OUT/ptx"
             MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO="$OUT/ptx" $RUN \
               python3 bench/dilution.py --passes --b1-variants default,lean,lean_skip \
               --out "$OUT/lean_passes.json" > "$OUT/lean_passes.log" 2>&1
             grep "TFLOP" "$OUT/lean_passes.log" | tail -12
             find "$OUT/ptx" -type f ! -name "*.ptx" ! -name "*.ptxas" -delete
             grep -H "spill stores" "$OUT"/ptx/*.ptxas | grep -v warning | tail -12 ;;
    dilution_lean_time)  # issue 4: dilution_lean's timing half
             $RUN python3 bench/dilution.py --impls dilution,cudnn --skip decode \
               --train-variants default,lean,lean_skip --out "$OUT/lean.json" 2>&1 \
               | tee "$OUT/lean.log" | tail -40 ;;
    dilution_lean_step)  # issue 4: the 209M step at 16K with dilution.BlockSizes.default plus
             # DILUTION_STEP (a bench.dilution_blocks choice) beside the softmax model's step
             $RUN python3 bench/train_step.py --sizes 209m --seq_len 16384 --batch 1 --impls pallas \
               --patterns "softmax:rope;dilution:none" \
               --variants ";bench.dilution_blocks=${DILUTION_STEP:-lean_skip}" --steps 6 \
               --out "$OUT/lean_step.json" 2>&1 | grep --line-buffered -v -i autotun \
               | tee "$OUT/lean_step.log" | tail -6 ;;
    dilution_chain)  # issue 4: BlockSizes.mosaic_chain_pieces (the mask products' bf16 pieces in
             # one wgmma group; the default at D = 64 since the thirty-fifth session, which ran
             # this stage as default-vs-chain before the switch): compiled tests through the op,
             # forward+backward at (2,12,16K,64), B1 and F2 alone (PTX kept), then the two other
             # shapes and the 209M step beside the softmax model's, as far as the limit allows
             $RUN python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/kernels/dilution/test_dilution_triton.py \
               -k "Compiled and machine_chain and not chain_off" 2>&1 | tee "$OUT/chain_tests.log" | tail -3
             $RUN python3 bench/dilution.py --impls dilution --skip prefill,decode \
               --train-shapes 2x12x16384x64 --train-variants chain_off,default,chain_off \
               --out "$OUT/chain.json" 2>&1 | tee "$OUT/chain.log" | tail -8
             mkdir -p "$OUT/ptx"
             MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO="$OUT/ptx" $RUN \
               python3 bench/dilution.py --passes --b1-variants default,chain_off \
               --out "$OUT/chain_passes.json" > "$OUT/chain_passes.log" 2>&1
             find "$OUT/ptx" -type f ! -name "dilution_mgpu_b1*" ! -name "dilution_mgpu_f2*" -delete
             grep "TFLOP" "$OUT/chain_passes.log" | grep "F2\|B1" | tail -6
             $RUN python3 bench/dilution.py --impls dilution,cudnn --skip prefill,decode \
               --train-shapes 1x16x8192x128,8x8x4096x64 --train-variants chain_off,chain \
               --out "$OUT/chain_2.json" 2>&1 | tee "$OUT/chain_2.log" | tail -8
             $RUN python3 bench/train_step.py --sizes 209m --seq_len 16384 --batch 1 --impls pallas \
               --patterns "dilution:none;softmax:rope" --variants ";bench.dilution_blocks=chain_off" \
               --steps 6 --out "$OUT/chain_step.json" 2>&1 | grep --line-buffered -v -i autotun \
               | tee "$OUT/chain_step.log" | tail -6 ;;
    step_1p3b)  # issue 3: the 1.3B step (batch 24 x 2048, packed) with the defaults, STEP_RUNS
             # times in one process (55% MFU needs <= 748.4 ms; machines differ by 2-10%)
             $RUN python3 bench/train_step.py --sizes 1.3b --batch 24 --impls pallas --steps 8 \
               --variants "$(printf ';%.0s' $(seq 2 ${STEP_RUNS:-4}))" --out "$OUT/step_1p3b.json" \
               2>&1 | grep --line-buffered -v -i autotun | tee "$OUT/step_1p3b.log" | tail -8 ;;
    dilution_step) $RUN python3 bench/train_step.py --sizes 209m --seq_len 16384 --batch 1 \
             --impls "${DIL_STEP_IMPLS:-pallas,cudnn}" --steps 6 \
             --patterns "${DIL_STEP_PATTERNS:-softmax:rope;dilution:none;softmax:rope,dilution:none}" \
             --out "$OUT/dilution_step.json" 2>&1 | grep --line-buffered -v -i autotun \
             | tee "$OUT/dilution_step.log" | tail -12 ;;
    auto_crossover)  # issue 3: where packed rows stop favouring cuDNN (its dense segment mask):
             # the focal presets at 2K (packed, Mosaic's segment masking against the mask, never
             # timed), then the 209M softmax step at 4K and 8K, 16K tokens a step (16K: dilution_step).
             # CROSS_SIZES (400m,1.3b) and CROSS_LENGTHS ("4096 8192"; "" skips) trim it, e.g.
             # CROSS_SIZES=400m CROSS_LENGTHS= for the preset nearest its MFU target alone (~150 s).
             $RUN python3 bench/train_step.py --sizes "${CROSS_SIZES:-400m,1.3b}" --impls cudnn,pallas \
               --steps 8 --out "$OUT/crossover_2048.json" 2>&1 | grep --line-buffered -v -i autotun \
               | tee "$OUT/crossover_2048.log" | tail -6
             for t in ${CROSS_LENGTHS-4096 8192}; do
               $RUN python3 bench/train_step.py --sizes 209m --seq_len $t --batch $((16384 / t)) \
                 --impls pallas,cudnn --patterns softmax:rope --steps 6 --out "$OUT/crossover_$t.json" \
                 2>&1 | grep --line-buffered -v -i autotun | tee "$OUT/crossover_$t.log" | tail -3
             done ;;
    mgpu_tests)  # MGPU_TESTS / MGPU_K narrow it, e.g. to the backward files or one variant
             $RUN python3 -m pytest -q -o addopts="" -p no:cacheprovider ${MGPU_TESTS:-tests/kernels/focal/test_focal_mosaic.py \
             tests/kernels/focal/test_focal_mosaic_bwd.py tests/kernels/condense/test_condense.py} -k "${MGPU_K:-Compiled}" 2>&1 \
             | tee "$OUT/mgpu_tests.log" | tail -40 ;;
    dilution_passes) $RUN python3 bench/dilution.py --passes --out "$OUT/dilution_passes.json" 2>&1 \
             | tee "$OUT/dilution_passes.log" | tail -8 ;;
    dilution_sweep) $RUN python3 bench/dilution.py --sweep --out "$OUT/dilution_sweep.json" 2>&1 \
             | tee "$OUT/dilution_sweep.log" | tail -30 ;;
    mgpu_fwd) $RUN python3 bench/focal_mgpu_fwd.py ${MGPU_FWD_ARGS:-} 2>&1 | tee "$OUT/mgpu_fwd.log" | tail -30 ;;
    mgpu_bwd)  # MGPU_BWD_ARGS: one run's arguments; runs separated by ';' go one after another
             IFS=';' read -ra runs <<< "${MGPU_BWD_ARGS:-}"
             for args in "${runs[@]:-}"; do
               $RUN python3 bench/focal_mgpu_bwd.py $args 2>&1 | grep -v -i autotun \
                 | tee -a "$OUT/mgpu_bwd.log" | tail -30
             done ;;
    glue_tests) $RUN python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/kernels/glue/test_norm_rope.py \
               tests/kernels/glue/test_swiglu.py -k Compiled 2>&1 | tee "$OUT/glue_tests.log" | tail -3 ;;
    add_norm) $RUN python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/kernels/glue/test_add_norm.py \
               -k Compiled 2>&1 | tee "$OUT/add_norm_tests.log" | tail -3
             $RUN python3 bench/add_norm.py --out "$OUT/add_norm.json" 2>&1 | tee "$OUT/add_norm.log" | tail -12 ;;
    norm_rope) $RUN python3 bench/norm_rope.py --out "$OUT/norm_rope.json" 2>&1 | tee "$OUT/norm_rope.log" | tail -16 ;;
    bwd_sweep)  # issue 3: the two-kernel backward's tiles at the 1.3B step's shape and at 4K/8K;
             # BWD_BLOCKS: block_q_dq,block_kv_dq,block_q_dkv,block_kv_dkv,ring depth (one process each)
             for b in ${BWD_BLOCKS:-64,64,64,64,2 64,128,64,64,2 64,64,64,64,3 64,128,64,64,3 64,64,128,64,2}; do
               $RUN python3 bench/focal_mgpu_bwd.py --blocks $b --iters 20 --shapes \
                 ${BWD_SHAPES:-24,16,2048,128 2,16,4096,128 1,16,8192,128} 2>&1 | grep -v -i autotun \
                 | tee -a "$OUT/bwd_sweep.log" | tail -5
             done ;;
    bwd_pingpong)  # issue 3: the ping-pong schedule in the dq, dk/dv and fused backwards (written
             # in the twenty-seventh session, never compiled): the backward's compiled tests (the
             # defaults too: their scratch gained the schedule barrier), then each arm timed
             # beside the defaults at D = 128 and 64, then the 1.3B step with it (~500 s)
             $RUN python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/kernels/focal/test_focal_mosaic_bwd.py \
               tests/kernels/focal/test_focal_mosaic_bwd_fused.py -k "Compiled and not joint and not halves" 2>&1 \
               | tee "$OUT/pingpong_tests.log" | tail -3
             $RUN python3 bench/focal_mgpu_bwd.py --fused --arms pingpong lean_pingpong --shapes \
               24,16,2048,128 2,16,4096,128 1,16,8192,128 1,8,16384,128 --out "$OUT/pingpong128.json" \
               2>&1 | grep -v -i autotun | tee "$OUT/pingpong.log" | tail -12
             $RUN python3 bench/focal_mgpu_bwd.py --fused --arms pingpong --blocks 64,64,64,64,3 \
               --shapes 2,12,16384,64 4,12,4096,64 --out "$OUT/pingpong64.json" 2>&1 \
               | grep -v -i autotun | tee -a "$OUT/pingpong.log" | tail -6
             $RUN python3 bench/train_step.py --sizes 1.3b --batch 24 --impls pallas --steps 8 \
               --variants "${PINGPONG_STEP_VARIANTS:-;bench.mgpu_backward=two_kernel_pingpong}" \
               --out "$OUT/pingpong_step.json" 2>&1 | grep --line-buffered -v -i autotun \
               | tee "$OUT/pingpong_step.log" | tail -4 ;;
    pingpong_dkv)  # issue 3: the dk/dv kernel's ping-pong with its lean step, the dq kernel
             # plain (twenty-eighth session: that pair ran fastest at 2K): compiled tests, the
             # kernels at D = 128, then the 1.3B step twice each, interleaved (~420 s)
             $RUN python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/kernels/focal/test_focal_mosaic_bwd.py \
               -k "Compiled and dkv_step_modes" 2>&1 | tee "$OUT/pingpong_dkv_tests.log" | tail -3
             $RUN python3 bench/focal_mgpu_bwd.py --arms lean_pingpong_dkv --shapes 24,16,2048,128 \
               1,16,8192,128 --out "$OUT/pingpong_dkv.json" 2>&1 | grep -v -i autotun \
               | tee "$OUT/pingpong_dkv.log" | tail -6
             v=bench.mgpu_backward=two_kernel_lean_pingpong_dkv
             $RUN python3 bench/train_step.py --sizes 1.3b --batch 24 --impls pallas --steps 8 \
               --variants ";$v;;$v" --out "$OUT/pingpong_dkv_step.json" 2>&1 \
               | grep --line-buffered -v -i autotun | tee "$OUT/pingpong_dkv_step.log" | tail -6 ;;
    fused_diag)  # issue 3: why the fused backward loses at D = 128: the dq-halves variant's
             # compiled tests, then every variant timed with the dq stages left out (--ablate),
             # ptxas's registers and spills per kernel, then ncu's view if it runs here
             $RUN python3 -m pytest -q -o addopts="" -p no:cacheprovider \
               tests/kernels/focal/test_focal_mosaic_bwd_fused.py -k "Compiled and halves" 2>&1 | tail -3
             MOSAIC_GPU_DUMP_PTXAS=1 $RUN python3 bench/focal_mgpu_bwd.py --ablate --joint --halves \
               --shapes ${DIAG_SHAPES:-1,16,8192,128 2,12,16384,64} --out "$OUT/fused_diag.json" \
               > "$OUT/fused_diag.log" 2>&1
             grep -i "spill\|registers\|entry function\| ms\|without\|(B,H" "$OUT/fused_diag.log" | tail -60
             NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
             $RUN ${NCU:-ncu} --clock-control none --kernel-name regex:"fused|dkv" --launch-count 2 \
               --section SpeedOfLight --section WarpStateStats --section LaunchStats \
               --section MemoryWorkloadAnalysis python3 bench/focal_mgpu_bwd.py --fused --iters 1 \
               --shapes 1,16,8192,128 > "$OUT/fused_ncu.log" 2>&1; tail -60 "$OUT/fused_ncu.log" ;;
    ptx)  # the focal Mosaic kernels' PTX and ptxas reports (one file each under $OUT/ptx), for
          # register work on the CPU machine: `ptxas -arch=sm_90a -v F.ptx` reports the spills there
          # (twenty-sixth session); PTX_ARGS picks the bench run (default: both backwards, D = 128)
             mkdir -p "$OUT/ptx"
             MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO="$OUT/ptx" $RUN python3 \
               bench/focal_mgpu_bwd.py ${PTX_ARGS:---fused --iters 1 --shapes 1,16,2048,128} \
               > "$OUT/ptx.log" 2>&1
             find "$OUT/ptx" -type f ! -name "*.ptx" ! -name "*.ptxas" -delete  # MLIR logs: ~300 MB
             grep -H "spill stores" "$OUT"/ptx/*.ptxas | grep -v warning ;;
    overlap)  # issue 3: the forward with FA3's intra-warpgroup overlap (BlockSizes.overlap_softmax):
             # ptxas's report first ("wgmma ... serialized", C7513, means no overlap: stop there),
             # then the compiled tests and the issue's table beside the default kernel and cuDNN
             mkdir -p "$OUT/ptx"
             MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO="$OUT/ptx" $RUN python3 \
               bench/attention.py --impls mosaic_overlap,mosaic --shapes "1,16,2048,128;1,12,2048,64" \
               --iters 1 --out "$OUT/ptx/unused.json" > "$OUT/overlap_ptx.log" 2>&1
             find "$OUT/ptx" -type f ! -name "*.ptxas" -delete
             grep -H -i "spill stores\|serializ" "$OUT"/ptx/*.ptxas | head -40
             if grep -q -i serializ "$OUT"/ptx/*.ptxas; then echo "overlap: serialized, not timed"; continue; fi
             $RUN python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/kernels/focal/test_focal_mosaic.py \
               -k "Compiled and overlap" 2>&1 | tee "$OUT/overlap_tests.log" | tail -3
             $RUN python3 bench/attention.py --impls ${ATTN_IMPLS:-cudnn,mosaic,mosaic_overlap,cudnn_temp,mosaic_temp,mosaic_overlap_temp} \
               --out "$OUT/overlap_attention.json" 2>&1 | tee "$OUT/overlap_attention.log" | tail -40 ;;
    overlap_step)  # issue 3: the 1.3B step, defaults against the overlapped forward, alternating
             $RUN python3 bench/train_step.py --sizes 1.3b --batch 24 --impls pallas --steps 8 \
               --variants ";bench.mgpu_backward=overlap_fwd;;bench.mgpu_backward=overlap_fwd" \
               --out "$OUT/overlap_step.json" 2>&1 | grep --line-buffered -v -i autotun \
               | tee "$OUT/overlap_step.log" | tail -10 ;;
    condense) $RUN python3 bench/condense.py --out "$OUT/condense.json" 2>&1 | tee "$OUT/condense.log" | tail -20 ;;
    attention) $RUN python3 bench/attention.py ${ATTN_IMPLS:+--impls $ATTN_IMPLS} ${ATTN_SHAPES:+--shapes $ATTN_SHAPES} --out "$OUT/attention.json" 2>&1 | tee "$OUT/attention.log" | tail -40 ;;
    dilution) $RUN python3 bench/dilution.py --impls dilution,cudnn --out "$OUT/dilution.json" 2>&1 | tee "$OUT/dilution.log" | tail -40 ;;
    train_step) $RUN python3 bench/train_step.py --impls cudnn,pallas,tokamax ${TRAIN_STEP_ARGS:-} --out "$OUT/train_step.json" 2>&1 | grep --line-buffered -v -i autotun | tee "$OUT/train_step.log" | tail -20 ;;
    tokamax_step)  # issue 3: the training step with implementation="tokamax" (tokamax 0.0.12 through
             # bench/tokamax_shim.py). Thirty-first session: no row within 150-280 s at 400M or
             # 1.3B, packed or not, and no error; tokamax's own log lines are kept this time (they
             # say which of its kernels it picked), and the step prints its phases on stderr.
             # Thirty-second session (400M): init compiles ~45 s, tracing tokamax's backward ~45 s
             # (jax builds a ConcretizationError message per call, tokamax/_src/ops/op.py:638),
             # then XLA compiled for > 65 s when the 200 s limit came; ours runs first. The second
             # try segfaulted while faulthandler printed a stack (during MLIR lowering, ~190 s), the
             # third, without the dumps, ran (first step 162 s): STEP_STACK_EVERY=45 turns them on
             $RUN env STEP_STACK_EVERY="${STEP_STACK_EVERY:-0}" python3 bench/train_step.py \
               --sizes "${TOKAMAX_SIZES:-400m}" --impls "${TOKAMAX_IMPLS:-pallas,tokamax}" \
               --batch "${TOKAMAX_BATCH:-32}" --steps 8 ${TOKAMAX_STEP_ARGS:-} \
               --out "$OUT/tokamax_step.json" > "$OUT/tokamax_step.log" 2>&1
             grep -v "Autotuning cache miss" "$OUT/tokamax_step.log" | cut -c1-300 | tail -60
             grep "Autotuning cache miss" "$OUT/tokamax_step.log" | sed 's/ with key.*//' | cut -c1-200 \
               | sort | uniq -c | head ;;
    train_step_packed)  # the trainer's own batches: packed rows with segment ids (cuDNN: a mask)
             $RUN python3 bench/train_step.py --sizes "${PACKED_SIZES:-1.3b}" --impls cudnn,pallas \
               --steps 6 --out "$OUT/train_step_packed.json" 2>&1 | grep --line-buffered -v -i autotun \
               | tee "$OUT/train_step_packed.log" | tail -6 ;;
    train_step_flags)  # the same step under XLA flags (default: cuBLAS for every GEMM, as MaxText sets;
             # STEP_XLA_FLAGS= (set, empty) for none: a second train_step run with its own files);
             # FLAG_STEP_ARGS replaces the step's arguments, e.g. the train_step stage's for an A/B
             XLA_FLAGS="${STEP_XLA_FLAGS-"--xla_gpu_enable_triton_gemm=false"}" $RUN python3 \
               bench/train_step.py ${FLAG_STEP_ARGS:---sizes ${FLAG_SIZES:-1.3b} --impls cudnn --no_segments --steps 6} \
               --out "$OUT/train_step_flags.json" 2>&1 | grep --line-buffered -v -i autotun \
               | tee "$OUT/train_step_flags.log" | tail -6 ;;
    profile) for spec in ${PROFILE_RUNS:-1.3b:cudnn 400m:cudnn}; do  # size:impl, one process each;
               # PROFILE_ARGS adds to every run, e.g. "--batch 24"
               $RUN python3 bench/step_profile.py --size ${spec%%:*} --impl ${spec#*:} ${PROFILE_ARGS:-} \
                 --out "$OUT/profile_${spec%%:*}_${spec#*:}.json" 2>&1 | grep -v -i autotun \
                 | tee "$OUT/profile_${spec%%:*}_${spec#*:}.log" | head -45
             done ;;
    focus_decode)  # issue 5: FocusLLM decode (batched chunks / one at a time / the base), 8x and 32x
             $RUN python3 bench/focus_decode.py --focus_impl pallas ${DECODE_ARGS:---size 100m \
               --chunk_size 512 --prompt_len 256 --local_len 512} --out "$OUT/focus_decode.json" \
               2>&1 | grep --line-buffered -v -i autotun | tee "$OUT/focus_decode.log" | tail -14 ;;
    jaxsrc) J=$(python3 -c "import jax,os;print(os.path.dirname(jax.__file__))")
            tar czf "$OUT/jax_mgpu_src.tgz" -C "$J" _src/pallas/mosaic_gpu experimental/pallas/mosaic_gpu.py \
              experimental/pallas/ops/gpu _src/pallas/core.py _src/pallas/pallas_call.py _src/pallas/primitives.py ;;
    *) echo "unknown stage $stage" ;;
  esac
done
# The device returns at most 8 files: pack everything into one archive.
(cd "$OUT" && tar czf /tmp/session.tgz ./* && rm -rf ./* && mv /tmp/session.tgz .)
