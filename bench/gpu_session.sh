#!/bin/bash
# Everything a GPU session measures, in one device call (carry [".whl/slim"], made by
# bench/device_bundle.sh): the GPU tests, the tritonserver stream benchmark with the stub sampled
# by py-spy, the decode benchmark. Results and logs land in $OUT. Set HSSERVE_COMMIT first.
#   bash bench/gpu_session.sh [PART ...]   (default: tests triton decode)
# PART: tests spec_tests fp8_tests fp8_gemm fp8_graph fp8_8b fp8_70b triton decode decode1b decode8b decode_sync decode_nopdl triton_wait profile
# profile1 host logprobs extract8b extract_spy moe moe_kernels moe_profile ablation tp_tests tp8b tp70b
# two_instances route64 (batch 64 routed by torch vs route_align) spec_verify guided openai (both carry .whl/tok:
# SmolLM2's tokenizer files) none. The one-off A/B scripts'
# parts went with them (bench/archive/, last at e9f3215).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/backend:$PWD/tests:$PWD/bench
mkdir -p /tmp/x && tar -xJf .whl/slim/slim.tar.xz -C /tmp/x
sp=$(python3 -c "import site; print(site.getsitepackages()[0])")
echo "$PWD/backend" > "$sp/hsserve-dev.pth"  # NOTE: the stub does not read PYTHONPATH
# NOTE: numpy 1.26 for the stub only (transformers in the image needs its numpy 2)
echo "import os, sys; sys.path.insert(0, '/tmp/x/np') if os.path.basename(os.readlink('/proc/self/exe')).startswith('triton_python') else None" > "$sp/00-np.pth"
export PYTHONPATH=$PYTHONPATH:/tmp/x/site PATH=$PATH:/tmp/x/tools/bin
parts=${*:-tests triton decode}
for part in $parts; do
  case $part in
    tests) timeout 560 python3 -m pytest -m gpu tests/gpu -n "${WORKERS:-6}" -q -p no:cacheprovider \
             2>&1 | grep -v "^[IW]1\|^|\|^+" | tail -25 ;;  # NOTE: pytest's summary line last
    spec_tests) timeout 200 python3 -m pytest -m gpu tests/gpu/test_gpu_speculative.py \
                  tests/gpu/test_gpu_eagle3.py -n 4 -q \
                  -p no:cacheprovider 2>&1 | grep -v "^[IW]1\|^|\|^+" | tail -12 ;;
    fp8_tests) timeout 300 python3 -m pytest -m gpu tests/gpu/test_gpu_fp8.py -n 6 -q \
                 -p no:cacheprovider 2>&1 | grep -v "^[IW]1\|^|\|^+" | tail -12 ;;
    fp8_8b) timeout 560 python3 bench/gpu_decode.py --shapes llama-8b --batches-8b 1 64 --repeats 3 \
              --no-hf --prefill --quantization ${QUANTS:-none fp8} --out "$OUT/${FP8_OUT:-h200_decode_fp8}.json" \
              2>&1 | grep "^{\|Error\|skipped" ;;
    fp8_gemm) timeout 200 python3 bench/fp8_gemm.py --out "$OUT/${FP8_GEMM_OUT:-h200_fp8_gemm}.json" 2>&1 \
                | grep -v Warning | tail -30 ;;
    fp8_graph) timeout 300 python3 bench/fp8_graph.py --rows ${FP8_ROWS:-16 64} \
                 --out "$OUT/${FP8_GRAPH_OUT:-h200_fp8_graph}.json" 2>&1 | grep -v Warning | tail -40 ;;
    fp8_70b) timeout 560 python3 bench/gpu_decode.py --shapes llama-70b --batches-8b 1 64 --repeats 2 \
               --no-hf --quantization ${QUANTS70:-fp8} --out "$OUT/${FP8_OUT:-h200_decode_fp8}_70b.json" \
               2>&1 | grep "^{\|Error\|skipped" ;;
    triton) [ "${SPY:-1}" = 1 ] && (bash bench/spy_stub.sh 4 > "$OUT/spy.out" 2>&1 &)
            timeout 280 python3 bench/triton_stream_vs_direct.py --shape llama-1b --concurrency 64 \
              --requests 1536 --new 256 --client-procs "${CLIENT_PROCS:-8}" \
              --client-cpus "${CLIENT_CPUS:-6}" \
              --out "$OUT/${TRITON_OUT:-h200_triton}.json" 2>&1 | grep -v "^|" | tail -4
            pkill -9 triton_python_b ;;
    decode) timeout 240 python3 bench/gpu_decode.py --shapes llama-1b llama-8b --batches-1b 1 64 \
              --batches-8b 1 --repeats 4 --no-hf --out "$OUT/h200_decode.json" 2>&1 | grep "^{\|Error" ;;
    triton_wait) timeout 280 python3 bench/triton_stream_vs_direct.py --shape llama-1b --concurrency 64 \
              --requests 1536 --new 256 --client-procs 8 --param prefill_wait_ms=${WAIT_MS:-10} \
              --out "$OUT/h200_triton_wait.json" 2>&1 | grep -v "^|" | tail -4
            pkill -9 triton_python_b ;;
    decode_sync) timeout 150 python3 bench/gpu_decode.py --shapes llama-1b --batches-1b 1 64 \
              --repeats 3 --no-hf --async-scheduling off --out "$OUT/h200_decode_sync.json" 2>&1 | grep "^{" ;;
    profile) timeout 200 python3 bench/gpu_profile.py --batches 1 64 --top 16 2>&1 | grep -v "^\[W"
             timeout 150 python3 bench/gpu_profile.py --shape llama-8b --batches 1 --top 12 2>&1 | grep -v "^\[W" ;;
    host) timeout 200 python3 bench/gpu_profile.py --batches 64 --host --modes none last --top 30 2>&1 \
            | grep -v "^\[W" | cut -c1-150 ;;
    decode1b) timeout 150 python3 bench/gpu_decode.py --shapes llama-1b --batches-1b 1 64 \
              --repeats 4 --no-hf --out "$OUT/h200_decode_1b.json" 2>&1 | grep "^{\|Error" ;;
    decode8b) timeout 150 python3 bench/gpu_decode.py --shapes llama-8b --batches-8b 1 \
              --repeats 4 --no-hf --out "$OUT/h200_decode_8b.json" 2>&1 | grep "^{\|Error" ;;
    decode_nopdl) timeout 150 python3 bench/gpu_decode.py --shapes llama-1b --batches-1b 1 64 \
              --repeats 3 --no-hf --no-pdl --out "$OUT/h200_decode_nopdl.json" 2>&1 | grep "^{\|Error" ;;
    logprobs) for k in ${LOGPROBS_K:-0 5}; do
                timeout 150 python3 bench/gpu_decode.py --shapes llama-1b --batches-1b 64 --repeats 3 \
                  --no-hf --logprobs "$k" --out "$OUT/h200_decode_logprobs_k$k.json" 2>&1 | grep "^{\|Error"
              done ;;
    extract8b) timeout 500 python3 bench/extract.py --shape llama-8b --records 256 \
                 --out "$OUT/h200_extract_8b.json" 2>&1 | grep -v "^\[W\|WARNING" | tail -30 ;;
    extract_spy) timeout 400 python3 bench/extract.py --shape llama-8b --records 512 --repeats 1 \
                 --only server_bf16_shm --spy "$OUT/spy" --out "$OUT/h200_extract_spy.json" 2>&1 \
                 | grep -v "^\[W\|WARNING" | tail -12 ;;
    moe) timeout 220 python3 -m pytest -m gpu tests/gpu/test_gpu_families.py tests/gpu/test_gpu_kernels.py \
           -k "moe or family" -q -p no:cacheprovider 2>&1 | grep -v "^[IW]1\|^|\|^+" | tail -15
         timeout 240 python3 bench/gpu_decode.py --shapes qwen3-30b-a3b --batches-8b 1 64 --repeats 1 \
           --no-hf --out "$OUT/h200_decode_moe.json" 2>&1 | grep "^{\|Error\|error" ;;
    moe_kernels) timeout 300 python3 bench/moe_kernels.py --out "$OUT/h200_moe_kernels.json" 2>&1 \
                   | grep -v "^\[W" ;;  # NOTE: the MoE pieces' launch sweeps (one H200)
    ablation) timeout 240 python3 bench/gpu_ablation.py --shape "${SHAPE:-qwen3-30b-a3b}" \
                --out "$OUT/h200_ablation_${SHAPE:-qwen3-30b-a3b}.json" 2>&1 | grep "^{\|Error" ;;
    moe_profile) timeout 200 python3 bench/gpu_profile.py --shape qwen3-30b-a3b --batches 1 --top 24 \
                   2>&1 | grep -v "^\[W" ;;
    tp_tests) timeout 300 python3 -m pytest -m gpu tests/gpu/test_gpu_tensor_parallel.py -q \
                -p no:cacheprovider 2>&1 | grep -v "^[IW]1\|^|\|^+" | tail -12 ;;  # NOTE: nvidia-h200-x2
    tp8b) for n in 1 2; do timeout 250 python3 bench/gpu_decode.py --shapes llama-8b --batches-8b 1 64 \
            --repeats 2 --no-hf --tensor-parallel $n --out "$OUT/h200x2_decode_8b_tp$n.json" 2>&1 \
            | grep "^{\|Error"
          done ;;
    two_instances) for g in "0" "0 1"; do  # NOTE: one instance at 64 streams, then one per GPU at 128
          c=$(( 64 * $(echo $g | wc -w) ))
          timeout 280 python3 bench/triton_stream_vs_direct.py --shape llama-1b --concurrency $c \
            --requests $(( 24 * c )) --new 256 --client-procs 8 --client-cpus 8 --gpus $g \
            --out "$OUT/h200x2_triton_gpus_${g// /_}.json" 2>&1 | grep -v "^|" | tail -3
          pkill -9 triton_python_b
        done ;;
    tp70b) timeout 550 python3 bench/gpu_decode.py --shapes llama-70b --batches-8b 1 64 --repeats 1 \
             --no-hf --tensor-parallel 2 --out "$OUT/h200x2_decode_70b_tp2.json" 2>&1 | grep "^{\|Error" ;;
    profile1) timeout 100 python3 bench/gpu_profile.py --batches 1 --top 24 2>&1 | grep -v "^\[W" ;;
    route64) timeout 150 python3 -m pytest -m gpu tests/gpu/test_gpu_kernels.py -k "route or one_token" -q \
               -p no:cacheprovider 2>&1 | tail -3
             R=hsserve.kernels.moe_route:MAX_PAIRS
             timeout 400 python3 bench/graph_flags_ab.py --batch "${BATCH:-64}" --rounds 3 \
               --variant torch $R=128 --variant kernel $R=512 \
               --out "$OUT/h200_route_ab_b${BATCH:-64}.json" 2>&1 | grep -v "^\[W" | tail -8 ;;
    guided) timeout 300 python3 bench/guided_cost.py --shape llama-1b --tokenizer .whl/tok --long 200 \
              --out "$OUT/${GUIDED_OUT:-h200_guided_cost}.json" 2>&1 | grep -v "^\[W\|Warning" | tail -8 ;;
    openai) timeout 400 python3 bench/openai_gateway.py --shape llama-1b --tokenizer .whl/tok \
              --concurrency 64 --out "$OUT/${OPENAI_OUT:-h200_openai_gateway}.json" 2>&1 \
              | grep -v "^[IW]1\|^\[W" | tail -6 ;;
    spec_verify) timeout 500 python3 bench/gpu_spec_verify.py --shape llama-8b --batches 1 16 --k 4 \
                   ${SPEC_ARGS:-} \
                   --out "$OUT/${SPEC_OUT:-h200_spec_decode}.json" 2>&1 | grep "^{\|Error" ;;
    none) ;;  # NOTE: the set-up only
    *) echo "gpu_session.sh: unknown part $part" >&2 ;;
  esac
done
