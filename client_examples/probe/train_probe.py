"""Train a logistic probe on the model's hidden states and install it as hidden_classifier's head.

Reads topics.tsv (label<TAB>sentence), asks the running server for each sentence's MODE=last
hidden state (the final layer, max_tokens=0: the prompt's own last token), splits 70/30
(stratified, fixed seed), fits multinomial logistic regression on the standardized training rows,
reports held-out accuracy against the majority baseline, and writes head.safetensors, labels.txt
and probe.json into the hidden_classifier model folder (reload the model, or restart the server,
to serve it).

    python client_examples/probe/train_probe.py [--url 127.0.0.1:8001] [--save-features f.npz]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from extract_hidden_states import extract  # noqa: E402

from hsserve.triton.classifier_head import ClassifierHead  # noqa: E402

DEFAULT_OUT = os.path.join(HERE, "..", "..", "model_repository", "hidden_classifier", "1")


def load_dataset(path: str) -> tuple[list[str], list[str]]:
    labels, texts = [], []
    with open(path) as f:
        for line in f:
            label, text = line.rstrip("\n").split("\t", 1)
            labels.append(label)
            texts.append(text)
    return labels, texts


def split(y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        n_test = int(round(len(idx) * test_fraction))
        test += idx[:n_test].tolist()
        train += idx[n_test:].tolist()
    return np.array(sorted(train)), np.array(sorted(test))


def fit_logistic(x: torch.Tensor, y: torch.Tensor, classes: int, l2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Multinomial logistic regression (L-BFGS, L2 penalty): weight [classes, d], bias [classes]."""
    w = torch.zeros(classes, x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(classes, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=500, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ w.T + b, y) + l2 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach(), b.detach()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="127.0.0.1:8001")
    ap.add_argument("--model", default="llm_sync")
    ap.add_argument("--dataset", default=os.path.join(HERE, "topics.tsv"))
    ap.add_argument("--out", default=DEFAULT_OUT, help="the hidden_classifier version folder")
    ap.add_argument("--l2", type=float, default=1e-3)
    ap.add_argument("--test-fraction", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-features", default="", help="also write rows + labels to this .npz")
    args = ap.parse_args()

    labels, texts = load_dataset(args.dataset)
    names = sorted(set(labels))
    y = np.array([names.index(label) for label in labels])
    rows = extract(args.url, args.model, texts, [-1], max_tokens=0)
    if args.save_features:
        np.savez(args.save_features, rows=rows, labels=np.array(labels))
    train, test = split(y, args.test_fraction, args.seed)
    x = torch.from_numpy(rows).double()
    mean, std = x[train].mean(0), x[train].std(0).clamp_min(1e-6)
    z = (x - mean) / std
    w, b = fit_logistic(z[train], torch.from_numpy(y[train]), len(names), args.l2)
    pred = (z[test] @ w.T + b).argmax(1).numpy()
    accuracy = float((pred == y[test]).mean())
    majority = int(np.bincount(y[train]).argmax())
    baseline = float((y[test] == majority).mean())
    # NOTE: standardization folded into the layer: w (x - m) / s + b = (w / s) x + (b - w m / s)
    weight = (w / std).float()
    bias = (b - (w * mean / std).sum(1)).float()
    ClassifierHead({"weight": weight, "bias": bias}, names).save(args.out)
    report = {"labels": names, "layer": -1, "features": rows.shape[1], "train": len(train),
              "test": len(test), "accuracy": round(accuracy, 4),
              "majority_baseline": round(baseline, 4), "l2": args.l2, "seed": args.seed}
    with open(os.path.join(args.out, "probe.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report))
    print(f"held-out accuracy {accuracy:.1%} vs majority baseline {baseline:.1%} "
          f"({len(test)} sentences); head written to {os.path.abspath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
