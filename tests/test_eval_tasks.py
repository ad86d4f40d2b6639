"""``lmforge eval RUN --tasks``: multiple choice scored by log-likelihood (checked against the model's own
forward and log_softmax computed here), the acc_norm rule, generation with a regex extractor, the
standard error, the lm-evaluation-harness YAML subset, loss tasks, the refusals and the shipped tasks."""

from __future__ import annotations

import json
import math
import re
import shutil
import statistics
import sys
from pathlib import Path

import pytest
import torch

from lmforge.cli import main
from lmforge.errors import UserError
from lmforge.evaluate import task_builder
from lmforge.evaluate.files import evaluate_files
from lmforge.evaluate.loglikelihood import continuation_logprobs, split_pair, windows
from lmforge.evaluate.run_loading import load_run
from lmforge.evaluate.scoring import INVALID, binomial_stderr, choice_correct, extract
from lmforge.evaluate.task_files import TASK_DATA, read_spec
from lmforge.evaluate.task_scoring import resolve_tasks, score_generate, score_multiple_choice, shipped_tasks
from lmforge.evaluate.task_yaml import read_yaml_task
from lmforge.evaluate.tasks import run_tasks
from lmforge.model.sampling import generate_batch
from lmforge.recipe import load_config
from lmforge.train.callbacks import Callback
from lmforge.train.launch import train
from tests.conftest import tiny_overrides, training_texts
from tests.torchrun import torchrun, worker

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _cli_logging(cli_logging):
    """Tests here run the CLI in this process."""


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def write_task(folder: Path, lines: list, spec: str, name: str = "t") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (folder / f"{name}.toml").write_text(f'file = "{name}.jsonl"\n' + spec)
    return folder / f"{name}.toml"


def hand_logprob(model, tok, context: str, choice: str) -> float:
    """log p(choice | <|endoftext|> context), summed over the choice's tokens, from one forward pass over
    the last max_seq_len + 1 tokens."""
    head = tok.encode(context)
    whole = tok.encode(context + choice)
    assert whole[: len(head)] == head  # the split falls on a token boundary
    m = len(whole) - len(head)
    ids = [tok.eot_id, *whole][
        -(model.max_seq_len + 1) :
    ]  # the model's positions: the context cut from the left
    assert m < len(ids)
    with torch.no_grad():
        logp = torch.log_softmax(model.logits(model(torch.tensor([ids[:-1]]))).float(), -1)[0]
    return sum(float(logp[len(ids) - 1 - m + j, ids[len(ids) - m + j]]) for j in range(m))


def three_questions() -> list[dict]:
    """Three questions on bisect.py (which the run learned): a function's first line, and 3 next lines."""
    texts = [t for t in training_texts() if len(t) > 200][:3]
    out = []
    for i, t in enumerate(texts):
        cut = t.index("\n")  # no whitespace at the context's end: the split is the plain token boundary
        endings = [t[cut : cut + 20], "\n" + texts[(i + 1) % 3][5:14], "\n    pass"]
        out.append({"context": t[:cut], "choices": endings, "answer": i % 3})
    return out


