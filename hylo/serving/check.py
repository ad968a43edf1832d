"""Greedy tokens and their log-probabilities from vLLM's real engine, for checks against our own model.

    python -m hylo.serving.check --request request.json --out result.json

Run by the serving interpreter (the one with vLLM; `make serve-install`). `request.json`:

    {"exports": [{"path": ".../export", "dtype": "bfloat16"}, ...],
     "prompts": [[token ids], ...], "max_tokens": 32, "max_model_len": 1024}

Every export's prompts go to the engine at once (one `generate` call: vLLM batches them continuously, so a
state that leaked between sequences would show). `result.json` maps each path to one record per prompt:
{"tokens": [...], "logprobs": [log p of each chosen token]}, plus {"seconds": {"init": .., "generate": ..}}.

One engine at a time, in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) with one thread: a tiny engine
then starts in seconds on a CPU instead of a minute.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_LOGGING_LEVEL": "WARNING"}


def run(request: dict[str, Any]) -> dict[str, Any]:
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [int(t) for t in p]} for p in request["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=int(request["max_tokens"]), logprobs=1, ignore_eos=True)
    out: dict[str, Any] = {}
    for export in request["exports"]:
        path = str(export["path"])
        t0 = time.perf_counter()
        llm = LLM(model=path, skip_tokenizer_init=True, dtype=export.get("dtype", "bfloat16"),
                  max_model_len=int(request.get("max_model_len", 1024)), max_num_seqs=max(1, len(prompts)),
                  enforce_eager=True, seed=0, config_format="hylo")
        t1 = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        t2 = time.perf_counter()
        records = []
        for res in results:
            seq = res.outputs[0]
            tokens = list(seq.token_ids)
            records.append({"tokens": tokens, "logprobs": [step[t].logprob for step, t in zip(seq.logprobs, tokens)]})
        out[path] = {"records": records, "seconds": {"init": round(t1 - t0, 2), "generate": round(t2 - t1, 2)}}
        del llm
        gc.collect()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--request", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    result = run(json.loads(args.request.read_text()))
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
