"""What the estimated step is built from: the shapes of the student, the base (stage 1) and the teacher (stage 2),
read from configs, and the teacher at its shape (`ShapeTeacher`: the in-process teacher's model, or the records
the Serve pool or the cache delivers)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hylo.assets import asset_name, resolve_path_or_asset
from hylo.json_files import read_json
from hylo.kernels.fused_kl.topk import TeacherTopK
from hylo.model_files import ModelFileError, check_model_config
from hylo.pipeline.config import ConfigError
from hylo.pipeline.estimate.fake import build_model, fake_tensors
from hylo.pipeline.teacher.model import TeacherModel, torch_dtype
from hylo.pipeline.teacher.protocol import BoundTeacher, StreamedLogits, TargetSpec
from hylo.pipeline.teacher.sources import source_kind
from hylo.pipeline.train.config import Stage1Config, Stage2Config, StageConfig
from hylo.upcycle.options import hybrid_config_from_base

# config.json of the published bases and teachers the recipes name, for a machine where their directories
# are not mounted (the estimate needs the shapes only; a directory that exists is read instead)
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "Llama-3.2-1B-Instruct": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                                  rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
                                  rms_norm_eps=1e-5),
    "Llama-3.2-3B-Instruct": dict(model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                  num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                                  rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
                                  rms_norm_eps=1e-5),
    "Llama-3.1-8B-Instruct": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                                  rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False,
                                  rms_norm_eps=1e-5),
    "Qwen3-1.7B": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True,
                       rms_norm_eps=1e-6),
    "Qwen3-8B": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
                     rms_norm_eps=1e-6),
}


def model_config(path: str, what: str):
    """The transformers config of a model directory, an asset, or a published model named by its directory."""
    from transformers import AutoConfig  # lazy: transformers

    p = Path(str(path)).expanduser()
    if asset_name(path) is not None or (p / "config.json").is_file():
        d = resolve_path_or_asset(path, what, directory=True)
        # its fields within what a model can be built from (one line naming the file and the field)
        check_model_config(read_json(d / "config.json", ModelFileError, mapping=True), d / "config.json")
        return AutoConfig.from_pretrained(d)
    known = KNOWN_MODELS.get(p.name)
    if known is None:
        raise ConfigError(f"{what}={path}: no config.json there and not a published model this estimate knows "
                          f"({', '.join(KNOWN_MODELS)}); point it at a directory holding the model's config.json",
                          what)
    return AutoConfig.for_model(**known)


@dataclass
class Shapes:
    """What the step is built from: the student's HybridConfig, and the base (stage 1) or teacher config."""

    student: Any
    base: Any | None = None
    teacher: Any | None = None


def conversion_for_student(cfg: StageConfig, config_path: str | None, overrides: list[str]) -> Stage1Config | None:
    """Where the shape of the student a tool prices (`hylo estimate`, `hylo kernels-check`) comes from: None when
    model.student is a checkpoint here (its config.json), else the stage-1 conversion the config describes, with
    the paths resolved.

    A named student that does not exist, or a folder without a config.json, is refused with the stages' words
    (train/inputs.py `check_hylo_checkpoint`), unless it is the model this config's stage 1 writes (`<stage 1's
    ray.storage_path>/<ray.name>/model`): a recipe is priced before its stage 1 ran, from that conversion, and the
    report says so (`conversion_note`). Stage 1's own student is its input: never converted in its place. Without
    model.student, stage 2 is priced from the conversion (as stage 1 makes it)."""
    from hylo.pipeline.paths import resolve_paths  # lazy: layering
    from hylo.pipeline.train.config import load_conversion_config
    from hylo.pipeline.train.storage import is_uri, run_location

    student = cfg.model.student
    stage1 = resolve_paths(load_conversion_config(config_path, overrides)) if cfg.stage == 2 else None
    if not student:
        return stage1
    here = not is_uri(student) and Path(student).expanduser().exists()
    if here and (Path(student).expanduser() / "config.json").is_file():
        return None
    made = (run_location(stage1.ray.storage_path, stage1.ray.name) / "model"
            if stage1 is not None and stage1.model.base else None)
    if made is not None and not here and made.uri().rstrip("/") == (
            student.rstrip("/") if is_uri(student) else str(Path(student).expanduser().resolve())):
        return stage1
    what = "has no config.json" if here else "does not exist"
    hint = (f"; before stage 1 ran, set it to the model stage 1 writes ({made.uri()}) to price that conversion"
            if made is not None and not here else "")
    raise ConfigError(f"model.student={student!r}: {what}; it must be a HyLo checkpoint directory (jobs/convert.py "
                      f"writes one){hint}", "model.student")


def conversion_note(cfg: StageConfig, stage1: Stage1Config | None) -> str | None:
    """The line a report carries when a named model.student is priced as stage 1's conversion (it does not exist
    yet: `conversion_for_student`); None otherwise."""
    if stage1 is None or not cfg.model.student:
        return None
    convert = stage1.model.convert.non_defaults() if stage1.model.convert is not None else {}
    return (f"model.student={cfg.model.student} does not exist yet: it is the model stage 1 of this config writes, "
            f"priced as stage 1's conversion (model.base={stage1.model.base}, model.convert={convert})")


