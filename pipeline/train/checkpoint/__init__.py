"""Training checkpoints: what a checkpoint directory holds, which one a run resumes from, DeepSpeed's
part of saving and loading, and the final HF-format consolidation.

A checkpoint is one directory `<run dir>/step_<NNNNNNNN>/`:

    zero/state/...                       DeepSpeed's files: each rank's ZeRO-3 partition of parameters
                                         and optimiser state (+ rank 0's `latest`), written by
                                         `engine.save_checkpoint`
    trainer_state.json                   rank 0: step, config (whole) + breaking-key hash, world size,
                                         scheduler state (checked against DeepSpeed's on load), data
                                         fingerprint, metrics of the step
    ranks/rank_<r>.json                  each rank: its exact data position and Python RNG state
    ranks/rank_<r>.rng.safetensors       each rank: torch / CUDA / numpy RNG states
    ranks/rank_<r>.files.json            each rank: size + sha256 of the files it hashed
    manifest.json                        rank 0, LAST: every file of the checkpoint with size + sha256

One idea per module:

    layout.py        the directory format: names, the manifest (written last), when a checkpoint is
                     complete and intact, a run's checkpoints (newest, pruning, deletion)
    write_errors.py  a failed write or upload (a full disk above all) told as which checkpoint, which
                     file, why and how much space is left
    deepspeed_io.py  saving and loading a DeepSpeed engine's state and our per-rank state (RNG, data
                     position); DeepSpeed's pickles loaded weights-only, with an allow-list
    resume.py        which checkpoint a run resumes from, whether it may (config, world size, data,
                     student), and the new line of checkpoints a resume from an older step starts
    consolidate.py   the trained model gathered from the ZeRO partitions (fp32 masters) and saved as an
                     HF-format HyLo checkpoint

The per-worker side (who writes what, the collective resume check) is `pipeline/train/session.py`.
Storage may be local or a URI (`storage.Loc`); every function here takes either where it reads storage.
"""