def test_multiple_choice_scores_equal_a_hand_computation(scorer_run, tmp_path):
    _, tok, model, _ = load_run(scorer_run, CPU)
    model.eval()
    questions = three_questions()
    task = read_spec(write_task(tmp_path, questions, 'kind = "multiple_choice"\n'))
    expected_acc, expected_norm = [], []
    for q in questions:
        lls = [hand_logprob(model, tok, q["context"], c) for c in q["choices"]]
        norms = [ll / len(c.encode()) for ll, c in zip(lls, q["choices"], strict=True)]
        expected_acc.append(lls.index(max(lls)) == q["answer"])
        expected_norm.append(norms.index(max(norms)) == q["answer"])
        got = continuation_logprobs(model, [split_pair(tok, q["context"], c) for c in q["choices"]], 2)
        # the same FP32 log-probs, batched with padding vs one sequence alone: reduction orders differ, a few
        # u (6e-8) relative per token, ~1e-6 on a short continuation's sum of nats; abs 1e-4 is ~100x room
        # (measured at most 2.9e-6 default kernels, 7.2e-6 AVX2-forced, 2-core Xeon with AMX, 1 and 2 threads)
        assert [g for g, _ in got] == pytest.approx(lls, abs=1e-4)
    out = score_multiple_choice(task, model, tok, 4, None)
    assert out["acc"] == sum(expected_acc) / 3
    assert out["acc_norm"] == sum(expected_norm) / 3
    # pytest.approx's default rel 1e-6: a float64 formula against its hand computation, exact up to rounding
    assert out["acc_stderr"] == pytest.approx(math.sqrt(out["acc"] * (1 - out["acc"]) / 2))


def test_the_context_continuation_split_is_the_harness_token_boundary(scorer_run):
    from lmforge.tokenizer import Tokenizer

    tok = Tokenizer(scorer_run / "tokenizer.json")
    context, choice = "def insort(a, x):\n    ", "return x"
    ctx, cont = split_pair(tok, context, choice)
    whole = tok.encode(context + choice)
    # the trailing whitespace goes with the continuation: the context is "def insort(a, x):" encoded alone
    assert ctx == [tok.eot_id, *tok.encode("def insort(a, x):")]
    assert ctx[1:] + cont == whole and tok.decode(cont) == "\n    return x"


def test_a_continuation_longer_than_the_model_is_scored_once_per_token():
    ids = list(range(100))
    parts = windows(ids, 70, 32)
    scored = [t for _, targets in reversed(parts) for t in targets]
    assert scored == ids[30:]  # each continuation token once, in order
    for inputs, targets in parts:
        assert len(inputs) <= 32
        start = ids.index(inputs[0])
        assert targets == ids[start + 1 : start + 1 + len(inputs)][-len(targets) :]
    assert windows(ids[:20], 5, 32) == [(ids[:19], ids[15:20])]


def test_acc_norm_divides_by_the_choices_length_in_bytes():
    # raw: -10 > -12 picks choice 0; per byte: -10/2 = -5 < -12/8 = -1.5 picks choice 1
    assert choice_correct([-10.0, -12.0], ["ab", "abcdefgh"], 1) == (False, True)
    # bytes, not characters: "éé" is 4 bytes, so -8/4 = -2 beats -9/3 = -3
    assert choice_correct([-8.0, -9.0], ["éé", "abc"], 0) == (True, True)
    assert choice_correct([-9.0, -8.0], ["éé", "abc"], 0) == (False, True)


def test_standard_error_is_the_binomial_formula():
    outcomes = [1, 1, 1, 0, 1, 0, 0, 1, 1, 1]
    acc = sum(outcomes) / len(outcomes)
    # pytest.approx's default rel 1e-6 (both asserts): float64 formulas, exact up to rounding
    assert binomial_stderr(acc, len(outcomes)) == pytest.approx(
        statistics.stdev(outcomes) / math.sqrt(len(outcomes))
    )
    assert binomial_stderr(0.75, 4) == pytest.approx(0.25)
    assert math.isnan(binomial_stderr(1.0, 1))


def test_generation_with_a_regex_extractor_scores_the_models_greedy_output(scorer_run, tmp_path):
    _, tok, model, _ = load_run(scorer_run, CPU)
    contexts = [t[: t.index("\n") + 1] for t in training_texts()[:2]]
    greedy = generate_batch(
        model, [[tok.eot_id, *tok.encode(contexts[0])]], 12, temperature=0, stop_tokens=(tok.eot_id,)
    )
    first_line = tok.decode(greedy[0]).split("\n")[0]
    words = re.findall(r"([A-Za-z_]+)", first_line)
    assert words, first_line  # the learned text continues with code
    lines = [{"context": contexts[0], "answer": words[0]}, {"context": contexts[1], "answer": "zz_never"}]
    spec = 'kind = "generate"\nuntil = ["\\n"]\nmax_new_tokens = 12\nregex = "([A-Za-z_]+)"\n'
    task = read_spec(write_task(tmp_path, lines, spec))
    assert score_generate(task, model, tok, 2)["exact_match"] == 0.5
    assert extract("x = 42 and 7", r"(\d+)", 1) == "7"
    assert extract("no digits", r"(\d+)") == INVALID


