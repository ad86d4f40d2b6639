"""The split-backward pipeline schedules (``zero_bubble``, ``zbv``) in the planner: torch's action table,
how many weight backwards wait at once, and what an input backward keeps alive until its weight backward.

The accuracy matrix's two cases (``pp2-zero-bubble-fp32-adamw``, ``pp2-zbv-fp32-sgd``) were planned
13.5% and 19.6% under their measured peaks: the plan let each input backward free its micro-batch, as a
whole backward does, while torch's ``stage_backward_input`` keeps the graph (``retain_graph=True``) and
the gradients its weight backward starts from, and the schedule runs several input backwards before
their weight backwards (and ``zbv``'s first stage forwards three micro-batches, not two)."""

from __future__ import annotations

import torch
from torch.distributed.pipelining._backward import stage_backward_input

from lmforge.config import ModelConfig
from lmforge.model.loss import head_loss
from lmforge.model.transformer import Transformer, keep_stage
from lmforge.parallel.pipeline import schedule_order
from lmforge.plan.activations import split_backward_bytes
from lmforge.plan.estimate import SplitStage, split_backward_peak
from lmforge.probes.step_memory import StoragePeak

# each rank's pipeline_order as the two ranks of the accuracy matrix's runs printed it (p = 2, v = 2,
# m = 4; torch 2.13's schedules, built with their stages and process group)
RUN_ORDERS = {
    "zero_bubble": {
        0: "0F0 0F1 2F0 2F1 2I0 2W0 0F2 2I1 2W1 0F3 0I0 0W0 2F2 0I1 0W1 2F3 2I2 2W2 2I3 2W3 0I2 0W2 0I3 0W3",
        1: "1F0 1F1 3F0 3I0 3F1 3I1 3W0 1F2 1I0 3W1 1F3 1I1 1W0 3F2 3I2 1W1 3F3 3I3 3W2 1I2 3W3 1I3 1W2 1W3",
    },
    "zbv": {
        0: "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3",
        1: "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3",
    },
}
LLAMA = ModelConfig(arch="llama", n_layers=4, d_model=64, n_heads=4, n_kv_heads=2, tie_embeddings=False)
VOCAB, T = 512, 64


def test_the_planners_action_table_is_the_one_the_runs_took():
    for schedule, ranks in RUN_ORDERS.items():
        got = schedule_order(2, schedule, 4, 2)
        assert {r: " ".join(f"{s}{k}{m}" for s, k, m in a) for r, a in got.items()} == ranks, schedule


def _stages(schedule: str, rank: int, saved: float, retained: float) -> dict[int, SplitStage]:
    ids = {int(a[0]) for a in RUN_ORDERS[schedule][rank].split()}
    return {s: SplitStage(saved, retained, 0.0, frozenset(), first=s == 0, last=s == 3) for s in ids}


def test_weight_backwards_waiting_at_once_follow_the_table():
    """With only the retained bytes counted (1 per waiting micro-batch), the peak is the most weight
    backwards waiting at once, read off the tables above by hand: zero bubble rank 1 runs 3I0 3F1 3I1
    before 3W0 (2); zbv rank 1 runs 1I2 2I3 1I3 before 1W2 (3); rank 0 of both, 1 (its first stage's
    input backward runs nothing, but it waits all the same)."""
    want = {("zero_bubble", 0): 1, ("zero_bubble", 1): 2, ("zbv", 0): 1, ("zbv", 1): 3}
    for (schedule, rank), n in want.items():
        actions = schedule_order(2, schedule, 4, 2)[rank]
        name, grads, acts, temps = split_backward_peak(actions, _stages(schedule, rank, 0.0, 1.0), {}, {})
        assert (acts, grads, temps) == (n, 0.0, {}), (schedule, rank, name)
    name, *_ = split_backward_peak(schedule_order(2, "zbv", 4, 2)[1], _stages("zbv", 1, 0.0, 1.0), {}, {})
    assert name == "backward: stage 1's input gradient, micro-batch 3, 3 weight backward(s) waiting"


def test_zbvs_first_stage_holds_three_forwards():
    """Saved bytes only (1 per forwarded micro-batch, nothing retained): zbv's rank 0 forwards 0F0 0F1
    0F2 3F0 before its first backward (4 held), zero bubble's 0F0 0F1 2F0 2F1 (4); at zbv's 3I2 stage 0
    still holds micro-batches 1, 2, 3 (0W0 ran) and stage 3 micro-batch 2: 4 too, so the first such moment
    is the peak."""
    actions = schedule_order(2, "zbv", 4, 2)[0]
    name, _, acts, _ = split_backward_peak(actions, _stages("zbv", 0, 1.0, 0.0), {}, {})
    assert acts == 4 and name == "forward: stage 3, micro-batch 0"


def _measured_input_backward(layers: range) -> tuple[int, int, int, int]:
    """One micro-batch (1 x 64 tokens) through a stage of :data:`LLAMA`, then torch's own input backward
    (``stage_backward_input``, what the schedule's ``I`` runs) under ``StoragePeak``: what it leaves alive,
    its peak above that, the received output gradient's bytes and the input gradient's."""
    torch.manual_seed(0)
    stage = keep_stage(Transformer(LLAMA, VOCAB, T), layers)
    x = torch.randn(1, T, LLAMA.d_model, requires_grad=True)
    targets = torch.randint(0, VOCAB, (1, T))
    with StoragePeak([*stage.parameters(), *stage.buffers(), x]) as peak:  # the forward's tensors seen too
        h = stage(x)
        if layers.stop == LLAMA.n_layers:  # the last stage: the loss, as the schedule's loss_fn computes it
            outputs, grads = [head_loss(stage, h, targets, 1024)], None
        else:
            outputs, grads = [h], [torch.randn_like(h)]
        before = peak.peak = peak.current
        (dx,), _groups = stage_backward_input(outputs, grads, [x], stage.parameters())
        after = peak.current - before
        above = peak.peak - peak.current
    received = grads[0].untyped_storage().nbytes() if grads else 0
    return after, above, received, dx.untyped_storage().nbytes()


def test_what_an_input_backward_retains_is_the_gradients_its_weight_backward_starts_from():
    """A middle stage (block 1) and the last (block 3, final norm, head and fused loss): the bytes the
    input backward leaves alive (less its input's gradient, which is sent, plus the received gradient of
    the stage's output, which it keeps) are ``split_backward_bytes``'s retained bytes, exactly; its peak
    above them is the working set; the first stage retains nothing."""
    for layers in (range(1, 2), range(3, 4)):
        after, above, received, dx = _measured_input_backward(layers)
        retained, working = split_backward_bytes(LLAMA, VOCAB, T, 1, 4, layers=1, first_layer=layers.start)
        assert after - dx + received == retained, layers
        if layers.stop < LLAMA.n_layers:  # the last stage's peak is the loss's backward, planned apart
            assert above == working, layers
    assert split_backward_bytes(LLAMA, VOCAB, T, 1, 4, layers=1, first_layer=0) == (0, 0)
