"""Our released-layout exports and imports against AMD's real code: both directions, at tiny width, on CPU.

    python bench/amd_compat.py --amd-repo DIR --amd-python PY [--work DIR]

DIR is a checkout of github.com/AMD-AGI/AMD-Hybrid-Models (never copied into this project); PY an interpreter
with their pinned packages, e.g. `python3.10 -m venv amd-venv && amd-venv/bin/pip install torch
transformers==4.43.1 huggingface-hub==0.24.5 einops safetensors "numpy<2"` (their install.sh pins
transformers 4.43.1; their X-EcoMLA config dataclass imports on Python 3.10 only). Their code runs there
unmodified (bench/amd_compat_worker.py), with our pure-torch stand-ins for mamba_ssm, causal_conv1d and
flash_attn (bench/amd_standins.py) and their CUDA calls on the CPU; this side (this project's environment)
converts, exports, imports and compares. Nothing is unpickled: tensors cross as safetensors.

It prints:
* whether every fact hylo/released_facts.py records (their config fields and defaults, the asserts, the
  fixed norm eps, Mamba2's arguments) is what the checkout says, and whether the module trees our read-back
  (`their_expected_tensors`, `xecomla_expected_tensors`) predicts are the ones their loaders build;
* one row per layout and direction: ours -> theirs (a conversion of a tiny random base, every weight
  perturbed, exported with `jobs/convert.py --to-released` and loaded by their `from_pretrained` as written),
  theirs -> ours (a model their code builds from a random base with its SVD / attention init, perturbed,
  saved as their training saves it, imported with `--from-released`): the file's tensors their loader did
  not take, its parameters the file did not set, max |logit difference| in fp32 and fp64, and for
  Zebra-Llama exports prefill + greedy decode through their `hybrid_inference` (matrix absorb off / on).
The layouts their public code cannot build (GDN, Qwen q/k norms) must be refused by it: the row says how.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file (python bench/amd_compat.py) of a checkout

from hylo import released_facts as facts  # noqa: E402
from hylo.io import load_hylo, save_hylo  # noqa: E402
from hylo.jobs import convert  # noqa: E402
from hylo.released import their_expected_tensors  # noqa: E402
from hylo.released_xecomla import xecomla_expected_tensors  # noqa: E402
from hylo.upcycle import upcycle  # noqa: E402

WORKER = Path(__file__).resolve().parent / "amd_compat_worker.py"
D, FF, H, G, DH, VOCAB, LAYERS = 64, 128, 4, 2, 16, 128, 4
T, NEW_TOKENS = 16, 6
LLAMA = dict(hidden_size=D, intermediate_size=FF, num_hidden_layers=LAYERS, num_attention_heads=H,
             num_key_value_heads=G, head_dim=DH, vocab_size=VOCAB, max_position_embeddings=256, rope_theta=10000.0,
             rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, rope_key_groups=1, kv_b_per_kv_head=True, tie_word_embeddings=False)
M2 = dict(linear_type="mamba2", mamba2_xb_groups=G)

# ours -> theirs: (layout name, base, conversion options, export layout, their public code builds it)
OURS = [
    ("Llama MLA + Mamba-2", "llama", dict(MLA, mla_layers=[0, 2], q_lora_rank=32, **M2), "zebra-llama", True),
    ("Llama MLA + Mamba-2, whole queries", "llama", dict(MLA, mla_layers=[1, 3], **M2), "zebra-llama", True),
    ("Llama MLA + Mamba-2, kv_b per query head", "llama",
     dict(MLA, mla_layers=[0, 2], q_lora_rank=32, kv_b_per_kv_head=False, **M2), "zebra-llama", True),
    ("Llama MLA only", "llama", dict(MLA, mla_layers="all"), "zebra-llama", True),
    ("Llama MLA only, YaRN, latent norms", "llama",
     dict(MLA, mla_layers="all", q_lora_rank=48, mla_latent_norm=True, mla_latent_norm_eps=1e-6, yarn_factor=4.0,
          yarn_original_max_position_embeddings=64), "zebra-llama", True),
    ("Llama MLA + GDN", "llama", dict(MLA, mla_layers=[0, 2], q_lora_rank=32, gdn_num_heads=2, gdn_head_dim=32),
     "zebra-llama", False),
    ("Qwen3 MLA + Mamba-2 (q/k norms)", "qwen3", dict(MLA, mla_layers=[0, 2], q_lora_rank=32, mamba2_norm_eps=1e-5, **M2),
     "zebra-llama", False),
    ("Llama MLA only -> X-EcoMLA", "llama", dict(MLA, mla_layers="all", q_lora_rank=32), "x-ecomla", True),
    ("Llama MLA only, tied head -> X-EcoMLA", "llama", dict(MLA, mla_layers="all", tie_word_embeddings=True),
     "x-ecomla", True),
]
SSM = {"expand": 1, "ngroups": H, "d_state": DH, "repeat_kv_before_conv": False}
ZEBRA = dict(hidden_size=D, intermediate_size=FF, hidden_act="silu", n_layer=LAYERS, rms_norm_eps=1e-5,
             num_attention_heads=H, num_key_value_heads=G, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8,
             v_head_dim=DH, qk_nope_head_dim=8, max_position_embeddings=256, rope_theta=10000.0, d_model=D,
             d_inner=H * DH, d_xb=G * DH, ssm_cfg=SSM)
XECO_LAYER = dict(hidden_size=D, intermediate_size=FF, attention_dropout=0.0, num_attention_heads=H,
                  llama_num_key_value_heads=G, mla_num_key_value_heads=None, q_energy_ratio=None, kv_energy_ratio=None,
                  max_position_embeddings=256, rope_theta=10000.0, q_lora_rank=32, qk_rope_head_dim=8,
                  kv_lora_rank=32, use_lora_layer_norm=False, use_fixed_rank_for_first_and_last_block=True,
                  v_head_dim=DH, qk_nope_head_dim=8, attention_bias=False, rope_scaling=None)
XECO_MLA = dict(d_model=D, rms_norm_eps=1e-5, d_inner=D, d_xb=G * DH, intermediate_size=FF, hidden_act="silu",
                n_layer=LAYERS, attn_layers=[])
# theirs -> ours: (layout name, side, worker build spec)
THEIRS = [
    ("Zebra-Llama MLA + Mamba-2", "zebra", dict(hybrid_config=dict(ZEBRA, mla_layers=[0, 2]))),
    ("Zebra-Llama MLA + Mamba-2, full kv, latent norms", "zebra",
     dict(hybrid_config=dict(ZEBRA, mla_layers=[1, 3], use_full_kv_head=True, use_lora_layer_norm=True))),
    ("Zebra-Llama MLA + Mamba-2, repeat_kv_before_conv", "zebra",
     dict(hybrid_config=dict(ZEBRA, mla_layers=[0, 2], ssm_cfg=dict(SSM, repeat_kv_before_conv=True)))),
    ("Zebra-Llama MLA only, YaRN", "zebra",
     dict(hybrid_config=dict(ZEBRA, mla_layers=list(range(LAYERS)),
                             rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                           "mscale": 1.0, "mscale_all_dim": 1.0}))),
    ("X-EcoMLA, fixed ranks, tied head", "xecomla",
     dict(layer_config=XECO_LAYER, mla_config=XECO_MLA, tie=True)),
    ("X-EcoMLA, per-layer ranks (SVD energy ratios)", "xecomla",
     dict(layer_config=dict(XECO_LAYER, q_energy_ratio=0.9, kv_energy_ratio=0.98), mla_config=XECO_MLA)),
]


def _base(kind: str, seed: int):
    torch.manual_seed(seed)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**LLAMA)).double().eval()
    cfg = {k: v for k, v in LLAMA.items()}
    cfg.update(rms_norm_eps=1e-6)
    base = Qwen3ForCausalLM(Qwen3Config(**cfg)).double().eval()
    with torch.no_grad():
        for layer in base.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return base


def _perturb(model, seed: int):
    """Every weight moved (trained-looking), then rounded to fp32: the export is written in fp32, and their
    loader builds its layers in fp32 before casting them to the dtype asked for, so weights that are not fp32
    values would differ in an fp64 load before any math ran."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model.float()


