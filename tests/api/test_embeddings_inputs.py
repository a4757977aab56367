"""The embeddings API's pure parts: which inputs it takes (and the 400 for each it does not),
what `dimensions` and `normalize` do to a vector, and base64 as the openai SDK decodes it."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from llmbus.services.api.embeddings import encode_vector, finish_vectors, inputs_of
from llmbus.services.api.errors import OpenAIError


def test_each_input_form():
    assert inputs_of("hi", 8) == ["hi"]
    assert inputs_of(["a", "b"], 8) == ["a", "b"]
    assert inputs_of([1, 2, 3], 8) == [[1, 2, 3]]  # one input of token ids
    assert inputs_of([[1, 2], [3]], 8) == [[1, 2], [3]]


@pytest.mark.parametrize("value, needle", [
    ("", "empty string"), ([], "must not be empty"), ([[]], "token-id lists"),
    (["a", 1], "token-id lists"), ([True, False], "token-id lists"),
    (["x"] * 9, "at most 8 items"), ([2**64], "token ids are between"),
    ([[1], [-1]], "token ids are between")])
def test_bad_inputs_are_400s(value, needle):
    with pytest.raises(OpenAIError) as caught:
        inputs_of(value, 8)
    assert caught.value.status_code == 400 and needle in caught.value.message
    assert caught.value.param == "input"


def test_dimensions_keep_the_first_components_then_normalise():
    vectors = np.array([[3.0, 4.0, 12.0], [1.0, 0.0, 0.0]], dtype=np.float32)
    np.testing.assert_allclose(finish_vectors(vectors, normalize=True, dimensions=None)[0],
                               [3 / 13, 4 / 13, 12 / 13], rtol=1e-6)
    np.testing.assert_allclose(finish_vectors(vectors, normalize=True, dimensions=2)[0],
                               [0.6, 0.8], rtol=1e-6)
    assert finish_vectors(vectors, normalize=False, dimensions=2).tolist()[0] == [3.0, 4.0]
    with pytest.raises(OpenAIError) as caught:
        finish_vectors(vectors, normalize=True, dimensions=4)
    assert caught.value.param == "dimensions"


def test_base64_is_little_endian_float32():
    vector = np.array([1.0, -2.5, 0.125], dtype=np.float32)
    decoded = np.frombuffer(base64.b64decode(encode_vector(vector, "base64")), dtype="<f4")
    assert decoded.tolist() == vector.tolist()  # exact: the same float32 bits
    assert encode_vector(vector, "float") == [1.0, -2.5, 0.125]
