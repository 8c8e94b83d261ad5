"""The registry's once-per-process decisions (each fix's detection, the models each fix hooked), forgotten between
tests. The runtime never forgets them, so this lives with the tests."""


def forget_detection(registry) -> None:
    """Make ``registry``'s next ``status`` call detect again, and forget which models the fixes hooked (``registry``:
    the pack's registry module, or the copy ComfyUI loaded)."""
    with registry._lock:
        registry._detected.clear()
        registry._hooked.clear()
        registry._last_hooked.clear()