def _worker(args, side: str, tasks: list[dict], out: Path) -> dict:
    job = out / f"job-{side}.json"
    job.write_text(json.dumps({"tasks": tasks}))
    res = out / f"res-{side}"
    proc = subprocess.run([args.amd_python, str(WORKER), "--repo", str(args.amd_repo), "--side", side, "--job",
                           str(job), "--out", str(res)], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"error: the worker ({args.amd_python}) failed:\n{proc.stderr[-3000:]}")
    return {"dir": res, **json.loads((res / "results.json").read_text())}


def _quiet(fn, argv: list[str]) -> int:
    """Run a CLI main with its summary (stdout) and warnings kept out of the table; errors still go to stderr."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        return fn(argv)


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def _exp(x: float) -> str:
    return f"{x:.1e}"


# ------------------------------------------------------------------------------------ facts
def check_facts(zebra: dict, xeco: dict) -> list[str]:
    """Mismatches between hylo/released_facts.py and what the checkout's code says."""
    bad = []

    def same(name, ours, theirs):
        if json.dumps(ours, sort_keys=False) != json.dumps(theirs, sort_keys=False):
            bad.append(f"{name}: recorded {ours!r}, the checkout has {theirs!r}")

    def exprs(rows):
        # (message, expression), spaces aside
        return [[m, e.replace(" ", "")] for m, e in rows]

    same("HybridConfig fields", facts.HYBRID_CONFIG_FIELDS, zebra["hybrid_config_fields"])
    same("HybridConfig.__post_init__ asserts", exprs(facts.HYBRID_CONFIG_ASSERTS), exprs(zebra["hybrid_config_asserts"]))
    same("latent norm eps", facts.LATENT_NORM_EPS, zebra["latent_norm_eps"])
    same("Mamba-2 gated norm eps", facts.MAMBA_GATED_NORM_EPS, zebra["mamba_gated_norm_eps"])
    args = zebra["mamba2_args"]
    same("Mamba2 arguments", {k: facts.MAMBA2_ARGS[k] for k in facts.MAMBA2_ARGS},
         {k: args.get(k, "<absent>") for k in facts.MAMBA2_ARGS})
    missing = [k for k in facts.MAMBA2_ARGS_NO_MATH if k not in args]
    if missing:
        bad.append(f"Mamba2 has no argument(s) {missing}")
    same("YaRN default original window", facts.YARN_DEFAULT_ORIGINAL, zebra["yarn_default_original"])
    same("MLAConfig fields", facts.MLA_CONFIG_FIELDS, xeco["mla_config_fields"])
    same("DeepseekV3Config defaults", facts.DEEPSEEK_V3_DEFAULTS, xeco["deepseek_v3_defaults"])
    same("DeepseekV3Config asserts", exprs(facts.DEEPSEEK_V3_ASSERTS), exprs(xeco["deepseek_v3_asserts"]))
    return bad


