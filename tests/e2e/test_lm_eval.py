"""lm-eval, a harness written elsewhere, scores ``tokenmill serve`` (``local-completions``)
as it scores HF ``transformers`` (``hf``) on the same weights, on one loglikelihood and one
generate-until task defined from the local files in ``tests/support/lm_eval_tasks``."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from server.test_server import MODEL

TASKS_DIR = Path(__file__).parents[1] / "support" / "lm_eval_tasks"
METRICS = {"tokenmill_mc": "acc,none", "tokenmill_gen": "exact_match,first_word"}


def run_lm_eval(model: str, model_args: str, output_path: Path, *args: str) -> tuple[dict, dict]:
    """Run the ``lm_eval`` command on both tasks; return its results and its samples by task."""
    cmd = [
        sys.executable, "-m", "lm_eval",
        "--model", model,
        "--model_args", model_args,
        "--include_path", ".",
        "--tasks", ",".join(METRICS),
        "--output_path", str(output_path),
        "--log_samples",
        *args,
    ]
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
    ours, our_samples = run_lm_eval(
        "local-completions",
        f"base_url={default_server.url}/v1/completions,model={MODEL},num_concurrent=4,"
        f"tokenizer_backend=huggingface,tokenizer={default_model_dir}",
        tmp_path / "tokenmill",
    )
    ref, ref_samples = run_lm_eval(
        "hf", f"pretrained={default_model_dir},dtype=float32", tmp_path / "hf", "--device", "cpu"
    )
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
