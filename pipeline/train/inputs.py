"""What a training stage reads, checked before Ray or torchrun starts. Every error names the key and the file.

`check_stage_inputs(cfg)` is cheap: config files, safetensors headers and Parquet footers, no weights.
* model.student is a HyLo checkpoint. Stage 1 without one checks model.base with the model.convert options.
* model.base (stage 1) has whole .safetensors files.
* Stage 2's teacher source checks what it reads (pipeline/teacher/sources).
* Teacher, base and student agree from their config files: vocabulary, tokenizer, and for stage 1 shape.
* The data's manifest, split and shards are readable, and their rows were made by the student's tokenizer.
* The rows split over a sequence-parallel group (`config.sp_shard_problem`, with the data's own length).

A mismatch stops here, not in the workers, where Ray would retry it as a fault. The driver runs these checks
before the run directory is made or Ray starts (driver.check_run); `--print-config` runs them too
(`check_inputs_for_print`), when every input the config names is on this machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hylo.assets import asset_name, asset_path, resolve_path_or_asset
from hylo.json_files import read_json
from hylo.logs import get_logger
from hylo.pipeline.config import ConfigError
from hylo.pipeline.data.render import token_table, token_table_hash
from hylo.pipeline.teacher.sources import TeacherSourceKind, source_kind
from hylo.pipeline.train.config import CONVERTED_CONV_SIZE, StageConfig, largest_group, sp_shard_problem
from hylo.pipeline.train.storage import is_uri, run_dir
from hylo.weight_files import check_weights_dir

logger = get_logger(__name__)


def check_hylo_checkpoint(key: str, path: str) -> None:
    """`key` names a HyLo checkpoint directory here: its hybrid_config.json and whole weights (ConfigError naming
    the key). The stages' check of model.student, also the estimator's and kernels-check's."""
    from hylo.config import HYBRID_CONFIG_NAME, HybridConfig  # lazy: transformers

    p = Path(path).expanduser()
    if not (p / HYBRID_CONFIG_NAME).is_file():
        what = "does not exist" if not p.exists() else f"has no {HYBRID_CONFIG_NAME}"
        raise ConfigError(f"{key}={path!r}: {what}; it must be a HyLo checkpoint directory (jobs/convert.py "
                          "writes one)", key)
    HybridConfig.from_hybrid_json(p)
    check_weights_dir(p)


def _convert_options_fit_the_base(cfg: StageConfig, base_dir: str | Path) -> None:
    """model.convert against the base's config.json, without loading weights (HybridConfigError names the key)."""
    from transformers import AutoConfig  # lazy: transformers

    from hylo.config import HybridConfigError  # lazy: transformers
    from hylo.upcycle import UpcycleError, hybrid_config_from_base, read_base_config  # lazy: transformers

    options = cfg.model.convert
    # the base's own fields first (its file and field named), then the options against them
    read_base_config(Path(base_dir) / "config.json")
    try:
        hybrid_config_from_base(AutoConfig.from_pretrained(base_dir), options)
    except (HybridConfigError, UpcycleError) as e:
        raise ConfigError(f"model.convert={options.non_defaults()}: {e} (base {base_dir})", "model.convert") from None


def _student_conv(cfg: StageConfig) -> int:
    """The conv window (gdn_conv_size) of the student a run trains: model.student's, else the conversion's."""
    from hylo.config import HYBRID_CONFIG_NAME, HybridConfig  # lazy: transformers

    if not cfg.model.student:
        return CONVERTED_CONV_SIZE
    p = Path(cfg.model.student).expanduser()
    if (p / HYBRID_CONFIG_NAME).is_file():
        hc = HybridConfig.from_hybrid_json(p)
        return hc.gdn_conv_size if hc.linear_layers else 1
    return 1


def _shards_fit_the_student(cfg: StageConfig, tokens: int | None, at: str, length: str = "") -> None:
    """At train.sequence_parallel > 1: the rows split into equal shards that hold the student's conv window
    (`sp_shard_problem`, the one home of the rules). `at` and `length` name where `tokens` comes from."""
    sp = cfg.train.sequence_parallel
    if sp <= 1 or not isinstance(tokens, int):
        return
    student = f"model.student={cfg.model.student}" if cfg.model.student else "the converted student"
    why = sp_shard_problem(tokens, sp, _student_conv(cfg), length, f"{at} ({student})")
    if why:
        raise ConfigError(f"train.sequence_parallel={sp}: {why}", "train.sequence_parallel")


