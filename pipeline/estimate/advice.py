"""What to change where a GPU does not fit: the line `hylo estimate` prints under its tables.

For each row length and each GPU of `gpus.GPUS` its peak does not fit, the smallest change that fits:
* a larger world size (`--world-size`, the config's `ray.num_workers`): ZeRO-3 shards the student's states over
  more GPUs. Exact, from the measured step itself: the per-GPU peak at other world sizes is tracked in the same
  pass (`estimate_step(..., other_worlds=...)`);
* a larger sequence-parallel group (`--sequence-parallel`, `train.sequence_parallel`): the row split over more
  GPUs. Measured: the split step is run at each group size in turn (2N, 4N, ...: its time is T / N' tokens' worth,
  all of them together less than the step at N), until every GPU fits;
* the teacher split with the row (`--teacher-split`, `train.sequence_parallel_teacher`), where the teacher runs on
  the training GPUs whole: its figures are the ones the teacher table prints.

Every layout is checked before it is offered, by the config's own rules (`load_stage_config` with the layout's
keys: the group divides the workers and the row, the global batch divides into the groups) and the split's (the
shards hold the conv window, `sp_shard_problem`; Ulysses divides the teacher's query heads,
`sp_teacher.ulysses_problem`). Where the global batch does not divide, the smallest one that does is given with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hylo.pipeline.estimate.gpus import GPU, GPUS
from hylo.pipeline.estimate.report import format_gib, format_tokens
from hylo.pipeline.estimate.sp_teacher import TeacherDims, ulysses_problem

# the largest world size and sequence-parallel group the advice looks at
MAX_WORLD = 1024
MAX_GROUP = 64
# the group search stops where doubling the group lowers the peak by less than this share
MIN_GAIN = 0.1
# refused layouts named under the advice, at most
MAX_REFUSED = 3


@dataclass
class Layout:
    """A world size W and group size N for rows of T tokens, the flags that give it, and why it cannot be (None:
    the config's rules and the split's accept it)."""

    tokens: int
    world: int
    group: int
    flags: list[str] = field(default_factory=list)
    problem: str | None = None


def check_layout(load: Callable[[list[str]], Any], T: int, W: int, N: int, given: tuple[int, int], conv: int,
                 teacher: TeacherDims | None = None, split: str = "whole") -> Layout:
    """The layout (W workers, groups of N, rows of T) checked by the config's rules (`load(overrides)`: the stage
    config loaded with them, raising on a broken rule) and the split's; `given`: the (W, N) of the estimate, whose
    flags need not be repeated. A global batch the groups do not divide is raised to the smallest that they do."""
    from hylo.pipeline.train.config import sp_shard_problem  # lazy: the config's rules

    out = Layout(T, W, N)
    if N > 1 and (why := sp_shard_problem(T, N, conv)):
        out.problem = why
        return out
    if N > 1 and teacher is not None and split == "ulysses" and teacher.heads % N:
        out.problem = ulysses_problem(teacher, N)
        return out
    keys = [f"ray.num_workers={W}", f"train.sequence_parallel={N}", f"data.seq_len={T}"]
    try:
        cfg = load(keys)
    except ValueError as e:
        if "global_batch_sequences" not in str(e):
            out.problem = str(e)
            return out
        cfg = None
    extra: list[str] = []
    if cfg is None:
        # the smallest global batch the W / N data-parallel groups divide, at least the config's
        dp = W // N
        gbs = load([]).train.global_batch_sequences
        gbs = -(-gbs // dp) * dp
        extra = ["--set", f"train.global_batch_sequences={gbs}"]
        try:
            load([*keys, f"train.global_batch_sequences={gbs}"])
        except ValueError as e:
            out.problem = str(e)
            return out
    if N != given[1]:
        out.flags += ["--sequence-parallel", str(N)]
    if W != given[0]:
        out.flags += ["--world-size", str(W)]
    out.flags += extra
    return out


def world_sizes(W: int) -> list[int]:
    """The larger world sizes the advice looks at: W doubled, up to `MAX_WORLD` (multiples of W, so of its groups)."""
    out, w = [], 2 * W
    while w <= MAX_WORLD:
        out.append(w)
        w *= 2
    return out


def group_layouts(T: int, W: int, N: int) -> list[tuple[int, int]]:
    """(group size, world size) the advice looks at: N doubled up to `MAX_GROUP` while the rank keeps at least 2
    tokens, each on W workers, or on the smallest multiple of the group above W where the group does not divide
    W."""
    out, n = [], 2 * N
    while n <= MAX_GROUP and T // n >= 2:
        out.append((n, W if W % n == 0 else -(-W // n) * n))
        n *= 2
    return out


@dataclass
class Fix:
    """One change that fits a GPU: its flags, the peak per GPU it gives, and how that peak was found."""

    layout: Layout
    peak: float
    how: str

    def text(self) -> str:
        return f"{' '.join(self.layout.flags)} ({format_gib(self.peak)} GiB, {self.how})"

    def to_dict(self) -> dict[str, Any]:
        return {"flags": self.layout.flags, "world_size": self.layout.world, "sequence_parallel": self.layout.group,
                "peak_bytes": self.peak, "how": self.how}


def advise(T: int, peak: float, W: int, N: int, peaks_by_world: dict[int, float],
           check: Callable[[int, int], Layout], measure: Callable[[int, int], float],
           teacher_split: tuple[str, float] | None = None,
           gpus: tuple[GPU, ...] | None = None) -> tuple[list[str], list[dict[str, Any]]]:
    """One line per GPU that a T-token row's `peak` (at W workers, groups of N) does not fit: the smallest world
    size that fits it (`peaks_by_world`, the same step's peak at other W), the smallest group that does
    (`measure(N', W')`, the split step's peak, run once per group and only while a GPU is left unfitted), the
    teacher split (`teacher_split`: the key's value and the peak it gives); each layout `check(W', N')`-ed first.
    Returns the lines and, for --json, one record per GPU."""
    unfit = [g for g in (gpus or GPUS) if not g.fits(peak)]
    if not unfit:
        return [], []
    fixes: dict[str, list[Fix]] = {g.name: [] for g in unfit}
    refused: list[str] = []
    checked: dict[tuple[int, int], Layout] = {}

    def check_once(w: int, n: int) -> Layout:
        if (w, n) not in checked:
            checked[(w, n)] = check(w, n)
        return checked[(w, n)]

    # ZeRO-3 over more GPUs: the smallest world size of each GPU that fits it
    for g in unfit:
        for w in sorted(x for x in peaks_by_world if x > W):
            if g.fits(peaks_by_world[w]):
                lay = check_once(w, N)
                if lay.problem is None:
                    fixes[g.name].append(Fix(lay, peaks_by_world[w], "ZeRO-3 arithmetic on this step"))
                    break
                refused.append(f"--world-size {w}: {lay.problem}")
    # the row split over more GPUs, measured, while a GPU has no split that fits it and splitting further still
    # lowers the peak (`MIN_GAIN`: what the rank's tokens hold no longer sets it)
    left, last = list(unfit), peak
    tried: list[Fix] = []
    for n, w in group_layouts(T, W, N):
        if not left:
            break
        lay = check_once(w, n)
        if lay.problem is not None:
            refused.append(f"--sequence-parallel {n}: {lay.problem}")
            continue
        p = measure(n, w)
        tried.append(Fix(lay, p, "its split step measured"))
        for g in [g for g in left if g.fits(p)]:
            fixes[g.name].append(Fix(lay, p, "its split step measured"))
            left.remove(g)
        if p > (1 - MIN_GAIN) * last:
            break
        last = p
    if teacher_split is not None:
        mode, p = teacher_split
        for g in unfit:
            if g.fits(p):
                fixes[g.name].append(Fix(Layout(T, W, N, ["--teacher-split", mode]), p, "the teacher table's figure"))
    lines, records = [], []
    for g in unfit:
        records.append({"tokens": T, "gpu": g.name, "peak_bytes": peak, "fixes": [f.to_dict() for f in fixes[g.name]],
                        "groups_measured": [f.to_dict() for f in tried]})
        what = f"  {g.name} {g.memory_gib:.0f} GiB at {format_tokens(T)} ({format_gib(peak)} GiB): "
        got = fixes[g.name]
        if got:
            lines.append(what + " or ".join(f.text() for f in got))
            continue
        low = min(tried, key=lambda f: f.peak, default=None)
        lines.append(what + f"no larger world size (to {MAX_WORLD}) or sequence-parallel group fits it"
                     + (f"; the lowest measured: {low.text()}" if low else ""))
    # the first layouts the rules refused, so that a missing one is not a mystery
    for r in list(dict.fromkeys(refused))[:MAX_REFUSED]:
        lines.append(f"    (not offered: {r})")
    return lines, records
