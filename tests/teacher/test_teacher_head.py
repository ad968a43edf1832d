"""The Serve pool's hidden-state form (`exact_form: hidden`), without Ray: the trainer's LM head read from the
teacher's checkpoint (teacher/head.py), `auto`'s choice, the handshake against the replica's head, and the
targets the pool's real replica class and client give, against the in-process teacher's.

The real pool (Ray Serve) runs the same in tests/teacher/test_teacher_serve.py; the stage-2 loss and gradients of
a split row (N = 2) against the in-process teacher's in tests/train/test_train_seq_parallel.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hylo.pipeline.config import ConfigError
from hylo.pipeline.data.rows import check_row
from hylo.pipeline.teacher.head import HEAD_KEY, TIED_KEY, HeadError, find_head, head_digest, load_head
from hylo.pipeline.teacher.protocol import BoundTeacher, TargetSpec
from hylo.pipeline.train.config import load_stage_config

from tests.helpers import teacher as teacher_helpers
from tests.helpers.teacher import make_packed_row, save_tiny_llama

VOCAB, HIDDEN = 96, 32
HIDDEN_FORM = TargetSpec(0, "hidden")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny Llama (untied head), the same with tied embeddings, a HyLo conversion, and the replica."""
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("head")
    untied = save_tiny_llama(root / "untied", VOCAB, HIDDEN)
    tied = root / "tied"
    shutil.copytree(untied, tied)
    m = LlamaForCausalLM.from_pretrained(untied)
    m.config.tie_word_embeddings = True
    m.tie_weights()
    m.save_pretrained(tied, safe_serialization=True)
    return {"untied": untied, "tied": tied, "replica": teacher_helpers.local_replica(untied, 8)}


def _rows() -> list:
    return [check_row(make_packed_row(docs, VOCAB, seed=60 + i, pad=pad))
            for i, (docs, pad) in enumerate([([5, 9, 6], 0), ([12, 4], 4)])]


def test_the_head_is_found_from_the_safetensors_headers_tied_or_not(models):
    from safetensors import safe_open

    untied, tied = find_head(models["untied"]), find_head(models["tied"])
    assert (untied.key, untied.shape, untied.dtype) == (HEAD_KEY, (VOCAB, HIDDEN), "F32")
    with safe_open(tied.file, "np") as st:
        assert HEAD_KEY not in st.keys()  # noqa: SIM118
    assert (tied.key, tied.shape) == (TIED_KEY, (VOCAB, HIDDEN))
    # the loaded head is the model's own output layer, in the teacher's dtype
    from transformers import AutoModelForCausalLM

    for name in ("untied", "tied"):
        ref = AutoModelForCausalLM.from_pretrained(models[name], dtype=torch.bfloat16).get_output_embeddings().weight
        got = load_head(models[name], torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, ref), name


def test_a_head_that_cannot_be_read_is_named(models, tmp_path):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "m"
    shutil.copytree(models["untied"], d)
    weights = load_file(d / "model.safetensors")
    # untied and no lm_head: the embeddings are not it
    save_file({k: v for k, v in weights.items() if k != HEAD_KEY}, d / "model.safetensors")
    assert find_head(d) == f"{d}: no tensor {HEAD_KEY} in model.safetensors"
    # a head of another shape than config.json's
    save_file({**weights, HEAD_KEY: weights[HEAD_KEY][:-1].contiguous()}, d / "model.safetensors")
    assert f"{HEAD_KEY} has shape [{VOCAB - 1}, {HIDDEN}], config.json says [vocab_size {VOCAB}" in find_head(d)
    # a NaN in it
    bad = weights[HEAD_KEY].clone()
    bad[3, 4] = float("nan")
    save_file({**weights, HEAD_KEY: bad}, d / "model.safetensors")
    with pytest.raises(HeadError, match=rf"{HEAD_KEY} \(the teacher's LM head\) holds 1 NaN / inf values"):
        load_head(d, torch.float32)
    # no safetensors at all
    (d / "model.safetensors").unlink()
    assert find_head(d) == f"{d} has no .safetensors weights (the head is read with safetensors)"


def _serve(path, *sets: str):
    return load_stage_config(2, None, ["teacher.source=serve", f"teacher.model.path={path}", *sets]).teacher