def _data(cfg: StageConfig) -> None:
    from hylo.pipeline.train.row_sources import open_rows  # lazy: torch

    source = open_rows(cfg.data, cfg.train.seed, 0, cfg.ray.num_workers).source
    source.check_shards()
    _data_fits_the_student(cfg, source)
    # the rows' length of a prepared split is its manifest's max_len
    max_len = source.manifest.get("max_len")
    _shards_fit_the_student(cfg, max_len, f"data.path={cfg.data.path} was packed to max_len={max_len}",
                            f"the rows' length, but data.path={cfg.data.path} was packed to max_len={max_len} tokens")
    unverified = [s["file"] for s in source.manifest["shards"] if not s.get("page_checksums")]
    if unverified:
        more = " ..." if len(unverified) > 3 else ""
        logger.warning(f"[train] warning: data.path={cfg.data.path}: {len(unverified)} shard(s) "
                       f"({', '.join(unverified[:3])}{more}) were written without page checksums (prepared "
                       "before they were written): they are read unverified, so a byte changed on disk would "
                       "not be noticed; prepare the data again to have them checked")


def _student_tokenizer(cfg: StageConfig) -> tuple[str, Path] | None:
    """(key, directory) of the tokenizer the student reads: model.student's, or for stage 1 without one
    model.base's (the conversion copies it); None when it is not a local directory."""
    if cfg.model.student:
        if is_uri(cfg.model.student) or not Path(cfg.model.student).expanduser().is_dir():
            return None
        return "model.student", Path(cfg.model.student).expanduser()
    if cfg.stage == 1 and cfg.model.base:
        return "model.base", resolve_path_or_asset(cfg.model.base, "model.base", directory=True)
    return None


def _local_tokenizer(name: str) -> Path | None:
    """The directory a data manifest's `tokenizer` names when it is on this machine (an asset only when it
    is in the cache already: nothing is fetched for a check)."""
    try:
        asset = asset_name(name)
        p = asset_path(asset) if asset is not None else Path(name).expanduser()
    except Exception:  # noqa: BLE001 - an unknown asset or an odd name: nothing to compare with
        return None
    return p if p.is_dir() else None


def _data_fits_the_student(cfg: StageConfig, source: Any) -> None:
    """The rows of data.path were tokenized with the student's tokenizer: the same token for each id (the
    manifest's `token_table` fingerprint, or the tokenizer it names when that is on this machine) and no
    token id past the student's vocabulary (the shards' footer statistics). Rows of another tokenizer stop
    here, not in the workers, where their error would be retried as if it were a fault."""
    found = _student_tokenizer(cfg)
    if found is None:
        return
    key, student = found
    where = f"data.path={cfg.data.path}"
    fix = (f"prepare the data again with the student's tokenizer (tokenize.tokenizer={student}), or train a "
           f"student converted from the model whose tokenizer made these rows")
    m = source.manifest
    mine = _tokens(student)
    made_by = m.get("tokenizer")
    if mine is not None:
        theirs_dir = _local_tokenizer(str(made_by)) if made_by else None
        theirs = _tokens(theirs_dir) if theirs_dir is not None else None
        recorded = m.get("token_table")
        if theirs is not None:
            differ = sorted(i for i in set(mine) | set(theirs) if mine.get(i) != theirs.get(i))
            if differ:
                i = differ[0]
                raise ConfigError(f"{where}: its rows were tokenized with {made_by!r}, whose tokenizer disagrees with "
                                  f"the student's ({student}, {key}) on {len(differ)} token id(s), first id {i}: "
                                  f"{theirs.get(i)!r} vs {mine.get(i)!r}; {fix}", "data.path")
        elif recorded and recorded != token_table_hash(mine):
            raise ConfigError(f"{where}: its rows were tokenized with {made_by!r} (token table {recorded}), not with the "
                              f"student's tokenizer ({student}, {key}: token table {token_table_hash(mine)}); {fix}",
                              "data.path")
    vocab = _model_config(key, student).get("vocab_size") if (student / "config.json").is_file() else None
    if isinstance(vocab, int):
        for file, high in source.max_token_ids():
            if high >= vocab:
                raise ConfigError(f"{where}: {file} holds token id {high}, outside the student's vocabulary of {vocab} "
                                  f"({student / 'config.json'}): the rows were tokenized with another tokenizer"
                                  f"{f' ({made_by!r})' if made_by else ''}; {fix}", "data.path")


def _model_config(key: str, directory: Path) -> dict[str, Any]:
    try:
        return read_json(directory / "config.json", ConfigError, mapping=True)
    except FileNotFoundError:
        raise ConfigError(f"{key}: {directory} has no config.json", key) from None


def _tokens(directory: Path) -> dict[int, str] | None:
    """id -> token of a tokenizer directory's tokenizer.json (vocabulary and added tokens); None when
    it has none (nothing to compare)."""
    tj = directory / "tokenizer.json"
    if not tj.is_file():
        return None
    try:
        data = read_json(tj, ValueError)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{tj}: not a readable tokenizer.json ({e})") from None
    return token_table(data)


