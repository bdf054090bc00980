"""The request fields that ask for structured outputs, as one ``StructuredOutputsParams``."""

from __future__ import annotations

from typing import Any

from tokenmill.entrypoints.openai.errors import OpenAIError
from tokenmill.entrypoints.openai.protocol import SamplingFields
from tokenmill.sampling_params import StructuredOutputsParams

GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
"""vLLM's legacy request fields -> the ``StructuredOutputsParams`` field each sets."""


def structured_outputs_of(request: SamplingFields) -> StructuredOutputsParams | None:
    """The constraint the request asks for, if any; a 400 naming the field when it is
    malformed or when more than one field asks for one."""
    given: dict[str, dict[str, Any]] = {}
    if request.structured_outputs is not None:
        given["structured_outputs"] = request.structured_outputs
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(request, name)
        if value is not None:
            given[name] = {kind: value}
    response_format = request.response_format
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            given["response_format"] = {"json_object": True}
        else:
            spec = response_format.json_schema
            if spec is None or spec.schema_ is None:
                raise OpenAIError(
                    "response_format of type json_schema needs json_schema.schema",
                    param="response_format",
                )
            given["response_format"] = {"json": spec.schema_}
    if not given:
        return None
    if len(given) > 1:
        raise OpenAIError(
            f"only one kind of structured output may be requested, got {', '.join(given)}",
            param=next(iter(given)),
        )
    param, fields = next(iter(given.items()))
    return structured_outputs_params(fields, param)


def structured_outputs_params(fields: dict[str, Any], param: str) -> StructuredOutputsParams:
    """``StructuredOutputsParams(**fields)``, or a 400 naming ``param``."""
    unknown = sorted(set(fields) - set(StructuredOutputsParams.__dataclass_fields__))
    if unknown:
        raise OpenAIError(
            f"{param} has unknown or unsupported field(s) {unknown}; supported: "
            f"{', '.join(StructuredOutputsParams.__dataclass_fields__)}",
            param=param,
        )
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as e:
        raise OpenAIError(f"{param}: {e}", param=param) from None
