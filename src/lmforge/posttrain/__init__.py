"""Post-training: supervised fine-tuning (SFT), preference optimisation (DPO), reward models and RL
records, chat template, loaders and losses, and what the one build path adds for them (``run.py``); all
of it below ``train/``. Above it: the objectives registered for the build with their training modules
(``objective_*.py``, through the ``lmforge.objectives`` entry points), and ``lmforge sft`` / ``dpo`` /
``reward`` / ``rl`` (``finetune.py``), which start runs of them from another run's checkpoint."""
