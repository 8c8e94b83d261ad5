"""One module per fix, named by the fix id, each with ``self_test() -> Iterable[Check]``: the red control (the bug
reproduces with the fix off), then green (fixed, equal to the fault-free reference)."""
