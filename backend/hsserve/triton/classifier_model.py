"""TritonPythonModel for `hidden_classifier`: ClassifierHead over the last row of HIDDEN_STATES.

Dynamic batching hands several requests to one execute(): their last rows are classified in one
matrix product. A row of the wrong width is refused naming HIDDEN_STATES and the width expected.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from hsserve.triton.classifier_head import ClassifierHead

pb_utils = None  # NOTE: bound in initialize()


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        global pb_utils
        import triton_python_backend_utils as _pb

        pb_utils = _pb
        folder = os.path.join(args["model_repository"], args["model_version"])
        self.head = ClassifierHead.load(folder)
        pb_utils.Logger.log_info(
            f"hidden_classifier: {len(self.head.labels)} labels {self.head.labels}, "
            f"{self.head.num_features} features"
        )

    def execute(self, requests):
        responses: list = [None] * len(requests)
        rows, owners = [], []
        for i, request in enumerate(requests):
            t = pb_utils.get_input_tensor_by_name(request, "HIDDEN_STATES")
            x = torch.from_numpy(np.array(t.as_numpy(), dtype=np.float32, copy=True))
            if x.ndim != 2 or x.shape[0] < 1 or x.shape[1] != self.head.num_features:
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"HIDDEN_STATES: shape {list(x.shape)}; expected [rows >= 1, "
                    f"{self.head.num_features}] (one layer of the model this head was trained on)",
                    pb_utils.TritonError.INVALID_ARG))
                continue
            rows.append(x[-1])
            owners.append(i)
        if rows:
            probs = self.head(torch.stack(rows)).numpy()
            for p, i in zip(probs, owners):
                label = self.head.labels[int(p.argmax())]
                responses[i] = pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("PROBABILITIES", p[None, :].astype(np.float32)),
                    pb_utils.Tensor("LABEL", np.array([[label.encode()]], dtype=np.object_)),
                ])
        return responses
