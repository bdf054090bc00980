"""lm-eval, a harness written elsewhere, scores ``tokenmill serve`` (``local-completions``)
as it scores HF ``transformers`` (``hf``) on the same weights, on one loglikelihood and one
generate-until task defined from the local files in ``tests/support/lm_eval_tasks``.

The two ``lm_eval`` commands are docs/logprobs_and_eval.md's, run as written against the shared
``default_server`` (the page's ``tokenmill serve --port 8000 &`` with the test flags), with
``$M`` the default model's directory and ``--output_path``/``--log_samples`` added."""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from server.test_server import MODEL

TASKS_DIR = Path(__file__).parents[1] / "support" / "lm_eval_tasks"
DOC = Path(__file__).parents[2] / "docs" / "logprobs_and_eval.md"
METRICS = {"tokenmill_mc": "acc,none", "tokenmill_gen": "exact_match,first_word"}


def doc_lm_eval_commands(model_dir: str, server_url: str) -> dict[str, list[str]]:
    """The page's ``lm_eval`` commands (``--model`` -> arguments after ``lm_eval``), with ``$M``
    and the server's URL filled in."""
    body = re.search(r"^```bash\n(tokenmill serve --port 8000 &\n.*?)^```", DOC.read_text(), re.S | re.M).group(1)
    commands = {}
    for line in body.replace("\\\n", " ").splitlines():
        line = re.sub(r"\s#\s.*$", "", line).replace("$M", model_dir)
        words = shlex.split(line.replace("http://127.0.0.1:8000", server_url))
        if words[:2] == ["HF_DATASETS_OFFLINE=1", "lm_eval"]:
            commands[words[words.index("--model") + 1]] = words[2:]
    assert set(commands) == {"local-completions", "hf"}, commands
    return commands


def run_lm_eval(args: list[str], output_path: Path) -> tuple[dict, dict]:
    """Run ``lm_eval`` with ``args`` (on both tasks); return its results and its samples by task."""
    assert args[args.index("--tasks") + 1] == ",".join(METRICS)
    cmd = [sys.executable, "-m", "lm_eval", *args, "--output_path", str(output_path), "--log_samples"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, cwd=TASKS_DIR, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(Path(glob.glob(f"{output_path}/*/results_*.json")[0]).read_text())
    samples = {}
    for task in METRICS:
        path = glob.glob(f"{output_path}/*/samples_{task}_*.jsonl")[0]
        rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
        samples[task] = sorted(rows, key=lambda r: r["doc_id"])
    return results["results"], samples


@pytest.mark.slow
def test_lm_eval_scores_equal_hf(default_model_dir, default_server, tmp_path):
    commands = doc_lm_eval_commands(default_model_dir, default_server.url)
    assert f"model={MODEL}," in commands["local-completions"][3]
    ours, our_samples = run_lm_eval(commands["local-completions"], tmp_path / "tokenmill")
    ref, ref_samples = run_lm_eval(commands["hf"], tmp_path / "hf")
    for task, metric in METRICS.items():
        assert ours[task][metric] == pytest.approx(ref[task][metric], abs=0.005), task
    assert ref["tokenmill_mc"]["acc,none"] > 0.5, "the loglikelihood task tells choices apart"
    assert ref["tokenmill_gen"]["exact_match,first_word"] > 0, "some generations are right"
    for a, b in zip(our_samples["tokenmill_mc"], ref_samples["tokenmill_mc"]):
        ours_ll = [float(r[0][0]) for r in a["resps"]]
        ref_ll = [float(r[0][0]) for r in b["resps"]]
        assert ours_ll == pytest.approx(ref_ll, abs=1e-3), a["doc_id"]
    assert [s["filtered_resps"] for s in our_samples["tokenmill_gen"]] == [
        s["filtered_resps"] for s in ref_samples["tokenmill_gen"]
    ]
