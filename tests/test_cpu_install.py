"""A CPU-only install has no triton (it is the `.[gpu]` extra): the CPU engine must load,
serve and sample without ever importing it. Run in a subprocess whose import system refuses
triton the way a missing package does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.model_fixtures import build_tiny_llama_dir

REPO = Path(__file__).resolve().parent.parent

SCRIPT = """
import sys


class NoTriton:  # what an install without the package answers
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NoTriton())
try:
    import triton  # noqa: F401
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("the import hook let triton through")

from common.protocol import AddRequest
from common.sampling import SamplingParams
from tests.engine_helpers import greedy_request, make_core, run_to_completion

core = make_core(sys.argv[1])
sampled = SamplingParams(max_tokens=3, temperature=1.0, top_p=0.9, seed=3, logprobs=2,
                         ignore_eos=True)
outputs = run_to_completion(core, [greedy_request([5, 6, 7], max_tokens=4),
                                   AddRequest("sampled", [9, 8], sampled, 0.0)])
assert core.runner.graphs is None
assert not [name for name in sys.modules if name.split(".")[0] == "triton"]
print("tokens", sum(map(len, outputs.values())))
"""


def test_the_cpu_engine_serves_without_triton(tmp_path: Path) -> None:
    model_dir = build_tiny_llama_dir(tmp_path)
    done = subprocess.run([sys.executable, "-c", SCRIPT, model_dir], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["tokens", "7"]
