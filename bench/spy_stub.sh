#!/bin/bash
# Samples the Python backend stub of a running benchmark with py-spy (carry its wheel to the GPU
# machine). Start it beside bench/triton_stream_vs_direct.py, which writes the server log to
# $OUT/triton_bench_server.log: once the server is up, waits $1 s (default 4) for the gRPC load,
# then writes $OUT/stub_idle.txt (every thread, idle included) and $OUT/stub_gil.txt (only the
# thread holding the GIL), 6 s at 200 Hz each, as collapsed stacks ("--format raw").
until grep -q "Started GRPCInferenceService" "$OUT/triton_bench_server.log" 2>/dev/null; do sleep 0.5; done
sleep "${1:-4}"
pid=$(pgrep triton_python_b | head -1)
echo "stub pid $pid"
py-spy dump -p "$pid" > "$OUT/dump.txt" 2>&1
py-spy record -p "$pid" -d 6 -r 200 --threads --idle --subprocesses --nonblocking --format raw \
  -o "$OUT/stub_idle.txt" > "$OUT/spy1.log" 2>&1 &
py-spy record -p "$pid" -d 6 -r 200 --threads --gil --nonblocking --format raw \
  -o "$OUT/stub_gil.txt" > "$OUT/spy2.log" 2>&1
wait
