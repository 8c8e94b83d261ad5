"""The fixes, one module per fix, each defining ``FIX``; the module's name is the fix's id. The registry
(``registry/``) finds them here and imports a module only when it is needed."""

# The process-wide fixes (``Target.PROCESS``): imported and installed at ComfyUI start-up, before any model is built.
# Every other fix waits for a model it may attach to. tests/test_registry.py checks this list against each fix's targets.
PROCESS_WIDE = ("ck_rope_device", "cpu_device_cuda_query", "transformers_static_cache")