def _has_chat_template(directory: Path) -> bool:
    if (directory / "chat_template.jinja").is_file() or (directory / "chat_template.json").is_file():
        return True
    tc = directory / "tokenizer_config.json"
    try:
        return bool(read_json(tc, ValueError).get("chat_template")) if tc.is_file() else False
    except (OSError, ValueError, AttributeError):
        return False


def check_compatible_models(student: Path, other: Path | None, other_key: str, *, other_vocab: int | None = None,
                            tokenizer: Path | None = None, same_shape: bool = False, shown: str | None = None) -> None:
    """Refuse a teacher (or stage 1's base) that cannot distil into `student`, from config files alone:
    vocabulary size, token-for-token tokenizer agreement, and with `same_shape` (layer-wise ILD: the
    student's layers learn the base's layer outputs) hidden size and layer count. `other`: the model
    directory `other_key` names, or None with `other_vocab` its vocabulary and `shown` what the key holds."""
    scfg = _model_config("model.student", student)
    if other is not None:
        ocfg = _model_config(other_key, other)
        other_vocab = ocfg.get("vocab_size")
        if same_shape:
            for k in ("hidden_size", "num_hidden_layers"):
                if ocfg.get(k) != scfg.get(k):
                    raise ConfigError(
                        f"{other_key}={str(other)!r}: {k} {ocfg.get(k)} != the student's {scfg.get(k)} "
                        f"({student / 'config.json'}); stage 1 distils layer by layer, so the base must be the "
                        f"model the student was converted from", other_key)
    if other_vocab is not None and other_vocab != scfg.get("vocab_size"):
        raise ConfigError(
            f"{other_key}={str(other) if other is not None else shown!r}: vocabulary {other_vocab} != the "
            f"student's {scfg.get('vocab_size')} ({student / 'config.json'}); teacher and student must share "
            f"a tokenizer", other_key)
    tok_dir = tokenizer or other
    if tok_dir is None:
        return
    mine, theirs = _tokens(student), _tokens(tok_dir)
    if mine is not None and theirs is not None:
        differ = sorted(i for i in set(mine) & set(theirs) if mine[i] != theirs[i])
        if differ:
            i = differ[0]
            raise ConfigError(
                f"{other_key}: the tokenizers of {tok_dir} and the student ({student}) disagree on {len(differ)} "
                f"token id(s), first id {i}: {theirs[i]!r} vs {mine[i]!r}; teacher and student must share a "
                f"tokenizer", other_key)
    if _has_chat_template(student) and not _has_chat_template(tok_dir):
        logger.warning(f"[train] warning: {other_key}: {tok_dir} has no chat template but the student's "
                       "tokenizer has one: the rows are chat-formatted for the student, a format this "
                       "teacher may not know")


def _teacher_fits(cfg: StageConfig, source: TeacherSourceKind) -> None:
    """What the teacher source knows of its teacher (`compared_with_student`) against the student's files."""
    if not cfg.model.student or cfg.stage != 2 or is_uri(cfg.model.student):
        return
    student = Path(cfg.model.student).expanduser()
    found = source.compared_with_student(cfg.teacher)
    if found is not None:
        check_compatible_models(student, found.model_dir, found.key, other_vocab=found.vocab_size,
                                tokenizer=found.tokenizer_dir, shown=found.value)


def _k_fits_the_vocabulary(cfg: StageConfig, source: TeacherSourceKind) -> None:
    """teacher.k (top-k targets) at most the teacher's vocabulary: from its config.json (or what the source knows
    of it), else the student's, which must be the same."""
    k = cfg.teacher.k
    if k <= 0:
        return
    found = source.compared_with_student(cfg.teacher)
    known: list[tuple[int, str]] = []
    if found is not None and found.model_dir is not None and (found.model_dir / "config.json").is_file():
        known.append((_model_config(found.key, found.model_dir).get("vocab_size"), str(found.model_dir / "config.json")))
    elif found is not None and found.vocab_size is not None:
        known.append((found.vocab_size, f"{found.key}={found.value or found.model_dir}"))
    if cfg.model.student and not is_uri(cfg.model.student):
        student = Path(cfg.model.student).expanduser()
        if (student / "config.json").is_file():
            known.append((_model_config("model.student", student).get("vocab_size"), str(student / "config.json")))
    for vocab, where in known:
        if isinstance(vocab, int) and k > vocab:
            raise ConfigError(f"teacher.k={k}: more than the vocabulary of {vocab:,} tokens ({where}); top-k targets "
                              f"keep at most every token (teacher.k: 0 gives the exact teacher)", "teacher.k")