def test_the_lm_eval_yaml_subset_gives_the_same_task_as_the_jsonl_spec(tmp_path):
    lines = [
        {"context": f"Question {i}:", "choices": [f"a{i}", f"b{i}", "c"], "answer": i % 3} for i in range(6)
    ]
    spec = write_task(
        tmp_path,
        lines,
        'kind = "multiple_choice"\nmetric = "acc_norm"\ntarget_delimiter = " "\nnum_fewshot = 2\n',
    )
    (tmp_path / "t.yaml").write_text(
        "task: t\ndataset_path: json\ndataset_kwargs:\n  data_files: t.jsonl\ntest_split: train\n"
        "output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nnum_fewshot: 2\nmetric_list:\n  - metric: acc_norm\n"
        "    aggregation: mean\n    higher_is_better: true\nmetadata:\n  version: 1.0\n"
    )
    a, b = read_spec(spec), read_yaml_task(tmp_path / "t.yaml")
    assert a.items == b.items and a.items[0].context.count("Question") == 3
    assert (a.kind, a.metric, a.target_delimiter) == (b.kind, b.metric, b.target_delimiter)
    gen = [{"question": "2+2?", "target": "#### 4"}]
    (tmp_path / "g.jsonl").write_text(json.dumps(gen[0]) + "\n")
    (tmp_path / "g.yaml").write_text(
        "task: g\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: g.jsonl\ntest_split: test\n"
        "output_type: generate_until\ndoc_to_text: 'Q: {{question}}\nA:'\ndoc_to_target: "
        "\"{{target.split('####')[-1].strip()}}\"\ngeneration_kwargs:\n  until: ['Q:']\n  max_gen_toks: 8\n"
        "filter_list:\n  - name: strict\n    filter:\n      - function: regex\n        regex_pattern: '(\\d+)'\n"
        "      - function: take_first\n"
    )
    g = read_yaml_task(tmp_path / "g.yaml")
    assert (g.kind, g.items[0].context, g.items[0].answer) == ("generate", "Q: 2+2? A:", "4")
    assert (g.until, g.max_new_tokens, g.regex) == (("Q:",), 8, r"(\d+)")


def refusal(capsys, run: Path, tasks: str) -> str:
    code, out, err = run_cli(capsys, "eval", str(run), "--tasks", tasks)
    assert code == 2 and out == "", (code, out, err)
    assert len(err.strip().splitlines()) == 1, err
    assert not (run / "eval").exists()  # nothing written
    return err


def test_bad_tasks_are_refused_in_one_line_before_any_work(scorer_run, tmp_path, capsys):
    good = {"context": "a", "choices": ["b", "c"], "answer": 0}
    mc = 'kind = "multiple_choice"\n'
    path = write_task(tmp_path / "m", [good, {"context": "a", "answer": 0}], mc)
    assert "t.jsonl:2: missing field 'choices'" in refusal(capsys, scorer_run, str(path))
    path = write_task(tmp_path / "r", [good, good, good | {"answer": 2}], mc)
    assert "t.jsonl:3: answer 2 is out of range for 2 choices" in refusal(capsys, scorer_run, str(path))
    err = refusal(capsys, scorer_run, "stdlib_next_line,no_such_task")
    assert "no_such_task: no such task" in err and all(n in err for n in shipped_tasks())
    (tmp_path / "f.yaml").write_text(
        "task: f\ndataset_path: json\nprocess_results: !function utils.process\n"
    )
    assert "!function" in refusal(capsys, scorer_run, str(tmp_path / "f.yaml"))
    (tmp_path / "k.yaml").write_text("task: k\ndataset_path: json\nshould_decontaminate: true\n")
    assert "'should_decontaminate' is not supported" in refusal(capsys, scorer_run, str(tmp_path / "k.yaml"))
    bare = tmp_path / "bare"
    shutil.copytree(scorer_run, bare)
    (bare / "tokenizer.json").unlink()
    assert "has no tokenizer.json" in refusal(capsys, bare, "stdlib_next_line")


