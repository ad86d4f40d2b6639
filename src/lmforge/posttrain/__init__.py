"""Post-training: supervised fine-tuning (SFT) and preference optimisation (DPO) records, chat template,
loaders and losses, and what the one build path adds for ``train.objective = "sft" / "dpo"``
(``run.py``); all of it below ``train/``. ``lmforge sft`` / ``lmforge dpo`` (``finetune.py``, the one
module above ``train/``) start runs of them from another run's checkpoint."""
