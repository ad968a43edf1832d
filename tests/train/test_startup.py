"""The trainer's start-up clock (pipeline/train/startup.py): laps, parts counted inside a phase, the line; and
what start-up builds: no DeepSpeed op on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from hylo.pipeline.train.startup import StartupClock


def test_a_part_counted_inside_a_phase_is_left_out_of_it():
    clock = StartupClock(since=time.time() - 2.0)
    clock.lap("import")
    with clock.timed("model load"):
        t0 = time.time()
        time.sleep(0.2)
        clock.add("deepspeed init", time.time() - t0)  # measured inside the block by the engine factory
        time.sleep(0.1)
    assert 1.9 < clock.phases["import"] < 3.0
    assert 0.19 < clock.phases["deepspeed init"] < 0.5
    assert 0.09 < clock.phases["model load"] < 0.19  # the block's 0.3 s less DeepSpeed's 0.2 s
    line = clock.line()
    assert line.startswith("[train] start-up: import ") and "model load" in line and "deepspeed init 0.2 s" in line


def test_the_clock_travels_as_a_dict_and_keeps_measuring_from_its_mark():
    sent = StartupClock({"import": 1.5, "ray start": 0.0}, since=time.time() - 1.0).to_dict()
    clock = StartupClock.from_dict(sent)
    clock.lap("worker group")
    assert clock.phases["import"] == 1.5 and 0.9 < clock.phases["worker group"] < 2.0
    assert StartupClock.from_dict(None).phases == {}


def test_only_a_jobs_own_process_counts_its_start_as_the_runs_import(monkeypatch):
    import sys
    import types

    from hylo.pipeline.train.startup import is_job_process

    for main, stage, own in (("/x/jobs/stage2.py", 2, True), ("/venv/bin/hylo", 1, True),
                             ("/x/jobs/stage1.py", 2, False), ("/venv/bin/pytest", 2, False), (None, 2, False)):
        monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace(__file__=main))
        assert is_job_process(stage) is own, (main, stage)


@pytest.mark.slow
def test_the_trainers_distributed_setup_on_cpu_compiles_no_deepspeed_op(tmp_path):
    """`loop.setup_distributed` on gloo, in a process of its own with an empty TORCH_EXTENSIONS_DIR: DeepSpeed's
    backend holds no shared-memory op and nothing was built (without `import_deepspeed` it compiles
    deepspeed_shm_comm there, 54 CPU-seconds, and holds the op); then a ZeRO-3 engine starts without a torch.compile."""
    from hylo.pipeline.rehearse import free_port

    code = ("from types import SimpleNamespace as N\n"
            "from hylo.pipeline.train.loop import setup_distributed\n"
            "print('device', setup_distributed(N(ray=N(use_gpu=False)))[2])\n"
            "from deepspeed.comm import comm\n"
            "print('shm op', comm.cdb.shm_comm_op)\n"
            # ZeRO-3's engine over a client AdamW, as deepspeed_cfg.init_engine makes it, counting torch.compile
            "import torch\n"
            "compiled = []\n"
            "real = torch.compile\n"
            "torch.compile = lambda *a, **k: compiled.append(a) or real(*a, **k)\n"
            "from hylo.pipeline.train.deepspeed_cfg import import_deepspeed\n"
            "m = torch.nn.Linear(4, 4)\n"
            "e, *_ = import_deepspeed().initialize(model=m, optimizer=torch.optim.AdamW(m.parameters()), config={\n"
            "    'train_micro_batch_size_per_gpu': 1, 'zero_optimization': {'stage': 3},\n"
            "    'zero_allow_untested_optimizer': True})\n"
            "print('engine', type(e).__name__, 'torch.compile calls', len(compiled))\n")
    ext = tmp_path / "torch_extensions"
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "device cpu" in proc.stdout and "shm op None" in proc.stdout, proc.stdout
    # the engine's start compiled nothing: DeepSpeed's Muon, which ZeRO imports, no longer torch.compile-decorates
    # its functions when it loads (1.2-2.7 CPU-s in every training process; deepspeed_cfg.import_deepspeed)
    assert "engine DeepSpeedEngine torch.compile calls 0" in proc.stdout, proc.stdout
    assert not ext.exists() or not any(ext.rglob("*")), sorted(map(str, ext.rglob("*")))