def test_eval_tasks_on_a_tiny_run_writes_the_scores_and_compare_shows_them(scorer_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(scorer_run, run)
    text = [{"text": t} for t in training_texts()[:3]]
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(x) + "\n" for x in text))
    (tmp_path / "held.toml").write_text('kind = "loss"\nfile = "held.jsonl"\n')
    code, out, err = run_cli(
        capsys,
        "eval",
        str(run),
        "--tasks",
        f"stdlib_next_line,{tmp_path / 'held.toml'}",
        "--limit",
        "6",
        "--json",
    )
    assert code == 0, err
    result = json.loads(out)
    nl = result["tasks"]["stdlib_next_line"]
    assert nl["n"] == 6 and nl["metric"] == "acc" and 0 <= nl["acc"] <= 1
    # pytest.approx's default rel 1e-6: a float64 formula against its hand computation, exact up to rounding
    assert nl["stderr"] == pytest.approx(math.sqrt(nl["acc"] * (1 - nl["acc"]) / 5))
    held = result["tasks"]["held"]
    files = evaluate_files(run, [str(tmp_path / "held.jsonl")], CPU)
    n_bytes = sum(len(t["text"].encode()) for t in text)
    # the same FP32 windows through score(), by eval --tasks and by evaluate_files (batch sizes may differ):
    # equal up to reduction order; rel 1e-6 (~8 FP32 eps of 1.2e-7) is room; bits per byte: a float64 formula
    # on that loss
    assert held["loss"] == pytest.approx(files["loss"], rel=1e-6)
    assert held["bits_per_byte"] == pytest.approx(
        files["loss"] * files["targets"] / (math.log(2) * n_bytes), rel=1e-6
    )
    saved = json.loads((run / "eval" / f"tasks_step_{result['step']}.json").read_text())
    assert saved["tasks"] == result["tasks"]
    code, out, _ = run_cli(capsys, "eval", str(run), "--tasks", "stdlib_next_line", "--limit", "6")
    assert code == 0 and re.search(r"stdlib_next_line\s+acc\s+\d\.\d{4}\s+\d\.\d{4}\s+6", out), out
    code, out, _ = run_cli(
        capsys, "eval", str(run), "--tasks", "stdlib_assign", "--limit", "2", "--step", "30", "--json"
    )
    assert code == 0 and json.loads(out)["step"] == 30 and (run / "eval" / "tasks_step_30.json").is_file()
    code, out, _ = run_cli(capsys, "compare", str(run), str(scorer_run))  # the newest step's scores
    assert code == 0 and re.search(
        rf"stdlib_next_line\s+acc\s+{nl['acc']:.4f} ± {nl['stderr']:.4f}\s+-", out
    ), out


def test_the_shipped_tasks_read_and_are_small():
    tasks = resolve_tasks(",".join(shipped_tasks()))
    assert {t.name: t.kind for t in tasks} == {
        "stdlib_assign": "generate", "stdlib_docstring": "multiple_choice", "stdlib_next_line": "multiple_choice",
    }  # fmt: skip
    assert all(len(t.items) >= 80 for t in tasks)
    assert sum(p.stat().st_size for p in TASK_DATA.iterdir()) < 200_000


