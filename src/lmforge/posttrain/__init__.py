"""Post-training: supervised fine-tuning (SFT) and preference optimisation (DPO) records, chat template,
loaders and losses. ``lmforge sft`` / ``lmforge dpo`` (``train/finetune.py``) build runs of them."""
