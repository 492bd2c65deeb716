"""The Tinker codec's ``target_prompt_logprobs`` (TensorData JSON, dense or sparse CSR) and
the layout its answer keeps (no torch, no HTTP)."""

from typing import Any

import msgspec
import pytest

from adapters.http.tinker.codec import json as json_codec
from domain.tinker.errors import InvalidTrainingRequest
from domain.tinker.values import PromptTable


def targets(**fields: Any) -> PromptTable | None:
    body = {"data": [], "dtype": "int64", **fields}
    return json_codec.prompt_targets(msgspec.convert(body, json_codec.SampleTensorIn))


def test_a_dense_table_keeps_its_cells_and_asks_each_row_for_its_distinct_ids() -> None:
    table = targets(data=[5, -1, 7, 7, 7, -1, 9, 5, -1], shape=[3, 3])
    assert table is not None
    assert table.shape == (3, 3) and table.crow_indices is None
    assert table.row_ids() == ((5, 7), (7,), (5, 9))
    scored = table.scored([{5: -1.0, 7: -2.0}, {7: -5.0}, {5: -3.0, 9: -4.0}])
    # -1 cells answer 0.0; a repeated id its one logprob
    assert list(scored.values) == [-1.0, 0.0, -2.0, -5.0, -5.0, 0.0, -4.0, -3.0, 0.0]
    assert scored.shape == (3, 3) and scored.crow_indices is None


def test_a_sparse_table_lists_only_its_cells_and_the_answer_keeps_the_layout() -> None:
    # [[-1, 4], [-1, -1], [6, 8]] as torch's CSR: rows 0 and 2 hold cells
    table = targets(
        data=[4, 6, 8], shape=[3, 2], sparse_crow_indices=[0, 1, 1, 3], sparse_col_indices=[1, 0, 1]
    )
    assert table is not None
    assert table.row_ids() == ((4,), (), (6, 8))
    scored = table.scored([{4: -0.5}, {}, {6: -1.5, 8: -2.5}])
    assert list(scored.values) == [-0.5, -1.5, -2.5]
    assert (scored.crow_indices, scored.col_indices) == ((0, 1, 1, 3), (1, 0, 1))


def test_a_sparse_cell_may_still_say_minus_one() -> None:
    table = targets(
        data=[-1, 3], shape=[1, 2], sparse_crow_indices=[0, 2], sparse_col_indices=[0, 1]
    )
    assert table is not None and table.row_ids() == ((3,),)
    assert list(table.scored([{3: -0.25}]).values) == [0.0, -0.25]


def test_integral_floats_are_ids_and_no_table_is_none() -> None:
    table = targets(data=[2.0, -1.0], shape=[1, 2])
    assert table is not None and list(table.values) == [2, -1]
    assert json_codec.prompt_targets(None) is None


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"data": [1.0], "dtype": "float32", "shape": [1, 1]}, "dtype must be int64"),
        ({"data": [1, 2], "shape": [2]}, "2-D"),
        ({"data": [1, 2]}, "2-D"),
        ({"data": [1, 2], "shape": [-1, 2]}, "2-D"),
        ({"data": [1, 2, 3], "shape": [2, 2]}, "holds 4 values, got 3"),
        ({"data": [1, -2], "shape": [1, 2]}, "-2 is neither a token id nor -1"),
        ({"data": [1.5], "shape": [1, 1]}, "1.5 is neither"),
        ({"data": [2**31], "shape": [1, 1]}, "neither a token id"),
        ({"data": [1], "shape": [1, 1], "sparse_crow_indices": [0, 1]}, "come together"),
        (
            {
                "data": [1],
                "shape": [2, 1],
                "sparse_crow_indices": [0, 1],
                "sparse_col_indices": [0],
            },
            "3 row pointers",
        ),
        (
            {
                "data": [1],
                "shape": [1, 1],
                "sparse_crow_indices": [1, 1],
                "sparse_col_indices": [0],
            },
            "row pointers from 0",
        ),
        (
            {
                "data": [1, 2],
                "shape": [2, 2],
                "sparse_crow_indices": [0, 2, 1],
                "sparse_col_indices": [0, 1],
            },
            "row pointers",
        ),
        (
            {
                "data": [1, 2],
                "shape": [2, 2],
                "sparse_crow_indices": [0, 2, 2],
                "sparse_col_indices": [0, 2],
            },
            "row 0's sparse_col_indices must increase within 0..1",
        ),
        (
            {
                "data": [1, 2],
                "shape": [1, 2],
                "sparse_crow_indices": [0, 2],
                "sparse_col_indices": [1, 1],
            },
            "must increase",
        ),
        (
            {
                "data": [1, 2, 3],
                "shape": [3, 2],
                "sparse_crow_indices": [0, 2, 1, 3],
                "sparse_col_indices": [0, 1, 0],
            },
            "must not decrease",
        ),
    ],
)
def test_bad_tables_are_refused_naming_the_field(fields: dict[str, Any], why: str) -> None:
    with pytest.raises(InvalidTrainingRequest, match="target_prompt_logprobs") as caught:
        targets(**fields)
    assert why in str(caught.value)


def test_a_non_integer_id_list_is_a_bad_body_naming_the_field() -> None:
    body = b'{"prompt": {"chunks": []}, "sampling_params": {}, "target_prompt_logprobs": 3}'
    with pytest.raises(InvalidTrainingRequest, match="target_prompt_logprobs"):
        json_codec.decode(body, json_codec.SampleIn)
