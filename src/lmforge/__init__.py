"""lmforge: train language models from raw text to an exported model.

Importing the package does one thing beyond naming its version: with ``ATEN_CPU_CAPABILITY`` set, it
gives ``torch.compile``'s caches one set of entries per capability
(:func:`key_compile_caches_by_cpu_capability`), before anything in the process compiles. It imports
nothing (torch reads the tag from the environment when it is imported), and without the variable it
changes nothing.
"""

import os
import sys

__version__ = "0.1.0"

CPU_CAPABILITY_VARIABLE = "ATEN_CPU_CAPABILITY"
TAG_VARIABLE = "TORCH_COMPILE_CACHE_KEY_TAG"  # torch.compiler.config.cache_key_tag's, read at torch's import


def compile_cache_key_tag(tag: str, capability: str | None) -> str:
    """``torch.compiler.config.cache_key_tag`` for a process whose ``ATEN_CPU_CAPABILITY`` is
    ``capability``: ``tag`` with ``ATEN_CPU_CAPABILITY=<capability>`` added (comma-separated, once), or
    ``tag`` unchanged when the variable is unset or empty (inductor then picks the CPU's widest ISA)."""
    if not capability:
        return tag
    part = f"{CPU_CAPABILITY_VARIABLE}={capability}"
    if part in tag.split(","):
        return tag
    return f"{tag},{part}" if tag else part


def key_compile_caches_by_cpu_capability() -> None:
    """Keep compiled CPU kernels made for one ``ATEN_CPU_CAPABILITY`` away from processes with another.

    Inductor writes its C++ for the vector ISA that ``torch._inductor.cpu_vec_isa.pick_vec_isa`` returns:
    with ``config.cpp.simdlen`` unset (the default) that is the ISA named by ``ATEN_CPU_CAPABILITY`` when
    the variable is set, else the CPU's widest. Loops are tiled to its width (16 floats a step for
    AVX-512, 8 for AVX2). The FX graph cache and AOTAutograd's cache (torch 2.13) key a graph on
    inductor's config, not on the ISA picked, so a graph compiled without the variable on an AVX-512 CPU
    is served to a process with ``ATEN_CPU_CAPABILITY=avx2``, whose C++ is then built against AVX2's
    8-float vectors: 16-float steps over 8-float vectors. Measured on a 2-core AMD EPYC with
    AVX-512-BF16: a float64 FSDP2 run compiled in place crashed (SIGSEGV) in the rotary-embedding kernel;
    the other way round (cached under ``avx2``, served without the variable) the same run trained to a
    loss of 7.56 instead of 5.88 at step 10, and ``(x * x).sum()`` over 1,000 values summed about half
    of them (``tests/test_compile_cache.py``).

    The remedy is torch's own knob for splitting caches: ``ATEN_CPU_CAPABILITY=<value>`` is added to
    ``torch.compiler.config.cache_key_tag`` (part of every compile cache's key; a tag the user set, e.g.
    through ``TORCH_COMPILE_CACHE_KEY_TAG``, is kept), so each capability compiles and caches its own
    kernels. Before torch is imported the tag is set in that variable (torch reads it at import; child
    processes inherit it), so importing lmforge imports nothing; after, on torch's config. The generated code is unchanged, and a process without the variable keys its caches as
    before.
    """
    capability = os.environ.get(CPU_CAPABILITY_VARIABLE)
    if not capability:
        return
    if "torch" not in sys.modules:  # torch reads the variable when it is imported: nothing imported here
        tag = os.environ.get(TAG_VARIABLE, "")
        os.environ[TAG_VARIABLE] = compile_cache_key_tag(tag, capability)
        return
    import torch.compiler.config

    config = torch.compiler.config
    config.cache_key_tag = compile_cache_key_tag(config.cache_key_tag, capability)


key_compile_caches_by_cpu_capability()
