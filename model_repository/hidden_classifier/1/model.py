"""The `hidden_classifier` model: a small torch head over HIDDEN_STATES (head.safetensors, labels.txt)."""

from hsserve.triton.classifier_model import TritonPythonModel  # noqa: F401
