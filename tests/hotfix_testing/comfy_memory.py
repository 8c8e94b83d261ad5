"""ComfyUI's ``unload_all_models`` for the tests that load models in this process, after a garbage collection.

A model kept alive only by a reference cycle (a failed forward's traceback, a test's closures) is otherwise
collected whenever Python's collector runs, which can be inside ComfyUI's ``free_memory`` loop: its finalizer
(``cleanup_models``) or its dying patcher shifts ``current_loaded_models`` under the loop's cached indices, and the
loop fails (``IndexError``, or ``'NoneType' object has no attribute 'model'``), leaving a dead entry that breaks
every later unload of the process (Comfy-Org/ComfyUI#14365; seen in CI, in a random test order). Collected first,
nothing is left to die inside the loop."""

import gc


def unload_all_models() -> None:
    import comfy.model_management

    gc.collect()
    comfy.model_management.unload_all_models()
