"""A teacher source is one file: a new one, registered from a module of its own, is taken up by the config
(the choices of `teacher.source`, its own check), by the input checks before Ray starts, by the driver (its
Ray resources, the service it starts), by the estimate and by stage 2's opening; stage 2's `teacher` section is
composed of the sources' typed sections; and the sources' files load no implementation when a config is built.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hylo.pipeline.config import ConfigError, field_rules
from hylo.pipeline.data.rows import check_row
from hylo.pipeline.teacher import sources
from hylo.pipeline.train.config import TeacherSection, load_stage_config

from tests.helpers.teacher import make_packed_row
from tests.helpers.train import make_tiny_models

REPO = Path(__file__).resolve().parents[2]

# The whole of a new source: a teacher given as a JSON table (a stand-in for, say, a vLLM-backed pool). It
# reuses teacher.cache_path (the table file), teacher.k and teacher.pool.num_cpus (its server's share).
TABLE_SOURCE = '''
"""`teacher.source: table`: uniform top-k records over the first k ids of a vocabulary read from a JSON file."""

import json
import math
from pathlib import Path

from hylo.pipeline.config import ConfigError, FieldError
from hylo.pipeline.teacher.sources import register
from hylo.pipeline.teacher.sources.base import ResourceDemand, TeacherFiles, TeacherSourceKind

EVENTS = []


class TableTeacher:
    def __init__(self, vocab):
        self.vocab = vocab

    def targets(self, rows, spec):
        import torch
        from hylo.kernels.fused_kl.topk import TeacherTopK

        for row in rows:
            n = row.num_tokens
            yield {"teacher_topk": TeacherTopK(torch.full((n, spec.k), -math.log(self.vocab)),
                                               torch.arange(spec.k, dtype=torch.int32).expand(n, spec.k),
                                               torch.full((n,), math.log((self.vocab - spec.k) / self.vocab)))}


class TableSource(TeacherSourceKind):
    name = "table"

    def check_config(self, t):
        if not t.cache_path:
            raise FieldError("cache_path", t.cache_path, "teacher.source=table needs the table file")

    def check_inputs(self, t):
        EVENTS.append(("check_inputs", t.cache_path))
        if not Path(t.cache_path).is_file():
            raise ConfigError(f"teacher.cache_path={t.cache_path!r}: no table there", "teacher.cache_path")

    def vocab(self, t):
        return json.loads(Path(t.cache_path).read_text())["vocab_size"]

    def compared_with_student(self, t):
        return TeacherFiles("teacher.cache_path", vocab_size=self.vocab(t), value=t.cache_path)

    def resources(self, t):
        return [ResourceDemand("table server", 1, {"CPU": 3 * t.pool.num_cpus}, "teacher.pool.num_cpus")]

    def start(self, t, fault):
        EVENTS.append(("start", t.cache_path, fault.kill_at_row))
        return lambda: EVENTS.append(("stop", t.cache_path))

    def open(self, t, data_path):
        return TableTeacher(self.vocab(t)), self.vocab(t)


register(TableSource())
'''


def _import_table_source(tmp_path):
    """The source's module, imported from its file: that registers it."""
    assert "table" not in sources.SOURCES
    path = tmp_path / "table_source.py"
    path.write_text(TABLE_SOURCE)
    spec = importlib.util.spec_from_file_location("table_source", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def table_source(tmp_path):
    try:
        yield _import_table_source(tmp_path)
    finally:
        sources.SOURCES.pop("table", None)


def _table(tmp_path, vocab: int) -> Path:
    p = tmp_path / f"table-{vocab}.json"
    p.write_text(json.dumps({"vocab_size": vocab}))
    return p


def test_a_source_registered_in_one_file_is_a_choice_of_the_config_with_its_own_check(tmp_path):
    with pytest.raises(ConfigError, match="teacher.source='table': must be one of inprocess, serve, offline$"):
        load_stage_config(2, None, ["teacher.source=table"])
    try:
        _import_table_source(tmp_path)
        table = _table(tmp_path, 128)
        t = load_stage_config(2, None, ["teacher.source=table", "teacher.k=4", f"teacher.cache_path={table}"]).teacher
        assert (t.source, t.k, t.form) == ("table", 4, "topk")
        assert "table" in field_rules(TeacherSection)["source"].describe()
        with pytest.raises(ConfigError, match="teacher.source='tabel': must be one of inprocess, serve, offline, table"):
            load_stage_config(2, None, ["teacher.source=tabel"])
        # its own check, naming the key
        with pytest.raises(ConfigError, match="teacher.cache_path=None: teacher.source=table needs the table file"):
            load_stage_config(2, None, ["teacher.source=table", "teacher.k=4"])
        # what it can give (top-k only: no exact form), checked like every source's
        with pytest.raises(ConfigError, match="teacher.k=0: the table teacher gives top-k records only: set k > 0"):
            load_stage_config(2, None, ["teacher.source=table", f"teacher.cache_path={table}"])
    finally:
        sources.SOURCES.pop("table", None)
    with pytest.raises(ConfigError, match="must be one of inprocess, serve, offline$"):
        load_stage_config(2, None, ["teacher.source=table"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_models(tmp_path_factory.mktemp("sources") / "models")


def test_the_new_source_is_checked_before_ray_against_the_student(table_source, tiny, tmp_path):
    from hylo.pipeline.train.inputs import check_stage_inputs

    def cfg(table):
        return load_stage_config(2, None, [f"model.student={tiny['student']}", "data.source=synthetic",
                                           f"ray.storage_path={tmp_path}", "teacher.source=table", "teacher.k=4",
                                           f"teacher.cache_path={table}"])

    with pytest.raises(ConfigError, match="no table there"):
        check_stage_inputs(cfg(tmp_path / "missing.json"))
    wrong = _table(tmp_path, 128)
    with pytest.raises(ConfigError, match=rf"teacher.cache_path='{wrong}': vocabulary 128 != the student's 96"):
        check_stage_inputs(cfg(wrong))
    check_stage_inputs(cfg(_table(tmp_path, 96)))
    assert [e[0] for e in table_source.EVENTS] == ["check_inputs"] * 3


def test_the_driver_counts_the_new_sources_resources_and_starts_it(table_source, tmp_path):
    from hylo.pipeline.train.driver import check_resources, resource_demand, start_teacher

    table = _table(tmp_path, 96)
    cfg = load_stage_config(2, None, ["teacher.source=table", "teacher.k=4", f"teacher.cache_path={table}",
                                      "ray.num_workers=2", "ray.cpus_per_worker=1", "fault.teacher.kill_at_row=7"])
    assert [(d.what, d.count, d.resources) for d in resource_demand(cfg)] == [
        ("train worker", 2, {"CPU": 1.0}), ("table server", 1, {"CPU": 3.0})]
    with pytest.raises(ConfigError, match=r"this run needs 5 CPU \(2 train workers x 1 \+ 1 table server x 3\) but "
                                          r"the Ray cluster has 4: lower ray.num_workers / ray.cpus_per_worker or "
                                          r"teacher.pool.num_cpus, or add nodes"):
        check_resources(cfg, {"CPU": 4.0}, [{"CPU": 4.0}])
    check_resources(cfg, {"CPU": 5.0}, [{"CPU": 5.0}])
    stop = start_teacher(cfg)
    assert table_source.EVENTS == [("start", str(table), 7)]
    stop()
    assert table_source.EVENTS[-1] == ("stop", str(table))
    # the in-tree sources: only the pool the driver deploys asks for resources and starts anything
    for sets, demands in ((["teacher.source=serve"], ["train worker", "teacher replica"]),
                          (["teacher.source=serve", "teacher.start_pool=false"], ["train worker"]),
                          ([], ["train worker"])):
        assert [d.what for d in resource_demand(load_stage_config(2, None, sets))] == demands
    assert start_teacher(load_stage_config(2, None, [])) is None


def test_stage2_opens_the_new_source_and_checks_its_vocabulary(table_source, tmp_path):
    table = _table(tmp_path, 50)
    t = load_stage_config(2, None, ["teacher.source=table", "teacher.k=4", f"teacher.cache_path={table}"]).teacher
    teacher = sources.open_teacher(t, 50)
    rows = [check_row(make_packed_row([5, 3], 50, seed=i)) for i in range(2)]
    got = list(teacher.targets(rows, "cpu"))
    assert [g["teacher_topk"].logprobs.shape for g in got] == [(8, 4), (8, 4)]
    torch.testing.assert_close(got[0]["teacher_topk"].logprobs, torch.full((8, 4), -math.log(50)))
    with pytest.raises(ConfigError, match="teacher vocabulary 50 != student vocabulary 64"):
        sources.open_teacher(t, 64)


def test_stage2s_teacher_section_is_composed_of_the_sources_typed_sections():
    """Each source names the keys it reads; stage 2's flat section is all of them, in the order printed."""
    from dataclasses import dataclass, fields

    def keys(cls):
        return [f.name for f in fields(cls)]

    assert keys(TeacherSection) == ["source", "k", "exact_form", "model", "pool", "client", "start_pool", "cache_path"]
    for name, own in (("inprocess", ["model"]), ("serve", ["model", "pool", "client", "start_pool"]),
                      ("offline", ["cache_path"])):
        section = sources.source_kind(name).section
        assert keys(section) == ["source", "k", "exact_form", *own]
        assert isinstance(TeacherSection(), section)
    # the offline section's rule travels with it: cache_path is a path (resolved, checked)
    assert field_rules(TeacherSection)["cache_path"].path

    # a source whose section stage 2's does not hold is refused when it is named
    @dataclass
    class WithTable(sources.SourceSection):
        table: str = ""

    class Late(sources.TeacherSourceKind):
        name = "late"
        section = WithTable

    sources.register(Late())
    try:
        with pytest.raises(ConfigError, match="teacher.source='late' reads teacher.table as .*WithTable declares it, "
                                              "which TeacherSection does not"):
            load_stage_config(2, None, ["teacher.source=late", "teacher.k=4"])
    finally:
        sources.SOURCES.pop("late", None)


def test_the_estimate_asks_the_source_where_its_teacher_model_runs(tiny):
    """`hylo estimate` sizes the teacher model where the source says it runs: a second pool, registered in a
    file of its own, gets the pool's treatment (the teacher's shape, a replica of its own) under its own words."""
    import torch

    from hylo.pipeline.estimate.cli import describe
    from hylo.pipeline.estimate.shapes import shapes_of
    from hylo.pipeline.teacher.sources.serve import ServeSource

    class OtherPool(ServeSource):
        name = "otherpool"
        where = "in the other pool"

    sources.register(OtherPool())
    try:
        for source, where, shaped in (("inprocess", "on every training GPU", True), ("serve", "in the Serve pool", True),
                                      ("offline", "from the top-k cache", False),
                                      ("otherpool", "in the other pool", True)):
            cfg = load_stage_config(2, None, [f"model.student={tiny['student']}", f"teacher.model.path={tiny['base']}",
                                              f"teacher.source={source}", "teacher.k=8", "teacher.cache_path=/c"])
            shapes = shapes_of(cfg)
            assert (shapes.teacher is not None) == shaped, source
            assert f"{where}, fused KL over top-8 + tail" in describe(cfg, shapes, 2, torch.bfloat16, None), source
    finally:
        sources.SOURCES.pop("otherpool", None)


def test_a_taken_name_is_refused():
    class Other(sources.TeacherSourceKind):
        name = "serve"

    with pytest.raises(ValueError, match="teacher source 'serve' is registered already"):
        sources.register(Other())
    assert type(sources.SOURCES["serve"]).__name__ == "ServeSource"


@pytest.mark.parametrize("sets", [[], ["teacher.source=serve"], ["teacher.source=offline", "teacher.k=8",
                                                                 "teacher.cache_path=/c"]],
                         ids=["inprocess", "serve", "offline"])
@pytest.mark.slow
def test_building_a_config_loads_the_sources_but_no_implementation(sets):
    """`teacher.source` is checked by its source when the config is built: the sources' files import their
    implementations (model, client, cache, Serve) only inside the methods that use them."""
    code = ("import json, sys; from hylo.pipeline.train.config import load_stage_config; "
            f"t = load_stage_config(2, None, {sets!r}).teacher; t.form; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('hylo.', 'torch', 'ray')))))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.splitlines()[-1])
    assert "hylo.pipeline.teacher.sources.offline" in loaded
    assert [m for m in loaded if m.startswith(("torch", "ray"))] == []
    assert [m for m in loaded if not (m.rpartition(".")[2] == "config" or m.startswith("hylo.pipeline.teacher.sources")
                                      or m in ("hylo.json_files", "hylo.weight_files", "hylo.rules", "hylo.pipeline",
                                               "hylo.pipeline.teacher", "hylo.pipeline.train", "hylo.pipeline.data",
                                               "hylo.upcycle", "hylo.kernels", "hylo.yaml_limits", "hylo.lazy",
                                               "hylo.logs", "hylo.bounded_read",
                                               # the serve source's `exact_form: auto` reads where the teacher's
                                               # checkpoint is (no fetch) and its safetensors headers
                                               "hylo.assets", "hylo.atomic", "hylo.locks", "hylo.stopping",
                                               "hylo.pipeline.teacher.head"))] == []
