"""The ``eagle``, ``eagle3`` and ``mtp`` proposers: greedy output equals the non-speculative
run (plain, chunked prefill, preemption, prefix caching; every block freed), with tiny random
heads written here in the layouts the EAGLE authors publish, and a DeepSeek-V3 checkpoint's
own MTP layer."""

from __future__ import annotations

import copy
import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_checkpoint
from support.deepseek_checkpoints import write_mtp_checkpoint
from support.eagle_heads import write_eagle_head
from support.spec_decode_common import ENGINES, assert_same, generate, generate_toggling, random_prompts
from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("eagle")
    # layers 2, n // 2 and n - 3 of an EAGLE-3 target must exist
    target = make_tiny_checkpoint(root / "target", num_hidden_layers=6)
    write_mtp_checkpoint(root / "deepseek")
    return {
        "target": target,
        "eagle": write_eagle_head(root / "eagle", target),
        "eagle3": write_eagle_head(root / "eagle3", target, draft_vocab_size=96),
        "eagle3-own-embedding": write_eagle_head(root / "eagle3e", target, 96, own_embedding=True),
        "deepseek": str(root / "deepseek"),
    }


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    return random_prompts()


@pytest.fixture(scope="module")
def references(models, prompts) -> dict[str, list[list[int]]]:
    return {
        target: generate(LLM(model=models[target], num_kv_blocks=256, max_model_len=256), prompts)
        for target in ("target", "deepseek")
    }


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("head", ["eagle", "eagle3", "eagle3-own-embedding", "mtp"])
def test_greedy_equals_non_speculative(models, prompts, references, head, engine):
    target = "deepseek" if head == "mtp" else "target"
    spec = {"method": head.split("-")[0], "num_speculative_tokens": 3, "disable_by_batch_size": 0}
    if head != "mtp":
        spec["model"] = models[head]
    llm = LLM(model=models[target], max_model_len=256, speculative_config=spec, **ENGINES[engine])
    assert generate(llm, prompts) == references[target]
    if engine == "plain":
        assert generate(llm, prompts) == references[target]
        assert llm.get_stats()["prefix_cache_hit_tokens"] > 0
    stats = llm.get_stats()
    assert stats["spec_num_drafts"] > 0
    if engine == "preempting":
        assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("method", ["eagle3", "mtp", "draft_model"])
def test_prompt_lookup_drafts_first(models, prompts, references, method, engine, monkeypatch):
    """With ``prompt_lookup_*`` a model's request takes the lookup's drafts where its tokens
    end in a suffix that recurs, the model's elsewhere (the target as its own draft for
    ``draft_model``); outputs stay exact."""
    from tokenmill.spec_decode import model_proposer

    lookups, proposals = [], []
    lookup, propose = model_proposer.prompt_lookup, model_proposer.ModelProposer.propose

    def recorded_lookup(*args):
        found = lookup(*args)
        lookups.append(copy.deepcopy(found))
        return found

    monkeypatch.setattr(model_proposer, "prompt_lookup", recorded_lookup)
    monkeypatch.setattr(model_proposer.ModelProposer, "propose",
                        lambda self, b: proposals.append(propose(self, b)) or proposals[-1])
    target = "deepseek" if method == "mtp" else "target"
    spec = {"method": method, "num_speculative_tokens": 3, "disable_by_batch_size": 0,
            "prompt_lookup_min": 1, "prompt_lookup_max": 3, "adaptive_draft_length": False}
    if method != "mtp":
        spec["model"] = models["eagle3" if method == "eagle3" else "target"]
    llm = LLM(model=models[target], max_model_len=256, speculative_config=spec, **ENGINES[engine])
    assert generate(llm, prompts) == references[target]
    assert len(lookups) == len(proposals)
    found = [x.num_draft_tokens > 0 for x in lookups]
    assert any(f.any() for f in found) and not all(f.all() for f in found)
    for f, x, got in zip(found, lookups, proposals):
        assert (got.num_draft_tokens[f] == x.num_draft_tokens[f]).all()
        assert (got.draft_token_ids[f] == x.draft_token_ids[f]).all()
        assert (got.num_draft_tokens[~f] == got.draft_token_ids.shape[1]).all()  # the step's length