def test_auto_picks_hidden_where_the_pool_runs_a_transformers_teacher_whose_head_can_be_read(models, tmp_path):
    assert _serve(models["untied"]).form == "hidden"
    assert _serve(models["tied"]).form == "hidden"
    # a pool someone else runs: its checkpoint is not known here
    assert _serve(models["untied"], "teacher.start_pool=false").form == "logits"
    assert _serve(models["untied"], "teacher.start_pool=false", "teacher.exact_form=hidden").form == "hidden"
    # a published teacher not mounted here (`hylo estimate` on a laptop): a transformers one
    assert _serve("/mnt/none/Llama-3.1-8B-Instruct").form == "hidden"
    # a HyLo teacher, and one whose head safetensors cannot read: logits
    hylo = tmp_path / "hylo"
    shutil.copytree(models["untied"], hylo)
    (hylo / "hybrid_config.json").write_text(json.dumps({}))
    assert _serve(hylo).form == "logits"
    nohead = tmp_path / "nohead"
    shutil.copytree(models["untied"], nohead)
    (nohead / "model.safetensors").rename(nohead / "other.bin")
    assert _serve(nohead).form == "logits"
    # top-k stays top-k
    assert _serve(models["untied"], "teacher.k=8").form == "topk"


def test_hidden_asked_of_a_teacher_whose_head_cannot_be_read_stops_before_ray(models, tmp_path):
    from hylo.pipeline.teacher.sources import source_kind

    nohead = tmp_path / "nohead"
    shutil.copytree(models["untied"], nohead)
    (nohead / "model.safetensors").rename(nohead / "other.bin")
    t = _serve(nohead, "teacher.exact_form=hidden", "teacher.start_pool=false")
    with pytest.raises(ConfigError, match=r"teacher.model.path=.*nohead: exact_form hidden reads the teacher's LM "
                                          r"head there, and cannot: .* has no .safetensors weights .*; set "
                                          r"teacher.exact_form: logits"):
        source_kind("serve").check_inputs(t)


def _client(replica, head):
    from hylo.pipeline.teacher.client import TeacherClient

    handle = teacher_helpers.LocalHandle(replica)
    return TeacherClient(handle, chunk_tokens=8, head=head, retry_backoff_s=0), handle


def test_the_pools_hidden_states_are_the_inprocess_teachers_and_the_head_is_checked(models):
    """Whole rows and a range: the replica's hidden states with the trainer's head are the in-process teacher's
    targets (same dtype, same values); the head is given once per device, not copied per row."""
    from hylo.pipeline.teacher.model import TeacherModel

    rows = _rows()
    inproc = BoundTeacher(TeacherModel(models["untied"]), HIDDEN_FORM)
    client, handle = _client(models["replica"], load_head(models["untied"], torch.float32))
    client.check_head(str(models["untied"]))
    pool = BoundTeacher(client, HIDDEN_FORM)
    for rng in (None, (6, 17)):
        got, want = list(pool.targets(rows, "cpu", rng)), list(inproc.targets(rows, "cpu", rng))
        for g, w in zip(got, want, strict=True):
            assert g["teacher_hidden"].dtype == w["teacher_hidden"].dtype == torch.float32
            torch.testing.assert_close(g["teacher_hidden"], w["teacher_hidden"], rtol=1e-6, atol=1e-6)
            assert torch.equal(g["teacher_weight"], w["teacher_weight"])
        assert len({id(g["teacher_weight"]) for g in got}) == 1
    # one request per row, the range in it; only the range's tokens came back
    assert [r[0] for r in handle.requests] == ["hidden"] * 4
    assert handle.tokens_back == [r.num_tokens for r in rows] + [11, 11]


def test_a_pool_with_another_head_or_dtype_is_refused_naming_it(models, tmp_path):
    head = load_head(models["untied"], torch.float32)
    other = save_tiny_llama(tmp_path / "other", VOCAB, HIDDEN, seed=1)
    client, _ = _client(models["replica"], load_head(other, torch.float32))
    with pytest.raises(HeadError, match=r"the teacher pool's LM head is not the one read from /x .*: digest "
                                        rf"'{head_digest(head)}' on the replica, '[0-9a-f]+' here"):
        client.check_head("/x")
    client, _ = _client(models["replica"], load_head(models["untied"], torch.bfloat16))
    with pytest.raises(HeadError, match=r"dtype 'float32' on the replica, 'bfloat16' here"):
        client.check_head("/x")
    # a client without a head gives no hidden states
    client, _ = _client(models["replica"], None)
    with pytest.raises(ValueError, match="the pool teacher cannot give hidden targets"):
        next(client.targets(_rows(), HIDDEN_FORM))
