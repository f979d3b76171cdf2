"""`--enable-torch-compile`: the target's forward through torch.compile (TorchInductor), opt-in.

On the 2-core CPU the decode step of a small model is mostly Python and operator dispatch around small matmuls
(thousands of ops a step: norms, rotary, casts, views); Inductor fuses them into generated C++ kernels. Dynamo
traces the paged attention (engine/model/attention.py) too, so a forward is one graph. Tried and dropped: the
attention kept out of the graph (torch._dynamo.disable) avoids recompiles too, but the graph breaks around every
layer's attention cost what the fusion saved (no faster than eager at one stream, slower at sixteen).

Costs, said where a user meets them:
- Inductor builds C++ with the machine's compiler (g++/clang++; `CXX` names another). Without one the engine logs a
  warning and runs eager — the same outputs, the eager speed.
- Compiling happens on the first forward of each new shape class, on the engine thread (tens of seconds to minutes
  on 2 cores; those requests wait). Dynamo specializes every size of 1 and the number of query groups, which a
  ragged batch's metadata is full of (a lone sequence in a group, one query, one block); so a compiled runner builds
  its metadata with stable shapes (engine/model/attention.py: both query groups always present, no size 1, stand-in
  rows writing to a spare output row), and the classes left are one vs several input tokens and logits rows, and
  token trees: the warm-up (EngineCore._warm_up) meets all but trees before the first request. Inductor
  keeps what it built on disk (`TORCHINDUCTOR_CACHE_DIR`, default /tmp/torchinductor_$USER): a restart on the same
  machine compiles again from that cache in a fraction of the time.
- Outputs are those of the compiled kernels: fused float arithmetic rounds differently from eager, so a compiled
  engine's text may differ from an eager one's at near-ties (greedy speculative output still equals greedy plain
  output of the same compiled engine in fp32, as eager's does).
"""

from __future__ import annotations

import logging
import os
import shutil

import torch

log = logging.getLogger(__name__)

# one forward per (batch, query width, block-table width) class: allow many more than Dynamo's default of 8 before
# it gives up on a frame and runs it eager
RECOMPILE_LIMIT = 64


def cxx_compiler() -> str | None:
    """The C++ compiler Inductor would call, if it exists on PATH."""
    name = os.environ.get("CXX") or "g++"
    return shutil.which(name) or shutil.which("clang++")


def compile_model(model: torch.nn.Module, device: torch.device) -> bool:
    """Compile `model`'s forward in place (its attributes, weights and hooks stay as they are); -> whether it was.
    Without a C++ compiler on a CPU device: a warning and eager."""
    if device.type == "cpu" and cxx_compiler() is None:
        log.warning("compile: no C++ compiler found (g++, clang++ or $CXX), which TorchInductor needs on CPU; "
                    "running the model eager")
        return False
    import torch._dynamo.config as dynamo_config

    import torch.fx.experimental._config as fx_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    # sizes that happen to be equal when a graph is traced (a batch of 2 with 2 blocks) are not assumed equal later
    fx_config.use_duck_shape = False
    model.compile(dynamic=True)
    return True


def compilations() -> int:
    """Graphs Dynamo has compiled in this process so far (its own counter): a step during which it grew spent time
    compiling, which is not what a step of that shape costs."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
