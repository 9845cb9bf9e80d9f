"""lm-eval's `local-completions` against a live server: a multiple-choice (log-likelihood) task
from a local file runs end to end, and every choice's log-likelihood equals lm-eval's own `hf`
backend on the same checkpoint. Skips where lm-eval is not installed (`pip install
'lm-eval[api]'`): it is not a test extra (it pulls in datasets, evaluate, scikit-learn, ...)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from checkpoints import write_qwen3_moe_checkpoint
from serving import Server, start_server, stop_server

lm_eval = pytest.importorskip(
    "lm_eval", reason="lm-eval is not installed (pip install 'lm-eval[api]')"
)
pytestmark = pytest.mark.slow

MODEL = "mc-tiny"
QUESTIONS = [
    ("The quick brown fox jumps over the", ["lazy dog.", "router.", "cache blocks"], 0),
    ("Experts route tokens; the router picks", ["the top k experts", "a café", "0123"], 0),
    ("A paged key value cache stores", ["emoji 🙂", "attention keys", "nothing at all"], 1),
    ("Héllo wörld, naïve", ["café", "GPUs", "fixed size"], 0),
    ("Mixture of experts models serve", ["many requests", "the lazy dog", "( ) [ ]"], 0),
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen3_moe_checkpoint(tmp_path_factory.mktemp("lm-eval"), seed=5)


@pytest.fixture(scope="module")
def server(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("log") / "server.log"
    # A small step budget: the prompts are prefilled in several chunks.
    s = start_server(
        ["--model", str(ckpt), "--served-model-name", MODEL, "--chunked-prefill-size", "4"], log
    )
    yield s
    stop_server(s.proc)


def _task_dir(root: Path) -> Path:
    data = root / "mc.jsonl"
    with data.open("w") as f:
        for q, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": q, "choices": choices, "answer": answer}) + "\n")
    (root / "safeserve_mc.yaml").write_text(
        "task: safeserve_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    return root


def _logliks(results: dict) -> dict[tuple[int, int], tuple[float, bool]]:
    """(doc id, choice) -> (log-likelihood, is greedy), from lm-eval's logged samples."""
    out = {}
    for sample in results["samples"]["safeserve_mc"]:
        for choice, resp in enumerate(sample["resps"]):
            loglik, greedy = resp[0]
            out[(sample["doc_id"], choice)] = (float(loglik), bool(greedy))
    return out


def test_local_completions_loglikelihoods_equal_the_hf_backend(
    server: Server, ckpt: Path, tmp_path: Path
) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(_task_dir(tmp_path)))
    common = dict(tasks=["safeserve_mc"], task_manager=tasks, log_samples=True, batch_size=1)
    served = simple_evaluate(
        model="local-completions",
        model_args=(
            f"model={MODEL},base_url={server.url}/v1/completions,tokenizer={ckpt},"
            "tokenized_requests=True,max_retries=1"
        ),
        **common,
    )
    reference = simple_evaluate(
        model="hf", model_args=f"pretrained={ckpt},dtype=float32,device=cpu", **common
    )
    assert served is not None and reference is not None
    ours, theirs = _logliks(served), _logliks(reference)
    assert len(ours) == sum(len(c) for _, c, _ in QUESTIONS)
    assert ours.keys() == theirs.keys()
    for key, (loglik, greedy) in ours.items():
        print(f"doc {key[0]} choice {key[1]}: served {loglik:.6f}, hf {theirs[key][0]:.6f}")
        assert loglik == pytest.approx(theirs[key][0], abs=1e-4), key
        assert greedy == theirs[key][1], key
    acc = served["results"]["safeserve_mc"]["acc,none"]
    assert acc == reference["results"]["safeserve_mc"]["acc,none"]
