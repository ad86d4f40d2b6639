"""Everything that happens during a run besides the step itself: each a :class:`Callback`."""
