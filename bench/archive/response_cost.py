"""What one streamed response costs inside Triton's Python stub, by how its tensors are built.

A probe model (written to a temporary repository) answers one request with N decoupled responses
from a thread, as the adapter's sender does, building each response one of five ways; it reports
the build time (Python, holding the GIL) and the total per response (build + send(), whose IPC
round trip releases the GIL). Variants: 0 text (object array) + output_ids and sequence_index
via torch + DLPack (the adapter before 94ef6e5); 1 the same with numpy numerics (now);
2 text as a bytes_ array; 3 output_ids alone; 4 an empty response.

    python bench/response_cost.py [--responses 2000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "backend"))
from hsserve.triton.server import start_server  # noqa: E402

CONFIG = """name: "probe"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
instance_group [{ count: 1, kind: KIND_CPU }]
input [ { name: "n", data_type: TYPE_INT32, dims: [ 1 ] },
        { name: "variant", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "text_output", data_type: TYPE_STRING, dims: [ -1 ] },
         { name: "output_ids", data_type: TYPE_INT32, dims: [ -1 ] },
         { name: "sequence_index", data_type: TYPE_UINT32, dims: [ 1 ] } ]
"""

MODEL = '''
import json, threading, time
import numpy as np
import torch
import triton_python_backend_utils as pb


def dl(name, v):
    return pb.Tensor.from_dlpack(name, torch.utils.dlpack.to_dlpack(v))


def build(v, i):
    ids = [i, i + 1, i + 2]
    if v == 0:
        return [pb.Tensor("text_output", np.array([b"tok"], dtype=np.object_)),
                dl("output_ids", torch.tensor(ids, dtype=torch.int32)),
                dl("sequence_index", torch.tensor([0], dtype=torch.uint32))]
    if v in (1, 2):
        text = np.array([b"tok"], dtype=np.object_ if v == 1 else np.bytes_)
        return [pb.Tensor("text_output", text), pb.Tensor("output_ids", np.asarray(ids, np.int32)),
                pb.Tensor("sequence_index", np.zeros(1, np.uint32))]
    if v == 3:
        return [pb.Tensor("output_ids", np.asarray(ids, np.int32))]
    return []


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            n = int(pb.get_input_tensor_by_name(r, "n").as_numpy()[0])
            v = int(pb.get_input_tensor_by_name(r, "variant").as_numpy()[0])
            threading.Thread(target=self.run, args=(r.get_response_sender(), n, v)).start()

    def run(self, sender, n, v):
        t0, building = time.perf_counter(), 0.0
        for i in range(n):
            a = time.perf_counter()
            response = pb.InferenceResponse(output_tensors=build(v, i))
            building += time.perf_counter() - a
            sender.send(response)
        total = time.perf_counter() - t0
        out = json.dumps([building / n * 1e6, total / n * 1e6]).encode()
        sender.send(pb.InferenceResponse(output_tensors=[
            pb.Tensor("text_output", np.array([out], dtype=np.object_))]),
            flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''


def main() -> None:
    import tritonclient.grpc as grpcclient

    ap = argparse.ArgumentParser()
    ap.add_argument("--responses", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    repo = tempfile.mkdtemp()
    os.makedirs(os.path.join(repo, "probe", "1"))
    with open(os.path.join(repo, "probe", "config.pbtxt"), "w") as f:
        f.write(CONFIG)
    with open(os.path.join(repo, "probe", "1", "model.py"), "w") as f:
        f.write(MODEL)
    server = start_server(repo, log_path=os.path.join(repo, "server.log"))
    try:
        server.wait_ready(timeout=120, models=("probe",))
        for _ in range(args.rounds):
            for variant in range(5):
                client = grpcclient.InferenceServerClient(server.grpc_url)
                got: queue.Queue = queue.Queue()
                client.start_stream(callback=lambda result, error: got.put((result, error)))
                inputs = []
                for name, value in (("n", args.responses), ("variant", variant)):
                    x = grpcclient.InferInput(name, [1], "INT32")
                    x.set_data_from_numpy(np.array([value], dtype=np.int32))
                    inputs.append(x)
                client.async_stream_infer("probe", inputs)
                while True:
                    result, error = got.get(timeout=120)
                    assert error is None, error
                    if result.get_response().parameters["triton_final_response"].bool_param:
                        build_us, total_us = json.loads(result.as_numpy("text_output")[0])
                        print(f"variant {variant}: build {build_us:.1f} us, build + send "
                              f"{total_us:.1f} us per response", flush=True)
                        break
                client.stop_stream()
                client.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
