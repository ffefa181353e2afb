"""ClassifierHead: a small torch head over one hidden-state row (a probe, a safety head).

Stored as `head.safetensors` (float32): `weight` [classes, features] and `bias` [classes], with an
optional hidden layer `hidden.weight` [width, features] and `hidden.bias` [width] (then ReLU) in
front; label names one per line in `labels.txt`. Feature standardization, if any, is folded into
the first layer when the head is written.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file, save_file


class ClassifierHead(torch.nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor], labels: list[str]):
        super().__init__()
        self.tensors = {k: v.float() for k, v in tensors.items()}
        self.labels = labels
        w = self.tensors["weight"]
        if w.shape[0] != len(labels):
            raise ValueError(f"head has {w.shape[0]} classes but {len(labels)} labels")
        first = self.tensors.get("hidden.weight", w)
        self.num_features = first.shape[1]

    @classmethod
    def load(cls, folder: str) -> ClassifierHead:
        with open(os.path.join(folder, "labels.txt")) as f:
            labels = [line.strip() for line in f if line.strip()]
        return cls(load_file(os.path.join(folder, "head.safetensors")), labels)

    def save(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.tensors.items()},
                  os.path.join(folder, "head.safetensors"))
        with open(os.path.join(folder, "labels.txt"), "w") as f:
            f.write("\n".join(self.labels) + "\n")

    @torch.no_grad()
    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, features] -> class probabilities [n, classes] (float32, rows sum to 1)."""
        x = rows.float()
        t = self.tensors
        if "hidden.weight" in t:
            x = torch.relu(x @ t["hidden.weight"].T + t["hidden.bias"])
        return torch.softmax(x @ t["weight"].T + t["bias"], dim=-1)
