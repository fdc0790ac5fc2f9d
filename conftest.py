"""Collection for `pytest --doctest-modules paddleviz_hooks tests`: an integration module
whose framework is not installed in this venv is not imported (the Makefile runs the
PaddleFormers tests in a venv of their own)."""

import importlib.util

collect_ignore = [
    f"paddleviz_hooks/integrations/{name}.py"
    for name in ("paddleformers", "ppdet")
    if importlib.util.find_spec(name) is None
]
