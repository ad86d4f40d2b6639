"""``lmforge export RUN``: a run's checkpoint as a Hugging Face model folder.

The checkpoint is read whole into this process (``load_checkpoint``: DCP consolidates the shards of any
layout, so a run trained under torchrun exports the same way), renamed by the architecture's map
(``llama.py``, ``gpt2.py``; a mixture of experts: ``mixtral.py``, ``qwen2_moe.py`` or ``glm4_moe.py``, as
``moe.py`` picks) and written as ``config.json``, ``generation_config.json``,
``model.safetensors`` and the tokenizer files; a reward model (``train.objective = "reward"``) as a
sequence-classification checkpoint (``reward.py``). A setting the Hugging Face class cannot express is refused
before anything is written.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lmforge.config import ModelConfig
from lmforge.errors import UserError
from lmforge.evaluate.run_loading import pick_checkpoint
from lmforge.hf import glm4_moe, gpt2, llama, mixtral, qwen2_moe, reward
from lmforge.hf.files import write_json, write_tokenizer, write_weights
from lmforge.hf.moe import pick_class
from lmforge.hf.peft import adapted_modules, adapter_files
from lmforge.model.lora import dense_base, merged_state, target_names
from lmforge.model.transformer import Transformer
from lmforge.posttrain.ppo import language_model_state
from lmforge.posttrain.template import ChatTemplate, read_template
from lmforge.recipe import load_saved_config
from lmforge.tokenizer import Tokenizer
from lmforge.train.checkpoint import load_checkpoint

MAPS = {"llama": llama, "gpt2": gpt2}
MOE_MAPS = {"mixtral": mixtral, "qwen2_moe": qwen2_moe, "glm4_moe": glm4_moe}


def arch_map(model: ModelConfig):
    """The map of the Hugging Face class ``model`` exports to: Llama / GPT-2 for dense models, for a
    mixture of experts the class whose routing is lmforge's (``hf/moe.py``; refused where none is)."""
    if model.moe.experts and model.arch == "llama":
        return MOE_MAPS[pick_class(model)]
    return MAPS[model.arch]


def write_folder(
    out: Path,
    model: ModelConfig,
    state: dict[str, torch.Tensor],
    tok: Tokenizer,
    max_len: int,
    chat: ChatTemplate | None = None,
) -> Path:
    """Write the Hugging Face folder of an lmforge model (``state``: its tensors by lmforge name). A chat
    run (``chat``: its template) also gets the template as ``chat_template`` and ``<|end|>`` as the token
    that ends generation."""
    arch = arch_map(model)
    hf_config = arch.config_to_hf(model, tok.vocab_size, max_len, tok.eot_id)  # refusals before any write
    if "score.weight" in state:  # a reward model (no lm_head): the causal LM's names for the rest
        state = {**state, "lm_head.weight": state.get("lm_head.weight", state["embed.weight"])}
    tensors = arch.state_to_hf(state, model)
    if "score.weight" in state:
        hf_config, tensors = reward.sequence_classification(hf_config, tensors, state, tok.eot_id)
    hf_config["dtype"] = str(tensors[next(iter(tensors))].dtype).removeprefix("torch.")
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", hf_config)
    write_json(
        out / "generation_config.json",
        {
            "bos_token_id": tok.eot_id,
            "eos_token_id": chat.end_id if chat is not None else tok.eot_id,
            "do_sample": False,
        },
    )
    write_weights(out, tensors)
    write_tokenizer(out, tok.path, max_len, chat.jinja() if chat is not None else None)
    return out


def export_run(
    run_dir: str | Path, out: str | Path | None = None, step: int | None = None, adapter: bool = False
) -> Path:
    """Write the Hugging Face folder of ``run_dir``'s checkpoint ``step`` to ``out`` (default RUN/hf). A LoRA
    run (``lora.rank > 0``) exports its merged weights ``W + (alpha / r) B A``, or with ``adapter`` a PEFT
    adapter folder (default RUN/hf-adapter) with the base in its ``base/`` (``hf/peft.py``)."""
    run_dir = Path(run_dir)
    ckpt = pick_checkpoint(run_dir, step)
    cfg = load_saved_config(ckpt / "config.toml")
    tok = Tokenizer(run_dir / "tokenizer.json")
    arch = arch_map(cfg.model)
    arch.config_to_hf(cfg.model, tok.vocab_size, cfg.data.seq_len, tok.eot_id)  # refuse early
    if adapter and not cfg.lora.rank:
        raise UserError(
            f"--adapter: {run_dir} is not a LoRA run (lora.rank = 0); export it without --adapter"
        )
    with torch.device("meta"):
        plain = Transformer(cfg.model, tok.vocab_size, cfg.data.seq_len)
        shapes = {k: v.shape for k, v in plain.state_dict().items()}
    if adapter:  # refused before anything is written: the map, then each adapted layer
        adapted_modules(arch, cfg, list(shapes), target_names(plain, cfg.lora.targets))
    state = language_model_state(load_checkpoint(ckpt)["model"])  # a PPO run's value head is not exported
    template = read_template(run_dir)
    if not cfg.lora.rank:
        out = Path(out) if out is not None else run_dir / "hf"
        return write_folder(out, cfg.model, state, tok, cfg.data.seq_len, template)
    if not adapter:
        out = Path(out) if out is not None else run_dir / "hf"
        return write_folder(
            out, cfg.model, merged_state(state, cfg.lora, shapes), tok, cfg.data.seq_len, template
        )
    out = Path(out) if out is not None else run_dir / "hf-adapter"
    base = write_folder(out / "base", cfg.model, dense_base(state, shapes), tok, cfg.data.seq_len, template)
    return adapter_files(out, arch, cfg, state, list(shapes), base)
