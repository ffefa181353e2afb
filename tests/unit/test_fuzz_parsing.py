"""Request parsing under hypothesis: a request or a RequestError naming an input, nothing else.

Issue 7: request parsing under hypothesis: typed tensors of any dtype and shape, request
parameters and sampling_parameters JSON of any content: the result is a request or a
RequestError naming an input, never another exception."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsserve.request import RequestError
from hsserve.triton.tensors import INPUTS, parse_request

NAMES = list(INPUTS) + ["bogus", "MODE "]  # NOTE: Triton itself refuses names not in the config
DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint32, np.uint64, np.float16,
          np.float32, np.float64, np.bool_, np.object_]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
settings.register_profile("ci", max_examples=600, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")


@st.composite
def arrays(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    n = int(np.prod(shape)) if shape else 1
    if dtype is np.object_:
        items = draw(st.lists(st.binary(max_size=6) | st.text(max_size=6), min_size=n, max_size=n))
        arr = np.empty(n, dtype=np.object_)
        arr[:] = items
    elif dtype is np.bool_:
        arr = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=np.bool_)
    elif np.issubdtype(dtype, np.floating):
        width = {np.float16: 16, np.float32: 32}.get(dtype, 64)
        arr = np.array(draw(st.lists(st.floats(width=width), min_size=n, max_size=n)), dtype=dtype)
    else:
        info = np.iinfo(dtype)
        arr = np.array(draw(st.lists(st.integers(int(info.min), int(info.max)), min_size=n,
                                     max_size=n)), dtype=dtype)
    return arr.reshape(shape)


def check(tensors, parameters):
    try:
        parsed = parse_request("fuzz", tensors, parameters, 16)
    except RequestError as e:
        assert isinstance(e.input_name, str) and e.input_name and str(e).startswith(e.input_name)
        return
    sp = parsed.request.sampling
    try:  # NOTE: the engine's own checks (admission) must also only ever raise RequestError
        sp.validate(4096, 64)
    except RequestError as e:
        assert e.input_name and str(e)


@given(st.dictionaries(st.sampled_from(NAMES), arrays(), max_size=5),
       st.none() | json_values.map(json.dumps) | st.text(max_size=20))
def test_typed_tensors_and_parameters_never_crash(tensors, parameters):
    check(tensors, parameters)


@given(json_values.map(json.dumps) | st.text(max_size=30),
       st.dictionaries(st.sampled_from(["max_tokens", "temperature", "top_p", "top_k", "seed",
                                        "stop", "n", "MODE", "hidden_layers", "ignore_eos",
                                        "stop_token_ids", "stream"]), json_values, max_size=4))
def test_sampling_parameters_json_never_crashes(text, fields):
    base = {"text_input": np.array([b"hi"], dtype=np.object_)}
    check({**base, "sampling_parameters": np.array([text.encode()], dtype=np.object_)}, None)
    check({**base, "sampling_parameters": np.array([json.dumps(fields).encode()], dtype=np.object_)},
          None)