def _heads_split(cfg: StageConfig, model_dir: Path | None, key: str) -> None:
    """`train.sequence_parallel_teacher: ulysses` splits the heads of the model that runs in each step (stage 1's
    base, stage 2's in-process teacher) over the group: its config.json's heads must divide by N."""
    sp = cfg.train.sequence_parallel
    if sp <= 1 or cfg.train.sequence_parallel_teacher != "ulysses" or model_dir is None:
        return
    if (model_dir / "hybrid_config.json").is_file() or not (model_dir / "config.json").is_file():
        return  # a HyLo teacher splits as the student does (its MLA gathers the latent)
    heads = _model_config(key, model_dir).get("num_attention_heads")
    if isinstance(heads, int) and heads % sp:
        from hylo.seq_parallel import ulysses_problem  # lazy: torch

        # the advice is a group size the run takes: it divides the heads and the workers and splits the rows
        best = largest_group(sp, workers=cfg.ray.num_workers, heads=heads,
                             tokens=[cfg.data.seq_len] if cfg.data.seq_len else [], conv_size=_student_conv(cfg))
        raise ConfigError(f"train.sequence_parallel_teacher=ulysses: {ulysses_problem(heads, sp, best)} "
                          f"({key}: {model_dir / 'config.json'}); train.sequence_parallel_teacher: allgather splits "
                          f"any head count", "train.sequence_parallel_teacher")


def check_stage_inputs(cfg: StageConfig) -> None:
    if cfg.model.student:
        check_hylo_checkpoint("model.student", cfg.model.student)
    if cfg.stage == 1:
        if not cfg.model.base:
            raise ConfigError("stage 1 needs model.base (the model whose layers the student imitates)", "model.base")
        base_dir = resolve_path_or_asset(cfg.model.base, "model.base", directory=True)
        check_weights_dir(base_dir)
        converted = run_dir(cfg) / "converted" / "hybrid_config.json"
        if not cfg.model.student and cfg.model.convert is not None and not converted.is_file():
            _convert_options_fit_the_base(cfg, base_dir)
        if cfg.model.student and Path(cfg.model.student).expanduser().is_dir():
            check_compatible_models(Path(cfg.model.student).expanduser(), Path(base_dir), "model.base",
                                    same_shape=True)
        _heads_split(cfg, Path(base_dir), "model.base")
    else:
        # the source's own files (the teacher's weights, the cache's manifest of teacher.k), then its teacher
        # against the student
        source = source_kind(cfg.teacher.source)
        source.check_inputs(cfg.teacher)
        _teacher_fits(cfg, source)
        _k_fits_the_vocabulary(cfg, source)
        if source.model_runs == "step":
            found = source.compared_with_student(cfg.teacher)
            _heads_split(cfg, found.model_dir if found else None, found.key if found else "teacher")
    if cfg.data.source == "parquet":
        _data(cfg)
    else:
        n = cfg.data.seq_len
        _shards_fit_the_student(cfg, n, f"data.seq_len={n}", f"data.seq_len ({n})")


def absent_inputs(cfg: StageConfig) -> list[str]:
    """Each input the run reads that is not on this machine (yet), as `key=value (not here)` (a path that does not
    exist, an asset not in the cache, a URI) or `key (not set)`. The run refuses them; `--print-config` checks a
    config against its inputs only when there are none (a recipe is printed before its models are made)."""
    keys: list[tuple[str, str | None]] = []
    if cfg.model.student or cfg.stage == 2:
        keys.append(("model.student", cfg.model.student))
    if cfg.stage == 1:
        keys.append(("model.base", cfg.model.base))
    teacher = getattr(cfg, "teacher", None)
    if teacher is not None:
        if teacher.source == "offline":
            keys.append(("teacher.cache_path", teacher.cache_path))
        elif teacher.source != "serve" or teacher.start_pool:
            keys.append(("teacher.model.path", teacher.model.path))
    if cfg.data.source == "parquet":
        keys.append(("data.path", cfg.data.path))
    absent = []
    for key, value in keys:
        if not value:
            absent.append(f"{key} (not set)")
            continue
        try:
            asset = asset_name(value)
            here = (asset_path(asset) if asset is not None else Path(value).expanduser()).exists()
        except Exception:  # noqa: BLE001 - an unknown asset or a URI: not checkable here
            here = False
        if is_uri(value) or not here:
            absent.append(f"{key}={value} (not here)")
    return absent


def check_inputs_for_print(cfg: StageConfig) -> list[str]:
    """What `--print-config` checks before it prints: the run's own checks of its inputs (`check_stage_inputs`,
    ConfigError as the run refuses), when every input is on this machine. Returns the inputs that are not (then
    nothing was checked; the output stays the config alone, which scripts parse)."""
    from hylo.pipeline.paths import resolve_paths  # lazy: layering

    absent = absent_inputs(cfg)
    if not absent:
        check_stage_inputs(resolve_paths(cfg))
    return absent
