"""Short real runs and measurements before spending compute, through the one build path
(``train/build.py``): ``lmforge lr-find`` (``lr_find.py``), ``lmforge mup-check`` (``mup_check.py``),
``tokenizers compare --train-steps`` (``tokenizer_bpb.py``); and the measurements the build, its callbacks
and the planner call, which import nothing of ``train/``: ``train.micro_batch_size = "auto"``
(``auto_batch.py``), the peak FLOP/s that MFU divides by (``peak_flops.py``) and the bytes a forward
keeps for backward (``activation_memory.py``)."""