def student_config(cfg: StageConfig, stage1: Stage1Config | None):
    """The student's HybridConfig: its checkpoint's config where it exists, else the conversion of the base."""
    from hylo.config import HybridConfig  # lazy: transformers

    if cfg.model.student and (Path(cfg.model.student).expanduser() / "config.json").is_file():
        return HybridConfig.from_pretrained(Path(cfg.model.student).expanduser())
    s1 = cfg if isinstance(cfg, Stage1Config) else stage1
    if s1 is None or not s1.model.base:
        student = (f"model.student={cfg.model.student} has no config.json" if cfg.model.student
                   else "model.student is not set")
        raise ConfigError(f"{student}, and the config has no model.base to convert (stage 1's): the student's shape "
                          f"is unknown; set model.student to a HyLo checkpoint, or model.base (and model.convert) "
                          f"to the model stage 1 converts", "model.student")

    with warnings.catch_warnings():
        # the base's RoPE scaling is replaced by YaRN in the MLA layers (the converter warns)
        warnings.simplefilter("ignore")
        return hybrid_config_from_base(model_config(s1.model.base, "model.base"), s1.model.convert)


def shapes_of(cfg: StageConfig, stage1: Stage1Config | None = None) -> Shapes:
    shapes = Shapes(student_config(cfg, stage1))
    if isinstance(cfg, Stage1Config):
        shapes.base = model_config(cfg.model.base, "model.base")
    elif source_kind(cfg.teacher.source).model_runs:
        shapes.teacher = model_config(cfg.teacher.model.path, "teacher.model.path")
    return shapes


def parameter_count(config: Any) -> int:
    """Parameters of a model of this config (built on fake tensors: exact, no memory)."""
    with fake_tensors():
        model = build_model(config, torch.float32)
        return sum(p.numel() for p in model.parameters())


class _WireTopK:
    """The top-k records a Serve pool or the offline cache hands the step (logprobs [T, k] in the wire
    dtype, indices [T, k] int32, tail mass [T] fp32), on the step's device."""

    def __init__(self, k: int, dtype: torch.dtype) -> None:
        self.k, self.dtype = k, dtype

    def targets(self, rows, spec):
        for r in rows:
            T = r.num_tokens
            yield {"teacher_topk": TeacherTopK(torch.zeros(T, self.k, dtype=self.dtype),
                                               torch.zeros(T, self.k, dtype=torch.int32),
                                               torch.zeros(T, dtype=torch.float32))}


class _WireLogits:
    """Full-vocabulary logit chunks [C, V] as the pool streams them (the client's dtype)."""

    def __init__(self, vocab: int, chunk: int, dtype: torch.dtype) -> None:
        self.vocab, self.chunk, self.dtype = vocab, chunk, dtype

    def targets(self, rows, spec):
        for r in rows:
            T = r.num_tokens
            chunks = (torch.zeros(min(self.chunk, T - s), self.vocab, dtype=self.dtype) for s in range(0, T, self.chunk))
            yield {"teacher_logits_fn": StreamedLogits(chunks)}



class _WireHidden:
    """The Serve pool's hidden states [T, H'] (the teacher's dtype) and the trainer's copy of its LM head [V, H']
    (one tensor, held for the run as the client holds it)."""

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype) -> None:
        self.head = torch.zeros(vocab, hidden, dtype=dtype)
        self.dtype = dtype

    def targets(self, rows, spec):
        for r in rows:
            yield {"teacher_hidden": torch.zeros(r.num_tokens, self.head.shape[1], dtype=self.dtype),
                   "teacher_weight": self.head}


class ShapeTeacher:
    """stage2.build's teacher factory at the teacher's shape, on the current mode (fake tensors in the estimate):
    the in-process teacher (its own `TeacherModel` over a model of `shapes.teacher`), or the top-k records,
    hidden states (with the LM head the trainer holds: its memory and its product in the fused KL are the step's)
    or logit chunks the Serve pool or the cache delivers. `model`: the in-process teacher's model once built (None
    from the pool or the cache)."""

    def __init__(self, cfg: Stage2Config, shapes: Shapes) -> None:
        self.cfg, self.shapes = cfg, shapes
        self.model: nn.Module | None = None

    def __call__(self, vocab: int):
        t = self.cfg.teacher
        spec = TargetSpec(t.k, t.form)
        teacher_model = None
        if source_kind(t.source).model_runs == "step":
            teacher_model = build_model(self.shapes.teacher, torch_dtype(t.model.dtype))
            m = t.model
            source: Any = TeacherModel(teacher_model, dtype=m.dtype, device="cpu", isolation=m.isolation,
                                       logits_chunk_tokens=m.logits_chunk_tokens, max_forward_tokens=m.max_forward_tokens)
        elif spec.form == "topk":
            source = _WireTopK(t.k, torch_dtype(t.client.dtype))
        elif spec.form == "hidden":
            text = self.shapes.teacher.get_text_config()
            source = _WireHidden(vocab, int(text.hidden_size), torch_dtype(t.model.dtype))
        else:
            source = _WireLogits(vocab, t.model.logits_chunk_tokens, torch_dtype(t.client.dtype))
        self.model = teacher_model
        return BoundTeacher(source, spec, vocab)
