"""The fixes, one module per fix, each defining ``FIX``; the registry (``registry/``) finds them here."""