@pytest.mark.slow  # the builder parses every module of the standard library (about 20 s on 2 busy cores)
def test_the_shipped_tasks_are_rebuilt_the_same(tmp_path):
    version = ".".join(str(v) for v in sys.version_info[:3])
    if f"Python {version}'s" not in (TASK_DATA / "stdlib_assign.toml").read_text():
        pytest.skip("the shipped tasks were built from another Python's standard library")
    for path in task_builder.build(tmp_path):
        assert path.read_bytes() == (TASK_DATA / path.name).read_bytes(), path.name


def bisect_task(folder: Path) -> Path:
    """20 questions on the text the tiny run learns: three lines of bisect.py, which of 3 lines is next."""
    import random

    lines = [ln for t in training_texts() for ln in t.splitlines() if len(ln.strip()) > 8]
    rng = random.Random(0)
    questions = []
    for i in rng.sample(range(3, len(lines)), 20):
        others = rng.sample([ln for ln in lines if ln != lines[i]], 2)
        choices = [lines[i], *others]
        rng.shuffle(choices)
        questions.append(
            {
                "context": "\n".join(lines[i - 3 : i]),
                "choices": ["\n" + c for c in choices],
                "answer": choices.index(lines[i]),
            }
        )
    return write_task(folder, questions, 'kind = "multiple_choice"\n', name="bisect")


class Damage(Callback):
    """Replaces every weight with noise after step ``at``: a planted regression."""

    def __init__(self, at: int):
        self.at = at

    def on_step_end(self, trainer, result) -> None:
        if trainer.progress.step == self.at:
            gen = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in trainer.run.model.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


