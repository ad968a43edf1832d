"""Where should the MLA layers go? Sensitivity search by measurement, and a proxy that needs no training.

Legend: L layers, T tokens of a packed row, N scored tokens of a row, D hidden size.

The measured score (Zebra-Llama's SMART layer-selection method): take the all-linear student and the
all-MLA student of the same base, both after a short stage 1. For each layer i, switch layer i of the
all-linear student to the all-MLA student's layer i and measure KL(base || student) on held-out rows;
the score is how much the KL drops:

    drop_i = KL(all linear) - KL(all linear, layer i = MLA)

and the N layers with the largest drops get MLA. Design choices:
* Stage 1 (Enhanced-ILD) trains every layer on the base model's own layer inputs, so layer i of the
  all-MLA student after stage 1 is what layer i of any mixed student would be after the same stage 1:
  the swap is the student that placement would produce, not an approximation of it.
* Layers before i are the same in the swapped and the all-linear student, so their hidden states are
  computed once (`layer_inputs`) and each score runs only layers i..L-1: on average half a forward.
* Scores run as Ray tasks, one per layer (one CPU or GPU each); every worker process loads the two
  students once and keeps them for the layers it is given.
* Teacher = the base model: its final hidden states on the scored tokens are computed once, and the KL
  goes through the project's fused linear KL (`hylo.pipeline.eval.kl`), so no [N, V] logits are kept.
* The proxy (`proxy_scores`, no training, seconds): per-layer error of each converted mixer at
  initialisation against the base attention output it replaces, on the same rows, fed the base model's
  own layer inputs (mean per-token L2 distance). Three forms are reported with their rank correlation
  (Spearman) against the measured drops: the linear block's error, that error relative to the size of the
  attention output, and the gap between the linear and the MLA block's errors.

The workflow (`PlaceLayers`, run by jobs/place_layers.py; options: `PlacementConfig`), each step resumable
(`<run_dir>/done/` records what finished, `force` redoes everything):
  convert the base all-linear (mla_layers: none) and all-MLA (mla_layers: all)
  -> proxy: per-layer error of each converted mixer against the base attention, no training
  -> a short stage 1 of both students (jobs/stage1.py, `steps`)
  -> score every layer in parallel with Ray tasks -> the `n_mla` largest drops get MLA
  -> placement.json (chosen mla_layers, per-layer scores, proxy rank correlations) + placement_scores.png
  -> with `compare`: each placement (the searched one and the listed ones) converted, trained with the
     same stage 1 + stage 2 budget (`compare_steps`) and evaluated: compare.md / compare.json.
     `compare_seeds: [0, 1, 2]` repeats every compared run per seed (`convert --seed`: the init of what
     conversion does not set; also `train.seed`, though packed rows are read in file order whatever the
     seed) and reports the mean, the spread and the paired difference to the searched placement per seed:
     one seed's init noise on these tiny budgets is as large as the gaps between placements.

The modules: `rows.py` (the held-out rows, `PlacementError`), `swap.py` (the swapped-layer KL), `score.py`
(every layer's score as Ray tasks), `proxy.py` (the training-free proxy), `ranking.py` (rank correlation, the
chosen layers, the compared runs' summary, the plot), `workflow.py` (`PlacementConfig`, `PlaceLayers`), `cli.py`
(the command line). Outside callers import from here.
"""

from __future__ import annotations

from hylo.lazy import lazy_exports

# The names below are loaded on first use: `hylo place-layers --help` (cli.py) imports no torch.
_EXPORTS = {
    "cli": ("placement_config", "run_placement"),
    "proxy": ("proxy_scores",),
    "ranking": ("choose", "compare_summary", "ranks", "spearman"),
    "rows": ("PlacementError", "load_rows"),
    "score": ("score_layers",),
    "swap": ("layer_inputs", "swapped_kl", "teacher_hidden"),
    "workflow": ("PlaceLayers", "PlacementConfig", "compare_markdown"),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
