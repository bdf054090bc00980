"""Structured outputs in the engine: every sample of a JSON schema, regex or choice request
holds to it, under greedy and random sampling, on the default model; a constraint that does
not compile is a ``ValueError`` and the engine goes on serving."""

from __future__ import annotations

import json
import random
import re
import string
import time

import numpy as np
import pytest
import torch

from tokenmill import LLM, SamplingParams, StructuredOutputsParams
from tokenmill.sampling_params import MAX_CHOICES, MAX_CONSTRAINT_CHARS
from tokenmill.engine.input_processor import EngineCoreRequest
from tokenmill.structured_output.bitmask import apply_grammar_bitmask

jsonschema = pytest.importorskip("jsonschema")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
}


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(model=default_model_dir, max_num_seqs=64, kv_cache_memory_bytes=256 * 2**20)


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="unknown or unsupported"):
        SamplingParams(structured_outputs={"regex": "a", "backend": "outlines"})
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.kind == "regex"


def test_bitmask_masks_only_the_rows_it_names():
    logits = torch.zeros(3, 70)
    bitmask = np.zeros((1, 3), dtype=np.int32)
    bitmask[0, 0] = 0b101
    bitmask[0, 2] = 1 << (69 - 64)
    apply_grammar_bitmask(logits, [1], bitmask)
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0, 2, 69]
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()


def test_json_schema_50_requests_all_validate(llm):
    prompts = [f"Write a JSON record for person number {i}:" for i in range(50)]
    params = [
        SamplingParams(
            temperature=0 if i % 5 == 0 else 1.0,
            seed=None if i % 5 == 0 else i,
            max_tokens=120,
            structured_outputs=StructuredOutputsParams(json=PERSON, disable_any_whitespace=True),
        )
        for i in range(50)
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for out in outputs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), PERSON)
    assert len({o.outputs[0].text for o in outputs}) > 10, "random rows sample different records"


def test_regex_and_choice_hold_on_every_sample(llm):
    regex = SamplingParams(
        n=8, temperature=1.5, seed=1, max_tokens=16,
        structured_outputs=StructuredOutputsParams(regex=r"[A-Z][a-z]{2,6}-[0-9]{3}"),
    )
    choice = SamplingParams(
        n=8, temperature=1.5, seed=2, max_tokens=16,
        structured_outputs=StructuredOutputsParams(choice=["red", "green", 'say "blue"']),
    )
    greedy = SamplingParams(
        temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(regex=r"\d{3}-\d{4}")
    )
    out_regex, out_choice, out_greedy = llm.generate(
        ["Product code:", "Pick a colour:", "Phone number:"], [regex, choice, greedy], use_tqdm=False
    )
    for c in out_regex.outputs:
        assert re.fullmatch(r"[A-Z][a-z]{2,6}-[0-9]{3}", c.text), c.text
    assert {c.text for c in out_choice.outputs} <= {"red", "green", 'say "blue"'}
    assert re.fullmatch(r"\d{3}-\d{4}", out_greedy.outputs[0].text)


def test_grammar_and_json_object(llm):
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9]'
    params = [
        SamplingParams(temperature=1.0, seed=4, max_tokens=24,
                       structured_outputs=StructuredOutputsParams(grammar=grammar)),
        SamplingParams(temperature=0, max_tokens=64,
                       structured_outputs=StructuredOutputsParams(json_object=True)),
    ]
    out_grammar, out_object = llm.generate(["Sum:", "A JSON object:"], params, use_tqdm=False)
    assert re.fullmatch(r"\([1-9](\+[1-9])*\)", out_grammar.outputs[0].text)
    if out_object.outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(out_object.outputs[0].text), dict)
    else:
        assert out_object.outputs[0].text.lstrip().startswith("{")


