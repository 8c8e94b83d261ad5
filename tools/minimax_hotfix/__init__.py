"""The pack as the package ``minimax_hotfix``, without its ComfyUI entry point: ``import minimax_hotfix.registry``
(and every other module of the pack) for the tools, the benchmarks and the tests.

The pack's own ``__init__.py`` is ComfyUI's entry point (with ComfyUI importable it installs the process-wide fixes
and registers routes), and its folder may have any name, so neither can be imported as ``minimax_hotfix``. This
package spans the pack's folder instead: its modules are the pack's files, found where they are. The tests find it
through pytest's ``pythonpath`` setting (pyproject.toml), the commands in tools/ as their own folder's package, the
benchmarks with tools/ on their path (docs/testing.md, "How the tests import the pack").
"""

from pathlib import Path

__path__ = [str(Path(__file__).resolve().parents[2])]  # the pack's folder (this file: <pack>/<scripts>/minimax_hotfix)