def bisect_corpus(tmp_path: Path) -> dict:
    """Overrides of a tiny run on the texts the bisect task asks about (bisect.py), tied embeddings."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "stdlib.jsonl").write_text(
        "".join(
            json.dumps({"id": f"bisect.py#{i}", "text": t}) + "\n" for i, t in enumerate(training_texts())
        )
    )
    return tiny_overrides(corpus, tmp_path / "data") | {
        "data.vocab_size": 384, "model.d_model": 64, "train.micro_batch_size": 16, "train.eval_interval": 0,
        "train.sample_tokens": 0, "optim.lr": 1e-2,
    }  # fmt: skip


def test_tasks_during_training_log_scores_flag_a_planted_regression_and_keep_the_best(tmp_path):
    """Scores at steps 20, 40 and 60 of a run whose weights are replaced by noise at step 59: the step-60
    score is flagged against the best, and ``eval.keep_best`` keeps the best step's checkpoint although
    ``train.keep_checkpoints = 1`` rotates the other one away; ``lmforge eval --tasks`` on that
    checkpoint gives the score logged during training (the same weights)."""
    spec = bisect_task(tmp_path / "task")
    over = bisect_corpus(tmp_path) | {
        "train.steps": 60, "train.checkpoint_interval": 20, "train.keep_checkpoints": 1,
        "eval.tasks": [str(spec)], "eval.interval": 20, "eval.regression_factor": 1.0, "eval.keep_best": "bisect",
    }  # fmt: skip
    torch.set_num_threads(1)
    summary = train(load_config(None, over), tmp_path / "run", progress_bar=False, callbacks=[Damage(59)])
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    scores = {r["step"]: r["task/bisect/acc"] for r in records if "task/bisect/acc" in r}
    assert sorted(scores) == [20, 40, 60]
    events = [r for r in records if r.get("event") == "task_regression"]
    assert max(scores[20], scores[40]) >= 0.5 and scores[60] <= 0.4, scores  # chance: 1/3
    assert [e["step"] for e in events] == [60]
    assert events[0]["best"] == max(scores[20], scores[40]) and events[0]["value"] == scores[60]

    best = max(scores, key=lambda s: (scores[s], -s))  # the highest score, the earliest of equal ones
    other = 60 - best  # the other trained step: 20 or 40
    kept = json.loads((tmp_path / "run" / "best_task.json").read_text())
    assert kept == {"task": "bisect", "metric": "acc", "step": best, "value": scores[best],
                    "checkpoint": f"checkpoints/step_{best:08d}"}  # fmt: skip
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == [f"step_{best:08d}", "step_00000060"], names  # step `other` rotated away
    assert (summary["best_task_step"], summary["best_task_value"]) == (best, scores[best])
    again = run_tasks(tmp_path / "run", str(spec), CPU, step=best)  # the kept weights, scored again
    assert again["tasks"]["bisect"]["acc"] == scores[best] and other in (20, 40)


@pytest.mark.distributed
def test_task_scores_during_training_are_the_same_in_every_layout(tmp_path):
    """One process trains 30 steps and scores the bisect task at the end (the checkpoint of step 30
    holds those weights). Two processes load that checkpoint under FSDP2 (dp_shard = 2) and under a
    pipeline (pp = 2, each rank one layer; the tied head's copy on the second stage), and the ``[eval]``
    callback scores it: the same accuracy and standard error as the one process, exactly (tolerance 0:
    the weights are the checkpoint's bits in each case, gathered whole onto rank 0's CPU and scored by
    the same code on the same CPU), logged alike on both ranks."""
    spec = bisect_task(tmp_path / "task")
    over = bisect_corpus(tmp_path) | {
        "train.steps": 30,
        "train.checkpoint_interval": 0,
        "eval.tasks": [str(spec)],
    }
    torch.set_num_threads(1)
    train(load_config(None, over), tmp_path / "run", progress_bar=False)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (one,) = [
        {k: v for k, v in r.items() if k.startswith("task/")} for r in records if "task/bisect/acc" in r
    ]
    assert one["task/bisect/acc"] >= 0.5  # trained weights: well above chance (1/3) on 20 questions
    layouts = [{"parallel.dp_shard": 2}, {"parallel.pp": 2}]
    out = tmp_path / "layouts.jsonl"
    args = {"run": str(tmp_path / "run"), "step": 30, "over": over, "layouts": layouts, "out": str(out)}
    done = torchrun(2, [worker("eval_layouts_worker.py"), json.dumps(args)], timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["layout"] for line in lines] == layouts
    for line in lines:
        assert line["agreed"], line["layout"]
        (scored,) = [r for r in line["records"] if "task/bisect/acc" in r]
        assert scored == {"step": 30, **one}, line["layout"]
        assert not [r for r in line["records"] if r.get("event") == "task_regression"]
    print(f"one process and both layouts: {one}")


def test_a_loss_task_or_a_missing_task_in_eval_tasks_is_refused_before_any_work(tmp_path, corpus_dir):
    (tmp_path / "held.toml").write_text('kind = "loss"\nfile = "held.toml"\n')
    over = tiny_overrides(corpus_dir, tmp_path / "data")
    with pytest.raises(UserError, match=r"eval\.tasks: held is a loss task"):
        train(load_config(None, over | {"eval.tasks": [str(tmp_path / "held.toml")]}), tmp_path / "run")
    with pytest.raises(UserError, match="no_such: no such task"):
        train(load_config(None, over | {"eval.tasks": ["no_such"]}), tmp_path / "run")
    with pytest.raises(
        UserError, match=r"eval\.keep_best: 'nope' is not a task of eval\.tasks \(stdlib_assign\)"
    ):
        train(
            load_config(None, over | {"eval.tasks": ["stdlib_assign"], "eval.keep_best": "nope"}),
            tmp_path / "run",
        )
    with pytest.raises(
        UserError, match=r"eval\.keep_best: 'stdlib_assign' names a task but eval\.tasks is empty"
    ):
        load_config(None, over | {"eval.keep_best": "stdlib_assign"})
    assert not (tmp_path / "run").exists() and not (tmp_path / "data").exists()
