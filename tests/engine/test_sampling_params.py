"""SamplingParams' range checks: every setting out of range is named, by its field."""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingError, SamplingParams


def test_settings_out_of_range_are_named_by_field_first_one_first():
    with pytest.raises(SamplingError) as info:
        SamplingParams(temperature=3.0, logprobs=21, logit_bias={7: 101.0})
    error = info.value
    assert isinstance(error, ValueError) and error.field == "temperature"
    assert [field for field, _ in error.problems] == ["temperature", "logprobs", "logit_bias"]
    assert str(error) == ("temperature must be in [0, 2], got 3.0; logprobs must be in "
                          "[0, 20], got 21; logit_bias for token 7 must be in [-100, 100], "
                          "got 101.0")  # fmt: skip


def test_a_caller_names_the_fields_its_own_way():
    with pytest.raises(SamplingError) as info:
        SamplingParams(logprobs=21, top_p=0.0)
    assert info.value.field == "top_p"
    assert info.value.describe({"logprobs": "top_logprobs"}) == (
        "top_p must be in (0, 1], got 0.0; top_logprobs must be in [0, 20], got 21")


@pytest.mark.parametrize("field", ["top_k", "min_p", "presence_penalty",
                                   "frequency_penalty", "repetition_penalty",
                                   "max_tokens", "prompt_logprobs"])  # fmt: skip
def test_each_setting_is_checked(field):
    with pytest.raises(SamplingError) as info:
        SamplingParams(**{field: -3})
    assert info.value.field == field and str(info.value).startswith(f"{field} must be")


def test_settings_in_range_pass():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=1.0, presence_penalty=-2.0,
                   repetition_penalty=2.0, logprobs=20, logit_bias={1: -100.0})  # fmt: skip