def test_ignore_eos_still_finishes_when_the_grammar_terminates(llm):
    params = SamplingParams(
        temperature=0, max_tokens=32, ignore_eos=True,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    [out] = llm.generate(["Is water wet?"], params, use_tqdm=False)
    assert out.outputs[0].text in ("yes", "no") and out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "constraint, problem",
    [
        ({"json": {"type": "nonsense"}}, "nonsense"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"regex": "(abc"}, "parenthesis"),
        ({"grammar": "root ::= missing"}, "missing"),
    ],
)
def test_constraint_that_does_not_compile_is_a_value_error(llm, constraint, problem):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match="does not compile") as err:
        llm.generate(["x"], params, use_tqdm=False)
    assert problem in str(err.value)
    [out] = llm.generate(["The capital of France is"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


def test_request_waits_outside_the_scheduler_until_its_grammar_compiled(llm):
    core = llm.llm_engine.engine_core.engine_core
    constraint = StructuredOutputsParams(choice=["alpha", "beta"])
    llm.llm_engine.add_request("fsm", "x", SamplingParams(max_tokens=12, structured_outputs=constraint))
    assert "0_fsm" in core.waiting_for_fsm and "0_fsm" not in core.scheduler.requests
    outputs = []
    while llm.llm_engine.has_unfinished_requests():
        outputs += llm.llm_engine.step()
    assert not core.waiting_for_fsm
    assert outputs[-1].outputs[0].text in ("alpha", "beta")


def test_core_finishes_a_request_whose_grammar_fails_to_compile(llm):
    core = llm.llm_engine.engine_core.engine_core
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(abc"))
    core.add_request(EngineCoreRequest("bad", [1, 2, 3], params, None, 4, time.monotonic()))
    outputs = []
    while core.has_unfinished_requests():
        outputs += core.step().outputs
    assert [(o.req_id, o.new_token_ids, o.finish_reason) for o in outputs] == [("bad", [], "error")]


def test_oversized_constraints_are_refused():
    with pytest.raises(ValueError, match=f"choice has {MAX_CHOICES + 1} options; at most"):
        StructuredOutputsParams(choice=[str(i) for i in range(MAX_CHOICES + 1)])
    with pytest.raises(ValueError, match=f"regex is {MAX_CONSTRAINT_CHARS + 1} characters"):
        StructuredOutputsParams(regex="a" * (MAX_CONSTRAINT_CHARS + 1))
    with pytest.raises(ValueError, match="json is .* characters long; at most"):
        StructuredOutputsParams(json={"enum": ["x" * 100] * 3000})
    with pytest.raises(ValueError, match="choice is .* characters long; at most"):
        StructuredOutputsParams(choice=["x" * 100] * 3000)
    assert StructuredOutputsParams(choice=[str(i) for i in range(MAX_CHOICES)]).kind == "choice"


def test_a_compile_past_the_time_limit_fails_its_request_alone(llm, monkeypatch):
    """A constraint that takes seconds to compile (10,000 options of 16 letters and spaces)
    fails once it has compiled for longer than TOKENMILL_GRAMMAR_COMPILE_TIMEOUT; a small one
    added after it compiles beside it and completes."""
    monkeypatch.setenv("TOKENMILL_GRAMMAR_COMPILE_TIMEOUT", "2")
    rng = random.Random(7)
    huge = ["".join(rng.choices(string.ascii_lowercase + " ", k=16)) for _ in range(10_000)]
    core = llm.llm_engine.engine_core.engine_core
    for req_id, choice in (("huge", huge), ("small", ["alpha", "beta"])):
        params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=choice))
        core.add_request(EngineCoreRequest(req_id, [1, 2, 3], params, None, 16, time.monotonic()))
    outputs = {}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            outputs.setdefault(o.req_id, []).append(o)
    assert [(o.new_token_ids, o.finish_reason) for o in outputs["huge"]] == [([], "error")]
    assert outputs["small"][-1].finish_reason == "stop"
    ids = [t for o in outputs["small"] for t in o.new_token_ids]
    assert llm.get_tokenizer().decode(ids, skip_special_tokens=True) in ("alpha", "beta")
