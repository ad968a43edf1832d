"""kl.teacher_cache: the teacher's hidden states per held-out row, reused by later KL evaluations."""

from __future__ import annotations

import json

import pytest
import torch

from hylo.pipeline.eval.decode import load_model
from hylo.pipeline.eval.kl import TeacherStateCache, evaluate_kl

from tests.helpers.train import make_tiny_models

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    paths = make_tiny_models(tmp_path_factory.mktemp("tiny"))
    return load_model(paths["student"], "float32", "cpu"), load_model(paths["base"], "float32", "cpu")


def rows(seed: int, n: int = 3) -> list[tuple[str, dict]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, 96, (40,), generator=g)
        mask = torch.rand(40, generator=g) > 0.3
        out.append((f"row {i}", {"input_ids": ids, "cu_seqlens": torch.tensor([0, 15, 40], dtype=torch.int32),
                                 "loss_mask": mask}))
    return out


def counting(teacher, calls: list[int]):
    """Count the teacher's forwards (HF models run through their base model)."""
    return teacher.base_model.register_forward_hook(lambda *_: calls.append(1))


def test_cached_teacher_gives_the_same_kl_without_its_forward(models, tmp_path):
    student, teacher = models
    calls: list[int] = []
    hook = counting(teacher, calls)
    plain = evaluate_kl(student, rows(0), teacher)
    n_plain = len(calls)
    assert n_plain > 0
    cache = TeacherStateCache(tmp_path / "t.safetensors", key="teacher-a")
    first = evaluate_kl(student, rows(0), teacher, teacher_cache=cache)
    cache.save()
    assert (cache.hits, cache.misses) == (0, 3) and len(calls) == 2 * n_plain
    # a new process: the file alone, no teacher forward
    again = TeacherStateCache(tmp_path / "t.safetensors", key="teacher-a")
    second = evaluate_kl(student, rows(0), teacher, teacher_cache=again)
    assert (again.hits, again.misses) == (3, 0) and len(calls) == 2 * n_plain
    for r in (first, second):
        assert r.kl == pytest.approx(plain.kl, rel=1e-9) and r.teacher_nll == pytest.approx(plain.teacher_nll, rel=1e-9)
        assert r.nll == pytest.approx(plain.nll, rel=1e-9) and r.tokens == plain.tokens
    hook.remove()


def test_other_rows_or_another_teacher_miss(models, tmp_path):
    student, teacher = models
    path = tmp_path / "t.safetensors"
    cache = TeacherStateCache(path, key="teacher-a")
    evaluate_kl(student, rows(0), teacher, teacher_cache=cache)
    cache.save()
    other_rows = TeacherStateCache(path, key="teacher-a")
    evaluate_kl(student, rows(1), teacher, teacher_cache=other_rows)
    assert (other_rows.hits, other_rows.misses) == (0, 3)
    other_teacher = TeacherStateCache(path, key="teacher-b")
    evaluate_kl(student, rows(0), teacher, teacher_cache=other_teacher)
    assert (other_teacher.hits, other_teacher.misses) == (0, 3)


def test_eval_job_reports_cache_use(models, tmp_path):
    """jobs/eval.py with --set kl.teacher_cache=...: the second evaluation reads the teacher from the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hylo.jobs.eval import main

    student, teacher = models
    data = tmp_path / "rows.parquet"
    rs = [r for _, r in rows(2)]
    pq.write_table(pa.table({"input_ids": [r["input_ids"].tolist() for r in rs],
                             "cu_seqlens": [r["cu_seqlens"].tolist() for r in rs],
                             "loss_mask": [r["loss_mask"].tolist() for r in rs]}), data)
    s_dir, t_dir = student.config._name_or_path, teacher.config._name_or_path
    args = ["--model", s_dir, "--teacher", t_dir, "--data", str(data), "--suite", "kl", "--quiet",
            "--set", f"kl.teacher_cache={tmp_path / 'cache' / 'teacher.safetensors'}"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    assert main([*args, "--out", str(tmp_path / "b")]) == 0
    a, b = (json.loads((tmp_path / d / "results.json").read_text())["kl"] for d in "ab")
    assert a["teacher_cache"]["misses"] == 3 and b["teacher_cache"] == {**a["teacher_cache"], "hits": 3, "misses": 0}
    assert b["kl"] == pytest.approx(a["kl"], rel=1e-9)
