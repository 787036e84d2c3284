"""The proxy overhead benchmark: direct vs bare pass-through vs nginx vs sluice, one run.

Starts a fake OpenAI upstream and every arm as its own process on 127.0.0.1, then for
each round and each mode (non-streaming, streaming fast, streaming paced at concurrency
--concurrency; non-streaming one at a time for unqueued latency) runs a bounded load
through every arm in a rotating order (the machine is shared and noisy,
so arms are interleaved rather than run one after the other). For each phase it reads
the proxy's CPU time from /proc right before and after the load and samples the whole
machine's busy fraction.

    python bench/overhead/run.py [--requests N] [--rounds R] [--arms a,b,...] [--out DIR]

Arms: direct, passthrough (the bare app on the gateway's chosen stack), nginx, sluice
(skipped with a message while `sluice serve` does not exist), and the other candidate
stacks aiohttp, uvicorn, granian. Writes DIR/results.json, DIR/overhead.md, DIR/overhead.png.
"""

import os
import sys
from pathlib import Path

# `python bench/overhead/run.py` under a Python that lacks the project's packages: rerun
# under the repo's .venv, which has them (aiohttp, rich, matplotlib, uvicorn, granian).
_VENV_PY = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "python"
if _VENV_PY.exists() and Path(sys.prefix).resolve() != _VENV_PY.parent.parent.resolve():
    os.execv(str(_VENV_PY), [str(_VENV_PY), *sys.argv])

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runner import main  # noqa: E402  (after the path set-up above)

if __name__ == "__main__":
    sys.exit(main())
