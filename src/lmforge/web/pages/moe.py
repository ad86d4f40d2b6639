"""The mixture-of-experts planner (8 experts, 2 active) needs an MoE layer, which lmforge does not have
yet. Until it does, the page is absent: not in the navigation, and ``/moe`` answers 404."""

PAGE = None