# ------------------------------------------------------------------------------------ run
def prepare_ours(work: Path) -> list[dict]:
    """Convert, perturb, save, export with the CLI; our logits in fp32 / fp64 and teacher-forced decode logits."""
    rows = []
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(7))
    save_file({"ids": ids}, str(work / "ids.safetensors"))
    for n, (name, base_kind, opts, layout, public) in enumerate(OURS):
        model = _perturb(upcycle(_base(base_kind, n), **opts).eval(), 100 + n)
        ours, out = work / f"ours-{n}", work / f"export-{n}"
        save_hylo(model, ours)
        rc = _quiet(convert.main, ["--to-released", str(ours), "--out", str(out), "--released-layout", layout])
        if rc:
            raise SystemExit(f"error: the export of {name!r} failed (exit {rc})")
        logits = {dt: load_hylo(ours, dtype=getattr(torch, dt))(ids).logits.detach() for dt in ("float32", "float64")}
        rows.append(dict(name=name, n=n, dir=out, ours=ours, layout=layout, public=public, logits=logits))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--amd-repo", required=True, type=Path, help="a checkout of AMD-AGI/AMD-Hybrid-Models")
    ap.add_argument("--amd-python", required=True, help="an interpreter with their pinned packages")
    ap.add_argument("--work", type=Path, help="keep the files here (default: a temporary directory)")
    ap.add_argument("--fp64-norms", action="store_true",
                    help="diagnostic: one more fp64 column with their RMSNorms computing in fp64 (as written they "
                         "compute in fp32 whatever the dtype); not their code as written")
    args = ap.parse_args(argv)
    for sub in ("Zebra-Llama/hybrid/hybrid_config.py", "X-EcoMLA/mla/hybrid_wrapper.py"):
        if not (args.amd_repo / sub).is_file():
            raise SystemExit(f"error: {args.amd_repo} has no {sub}: not a checkout of {facts.AMD_REPO}")
    commit = _commit(args.amd_repo)
    work = args.work or Path(tempfile.mkdtemp(prefix="amd-compat-"))
    work.mkdir(parents=True, exist_ok=True)
    torch.set_grad_enabled(False)
    ours = prepare_ours(work)
    ids_file = str(work / "ids.safetensors")
    ids = load_file(ids_file)["ids"]
    tasks = {"zebra": [{"name": "facts", "kind": "facts"}], "xecomla": [{"name": "facts", "kind": "facts"}]}
    for r in ours:
        side = "xecomla" if r["layout"] == "x-ecomla" else "zebra"
        tasks[side].append({"name": f"load-{r['n']}", "kind": "load", "dir": str(r["dir"]), "ids": ids_file,
                            "fp64_norms": args.fp64_norms})
        if r["public"]:
            cfgs = work / f"configs-{r['n']}"
            cfgs.mkdir(exist_ok=True)
            for f in r["dir"].glob("*.json"):
                shutil.copy(f, cfgs / f.name)
            tasks[side].append({"name": f"tree-{r['n']}", "kind": "tree", "dir": str(cfgs)})
            if side == "zebra":
                tasks[side].append({"name": f"infer-{r['n']}", "kind": "infer", "dir": str(r["dir"]), "ids": ids_file,
                                    "new_tokens": NEW_TOKENS})
    for n, (_, side, spec) in enumerate(THEIRS):
        base = dict(LLAMA, tie_word_embeddings=bool(spec.get("tie")))
        tasks[side].append({"name": f"build-{n}", "kind": "build", "seed": 200 + n, "base": base, "ids": ids_file,
                            "out": str(work / f"theirs-{n}"), "fp64_norms": args.fp64_norms,
                            **{k: v for k, v in spec.items() if k != "tie"}})
    res = {side: _worker(args, side, tasks[side], work) for side in ("zebra", "xecomla")}

    print(f"AMD's code: {facts.AMD_REPO} at {commit} (their modules unmodified; Python 3.10, transformers 4.43.1, "
          f"CPU, stand-ins bench/amd_standins.py)")
    print(f"facts recorded at {facts.AMD_COMMIT[:8]} (hylo/released_facts.py)", end=": ")
    for side in res:
        if not res[side]["facts"]["ok"]:
            raise SystemExit(f"error: reading their {side} facts failed: {res[side]['facts']['error']}")
    bad = check_facts(res["zebra"]["facts"], res["xecomla"]["facts"])
    print("all match the checkout" if not bad else "MISMATCH\n  " + "\n  ".join(bad))
    trees = []
    for r in ours:
        side = "xecomla" if r["layout"] == "x-ecomla" else "zebra"
        t = res[side].get(f"tree-{r['n']}")
        if t is None:
            continue
        if not t["ok"]:
            trees.append(f"{r['name']}: {t['error']}")
            continue
        cfg = {f.name: json.loads(f.read_text()) for f in r["dir"].glob("*.json")}
        if side == "zebra":
            want = their_expected_tensors(cfg["config.json"], cfg["hybrid_config.json"])
        else:
            want = xecomla_expected_tensors(cfg["config.json"], cfg["MLA_config.json"], cfg["mla_layer_config.json"])
        got = {k: tuple(v) for k, v in t["tree"].items()}
        if side == "xecomla" and cfg["config.json"].get("tie_word_embeddings"):
            # their LlamaForCausalLM ties the head: it is the embeddings, not read from the file
            got.pop("lm_head.weight", None)
        if got != want:
            diff = sorted(set(got) ^ set(want)) or sorted(k for k in got if got[k] != want.get(k))
            trees.append(f"{r['name']}: {diff[:6]}")
    print(f"module trees (our read-back vs their loader's), {sum(1 for r in ours if r['public'])} layouts: "
          + ("all match" if not trees else "MISMATCH\n  " + "\n  ".join(trees)))
    print()
    W = max(len(x[0]) for x in OURS + THEIRS)
    star = f" {'fp64*':>8}" if args.fp64_norms else ""
    head = (f"{'direction':<12} {'layout':<{W}} {'their loader':<21} {'not consumed':>12} {'left at init':>12} "
            f"{'fp32':>8} {'fp64':>8}{star}  prefill+decode fp32 (absorb off / on)")
    print(head)
    print("-" * len(head))
    for r in ours:
        side = "xecomla" if r["layout"] == "x-ecomla" else "zebra"
        got = res[side][f"load-{r['n']}"]
        if not got["ok"]:
            verdict = "refused" + (" (as designed)" if not r["public"] else " (UNEXPECTED)")
            print(f"{'ours->theirs':<12} {r['name']:<{W}} {verdict:<21} {_one_line(got['error'])[:110]}")
            continue
        logits = load_file(str(res[side]["dir"] / f"load-{r['n']}.safetensors"))
        acc = got["fp32"]
        cells = [_exp(_maxdiff(logits["fp32"], r["logits"]["float32"])),
                 _exp(_maxdiff(logits["fp64"], r["logits"]["float64"]))]
        if args.fp64_norms:
            cells.append(_exp(_maxdiff(logits["fp64n"], r["logits"]["float64"])))
        infer = res[side].get(f"infer-{r['n']}")
        dec = "-" if infer is None else _decode_cell(infer, res[side]["dir"] / f"infer-{r['n']}.safetensors", r, ids)
        verdict = "loads as written" + ("" if r["public"] else " (UNEXPECTED)")
        differ = sorted({k for run in ("fp32", "fp64") for k in got[run]["value_differs"]})
        extra = f"  LOADED VALUES DIFFER FROM THE FILE: {differ[:3]}" if differ else ""
        print(f"{'ours->theirs':<12} {r['name']:<{W}} {verdict:<21} {len(acc['not_consumed']):>5} of {acc['tensors']:<4} "
              f"{len(acc['left_at_init']):>12} " + " ".join(f"{c:>8}" for c in cells) + f"  {dec}{extra}")
    for n, (name, side, _) in enumerate(THEIRS):
        got = res[side][f"build-{n}"]
        if not got["ok"]:
            print(f"{'theirs->ours':<12} {name:<{W}} {'their build failed':<21} {_one_line(got['error'])[:110]}")
            continue
        d, mine = work / f"theirs-{n}", work / f"imported-{n}"
        rc = _quiet(convert.main, ["--from-released", str(d), "--out", str(mine)])
        if rc:
            print(f"{'theirs->ours':<12} {name:<{W}} {'our import refused it':<21} (exit {rc}, the error is above)")
            continue
        theirs = load_file(str(res[side]["dir"] / f"build-{n}.safetensors"))
        ours64 = load_hylo(mine, dtype=torch.float64)(ids).logits
        cells = [_exp(_maxdiff(load_hylo(mine, dtype=torch.float32)(ids).logits, theirs["fp32"])),
                 _exp(_maxdiff(ours64, theirs["fp64"]))]
        if args.fp64_norms:
            cells.append(_exp(_maxdiff(ours64, theirs["fp64n"])))
        print(f"{'theirs->ours':<12} {name:<{W}} {'imported (strict)':<21} {0:>5} of {got['fp32']['tensors']:<4} {0:>12} "
              + " ".join(f"{c:>8}" for c in cells) + "  -")
    print(f"\nnot consumed / left at init: the file's tensors their from_pretrained did not take / its parameters the "
          f"file did not set (theirs -> ours: our import is strict, either is an error); fp32 / fp64: max |logit "
          f"difference| over {ids.shape[0]} x {T} tokens, vocabulary {VOCAB}"
          + ("; fp64*: their RMSNorms computing in fp64 (diagnostic, not their code as written)" if args.fp64_norms else "")
          + f"; prefill + decode: their hybrid_inference on {T} tokens then greedy decoding, max |difference| of the "
          f"logits it samples each token from and ours on the same tokens (the same greedy tokens unless said)."
          + (f" Files kept in {work}." if args.work else ""))
    return 0


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _decode_cell(infer: dict, path: Path, r: dict, ids: torch.Tensor) -> str:
    if not infer["ok"]:
        m = re.search(r"size mismatch for (\S+):", infer["error"])
        why = f"size mismatch for {m.group(1)}" if m else _one_line(infer["error"])[:150]
        return f"their hybrid_inference refused it: {why}"
    t = load_file(str(path))
    model = load_hylo(r["ours"], dtype=torch.float32)
    cells = []
    for key in ("plain", "absorb"):
        seq, scores = t[f"{key}.sequences"], t[f"{key}.scores"]
        ours = model(seq).logits[:, ids.shape[1] - 1: ids.shape[1] - 1 + scores.shape[1]]
        # our greedy choice from the same prefix must be theirs
        same = torch.equal(ours.argmax(-1), seq[:, ids.shape[1]: ids.shape[1] + scores.shape[1]])
        cells.append(f"{_exp(_maxdiff(scores, ours))}{'' if same else ' (tokens differ)'}")
    return " / ".join(cells) + f" (prefill + {scores.shape[1] - 1} decode steps)"


def _commit(repo: Path) -> str:
    """The checkout's commit: `git rev-parse HEAD`, or the COMMIT file an export (`git archive`) was given."""
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
        if out.returncode == 0:
            return out.stdout.strip()[:8]
    except OSError:
        pass
    f = repo / "COMMIT"
    return f.read_text().strip()[:8] if f.is_file() else "an unknown commit"


if __name__ == "__main__":
    sys.exit(main())