def test_a_step_that_does_not_speculate_runs_the_head_without_drafting(models, prompts, references, monkeypatch):
    """Speculation off for every step (``disable_by_batch_size`` 1): the head still runs after
    each step, over no request to draft for (only its cache pass), and nothing is drafted.
    With a cut-off of 4 and requests ending one by one, drafting resumes; outputs stay exact."""
    from tokenmill.spec_decode.eagle import HeadProposer

    calls = []
    propose = HeadProposer.propose

    def spy(self, batch):
        calls.append(len(batch.rows))
        return propose(self, batch)

    monkeypatch.setattr(HeadProposer, "propose", spy)
    spec = {"method": "eagle3", "model": models["eagle3"], "num_speculative_tokens": 3, "adaptive_draft_length": False}
    llm = LLM(model=models["target"], num_kv_blocks=256, max_model_len=256,
              speculative_config=spec | {"disable_by_batch_size": 1})
    assert generate(llm, prompts) == references["target"]
    assert calls and not any(calls)
    assert llm.get_stats()["spec_num_drafts"] == 0
    llm = LLM(model=models["target"], num_kv_blocks=256, max_model_len=256,
              speculative_config=spec | {"disable_by_batch_size": 4})
    lengths = [3 * i + 3 for i in range(len(prompts))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    expected = [ref[:n] for ref, n in zip(references["target"], lengths)]
    assert generate(llm, prompts, params) == expected
    assert llm.get_stats()["spec_num_drafts"] > 0


def record_drafts(monkeypatch) -> dict[tuple[int, ...], list[int]]:
    """Every head's drafts from now on, by the request's tokens when it drafted them (the
    longest, where requests drafted after the same tokens)."""
    from tokenmill.spec_decode.eagle import HeadProposer

    drafts: dict[tuple[int, ...], list[int]] = {}
    propose = HeadProposer.propose

    def spy(self, batch):
        proposal = propose(self, batch)
        for j, row in enumerate(batch.rows):
            tokens = tuple(batch.input_batch.token_ids[row, : batch.input_batch.num_tokens[row]].tolist())
            draft = proposal.draft_token_ids[j, : proposal.num_draft_tokens[j]].tolist()
            if len(draft) >= len(drafts.get(tokens, ())):  # another request's, nearer its end
                drafts[tokens] = draft
        return proposal

    monkeypatch.setattr(HeadProposer, "propose", spy)
    return drafts


FRESH = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
"""A fresh request's sampling, with room for 3 drafts after its first token."""


def assert_fresh_drafts(fresh: dict[tuple[int, ...], list[int]], recorded: dict[tuple[int, ...], list[int]]) -> None:
    """Each recorded draft is what a fresh request of the same tokens drafted first (its
    start: a recorded draft near its request's ``max_tokens`` is shorter)."""
    for tokens, draft in recorded.items():
        assert fresh[tokens][: len(draft)] == draft, tokens


@pytest.mark.parametrize("head", ["eagle", "eagle3", "mtp"])
def test_toggling_speculation_keeps_the_heads_cache_complete(models, prompts, head, monkeypatch):
    """Concurrency 1 -> 3 -> 1 under the default cut-off of 2. Every output field equals the
    non-speculative run's, and every draft, before and after the steps that did not speculate,
    is the one the head makes for a fresh request of the same tokens (whose head cache is
    complete): those steps left no holes in the head's cache."""
    drafts = record_drafts(monkeypatch)
    target = "deepseek" if head == "mtp" else "target"
    spec = {"method": head, "num_speculative_tokens": 3, "adaptive_draft_length": False}
    if head != "mtp":
        spec["model"] = models[head]
    long_prompt, *short = (p["prompt_token_ids"] for p in prompts[:3])
    engine = {"model": models[target], "num_kv_blocks": 256, "max_model_len": 256}
    reference, _, _ = generate_toggling(LLM(**engine), long_prompt, short, max_tokens=48)
    outputs, _, resumed = generate_toggling(LLM(**engine, speculative_config=spec), long_prompt, short, max_tokens=48)
    for got, expected in zip(outputs, reference):
        assert_same(got.outputs[0], expected.outputs[0], "speculative vs plain")
    assert resumed["spec_num_drafts"] > 0
    toggling = {tokens: d for tokens, d in drafts.items() if tokens[: len(long_prompt)] == tuple(long_prompt)}
    drafts.clear()
    fresh = LLM(**engine, speculative_config=spec | {"disable_by_batch_size": 0})
    generate(fresh, [{"prompt_token_ids": list(t[:-1])} for t in toggling], FRESH)
    assert_fresh_drafts(drafts, toggling)


@pytest.mark.parametrize("defer_max", [None, 4], ids=["deferred", "capped"])
def test_a_prefix_hit_on_blocks_of_a_request_that_never_drafted_finds_the_heads_cache(models, monkeypatch, defer_max):
    """Two requests run together under a cut-off of 2, so no step drafts and the head keeps
    its cache writes back; they finish, and a request whose prompt extends one of theirs
    hits its blocks and drafts alone: its drafts are a fresh engine's for the same tokens,
    because the head wrote its cache for the leaving requests (``release``). With a cap of 4
    kept positions the head writes every step instead; the same drafts."""
    from tokenmill.spec_decode import eagle

    if defer_max is not None:
        monkeypatch.setattr(eagle, "DEFER_MAX_POSITIONS", defer_max)
    drafts = record_drafts(monkeypatch)
    rng = random.Random(5)
    shared, other = ([rng.randrange(256) for _ in range(40)] for _ in range(2))
    spec = {"method": "eagle3", "model": models["eagle3"], "num_speculative_tokens": 3,
            "adaptive_draft_length": False, "disable_by_batch_size": 2}
    engine = {"model": models["target"], "num_kv_blocks": 256, "max_model_len": 256}
    llm = LLM(**engine, speculative_config=spec)
    together = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    generate(llm, [{"prompt_token_ids": shared}, {"prompt_token_ids": other}], together)
    assert not drafts and llm.get_stats()["spec_num_drafts"] == 0
    generate(llm, [{"prompt_token_ids": shared + [7, 9]}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert llm.get_stats()["prefix_cache_hit_tokens"] >= 32
    hit = dict(drafts)
    assert hit and max(map(len, hit.values())) == 3
    drafts.clear()
    fresh = LLM(**engine, speculative_config=spec | {"disable_by_batch_size": 0})
    generate(fresh, [{"prompt_token_ids": list(t[:-1])} for t in hit], FRESH)
    assert_fresh_drafts(drafts, hit)


def test_mtp_reuses_its_layer_beyond_num_nextn_predict_layers(models, prompts, references):
    """k = 4 with one MTP layer: the layer runs at every depth (drafts of 4 tokens, fewer only
    near max_tokens), output unchanged."""
    spec = {"method": "mtp", "num_speculative_tokens": 4, "disable_by_batch_size": 0, "adaptive_draft_length": False}
    llm = LLM(model=models["deepseek"], num_kv_blocks=256, max_model_len=256, speculative_config=spec)
    assert generate(llm, prompts[:3]) == references["deepseek"][:3]
    stats = llm.get_stats()
    assert 3 * stats["spec_num_drafts"] < stats["spec_num_draft_tokens"] <= 4 * stats["spec_num_drafts"]


def test_refused_configs_name_the_problem(models):
    cases = [
        ({"method": "mtp"}, models["target"], r"'mtp' needs a target with MTP layers"),
        ({"method": "mtp", "model": models["eagle"]}, models["deepseek"], r"\['model'\] .* method 'mtp' runs the MTP layers of the target"),
        ({"method": "eagle"}, models["target"], r"\['model'\] is required for method 'eagle'"),
        ({"method": "eagle3", "model": models["eagle3"]}, models["deepseek"], r"eagle3 heads use standard attention; the target DeepseekV3ForCausalLM has MLA layers"),
    ]
    for spec, target, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(model=target, num_kv_blocks=64, max_model_len=256,
                speculative_config={"num_speculative_tokens": 2, **spec})


def _training_script():
    """``scripts/train_eagle.py``, whose whole-sequence heads trained the shipped ones."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "train_eagle.py"
    spec = importlib.util.spec_from_file_location("train_eagle", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_eagle"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_drafts_are_the_training_heads(models, tmp_path, monkeypatch, method):
    """The engine's EAGLE-1 and EAGLE-3 heads, run step by step over the paged cache, draft
    what the training script's heads (whole sequence, the training-time-test attention)
    predict, from the files that script writes."""
    import transformers

    from tokenmill.spec_decode.eagle import HeadProposer

    train = _training_script()
    cfg = json.loads((Path(models["target"]) / "config.json").read_text())
    hf = transformers.LlamaForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()
    embed = hf.model.embed_tokens.weight.detach()
    torch.manual_seed(0)
    draft_ids = torch.randperm(cfg["vocab_size"])[:96].sort().values
    if method == "eagle3":
        head = train.Eagle3Head(cfg, embed, 96)
    else:  # the target's LM head rows of the draft vocabulary, shipped as the head's (float16)
        head = train.EagleHead(cfg, embed, hf.lm_head.weight.detach()[draft_ids].half().float())
    with torch.no_grad():
        for name, param in head.named_parameters():
            param.copy_((1 + torch.randn_like(param) / 10) if "norm" in name else torch.randn_like(param) * 0.3)
            param.copy_(param.half().float())  # as saved
    train.save_head(tmp_path / "head", head, cfg, draft_ids)

    proposals = []
    propose = HeadProposer.propose

    def spy(self, batch):
        proposal = propose(self, batch)
        if len(batch.rows):
            proposals.append(proposal.draft_token_ids.copy())
        return proposal

    monkeypatch.setattr(HeadProposer, "propose", spy)
    spec = {"method": method, "model": str(tmp_path / "head"), "num_speculative_tokens": 3, "adaptive_draft_length": False}
    llm = LLM(model=models["target"], num_kv_blocks=64, max_model_len=256, speculative_config=spec)
    prompt = [random.Random(1).randrange(256) for _ in range(21)]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    ids = prompt + out[0].outputs[0].token_ids[:1]

    with torch.no_grad():
        states = hf.model(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states
        if method == "eagle3":
            feats = torch.cat([states[i][0] for i in (2, 3, 3)], dim=-1)  # 2, n // 2, n - 3 of 6 layers
        else:
            feats = states[-1][0]  # the final, normalised state
        next_ids, expected = torch.tensor(ids[1:]), []
        for j in range(3):
            logits = head.logits(head(next_ids[None], feats[None], steps=j + 1)[j][0, len(prompt) - 1 + j])
            expected.append(int(draft_ids[logits.argmax()]))
            next_ids = torch.cat((next_ids, torch.tensor(expected[-1:])))
            feats = torch.cat((feats, torch.zeros(1, feats.shape[1])))  # never read: only step 0 reads it
    assert proposals[0][0].tolist() == expected


@pytest.mark.parametrize("missing", ["d2t", "lm_head.weight"])
def test_a_draft_vocabulary_needs_its_mapping_and_rows(models, tmp_path, missing):
    """An EAGLE-1 head with a draft vocabulary smaller than the target's must bring ``d2t`` and
    its own LM head rows (the target's cover every token)."""
    from safetensors.torch import load_file, save_file

    head = tmp_path / "head"
    head.mkdir()
    config = json.loads((Path(models["eagle"]) / "config.json").read_text())
    (head / "config.json").write_text(json.dumps(config | {"draft_vocab_size": 96}))
    tensors = load_file(str(Path(models["eagle"]) / "model.safetensors"))
    tensors |= {"d2t": torch.zeros(96, dtype=torch.int64), "lm_head.weight": torch.randn(96, config["hidden_size"])}
    del tensors[missing]
    save_file(tensors, str(head / "model.safetensors"))
    message = "lacks its d2t mapping" if missing == "d2t" else "lacks its own lm_head"
    with pytest.raises(ValueError, match=message):
        LLM(model=models["target"], num_kv_blocks=64, max_model_len=256,
            speculative_config={"method": "eagle", "model": str(head), "num_speculative_tokens": 2})
