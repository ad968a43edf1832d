"""What of a job's output a multi-step run shows on its terminal and keeps in its log (pipeline/job_output.py).

The lines are as a demo run printed them (Ray 2.60, torch, DeepSpeed on CPU), with Ray's colour codes.
"""

from __future__ import annotations

from hylo.pipeline.job_output import JobEcho, known_noise, strip_ansi

CYAN, GREEN, RESET = "\x1b[36m", "\x1b[32m", "\x1b[0m"


def ray(who: str, text: str) -> str:
    """`text` as the driver of a Ray job prints a line of worker `who`."""
    return f"{CYAN}({who}){RESET} {text}\n"


NOISE = [
    "2026-12-06 02:57:34,591\tINFO worker.py:1841 -- Connecting to existing Ray cluster at address: 127.0.0.1:38217...\n",
    "2026-12-06 02:57:40,360\tINFO logging_progress.py:225 -- Total Progress: 0/?\n",
    "prepare stage2 (starting 2 tokenizer actor(s)):   0%|          | 0/40 [00:00<?, ?rec/s]2026-12-06 03:13:26,432"
    "\tINFO streaming_executor.py:215 -- Starting execution of Dataset dataset_0359lHRp3AAEU\n",
    "2026-12-06 02:57:59,636\tWARNING __init__.py:28 -- Progress bars disabled. To enable, set "
    "`ray.data.DataContext.get_current().enable_progress_bars = True`.\n",
    "[2026-12-06 02:57:59,623 E 11707 11707] core_worker.cc:2465: Actor with class name: 'MapWorker(MapBatches("
    "TokenizeUDF))' and ID: '8bd84dff1eae0d38d17d80c103000000' has constructor arguments in the object store and "
    "max_restarts > 0. If the arguments in the object store go out of scope or are lost, the actor restart will "
    "fail.\n",
    ray("TrainController pid=17499", "[2026-12-06 03:03:06,800 E 17499 17610] core_worker.cc:2465: Actor with class "
        "name: 'PreemptionWatcher' and ID: '6688eedc8d44dbbb43d9506a06000000' has constructor arguments in the "
        "object store and max_restarts > 0."),
    ray("PlacementGroupCleaner pid=17698", "Failed to query Ray Train Controller actor state. State API may be "
        "temporarily unavailable. Continuing to monitor."),
    ray("RayTrainWorker pid=17869", "[2026-12-06 03:03:29,251] [WARNING] [real_accelerator.py:213:get_accelerator] "
        "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."),
    ray("pid=gcs_server", "[2026-12-06 02:59:00,726 E 10347 10347] (gcs_server) gcs_actor_scheduler.cc:538: Failed "
        "to kill actor 4a59be87ce6ef15832c622a305000000, return status: Invalid: KillActor RPC failed for actor "
        "4a59be87ce6ef15832c622a305000000: RpcError: RPC error: Socket closed rpc_code: 14"),
]
KEPT = [
    "[eval] suite kl (1/2)\n",
    ray("RayTrainWorker pid=17869", "[stage1] step 1/1 (100%) | loss 1711.4994 | lr 2.00e-04 | 12 tok/s"),
    # not listed: an error, a traceback, another warning, another Ray warning
    ray("RayTrainWorker pid=17869", "Traceback (most recent call last):"),
    ray("PlacementGroupCleaner pid=17698", "ConnectionError: Found multiple active Ray instances: {'127.0.0.1:1'}"),
    "/work/x.py:3: FutureWarning: `torch.load` with weights_only=False is deprecated\n",
    "2026-12-06 02:57:59,636\tWARNING worker.py:1 -- A worker died or was killed while executing a task\n",
    "2026-12-06 02:57:59,636\tERROR worker.py:1 -- Failed to connect\n",
]


def test_known_noise_goes_to_the_log_only_and_everything_else_to_the_terminal():
    echo = JobEcho(tty=False)
    for piece in NOISE:
        assert echo.terminal_text(piece) is None, piece
        assert echo.log_text(piece) == strip_ansi(piece)  # the log keeps it
    for piece in KEPT:
        assert echo.terminal_text(piece) == strip_ansi(piece), piece
    assert echo.held == len(NOISE)
    assert all(known_noise(strip_ansi(p).rstrip("\n")) for p in NOISE)


def test_a_held_warning_takes_its_source_line_along_also_between_other_workers_lines():
    warn = ("/work/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py:83: FutureWarning: "
            "`torch.distributed.{}` is deprecated. Please use `torch.distributed.{}` instead.")
    a, b = "RayTrainWorker pid=17869", "RayTrainWorker pid=17925"
    pieces = [ray(a, warn.format("reduce_scatter_tensor", "reduce_scatter_single")),
              ray(b, warn.format("all_gather_into_tensor", "all_gather_single")),
              ray(a, f"  return func(*args, **kwargs){GREEN} [repeated 2x across cluster]{RESET}"),
              ray(b, "  return func(*args, **kwargs)"),
              ray(b, "  indented output of the worker's own"),
              # outside Ray: the warning's next line
              "/x/c10d_logger.py:83: FutureWarning: `torch.distributed.all_gather_into_tensor` is deprecated.\n",
              "  return func(*args, **kwargs)\n",
              "  the job's own indented line\n"]
    echo = JobEcho(tty=False)
    shown = [echo.terminal_text(p) for p in pieces]
    assert shown == [None] * 4 + [strip_ansi(pieces[4]), None, None, pieces[7]]


def test_progress_bar_redraws_show_in_place_on_a_terminal_and_as_the_last_state_elsewhere():
    pieces = ["\r", "prepare all:   0%|          | 0/8 [00:00<?, ?rec/s]\r",
              "prepare all: 100%|##########| 8/8 [00:09<00:00,  1.13s/rec]\n",
              f"{CYAN}(RayTrainWorker pid=1){RESET} \r", "\x1b[ALoading weights: 100%|####| 272/272\n"]
    pipe = JobEcho(tty=False)
    last = "Loading weights: 100%|####| 272/272\n"
    assert [pipe.terminal_text(p) for p in pieces] == [None, None, pieces[2], None, last]
    tty = JobEcho(tty=True)
    assert [tty.terminal_text(p) for p in pieces] == [None, pieces[1], pieces[2], pieces[3], pieces[4]]
    assert pipe.held == tty.held == 0  # redraws are progress, not noise
    # the log: each redraw on a line of its own, without ANSI codes
    assert "".join(JobEcho.log_text(p) for p in pieces) == (
        "\nprepare all:   0%|          | 0/8 [00:00<?, ?rec/s]\nprepare all: 100%|##########| 8/8 [00:09<00:00,"
        "  1.13s/rec]\n(RayTrainWorker pid=1) \nLoading weights: 100%|####| 272/272\n")
